"""KVCache._take_sealed_copies (the shared tier's offload: drain the sealed-page log and copy the
pages in one hold of the lock) and pagedkv_c._tier_io (checksums of page values), against the
pool's own bytes, the prefix index's hashes and pagedkv_c._checksum.page_checksums."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv import KVCache
from pagedkv_c._checksum import page_checksums
from pagedkv_c._tier_io import record_checksums

LAYERS, HEADS, DIM, PS = 3, 2, 8, 4


def _cache(num_pages=32, **kwargs):
    cache = KVCache(LAYERS, HEADS, DIM, num_pages, page_size=PS, enable_prefix_caching=True, **kwargs)
    cache._enable_sealed_log(True, num_pages)
    return cache


def _fill(cache, seq_id, num_tokens, seed):
    rng = np.random.default_rng(seed)
    slots = cache.append([seq_id], [num_tokens])
    for layer in range(cache.num_layers):
        cache.store(layer, slots, rng.standard_normal((num_tokens, HEADS, DIM), dtype=np.float32),
                    rng.standard_normal((num_tokens, HEADS, DIM), dtype=np.float32))


def _buffers(cache, rows, gap=5):
    """Rows of [gap | token ids | gap | body | gap] bytes, so that writes outside the ranges show."""
    body = cache.stats()["bytes_per_page"]
    token_offset, body_offset = gap, gap + 4 * PS + gap
    records = np.full((rows, body_offset + body + gap), 0xAB, dtype=np.uint8)
    return records, np.zeros((rows, 2), dtype=np.uint64), token_offset, body_offset, body


def _expected(cache, page_ids):
    """What the log should give for these pages: body bytes, token ids, hash (lo, hi)."""
    out = []
    for p in page_ids:
        body = np.ascontiguousarray(cache.kv[:, p]).view(np.uint8).reshape(-1)
        h = cache.prefix_index.page_hash(int(p))
        out.append((body, cache.prefix_index.token_table()[p].copy(), (h & (2**64 - 1), h >> 64)))
    return out


def test_copies_equal_the_sealed_pages_and_the_log_empties():
    cache = _cache()
    prompt = np.arange(3 * PS + 2, dtype=np.int32)
    cache.add_sequence(0, prompt)
    _fill(cache, 0, len(prompt), 0)
    cache.seal()
    full = cache.page_table([0]).indices[:3]
    expected = _expected(cache, full)
    records, hashes, token_offset, body_offset, body = _buffers(cache, 8)
    taken, discarded = cache._take_sealed_copies(records, token_offset, body_offset, hashes)
    assert (taken, discarded) == (3, 0)
    for k, (want_body, want_tokens, want_hash) in enumerate(expected):
        assert np.array_equal(records[k, body_offset:body_offset + body], want_body)
        assert np.array_equal(records[k, token_offset:token_offset + 4 * PS].view(np.int32), want_tokens)
        assert tuple(int(x) for x in hashes[k]) == want_hash
        # Bytes outside the two ranges are left alone.
        assert (records[k, :token_offset] == 0xAB).all() and (records[k, body_offset + body:] == 0xAB).all()
        assert (records[k, token_offset + 4 * PS:body_offset] == 0xAB).all()
    assert (records[3:] == 0xAB).all()
    assert cache._take_sealed_copies(records, token_offset, body_offset, hashes) == (0, 0)
    assert cache._sealed_log_stats()["pending"] == 0


def test_pages_beyond_the_buffer_wait_or_are_discarded():
    cache = _cache()
    prompt = np.arange(7 * PS, dtype=np.int32)
    cache.add_sequence(0, prompt)
    _fill(cache, 0, len(prompt), 1)
    cache.seal()
    full = cache.page_table([0]).indices[:7]
    expected = _expected(cache, full)
    records, hashes, token_offset, body_offset, body = _buffers(cache, 2)
    for first in (0, 2):  # the first pages in seal order, then the next ones: the rest stays pending
        assert cache._take_sealed_copies(records, token_offset, body_offset, hashes) == (2, 0)
        for k in range(2):
            assert np.array_equal(records[k, body_offset:body_offset + body], expected[first + k][0])
            assert tuple(int(x) for x in hashes[k]) == expected[first + k][2]
    assert cache._sealed_log_stats()["pending"] == 3
    assert cache._take_sealed_copies(records[:1], token_offset, body_offset, hashes[:1], discard_rest=True) == (1, 2)
    assert np.array_equal(records[0, body_offset:body_offset + body], expected[4][0])
    assert cache._sealed_log_stats()["pending"] == 0


def test_seals_that_find_the_log_full_are_reported_once():
    cache = KVCache(LAYERS, HEADS, DIM, 32, page_size=PS, enable_prefix_caching=True)
    cache._enable_sealed_log(True, 2)
    cache.add_sequence(0, np.arange(5 * PS, dtype=np.int32))
    _fill(cache, 0, 5 * PS, 5)
    cache.seal()
    records, hashes, token_offset, body_offset, body = _buffers(cache, 8)
    assert cache._take_sealed_copies(records, token_offset, body_offset, hashes) == (2, 3)
    assert cache._take_sealed_copies(records, token_offset, body_offset, hashes) == (0, 0)


def test_a_page_written_again_is_not_copied():
    """Truncating into a sealed page and appending withdraws its entry: no copy holds bytes of
    another write. The page released by the truncation keeps its sealed bytes and its entry."""
    cache = _cache()
    cache.add_sequence(0, np.arange(3 * PS, dtype=np.int32))
    _fill(cache, 0, 3 * PS, 2)
    cache.seal()
    full = cache.page_table([0]).indices[:3]
    expected = _expected(cache, full)
    cache.truncate(0, PS + 1)  # pages 1 and 2 of the sequence are no longer complete
    _fill(cache, 0, 1, 3)  # the append hands out page 1's slots again: its seal and entry go
    records, hashes, token_offset, body_offset, body = _buffers(cache, 4)
    assert cache._take_sealed_copies(records, token_offset, body_offset, hashes) == (2, 0)
    for k, page in enumerate((0, 2)):
        assert np.array_equal(records[k, body_offset:body_offset + body], expected[page][0])
        assert tuple(int(x) for x in hashes[k]) == expected[page][2]


def test_bad_buffers_raise_and_take_nothing():
    cache = _cache()
    cache.add_sequence(0, np.arange(2 * PS, dtype=np.int32))
    _fill(cache, 0, 2 * PS, 4)
    cache.seal()
    records, hashes, token_offset, body_offset, body = _buffers(cache, 4)
    with pytest.raises(TypeError, match="records"):
        cache._take_sealed_copies(records.view(np.int8), token_offset, body_offset, hashes)
    with pytest.raises(ValueError, match="records"):
        cache._take_sealed_copies(records[:, ::2], token_offset, body_offset, hashes)
    with pytest.raises(ValueError, match="page_hashes"):
        cache._take_sealed_copies(records, token_offset, body_offset, hashes[:3])
    with pytest.raises(TypeError, match="page_hashes"):
        cache._take_sealed_copies(records, token_offset, body_offset, hashes.view(np.int64))
    with pytest.raises(ValueError, match="body_offset"):
        cache._take_sealed_copies(records, token_offset, records.shape[1] - body + 1, hashes)
    with pytest.raises(ValueError, match="token_offset"):
        cache._take_sealed_copies(records, -1, body_offset, hashes)
    with pytest.raises(ValueError, match="overlaps"):
        cache._take_sealed_copies(records, body_offset, body_offset, hashes)
    frozen = records.copy()
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="writable"):
        cache._take_sealed_copies(frozen, token_offset, body_offset, hashes)
    assert cache._sealed_log_stats()["pending"] == 2
    assert cache._take_sealed_copies(records, token_offset, body_offset, hashes) == (2, 0)
    plain = KVCache(LAYERS, HEADS, DIM, 8, page_size=PS, enable_prefix_caching=True)
    with pytest.raises(RuntimeError, match="not enabled"):
        plain._take_sealed_copies(records, token_offset, body_offset, hashes)


@settings(max_examples=25, deadline=None)
@given(layers=st.integers(0, 4), num_pages=st.integers(0, 5), seed=st.integers(0, 2**32 - 1))
def test_value_checksums_equal_the_pool_checksum(layers, num_pages, seed):
    """A body laid out as a one-page pool has that pool's page checksum, wherever it lies."""
    rng = np.random.default_rng(seed)
    pool = rng.standard_normal((layers, num_pages, 2, PS, HEADS, DIM)).astype(np.float16)
    want = page_checksums(pool, np.arange(num_pages))
    page_bytes = 2 * PS * HEADS * DIM * 2
    bodies = [np.ascontiguousarray(pool[:, p]).view(np.uint8).reshape(-1) for p in range(num_pages)]
    offset = int(rng.integers(0, 9))
    records = np.zeros((num_pages, offset + layers * page_bytes + 3), dtype=np.uint8)
    for p, body in enumerate(bodies):
        records[p, offset:offset + body.size] = body
    assert np.array_equal(record_checksums(records, offset, layers, page_bytes), want)


def test_checksum_helpers_check_their_arguments():
    page_bytes = 2 * PS * HEADS * DIM * 2
    with pytest.raises(ValueError, match="body_offset"):
        record_checksums(np.zeros((2, page_bytes), dtype=np.uint8), 1, 1, page_bytes)
    with pytest.raises(ValueError, match="records"):
        record_checksums(np.zeros((2, page_bytes - 1), dtype=np.uint8), 0, 1, page_bytes)
    with pytest.raises(TypeError, match="records"):
        record_checksums(np.zeros((2, page_bytes), dtype=np.int16), 0, 1, page_bytes)


@settings(max_examples=40, deadline=None)
@given(layers=st.integers(0, 3), num_pages=st.integers(1, 4), with_tokens=st.booleans(),
       damage=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 2**20), st.integers(1, 255)), max_size=3),
       seed=st.integers(0, 2**32 - 1))
def test_page_value_checker_agrees_with_the_reference(layers, num_pages, with_tokens, damage, seed):
    """PageValueChecker accepts a row exactly when the format's reference check (check_value) passes
    and the stated checksum is the pool's page checksum, whichever byte of a row is damaged (header,
    hash, token ids, any layer of the body)."""
    from pagedkv.tiers._format import CHECKSUM_OFFSET, HASH_OFFSET, PageLayout, check_value, encode_header, \
        expected_header
    from pagedkv_c._tier_io import PageValueChecker

    rng = np.random.default_rng(seed)
    layout = PageLayout.of_cache(layers, HEADS, DIM, PS, np.float16, "xxh3_128")
    pool = rng.standard_normal((layers, num_pages, 2, PS, HEADS, DIM)).astype(np.float16)
    sums = page_checksums(pool, np.arange(num_pages))
    hashes = rng.integers(0, 2**63, size=(num_pages, 2), dtype=np.int64).astype(np.uint64)
    tokens = rng.integers(0, 50000, size=(num_pages, PS)).astype(np.int32) if with_tokens else None
    values = [encode_header(layout, hashes[p], None if tokens is None else tokens[p], sums[p])
              + np.ascontiguousarray(pool[:, p]).tobytes() for p in range(num_pages)]
    records = np.frombuffer(b"".join(values), dtype=np.uint8).reshape(num_pages, -1).copy()
    for row, at, flip in damage:
        if row < num_pages:
            records[row, at % records.shape[1]] ^= flip
    checker = PageValueChecker(records, expected_header(layout, with_tokens), HASH_OFFSET, CHECKSUM_OFFSET,
                               hashes, tokens, layers, layout.page_bytes)
    assert checker.body_offset == len(values[0]) - layout.body_bytes
    for p in range(num_pages):
        kind, offset, stated = check_value(records[p].tobytes(), layout, hashes[p],
                                           None if tokens is None else tokens[p])
        body = np.ascontiguousarray(records[p, checker.body_offset:]).view(np.float16)
        actual = page_checksums(body.reshape(layers, 1, 2, PS, HEADS, DIM), [0])[0]
        want = kind is None and stated == actual
        assert checker.check(p) == want
        if want:
            assert checker.checksums[p] == actual
    if not damage:
        assert all(checker.check(p) for p in range(num_pages)) and np.array_equal(checker.checksums, sums)
    with pytest.raises(ValueError, match="row"):
        checker.check(num_pages)
    with pytest.raises(ValueError, match="records"):
        PageValueChecker(records[:, 1:].copy(), expected_header(layout, with_tokens), HASH_OFFSET, CHECKSUM_OFFSET,
                         hashes, tokens, layers, layout.page_bytes)
    with pytest.raises(ValueError, match="page_hashes"):
        PageValueChecker(records, expected_header(layout, with_tokens), HASH_OFFSET, CHECKSUM_OFFSET,
                         hashes[:0], tokens, layers, layout.page_bytes)
