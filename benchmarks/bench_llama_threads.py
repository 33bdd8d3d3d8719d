"""Thread settings of a SmolLM2-135M decode step: BLAS threads x attention (OpenMP) threads.

A decode step alternates NumPy's BLAS (OpenBLAS, its own pthreads pool) and the OpenMP
attention kernels. This script times decode steps, in the same run, for every
combination of ``--blas-threads`` and ``--attention-threads`` (paged float32 cache) and
for the dense backend under each BLAS setting, the combinations taking turns step by
step. It does so in two machine states (``--neighbour``):

``idle``
    nothing else started by the script;
``busy``
    a neighbour process that the script starts first and stops after: two threads
    hashing in a loop (hashlib releases the GIL), i.e. two cores' worth of demand, as
    another 2-thread inference job or a CPU-quota neighbour would make.

and with two settings of the idle workers of both pools (``--wait-policy``):
``passive``, what ``import pagedkv`` sets unless the environment says otherwise
(``OMP_WAIT_POLICY=PASSIVE`` and ``OPENBLAS_THREAD_TIMEOUT=4``: idle workers sleep at
once), and ``active``, the runtimes' behaviour before (``OMP_WAIT_POLICY=ACTIVE``: libgomp's
own default spins for about 3 ms, longer than the gap between two attention calls of a
decode step, so it behaves like ``active`` here; OpenBLAS's default: spin 2**28 cycles).
Both variables are read when the runtimes load, so every (state, policy) pair runs in a
fresh subprocess.

Prints the median step time of each combination, then for each state, policy and batch
the speed of N threads (BLAS and attention both N) relative to one thread, against the
goals: at least 0.9x with a busy neighbour, above 1x on an idle machine. Writes
``benchmarks/results/bench_llama_threads.json``.

Example::

    python benchmarks/bench_llama_threads.py --context 512 --batch 1 8
"""
import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

from _timing import format_table, machine_info, write_json


def worker(args):
    from threadpoolctl import threadpool_limits

    from pagedkv.models import DenseBackend, LlamaModel
    from pagedkv.models.paged_backend import PagedBackend

    # num_threads=None: the model leaves the BLAS thread count to the limits set below.
    model, _ = LlamaModel.from_gguf(args.gguf, num_threads=None)
    rng = np.random.default_rng(0)
    results = []
    for batch_size in args.batch:
        prompts = [rng.integers(0, model.config.vocab_size, size=args.context) for _ in range(batch_size)]
        seq_ids = list(range(batch_size))
        total = args.context + args.rounds * args.steps + 1
        combos = [("dense", blas, 0) for blas in args.blas_threads]
        combos += [("paged", blas, attn) for blas, attn in itertools.product(args.blas_threads,
                                                                              args.attention_threads)]
        backends, tokens = {}, {}
        with threadpool_limits(1, "blas"):
            for combo in combos:
                kind, _, attn = combo
                if kind == "dense":
                    backend = DenseBackend.for_config(model.config, initial_capacity=total)
                else:
                    backend = PagedBackend.for_config(model.config, PagedBackend.pages_for([total] * batch_size),
                                                      dtype=np.float32, num_threads=attn)
                for s in seq_ids:
                    backend.add_sequence(s)
                logits = model.forward(backend, seq_ids, prompts)
                backends[combo], tokens[combo] = backend, [[int(t)] for t in logits.argmax(axis=-1)]
        times = {combo: [] for combo in combos}
        for round_index in range(args.rounds):
            shift = round_index % len(combos)
            for combo in combos[shift:] + combos[:shift]:
                with threadpool_limits(combo[1], "blas"):
                    for _ in range(args.steps):
                        start = time.perf_counter()
                        logits = model.forward(backends[combo], seq_ids, tokens[combo])
                        times[combo].append(time.perf_counter() - start)
                        tokens[combo] = [[int(t)] for t in logits.argmax(axis=-1)]
        for combo in combos:
            results.append({"batch_size": batch_size, "backend": combo[0], "blas_threads": combo[1],
                            "attention_threads": combo[2] or None,
                            "median_ms": statistics.median(times[combo]) * 1e3,
                            "min_ms": min(times[combo]) * 1e3})
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


def stop_neighbour(neighbour):
    neighbour.kill()
    neighbour.wait()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gguf", default=None)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--blas-threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--attention-threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--wait-policy", nargs="+", default=["passive", "active"], choices=["passive", "active"])
    parser.add_argument("--neighbour", nargs="+", default=["idle", "busy"], choices=["idle", "busy"])
    parser.add_argument("--rounds", type=int, default=5, help="rounds; each combination runs --steps steps per round")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return

    before = machine_info()
    rows = []
    for state in args.neighbour:
        for policy in args.wait_policy:
            env = dict(os.environ, OMP_WAIT_POLICY=policy.upper())
            env.pop("OPENBLAS_THREAD_TIMEOUT", None)
            if policy == "passive":
                env["OPENBLAS_THREAD_TIMEOUT"] = "4"  # what import pagedkv sets (the worker imports NumPy first)
            command = [sys.executable, __file__, "--worker", "--context", str(args.context),
                       "--rounds", str(args.rounds), "--steps", str(args.steps),
                       "--batch", *map(str, args.batch), "--blas-threads", *map(str, args.blas_threads),
                       "--attention-threads", *map(str, args.attention_threads)]
            if args.gguf:
                command += ["--gguf", args.gguf]
            neighbour = start_neighbour() if state == "busy" else None
            try:
                load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
                out = subprocess.run(command, env=env, check=True, capture_output=True, text=True).stdout
            finally:
                if neighbour is not None:
                    stop_neighbour(neighbour)
            for row in json.loads(out.strip().splitlines()[-1]):
                rows.append({"neighbour": state, "wait_policy": policy, "load_average_at_start": load, **row})
                print(rows[-1], flush=True)
    after = machine_info()
    print(f"\nDecode step at context {args.context}, median of {args.rounds * args.steps} steps "
          f"(load average before {before['load_average']}, after {after['load_average']})")
    print(format_table(
        ["neighbour", "idle workers", "batch", "backend", "BLAS threads", "attention threads", "median", "min"],
        [[r["neighbour"], r["wait_policy"], r["batch_size"], r["backend"], r["blas_threads"],
          r["attention_threads"] or "-", f"{r['median_ms']:.1f} ms", f"{r['min_ms']:.1f} ms"] for r in rows]))

    # N threads (both pools) against one thread, paged backend: the goals.
    summary = []
    paged = {(r["neighbour"], r["wait_policy"], r["batch_size"], r["blas_threads"], r["attention_threads"]): r
             for r in rows if r["backend"] == "paged"}
    for (state, policy, batch, blas, attn), row in paged.items():
        one = paged.get((state, policy, batch, 1, 1))
        if one is None or (blas, attn) == (1, 1):
            continue
        speed = one["median_ms"] / row["median_ms"]
        goal = "> 1.0x" if state == "idle" else ">= 0.9x"
        met = speed > 1.0 if state == "idle" else speed >= 0.9
        summary.append({"neighbour": state, "wait_policy": policy, "batch_size": batch, "blas_threads": blas,
                        "attention_threads": attn, "speed_vs_one_thread": speed, "goal": goal, "met": met})
    print("\nSpeed of N threads relative to one thread (paged backend; one-thread median / N-thread median)")
    print(format_table(
        ["neighbour", "idle workers", "batch", "BLAS threads", "attention threads", "speed vs 1 thread", "goal",
         "met"],
        [[r["neighbour"], r["wait_policy"], r["batch_size"], r["blas_threads"], r["attention_threads"],
          f"{r['speed_vs_one_thread']:.2f}x", r["goal"], "yes" if r["met"] else "NO"] for r in summary]))
    path = write_json("bench_llama_threads", {"machine_before": before, "machine_after": after,
                                              "args": vars(args), "rows": rows, "summary": summary})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
