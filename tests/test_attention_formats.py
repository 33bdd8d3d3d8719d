"""Paged attention over bfloat16, int8 and int4 pages against dense float64 attention.

The pools are encoded with tests/reference_formats.py (the NumPy oracle of
page_formats.h) from the random float32 pools of tests/_fake_cache.py, whose
unread slots are NaN first (poison_unread_slots): a NaN row encodes to a NaN
scale, so a kernel that reads a row outside the mask fails here as it does
over float pages. The reference is test_attention.reference over the decoded
K/V (reference_formats.decode): the kernels decode in registers to the same
float32 values, so results agree within float32 tolerance.

int8 pages on a path that scores with integer dot products
(kernel_info()["int8_scores"]) quantize the query per row to int8; the
reference then attends with that rounded query (reference_formats.quantize_query), so the
comparison stays at float32 tolerance.
"""
import numpy as np
import pytest

import reference_formats as rf
from pagedkv import attention
from pagedkv_c import _attention

from _fake_cache import FakeCache
from test_attention import (
    AVAILABLE_ISAS,
    decode_partition,
    kernel_path,
    poison_unread_slots,
    reference,
)

FORMATS = ("bfloat16", "int8", "int4")
POOL_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16,
               "int8": np.uint8, "int4": np.uint8}
# decoded values are exact; the kernels' float32 arithmetic is what remains
TOLERANCE = 1e-5
# (num_kv_heads, group, head_dim, page_size): GQA 4 at D 128 and 64; odd
# group and a vector tail at D 40; D 96 (int4 rotation blocks of 32, a VNNI
# tail); D 7 (no rotation block, scalar tails only)
SHAPES = [(2, 4, 128, 16), (2, 4, 64, 8), (3, 3, 40, 4), (2, 2, 96, 16), (1, 2, 7, 4)]


class FormatCache:
    """The pool of a FakeCache encoded in a page format, with the attention contract.

    ``kv`` is the encoded pool (dtype of the format, last axis the row size),
    ``kv_dtype`` its format; ``gather`` returns the decoded K/V (float64),
    which is what the reference attends over.
    """

    def __init__(self, base, fmt):
        self.base = base
        self.kv_dtype = fmt
        for name in ("num_layers", "num_kv_heads", "head_dim", "page_size", "window", "sink_tokens",
                     "chunk_size"):
            setattr(self, name, getattr(base, name))
        self.encode()

    def encode(self):
        """Encode the base pool again (after the test changed its float values)."""
        with np.errstate(invalid="ignore"):  # rotating a row with an inf: NaN, as intended
            raw = np.ascontiguousarray(rf.encode(self.base.kv.astype(np.float32), self.kv_dtype))
            self.decoded = rf.decode(raw, self.kv_dtype, self.head_dim)
        self.kv = raw.view(POOL_DTYPES[self.kv_dtype])

    def raw(self):
        """The pool's bytes, shape (..., row_bytes), a view."""
        return self.kv.view(np.uint8)

    def redecode(self):
        """Decode the pool again after the test changed its bytes."""
        with np.errstate(invalid="ignore"):
            self.decoded = rf.decode(self.raw(), self.kv_dtype, self.head_dim)

    def page_table(self, seq_ids):
        return self.base.page_table(seq_ids)

    def seq_len(self, seq_id):
        return self.base.seq_len(seq_id)

    def gather(self, layer, seq_id):
        length, pages = self.base._seqs[seq_id]
        ps = self.page_size
        ks, vs, pos = [], [], []
        for i in sorted(pages):
            n = min(ps, length - i * ps)
            ks.append(self.decoded[layer, pages[i], 0, :n])
            vs.append(self.decoded[layer, pages[i], 1, :n])
            pos.append(np.arange(i * ps, i * ps + n, dtype=np.int64))
        return np.concatenate(ks), np.concatenate(vs), np.concatenate(pos)


def quantizes_query(fmt, isa):
    """True if the kernels of ``isa`` score ``fmt`` pages against the int8-rounded query."""
    if fmt != "int8":
        return False
    with kernel_path(isa):
        return attention.kernel_info()["int8_scores"] != "float32"


def build(fmt, shape, seqs, window=None, sinks=0, chunk=None, queries=None, seed=0, num_pages=160):
    """A FormatCache of 2 layers holding ``seqs`` ({seq_id: (length, hold_from)}).

    Slots no query of ``queries`` ({seq_id: positions}; default the last
    token) reads are NaN before encoding.
    """
    num_kv_heads, _, dim, ps = shape
    base = FakeCache(2, num_kv_heads, dim, num_pages, ps, np.float32, window, sinks, seed=seed, chunk_size=chunk)
    for seq_id, (length, hold_from) in seqs.items():
        base.add_sequence(seq_id, length, hold_from=hold_from)
    if queries is None:
        queries = {seq_id: [length - 1] for seq_id, (length, _) in seqs.items()}
    poison_unread_slots(base, queries)
    return FormatCache(base, fmt)


def run(cache, isa, seq_ids, q, qo_lens=None, threads=(1, 2), **options):
    """decode (qo_lens None) or prefill on ``isa`` for every thread count; they must agree bit for bit."""
    with kernel_path(isa):
        if qo_lens is None:
            results = [attention.decode(q, cache, 1, seq_ids, num_threads=t, return_lse=True, **options)
                       for t in threads]
        else:
            qo = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int64)
            results = [attention.prefill(q, cache, 1, seq_ids, qo, num_threads=t, return_lse=True, **options)
                       for t in threads]
    out, lse = results[0]
    for other_out, other_lse in results[1:]:
        np.testing.assert_array_equal(out, other_out)
        np.testing.assert_array_equal(lse, other_lse)
    return out, lse


def expected(cache, isa, seq_ids, q, qo_lens=None, scale=None, q_sink=None, **options):
    """The reference over the decoded K/V, with the query the path uses."""
    if quantizes_query(cache.kv_dtype, isa):
        q = rf.quantize_query(q)
        q_sink = None if q_sink is None else rf.quantize_query(q_sink)
    scale = 1.0 / np.sqrt(cache.head_dim) if scale is None else scale
    qo_lens = [1] * len(seq_ids) if qo_lens is None else qo_lens
    qo = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int64)
    outs, lses = [], []
    for b, seq_id in enumerate(seq_ids):
        n = cache.seq_len(seq_id)
        rows = slice(qo[b], qo[b + 1])
        with np.errstate(invalid="ignore"):
            o, l = reference(cache, 1, seq_id, q[rows], list(range(n - qo_lens[b], n)), scale,
                             None if q_sink is None else q_sink[rows], **options)
        outs.append(o)
        lses.append(l)
    return np.concatenate(outs), np.concatenate(lses)


def assert_close(got, want):
    np.testing.assert_allclose(got, want, rtol=0, atol=TOLERANCE, equal_nan=True)


def check(cache, group, isa, seq_ids, rng, qo_lens=None, q_sink=False, scale=None, threads=(1, 2),
          **options):
    """Random queries (and sink queries) of ``group`` query heads per KV head, compared with the reference."""
    num_qo_heads = cache.num_kv_heads * group
    num_rows = len(seq_ids) if qo_lens is None else int(sum(qo_lens))
    q = rng.standard_normal((num_rows, num_qo_heads, cache.head_dim), dtype=np.float32)
    qs = rng.standard_normal(q.shape, dtype=np.float32) if q_sink else None
    out, lse = run(cache, isa, seq_ids, q, qo_lens, threads, q_sink=qs, scale=scale, **options)
    assert np.isfinite(out).all(), "output has NaN/inf: a kernel read a slot outside the mask"
    want_out, want_lse = expected(cache, isa, seq_ids, q, qo_lens, scale, qs, **options)
    assert_close(out, want_out)
    assert_close(lse, want_lse)
    return out


CASES = [(fmt, isa, shape) for fmt in FORMATS for isa in AVAILABLE_ISAS for shape in SHAPES]


def lengths_for(ps):
    return [1, ps, 2 * ps + 1, 70, 129]


# ------------------------------------------------------------- every option

@pytest.mark.parametrize("fmt, isa, shape", CASES)
@pytest.mark.parametrize("split", [False, True])
def test_decode_matches_dense_attention_over_the_decoded_pages(fmt, isa, shape, split):
    ps = shape[3]
    cache = build(fmt, shape, {i: (n, None) for i, n in enumerate(lengths_for(ps))}, seed=1)
    with decode_partition(ps if split else 0):
        check(cache, shape[1], isa, list(range(5)), np.random.default_rng(2), threads=(1, 2, 3))


@pytest.mark.parametrize("fmt, isa, shape", CASES)
def test_prefill_matches_dense_attention_over_the_decoded_pages(fmt, isa, shape):
    ps = shape[3]
    lengths, qo_lens = [ps, 70, 41], [ps, 23, 1]
    queries = {i: range(n - m, n) for i, (n, m) in enumerate(zip(lengths, qo_lens))}
    cache = build(fmt, shape, {i: (n, None) for i, n in enumerate(lengths)}, queries=queries, seed=3)
    check(cache, shape[1], isa, [0, 1, 2], np.random.default_rng(4), qo_lens=qo_lens)


@pytest.mark.parametrize("fmt, isa, shape", CASES)
@pytest.mark.parametrize("mode", ["decode", "split decode", "prefill"])
def test_window_sinks_and_sink_queries(fmt, isa, shape, mode):
    ps = shape[3]
    window, sinks = 3 * ps + 1, 5
    lengths = [1, sinks + 1, 2 * ps + 1, 70, 129]
    qo_lens = [min(n, 9) for n in lengths] if mode == "prefill" else None
    firsts = [n - (1 if qo_lens is None else m) for n, m in zip(lengths, qo_lens or lengths)]
    seqs = {i: (n, first - window + 1 - (i % 2) * ps) for i, (n, first) in enumerate(zip(lengths, firsts))}
    queries = {i: range(first, n) for i, (n, first) in enumerate(zip(lengths, firsts))}
    cache = build(fmt, shape, seqs, window=window, sinks=sinks, queries=queries, seed=5)
    rng = np.random.default_rng(6)
    with decode_partition(ps if mode == "split decode" else 0):
        check(cache, shape[1], isa, list(range(5)), rng, qo_lens=qo_lens)
        check(cache, shape[1], isa, list(range(5)), rng, qo_lens=qo_lens, q_sink=True)


@pytest.mark.parametrize("fmt, isa, shape", CASES)
@pytest.mark.parametrize("mode", ["decode", "split decode", "prefill"])
def test_chunks_softcap_and_sink_logits(fmt, isa, shape, mode):
    ps = shape[3]
    chunk = 2 * ps
    lengths = [1, chunk, chunk + 1, 3 * chunk - 1, 70]
    qo_lens = [min(n, 5) for n in lengths] if mode == "prefill" else None
    firsts = [n - (1 if qo_lens is None else m) for n, m in zip(lengths, qo_lens or lengths)]
    seqs = {i: (n, first - first % chunk) for i, (n, first) in enumerate(zip(lengths, firsts))}
    queries = {i: range(first, n) for i, (n, first) in enumerate(zip(lengths, firsts))}
    cache = build(fmt, shape, seqs, chunk=chunk, queries=queries, seed=7)
    rng = np.random.default_rng(8)
    num_qo_heads = shape[0] * shape[1]
    sink_logits = rng.normal(1.0, 2.0, num_qo_heads).astype(np.float32)
    sink_logits[0] = -np.inf
    with decode_partition(ps if mode == "split decode" else 0):
        check(cache, shape[1], isa, list(range(5)), rng, qo_lens=qo_lens, scale=3.0 / np.sqrt(shape[2]),
              softcap=2.5)
        check(cache, shape[1], isa, list(range(5)), rng, qo_lens=qo_lens, sink_logits=sink_logits)


@pytest.mark.parametrize("fmt", FORMATS)
def test_long_sequence_in_uneven_partitions_on_many_threads(fmt):
    shape = (2, 4, 64, 16)
    cache = build(fmt, shape, {"long": (3000, None), "short": (30, None)}, seed=9, num_pages=200)
    with decode_partition(1000):  # 188 pages: 63, 63, 62
            check(cache, shape[1], AVAILABLE_ISAS[-1], ["short", "long"], np.random.default_rng(10),
              threads=(1, 2, 3, 4))


# --------------------------------------------------------------- non-finite

NONFINITE_CASES = [(fmt, isa, mode) for fmt in FORMATS for isa in AVAILABLE_ISAS
                   for mode in ("decode", "split decode", "prefill")]


def set_row(cache, seq_id, position, half, kv_head, value):
    """Set every value of the base pool's K (half 0) or V (half 1) row of a position, layer 1."""
    view = cache.base.page_table([seq_id])
    j = int(np.searchsorted(view.page_positions, position, side="right")) - 1
    cache.base.kv[1, view.indices[j], half, position - int(view.page_positions[j]), kv_head] = value


@pytest.mark.parametrize("fmt, isa, mode", NONFINITE_CASES)
def test_a_nan_scale_decodes_to_nan_and_reaches_only_the_rows_that_admit_it(fmt, isa, mode):
    # A quantized row holding an inf or NaN is stored with a NaN scale (the
    # whole row NaN; bfloat16 keeps the inf): in an admitted K row its query
    # group is NaN, an admitted V row reaches the output, a row the window
    # excludes changes nothing.
    shape = (2, 3, 40, 4)
    window = 12
    qo_len = 4 if mode == "prefill" else 1
    cache = build(fmt, shape, {"s": (70, 70 - qo_len - window + 1 - 4)}, window=window,
                  queries={"s": range(70 - qo_len, 70)}, seed=11)
    set_row(cache, "s", 66, 0, 0, np.nan)   # admitted by every query: KV head 0's group NaN
    set_row(cache, "s", 69, 1, 1, np.inf)   # V of the last token, KV head 1: admitted by the last query
    set_row(cache, "s", 53, 0, 1, np.nan)   # held, outside every window: ignored
    set_row(cache, "s", 53, 1, 1, np.nan)
    cache.encode()
    rng = np.random.default_rng(12)
    q = rng.standard_normal((qo_len, 6, 40), dtype=np.float32)
    with decode_partition(4 if mode == "split decode" else 0):
        out, lse = run(cache, isa, ["s"], q, None if mode != "prefill" else [qo_len])
    want_out, want_lse = expected(cache, isa, ["s"], q, None if mode != "prefill" else [qo_len])
    assert np.isnan(out[:, :3]).all() and np.isnan(lse[:, :3]).all()
    assert not np.isfinite(out[-1, 3:]).any() and np.isfinite(lse[:, 3:]).all()
    if qo_len > 1:
        assert np.isfinite(out[:-1, 3:]).all()
    assert_close(out, want_out)
    assert_close(lse, want_lse)


@pytest.mark.parametrize("fmt, isa, mode", NONFINITE_CASES)
def test_nan_in_a_query_gives_exactly_that_row_nan(fmt, isa, mode):
    shape = (2, 3, 40, 4)
    qo_len = 3 if mode == "prefill" else 1
    cache = build(fmt, shape, {"s": (50, None)}, queries={"s": range(50 - qo_len, 50)}, seed=13)
    rng = np.random.default_rng(14)
    q = rng.standard_normal((qo_len, 6, 40), dtype=np.float32)
    q[0, 4, 7] = np.nan
    with decode_partition(4 if mode == "split decode" else 0):
        out, lse = run(cache, isa, ["s"], q, None if mode != "prefill" else [qo_len])
    nan_rows = np.isnan(out).any(axis=-1)
    assert nan_rows[0, 4] and nan_rows.sum() == 1 and np.isnan(lse[0, 4])
    want_out, want_lse = expected(cache, isa, ["s"], q, None if mode != "prefill" else [qo_len])
    assert_close(out, want_out)
    assert_close(lse, want_lse)


# ------------------------------------------------------ the tests bite

def test_one_wrong_scale_byte_fails_the_comparison():
    # The planted fault: one byte of one admitted K row's scale changes in the
    # pool after the reference decoded it. The kernels read the pool as it
    # is, so the comparison must fail; decoded again, it passes.
    shape = (2, 4, 64, 16)
    for fmt in ("int8", "int4"):
        cache = build(fmt, shape, {"s": (100, None)}, seed=15)
        view = cache.page_table(["s"])
        row = cache.raw()[1, view.indices[2], 0, 3, 1]     # position 35, KV head 1
        row[rf.row_bytes(fmt, 64) - 1] ^= 0x01              # the high byte of the (last) scale
        rng = np.random.default_rng(16)
        q = rng.standard_normal((1, 8, 64), dtype=np.float32)
        out, lse = run(cache, AVAILABLE_ISAS[-1], ["s"], q)
        stale_out, _ = expected(cache, AVAILABLE_ISAS[-1], ["s"], q)
        with pytest.raises(AssertionError):
            assert_close(out, stale_out)
        cache.redecode()
        want_out, want_lse = expected(cache, AVAILABLE_ISAS[-1], ["s"], q)
        assert_close(out, want_out)
        assert_close(lse, want_lse)


def test_float_formats_named_by_kv_dtype_give_the_plain_results():
    shape = (2, 4, 64, 16)
    rng = np.random.default_rng(17)
    q = rng.standard_normal((2, 8, 64), dtype=np.float32)
    for fmt in ("float32", "float16"):
        cache = build(fmt, shape, {0: (40, None), 1: (77, None)}, seed=18)
        named = attention.decode(q, cache, 1, [0, 1])
        del cache.kv_dtype  # the pool's dtype names the format
        np.testing.assert_array_equal(attention.decode(q, cache, 1, [0, 1]), named)


def test_int8_scores_use_the_rounded_query_only_where_kernel_info_says():
    # On a path with integer scores, the result is attention with the
    # rounded query (float32-close) and differs from the unrounded one.
    shape = (2, 4, 128, 16)
    cache = build("int8", shape, {0: (300, None)}, seed=19)
    rng = np.random.default_rng(20)
    q = rng.standard_normal((1, 8, 128), dtype=np.float32)
    for isa in AVAILABLE_ISAS:
        out, _ = run(cache, isa, [0], q)
        plain, _ = expected(cache, "scalar", [0], q)
        if quantizes_query("int8", isa):
            assert np.abs(out - plain).max() > 10 * TOLERANCE
        else:
            assert_close(out, plain)


# --------------------------------------------------------------- bad input

def test_a_pool_of_the_wrong_dtype_names_the_format():
    cache = build("int8", (2, 4, 64, 16), {0: (20, None)})
    q = np.zeros((1, 8, 64), np.float32)
    cache.kv = cache.kv.view(np.int8)
    with pytest.raises(ValueError, match=r"Invalid dtype of cache.kv: expected uint8 for cache.kv_dtype='int8', got int8"):
        attention.decode(q, cache, 1, [0])
    cache.kv_dtype = "bfloat16"
    cache.kv = np.zeros((2, 160, 2, 16, 2, 64), np.float16)
    with pytest.raises(ValueError, match=r"expected uint16 for cache.kv_dtype='bfloat16', got float16"):
        attention.decode(q, cache, 1, [0])


def test_a_row_size_that_does_not_fit_head_dim_is_refused():
    cache = build("int4", (2, 4, 64, 16), {0: (20, None)})
    q = np.zeros((1, 8, 64), np.float32)
    attention.decode(q, cache, 1, [0])
    with pytest.raises(ValueError, match=r"Invalid shape of cache.kv: expected a last axis of 39 bytes "
                                         r"\(one int4 head row of head_dim=66 values, head_dim from "
                                         r"q.shape\[2\]\), got 36"):
        attention.decode(np.zeros((1, 8, 66), np.float32), cache, 1, [0])
    with pytest.raises(ValueError, match=r"Invalid shape of q: expected \(\*, Hq, head_dim\) with 1 <= head_dim <= 256"):
        attention.decode(np.zeros((1, 8, 300), np.float32), cache, 1, [0])


def test_head_dim_of_the_cache_must_match_q():
    cache = build("int8", (2, 4, 64, 16), {0: (20, None)})
    cache.head_dim = 62
    with pytest.raises(ValueError, match=r"Invalid value of cache.head_dim: expected 64"):
        attention.decode(np.zeros((1, 8, 64), np.float32), cache, 1, [0])


@pytest.mark.parametrize("kv_dtype", ["int3", "fp8", 8, np.float16])
def test_unknown_kv_dtype_is_refused(kv_dtype):
    cache = build("int8", (2, 4, 64, 16), {0: (20, None)})
    cache.kv_dtype = kv_dtype
    with pytest.raises(ValueError, match=r"Invalid value of cache.kv_dtype: expected one of \['float32', "
                                         r"'float16', 'bfloat16', 'int8', 'int4'\]"):
        attention.decode(np.zeros((1, 8, 64), np.float32), cache, 1, [0])


def test_kernel_info_lists_the_formats():
    info = attention.kernel_info()
    assert info["page_formats"] == ["float32", "float16", "bfloat16", "int8", "int4"]
    assert info["int8_scores"] in ("float32", "int8 query (vnni)")
    with kernel_path("scalar"):
        assert attention.kernel_info()["int8_scores"] == "float32"
    assert _attention.kernel_info() == attention.kernel_info()
