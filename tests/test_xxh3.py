"""XXH3-128 of the core (pagedkv_c/xxh3.h) against the xxHash library's digests.

The reference is the Python ``xxhash`` package (the xxHash library's own C
code): every input length from 0 to 1024 bytes covers each size class of the
algorithm (0, 1-3, 4-8, 9-16, 17-128, 129-240 and over 240 bytes) and every
remainder of a 64-byte stripe; longer inputs cover several 1024-byte blocks,
a block boundary and a last stripe that overlaps the previous block.
"""
import struct

import numpy as np
import pytest
import xxhash

import pagedkv
from pagedkv_c._prefix import xxh3_128_intdigest


def random_bytes(seed, length):
    return np.random.default_rng(seed).integers(0, 256, size=length, dtype=np.uint8).tobytes()


def test_every_length_up_to_1024_bytes_matches_xxhash():
    for length in range(1025):
        for seed in (1, 2):
            data = random_bytes(1000 * length + seed, length)
            assert xxh3_128_intdigest(data) == xxhash.xxh3_128_intdigest(data), (length, seed)


@pytest.mark.parametrize("length", [1025, 1087, 1088, 2047, 2048, 2049, 3000, 4096, 10_000, 65_536 + 13, 1 << 20])
def test_long_inputs_match_xxhash(length):
    data = random_bytes(length, length)
    assert xxh3_128_intdigest(data) == xxhash.xxh3_128_intdigest(data)


@pytest.mark.parametrize("byte", [0x00, 0xFF])
@pytest.mark.parametrize("length", [0, 1, 3, 4, 8, 9, 16, 17, 128, 129, 240, 241, 1024, 1025])
def test_constant_inputs_match_xxhash(byte, length):
    """All-zero and all-one inputs: carries through every 64-bit addition and product."""
    data = bytes([byte]) * length
    assert xxh3_128_intdigest(data) == xxhash.xxh3_128_intdigest(data)


def test_published_digest_of_the_empty_input():
    """XXH3_128bits("") of xxHash 0.8 (its high and low 64-bit halves)."""
    assert xxh3_128_intdigest(b"") == 0x99AA06D3014798D86001C324468D497F


def test_accepts_bytes_like_inputs():
    data = random_bytes(7, 300)
    expected = xxhash.xxh3_128_intdigest(data)
    assert xxh3_128_intdigest(bytearray(data)) == expected
    assert xxh3_128_intdigest(memoryview(data)) == expected
    assert xxh3_128_intdigest(np.frombuffer(data, dtype=np.uint8)) == expected


@pytest.mark.parametrize("page_size", [1, 16, 64, 300])
def test_token_page_hashes_are_xxh3_of_the_documented_bytes(page_size):
    """Page hashes of 36, 96, 288 and 1232 bytes (every size class from 17 bytes
    on) equal XXH3-128 of parent, salt and token ids computed by xxhash."""
    num_pages = 3
    cache = pagedkv.KVCache(1, 1, 8, 2 * num_pages, page_size=page_size, dtype=np.float32,
                            enable_prefix_caching=True)
    prompt = np.random.default_rng(page_size).integers(0, 50_000, size=num_pages * page_size).tolist()
    cache.add_sequence(0, prompt)
    cache.append([0], [len(prompt)])
    table = cache.page_table([0])
    parent = 0
    for k in range(num_pages):
        data = struct.pack("<QQQQ", parent & (2**64 - 1), parent >> 64, 0, 0)
        data += np.asarray(prompt[k * page_size:(k + 1) * page_size], "<i4").tobytes()
        parent = xxhash.xxh3_128_intdigest(data)
        assert cache.prefix_index.page_hash(int(table.indices[k])) == parent, k
