"""Thread settings of a SmolLM2-135M decode step: BLAS threads x attention threads, and the default.

A decode step alternates NumPy's BLAS (OpenBLAS, its own pthreads pool) and the OpenMP
attention kernels. This script times decode steps, in the same run, for every
combination of ``--blas-threads`` and ``--attention-threads`` (paged float32 cache), for
the dense backend under each BLAS setting, and for the default thread count
(``"auto"``: :func:`pagedkv.models.threads.choose_num_threads`, BLAS and attention on
the same count), the combinations taking turns step by step.

It does so in two machine states (``--neighbour``), interleaved step by step inside one
process (each combination runs one step in one state, then one in the other), so that
both states see the same background load:

``idle``
    the script's neighbour is paused (other work on the machine still runs: read the
    load average printed beside the figures);
``busy``
    the script's neighbour runs: one process, started once, with two threads hashing in
    a loop (hashlib releases the GIL), i.e. two cores' worth of demand, as another
    2-thread inference job or a CPU-quota neighbour would make; paused with SIGSTOP and
    resumed with SIGCONT (restarted where these signals do not exist).

At the start of each round the default is chosen afresh in each state (what a process
started at that moment would pick; the picks are printed), and its backend runs on that
count for the round's steps in that state.

Two settings of the idle workers of both pools (``--wait-policy``), each in a fresh
subprocess since the runtimes read them when they load: ``passive``, what ``import
pagedkv`` sets unless the environment says otherwise (``OMP_WAIT_POLICY=PASSIVE`` and
``OPENBLAS_THREAD_TIMEOUT=4``: idle workers sleep at once), and ``active``, the runtimes'
behaviour before (``OMP_WAIT_POLICY=ACTIVE``: libgomp's own default spins for about 3 ms,
longer than the gap between two attention calls of a decode step, so it behaves like
``active`` here; OpenBLAS's default: spin 2**28 cycles). Under ``active`` the process's
own spinning workers count as load for the default's sample, as they would for any
process that spins.

Prints the median step time of each combination, then for each state, policy and batch
the speed of N threads (BLAS and attention both N) and of the default relative to one
thread, against the goals: at least 0.9x with a busy neighbour, above 1x on an idle
machine for N > 1 (the default meets its idle goal by picking the faster count). Writes
``benchmarks/results/bench_llama_threads.json``.

Example::

    python benchmarks/bench_llama_threads.py --context 512 --batch 1 8
"""
import argparse
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter

import numpy as np

from _timing import format_table, machine_info, write_json

DEFAULT = "default"  # the combination that runs the default thread count of the round


def worker(args):
    from threadpoolctl import ThreadpoolController, threadpool_limits

    from pagedkv.models import DenseBackend, LlamaModel
    from pagedkv.models.paged_backend import PagedBackend
    from pagedkv.models.threads import choose_num_threads

    # num_threads=None: the model leaves the BLAS thread count to the limits set below.
    model, _ = LlamaModel.from_gguf(args.gguf, num_threads=None)
    controller = ThreadpoolController()  # looked up once: a limit then costs tens of microseconds per step
    rng = np.random.default_rng(0)
    results = []
    for batch_size in args.batch:
        prompts = [rng.integers(0, model.config.vocab_size, size=args.context) for _ in range(batch_size)]
        seq_ids = list(range(batch_size))
        # Both states decode on the same backends, one step each in turn.
        total = args.context + len(args.neighbour) * args.rounds * args.steps + 1
        combos = [("dense", blas, 0) for blas in args.blas_threads] if "dense" in args.backends else []
        combos += [("paged", blas, attn) for blas, attn in itertools.product(args.blas_threads,
                                                                              args.attention_threads)]
        combos.append((DEFAULT, 0, 0))
        backends, tokens = {}, {}
        with threadpool_limits(1, "blas"):
            for combo in combos:
                kind, _, attn = combo
                if kind == "dense":
                    backend = DenseBackend.for_config(model.config, initial_capacity=total)
                else:
                    backend = PagedBackend.for_config(model.config, PagedBackend.pages_for([total] * batch_size),
                                                      dtype=np.float32, num_threads=attn or 1)
                for s in seq_ids:
                    backend.add_sequence(s)
                logits = model.forward(backend, seq_ids, prompts)
                backends[combo], tokens[combo] = backend, [[int(t)] for t in logits.argmax(axis=-1)]
        times = {(state, combo): [] for state in args.neighbour for combo in combos}
        picks = {state: [] for state in args.neighbour}
        neighbour = Neighbour() if "busy" in args.neighbour else None
        try:
            for round_index in range(args.rounds):
                for state in args.neighbour:  # the default, chosen afresh in each state
                    set_state(neighbour, state)
                    picks[state].append(choose_num_threads().num_threads)
                shift = round_index % len(combos)
                for step in range(args.steps):
                    states = args.neighbour if (round_index + step) % 2 == 0 else args.neighbour[::-1]
                    for combo in combos[shift:] + combos[:shift]:
                        for state in states:  # the states of one combination take turns step by step
                            set_state(neighbour, state)
                            blas = picks[state][-1] if combo[0] == DEFAULT else combo[1]
                            if combo[0] == DEFAULT:
                                backends[combo].num_threads = picks[state][-1]
                            with controller.limit(limits=blas, user_api="blas"):
                                start = time.perf_counter()
                                logits = model.forward(backends[combo], seq_ids, tokens[combo])
                                times[(state, combo)].append(time.perf_counter() - start)
                            tokens[combo] = [[int(t)] for t in logits.argmax(axis=-1)]
        finally:
            if neighbour is not None:
                neighbour.close()
        for (state, combo), samples in times.items():
            results.append({"neighbour": state, "batch_size": batch_size, "backend": combo[0],
                            "blas_threads": combo[1] or None, "attention_threads": combo[2] or None,
                            "default_picks": picks[state] if combo[0] == DEFAULT else None,
                            "median_ms": statistics.median(samples) * 1e3, "min_ms": min(samples) * 1e3})
        del backends
    print(json.dumps(results))


NEIGHBOUR_CODE = """
import hashlib, threading
block = bytes(1 << 20)
def spin():
    while True:
        hashlib.sha256(block).digest()
threads = [threading.Thread(target=spin, daemon=True) for _ in range(2)]
for t in threads:
    t.start()
print("spinning", flush=True)
for t in threads:
    t.join()
"""


def start_neighbour():
    """Start the busy neighbour (two spinning threads in one process); return its Popen once it spins."""
    neighbour = subprocess.Popen([sys.executable, "-c", NEIGHBOUR_CODE], stdout=subprocess.PIPE, text=True)
    neighbour.stdout.readline()
    return neighbour


class Neighbour:
    """The busy neighbour, paused and resumed between steps so that both states share the background load.

    POSIX: one process, stopped with SIGSTOP and continued with SIGCONT (microseconds);
    elsewhere it is killed and started again. It starts paused.
    """

    def __init__(self):
        self.signals = hasattr(signal, "SIGSTOP")
        self.process = start_neighbour()
        self.running = True
        self.pause()

    def resume(self):
        if not self.running:
            if self.signals:
                os.kill(self.process.pid, signal.SIGCONT)
            else:
                self.process = start_neighbour()
            self.running = True

    def pause(self):
        if self.running:
            if self.signals:
                os.kill(self.process.pid, signal.SIGSTOP)
            else:
                self.process.kill()
                self.process.wait()
            self.running = False

    def close(self):
        self.process.kill()
        self.process.wait()


def set_state(neighbour, state):
    """Resume the neighbour for ``busy``, pause it for ``idle``."""
    if neighbour is None:
        return
    if state == "busy":
        neighbour.resume()
    else:
        neighbour.pause()


def threads_label(row):
    """``BLAS / attention`` threads of a row, or ``default`` with its picks (``1x3 2x2``: count x rounds)."""
    if row["backend"] == DEFAULT:
        picks = Counter(row["default_picks"])
        return "default (" + " ".join(f"{n}x{picks[n]}" for n in sorted(picks)) + ")"
    return f"{row['blas_threads']} / {row['attention_threads'] or '-'}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gguf", default=None)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--blas-threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--attention-threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--backends", nargs="+", default=["dense", "paged"], choices=["dense", "paged"],
                        help="paged always runs (the goals are about it); dense adds the dense backend")
    parser.add_argument("--wait-policy", nargs="+", default=["passive", "active"], choices=["passive", "active"])
    parser.add_argument("--neighbour", nargs="+", default=["idle", "busy"], choices=["idle", "busy"])
    parser.add_argument("--rounds", type=int, default=5,
                        help="rounds; in each, every state runs every combination for --steps steps")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if 1 not in args.blas_threads or 1 not in args.attention_threads:
        parser.error("--blas-threads and --attention-threads must include 1 (the baseline)")
    if args.worker:
        worker(args)
        return

    before = machine_info()
    rows = []
    for policy in args.wait_policy:
        env = dict(os.environ, OMP_WAIT_POLICY=policy.upper())
        env.pop("OPENBLAS_THREAD_TIMEOUT", None)
        if policy == "passive":
            env["OPENBLAS_THREAD_TIMEOUT"] = "4"  # what import pagedkv sets (the worker imports NumPy first)
        command = [sys.executable, __file__, "--worker", "--context", str(args.context),
                   "--rounds", str(args.rounds), "--steps", str(args.steps),
                   "--batch", *map(str, args.batch), "--blas-threads", *map(str, args.blas_threads),
                   "--attention-threads", *map(str, args.attention_threads),
                   "--backends", *args.backends, "--neighbour", *args.neighbour]
        if args.gguf:
            command += ["--gguf", args.gguf]
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
        out = subprocess.run(command, env=env, check=True, capture_output=True, text=True).stdout
        for row in json.loads(out.strip().splitlines()[-1]):
            rows.append({"wait_policy": policy, "load_average_at_start": load, **row})
            print(rows[-1], flush=True)
    after = machine_info()
    print(f"\nDecode step at context {args.context}, median of {args.rounds * args.steps} steps per state "
          f"(load average before {before['load_average']}, after {after['load_average']})")
    print(format_table(
        ["neighbour", "idle workers", "batch", "backend", "BLAS / attention threads", "median", "min"],
        [[r["neighbour"], r["wait_policy"], r["batch_size"], "paged" if r["backend"] == DEFAULT else r["backend"],
          threads_label(r), f"{r['median_ms']:.1f} ms", f"{r['min_ms']:.1f} ms"] for r in rows]))

    # N threads (both pools) and the default against one thread, paged backend: the goals.
    summary = []
    paged = {(r["neighbour"], r["wait_policy"], r["batch_size"], r["blas_threads"], r["attention_threads"]): r
             for r in rows if r["backend"] == "paged"}
    for r in rows:
        if r["backend"] == "dense" or (r["backend"] == "paged" and r["blas_threads"] != r["attention_threads"]):
            continue
        one = paged[(r["neighbour"], r["wait_policy"], r["batch_size"], 1, 1)]
        if r is one:
            continue
        speed = one["median_ms"] / r["median_ms"]
        if r["neighbour"] == "busy":
            goal, met = ">= 0.9x", speed >= 0.9
        elif r["backend"] == DEFAULT:  # idle: as fast as the faster of 1 and N threads, within the noise
            best = max(one["median_ms"] / p["median_ms"] for k, p in paged.items()
                       if k[:3] == (r["neighbour"], r["wait_policy"], r["batch_size"]) and k[3] == k[4])
            goal, met = f">= 0.9 x best ({best:.2f}x)", speed >= 0.9 * best
        else:
            goal, met = "> 1.0x", speed > 1.0
        summary.append({"neighbour": r["neighbour"], "wait_policy": r["wait_policy"], "batch_size": r["batch_size"],
                        "threads": threads_label(r), "speed_vs_one_thread": speed, "goal": goal, "met": met})
    print("\nSpeed relative to one thread (paged backend; one-thread median / median)")
    print(format_table(
        ["neighbour", "idle workers", "batch", "BLAS / attention threads", "speed vs 1 thread", "goal", "met"],
        [[r["neighbour"], r["wait_policy"], r["batch_size"], r["threads"], f"{r['speed_vs_one_thread']:.2f}x",
          r["goal"], "yes" if r["met"] else "NO"] for r in summary]))
    path = write_json("bench_llama_threads", {"machine_before": before, "machine_after": after,
                                              "args": vars(args), "rows": rows, "summary": summary})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
