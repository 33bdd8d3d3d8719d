"""Attention kernels over a KVCache with per-layer attention settings (page groups): each layer
is read from its own group's pages and page table, under its own mask, against dense attention
over what the layer's group holds."""
import numpy as np
import pytest

from pagedkv import AttentionSetting, KVCache, attention
from test_attention import attends

SETTINGS = [None, AttentionSetting(window=7), AttentionSetting(window=5, sink_tokens=2),
            AttentionSetting(chunk_size=6)]


def hybrid_cache(dtype, rng, lengths):
    """Layers 0..7 cycling through SETTINGS (4 kinds, 2 layers each: 4 groups of 2 layers)."""
    cache = KVCache(8, 2, 16, num_pages=256, page_size=4, dtype=dtype,
                    layer_attention=[SETTINGS[layer % 4] for layer in range(8)])
    for seq_id in range(len(lengths)):
        cache.add_sequence(seq_id)
    for _ in range(3):  # three appends, so that windows and chunks release pages on the way
        slots = cache.append(list(range(len(lengths))), lengths)
        total = int(sum(lengths))
        for layer in range(8):
            k = rng.standard_normal((total, 2, 16)).astype(dtype)
            v = rng.standard_normal((total, 2, 16)).astype(dtype)
            cache.store(layer, slots, k, v)
    return cache


def dense(cache, layer, seq_id, q, positions, scale, sink_logits=None, softcap=None):
    setting = cache.layer_setting(layer)
    k, v, key_pos = cache.gather(layer, seq_id)
    k, v = k.astype(np.float64), v.astype(np.float64)
    n, hq, dim = q.shape
    group = hq // cache.num_kv_heads
    out = np.empty((n, hq, dim))
    for i, p in enumerate(positions):
        mask = attends(key_pos, p, setting.window, setting.sink_tokens, setting.chunk_size)
        qh = q[i].astype(np.float64).reshape(cache.num_kv_heads, group, dim)
        scores = np.einsum("hgd,mhd->hgm", qh, k[mask]) * scale
        if softcap is not None:
            scores = softcap * np.tanh(scores / softcap)
        top = scores.max(axis=-1, keepdims=True)
        extra = 0.0
        if sink_logits is not None:
            sink = np.asarray(sink_logits, np.float64).reshape(cache.num_kv_heads, group, 1)
            top = np.maximum(top, sink)
            extra = np.exp(sink - top)
        weights = np.exp(scores - top)
        out[i] = (np.einsum("hgm,mhd->hgd", weights, v[mask])
                  / (weights.sum(axis=-1, keepdims=True) + extra)).reshape(hq, dim)
    return out


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("options", [{}, {"softcap": 2.0, "sink_logits": [0.3, -1.0, 1.5, -np.inf]}])
def test_every_layer_attends_over_its_own_group(dtype, options):
    rng = np.random.default_rng(3)
    lengths = [9, 1, 14]
    cache = hybrid_cache(dtype, rng, lengths)
    assert cache.num_groups == 4
    seq_ids = [0, 1, 2]
    scale = 0.3
    tolerance = 2e-3 if dtype == np.float16 else 2e-5
    for layer in range(8):
        q = rng.standard_normal((3, 4, 16)).astype(np.float32)
        out = attention.decode(q, cache, layer, seq_ids, scale=scale, **options)
        for b, seq_id in enumerate(seq_ids):
            want = dense(cache, layer, seq_id, q[b:b + 1], [cache.seq_len(seq_id) - 1], scale, **options)
            np.testing.assert_allclose(out[b], want[0], atol=tolerance, rtol=0)
        qo = np.concatenate([[0], np.cumsum(lengths)])
        q = rng.standard_normal((int(qo[-1]), 4, 16)).astype(np.float32)
        out = attention.prefill(q, cache, layer, seq_ids, qo, scale=scale, **options)
        for b, seq_id in enumerate(seq_ids):
            n = cache.seq_len(seq_id)
            positions = list(range(n - lengths[b], n))
            want = dense(cache, layer, seq_id, q[qo[b]:qo[b + 1]], positions, scale, **options)
            np.testing.assert_allclose(out[qo[b]:qo[b + 1]], want, atol=tolerance, rtol=0)


def test_a_layer_reads_only_its_own_groups_pages():
    """Poison every pool slot of the other groups' pages: a layer's attention stays finite and equal."""
    rng = np.random.default_rng(5)
    cache = hybrid_cache(np.float32, rng, [11, 6])
    q = rng.standard_normal((2, 4, 16)).astype(np.float32)
    before = {layer: attention.decode(q, cache, layer, [0, 1]) for layer in range(8)}
    for layer in range(8):
        group = cache.layer_group(layer)
        own = set()
        for g in range(cache.num_groups):
            if g == group:
                own.update(cache.page_table([0, 1], group=g).indices.tolist())
        others = [page for page in range(cache.num_pages) if page not in own]
        saved = cache.kv[:, others].copy()
        cache.kv[:, others] = np.nan
        np.testing.assert_array_equal(attention.decode(q, cache, layer, [0, 1]), before[layer])
        cache.kv[:, others] = saved
