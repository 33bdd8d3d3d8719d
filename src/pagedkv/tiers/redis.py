"""RedisTier: a prefix tier shared by processes and machines, on Redis or Valkey (standalone or cluster).

Needs the ``redis`` extra (``pip install "pagedkv[redis]"``: redis-py with hiredis).
See :mod:`pagedkv.tiers._format` for the keys and the page value format.
"""
from __future__ import annotations

import collections
import logging
import threading
import time
import urllib.parse

import numpy as np
import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.retry import Retry

from pagedkv.tiers._format import HEADER, REJECT_KINDS, PageLayout, check_value, encode_header, page_keys

__all__ = ["RedisTier"]

log = logging.getLogger("pagedkv.tiers")

# Errors after which the store is taken as unreachable for a while (fetches are misses at once).
_UNREACHABLE = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError,
                redis.exceptions.ClusterDownError, redis.exceptions.RedisClusterException, OSError)
# Pages and bytes the writer thread sends in one pipeline.
_WRITE_BATCH_PAGES = 64
_WRITE_BATCH_BYTES = 16 * 2**20
# Wait before the first retry after the store was unreachable, and the longest wait, in seconds.
_BACKOFF_FIRST = 0.25
_BACKOFF_MAX = 4.0


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
    if scheme in ("redis", "rediss") and rest:
        return redis.Redis.from_url(url_or_client, retry=Retry(NoBackoff(), 1), **timeouts), False
    if scheme == "redis+cluster" and rest:
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
        Expiry of each written page, in seconds (``SET ... EX``); None keeps
        pages until the store evicts them (set a ``maxmemory-policy`` such as
        ``allkeys-lru`` on the servers).
    max_inflight_bytes : int
        Bytes of pages queued or being written at once, ``>= 1`` (default
        256 MiB). An offload that does not fit is dropped and counted
        (``dropped_writes``): the cache never waits on the network.
    timeout_seconds : float
        Connect and read timeout of URL clients, in seconds (default 2.0).

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
        An argument of the wrong type or out of range, or a URL of another
        form; nothing connects yet.

    Notes
    -----
    *Faults.* A server that is down, a timeout, a reset connection, an evicted
    key, a value that is corrupt, truncated, of another layout or whose token
    ids differ from the prompt's is a miss: it is counted (:meth:`stats`),
    logged once per kind on the ``pagedkv.tiers`` logger, and never raised
    out of the cache's calls. After a connection failure the tier answers
    misses at once for a short while (0.25 s, doubling up to 4 s while the
    store stays down), then tries again: it reconnects by itself.

    *Round trips.* A fetch is one pipeline of GETs: one round trip to a
    standalone server, and with a cluster one round trip per node holding some
    of the keys (redis-py's cluster pipeline groups the commands by node,
    writes to every node, then reads every node).

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
            if isinstance(ttl_seconds, bool) or not isinstance(ttl_seconds, int) or ttl_seconds < 1:
                raise ValueError(f"Invalid value of ttl_seconds: expected None or an int >= 1, got {ttl_seconds!r}")
        if isinstance(max_inflight_bytes, bool) or not isinstance(max_inflight_bytes, int) or max_inflight_bytes < 1:
            raise ValueError(f"Invalid value of max_inflight_bytes: expected an int >= 1, got {max_inflight_bytes!r}")
        if isinstance(timeout_seconds, bool) or not isinstance(timeout_seconds, (int, float)) or not timeout_seconds > 0:
            raise ValueError(f"Invalid value of timeout_seconds: expected a number > 0, got {timeout_seconds!r}")
        client, self.is_cluster = _connect(url_or_client, float(timeout_seconds))
        self._client_or_factory = client
        self._client_lock = threading.Lock()
        self.namespace = namespace
        self.ttl_seconds = ttl_seconds
        self.max_inflight_bytes = max_inflight_bytes
        self.layout = None
        self._prefix = None
        self._lock = threading.Condition()
        self._queue = collections.deque()      # (key, header, body) waiting for the writer
        self._inflight_bytes = 0               # reserved, queued or being written
        self._writing = 0                      # pages the writer is sending now
        self._closed = False
        self._writer = None
        self._unreachable_until = 0.0          # time.monotonic() before which fetches are misses
        self._backoff = _BACKOFF_FIRST
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
            store: ``SET NX`` did nothing), ``dropped_writes`` (pages not queued:
            ``max_inflight_bytes`` was reached), ``write_errors`` (pages whose write
            failed), ``stale_writes`` (pages not sent: their copy no longer matched the
            checksum of the seal); ``fetch_errors`` (fetches or values lost to a server or network
            fault), ``unreachable_skips`` (fetches answered as misses while the
            store was taken as down); ``rejected_<kind>`` for each kind of bad
            value (``truncated``, ``format``, ``layout``, ``hash``, ``tokens``,
            ``checksum``) and ``checksum_failures`` (= ``rejected_checksum``);
            ``inflight_bytes`` (queued or being written now).
        """
        with self._lock:
            counts = dict(self._counts)
            inflight = self._inflight_bytes
        out = {name: counts.get(name, 0) for name in (
            "lookups", "pages_requested", "hit_pages", "misses", "bytes_read", "pages_written",
            "bytes_written", "pages_existing", "dropped_writes", "write_errors", "stale_writes", "fetch_errors",
            "unreachable_skips")}
        out["hit_tokens"] = out["hit_pages"] * (self.layout.page_size if self.layout else 0)
        for kind in REJECT_KINDS[1:]:
            out[f"rejected_{kind}"] = counts.get(f"rejected_{kind}", 0)
        out["checksum_failures"] = out["rejected_checksum"]
        out["inflight_bytes"] = inflight
        return out

    def flush(self, timeout=None):
        """Wait until every queued page is written (or failed).

        Parameters
        ----------
        timeout : float or None
            Longest wait in seconds; None waits as long as it takes.

        Returns
        -------
        bool
            True when the queue is empty and nothing is being written.
        """
        with self._lock:
            return self._lock.wait_for(lambda: not self._queue and not self._writing, timeout)

    def close(self, timeout=10.0):
        """Write what is queued (waiting at most ``timeout`` seconds), stop the writer thread.

        Later offloads are dropped and counted; fetches still work.
        """
        with self._lock:
            self._closed = True
            self._lock.notify_all()
            writer = self._writer
        if writer is not None:
            writer.join(timeout)

    def __repr__(self):
        kind = "cluster" if self.is_cluster else "standalone"
        layout = self.layout.describe() if self.layout else "unattached"
        return f"RedisTier({kind}, namespace={self.namespace!r}, layout={layout})"

    # ------------------------------------------------- interface of KVCache
    def _attach(self, num_layers, num_kv_heads, head_dim, page_size, dtype, hash_algorithm):
        """Fix the layout on the first cache; refuse a cache of another layout (ValueError)."""
        layout = PageLayout.of_cache(num_layers, num_kv_heads, head_dim, page_size, dtype, hash_algorithm)
        with self._lock:
            if self.layout is not None and self.layout != layout:
                raise ValueError(
                    f"Invalid value of tier: it serves caches of layout {self.layout.describe()}, "
                    f"got a cache of layout {layout.describe()}; make one RedisTier per layout")
            self.layout = layout
            self._prefix = layout.key_prefix(self.namespace)

    def _reserve(self, num_pages):
        """Room in the write queue for up to ``num_pages`` pages; the rest count as dropped.

        Returns the number of pages reserved (the caller enqueues that many, or cancels).
        """
        per_page = HEADER.size + 4 * self.layout.page_size + self.layout.body_bytes
        with self._lock:
            if self._closed:
                fit = 0
            else:
                fit = min(num_pages, (self.max_inflight_bytes - self._inflight_bytes) // per_page)
            self._inflight_bytes += fit * per_page
            if fit < num_pages:
                self._counts["dropped_writes"] += num_pages - fit
                self._log_once("dropped", "write queue full (max_inflight_bytes=%d): offloads are "
                               "dropped and counted", self.max_inflight_bytes)
        return fit

    def _cancel(self, num_pages):
        """Give back the room of pages reserved but not enqueued."""
        per_page = HEADER.size + 4 * self.layout.page_size + self.layout.body_bytes
        with self._lock:
            self._inflight_bytes -= num_pages * per_page
            self._lock.notify_all()

    def _enqueue(self, page_hashes, token_ids, checksums, bodies):
        """Queue reserved pages for writing.

        Parameters
        ----------
        page_hashes : numpy.ndarray
            uint64, shape ``[n, 2]``.
        token_ids : numpy.ndarray or None
            int32, shape ``[n, page_size]``; None for block-keyed pages.
        checksums : numpy.ndarray
            uint64, shape ``[n]``: page checksums recorded at the seal. The
            writer checks each copy against its checksum and does not send a
            page whose bytes changed after the seal (``stale_writes``).
        bodies : numpy.ndarray
            uint8, shape ``[n, body_bytes]``: a copy the tier owns.
        """
        n = len(page_hashes)
        keys = page_keys(self._prefix, page_hashes)
        items = []
        for i in range(n):
            # A block-keyed page has no token ids (the sealed-page log gives -1s).
            tokens = None if token_ids is None or (token_ids[i] == -1).all() else token_ids[i]
            items.append((keys[i], encode_header(self.layout, page_hashes[i], tokens, checksums[i]),
                          int(checksums[i]), bodies[i].data))
        with self._lock:
            self._queue.extend(items)
            if self._writer is None:
                self._writer = threading.Thread(target=self._write_loop, name="pagedkv-tier-writer",
                                                daemon=True)
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
        list of memoryview
            The bodies (``layout.body_bytes`` each) of pages ``0 .. k-1``, where
            page ``k`` is the first one missing or rejected. Never raises for a
            fault of the store or a bad value.
        """
        n = len(page_hashes)
        with self._lock:
            self._counts["lookups"] += 1
            self._counts["pages_requested"] += n
            if n and time.monotonic() < self._unreachable_until:
                self._counts["unreachable_skips"] += 1
                return []
        if n == 0:
            return []
        try:
            client = self._client()
            pipe = client.pipeline(transaction=False)
            for key in page_keys(self._prefix, page_hashes):
                pipe.get(key)
            values = pipe.execute(raise_on_error=False)
        except Exception as exc:  # any failure of the store or the client is a miss
            self._fault("fetch_errors", exc)
            return []
        bodies = []
        layout = self.layout
        num_read = 0
        for i, value in enumerate(values):
            if isinstance(value, Exception):
                self._fault("fetch_errors", value)
                break
            kind, offset, checksum = check_value(value, layout, page_hashes[i],
                                                 None if token_ids is None else token_ids[i])
            if kind is None:
                body = memoryview(value)[offset:]
                if _body_checksum(body, layout) != checksum:
                    kind = "checksum"
            if kind == "missing":
                with self._lock:
                    self._counts["misses"] += 1
                break
            if kind is not None:
                with self._lock:
                    self._counts[f"rejected_{kind}"] += 1
                self._log_once(f"rejected_{kind}", "rejected a page value (%s check failed) under key %r: "
                               "counted as a miss", kind, page_keys(self._prefix, page_hashes[i:i + 1])[0])
                break
            bodies.append(body)
            num_read += len(value)
        with self._lock:
            self._counts["hit_pages"] += len(bodies)
            self._counts["bytes_read"] += num_read
            self._unreachable_until = 0.0
            self._backoff = _BACKOFF_FIRST
        return bodies

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

    def _fault(self, counter, exc):
        """Count a failure of the store; take it as unreachable for a while after a connection fault."""
        with self._lock:
            self._counts[counter] += 1
            if isinstance(exc, _UNREACHABLE):
                self._unreachable_until = time.monotonic() + self._backoff
                self._backoff = min(2 * self._backoff, _BACKOFF_MAX)
        self._log_once(f"{counter}:{type(exc).__name__}", "%s from %r: %s (%s; counted as a miss)",
                       type(exc).__name__, self, exc, counter)

    def _write_loop(self):
        per_page = HEADER.size + 4 * self.layout.page_size + self.layout.body_bytes
        while True:
            with self._lock:
                self._lock.wait_for(lambda: self._queue or self._closed)
                if not self._queue:
                    return
                batch, size = [], 0
                while self._queue and len(batch) < _WRITE_BATCH_PAGES and size < _WRITE_BATCH_BYTES:
                    item = self._queue.popleft()
                    batch.append(item)
                    size += per_page
                self._writing = len(batch)
            written = existing = failed = num_bytes = 0
            # A copy whose bytes changed after the seal (another thread wrote the page
            # between the seal and the copy) is not sent.
            fresh = [item for item in batch if _body_checksum(item[3], self.layout) == item[2]]
            try:
                pipe = self._client().pipeline(transaction=False)
                for key, header, checksum, body in fresh:
                    pipe.set(key, b"".join((header, body)), nx=True, ex=self.ttl_seconds)
                results = pipe.execute(raise_on_error=False) if fresh else []
            except Exception as exc:
                results = [exc] * len(fresh)
            error = None
            for (key, header, checksum, body), result in zip(fresh, results):
                if isinstance(result, Exception):
                    failed += 1
                    error = result
                elif result:
                    written += 1
                    num_bytes += len(header) + len(body)
                else:
                    existing += 1
            if error is not None:
                self._fault("write_errors", error)
                with self._lock:  # fault counted one; the counter is per page
                    self._counts["write_errors"] += failed - 1
            with self._lock:
                self._counts["pages_written"] += written
                self._counts["bytes_written"] += num_bytes
                self._counts["pages_existing"] += existing
                self._counts["stale_writes"] += len(batch) - len(fresh)
                self._inflight_bytes -= len(batch) * per_page
                self._writing = 0
                self._lock.notify_all()
            if error is not None and isinstance(error, _UNREACHABLE):
                time.sleep(min(self._backoff, _BACKOFF_MAX))


def _body_checksum(body, layout):
    """The page checksum of a value's body (pagedkv_c._checksum, the pool's layout with one page)."""
    from pagedkv_c._checksum import page_checksums

    shape = (layout.num_layers, 1, 2, layout.page_size, layout.num_kv_heads, layout.head_dim)
    pages = np.frombuffer(body, dtype=layout.dtype).reshape(shape)
    return int(page_checksums(pages, np.zeros(1, dtype=np.int32))[0])
