"""Replays of pagedkv.events over real ZeroMQ sockets with slow, stalled and vanishing peers.

A replay either delivers every batch from the requested start (or from the oldest one
buffered, which the consumer sees as a first sequence number above its request) up to
END_SEQ, or it ends without END_SEQ: with REPLAY_STOPPED_SEQ naming the first batch not
sent, or with nothing. Never a gap followed by END_SEQ.
"""
import re
import threading
import time
from pathlib import Path

import pytest

from test_events import DECODER, END_SEQ, cache_hashes, endpoints, wait_sent  # skips without pyzmq / msgspec

import zmq  # noqa: E402  (after the skip above)

from pagedkv import KVCache  # noqa: E402
from pagedkv.events import REPLAY_STOPPED_SEQ, ZmqEventPublisher, encode_events  # noqa: E402

NUM_BATCHES = 6000


def fill(publisher, cache, num_steps, first=0, small=False):
    """Publish ``num_steps`` batches of about 2.6 KB (64 pages of 4 tokens stored, as many evicted),
    or with ``small`` of about 220 bytes (4 pages of small token ids).

    6,000 of them (12 MB) are more than a loopback connection's buffers hold (4 MB for the
    sender here, the peer's receive buffer made small) with the ROUTER's 1000-message pipe:
    a peer that does not read leaves a replay of them stuck. With ``interval`` set, the
    thread drains some steps too, and a batch may hold several steps' events.
    """
    for i in range(first, first + num_steps):
        if small:
            tokens = [i, i + 1, i + 2, i + 3] * 4
        else:
            tokens = list(range(2**30 + 256 * i, 2**30 + 256 * (i + 1)))  # 5 bytes each on the wire
        cache.add_sequence(i, tokens)
        cache.append([i], [len(tokens)], token_ids=tokens)
        cache.remove_sequence(i)
        publisher.publish()


def slow_dealer(context, replay_endpoint):
    """A DEALER with receive buffers far smaller than a replay of thousands of batches."""
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.RCVHWM, 10)
    dealer.setsockopt(zmq.RCVBUF, 4096)
    dealer.connect(replay_endpoint)
    return dealer


def read_answer(dealer, timeout_ms=10_000, pause_every=0, pause=0.0):
    """Read one replay answer: (sequence numbers, how it ended: "end", "stopped" or "silent", stop payload)."""
    got = []
    while dealer.poll(timeout_ms):
        empty, seq, payload = dealer.recv_multipart()
        assert empty == b""
        if seq == END_SEQ:
            assert payload == b""
            return got, "end", None
        if seq == REPLAY_STOPPED_SEQ:
            return got, "stopped", int.from_bytes(payload, "big")
        got.append(int.from_bytes(seq, "big"))
        DECODER.decode(payload)  # a real batch
        if pause_every and len(got) % pause_every == 0:
            time.sleep(pause)
    return got, "silent", None


def check_answer(got, end, stopped_at, start):
    """The contract: contiguous from the first number on; END_SEQ only after a complete run."""
    assert got == list(range(got[0], got[0] + len(got))) if got else True, \
        f"a gap in the replayed sequence numbers: {missing(got)}, then {end!r}"
    if end == "end":
        assert not got or got[0] >= start
    elif end == "stopped":
        assert stopped_at == (got[-1] + 1 if got else start)


def missing(got):
    if not got:
        return []
    present = set(got)
    gaps = [s for s in range(got[0], got[-1] + 1) if s not in present]
    return f"{len(gaps)} missing, {gaps[0]}..{gaps[-1]}" if gaps else "none"


@pytest.mark.parametrize("small", [True, False])
def test_a_slow_reader_gets_every_batch_or_is_told_the_replay_stopped(small):
    """6,000 batches buffered; a DEALER with small buffers asks for all of them and reads only
    after a pause, then slowly. The ROUTER used to drop what did not fit in the peer's pipe:
    with batches of 220 bytes it still sent END_SEQ after the hole (1000..1202 missing), so the
    consumer took a hole for a history; with batches of 2.6 KB the tail and END_SEQ vanished."""
    endpoint, replay_endpoint = endpoints()
    cache = KVCache(0, 1, 1, 128, page_size=4, enable_prefix_caching=True, enable_kv_events=True)
    with ZmqEventPublisher(cache, endpoint, replay_endpoint=replay_endpoint, buffer_steps=NUM_BATCHES) as publisher:
        fill(publisher, cache, NUM_BATCHES, small=small)
        assert publisher.num_batches == NUM_BATCHES
        context = zmq.Context()
        dealer = slow_dealer(context, replay_endpoint)
        try:
            dealer.send_multipart([b"", (0).to_bytes(8, "big")])
            time.sleep(0.5)  # the peer reads nothing for a while
            got, end, stopped_at = read_answer(dealer, pause_every=500, pause=0.05)
        finally:
            dealer.close(linger=0)
            context.term()
        check_answer(got, end, stopped_at, 0)
        # A peer that reads within replay_timeout gets the whole history.
        assert (end, got) == ("end", list(range(NUM_BATCHES)))
        assert publisher.num_replays_stopped == 0


def test_peers_replaying_at_once_each_get_their_whole_answer_while_the_thread_drains():
    """Three peers ask at once (one of them twice, the second request queued behind the first)
    while the thread drains every 10 ms: the thread serves them in turn, and each answer is
    complete, in order, and ends with END_SEQ."""
    endpoint, replay_endpoint = endpoints()
    cache = KVCache(0, 1, 1, 128, page_size=4, enable_prefix_caching=True, enable_kv_events=True)
    with ZmqEventPublisher(cache, endpoint, replay_endpoint=replay_endpoint, buffer_steps=NUM_BATCHES,
                           interval=0.01) as publisher:
        fill(publisher, cache, 2000)
        publisher.publish()
        num = publisher.num_batches
        context = zmq.Context()
        dealers = [slow_dealer(context, replay_endpoint) for _ in range(3)]
        answers = {}

        def read(index, starts):
            answers[index] = []
            for start in starts:
                answers[index].append(read_answer(dealers[index], pause_every=300, pause=0.02))

        requests = {0: [0], 1: [10, num - 5], 2: [num // 2]}
        try:
            for index, starts in requests.items():
                for start in starts:
                    dealers[index].send_multipart([b"", start.to_bytes(8, "big")])
            readers = [threading.Thread(target=read, args=item) for item in requests.items()]
            for reader in readers:
                reader.start()
            cache.add_sequence(-1, list(range(10_000, 10_008)))  # an interval drain publishes it meanwhile
            cache.append([-1], [8], token_ids=list(range(10_000, 10_008)))
            for reader in readers:
                reader.join(60)
        finally:
            for dealer in dealers:
                dealer.close(linger=0)
            context.term()
        for index, starts in requests.items():
            assert len(answers[index]) == len(starts)
            for start, (got, end, _) in zip(starts, answers[index]):
                assert end == "end" and got == list(range(start, got[-1] + 1)) and got[-1] >= num - 1
        assert publisher.num_replays == 4 and publisher.num_replays_stopped == 0


@pytest.mark.parametrize("value, error", [(0, ValueError), (-1.0, ValueError), (float("inf"), ValueError),
                                          (float("nan"), ValueError), (True, TypeError), ("5", TypeError)])
def test_replay_timeout_must_be_finite_seconds_above_zero(value, error):
    cache = KVCache(0, 1, 1, 8, enable_prefix_caching=True, enable_kv_events=True)
    with pytest.raises(error, match="replay_timeout"):
        ZmqEventPublisher(cache, endpoints()[0], replay_timeout=value)


def wait_for(predicate, what, seconds=20):
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.01)


def test_a_peer_that_never_reads_delays_no_one_and_its_replay_ends_with_the_stop_marker(caplog):
    """While one peer's replay is stuck on its full pipe, another peer's replay completes and the
    thread goes on draining every interval; after replay_timeout the stuck replay stops, and when the
    peer reads at last it finds a contiguous run from its start and REPLAY_STOPPED_SEQ naming the
    first batch it did not get: never END_SEQ."""
    endpoint, replay_endpoint = endpoints()
    cache = KVCache(0, 1, 1, 128, page_size=4, enable_prefix_caching=True, enable_kv_events=True)
    publisher = ZmqEventPublisher(cache, endpoint, replay_endpoint=replay_endpoint, buffer_steps=10_000,
                                  replay_timeout=2.0, interval=0.02)
    context = zmq.Context()
    stuck = slow_dealer(context, replay_endpoint)
    other = context.socket(zmq.DEALER)
    other.connect(replay_endpoint)
    try:
        fill(publisher, cache, NUM_BATCHES)
        publisher.publish()
        num = publisher.num_batches  # the thread drained some steps: fewer batches than steps
        assert num > 1500
        stuck.send_multipart([b"", (0).to_bytes(8, "big")])
        time.sleep(0.2)  # the stuck peer's pipe is full by now
        other.send_multipart([b"", (num - 50).to_bytes(8, "big")])
        assert read_answer(other) == (list(range(num - 50, num)), "end", None)
        cache.add_sequence(-1, list(range(10_000, 10_008)))  # the interval drain publishes it
        cache.append([-1], [8], token_ids=list(range(10_000, 10_008)))
        wait_sent(publisher, num + 1)
        assert publisher.num_replays_stopped == 0  # the stuck peer is still within replay_timeout
        wait_for(lambda: publisher.num_replays_stopped == 1, "the stuck replay stops")
        got, end, stopped_at = read_answer(stuck, timeout_ms=3000)
        check_answer(got, end, stopped_at, 0)
        assert end == "stopped" and got[0] == 0 and 0 < stopped_at < num
        assert publisher.num_replays == 1 and "the peer took no message for 2 s" in caplog.text
        # The same peer, reading now, gets the rest.
        stuck.send_multipart([b"", stopped_at.to_bytes(8, "big")])
        rest, end, _ = read_answer(stuck)
        assert end == "end" and rest == list(range(stopped_at, num + 1))
    finally:
        stuck.close(linger=0)
        other.close(linger=0)
        context.term()
        publisher.close()


def test_close_is_prompt_while_a_peer_never_reads_and_that_peer_gets_no_end_marker():
    endpoint, replay_endpoint = endpoints()
    cache = KVCache(0, 1, 1, 128, page_size=4, enable_prefix_caching=True, enable_kv_events=True)
    publisher = ZmqEventPublisher(cache, endpoint, replay_endpoint=replay_endpoint, buffer_steps=NUM_BATCHES,
                                  replay_timeout=60.0, linger=0.1)
    context = zmq.Context()
    stuck = slow_dealer(context, replay_endpoint)
    try:
        fill(publisher, cache, NUM_BATCHES)
        wait_sent(publisher, NUM_BATCHES)
        stuck.send_multipart([b"", (0).to_bytes(8, "big")])
        time.sleep(0.3)
        closing = threading.Thread(target=publisher.close)
        closing.start()
        closing.join(30)  # a hang detector, far above the 0.1 s linger
        assert not closing.is_alive(), "close() waited for a peer that does not read"
        assert publisher.num_replays_stopped == 1
        got, end, stopped_at = read_answer(stuck, timeout_ms=1000)
        check_answer(got, end, stopped_at, 0)
        assert end in ("stopped", "silent") and got[0] == 0 and len(got) < NUM_BATCHES
    finally:
        stuck.close(linger=0)
        context.term()
        publisher.close()


def test_batches_that_leave_the_buffer_during_a_slow_replay_stop_it_instead_of_leaving_a_gap():
    endpoint, replay_endpoint = endpoints()
    cache = KVCache(0, 1, 1, 128, page_size=4, enable_prefix_caching=True, enable_kv_events=True)
    num = NUM_BATCHES
    with ZmqEventPublisher(cache, endpoint, replay_endpoint=replay_endpoint, buffer_steps=num,
                           replay_timeout=30.0) as publisher:
        fill(publisher, cache, num)
        wait_sent(publisher, num)
        context = zmq.Context()
        dealer = slow_dealer(context, replay_endpoint)
        try:
            dealer.send_multipart([b"", (0).to_bytes(8, "big")])
            time.sleep(0.3)  # the peer's pipe fills; the rest of the replay waits
            fill(publisher, cache, num, first=num)  # the batches it waits for leave the buffer
            got, end, stopped_at = read_answer(dealer)
        finally:
            dealer.close(linger=0)
            context.term()
        check_answer(got, end, stopped_at, 0)
        assert end == "stopped" and got[0] == 0 and stopped_at < num
        assert publisher.num_replays_stopped == 1 and publisher.num_replays == 0


def test_a_peer_that_disconnects_mid_replay_is_dropped_and_the_others_are_served(caplog):
    endpoint, replay_endpoint = endpoints()
    cache = KVCache(0, 1, 1, 128, page_size=4, enable_prefix_caching=True, enable_kv_events=True)
    with ZmqEventPublisher(cache, endpoint, replay_endpoint=replay_endpoint, buffer_steps=NUM_BATCHES,
                           replay_timeout=60.0) as publisher:
        fill(publisher, cache, NUM_BATCHES)
        wait_sent(publisher, NUM_BATCHES)
        context = zmq.Context()
        try:
            leaving = slow_dealer(context, replay_endpoint)
            leaving.send_multipart([b"", (0).to_bytes(8, "big")])
            assert leaving.poll(5000)
            leaving.recv_multipart()
            leaving.close(linger=0)  # mid-replay: thousands of batches still to send
            wait_for(lambda: publisher.num_replays_stopped == 1, "the replay of the peer that left stops")
            assert "the peer disconnected" in caplog.text
            staying = context.socket(zmq.DEALER)
            staying.connect(replay_endpoint)
            staying.send_multipart([b"", (0).to_bytes(8, "big")])
            assert read_answer(staying) == (list(range(NUM_BATCHES)), "end", None)
            staying.close(linger=0)
        finally:
            context.term()
        assert publisher.num_replays == 1


DOCS = Path(__file__).resolve().parents[1] / "docs" / "kv_events.md"


def documented_consumer():
    """The consumer of docs/kv_events.md, run as written: the namespace of its python block."""
    if not DOCS.is_file():
        pytest.skip("docs/kv_events.md is not beside the tests (installed-wheel run)")
    (code,) = [block for block in re.findall(r"```python\n(.*?)```", DOCS.read_text(encoding="utf-8"), flags=re.S)
               if "class InstanceView" in block]
    namespace = {}
    exec(compile(code, "docs/kv_events.md consumer", "exec"), namespace)
    assert namespace["STOPPED_SEQ"] == REPLAY_STOPPED_SEQ and namespace["END_SEQ"] == END_SEQ

    class RecordingView(namespace["InstanceView"]):
        """The documented consumer, recording the sequence numbers it applies."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.applied = []

        def apply(self, seq, payload):
            self.applied.append(seq)
            super().apply(seq, payload)

    return RecordingView


def steps(publisher, cache, first, num):
    """``num`` batches that store and evict pages (a 32-page cache, 12 tokens a step in pages of 2)."""
    for i in range(first, first + num):
        tokens = [3 * i, 3 * i + 1, 3 * i + 2] * 4
        cache.add_sequence(i, tokens)
        cache.append([i], [len(tokens)], token_ids=tokens)
        cache.remove_sequence(i)
        assert publisher.publish() >= 1


def consume(view):
    while view.sub.poll(500):
        _, seq, payload = view.sub.recv_multipart()
        view.on_message(seq, payload)


@pytest.mark.parametrize("buffer_steps", [1000, 10])
def test_the_documented_consumer_replays_a_late_start_or_resyncs_when_history_is_gone(buffer_steps):
    InstanceView = documented_consumer()
    endpoint, replay_endpoint = endpoints()
    cache = KVCache(0, 1, 1, 32, page_size=2, enable_prefix_caching=True, enable_kv_events=True)
    context = zmq.Context()
    with ZmqEventPublisher(cache, endpoint, replay_endpoint=replay_endpoint, buffer_steps=buffer_steps) as publisher:
        steps(publisher, cache, 0, 30)  # before the consumer exists
        view = InstanceView(context, endpoint, replay_endpoint, timeout_ms=5000)
        try:
            time.sleep(0.3)  # the subscription reaches the PUB socket
            steps(publisher, cache, 30, 5)
            consume(view)
        finally:
            view.sub.close(linger=0)
    context.term()
    assert view.expected == publisher.num_batches == 35
    truth = cache_hashes(cache)
    if buffer_steps == 1000:  # the replay from 0 brought the whole history
        assert view.resyncs == 0 and view.cached == truth and view.applied == list(range(35))
    else:  # batches 0..24 left the buffer: the view starts over from the live stream
        assert view.resyncs == 1 and view.cached < truth  # misses pages, never invents one
        assert view.applied == list(range(view.applied[0], 35)) and view.applied[0] >= 30


def test_the_documented_consumer_asks_again_after_a_stopped_or_gapped_replay():
    """A replay server written for the test answers: 0, 1, then REPLAY_STOPPED_SEQ; then 2 and
    4 with 3 missing, then END_SEQ (what vLLM's ROUTER sends when it drops a message); then 3,
    4, END_SEQ. The consumer applies each batch once, in order, and never takes the answer
    with a hole for a complete one."""
    InstanceView = documented_consumer()
    cache = KVCache(0, 1, 1, 32, page_size=2, enable_prefix_caching=True, enable_kv_events=True)
    payloads = []
    for i in range(6):
        tokens = [3 * i, 3 * i + 1, 3 * i + 2] * 4
        cache.add_sequence(i, tokens)
        cache.append([i], [len(tokens)], token_ids=tokens)
        cache.remove_sequence(i)
        payloads.append(encode_events(cache.take_kv_events()[0]))
    seq = [s.to_bytes(8, "big") for s in range(6)]
    script = [(0, [(seq[0], payloads[0]), (seq[1], payloads[1]), (REPLAY_STOPPED_SEQ, seq[2])]),
              (2, [(seq[2], payloads[2]), (seq[4], payloads[4]), (END_SEQ, b"")]),
              (3, [(seq[3], payloads[3]), (seq[4], payloads[4]), (END_SEQ, b"")])]
    endpoint, replay_endpoint = endpoints()
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    router.bind(replay_endpoint)
    requests = []

    def serve():
        for start, answer in script:
            if not router.poll(10_000):
                return
            identity, empty, request = router.recv_multipart()
            requests.append(int.from_bytes(request, "big"))
            for frames in answer:
                router.send_multipart([identity, empty, *frames])

    server = threading.Thread(target=serve)
    server.start()
    view = InstanceView(context, endpoint, replay_endpoint, timeout_ms=5000)
    try:
        view.on_message(seq[5], payloads[5])  # the live stream's first message: 0..4 missed
    finally:
        server.join()
        view.sub.close(linger=0)
        router.close(linger=0)
        context.term()
    assert requests == [start for start, _ in script]
    assert view.expected == 6 and view.resyncs == 0 and view.applied == [0, 1, 2, 3, 4, 5]
    assert view.cached == cache_hashes(cache)
