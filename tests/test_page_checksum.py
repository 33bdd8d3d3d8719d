"""Page checksums of the core (pagedkv_c._checksum) against the xxHash library.

The reference computes the agreed definition with the Python ``xxhash``
package: for each layer, the 16-byte digest of XXH3-128 over the page's
bytes in that layer (K then V, as laid out in the pool); the checksum is the
low 64 bits of XXH3-128 over the concatenated digests.
"""
import numpy as np
import pytest
import xxhash

from pagedkv_c._checksum import page_checksums


def reference_checksum(kv, page_id):
    digests = b"".join(xxhash.xxh3_128(kv[layer, page_id].tobytes()).digest() for layer in range(kv.shape[0]))
    return xxhash.xxh3_128(digests).intdigest() & (2**64 - 1)


def random_pool(seed, num_layers, num_pages, page_size, num_kv_heads, head_dim, dtype):
    rng = np.random.default_rng(seed)
    shape = (num_layers, num_pages, 2, page_size, num_kv_heads, head_dim)
    return rng.standard_normal(shape).astype(dtype)


# (num_layers, num_pages, page_size, num_kv_heads, head_dim): page bytes from 4
# (float16, one token of one value) through every XXH3 size class to many KB.
LAYOUTS = [
    (0, 3, 4, 2, 8),
    (1, 1, 1, 1, 1),
    (1, 5, 1, 2, 4),
    (2, 4, 4, 1, 2),
    (3, 6, 16, 2, 8),
    (30, 3, 16, 3, 64),
    (4, 7, 2, 1, 60),
]


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_checksums_match_xxhash_reference(layout, dtype):
    kv = random_pool(sum(layout), *layout, dtype)
    num_pages = layout[1]
    ids = list(range(num_pages)) + [num_pages - 1, 0]
    got = page_checksums(kv, ids)
    assert got.dtype == np.uint64 and got.shape == (len(ids),)
    assert [int(c) for c in got] == [reference_checksum(kv, p) for p in ids]


def test_zero_layers_is_the_hash_of_the_empty_string():
    kv = np.zeros((0, 2, 2, 4, 1, 8), dtype=np.float32)
    expected = xxhash.xxh3_128(b"").intdigest() & (2**64 - 1)
    assert page_checksums(kv, [0, 1]).tolist() == [expected, expected]


def test_one_flipped_bit_changes_only_that_pages_checksum():
    kv = random_pool(7, 3, 5, 4, 2, 8, np.float16)
    before = page_checksums(kv, np.arange(5))
    raw = kv.view(np.uint8)
    raw[2, 3, 1, 2, 1, 5] ^= 0x10  # layer 2, page 3, V
    after = page_checksums(kv, np.arange(5))
    assert (after != before).tolist() == [False, False, False, True, False]
    assert int(after[3]) == reference_checksum(kv, 3)


def test_empty_ids_and_readonly_pool():
    kv = random_pool(3, 2, 3, 2, 1, 4, np.float32)
    kv.flags.writeable = False
    assert page_checksums(kv, []).shape == (0,)
    assert int(page_checksums(kv, np.array([2], dtype=np.uint8))[0]) == reference_checksum(kv, 2)


def test_pool_of_a_kvcache():
    from pagedkv import KVCache

    cache = KVCache(num_layers=2, num_pages=4, num_kv_heads=2, head_dim=4, page_size=2, dtype=np.float16)
    cache.kv[...] = random_pool(11, 2, 4, 2, 2, 4, np.float16)
    assert [int(c) for c in page_checksums(cache.kv, [0, 3])] == [reference_checksum(cache.kv, p) for p in (0, 3)]


@pytest.mark.parametrize(
    ("kv", "error", "match"),
    [
        ([[1.0]], TypeError, "Invalid type of kv: expected numpy.ndarray"),
        (np.zeros((1, 2, 2, 1, 1, 1), dtype=np.float64), TypeError, "Invalid dtype of kv: expected float16, float32, uint16 or uint8"),
        (np.zeros((1, 2, 2, 1, 1), dtype=np.float32), ValueError, "Invalid shape of kv"),
        (np.zeros((1, 2, 3, 1, 1, 1), dtype=np.float32), ValueError, "Invalid shape of kv"),
        (np.zeros((1, 2, 2, 2, 1, 2), dtype=np.float32)[..., :1], ValueError, "Invalid layout of kv"),
    ],
)
def test_bad_pool_is_refused(kv, error, match):
    with pytest.raises(error, match=match):
        page_checksums(kv, [0])


@pytest.mark.parametrize(
    ("ids", "error", "match"),
    [
        ([2], ValueError, r"Invalid value of page_ids: expected page ids in \[0, 1\], got 2"),
        ([-1, 0], ValueError, r"Invalid value of page_ids: expected page ids in \[0, 1\], got -1"),
        ([0.0], TypeError, "Invalid dtype of page_ids"),
        ([[0]], ValueError, "Invalid shape of page_ids"),
        (None, TypeError, "Invalid type of page_ids"),
        ([2**40], ValueError, "Invalid value of page_ids"),
    ],
)
def test_bad_page_ids_are_refused(ids, error, match):
    kv = np.zeros((1, 2, 2, 1, 1, 1), dtype=np.float32)
    with pytest.raises(error, match=match):
        page_checksums(kv, ids)


def test_pool_without_pages_refuses_every_id():
    kv = np.zeros((2, 0, 2, 4, 1, 8), dtype=np.float32)
    assert page_checksums(kv, []).shape == (0,)
    with pytest.raises(ValueError, match=r"expected page ids in \[0, -1\], got 0"):
        page_checksums(kv, [0])
