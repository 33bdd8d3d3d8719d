"""vLLM-compatible KV events: wire encoding and a ZeroMQ publisher.

A :class:`~pagedkv.KVCache` made with ``enable_kv_events=True`` records, in
its compiled core, one event per page entering the prefix cache, per cached
page leaving it and per reset (see :meth:`pagedkv.KVCache.take_kv_events`).
This module encodes them as vLLM's ``KVEventBatch`` and publishes them the
way vLLM's ``ZmqEventPublisher`` does, so a KV-aware router written for vLLM
(llm-d's KV-cache manager, NVIDIA Dynamo, SGLang's and vLLM's routers)
consumes a pagedkv cache unchanged.

Needs the ``events`` extra (``pip install "pagedkv[events]"``): pyzmq for
the sockets (the batches are encoded in the core, in C) and msgspec, the
MessagePack library vLLM's consumers decode with (docs/kv_events.md).
``import pagedkv`` does not import this module.

Wire format (vLLM 0.26, ``vllm/distributed/kv_events.py`` after vLLM PR
#42892, which made events named-field maps)
--------------------------------------------------------------------------
Each ZeroMQ message has three frames: the topic (UTF-8), the batch's
sequence number (8 bytes, big-endian, from 0) and the payload, a MessagePack
array ``[ts, events, data_parallel_rank]`` (``ts``: seconds since the epoch,
float). Each event is a map tagged by its ``"type"`` key:

``BlockStored``
    ``block_hashes`` (list), ``parent_block_hash`` (hash or nil),
    ``token_ids`` (list of int), ``block_size`` (int, tokens), ``lora_id``
    (nil), ``medium`` (str), ``lora_name`` (nil), ``group_idx`` (0),
    ``kv_cache_spec_kind`` (``"full_attention"``, or ``"sliding_window"`` for
    a cache with a window) and, with a window, ``kv_cache_spec_sliding_window``
    (the window in tokens).
``BlockRemoved``
    ``block_hashes``, ``medium``, ``group_idx`` (0).
``AllBlocksCleared``
    no field.

Hashes are vLLM's integer form (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``, its
default): the low 64 bits of the page's 128-bit hash, which is what vLLM's
``maybe_convert_block_hash`` takes from the last 8 bytes of a hash read
big-endian; with ``hash_format="bytes"`` the whole hash as 16 big-endian
bytes. Fields vLLM leaves at their default (``extra_keys``) are omitted, as
its encoder (``omit_defaults=True``) does.

Differences from vLLM: ``medium`` defaults to ``"CPU"`` (the pool is host
memory; pass ``medium="GPU"`` for routers that score only that tier); pages
keyed by external block ids (``add_sequence(block_hashes=...)``, the trace
replay) have no token ids, so their ``BlockStored`` carries an empty
``token_ids``; attention-sink pages have no field of their own (a windowed
cache reports ``sliding_window``); the PUB socket binds its endpoint unless
``connect=True`` (vLLM binds only addresses with ``*`` and connects to the
others). docs/kv_events.md shows a consumer.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque

try:
    import zmq
except ImportError as exc:  # pragma: no cover - exercised without the extra
    raise ImportError('pagedkv.events needs pyzmq: pip install "pagedkv[events]" (from a checkout: '
                      'pip install ".[events]")') from exc

from pagedkv_c._checks import checked_flag, checked_int, checked_seconds
from pagedkv_c._kv_events import EncodedBatch, KVEvents, PayloadArena, _EncodeOptions

__all__ = ["VLLM_SCHEMA_VERSION", "END_SEQ", "REPLAY_STOPPED_SEQ", "encode_events", "ZmqEventPublisher", "KVEvents"]

logger = logging.getLogger(__name__)

VLLM_SCHEMA_VERSION = "0.26"
"""The vLLM release whose ``KVEventBatch`` wire schema this module follows."""

END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""Sequence-number frame that ends a replay (vLLM's ``ZmqEventPublisher.END_SEQ``), sent with an empty payload."""

REPLAY_STOPPED_SEQ = (-2).to_bytes(8, "big", signed=True)
"""Sequence-number frame that ends a replay cut short (pagedkv's; vLLM has none).

Its payload is the 8-byte big-endian sequence number of the first batch not
sent: the consumer re-requests from there. It is not ``END_SEQ`` and its
payload is not empty, so a consumer that knows only vLLM's end marker (vLLM's
example subscriber ends a replay on an empty payload) never takes it for a
complete replay; decoded as a ``KVEventBatch`` it fails.
"""

_POPULATE, _STOP = b"p", b"s"  # messages to the publisher thread
_REPLAY_BURST = 256  # messages sent to one replay peer before the next peer's turn
_REPLAY_ROUND = 1024  # messages sent to all replay peers before the thread looks at its other work
_REPLAY_RETRY_MS = (1, 16)  # wait before retrying peers whose pipes are full: first, longest (doubling)
_REPLAY_QUEUED = 16  # requests a peer may queue behind its replay in progress; more are ignored


def encode_events(events, *, ts: float | None = None, data_parallel_rank: int = 0, window: int | None = None,
                  medium: str = "CPU", hash_format: str = "int") -> bytes:
    """Encode drained KV events as one vLLM ``KVEventBatch``.

    Parameters
    ----------
    events : pagedkv_c._kv_events.KVEvents
        Events that :meth:`pagedkv.KVCache.take_kv_events` returned.
    ts : float or None
        Batch timestamp in seconds since the epoch; None: now (``time.time()``).
    data_parallel_rank : int
        Data-parallel rank written in the batch, ``>= 0`` (vLLM writes its
        engine's rank; 0 for a single engine).
    window : int or None
        The cache's sliding window in tokens (``cache.window``): fills
        vLLM's ``kv_cache_spec_kind`` and ``kv_cache_spec_sliding_window``.
    medium : str
        Storage tier named in every event (vLLM: ``"GPU"``, ``"CPU"``).
    hash_format : str
        ``"int"`` (vLLM's default: the low 64 bits of the 128-bit page hash)
        or ``"bytes"`` (the 16-byte big-endian hash).

    Returns
    -------
    bytes
        The MessagePack payload ``[ts, events, data_parallel_rank]``; see
        the module notes for the fields. Encoded in C without the GIL.

    Raises
    ------
    TypeError
        ``events`` is not a drained ``KVEvents``, ``medium`` is not a str, or
        ``data_parallel_rank`` or ``window`` is not an integer (a float or a
        bool is refused).
    ValueError
        An unknown ``hash_format``, or a ``data_parallel_rank`` or
        ``window`` outside ``[0, 2**63 - 1]``.
    """
    if not isinstance(events, KVEvents):
        raise TypeError(f"Invalid type of events: expected the KVEvents of KVCache.take_kv_events, "
                        f"got {type(events).__name__}")
    return events.encode(time.time() if ts is None else float(ts), data_parallel_rank=data_parallel_rank,
                         window=window, medium=medium, hash_format=hash_format)


class ZmqEventPublisher:
    """Publish a cache's KV events on a ZeroMQ PUB socket, as vLLM's ``ZmqEventPublisher``.

    Each :meth:`publish` takes the events the cache recorded since the last
    one (one short call under the cache's lock), encodes them in C without
    the GIL (see the module notes) and hands the message ``(topic, sequence
    number, payload)``, sequence numbers from 0, to ZeroMQ, whose I/O thread
    sends it; the last ``buffer_steps`` payloads are kept for replay. The
    caller never waits for the network: a PUB socket does not block, and a
    subscriber too slow for its high-water mark loses messages, which it
    sees as a gap in the sequence numbers and recovers through the replay
    socket. A background thread answers replay requests, drains the cache
    every ``interval`` if asked to, and faults in the memory of the next
    payloads ahead of the caller; it sleeps in a poll without the GIL
    otherwise, so a batch costs no hand-over between threads.

    Parameters
    ----------
    cache : pagedkv.KVCache
        A cache made with ``enable_kv_events=True``.
    endpoint : str
        ZeroMQ address of the PUB socket, bound (default ``"tcp://*:5557"``,
        vLLM's); with ``connect=True`` connected instead.
    topic : str
        Topic frame of every message (default ``""``; vLLM's default too).
    replay_endpoint : str or None
        Address to bind a ROUTER socket for replays, or None (no replay). A
        client sends a sequence number (8 bytes, big-endian); the publisher
        answers with one message ``(sequence number, payload)`` per buffered
        batch from that number (or from the oldest batch still buffered, if
        that is later: the consumer sees history it can no longer replay as
        a first number above its request) up to the last batch published
        when the request arrived, then ``(END_SEQ, b"")``. ``END_SEQ`` comes
        only after all of them: a peer whose pipe is full is waited for (it
        never loses a message of the answer), and a replay that cannot go on
        ends with ``(REPLAY_STOPPED_SEQ, first sequence number not sent)``
        instead, or with no marker when the peer does not take even that
        within ``replay_timeout``. Use a DEALER socket (send ``(b"", seq)``,
        receive ``(b"", seq, payload)``): a REQ socket accepts only the first
        message of an answer. docs/kv_events.md shows a consumer that checks
        the numbers.
    buffer_steps : int
        Batches kept for replay, ``1 <= buffer_steps <= 2**63 - 1`` (default
        10000, vLLM's).
    replay_timeout : float
        Seconds a replay peer may take no message (its pipe stays full)
        before its replay stops, ``0 < replay_timeout <= 2147483.647``
        (default 5). A replay also stops
        when a batch it still has to send leaves the buffer (more than
        ``buffer_steps`` batches published while the peer read) and when the
        peer disconnects. The thread serves replays a few hundred messages
        at a time, in turn with the other peers' replays and the
        ``interval`` drains: a slow peer delays neither.
    interval : float or None
        When set, the background thread also drains the cache every
        ``interval`` seconds (``0 < interval <= 2147483.647``, ZeroMQ's
        int milliseconds), so a caller need not call
        :meth:`publish`; None (default): only :meth:`publish` drains.
    data_parallel_rank : int
        Rank written in every batch (default 0).
    medium : str
        Storage tier named in every event (default ``"CPU"``).
    hash_format : str
        ``"int"`` (default) or ``"bytes"``; see :func:`encode_events`.
    connect : bool
        Connect the PUB socket to ``endpoint`` instead of binding it (for a
        subscriber that binds). vLLM decides by the address (it binds
        addresses with ``*``); here it is explicit.
    hwm : int
        High-water mark of the PUB socket in messages, ``1 <= hwm <= 2**31 -
        1`` (default 100000, vLLM's).
    linger : float
        Seconds :meth:`close` waits for queued messages to leave, ``0 <=
        linger <= 2147483.647`` (default 1).

    Attributes
    ----------
    num_batches : int
        Batches sent (each one ZeroMQ message).
    num_events : int
        Events sent (a ``BlockStored`` of several pages counts once).
    num_bytes : int
        Bytes of the frames sent (topic, sequence number and payload).
    num_dropped : int
        Events the cache's log dropped (it was full) before a drain; each
        drop is logged as a warning.
    num_replays : int
        Replays answered completely (ended with ``END_SEQ``).
    num_replays_stopped : int
        Replays that ended before ``END_SEQ`` (see ``replay_endpoint``);
        each is logged as a warning.

    Raises
    ------
    TypeError
        ``cache`` is not a KVCache, or an argument of the wrong type (a
        float or a bool for an integer, a bool or a string for seconds, a
        non-bool ``connect``).
    ValueError
        The cache records no KV events, or an argument out of range
        (seconds that are NaN or infinite included).
    OSError
        A socket cannot bind (or connect to) its endpoint; the message names it.

    Notes
    -----
    Source: vLLM's ``vllm/distributed/kv_events.py`` (``ZmqEventPublisher``:
    PUB frames, sequence numbers, ROUTER replay and ``END_SEQ``). vLLM's
    ROUTER drops what does not fit in a peer's pipe and sends ``END_SEQ``
    all the same; this one sets ``ZMQ_ROUTER_MANDATORY`` and waits, bounded
    by ``replay_timeout``, and ``REPLAY_STOPPED_SEQ`` is its own.
    """

    def __init__(self, cache, endpoint: str = "tcp://*:5557", *, topic: str = "",
                 replay_endpoint: str | None = None, buffer_steps: int = 10000,
                 replay_timeout: float = 5.0, interval: float | None = None, data_parallel_rank: int = 0,
                 medium: str = "CPU", hash_format: str = "int", connect: bool = False, hwm: int = 100_000,
                 linger: float = 1.0) -> None:
        from pagedkv import KVCache

        if not isinstance(cache, KVCache):
            raise TypeError(f"Invalid type of cache: expected pagedkv.KVCache, got {type(cache).__name__}")
        if not cache.kv_events_enabled:
            raise ValueError("Invalid value of cache: it records no KV events; create it with "
                             "KVCache(..., enable_prefix_caching=True, enable_kv_events=True)")
        for name, value in (("endpoint", endpoint), ("topic", topic)):
            if not isinstance(value, str):
                raise TypeError(f"Invalid type of {name}: expected str, got {type(value).__name__}")
        if replay_endpoint is not None and not isinstance(replay_endpoint, str):
            raise TypeError(f"Invalid type of replay_endpoint: expected str or None, got {type(replay_endpoint).__name__}")
        buffer_steps = checked_int(buffer_steps, "buffer_steps", 1, 2**63 - 1)
        hwm = checked_int(hwm, "hwm", 1, 2**31 - 1)  # a C int in ZeroMQ
        if interval is not None:
            interval = checked_seconds(interval, "interval")
        linger = checked_seconds(linger, "linger", low_inclusive=True)
        connect = checked_flag(connect, "connect")
        replay_timeout = checked_seconds(replay_timeout, "replay_timeout")
        _EncodeOptions(data_parallel_rank, None, medium, hash_format)  # checked now, not at the first batch

        self._cache = cache
        self._window = cache.window
        self._topic = topic.encode("utf-8")
        self._interval = interval
        self._rank = data_parallel_rank
        self._medium = medium
        self._hash_format = hash_format
        self._linger_ms = int(linger * 1000)
        self._buffer: deque[tuple[int, EncodedBatch]] = deque(maxlen=buffer_steps)
        self._replay_timeout = float(replay_timeout)
        self._replays: dict[bytes, _Replay] = {}  # peer identity -> its replay in progress (the thread's)
        self._retry_ms = _REPLAY_RETRY_MS[0]
        self._use_pollout = True  # False while POLLOUT reports room that no replay peer has
        self._arena = PayloadArena()  # kept payloads; the thread faults its memory in ahead
        self._populate_pending = False
        self._unsent = None  # events a drain took but could not encode (no memory)
        self._take_lock = threading.RLock()  # a take and its send are one step: batches keep their order
        self._closed = False
        self.num_batches = 0
        self.num_events = 0
        self.num_bytes = 0
        self.num_dropped = 0
        self.num_replays = 0
        self.num_replays_stopped = 0
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint

        self._context = zmq.Context()
        self._pub = self._replay = self._wake_in = self._wake_out = None
        try:
            self._pub = self._context.socket(zmq.PUB)
            self._pub.set_hwm(hwm)
            self._open(self._pub, endpoint, "endpoint", connect)
            if replay_endpoint is not None:
                self._replay = self._context.socket(zmq.ROUTER)
                # A full peer pipe raises zmq.Again instead of dropping the message (and a
                # peer gone raises EHOSTUNREACH): a replay never loses a batch silently.
                self._replay.setsockopt(zmq.ROUTER_MANDATORY, 1)
                self._open(self._replay, replay_endpoint, "replay_endpoint", False)
            # The thread sleeps in a poll (without the GIL) until a replay request, the next
            # interval drain, or a message on this pair (sent under _take_lock): fault in
            # the payload arena's next memory, or stop.
            wake_address = f"inproc://pagedkv-kv-events-{id(self):x}"
            self._wake_in = self._context.socket(zmq.PULL)
            self._wake_in.bind(wake_address)
            self._wake_out = self._context.socket(zmq.PUSH)
            self._wake_out.connect(wake_address)
        except BaseException:
            self._close_sockets(0)
            raise
        self._thread = threading.Thread(target=self._run, name="pagedkv-kv-events", daemon=True)
        self._thread.start()

    @staticmethod
    def _open(socket, address: str, name: str, connect: bool) -> None:
        try:
            if connect:
                socket.connect(address)
            else:
                socket.bind(address)
        except zmq.ZMQError as exc:
            raise OSError(f"cannot {'connect' if connect else 'bind'} the KV event {name} {address!r}: {exc}") from exc

    def _close_sockets(self, linger_ms: int) -> None:
        for socket in (self._wake_out, self._wake_in):
            if socket is not None:
                socket.close(linger=0)
        for socket in (self._pub, self._replay):
            if socket is not None:
                socket.close(linger=linger_ms)
        self._context.term()

    @property
    def closed(self) -> bool:
        """True after :meth:`close`."""
        return self._closed

    def publish(self) -> int:
        """Take the cache's pending KV events and publish them as one batch.

        Takes the events (one short call under the cache's lock), encodes
        them in C without the GIL (a few ns per page hash) and hands the
        message to ZeroMQ, whose I/O thread sends it: the caller never waits
        for the network or a subscriber. Nothing is sent when there are no
        events.

        Returns
        -------
        int
            Events taken (0: nothing was pending).

        Raises
        ------
        RuntimeError
            The publisher is closed.
        MemoryError
            No memory for the payload. The events taken are kept, and the
            next :meth:`publish` (or :meth:`close`) sends them first, as
            their own batch: none is lost.
        """
        return self._drain()

    def _drain(self, from_thread: bool = False) -> int:
        with self._take_lock:
            if self._closed:  # checked under the lock: close() may have run while this call waited for it
                if from_thread:
                    return 0  # close() took the last batch
                raise RuntimeError("this ZmqEventPublisher is closed: create a new one to publish")
            if self._unsent is not None:  # a batch taken by an earlier drain that could not be encoded
                unsent, self._unsent = self._unsent, None
                self._send(unsent)
            events, dropped = self._cache.take_kv_events()
            if dropped:
                self.num_dropped += dropped
                logger.warning("the KV event log of the cache was full: %d events were dropped; raise "
                               "kv_events_capacity or publish more often", dropped)
            if len(events):
                self._send(events)
            return len(events)

    def _send(self, events) -> None:
        """Encode one batch, publish it as ``(topic, sequence, payload)`` and keep it for replays.

        Runs under ``_take_lock``, in the draining thread: the drain's own
        thread sends, so a batch costs no hand-over between threads (each
        would wait for the caller's GIL).
        """
        sequence = self.num_batches
        try:
            payload = self._arena.encode(events, time.time(), data_parallel_rank=self._rank, window=self._window,
                                         medium=self._medium, hash_format=self._hash_format)
        except Exception:
            self._unsent = events  # taken from the cache: the next drain sends it first
            raise
        try:
            # PUB sends never block (at the high-water mark a subscriber misses the message
            # and sees a gap). copy=False: ZeroMQ sends from the payload itself.
            self._pub.send_multipart((self._topic, sequence.to_bytes(8, "big"), payload), copy=False)
        except zmq.ZMQError:
            logger.exception("sending KV event batch %d failed", sequence)
        self._buffer.append((sequence, payload))
        if self._arena.needs_populate and not self._populate_pending:
            # The thread faults in the arena's next memory, off the caller's path.
            self._populate_pending = True
            self._wake_out.send(_POPULATE)
        self.num_batches += 1
        self.num_events += len(events)
        self.num_bytes += len(self._topic) + 8 + len(payload)

    def close(self) -> None:
        """Publish what is pending, stop the thread and close the sockets.

        Waits up to ``linger`` seconds for the sockets to deliver what was
        sent. Calling it again does nothing.
        """
        if self._closed:
            return
        with self._take_lock:
            if self._closed:
                return  # another thread closed it meanwhile
            self._drain()
            self._closed = True
            self._wake_out.send(_STOP)
        self._thread.join()
        self._close_sockets(self._linger_ms)

    def __enter__(self) -> ZmqEventPublisher:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"ZmqEventPublisher(endpoint={self.endpoint!r}, replay_endpoint={self.replay_endpoint!r}, "
                f"batches={self.num_batches}, events={self.num_events}, closed={self._closed})")

    # ----------------------------------------------------------- the thread
    def _run(self) -> None:
        """Answer replay requests and drain every ``interval``; sleeps in a poll without the GIL."""
        poller = zmq.Poller()
        poller.register(self._wake_in, zmq.POLLIN)
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        next_drain = time.monotonic() + self._interval if self._interval is not None else None
        replay_wait = None  # ms until the replays in progress can go on (0: now)
        replay_events = zmq.POLLIN
        while True:
            timeout = None if next_drain is None else max(0.0, next_drain - time.monotonic()) * 1000
            if replay_wait is not None:
                timeout = replay_wait if timeout is None else min(timeout, replay_wait)
            if self._replay is not None:
                # Every replay peer's pipe is full: wake when a pipe has room (POLLOUT of a ROUTER
                # with ROUTER_MANDATORY: some peer's pipe, maybe an idle peer's, then of no use).
                wanted = zmq.POLLIN | zmq.POLLOUT if replay_wait and self._use_pollout else zmq.POLLIN
                if wanted != replay_events:
                    poller.modify(self._replay, wanted)
                    replay_events = wanted
            ready = dict(poller.poll(timeout))
            if self._wake_in in ready:
                if self._wake_in.recv() == _STOP:
                    self._stop_replays()
                    return  # close() drained and sent the last batch
                self._populate_pending = False
                try:
                    self._arena.populate()
                except MemoryError:
                    logger.warning("no memory to fault in the memory of later KV event payloads ahead of time")
            if self._replay is not None:
                try:
                    if ready.get(self._replay, 0) & zmq.POLLIN:
                        self._take_requests()
                    woken = bool(ready.get(self._replay, 0) & zmq.POLLOUT)
                    replay_wait = self._serve_replays(woken) if self._replays else None
                except zmq.ZMQError:
                    logger.exception("replay request failed")
            if next_drain is not None and time.monotonic() >= next_drain:
                try:
                    self._drain(from_thread=True)
                except Exception:  # the thread keeps serving replays; the next drain tries again
                    logger.exception("draining KV events in the publisher thread failed")
                next_drain = time.monotonic() + self._interval

    def _take_requests(self) -> None:
        """Read the replay requests waiting (a bounded number): each starts or queues a peer's replay."""
        for _ in range(_REPLAY_QUEUED):
            try:
                frames = self._replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            # REQ clients send (identity, b"", seq); DEALER clients may leave out the empty delimiter.
            if len(frames) == 3 and frames[1] == b"":
                envelope, request = tuple(frames[:2]), frames[2]
            elif len(frames) == 2:
                envelope, request = tuple(frames[:1]), frames[1]
            else:
                logger.warning("ignored a replay request of %d frames", len(frames))
                continue
            if len(request) != 8:
                logger.warning("ignored a replay request whose sequence number is %d bytes, not 8", len(request))
                try:
                    self._replay.send_multipart((*envelope, END_SEQ, b""), zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass  # the peer's pipe is full or the peer is gone: nothing to answer
                continue
            start = int.from_bytes(request, "big")
            replay = self._replays.get(envelope[0])
            if replay is None:
                self._replays[envelope[0]] = self._new_replay(envelope, start)
            elif len(replay.queued) < _REPLAY_QUEUED:
                replay.queued.append((envelope, start))  # answered after the one in progress
            else:
                logger.warning("ignored a replay request from %d: %d of that peer's are waiting already",
                               start, _REPLAY_QUEUED)

    def _new_replay(self, envelope: tuple[bytes, ...], start: int) -> _Replay:
        """A replay of the batches buffered from ``start`` to the last one published now."""
        buffer = self._buffer
        try:  # batches only ever leave the buffer as others come in: never empty again once filled
            first, end = buffer[0][0], buffer[-1][0] + 1
        except IndexError:
            first = end = start
        if start < first:
            logger.info("a replay from batch %d starts at %d, the oldest one buffered", start, first)
        return _Replay(envelope, max(start, first), end, time.monotonic() + self._replay_timeout)

    def _buffered(self, sequence: int) -> EncodedBatch | None:
        """The payload of batch ``sequence`` if it is still buffered; None if it left the buffer.

        Reads the deque without the lock publishers append under: an append
        that evicts the oldest batch between the two reads shifts the index,
        which the sequence check sees, and the lookup runs again.
        """
        buffer = self._buffer
        while True:
            try:
                first = buffer[0][0]
                if sequence < first:
                    return None
                found, payload = buffer[sequence - first]
            except IndexError:
                return None
            if found == sequence:
                return payload

    def _serve_replays(self, woken: bool = False) -> float:
        """Send each replay in progress its next messages, in turn; return ms until the next round.

        ``woken``: the poll reported POLLOUT. If no replay moves after it, the
        room is another peer's, and until a replay moves again the thread
        waits on the timer alone (POLLOUT would wake it at once every time).
        """
        now = time.monotonic()
        more = progress = False
        budget = _REPLAY_ROUND
        for identity in list(self._replays):
            if budget <= 0:  # the peers not served yet come first in the next round
                more = True
                break
            replay = self._replays.pop(identity)
            sent, state = self._advance(replay, now, min(_REPLAY_BURST, budget))
            budget -= sent
            progress |= sent > 0
            if state == "done" and replay.queued:  # the peer's next request
                following = self._new_replay(*replay.queued.popleft())
                following.queued = replay.queued
                replay, state = following, "more"
            if state in ("more", "blocked"):
                self._replays[identity] = replay  # the end of the turn
                more |= state == "more"
        if progress:
            self._use_pollout = True
        elif woken:
            self._use_pollout = False
        if more:
            self._retry_ms = _REPLAY_RETRY_MS[0]
            return 0.0
        # Every peer in a replay has a full pipe: wait for POLLOUT, or for a timer that checks the
        # deadlines, longer each time nothing moves.
        self._retry_ms = _REPLAY_RETRY_MS[0] if progress else min(2 * self._retry_ms, _REPLAY_RETRY_MS[1])
        return float(self._retry_ms)

    def _advance(self, replay: _Replay, now: float, limit: int) -> tuple[int, str]:
        """Send one replay up to ``limit`` messages; return (messages sent, state).

        State: ``"more"`` (more to send now), ``"blocked"`` (the peer's pipe
        is full), ``"done"`` (the replay ended, with its marker) or
        ``"gone"`` (dropped: the peer left, or took not even the stop marker).
        """
        sent = 0
        while sent < limit:
            last = True
            if replay.stopped:
                frames = (*replay.envelope, REPLAY_STOPPED_SEQ, replay.next.to_bytes(8, "big"))
            elif replay.next >= replay.end:
                frames = (*replay.envelope, END_SEQ, b"")
            else:
                payload = self._buffered(replay.next)
                if payload is None:  # it left the buffer while the peer read slowly: a gap
                    self._stop(replay, f"batch {replay.next} left the buffer (buffer_steps) before the peer took it")
                    continue
                frames = (*replay.envelope, replay.next.to_bytes(8, "big"), payload)
                last = False
            try:
                self._replay.send_multipart(frames, zmq.NOBLOCK)
            except zmq.Again:  # the peer's pipe is full: try again later, up to the deadline
                if now < replay.deadline:
                    return sent, "blocked"
                if replay.stopped:
                    logger.warning("a replay peer did not take even the stop marker of its replay in %.3g s: "
                                   "dropped without a marker", self._replay_timeout)
                    return sent, "gone"
                self._stop(replay, f"the peer took no message for {self._replay_timeout:.3g} s")
                replay.deadline = now + self._replay_timeout  # to take the stop marker
                continue
            except zmq.ZMQError as exc:  # EHOSTUNREACH: the peer disconnected
                if not replay.stopped:
                    why = "the peer disconnected" if exc.errno == zmq.EHOSTUNREACH else f"send failed: {exc}"
                    self._stop(replay, why)
                return sent, "gone"
            sent += 1
            replay.deadline = now + self._replay_timeout
            if last:
                if not replay.stopped:
                    self.num_replays += 1
                return sent, "done"
            replay.next += 1
        return sent, "more"

    def _stop(self, replay: _Replay, why: str) -> None:
        """Mark a replay as stopped early: it sends REPLAY_STOPPED_SEQ next, never END_SEQ."""
        replay.stopped = True
        self.num_replays_stopped += 1
        logger.warning("a replay stopped at batch %d of %d..%d: %s", replay.next, replay.first, replay.end - 1, why)

    def _stop_replays(self) -> None:
        """On close: end every replay in progress with its stop marker if the peer's pipe takes it now."""
        for replay in self._replays.values():
            if not replay.stopped:
                self._stop(replay, "the publisher was closed")
            try:
                self._replay.send_multipart((*replay.envelope, REPLAY_STOPPED_SEQ, replay.next.to_bytes(8, "big")),
                                            zmq.NOBLOCK)
            except zmq.ZMQError:
                pass  # full or gone: the peer sees no end marker at all
        self._replays.clear()


class _Replay:
    """One peer's replay in progress: batches ``next .. end - 1`` still to send, then a marker."""

    __slots__ = ("envelope", "first", "next", "end", "deadline", "stopped", "queued")

    def __init__(self, envelope: tuple[bytes, ...], first: int, end: int, deadline: float) -> None:
        self.envelope = envelope
        self.first = first
        self.next = first
        self.end = max(end, first)
        self.deadline = deadline  # monotonic time by which the peer must take its next message
        self.stopped = False  # it ends with REPLAY_STOPPED_SEQ
        self.queued: deque[tuple[tuple[bytes, ...], int]] = deque()  # the peer's later requests
