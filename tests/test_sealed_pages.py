"""Sealed pages of KVCache: the seal rule, page checksums, verify_pages and the sealed-page log.

The seal rule is checked against two plain-Python models of reference_cache:
RefCache (abstract pages, without prefix caching) and RefSealedPages (the rule
applied to the page tables observed around each call, with prefix caching).
Checksums are checked against pagedkv_c._checksum.page_checksums, itself
checked against the xxhash package in test_page_checksum.py.
"""
import numpy as np
import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagedkv import KVCache, OutOfPagesError
from pagedkv_c._checksum import page_checksums
from pagedkv_c._kv_cache import BadPage, PageCheckReport
from reference_cache import OutOfPages, RefCache, RefSealedPages

HEADS, DIM = 2, 4
LAYERS = 2


def observe(cache, seq_id):
    """({logical page: page id}, length) of one sequence."""
    view = cache.page_table([seq_id])
    held = dict(zip((view.page_positions // cache.page_size).tolist(), view.indices.tolist()))
    return held, int(view.seq_lens[0])


def sealed_pages(cache):
    return set(np.flatnonzero(cache._sealed_state()["sealed"]).tolist())


def store_random(cache, rng, slots):
    for layer in range(cache.num_layers):
        k = rng.standard_normal((len(slots), cache.num_kv_heads, cache.head_dim))
        v = rng.standard_normal((len(slots), cache.num_kv_heads, cache.head_dim))
        cache.store(layer, slots, k, v)


def make(num_pages=16, page_size=4, **kwargs):
    kwargs.setdefault("page_checksums", True)
    return KVCache(LAYERS, HEADS, DIM, num_pages, page_size=page_size, **kwargs)


# ----------------------------------------------------------------- the rule

def test_decode_seals_a_page_when_the_next_append_moves_past_it():
    cache = make(page_size=4)
    rng = np.random.default_rng(0)
    cache.add_sequence(0)
    for step in range(9):
        store_random(cache, rng, cache.append([0], [1]))
        held, _ = observe(cache, 0)
        # After appending token `step`, pages full before this append are sealed.
        full_before = step // 4
        assert sealed_pages(cache) == {held[k] for k in range(full_before)}, step
    assert not cache.verify_pages()


def test_page_size_one_seals_every_token_page():
    cache = make(num_pages=8, page_size=1)
    cache.add_sequence(0)
    store_random(cache, np.random.default_rng(1), cache.append([0], [5]))
    assert sealed_pages(cache) == set()
    assert cache.seal() == 5
    assert cache.seal() == 0
    report = cache.verify_pages()
    assert not report and report.num_pages_checked == 5


def test_forked_sequences_seal_a_shared_page_once():
    cache = make()
    rng = np.random.default_rng(2)
    cache.add_sequence(0)
    store_random(cache, rng, cache.append([0], [8]))
    cache.fork(0, 1)
    store_random(cache, rng, cache.append([0, 1], [1, 1]))
    held, _ = observe(cache, 0)
    assert sealed_pages(cache) == {held[0], held[1]}
    assert cache._sealed_state()["pages_sealed"] == 2


def test_window_release_in_the_same_append_seals_the_page_first():
    """The pages a window releases are full: the append seals them before releasing them."""
    cache = make(num_pages=16, page_size=4, window=4, enable_prefix_caching=True)
    cache._enable_sealed_log(True)
    rng = np.random.default_rng(3)
    cache.add_sequence(0)
    store_random(cache, rng, cache.append([0], [8], token_ids=np.arange(8)))
    before, _ = observe(cache, 0)
    cache._take_sealed_pages()
    store_random(cache, rng, cache.append([0], [1], token_ids=[8]))  # releases page 0
    held, _ = observe(cache, 0)
    assert 0 not in held
    # Released page 0 stays cached (findable) and sealed; page 1 is held and sealed.
    assert sealed_pages(cache) == {before[0], before[1]}
    ids, _, tokens, checksums = cache._take_sealed_pages()
    assert ids.tolist() == [before[0], before[1]]
    assert tokens.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert checksums.tolist() == page_checksums(cache.kv, ids).tolist()


def test_window_reuse_in_place_clears_the_seal():
    cache = make(num_pages=16, page_size=2, window=2)
    rng = np.random.default_rng(4)
    cache.add_sequence(0)
    seen = set()
    for _ in range(12):  # a page's worth per append: the released page is reused at once
        store_random(cache, rng, cache.append([0], [2]))
        held, _ = observe(cache, 0)
        seen |= set(held.values())
        # The newest page is being written: never sealed.
        assert held[max(held)] not in sealed_pages(cache)
    assert len(seen) <= 3  # the ring reused its pages in place
    assert not cache.verify_pages()


def test_sink_pages_are_sealed():
    cache = make(num_pages=16, page_size=2, window=3, sink_tokens=3)
    rng = np.random.default_rng(5)
    cache.add_sequence(0)
    for _ in range(12):
        store_random(cache, rng, cache.append([0], [1]))
    held, length = observe(cache, 0)
    assert held[0] in sealed_pages(cache)  # full sink page
    assert held[1] not in sealed_pages(cache) or length > 4
    assert not cache.verify_pages()


def test_truncate_into_a_sealed_page_unseals_it_at_the_next_append_only():
    cache = make()
    rng = np.random.default_rng(6)
    cache.add_sequence(0)
    store_random(cache, rng, cache.append([0], [8]))
    store_random(cache, rng, cache.append([0], [1]))
    held, _ = observe(cache, 0)
    assert sealed_pages(cache) == {held[0], held[1]}
    cache.truncate(0, 6)  # into page 1: its bytes are unchanged until the next append
    assert sealed_pages(cache) == {held[0], held[1]}
    assert not cache.verify_pages()
    store_random(cache, rng, cache.append([0], [1]))  # writes position 6 of page 1
    assert sealed_pages(cache) == {held[0]}
    assert not cache.verify_pages()


def test_shared_page_truncated_into_stays_sealed_for_the_other_sequence():
    cache = make()
    rng = np.random.default_rng(7)
    cache.add_sequence(0)
    store_random(cache, rng, cache.append([0], [8]))
    cache.fork(0, 1)
    cache.seal()
    held, _ = observe(cache, 0)
    cache.truncate(1, 6)
    store_random(cache, rng, cache.append([1], [1]))  # copy-on-write: page 1 itself is not written
    assert held[1] in sealed_pages(cache)
    child, _ = observe(cache, 1)
    assert child[1] != held[1] and child[1] not in sealed_pages(cache)
    assert not cache.verify_pages()


def test_remove_sequence_seals_full_pages_and_freed_pages_keep_it():
    cache = make(enable_prefix_caching=True)
    rng = np.random.default_rng(8)
    cache.add_sequence(0, list(range(10)))
    store_random(cache, rng, cache.append([0], [10]))
    held, _ = observe(cache, 0)
    cache.remove_sequence(0)
    assert sealed_pages(cache) == {held[0], held[1]}
    report = cache.verify_pages()
    assert not report and report.num_pages_checked == 2
    # A new sequence on the same prompt is served the sealed cached pages.
    assert cache.add_sequence(1, list(range(10))) == 8
    assert not cache.verify_pages([1]) and cache.verify_pages([1]).num_pages_checked == 2


def test_failed_append_seals_nothing():
    cache = make(num_pages=3, page_size=4)
    rng = np.random.default_rng(9)
    cache.add_sequence(0)
    store_random(cache, rng, cache.append([0], [8]))
    state = cache._sealed_state()
    with pytest.raises(OutOfPagesError):
        cache.append([0], [9])
    after = cache._sealed_state()
    assert after["sealed"].tolist() == state["sealed"].tolist() == [0, 0, 0]
    assert after["pages_sealed"] == 0


def test_seal_counts_only_new_pages_and_refuses_bad_ids():
    cache = make()
    cache.add_sequence(0)
    cache.add_sequence(1)
    cache.append([0, 1], [9, 3])
    assert cache.seal([1]) == 0
    assert cache.seal([0]) == 2
    assert cache.seal() == 0
    with pytest.raises(KeyError):
        cache.seal([5])
    with pytest.raises(ValueError, match="listed more than once"):
        cache.seal([0, 0])
    with pytest.raises(TypeError):
        cache.seal([0.5])


def test_sealing_without_checksums_tracks_flags_only():
    cache = make(page_checksums=False)
    assert not cache.page_checksums_enabled
    cache.add_sequence(0)
    cache.append([0], [8])
    assert cache.seal() == 2
    state = cache._sealed_state()
    assert state["checksums"] is None and state["sealed"].sum() == 2
    with pytest.raises(RuntimeError, match="page_checksums=True"):
        cache.verify_pages()


def test_page_checksums_argument_must_be_a_bool():
    with pytest.raises(TypeError, match="Invalid type of page_checksums"):
        make(page_checksums=1)


# ----------------------------------------------------------- verify_pages

def test_verify_pages_names_a_flipped_bit_and_the_sequences_holding_the_page():
    cache = make()
    rng = np.random.default_rng(10)
    cache.add_sequence(0)
    store_random(cache, rng, cache.append([0], [8]))
    cache.fork(0, 1)
    cache.add_sequence(2)
    store_random(cache, rng, cache.append([2], [4]))
    cache.seal()
    held, _ = observe(cache, 0)
    page = held[1]
    expected = int(page_checksums(cache.kv, [page])[0])
    cache.kv.view(np.uint8)[1, page, 1, 2, 1, 3] ^= 0x04  # layer 1, V
    report = cache.verify_pages()
    assert report and isinstance(report, PageCheckReport)
    assert report.num_pages_checked == 3
    actual = int(page_checksums(cache.kv, [page])[0])
    assert report.bad_pages == [BadPage(page, expected, actual, [0, 1])]
    assert "BadPage(page_id=" in repr(report)
    assert cache.verify_pages([2]).bad_pages == []
    assert cache.verify_pages([1]).bad_pages[0].page_id == page


def test_verify_pages_finds_a_flip_in_a_cached_free_page():
    cache = make(enable_prefix_caching=True)
    cache.add_sequence(0, list(range(5)))
    store_random(cache, np.random.default_rng(11), cache.append([0], [5]))
    held, _ = observe(cache, 0)
    cache.remove_sequence(0)
    cache.kv.view(np.uint8)[0, held[0], 0, 0, 0, 0] ^= 0x80
    report = cache.verify_pages()
    assert [(b.page_id, b.seq_ids) for b in report.bad_pages] == [(held[0], [])]


def test_verify_pages_is_clean_after_ten_thousand_random_operations():
    rng = np.random.default_rng(12)
    cache = KVCache(LAYERS, HEADS, DIM, num_pages=48, page_size=4, dtype=np.float32, window=10,
                    sink_tokens=3, enable_prefix_caching=True, page_checksums=True)
    vocab = [rng.integers(0, 50, size=40).tolist() for _ in range(3)]
    tokens = {}
    next_id = 0
    for step in range(10_000):
        op = rng.integers(0, 100)
        live = list(tokens)
        if op < 15 or not live:
            prompt = vocab[rng.integers(0, 3)][:rng.integers(0, 30)]
            served = cache.add_sequence(next_id, prompt)
            tokens[next_id] = list(prompt)[:served] + list(prompt)[served:]
            cache_len = served
            # append the rest of the prompt as the prefill
            rest = prompt[served:]
            if rest:
                try:
                    store_random(cache, rng, cache.append([next_id], [len(rest)], token_ids=rest))
                except OutOfPagesError:
                    cache.remove_sequence(next_id)
                    del tokens[next_id]
                    next_id += 1
                    continue
            tokens[next_id] = list(prompt)
            del cache_len
            next_id += 1
        elif op < 70:
            ids = rng.choice(live, size=min(len(live), rng.integers(1, 4)), replace=False).tolist()
            counts = rng.integers(0, 3, size=len(ids)).tolist()
            new = [int(t) for t in rng.integers(0, 50, size=sum(counts))]
            try:
                slots = cache.append(ids, counts, token_ids=new)
            except OutOfPagesError:
                cache.remove_sequence(live[0])
                del tokens[live[0]]
                continue
            store_random(cache, rng, slots)
            offset = 0
            for sid, c in zip(ids, counts):
                tokens[sid] += new[offset:offset + c]
                offset += c
        elif op < 78:
            parent = live[rng.integers(0, len(live))]
            cache.fork(parent, next_id)
            tokens[next_id] = list(tokens[parent])
            next_id += 1
        elif op < 86:
            sid = live[rng.integers(0, len(live))]
            new_len = int(rng.integers(0, cache.seq_len(sid) + 1))
            try:
                cache.truncate(sid, new_len)
            except ValueError:
                continue
            tokens[sid] = tokens[sid][:new_len]
        elif op < 96:
            sid = live[rng.integers(0, len(live))]
            cache.remove_sequence(sid)
            del tokens[sid]
        else:
            cache.seal(live[:rng.integers(1, len(live) + 1)])
        if step % 2000 == 0:
            assert not cache.verify_pages()
    cache.check_invariants()
    report = cache.verify_pages()
    assert not report and report.num_pages_checked > 0
    state = cache._sealed_state()
    sealed = np.flatnonzero(state["sealed"])
    assert state["checksums"][sealed].tolist() == page_checksums(cache.kv, sealed).tolist()
    # One flipped bit in one sealed page is found, and nothing else.
    page = int(sealed[len(sealed) // 2])
    cache.kv.view(np.uint8)[1, page, 0, 0, 0, 0] ^= 1
    report = cache.verify_pages()
    holders = [sid for sid in cache.seq_ids() if page in observe(cache, sid)[0].values()]
    assert [(b.page_id, b.seq_ids) for b in report.bad_pages] == [(page, holders)]


# ------------------------------------------------------- sealed-page log

def test_log_lists_cached_pages_in_seal_order_with_hash_tokens_and_checksum():
    cache = make(num_pages=16, page_size=4, enable_prefix_caching=True, page_checksums=False)
    cache._enable_sealed_log(True)
    rng = np.random.default_rng(13)
    prompt = list(range(100, 113))
    cache.add_sequence(0, prompt, extra_key="tenant")
    store_random(cache, rng, cache.append([0], [13]))
    assert cache._take_sealed_pages()[0].size == 0  # nothing sealed yet
    store_random(cache, rng, cache.append([0], [1], token_ids=[7]))
    ids, hashes, tokens, checksums = cache._take_sealed_pages()
    held, _ = observe(cache, 0)
    assert ids.tolist() == [held[0], held[1], held[2]]
    assert [int.from_bytes(h.tobytes(), "little") for h in hashes] == \
        [cache.prefix_index.page_hash(p) for p in ids]
    assert tokens.tolist() == [prompt[0:4], prompt[4:8], prompt[8:12]]
    assert checksums.tolist() == page_checksums(cache.kv, ids).tolist()
    assert cache._take_sealed_pages()[0].size == 0  # drained
    stats = cache._sealed_log_stats()
    assert stats["logged"] == 3 and stats["pending"] == 0 and stats["dropped"] == 0


def test_log_skips_pages_without_a_prefix_hash():
    cache = make(enable_prefix_caching=False)
    cache._enable_sealed_log(True)
    cache.add_sequence(0)
    cache.append([0], [9])
    assert cache.seal() == 2
    assert cache._take_sealed_pages()[0].size == 0
    # With prefix caching, a sequence appended without token ids has no page hashes.
    cache = make(enable_prefix_caching=True)
    cache._enable_sealed_log(True)
    cache.add_sequence(0)
    cache.append([0], [9])
    assert cache.seal() == 2
    assert cache._take_sealed_pages()[0].size == 0


def test_log_of_block_keyed_pages_has_no_token_ids():
    cache = make(enable_prefix_caching=True)
    cache._enable_sealed_log(True)
    cache.add_sequence(0, block_hashes=[11, 12], block_tokens=4, num_prompt_tokens=8)
    cache.append([0], [8])
    cache.seal()
    ids, _, tokens, _ = cache._take_sealed_pages()
    assert ids.size == 2 and (tokens == -1).all()


def test_log_is_bounded_and_counts_drops():
    cache = make(num_pages=16, page_size=1, enable_prefix_caching=True)
    cache._enable_sealed_log(True, capacity=2)
    cache.add_sequence(0, list(range(6)))
    cache.append([0], [6])
    assert cache.seal() == 6
    ids = cache._take_sealed_pages()[0]
    held, _ = observe(cache, 0)
    assert ids.tolist() == [held[0], held[1]]  # the oldest entries are kept
    stats = cache._sealed_log_stats()
    assert (stats["capacity"], stats["logged"], stats["dropped"]) == (2, 2, 4)


def test_log_withdraws_an_entry_whose_page_is_written_before_the_drain():
    cache = make(num_pages=2, page_size=2, enable_prefix_caching=True)
    cache._enable_sealed_log(True)
    cache.add_sequence(0, [1, 2, 3])
    cache.append([0], [3])
    cache.remove_sequence(0)  # seals page of tokens [1, 2], logged, then cached free
    cache.add_sequence(1, [9, 9, 9, 9])
    cache.append([1], [4])  # takes both pages: the logged one is written again
    assert cache._take_sealed_pages()[0].size == 0
    stats = cache._sealed_log_stats()
    assert stats["logged"] == 1 and stats["withdrawn"] == 1


def test_log_arguments_are_checked():
    cache = make(enable_prefix_caching=True)
    with pytest.raises(RuntimeError, match="not enabled"):
        cache._take_sealed_pages()
    with pytest.raises(TypeError, match="Invalid type of enabled"):
        cache._enable_sealed_log(1)
    with pytest.raises(ValueError, match="capacity"):
        cache._enable_sealed_log(True, capacity=0)
    cache._enable_sealed_log(True)
    cache._enable_sealed_log(False)
    assert cache._sealed_log_stats()["enabled"] is False


# --------------------------------------------------- state for snapshots

def test_sealed_state_round_trip_and_bad_input_changes_nothing():
    cache = make()
    rng = np.random.default_rng(14)
    cache.add_sequence(0)
    store_random(cache, rng, cache.append([0], [9]))
    cache.seal()
    state = cache._sealed_state()
    other = make()
    other.add_sequence(0)
    other.append([0], [9])
    other.kv[...] = cache.kv
    other._restore_sealed_state(state["sealed"], state["checksums"], state["pages_sealed"])
    restored = other._sealed_state()
    assert restored["sealed"].tolist() == state["sealed"].tolist()
    assert restored["checksums"].tolist() == state["checksums"].tolist()
    assert restored["pages_sealed"] == 2
    assert not other.verify_pages() and other.verify_pages().num_pages_checked == 2
    bad_flags = state["sealed"].copy()
    bad_flags[0] = 2
    for args, error in [
        ((bad_flags, state["checksums"]), ValueError),
        ((state["sealed"].astype(np.int32), state["checksums"]), TypeError),
        ((state["sealed"][:3], state["checksums"]), ValueError),
        ((state["sealed"], None), ValueError),
        ((state["sealed"], state["checksums"].astype(np.int64)), TypeError),
        ((state["sealed"], state["checksums"], -1), ValueError),
    ]:
        with pytest.raises(error):
            other._restore_sealed_state(*args)
        assert other._sealed_state()["sealed"].tolist() == state["sealed"].tolist()
    plain = make(page_checksums=False)
    with pytest.raises(ValueError, match="expected None"):
        plain._restore_sealed_state(np.zeros(16, np.uint8), np.zeros(16, np.uint64))


# ------------------------------------------------- against the reference

CONFIGS = st.sampled_from(
    [
        # num_pages, page_size, window, sink_tokens, prefix caching
        (12, 4, None, 0, False),
        (12, 4, 6, 0, False),
        (16, 4, 9, 5, False),
        (24, 1, 4, 1, False),
        (10, 3, 7, 2, False),
        (16, 4, None, 0, True),
        (16, 4, 9, 5, True),
        (20, 2, 5, 1, True),
        (12, 1, 3, 0, True),
    ]
)
BASE_PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3], [2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4, 5]]


class SealMachine(RuleBasedStateMachine):
    """Random add/append/fork/truncate/remove/seal; the seal rule against the reference models."""

    @initialize(config=CONFIGS, consumers=st.booleans())
    def setup(self, config, consumers):
        # consumers=False: no checksums and no log, the path where taking a page clears its seal.
        num_pages, page_size, window, sinks, prefix = config
        self.prefix = prefix
        self.consumers = consumers
        self.cache = KVCache(LAYERS, HEADS, DIM, num_pages, page_size=page_size, dtype=np.float32,
                             window=window, sink_tokens=sinks, enable_prefix_caching=prefix,
                             page_checksums=consumers)
        if prefix and consumers:
            self.cache._enable_sealed_log(True)
        self.ref = None if prefix else RefCache(num_pages, page_size, window, sinks)
        self.model = RefSealedPages(page_size)
        self.rng = np.random.default_rng(0)
        self.tokens = {}
        self.next_id = 0

    def live(self):
        return sorted(self.tokens)

    def cached(self):
        return set(self.cache.prefix_index.cached_pages().tolist()) if self.prefix else set()

    def check_log(self, order, cached_before):
        if not (self.prefix and self.consumers):
            return
        ids, hashes, tokens, checksums = self.cache._take_sealed_pages()
        expected = [p for p in order if p in cached_before and p in self.model.sealed]
        assert ids.tolist() == expected
        index = self.cache.prefix_index
        assert [int.from_bytes(h.tobytes(), "little") for h in hashes] == [index.page_hash(p) for p in expected]
        assert tokens.tolist() == index.token_table()[ids].tolist()
        assert checksums.tolist() == page_checksums(self.cache.kv, ids).tolist()

    @rule(data=st.data())
    def add(self, data):
        sid = self.next_id
        self.next_id += 1
        if self.prefix:
            base = data.draw(st.sampled_from(BASE_PROMPTS))
            prompt = base[:data.draw(st.integers(0, len(base)))]
            self.cache.add_sequence(sid, prompt)
            self.tokens[sid] = list(prompt)
        else:
            self.cache.add_sequence(sid)
            self.ref.add(sid)
            self.tokens[sid] = []

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def append(self, data):
        live = self.live()
        ids = data.draw(st.lists(st.sampled_from(live), min_size=1, max_size=len(live), unique=True))
        ps = self.cache.page_size
        counts = data.draw(st.lists(st.integers(0, 2 * ps + 3), min_size=len(ids), max_size=len(ids)))
        new_tokens = []
        for sid, c in zip(ids, counts):
            length = self.cache.seq_len(sid)
            known = self.tokens[sid]
            new_tokens += [known[p] if p < len(known) else 7 + (p % 3) for p in range(length, length + c)]
        before = [observe(self.cache, sid) for sid in ids]
        state = self.cache._sealed_state()
        cached_before = self.cached()
        if self.ref is not None:
            try:
                self.ref.append(ids, counts)
            except OutOfPages:
                with pytest.raises(OutOfPagesError):
                    self.cache.append(ids, counts)
                assert self.cache._sealed_state()["sealed"].tolist() == state["sealed"].tolist()
                return
        try:
            slots = self.cache.append(ids, counts, token_ids=new_tokens if self.prefix else None)
        except OutOfPagesError:
            assert self.ref is None
            assert self.cache._sealed_state()["sealed"].tolist() == state["sealed"].tolist()
            return
        after = [observe(self.cache, sid) for sid in ids]
        order = self.model.append(before, after, counts)
        self.check_log(order, cached_before)
        offset = 0
        for sid, c in zip(ids, counts):
            length = after[ids.index(sid)][1]
            self.tokens[sid] = (self.tokens[sid] + [None] * length)[:length - c] + new_tokens[offset:offset + c]
            offset += c
        store_random(self.cache, self.rng, slots)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(self.live()))
        self.cache.fork(parent, self.next_id)
        if self.ref is not None:
            self.ref.fork(parent, self.next_id)
        self.tokens[self.next_id] = list(self.tokens[parent])
        self.next_id += 1

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def truncate(self, data):
        sid = data.draw(st.sampled_from(self.live()))
        length = self.cache.seq_len(sid)
        new_len = data.draw(st.integers(0, length))
        if self.ref is not None and not self.ref.truncate_allowed(sid, new_len):
            return
        try:
            self.cache.truncate(sid, new_len)
        except ValueError:
            assert self.ref is None
            return
        if self.ref is not None:
            self.ref.truncate(sid, new_len)
        self.tokens[sid] = self.tokens[sid][:new_len]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def remove(self, data):
        sid = data.draw(st.sampled_from(self.live()))
        cached_before = self.cached()
        order = self.model.seal([observe(self.cache, sid)])
        self.cache.remove_sequence(sid)
        if self.ref is not None:
            self.ref.remove(sid)
        del self.tokens[sid]
        self.check_log(order, cached_before)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def seal(self, data):
        if data.draw(st.booleans()):
            ids = None
            observed = [observe(self.cache, sid) for sid in self.cache.seq_ids()]
        else:
            ids = data.draw(st.lists(st.sampled_from(self.live()), min_size=1, unique=True))
            observed = [observe(self.cache, sid) for sid in ids]
        cached_before = self.cached()
        order = self.model.seal(observed)
        assert self.cache.seal(ids) == len(order)
        if self.ref is not None:
            assert self.ref.seal(ids) == len(order)
        self.check_log(order, cached_before)

    @invariant()
    def matches_reference(self):
        cache = self.cache
        state = cache._sealed_state()
        assert set(np.flatnonzero(state["sealed"]).tolist()) == self.model.sealed
        sealed = np.flatnonzero(state["sealed"])
        if self.consumers:
            assert state["checksums"][sealed].tolist() == page_checksums(cache.kv, sealed).tolist()
            assert not state["checksums"][state["sealed"] == 0].any()
            assert not cache.verify_pages()
        else:
            assert state["checksums"] is None
        if self.ref is not None:
            for sid in self.live():
                held, _ = observe(cache, sid)
                core = sorted(k for k, p in held.items() if state["sealed"][p])
                assert core == self.ref.sealed_logical_pages(sid), sid


TestSealMachine = SealMachine.TestCase
TestSealMachine.settings = settings(max_examples=120, stateful_step_count=30, deadline=None)
