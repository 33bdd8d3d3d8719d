"""The one rule for array and integer arguments, checked at every entry point.

The rule (KVCache class docstring, README "Semantics in brief"):

- integer arguments accept any 1-D array-like of integers (list, tuple, an
  ndarray of any integer dtype and layout); floats (even whole ones), bools
  and object arrays raise TypeError naming the argument;
- floating arguments (K, V, queries) accept any array-like of real numbers
  (float16/32/64, lists, tuples, any layout), converted to the pool dtype;
  bool, complex and object arrays raise TypeError naming the argument.

Each accepted form must give exactly what the canonical C-contiguous ndarray
gives; each refused form must leave the state as it was.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import pytest

from pagedkv import KVCache, PagedKVCache, PagePool, attention
from pagedkv_c._page_table import PageTable
from pagedkv.models.paged_backend import PagedBackend

HEADS, DIM, QO_HEADS = 2, 4, 4


def kv_cache(**kw):
    args = dict(num_layers=2, num_kv_heads=HEADS, head_dim=DIM, num_pages=16, page_size=2, dtype=np.float32)
    args.update(kw)
    return KVCache(**args)


def kv_rows(n, offset=0.0):
    """K/V rows whose values are exact in float16: multiples of 0.25."""
    return (np.arange(n * HEADS * DIM, dtype=np.float32).reshape(n, HEADS, DIM) % 13) / 4 + offset


def cache_state(cache):
    ids = cache.seq_ids()
    view = cache.page_table(ids)
    return (cache.stats(), cache.pool.free_pages().tolist(), ids, view.indices.tolist(),
            view.seq_lens.tolist(), cache.kv.tobytes())


def pool_state(pool):
    return pool.num_free, pool.free_pages().tolist(), [pool.ref_count(p) for p in range(pool.num_pages)]


def classic_state(cache):
    keys, values, present = cache.get_many(np.arange(12))
    return len(cache), keys.tobytes(), values.tobytes(), present.tolist()


# ----------------------------------------------------------------- fixtures
def two_sequences(prefix=False):
    cache = kv_cache(enable_prefix_caching=prefix)
    cache.add_sequence(3)
    cache.add_sequence(5)
    return cache


def stored_cache():
    """Sequences 3 (3 tokens) and 5 (2 tokens) with K/V stored in both layers."""
    cache = two_sequences()
    slots = cache.append([3, 5], [3, 2])
    for layer in range(2):
        cache.store(layer, slots, kv_rows(5, layer), kv_rows(5, 0.5 + layer))
    return cache


def prompt_cache():
    cache = kv_cache(enable_prefix_caching=True)
    cache.add_sequence(1, [7, 8, 9, 10, 11])
    cache.append([1], [5])
    return cache


def block_cache():
    cache = kv_cache(enable_prefix_caching=True)
    cache.add_sequence(1, block_hashes=[11, 12, 13], block_tokens=2, num_prompt_tokens=6)
    cache.append([1], [6])
    return cache


def allocated_pool():
    pool = PagePool(8)
    pool.allocate(4)
    return pool


def classic_cache():
    cache = PagedKVCache(4, DIM, page_size=2)
    cache.put_many([0, 1, 2, 5], np.arange(16.0).reshape(4, DIM), -np.arange(16.0).reshape(4, DIM))
    return cache


@dataclass
class Entry:
    name: str
    arg: str                       # the argument's name, as error messages spell it
    kind: str                      # "int" or "float"
    base: np.ndarray               # canonical value: C-contiguous ndarray of the target dtype
    setup: Callable[[], Any]
    call: Callable[[Any, Any], Any]  # result of the call, as plain comparable data
    state: Callable[[Any], Any]


def _seq_result(cache, slots):
    return (None if slots is None else slots.tolist()), cache_state(cache)


ENTRIES = [
    Entry("KVCache.append seq_ids", "seq_ids", "int", np.array([3, 5]), two_sequences,
          lambda c, v: _seq_result(c, c.append(v, [2, 3])), cache_state),
    Entry("KVCache.append num_tokens", "num_tokens", "int", np.array([2, 3]), two_sequences,
          lambda c, v: _seq_result(c, c.append([3, 5], v)), cache_state),
    Entry("KVCache.append token_ids", "token_ids", "int", np.array([7, 8, 9, 10, 11], np.int32),
          lambda: two_sequences(prefix=True),
          # the filled pages become cached: a prompt starting with [7, 8] then hits
          lambda c, v: (_seq_result(c, c.append([3, 5], [2, 3], token_ids=v)), c.add_sequence(9, [7, 8, 0])),
          cache_state),
    Entry("KVCache.add_sequence prompt_token_ids", "prompt_token_ids", "int",
          np.array([7, 8, 9, 10, 11], np.int32), prompt_cache,
          lambda c, v: (c.add_sequence(2, v), cache_state(c)), cache_state),
    Entry("KVCache.add_sequence block_hashes", "block_hashes", "int", np.array([11, 12, 14]), block_cache,
          lambda c, v: (c.add_sequence(2, block_hashes=v, block_tokens=2, num_prompt_tokens=6), cache_state(c)),
          cache_state),
    Entry("KVCache.page_table seq_ids", "seq_ids", "int", np.array([5, 3, 5]), stored_cache,
          lambda c, v: [getattr(c.page_table(v), a).tolist()
                        for a in ("indptr", "indices", "last_page_len", "page_positions", "seq_lens")],
          cache_state),
    Entry("KVCache.store slot_mapping", "slot_mapping", "int", np.array([4, 1, -1]), two_sequences,
          lambda c, v: (c.store(1, v, kv_rows(3), kv_rows(3, 1.0)), cache_state(c)), cache_state),
    Entry("KVCache.store k", "k", "float", kv_rows(3, 0.25), two_sequences,
          lambda c, v: (c.store(0, [0, 1, 6], v, kv_rows(3)), cache_state(c)), cache_state),
    Entry("KVCache.store v", "v", "float", kv_rows(3, 0.75), two_sequences,
          lambda c, v: (c.store(1, [0, 1, 6], kv_rows(3), v), cache_state(c)), cache_state),
    Entry("PagePool.free page_ids", "page_ids", "int", np.array([1, 3], np.int32), allocated_pool,
          lambda p, v: (p.free(v), pool_state(p)), pool_state),
    Entry("PagePool.incref page_ids", "page_ids", "int", np.array([0, 2], np.int32), allocated_pool,
          lambda p, v: (p.incref(v), pool_state(p)), pool_state),
    Entry("PagedKVCache.put key", "key", "float", np.arange(DIM, dtype=np.float32) / 4, classic_cache,
          lambda c, v: (c.put(3, v, np.ones(DIM)), classic_state(c)), classic_state),
    Entry("PagedKVCache.put value", "value", "float", np.arange(DIM, dtype=np.float32) / 2, classic_cache,
          lambda c, v: (c.put(7, np.ones(DIM), v), classic_state(c)), classic_state),
    Entry("PagedKVCache.put_many token_idxs", "token_idxs", "int", np.array([6, 3, 9]), classic_cache,
          lambda c, v: (c.put_many(v, np.ones((3, DIM)), np.zeros((3, DIM))), classic_state(c)), classic_state),
    Entry("PagedKVCache.put_many keys", "keys", "float", np.arange(3.0 * DIM, dtype=np.float32).reshape(3, DIM),
          classic_cache, lambda c, v: (c.put_many([6, 3, 9], v, np.zeros((3, DIM))), classic_state(c)),
          classic_state),
    Entry("PagedKVCache.get_many token_idxs", "token_idxs", "int", np.array([5, 0, 3, 5]), classic_cache,
          lambda c, v: [a.tolist() for a in c.get_many(v)], classic_state),
    Entry("attention.decode q", "q", "float",
          (np.arange(2 * QO_HEADS * DIM, dtype=np.float32).reshape(2, QO_HEADS, DIM) % 5) / 4, stored_cache,
          lambda c, v: attention.decode(v, c, 1, [3, 5]).tobytes(), cache_state),
    Entry("attention.decode seq_ids", "seq_ids", "int", np.array([5, 3]), stored_cache,
          lambda c, v: attention.decode(np.ones((2, QO_HEADS, DIM), np.float32), c, 0, v).tobytes(), cache_state),
    Entry("attention.prefill q", "q", "float",
          (np.arange(3 * QO_HEADS * DIM, dtype=np.float32).reshape(3, QO_HEADS, DIM) % 7) / 4, stored_cache,
          lambda c, v: attention.prefill(v, c, 0, [3, 5], [0, 2, 3]).tobytes(), cache_state),
    Entry("attention.prefill qo_indptr", "qo_indptr", "int", np.array([0, 2, 3]), stored_cache,
          lambda c, v: attention.prefill(np.ones((3, QO_HEADS, DIM), np.float32), c, 0, [3, 5], v).tobytes(),
          cache_state),
]


def _nested_tuple(x):
    return tuple(_nested_tuple(i) for i in x) if isinstance(x, list) else x


def _non_contiguous(base):
    view = np.stack([base, base], axis=-1)[..., 0]
    assert not view.flags.c_contiguous and np.array_equal(view, base)
    return view


ACCEPTED = {
    "list": lambda b: b.tolist(),
    "tuple": lambda b: _nested_tuple(b.tolist()),
    "non-contiguous": _non_contiguous,
    "other dtype": lambda b: b.astype(np.int16 if b.dtype.kind in "iu" else np.float16),
    "big-endian": lambda b: b.astype(b.dtype.newbyteorder(">")),
}
REFUSED = {
    "bool array": lambda b: b.astype(bool),
    "object array": lambda b: b.astype(object),
}
INT_REFUSED = {
    "float64": lambda b: b.astype(np.float64),  # whole numbers, still refused (as in NumPy indexing)
    "float with a fraction": lambda b: b + 0.5,
    "bool in a list": lambda b: [True] + b.tolist()[1:],
}
FLOAT_ACCEPTED = {
    "float64": lambda b: b.astype(np.float64),
    "integers": None,  # checked against the canonical array of the same integer values
}
FLOAT_REFUSED = {
    "complex": lambda b: b.astype(np.complex128),
    "strings": lambda b: b.astype(str),
}


def _cases():
    for entry in ENTRIES:
        accepted = dict(ACCEPTED) | (FLOAT_ACCEPTED if entry.kind == "float" else {})
        refused = dict(REFUSED) | (INT_REFUSED if entry.kind == "int" else FLOAT_REFUSED)
        for name in accepted:
            yield pytest.param(entry, name, True, id=f"{entry.name}-{name}")
        for name in refused:
            yield pytest.param(entry, name, False, id=f"{entry.name}-{name}")


@pytest.mark.parametrize("entry, variant, accepted", list(_cases()))
def test_every_entry_point_follows_the_array_rule(entry, variant, accepted):
    if accepted:
        base = entry.base
        if variant == "integers":
            base = np.round(entry.base * 4)  # integer-valued, exact in every float dtype
            value = base.astype(np.int32)
        else:
            value = ACCEPTED.get(variant, FLOAT_ACCEPTED.get(variant))(base)
        expected = entry.call(entry.setup(), base)
        assert entry.call(entry.setup(), value) == expected
        return
    value = (REFUSED | INT_REFUSED | FLOAT_REFUSED)[variant](entry.base)
    target = entry.setup()
    before = entry.state(target)
    with pytest.raises(TypeError) as info:
        entry.call(target, value)
    message = str(info.value)
    assert re.match(rf"Invalid (type|dtype) of {re.escape(entry.arg)}: expected ", message), message
    assert entry.state(target) == before


# ------------------------------------------------------------ integer scalars
def _scalar_entries():
    """(name, setup, call(target, value), state): calls that take one integer, with value 1 valid."""
    def cache_with(*seq_ids):
        def setup():
            cache = kv_cache()
            for s in seq_ids:
                cache.add_sequence(s)
            cache.append(list(seq_ids), [3] * len(seq_ids))
            return cache
        return setup

    # The valid value is 1 in every call; the setups make 1 a free or a known sequence id.
    return [
        ("KVCache.add_sequence seq_id", cache_with(0, 3), lambda c, v: c.add_sequence(v), cache_state),
        ("KVCache.fork child_id", cache_with(0, 3), lambda c, v: c.fork(0, v), cache_state),
        ("KVCache.remove_sequence seq_id", cache_with(1, 3), lambda c, v: c.remove_sequence(v), cache_state),
        ("KVCache.fork parent_id", cache_with(1, 3), lambda c, v: c.fork(v, 7), cache_state),
        ("KVCache.truncate seq_id", cache_with(1, 3), lambda c, v: c.truncate(v, 2), cache_state),
        ("KVCache.truncate new_len", cache_with(1, 3), lambda c, v: c.truncate(3, v), cache_state),
        ("KVCache.seq_len seq_id", cache_with(1, 3), lambda c, v: c.seq_len(v), cache_state),
        ("KVCache.gather seq_id", cache_with(1, 3), lambda c, v: c.gather(0, v)[2].tolist(), cache_state),
        ("KVCache.gather layer", cache_with(1, 3), lambda c, v: c.gather(v, 1)[2].tolist(), cache_state),
        ("KVCache.store layer", cache_with(1, 3),
         lambda c, v: c.store(v, [0], kv_rows(1), kv_rows(1)), cache_state),
        ("attention.decode layer", stored_cache,
         lambda c, v: attention.decode(np.ones((1, QO_HEADS, DIM)), c, v, [3]).tobytes(), cache_state),
        ("PagePool.allocate n", lambda: PagePool(4), lambda p, v: p.allocate(v).tolist(), pool_state),
        ("PagePool.ref_count page_id", allocated_pool, lambda p, v: p.ref_count(v), pool_state),
        ("PagedKVCache.put token_idx", classic_cache, lambda c, v: c.put(v, np.ones(DIM), np.ones(DIM)),
         classic_state),
        ("PagedKVCache.get token_idx", classic_cache, lambda c, v: c.get(v) is not None, classic_state),
    ]


SCALARS = _scalar_entries()


@pytest.mark.parametrize("name, setup, call, state", SCALARS, ids=[s[0] for s in SCALARS])
def test_integer_scalars_follow_the_rule(name, setup, call, state):
    expected = call(setup(), 1)
    for same in (np.int16(1), np.uint64(1), np.int64(1)):
        assert call(setup(), same) == expected
    for wrong in (1.0, np.float64(1), True, np.bool_(True), "1", None):
        target = setup()
        before = state(target)
        with pytest.raises(TypeError, match=r"^Invalid type of \w+: expected an integer"):
            call(target, wrong)
        assert state(target) == before


# ------------------------------------------------------------ dtype messages
@pytest.mark.parametrize("dtype, got", [(np.float64, "float64"), ("int8", "int8"),
                                        ("no such type", "'no such type'")])
def test_pool_dtype_message_does_not_stutter(dtype, got):
    with pytest.raises(TypeError) as info:
        kv_cache(dtype=dtype)
    assert str(info.value) == f"Invalid dtype: expected float16 or float32, got {got}"


STUTTER = re.compile(r"Invalid (\w+) of \1\b")
BAD_CALLS = [
    lambda: kv_cache(dtype=np.float64),
    lambda: kv_cache(page_size=0),
    lambda: kv_cache(page_size=1.5),
    lambda: kv_cache(window=0),
    lambda: kv_cache(sink_tokens=-1),
    lambda: kv_cache(num_pages="8"),
    lambda: PagedKVCache(4, DIM, dtype=np.int32),
    lambda: PagedKVCache(4, DIM, page_size=0),
    lambda: PagedKVCache(4, DIM).put(0, np.ones(DIM), "value"),
    lambda: PagedKVCache(4, DIM).put(0, np.ones(DIM), np.ones(DIM, bool)),
    lambda: PagedKVCache(4, DIM).put(0, np.ones(DIM), np.ones(DIM + 1)),
    lambda: PagePool(0),
    lambda: PagePool(4).allocate(9),
    lambda: attention.decode(np.ones((1, QO_HEADS, DIM)), stored_cache(), 0, [3], scale="x"),
]


@pytest.mark.parametrize("call", BAD_CALLS)
def test_validator_messages_name_each_thing_once(call):
    with pytest.raises((TypeError, ValueError)) as info:
        call()
    message = str(info.value)
    assert message.startswith("Invalid "), message
    assert not STUTTER.search(message), message


# ------------------------------------------------------------------ sinks
SINK_MESSAGE = ("Invalid value of sink_tokens: expected 0 without a sliding window (attention sinks "
                "only exist with one: add window=W), got 4")


def test_sinks_without_a_window_are_refused_everywhere_with_one_message(capsys):
    with pytest.raises(ValueError) as info:
        kv_cache(sink_tokens=4)
    assert str(info.value) == SINK_MESSAGE
    with pytest.raises(ValueError) as info:
        PagedBackend(1, HEADS, DIM, 16, sink_tokens=4)
    assert str(info.value) == SINK_MESSAGE
    with pytest.raises(ValueError) as info:
        PageTable(PagePool(4), 4, None, 4)
    assert str(info.value) == SINK_MESSAGE
    # With a window, or without sinks, all three accept.
    assert kv_cache(sink_tokens=4, window=8).sink_tokens == 4
    assert kv_cache(sink_tokens=0).window is None
    PagedBackend(1, HEADS, DIM, 16, window=8, sink_tokens=4)

    from pagedkv import cli

    with pytest.raises(SystemExit) as exc:
        cli.main(["generate", "hi", "--sinks", "4"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert ("argument --sinks: expected 0 without a sliding window (attention sinks only exist "
            "with one: add --window W), got 4") in err
