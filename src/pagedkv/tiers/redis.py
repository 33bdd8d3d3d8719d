"""RedisTier: a prefix tier shared by processes and machines, on Redis or Valkey (standalone or cluster).

Needs the ``redis`` extra (``pip install "pagedkv[redis]"``: redis-py with hiredis).
See :mod:`pagedkv.tiers._format` for the keys and the page value format.
"""
from __future__ import annotations

import collections
import logging
import math
import socket
import threading
import time
import urllib.parse

import numpy as np
import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.retry import Retry

from pagedkv.tiers._format import (
    CHECKSUM_OFFSET,
    FLAG_TOKENS,
    FORMAT_VERSION,
    HASH_OFFSET,
    HEADER,
    MAGIC,
    REJECT_KINDS,
    PageLayout,
    check_value,
    expected_header,
    page_keys,
)
from pagedkv_c._checks import checked_int, checked_seconds
from pagedkv_c._tier_io import PageValueChecker, record_checksums

__all__ = ["RedisTier"]

log = logging.getLogger("pagedkv.tiers")

# _per_node's answer for a node taken as down.
_SKIPPED = object()


class _NotAsked(redis.exceptions.TimeoutError):
    """The deadline passed before a node was asked (other nodes took the time): not that node's fault."""


# Errors after which the store is taken as unreachable for a while (fetches are misses at once).
_UNREACHABLE = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError,
                redis.exceptions.ClusterDownError, redis.exceptions.RedisClusterException, OSError)
# Pages and bytes the writer thread sends in one pipeline.
_WRITE_BATCH_PAGES = 64
_WRITE_BATCH_BYTES = 16 * 2**20
# The longest timeout_seconds, in seconds (a day): a socket timeout must fit the platform's time type.
_MAX_TIMEOUT = 86400
# Largest database number a server takes (its SELECT argument is a 32-bit int).
_MAX_DATABASE = 2**31 - 1
# Wait before the first retry after the store was unreachable, and the longest wait, in seconds.
_BACKOFF_FIRST = 0.25
_BACKOFF_MAX = 4.0


def _packed_set(key, value, ttl_seconds):
    """``SET key value NX [EX ttl]`` in the Redis protocol (RESP) as chunks, the value itself as given.

    Sending the value's memoryview as it is (``socket.sendall`` runs without the GIL)
    spares the two copies redis-py's packer makes of it while holding the GIL.
    """
    expiry = b"" if ttl_seconds is None else b"$2\r\nEX\r\n$%d\r\n%d\r\n" % (len(str(ttl_seconds)), ttl_seconds)
    head = b"*%d\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (4 if ttl_seconds is None else 6, len(key), key,
                                                               len(value))
    return [head, value, b"\r\n$2\r\nNX\r\n" + expiry]


# Server errors that redis-py's parser turns into their own exception classes (the text after the code
# is the exception's argument); MOVED and ASK tell the tier to read the cluster's slot map again.
_ERROR_CLASSES = {"MOVED": redis.exceptions.MovedError, "ASK": redis.exceptions.AskError,
                  "TRYAGAIN": redis.exceptions.TryAgainError, "CLUSTERDOWN": redis.exceptions.ClusterDownError}
# The longest reply line (a bulk length, a null or an error) read while looking for its end, in bytes.
_MAX_LINE = 4096
# A GET reply announcing another length than a page value's is a miss, and its bytes are not kept:
# up to this many are read and thrown away in one reused buffer (the connection stays in step with
# its commands); for a longer one the tier closes the connection instead of reading on. Reading 64 KiB
# takes about as long as opening a new connection (a few round trips) on a 1 Gb/s network; a value
# of another length is never written by a tier, only by a fault or by someone else.
_DISCARD_MAX = 64 * 1024
# How far past its deadline a read may end, in seconds: the socket's timeout (a system call to set)
# is set again only when it is older than this, not before every read.
_DEADLINE_SLACK = 0.005
# What a reader gives for a value of another length than a page value's (its bytes are not kept).
_WRONG_LENGTH = object()


def _raw_socket(conn):
    """The socket of a redis-py connection, or None for a connection without one of its own
    (a wrapper such as client-side caching's, whose replies only its parser can read)."""
    sock = getattr(conn, "_sock", None)
    return sock if isinstance(sock, socket.socket) else None


def _deadline_error(what):
    return redis.exceptions.TimeoutError(f"timeout_seconds passed before {what}")


def _send(sock, chunks, deadline):
    """Send protocol chunks (bytes-like, sent as they are) on ``sock``, all by ``deadline`` (``time.monotonic()``)."""
    try:
        for chunk in chunks:
            left = deadline - time.monotonic()
            if left <= 0:
                raise _deadline_error("the commands were sent")
            sock.settimeout(left)
            sock.sendall(chunk)
    except TimeoutError:
        raise _deadline_error("the commands were sent") from None
    except OSError as exc:
        raise redis.exceptions.ConnectionError(f"error while sending to the server: {exc}") from exc


class _SocketReader:
    """Replies read from a connection's socket by the tier itself, every read bounded by one deadline.

    ``deadline`` is a ``time.monotonic()`` time: no ``recv`` waits past it by
    more than ``_DEADLINE_SLACK`` (the socket's timeout is the time left, set
    again when it is older than that), so a server that sends a byte at a
    time holds the reader no longer than a silent one.
    """

    __slots__ = ("_reset_after", "_scratch", "deadline", "pending", "sock")

    def __init__(self, sock, deadline):
        self.sock = sock
        self.pending = bytearray()  # bytes received but not used yet: reply lines and what came after them
        self.deadline = deadline
        self._scratch = None
        self._reset_after = -math.inf  # when the socket's timeout must be set again

    def _wait(self):
        """Before a ``recv``: raise when the deadline passed; keep the socket's timeout within the slack of it."""
        now = time.monotonic()
        if now >= self._reset_after:  # a recv started now could wait past the deadline by more than the slack
            left = self.deadline - now
            if left <= 0:
                raise _deadline_error("the replies were read")
            self.sock.settimeout(left)
            self._reset_after = now + _DEADLINE_SLACK

    def _recv(self, size):
        self._wait()
        try:
            chunk = self.sock.recv(size)
        except TimeoutError:
            raise _deadline_error("the replies were read") from None
        if not chunk:
            raise redis.exceptions.ConnectionError("the server closed the connection")
        return chunk

    def line(self):
        """The next reply line (without its CRLF), from ``pending`` and then the socket."""
        pending = self.pending
        start = 0
        while True:
            end = pending.find(b"\r\n", start)
            if end >= 0:
                line = bytes(pending[:end])
                del pending[:end + 2]
                return line
            if len(pending) > _MAX_LINE:
                raise redis.exceptions.InvalidResponse(f"a reply line longer than {_MAX_LINE} bytes")
            start = max(len(pending) - 1, 0)
            pending += self._recv(256)  # a reply line is short; what follows it is copied from here once

    def read_into(self, view):
        """Fill ``view`` with the next ``len(view)`` bytes: first from ``pending``, then from the socket."""
        pending = self.pending
        have = min(len(pending), len(view))
        if have:
            view[:have] = pending[:have]
            del pending[:have]
        size = len(view)
        while have < size:
            self._wait()
            try:
                got = self.sock.recv_into(view[have:])
            except TimeoutError:
                raise _deadline_error("the replies were read") from None
            if not got:
                raise redis.exceptions.ConnectionError("the server closed the connection")
            have += got

    def skip(self, size):
        """Read the next ``size`` bytes (at most ``_DISCARD_MAX``) and throw them away."""
        if self._scratch is None or len(self._scratch) < size:
            self._scratch = bytearray(size)
        self.read_into(memoryview(self._scratch)[:size])

    def bulk_length(self, line):
        """The length a bulk reply line (``$<n>``) announces, -1 for a null."""
        digits = line[1:]
        if not (digits.isdigit() or digits == b"-1"):
            raise redis.exceptions.InvalidResponse(f"a bulk length that is not a number: {line[:32]!r}")
        return int(digits)

    def end_of_bulk(self):
        """Read the CRLF that ends a bulk reply; InvalidResponse if anything else is there (a length that lied)."""
        if self.line() != b"":
            raise redis.exceptions.InvalidResponse("a bulk reply does not end where its length says")

    def finish(self):
        """Check that nothing came after the replies (the connection would be out of step with its commands)."""
        if self.pending:
            raise redis.exceptions.InvalidResponse(f"{len(self.pending)} bytes after the replies")


def _error_reply(line):
    """The exception object of an error reply line (``-CODE message``)."""
    code, _, message = line[1:].decode("utf-8", "replace").partition(" ")
    error_class = _ERROR_CLASSES.get(code)
    return error_class(message) if error_class else redis.exceptions.ResponseError(f"{code} {message}")


def _read_values(conn, sock, indices, records, checker, deadline):
    """Read the replies of the pipelined ``GET`` of each page in ``indices`` from the socket ``sock``.

    A value of the expected length goes from the socket straight into its row
    of ``records`` (``recv_into``: one copy, no bytes object) and is verified at
    once by ``checker`` while its bytes are in the CPU caches. A reply that
    announces another length is not kept: up to ``_DISCARD_MAX`` bytes are read
    and thrown away, a longer one ends the reading (the connection is closed).
    Every socket read ends by ``deadline`` (``time.monotonic()``): memory and
    time do not depend on what the server announces or how slowly it sends.

    Returns ``(outcomes, reusable, error)``: per index read, in order, True
    (its row holds a value that passed every check), False (its row holds a
    value that failed one), None (no such key), ``_WRONG_LENGTH`` or a
    ``redis.exceptions.ResponseError`` (the server refused that ``GET``: MOVED,
    ASK, ...); whether the connection is in step with its commands (False: it
    must be closed); and the exception that ended the reading early (the
    deadline, a connection fault, a reply of another kind), or None. The
    outcomes of the values read before a fault are kept.
    """
    value_bytes = records.shape[1]
    reader = _SocketReader(sock, deadline)
    out = []
    try:
        for i in indices:
            line = reader.line()
            kind = line[:1]
            if kind == b"$":
                length = reader.bulk_length(line)
                if length < 0:
                    out.append(None)
                    continue
                if length == value_bytes:
                    reader.read_into(memoryview(records[i]))
                    outcome = checker.check(i)
                elif length <= _DISCARD_MAX:
                    reader.skip(length)
                    outcome = _WRONG_LENGTH
                else:  # not read: the replies after it cannot be reached on this connection
                    out.append(_WRONG_LENGTH)
                    return out, False, None
                reader.end_of_bulk()
                out.append(outcome)
            elif kind == b"_":  # RESP3 null
                out.append(None)
            elif kind == b"-":
                out.append(_error_reply(line))
            else:
                raise redis.exceptions.InvalidResponse(f"unexpected reply to GET: {line[:32]!r}")
        reader.finish()
    except Exception as exc:  # the replies not read yet are lost; the connection is out of step
        return out, False, exc
    return out, True, None


def _read_set_replies(conn, sock, indices, deadline):
    """Read the replies of the pipelined ``SET ... NX`` of ``indices`` from the socket ``sock``.

    Returns ``(replies, reusable, error)`` as :func:`_read_values` does; a reply is
    True (written), None (the key existed) or the server's error as an exception object.
    """
    reader = _SocketReader(sock, deadline)
    out = []
    try:
        for _ in indices:
            line = reader.line()
            kind = line[:1]
            if kind == b"+":
                out.append(True)
            elif kind == b"_" or line == b"$-1":
                out.append(None)
            elif kind == b"-":
                out.append(_error_reply(line))
            else:
                raise redis.exceptions.InvalidResponse(f"unexpected reply to SET: {line[:32]!r}")
        reader.finish()
    except Exception as exc:
        return out, False, exc
    return out, True, None


class _Watchdog:
    """Shuts a connection's socket down at a deadline, unless stopped first.

    A client's parser reads a reply in as many socket reads as it takes, each
    with the connection's own timeout: only taking the socket away from under
    it ends its wait at the deadline. Its next read then finds the connection
    closed (a ConnectionError), and the caller closes the connection.
    """

    def __init__(self, conn, deadline):
        self._conn = conn
        self._lock = threading.Lock()
        self._stopped = False
        self.fired = False
        self._timer = threading.Timer(max(0.0, deadline - time.monotonic()), self._fire)
        self._timer.daemon = True
        self._timer.start()

    def _fire(self):
        with self._lock:
            if self._stopped:
                return
            self.fired = True
            conn = self._conn
            for _ in range(4):  # a wrapper (client-side caching) holds the connection that holds the socket
                sock = getattr(conn, "_sock", None)
                if isinstance(sock, socket.socket):
                    try:
                        sock.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass
                    return
                conn = getattr(conn, "_conn", None)
                if conn is None:
                    return

    def stop(self):
        """Stop the watchdog; True when it fired (the connection must not be used again)."""
        with self._lock:
            self._stopped = True
        self._timer.cancel()
        return self.fired


def _parsed_replies(conn, count, deadline):
    """The next ``count`` replies through the client's parser, all by ``deadline`` (``time.monotonic()``).

    Returns ``(replies, reusable, error)`` as :func:`_read_values` does; a
    command the server refused gives its error as an exception object.
    """
    replies = []
    watchdog = _Watchdog(conn, deadline)
    error = None
    try:
        for _ in range(count):
            if time.monotonic() >= deadline:
                raise _deadline_error("the replies were read")
            try:
                replies.append(conn.read_response())
            except redis.exceptions.ResponseError as exc:  # this command only; the rest follow
                replies.append(exc)
    except Exception as exc:
        error = exc
    if watchdog.stop():
        return replies, False, _deadline_error("the replies were read")
    return replies, error is None, error


def _read_values_parsed(conn, indices, records, checker, deadline):
    """:func:`_read_values` through the client's parser (``conn.read_response``), for replies to
    ``GETRANGE key 0 <page value bytes>``.

    A parser reads a whole reply before it returns it, so the command bounds
    what the server sends: at most one byte more than a page value (a longer
    value is told by its length). An empty reply (no such key, or an empty
    value) is a miss. The deadline is kept by a :class:`_Watchdog`.
    """
    value_bytes = records.shape[1]
    replies, reusable, error = _parsed_replies(conn, len(indices), deadline)
    out = []
    for i, value in zip(indices, replies):
        if isinstance(value, Exception):
            out.append(value)
        elif not value:
            out.append(None)
        elif len(value) == value_bytes:
            records[i] = np.frombuffer(value, dtype=np.uint8)
            out.append(checker.check(i))
        else:
            out.append(_WRONG_LENGTH)
    return out, reusable, error


def _connect(url_or_client, timeout_seconds):
    """A redis-py client for a URL (or the client itself), and whether it is a cluster client."""
    if isinstance(url_or_client, RedisCluster):
        return url_or_client, True
    if isinstance(url_or_client, redis.Redis):
        return url_or_client, False
    expected = ("expected redis://HOST:PORT/DB, rediss://..., redis+cluster://HOST:PORT[,HOST:PORT...] "
                "or a redis.Redis / redis.RedisCluster client")
    if not isinstance(url_or_client, str):
        raise TypeError(f"Invalid type of url_or_client: {expected}, got {type(url_or_client).__name__}")
    timeouts = dict(socket_timeout=timeout_seconds, socket_connect_timeout=timeout_seconds)
    scheme, _, rest = url_or_client.partition("://")
    address, _, query = rest.partition("?")
    database = address.partition("/")[2]
    if scheme in ("redis", "rediss") and rest:
        if database and not (database.isascii() and database.isdigit() and int(database) <= _MAX_DATABASE):
            raise ValueError(f"Invalid value of url_or_client: the database of {url_or_client!r} is {database!r}; "
                             f"expected /DB with DB a number in 0 .. {_MAX_DATABASE} (the server's own limit, "
                             "16 databases by default, may be lower), or none (database 0)")
        if "db" in urllib.parse.parse_qs(query):
            raise ValueError(f"Invalid value of url_or_client: {url_or_client!r} gives the database as ?db=; "
                             "give it as /DB, the form this URL's database is read from")
        client = redis.Redis.from_url(url_or_client, retry=Retry(NoBackoff(), 1), **timeouts)
        pool = client.connection_pool
        try:  # a connection object opens no socket: this checks the query's parameter names now
            pool.connection_class(**pool.connection_kwargs)
        except TypeError as exc:
            raise ValueError(f"Invalid value of url_or_client: {url_or_client!r} has a query parameter the "
                             f"client does not take ({exc})") from None
        return client, False
    if scheme == "redis+cluster" and rest:
        if database not in ("", "0"):
            raise ValueError(f"Invalid value of url_or_client: the database of {url_or_client!r} is {database!r}; "
                             "a Redis Cluster has database 0 only (give /0 or none)")
        if query:
            raise ValueError(f"Invalid value of url_or_client: {url_or_client!r} has a query ({query!r}); "
                             "a redis+cluster:// URL takes none")
        nodes = []
        for address in rest.split("/")[0].split(","):
            parsed = urllib.parse.urlsplit("//" + address)
            try:
                port = parsed.port or 6379
            except ValueError:
                port = None
            if not parsed.hostname or port is None:
                raise ValueError(f"Invalid value of url_or_client: bad node address {address!r} in "
                                 f"{url_or_client!r}; {expected}")
            nodes.append(ClusterNode(parsed.hostname, port))
        # The cluster client connects when it is made: done lazily (see RedisTier._client).
        return (lambda: RedisCluster(startup_nodes=nodes, require_full_coverage=False,
                                     retry=Retry(NoBackoff(), 1), **timeouts)), True
    raise ValueError(f"Invalid value of url_or_client: {expected}, got {url_or_client!r}")


# Longest ttl_seconds: Redis refuses an expiry whose milliseconds, added to now, pass int64.
MAX_TTL_SECONDS = 2**50


class RedisTier:
    """Sealed pages of prefix caches in Redis or Valkey, shared by every cache of one namespace.

    Give it to :class:`pagedkv.KVCache` (``KVCache(..., enable_prefix_caching=True,
    tier=RedisTier(...))``): each page the cache seals (a full page whose K/V is
    complete in every layer) is written once, in a background thread, under its
    chained 128-bit prefix hash; :meth:`pagedkv.KVCache.add_sequence` asks the tier
    for the pages of a prompt that the local prefix cache does not hold.

    Parameters
    ----------
    url_or_client : str, redis.Redis or redis.RedisCluster
        ``redis://HOST:PORT/DB`` (or ``rediss://``) for one server,
        ``redis+cluster://HOST:PORT[,HOST:PORT...]`` for a cluster (the nodes
        to start from; the client finds the others), or a ready client (its
        own timeouts and retries then apply).
    namespace : str
        The model's fingerprint (e.g. a hash of its weights file): caches of
        other models must not share pages. The cache layout (layers, KV heads,
        head dim, page size, dtype, hash algorithm) is added to it, so caches
        of other layouts never read each other's pages.
    ttl_seconds : int or None
        Expiry of each written page, in seconds (``SET ... EX``), ``1 <=
        ttl_seconds <= 2**50`` (Redis refuses expiries whose milliseconds
        pass int64); None keeps pages until the store evicts them (set a
        ``maxmemory-policy`` such as ``allkeys-lru`` on the servers).
    max_inflight_bytes : int
        Bytes of page values the writer thread copies out and sends at once,
        ``1 <= max_inflight_bytes <= 2**63 - 1`` (default 256 MiB; a
        SmolLM2-135M page value is about 369 KB);
        as many pages again may wait, sealed, in each cache's log. A page
        sealed while its cache's log is full is not written and is counted
        (``dropped_writes``): the cache never waits on the network.
    timeout_seconds : float
        The longest a fetch or a write batch may take, in seconds, ``0 <
        timeout_seconds <= 86400`` (default 2.0): one deadline for the whole round trip
        (sending the commands and reading every reply, all nodes together),
        whatever client is given; the pages not read by then are misses and
        the connections still reading are closed. Also the connect timeout of
        URL clients and the timeout of each of their socket operations.

    Attributes
    ----------
    namespace : str
        The model fingerprint given.
    is_cluster : bool
        True for a Redis Cluster client.
    layout : PageLayout or None
        The layout of the caches served, set by the first cache.
    ttl_seconds, max_inflight_bytes
        As given.

    Raises
    ------
    TypeError, ValueError
        An argument of the wrong type (a float or a bool for an integer, a
        bool or a string for seconds) or out of range (NaN or infinite
        seconds included), or a URL of another form; nothing connects yet.

    Notes
    -----
    *Faults.* A server that is down, a timeout, a reset connection, an evicted
    key, a value that is corrupt, of another length, of another layout or
    whose token ids differ from the prompt's is a miss: it is counted
    (:meth:`stats`), logged once per kind on the ``pagedkv.tiers`` logger,
    and never raised out of the cache's calls. After a connection failure or
    a timeout the tier takes that node (or the whole store) as down for a
    short while (0.25 s, doubling up to 4 s while it stays down): its keys are
    misses at once and its writes are counted as failed; then it tries again:
    it reconnects by itself.

    *Untrusted replies.* Anything with network access to the store can write
    there, and a faulty server or proxy can answer anything: no reply sets
    what the tier allocates or how long it waits. A fetch allocates the page
    values it asks for (one buffer, ``n`` rows of a page value) and nothing
    in proportion to what a reply announces: a value of another length than
    a page value's is a miss (``rejected_truncated``) that is not kept; up to
    64 KiB of it are read and thrown away in one small buffer, so that the
    connection stays in step, and for a longer one the connection is closed
    instead (``connections_closed``). ``timeout_seconds`` bounds the whole
    fetch, however slowly a server sends (``fetch_timeouts``), and a write
    batch likewise. A connection that a fault, a timeout or an unread reply
    left out of step with its commands is closed, never reused: the next
    request opens a new one. The setup of a new connection (TCP connect,
    redis-py's handshake) and a cluster client's reading of the slot map
    are bounded by the client's own timeouts (for URL clients
    ``timeout_seconds`` per socket operation).

    *Offload.* The cache's thread only tells the writer thread that a call
    sealed pages. The writer takes them from the cache's sealed-page log and
    copies their bytes in one hold of the cache's lock (in C, without the
    GIL, so the copy is exactly the sealed bytes), fills the value headers,
    computes the page checksums (in C, without the GIL) and sends the values
    with one pipeline of ``SET NX`` per node (the page bytes go to the socket
    without a copy in Python).

    *Round trips.* A fetch is one pipeline of GETs per server holding some
    of the keys: one round trip to a standalone server, one per node of a
    cluster. A node that is down (or times out) costs only its own keys: the
    prompt's pages before its first key still count, the run stops there.
    The replies are read from the connection's socket by the tier itself: each
    value lands in its row of one buffer (no bytes object per value) and is
    verified at once, in C, while its bytes are in the CPU caches. A
    connection without a socket of its own (a wrapper, as for client-side
    caching) is read through the client's parser instead, which reads each
    reply whole: the tier then sends ``GETRANGE key 0 <page value bytes>``,
    so that a server never sends more than one byte beyond a page value
    (an empty reply is a miss), and a timer takes the socket away from the
    parser at the deadline. A node that
    answers MOVED or ASK (a slot moving between nodes) makes that key a miss;
    the tier reads the cluster's slot map again before the next request.

    *One layout.* A tier serves caches of one layout, fixed by the first
    cache it is given to; a cache of another layout raises ValueError.

    *Exit.* The writer is a daemon thread: call :meth:`flush` or
    :meth:`close` before the process exits to write what is still queued.
    """

    def __init__(self, url_or_client, *, namespace, ttl_seconds=None, max_inflight_bytes=256 * 2**20,
                 timeout_seconds=2.0):
        if not isinstance(namespace, str) or not namespace:
            raise TypeError(f"Invalid value of namespace: expected a non-empty str, got {namespace!r}")
        if ttl_seconds is not None:
            ttl_seconds = checked_int(ttl_seconds, "ttl_seconds", 1, MAX_TTL_SECONDS)
        max_inflight_bytes = checked_int(max_inflight_bytes, "max_inflight_bytes", 1, 2**63 - 1)
        timeout_seconds = checked_seconds(timeout_seconds, "timeout_seconds", high=_MAX_TIMEOUT)
        client, self.is_cluster = _connect(url_or_client, timeout_seconds)
        self._owns_client = isinstance(url_or_client, str)  # close() closes only connections it opened
        self.timeout_seconds = timeout_seconds
        self._client_or_factory = client
        self._client_lock = threading.Lock()
        self.namespace = namespace
        self.ttl_seconds = ttl_seconds
        self.max_inflight_bytes = max_inflight_bytes
        self.layout = None
        self._prefix = None
        self._lock = threading.Condition()
        self._queue = collections.deque()      # caches whose sealed pages wait for the writer
        self._inflight_bytes = 0               # pages being written, in bytes
        self._writing = 0                      # pages the writer is sending now
        self._closed = False
        self._writer = None
        self._down = {}                        # node (None: the store) -> (monotonic time it may be up, next backoff)
        self._record_bytes = 0                 # bytes of one page value (set by _attach)
        self._stale_map = False                # the cluster's slot map must be read again
        self._logged = set()
        self._counts = collections.Counter()

    # ------------------------------------------------------------------ public
    def stats(self):
        """Counters of this tier since it was made.

        Returns
        -------
        dict
            ``lookups`` (fetches asked for by ``add_sequence``), ``pages_requested``,
            ``hit_pages`` and ``hit_tokens`` (verified pages returned),
            ``misses`` (keys absent: never written or evicted), ``bytes_read``;
            ``pages_written``, ``bytes_written``, ``pages_existing`` (already in the
            store: ``SET NX`` did nothing), ``dropped_writes`` (sealed pages not written:
            their cache's log was full, see ``max_inflight_bytes``), ``write_errors`` (pages whose write
            failed, a node down or a timeout included); ``fetch_errors`` (fetches or values lost to a
            server or network fault, a timeout included), ``fetch_timeouts`` (fetches cut short by
            ``timeout_seconds``: the pages not read by then were misses), ``unreachable_skips`` (fetches,
            or parts of one, answered as misses and write batches not sent while a node or the store was
            taken as down), ``connections_closed`` (connections the tier closed instead of reusing them:
            after a fault, a timeout, or a value too long to read through); ``rejected_<kind>`` for each
            kind of bad value (``truncated``: a value of another length than a page value's, ``format``,
            ``layout``, ``hash``, ``tokens``, ``checksum``) and ``checksum_failures`` (= ``rejected_checksum``);
            ``inflight_bytes`` (page values being written now).
        """
        with self._lock:
            counts = dict(self._counts)
            inflight = self._inflight_bytes
        out = {name: counts.get(name, 0) for name in (
            "lookups", "pages_requested", "hit_pages", "misses", "bytes_read", "pages_written",
            "bytes_written", "pages_existing", "dropped_writes", "write_errors", "fetch_errors",
            "fetch_timeouts", "unreachable_skips", "connections_closed")}
        out["hit_tokens"] = out["hit_pages"] * (self.layout.page_size if self.layout else 0)
        for kind in REJECT_KINDS[1:]:
            out[f"rejected_{kind}"] = counts.get(f"rejected_{kind}", 0)
        out["checksum_failures"] = out["rejected_checksum"]
        out["inflight_bytes"] = inflight
        return out

    def flush(self, timeout=None):
        """Wait until every sealed page the caches told the writer about is written (or failed).

        Parameters
        ----------
        timeout : float or None
            Longest wait in seconds, ``0 <= timeout <= 2147483.647``; None
            waits as long as it takes.

        Returns
        -------
        bool
            True when no cache waits for the writer and nothing is being written.

        Raises
        ------
        TypeError, ValueError
            ``timeout`` is not a number of seconds (a bool or a string), or is
            NaN, infinite or out of range.
        """
        if timeout is not None:
            timeout = checked_seconds(timeout, "timeout", low_inclusive=True)
        with self._lock:
            return self._lock.wait_for(lambda: not self._queue and not self._writing, timeout)

    def close(self, timeout=10.0):
        """Write what is queued (waiting at most ``timeout`` seconds), stop the writer thread.

        Pages sealed later are not written (they wait in their cache's log
        until it is full); fetches still work. A tier made from a URL then
        closes its sockets (a later fetch opens new ones); a client passed in
        is left as it is. ``timeout`` is as in :meth:`flush` (None waits as
        long as it takes).
        """
        if timeout is not None:
            timeout = checked_seconds(timeout, "timeout", low_inclusive=True)
        with self._lock:
            self._closed = True
            self._lock.notify_all()
            writer = self._writer
        if writer is not None:
            writer.join(timeout)
        if self._owns_client:
            self._disconnect()

    def _disconnect(self):
        """Close the sockets of the client this tier made from its URL (a later fetch opens new ones)."""
        with self._client_lock:
            client = self._client_or_factory
        try:
            if isinstance(client, RedisCluster):
                for node in client.get_nodes():
                    if node.redis_connection is not None:
                        node.redis_connection.connection_pool.disconnect()
            elif isinstance(client, redis.Redis):
                client.connection_pool.disconnect()
            # else: a cluster client never made, nothing connected
        except (redis.RedisError, OSError) as exc:  # closing sockets of a server that is gone
            log.debug("RedisTier.close: %s", exc)

    def __repr__(self):
        kind = "cluster" if self.is_cluster else "standalone"
        layout = self.layout.describe() if self.layout else "unattached"
        return f"RedisTier({kind}, namespace={self.namespace!r}, layout={layout})"

    # ------------------------------------------------- interface of KVCache
    def _attach(self, num_layers, num_kv_heads, head_dim, page_size, dtype, hash_algorithm):
        """Fix the layout on the first cache; refuse a cache of another layout (ValueError).

        Returns the number of sealed pages that may wait in the cache's log.
        """
        layout = PageLayout.of_cache(num_layers, num_kv_heads, head_dim, page_size, dtype, hash_algorithm)
        with self._lock:
            if self.layout is not None and self.layout != layout:
                raise ValueError(
                    f"Invalid value of tier: it serves caches of layout {self.layout.describe()}, "
                    f"got a cache of layout {layout.describe()}; make one RedisTier per layout")
            self.layout = layout
            self._prefix = layout.key_prefix(self.namespace)
            self._record_bytes = HEADER.size + 4 * layout.page_size + layout.body_bytes
        # Sealed pages that may wait in a cache's log for the writer (the writer holds as many more).
        return max(1, self.max_inflight_bytes // self._record_bytes)

    def _offload_notify(self, cache):
        """``cache`` sealed pages: the writer thread takes them from its log (the caller does nothing more)."""
        with self._lock:
            if self._closed:
                return
            if not any(waiting is cache for waiting in self._queue):
                self._queue.append(cache)
            if self._writer is None:
                self._writer = threading.Thread(target=self._write_loop, name="pagedkv-tier-writer", daemon=True)
                self._writer.start()
            self._lock.notify_all()

    def _fetch(self, page_hashes, token_ids):
        """The leading run of pages the store holds and that pass every check.

        Parameters
        ----------
        page_hashes : numpy.ndarray
            uint64, shape ``[n, 2]``: hashes of consecutive pages of a prompt.
        token_ids : numpy.ndarray or None
            int32, shape ``[n, page_size]``: the prompt's tokens of those pages,
            or None for block-keyed pages.

        Returns
        -------
        (numpy.ndarray, int, int, numpy.ndarray) or None
            ``(records, count, body_offset, checksums)``: ``records`` (uint8,
            shape ``[n, value_bytes]``) holds in rows ``0 .. count-1`` the
            verified values of pages ``0 .. count-1``, each page's body
            (``layout.body_bytes``) at ``body_offset``, and ``checksums``
            (uint64, shape ``[n]``) their page checksums; page ``count`` is the
            first one missing, rejected, not read by the deadline or on a node
            that failed. None when ``count`` is 0. Never raises for a fault of
            the store or a bad value.

        Notes
        -----
        One pipeline per node holding some of the keys (one round trip each),
        so that a node that is down costs only its own keys: the pages before
        its first key still count. Each value is read from the socket straight
        into its row and verified right away, while its bytes are still in the
        CPU caches (:class:`pagedkv_c._tier_io.PageValueChecker`, in C): no
        bytes object per value, no second pass over the bytes before the
        cache copies them into its pool. The whole fetch ends by
        ``timeout_seconds`` after it began, and allocates ``records`` (and at
        most 64 KiB more) whatever the replies announce.
        """
        n = len(page_hashes)
        deadline = time.monotonic() + self.timeout_seconds
        with self._lock:
            self._counts["lookups"] += 1
            self._counts["pages_requested"] += n
        if n == 0:
            return None
        keys = page_keys(self._prefix, page_hashes)
        groups = self._by_node(keys, "fetch_errors")
        if groups is None or groups is _SKIPPED:
            return None
        layout = self.layout
        with_tokens = token_ids is not None
        value_bytes = HEADER.size + (4 * layout.page_size if with_tokens else 0) + layout.body_bytes
        records = np.empty((n, value_bytes), dtype=np.uint8)
        checker = PageValueChecker(records, expected_header(layout, with_tokens), HASH_OFFSET, CHECKSUM_OFFSET,
                                   page_hashes, token_ids, layout.num_layers, layout.page_bytes)

        def command(i, raw):
            """GET of page ``i``; through a parser, which reads a whole reply, a GETRANGE that bounds it."""
            return ("GET", keys[i]) if raw else ("GETRANGE", keys[i], 0, value_bytes)

        def read(conn, sock, indices):
            """One node's replies, read into ``records`` and verified (see :func:`_read_values`)."""
            if sock is None:
                return _read_values_parsed(conn, indices, records, checker, deadline)
            return _read_values(conn, sock, indices, records, checker, deadline)

        outcomes = [None] * n
        end = n  # pages from `end` on are lost to a fault: the run stops there
        timed_out = False
        for (node, _, indices), result in zip(groups, self._per_node(groups, command, deadline, read)):
            if result is _SKIPPED:
                end = min(end, indices[0])
                continue
            replies, error = result
            if len(replies) < len(indices):  # the rest was not read
                end = min(end, indices[len(replies)])
            for i, outcome in zip(indices, replies):
                if isinstance(outcome, Exception):
                    self._fault("fetch_errors", outcome, node)
                    end = min(end, i)
                    break
                outcomes[i] = outcome
            else:
                if error is None:
                    self._node_up(node)
            if error is not None:
                self._fault("fetch_errors", error, node)
                timed_out = timed_out or isinstance(error, redis.exceptions.TimeoutError)
        if timed_out:
            with self._lock:
                self._counts["fetch_timeouts"] += 1
        good = self._count_verified(outcomes[:end], records, page_hashes, token_ids, keys)
        if good == 0:
            return None
        return records, good, checker.body_offset, checker.checksums

    def _count_verified(self, outcomes, records, page_hashes, token_ids, keys):
        """Pages of the leading run of values that passed every check; counts the hits and the first failure."""
        good = 0
        while good < len(outcomes) and outcomes[good] is True:
            good += 1
        kind = None
        if good < len(outcomes):
            outcome = outcomes[good]
            if outcome is None:
                kind = "missing"
            elif outcome is _WRONG_LENGTH:  # not read: its length alone rules it out
                kind = "truncated"
            else:  # which check failed: a rare path, one value
                kind = check_value(bytes(records[good]), self.layout, page_hashes[good],
                                   None if token_ids is None else token_ids[good])[0] or "checksum"
        if kind == "missing":
            with self._lock:
                self._counts["misses"] += 1
        elif kind is not None:
            with self._lock:
                self._counts[f"rejected_{kind}"] += 1
            self._log_once(f"rejected_{kind}", "rejected a page value (%s check failed) under key %r: "
                           "counted as a miss", kind, keys[good])
        with self._lock:
            self._counts["hit_pages"] += good
            self._counts["bytes_read"] += good * records.shape[1]
        return good

    # ---------------------------------------------------------------- internals
    def _client(self):
        with self._client_lock:
            if callable(self._client_or_factory) and not isinstance(self._client_or_factory, (redis.Redis, RedisCluster)):
                self._client_or_factory = self._client_or_factory()
            return self._client_or_factory

    def _log_once(self, kind, message, *args):
        if kind not in self._logged:
            self._logged.add(kind)
            log.warning(message + " (logged once per kind; see RedisTier.stats())", *args)

    def _by_node(self, keys, counter):
        """``[(node, client, indices)]``: the keys' indices grouped by the node that holds them.

        ``node`` names the server (``host:port``; ``None`` for a standalone
        client), ``client`` is a plain client of it. None when the cluster's
        map cannot be had (counted once under ``counter``); ``_SKIPPED`` when the
        store is taken as down (counted in ``unreachable_skips`` only).
        """
        if self._is_down(None):
            with self._lock:
                self._counts["unreachable_skips"] += 1
            return _SKIPPED
        try:
            client = self._client()
            if not self.is_cluster:
                return [(None, client, list(range(len(keys))))]
            if self._stale_map:  # a node answered MOVED or ASK: slots moved since the map was read
                self._stale_map = False
                client.nodes_manager.initialize()
            groups = {}
            for i, key in enumerate(keys):
                node = client.get_node_from_key(key)
                if node.name not in groups:
                    groups[node.name] = (node.name, client.get_redis_connection(node), [])
                groups[node.name][2].append(i)
        except Exception as exc:
            self._fault(counter, exc, None)
            return None
        return list(groups.values())

    def _per_node(self, groups, command, deadline, read, packed=False):
        """Run ``command(i, raw)`` for every index of every group: send to each node, then read each node.

        ``command(i, raw)`` gives the command's arguments, or with ``packed``
        the command already in the protocol, as a list of bytes-like chunks
        (sent as they are: a page value is never copied by the client); ``raw``
        says whether the replies will be read from the connection's socket
        (else through the client's parser). ``read(connection, socket,
        indices)`` reads a group's replies (``socket`` None: through the
        parser) and returns ``(replies, reusable, error)`` (see
        :func:`_read_values`). Sending and reading end by ``deadline``
        (``time.monotonic()``), a node not yet asked by then is not asked.

        All nodes work at once (as redis-py's cluster pipeline does), but a node
        that fails costs only its own commands. Returns, per group in order,
        ``(replies, error)``: the replies read, in order (fewer than the group's
        commands when ``error``, the exception that lost the rest, is not None),
        or ``_SKIPPED`` for a node taken as down (counted in ``unreachable_skips``).
        A connection that is not in step with its commands (a fault, a timeout,
        replies left unread) is closed, never reused.
        """
        out = [None] * len(groups)
        sent = []
        for g, (node, client, indices) in enumerate(groups):
            if self._is_down(node):
                with self._lock:
                    self._counts["unreachable_skips"] += 1
                out[g] = _SKIPPED
                continue
            if time.monotonic() >= deadline:
                out[g] = ([], _NotAsked("timeout_seconds passed before this node was asked"))
                continue
            pool = client.connection_pool
            conn = None
            try:
                conn = pool.get_connection()
                sock = _raw_socket(conn)
                if packed:
                    chunks = [chunk for i in indices for chunk in command(i, sock is not None)]
                else:
                    chunks = conn.pack_commands([command(i, sock is not None) for i in indices])
                if sock is not None:
                    _send(sock, chunks, deadline)
                else:
                    watchdog = _Watchdog(conn, deadline)
                    try:
                        conn.send_packed_command(chunks)
                    finally:
                        if watchdog.stop():
                            raise _deadline_error("the commands were sent")
                sent.append((g, pool, conn, sock))
            except Exception as exc:  # any failure of the store or the client loses this node's part
                if conn is not None:
                    self._close(pool, conn)
                out[g] = ([], exc)
        for g, pool, conn, sock in sent:
            try:
                replies, reusable, error = read(conn, sock, groups[g][2])
                if reusable and sock is not None:
                    sock.settimeout(getattr(conn, "socket_timeout", None))  # as the client set it
            except Exception as exc:  # a reader's own failure: nothing it read can be trusted
                replies, reusable, error = [], False, exc
            if reusable:
                pool.release(conn)
            else:
                self._close(pool, conn)
            out[g] = (replies, error)
        return out

    def _close(self, pool, conn):
        """Close a connection that must not be used again (replies may be left unread) and give it back."""
        try:
            conn.disconnect()
        finally:
            pool.release(conn)
            with self._lock:
                self._counts["connections_closed"] += 1

    def _is_down(self, node):
        """True while a node (None: the whole store) is taken as unreachable after a connection fault."""
        state = self._down.get(node)
        return state is not None and time.monotonic() < state[0]

    def _node_up(self, node):
        if node in self._down or None in self._down:
            with self._lock:
                self._down.pop(node, None)
                self._down.pop(None, None)

    def _fault(self, counter, exc, node=None):
        """Count a failure of the store; take the node as unreachable for a while after a connection fault."""
        with self._lock:
            self._counts[counter] += 1
            if isinstance(exc, (redis.exceptions.MovedError, redis.exceptions.AskError)):
                self._stale_map = True
            if isinstance(exc, _UNREACHABLE) and not isinstance(exc, _NotAsked):
                backoff = self._down[node][1] if node in self._down else _BACKOFF_FIRST
                self._down[node] = (time.monotonic() + backoff, min(2 * backoff, _BACKOFF_MAX))
        self._log_once(f"{counter}:{type(exc).__name__}", "%s from %r: %s (%s; counted as a miss)",
                       type(exc).__name__, self, exc, counter)

    def _write_loop(self):
        layout = self.layout
        token_offset, body_offset = HEADER.size, HEADER.size + 4 * layout.page_size
        room = self.max_inflight_bytes // self._record_bytes  # pages taken and written at once
        per_batch = max(1, min(room, _WRITE_BATCH_PAGES, _WRITE_BATCH_BYTES // self._record_bytes))
        records = np.empty((per_batch, self._record_bytes), dtype=np.uint8)  # reused: no new pages to fault in
        page_hashes = np.empty((per_batch, 2), dtype=np.uint64)
        while True:
            with self._lock:
                self._lock.wait_for(lambda: self._queue or self._closed)
                if not self._queue:
                    return
                cache = self._queue.popleft()
                self._writing = 1
            try:
                while True:
                    # One hold of the cache's lock takes the log entries and copies the pages (C,
                    # no GIL): the copies are the sealed bytes, nothing to check again.
                    taken, lost = cache._take_sealed_copies(records[:per_batch if room else 0], token_offset,
                                                            body_offset, page_hashes[:per_batch if room else 0],
                                                            discard_rest=not room)
                    if lost:
                        with self._lock:
                            self._counts["dropped_writes"] += lost
                        self._log_once("dropped", "offloads dropped: more sealed pages waited than "
                                       "max_inflight_bytes=%d holds (counted)", self.max_inflight_bytes)
                    if not taken:
                        break
                    with self._lock:
                        self._inflight_bytes = taken * self._record_bytes
                    self._write(records[:taken], page_hashes[:taken], body_offset)
                    if taken < per_batch:
                        break
            except Exception as exc:  # a bug must not kill the writer silently
                self._fault("write_errors", exc)
            finally:
                del cache
                with self._lock:
                    self._inflight_bytes = 0
                    self._writing = 0
                    self._lock.notify_all()

    def _write(self, rows, page_hashes, body_offset):
        """Fill the value headers of copied pages and send them, one pipeline of ``SET NX`` per node."""
        layout = self.layout
        count = rows.shape[0]
        checksums = record_checksums(rows, body_offset, layout.num_layers, layout.page_bytes)  # C, no GIL
        token_bytes = rows[:, HEADER.size:body_offset]
        native_tokens = token_bytes.view(np.int32).copy()  # as the cache copied them: the machine's byte order
        token_bytes.view("<i4")[...] = native_tokens       # the format's: little-endian on every host
        keyed = (native_tokens != -1).any(axis=1)
        raw_hashes = np.ascontiguousarray(page_hashes, dtype="<u8").tobytes()
        keys = page_keys(self._prefix, page_hashes)
        fields = layout.header_fields()
        values = []
        for i in range(count):
            if keyed[i]:  # header, token ids, body
                at, flags = 0, FLAG_TOKENS
            else:  # a block-keyed page has no token ids: the header goes right before the body
                at, flags = body_offset - HEADER.size, 0
            HEADER.pack_into(rows[i], at, MAGIC, FORMAT_VERSION, flags, *fields, 0,
                             raw_hashes[16 * i:16 * i + 16], int(checksums[i]), layout.body_bytes)
            values.append(memoryview(rows[i])[at:])
        written = existing = failed = num_bytes = 0
        error = None
        deadline = time.monotonic() + self.timeout_seconds
        groups = self._by_node(keys, "write_errors")
        if groups is None or groups is _SKIPPED:
            failed = count - 1 if groups is None else count  # a fault was counted once; a skip was not
            groups = []

        def set_command(i, raw):
            """The ``SET key value NX [EX ttl]`` of page ``i``, as protocol chunks (the value not copied)."""
            return _packed_set(keys[i], values[i], self.ttl_seconds)

        def read(conn, sock, indices):
            """One node's replies to its SETs (see :func:`_read_set_replies`)."""
            if sock is None:
                return _parsed_replies(conn, len(indices), deadline)
            return _read_set_replies(conn, sock, indices, deadline)

        for (node, _, indices), outcome in zip(groups, self._per_node(groups, set_command, deadline, read,
                                                                      packed=True)):
            if outcome is _SKIPPED:
                failed += len(indices)
                continue
            results, exc = outcome
            if exc is not None:
                self._fault("write_errors", exc, node)
                failed += len(indices) - len(results) - 1  # _fault counted one
            for i, result in zip(indices, results):
                if isinstance(result, Exception):
                    failed += 1
                    error = (result, node)
                elif result is not None:
                    written += 1
                    num_bytes += len(values[i])
                else:
                    existing += 1
        if error is not None:
            self._fault("write_errors", *error)
            failed -= 1
        with self._lock:
            self._counts["pages_written"] += written
            self._counts["bytes_written"] += num_bytes
            self._counts["pages_existing"] += existing
            self._counts["write_errors"] += failed
