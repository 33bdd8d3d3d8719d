"""pagedkv.events over a real ZeroMQ SUB socket on loopback, decoded as a vLLM consumer would.

The msgspec structs below are written from vLLM's documented KVEventBatch schema
(vllm/distributed/kv_events.py, vLLM 0.26: the outer batch an array, each event a map
tagged by "type"), not imported from pagedkv. They forbid unknown fields, and every field
without a default must be present. The tests skip, saying why, without pyzmq or msgspec;
with ``PAGEDKV_REQUIRE_EVENTS=1`` (CI) a missing package is a failure instead.
"""
import importlib.util
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

REQUIRED = os.environ.get("PAGEDKV_REQUIRE_EVENTS") == "1"
_MISSING = [name for name in ("zmq", "msgspec") if importlib.util.find_spec(name) is None]
if _MISSING:
    if REQUIRED:
        raise ImportError(f"PAGEDKV_REQUIRE_EVENTS=1 but {_MISSING} are not installed")
    pytest.skip(f"{_MISSING} not installed (pip install 'pagedkv[events]')", allow_module_level=True)

import msgspec  # noqa: E402
import zmq  # noqa: E402

from pagedkv import KVCache  # noqa: E402
from pagedkv.events import END_SEQ, ZmqEventPublisher, encode_events  # noqa: E402
from pagedkv.replay import replay  # noqa: E402
from pagedkv.traces import load_trace  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
MASK64 = 2**64 - 1
Hash = int | bytes


# vLLM's KVEventBatch, from its documented schema.
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, forbid_unknown_fields=True):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True, forbid_unknown_fields=True):
    """Base of the events: a map whose "type" key holds the class name."""


class BlockStored(KVCacheEvent):
    block_hashes: list[Hash]
    parent_block_hash: Hash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[Hash]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


DECODER = msgspec.msgpack.Decoder(KVEventBatch)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def endpoints():
    return f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"


class Subscriber:
    """A vLLM-style consumer: SUB socket for the stream, DEALER for replays of missed batches."""

    def __init__(self, endpoint, replay_endpoint=None, topic=b""):
        self.context = zmq.Context()
        self.sub = self.context.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic)
        self.sub.connect(endpoint)
        self.replay = None
        if replay_endpoint is not None:
            self.replay = self.context.socket(zmq.DEALER)
            self.replay.connect(replay_endpoint)
        self.batches = {}  # sequence number -> KVEventBatch
        self.bytes = 0

    def receive(self, timeout_ms=300):
        """Read the stream until it has been quiet for ``timeout_ms``."""
        while self.sub.poll(timeout_ms):
            topic, seq, payload = self.sub.recv_multipart()
            self.bytes += len(topic) + len(seq) + len(payload)
            self.batches[int.from_bytes(seq, "big")] = DECODER.decode(payload)

    def request_replay(self, start):
        """Ask for every buffered batch from ``start`` on; return their sequence numbers (END_SEQ ends)."""
        self.replay.send_multipart([b"", start.to_bytes(8, "big")])
        got = []
        while True:
            assert self.replay.poll(5000), "no answer from the replay socket"
            empty, seq, payload = self.replay.recv_multipart()
            assert empty == b""
            if seq == END_SEQ:
                assert payload == b""
                return got
            got.append(int.from_bytes(seq, "big"))
            self.batches[got[-1]] = DECODER.decode(payload)

    def complete(self, num_batches):
        """Make sure batches 0 .. num_batches - 1 arrived (replaying what the stream lost)."""
        self.receive()
        missing = [s for s in range(num_batches) if s not in self.batches]
        if missing:
            self.request_replay(missing[0])
        assert sorted(self.batches) == list(range(num_batches))

    def close(self):
        self.sub.close(linger=0)
        if self.replay is not None:
            self.replay.close(linger=0)
        self.context.term()


def rebuild(batches, hash_format="int"):
    """The set of hashes the BlockStored / BlockRemoved stream leaves, applied in sequence order."""
    state = set()
    for seq in sorted(batches):
        for event in batches[seq].events:
            if isinstance(event, BlockStored):
                assert event.block_size > 0 and event.lora_id is None and event.group_idx == 0
                for h in event.block_hashes:
                    assert isinstance(h, int if hash_format == "int" else bytes)
                    assert h not in state
                    state.add(h)
            elif isinstance(event, BlockRemoved):
                for h in event.block_hashes:
                    state.remove(h)
            else:
                state.clear()
    return state


def cache_hashes(cache, hash_format="int"):
    """The hashes the cache reports, in the wire form."""
    index = cache.prefix_index
    full = [index.page_hash(int(p)) for p in index.cached_pages()]
    if hash_format == "int":
        return {h & MASK64 for h in full}
    return {h.to_bytes(16, "big") for h in full}


def wait_sent(publisher, num_batches):
    deadline = time.monotonic() + 20
    while publisher.num_batches < num_batches:
        assert time.monotonic() < deadline, "the publisher thread did not send its batches"
        time.sleep(0.01)


def test_batches_decode_with_vllm_structs_and_match_the_cache_tuples():
    endpoint, _ = endpoints()
    cache = KVCache(0, 1, 1, 16, page_size=2, window=6, enable_prefix_caching=True, enable_kv_events=True)
    with ZmqEventPublisher(cache, endpoint, topic="kv-events", data_parallel_rank=3) as publisher:
        subscriber = Subscriber(endpoint, topic=b"kv-events")
        time.sleep(0.3)  # the subscription reaches the PUB socket
        try:
            cache.add_sequence(0, [5, 6, 7, 8, 9])
            cache.append([0], [5], token_ids=[5, 6, 7, 8, 9])
            assert publisher.publish() == 1
            assert publisher.publish() == 0  # nothing pending: no batch
            wait_sent(publisher, 1)
            subscriber.receive()
        finally:
            subscriber.close()
    batch = subscriber.batches[0]
    assert batch.data_parallel_rank == 3 and abs(batch.ts - time.time()) < 60
    (stored,) = batch.events
    full = cache.prefix_index.page_hash(int(cache.page_table([0]).indices[0]))
    assert stored.block_hashes[0] == full & MASK64
    assert stored.parent_block_hash is None and stored.token_ids == [5, 6, 7, 8]
    assert stored.medium == "CPU" and stored.kv_cache_spec_kind == "sliding_window"
    assert stored.kv_cache_spec_sliding_window == 6 and stored.extra_keys is None
    assert publisher.num_batches == 1 and publisher.num_events == 1 and publisher.closed


def test_encode_events_full_attention_bytes_hashes_and_removals():
    cache = KVCache(0, 1, 1, 2, page_size=2, enable_prefix_caching=True, enable_kv_events=True)
    cache.add_sequence(0, [1, 2, 3])
    cache.append([0], [3], token_ids=[1, 2, 3])
    cache.remove_sequence(0)
    cache.add_sequence(1, [4, 5, 6, 7])
    cache.append([1], [4], token_ids=[4, 5, 6, 7])
    cache.remove_sequence(1)
    assert cache.reset_prefix_cache()
    events, dropped = cache.take_kv_events()
    tuples = events.tolist()
    batch = DECODER.decode(encode_events(events, ts=12.5, hash_format="bytes", medium="GPU"))
    assert batch.ts == 12.5 and batch.data_parallel_rank == 0 and dropped == 0
    assert [type(e).__name__ for e in batch.events] == [t[0] for t in tuples]
    assert [type(e).__name__ for e in batch.events] == ["BlockStored", "BlockRemoved", "BlockStored",
                                                         "AllBlocksCleared"]
    for event, expected in zip(batch.events, tuples):
        if expected[0] != "AllBlocksCleared":
            assert event.block_hashes == [h.to_bytes(16, "big") for h in expected[1]]
            assert event.medium == "GPU"
        if expected[0] == "BlockStored":
            assert event.token_ids == expected[3] and event.block_size == 2
            assert event.kv_cache_spec_kind == "full_attention" and event.kv_cache_spec_sliding_window is None
    # The raw map carries every required key and no sliding-window key without a window.
    raw = msgspec.msgpack.decode(encode_events(events))
    assert set(raw[1][0]) == {"type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                              "medium", "lora_name", "group_idx", "kv_cache_spec_kind"}
    with pytest.raises(ValueError, match="hash_format"):
        encode_events(events, hash_format="hex")
    with pytest.raises(TypeError, match="events"):
        encode_events(tuples)


def reference_payload(tuples, ts, rank, window, medium, hash_format):
    """The KVEventBatch of drained events, encoded by msgspec from vLLM's field list.

    ``tuples`` are ``KVEvents.tolist()``, whose hashes and token ids tests/test_kv_events.py
    checks against the cache's prefix index and an XXH3 reference.
    """
    def wire(h):
        return h & MASK64 if hash_format == "int" else h.to_bytes(16, "big")

    events = []
    for t in tuples:
        if t[0] == "BlockStored":
            event = {"type": "BlockStored", "block_hashes": [wire(h) for h in t[1]],
                     "parent_block_hash": None if t[2] is None else wire(t[2]), "token_ids": t[3],
                     "block_size": t[4], "lora_id": None, "medium": medium, "lora_name": None, "group_idx": 0,
                     "kv_cache_spec_kind": "full_attention" if window is None else "sliding_window"}
            if window is not None:
                event["kv_cache_spec_sliding_window"] = window
        elif t[0] == "BlockRemoved":
            event = {"type": "BlockRemoved", "block_hashes": [wire(h) for h in t[1]], "medium": medium,
                     "group_idx": 0}
        else:
            event = {"type": "AllBlocksCleared"}
        events.append(event)
    return msgspec.msgpack.encode([ts, events, rank])


@pytest.mark.parametrize("window,hash_format,capacity", [(None, "int", 2**20), (None, "bytes", 5),
                                                         (12, "int", 3), (40, "bytes", 2**20)])
def test_encoding_is_byte_identical_to_msgspec_on_a_random_run(window, hash_format, capacity):
    """Every drained batch, full or cut short by the log's bound, equals msgspec's encoding."""
    rng = np.random.default_rng(capacity + (window or 0))
    cache = KVCache(0, 1, 1, 96, page_size=4, window=window, enable_prefix_caching=True, enable_kv_events=True,
                    kv_events_capacity=capacity)
    prompts = [rng.integers(0, 3, size=80).tolist() for _ in range(4)]
    live, counts = [], {"batches": 0, "events": 0, "dropped": 0, "big": 0}
    for step in range(600):
        if len(live) >= 3 or (live and rng.random() < 0.3):
            cache.remove_sequence(live.pop(int(rng.integers(len(live)))))
        if step == 300:
            for seq in live:
                cache.remove_sequence(seq)
            live.clear()
            assert cache.reset_prefix_cache()
        prompt = prompts[rng.integers(len(prompts))][:int(rng.integers(2, 80))]
        prompt = prompt + rng.integers(0, 3, size=int(rng.integers(0, 9))).tolist()
        cached = cache.add_sequence(step, prompt)
        cache.append([step], [len(prompt) - cached], token_ids=prompt[cached:])
        live.append(step)
        if step % 11 == 0 or step == 599:
            events, dropped = cache.take_kv_events()
            ts = 1.5e9 + step / 7
            payload = encode_events(events, ts=ts, data_parallel_rank=step % 3, window=window, medium="CPU",
                                    hash_format=hash_format)
            tuples = events.tolist()
            assert payload == reference_payload(tuples, ts, step % 3, window, "CPU", hash_format)
            batch = DECODER.decode(payload)  # vLLM's structs accept it
            assert len(batch.events) == len(events) == len(tuples)
            counts["batches"] += 1
            counts["events"] += len(events)
            counts["dropped"] += dropped
            counts["big"] += any(len(t) > 1 and len(t[1]) >= 16 for t in tuples)  # array16 headers
    assert counts["events"] > 50 and (counts["dropped"] > 0) == (capacity < 100)
    assert capacity < 100 or counts["big"] > 0


@pytest.mark.parametrize("hash_format", ["int", "bytes"])
def test_stream_rebuilds_cached_hashes_after_a_long_random_run(hash_format):
    endpoint, replay_endpoint = endpoints()
    rng = np.random.default_rng(5)
    cache = KVCache(0, 1, 1, 64, page_size=4, enable_prefix_caching=True, enable_kv_events=True)
    prompts = [rng.integers(0, 4, size=40).tolist() for _ in range(6)]
    publisher = ZmqEventPublisher(cache, endpoint, replay_endpoint=replay_endpoint, hash_format=hash_format)
    subscriber = Subscriber(endpoint, replay_endpoint)
    try:
        live, batches = [], 0
        for step in range(1200):
            if len(live) >= 3 or (live and rng.random() < 0.3):
                cache.remove_sequence(live.pop(int(rng.integers(len(live)))))
            prompt = prompts[rng.integers(len(prompts))][:int(rng.integers(2, 40))]
            prompt = prompt + rng.integers(0, 4, size=int(rng.integers(0, 9))).tolist()
            cached = cache.add_sequence(step, prompt)
            cache.append([step], [len(prompt) - cached], token_ids=prompt[cached:])
            live.append(step)
            if step % 7 == 0:
                batches += publisher.publish() > 0
        for seq in live:
            cache.remove_sequence(seq)
        batches += publisher.publish() > 0
        assert batches == publisher.num_batches
        wait_sent(publisher, batches)
        subscriber.complete(batches)  # the first batches may precede the subscription: replayed
        assert rebuild(subscriber.batches, hash_format) == cache_hashes(cache, hash_format)
        assert cache.stats()["prefix_evictions"] > 100 and publisher.num_dropped == 0
    finally:
        subscriber.close()
        publisher.close()


def mooncake_path():
    for base in [REPO_ROOT.parent, *REPO_ROOT.parent.parents]:
        candidate = base / "shared" / "data" / "mooncake_conversation_trace.jsonl"
        if candidate.is_file():
            return candidate
    pytest.skip(f"mooncake_conversation_trace.jsonl not found in {REPO_ROOT.parent / 'shared' / 'data'}")


def test_stream_rebuilds_cached_hashes_after_a_mooncake_replay():
    trace = load_trace(mooncake_path(), limit=300)
    endpoint, replay_endpoint = endpoints()
    subscriber = Subscriber(endpoint, replay_endpoint)
    publishers = []

    def attach(cache):
        publishers.append(ZmqEventPublisher(cache, endpoint, replay_endpoint=replay_endpoint))
        return publishers[0].publish

    try:
        result = replay(trace, 400_000, kv_events=attach, keep_cache=True)
        publisher = publishers[0]
        publisher.publish()
        num_batches = publisher.num_batches
        wait_sent(publisher, num_batches)
        subscriber.complete(num_batches)
        assert result.prefix_evictions > 0
        assert rebuild(subscriber.batches) == cache_hashes(result.cache)
        assert len(cache_hashes(result.cache)) == result.prefix_cached_pages
        assert subscriber.bytes <= publisher.num_bytes  # the live stream (what came before the subscription was replayed)
    finally:
        subscriber.close()
        for publisher in publishers:
            publisher.close()


def test_replay_from_a_sequence_number_returns_the_missed_batches_and_the_end_marker():
    endpoint, replay_endpoint = endpoints()
    cache = KVCache(0, 1, 1, 64, page_size=2, enable_prefix_caching=True, enable_kv_events=True)
    with ZmqEventPublisher(cache, endpoint, replay_endpoint=replay_endpoint, buffer_steps=4) as publisher:
        for i in range(6):  # six batches before anyone listens; the buffer keeps the last four
            cache.add_sequence(i, [i, i, 9])
            cache.append([i], [3], token_ids=[i, i, 9])
            cache.remove_sequence(i)
            assert publisher.publish() == 1
        wait_sent(publisher, 6)
        late = Subscriber(endpoint, replay_endpoint)
        try:
            assert late.request_replay(3) == [3, 4, 5]
            assert late.request_replay(0) == [2, 3, 4, 5]  # 0 and 1 left the buffer
            assert late.request_replay(6) == []
            assert [e.token_ids for e in late.batches[3].events] == [[3, 3]]
            # A REQ-style request (identity, empty frame, sequence) is answered too.
            req = late.context.socket(zmq.REQ)
            req.connect(replay_endpoint)
            req.send((5).to_bytes(8, "big"))
            assert req.poll(5000)
            seq, payload = req.recv_multipart()
            assert int.from_bytes(seq, "big") == 5 and DECODER.decode(payload).events
            req.close(linger=0)
        finally:
            late.close()


def test_overflow_is_counted_by_the_publisher(caplog):
    cache = KVCache(0, 1, 1, 64, page_size=1, enable_prefix_caching=True, enable_kv_events=True,
                    kv_events_capacity=3)
    endpoint, _ = endpoints()
    with ZmqEventPublisher(cache, endpoint) as publisher:
        cache.add_sequence(0, list(range(10)))
        cache.append([0], [10], token_ids=list(range(10)))
        assert publisher.publish() == 1  # one BlockStored of the three pages kept
        assert publisher.num_dropped == 7
    assert "7 events were dropped" in caplog.text
    assert cache.stats()["kv_events_dropped"] == 7


def test_bind_failure_names_the_endpoint_and_a_closed_publisher_refuses():
    cache = KVCache(0, 1, 1, 8, enable_prefix_caching=True, enable_kv_events=True)
    endpoint, _ = endpoints()
    first = ZmqEventPublisher(cache, endpoint)
    try:
        with pytest.raises(OSError, match=endpoint.replace(".", r"\.")):
            ZmqEventPublisher(cache, endpoint)
        with pytest.raises(OSError, match="'nonsense'"):
            ZmqEventPublisher(cache, "nonsense")
        with pytest.raises(OSError, match="replay_endpoint"):
            ZmqEventPublisher(cache, endpoints()[0], replay_endpoint=endpoint)
    finally:
        first.close()
    with pytest.raises(RuntimeError, match="closed"):
        first.publish()
    first.close()  # a second close does nothing
    with pytest.raises(ValueError, match="records no KV events"):
        ZmqEventPublisher(KVCache(0, 1, 1, 8, enable_prefix_caching=True), endpoint)
    with pytest.raises(ValueError, match="buffer_steps"):
        ZmqEventPublisher(cache, endpoint, buffer_steps=0)


def test_interval_drains_from_the_thread():
    endpoint, _ = endpoints()
    cache = KVCache(0, 1, 1, 8, page_size=2, enable_prefix_caching=True, enable_kv_events=True)
    with ZmqEventPublisher(cache, endpoint, interval=0.02) as publisher:
        cache.add_sequence(0, [1, 2, 3])
        cache.append([0], [3], token_ids=[1, 2, 3])
        wait_sent(publisher, 1)
        assert publisher.num_events == 1
    assert threading.active_count() >= 1


def test_concurrent_publishers_interval_drains_and_large_batches_keep_the_stream_exact():
    """Two threads publish while the publisher thread drains every 5 ms and faults in the memory
    of later payloads (batches of 10k to 40k pages fill several arena chunks): sequence numbers
    stay contiguous, every batch decodes, the stream rebuilds the cached hashes, and a replay
    from 0 returns the kept payloads byte for byte as they were first sent."""
    endpoint, replay_endpoint = endpoints()
    cache = KVCache(0, 1, 1, 60_000, page_size=1, enable_prefix_caching=True, enable_kv_events=True)
    subscriber = Subscriber(endpoint, replay_endpoint)
    raw = {}
    try:
        with ZmqEventPublisher(cache, endpoint, replay_endpoint=replay_endpoint, interval=0.005) as publisher:
            time.sleep(0.3)  # the subscription reaches the PUB socket

            def work(seed):
                rng = np.random.default_rng(seed)
                for step in range(12):
                    seq = seed * 1000 + step
                    length = int(rng.integers(10_000, 20_000))
                    tokens = rng.integers(0, 2**31 - 1, size=length).tolist()
                    cache.add_sequence(seq, tokens)
                    cache.append([seq], [length], token_ids=tokens)
                    cache.remove_sequence(seq)
                    publisher.publish()

            threads = [threading.Thread(target=work, args=(seed,)) for seed in (1, 2)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            publisher.publish()
            num_batches = publisher.num_batches
            while subscriber.sub.poll(500):
                topic, seq, payload = subscriber.sub.recv_multipart()
                raw[int.from_bytes(seq, "big")] = payload
                subscriber.batches[int.from_bytes(seq, "big")] = DECODER.decode(payload)
            subscriber.complete(num_batches)
            assert publisher.num_dropped == 0 and num_batches >= 3
            assert rebuild(subscriber.batches) == cache_hashes(cache)
            kept = {}
            subscriber.replay.send_multipart([b"", (0).to_bytes(8, "big")])
            while True:
                assert subscriber.replay.poll(5000)
                _, seq, payload = subscriber.replay.recv_multipart()
                if seq == END_SEQ:
                    break
                kept[int.from_bytes(seq, "big")] = payload
            assert sorted(kept) == list(range(num_batches))
            assert all(kept[s] == raw[s] for s in raw)
    finally:
        subscriber.close()


def test_a_failed_interval_drain_is_logged_and_the_thread_goes_on(caplog):
    endpoint, replay_endpoint = endpoints()
    cache = KVCache(0, 1, 1, 8, page_size=2, enable_prefix_caching=True, enable_kv_events=True)

    class FailsOnce:
        """The cache, except that its first drain raises."""
        failed = False

        def take_kv_events(self):
            if not self.failed:
                self.failed = True
                raise MemoryError("no memory for the drain")
            return cache.take_kv_events()

    with ZmqEventPublisher(cache, endpoint, replay_endpoint=replay_endpoint, interval=0.01) as publisher:
        publisher._cache = FailsOnce()
        cache.add_sequence(0, [1, 2, 3])
        cache.append([0], [3], token_ids=[1, 2, 3])
        wait_sent(publisher, 1)  # a later interval drain sent the events
        late = Subscriber(endpoint, replay_endpoint)
        try:
            assert late.request_replay(0) == [0]  # the thread still answers replays
        finally:
            late.close()
    assert "draining KV events in the publisher thread failed" in caplog.text


def test_a_batch_that_could_not_be_encoded_is_sent_first_by_the_next_publish():
    endpoint, _ = endpoints()
    cache = KVCache(0, 1, 1, 16, page_size=2, enable_prefix_caching=True, enable_kv_events=True)
    subscriber = Subscriber(endpoint)
    try:
        with ZmqEventPublisher(cache, endpoint) as publisher:
            time.sleep(0.3)  # the subscription reaches the PUB socket
            arena = publisher._arena

            class NoMemoryOnce:
                """The publisher's arena, except that its first encode finds no memory."""
                failed = False

                def encode(self, *args, **kwargs):
                    if not self.failed:
                        self.failed = True
                        raise MemoryError("no memory for the payload")
                    return arena.encode(*args, **kwargs)

                def __getattr__(self, name):
                    return getattr(arena, name)

            publisher._arena = NoMemoryOnce()
            cache.add_sequence(0, [1, 2, 3, 4])
            cache.append([0], [4], token_ids=[1, 2, 3, 4])
            with pytest.raises(MemoryError):
                publisher.publish()
            assert publisher.num_batches == 0
            cache.remove_sequence(0)
            cache.add_sequence(1, [5, 6, 7])
            cache.append([1], [3], token_ids=[5, 6, 7])
            assert publisher.publish() == 1  # the new events; the kept batch went first
            assert publisher.num_batches == 2
            subscriber.receive()
        assert sorted(subscriber.batches) == [0, 1]
        assert [e.token_ids for e in subscriber.batches[0].events] == [[1, 2, 3, 4]]
        assert [e.token_ids for e in subscriber.batches[1].events] == [[5, 6]]
        assert rebuild(subscriber.batches) == cache_hashes(cache)
    finally:
        subscriber.close()


def test_cli_replay_publishes_kv_events(capsys):
    from pagedkv.cli import main

    path = mooncake_path()
    endpoint, _ = endpoints()
    subscriber = Subscriber(endpoint)
    received = threading.Thread(target=subscriber.receive, args=(3000,))
    try:
        received.start()
        status = main(["replay", str(path), "--limit", "40", "--capacity-tokens", "200000",
                       "--kv-events", endpoint, "--no-progress"])
        received.join()
    finally:
        subscriber.close()
    out = capsys.readouterr().out
    assert status == 0 and "KV events:" in out and f"published on {endpoint}" in out
    assert main(["replay", str(path), "--limit", "5", "--capacity-tokens", "200000", "400000",
                 "--kv-events", endpoint, "--no-progress"]) == 2
    assert "one --capacity-tokens" in capsys.readouterr().err
    assert main(["replay", str(path), "--limit", "5", "--capacity-tokens", "200000",
                 "--kv-events", "nonsense", "--no-progress"]) == 2
    assert "--kv-events: cannot bind the KV event endpoint 'nonsense'" in capsys.readouterr().err


def test_a_publish_that_waits_for_close_is_refused_and_leaves_the_events_in_the_cache(monkeypatch):
    """A publish() that passed its closed check while close() held the lock they share must not
    send on the sockets close() shuts, nor take events out of the cache that no one will send."""
    endpoint, _ = endpoints()
    cache = KVCache(0, 1, 1, 16, page_size=2, enable_prefix_caching=True, enable_kv_events=True)
    publisher = ZmqEventPublisher(cache, endpoint)
    lock = publisher._take_lock
    waiting = threading.Event()

    class WatchedLock:
        """The publisher's lock, telling when the publishing thread starts to wait for it."""

        def __enter__(self):
            if threading.current_thread() is thread:
                waiting.set()
            return lock.__enter__()

        def __exit__(self, *exc_info):
            return lock.__exit__(*exc_info)

    monkeypatch.setattr(publisher, "_take_lock", WatchedLock())
    outcome = []

    def publish():
        try:
            outcome.append(publisher.publish())
        except Exception as exc:
            outcome.append(exc)

    thread = threading.Thread(target=publish)
    with lock:
        thread.start()
        assert waiting.wait(10)
        publisher.close()  # the publishing thread waits for the lock throughout
        cache.add_sequence(0, [1, 2, 3])
        cache.append([0], [3], token_ids=[1, 2, 3])
    thread.join()
    (result,) = outcome
    assert isinstance(result, RuntimeError) and "closed" in str(result)
    assert publisher.num_batches == 0
    events, _ = cache.take_kv_events()
    assert len(events) == 1  # still there for a new publisher
