"""Replays of pagedkv.events over real ZeroMQ sockets with slow, stalled and vanishing peers.

A replay either delivers every batch from the requested start (or from the oldest one
buffered, which the consumer sees as a first sequence number above its request) up to
END_SEQ, or it ends without END_SEQ: with REPLAY_STOPPED_SEQ naming the first batch not
sent, or with nothing. Never a gap followed by END_SEQ.
"""
import threading
import time

import pytest

from test_events import DECODER, END_SEQ, cache_hashes, endpoints, wait_sent  # skips without pyzmq / msgspec

import zmq  # noqa: E402  (after the skip above)

from pagedkv import KVCache  # noqa: E402
from pagedkv.events import REPLAY_STOPPED_SEQ, ZmqEventPublisher  # noqa: E402

NUM_BATCHES = 6000


def fill(publisher, cache, num_batches, first=0):
    """Publish ``num_batches`` batches of one BlockStored each (16 tokens in pages of 4)."""
    for i in range(first, first + num_batches):
        tokens = [i, i + 1, i + 2, i + 3] * 4
        cache.add_sequence(i, tokens)
        cache.append([i], [len(tokens)], token_ids=tokens)
        cache.remove_sequence(i)
        assert publisher.publish() >= 1


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
        f"a gap in the replayed sequence numbers: {missing(got)}"
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


def test_a_slow_reader_gets_every_batch_or_is_told_the_replay_stopped():
    """6,000 batches buffered; a DEALER with small buffers asks for all of them and reads only
    after a pause, then slowly. The ROUTER used to drop what did not fit in the peer's pipe and
    still send END_SEQ (e.g. 1000..5999 missing): the consumer took a hole for a history."""
    endpoint, replay_endpoint = endpoints()
    cache = KVCache(0, 1, 1, 256, page_size=4, enable_prefix_caching=True, enable_kv_events=True)
    with ZmqEventPublisher(cache, endpoint, replay_endpoint=replay_endpoint, buffer_steps=NUM_BATCHES) as publisher:
        fill(publisher, cache, NUM_BATCHES)
        wait_sent(publisher, NUM_BATCHES)
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
