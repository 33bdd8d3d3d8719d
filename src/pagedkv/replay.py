"""Replay of serving traces through the page manager, with prefix caching.

A replay drives a :class:`pagedkv.KVCache` with ``num_layers=0`` (page
management only, no K/V bytes) through the requests of a
:class:`pagedkv.traces.Trace`, one request at a time in file order:

1. ``add_sequence`` with the request's prompt block ids (Mooncake
   ``hash_ids``): the sequence starts on the longest run of cached pages its
   prompt matches (prefix caching), at most ``(P - 1) // page_size`` pages
   for a prompt of ``P`` tokens, so the last prompt token is always computed;
2. ``append`` of the remaining prompt tokens (their full pages become cached);
3. ``append`` of the output tokens;
4. ``remove_sequence``: its pages are released newest first, so they join the
   free queue tail first and the heads of prefixes stay findable longest.

Freed pages keep their content and hash; the allocator hands out the least
recently freed page first, and handing out a cached page evicts it from the
prefix index. Traces without block ids (Azure) replay the same steps with
prefix caching off: they measure occupancy and allocation speed.

Rejection. One request is in the cache at a time, so the whole pool is free
when a request starts, and a request fits iff its ``ceil((P + O) /
page_size)`` pages fit the pool. A request that does not fit is *rejected*
before any call: it counts in ``num_rejected``, leaves the cache and its
counters exactly as they were (no hit or query is recorded), and the replay
goes on with the next request.

Page operations. The throughput unit ``page_operations`` is the number of
single-page steps of the manager: **pages allocated** (taken from the head of
the free queue for new tokens; taking a cached page this way evicts it) +
**pages matched** (cached pages taken for a prefix hit, off the free queue
in O(1)) + **pages freed** (returned to the free queue when the request
ends). Every page a request holds is either matched or allocated, and is
freed once, so an admitted request of ``P`` prompt and ``O`` output tokens
costs exactly ``2 * ceil((P + O) / page_size)`` page operations. Hash
computations and index lookups are not counted separately.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import numpy as np

from pagedkv import KVCache
from pagedkv.traces import Trace
from pagedkv_c._checks import checked_int

_PROGRESS_CHUNK = 256  # requests between progress callbacks
PREFIX_HASHES = ("xxh3_128", "sha256")
MAX_PAGES = 2**31 - 2
"""Most pages of a pool (page ids are int32)."""
MAX_PREFIX_PAGES = 2**30
"""Most pages of a pool with prefix caching (the index's slot arithmetic)."""
MAX_PAGE_SIZE = 2**20
"""Largest page of a KVCache, in tokens."""


@dataclass
class ReplayResult:
    """Counters and timing of one :func:`replay`.

    Attributes
    ----------
    trace_format : str
        ``"mooncake"`` or ``"azure"``.
    prefix_caching : bool
        True when the trace carried block ids and prefix caching was on.
    capacity_tokens : int
        Capacity asked for, in tokens.
    page_size : int
        Tokens per page.
    num_pages : int
        Pages in the pool, ``capacity_tokens // page_size``.
    num_requests : int
        Requests replayed, rejected ones included.
    num_rejected : int
        Requests that needed more than ``num_pages`` pages (see the module notes).
    prompt_tokens : int
        Prompt tokens of the admitted requests (the prefix cache's queries), in tokens.
    hit_tokens : int
        Prompt tokens served from cached pages, in tokens.
    pages_allocated, pages_matched, pages_freed : int
        Page operations by kind, in pages (see the module notes).
    prefix_evictions : int
        Cached pages dropped from the prefix index because the allocator
        handed them out again.
    prefix_cached_pages : int
        Pages findable by hash when the replay ended.
    pages_peak : int
        Most pages in use at once.
    seconds : float
        Wall time of the request loop (manager calls only; loading the trace
        and preparing per-request views are not timed), in seconds.
    cached_tokens : numpy.ndarray
        int64, shape ``[num_requests]``: tokens each request was served from
        cache, -1 for a rejected request.
    cache : KVCache or None
        The cache after the replay, when :func:`replay` was asked to keep it.
    tier_hit_tokens : int
        Of ``hit_tokens``, those served from a shared tier (0 without one).
    """

    trace_format: str
    prefix_caching: bool
    capacity_tokens: int
    page_size: int
    num_pages: int
    num_requests: int
    num_rejected: int
    prompt_tokens: int
    hit_tokens: int
    pages_allocated: int
    pages_matched: int
    pages_freed: int
    prefix_evictions: int
    prefix_cached_pages: int
    pages_peak: int
    seconds: float
    cached_tokens: np.ndarray = field(repr=False)
    cache: KVCache | None = field(default=None, repr=False)
    tier_hit_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        """Token hit rate: ``hit_tokens / prompt_tokens`` (0.0 without admitted prompts)."""
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def page_operations(self) -> int:
        """``pages_allocated + pages_matched + pages_freed`` (see the module notes)."""
        return self.pages_allocated + self.pages_matched + self.pages_freed

    @property
    def requests_per_second(self) -> float:
        """Replayed requests (rejected ones included) per second of :attr:`seconds`."""
        return self.num_requests / self.seconds if self.seconds > 0 else float("inf")

    @property
    def page_operations_per_second(self) -> float:
        """Page operations per second of :attr:`seconds`."""
        return self.page_operations / self.seconds if self.seconds > 0 else float("inf")

    @property
    def peak_occupancy(self) -> float:
        """``pages_peak / num_pages``: the largest fraction of the pool in use at once."""
        return self.pages_peak / self.num_pages

    def to_dict(self) -> dict:
        """The counters and derived rates as a JSON-ready dict (without the per-request array and the cache)."""
        out = {k: v for k, v in asdict(self).items() if k not in ("cached_tokens", "cache")}
        out.update(
            hit_rate=self.hit_rate,
            page_operations=self.page_operations,
            requests_per_second=self.requests_per_second,
            page_operations_per_second=self.page_operations_per_second,
            peak_occupancy=self.peak_occupancy,
        )
        return out


def capacity_pages(capacity_tokens: int, page_size: int, max_pages: int = MAX_PAGES) -> int:
    """Pages of a pool of ``capacity_tokens`` tokens: ``capacity_tokens // page_size``.

    ``max_pages`` is the largest pool allowed: ``MAX_PAGES`` (``2**31 - 2``,
    page ids are int32), or ``MAX_PREFIX_PAGES`` (``2**30``) for a replay
    with prefix caching.

    Raises
    ------
    TypeError
        A non-integer argument (a float or a bool is refused).
    ValueError
        ``page_size`` outside ``[1, 2**20]`` (the largest page of a
        :class:`pagedkv.KVCache`) or ``capacity_tokens < page_size`` (no
        whole page), or more than ``max_pages`` pages.
    """
    capacity_tokens = checked_int(capacity_tokens, "capacity_tokens")
    page_size = checked_int(page_size, "page_size", 1, MAX_PAGE_SIZE)
    num_pages = capacity_tokens // page_size
    if num_pages < 1 or num_pages > max_pages:
        raise ValueError(
            f"Invalid value of capacity_tokens: expected {page_size} <= capacity_tokens <= "
            f"{max_pages * page_size} (1 to {max_pages:,} pages of {page_size} tokens), got {capacity_tokens}"
        )
    return num_pages


def replay(trace: Trace, capacity_tokens: int, *, page_size: int = 16, prefix_hash: str = "xxh3_128",
           progress: Callable[[int], object] | None = None, keep_cache: bool = False,
           on_cache: Callable[[KVCache], object] | None = None, tier=None,
           kv_events: Callable[[KVCache], Callable[[], object]] | None = None) -> ReplayResult:
    """Replay a trace through a page manager of ``capacity_tokens`` tokens.

    See the module notes for the steps per request, the rejection rule and
    the definition of page operations.

    Parameters
    ----------
    trace : Trace
        Requests in file order. With block ids (Mooncake) prefix caching is
        on; without (Azure) it is off.
    capacity_tokens : int
        Pool capacity in tokens; the pool has ``capacity_tokens // page_size`` pages.
    page_size : int
        Tokens per page, ``>= 1``; with block ids, ``trace.block_tokens`` must
        be a multiple of it (page ``j`` of a block is keyed by (block id, j)).
    prefix_hash : str
        ``"xxh3_128"`` (default) or ``"sha256"``: the page hash of the prefix
        index (see :class:`pagedkv.KVCache`).
    progress : callable or None
        Called as ``progress(n)`` after every few hundred requests with the
        number finished since the previous call (e.g. ``tqdm.update``).
    keep_cache : bool
        Keep the cache in ``ReplayResult.cache`` for inspection.
    on_cache : callable or None
        Called as ``on_cache(cache)`` with the new :class:`pagedkv.KVCache`
        before the first request, e.g. to register a
        :class:`pagedkv.metrics.Collector` for it.
    tier : pagedkv.tiers.RedisTier or None
        A prefix tier shared with other replays (needs block ids): the pages
        a request seals are written to it (headers only: a replay has no
        K/V bytes), and a request fetches the pages its local cache lacks.
        The replay waits for the tier's writes at the end.
    kv_events : callable or None
        Record the prefix cache's KV events (``enable_kv_events=True``, a
        trace with block ids only): ``kv_events(cache)`` is called once with
        the new cache, before the timer starts, and returns the function
        that drains its events (e.g. ``cache.take_kv_events``, or the
        ``publish`` of a :class:`pagedkv.events.ZmqEventPublisher` it
        makes); that function is called every 256 requests and after the
        last one, inside the timed loop.

    Returns
    -------
    ReplayResult

    Raises
    ------
    ValueError
        ``capacity_tokens`` or ``page_size`` out of range, ``block_tokens`` not
        a multiple of ``page_size``, an unknown ``prefix_hash``, or
        ``kv_events`` with a trace without block ids.
    TypeError
        ``trace`` is not a :class:`Trace`, or a non-integer capacity or page size.
    """
    if tier is not None and not trace.has_block_ids:
        raise ValueError(f"Invalid value of tier: a shared tier needs block ids, the {trace.format} trace has none")
    num_pages = _checked_num_pages(trace, capacity_tokens, page_size, prefix_hash)
    with_prefix = trace.has_block_ids
    if kv_events is not None and not with_prefix:
        raise ValueError(f"Invalid value of kv_events: KV events report the prefix cache, and a {trace.format} "
                         "trace has no block ids to cache")
    cache = KVCache(0, 1, 1, num_pages, page_size=page_size, enable_prefix_caching=with_prefix,
                    prefix_hash=prefix_hash, tier=tier, enable_kv_events=kv_events is not None)
    if on_cache is not None:
        on_cache(cache)
    drain_events = kv_events(cache) if kv_events is not None else None

    inputs = trace.input_lengths
    outputs = trace.output_lengths
    needed_pages = (inputs + outputs + (page_size - 1)) // page_size
    admitted = needed_pages <= num_pages
    # Python scalars and per-request views are made before the timer starts.
    input_list = inputs.tolist()
    output_list = outputs.tolist()
    admitted_list = admitted.tolist()
    blocks = trace.request_blocks() if with_prefix else None
    block_tokens = trace.block_tokens
    num_requests = len(trace)
    cached_tokens = [-1] * num_requests
    seq_ids = np.zeros(1, dtype=np.int64)   # one sequence (id 0) at a time
    counts = np.zeros(1, dtype=np.int64)    # reused: the core takes int64 arrays as they are
    add_sequence, append, remove_sequence = cache.add_sequence, cache.append, cache.remove_sequence

    start = time.perf_counter()
    for chunk_start in range(0, num_requests, _PROGRESS_CHUNK):
        chunk_stop = min(num_requests, chunk_start + _PROGRESS_CHUNK)
        for i in range(chunk_start, chunk_stop):
            if not admitted_list[i]:
                continue
            if with_prefix:
                cached = add_sequence(0, block_hashes=blocks[i], block_tokens=block_tokens,
                                      num_prompt_tokens=input_list[i])
            else:
                cached = add_sequence(0)
            counts[0] = input_list[i] - cached
            append(seq_ids, counts, return_slot_mapping=False)
            if output_list[i]:
                counts[0] = output_list[i]
                append(seq_ids, counts, return_slot_mapping=False)
            remove_sequence(0)
            cached_tokens[i] = cached
        if drain_events is not None:
            drain_events()
        if progress is not None:
            progress(chunk_stop - chunk_start)
    seconds = time.perf_counter() - start
    if tier is not None:
        tier.flush()

    return _result(trace, cache, capacity_tokens, page_size, num_pages, cached_tokens, seconds, keep_cache)


def _checked_num_pages(trace, capacity_tokens, page_size, prefix_hash) -> int:
    """The pool size of a replay in pages, after checking its arguments (see :func:`replay`)."""
    if not isinstance(trace, Trace):
        raise TypeError(f"Invalid type of trace: expected pagedkv.traces.Trace, got {type(trace).__name__}")
    with_prefix = trace.has_block_ids
    num_pages = capacity_pages(capacity_tokens, page_size, MAX_PREFIX_PAGES if with_prefix else MAX_PAGES)
    if prefix_hash not in PREFIX_HASHES:
        raise ValueError(f"Invalid value of prefix_hash: expected one of {PREFIX_HASHES}, got {prefix_hash!r}")
    if with_prefix and trace.block_tokens % page_size:
        raise ValueError(
            f"Invalid value of page_size: expected a divisor of the trace's block_tokens "
            f"{trace.block_tokens}, got {page_size}"
        )
    return num_pages


def _result(trace, cache, capacity_tokens, page_size, num_pages, cached_tokens, seconds, keep_cache):
    """The :class:`ReplayResult` of ``trace`` replayed through ``cache``; checks the cache ended empty."""
    with_prefix = trace.has_block_ids
    inputs = trace.input_lengths
    needed_pages = (inputs + trace.output_lengths + (page_size - 1)) // page_size
    admitted = needed_pages <= num_pages
    num_requests = len(trace)
    stats = cache.stats()
    admitted_inputs = int(inputs[admitted].sum())
    if stats["pages_in_use"] or stats["num_sequences"] or \
            (with_prefix and stats["prefix_queries"] != admitted_inputs):
        raise RuntimeError(f"replay left the cache inconsistent: {stats}")
    hit_tokens = stats["prefix_hits"] + stats.get("tier_hits", 0) if with_prefix else 0
    total_pages = int(needed_pages[admitted].sum())
    pages_matched = hit_tokens // page_size
    return ReplayResult(
        trace_format=trace.format,
        prefix_caching=with_prefix,
        capacity_tokens=int(capacity_tokens),
        page_size=int(page_size),
        num_pages=num_pages,
        num_requests=num_requests,
        num_rejected=int(num_requests - admitted.sum()),
        prompt_tokens=admitted_inputs,
        hit_tokens=hit_tokens,
        pages_allocated=total_pages - pages_matched,
        pages_matched=pages_matched,
        pages_freed=total_pages,
        prefix_evictions=stats.get("prefix_evictions", 0),
        prefix_cached_pages=stats.get("prefix_cached_pages", 0),
        pages_peak=stats["pages_peak"],
        seconds=seconds,
        cached_tokens=np.asarray(cached_tokens, dtype=np.int64),
        cache=cache if keep_cache else None,
        tier_hit_tokens=stats.get("tier_hits", 0),
    )


def split_round_robin(trace: Trace, num_parts: int, part: int) -> Trace:
    """Requests ``part, part + num_parts, part + 2 * num_parts, ...`` of a trace, in order.

    How a load balancer that deals requests in turn spreads a trace over
    ``num_parts`` instances.

    Raises
    ------
    TypeError
        ``num_parts`` or ``part`` is not an integer (a float or a bool is refused).
    ValueError
        ``num_parts < 1`` or ``part`` outside ``[0, num_parts)``.
    """
    num_parts = checked_int(num_parts, "num_parts", 1, 2**63 - 1)
    part = checked_int(part, "part", 0, num_parts - 1)
    keep = np.arange(part, len(trace), num_parts)
    block_ids = block_offsets = None
    if trace.has_block_ids:
        pieces = [trace.blocks(int(i)) for i in keep]
        sizes = np.array([len(b) for b in pieces], dtype=np.int64)
        block_offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(trace.block_offsets.dtype)
        block_ids = (np.concatenate(pieces) if pieces else trace.block_ids[:0]).astype(trace.block_ids.dtype)
    return Trace(format=trace.format, source=f"{trace.source} (part {part} of {num_parts})",
                 arrival_seconds=trace.arrival_seconds[keep], input_lengths=trace.input_lengths[keep],
                 output_lengths=trace.output_lengths[keep], block_ids=block_ids, block_offsets=block_offsets,
                 block_tokens=trace.block_tokens)


def replay_shared(trace: Trace, capacity_tokens: int, tiers, *, page_size: int = 16,
                  prefix_hash: str = "xxh3_128",
                  progress: Callable[[int], object] | None = None) -> list[ReplayResult]:
    """Replay a trace over several caches that share a prefix tier, dealt round-robin.

    Instance ``p`` of ``n = len(tiers)`` gets requests ``p, p + n, p + 2n,
    ...`` (what :func:`split_round_robin` gives it), with a cache of its own
    of ``capacity_tokens`` tokens on top of ``tiers[p]``. Requests are served
    one at a time in file order, each as in :func:`replay`, and every request
    waits for its tier's writes (``tier.flush()``) before the next one starts:
    a request finds in the tier every page that the requests before it in
    the trace sealed, whichever instance served them. That is the case of a
    fleet whose requests finish and whose pages land in the tier before the
    next turn of a conversation arrives; it makes the result the same from
    run to run. (Replays in parallel processes that share a tier race: a
    replay runs thousands of requests per second, faster than the writes
    land, and would measure that race instead.)

    Parameters
    ----------
    trace : Trace
        Requests in file order, with block ids (Mooncake).
    capacity_tokens : int
        Pool capacity of each instance in tokens (``capacity_tokens //
        page_size`` pages).
    tiers : sequence of pagedkv.tiers.RedisTier
        One tier object per instance, all on the same store and namespace
        (a tier object serves one cache).
    page_size, prefix_hash, progress
        As for :func:`replay` (``progress`` gets the number of requests
        served across all instances).

    Returns
    -------
    list of ReplayResult
        One per instance, over that instance's requests (``seconds`` is the
        wall time of the whole shared loop, waits for the tier included).

    Raises
    ------
    ValueError
        No tiers, a trace without block ids, or an argument out of range as
        for :func:`replay`.
    TypeError
        As for :func:`replay`.
    """
    num_pages = _checked_num_pages(trace, capacity_tokens, page_size, prefix_hash)
    tiers = list(tiers)
    if not tiers:
        raise ValueError("Invalid value of tiers: expected at least one tier, got none")
    if not trace.has_block_ids:
        raise ValueError(f"Invalid value of trace: a shared tier needs block ids, the {trace.format} trace has none")
    n = len(tiers)
    parts = [split_round_robin(trace, n, p) for p in range(n)]
    caches = [KVCache(0, 1, 1, num_pages, page_size=page_size, enable_prefix_caching=True,
                      prefix_hash=prefix_hash, tier=tier) for tier in tiers]
    cached_tokens = [[-1] * len(part) for part in parts]
    inputs, outputs = trace.input_lengths.tolist(), trace.output_lengths.tolist()
    admitted = (((trace.input_lengths + trace.output_lengths + (page_size - 1)) // page_size)
                <= num_pages).tolist()
    blocks = trace.request_blocks()
    seq_ids = np.zeros(1, dtype=np.int64)
    counts = np.zeros(1, dtype=np.int64)
    start = time.perf_counter()
    for i in range(len(trace)):
        p, cache = i % n, caches[i % n]
        if admitted[i]:
            cached = cache.add_sequence(0, block_hashes=blocks[i], block_tokens=trace.block_tokens,
                                        num_prompt_tokens=inputs[i])
            for count in (inputs[i] - cached, outputs[i]):
                if count:
                    counts[0] = count
                    cache.append(seq_ids, counts, return_slot_mapping=False)
            cache.remove_sequence(0)
            tiers[p].flush()
            cached_tokens[p][i // n] = cached
        if progress is not None and (i + 1) % _PROGRESS_CHUNK == 0:
            progress(_PROGRESS_CHUNK)
    seconds = time.perf_counter() - start
    if progress is not None and len(trace) % _PROGRESS_CHUNK:
        progress(len(trace) % _PROGRESS_CHUNK)
    return [_result(part, cache, capacity_tokens, page_size, num_pages, cached, seconds, False)
            for part, cache, cached in zip(parts, caches, cached_tokens)]
