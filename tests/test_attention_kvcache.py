"""Paged attention over real KVCache page tables (built by append, fork and the window).

The kernels are checked against the dense float64 reference of
test_attention.py on K/V gathered from the cache, with every slot that no
query may read poisoned with NaN.
"""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from pagedkv import KVCache
from test_attention import check_decode, check_prefill


def grow(cache, seq_ids, counts, rng):
    """Append counts[b] tokens to each sequence and store random K/V in every layer."""
    slots = cache.append(seq_ids, counts)
    n = int(np.sum(counts))
    for layer in range(cache.num_layers):
        shape = (n, cache.num_kv_heads, cache.head_dim)
        cache.store(layer, slots, rng.standard_normal(shape, dtype=np.float32),
                    rng.standard_normal(shape, dtype=np.float32))


@st.composite
def scenarios(draw):
    page_size = draw(st.sampled_from([1, 3, 16]))
    window = draw(st.sampled_from([None, 1, 2, 5, 17, 40]))
    sinks = draw(st.sampled_from([0, 1, 4])) if window is not None else 0
    num_kv_heads = draw(st.sampled_from([1, 2]))
    group = draw(st.sampled_from([1, 3, 4]))
    head_dim = draw(st.sampled_from([8, 64]))
    dtype = draw(st.sampled_from([np.float32, np.float16]))
    # Per sequence: a prefill chunk, then decode steps or chunks; lengths of 1
    # and exact page multiples come up through the sampled sizes.
    chunks = draw(st.lists(st.lists(st.sampled_from([1, 1, 2, page_size, 2 * page_size, 7]),
                                    min_size=1, max_size=6), min_size=1, max_size=3))
    fork_from = draw(st.sampled_from([None, 0]))
    seed = draw(st.integers(0, 2**16))
    return page_size, window, sinks, num_kv_heads, group, head_dim, dtype, chunks, fork_from, seed


@settings(max_examples=60, deadline=None)
@given(scenarios())
def test_decode_and_prefill_over_kvcache_page_tables(scenario):
    page_size, window, sinks, num_kv_heads, group, head_dim, dtype, chunks, fork_from, seed = scenario
    rng = np.random.default_rng(seed)
    cache = KVCache(2, num_kv_heads, head_dim, num_pages=256, page_size=page_size, dtype=dtype,
                    window=window, sink_tokens=sinks)
    seq_ids = list(range(len(chunks)))
    for seq_id in seq_ids:
        cache.add_sequence(seq_id)
    last = {}
    for step in range(max(len(c) for c in chunks)):
        batch = [s for s in seq_ids if step < len(chunks[s])]
        counts = [chunks[s][step] for s in batch]
        grow(cache, batch, counts, rng)
        last.update(zip(batch, counts))
    if fork_from is not None:
        child = len(seq_ids)
        cache.fork(fork_from, child)
        grow(cache, [child], [2], rng)  # copy-on-write of a shared partial page, if any
        seq_ids.append(child)
        last[child] = 2
    cache.check_invariants()
    num_qo_heads = num_kv_heads * group
    # Checks poison every slot their queries may not read, so prefill (whose last
    # query is the decode query) goes first.
    for layer in range(2):
        check_prefill(cache, seq_ids, [last[s] for s in seq_ids], num_qo_heads, rng, layer=layer)
    for layer in range(2):
        check_decode(cache, seq_ids, num_qo_heads, rng, layer=layer)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_long_windowed_decode_reads_only_the_window(dtype):
    """16k tokens through a 256-token window with 4 sinks: the ring holds what decode needs."""
    rng = np.random.default_rng(7)
    cache = KVCache(1, 2, 32, num_pages=64, page_size=16, dtype=dtype, window=256, sink_tokens=4)
    cache.add_sequence(0)
    grow(cache, [0], [1000], rng)
    for _ in range(40):
        grow(cache, [0], [1], rng)
    assert cache.stats()["pages_peak"] <= 64
    check_decode(cache, [0], 8, rng)


def test_bad_layer_and_dtype_raise_as_kvcache_does():
    from pagedkv import attention

    cache = KVCache(2, 2, 8, num_pages=8, page_size=4, dtype=np.float32)
    cache.add_sequence(0)
    slots = cache.append([0], [3])
    k = np.zeros((3, 2, 8), np.float32)
    q = np.zeros((3, 4, 8), np.float32)
    calls = [lambda layer: cache.store(layer, slots, k, k), lambda layer: cache.gather(layer, 0),
             lambda layer: attention.decode(q[:1], cache, layer, [0]),
             lambda layer: attention.prefill(q, cache, layer, [0], [0, 3])]
    for call in calls:
        with pytest.raises(IndexError, match=r"^Invalid value of layer: expected 0 <= layer < 2, got 5$"):
            call(5)
        with pytest.raises(TypeError, match=r"^Invalid type of layer: expected an integer, got float$"):
            call(1.0)
    real = "expected real numbers \\(float16, float32, float64 or integers\\)"
    with pytest.raises(TypeError, match=f"^Invalid dtype of k: {real}, got bool$"):
        cache.store(0, slots, k.astype(bool), k)
    with pytest.raises(TypeError, match=f"^Invalid dtype of q: {real}, got complex128$"):
        attention.decode(q[:1].astype(complex), cache, 0, [0])


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("window, sinks", [(None, 0), (20, 3)])
def test_sink_logits_and_softcap_over_kvcache_page_tables(dtype, window, sinks):
    rng = np.random.default_rng(11)
    cache = KVCache(2, 2, 32, num_pages=64, page_size=4, dtype=dtype, window=window, sink_tokens=sinks)
    for seq_id in (0, 1):
        cache.add_sequence(seq_id)
    grow(cache, [0, 1], [37, 5], rng)
    grow(cache, [0, 1], [6, 9], rng)
    options = dict(sink_logits=np.array([0.5, -np.inf, 2.0, -1.0, 1.0, 0.0], np.float32), softcap=1.5,
                   sink_queries=sinks > 0)
    check_prefill(cache, [0, 1], [6, 9], 6, rng, layer=1, **options)
    check_decode(cache, [0, 1], 6, rng, layer=1, **options)
