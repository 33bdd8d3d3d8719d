"""Prefix-cache hash domains: token-keyed and block-keyed pages never meet.

The hashed byte strings come from ``pagedkv_c._prefix.token_page_input`` and
``block_page_input``, the writers the hash chain itself uses; the first tests
tie them to the hashes the index records. The oracle of the cache-level test
is a cold computation: every K/V row a request reads, served from cache or
not, must equal what the request would compute itself, a pure function of its
domain, salt and content up to that position.
"""
import hashlib

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings, strategies as st

from pagedkv import KVCache
from pagedkv_c._prefix import block_page_input, salt_digest, token_page_input

INT32 = (-2**31, 2**31 - 1)
INT64 = (-2**63, 2**63 - 1)


def int32(x):
    return (x + 2**31) % 2**32 - 2**31


def int64(x):
    return (x + 2**63) % 2**64 - 2**63


def new_cache(page_size, **kwargs):
    return KVCache(num_layers=1, num_kv_heads=1, head_dim=2, num_pages=64, page_size=page_size,
                   dtype=np.float32, enable_prefix_caching=True, **kwargs)


# ------------------------------------------------------------ the reported case
def test_issue_case_token_page_never_serves_a_block_request():
    cache = new_cache(4)
    cache.add_sequence(0, [7, 5, 0, -1, 1, 2, 3, 4, 9])
    cache.append([0], [9], return_slot_mapping=False)
    assert cache.prefix_index.num_cached == 2
    block = (5 << 32) | 7
    assert cache.add_sequence(1, block_hashes=[block, 11, 12], block_tokens=4, num_prompt_tokens=12) == 0
    cache.check_invariants()


def test_issue_case_block_page_never_serves_a_token_request():
    cache = new_cache(4)
    block = (5 << 32) | 7
    cache.add_sequence(0, block_hashes=[block, 11, 12], block_tokens=4, num_prompt_tokens=12)
    cache.append([0], [12], return_slot_mapping=False)
    assert cache.prefix_index.num_cached == 3
    assert cache.add_sequence(1, [7, 5, 0, -1, 1, 2, 3, 4, 9]) == 0
    # the block request itself still hits
    assert cache.add_sequence(2, block_hashes=[block, 11, 12], block_tokens=4, num_prompt_tokens=12) == 8
    cache.check_invariants()


def test_issue_case_bytes_differ():
    tokens = token_page_input(0, 0, [7, 5, 0, -1])
    block = block_page_input(0, 0, (5 << 32) | 7, 0, 1)
    assert len(tokens) == 48 and len(block) == 49 and block[-1:] == b"B"
    assert tokens != block


# ------------------------------------------------------------ bytes = recorded hashes
@pytest.mark.parametrize("extra_key", [None, 3, "tenant", b"tenant"])
def test_token_hashes_are_xxh3_of_the_documented_bytes(extra_key):
    page_size = 3
    prompt = [2**31 - 1, -2**31, -1, 0, 1, 5, 6, 7, 8, 9]
    cache = new_cache(page_size)
    cache.add_sequence(0, prompt, extra_key)
    cache.append([0], [len(prompt)], return_slot_mapping=False)
    salt = salt_digest("xxh3_128", extra_key)
    parent = 0
    pages = cache.page_table([0]).indices.tolist()
    for k in range(len(prompt) // page_size):
        data = token_page_input(parent, salt, prompt[k * page_size:(k + 1) * page_size])
        assert len(data) == 32 + 4 * page_size
        parent = xxhash.xxh3_128_intdigest(data)
        assert cache.prefix_index.page_hash(pages[k]) == parent


def test_token_hashes_are_unchanged():
    # Values recorded with the layout of token-keyed pages before block-keyed
    # pages got their own input length: cached token hashes stay valid.
    cache = new_cache(4)
    cache.add_sequence(0, [1, 2, 3, 4, -1, 2**31 - 1, -2**31, 0, 5], "tenant")
    cache.append([0], [9], return_slot_mapping=False)
    pages = cache.page_table([0]).indices[:2]
    assert [cache.prefix_index.page_hash(p) for p in pages] == [
        0x65490c90ec37ee63d312e618296b273a, 0x478b48b73a32377bf2a2e6a5c6594153]


@pytest.mark.parametrize("extra_key", [None, -1, "tenant"])
def test_block_hashes_are_xxh3_of_the_documented_bytes(extra_key):
    page_size, block_tokens = 2, 4
    blocks = [2**63 - 1, -2**63, -1, 0]
    cache = new_cache(page_size)
    cache.add_sequence(0, block_hashes=blocks, block_tokens=block_tokens, num_prompt_tokens=15,
                       extra_key=extra_key)
    cache.append([0], [15], return_slot_mapping=False)
    salt = salt_digest("xxh3_128", extra_key)
    parent = 0
    pages = cache.page_table([0]).indices.tolist()
    for k in range(15 // page_size):
        data = block_page_input(parent, salt, blocks[k // 2], k % 2, 2)
        assert len(data) == 49
        parent = xxhash.xxh3_128_intdigest(data)
        assert cache.prefix_index.page_hash(pages[k]) == parent


def test_uint64_block_ids_hash_as_their_int64_bits():
    assert block_page_input(1, 2, 2**64 - 1, 0, 1) == block_page_input(1, 2, -1, 0, 1)


# ------------------------------------------------------------ no two inputs share bytes
token_id = st.one_of(st.sampled_from([INT32[0], INT32[0] + 1, -1, 0, 1, INT32[1] - 1, INT32[1]]),
                     st.integers(*INT32))
block_id = st.one_of(st.sampled_from([INT64[0], -1, 0, 1, (5 << 32) | 7, 2**32 - 1, 2**32, INT64[1]]),
                     st.integers(*INT64))
hash128 = st.one_of(st.sampled_from([0, 1, 2**64 - 1, 2**64, 2**128 - 1]), st.integers(0, 2**128 - 1))
salt_key = st.one_of(st.none(), st.integers(-3, 3), st.sampled_from(["", "1", "-1", b"", b"1", b"-1"]),
                     st.text(max_size=4), st.binary(max_size=4), st.integers(*INT64))
token_page = st.tuples(st.just("t"), hash128, hash128, st.lists(token_id, min_size=1, max_size=8).map(tuple))
block_page = st.tuples(st.just("b"), hash128, hash128, block_id, st.integers(0, 2**31 - 1),
                       st.integers(1, 2**31 - 1))
page = st.one_of(token_page, block_page)


def page_bytes(desc):
    if desc[0] == "t":
        return token_page_input(desc[1], desc[2], list(desc[3]))
    return block_page_input(desc[1], desc[2], desc[3], desc[4], desc[5])


def forgeries(desc):
    """Inputs of the other domain (and neighbours) read from the same bytes."""
    data = page_bytes(desc)
    words = data[32:len(data) - len(data) % 4] or data[32:36].ljust(4, b"\0")
    tokens = tuple(int(t) for t in np.frombuffer(words.ljust(4, b"\0"), "<i4"))
    out = [("t", desc[1], desc[2], tokens), ("t", desc[1], desc[2], tokens + (-1,))]
    if desc[0] == "t" and len(desc[3]) >= 2:
        t = desc[3]
        out.append(("b", desc[1], desc[2], int64((t[1] << 32) | (t[0] & 0xFFFFFFFF)),
                    (t[2] & 0xFFFFFFFF) if len(t) > 2 and t[2] >= 0 else 0,
                    (t[3] & 0x7FFFFFFF) or 1 if len(t) > 3 else 1))
        out.append(("t", desc[1], desc[2], t[:-1] + (int32(t[-1] + 1),)))
    if desc[0] == "b":
        out.append(("b", desc[1], desc[2], desc[3], (desc[4] + 1) % 2**31, desc[5]))
        out.append(("b", desc[1], desc[2], int64(desc[3] + 1), desc[4], desc[5]))
        # The same block id and index over blocks of another size: other content.
        out.append(("b", desc[1], desc[2], desc[3], desc[4], desc[5] % (2**31 - 1) + 1))
    return out


@settings(max_examples=300, deadline=None)
@given(page, page)
def test_no_two_page_inputs_share_bytes(a, b):
    for x, y in [(a, b)] + [(a, f) for f in forgeries(a)]:
        assert (page_bytes(x) == page_bytes(y)) == (x == y), (x, y)


@settings(max_examples=50, deadline=None)
@given(st.lists(salt_key, min_size=2, max_size=6, unique_by=lambda k: (type(k), k)))
def test_distinct_salts_have_distinct_digests(keys):
    for algorithm in ("xxh3_128", "sha256"):
        digests = [salt_digest(algorithm, k) for k in keys]
        assert len(set(digests)) == len(keys)


# ------------------------------------------------------------ a hit equals a cold computation
def cold_kv(domain, salt, content, position):
    """K and V of ``position``: a function of the domain, salt and content up to it."""
    digest = hashlib.blake2b(repr((domain, type(salt).__name__, salt, content, position)).encode(),
                             digest_size=12).digest()
    values = np.frombuffer(digest, "<u4") % 2**24  # exact in float32
    return values[:2].astype(np.float32), (values[1:] + 7).astype(np.float32)


def token_content(tokens, position):
    return tuple(tokens[:position + 1])


def block_content(blocks, block_tokens, position):
    return tuple(blocks[:position // block_tokens + 1])


request = st.one_of(
    st.tuples(st.just("token"), st.lists(token_id, min_size=1, max_size=12), salt_key),
    st.tuples(st.just("block"), st.lists(block_id, min_size=1, max_size=4), salt_key,
              st.integers(1, 16)),
    # the other domain's bytes, read back: token pages [a, b, 0, -1, ...] (a
    # block id's two halves, index 0 and the tag -1 of the old layout), then a
    # block request whose first id is (b << 32) | a, and the reverse
    st.tuples(st.just("token_tagged"), token_id, token_id, st.lists(token_id, max_size=8), salt_key),
    st.tuples(st.just("token_from_last_block"), st.lists(token_id, max_size=8), salt_key),
    st.tuples(st.just("block_from_last_tokens"), st.lists(block_id, min_size=1, max_size=3), salt_key,
              st.integers(1, 16)),
)


@settings(max_examples=150, deadline=None)
@given(page_size=st.sampled_from([1, 2, 4]), pages_per_block=st.sampled_from([1, 2]),
       requests=st.lists(request, min_size=1, max_size=10), same_salt=st.booleans())
def test_a_prefix_hit_equals_a_cold_computation(page_size, pages_per_block, requests, same_salt):
    cache = new_cache(page_size)
    block_tokens = page_size * pages_per_block
    last_tokens, last_blocks = [0, 0], [0]
    for seq_id, req in enumerate(requests):
        kind, salt = req[0], None
        if kind == "token":
            tokens, salt = req[1], req[2]
        elif kind == "token_tagged":
            tokens, salt = [req[1], req[2], 0, -1] + req[3], req[4]
        elif kind == "token_from_last_block":
            b = last_blocks[0] & 0xFFFFFFFFFFFFFFFF
            tokens = [int32(b & 0xFFFFFFFF), int32(b >> 32), 0, -1] + req[1]
            salt = req[2]
        elif kind == "block":
            blocks, salt, length = req[1], req[2], req[3]
        else:
            t = last_tokens + [0, 0]
            blocks = [int64((t[1] << 32) | (t[0] & 0xFFFFFFFF))] + req[1]
            salt, length = req[2], req[3]
        if same_salt:
            salt = None
        if kind.startswith("token"):
            length = len(tokens)
            hit = cache.add_sequence(seq_id, tokens, salt)
            content = lambda p, tokens=tokens: ("token", token_content(tokens, p))
            last_tokens = tokens
        else:
            length = min(length, len(blocks) * block_tokens)
            hit = cache.add_sequence(seq_id, block_hashes=blocks, block_tokens=block_tokens,
                                     num_prompt_tokens=length, extra_key=salt)
            content = lambda p, blocks=blocks: ("block", block_content(blocks, block_tokens, p))
            last_blocks = blocks
        assert hit % page_size == 0 and 0 <= hit < max(length, 1)
        slots = cache.append([seq_id], [length - hit])
        rows = [cold_kv(*content(p)[:1], salt, content(p)[1], p) for p in range(hit, length)]
        if rows:
            k = np.stack([r[0] for r in rows])[:, None, :]
            v = np.stack([r[1] for r in rows])[:, None, :]
            cache.store(0, slots, k, v)
        k, v, positions = cache.gather(0, seq_id)
        assert positions.tolist() == list(range(length))
        for p in range(length):
            want_k, want_v = cold_kv(*content(p)[:1], salt, content(p)[1], p)
            assert np.array_equal(k[p, 0], want_k) and np.array_equal(v[p, 0], want_v), (p, hit)
        cache.check_invariants()
        cache.remove_sequence(seq_id)


def test_a_block_id_over_blocks_of_another_size_is_no_hit():
    """Block id 3 over 5-token blocks and over 10-token blocks names different content:
    the first page of one must not serve the other (pages per block are hashed)."""
    cache = new_cache(5)
    cache.add_sequence(1, block_hashes=[3, 2], block_tokens=5, num_prompt_tokens=10, extra_key=1)
    cache.append([1], [10], return_slot_mapping=False)
    assert cache.add_sequence(4, block_hashes=[3, 4], block_tokens=10, num_prompt_tokens=20, extra_key=1) == 0
    # The same block size still hits.
    assert cache.add_sequence(5, block_hashes=[3, 2], block_tokens=5, num_prompt_tokens=10, extra_key=1) == 5
    cache.check_invariants()
