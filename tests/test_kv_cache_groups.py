"""KVCache with per-layer attention settings (hybrid models): page groups over one pool.

A NumPy reference model (per page group: which positions each sequence
holds, and per layer the K/V it stored) is driven by a hypothesis state
machine against the cache; the rest checks construction, layout, the
all-or-nothing append across groups, the window's resident pages,
snapshots and the features refused with more than one group.
"""
import os
import pathlib

import numpy as np
import pytest
from hypothesis import HealthCheck, event, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagedkv import AttentionSetting, KVCache, OutOfPagesError
from pagedkv.snapshot import SnapshotError

import _snapshot_v1_fixture as v1_fixture

A = AttentionSetting
REFUSED = "not supported with per-layer attention settings"
DATA = pathlib.Path(__file__).parent / "data"


# ----------------------------------------------------------------- AttentionSetting
def test_attention_setting_is_an_immutable_hashable_value():
    a = A(window=16)
    assert (a.window, a.sink_tokens, a.chunk_size) == (16, 0, None)
    assert repr(a) == "AttentionSetting(window=16, sink_tokens=0, chunk_size=None)"
    assert a == A(16, 0, None) and a != A(window=17) and a != A() and hash(a) == hash(A(window=16))
    assert len({A(), A(), A(window=4), A(window=4, sink_tokens=2), A(chunk_size=4)}) == 4
    assert sorted([A(chunk_size=2), A(window=3), A()]) == [A(), A(window=3), A(chunk_size=2)]
    with pytest.raises(AttributeError):
        a.window = 3
    assert A(np.int64(8), np.int32(2)).window == 8


@pytest.mark.parametrize(("kwargs", "error", "name"), [
    ({"window": 0}, ValueError, "window"),
    ({"window": 2**62 + 1}, ValueError, "window"),
    ({"window": 2.0}, TypeError, "window"),
    ({"sink_tokens": -1, "window": 4}, ValueError, "sink_tokens"),
    ({"sink_tokens": 2}, ValueError, "sink_tokens"),
    ({"chunk_size": 0}, ValueError, "chunk_size"),
    ({"chunk_size": True}, TypeError, "chunk_size"),
    ({"chunk_size": 8, "window": 4}, ValueError, "chunk_size"),
])
def test_attention_setting_validation_names_the_argument(kwargs, error, name):
    with pytest.raises(error, match=name):
        A(**kwargs)


# ----------------------------------------------------------------- construction
@pytest.mark.parametrize(("kwargs", "error", "name"), [
    ({"layer_attention": [A()] * 3}, ValueError, "layer_attention"),
    ({"layer_attention": A()}, TypeError, "layer_attention"),
    ({"layer_attention": 5}, TypeError, "layer_attention"),
    ({"layer_attention": [A(), "full", A(), A()]}, TypeError, r"layer_attention\[1\]"),
    ({"layer_attention": [A()] * 4, "window": 8}, ValueError, "window"),
    ({"layer_attention": [A(window=8)] * 4, "sink_tokens": 2}, ValueError, "sink_tokens"),
])
def test_layer_attention_validation_names_the_argument(kwargs, error, name):
    with pytest.raises(error, match=name):
        KVCache(4, 1, 4, 8, **kwargs)


@pytest.mark.parametrize("name", ["enable_kv_events", "tier"])
def test_features_refused_at_construction_with_more_than_one_group(name):
    value = object() if name == "tier" else True
    extra = {"enable_prefix_caching": True} if name == "enable_kv_events" else {}
    with pytest.raises(ValueError, match=REFUSED) as info:
        KVCache(2, 1, 4, 8, layer_attention=[A(window=4), None], **{name: value}, **extra)
    assert name in str(info.value)


def test_features_refused_at_call_with_more_than_one_group():
    cache = KVCache(2, 1, 4, 8, page_size=2, layer_attention=[A(window=4), None])
    cache.add_sequence(1)
    cache.append([1], [3])
    for call, feature in ((lambda: cache.export_sequence(1), "export_sequence"),
                          (lambda: cache.import_sequence(2, b""), "import_sequence"),
                          (lambda: cache._enable_sealed_log(True), "sealed-page log")):
        with pytest.raises(ValueError, match=REFUSED) as info:
            call()
        assert feature in str(info.value)
    with pytest.raises(ValueError, match="group"):
        cache.page_table([1])
    with pytest.raises(ValueError, match="group"):
        cache.num_cached_tokens(1)
    with pytest.raises(IndexError, match="group"):
        cache.page_table([1], group=2)
    cache.check_invariants()


def test_prefix_caching_and_export_still_work_with_one_group_of_equal_settings():
    cache = KVCache(2, 1, 4, 16, page_size=2, layer_attention=[A(window=4)] * 2, enable_prefix_caching=True)
    assert cache.num_groups == 1 and cache.window == 4
    cache.add_sequence(1, [1, 2, 3, 4, 5])
    cache.append([1], [5])
    data = cache.export_sequence(1)
    cache.import_sequence(2, data)
    cache.check_invariants()


# ----------------------------------------------------------------- layout
def test_gcd_grouping_15_sliding_and_3_full_layers_gives_6_groups_of_3():
    layers = ([A(window=16)] * 5 + [None]) * 3
    cache = KVCache(18, 2, 4, 32, layer_attention=layers)
    assert cache.num_groups == 6
    assert cache.kv.shape == (3, 32, 2, 16, 2, 4)
    groups = [cache.group_layers(g) for g in range(6)]
    assert sorted(layer for group in groups for layer in group) == list(range(18))
    assert all(len(group) == 3 and list(group) == sorted(group) for group in groups)
    assert [group[0] for group in groups] == sorted(group[0] for group in groups)
    full = [g for g in range(6) if cache.group_setting(g) == A()]
    assert [cache.group_layers(g) for g in full] == [(5, 11, 17)]
    for layer in range(18):
        g = cache.layer_group(layer)
        assert layer in cache.group_layers(g)
        assert cache.layer_setting(layer) == (A() if layer % 6 == 5 else A(window=16))
        assert cache.group_setting(g) == cache.layer_setting(layer)
        slot = cache.group_layers(g).index(layer)
        assert np.shares_memory(cache.layer_pages(layer), cache.kv[slot])
        assert cache.layer_pages(layer).shape == (32, 2, 16, 2, 4)


def test_gcd_grouping_7_and_5_layers_gives_groups_of_one_layer():
    cache = KVCache(12, 1, 4, 8, layer_attention=[A(chunk_size=8)] * 7 + [None] * 5)
    assert cache.num_groups == 12 and cache.kv.shape[0] == 1
    assert [cache.group_layers(g) for g in range(12)] == [(layer,) for layer in range(12)]
    assert cache.layer_setting(0) == A(chunk_size=8) and cache.layer_setting(11) == A()


def test_uniform_caches_answer_the_group_api_and_keep_their_layout():
    cache = KVCache(3, 2, 4, 8, page_size=4, window=6, sink_tokens=2)
    assert cache.num_groups == 1 and cache.kv.shape == (3, 8, 2, 4, 2, 4)
    assert cache.group_layers(0) == (0, 1, 2) and cache.layer_group(2) == 0
    assert cache.layer_setting(1) == A(6, 2, None) == cache.group_setting(0)
    assert cache.chunk_size is None and cache.window == 6
    cache.add_sequence(1)
    slots = cache.append([1], [5])
    assert slots.shape == (5,)
    pages, view, window, sinks, chunk = cache.layer_attention_view(1, [1])
    assert np.shares_memory(pages, cache.kv[1]) and (window, sinks, chunk) == (6, 2, None)
    assert np.array_equal(view.indices, cache.page_table([1]).indices)
    assert np.array_equal(cache.page_table([1], group=0).indices, view.indices)
    with pytest.raises(IndexError, match="layer"):
        cache.layer_group(3)
    with pytest.raises(IndexError, match="group"):
        cache.group_layers(1)


def test_equal_settings_behave_as_the_uniform_cache_of_that_setting():
    rng = np.random.default_rng(0)
    plain = KVCache(2, 1, 4, 16, page_size=4, window=6, sink_tokens=2, dtype=np.float32)
    layered = KVCache(2, 1, 4, 16, page_size=4, dtype=np.float32, layer_attention=[A(6, 2)] * 2)
    assert layered.window == 6 and layered.sink_tokens == 2 and layered.num_groups == 1
    for cache in (plain, layered):
        cache.add_sequence(7)
    for n in (3, 1, 5, 1, 1, 4):
        a, b = plain.append([7], [n]), layered.append([7], [n])
        assert np.array_equal(a, b)
        k = rng.standard_normal((n, 1, 4))
        for cache in (plain, layered):
            cache.store(0, a, k, -k)
    assert np.array_equal(plain.kv, layered.kv) and plain.stats() == layered.stats()


def test_chunked_layers_are_stored_as_a_window_of_the_chunk():
    cache = KVCache(2, 1, 4, 32, page_size=2, layer_attention=[A(chunk_size=4), None])
    assert cache.num_groups == 2
    cache.add_sequence(1)
    for _ in range(9):
        cache.append([1], [1])
    pages, view, window, sinks, chunk = cache.layer_attention_view(0, [1])
    assert (window, sinks, chunk) == (None, 0, 4)
    # Stored as a window of 4: the last append (at 8) released the pages of positions < 8 - 4 + 1
    # (pages of 2 tokens: those from 0 and 2); the chunk mask is the kernel's.
    assert view.page_positions.tolist() == [4, 6, 8]
    assert cache.layer_attention_view(1, [1])[1].page_positions.tolist() == [0, 2, 4, 6, 8]
    uniform = KVCache(2, 1, 4, 32, page_size=2, layer_attention=[A(chunk_size=4)] * 2)
    assert uniform.chunk_size == 4 and uniform.window is None and uniform.num_groups == 1


# ----------------------------------------------------------------- reference model
class GroupModel:
    """Which positions a sequence holds in one page group: the release rule of DESIGN.md in page terms."""

    def __init__(self, window, sink_tokens, page_size):
        self.window, self.page_size = window, page_size
        self.num_sink_pages = -(-sink_tokens // page_size) if window is not None else 0
        self.ring_first = {}  # seq_id -> logical index of the oldest held window page

    def add(self, seq_id):
        self.ring_first[seq_id] = self.num_sink_pages

    def ring_count(self, seq_id, length):
        return max(-(-length // self.page_size), self.num_sink_pages) - self.ring_first[seq_id]

    def append(self, seq_id, length, count):
        if count and self.window is not None and length - self.window + 1 > 0:
            bound = (length - self.window + 1) // self.page_size
            released = min(max(bound - self.ring_first[seq_id], 0), self.ring_count(seq_id, length))
            self.ring_first[seq_id] += released

    def truncate_allowed(self, seq_id, new_len):
        sink_end = self.num_sink_pages * self.page_size
        low = 0
        if self.window is not None and self.ring_first[seq_id] > self.num_sink_pages:
            low = self.ring_first[seq_id] * self.page_size + self.window - 1
        return not (sink_end < new_len < low)

    def truncate(self, seq_id, length, new_len):
        keep = -(-new_len // self.page_size)
        if self.ring_first[seq_id] >= keep:  # every window page goes
            self.ring_first[seq_id] = max(self.num_sink_pages, keep)

    def held(self, seq_id, length):
        """Positions the group holds, increasing."""
        logical = np.arange(length) // self.page_size
        return np.flatnonzero((logical < self.num_sink_pages) | (logical >= self.ring_first[seq_id]))

    def window_pages(self, seq_id, length):
        return self.ring_count(seq_id, length)


CONFIGS = [
    # (layer settings, page_size): two kinds of two layers (G = 2), then three kinds of one layer,
    # with sinks and a chunked layer.
    ([A(window=5), None, A(window=5), None], 2),
    ([A(window=3, sink_tokens=3), A(chunk_size=4), None], 2),
    ([None, A(window=4), A(window=4), A(window=4), None, A(window=4)], 3),
]


class HybridCacheMachine(RuleBasedStateMachine):
    """A hybrid cache against the reference model, with K/V stored per layer, with or without prefix caching.

    Every token has an id (from a small alphabet, so that prompts share
    prefixes) and the K/V stored at a position is a value unique to the
    layer and the token prefix up to it: a page served from the prefix cache
    must hold exactly the values of its prompt's prefix in that layer. With
    prefix caching the model keeps its own index: per group, the token
    prefixes of the full pages registered (as the cache registers them: held
    pages that fill, from the chain's registered point on, one page per
    hash), each with the page id that holds it, dropped when the allocator
    hands that page out again or an append writes into it; the pages it lists
    must be exactly the cache's cached pages, and a prompt's hit is the
    largest number of pages every group can serve from it.
    """

    def __init__(self):
        super().__init__()
        self.cache = None

    @initialize(config=st.sampled_from(CONFIGS), num_pages=st.integers(6, 24),
                prefix=st.sampled_from([None, "xxh3_128", "sha256"]))
    def setup(self, config, num_pages, prefix):
        layers, page_size = config
        self.page_size = page_size
        self.prefix = prefix is not None
        self.cache = KVCache(len(layers), 1, 2, num_pages, page_size=page_size, dtype=np.float32,
                             layer_attention=layers, page_checksums=True, enable_prefix_caching=self.prefix,
                             prefix_hash=prefix or "xxh3_128")
        self.num_layers = len(layers)
        self.models = []
        for g in range(self.cache.num_groups):
            s = self.cache.group_setting(g)
            window = s.chunk_size if s.chunk_size is not None else s.window
            self.models.append(GroupModel(window, s.sink_tokens, page_size))
        self.lengths = {}  # seq_id -> length
        self.kv = {}  # seq_id -> layer -> {position: value}
        self.tokens = {}  # seq_id -> known token ids (a prompt may run past the length)
        self.history = []  # token ids of removed sequences and of truncated tails
        self.values = {}  # (layer, token prefix) -> the K value stored for its last position
        self.registry = {}  # (group, token prefix of a full page) -> page id cached under it
        self.registered = {}  # (group, seq_id) -> leading pages of the chain already offered to the index
        self.queries = self.hits = self.lookups = 0
        self.next_id = 0
        self.add()

    def _value(self, layer, prefix):
        return self.values.setdefault((layer, tuple(prefix)), float(len(self.values) + 1))

    def _start(self, seq_id, tokens):
        self.lengths[seq_id] = 0
        self.tokens[seq_id] = list(tokens)
        self.kv[seq_id] = {layer: {} for layer in range(self.num_layers)}
        for g, model in enumerate(self.models):
            model.add(seq_id)
            self.registered[g, seq_id] = 0

    # ------------------------------------------------------------ rules
    @rule()
    def add(self):
        seq_id = self.next_id
        self.next_id += 1
        self.cache.add_sequence(seq_id)
        self._start(seq_id, [])

    @rule(data=st.data())
    def add_prompt(self, data):
        """A new sequence whose prompt starts like a known one (or not): served as the reference says."""
        # The tokens of a live sequence or of a removed or truncated one (whose freed pages may be
        # cached, or evicted in one group and not in another).
        sources = [self.tokens[seq_id] for seq_id in sorted(self.tokens)] + self.history[-8:]
        known = data.draw(st.sampled_from(sources)) if sources else []
        prompt = known[:data.draw(st.integers(0, len(known)))] + data.draw(st.lists(st.integers(0, 2), max_size=6))
        seq_id = self.next_id
        self.next_id += 1
        expected = self._expected_hit(prompt) if self.prefix else 0
        served = self.cache.add_sequence(seq_id, prompt)
        assert served == expected * self.page_size, (prompt, served, expected)
        event(f"add_prompt: {'hit' if expected else 'miss'}")
        if self.prefix and expected < self._expected_hit(prompt, groups=[g for g, m in enumerate(self.models)
                                                                         if m.window is None]):
            event("add_prompt: a sliding group limits the hit")
        self._start(seq_id, prompt)
        if self.prefix:
            self.queries += len(prompt)
            self.hits += served
            self.lookups += 1
        if expected:
            self.lengths[seq_id] = served
            for g, model in enumerate(self.models):
                self.registered[g, seq_id] = expected
                if model.window is not None:
                    model.ring_first[seq_id] = max(model.num_sink_pages, self._low(model, expected))
            for layer in range(self.num_layers):
                for pos in range(served):
                    self.kv[seq_id][layer][pos] = self._value(layer, prompt[:pos + 1])

    @precondition(lambda self: self.lengths)
    @rule(data=st.data())
    def append(self, data):
        ids = data.draw(st.lists(st.sampled_from(sorted(self.lengths)), min_size=1, max_size=3, unique=True))
        counts = data.draw(st.lists(st.integers(0, 7), min_size=len(ids), max_size=len(ids)))
        new_tokens = []
        for seq_id, n in zip(ids, counts):
            known = self.tokens[seq_id][self.lengths[seq_id]:self.lengths[seq_id] + n]
            new_tokens.append(known + data.draw(st.lists(st.integers(0, 2), min_size=n - len(known),
                                                         max_size=n - len(known))))
        before = self._state()
        held_before = self._holdings() if self.prefix else None
        try:
            slots = self.cache.append(ids, counts, [t for tokens in new_tokens for t in tokens])
        except OutOfPagesError:
            event("append: OutOfPagesError")
            assert self._state() == before, "an OutOfPagesError changed the cache"
            return
        assert slots.shape == (self.cache.num_groups, sum(counts)) and slots.dtype == np.int64
        for seq_id, n, tokens in zip(ids, counts, new_tokens):
            for model in self.models:
                model.append(seq_id, self.lengths[seq_id], n)
            length = self.lengths[seq_id]
            self.tokens[seq_id] = self.tokens[seq_id][:length] + tokens + self.tokens[seq_id][length + n:]
        for layer in range(self.num_layers):
            values = np.array([self._value(layer, self.tokens[seq_id][:self.lengths[seq_id] + i + 1])
                               for seq_id, n in zip(ids, counts) for i in range(n)], dtype=np.float32)
            k = np.repeat(values.reshape(-1, 1, 1), 2, axis=2)
            self.cache.store(layer, slots, k, -k)
            t = 0
            for seq_id, n in zip(ids, counts):
                for i in range(n):
                    self.kv[seq_id][layer][self.lengths[seq_id] + i] = values[t]
                    t += 1
        old_lengths = {seq_id: self.lengths[seq_id] for seq_id in ids}
        for seq_id, n in zip(ids, counts):
            self.lengths[seq_id] += n
            # The window's resident pages after an append of n tokens (DESIGN.md).
            for g, model in enumerate(self.models):
                if model.window is not None and n:
                    bound = -(-(model.window + n - 2) // self.page_size) + 1
                    assert model.window_pages(seq_id, self.lengths[seq_id]) <= max(bound, 1)
        if self.prefix:
            self._register(ids, counts, old_lengths, held_before)

    # ------------------------------------------------------------ prefix model
    def _holdings(self):
        """``{(group, seq_id, logical page): page id}`` of every table."""
        out = {}
        ids = sorted(self.lengths)
        for g in range(self.cache.num_groups):
            view = self.cache.page_table(ids, group=g)
            for b, seq_id in enumerate(ids):
                for j in range(view.indptr[b], view.indptr[b + 1]):
                    out[g, seq_id, int(view.page_positions[j]) // self.page_size] = int(view.indices[j])
        return out

    def _register(self, ids, counts, old_lengths, held_before):
        """The model's index after an append: pages handed out or written into leave it, pages that filled join."""
        ps = self.page_size
        held = self._holdings()
        gone = {page for key, page in held.items() if held_before.get(key) != page}  # taken from the pool
        for seq_id, n in zip(ids, counts):
            if n and old_lengths[seq_id] % ps:  # the append wrote into its partial last page
                for g in range(self.cache.num_groups):
                    key = (g, seq_id, old_lengths[seq_id] // ps)
                    if held_before.get(key) == held.get(key):  # in place, not a copy-on-write copy
                        gone.add(held[key])
        self.registry = {key: page for key, page in self.registry.items() if page not in gone}
        cached = set(self.registry.values())
        for g in range(self.cache.num_groups):
            for seq_id in ids:
                tokens = self.tokens[seq_id]
                upto = min(self.lengths[seq_id] // ps, len(tokens) // ps)
                for k in range(self.registered[g, seq_id], upto):
                    page = held.get((g, seq_id, k))
                    if page is None or page in cached:
                        continue  # released by the window, or cached already
                    key = (g, tuple(tokens[:(k + 1) * ps]))
                    if key not in self.registry:
                        self.registry[key] = page
                        cached.add(page)
                self.registered[g, seq_id] = max(self.registered[g, seq_id], upto)

    def _low(self, model, h):
        """The first window page the query at ``h * page_size`` needs (sink pages excluded)."""
        return max(model.num_sink_pages, max(0, h * self.page_size - model.window + 1) // self.page_size)

    def _expected_hit(self, prompt, groups=None):
        """The largest number of pages every group (of ``groups``, default all) can serve from the model's
        index (the last token computed)."""
        ps = self.page_size
        servable = (len(prompt) - 1) // ps if prompt else 0
        best = 0
        for h in range(1, servable + 1):
            ok = True
            for g, model in enumerate(self.models):
                if groups is not None and g not in groups:
                    continue
                needed = range(h) if model.window is None else \
                    list(range(min(model.num_sink_pages, h))) + list(range(self._low(model, h), h))
                ok = ok and all((g, tuple(prompt[:(k + 1) * ps])) in self.registry for k in needed)
            if ok:
                best = h
        return best

    @precondition(lambda self: self.prefix)
    @rule()
    def reset_prefix_cache(self):
        empty = self.cache.stats()["pages_in_use"] == 0
        assert self.cache.reset_prefix_cache() == empty
        if empty:
            self.registry.clear()

    @precondition(lambda self: self.lengths)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(sorted(self.lengths)))
        child = self.next_id
        self.next_id += 1
        self.cache.fork(parent, child)
        self.lengths[child] = self.lengths[parent]
        self.kv[child] = {layer: dict(rows) for layer, rows in self.kv[parent].items()}
        self.tokens[child] = list(self.tokens[parent])
        for g, model in enumerate(self.models):
            model.ring_first[child] = model.ring_first[parent]
            self.registered[g, child] = self.registered[g, parent]

    @precondition(lambda self: self.lengths)
    @rule(data=st.data())
    def truncate(self, data):
        seq_id = data.draw(st.sampled_from(sorted(self.lengths)))
        length = self.lengths[seq_id]
        new_len = data.draw(st.integers(0, length))
        allowed = all(model.truncate_allowed(seq_id, new_len) for model in self.models)
        before = self._state()
        if not allowed:
            event("truncate: refused by a window")
            with pytest.raises(ValueError, match="new_len"):
                self.cache.truncate(seq_id, new_len)
            assert self._state() == before
            return
        self.cache.truncate(seq_id, new_len)
        for model in self.models:
            model.truncate(seq_id, length, new_len)
        self.lengths[seq_id] = new_len
        self.history.append(self.tokens[seq_id])
        self.tokens[seq_id] = self.tokens[seq_id][:new_len]
        for g in range(len(self.models)):
            self.registered[g, seq_id] = min(self.registered[g, seq_id], new_len // self.page_size)
        for rows in self.kv[seq_id].values():
            for p in [p for p in rows if p >= new_len]:
                del rows[p]

    @precondition(lambda self: self.lengths)
    @rule(data=st.data())
    def remove(self, data):
        seq_id = data.draw(st.sampled_from(sorted(self.lengths)))
        self.cache.remove_sequence(seq_id)
        self.history.append(self.tokens[seq_id])
        del self.lengths[seq_id], self.kv[seq_id], self.tokens[seq_id]
        for g, model in enumerate(self.models):
            del model.ring_first[seq_id], self.registered[g, seq_id]

    # ------------------------------------------------------------ checks
    def _state(self):
        """Everything observable of the cache's page state, comparable with ==."""
        state = self.cache._export_state()
        tables = [[(k, t["length"], t["ring_first"], t["pages"].tolist()) for k, t, _ in state["sequences"]]]
        tables += [[(k, t["length"], t["ring_first"], t["pages"].tolist()) for k, t in more]
                   for more in state["group_tables"]]
        stats = self.cache.stats()
        return (tables, state["ref_counts"].tolist(), state["free_queue"].tolist(), stats,
                self.cache._sealed_state()["sealed"].tolist())

    @invariant()
    def matches_the_model(self):
        if self.cache is None:
            return
        self.cache.check_invariants()
        assert self.cache.seq_ids() == sorted(self.lengths)
        used = 0
        for g, model in enumerate(self.models):
            ids = sorted(self.lengths)
            view = self.cache.page_table(ids, group=g)
            used += view.indices.shape[0]
            assert view.seq_lens.tolist() == [self.lengths[s] for s in ids]
            for s in ids:
                assert self.cache.num_cached_tokens(s, group=g) == model.held(s, self.lengths[s]).shape[0]
        for seq_id, length in self.lengths.items():
            assert self.cache.seq_len(seq_id) == length
            for layer in range(self.num_layers):
                model = self.models[self.cache.layer_group(layer)]
                held = model.held(seq_id, length)
                k, v, positions = self.cache.gather(layer, seq_id)
                assert positions.tolist() == held.tolist(), (seq_id, layer)
                expected = np.array([self.kv[seq_id][layer].get(p, np.nan) for p in held], dtype=np.float32)
                assert np.array_equal(k[:, 0, 0], expected), (seq_id, layer)
                assert np.array_equal(v[:, 0, 1], -expected), (seq_id, layer)
        stats = self.cache.stats()
        assert stats["pages_in_use"] + stats["pages_free"] == self.cache.num_pages
        assert stats["bytes_per_page"] == self.cache.kv[:, 0].nbytes
        assert stats["num_sequences"] == len(self.lengths)
        assert self.cache.verify_pages().bad_pages == []
        if self.prefix:
            pages = sorted(self.registry.values())
            assert len(set(pages)) == len(pages)
            assert pages == sorted(self.cache.prefix_index.cached_pages()), "the index is not the model's"
            stats = self.cache.stats(metrics=True)
            assert (stats["prefix_queries"], stats["prefix_hits"], stats["prefix_lookups"]) == \
                (self.queries, self.hits, self.lookups)
            assert sum(stats["prefix_hit_histogram"]) == self.lookups


TestHybridCacheMachine = HybridCacheMachine.TestCase
TestHybridCacheMachine.settings = settings(max_examples=int(os.environ.get("PAGEDKV_GROUP_EXAMPLES", 200)),
                                           stateful_step_count=30, deadline=None,
                                           suppress_health_check=[HealthCheck.too_slow])


# ----------------------------------------------------------------- all or nothing
def _observable(cache):
    state = cache._export_state()
    return (repr([(k, t["length"], t["ring_first"], t["pages"].tolist()) for k, t, _ in state["sequences"]]),
            repr([[(k, t["length"], t["pages"].tolist()) for k, t in more] for more in state["group_tables"]]),
            state["ref_counts"].tolist(), state["free_queue"].tolist(), cache.stats(),
            cache._sealed_state()["sealed"].tolist(), cache.kv.copy())


def test_out_of_pages_in_one_group_leaves_every_group_unchanged():
    # Window group (first) and full group: the full group runs out while the window group could go on.
    cache = KVCache(2, 1, 2, 10, page_size=2, dtype=np.float32, layer_attention=[A(window=2), None],
                    page_checksums=True)
    cache.add_sequence(1)
    cache.add_sequence(2)
    slots = cache.append([1, 2], [4, 2])
    cache.store(0, slots, np.ones((6, 1, 2)), np.ones((6, 1, 2)))
    cache.fork(2, 3)  # a shared partial page: the next append to 3 copies it
    before = _observable(cache)
    with pytest.raises(OutOfPagesError, match="page groups") as info:
        cache.append([1, 3], [3, 5])
    assert "Nothing was changed" in str(info.value)
    after = _observable(cache)
    for a, b in zip(before[:-2], after[:-2]):
        assert a == b
    assert before[-2] == after[-2] and np.array_equal(before[-1], after[-1])
    cache.check_invariants()
    assert cache.stats(metrics=True)["out_of_pages_errors"] == 1
    # What fits still goes through, in both groups.
    cache.append([1], [1])
    cache.check_invariants()


def test_pages_a_window_group_releases_serve_another_group_in_the_same_append():
    cache = KVCache(2, 1, 2, 4, page_size=2, layer_attention=[A(window=1), None])
    cache.add_sequence(1)
    cache.append([1], [4])  # two pages in each group: the pool is full
    assert cache.stats()["pages_free"] == 0
    # The next append releases both of the window group's pages (positions < 4) first; one of
    # them serves the full group's new page.
    slots = cache.append([1], [2])
    assert slots.shape == (2, 2) and slots[0, 0] // 2 != slots[1, 0] // 2
    cache.check_invariants()
    assert cache.stats()["pages_free"] == 0 and cache.stats()["evictions"] == 2


# ----------------------------------------------------------------- resident pages
@pytest.mark.parametrize(("window", "sinks", "page_size"), [(8, 0, 4), (5, 3, 2), (16, 4, 16)])
def test_a_sliding_group_keeps_its_decode_bound_while_the_full_group_grows(window, sinks, page_size):
    cache = KVCache(4, 1, 2, 256, page_size=page_size,
                    layer_attention=[A(window=window, sink_tokens=sinks), None] * 2)
    sliding = cache.layer_group(0)
    full = cache.layer_group(1)
    cache.add_sequence(1)
    bound = -(-(window - 1) // page_size) + 1 + -(-sinks // page_size)
    for step in range(200):
        cache.append([1], [1])
        held = cache.page_table([1], group=sliding).indices.shape[0]
        assert held <= bound
        assert cache.page_table([1], group=full).indices.shape[0] == -(-(step + 1) // page_size)
    assert cache.stats()["pages_in_use"] == held + -(-200 // page_size)
    cache.check_invariants()


# ----------------------------------------------------------------- snapshots
def _hybrid_cache():
    cache = KVCache(6, 2, 4, 48, page_size=4, page_checksums=True,
                    layer_attention=[A(window=6, sink_tokens=2), A(window=6, sink_tokens=2), None, None,
                                     A(chunk_size=8), A(chunk_size=8)])
    rng = np.random.default_rng(1)
    cache.add_sequence(1)
    cache.add_sequence(2)
    for n in (5, 1, 1, 7, 1, 2):
        slots = cache.append([1, 2], [n, 1])
        for layer in range(6):
            k = rng.standard_normal((n + 1, 2, 4))
            cache.store(layer, slots, k, -k)
    cache.fork(1, 3)
    cache.append([3], [1])
    cache.truncate(2, cache.seq_len(2) - 1)
    return cache


def _same_cache(a, b):
    assert a.num_groups == b.num_groups and a.kv.shape == b.kv.shape
    assert [a.layer_setting(layer) for layer in range(a.num_layers)] == \
        [b.layer_setting(layer) for layer in range(b.num_layers)]
    assert a.seq_ids() == b.seq_ids() and a.stats() == b.stats()
    for g in range(a.num_groups):
        va, vb = a.page_table(a.seq_ids(), group=g), b.page_table(b.seq_ids(), group=g)
        assert np.array_equal(va.indices, vb.indices) and np.array_equal(va.page_positions, vb.page_positions)
    for layer in range(a.num_layers):
        for seq_id in a.seq_ids():
            for x, y in zip(a.gather(layer, seq_id), b.gather(layer, seq_id)):
                assert np.array_equal(x, y)


@pytest.mark.parametrize("mmap", [False, True])
def test_snapshot_round_trip_of_a_hybrid_cache(tmp_path, mmap):
    from pagedkv import snapshot

    cache = _hybrid_cache()
    assert cache.num_groups == 3
    path = tmp_path / "hybrid.pkv"
    cache.save(path)
    snapshot.verify(path)
    loaded = KVCache.load(path, mmap=mmap)
    loaded.check_invariants()
    _same_cache(cache, loaded)
    assert loaded._sealed_state()["sealed"].tolist() == cache._sealed_state()["sealed"].tolist()
    assert not loaded.verify_pages()
    # The loaded cache goes on as the saved one would.
    for c in (cache, loaded):
        c.append([1, 2, 3], [3, 1, 2])
        c.remove_sequence(2)
    _same_cache(cache, loaded)
    assert int.from_bytes(path.read_bytes()[8:12], "little") == snapshot.FORMAT_VERSION == 2


def test_snapshot_round_trip_of_a_cache_of_equal_layer_settings(tmp_path):
    cache = KVCache(2, 1, 4, 16, page_size=2, layer_attention=[A(chunk_size=4)] * 2)
    cache.add_sequence(1)
    cache.append([1], [9])
    cache.save(tmp_path / "c.pkv")
    loaded = KVCache.load(tmp_path / "c.pkv")
    assert loaded.chunk_size == 4 and loaded.num_groups == 1
    _same_cache(cache, loaded)


def test_restore_refuses_a_page_held_by_two_groups():
    cache = KVCache(2, 1, 4, 16, page_size=2, layer_attention=[A(window=4), None])
    cache.add_sequence(1)
    cache.append([1], [3])
    state = cache._export_state()
    pages = state["group_tables"][0][0][1]["pages"]
    pages[0] = state["sequences"][0][1]["pages"][0]  # group 1's first page is group 0's
    fresh = KVCache(2, 1, 4, 16, page_size=2, layer_attention=[A(window=4), None])
    with pytest.raises(ValueError, match="page groups 0 and 1|ref count"):
        fresh._restore_state(state)
    assert fresh.num_sequences == 0


def test_a_version_1_snapshot_still_loads(tmp_path):
    from pagedkv import snapshot

    path = DATA / "snapshot_v1.pkv"
    assert int.from_bytes(path.read_bytes()[8:12], "little") == 1
    snapshot.verify(path)
    for mmap in (False, True):
        cache = KVCache.load(path, mmap=mmap)
        cache.check_invariants()
        assert cache.num_groups == 1 and cache.window == 6 and cache.sink_tokens == 2 and cache.prefix_caching
        assert cache.seq_ids() == [1, 2, 3]
        assert not cache.verify_pages()
        for seq_id in (1, 2, 3):
            for layer in range(2):
                k, v, positions = cache.gather(layer, seq_id)
                expected = v1_fixture.expected_rows(layer, seq_id, positions.tolist())
                assert np.array_equal(k, expected) and np.array_equal(v, -expected)
        # It goes on, and saves as version 2 a file that loads.
        cache.add_sequence(4, v1_fixture.PROMPT)
        cache.save(tmp_path / "again.pkv")
        again = KVCache.load(tmp_path / "again.pkv")
        again.check_invariants()
        assert again.seq_ids() == [1, 2, 3, 4]


def test_a_version_1_file_may_not_carry_layer_attention():
    from pagedkv.snapshot import _read_config
    from pagedkv._snapshot_format import _Section

    arrays = {"num_layers": 2, "num_kv_heads": 1, "head_dim": 4, "num_pages": 8, "page_size": 2,
              "dtype": "float16", "window": -1, "sink_tokens": 0, "prefix_caching": 0, "prefix_hash": "xxh3_128",
              "page_checksums": 0}
    section = _Section("config", {key: (np.frombuffer(value.encode(), np.uint8) if isinstance(value, str)
                                        else np.array(value, dtype=np.int64)) for key, value in arrays.items()}
                       | {"layer_attention": np.array([[4, 0, -1], [-1, 0, -1]], dtype=np.int64)})
    assert _read_config(section, 8, 2)["layer_attention"] == ((4, 0, -1), (-1, 0, -1))
    with pytest.raises(SnapshotError, match="version 1"):
        _read_config(section, 8, 1)


@pytest.mark.parametrize("edit", ["groups order", "groups missing", "two groups share a page", "group lengths",
                                  "layer_attention shape", "layer_attention invalid", "window with layers"])
def test_forged_hybrid_snapshots_are_refused(tmp_path, edit):
    from _snapshot_forge import forge_file
    from pagedkv import snapshot

    cache = _hybrid_cache()
    path = tmp_path / "forged.pkv"
    cache.save(path)

    def change(sections):
        tables, config = sections["tables"], sections["config"]
        rows = tables["seq_ids"].shape[0] // 3
        if edit == "groups order":
            tables["groups"] = tables["groups"][::-1].copy()
        elif edit == "groups missing":
            del tables["groups"]
        elif edit == "two groups share a page":  # group 1's first page replaced by group 0's first page
            first_of_group_1 = int(tables["fields"][:rows, 4].sum())
            tables["pages"][first_of_group_1] = tables["pages"][0]
        elif edit == "group lengths":
            tables["fields"][rows, 0] -= 1
        elif edit == "layer_attention shape":
            config["layer_attention"] = config["layer_attention"][:5].copy()
        elif edit == "layer_attention invalid":
            config["layer_attention"][0, 2] = 4  # a window and a chunk size on one layer
        elif edit == "window with layers":
            config["window"] = np.array(8, dtype=np.int64)

    forge_file(path, change)
    with pytest.raises(SnapshotError):
        KVCache.load(path)
    with pytest.raises(SnapshotError):
        snapshot.verify(path)


def test_pages_seal_when_their_own_group_moves_past_them():
    cache = KVCache(2, 1, 2, 32, page_size=2, dtype=np.float32, page_checksums=True,
                    layer_attention=[A(window=3), None])
    cache.add_sequence(1)
    slots = cache.append([1], [3])  # pages: positions 0-1 full, 2 partial, in both groups
    for layer in range(2):
        cache.store(layer, slots, np.full((3, 1, 2), layer + 1.0), np.zeros((3, 1, 2)))
    sealed = lambda: set(np.flatnonzero(cache._sealed_state()["sealed"]).tolist())  # noqa: E731
    assert sealed() == set()
    cache.append([1], [1])  # moves past the full page of each group: both seal
    full_pages = {int(cache.page_table([1], group=g).indices[0]) for g in range(2)}
    window_page = int(slots[0, 0] // 2)
    assert window_page in full_pages and sealed() == full_pages
    assert cache.seal() == 1 + 1  # the pages of positions 2-3, one per group
    assert not cache.verify_pages()
    # A changed byte in one group's page is found, with the sequence holding it.
    page = int(cache.page_table([1], group=1).indices[1])
    cache.layer_pages(1)[page, 0, 0, 0, 0] += 1
    report = cache.verify_pages([1])
    assert [bad.page_id for bad in report.bad_pages] == [page] and report.bad_pages[0].seq_ids == [1]


def test_a_removal_deferred_from_a_finalizer_removes_every_group():
    from test_threads import _GarbageStream, run_threads

    cache = KVCache(2, 1, 2, 32, page_size=2, layer_attention=[A(window=3), None])
    for seq_id in range(3):
        cache.add_sequence(seq_id)
    cache.append([0, 1, 2], [5, 5, 5])
    victims = [1, 2]
    log = []

    def finalize():
        if not victims:
            return
        try:
            cache.seq_len(0)
            return  # not inside a call of the cache
        except RuntimeError:
            pass
        seq_id = victims.pop()
        cache.remove_sequence(seq_id)
        log.append("deferred" if seq_id in cache else "removed")

    def scenario():
        with _GarbageStream(finalize):
            while victims:
                cache.page_table([0, 0, 0], group=1)

    run_threads(scenario, timeout=60)
    assert log == ["deferred", "deferred"]
    assert cache.seq_ids() == [0]
    cache.check_invariants()
    assert cache.stats()["pages_in_use"] == sum(cache.page_table([0], group=g).indices.shape[0] for g in range(2))


def test_append_and_store_arguments_with_page_groups():
    cache = KVCache(3, 1, 2, 16, page_size=2, dtype=np.float32, layer_attention=[A(window=2), None, None])
    assert cache.num_groups == 3
    cache.add_sequence(1)
    assert cache.append([1], [2], return_slot_mapping=False) is None
    empty = cache.append([], [])
    assert empty.shape == (3, 0)
    slots = cache.append([1], [1])
    k = np.ones((1, 1, 2))
    with pytest.raises(ValueError, match="slot_mapping"):
        cache.store(0, slots[:2], k, k)  # two rows: neither one group's slots nor every group's
    for row in range(3):  # a 1-D row, even the layer's own: a row of another group would write another layer
        with pytest.raises(ValueError, match=r"^Invalid shape of slot_mapping: expected the \(3, T\) array"):
            cache.store(0, slots[row], k, k)
    with pytest.raises(ValueError, match="k"):
        cache.store(0, slots, np.ones((2, 1, 2)), k)
    with pytest.raises(IndexError, match="layer"):
        cache.store(3, slots, k, k)
    for layer in range(3):
        cache.store(layer, slots, k * layer, -k)
    for layer in range(3):
        keys, _, positions = cache.gather(layer, 1)
        assert positions[-1] == 2 and keys[-1, 0, 0] == layer
    with pytest.raises(KeyError):
        cache.append([2], [1])
    with pytest.raises(ValueError, match="num_tokens"):
        cache.append([1], [1, 1])
    cache.check_invariants()


# ----------------------------------------------------------------- prefix caching with page groups
PROMPT = list(range(100, 113))  # 13 tokens: 6 full pages of 2 and one partial


def _decoded(cache, seq_id, prompt):
    """Append a prompt's remaining tokens one at a time, storing per layer a K unique to (layer, position)."""
    for pos in range(cache.seq_len(seq_id), len(prompt)):
        slots = cache.append([seq_id], [1])
        for layer in range(cache.num_layers):
            k = np.full((1, 1, 2), 1000.0 * layer + pos, dtype=np.float32)
            cache.store(layer, slots, k, -k)
    cache.check_invariants()


def _positions(cache, seq_id, group):
    return cache.page_table([seq_id], group=group).page_positions.tolist()


def _same_kv_where_held(cache, a, b):
    """Every row sequence ``b`` holds equals sequence ``a``'s at that position, in every layer."""
    for layer in range(cache.num_layers):
        ka, va, pa = cache.gather(layer, a)
        kb, vb, pb = cache.gather(layer, b)
        rows = {int(p): i for i, p in enumerate(pa)}
        assert pb.size and all(int(p) in rows for p in pb)
        index = [rows[int(p)] for p in pb]
        assert np.array_equal(kb, ka[index]) and np.array_equal(vb, va[index])


def test_a_sliding_group_serves_from_the_pages_it_still_holds_after_its_early_pages_were_evicted():
    cache = KVCache(2, 1, 2, 16, page_size=2, dtype=np.float32, enable_prefix_caching=True,
                    layer_attention=[A(window=4), None])
    sliding, full = 0, 1
    cache.add_sequence(1, PROMPT)
    _decoded(cache, 1, PROMPT)
    assert _positions(cache, 1, sliding) == [8, 10, 12]  # pages of positions < 8 released (cached, free)
    # Another sequence takes every free page: the sliding group's released pages are evicted.
    cache.add_sequence(9)
    cache.append([9], [6])
    assert cache.stats()["pages_free"] == 0 and cache.stats()["prefix_evictions"] == 4
    # The whole prompt again: the full group has pages 0-5, the sliding group needs only pages 4-5
    # (the query at 12 sees 9..12).
    assert cache.add_sequence(2, PROMPT + [7]) == 12
    assert _positions(cache, 2, full) == [0, 2, 4, 6, 8, 10] and _positions(cache, 2, sliding) == [8, 10]
    for g in (sliding, full):
        assert cache.page_table([2], group=g).seq_lens.tolist() == [12]
    assert cache.num_cached_tokens(2, group=full) == 12 and cache.num_cached_tokens(2, group=sliding) == 4
    _same_kv_where_held(cache, 1, 2)
    # A prompt sharing only pages 0-3: the full group could serve 4 pages, but the sliding group
    # would need pages 2-3 (for 4), 1-2 (for 3), ..., all evicted: nothing is served.
    assert cache.add_sequence(3, PROMPT[:8] + [7, 7, 7]) == 0
    assert cache.stats(metrics=True)["prefix_hit_histogram"][:2] == (2, 1)
    cache.check_invariants()
    # The served sequence goes on as a computed one would.
    cache.remove_sequence(9)
    _decoded(cache, 2, PROMPT + [7])
    cache.check_invariants()


def test_evicting_one_groups_page_limits_the_hit_of_every_group():
    cache = KVCache(2, 1, 2, 16, page_size=2, dtype=np.float32, enable_prefix_caching=True,
                    layer_attention=[None, A(window=4)])
    full, sliding = 0, 1
    cache.add_sequence(1, PROMPT)
    _decoded(cache, 1, PROMPT)
    pages = {g: dict(zip(_positions(cache, 1, g), cache.page_table([1], group=g).indices.tolist()))
             for g in (full, sliding)}
    cache.remove_sequence(1)  # every page free; the full pages stay cached
    cache.add_sequence(9)
    cache.append([9], [8])  # takes 8 pages from the front of the free queue
    cached = set(cache.prefix_index.cached_pages().tolist())
    assert {pages[full][p] for p in (0, 2, 4, 6, 8)} <= cached and pages[full][10] not in cached
    # Cached: the full pages of positions 0-9, the sliding pages of 8-11; the sliding group's earlier
    # (released while decoding) and the full page of 10-11 were evicted.
    assert {pages[sliding][8], pages[sliding][10]} <= cached and len(cached) == 7
    # Alone, the sliding group could serve 6 pages (it needs pages 4-5) and the full group 5; every
    # smaller hit needs evicted pages of the sliding group: nothing is served.
    assert cache.add_sequence(2, PROMPT + [7]) == 0
    assert all(cache.page_table([2], group=g).indices.size == 0 for g in (full, sliding))
    cache.check_invariants()


def test_sink_pages_are_served_with_the_window_pages():
    cache = KVCache(2, 1, 2, 32, page_size=2, dtype=np.float32, enable_prefix_caching=True,
                    layer_attention=[A(window=4, sink_tokens=2), None])
    sliding, full = 0, 1
    cache.add_sequence(1, PROMPT)
    _decoded(cache, 1, PROMPT)
    assert _positions(cache, 1, sliding) == [0, 8, 10, 12]
    assert cache.add_sequence(2, PROMPT + [7]) == 12
    assert _positions(cache, 2, sliding) == [0, 8, 10] and _positions(cache, 2, full) == list(range(0, 12, 2))
    _same_kv_where_held(cache, 1, 2)
    # A prompt whose first page differs matches no sink page: nothing is served.
    assert cache.add_sequence(3, [5] + PROMPT[1:] + [7]) == 0
    cache.check_invariants()


def test_a_chunked_group_is_served_as_the_window_of_its_chunk():
    cache = KVCache(2, 1, 2, 32, page_size=2, dtype=np.float32, enable_prefix_caching=True,
                    layer_attention=[A(chunk_size=4), None])
    chunked, full = 0, 1
    cache.add_sequence(1, PROMPT)
    _decoded(cache, 1, PROMPT)
    assert cache.add_sequence(2, PROMPT + [7]) == 12
    # The query at 12 reads its chunk from 12 on; the group, stored as a window of 4, takes the pages
    # that window needs (positions 9..12: pages of 8 and 10).
    assert _positions(cache, 2, chunked) == [8, 10] and _positions(cache, 2, full) == list(range(0, 12, 2))
    _same_kv_where_held(cache, 1, 2)
    cache.check_invariants()


def test_every_group_registers_its_own_pages_under_its_own_hashes():
    cache = KVCache(4, 1, 2, 64, page_size=2, dtype=np.float32, enable_prefix_caching=True,
                    layer_attention=[A(window=6), None, A(window=6), None])
    assert cache.num_groups == 2
    cache.add_sequence(1, PROMPT)
    cache.append([1], [13])
    index = cache.prefix_index
    per_group = [cache.page_table([1], group=g).indices[:6].tolist() for g in range(2)]
    assert sorted(index.cached_pages().tolist()) == sorted(per_group[0] + per_group[1])
    hashes = [[index.page_hash(p) for p in pages] for pages in per_group]
    assert not set(hashes[0]) & set(hashes[1])
    # Group 0's chain is not the chain of a cache without groups either.
    plain = KVCache(1, 1, 2, 64, page_size=2, enable_prefix_caching=True)
    plain.add_sequence(1, PROMPT)
    plain.append([1], [13])
    plain_hashes = [plain.prefix_index.page_hash(p) for p in plain.page_table([1]).indices[:6].tolist()]
    assert not set(plain_hashes) & (set(hashes[0]) | set(hashes[1]))
    # Salts keep tenants apart in every group.
    assert cache.add_sequence(2, PROMPT, extra_key="other") == 0
    assert cache.add_sequence(3, PROMPT) == 12


def test_reset_prefix_cache_and_stats_with_page_groups():
    cache = KVCache(2, 1, 2, 32, page_size=2, enable_prefix_caching=True, layer_attention=[A(window=4), None])
    cache.add_sequence(1, PROMPT)
    cache.append([1], [13])
    assert cache.reset_prefix_cache() is False  # pages in use
    assert cache.add_sequence(2, PROMPT) == 12
    stats = cache.stats(metrics=True)
    assert (stats["prefix_queries"], stats["prefix_hits"], stats["prefix_lookups"]) == (26, 12, 2)
    assert stats["prefix_cached_pages"] == 12
    cache.remove_sequence(1)
    cache.remove_sequence(2)
    assert cache.stats()["prefix_cached_free_pages"] == 12
    assert cache.reset_prefix_cache() is True
    assert cache.stats()["prefix_cached_pages"] == 0
    assert cache.add_sequence(3, PROMPT) == 0
    cache.check_invariants()


def _hybrid_prefix_cache(prefix_hash="xxh3_128"):
    cache = KVCache(3, 1, 2, 40, page_size=2, dtype=np.float32, enable_prefix_caching=True, page_checksums=True,
                    prefix_hash=prefix_hash, layer_attention=[A(window=4, sink_tokens=2), None, A(chunk_size=4)])
    cache.add_sequence(1, PROMPT)
    _decoded(cache, 1, PROMPT)
    cache.add_sequence(2, PROMPT[:9], extra_key="tenant")
    _decoded(cache, 2, PROMPT[:9])
    assert cache.add_sequence(3, PROMPT + [1]) == 12
    cache.append([3], [2], token_ids=[1, 2])
    cache.fork(3, 4)
    cache.truncate(4, 13)
    cache.remove_sequence(1)
    return cache


@pytest.mark.parametrize("prefix_hash", ["xxh3_128", "sha256"])
def test_snapshot_round_trip_with_a_populated_prefix_index(tmp_path, prefix_hash):
    from pagedkv import snapshot

    cache = _hybrid_prefix_cache(prefix_hash)
    assert cache.stats()["prefix_cached_free_pages"] > 0
    path = tmp_path / "prefix.pkv"
    cache.save(path)
    snapshot.verify(path)
    loaded = KVCache.load(path)
    loaded.check_invariants()
    _same_cache(cache, loaded)
    assert cache.stats(metrics=True) == loaded.stats(metrics=True)
    for page in cache.prefix_index.cached_pages().tolist():
        assert loaded.prefix_index.page_hash(page) == cache.prefix_index.page_hash(page)
    # Both serve and register alike from here on.
    for c in (cache, loaded):
        assert c.add_sequence(5, PROMPT + [3]) == 12
        assert c.add_sequence(6, PROMPT[:9] + [3], extra_key="tenant") == 8
        c.append([4, 5], [3, 2], token_ids=[1, 2, 3, 4, 5])
        c.check_invariants()
    _same_cache(cache, loaded)
    assert np.array_equal(cache.prefix_index.cached_pages(), loaded.prefix_index.cached_pages())


def test_a_snapshot_whose_group_chain_is_salted_for_another_request_is_refused():
    cache = _hybrid_prefix_cache()
    state = cache._export_state()
    fresh = KVCache(3, 1, 2, 40, page_size=2, dtype=np.float32, enable_prefix_caching=True, page_checksums=True,
                    layer_attention=[A(window=4, sink_tokens=2), None, A(chunk_size=4)])
    assert len(state["group_hashes"]) == 2
    # Sequence 2's (salted "tenant") chain of group 1 given sequence 3's chain: wrong salt and hashes.
    forged = dict(state, group_hashes=[list(state["group_hashes"][0]), list(state["group_hashes"][1])])
    forged["group_hashes"][0][0] = state["group_hashes"][0][1]
    with pytest.raises(ValueError):
        fresh._restore_state(forged)
    assert fresh.num_sequences == 0
    missing = dict(state, group_hashes=[])
    with pytest.raises(ValueError, match="group_hashes"):
        fresh._restore_state(missing)
    fresh._restore_state(state)
    fresh.check_invariants()


@pytest.mark.parametrize("edit", ["group salt", "group chains missing"])
def test_forged_hashes_of_a_hybrid_prefix_snapshot_are_refused(tmp_path, edit):
    from _snapshot_forge import forge_file
    from pagedkv import snapshot

    cache = _hybrid_prefix_cache()
    path = tmp_path / "forged.pkv"
    cache.save(path)
    rows = len(cache.seq_ids())

    def change(sections):
        hashes = sections["hashes"]
        assert hashes["fields"].shape[0] == 3 * rows  # every group's chains
        if edit == "group salt":
            hashes["salts"][rows, 0] ^= 1  # group 1's chain of the first sequence
        else:  # group 0's rows only, as a file of one group would have them
            for key in ("fields", "salts"):
                hashes[key] = hashes[key][:rows].copy()
            num_chain, num_tokens, num_blocks = (int(hashes["fields"][:, j].sum()) for j in (1, 2, 3))
            hashes["chain"] = hashes["chain"][:num_chain].copy()
            hashes["token_ids"] = hashes["token_ids"][:num_tokens].copy()
            hashes["block_ids"] = hashes["block_ids"][:num_blocks].copy()

    forge_file(path, change)
    with pytest.raises(SnapshotError):
        KVCache.load(path)
    with pytest.raises(SnapshotError):
        snapshot.verify(path)


def test_sink_errors_give_advice_that_applies():
    """Sinks with chunks, or cache-wide sinks beside layer_attention: the message says what is
    wrong there, not to add a window (which those cases cannot take)."""
    with pytest.raises(ValueError, match=r"^Invalid value of sink_tokens: expected 0 with chunk_size"):
        A(sink_tokens=2, chunk_size=4)
    with pytest.raises(ValueError, match=r"^Invalid value of sink_tokens: expected 0 with layer_attention"):
        KVCache(2, 1, 8, 8, layer_attention=[None, A(window=4)], sink_tokens=2)
