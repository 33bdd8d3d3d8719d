"""Prefix caching in KVCache.

The oracle: a cached page must hold exactly the K/V that recomputing its
tokens would give. Tests store K/V that are a pure function of the token
prefix (``kv_of``), so a page served from cache is right iff it equals that
function of the new request's own tokens.
"""
import hashlib
import struct

import numpy as np
import pytest
import xxhash
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagedkv import KVCache, OutOfPagesError

HEADS, DIM = 1, 4


def kv_of(tokens, position):
    """K/V of ``position`` given the sequence's tokens: a function of the prefix up to it."""
    digest = hashlib.blake2b(np.asarray(tokens[: position + 1], np.int64).tobytes(), digest_size=8).digest()
    rng = np.random.default_rng(int.from_bytes(digest, "little"))
    k = rng.standard_normal((HEADS, DIM)).astype(np.float32)
    return k, -k


def feed(cache, seq_id, tokens, start, stop, token_ids=True):
    """Append tokens[start:stop] to a sequence, storing their K/V."""
    n = stop - start
    slots = cache.append([seq_id], [n], token_ids=tokens[start:stop] if token_ids else None)
    if cache.num_layers and n:
        rows = [kv_of(tokens, p) for p in range(start, stop)]
        cache.store(0, slots, np.stack([r[0] for r in rows]), np.stack([r[1] for r in rows]))
    return slots


def start(cache, seq_id, prompt, extra_key=None):
    """Add a sequence with its prompt, compute the uncached part; return tokens served."""
    cached = cache.add_sequence(seq_id, prompt, extra_key)
    assert cache.seq_len(seq_id) == cached
    feed(cache, seq_id, prompt, cached, len(prompt), token_ids=False)
    return cached


def assert_kv_matches_tokens(cache, seq_id, tokens):
    keys, values, positions = cache.gather(0, seq_id)
    for row_k, row_v, pos in zip(keys, values, positions):
        want_k, want_v = kv_of(tokens, int(pos))
        np.testing.assert_array_equal(row_k, want_k)
        np.testing.assert_array_equal(row_v, want_v)


def make(num_pages=32, page_size=4, **kwargs):
    return KVCache(1, HEADS, DIM, num_pages, page_size=page_size, dtype=np.float32,
                   enable_prefix_caching=True, **kwargs)


# ----------------------------------------------------------------- hashing
def test_page_hashes_are_xxh3_128_chained_on_parent_salt_and_tokens():
    """Recompute the documented hash chain with the Python xxhash package."""
    cache = make(page_size=4)
    prompt = list(range(7, 7 + 13))
    cache.add_sequence(0, prompt, extra_key="tenant-a")
    cache.append([0], [13])
    salt = xxhash.xxh3_128_intdigest(b"pagedkv-salt\x00" + b"s" + b"tenant-a")
    parent = 0
    index = cache.prefix_index
    table = cache.page_table([0])
    for k in range(3):
        data = struct.pack("<QQQQ", parent & (2**64 - 1), parent >> 64, salt & (2**64 - 1), salt >> 64)
        data += np.asarray(prompt[4 * k: 4 * k + 4], "<i4").tobytes()
        parent = xxhash.xxh3_128_intdigest(data)
        assert index.page_hash(int(table.indices[k])) == parent
    assert index.page_hash(int(table.indices[3])) is None  # partial page: not cached
    assert cache.add_sequence(1, prompt, extra_key="tenant-a") == 12
    assert cache.add_sequence(2, prompt) == 0


def test_tokens_appended_to_a_sequence_started_without_a_prompt_get_cached():
    cache = make()
    tokens = list(range(30, 39))
    cache.add_sequence(0)
    feed(cache, 0, tokens, 0, 9)  # token_ids given to append
    assert cache.stats()["prefix_cached_pages"] == 2
    assert cache.add_sequence(1, tokens) == 8
    assert_kv_matches_tokens(cache, 1, tokens[:8])
    cache.check_invariants()


def test_numpy_integer_extra_key_is_the_int_salt_and_types_stay_apart():
    cache = make()
    prompt = list(range(9))
    start(cache, 0, prompt, extra_key=7)
    assert cache.add_sequence(1, prompt, extra_key=np.int64(7)) == 8
    assert cache.add_sequence(2, prompt, extra_key="7") == 0
    assert cache.add_sequence(3, prompt, extra_key=b"7") == 0


def test_sha256_option_shares_within_a_tenant_only():
    cache = make(prefix_hash="sha256")
    prompt = list(range(20))
    start(cache, 0, prompt, extra_key=b"\x01")
    assert cache.add_sequence(1, prompt, extra_key=b"\x01") == 16
    assert cache.add_sequence(2, prompt, extra_key=b"\x02") == 0
    assert_kv_matches_tokens(cache, 1, prompt)
    with pytest.raises(ValueError, match="prefix_hash"):
        make(prefix_hash="md5")


# ----------------------------------------------------------------- matching
def test_prompt_of_exact_page_multiple_hits_all_but_its_last_page():
    cache = make()
    prompt = list(range(100, 116))  # 4 full pages
    assert start(cache, 0, prompt) == 0
    assert cache.add_sequence(1, prompt) == 12
    assert cache.add_sequence(2, prompt + [5]) == 16
    assert cache.add_sequence(3, prompt[:13]) == 12
    assert cache.add_sequence(4, prompt[:12]) == 8
    assert cache.add_sequence(5, prompt[:1]) == 0
    stats = cache.stats()
    assert stats["prefix_queries"] == 16 * 3 + 17 + 13 + 12 + 1 - 16
    assert stats["prefix_hits"] == 12 + 16 + 12 + 8


def test_shared_prefix_then_diverge_then_release_frees_each_page_once():
    cache = make(num_pages=12)
    a = list(range(10)) + [50, 51, 52, 53, 54]
    b = list(range(10)) + [60, 61, 62]
    start(cache, 0, a)
    assert start(cache, 1, b) == 8
    view = cache.page_table([0, 1])
    shared = view.indices[:2].tolist()
    assert view.indices[view.indptr[1]:view.indptr[1] + 2].tolist() == shared
    assert [cache.pool.ref_count(p) for p in shared] == [2, 2]
    assert_kv_matches_tokens(cache, 0, a)
    assert_kv_matches_tokens(cache, 1, b)
    cache.check_invariants()
    cache.remove_sequence(0)
    cache.check_invariants()
    cache.remove_sequence(1)
    cache.check_invariants()
    assert cache.pool.num_free == 12
    assert sorted(cache.pool.free_pages().tolist()) == list(range(12))


def test_cached_free_page_is_matched_again_and_taken_off_the_free_queue():
    cache = make(num_pages=8)
    prompt = list(range(9))
    start(cache, 0, prompt)
    pages = cache.page_table([0]).indices.tolist()
    cache.remove_sequence(0)
    assert cache.pool.num_free == 8
    # Released newest first: the prefix head is the most recently freed.
    assert cache.pool.free_pages().tolist()[-3:] == pages[::-1]
    assert cache.stats()["prefix_cached_pages"] == 2
    assert cache.add_sequence(1, prompt) == 8
    assert cache.page_table([1]).indices.tolist() == pages[:2]
    assert cache.pool.num_free == 6
    assert not set(pages[:2]) & set(cache.pool.free_pages().tolist())
    cache.check_invariants()


def test_allocator_reuse_evicts_cached_pages_least_recently_freed_first():
    cache = make(num_pages=4)
    start(cache, 0, list(range(9)))  # 3 pages, 2 of them cached
    cache.remove_sequence(0)
    cache.add_sequence(1)
    cache.append([1], [4])  # takes the never-used page
    assert cache.stats()["prefix_evictions"] == 0
    cache.append([1], [4])  # takes the tail page of sequence 0 (uncached)
    cache.append([1], [4])  # takes page 1 of the prefix: evicted
    assert cache.stats()["prefix_evictions"] == 1
    assert cache.add_sequence(2, list(range(9))) == 4  # page 0 is still cached
    cache.check_invariants()


def test_hash_collision_never_serves_a_wrong_page():
    """Equal hash, different tokens: the stored tokens are compared on every hit."""
    cache = make()
    prompt = list(range(9))
    start(cache, 0, prompt)
    page = int(cache.page_table([0]).indices[1])
    # Make page 1's stored tokens disagree with what its hash was computed from,
    # as a colliding page would.
    cache.prefix_index.token_table()[page, 0] += 1
    assert cache.add_sequence(1, prompt) == 4
    assert_kv_matches_tokens(cache, 1, prompt)
    cache.check_invariants()


def test_generated_tokens_become_cached_through_token_ids():
    cache = make()
    prompt = list(range(6))
    start(cache, 0, prompt)
    tokens = prompt + [40, 41, 42, 43, 44, 45]
    for position in range(6, 12):
        feed(cache, 0, tokens, position, position + 1)
    assert cache.add_sequence(1, tokens + [9]) == 12
    assert_kv_matches_tokens(cache, 1, tokens)


def test_a_prompt_token_replaced_by_append_cuts_the_chain():
    cache = make()
    prompt = list(range(12))
    cache.add_sequence(0, prompt)
    other = prompt[:5] + [77] + prompt[6:]
    feed(cache, 0, other, 0, 12)  # the caller computed a different token at position 5
    assert cache.add_sequence(1, prompt) == 4
    assert cache.add_sequence(2, other) == 8
    assert_kv_matches_tokens(cache, 2, other)


def test_truncate_into_a_cached_page_then_append_keeps_the_cache_right():
    cache = make()
    prompt = list(range(12))
    start(cache, 0, prompt)
    cache.truncate(0, 6)  # page 1 becomes partial and will be rewritten
    other = prompt[:6] + [90, 91]
    feed(cache, 0, other, 6, 8)
    assert_kv_matches_tokens(cache, 0, other)
    assert cache.add_sequence(1, prompt) == 4  # page 1's old content is not served
    assert cache.add_sequence(2, other + [1]) == 8  # its new content is
    assert_kv_matches_tokens(cache, 2, other)
    cache.check_invariants()


def test_fork_of_a_cached_sequence_copies_on_write():
    cache = make()
    prompt = list(range(10))
    start(cache, 0, prompt)
    cache.fork(0, 1)
    child = prompt + [31, 32]
    feed(cache, 1, child, 10, 12)
    assert_kv_matches_tokens(cache, 0, prompt)
    assert_kv_matches_tokens(cache, 1, child)
    assert cache.stats()["cow_copies"] == 1
    cache.check_invariants()


# ------------------------------------------------------- window and sinks
def test_windowed_hit_takes_only_the_pages_the_window_needs():
    cache = make(num_pages=32, page_size=4, window=8)
    prompt = list(range(41))
    start(cache, 0, prompt)
    cache.remove_sequence(0)
    # All 10 full pages were cached as they filled, even those the window released.
    assert cache.stats()["prefix_cached_pages"] == 10
    assert cache.add_sequence(1, prompt) == 40
    view = cache.page_table([1])
    # The query at position 40 sees keys 33..39: pages 8 and 9 only.
    assert view.page_positions.tolist() == [32, 36]
    assert_kv_matches_tokens(cache, 1, prompt)
    feed(cache, 1, prompt + [5], 40, 41)
    cache.check_invariants()


def test_windowed_hit_needs_every_window_page():
    cache = make(num_pages=32, page_size=4, window=8)
    prompt = list(range(41))
    start(cache, 0, prompt)
    cache.remove_sequence(0)
    # Break page 9's tokens (as if it were evicted/colliding): serving 40 tokens
    # would need it, so the best hit is 36 tokens (pages 7 and 8).
    index = cache.prefix_index
    ninth = [p for p in index.cached_pages() if index.token_table()[p, 0] == 36][0]
    index.token_table()[ninth, 0] = -5
    assert cache.add_sequence(1, prompt) == 36
    assert cache.page_table([1]).page_positions.tolist() == [28, 32]


def test_windowed_hit_needs_the_sink_pages():
    cache = make(num_pages=32, page_size=4, window=8, sink_tokens=2)
    prompt = list(range(41))
    start(cache, 0, prompt)
    cache.remove_sequence(0)
    assert cache.add_sequence(1, prompt) == 40
    assert cache.page_table([1]).page_positions.tolist() == [0, 32, 36]
    assert_kv_matches_tokens(cache, 1, prompt)
    cache.remove_sequence(1)
    index = cache.prefix_index
    sink_page = [p for p in index.cached_pages() if index.token_table()[p, 0] == 0][0]
    index.token_table()[sink_page, 1] = -1
    assert cache.add_sequence(2, prompt) == 0
    cache.check_invariants()


# ------------------------------------------------------------ external ids
def test_uint64_block_ids_are_the_int64_ids_with_the_same_bits():
    cache = KVCache(0, 1, 1, num_pages=64, page_size=16, enable_prefix_caching=True)
    high = [2**63 + 5, 2**64 - 1]  # as int64: -(2**63) + 5, -1
    assert cache.add_sequence(0, block_hashes=high, block_tokens=32, num_prompt_tokens=64) == 0
    cache.append([0], [64])
    as_int64 = np.array(high, dtype=np.uint64).view(np.int64)
    assert cache.add_sequence(1, block_hashes=as_int64, block_tokens=32, num_prompt_tokens=64) == 48
    assert cache.add_sequence(2, block_hashes=np.array(high, dtype=np.uint64), block_tokens=32,
                              num_prompt_tokens=64) == 48
    assert cache.add_sequence(3, block_hashes=[2**63 + 6, 2**64 - 1], block_tokens=32, num_prompt_tokens=64) == 0
    cache.check_invariants()


def test_block_hashes_share_pages_of_equal_blocks():
    cache = KVCache(0, 1, 1, num_pages=64, page_size=16, enable_prefix_caching=True)
    assert cache.add_sequence(0, block_hashes=[0, 1, 2], block_tokens=64, num_prompt_tokens=150) == 0
    cache.append([0], [150])
    # Same first two blocks, different third: pages of blocks 0 and 1 hit (8 pages).
    assert cache.add_sequence(1, block_hashes=[0, 1, 3], block_tokens=64, num_prompt_tokens=150) == 128
    # Same blocks: all 9 full pages are cached, and (150 - 1) // 16 = 9 are servable.
    assert cache.add_sequence(2, block_hashes=[0, 1, 2], block_tokens=64, num_prompt_tokens=150) == 144
    # A different first block shares nothing.
    assert cache.add_sequence(3, block_hashes=[5, 1, 2], block_tokens=64, num_prompt_tokens=150) == 0
    cache.check_invariants()


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        ({"block_hashes": [1], "block_tokens": 24, "num_prompt_tokens": 10}, ValueError, "block_tokens"),
        ({"block_hashes": [1], "block_tokens": 16, "num_prompt_tokens": 17}, ValueError, "num_prompt_tokens"),
        ({"block_hashes": [1]}, ValueError, "block_tokens"),
        ({"prompt_token_ids": [1], "block_hashes": [1]}, ValueError, "not both"),
        ({"prompt_token_ids": [2**31]}, ValueError, "prompt_token_ids"),
        ({"prompt_token_ids": [1.5]}, TypeError, "prompt_token_ids"),
        ({"prompt_token_ids": [1], "extra_key": 1.5}, TypeError, "extra_key"),
        # Python ints beyond int64 (NumPy makes floats or objects of them): a range error.
        ({"prompt_token_ids": [2**64, 1]}, ValueError, r"prompt_token_ids: expected values in \["),
        ({"block_hashes": [2**63, -1], "block_tokens": 16, "num_prompt_tokens": 20}, ValueError,
         r"block_hashes: expected values in \["),
    ],
)
def test_bad_prefix_arguments_change_nothing(kwargs, exc, match):
    cache = KVCache(0, 1, 1, num_pages=8, page_size=16, enable_prefix_caching=True)
    cache.add_sequence(0, list(range(40)))
    cache.append([0], [40])
    before = (cache.stats(), cache.pool.free_pages().tolist(), cache.seq_ids())
    with pytest.raises(exc, match=match):
        cache.add_sequence(1, **kwargs)
    assert (cache.stats(), cache.pool.free_pages().tolist(), cache.seq_ids()) == before


def test_bad_token_ids_in_append_change_nothing():
    cache = make()
    cache.add_sequence(0, [1, 2, 3])
    before = (cache.stats(), cache.pool.free_pages().tolist())
    with pytest.raises(ValueError, match="token_ids"):
        cache.append([0], [3], token_ids=[1, 2])
    assert (cache.stats(), cache.pool.free_pages().tolist()) == before


# ------------------------------------------------------------- stateful
class PrefixMachine(RuleBasedStateMachine):
    """Random requests with shared prefixes on a small pool: served K/V always equals recomputed K/V."""

    @initialize(config=st.sampled_from([(10, 4, None, 0), (14, 3, 7, 0), (16, 4, 9, 3), (12, 2, None, 0)]),
                algorithm=st.sampled_from(["xxh3_128", "sha256"]))
    def setup(self, config, algorithm):
        num_pages, page_size, window, sinks = config
        self.cache = KVCache(1, HEADS, DIM, num_pages, page_size=page_size, dtype=np.float32,
                             window=window, sink_tokens=sinks, enable_prefix_caching=True,
                             prefix_hash=algorithm)
        self.tokens = {}
        self.next_id = 0

    @rule(data=st.data())
    def request(self, data):
        base = data.draw(st.sampled_from([[1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 9, 9], [7, 7, 7, 7, 7, 7, 7]]))
        cut = data.draw(st.integers(1, len(base)))
        tail = data.draw(st.lists(st.integers(0, 3), max_size=6))
        prompt = base[:cut] + tail
        salt = data.draw(st.sampled_from([None, None, "t1"]))
        sid = self.next_id
        self.next_id += 1
        before = self.cache.stats()["prefix_hits"]
        try:
            cached = self.cache.add_sequence(sid, prompt, salt)
            assert cached % self.cache.page_size == 0 and cached < len(prompt)
            assert self.cache.stats()["prefix_hits"] - before == cached
            feed(self.cache, sid, prompt, cached, len(prompt), token_ids=False)
        except OutOfPagesError:
            self.cache.remove_sequence(sid)
            return
        self.tokens[sid] = list(prompt)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def decode(self, data):
        sid = data.draw(st.sampled_from(sorted(self.tokens)))
        token = data.draw(st.integers(0, 3))
        tokens = self.tokens[sid] + [token]
        try:
            feed(self.cache, sid, tokens, len(tokens) - 1, len(tokens))
        except OutOfPagesError:
            return
        self.tokens[sid] = tokens

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def fork(self, data):
        sid = data.draw(st.sampled_from(sorted(self.tokens)))
        self.cache.fork(sid, self.next_id)
        self.tokens[self.next_id] = list(self.tokens[sid])
        self.next_id += 1

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def truncate(self, data):
        sid = data.draw(st.sampled_from(sorted(self.tokens)))
        new_len = data.draw(st.integers(0, len(self.tokens[sid])))
        try:
            self.cache.truncate(sid, new_len)
        except ValueError:
            return  # the window already released what a query at new_len needs
        self.tokens[sid] = self.tokens[sid][:new_len]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def remove(self, data):
        sid = data.draw(st.sampled_from(sorted(self.tokens)))
        self.cache.remove_sequence(sid)
        del self.tokens[sid]

    @invariant()
    def served_kv_equals_recomputed_kv(self):
        self.cache.check_invariants()
        for sid, tokens in self.tokens.items():
            assert self.cache.seq_len(sid) == len(tokens)
            assert_kv_matches_tokens(self.cache, sid, tokens)


TestPrefixMachine = PrefixMachine.TestCase
TestPrefixMachine.settings = settings(max_examples=120, stateful_step_count=30, deadline=None)


def test_prefix_index_refuses_more_pages_than_32_hash_bits_can_address():
    from pagedkv_c._prefix import PrefixIndex

    # Checked before anything is allocated: the table would need 2**33 slots.
    with pytest.raises(ValueError, match=r"num_pages.*2\*\*30"):
        PrefixIndex(2**30 + 1, 16)
    assert PrefixIndex(1000, 16).num_cached == 0


def test_free_queue_keeps_lru_order_through_many_hits_on_free_pages():
    """Hits on free cached pages take them out of the middle of the free queue
    many times over (far more than the queue's ring holds without compacting);
    the hand-out order must stay least recently freed first throughout."""
    cache = make(num_pages=8, page_size=4)
    prompt = list(range(9))  # 2 full pages + 1 token
    start(cache, 0, prompt)
    cache.remove_sequence(0)
    pool = cache.pool
    model = [int(p) for p in pool.free_pages()]  # reference LRU order
    for i in range(200):
        assert cache.add_sequence(1, prompt) == 8
        held = [int(p) for p in cache.page_table([1]).indices]
        for page in held:
            model.remove(page)  # taken out of the middle of the queue
        if i % 3 == 0:  # sometimes allocate too: pops the head
            cache.append([1], [1])
            new = [int(p) for p in cache.page_table([1]).indices if int(p) not in held]
            assert new == model[:len(new)]
            del model[:len(new)]
            held = held + new
        cache.remove_sequence(1)
        model.extend(reversed(held))  # released newest page first
        assert [int(p) for p in pool.free_pages()] == model
        cache.check_invariants()


def test_block_keyed_hashes_are_the_documented_chain_over_many_pages():
    """Block-keyed sequences hash lazily, a batch at a time, inside the match
    and register loops; the chain must still be the documented one for every
    page (50 pages: several batches past the lookahead)."""
    cache = make(num_pages=64, page_size=4)
    blocks = [11, 7, 11, 3, 5, 8, 13, 21, 34, 55, 89, 144, 233]
    num_tokens = 50 * 4 + 2
    assert cache.add_sequence(0, block_hashes=blocks, block_tokens=16, num_prompt_tokens=num_tokens) == 0
    cache.append([0], [num_tokens])
    index = cache.prefix_index
    table = cache.page_table([0])
    parent = 0
    for k in range(50):
        # 49 bytes: parent, salt, block id, index in block, pages per block, domain tag b"B"
        data = struct.pack("<QQQQqIIB", parent & (2**64 - 1), parent >> 64, 0, 0, blocks[k // 4], k % 4, 4, 0x42)
        parent = xxhash.xxh3_128_intdigest(data)
        assert index.page_hash(int(table.indices[k])) == parent, k
    # A second request with the same blocks is served every full page but the last token's.
    assert cache.add_sequence(1, block_hashes=blocks, block_tokens=16, num_prompt_tokens=num_tokens) == 200
    cache.check_invariants()


def test_block_hashes_array_reused_by_the_caller_changes_nothing_stored():
    """Block-keyed pages are hashed lazily; a caller that refills its block id
    array for the next request must not change the first request's hashes."""
    blocks = np.array([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], dtype=np.int64)
    reference = make(num_pages=64, page_size=4)
    reference.add_sequence(0, block_hashes=blocks.copy(), block_tokens=16, num_prompt_tokens=190)
    reference.append([0], [190])
    cache = make(num_pages=64, page_size=4)
    buffer = blocks.copy()
    cache.add_sequence(0, block_hashes=buffer, block_tokens=16, num_prompt_tokens=190)
    buffer[:] = 99  # reused for another request before sequence 0's pages are registered
    cache.append([0], [190])
    want = [reference.prefix_index.page_hash(int(p)) for p in reference.page_table([0]).indices[:47]]
    got = [cache.prefix_index.page_hash(int(p)) for p in cache.page_table([0]).indices[:47]]
    assert got == want
    assert cache.add_sequence(1, block_hashes=blocks, block_tokens=16, num_prompt_tokens=190) == 188


def test_a_prompt_of_few_block_ids_cannot_make_the_cache_allocate_in_proportion_to_its_length():
    """Block ids describe a prompt in 8 bytes per block whatever block_tokens is; its hash chain
    takes 16 bytes per page. A prompt past 2**24 pages is refused before anything is built, and
    one within the bound allocates its chain as it is hashed, not up front."""
    cache = KVCache(1, 1, 4, num_pages=16, page_size=1, window=4, enable_prefix_caching=True)
    with pytest.raises(ValueError, match=r"Invalid value of num_prompt_tokens: expected 0 <= num_prompt_tokens"
                                         r" <= 16777216, got 4294967296"):
        cache.add_sequence(0, block_hashes=[1, 2, 3, 4], block_tokens=2**31 - 1, num_prompt_tokens=2**32)
    assert cache.seq_ids() == []
    assert cache.add_sequence(0, block_hashes=[1], block_tokens=2**24, num_prompt_tokens=2**24) == 0
    cache.check_invariants()
