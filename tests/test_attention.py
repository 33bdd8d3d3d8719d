"""Paged attention against a dense float64 NumPy reference with explicit masks.

The caches come from tests/_fake_cache.py, a NumPy stand-in with the attention
contract of pagedkv.KVCache (shuffled page ids, windows that released early
pages, sink pages listed first, forks that share page ids). Every pool slot
that no query may read is overwritten with NaN first, so a kernel that reads
outside the mask, outside a sequence, or a page it does not list, fails.
"""
import contextlib
import dataclasses
import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from pagedkv import KVCache, attention
from pagedkv_c import _attention

from _fake_cache import FakeCache

AVAILABLE_ISAS = attention.kernel_info()["available_isas"]
TOLERANCE = {np.float32: 1e-5, np.float16: 2e-3}


# ---------------------------------------------------------------- reference

def attends(key_positions, p, window, sink_tokens, chunk_size=None):
    """Window and sink mask: k <= p and (k >= p - W + 1 or k < S); no window: k <= p.

    With ``chunk_size`` C (chunked attention, no window): floor(p / C) * C <= k <= p.
    """
    mask = key_positions <= p
    if window is not None:
        mask &= (key_positions >= p - window + 1) | (key_positions < sink_tokens)
    if chunk_size is not None:
        mask &= key_positions >= p - p % chunk_size
    return mask


def reference(cache, layer, seq_id, q, positions, scale, q_sink=None, sink_logits=None, softcap=None):
    """Dense float64 attention of queries q[n, Hq, D] at ``positions`` over the gathered K/V.

    With ``q_sink`` (shape of q), the keys at positions < sink_tokens are
    scored with its rows instead of q's. ``softcap`` c maps every score s to
    c * tanh(s / c) (Gemma 2); ``sink_logits`` (Hq,) adds exp(sink_logits[h])
    to the denominator of query head h (gpt-oss), the LSE included; the
    cache's ``chunk_size`` (if any) masks by chunks.
    """
    k, v, key_pos = cache.gather(layer, seq_id)
    k, v = k.astype(np.float64), v.astype(np.float64)
    n, num_qo_heads, dim = q.shape
    num_kv_heads = cache.num_kv_heads
    group = num_qo_heads // num_kv_heads
    window, sinks = cache.window, cache.sink_tokens
    chunk = getattr(cache, "chunk_size", None)
    sink_term = None
    if sink_logits is not None:
        sink_term = np.asarray(sink_logits, np.float64).reshape(num_kv_heads, group, 1)
    out = np.empty((n, num_qo_heads, dim))
    lse = np.empty((n, num_qo_heads))
    for i, p in enumerate(positions):
        mask = attends(key_pos, p, window, sinks, chunk)
        if window is not None:
            expected = min(p + 1, window) + min(sinks, max(0, p - window + 1))
        elif chunk is not None:
            expected = p % chunk + 1
        else:
            expected = p + 1
        assert mask.sum() == expected, "the test cache lost a key that the query needs"
        qh = q[i].astype(np.float64).reshape(num_kv_heads, group, dim)
        scores = np.einsum("hgd,mhd->hgm", qh, k[mask]) * scale
        if q_sink is not None:
            sink_h = q_sink[i].astype(np.float64).reshape(num_kv_heads, group, dim)
            is_sink = key_pos[mask] < sinks
            scores[..., is_sink] = np.einsum("hgd,mhd->hgm", sink_h, k[mask][is_sink]) * scale
        if softcap is not None:
            scores = softcap * np.tanh(scores / softcap)
        top = scores.max(axis=-1, keepdims=True, initial=-np.inf)
        if sink_term is not None:
            top = np.maximum(top, sink_term)
        weights = np.exp(scores - top)
        total = weights.sum(axis=-1, keepdims=True)
        if sink_term is not None:
            total = total + np.exp(sink_term - top)
        out[i] = (np.einsum("hgm,mhd->hgd", weights, v[mask]) / total).reshape(num_qo_heads, dim)
        lse[i] = (top + np.log(total)).reshape(num_qo_heads)
    return out, lse


def poison_unread_slots(cache, query_positions):
    """Set every pool slot that no query may attend to NaN (all layers, K and V).

    ``query_positions``: {seq_id: positions of its queries}. Covers slots past
    a sequence's length, out-of-window tokens of held pages, and every page
    no sequence lists.
    """
    ps = cache.page_size
    needed = np.zeros((cache.kv.shape[1], ps), dtype=bool)
    seq_ids = list(query_positions)
    view = cache.page_table(seq_ids)
    for b, seq_id in enumerate(seq_ids):
        seq_len = int(view.seq_lens[b])
        for j in range(view.indptr[b], view.indptr[b + 1]):
            pos = view.page_positions[j] + np.arange(ps)
            cached = pos < seq_len
            for p in query_positions[seq_id]:
                needed[view.indices[j]] |= cached & attends(pos, p, cache.window, cache.sink_tokens,
                                                            getattr(cache, "chunk_size", None))
    pages, slots = np.nonzero(~needed)
    cache.kv[:, pages, :, slots] = np.nan


def assert_close(got, want, dtype):
    assert np.isfinite(got).all(), "output has NaN/inf: a kernel read a slot outside the mask"
    err = np.abs(got - want).max(initial=0.0)
    assert err <= TOLERANCE[dtype], f"max abs error {err:.3g} > {TOLERANCE[dtype]}"


@contextlib.contextmanager
def _kernel_setting(setter, value):
    """Apply a private kernel setting (``setter`` returns the previous one) inside the block, then restore it."""
    previous = setter(value)
    try:
        yield
    finally:
        setter(previous)


def kernel_path(isa):
    """Run the kernels on the SIMD path ``isa`` inside the block."""
    return _kernel_setting(_attention._set_isa, isa)


def decode_partition(tokens):
    """Split decode into as many partitions as ``tokens`` tokens (whole pages) fit (0: never split)."""
    return _kernel_setting(_attention._set_decode_partition, tokens)


def random_q(rng, n, num_qo_heads, dim):
    return rng.standard_normal((n, num_qo_heads, dim), dtype=np.float32)


def check_decode(cache, seq_ids, num_qo_heads, rng, layer=0, scale=None, threads=(1, 2),
                 sink_queries=False, sink_logits=None, softcap=None):
    lens = [cache.seq_len(s) for s in seq_ids]
    poison_unread_slots(cache, {s: [n - 1] for s, n in zip(seq_ids, lens)})
    q = random_q(rng, len(seq_ids), num_qo_heads, cache.head_dim)
    q_sink = random_q(rng, len(seq_ids), num_qo_heads, cache.head_dim) if sink_queries else None
    results = [attention.decode(q, cache, layer, seq_ids, scale=scale, num_threads=t, return_lse=True,
                                q_sink=q_sink, sink_logits=sink_logits, softcap=softcap)
               for t in threads]
    out, lse = results[0]
    for other_out, other_lse in results[1:]:
        np.testing.assert_array_equal(out, other_out)
        np.testing.assert_array_equal(lse, other_lse)
    used_scale = 1.0 / np.sqrt(cache.head_dim) if scale is None else scale
    dtype = cache.kv.dtype.type
    for b, (seq_id, n) in enumerate(zip(seq_ids, lens)):
        ref_out, ref_lse = reference(cache, layer, seq_id, q[b:b + 1], [n - 1], used_scale,
                                     None if q_sink is None else q_sink[b:b + 1], sink_logits, softcap)
        assert_close(out[b], ref_out[0], dtype)
        assert_close(lse[b], ref_lse[0], dtype)
    return out


def check_prefill(cache, seq_ids, qo_lens, num_qo_heads, rng, layer=0, threads=(1, 2),
                  sink_queries=False, sink_logits=None, softcap=None, scale=None):
    lens = [cache.seq_len(s) for s in seq_ids]
    qo_indptr = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int64)
    queries = {}
    for s, n, m in zip(seq_ids, lens, qo_lens):
        queries.setdefault(s, []).extend(range(n - m, n))
    poison_unread_slots(cache, queries)
    q = random_q(rng, int(qo_indptr[-1]), num_qo_heads, cache.head_dim)
    q_sink = random_q(rng, int(qo_indptr[-1]), num_qo_heads, cache.head_dim) if sink_queries else None
    results = [attention.prefill(q, cache, layer, seq_ids, qo_indptr, scale=scale, num_threads=t,
                                 return_lse=True, q_sink=q_sink, sink_logits=sink_logits, softcap=softcap)
               for t in threads]
    out, lse = results[0]
    for other_out, other_lse in results[1:]:
        np.testing.assert_array_equal(out, other_out)
        np.testing.assert_array_equal(lse, other_lse)
    used_scale = 1.0 / np.sqrt(cache.head_dim) if scale is None else scale
    dtype = cache.kv.dtype.type
    for b, (seq_id, n, m) in enumerate(zip(seq_ids, lens, qo_lens)):
        rows = slice(qo_indptr[b], qo_indptr[b + 1])
        ref_out, ref_lse = reference(cache, layer, seq_id, q[rows], list(range(n - m, n)), used_scale,
                                     None if q_sink is None else q_sink[rows], sink_logits, softcap)
        assert_close(out[rows], ref_out, dtype)
        assert_close(lse[rows], ref_lse, dtype)
    return out


# ------------------------------------------------------------- named cases

def test_kernel_info_reports_the_selected_path():
    info = attention.kernel_info()
    assert info["isa"] in info["available_isas"]
    assert "scalar" in info["available_isas"]
    assert info["float16_conversion"] == ("portable" if info["isa"] == "scalar" else "f16c")
    assert isinstance(info["openmp"], bool) and info["max_threads"] >= 1
    assert info["max_head_dim"] == 256


@pytest.mark.parametrize("cap", ["scalar", "avx2"])
def test_environment_variable_caps_the_path(cap):
    env = dict(os.environ, PAGEDKV_ATTENTION_ISA=cap)
    code = "from pagedkv import attention; print(attention.kernel_info()['isa'])"
    # -P: a checkout's pagedkv_c/ source directory in the working directory must not shadow the package.
    got = subprocess.run([sys.executable, "-P", "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout.strip()
    expected = cap if cap in AVAILABLE_ISAS else "scalar"
    assert got == expected


FORK_AFTER_TEAM = """
import os, signal, numpy as np
from pagedkv import KVCache, attention
cache = KVCache(num_layers=1, num_kv_heads=2, head_dim=64, num_pages=64, page_size=16)
cache.add_sequence(0); cache.add_sequence(1)
slots = cache.append([0, 1], [100, 100])
kv = np.random.default_rng(0).standard_normal((200, 2, 64), dtype=np.float32)
cache.store(0, slots, kv, kv)
q = np.ones((2, 4, 64), np.float32)
parent = attention.decode(q, cache, 0, [0, 1], num_threads=2)
pid = os.fork()
if pid == 0:
    signal.alarm(60)  # a hung child dies of SIGALRM
    child = attention.decode(q, cache, 0, [0, 1], num_threads=2)
    ok = np.array_equal(child, parent) and attention.kernel_info()["max_threads"] == 1
    os._exit(0 if ok else 3)
_, status = os.waitpid(pid, 0)
print("signal", os.WTERMSIG(status) if os.WIFSIGNALED(status) else "exit", os.WEXITSTATUS(status))
"""


@pytest.mark.skipif(not attention.kernel_info()["openmp"] or not hasattr(os, "fork"),
                    reason="needs OpenMP and os.fork")
def test_a_child_forked_after_a_multithreaded_call_runs_on_one_thread():
    """GNU OpenMP's pool does not survive fork: without the guard the child hangs."""
    got = subprocess.run([sys.executable, "-P", "-c", FORK_AFTER_TEAM], capture_output=True,
                         text=True, check=True, timeout=120).stdout.strip()
    assert got == "signal exit 0"


def test_unknown_isa_cap_in_the_environment_warns_and_is_ignored():
    env = dict(os.environ, PAGEDKV_ATTENTION_ISA="bogus")
    code = ("import warnings; warnings.simplefilter('error')\n"
            "try:\n    from pagedkv import attention\nexcept RuntimeWarning as w:\n    print(w)")
    got = subprocess.run([sys.executable, "-P", "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout.strip()
    assert "PAGEDKV_ATTENTION_ISA='bogus'" in got and "ignored" in got


def test_set_isa_rejects_unknown_path():
    with pytest.raises(ValueError, match="name"):
        _attention._set_isa("sse9")


def test_portable_float16_conversion_matches_numpy_for_every_bit_pattern():
    bits = np.arange(2**16, dtype=np.uint16)
    got = _attention._half_to_float_portable(bits)
    want = bits.view(np.float16).astype(np.float32)
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))


SHAPES = [
    # (num_kv_heads, group, head_dim, page_size, window, sinks)
    (2, 4, 128, 16, None, 0),   # GQA, full attention
    (1, 8, 64, 16, 40, 4),      # MQA, window + sinks
    (4, 1, 32, 3, 7, 2),        # MHA, window not a multiple of the page size
    (2, 3, 80, 1, 5, 3),        # page size 1
    (1, 2, 256, 16, 5, 0),      # largest head dim, window smaller than a page
    (3, 2, 100, 16, 20, 17),    # head dim with a vector tail, sinks past a page
    (1, 5, 1, 3, None, 0),      # head dim 1, odd group
]


@pytest.mark.parametrize("isa", AVAILABLE_ISAS)
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("shape", SHAPES)
def test_decode_matches_reference_on_every_path(isa, dtype, shape):
    num_kv_heads, group, dim, ps, window, sinks = shape
    rng = np.random.default_rng(1)
    cache = FakeCache(2, num_kv_heads, dim, 200, ps, dtype, window, sinks, seed=2)
    lengths = [1, ps, 3 * ps, 2 * ps + 1, 70, 129]
    for i, n in enumerate(lengths):
        cache.add_sequence(i, n)
    with kernel_path(isa):
        check_decode(cache, list(range(len(lengths))), num_kv_heads * group, rng, layer=1)


@pytest.mark.parametrize("isa", AVAILABLE_ISAS)
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("shape", SHAPES)
def test_prefill_matches_reference_on_every_path(isa, dtype, shape):
    num_kv_heads, group, dim, ps, window, sinks = shape
    rng = np.random.default_rng(3)
    cache = FakeCache(1, num_kv_heads, dim, 200, ps, dtype, window, sinks, seed=4)
    lengths = [1, 2 * ps, 50, 70, 33]
    qo_lens = [1, 2 * ps, 50, 0, 9]  # whole prompts, an empty chunk, a chunk after context
    for i, (n, m) in enumerate(zip(lengths, qo_lens)):
        hold_from = None if window is None else n - m - window + 1
        cache.add_sequence(i, n, hold_from=hold_from)
    with kernel_path(isa):
        check_prefill(cache, list(range(len(lengths))), qo_lens, num_kv_heads * group, rng)


SINK_SHAPES = [shape for shape in SHAPES if shape[5] > 0]


@pytest.mark.parametrize("isa", AVAILABLE_ISAS)
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("shape", SINK_SHAPES)
def test_decode_with_sink_queries_matches_reference_on_every_path(isa, dtype, shape):
    # Random q_sink rows, unrelated to q: a sink key scored with q, or a window
    # key scored with q_sink, changes the result far beyond the tolerance.
    num_kv_heads, group, dim, ps, window, sinks = shape
    rng = np.random.default_rng(31)
    cache = FakeCache(2, num_kv_heads, dim, 200, ps, dtype, window, sinks, seed=32)
    lengths = [1, sinks, sinks + 1, ps, 3 * ps, 2 * ps + 1, 70, 129]
    for i, n in enumerate(lengths):
        cache.add_sequence(i, n)
    with kernel_path(isa):
        check_decode(cache, list(range(len(lengths))), num_kv_heads * group, rng, layer=1,
                     sink_queries=True)


@pytest.mark.parametrize("isa", AVAILABLE_ISAS)
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("shape", SINK_SHAPES)
def test_prefill_with_sink_queries_matches_reference_on_every_path(isa, dtype, shape):
    num_kv_heads, group, dim, ps, window, sinks = shape
    rng = np.random.default_rng(33)
    cache = FakeCache(1, num_kv_heads, dim, 300, ps, dtype, window, sinks, seed=34)
    # whole prompts, a chunk longer than the window after context, an empty chunk
    lengths = [1, 2 * ps, 50, 70, 33, 3 * window + 10]
    qo_lens = [1, 2 * ps, 50, 0, 9, 2 * window + 3]
    for i, (n, m) in enumerate(zip(lengths, qo_lens)):
        cache.add_sequence(i, n, hold_from=n - m - window + 1)
    with kernel_path(isa):
        check_prefill(cache, list(range(len(lengths))), qo_lens, num_kv_heads * group, rng,
                      sink_queries=True)


def test_sink_queries_identical_for_any_thread_count():
    rng = np.random.default_rng(35)
    seq_ids = list(range(6))
    check_decode(windowed_batch(), seq_ids, 8, rng, threads=(1, 2, 3, 7), sink_queries=True)
    check_prefill(windowed_batch(), seq_ids, [40, 17, 33, 1, 5, 40], 8, rng, threads=(1, 2, 3, 7),
                  sink_queries=True)


def test_sink_queries_equal_to_q_give_the_plain_result():
    rng = np.random.default_rng(37)
    cache = windowed_batch()
    q = random_q(rng, 6, 8, 64)
    plain = attention.decode(q, cache, 0, list(range(6)))
    np.testing.assert_allclose(attention.decode(q, cache, 0, list(range(6)), q_sink=q.copy()), plain,
                               rtol=0, atol=1e-6)


def test_windowed_cost_skips_released_and_out_of_window_pages():
    # A long windowed sequence holds sinks + a few pages; everything else is
    # NaN (released pages are simply not listed, out-of-window slots poisoned).
    rng = np.random.default_rng(5)
    cache = FakeCache(1, 2, 16, 64, 16, np.float32, window=24, sink_tokens=5, seed=6)
    cache.add_sequence("long", 5000)
    view = cache.page_table(["long"])
    assert view.indices.size == 3  # 1 sink page + 2 window pages, not 313 pages
    assert view.page_positions[0] == 0 and view.page_positions[1] > 16
    check_decode(cache, ["long"], 4, rng)


# ------------------------------------------------------------- split decode
#
# A batch of few (sequence, KV head) pairs splits each sequence's pages into
# partitions, computed as items of their own and merged with the log-sum-exp
# rescaling (Flash-Decoding). The partition length is set small here so that
# short test sequences split: one page, two pages (from a length that is not a
# multiple of the page size), three pages; sequences whose page count the
# partitions do not divide get a shorter last partition.

def split_partition_tokens(ps):
    return [1, 2 * ps - 1, 3 * ps]


@pytest.mark.parametrize("isa", AVAILABLE_ISAS)
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("partition", [0, 1, 2])
def test_split_decode_matches_reference_on_every_path(isa, dtype, shape, partition):
    num_kv_heads, group, dim, ps, window, sinks = shape
    rng = np.random.default_rng(41)
    cache = FakeCache(2, num_kv_heads, dim, 200, ps, dtype, window, sinks, seed=42)
    lengths = [1, ps, 3 * ps, 2 * ps + 1, 70, 129]
    for i, n in enumerate(lengths):
        # windowed sequences also hold up to 2 pages the window has left
        hold_from = None if window is None else n - window - (i % 3) * ps
        cache.add_sequence(i, n, hold_from=hold_from)
    with kernel_path(isa), decode_partition(split_partition_tokens(ps)[partition]):
        check_decode(cache, list(range(len(lengths))), num_kv_heads * group, rng, layer=1,
                     threads=(1, 2, 3))


@pytest.mark.parametrize("isa", AVAILABLE_ISAS)
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("shape", SINK_SHAPES)
@pytest.mark.parametrize("partition", [0, 2])
def test_split_decode_with_sink_queries_matches_reference_on_every_path(isa, dtype, shape, partition):
    num_kv_heads, group, dim, ps, window, sinks = shape
    rng = np.random.default_rng(43)
    cache = FakeCache(2, num_kv_heads, dim, 200, ps, dtype, window, sinks, seed=44)
    lengths = [1, sinks, sinks + 1, ps, 3 * ps, 2 * ps + 1, 70, 129]
    for i, n in enumerate(lengths):
        cache.add_sequence(i, n, hold_from=n - window - (i % 3) * ps)
    with kernel_path(isa), decode_partition(split_partition_tokens(ps)[partition]):
        check_decode(cache, list(range(len(lengths))), num_kv_heads * group, rng, layer=1,
                     threads=(1, 2, 3), sink_queries=True)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_long_sequence_splits_by_default_and_matches_reference(dtype):
    # One sequence of 3,000 tokens, 3 KV heads of 3 query heads (SmolLM2's
    # shape): partitions of the default length, the last one uneven.
    rng = np.random.default_rng(45)
    cache = FakeCache(1, 3, 64, 200, 16, dtype, seed=46)
    cache.add_sequence("long", 2950)  # 185 pages: 47 x 3 + 44 (float32), 93 + 92 (float16)
    cache.add_sequence("short", 30)
    split = check_decode(cache, ["short", "long"], 9, rng, threads=(1, 2, 3, 4))
    with decode_partition(0):
        whole = check_decode(cache, ["short", "long"], 9, np.random.default_rng(45), threads=(1, 2, 3, 4))
    # same queries; the merge rounds differently from one pass over the pages
    np.testing.assert_array_equal(split[0], whole[0])  # "short" is one partition either way
    assert not np.array_equal(split[1], whole[1])


def test_split_decode_identical_for_any_thread_count():
    rng = np.random.default_rng(47)
    with decode_partition(40):
        check_decode(windowed_batch(), list(range(6)), 8, rng, threads=(1, 2, 3, 7))
        check_decode(windowed_batch(), list(range(6)), 8, rng, threads=(1, 2, 3, 7), sink_queries=True)


def test_set_decode_partition_rejects_bad_values():
    with pytest.raises(ValueError, match="Invalid value of tokens"):
        _attention._set_decode_partition(-1)
    with pytest.raises(TypeError):
        _attention._set_decode_partition(1.5)


def forked_cache(dtype):
    cache = FakeCache(1, 2, 32, 64, 3, dtype, window=None, seed=8)
    cache.add_sequence("parent", 20)
    cache.fork("parent", "same", 0)         # shares every page, partial page too
    cache.fork("parent", "longer", 11)      # shares full pages, copies the partial one
    cache.fork("longer", "grandchild", 4)
    return cache


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_forked_sequences_share_pages_and_diverge(dtype):
    rng = np.random.default_rng(7)
    cache = forked_cache(dtype)
    view = cache.page_table(["parent", "same", "longer", "grandchild"])
    pages = [set(view.indices[view.indptr[b]:view.indptr[b + 1]].tolist()) for b in range(4)]
    assert pages[1] == pages[0]
    assert len(pages[0] & pages[2]) == 20 // 3
    assert len(pages[2] & pages[3]) == 31 // 3
    check_decode(cache, ["parent", "same", "longer", "grandchild"], 6, rng)
    check_prefill(forked_cache(dtype), ["parent", "longer", "grandchild"], [20, 3, 35], 6, rng)


def windowed_batch():
    cache = FakeCache(1, 4, 64, 400, 16, np.float16, window=100, sink_tokens=4, seed=10)
    for i, n in enumerate([300, 17, 1000, 64, 5, 450]):
        cache.add_sequence(i, n, hold_from=n - 40 - 100 + 1)
    return cache


def test_results_identical_for_any_thread_count():
    rng = np.random.default_rng(9)
    seq_ids = list(range(6))
    check_decode(windowed_batch(), seq_ids, 8, rng, threads=(1, 2, 3, 7))
    check_prefill(windowed_batch(), seq_ids, [40, 17, 33, 1, 5, 40], 8, rng, threads=(1, 2, 3, 7))


def test_scale_and_float16_queries():
    rng = np.random.default_rng(11)
    cache = FakeCache(1, 2, 16, 32, 16, np.float32, seed=12)
    cache.add_sequence(0, 40)
    check_decode(cache, [0], 4, rng, scale=0.7)
    q16 = rng.standard_normal((1, 4, 16)).astype(np.float16)
    np.testing.assert_array_equal(attention.decode(q16, cache, 0, [0]),
                                  attention.decode(q16.astype(np.float32), cache, 0, [0]))
    # A strided view is accepted and copied, not misread.
    q = rng.standard_normal((1, 4, 32), dtype=np.float32)
    np.testing.assert_array_equal(attention.decode(q[:, :, ::2], cache, 0, [0]),
                                  attention.decode(np.ascontiguousarray(q[:, :, ::2]), cache, 0, [0]))


def test_decode_equals_the_last_row_of_prefill():
    rng = np.random.default_rng(13)
    cache = FakeCache(1, 2, 48, 64, 16, np.float32, window=30, sink_tokens=3, seed=14)
    cache.add_sequence(0, 77, hold_from=77 - 5 - 30 + 1)
    q = random_q(rng, 5, 4, 48)
    full = attention.prefill(q, cache, 0, [0], [0, 5])
    np.testing.assert_allclose(attention.decode(q[4:], cache, 0, [0]), full[4:], rtol=0, atol=1e-6)


def test_empty_batches():
    cache = FakeCache(1, 2, 16, 8, 16, np.float32, seed=15)
    cache.add_sequence(0, 3)
    out, lse = attention.decode(np.zeros((0, 4, 16), np.float32), cache, 0, [], return_lse=True)
    assert out.shape == (0, 4, 16) and lse.shape == (0, 4)
    out = attention.prefill(np.zeros((0, 4, 16), np.float32), cache, 0, [0], [0, 0])
    assert out.shape == (0, 4, 16) and out.dtype == np.float32


# ------------------------------------------------------ non-finite values
#
# The reference masks first (it takes only the admitted keys), then computes
# the softmax in float64: a NaN or +inf score among a row's keys makes the row
# and its LSE NaN (exp(inf - inf)), a -inf score weighs 0, and inf/NaN in V go
# through the weighted sum (0 * NaN is NaN). The kernels must give the same,
# NaN for NaN.

def nonfinite_cache(dtype, mode, window=None, sink_tokens=0, extra=()):
    """Sequences "s" (70 tokens) and "t" (37), queries: the last token or the last 12.

    2 KV heads of 3 query heads each, head_dim 40 (a vector tail on every
    path), pages of 4 tokens. With a window, each sequence holds one page more
    than its queries need, so held slots lie outside every window. ``extra``:
    more (seq_id, length, qo_len) sequences. Slots no query may read are NaN
    already (poison_unread_slots).
    """
    cache = FakeCache(1, 2, 40, 96, 4, dtype, window, sink_tokens, seed=21)
    qo_len = 12 if mode == "prefill" else 1
    specs = [("s", 70, qo_len), ("t", 37, qo_len), *extra]
    for seq_id, n, m in specs:
        hold_from = None if window is None else n - m - window + 1 - cache.page_size
        cache.add_sequence(seq_id, n, hold_from=hold_from)
    poison_unread_slots(cache, {seq_id: range(n - m, n) for seq_id, n, m in specs})
    return cache, [seq_id for seq_id, _, _ in specs], [m for _, _, m in specs]


def set_kv(cache, seq_id, position, half, kv_head, value, dims=slice(None)):
    """Write ``value`` into the K (half 0) or V (half 1) row of a cached position, layer 0."""
    view = cache.page_table([seq_id])
    j = int(np.searchsorted(view.page_positions, position, side="right")) - 1
    offset = position - int(view.page_positions[j])
    assert 0 <= offset < cache.page_size, "position not in a held page"
    cache.kv[0, view.indices[j], half, offset, kv_head, dims] = value


def attend_and_compare(cache, seq_ids, qo_lens, q, threads=(1, 2), sink_logits=None, softcap=None):
    """Decode (every qo_len 1) or prefill, compared NaN for NaN with the reference.

    Returns (out, lse, ref_out, ref_lse) over all query rows.
    """
    qo_indptr = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int64)
    decode = all(m == 1 for m in qo_lens) and len(q) == len(seq_ids)
    options = dict(sink_logits=sink_logits, softcap=softcap)
    if decode:
        results = [attention.decode(q, cache, 0, seq_ids, num_threads=t, return_lse=True, **options)
                   for t in threads]
    else:
        results = [attention.prefill(q, cache, 0, seq_ids, qo_indptr, num_threads=t, return_lse=True,
                                     **options)
                   for t in threads]
    out, lse = results[0]
    for other_out, other_lse in results[1:]:
        np.testing.assert_array_equal(out, other_out)  # NaN where the other has NaN
        np.testing.assert_array_equal(lse, other_lse)
    ref_out, ref_lse = np.empty(out.shape), np.empty(lse.shape)
    scale = 1.0 / np.sqrt(cache.head_dim)
    for b, seq_id in enumerate(seq_ids):
        n = cache.seq_len(seq_id)
        rows = slice(qo_indptr[b], qo_indptr[b + 1])
        with np.errstate(invalid="ignore"):  # inf - inf and 0 * inf are the point here
            ref_out[rows], ref_lse[rows] = reference(cache, 0, seq_id, q[rows],
                                                     list(range(n - qo_lens[b], n)), scale, **options)
    tol = TOLERANCE[cache.kv.dtype.type]
    np.testing.assert_allclose(out, ref_out, rtol=0, atol=tol, equal_nan=True)
    np.testing.assert_allclose(lse, ref_lse, rtol=0, atol=tol, equal_nan=True)
    return out, lse, ref_out, ref_lse


def split_decode_for(mode):
    """Partitions of one page for mode "split decode", the default split rule otherwise."""
    return decode_partition(1) if mode == "split decode" else contextlib.nullcontext()


NONFINITE_CASES = [(isa, dtype, mode) for isa in AVAILABLE_ISAS for dtype in (np.float32, np.float16)
                   for mode in ("decode", "split decode", "prefill")]


@pytest.mark.parametrize("isa, dtype, mode", NONFINITE_CASES)
def test_nan_in_one_query_element_gives_exactly_that_row_nan(isa, dtype, mode):
    cache, seq_ids, qo_lens = nonfinite_cache(dtype, mode)
    rng = np.random.default_rng(22)
    q = random_q(rng, sum(qo_lens), 6, 40)
    row = len(q) - 1 if mode != "prefill" else 5
    q[row, 4, 17] = np.nan
    with kernel_path(isa), split_decode_for(mode):
        out, lse, _, _ = attend_and_compare(cache, seq_ids, qo_lens, q)
    expected = np.zeros(lse.shape, bool)
    expected[row, 4] = True
    np.testing.assert_array_equal(np.isnan(lse), expected)
    np.testing.assert_array_equal(np.isnan(out).any(axis=-1), expected)
    assert np.isnan(out[row, 4]).all()


@pytest.mark.parametrize("isa, dtype, mode", NONFINITE_CASES)
def test_nan_score_among_minus_infinite_scores_gives_nan(isa, dtype, mode):
    # KV head 0 of "s": a NaN score at position 0, -inf at 1..31, so the first
    # chunk (16 or 32 tokens) has no finite score and its lanes put -inf after
    # the NaN, an order in which x86 max returns -inf, not NaN. Later chunks
    # are finite.
    cache, seq_ids, qo_lens = nonfinite_cache(dtype, mode)
    set_kv(cache, "s", 0, 0, 0, np.nan, dims=0)
    for position in range(1, 32):
        set_kv(cache, "s", position, 0, 0, -np.inf)  # q > 0
    rng = np.random.default_rng(28)
    q = np.abs(random_q(rng, sum(qo_lens), 6, 40))
    with kernel_path(isa), split_decode_for(mode):
        out, lse, _, _ = attend_and_compare(cache, seq_ids, qo_lens, q)
    expected = np.zeros(lse.shape, bool)
    expected[:qo_lens[0], :3] = True
    np.testing.assert_array_equal(np.isnan(lse), expected)
    np.testing.assert_array_equal(np.isnan(out).all(axis=-1), expected)
    assert np.isfinite(out[~expected]).all()


@pytest.mark.parametrize("isa, dtype, mode", NONFINITE_CASES)
def test_nan_in_an_admitted_key_gives_its_query_group_nan(isa, dtype, mode):
    cache, seq_ids, qo_lens = nonfinite_cache(dtype, mode)
    set_kv(cache, "s", 62, 0, 1, np.nan, dims=9)  # KV head 1 = query heads 3..5
    rng = np.random.default_rng(23)
    q = random_q(rng, sum(qo_lens), 6, 40)
    with kernel_path(isa), split_decode_for(mode):
        out, lse, _, _ = attend_and_compare(cache, seq_ids, qo_lens, q)
    # Rows of "s" at positions >= 62 (decode: position 69; prefill: 62..69 of
    # queries 58..69), heads 3..5; nothing else.
    expected = np.zeros(lse.shape, bool)
    if mode != "prefill":
        expected[0, 3:6] = True
    else:
        expected[62 - 58:12, 3:6] = True
    np.testing.assert_array_equal(np.isnan(lse), expected)
    np.testing.assert_array_equal(np.isnan(out).all(axis=-1), expected)
    assert np.isfinite(out[~expected]).all()


@pytest.mark.parametrize("isa, dtype, mode", NONFINITE_CASES)
def test_nonfinite_key_and_value_outside_the_mask_are_ignored(isa, dtype, mode):
    # Window 20, 2 sinks. Position 45 of "s" lies in a held page: outside the
    # window of every query in decode (69), inside the window of queries
    # 58..64 only in prefill. Position 66 is admitted by queries >= 66 only
    # (causal), which share work items with earlier queries.
    cache, seq_ids, qo_lens = nonfinite_cache(dtype, mode, window=20, sink_tokens=2)
    for position in (45, 66):
        set_kv(cache, "s", position, 0, 0, np.nan, dims=3)
        set_kv(cache, "s", position, 1, 0, np.nan, dims=5)
        set_kv(cache, "s", position, 1, 1, np.inf, dims=6)
    rng = np.random.default_rng(24)
    q = random_q(rng, sum(qo_lens), 6, 40)
    with kernel_path(isa), split_decode_for(mode):
        out, lse, _, ref_lse = attend_and_compare(cache, seq_ids, qo_lens, q)
    if mode != "prefill":
        assert np.isnan(lse[0, :3]).all() and np.isfinite(lse[:, 3:]).all()  # 66 is admitted by 69
    else:
        positions = np.arange(58, 70)
        admits = ((positions - 20 + 1 <= 45) & (positions >= 45)) | (positions >= 66)
        np.testing.assert_array_equal(np.isnan(ref_lse[:12, 0]), admits)
        assert not admits.all() and admits.any()
        assert np.isfinite(out[12:]).all()


@pytest.mark.parametrize("isa, dtype, mode", NONFINITE_CASES)
def test_positive_infinite_score_gives_nan(isa, dtype, mode):
    cache, seq_ids, qo_lens = nonfinite_cache(dtype, mode)
    set_kv(cache, "t", 30, 0, 0, np.inf, dims=11)  # q > 0: score +inf for heads 0..2
    rng = np.random.default_rng(25)
    q = np.abs(random_q(rng, sum(qo_lens), 6, 40))
    with kernel_path(isa), split_decode_for(mode):
        out, lse, _, _ = attend_and_compare(cache, seq_ids, qo_lens, q)
    # Rows of "t" at positions >= 30 (decode: 36; prefill: 30..36 of queries 25..36).
    nan_rows = slice(1, 2) if mode != "prefill" else slice(12 + 30 - 25, 24)
    assert np.isnan(lse[nan_rows, :3]).all() and np.isnan(out[nan_rows, :3]).all()
    assert np.isfinite(lse[nan_rows, 3:]).all() and np.isfinite(out[nan_rows, 3:]).all()
    assert np.isfinite(out[:nan_rows.start]).all()


@pytest.mark.parametrize("isa, dtype, mode", NONFINITE_CASES)
def test_negative_infinite_scores_weigh_zero(isa, dtype, mode):
    # "u": decode: one token, the only key of its query; prefill: 3 tokens, all
    # queries, the first of which sees only its own key.
    u = ("u", 1, 1) if mode != "prefill" else ("u", 3, 3)
    cache, seq_ids, qo_lens = nonfinite_cache(dtype, mode, extra=[u])
    set_kv(cache, "u", 0, 0, 0, -np.inf)  # q > 0: score -inf for heads 0..2
    set_kv(cache, "s", 65, 0, 0, -np.inf)  # one -inf key among finite ones: weight 0
    set_kv(cache, "s", 66, 0, 1, -np.inf)
    set_kv(cache, "s", 66, 1, 1, np.nan, dims=2)  # weight 0 times NaN is NaN
    for position in range(32):  # a first chunk of -inf scores only, then finite ones
        set_kv(cache, "s", position, 0, 0, -np.inf)
    rng = np.random.default_rng(26)
    q = np.abs(random_q(rng, sum(qo_lens), 6, 40))
    with kernel_path(isa), split_decode_for(mode):
        out, lse, ref_out, _ = attend_and_compare(cache, seq_ids, qo_lens, q)
    s_last = 0 if mode != "prefill" else 11
    u_first = len(q) - qo_lens[-1]
    assert np.isfinite(out[:s_last + 1, :3]).all()
    assert np.isnan(out[s_last, 3:, 2]).all() and np.isfinite(np.delete(out[s_last, 3:], 2, axis=-1)).all()
    # All admitted scores -inf: dense softmax is 0/0.
    assert np.isnan(out[u_first, :3]).all() and np.isnan(lse[u_first, :3]).all()
    assert np.isfinite(out[u_first + 1:]).all() and np.isfinite(out[u_first, 3:]).all()


@pytest.mark.parametrize("isa, dtype, mode", NONFINITE_CASES)
def test_nonfinite_values_of_admitted_tokens_reach_the_output(isa, dtype, mode):
    cache, seq_ids, qo_lens = nonfinite_cache(dtype, mode)
    set_kv(cache, "s", 63, 1, 1, np.nan, dims=7)
    set_kv(cache, "s", 68, 1, 0, np.inf, dims=1)
    set_kv(cache, "t", 36, 1, 0, -np.inf, dims=39)  # the last element: the scalar tail
    rng = np.random.default_rng(27)
    q = random_q(rng, sum(qo_lens), 6, 40)
    with kernel_path(isa), split_decode_for(mode):
        out, lse, _, _ = attend_and_compare(cache, seq_ids, qo_lens, q)
    assert np.isfinite(lse).all()
    s_last, t_last = (0, 1) if mode != "prefill" else (11, 23)
    assert np.isnan(out[s_last, 3:, 7]).all()
    assert np.isposinf(out[s_last, :3, 1]).all()
    assert np.isneginf(out[t_last, :3, 39]).all()
    if mode == "prefill":  # earlier queries of the same work items do not see them
        assert np.isfinite(out[:63 - 58]).all()
        assert np.isfinite(out[12:23]).all()


def test_split_decode_partition_whose_scores_are_all_minus_infinite_passes_nonfinite_values():
    # KV head 0 of "s": the keys of the first two pages score -inf (weight 0)
    # and position 3 has an inf V element: 0 * inf is NaN in that column of
    # query heads 0..2, as dense attention gives, while the partitions of one
    # page hold a sum of -0.0 (admitted keys, no finite score) there.
    for mode in ("decode", "split decode"):
        cache, seq_ids, qo_lens = nonfinite_cache(np.float32, "decode")
        for position in range(8):
            set_kv(cache, "s", position, 0, 0, -np.inf)
        set_kv(cache, "s", 3, 1, 0, np.inf, dims=5)
        q = np.abs(random_q(np.random.default_rng(29), 2, 6, 40))
        with split_decode_for(mode):
            out, lse, _, _ = attend_and_compare(cache, seq_ids, qo_lens, q, threads=(1, 2, 3))
        assert np.isnan(out[0, :3, 5]).all()
        assert np.isfinite(np.delete(out[0, :3], 5, axis=-1)).all() and np.isfinite(lse).all()
        assert np.isfinite(out[0, 3:]).all() and np.isfinite(out[1]).all()


# ------------------------------------------------------------- hypothesis

@st.composite
def problems(draw, prefill):
    ps = draw(st.sampled_from([1, 3, 16]))
    num_kv_heads = draw(st.integers(1, 3))
    group = draw(st.sampled_from([1, 2, 3, 4, 8]))
    dim = draw(st.sampled_from([1, 4, 8, 16, 24, 40, 64]))
    dtype = draw(st.sampled_from([np.float32, np.float16]))
    window = draw(st.one_of(st.none(), st.integers(1, 40)))
    sinks = draw(st.integers(0, 12))
    isa = draw(st.sampled_from(AVAILABLE_ISAS))
    length = st.one_of(st.integers(1, 90), st.integers(1, 6).map(lambda k: k * ps))
    num_roots = draw(st.integers(1, 4))
    specs = [("root", draw(length), None) for _ in range(num_roots)]
    for _ in range(draw(st.integers(0, 3))):
        parent = draw(st.integers(0, len(specs) - 1))
        specs.append(("fork", draw(st.integers(0, 40)), parent))
    seed = draw(st.integers(0, 2**16))
    return ps, num_kv_heads, group, dim, dtype, window, sinks, isa, specs, seed, prefill, draw


def build(problem):
    ps, num_kv_heads, group, dim, dtype, window, sinks, isa, specs, seed, prefill, draw = problem
    cache = FakeCache(2, num_kv_heads, dim, 400, ps, dtype, window, sinks, seed=seed)
    lengths, qo_lens = [], []
    for i, (kind, tokens, parent) in enumerate(specs):
        n = tokens if kind == "root" else lengths[parent] + tokens
        m = draw(st.integers(0, n)) if prefill else 1
        # Hold what the queries need, plus up to 2 pages of not-yet-released slack.
        slack = draw(st.integers(0, 2)) * ps
        hold_from = None if window is None else n - m - window + 1 - slack
        if kind == "root":
            cache.add_sequence(i, n, hold_from=hold_from)
        else:
            cache.fork(parent, i, tokens, hold_from=hold_from)
        lengths.append(n)
        qo_lens.append(m)
    return cache, num_kv_heads * group, isa, seed, qo_lens


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems(prefill=False))
def test_decode_hypothesis(problem):
    cache, num_qo_heads, isa, seed, _ = build(problem)
    with kernel_path(isa):
        check_decode(cache, list(range(len(problem[8]))), num_qo_heads, np.random.default_rng(seed),
                     layer=seed % 2)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems(prefill=False), st.sampled_from([1, 2, 3, 7, 16, 40]))
def test_split_decode_hypothesis(problem, partition_tokens):
    cache, num_qo_heads, isa, seed, _ = build(problem)
    with kernel_path(isa), decode_partition(partition_tokens):
        check_decode(cache, list(range(len(problem[8]))), num_qo_heads, np.random.default_rng(seed),
                     layer=seed % 2, threads=(1, 2, 3))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems(prefill=True))
def test_prefill_hypothesis(problem):
    cache, num_qo_heads, isa, seed, qo_lens = build(problem)
    with kernel_path(isa):
        check_prefill(cache, list(range(len(problem[8]))), qo_lens, num_qo_heads,
                      np.random.default_rng(seed), layer=seed % 2)


# ------------------------------------------------------------- bad input

class EditedTableCache(FakeCache):
    """Returns its page tables passed through ``edit(cache, view, seq_ids) -> view``:
    a cache that breaks the page_table contract in one chosen way."""

    def __init__(self, *args, edit, **kw):
        super().__init__(*args, **kw)
        self.edit = edit

    def page_table(self, seq_ids):
        return self.edit(self, super().page_table(seq_ids), seq_ids)


def page_beyond_pool(cache, view, seq_ids):
    """The last page id of the table moved one past the end of the pool."""
    indices = view.indices.copy()
    indices[-1] = cache.kv.shape[1]
    return dataclasses.replace(view, indices=indices)


def make_cache(**kw):
    args = dict(num_layers=2, num_kv_heads=2, head_dim=8, num_pages=16, page_size=4,
                dtype=np.float32, window=None, sink_tokens=0, seed=16)
    args.update(kw)
    cls = args.pop("cls", FakeCache)
    cache = cls(**args)
    cache.add_sequence("a", 9)
    cache.add_sequence("b", 5)
    cache.add_sequence("empty", 0)
    return cache


GOOD_Q = np.zeros((2, 4, 8), np.float32)

DECODE_BAD = [
    (dict(q=[[0.0]]), ValueError, "shape of q"),
    (dict(q=GOOD_Q.astype(bool)), TypeError, "dtype of q"),
    (dict(q=GOOD_Q.astype(np.complex64)), TypeError, "dtype of q"),
    (dict(q=None), TypeError, "type of q"),
    (dict(q=GOOD_Q[0]), ValueError, "shape of q"),
    (dict(q=np.zeros((3, 4, 8), np.float32)), ValueError, "shape of q"),
    (dict(q=np.zeros((2, 4, 9), np.float32)), ValueError, "shape of q"),
    (dict(q=np.zeros((2, 3, 8), np.float32)), ValueError, "multiple of num_kv_heads"),
    (dict(q=np.zeros((2, 0, 8), np.float32)), ValueError, "multiple of num_kv_heads"),
    (dict(layer=2), IndexError, r"Invalid value of layer: expected 0 <= layer < 2, got 2"),
    (dict(layer=-1), IndexError, r"Invalid value of layer: expected 0 <= layer < 2, got -1"),
    (dict(layer=np.int64(5)), IndexError, r"expected 0 <= layer < 2, got 5"),
    (dict(layer=True), TypeError, "type of layer"),
    (dict(layer=1.0), TypeError, "layer"),
    (dict(seq_ids=["a", "empty"]), ValueError, "'empty' has no cached token"),
    (dict(seq_ids=["a", "zzz"]), KeyError, "zzz"),
    (dict(scale=float("nan")), ValueError, "scale"),
    (dict(scale=1e39), ValueError, "scale"),  # finite in float64, inf in float32
    (dict(scale="1"), TypeError, "scale"),
    (dict(num_threads=0), ValueError, "num_threads"),
    (dict(num_threads=2.0), TypeError, "num_threads"),
    (dict(return_lse=1), TypeError, "return_lse"),
]


@pytest.mark.parametrize("change, exc, match", DECODE_BAD)
def test_decode_bad_input(change, exc, match):
    cache = make_cache()
    kv_before = cache.kv.copy()
    args = dict(q=GOOD_Q, cache=cache, layer=0, seq_ids=["a", "b"])
    args.update(change)
    with pytest.raises(exc, match=match):
        attention.decode(**args)
    np.testing.assert_array_equal(cache.kv, kv_before)


def test_bad_caches():
    with pytest.raises(ValueError, match="head_dim"):
        attention.decode(np.zeros((2, 2, 257), np.float32), make_cache(head_dim=257), 0, ["a", "b"])
    with pytest.raises(ValueError, match="indices"):
        attention.decode(GOOD_Q, make_cache(cls=EditedTableCache, edit=page_beyond_pool), 0, ["a", "b"])
    cache = make_cache()
    cache.kv = np.asfortranarray(cache.kv)
    with pytest.raises(ValueError, match="layout of cache.kv"):
        attention.decode(GOOD_Q, cache, 0, ["a", "b"])
    cache = make_cache()
    cache.kv = cache.kv.astype(np.float64)
    with pytest.raises(TypeError, match="dtype of cache.kv"):
        attention.decode(GOOD_Q, cache, 0, ["a", "b"])


PREFILL_BAD = [
    (dict(qo_indptr=[1, 3, 5]), ValueError, r"qo_indptr\[0\] == 0"),
    (dict(qo_indptr=[0, 5, 4]), ValueError, "non-decreasing"),
    (dict(qo_indptr=[0, 2, 4]), ValueError, r"qo_indptr\[-1\] == q.shape\[0\] == 5"),
    (dict(qo_indptr=[0, 5]), ValueError, r"shape of qo_indptr: expected \(3,\)"),
    (dict(qo_indptr=[0.0, 2.0, 5.0]), TypeError, "qo_indptr"),
    (dict(q=np.zeros((7, 4, 8), np.float32), qo_indptr=[0, 1, 7]), ValueError,
     "at most seq_len=5 new tokens for sequence 'b', got 6"),
    (dict(seq_ids=["a", "empty"], qo_indptr=[0, 5, 5]), None, None),  # empty chunk: fine
    (dict(seq_ids=["empty", "a"], q=np.zeros((1, 4, 8), np.float32), qo_indptr=[0, 1, 1]),
     ValueError, "at most seq_len=0"),
]


@pytest.mark.parametrize("change, exc, match", PREFILL_BAD)
def test_prefill_bad_input(change, exc, match):
    cache = make_cache()
    args = dict(q=np.zeros((5, 4, 8), np.float32), cache=cache, layer=0, seq_ids=["a", "b"],
                qo_indptr=[0, 2, 5])
    args.update(change)
    if exc is None:
        attention.prefill(**args)
        return
    with pytest.raises(exc, match=match):
        attention.prefill(**args)


def test_prefill_rejects_queries_whose_tokens_were_released():
    cache = FakeCache(1, 1, 8, 16, 4, np.float32, window=3, seed=17)
    cache.add_sequence("s", 20)  # holds only what a decode query needs: positions >= 16
    q = np.zeros((6, 1, 8), np.float32)
    with pytest.raises(ValueError, match="does not hold all of its 6 new tokens"):
        attention.prefill(q, cache, 0, ["s"], [0, 6])
    # 3 queries at 17..19 are held, but the one at 17 attends to 15, which is not
    with pytest.raises(ValueError, match=r"qo_indptr: sequence 's' does not hold every key .*15\.\.19"):
        attention.prefill(q[:3], cache, 0, ["s"], [0, 3])
    attention.prefill(q[:2], cache, 0, ["s"], [0, 2])


def test_decode_rejects_a_page_table_that_lacks_keys_of_the_window():
    cache = FakeCache(1, 1, 8, 32, 1, np.float32, window=4, sink_tokens=2, seed=19)
    cache.add_sequence("short", 20, hold_from=18)  # the query at 19 attends to 16..19
    cache.add_sequence("ok", 20, hold_from=16)
    q = np.zeros((1, 1, 8), np.float32)
    with pytest.raises(ValueError, match=r"seq_ids: sequence 'short' does not hold every key .*16\.\.19 "
                                         r"and the sink positions 0\.\.1"):
        attention.decode(q, cache, 0, ["short"])
    want, _ = reference(cache, 0, "ok", q, [19], 1 / np.sqrt(8))
    assert_close(attention.decode(q, cache, 0, ["ok"]), want, np.float32)


def reordered(reorder):
    """An edit that passes each sequence's page-table entries through ``reorder``."""

    def edit(cache, view, seq_ids):
        indices, positions = view.indices.copy(), view.page_positions.copy()
        for b in range(len(seq_ids)):
            j0, j1 = int(view.indptr[b]), int(view.indptr[b + 1])
            order = reorder(np.arange(j0, j1))
            indices[j0:j1], positions[j0:j1] = view.indices[order], view.page_positions[order]
        return dataclasses.replace(view, indices=indices, page_positions=positions)

    return edit


@pytest.mark.parametrize("reorder, match", [
    # every position still counted once, but out of order: the kernels would skip keys
    (lambda js: js[::-1], r"page_positions: expected the pages of each sequence in position "
                          r"order.* sequence 'a' lists a page at position 4 after one at 8"),
    # one page listed twice, the other missing: as many positions, not the same ones
    (lambda js: np.concatenate((js[:1], js[:1], js[2:])),
     r"page_positions: .* sequence 'a' lists a page at position 0 after one at 0"),
])
def test_decode_rejects_page_tables_out_of_position_order(reorder, match):
    cache = make_cache(cls=EditedTableCache, edit=reordered(reorder))
    with pytest.raises(ValueError, match=match):
        attention.decode(GOOD_Q, cache, 0, ["a", "b"])
    with pytest.raises(ValueError, match=match):
        attention.prefill(GOOD_Q, cache, 0, ["a", "b"], [0, 1, 2])
    ordered = make_cache(cls=EditedTableCache, edit=reordered(lambda js: js))
    want, _ = reference(ordered, 0, "a", GOOD_Q[:1], [8], 1 / np.sqrt(8))
    assert_close(attention.decode(GOOD_Q, ordered, 0, ["a", "b"])[:1], want, np.float32)


def test_decode_rejects_negative_page_positions():
    def shifted(cache, view, seq_ids):
        return dataclasses.replace(view, page_positions=view.page_positions - 4,
                                   seq_lens=view.seq_lens - 4)

    cache = make_cache(cls=EditedTableCache, edit=shifted)
    with pytest.raises(ValueError, match=r"page_positions: expected positions in \[0, 2\*\*62\], got -4"):
        attention.decode(GOOD_Q, cache, 0, ["a", "b"])


def test_prefill_over_tokens_of_an_earlier_append_raises_once_the_window_released_their_keys():
    """Queries whose window reaches into pages a later append released would
    silently lose keys from the softmax: the call must refuse instead."""
    window, dim = 4, 8
    cache = KVCache(num_layers=1, num_kv_heads=1, head_dim=dim, num_pages=32, page_size=1,
                    dtype=np.float32, window=window)
    rng = np.random.default_rng(0)
    keys = rng.standard_normal((9, 1, dim), dtype=np.float32)
    values = rng.standard_normal((9, 1, dim), dtype=np.float32)
    cache.add_sequence(0)
    cache.store(0, cache.append([0], [8]), keys[:8], values[:8])
    q = rng.standard_normal((3, 1, dim), dtype=np.float32)
    before = attention.prefill(q, cache, 0, [0], [0, 3])  # positions 5..7, all keys held
    want, _ = reference(cache, 0, 0, q, [5, 6, 7], 1 / np.sqrt(dim))
    assert_close(before, want, np.float32)
    cache.store(0, cache.append([0], [1]), keys[8:], values[8:])  # releases positions 0..4
    assert cache.gather(0, 0)[2].tolist() == [5, 6, 7, 8]
    with pytest.raises(ValueError, match=r"qo_indptr: sequence 0 does not hold every key .*3\.\.8"):
        attention.prefill(q, cache, 0, [0], [0, 3])  # positions 6..8: 6 needs 3 and 4
    out = attention.prefill(q[2:], cache, 0, [0], [0, 1])  # position 8 needs 5..8: held
    want, _ = reference(cache, 0, 0, q[2:], [8], 1 / np.sqrt(dim))
    assert_close(out, want, np.float32)


SINK_CACHE = dict(window=3, sink_tokens=1)
Q_SINK_BAD = [
    (dict(q_sink=[[0.0]]), dict(SINK_CACHE), ValueError, r"shape of q_sink: expected .*\(2, 4, 8\), got \(1, 1\)"),
    (dict(q_sink=GOOD_Q.astype(np.complex64)), dict(SINK_CACHE), TypeError, "dtype of q_sink"),
    (dict(q_sink=GOOD_Q[:1]), dict(SINK_CACHE), ValueError, r"shape of q_sink: expected .*\(2, 4, 8\)"),
    (dict(q_sink=GOOD_Q), dict(window=3, sink_tokens=0), ValueError,
     "q_sink: expected None for a cache without attention sinks"),
    (dict(q_sink=GOOD_Q), dict(), ValueError, "q_sink: expected None for a cache without attention sinks"),
]


@pytest.mark.parametrize("change, cache_args, exc, match", Q_SINK_BAD)
@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_q_sink_bad_input(change, cache_args, exc, match, kind):
    cache = make_cache(**cache_args)
    kv_before = cache.kv.copy()
    args = dict(q=GOOD_Q, cache=cache, layer=0, seq_ids=["a", "b"])
    args.update(change)
    with pytest.raises(exc, match=match):
        if kind == "decode":
            attention.decode(**args)
        else:
            attention.prefill(qo_indptr=[0, 1, 2], **args)
    np.testing.assert_array_equal(cache.kv, kv_before)


# ------------------------------------ chunked attention, sink logits, softcap
#
# Chunked attention (Llama 4: the query at p sees the keys of its own chunk,
# floor(p / C) * C <= k <= p), sink logits (gpt-oss: exp(logit_h) joins the
# softmax denominator of query head h, no value row) and the softcap (Gemma 2:
# scores become c * tanh(s / c)), against the dense reference above.

HYBRID_SHAPES = [
    # (num_kv_heads, group, head_dim, page_size, window, sinks, chunk_size)
    (2, 4, 128, 16, None, 0, None),  # GQA, full attention
    (1, 8, 64, 16, 40, 4, None),     # MQA, window + sinks
    (4, 1, 32, 3, 7, 2, None),       # window not a multiple of the page size
    (2, 3, 80, 16, None, 0, 5),      # chunks smaller than a page
    (1, 4, 40, 4, None, 0, 10),      # chunks larger than a page, not a multiple of it
    (3, 2, 100, 16, None, 0, 32),    # chunks of two pages, head dim with a vector tail
    (1, 2, 24, 3, None, 0, 7),       # page size 3, chunks of 7
    (2, 2, 16, 1, None, 0, 1),       # chunks of 1: each query sees only its own key
]
CHUNK_SHAPES = [shape for shape in HYBRID_SHAPES if shape[6] is not None]
SCORE_OPTIONS = ["none", "sink_logits", "softcap", "both"]


def score_options(option, num_qo_heads, rng):
    """(sink_logits, softcap, scale factor) of an option name.

    Sink logits around the scores' range (one head without a sink, -inf, when
    there are several) and a softcap that scores of 3 / sqrt(D) * q.k (about
    N(0, 9)) reach well into tanh's bend.
    """
    sink_logits = softcap = None
    if option in ("sink_logits", "both"):
        sink_logits = rng.normal(1.0, 2.0, num_qo_heads).astype(np.float32)
        if num_qo_heads > 1:
            sink_logits[num_qo_heads // 2] = -np.inf
    if option in ("softcap", "both"):
        softcap = 2.5
    return sink_logits, softcap, (3.0 if softcap is not None else 1.0)


def hybrid_cases(shapes):
    return [(shape, option) for shape in shapes for option in SCORE_OPTIONS
            if option != "none" or shape[6] is not None]


def held_from(window, chunk, first, slack):
    """First position a sequence must hold for queries from ``first`` on, minus ``slack``."""
    if window is not None:
        return first - window + 1 - slack
    if chunk is not None:
        return first - first % chunk - slack
    return None


@pytest.mark.parametrize("isa", AVAILABLE_ISAS)
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("shape, option", hybrid_cases(HYBRID_SHAPES))
@pytest.mark.parametrize("split", [False, True])
def test_decode_with_chunks_sink_logits_and_softcap_matches_reference(isa, dtype, shape, option, split):
    num_kv_heads, group, dim, ps, window, sinks, chunk = shape
    rng = np.random.default_rng(61)
    cache = FakeCache(2, num_kv_heads, dim, 200, ps, dtype, window, sinks, seed=62, chunk_size=chunk)
    lengths = [1, ps, 3 * ps, 2 * ps + 1, 70, 129]
    if chunk is not None:
        lengths += [chunk, chunk + 1, 2 * chunk - 1, 3 * chunk]
    for i, n in enumerate(lengths):
        # up to 2 pages more than the last query needs, as a cache that keeps C or W tokens
        cache.add_sequence(i, n, hold_from=held_from(window, chunk, n - 1, (i % 3) * ps))
    sink_logits, softcap, scale = score_options(option, num_kv_heads * group, rng)
    with kernel_path(isa), decode_partition(1 if split else 0):
        check_decode(cache, list(range(len(lengths))), num_kv_heads * group, rng, layer=1,
                     scale=scale / np.sqrt(dim), threads=(1, 2, 3), sink_queries=sinks > 0 and option == "both",
                     sink_logits=sink_logits, softcap=softcap)


@pytest.mark.parametrize("isa", AVAILABLE_ISAS)
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("shape, option", hybrid_cases(HYBRID_SHAPES))
def test_prefill_with_chunks_sink_logits_and_softcap_matches_reference(isa, dtype, shape, option):
    num_kv_heads, group, dim, ps, window, sinks, chunk = shape
    rng = np.random.default_rng(63)
    cache = FakeCache(1, num_kv_heads, dim, 300, ps, dtype, window, sinks, seed=64, chunk_size=chunk)
    # whole prompts, an empty chunk, chunks after context that cross chunk boundaries
    span = chunk or window or 10
    lengths = [1, 2 * ps, 50, 70, 33, 3 * span + 5]
    qo_lens = [1, 2 * ps, 50, 0, 9, 2 * span + 3]
    for i, (n, m) in enumerate(zip(lengths, qo_lens)):
        cache.add_sequence(i, n, hold_from=held_from(window, chunk, n - m, (i % 2) * ps))
    sink_logits, softcap, scale = score_options(option, num_kv_heads * group, rng)
    with kernel_path(isa):
        check_prefill(cache, list(range(len(lengths))), qo_lens, num_kv_heads * group, rng,
                      scale=scale / np.sqrt(dim), sink_queries=sinks > 0 and option == "both",
                      sink_logits=sink_logits, softcap=softcap)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_long_sequence_split_by_default_with_sink_logits_and_softcap(dtype):
    rng = np.random.default_rng(65)
    cache = FakeCache(1, 3, 64, 200, 16, dtype, seed=66)
    cache.add_sequence("long", 2950)  # split by the default rule (see above)
    cache.add_sequence("short", 30)
    sink_logits = np.array([0.5, 3.0, -np.inf, 8.0, -2.0, 1.0, 0.0, 4.0, -1.0], np.float32)
    options = dict(scale=0.4, sink_logits=sink_logits, softcap=3.0)
    split = check_decode(cache, ["short", "long"], 9, rng, threads=(1, 2, 3, 4), **options)
    with decode_partition(0):
        whole = check_decode(cache, ["short", "long"], 9, np.random.default_rng(65), threads=(1, 2), **options)
    np.testing.assert_array_equal(split[0], whole[0])
    assert not np.array_equal(split[1], whole[1])  # the merge rounds differently


def test_chunks_sink_logits_and_softcap_identical_for_any_thread_count():
    rng = np.random.default_rng(67)
    cache = FakeCache(1, 4, 64, 400, 16, np.float16, seed=68, chunk_size=90)
    qo_lens = [40, 17, 33, 1, 5, 40]
    for i, n in enumerate([300, 17, 1000, 64, 5, 450]):
        cache.add_sequence(i, n, hold_from=held_from(None, 90, n - qo_lens[i], 16))
    options = dict(sink_logits=rng.normal(size=8).astype(np.float32), softcap=1.5)
    check_prefill(cache, list(range(6)), qo_lens, 8, rng, threads=(1, 2, 3, 7), **options)
    check_decode(cache, list(range(6)), 8, rng, threads=(1, 2, 3, 7), **options)
    with decode_partition(40):
        check_decode(cache, list(range(6)), 8, rng, threads=(1, 2, 3, 7), **options)


@pytest.mark.parametrize("isa", AVAILABLE_ISAS)
def test_vector_tanh_matches_numpy(isa):
    # Both branches (polynomial below |x| = 0.55, exp above) and their seam,
    # subnormals, the float32 extremes, signed zeros, infinities and NaN.
    x = np.concatenate([
        np.linspace(-20, 20, 200_001), np.linspace(0.5, 0.6, 10_001),
        np.geomspace(1e-45, 3.4e38, 20_000), -np.geomspace(1e-45, 3.4e38, 20_000),
        [0.0, -0.0, np.inf, -np.inf, np.nan, np.finfo(np.float32).max, np.finfo(np.float32).tiny],
    ]).astype(np.float32)
    with kernel_path(isa):
        got = _attention._tanh(x)
    want = np.tanh(x.astype(np.float64))
    finite = ~np.isnan(want)
    rel = np.abs(got[finite] - want[finite]) / np.maximum(np.abs(want[finite]), np.finfo(np.float64).tiny)
    assert rel.max() <= 5e-7, f"relative error {rel.max():.3g} at x={x[finite][np.argmax(rel)]!r}"
    np.testing.assert_array_equal(np.signbit(got), np.signbit(x))
    assert np.isnan(got[~finite]).all()
    assert (np.abs(got) <= 1).all() or np.isnan(got).any()


def test_minus_infinite_sink_logits_give_the_plain_result():
    rng = np.random.default_rng(69)
    cache = windowed_batch()
    q = random_q(rng, 6, 8, 64)
    no_sinks = np.full(8, -np.inf, np.float32)
    for split in (0, 1):
        with decode_partition(split):
            plain = attention.decode(q, cache, 0, list(range(6)), return_lse=True)
            got = attention.decode(q, cache, 0, list(range(6)), return_lse=True, sink_logits=no_sinks)
        np.testing.assert_array_equal(got[0], plain[0])
        np.testing.assert_array_equal(got[1], plain[1])
    qp = random_q(rng, 10, 8, 64)
    np.testing.assert_array_equal(
        attention.prefill(qp, cache, 0, [0, 1], [0, 5, 10], sink_logits=no_sinks),
        attention.prefill(qp, cache, 0, [0, 1], [0, 5, 10]))


def test_sink_logits_shrink_the_weights_and_lse_includes_them():
    # One key per query head: out = v * e^s / (e^s + e^sink), lse = log(e^s + e^sink).
    cache = FakeCache(1, 1, 8, 4, 4, np.float32, seed=70)
    cache.add_sequence(0, 1)
    q = np.zeros((1, 2, 8), np.float32)  # score 0 for both heads
    logits = np.array([0.0, np.log(3.0)], np.float32)
    out, lse = attention.decode(q, cache, 0, [0], return_lse=True, sink_logits=logits)
    _, v, _ = cache.gather(0, 0)
    np.testing.assert_allclose(out[0, 0], v[0, 0] / 2, rtol=1e-6)
    np.testing.assert_allclose(out[0, 1], v[0, 0] / 4, rtol=1e-6)
    np.testing.assert_allclose(lse[0], [np.log(2.0), np.log(4.0)], rtol=1e-6)


def test_chunk_of_one_reads_only_the_query_token():
    cache = FakeCache(1, 1, 8, 16, 4, np.float32, seed=71, chunk_size=1)
    cache.add_sequence(0, 10, hold_from=7)
    _, v, positions = cache.gather(0, 0)
    q = np.random.default_rng(72).standard_normal((3, 2, 8), dtype=np.float32)
    np.testing.assert_allclose(attention.prefill(q, cache, 0, [0], [0, 3]),
                               np.repeat(v[positions >= 7], 2, axis=1), rtol=1e-6)


# Non-finite values with the new options: a sink term keeps a row whose
# admitted keys all score -inf finite (its keys weigh 0, the sink takes all
# the weight); a softcap maps +-inf scores to +-softcap, so only NaN scores
# make a row NaN; NaN stays NaN.

@pytest.mark.parametrize("isa, dtype, mode", NONFINITE_CASES)
def test_sink_logits_give_rows_of_minus_infinite_scores_zero_weight(isa, dtype, mode):
    u = ("u", 1, 1) if mode != "prefill" else ("u", 3, 3)
    cache, seq_ids, qo_lens = nonfinite_cache(dtype, mode, extra=[u])
    set_kv(cache, "u", 0, 0, 0, -np.inf)  # q > 0: score -inf for heads 0..2
    for position in range(32):  # "s": a first chunk of -inf scores only
        set_kv(cache, "s", position, 0, 0, -np.inf)
    set_kv(cache, "s", 66, 1, 1, np.nan, dims=2)
    rng = np.random.default_rng(73)
    q = np.abs(random_q(rng, sum(qo_lens), 6, 40))
    logits = np.array([0.5, -1.0, 2.0, -np.inf, 1.0, 0.0], np.float32)
    with kernel_path(isa), split_decode_for(mode):
        out, lse, _, _ = attend_and_compare(cache, seq_ids, qo_lens, q, sink_logits=logits)
    u_first = len(q) - qo_lens[-1]
    np.testing.assert_array_equal(out[u_first, :3], 0.0)  # the sink takes all the weight
    np.testing.assert_allclose(lse[u_first, :3], logits[:3], rtol=1e-6)
    s_last = 0 if mode != "prefill" else 11
    assert np.isnan(out[s_last, 3:, 2]).all()  # weight > 0 times NaN in V
    assert np.isfinite(lse).all()


@pytest.mark.parametrize("isa, dtype, mode", NONFINITE_CASES)
def test_softcap_turns_infinite_scores_finite_and_keeps_nan(isa, dtype, mode):
    cache, seq_ids, qo_lens = nonfinite_cache(dtype, mode)
    set_kv(cache, "t", 30, 0, 0, np.inf, dims=11)  # q > 0: score +inf for heads 0..2: softcap
    set_kv(cache, "t", 31, 0, 1, -np.inf, dims=11)  # -inf for heads 3..5: -softcap
    set_kv(cache, "s", 62, 0, 1, np.nan, dims=9)  # a NaN score stays NaN
    rng = np.random.default_rng(74)
    q = np.abs(random_q(rng, sum(qo_lens), 6, 40))
    with kernel_path(isa), split_decode_for(mode):
        out, lse, _, _ = attend_and_compare(cache, seq_ids, qo_lens, q, softcap=0.75,
                                            sink_logits=np.zeros(6, np.float32))
    t_rows = slice(1, 2) if mode != "prefill" else slice(12, 24)
    assert np.isfinite(out[t_rows]).all() and np.isfinite(lse[t_rows]).all()
    s_last = 0 if mode != "prefill" else 11
    assert np.isnan(out[s_last, 3:]).all() and np.isnan(lse[s_last, 3:]).all()
    assert np.isfinite(out[s_last, :3]).all()


# The cache contract of per-layer settings: a cache with layer_attention_view
# answers for one layer (its pool, page table, window, sinks, chunks); the
# kernels must take all of it from there and nothing from cache.kv.

class TwoGroupCache:
    """Layer 0 full attention, layer 1 chunked, each in a pool of its own (no ``kv``)."""

    def __init__(self, dtype, chunk_size):
        self.full = FakeCache(1, 2, 32, 64, 4, dtype, seed=75)
        self.chunked = FakeCache(1, 2, 32, 64, 4, dtype, seed=76, chunk_size=chunk_size)
        self.num_layers, self.num_kv_heads, self.head_dim, self.page_size = 2, 2, 32, 4
        self.calls = []

    def add_sequence(self, seq_id, n, first_query):
        self.full.add_sequence(seq_id, n)
        c = self.chunked.chunk_size
        self.chunked.add_sequence(seq_id, n, hold_from=first_query - first_query % c)

    def layer_attention_view(self, layer, seq_ids):
        self.calls.append(layer)
        group = (self.full, self.chunked)[layer]  # IndexError past the last layer
        return (group.kv[0], group.page_table(seq_ids), group.window, group.sink_tokens,
                group.chunk_size)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_layer_attention_view_supplies_pool_table_and_chunks(dtype):
    rng = np.random.default_rng(77)
    cache = TwoGroupCache(dtype, chunk_size=6)
    lengths, qo_lens = [30, 13, 1], [9, 13, 1]
    for i, (n, m) in enumerate(zip(lengths, qo_lens)):
        cache.add_sequence(i, n, n - m)
    seq_ids = [0, 1, 2]
    qo_indptr = np.concatenate([[0], np.cumsum(qo_lens)])
    q = random_q(rng, int(qo_indptr[-1]), 4, 32)
    logits = np.array([0.0, 1.0, -np.inf, 2.0], np.float32)
    for layer, group in enumerate((cache.full, cache.chunked)):
        queries = {s: range(n - m, n) for s, n, m in zip(seq_ids, lengths, qo_lens)}
        poison_unread_slots(group, queries)
        out = attention.prefill(q, cache, layer, seq_ids, qo_indptr, sink_logits=logits, softcap=4.0)
        dec = attention.decode(q[qo_indptr[1:] - 1], cache, layer, seq_ids, sink_logits=logits)
        for b, (n, m) in enumerate(zip(lengths, qo_lens)):
            rows = slice(qo_indptr[b], qo_indptr[b + 1])
            want, _ = reference(group, 0, b, q[rows], list(range(n - m, n)), 1 / np.sqrt(32),
                                sink_logits=logits, softcap=4.0)
            assert_close(out[rows], want, group.kv.dtype.type)
            want, _ = reference(group, 0, b, q[rows][-1:], [n - 1], 1 / np.sqrt(32), sink_logits=logits)
            assert_close(dec[b], want[0], group.kv.dtype.type)
    assert cache.calls == [0, 0, 1, 1]
    with pytest.raises(IndexError, match=r"layer: expected 0 <= layer < 2, got 2"):
        attention.decode(q[:3], cache, 2, seq_ids)
    with pytest.raises(KeyError):
        attention.decode(q[:1], cache, 0, ["missing"])


def test_chunked_cache_that_lacks_a_key_of_the_chunk_is_refused():
    cache = FakeCache(1, 1, 8, 32, 4, np.float32, seed=78, chunk_size=10)
    cache.add_sequence("short", 27, hold_from=24)  # the query at 26 reads 20..26
    cache.add_sequence("ok", 27)
    q = np.zeros((1, 1, 8), np.float32)
    with pytest.raises(ValueError, match=r"seq_ids: sequence 'short' does not hold every key .*20\.\.26\); "
                                         r"chunked attention reads every key from the start"):
        attention.decode(q, cache, 0, ["short"])
    attention.decode(q, cache, 0, ["ok"])
    # prefill of 25..26 needs 20..26 too; of 30..? the chunk 20..29 and no more
    with pytest.raises(ValueError, match=r"qo_indptr: sequence 'short' does not hold every key"):
        attention.prefill(np.zeros((2, 1, 8), np.float32), cache, 0, ["short"], [0, 2])
    cache.add_sequence("next", 33, hold_from=28)  # queries 30..32 read 30..32 only
    check_prefill(cache, ["next"], [3], 1, np.random.default_rng(79))


# ------------------------------------------------ hypothesis, new options

@st.composite
def hybrid_problems(draw, prefill):
    ps = draw(st.sampled_from([1, 3, 4, 16]))
    num_kv_heads = draw(st.integers(1, 3))
    group = draw(st.sampled_from([1, 2, 3, 4, 8]))
    dim = draw(st.sampled_from([1, 8, 24, 40, 64]))
    dtype = draw(st.sampled_from([np.float32, np.float16]))
    window = draw(st.one_of(st.none(), st.integers(1, 40)))
    sinks = draw(st.integers(0, 12)) if window is not None else 0
    chunk = draw(st.one_of(st.none(), st.integers(1, 50))) if window is None else None
    isa = draw(st.sampled_from(AVAILABLE_ISAS))
    num_qo_heads = num_kv_heads * group
    logits = draw(st.none() | st.lists(st.sampled_from([-np.inf, -3.0, 0.0, 1.5, 6.0]) | st.floats(-8, 8),
                                       min_size=num_qo_heads, max_size=num_qo_heads))
    softcap = draw(st.none() | st.sampled_from([0.5, 1.0, 2.5, 30.0]))
    scale = draw(st.sampled_from([None, 0.05, 0.5]))
    sink_queries = sinks > 0 and draw(st.booleans())
    seed = draw(st.integers(0, 2**16))
    cache = FakeCache(2, num_kv_heads, dim, 400, ps, dtype, window, sinks, seed=seed, chunk_size=chunk)
    qo_lens = []
    for i in range(draw(st.integers(1, 4))):
        n = draw(st.integers(1, 120))
        m = draw(st.integers(0, n)) if prefill else 1
        cache.add_sequence(i, n, hold_from=held_from(window, chunk, n - m, draw(st.integers(0, 2)) * ps))
        qo_lens.append(m)
    options = dict(sink_logits=None if logits is None else np.array(logits, np.float32),
                   softcap=softcap, scale=scale, sink_queries=sink_queries, layer=seed % 2)
    return cache, num_qo_heads, isa, seed, qo_lens, options


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hybrid_problems(prefill=False), st.sampled_from([0, 1, 2, 7, 40]))
def test_decode_with_new_options_hypothesis(problem, partition_tokens):
    cache, num_qo_heads, isa, seed, qo_lens, options = problem
    with kernel_path(isa), decode_partition(partition_tokens):
        check_decode(cache, list(range(len(qo_lens))), num_qo_heads, np.random.default_rng(seed),
                     threads=(1, 2, 3), **options)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hybrid_problems(prefill=True))
def test_prefill_with_new_options_hypothesis(problem):
    cache, num_qo_heads, isa, seed, qo_lens, options = problem
    with kernel_path(isa):
        check_prefill(cache, list(range(len(qo_lens))), qo_lens, num_qo_heads,
                      np.random.default_rng(seed), **options)


# ----------------------------------------------- bad input, new options

NEW_OPTIONS_BAD = [
    (dict(sink_logits=np.zeros(3)), ValueError, r"shape of sink_logits: expected \(Hq,\) = \(4,\)"),
    (dict(sink_logits=np.zeros((1, 4))), ValueError, "shape of sink_logits"),
    (dict(sink_logits=[0.0, np.nan, 0.0, 0.0]), ValueError,
     r"value of sink_logits: expected .* or -inf \(no sink term\), got nan for head 1"),
    (dict(sink_logits=[0.0, 0.0, np.inf, 0.0]), ValueError, "value of sink_logits: .* got inf for head 2"),
    (dict(sink_logits=[0.0, 0.0, 0.0, 1e39]), ValueError, r"sink_logits: .*\|logit\| <= 1e\+38"),
    (dict(sink_logits=[-1e39, 0.0, 0.0, 0.0]), ValueError, "sink_logits"),
    (dict(sink_logits=np.zeros(4, np.complex64)), TypeError, "dtype of sink_logits"),
    (dict(sink_logits=np.zeros(4, bool)), TypeError, "dtype of sink_logits"),
    (dict(sink_logits="0000"), TypeError, "sink_logits"),
    (dict(softcap=0.0), ValueError, r"value of softcap: expected None or a finite number with 1e-38 <= "),
    (dict(softcap=-1.0), ValueError, "value of softcap"),
    (dict(softcap=1e-39), ValueError, "value of softcap"),
    (dict(softcap=float("nan")), ValueError, "value of softcap"),
    (dict(softcap=float("inf")), ValueError, "value of softcap"),
    (dict(softcap=1e39), ValueError, "value of softcap"),
    (dict(softcap=1e-20, scale=1e30), ValueError, r"softcap: expected \|scale\| / softcap <= 1e\+38"),
    (dict(softcap=True), TypeError, "type of softcap"),
    (dict(softcap="1"), TypeError, "type of softcap"),
]


@pytest.mark.parametrize("change, exc, match", NEW_OPTIONS_BAD)
@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_sink_logits_and_softcap_bad_input(change, exc, match, kind):
    cache = make_cache()
    args = dict(q=GOOD_Q, cache=cache, layer=0, seq_ids=["a", "b"])
    args.update(change)
    with pytest.raises(exc, match=match):
        if kind == "decode":
            attention.decode(**args)
        else:
            attention.prefill(qo_indptr=[0, 1, 2], **args)


def test_good_edge_values_of_the_new_options_are_accepted():
    cache = make_cache()
    for options in (dict(sink_logits=[-np.inf] * 4), dict(sink_logits=[1e38, -1e38, 0, 0]),
                    dict(softcap=1e38), dict(softcap=1e-38, scale=1e-3), dict(softcap=np.float16(30))):
        assert np.isfinite(attention.decode(GOOD_Q, cache, 0, ["a", "b"], **options)).all()


class AttrCache(FakeCache):
    """A fake cache whose chunk_size attribute is set after construction, unchecked."""


@pytest.mark.parametrize("settings_, exc, match", [
    (dict(chunk_size=0), ValueError, r"value of cache.chunk_size: expected 1 <= .*, got 0"),
    (dict(chunk_size=2**62 + 1), ValueError, "value of cache.chunk_size"),
    (dict(chunk_size=2.0), TypeError, "cache.chunk_size"),
    (dict(chunk_size=4, window=3), ValueError,
     r"cache.chunk_size: expected None with a window .* got chunk_size=4 with window=3"),
])
def test_bad_chunk_sizes(settings_, exc, match):
    cache = make_cache()
    for name, value in settings_.items():
        setattr(cache, name, value)
    with pytest.raises(exc, match=match):
        attention.decode(GOOD_Q, cache, 0, ["a", "b"])
    cache.chunk_size = 2**62
    cache.window = None
    attention.decode(GOOD_Q, cache, 0, ["a", "b"])


def view_cache(answer):
    """A cache whose layer_attention_view returns ``answer(cache, seq_ids)``."""
    cache = make_cache()

    class Hooked:
        num_layers = 2

        def layer_attention_view(self, layer, seq_ids):
            return answer(cache, seq_ids)

    return Hooked()


@pytest.mark.parametrize("answer, exc, match", [
    (lambda c, s: [c.kv[0], c.page_table(s), None, 0, None], TypeError,
     r"type of cache.layer_attention_view\(layer, seq_ids\): expected a tuple"),
    (lambda c, s: (c.kv[0], c.page_table(s), None, 0), TypeError, "of length 4"),
    (lambda c, s: (c.kv, c.page_table(s), None, 0, None), ValueError,
     r"shape of cache.layer_attention_view\(layer, seq_ids\).pages: expected \(num_pages, 2, page_size"),
    (lambda c, s: (c.kv[0].astype(np.float64), c.page_table(s), None, 0, None), TypeError,
     r"dtype of cache.layer_attention_view\(layer, seq_ids\).pages"),
    (lambda c, s: (np.asfortranarray(c.kv[0]), c.page_table(s), None, 0, None), ValueError, "layout of"),
    (lambda c, s: (c.kv[0], c.page_table(s), 0, 0, None), ValueError,
     r"value of cache.layer_attention_view\(layer, seq_ids\).window"),
    (lambda c, s: (c.kv[0], c.page_table(s), 4, 0, 4), ValueError, r"\.chunk_size: expected None with a window"),
    (lambda c, s: (c.kv[0], None, None, 0, None), AttributeError, "indptr"),
])
def test_bad_layer_attention_views(answer, exc, match):
    with pytest.raises(exc, match=match):
        attention.decode(GOOD_Q, view_cache(answer), 0, ["a", "b"])
