"""The shared prefix tier on a real 3-node Redis Cluster on loopback.

Starts a cluster with ``scripts/redis_cluster.sh`` (or uses ``--url``) and measures, in one run:

* **Fetch throughput.** A writer cache offloads the pages of a prompt of ``--pages`` SmolLM2-sized
  pages (30 layers, 3 KV heads, head dim 64, 16-token pages, float16: 368,640 bytes of K/V per
  page). Each repetition makes a new reader cache and times ``add_sequence`` of the same prompt:
  one pipelined fetch, value checks (header, token ids, checksum), copy into the pool. The
  baseline, timed in the same run, is redis-py's own cluster pipeline of GETs of the same keys
  (the network part alone). Reported: pages/s, MB/s and the ratio (goal >= 0.8).
* **Decode with offload, no model (the worst case).** A decode loop over ``--batch`` sequences
  (one token per sequence per step: ``append``, ``store`` of every layer): tokens/s with the tier
  against the same loop without one. Every 16 steps each sequence seals a page, which the tier's
  writer thread copies out and sends while the loop goes on: with no model work the offload's
  traffic is about as many bytes as the loop stores.
* **Decode with offload, with a model.** SmolLM2-135M generates 64 tokens for each of 8 distinct
  128-token prompts as one batch (``pagedkv.models.generate``, greedy, 1 thread) over a cache with
  prefix caching, with the tier against without one: decode tokens/s, alternated runs (goal:
  within 5%).
* **Time to first token of a second ``pagedkv generate`` process.** A first process generates
  from a ``--ttft-tokens`` (default 1024) token prompt (the start of tinyshakespeare) with
  ``--tier URL`` and writes the prompt's pages; then, alternately, a process with the same prompt
  and tier (every full page but the last token's fetched) and one without a tier (the whole
  prompt prefilled). Each reports its time from the start of the sequence (tier fetch included)
  to the first token; the ratio is recompute / tier hit. SmolLM2-135M, 1 thread each.

The trace split (hit rate of 4 isolated caches, of the same 4 sharing the tier, of one cache of
4x the capacity) is ``pagedkv replay TRACE --tier URL --instances 4 --capacity-tokens 2500000``.

Prints a table (medians and ratios) and writes ``benchmarks/results/bench_tier.json``.

Example::

    nice -n 19 python benchmarks/bench_tier.py
    python benchmarks/bench_tier.py --url redis+cluster://10.0.0.5:7000 --pages 32 --repeats 5
"""
from __future__ import annotations

import argparse
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import machine_info, write_json  # noqa: E402

from pagedkv import KVCache  # noqa: E402
from pagedkv.tiers import RedisTier  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SMOLLM2 = dict(num_layers=30, num_kv_heads=3, head_dim=64, page_size=16, dtype=np.float16)


def start_cluster(tmp: Path):
    for _ in range(100):
        base = random.randrange(20000, 45000)
        if all(_free(p) and _free(p + 10000) for p in range(base, base + 3)):
            break
    env = dict(os.environ, REDIS_CLUSTER_DIR=str(tmp / "cluster"), REDIS_CLUSTER_PORT=str(base))
    out = subprocess.run([str(REPO / "scripts" / "redis_cluster.sh"), "start", "3"], env=env,
                         capture_output=True, text=True, check=True)
    url = out.stdout.strip()  # the script prints the URL to paste: redis+cluster://host:port,...
    if not url.startswith("redis+cluster://"):
        raise RuntimeError(f"scripts/redis_cluster.sh start printed {url!r}, not a redis+cluster:// URL")
    return url, env


def _free(port):
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def prefill(cache, seq_id, prompt, rng):
    slots = cache.append([seq_id], [len(prompt)])
    shape = (len(prompt), cache.num_kv_heads, cache.head_dim)
    for layer in range(cache.num_layers):
        cache.store(layer, slots, rng.standard_normal(shape, dtype=np.float32),
                    rng.standard_normal(shape, dtype=np.float32))


def bench_fetch(url, num_pages, repeats):
    ns = f"bench-{uuid.uuid4().hex}"
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 49152, size=num_pages * 16 + 1).astype(np.int32)
    writer_tier = RedisTier(url, namespace=ns)
    writer = KVCache(num_pages=num_pages + 8, enable_prefix_caching=True, tier=writer_tier, **SMOLLM2)
    writer.add_sequence(0, prompt)
    prefill(writer, 0, prompt, rng)
    writer.remove_sequence(0)
    assert writer_tier.flush(120), "the offload did not finish"
    assert writer_tier.stats()["pages_written"] == num_pages, writer_tier.stats()
    from pagedkv.tiers._format import page_keys

    index_cache = KVCache(0, 1, 1, num_pages + 8, enable_prefix_caching=True)
    index_cache.add_sequence(0, prompt)
    index_cache.append([0], [len(prompt)])
    ids = index_cache.page_table([0]).indices[:num_pages]
    hashes = [index_cache.prefix_index.page_hash(int(p)) for p in ids]
    keys = page_keys(writer_tier._prefix, np.array([[h & (2**64 - 1), h >> 64] for h in hashes], dtype=np.uint64))

    reader_tier = RedisTier(url, namespace=ns)
    cache_times, raw_times = [], []
    for _ in range(repeats):
        reader = KVCache(num_pages=num_pages + 8, enable_prefix_caching=True, tier=reader_tier, **SMOLLM2)
        reader.kv[...] = 0  # touch the pool outside the timed region
        start = time.perf_counter()
        served = reader.add_sequence(0, prompt)
        cache_times.append(time.perf_counter() - start)
        assert served == num_pages * 16, served
        raw = reader_tier._client()
        start = time.perf_counter()
        pipe = raw.pipeline(transaction=False)
        for key in keys:
            pipe.get(key)
        values = pipe.execute()
        raw_times.append(time.perf_counter() - start)
        assert all(v is not None for v in values)
    page_bytes = writer.stats()["bytes_per_page"]
    cache_s, raw_s = statistics.median(cache_times), statistics.median(raw_times)
    return {
        "pages": num_pages, "page_bytes": page_bytes,
        "cache_pages_per_s": num_pages / cache_s, "cache_mb_per_s": num_pages * page_bytes / cache_s / 1e6,
        "redis_py_pages_per_s": num_pages / raw_s, "redis_py_mb_per_s": num_pages * page_bytes / raw_s / 1e6,
        "ratio": raw_s / cache_s,
    }


def decode_loop(cache, batch, steps, rng):
    ids = list(range(batch))
    for s in ids:
        cache.add_sequence(s, rng.integers(0, 49152, size=33).astype(np.int32))
    prefill_slots = cache.append(ids, [33] * batch)
    shape = (33 * batch, cache.num_kv_heads, cache.head_dim)
    rows = rng.standard_normal(shape, dtype=np.float32).astype(np.float16)
    for layer in range(cache.num_layers):
        cache.store(layer, prefill_slots, rows, rows)
    one = rng.standard_normal((batch, cache.num_kv_heads, cache.head_dim), dtype=np.float32).astype(np.float16)
    tokens = np.zeros(batch, dtype=np.int32)
    start = time.perf_counter()
    for step in range(steps):
        tokens[:] = step
        slots = cache.append(ids, [1] * batch, tokens)
        for layer in range(cache.num_layers):
            cache.store(layer, slots, one, one)
    return batch * steps / (time.perf_counter() - start)


def bench_decode(url, batch, steps, repeats):
    with_tier, without = [], []
    for r in range(repeats):
        for use_tier in (False, True):
            tier = RedisTier(url, namespace=f"bench-decode-{uuid.uuid4().hex}") if use_tier else None
            cache = KVCache(num_pages=batch * (steps // 16 + 8), enable_prefix_caching=True, tier=tier, **SMOLLM2)
            rate = decode_loop(cache, batch, steps, np.random.default_rng(r))
            (with_tier if use_tier else without).append(rate)
            if tier is not None:
                tier.flush(120)
                tier.close()
    return {"batch": batch, "steps": steps, "tokens_per_s_without_tier": statistics.median(without),
            "tokens_per_s_with_tier": statistics.median(with_tier),
            "ratio": statistics.median(with_tier) / statistics.median(without)}


def bench_model_decode(url, repeats):
    from pagedkv.models import LlamaModel, generate
    from pagedkv.models.paged_backend import PagedBackend

    model, _ = LlamaModel.from_gguf(None, num_threads=1)
    rng = np.random.default_rng(1)
    with_tier, without = [], []
    for r in range(repeats):
        prompts = [rng.integers(0, model.config.vocab_size, size=128).tolist() for _ in range(8)]
        for use_tier in (False, True):
            tier = RedisTier(url, namespace=f"bench-model-{uuid.uuid4().hex}") if use_tier else None
            backend = PagedBackend.for_config(model.config, 8 * (128 + 64) // 16 + 16, num_threads=1,
                                              enable_prefix_caching=True, tier=tier)
            result = generate(model, backend, prompts, max_new_tokens=64)
            (with_tier if use_tier else without).append(result.decode_tokens_per_second)
            if tier is not None:
                assert tier.flush(120) and tier.stats()["pages_written"] > 0, tier.stats()
                tier.close()
    return {"batch": 8, "prompt_tokens": 128, "new_tokens": 64,
            "tokens_per_s_without_tier": statistics.median(without),
            "tokens_per_s_with_tier": statistics.median(with_tier),
            "ratio": statistics.median(with_tier) / statistics.median(without)}


def find_text():
    """``shared/data/tinyshakespeare.txt`` beside the checkout (or in an ancestor), else None."""
    for base in [REPO.parent, *REPO.parent.parents]:
        candidate = base / "shared" / "data" / "tinyshakespeare.txt"
        if candidate.is_file():
            return candidate
    return None


def _generate(prompt, url=None, fingerprint=None):
    """Run ``pagedkv generate`` for one token; (time to first token in s, tokens from the tier, prompt tokens)."""
    command = [sys.executable, "-m", "pagedkv", "generate", prompt, "--max-new-tokens", "1", "--threads", "1"]
    if url is not None:
        command += ["--tier", url, "--model-fingerprint", fingerprint]
    out = subprocess.run(command, capture_output=True, text=True, check=True, timeout=1800)
    prefill = next(line for line in out.stderr.splitlines() if line.startswith("prefill:"))
    tokens, seconds = int(prefill.split()[1]), float(prefill.split(" in ")[1].split(" s")[0])
    fetched = 0
    for line in out.stderr.splitlines():
        if line.startswith("prefix cache:"):
            fetched = int(line.split("(")[1].split(" fetched")[0])
    return seconds, fetched, tokens


def bench_ttft(url, num_tokens, repeats):
    from pagedkv.models import LlamaModel

    text_path = find_text()
    if text_path is None:
        return None
    _, tokenizer = LlamaModel.from_gguf(None)
    ids = tokenizer.encode(text_path.read_text(encoding="utf-8")[: num_tokens * 8])[:num_tokens]
    prompt = tokenizer.decode(ids)
    fingerprint = f"bench-ttft-{uuid.uuid4().hex}"
    _generate(prompt, url, fingerprint)  # the first process: writes the prompt's pages
    hit, recompute = [], []
    for _ in range(repeats):
        seconds, fetched, tokens = _generate(prompt, url, fingerprint)
        assert fetched == (tokens - 1) // 16 * 16, (fetched, tokens)
        hit.append(seconds)
        recompute.append(_generate(prompt)[0])
    return {"prompt_tokens": tokens, "fetched_tokens": fetched, "ttft_tier_hit_s": statistics.median(hit),
            "ttft_recompute_s": statistics.median(recompute),
            "ratio": statistics.median(recompute) / statistics.median(hit)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=None, help="a cluster or server URL; default: start a 3-node cluster")
    parser.add_argument("--pages", type=int, default=64, help="pages per fetch (default 64)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--batch", type=int, default=8, help="decode batch (default 8)")
    parser.add_argument("--steps", type=int, default=128, help="decode steps (default 128)")
    parser.add_argument("--ttft-tokens", type=int, default=1024,
                        help="prompt tokens of the generate processes (default 1024; 0 skips that part "
                             "and the model decode)")
    parser.add_argument("--ttft-repeats", type=int, default=3, help="generate pairs (default 3)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        env = None
        url = args.url
        if url is None:
            url, env = start_cluster(Path(tmp))
        try:
            fetch = bench_fetch(url, args.pages, args.repeats)
            decode = bench_decode(url, args.batch, args.steps, max(5, args.repeats // 2))
            model_decode = bench_model_decode(url, 3) if args.ttft_tokens else None
            ttft = bench_ttft(url, args.ttft_tokens, args.ttft_repeats) if args.ttft_tokens else None
        finally:
            if env is not None:
                subprocess.run([str(REPO / "scripts" / "redis_cluster.sh"), "stop"], env=env, check=True)
    print(f"fetch of {fetch['pages']} pages of {fetch['page_bytes']} bytes (median of {args.repeats}):")
    print(f"  through the cache   {fetch['cache_pages_per_s']:9.0f} pages/s {fetch['cache_mb_per_s']:8.0f} MB/s")
    print(f"  redis-py pipeline   {fetch['redis_py_pages_per_s']:9.0f} pages/s {fetch['redis_py_mb_per_s']:8.0f} MB/s")
    print(f"  ratio cache / redis-py: {fetch['ratio']:.2f} (goal >= 0.8)")
    print(f"decode, batch {decode['batch']}, {decode['steps']} steps, SmolLM2 layout:")
    print(f"  without tier {decode['tokens_per_s_without_tier']:9.0f} tokens/s")
    print(f"  with tier    {decode['tokens_per_s_with_tier']:9.0f} tokens/s  ratio {decode['ratio']:.3f} (goal >= 0.95)")
    if model_decode is not None:
        print("decode with SmolLM2-135M, batch 8, 128-token prompts, 64 new tokens (median of 3):")
        print(f"  without tier {model_decode['tokens_per_s_without_tier']:9.1f} tokens/s")
        print(f"  with tier    {model_decode['tokens_per_s_with_tier']:9.1f} tokens/s  "
              f"ratio {model_decode['ratio']:.3f} (goal >= 0.95)")
    if ttft is not None:
        print(f"time to first token of a second generate process, {ttft['prompt_tokens']}-token prompt "
              f"(median of {args.ttft_repeats}):")
        print(f"  tier hit ({ttft['fetched_tokens']} tokens fetched) {ttft['ttft_tier_hit_s']:7.2f} s")
        print(f"  recompute (no tier)          {ttft['ttft_recompute_s']:7.2f} s   "
              f"ratio recompute / hit {ttft['ratio']:.1f}x")
    write_json("bench_tier", {"machine": machine_info(), "fetch": fetch, "ttft": ttft, "model_decode": model_decode,
                              "decode": decode, "store": "3-node cluster on loopback" if env else "given URL"})


if __name__ == "__main__":
    main()
