"""Page formats of KVCache (kv_dtype): store encodes, gather decodes, every page operation keeps the bytes.

The oracle is tests/reference_formats.py (NumPy, written from the format's description).
"""
import numpy as np
import pytest

import reference_formats as rf
from pagedkv import KVCache
from pagedkv.snapshot import SnapshotError

FORMATS = ("float32", "float16", "bfloat16", "int8", "int4")
ENCODED = ("bfloat16", "int8", "int4")


def rows(rng, n, heads, dim, scale=1.0):
    return (rng.standard_normal((n, heads, dim)) * scale).astype(np.float32)


def filled(kv_dtype, n=10, heads=2, dim=64, layers=2, seed=0, **kwargs):
    """A cache with one sequence of ``n`` stored tokens; returns (cache, {layer: (k, v)})."""
    rng = np.random.default_rng(seed)
    cache = KVCache(layers, heads, dim, 32, page_size=4, kv_dtype=kv_dtype, **kwargs)
    cache.add_sequence(0, list(range(n)) if kwargs.get("enable_prefix_caching") else None)
    slots = cache.append([0], [n])
    data = {}
    for layer in range(layers):
        k, v = rows(rng, n, heads, dim), rows(rng, n, heads, dim)
        cache.store(layer, slots, k, v)
        data[layer] = (k, v)
    return cache, data


def expected(x, kv_dtype):
    """What gather returns (float32) for float32 rows ``x`` stored in format ``kv_dtype``."""
    return rf.read_back(x, kv_dtype)[0]


# ------------------------------------------------------------------ layout
@pytest.mark.parametrize("kv_dtype", FORMATS)
@pytest.mark.parametrize("dim", [1, 3, 32, 64, 96, 128, 256])
def test_pool_shape_dtype_and_bytes_per_token(kv_dtype, dim):
    cache = KVCache(3, 2, dim, 8, page_size=4, kv_dtype=kv_dtype)
    element = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}.get(kv_dtype, np.uint8)
    row_bytes = rf.row_bytes(kv_dtype, dim)
    assert cache.kv_dtype == kv_dtype and cache.dtype == element
    assert cache.kv.shape == (3, 8, 2, 4, 2, row_bytes // np.dtype(element).itemsize)
    assert cache.kv.nbytes == 3 * 8 * 2 * 4 * 2 * row_bytes


def test_quantized_bytes_per_token_meet_the_goals():
    """Bytes per cached token, scales included, against float16 (head_dim 64 and 128)."""
    for dim in (64, 128):
        float16 = KVCache(1, 1, dim, 1, page_size=1, kv_dtype="float16").kv.nbytes
        assert KVCache(1, 1, dim, 1, page_size=1, kv_dtype="int8").kv.nbytes / float16 <= 0.53
        assert KVCache(1, 1, dim, 1, page_size=1, kv_dtype="int4").kv.nbytes / float16 <= 0.31


def test_dtype_and_kv_dtype_agree_or_are_refused():
    assert KVCache(1, 1, 4, 2).kv_dtype == "float16"
    assert KVCache(1, 1, 4, 2, dtype=np.float32).kv_dtype == "float32"
    assert KVCache(1, 1, 4, 2, dtype=np.float32, kv_dtype="float32").kv_dtype == "float32"
    assert KVCache(1, 1, 4, 2, kv_dtype=np.float16).kv_dtype == "float16"
    with pytest.raises(ValueError, match="dtype: float32 contradicts kv_dtype='int8'"):
        KVCache(1, 1, 4, 2, dtype=np.float32, kv_dtype="int8")
    with pytest.raises(ValueError, match=r"kv_dtype: expected one of \('float32'"):
        KVCache(1, 1, 4, 2, kv_dtype="fp8")
    with pytest.raises(ValueError, match="head_dim: int4 pages take head_dim <= 256, got 512"):
        KVCache(1, 1, 512, 2, kv_dtype="int4")
    assert KVCache(1, 1, 512, 2, kv_dtype="bfloat16").head_dim == 512  # no limit for the float formats


# ------------------------------------------------------------ store / gather
@pytest.mark.parametrize("kv_dtype", FORMATS)
@pytest.mark.parametrize("dim", [3, 64, 96])
def test_gather_returns_the_reference_decoding(kv_dtype, dim):
    cache, data = filled(kv_dtype, n=11, dim=dim)
    for layer, (k, v) in data.items():
        gk, gv, positions = cache.gather(layer, 0, dtype=np.float32)
        assert positions.tolist() == list(range(11)) and gk.dtype == np.float32
        for got, rows in ((gk, k), (gv, v)):
            want, atol = rf.read_back(rows, kv_dtype)
            if atol:  # the C rotation runs in float32, the reference in float64
                np.testing.assert_allclose(got, want, rtol=0, atol=atol)
            else:
                np.testing.assert_array_equal(got, want.astype(np.float32))


@pytest.mark.parametrize("kv_dtype, dim", [("bfloat16", 64), ("int8", 63), ("int4", 63), ("int8", 64),
                                           ("int4", 64), ("int8", 96), ("int4", 128)])
def test_pages_hold_the_reference_bytes(kv_dtype, dim):
    """Byte for byte: the pool's rows are the reference encoding (rotation included: the reference
    rotates in float32 with the C code's butterflies)."""
    cache, data = filled(kv_dtype, n=4, dim=dim)
    k, v = data[1]
    page = cache.page_table([0]).indices[0]
    raw = cache.kv[1, page].view(np.uint8).reshape(2, 4, 2, -1)
    np.testing.assert_array_equal(raw[0], rf.encode(k, kv_dtype))
    np.testing.assert_array_equal(raw[1], rf.encode(v, kv_dtype))


@pytest.mark.parametrize("kv_dtype", ("int8", "int4"))
def test_quantization_error_within_the_scheme_bound(kv_dtype):
    rng = np.random.default_rng(1)
    x = rows(rng, 200, 1, 64) * rng.choice([1e-3, 1.0, 40.0], size=(200, 1, 1)).astype(np.float32)
    x[5, 0, 7] = 900.0  # a channel outlier
    cache = KVCache(1, 1, 64, 64, page_size=4, kv_dtype=kv_dtype)
    cache.add_sequence(0)
    cache.store(0, cache.append([0], [200]), x, x)
    got = cache.gather(0, 0)[0][:, 0].astype(np.float64)
    # Rotation (int4) is orthonormal: the row's Euclidean error is the rotated row's. int8: one block of 64
    # values, at most half a step (max / 127, rounded up to bfloat16) per value. int4: blocks of 32 whose
    # clip search keeps at most the squared error of the unclipped q4_0 grid (step max / 8, bfloat16
    # rounding at most 2**-8), where a value errs by at most one step (the level +8 does not exist).
    rotated = rf.rotate(x[:, 0]) if kv_dtype in rf.ROTATED else x[:, 0].astype(np.float64)
    if kv_dtype == "int8":
        steps = np.abs(rotated).max(axis=1, keepdims=True) / 127 * (1 + 2.0**-7) / 2
        block = 64
    else:
        steps = np.abs(rotated).reshape(200, 2, 32).max(axis=2) / 8 * (1 + 2.0**-7)
        block = 32
    bound = np.sqrt((block * steps**2).sum(axis=1)) * (1 + 1e-5) + 1e-6 * np.abs(x[:, 0]).max(axis=1)
    errors = np.linalg.norm(got - x[:, 0], axis=1)
    assert (errors <= bound).all()
    assert (errors / bound).max() > 0.2  # and the bound is not loose


@pytest.mark.parametrize("kv_dtype", FORMATS)
def test_every_input_type_encodes_alike(kv_dtype):
    """float32, float16, bfloat16 bits and lists reach the same pages as the same values in float32."""
    rng = np.random.default_rng(2)
    x16 = rows(rng, 6, 2, 64).astype(np.float16)
    bits = rf.float_to_bf16_bits(rows(rng, 6, 2, 64))
    x_from_bits = rf.bf16_bits_to_float(bits)
    for given, as_float32, kwargs in ((x16, x16.astype(np.float32), {}),
                                      (bits, x_from_bits, {"bfloat16_bits": True}),
                                      (x16.astype(np.float64).tolist(), x16.astype(np.float32), {})):
        a = KVCache(1, 2, 64, 4, page_size=4, kv_dtype=kv_dtype)
        b = KVCache(1, 2, 64, 4, page_size=4, kv_dtype=kv_dtype)
        for cache in (a, b):
            cache.add_sequence(0)
        a.store(0, a.append([0], [6]), given, given, **kwargs)
        b.store(0, b.append([0], [6]), as_float32, as_float32)
        np.testing.assert_array_equal(a.kv, b.kv)


@pytest.mark.parametrize("kv_dtype", FORMATS)
def test_gather_in_each_output_dtype(kv_dtype):
    cache, data = filled(kv_dtype, n=5, dim=8)
    full = cache.gather(0, 0, dtype=np.float32)[0]
    half = cache.gather(0, 0, dtype=np.float16)[0]
    brain = cache.gather(0, 0, dtype="bfloat16")[0]
    assert half.dtype == np.float16 and brain.dtype == np.uint16
    np.testing.assert_array_equal(half, full.astype(np.float16))
    np.testing.assert_array_equal(brain, rf.float_to_bf16_bits(full))
    default = cache.gather(0, 0)[0]
    assert default.dtype == (np.dtype(kv_dtype) if kv_dtype in ("float32", "float16") else np.float32)
    with pytest.raises(TypeError, match="dtype"):
        cache.gather(0, 0, dtype=np.float64)


@pytest.mark.parametrize("kv_dtype", ENCODED)
def test_non_finite_rows_decode_to_nan_never_to_finite_values(kv_dtype):
    cache = KVCache(1, 1, 64, 4, page_size=4, kv_dtype=kv_dtype)
    cache.add_sequence(0)
    x = np.ones((3, 1, 64), np.float32)
    x[0, 0, 5] = np.nan
    x[1, 0, 63] = np.inf
    cache.store(0, cache.append([0], [3]), x, x)
    got = cache.gather(0, 0)[0]
    if kv_dtype == "bfloat16":
        assert np.isnan(got[0, 0, 5]) and np.isposinf(got[1, 0, 63]) and (got[2] == 1).all()
    else:
        assert np.isnan(got[:2]).all() and (np.abs(got[2] - 1) < 0.2).all()


def test_bad_bfloat16_input_is_refused_and_nothing_is_written():
    cache = KVCache(1, 1, 4, 4, page_size=4, kv_dtype="int8")
    cache.add_sequence(0)
    slots = cache.append([0], [2])
    before = cache.kv.copy()
    with pytest.raises(TypeError, match="Invalid dtype of k: expected uint16 bfloat16 bit patterns"):
        cache.store(0, slots, np.ones((2, 1, 4), np.float32), np.ones((2, 1, 4), np.uint16), bfloat16_bits=True)
    with pytest.raises(ValueError, match="Invalid shape of v"):
        cache.store(0, slots, np.ones((2, 1, 4), np.uint16), np.ones((2, 1, 5), np.uint16), bfloat16_bits=True)
    with pytest.raises(TypeError, match="bfloat16_bits"):
        cache.store(0, slots, np.ones((2, 1, 4)), np.ones((2, 1, 4)), bfloat16_bits="yes")
    np.testing.assert_array_equal(cache.kv, before)


# -------------------------------------------------------- page operations
@pytest.mark.parametrize("kv_dtype", ENCODED)
def test_fork_copy_on_write_keeps_the_parent_bytes(kv_dtype):
    cache, data = filled(kv_dtype, n=6, dim=64)
    parent = [cache.gather(layer, 0) for layer in range(2)]
    cache.fork(0, 1)
    rng = np.random.default_rng(3)
    slots = cache.append([1], [1])  # writes into the shared last page: copy-on-write
    for layer in range(2):
        cache.store(layer, slots, rows(rng, 1, 2, 64), rows(rng, 1, 2, 64))
        for a, b in zip(parent[layer], cache.gather(layer, 0)):
            np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(cache.gather(layer, 1)[0][:6], parent[layer][0])
    assert cache.stats()["cow_copies"] == 1
    cache.check_invariants()


@pytest.mark.parametrize("kv_dtype", ENCODED)
def test_a_prefix_hit_serves_the_same_bytes(kv_dtype):
    cache, data = filled(kv_dtype, n=12, dim=64, enable_prefix_caching=True)
    cache.append([0], [1])  # seals the third page
    assert cache.add_sequence(1, list(range(12)) + [99]) == 12
    for layer in range(2):
        a, b = cache.gather(layer, 0), cache.gather(layer, 1)
        np.testing.assert_array_equal(a[0][:12], b[0][:12])
        np.testing.assert_array_equal(a[1][:12], b[1][:12])


@pytest.mark.parametrize("kv_dtype", ENCODED)
def test_sliding_window_and_truncate(kv_dtype):
    rng = np.random.default_rng(4)
    cache = KVCache(1, 1, 64, 6, page_size=4, kv_dtype=kv_dtype, window=8, sink_tokens=2)
    cache.add_sequence(0)
    stored = {}
    for step in range(40):
        slots = cache.append([0], [1])
        x = rows(rng, 1, 1, 64)
        cache.store(0, slots, x, -x)
        stored[step] = x[0]
    k, v, positions = cache.gather(0, 0)
    for row, pos in zip(k, positions):
        np.testing.assert_allclose(row, expected(stored[pos], kv_dtype), rtol=0, atol=1e-5)
    cache.truncate(0, 39)
    assert cache.gather(0, 0)[2].max() == 38
    cache.check_invariants()


@pytest.mark.parametrize("kv_dtype", ENCODED)
def test_snapshot_round_trip_is_bit_exact_and_checksums_cover_the_scales(kv_dtype, tmp_path):
    cache, _ = filled(kv_dtype, n=12, dim=64, page_checksums=True)
    cache.append([0], [1])
    path = tmp_path / "cache.pkv"
    cache.save(path)
    loaded = KVCache.load(path)
    assert loaded.kv_dtype == kv_dtype
    np.testing.assert_array_equal(loaded.kv, cache.kv)
    for layer in range(2):
        np.testing.assert_array_equal(loaded.gather(layer, 0)[0], cache.gather(layer, 0)[0])
    # One byte of one scale (the last bytes of a head row) changed in the file: the page is reported.
    page = int(cache.page_table([0]).indices[0])
    raw = bytearray(path.read_bytes())
    row = cache.kv[0, page, 0, 0, 0].view(np.uint8)
    pool = cache.kv.view(np.uint8).reshape(-1)
    offset_in_pool = row.__array_interface__["data"][0] - pool.__array_interface__["data"][0]
    needle = pool.tobytes()
    start = bytes(raw).find(needle)
    assert start >= 0
    raw[start + offset_in_pool + row.size - 1] ^= 0x01
    path.write_bytes(bytes(raw))
    with pytest.raises(SnapshotError, match=f"page {page}"):
        KVCache.load(path)


def test_a_sequence_moves_only_between_caches_of_one_format():
    cache, _ = filled("int8", n=8, dim=64)
    blob = cache.export_sequence(0)
    same = KVCache(2, 2, 64, 32, page_size=4, kv_dtype="int8")
    same.import_sequence(3, blob)
    np.testing.assert_array_equal(same.gather(1, 3)[0], cache.gather(1, 0)[0])
    for other in ("int4", "float16", "bfloat16"):
        target = KVCache(2, 2, 64, 32, page_size=4, kv_dtype=other)
        with pytest.raises(SnapshotError, match=f"dtype 'int8', this cache '{other}'"):
            target.import_sequence(3, blob)
        assert 3 not in target


def test_repr_and_stats_name_the_format():
    cache = KVCache(1, 1, 64, 4, kv_dtype="int4")
    assert "kv_dtype='int4'" in repr(cache)


@pytest.mark.parametrize("kv_dtype", FORMATS)
def test_replay_capacity_arithmetic_matches_the_pool(kv_dtype):
    """``pagedkv replay --capacity-gib`` sizes the pool from the bytes a KVCache of that format takes."""
    from pagedkv.commands._model_options import kv_bytes_per_token

    cache = KVCache(30, 3, 64, 2, page_size=16, kv_dtype=kv_dtype)
    assert kv_bytes_per_token(kv_dtype, 30, 3, 64) * 16 == cache.stats()["bytes_per_page"]
    if kv_dtype in ("int8", "int4"):
        with pytest.raises(ValueError, match="head dim <= 256"):
            kv_bytes_per_token(kv_dtype, 1, 1, 512)
