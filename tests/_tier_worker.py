"""One process of the shared-tier tests: a KVCache with a RedisTier, run as ``python _tier_worker.py MODE ...``.

The K/V stored for a prompt position is a function of the prompt up to that position
(:func:`expected_rows`), as a model's would be, so any process can check that every
page it got, from its own prefix cache or from the tier, holds exactly the right bytes.

Modes (each prints one JSON line of results):

``write URL NAMESPACE SEED LENGTH OUT``
    Prefill one prompt, store its K/V, remove the sequence (which seals its pages),
    wait for the offload; save every layer's gather to OUT (.npz).
``read URL NAMESPACE SEED LENGTH OUT``
    Add the same prompt; report the tokens served (local and tier) and save the
    gather of the served tokens; then append and store the rest and save the
    decode attention of a fixed query against a cold cache's.
``replay URL NAMESPACE WORKER ITERATIONS``
    Run prompts made of a few shared prefixes plus a private suffix; check every
    served page against :func:`expected_rows`; count tier hits.
"""
import json
import sys

import numpy as np

LAYOUT = dict(num_layers=3, num_kv_heads=2, head_dim=8, page_size=16, dtype=np.float32)


def make_prompt(seed, length):
    """A prompt of ``length`` token ids from a seed."""
    return np.random.default_rng(seed).integers(0, 32000, size=length).astype(np.int32)


def expected_rows(prompt, layer, num_kv_heads=LAYOUT["num_kv_heads"], head_dim=LAYOUT["head_dim"]):
    """K and V rows, float32 ``[len(prompt), num_kv_heads, head_dim]``: a function of each position's prefix."""
    prefix_sums = np.cumsum(prompt.astype(np.int64) * 7919 + 13) % 65521
    base = prefix_sums.astype(np.float32)[:, None, None]
    k = base + np.float32(layer * 0.5) + np.arange(num_kv_heads, dtype=np.float32)[None, :, None] * 0.25 \
        + np.arange(head_dim, dtype=np.float32)[None, None, :] / 64
    return k, -k


def make_cache(url, namespace, num_pages=64, tier_kwargs=None):
    from pagedkv import KVCache
    from pagedkv.tiers import RedisTier

    tier = RedisTier(url, namespace=namespace, **(tier_kwargs or {}))
    return KVCache(num_pages=num_pages, enable_prefix_caching=True, tier=tier, **LAYOUT), tier


def fill(cache, seq_id, prompt, start):
    """Append and store the prompt's tokens from position ``start`` on."""
    slots = cache.append([seq_id], [len(prompt) - start])
    for layer in range(cache.num_layers):
        k, v = expected_rows(prompt, layer)
        cache.store(layer, slots, k[start:], v[start:])


def served_rows_are_right(cache, seq_id, prompt):
    for layer in range(cache.num_layers):
        k, v, positions = cache.gather(layer, seq_id)
        want_k, want_v = expected_rows(prompt[:len(positions)], layer)
        if not (np.array_equal(positions, np.arange(len(positions))) and np.array_equal(k, want_k)
                and np.array_equal(v, want_v)):
            return False
    return True


def write(url, namespace, seed, length, out):
    cache, tier = make_cache(url, namespace)
    prompt = make_prompt(seed, length)
    cached = cache.add_sequence(0, prompt)
    fill(cache, 0, prompt, cached)
    np.savez(out, **{f"k{layer}": cache.gather(layer, 0)[0] for layer in range(cache.num_layers)},
             **{f"v{layer}": cache.gather(layer, 0)[1] for layer in range(cache.num_layers)})
    cache.remove_sequence(0)
    flushed = tier.flush(timeout=30)
    return {"cached": cached, "flushed": flushed, "stats": cache.stats()}


def read(url, namespace, seed, length, out):
    from pagedkv import KVCache, attention

    cache, tier = make_cache(url, namespace)
    prompt = make_prompt(seed, length)
    cached = cache.add_sequence(0, prompt)
    served = {f"k{layer}": cache.gather(layer, 0)[0] for layer in range(cache.num_layers)}
    served |= {f"v{layer}": cache.gather(layer, 0)[1] for layer in range(cache.num_layers)}
    right = served_rows_are_right(cache, 0, prompt)
    fill(cache, 0, prompt, cached)
    cold = KVCache(num_pages=64, **LAYOUT)
    cold.add_sequence(0)
    fill(cold, 0, prompt, 0)
    q = np.random.default_rng(7).standard_normal((1, 2 * LAYOUT["num_kv_heads"], LAYOUT["head_dim"]),
                                                  dtype=np.float32)
    same_attention = all(np.array_equal(attention.decode(q, cache, layer, [0]), attention.decode(q, cold, layer, [0]))
                         for layer in range(cache.num_layers))
    np.savez(out, **served)
    return {"cached": cached, "right": right, "same_attention": same_attention, "stats": cache.stats()}


def replay(url, namespace, worker, iterations, pause=False):
    """With ``pause``, print ``ready`` halfway and wait for a line on stdin before going on
    (the caller changes the cluster in between)."""
    cache, tier = make_cache(url, namespace, num_pages=48)
    rng = np.random.default_rng(worker)
    shared = [make_prompt(1000 + i, 64) for i in range(6)]
    wrong = served = tier_tokens = 0
    for i in range(iterations):
        if pause and i == iterations // 2:
            print("ready", flush=True)
            sys.stdin.readline()
        prompt = np.concatenate([shared[rng.integers(len(shared))], make_prompt(10**6 * (worker + 1) + i, 20)])
        before = cache.stats()["tier_hits"]
        cached = cache.add_sequence(i, prompt)
        tier_tokens += cache.stats()["tier_hits"] - before
        served += cached
        if not served_rows_are_right(cache, i, prompt):
            wrong += 1
        fill(cache, i, prompt, cached)
        cache.remove_sequence(i)
    tier.flush(timeout=30)
    return {"wrong": wrong, "served": served, "tier_tokens": tier_tokens, "stats": cache.stats()}


def main(argv):
    mode, url, namespace = argv[:3]
    if mode == "write":
        result = write(url, namespace, int(argv[3]), int(argv[4]), argv[5])
    elif mode == "read":
        result = read(url, namespace, int(argv[3]), int(argv[4]), argv[5])
    elif mode == "replay":
        result = replay(url, namespace, int(argv[3]), int(argv[4]), pause=argv[5:6] == ["pause"])
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    print(json.dumps(result, default=int))


if __name__ == "__main__":
    main(sys.argv[1:])
