"""The per-step entry of the kernels (``StepTable``, ``decode_step``, ``prefill_step``).

Engines (the vLLM backend) check a step's page table once and call the kernels
once per layer. The entry must give exactly the general path's results (which
``test_attention.py`` checks against dense float64 attention) and the general
path's errors, and a table checked for one pool must not pass for another.
"""
import numpy as np
import pytest

from pagedkv import attention
from pagedkv_c import _attention

from _fake_cache import FakeCache
from test_attention import assert_close, poison_unread_slots, reference


def _cache(dtype=np.float32, window=None, seed=0):
    cache = FakeCache(1, 2, 32, 40, page_size=8, dtype=dtype, window=window, seed=seed)
    for seq_id, length in (("a", 37), ("b", 8), ("c", 61)):
        cache.add_sequence(seq_id, length, hold_from=0)  # every page: prefill queries reach back
    return cache


def _table(cache, seq_ids, qo_indptr=None):
    view = cache.page_table(seq_ids)
    return _attention.StepTable(view.indptr, view.indices, view.page_positions, view.seq_lens, qo_indptr)


SEQS = ["a", "b", "c"]


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("window", [None, 12])
@pytest.mark.parametrize("num_qo_heads", [2, 6])
def test_decode_step_equals_decode_and_the_dense_reference(dtype, window, num_qo_heads):
    cache = _cache(dtype, window)
    lens = [cache.seq_len(s) for s in SEQS]
    poison_unread_slots(cache, {s: [n - 1] for s, n in zip(SEQS, lens)})
    q = np.random.default_rng(1).standard_normal((3, num_qo_heads, 32), dtype=np.float32)
    table = _table(cache, SEQS)
    want = attention.decode(q, cache, 0, SEQS, 0.2, 1)
    out = np.full_like(want, 7.0)
    got = _attention.decode_step(q, cache.kv[0], table, window, 0.2, 1, out)
    assert got is out
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(_attention.decode_step(q, cache.kv[0], table, window, 0.2, 2), want)
    for b, (seq_id, n) in enumerate(zip(SEQS, lens)):
        ref_out, _ = reference(cache, 0, seq_id, q[b:b + 1], [n - 1], 0.2)
        assert_close(got[b], ref_out[0], dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("window", [None, 12])
def test_prefill_step_equals_prefill_and_the_dense_reference(dtype, window):
    cache = _cache(dtype, window)
    qo_lens = [5, 1, 9]
    qo = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int64)
    lens = [cache.seq_len(s) for s in SEQS]
    poison_unread_slots(cache, {s: list(range(n - m, n)) for s, n, m in zip(SEQS, lens, qo_lens)})
    q = np.random.default_rng(2).standard_normal((int(qo[-1]), 4, 32), dtype=np.float32)
    table = _table(cache, SEQS, qo)
    want = attention.prefill(q, cache, 0, SEQS, qo, 0.2, 1)
    got = _attention.prefill_step(q, cache.kv[0], table, window, 0.2, 1)
    np.testing.assert_array_equal(got, want)
    for b, (seq_id, n, m) in enumerate(zip(SEQS, lens, qo_lens)):
        rows = slice(qo[b], qo[b + 1])
        ref_out, _ = reference(cache, 0, seq_id, q[rows], list(range(n - m, n)), 0.2)
        assert_close(got[rows], ref_out, dtype)


def test_score_options_reach_the_kernels():
    cache = _cache()
    q = np.random.default_rng(3).standard_normal((3, 4, 32), dtype=np.float32)
    logits = np.array([0.5, -np.inf, 2.0, -1.0])
    want = attention.decode(q, cache, 0, SEQS, 0.3, 1, sink_logits=logits, softcap=5.0)
    got = _attention.decode_step(q, cache.kv[0], _table(cache, SEQS), None, 0.3, 1, sink_logits=logits,
                                 softcap=5.0)
    np.testing.assert_array_equal(got, want)
    assert not np.array_equal(got, _attention.decode_step(q, cache.kv[0], _table(cache, SEQS), None, 0.3, 1))


def test_arguments_the_fast_checks_refuse_take_the_general_path():
    cache = _cache()
    table = _table(cache, SEQS)
    q = np.random.default_rng(4).standard_normal((3, 4, 32))  # float64: converted by the general path
    want = attention.decode(q, cache, 0, SEQS, 0.25, 1)
    np.testing.assert_array_equal(_attention.decode_step(q, cache.kv[0], table, None, 0.25, 1), want)
    np.testing.assert_array_equal(_attention.decode_step(q, cache.kv[0], table, None, np.float32(0.25), 1), want)
    out = np.empty((3, 4, 32), dtype=np.float32)
    assert _attention.decode_step(q, cache.kv[0], table, None, 0.25, np.int64(1), out) is out
    np.testing.assert_array_equal(out, want)


@pytest.mark.parametrize("change, error, match", [
    (lambda a: a.update(pages=np.asfortranarray(a["pages"])), ValueError, "layout of"),
    (lambda a: a.update(pages=a["pages"].astype(np.float64)), TypeError, "dtype of"),
    (lambda a: a.update(q=a["q"][:2]), ValueError, "one query per sequence"),
    (lambda a: a.update(q=a["q"][:, :3]), ValueError, "multiple of"),
    (lambda a: a.update(window=0), ValueError, "window"),
    (lambda a: a.update(scale=float("nan")), ValueError, "scale"),
    (lambda a: a.update(threads=0), ValueError, "num_threads"),
    (lambda a: a.update(out=np.empty((3, 4, 31), dtype=np.float32)), ValueError, "Invalid value of out"),
    (lambda a: a.update(out=np.empty((3, 4, 32), dtype=np.float64)), ValueError, "Invalid value of out"),
    (lambda a: a.update(out=np.empty((3, 4, 64), dtype=np.float32)[:, :, ::2]), ValueError,
     "Invalid value of out"),
])
def test_bad_arguments_raise_the_general_paths_errors(change, error, match):
    cache = _cache()
    args = {"q": np.zeros((3, 4, 32), dtype=np.float32), "pages": cache.kv[0], "window": None, "scale": 0.25,
            "threads": 1, "out": None}
    change(args)
    with pytest.raises(error, match=match):
        _attention.decode_step(args["q"], args["pages"], _table(cache, SEQS), args["window"], args["scale"],
                               args["threads"], args["out"])


def test_a_table_checked_for_one_pool_is_checked_again_for_a_smaller_one():
    cache = _cache()
    table = _table(cache, SEQS)
    q = np.zeros((3, 4, 32), dtype=np.float32)
    _attention.decode_step(q, cache.kv[0], table, None, 0.25, 1)
    largest = int(table.indices.max())
    with pytest.raises(ValueError, match="indices"):
        _attention.decode_step(q, np.ascontiguousarray(cache.kv[0][:largest]), table, None, 0.25, 1)
    # a window the table does not cover: pages of "c" before its window are listed, so it passes;
    # a page size the positions do not fit fails
    with pytest.raises(ValueError):
        _attention.decode_step(q, np.ascontiguousarray(cache.kv[0][:, :, :4]), table, None, 0.25, 1)


def test_prefill_step_checks_the_query_count_on_every_call():
    cache = _cache()
    qo = np.array([0, 2, 3, 6], dtype=np.int64)
    table = _table(cache, SEQS, qo)
    _attention.prefill_step(np.zeros((6, 4, 32), dtype=np.float32), cache.kv[0], table, None, 0.25, 1)
    with pytest.raises(ValueError, match="qo_indptr"):
        _attention.prefill_step(np.zeros((5, 4, 32), dtype=np.float32), cache.kv[0], table, None, 0.25, 1)
    with pytest.raises(ValueError, match="made with qo_indptr"):
        _attention.prefill_step(np.zeros((6, 4, 32), dtype=np.float32), cache.kv[0], _table(cache, SEQS), None,
                                0.25, 1)


def test_step_table_copies_its_arrays_read_only_and_checks_them():
    cache = _cache()
    view = cache.page_table(SEQS)
    indices = view.indices.copy()
    table = _attention.StepTable(view.indptr, indices, view.page_positions, view.seq_lens)
    indices[:] = 10**6  # the caller's array: the table keeps its own copy
    q = np.zeros((3, 4, 32), dtype=np.float32)
    np.testing.assert_array_equal(_attention.decode_step(q, cache.kv[0], table, None, 0.25, 1),
                                  attention.decode(q, cache, 0, SEQS, 0.25, 1))
    assert table.batch_size == 3 and table.qo_indptr is None
    for name in ("indptr", "indices", "page_positions", "seq_lens"):
        assert not getattr(table, name).flags.writeable
    with pytest.raises(ValueError, match="indptr"):
        _attention.StepTable(np.zeros(0, np.int32), view.indices, view.page_positions, view.seq_lens)
    with pytest.raises(TypeError, match="indices"):
        _attention.StepTable(view.indptr, view.indices.astype(np.int64), view.page_positions, view.seq_lens)
    with pytest.raises(ValueError, match="seq_lens"):
        _attention.StepTable(view.indptr, view.indices, view.page_positions, view.seq_lens[:2])
    with pytest.raises(ValueError, match="qo_indptr"):
        _attention.StepTable(view.indptr, view.indices, view.page_positions, view.seq_lens,
                             np.zeros(3, np.int64))
