"""The one rule for scalar integer arguments, checked at every public entry point.

The rule (the array rule of ``tests/test_inputs.py``, for one integer): page
ids, sequence ids, counts, positions, lengths, sizes, thread counts and
capacities accept a Python int or a NumPy integer with the same value; a
float (even a whole one such as ``1.0``), a bool, a string or None (where
None has no meaning) raises ``TypeError("Invalid type of <name>: expected
an integer, got <type>")``; an integer outside the argument's range raises
``ValueError("Invalid value of <name>: ...")`` (``IndexError`` for the
indices ``layer`` and ``index``, as documented). Never an ``OverflowError``,
never a silent truncation (``1.5`` used as ``1``), and a refused call leaves
the object exactly as it was.

The table below is written by hand, one row per integer argument of each
public function, method and constructor (``pagedkv.__all__``,
``pagedkv.attention``, ``pagedkv.snapshot``, ``pagedkv.replay``,
``pagedkv.traces``, ``pagedkv.events``, ``pagedkv.tiers``), so that a
method cannot drop out of the test unnoticed.
"""
from __future__ import annotations

import atexit
import decimal
import itertools
import os
import re
import shutil
import tempfile
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from pagedkv import KVCache, PagedKVCache, PagePool, attention, snapshot, traces
from pagedkv import replay as replay_module
from pagedkv_c._kv_events import KVEventLog
from pagedkv_c._page_map import PageMap
from pagedkv_c._page_table import PageTable
from pagedkv_c._prefix import PrefixIndex, block_page_input, token_page_input

HEADS, DIM, QO_HEADS = 2, 4, 4
BEYOND_INT64 = (2**64, -(2**64), 2**63)  # out of every range: never an OverflowError


# ------------------------------------------------------------------ targets
def kv_cache(**kw):
    args = {"num_layers": 2, "num_kv_heads": HEADS, "head_dim": DIM, "num_pages": 16, "page_size": 2,
            "dtype": np.float32}
    return KVCache(**(args | kw))


def kv_rows(n, offset=0.0):
    return (np.arange(n * HEADS * DIM, dtype=np.float32).reshape(n, HEADS, DIM) % 13) / 4 + offset


def cache_with(*seq_ids, **kw):
    """A cache holding ``seq_ids``, 3 tokens each, K/V stored in both layers."""
    def setup():
        cache = kv_cache(**kw)
        for s in seq_ids:
            cache.add_sequence(s)
        slots = cache.append(list(seq_ids), [3] * len(seq_ids))
        for layer in range(2):
            cache.store(layer, slots, kv_rows(len(slots), layer), kv_rows(len(slots), 0.5 + layer))
        return cache
    return setup


def cache_state(cache):
    ids = cache.seq_ids()
    view = cache.page_table(ids)
    return (cache.stats(metrics=True), cache.pool.free_pages().tolist(), ids, view.indices.tolist(),
            view.seq_lens.tolist(), cache.kv.tobytes())


def pool_state(pool):
    return pool.num_free, pool.free_pages().tolist(), [pool.ref_count(p) for p in range(pool.num_pages)]


def classic_cache():
    cache = PagedKVCache(4, DIM, page_size=2)
    cache.put_many([0, 1, 2, 5], np.arange(16.0).reshape(4, DIM), -np.arange(16.0).reshape(4, DIM))
    return cache


_OWN_LOOKUPS = weakref.WeakKeyDictionary()  # cache -> (hits, misses) that classic_state's own get_many counted


def classic_state(cache):
    stats = cache.stats()
    hits, misses = _OWN_LOOKUPS.get(cache, (0, 0))
    stats["hits"] -= hits
    stats["misses"] -= misses
    keys, values, present = cache.get_many(np.arange(12))
    found = int(present.sum())
    _OWN_LOOKUPS[cache] = (hits + found, misses + 12 - found)
    return len(cache), stats, keys.tobytes(), values.tobytes(), present.tolist()


def view_state(view):
    return [getattr(view, a).tolist() for a in ("indptr", "indices", "last_page_len", "page_positions", "seq_lens")]


def nothing(_):
    return None


def small_trace():
    """A Mooncake-style trace of 3 requests, blocks of 4 tokens."""
    return traces.Trace(format="mooncake", source="memory", arrival_seconds=np.zeros(3),
                        input_lengths=np.array([8, 5, 8]), output_lengths=np.array([2, 1, 3]),
                        block_ids=np.array([1, 2, 1, 3, 1, 2]), block_offsets=np.array([0, 2, 4, 6]),
                        block_tokens=4)


def trace_state(trace):
    return (trace.input_lengths.tolist(), trace.output_lengths.tolist(), trace.block_ids.tolist(),
            trace.block_offsets.tolist())


_FILES: dict[str, str] = {}  # made on first use, once per test session


def trace_file():
    """A directory with small Mooncake (t.jsonl) and Azure (t.csv) traces of 3 requests."""
    if "dir" not in _FILES:
        d = tempfile.mkdtemp(prefix="pagedkv-scalars-")
        atexit.register(shutil.rmtree, d, True)
        with open(f"{d}/t.jsonl", "w") as f:
            f.writelines(f'{{"timestamp": {i}, "input_length": 4, "output_length": 1, "hash_ids": [{i}]}}\n'
                         for i in range(3))
        with open(f"{d}/t.csv", "w") as f:
            f.write("TIMESTAMP,ContextTokens,GeneratedTokens\n")
            f.writelines(f"2023-11-16 18:15:4{i}.000,4,1\n" for i in range(3))
        _FILES["dir"] = d
    return _FILES["dir"]


def loaded(trace):
    return len(trace), trace.input_lengths.tolist(), trace.block_tokens


def exported(seq_id=3, **kw):
    return cache_with(seq_id, **kw)().export_sequence(seq_id)


_EXPORT = {}


def export_data():
    if "data" not in _EXPORT:
        _EXPORT["data"] = exported()
    return _EXPORT["data"]


def snapshot_file():
    if "path" not in _EXPORT:
        path = f"{trace_file()}/cache.pkvs"
        cache_with(1, 3)().save(path)
        _EXPORT["path"] = path
    return _EXPORT["path"]


def made_cache(cache):
    return (cache.stats(), cache.window, cache.sink_tokens, cache.kv.shape, cache.kv.dtype.name)


_ENDPOINTS = itertools.count()


def _need_events():
    """pyzmq for the pagedkv.events rows: a skip naming the extra, a failure where CI requires it."""
    if os.environ.get("PAGEDKV_REQUIRE_EVENTS") != "1":
        pytest.importorskip("zmq", reason='pagedkv.events needs pyzmq: pip install "pagedkv[events]"')


def publisher(**kw):
    _need_events()
    from pagedkv.events import ZmqEventPublisher

    cache = kv_cache(num_layers=0, enable_prefix_caching=True, enable_kv_events=True)
    pub = ZmqEventPublisher(cache, f"inproc://scalar-arguments-{next(_ENDPOINTS)}", **kw)
    try:
        return pub._buffer.maxlen, pub._rank, pub._pub.get_hwm()
    finally:
        pub.close()


def tier(**kw):
    pytest.importorskip("redis", reason="pagedkv.tiers needs redis-py: pip install \"pagedkv[redis]\"")
    from pagedkv.tiers import RedisTier

    t = RedisTier("redis://127.0.0.1:1/0", namespace="scalars", **kw)  # nothing connects yet
    return t.ttl_seconds, t.max_inflight_bytes


def encoded(**kw):
    _need_events()
    from pagedkv.events import encode_events

    cache = kv_cache(num_layers=0, enable_prefix_caching=True, enable_kv_events=True)
    cache.add_sequence(1, [1, 2, 3, 4, 5])
    cache.append([1], [5])  # the full pages enter the prefix cache: BlockStored
    events, _ = cache.take_kv_events()
    assert len(events)
    return encode_events(events, ts=1.0, **kw)


def _allocated_pool():
    pool = PagePool(8)
    pool.allocate(4)
    return pool


def _tolist(pair):
    return None if pair is None else [a.tolist() for a in pair]


def _table_with(n):
    table = PageTable(PagePool(4), 2)
    table.append(n)
    return table


def _page_map():
    m = PageMap(4)
    m.assign(1, 3)
    m.assign(7, 0)
    return m


def _map_state(m):
    return sorted(m.to_dict().items())


# -------------------------------------------------------------------- table
@dataclass
class Arg:
    name: str                       # the row's id: "Class.method argument"
    arg: str                        # the argument, as the messages name it
    setup: Callable[[], Any]
    call: Callable[[Any, Any], Any]  # result of the call with the value, as comparable data
    state: Callable[[Any], Any]
    valid: int = 1
    bad: tuple = ()                 # integers out of range besides BEYOND_INT64
    none_ok: bool = False           # None is a documented value (a default, or "not given")
    error: type = ValueError        # raised for an integer out of range
    beyond: tuple = BEYOND_INT64    # out of range for every row but those of 128-bit or uint64 values


A = Arg
ROWS = [
    # KVCache constructor
    A("KVCache num_layers", "num_layers", lambda: None, lambda _, v: made_cache(kv_cache(num_layers=v)),
      nothing, bad=(-1, 2**20 + 1, 2**62)),
    A("KVCache num_kv_heads", "num_kv_heads", lambda: None, lambda _, v: made_cache(kv_cache(num_kv_heads=v)),
      nothing, bad=(0, -1, 2**62)),
    A("KVCache head_dim", "head_dim", lambda: None, lambda _, v: made_cache(kv_cache(head_dim=v)),
      nothing, bad=(0, -1, 2**62)),
    A("KVCache num_pages", "num_pages", lambda: None, lambda _, v: made_cache(kv_cache(num_pages=v)),
      nothing, valid=4, bad=(0, -1, 2**31 - 1, 2**62)),
    A("KVCache page_size", "page_size", lambda: None, lambda _, v: made_cache(kv_cache(page_size=v)),
      nothing, valid=2, bad=(0, -1, 2**62)),
    A("KVCache window", "window", lambda: None, lambda _, v: made_cache(kv_cache(window=v)),
      nothing, valid=4, none_ok=True, bad=(0, -1, 2**62 + 1)),
    A("KVCache sink_tokens", "sink_tokens", lambda: None, lambda _, v: made_cache(kv_cache(window=4, sink_tokens=v)),
      nothing, bad=(-1, 2**62 + 1)),
    A("KVCache kv_events_capacity", "kv_events_capacity", lambda: None,
      lambda _, v: made_cache(kv_cache(enable_prefix_caching=True, enable_kv_events=True, kv_events_capacity=v)),
      nothing, valid=8, bad=(0, -1, 2**31 + 1, 2**62)),
    # KVCache methods
    A("KVCache.add_sequence seq_id", "seq_id", cache_with(0, 3), lambda c, v: (c.add_sequence(v), cache_state(c)),
      cache_state),
    A("KVCache.add_sequence block_tokens", "block_tokens", cache_with(1, enable_prefix_caching=True),
      lambda c, v: (c.add_sequence(9, block_hashes=[11, 12, 13], block_tokens=v, num_prompt_tokens=6),
                    cache_state(c)),
      cache_state, valid=2, none_ok=True, bad=(0, -1, 3, 2**31, 2**62)),
    A("KVCache.add_sequence num_prompt_tokens", "num_prompt_tokens", cache_with(1, enable_prefix_caching=True),
      lambda c, v: (c.add_sequence(9, block_hashes=[11, 12, 13], block_tokens=2, num_prompt_tokens=v),
                    cache_state(c)),
      cache_state, valid=5, none_ok=True, bad=(-1, 7, 2**62)),
    A("KVCache.remove_sequence seq_id", "seq_id", cache_with(1, 3),
      lambda c, v: (c.remove_sequence(v), cache_state(c)), cache_state),
    A("KVCache.fork parent_id", "parent_id", cache_with(1, 3), lambda c, v: (c.fork(v, 7), cache_state(c)),
      cache_state),
    A("KVCache.fork child_id", "child_id", cache_with(0, 3), lambda c, v: (c.fork(3, v), cache_state(c)),
      cache_state),
    A("KVCache.truncate seq_id", "seq_id", cache_with(1, 3), lambda c, v: (c.truncate(v, 2), cache_state(c)),
      cache_state),
    A("KVCache.truncate new_len", "new_len", cache_with(1, 3), lambda c, v: (c.truncate(3, v), cache_state(c)),
      cache_state, bad=(-1, 4, 2**62)),
    A("KVCache.seq_len seq_id", "seq_id", cache_with(1, 3), lambda c, v: c.seq_len(v), cache_state),
    A("KVCache.num_cached_tokens seq_id", "seq_id", cache_with(1, 3), lambda c, v: c.num_cached_tokens(v),
      cache_state),
    A("KVCache.gather seq_id", "seq_id", cache_with(1, 3), lambda c, v: [a.tolist() for a in c.gather(0, v)],
      cache_state),
    A("KVCache.gather layer", "layer", cache_with(1, 3), lambda c, v: [a.tolist() for a in c.gather(v, 1)],
      cache_state, bad=(-1, 2, 2**62), error=IndexError),
    A("KVCache.store layer", "layer", cache_with(1, 3),
      lambda c, v: (c.store(v, [0], kv_rows(1, 7.0), kv_rows(1, 8.0)), cache_state(c)),
      cache_state, bad=(-1, 2, 2**62), error=IndexError),
    A("KVCache.export_sequence seq_id", "seq_id", cache_with(1, 3), lambda c, v: c.export_sequence(v),
      cache_state),
    A("KVCache.import_sequence seq_id", "seq_id", cache_with(0),
      lambda c, v: (c.import_sequence(v, export_data()), cache_state(c)), cache_state),
    A("PageTableView.block_tables pad", "pad", lambda: cache_with(1, 3)().page_table([1, 3]),
      lambda view, v: view.block_tables(pad=v).tolist(), view_state, valid=-1,
      bad=(2**31, -(2**31) - 1, 2**62)),
    # PagePool
    A("PagePool num_pages", "num_pages", lambda: None, lambda _, v: pool_state(PagePool(v)), nothing, valid=4,
      bad=(0, -1, 2**31, 2**62)),
    A("PagePool.allocate n", "n", lambda: PagePool(4), lambda p, v: (p.allocate(v).tolist(), pool_state(p)),
      pool_state, bad=(-1, 5, 2**62)),
    A("PagePool.ref_count page_id", "page_id", lambda: _allocated_pool(), lambda p, v: p.ref_count(v), pool_state,
      bad=(-1, 8, 2**62)),
    # PagedKVCache
    A("PagedKVCache max_pages", "max_pages", lambda: None, lambda _, v: classic_state(PagedKVCache(v, DIM)),
      nothing, valid=4, bad=(0, -1, 2**62)),
    A("PagedKVCache dim", "dim", lambda: None, lambda _, v: classic_state(PagedKVCache(4, v)), nothing,
      valid=4, bad=(0, -1, 2**62)),
    A("PagedKVCache page_size", "page_size", lambda: None,
      lambda _, v: classic_state(PagedKVCache(4, DIM, page_size=v)), nothing, valid=2, bad=(0, -1, 2**62)),
    A("PagedKVCache.put token_idx", "token_idx", classic_cache,
      lambda c, v: (c.put(v, np.full(DIM, 3.0), np.full(DIM, 4.0)), classic_state(c)), classic_state, valid=3,
      bad=(-1,)),
    A("PagedKVCache.get token_idx", "token_idx", classic_cache, lambda c, v: _tolist(c.get(v)), classic_state,
      bad=(-1,)),
    # pagedkv.attention
    A("attention.decode layer", "layer", cache_with(1, 3),
      lambda c, v: attention.decode(np.ones((1, QO_HEADS, DIM)), c, v, [3]).tolist(), cache_state,
      bad=(-1, 2, 2**62), error=IndexError),
    A("attention.decode num_threads", "num_threads", cache_with(1, 3),
      lambda c, v: attention.decode(np.ones((1, QO_HEADS, DIM)), c, 0, [3], num_threads=v).tolist(), cache_state,
      none_ok=True, bad=(0, -1, 2**62)),
    A("attention.prefill layer", "layer", cache_with(1, 3),
      lambda c, v: attention.prefill(np.ones((2, QO_HEADS, DIM)), c, v, [3], [0, 2]).tolist(), cache_state,
      bad=(-1, 2, 2**62), error=IndexError),
    A("attention.prefill num_threads", "num_threads", cache_with(1, 3),
      lambda c, v: attention.prefill(np.ones((2, QO_HEADS, DIM)), c, 1, [3], [0, 2], num_threads=v).tolist(),
      cache_state, none_ok=True, bad=(0, -1, 2**62)),
    # pagedkv.snapshot
    A("snapshot.save_cache num_threads", "num_threads", cache_with(1, 3),
      lambda c, v: (snapshot.save_cache(c, f"{trace_file()}/saved.pkvs", num_threads=v),
                    cache_state(KVCache.load(f"{trace_file()}/saved.pkvs"))),
      cache_state, none_ok=True, bad=(0, -1, 3, 2**62)),
    A("snapshot.load_cache num_threads", "num_threads", lambda: None,
      lambda _, v: cache_state(snapshot.load_cache(snapshot_file(), num_threads=v)), nothing,
      none_ok=True, bad=(0, -1, 3, 2**62)),
    A("snapshot.export_sequence seq_id", "seq_id", cache_with(1, 3), lambda c, v: snapshot.export_sequence(c, v),
      cache_state),
    A("snapshot.import_sequence seq_id", "seq_id", cache_with(0),
      lambda c, v: (snapshot.import_sequence(c, v, export_data()), cache_state(c)), cache_state),
    # pagedkv.replay
    A("replay.capacity_pages capacity_tokens", "capacity_tokens", lambda: None,
      lambda _, v: replay_module.capacity_pages(v, 4), nothing, valid=64, bad=(-1, 0, 3, 2**62)),
    A("replay.capacity_pages page_size", "page_size", lambda: None,
      lambda _, v: replay_module.capacity_pages(64, v), nothing, valid=4, bad=(0, -1, 2**20 + 1, 2**62)),
    A("replay.replay capacity_tokens", "capacity_tokens", small_trace,
      lambda t, v: replay_module.replay(t, v, page_size=4).to_dict()["hit_tokens"], trace_state, valid=64,
      bad=(-1, 0, 3, 2**62)),
    A("replay.replay page_size", "page_size", small_trace,
      lambda t, v: replay_module.replay(t, 64, page_size=v).to_dict()["hit_tokens"], trace_state, valid=4,
      bad=(0, -1, 3, 2**20 + 1, 2**62)),
    A("replay.split_round_robin num_parts", "num_parts", small_trace,
      lambda t, v: trace_state(replay_module.split_round_robin(t, v, 0)), trace_state, valid=2,
      bad=(0, -1)),
    A("replay.split_round_robin part", "part", small_trace,
      lambda t, v: trace_state(replay_module.split_round_robin(t, 2, v)), trace_state, bad=(-1, 2, 2**62)),
    # pagedkv.traces
    A("traces.Trace.blocks index", "index", small_trace, lambda t, v: t.blocks(v).tolist(), trace_state,
      bad=(3, -4, 2**62), error=IndexError),
    A("traces.load_trace limit", "limit", lambda: None,
      lambda _, v: loaded(traces.load_trace(f"{trace_file()}/t.jsonl", limit=v)), nothing, none_ok=True,
      bad=(0, -1)),
    A("traces.load_mooncake limit", "limit", lambda: None,
      lambda _, v: loaded(traces.load_mooncake(f"{trace_file()}/t.jsonl", limit=v)), nothing, none_ok=True,
      bad=(0, -1)),
    A("traces.load_mooncake block_tokens", "block_tokens", lambda: None,
      lambda _, v: loaded(traces.load_mooncake(f"{trace_file()}/t.jsonl", block_tokens=v)), nothing, valid=4,
      bad=(0, -1, 2**31, 2**62)),
    A("traces.load_azure limit", "limit", lambda: None,
      lambda _, v: loaded(traces.load_azure(f"{trace_file()}/t.csv", limit=v)), nothing, none_ok=True,
      bad=(0, -1)),
    # pagedkv.events
    A("events.encode_events data_parallel_rank", "data_parallel_rank", lambda: None,
      lambda _, v: encoded(data_parallel_rank=v), nothing, bad=(-1,)),
    A("events.encode_events window", "window", lambda: None, lambda _, v: encoded(window=v), nothing,
      valid=4, none_ok=True, bad=(-1,)),
    A("events.ZmqEventPublisher buffer_steps", "buffer_steps", lambda: None,
      lambda _, v: publisher(buffer_steps=v), nothing, valid=3, bad=(0, -1)),
    A("events.ZmqEventPublisher hwm", "hwm", lambda: None, lambda _, v: publisher(hwm=v), nothing, valid=3,
      bad=(0, -1, 2**31, 2**62)),
    A("events.ZmqEventPublisher data_parallel_rank", "data_parallel_rank", lambda: None,
      lambda _, v: publisher(data_parallel_rank=v), nothing, bad=(-1,)),
    # pagedkv.tiers
    A("tiers.RedisTier ttl_seconds", "ttl_seconds", lambda: None, lambda _, v: tier(ttl_seconds=v), nothing,
      none_ok=True, bad=(0, -1, 2**62)),
    A("tiers.RedisTier max_inflight_bytes", "max_inflight_bytes", lambda: None,
      lambda _, v: tier(max_inflight_bytes=v), nothing, bad=(0, -1)),
    # Core classes under the public ones (importable from pagedkv_c, documented)
    A("PageTable page_size", "page_size", lambda: None,
      lambda _, v: PageTable(PagePool(4), v).append(3)[0].tolist(), nothing, valid=2, bad=(0, -1, 2**31, 2**62)),
    A("PageTable window", "window", lambda: None,
      lambda _, v: PageTable(PagePool(4), 2, v).append(3)[0].tolist(), nothing, valid=2, none_ok=True,
      bad=(0, -1, 2**62 + 1)),
    A("PageTable.append num_tokens", "num_tokens", lambda: PageTable(PagePool(4), 2),
      lambda t, v: (t.append(v)[0].tolist(), t.pages()[0].tolist()), lambda t: t.pages()[0].tolist(),
      valid=3, bad=(-1, 2**62 + 1)),
    A("PageTable.truncate new_len", "new_len", lambda: _table_with(3),
      lambda t, v: (t.truncate(v), t.pages()[0].tolist()), lambda t: (t.seq_len, t.pages()[0].tolist()),
      bad=(-1, 4, 2**62)),
    A("PageMap capacity", "capacity", lambda: None, lambda _, v: PageMap(v).table_length, nothing, valid=4,
      bad=(0, -1, 2**31, 2**62)),
    A("PageMap.find logical_page", "logical_page", lambda: _page_map(), lambda m, v: m.find(v), _map_state,
      bad=(-1,)),
    A("PageMap.assign logical_page", "logical_page", lambda: _page_map(),
      lambda m, v: (m.assign(v, 2), _map_state(m)), _map_state, bad=(-1,)),
    A("PageMap.assign page_id", "page_id", lambda: _page_map(),
      lambda m, v: (m.assign(5, v), _map_state(m)), _map_state, bad=(-1, 2**31, 2**62)),
    A("PageMap.discard logical_page", "logical_page", lambda: _page_map(),
      lambda m, v: (m.discard(v), _map_state(m)), _map_state, bad=(-1,)),
    A("PrefixIndex num_pages", "num_pages", lambda: None, lambda _, v: PrefixIndex(v, 4).cached_pages().tolist(),
      nothing, valid=4, bad=(0, -1, 2**30 + 1, 2**31, 2**62)),
    A("PrefixIndex page_size", "page_size", lambda: None, lambda _, v: PrefixIndex(4, v).token_table().shape,
      nothing, valid=4, bad=(0, -1, 2**31, 2**62)),
    A("KVEventLog capacity", "kv_events_capacity", lambda: None, lambda _, v: KVEventLog(v, 4).capacity, nothing,
      valid=8, bad=(0, -1, 2**31 + 1, 2**62)),
    A("KVEventLog page_size", "page_size", lambda: None, lambda _, v: KVEventLog(8, v).capacity, nothing,
      valid=4, bad=(0, -1, 2**31, 2**62)),
    A("_prefix.token_page_input parent", "parent", lambda: None, lambda _, v: token_page_input(v, 2, [1, 2]),
      nothing, bad=(-1, 2**128), beyond=(-(2**64),)),
    A("_prefix.token_page_input salt", "salt", lambda: None, lambda _, v: token_page_input(2, v, [1, 2]),
      nothing, bad=(-1, 2**128), beyond=(-(2**64),)),
    A("_prefix.block_page_input block_id", "block_id", lambda: None,
      lambda _, v: block_page_input(2, 3, v, 0, 2), nothing, valid=7, bad=(-(2**63) - 1, 2**64),
      beyond=(-(2**64),)),
    A("_prefix.block_page_input index_in_block", "index_in_block", lambda: None,
      lambda _, v: block_page_input(2, 3, 7, v, 2), nothing, bad=(-1, 2**31, 2**62)),
    A("_prefix.block_page_input pages_per_block", "pages_per_block", lambda: None,
      lambda _, v: block_page_input(2, 3, 7, 0, v), nothing, valid=2, bad=(0, -1, 2**31, 2**62)),
]


# Each refused value is made from the row's valid value, so that a truncation
# (1.5 -> 1) or a bool read as 1 would be accepted silently.
TYPE_REFUSED = {
    "float": float,
    "float with a fraction": lambda v: v + 0.5,
    "numpy float64": np.float64,
    "numpy float32 with a fraction": lambda v: np.float32(v + 0.5),
    "bool True": lambda v: True,
    "bool False": lambda v: False,
    "numpy bool": lambda v: np.bool_(True),
    "str": str,
    "Decimal": decimal.Decimal,
    "None": lambda v: None,
}


def _refusal_cases():
    for row in ROWS:
        for kind in TYPE_REFUSED:
            if kind == "None" and row.none_ok:
                continue
            yield pytest.param(row, kind, id=f"{row.name}-{kind}")


def _range_cases():
    for row in ROWS:
        for value in row.beyond + row.bad:
            yield pytest.param(row, value, id=f"{row.name}-{value}")


def _unchanged(row, target, before):
    assert row.state(target) == before, f"{row.name}: a refused call changed the state"


@pytest.mark.parametrize("row", ROWS, ids=[r.name for r in ROWS])
def test_numpy_integers_are_accepted_as_python_ints(row):
    expected = row.call(row.setup(), row.valid)
    same = [np.int64(row.valid), np.int32(row.valid), np.intp(row.valid)]
    if row.valid >= 0:
        same += [np.uint64(row.valid), np.uint8(row.valid)]
    for value in same:
        target = row.setup()
        assert row.call(target, value) == expected, f"{row.name}: {type(value).__name__} differs from int"


@pytest.mark.parametrize("row, kind", list(_refusal_cases()))
def test_non_integers_raise_type_error_naming_the_argument(row, kind):
    value = TYPE_REFUSED[kind](row.valid)
    target = row.setup()
    before = row.state(target)
    with pytest.raises(TypeError) as info:
        row.call(target, value)
    message = str(info.value)
    assert re.match(rf"Invalid type of {re.escape(row.arg)}: expected an integer\b", message), message
    _unchanged(row, target, before)


@pytest.mark.parametrize("row, value", list(_range_cases()))
def test_integers_out_of_range_raise_value_error_naming_the_argument(row, value):
    target = row.setup()
    before = row.state(target)
    with pytest.raises(row.error) as info:
        row.call(target, value)
    message = str(info.value)  # an OverflowError is not caught above: the test fails on it
    assert message.startswith(f"Invalid value of {row.arg}: "), message
    assert str(value) in message, message  # the value given, not a wrapped or truncated one
    _unchanged(row, target, before)


# ------------------------------------------------------------ special cases
def test_sequence_ids_span_int64():
    cache = kv_cache()
    for seq_id in (2**63 - 1, -(2**63), np.int64(-1), np.uint64(2**63 - 1 - 5)):
        cache.add_sequence(seq_id)
    assert sorted(cache.seq_ids()) == sorted([2**63 - 1, -(2**63), -1, 2**63 - 6])
    cache.append([2**63 - 1, -(2**63)], [1, 2])
    assert cache.seq_len(np.uint64(2**63 - 1)) == 1
    cache.fork(-(2**63), 2**62)
    assert cache.seq_len(2**62) == 2


def test_membership_is_false_for_non_integers_and_never_raises():
    cache = cache_with(1, 3)()
    assert 1 in cache and np.int64(1) in cache and np.uint8(3) in cache
    for value in (1.0, 1.5, np.float64(1.0), True, np.bool_(True), "1", None, 2**64, -(2**64)):
        assert value not in cache
    pool_cache = classic_cache()
    assert 1 in pool_cache and np.int64(1) in pool_cache
    for value in BEYOND_INT64:
        with pytest.raises(ValueError, match=r"^Invalid value of token_idx: "):
            value in pool_cache  # noqa: B015
    for value in (1.0, 1.5, True, "1", None):
        with pytest.raises(TypeError, match=r"^Invalid type of token_idx: expected an integer"):
            value in pool_cache  # noqa: B015


def test_extra_key_salts_with_any_integer_and_refuses_floats_and_bools():
    def hit(extra_key, probe):
        cache = kv_cache(enable_prefix_caching=True)
        cache.add_sequence(1, [1, 2, 3, 4, 5], extra_key=extra_key)
        cache.append([1], [5])
        return cache.add_sequence(2, [1, 2, 3, 4, 5], extra_key=probe)

    assert hit(1, np.int64(1)) == 4 and hit(2**64, 2**64) == 4
    assert hit(1, 2) == 0 and hit(2**64, 2**64 + 1) == 0
    for value in (1.0, 1.5, np.float64(1.0), True, np.bool_(True)):
        cache = kv_cache(enable_prefix_caching=True)
        before = cache_state(cache)
        with pytest.raises(TypeError, match=r"^Invalid type of extra_key: "):
            cache.add_sequence(1, [1, 2, 3], extra_key=value)
        assert cache_state(cache) == before


FLAGS = [
    ("KVCache.append return_slot_mapping", "return_slot_mapping", cache_with(1, 3),
     lambda c, v: (_tolist_or_none(c.append([1], [2], return_slot_mapping=v)), cache_state(c)), cache_state),
    ("KVCache.stats metrics", "metrics", cache_with(1, 3), lambda c, v: c.stats(metrics=v), cache_state),
    ("KVCache.load mmap", "mmap", lambda: None, lambda _, v: cache_state(KVCache.load(snapshot_file(), mmap=v)),
     nothing),
    ("snapshot.load_cache mmap", "mmap", lambda: None,
     lambda _, v: cache_state(snapshot.load_cache(snapshot_file(), mmap=v)), nothing),
    ("attention.decode return_lse", "return_lse", cache_with(1, 3),
     lambda c, v: str(attention.decode(np.ones((1, QO_HEADS, DIM)), c, 0, [3], return_lse=v)), cache_state),
]


def _tolist_or_none(a):
    return None if a is None else a.tolist()


@pytest.mark.parametrize("name, arg, setup, call, state", FLAGS, ids=[f[0] for f in FLAGS])
def test_flags_take_bools_only(name, arg, setup, call, state):
    for flag in (True, False):
        assert call(setup(), np.bool_(flag)) == call(setup(), flag)
    for value in (1, 0, 1.0, 0.5, "yes", None):
        target = setup()
        before = state(target)
        with pytest.raises(TypeError) as info:
            call(target, value)
        assert re.match(rf"Invalid type of {re.escape(arg)}: expected a? ?bool", str(info.value)), str(info.value)
        assert state(target) == before


def tier_wait(method, timeout):
    pytest.importorskip("redis", reason="pagedkv.tiers needs redis-py: pip install \"pagedkv[redis]\"")
    from pagedkv.tiers import RedisTier

    t = RedisTier("redis://127.0.0.1:1/0", namespace="scalars")  # no writer yet: nothing to wait for
    return getattr(t, method)(timeout)


SECONDS = [
    ("tiers.RedisTier timeout_seconds", "timeout_seconds", lambda v: tier(timeout_seconds=v)),
    ("tiers.RedisTier.flush timeout", "timeout", lambda v: tier_wait("flush", v)),
    ("tiers.RedisTier.close timeout", "timeout", lambda v: tier_wait("close", v)),
    ("events.ZmqEventPublisher linger", "linger", lambda v: publisher(linger=v)),
    ("events.ZmqEventPublisher interval", "interval", lambda v: publisher(interval=v)),
]


@pytest.mark.parametrize("name, arg, call", SECONDS, ids=[s[0] for s in SECONDS])
def test_durations_are_finite_numbers_of_seconds(name, arg, call):
    call(0.5)
    call(np.float32(0.5))
    call(2)
    for value in (float("inf"), float("nan"), -1.0, 1e300, 2**64):
        with pytest.raises(ValueError) as info:
            call(value)
        assert str(info.value).startswith(f"Invalid value of {arg}: "), str(info.value)
    for value in (True, "1", 1j):
        with pytest.raises(TypeError) as info:
            call(value)
        assert str(info.value).startswith(f"Invalid type of {arg}: "), str(info.value)


def test_the_model_layer_follows_the_scalar_rule():
    """pagedkv.models: sizes, counts and thread counts refuse floats and bools with TypeError and
    out-of-range integers with ValueError, naming the argument; NumPy integers are accepted."""
    from pagedkv.models import PagedBackend
    from pagedkv.models.paged_backend import max_pages_per_sequence
    from pagedkv.models.threads import resolve_num_threads

    for value in (16.0, 16.5, True, np.float64(16)):
        with pytest.raises(TypeError, match="Invalid type of page_size: expected an integer"):
            PagedBackend(1, 1, 4, 8, page_size=value)
        with pytest.raises(TypeError, match="Invalid type of page_size: expected an integer"):
            max_pages_per_sequence(10, value)
    with pytest.raises(TypeError, match="Invalid type of num_pages: expected an integer"):
        PagedBackend(1, 1, 4, 8.0)
    with pytest.raises(ValueError, match="Invalid value of page_size: expected 1 <= page_size <= "):
        max_pages_per_sequence(10, 0)
    with pytest.raises(ValueError, match="Invalid value of page_size: expected 1 <= page_size <= "):
        max_pages_per_sequence(10, 2**64)
    assert max_pages_per_sequence(np.int64(10), np.int32(4)) == max_pages_per_sequence(10, 4)
    with pytest.raises(TypeError, match="Invalid type of num_threads: expected an integer"):
        resolve_num_threads(2.0)
