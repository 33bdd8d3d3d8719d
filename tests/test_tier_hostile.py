"""pagedkv.tiers.RedisTier against a store that misbehaves: a hostile RESP server written here (a real
TCP server on loopback) and values overwritten under a prompt's real keys in a real redis-server.

Whatever the store answers, a fetch costs at most ``timeout_seconds`` (one deadline for the round
trip), at most the memory of the page values it asked for, and the sequence is still added: the
pages from the first bad one on are misses, counted by kind, and computed by the caller.
"""
import os
import select
import socket
import threading
import time
import tracemalloc

import _tier_worker as worker
import pytest

# test_tier skips (or, with PAGEDKV_REQUIRE_REDIS=1, fails) when redis-py or redis-server is missing.
from test_tier import _prompt_keys, fresh_cache, namespace, offload_prompt, standalone  # noqa: F401

from pagedkv import KVCache
from pagedkv.tiers import RedisTier

redis = pytest.importorskip("redis", reason="pagedkv.tiers needs redis-py: pip install \"pagedkv[redis]\"")

# Bytes of one page value of worker.LAYOUT (header, 16 token ids, 3 layers of K and V in float32).
VALUE_BYTES = 64 + 4 * 16 + 3 * 2 * 16 * 2 * 8 * 4
BIG = 32 * 2**20
HUGE = 1_500_000_000
# Memory a fetch of a 100-token prompt may take at its peak: its six page values and redis-py's
# connection, with room to spare; a value read in full would be 32 MiB or more.
MEMORY_BOUND = 4 * 2**20


class HostileRedis:
    """A RESP server on 127.0.0.1, one thread per connection.

    It answers the handshake redis-py sends (HELLO is refused, so the client stays on RESP2;
    PING gets PONG; CLIENT SETINFO, SELECT and the rest get OK), keeps what ``SET key value
    [NX] [EX s]`` stores, and answers ``GET`` and ``GETRANGE`` of the keys in ``bad_keys`` as
    ``mode`` says (other keys, and every key in mode ``"good"``, as Redis would):

    ``huge``          ``$1500000000\\r\\n`` and nothing more
    ``garbage``       a bulk of ``garbage_bytes`` random bytes (not a page value's length)
    ``drip``          the right length, then the value one byte every ``drip_seconds``
    ``stall``         nothing at all
    ``stall_writes``  (``SET``) no reply

    A connection that holds, drips or stalls is closed by the server ``hang_up_after`` seconds
    after the reply began (so that a client that would wait forever gets an end), or as soon as
    the client closes it. ``accepted`` counts the connections taken.
    """

    def __init__(self):
        self.store = {}
        self.mode = "good"
        self.bad_keys = set()
        self.garbage_bytes = 1000
        self.drip_seconds = 0.1
        self.hang_up_after = 8.0
        self.accepted = 0
        self._payload = os.urandom(BIG)  # made once, outside any measured region
        self._closed = False
        self._conns = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.1)
        self.port = self._listener.getsockname()[1]
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def close(self):
        self._closed = True
        self._thread.join()
        self._listener.close()
        for conn in self._conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _accept(self):
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            self.accepted += 1
            self._conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn):
        buf = bytearray()
        try:
            while not self._closed:
                parsed = _parse_command(buf)
                if parsed is None:
                    data = conn.recv(65536)
                    if not data:
                        return
                    buf += data
                    continue
                args, used = parsed
                del buf[:used]
                if not self._answer(conn, args):
                    return
        except OSError:
            pass
        finally:
            conn.close()

    def _answer(self, conn, args):
        """Send the reply to one command; False when the connection is to be closed."""
        name = args[0].upper()
        if name == b"HELLO":
            conn.sendall(b"-ERR unknown command 'HELLO'\r\n")
        elif name == b"PING":
            conn.sendall(b"+PONG\r\n")
        elif name == b"SET":
            if self.mode == "stall_writes":
                return self._hold(conn, time.monotonic())
            key, value = args[1], args[2]
            if b"NX" in (a.upper() for a in args[3:]) and key in self.store:
                conn.sendall(b"$-1\r\n")
            else:
                self.store[key] = value
                conn.sendall(b"+OK\r\n")
        elif name in (b"GET", b"GETRANGE"):
            key = args[1]
            value = self.store.get(key)
            if self.mode != "good" and key in self.bad_keys:
                return self._hostile(conn, value)
            if name == b"GETRANGE":
                value = (value or b"")[int(args[2]):int(args[3]) + 1]
            conn.sendall(b"$-1\r\n" if value is None else b"$%d\r\n%s\r\n" % (len(value), value))
        else:
            conn.sendall(b"+OK\r\n")
        return True

    def _hostile(self, conn, value):
        start = time.monotonic()
        if self.mode == "huge":
            conn.sendall(b"$%d\r\n" % HUGE)
            return self._hold(conn, start)
        if self.mode == "garbage":
            size = self.garbage_bytes
            conn.sendall(b"$%d\r\n" % size)
            conn.sendall(memoryview(self._payload)[:size])
            conn.sendall(b"\r\n")
            return True
        if self.mode == "drip":
            conn.sendall(b"$%d\r\n" % len(value))
            for i in range(len(value)):
                if not self._hold(conn, start, self.drip_seconds):
                    return False
                conn.sendall(value[i:i + 1])
            conn.sendall(b"\r\n")
            return True
        assert self.mode == "stall", self.mode
        return self._hold(conn, start)

    def _hold(self, conn, start, seconds=None):
        """Wait ``seconds`` (None: until the hang-up), reading what the client sends; False when
        the client closed the connection or the hang-up time came."""
        until = start + self.hang_up_after if seconds is None else min(time.monotonic() + seconds,
                                                                     start + self.hang_up_after)
        while not self._closed:
            left = until - time.monotonic()
            if left <= 0:
                return seconds is not None and time.monotonic() < start + self.hang_up_after
            readable, _, _ = select.select([conn], [], [], min(left, 0.05))
            if readable and not conn.recv(65536):
                return False
        return False


def _parse_command(buf):
    """``(args, bytes used)`` of the first complete RESP array of bulk strings in ``buf``, or None."""
    end = buf.find(b"\r\n")
    if end < 0:
        return None
    assert buf[:1] == b"*", bytes(buf[:32])
    pos, args = end + 2, []
    for _ in range(int(buf[1:end])):
        end = buf.find(b"\r\n", pos)
        if end < 0:
            return None
        start = end + 2
        length = int(buf[pos + 1:end])
        if len(buf) < start + length + 2:
            return None
        args.append(bytes(buf[start:start + length]))
        pos = start + length + 2
    return args, pos


@pytest.fixture
def hostile():
    server = HostileRedis()
    yield server
    server.close()


def measured(call):
    """``(result, seconds, peak bytes allocated)`` of ``call()``; memory as tracemalloc sees it."""
    tracemalloc.start()
    tracemalloc.reset_peak()
    start = time.monotonic()
    try:
        result = call()
    finally:
        seconds = time.monotonic() - start
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return result, seconds, peak


@pytest.fixture
def parser_path(request, monkeypatch):
    """Parametrised: the tier reads replies from the connection's socket itself, or (``"parser"``)
    through the client's parser, as for a connection without a socket of its own."""
    if request.param == "parser":
        import pagedkv.tiers.redis as redis_tier

        monkeypatch.setattr(redis_tier, "_raw_socket", lambda conn: None)
    return request.param


# ------------------------------------------------------------------ a hostile server
@pytest.mark.parametrize("parser_path, mode, garbage_bytes, counter, reconnects", [
    ("socket", "huge", 0, "rejected_truncated", 1),        # the reply announces 1.5 GB and sends nothing more
    ("socket", "garbage", BIG, "rejected_truncated", 1),   # 32 MiB of garbage: too long to read through
    ("socket", "garbage", 1000, "rejected_truncated", 0),  # 1000 bytes of garbage: read, thrown away
    ("socket", "drip", 0, "fetch_timeouts", 1),            # a byte every 0.1 s
    ("socket", "stall", 0, "fetch_timeouts", 1),           # no reply
    # The client's parser waits for the whole announced value: the deadline ends the wait.
    ("parser", "huge", 0, "fetch_timeouts", 1),
    ("parser", "garbage", 1000, "rejected_truncated", 0),
    ("parser", "drip", 0, "fetch_timeouts", 1),
    ("parser", "stall", 0, "fetch_timeouts", 1)], indirect=["parser_path"])
def test_a_hostile_server_costs_one_deadline_and_no_memory(hostile, parser_path, mode, garbage_bytes, counter,
                                                           reconnects):
    """The third page's reply is hostile: the first two pages are served, the sequence is added
    (the rest is computed), within the deadline and without memory in proportion to what the
    server announces or sends; the counters say why; a connection left out of step is closed
    and the next fetch, from a good server, opens a new one and gets every page."""
    ns = namespace()
    prompt = worker.make_prompt(40, 100)
    offload_prompt(hostile.url, ns, prompt)
    timeout = 1.0
    cache, tier = fresh_cache(hostile.url, ns, {"timeout_seconds": timeout})
    hostile.mode, hostile.garbage_bytes = mode, garbage_bytes
    hostile.bad_keys = set(_prompt_keys(tier, prompt)[2:])
    before = hostile.accepted
    served, seconds, peak = measured(lambda: cache.add_sequence(0, prompt))
    assert seconds < 3 * timeout, f"the fetch took {seconds:.1f} s with timeout_seconds={timeout}"
    assert peak < MEMORY_BOUND, f"the fetch allocated {peak / 2**20:.1f} MiB"
    assert served == 32 and worker.served_rows_are_right(cache, 0, prompt)
    stats = tier.stats()
    assert stats[counter] == 1 and stats["hit_pages"] == 2, stats
    assert stats["connections_closed"] == reconnects, stats
    worker.fill(cache, 0, prompt, served)  # the caller computes the rest
    cache.check_invariants()
    hostile.mode = "good"
    time.sleep(0.3)  # after a timeout the store is taken as down for 0.25 s
    again = KVCache(num_pages=64, enable_prefix_caching=True, tier=tier, **worker.LAYOUT)
    assert again.add_sequence(0, prompt) == 96 and worker.served_rows_are_right(again, 0, prompt)
    assert hostile.accepted - before == 1 + reconnects  # the first fetch's connection, then one per close


@pytest.mark.parametrize("parser_path", ["socket", "parser"], indirect=True)
def test_the_deadline_holds_for_a_ready_client_without_timeouts(hostile, parser_path):
    """A ready client made without socket timeouts: a stalled fetch still ends at timeout_seconds, and a
    stalled write batch ends too (its pages are counted as write errors) instead of holding the writer."""
    ns = namespace()
    prompt = worker.make_prompt(41, 100)
    offload_prompt(hostile.url, ns, prompt)
    timeout = 0.5
    tier = RedisTier(redis.Redis.from_url(hostile.url), namespace=ns, timeout_seconds=timeout)
    cache = KVCache(num_pages=64, enable_prefix_caching=True, tier=tier, **worker.LAYOUT)
    hostile.mode, hostile.bad_keys = "stall", set(_prompt_keys(tier, prompt)[1:])
    start = time.monotonic()
    served = cache.add_sequence(0, prompt)
    assert time.monotonic() - start < 3 * timeout
    assert served == 16
    assert tier.stats()["fetch_timeouts"] == 1
    time.sleep(0.3)  # after a timeout the store is taken as down for 0.25 s: writes would be skipped
    hostile.mode = "stall_writes"
    other = worker.make_prompt(42, 40)
    cache.add_sequence(1, other)
    worker.fill(cache, 1, other, 0)
    start = time.monotonic()
    cache.remove_sequence(1)  # seals two pages: the writer sends them
    assert tier.flush(timeout=3 * timeout), "the writer waits on a server that never answers"
    assert time.monotonic() - start < 3 * timeout
    stats = tier.stats()
    assert stats["write_errors"] == 2 and stats["pages_written"] == 0 and stats["unreachable_skips"] == 0, stats
    tier.close()


# ------------------------------------------------------------------ real redis-server, values overwritten
@pytest.mark.parametrize("parser_path, size, closes", [
    ("socket", BIG, 1), ("socket", 1000, 0), ("socket", VALUE_BYTES + 1, 0),
    # Through the parser the tier asks for at most one byte more than a page value (GETRANGE).
    ("parser", BIG, 0), ("parser", 1000, 0), ("parser", VALUE_BYTES + 1, 0)], indirect=["parser_path"])
def test_values_overwritten_with_garbage_of_another_length(standalone, parser_path, size, closes):  # noqa: F811
    """Three of a prompt's keys from the third page on overwritten by a plain client with random bytes
    of another length than a page value's (1 byte, then half of ``size``, then ``size``: 32 MiB,
    1000 bytes, one byte more than a page value). The first two pages are served; the fetch never
    holds the garbage (memory far below one value of it); a value too long to be thrown away
    closes the connection; repaired, the values are served through the same tier."""
    ns = namespace()
    prompt = worker.make_prompt(43, 100)
    offload_prompt(standalone, ns, prompt)
    cache, tier = fresh_cache(standalone, ns)
    client = redis.Redis.from_url(standalone)
    keys = _prompt_keys(tier, prompt)
    originals = [client.get(key) for key in keys]
    assert all(len(value) == VALUE_BYTES for value in originals)
    garbage = os.urandom(size)
    for key, length in zip(keys[2:5], (1, size // 2, size)):  # 48 MiB at most in the server
        client.set(key, garbage[:length])
    try:
        served, _, peak = measured(lambda: cache.add_sequence(0, prompt))
        assert served == 32 and worker.served_rows_are_right(cache, 0, prompt)
        assert peak < MEMORY_BOUND, f"the fetch allocated {peak / 2**20:.1f} MiB"
        stats = tier.stats()
        assert stats["rejected_truncated"] == 1 and stats["fetch_errors"] == 0, stats
        assert stats["connections_closed"] == closes, stats
    finally:
        for key, value in zip(keys, originals):
            client.set(key, value)
    again = KVCache(num_pages=64, enable_prefix_caching=True, tier=tier, **worker.LAYOUT)
    assert again.add_sequence(0, prompt) == 96 and worker.served_rows_are_right(again, 0, prompt)
    assert tier.stats()["connections_closed"] == closes
