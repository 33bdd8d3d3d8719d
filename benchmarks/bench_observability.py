"""Cost of observability on the Mooncake conversation replay with prefix caching.

Replays the Mooncake conversation trace (``pagedkv.replay.replay``, page size 16) at a
10M-token cache in five settings, each timed over the request loop:

* ``(a) plain``: no metrics, no events (the baseline).
* ``(b) collector``: a ``pagedkv.metrics.Collector`` registered for the cache and
  scraped (``prometheus_client.generate_latest``) every 100 ms from another thread.
* ``(c) events drained``: ``enable_kv_events=True``, ``take_kv_events()`` every 256
  requests (the events are dropped after the take).
* ``(d) events over ZeroMQ``: a ``pagedkv.events.ZmqEventPublisher`` publishing every 256
  requests on loopback to a subscriber *process* that receives every batch while the
  replay runs (checking sequence numbers as batches arrive) and, once it has ended,
  decodes every batch with msgspec structs of vLLM's schema. The run fails unless the
  subscriber received every batch (sequence numbers 0..n-1, gaps filled from the replay
  socket) and decoded every event.
* ``(e)``: as (d), but the subscriber decodes each batch as it arrives (from ZeroMQ's
  receive buffer, ``copy=False``). Decoding the replay's 12M page hashes into Python
  objects takes the subscriber about one CPU-second, so on a machine with few cores it
  competes with the replay for the CPUs: (e) - (d) is what a router decoding on the same
  machine costs, and (d) is what publishing costs. A router usually runs elsewhere.

Runs interleave the settings (the order rotates every repeat); the table gives medians,
each setting's ratio to (a) (ratio of the medians, and the median over repeats of the
ratio to the plain run of the same repeat, which cancels the machine's slow drifts) with
the goal next to it, events per second and bytes on
the wire (events as vLLM counts them: a BlockStored of k pages is one event; pages/s
counts page hashes stored and removed). Prints the load average before and after; writes
``benchmarks/results/bench_observability.json``.

Example::

    python benchmarks/bench_observability.py
    python benchmarks/bench_observability.py --limit 3000 --repeats 3
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import socket
import statistics
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

from pagedkv.replay import replay
from pagedkv.traces import load_trace

REPO_ROOT = Path(__file__).resolve().parents[1]
TRACE_NAME = "mooncake_conversation_trace.jsonl"
GOALS = {"b": 1.01, "c": 1.10, "d": 1.25}

# The subscriber process: vLLM-schema structs, SUB socket, replay of gaps over DEALER.
SUBSCRIBER = textwrap.dedent('''
    import json, sys
    from typing import Any
    import msgspec, zmq

    class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True): pass
    class BlockStored(KVCacheEvent):
        block_hashes: list[int]; parent_block_hash: int | None; token_ids: list[int]
        block_size: int; lora_id: int | None; medium: str | None; lora_name: str | None
        extra_keys: list[Any] | None = None; group_idx: int | None = None
        kv_cache_spec_kind: str | None = None; kv_cache_spec_sliding_window: int | None = None
    class BlockRemoved(KVCacheEvent):
        block_hashes: list[int]; medium: str | None; group_idx: int | None = None
    class AllBlocksCleared(KVCacheEvent): pass
    class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
        ts: float
        events: list[BlockStored | BlockRemoved | AllBlocksCleared]
        data_parallel_rank: int | None = None

    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    endpoint, replay_endpoint, decode_after = sys.argv[1], sys.argv[2], sys.argv[3] == "after"
    context = zmq.Context()
    sub = context.socket(zmq.SUB); sub.setsockopt(zmq.SUBSCRIBE, b""); sub.setsockopt(zmq.RCVHWM, 0)
    sub.connect(endpoint)
    replay = context.socket(zmq.DEALER); replay.connect(replay_endpoint)
    print("ready", flush=True)
    seen, events, pages, wire, replayed = set(), 0, 0, 0, 0
    held = []  # decode_after: the payloads, decoded once every batch is in

    def decode(payload):
        global events, pages
        batch = decoder.decode(payload)
        events += len(batch.events)
        pages += sum(len(e.block_hashes) for e in batch.events if not isinstance(e, AllBlocksCleared))

    def take(seq, payload):
        if seq in seen:
            return
        seen.add(seq)
        if decode_after:
            held.append(payload)
        else:
            decode(payload)

    expected = None
    poller = zmq.Poller(); poller.register(sub, zmq.POLLIN); poller.register(sys.stdin, zmq.POLLIN)
    while expected is None or len(seen) < expected:
        ready = dict(poller.poll(100))
        if sub in ready:
            topic, seq, payload = sub.recv_multipart(copy=False)  # decoded from ZeroMQ's buffer
            wire += len(topic) + len(seq) + len(payload)
            take(int.from_bytes(seq.bytes, "big"), payload.buffer)
        elif sys.stdin.fileno() in ready or sys.stdin in ready:
            expected = int(sys.stdin.readline())
        elif expected is not None:  # quiet and incomplete: replay what is missing
            missing = min(set(range(expected)) - seen)
            replay.send_multipart([b"", missing.to_bytes(8, "big")])
            while True:
                _, seq, payload = replay.recv_multipart()
                if seq == (-1).to_bytes(8, "big", signed=True):
                    break
                replayed += int.from_bytes(seq, "big") not in seen
                take(int.from_bytes(seq, "big"), payload)
    for payload in held:
        decode(payload)
    print(json.dumps({"batches": len(seen), "events": events, "pages": pages, "bytes": wire,
                      "replayed": replayed}), flush=True)
''')


def default_trace_path() -> Path | None:
    """``<repo root>/../shared/data/<trace>``, else the nearest ancestor's ``shared/data``."""
    for base in [REPO_ROOT.parent, *REPO_ROOT.parent.parents]:
        candidate = base / "shared" / "data" / TRACE_NAME
        if candidate.is_file():
            return candidate
    return None


def free_endpoint() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def run_plain(trace, args):
    return replay(trace, args.capacity_tokens, page_size=args.page_size).seconds, {}


def run_collector(trace, args):
    from prometheus_client import CollectorRegistry, generate_latest

    from pagedkv.metrics import Collector

    registry = CollectorRegistry()
    stop = threading.Event()
    scrapes = []

    def scrape():
        while not stop.wait(0.1):
            scrapes.append(len(generate_latest(registry)))

    def attach(cache):
        Collector(cache).register(registry)

    thread = threading.Thread(target=scrape, daemon=True)
    thread.start()
    try:
        seconds = replay(trace, args.capacity_tokens, page_size=args.page_size, on_cache=attach).seconds
    finally:
        stop.set()
        thread.join()
    return seconds, {"scrapes": len(scrapes), "exposition_bytes": scrapes[-1] if scrapes else 0}


def scrape_cost(path, page_size, requests=2000, capacity_tokens=1_000_000, repeats=15):
    """Median seconds of ``stats(metrics=True)`` (the lock's whole hold) and of a whole scrape.

    Measured on the cache that a replay of the trace's first ``requests`` requests at
    ``capacity_tokens`` leaves behind; returns ``(stats_s, scrape_s, exposition_bytes, pages)``.
    """
    from prometheus_client import CollectorRegistry, generate_latest

    from pagedkv.metrics import Collector

    trace = load_trace(path, "mooncake", limit=requests)
    cache = replay(trace, capacity_tokens, page_size=page_size, keep_cache=True).cache
    registry = CollectorRegistry()
    Collector(cache).register(registry)
    stats_times, scrape_times = [], []
    text = b""
    for _ in range(repeats):
        start = time.perf_counter()
        cache.stats(metrics=True)
        stats_times.append(time.perf_counter() - start)
        start = time.perf_counter()
        text = generate_latest(registry)
        scrape_times.append(time.perf_counter() - start)
    return statistics.median(stats_times), statistics.median(scrape_times), len(text), cache.num_pages


def run_drained(trace, args):
    totals = {"events": 0, "pages": 0, "dropped": 0}

    def attach(cache):
        def drain():
            events, dropped = cache.take_kv_events()
            totals["events"] += len(events)
            totals["pages"] += events.num_pages_stored + events.num_pages_removed
            totals["dropped"] += dropped
        return drain

    seconds = replay(trace, args.capacity_tokens, page_size=args.page_size, kv_events=attach).seconds
    if totals["dropped"]:
        raise SystemExit(f"(c): the event log dropped {totals['dropped']} events")
    return seconds, totals


def run_zmq(trace, args, decode_after=True):
    from pagedkv.events import ZmqEventPublisher

    endpoint, replay_endpoint = free_endpoint(), free_endpoint()
    subscriber = subprocess.Popen([sys.executable, "-c", SUBSCRIBER, endpoint, replay_endpoint,
                                   "after" if decode_after else "live"],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    publishers = []

    def attach(cache):
        publishers.append(ZmqEventPublisher(cache, endpoint, replay_endpoint=replay_endpoint))
        return publishers[0].publish

    try:
        if subscriber.stdout.readline().strip() != "ready":
            raise SystemExit("the subscriber process did not start")
        time.sleep(0.3)  # its subscription reaches the PUB socket (missed batches are replayed anyway)
        # publish() hands each batch to ZeroMQ before it returns: the timed loop covers it.
        seconds = replay(trace, args.capacity_tokens, page_size=args.page_size, kv_events=attach).seconds
        publisher = publishers[0]
        subscriber.stdin.write(f"{publisher.num_batches}\n")
        subscriber.stdin.flush()
        received = json.loads(subscriber.stdout.readline())
    finally:
        for publisher in publishers:
            publisher.close()
        subscriber.kill()
        subscriber.wait()
    lost = (received["batches"] != publisher.num_batches or received["events"] != publisher.num_events
            or publisher.num_dropped)
    if lost:
        raise SystemExit(f"events lost: sent {publisher.num_batches} batches / {publisher.num_events} events "
                         f"({publisher.num_dropped} dropped by the log), received {received}")
    return seconds, {"events": publisher.num_events, "pages": received["pages"], "batches": publisher.num_batches,
                     "bytes": publisher.num_bytes, "received": received}


SETTINGS = {
    "a": ("(a) plain", run_plain),
    "b": ("(b) collector, scraped every 100 ms", run_collector),
    "c": ("(c) events drained every 256 requests", run_drained),
    "d": ("(d) events over ZeroMQ to a subscriber process", run_zmq),
    "e": ("(e) as (d), the subscriber decodes during the run", lambda trace, args: run_zmq(trace, args, False)),
}


def paired_interval(ratios, resamples=5000, seed=0):
    """95% bootstrap interval of the median of ``ratios`` (percentile method, fixed seed)."""
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(resamples))
    return medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trace", default=None, help=f"Mooncake trace (default: shared/data/{TRACE_NAME})")
    parser.add_argument("--capacity-tokens", type=int, default=10_000_000)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "bench_observability.json"))
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    path = args.trace or default_trace_path()
    if path is None:
        raise SystemExit(f"{TRACE_NAME} not found in {REPO_ROOT.parent / 'shared' / 'data'}; pass --trace")
    trace = load_trace(path, "mooncake", limit=args.limit)

    keys = ["a", "b", "c", "d", "e"]
    skipped = {}
    for key, module in (("b", "prometheus_client"), ("b", "pagedkv.metrics"), ("d", "zmq"), ("d", "msgspec"),
                        ("e", "zmq"), ("e", "msgspec")):
        try:
            __import__(module)
        except ImportError as exc:
            skipped.setdefault(key, f"{module} is not importable ({exc})")
    keys = [k for k in keys if k not in skipped]

    load_before = os.getloadavg()
    seconds = {k: [] for k in keys}
    extra = {}
    for repeat in range(args.repeats):
        order = keys[repeat % len(keys):] + keys[:repeat % len(keys)]
        for key in order:
            s, info = SETTINGS[key][1](trace, args)
            seconds[key].append(s)
            extra[key] = info
    load_after = os.getloadavg()

    base = statistics.median(seconds["a"])
    print(f"Mooncake conversation trace: {len(trace):,} requests, capacity {args.capacity_tokens:,} tokens, "
          f"page size {args.page_size}, {args.repeats} interleaved runs per setting")
    header = (f"{'setting':<48} {'median s':>9} {'vs (a)':>7} {'paired':>7} {'95% interval':>13} {'goal':>6} "
              f"{'events/s':>9} {'pages/s':>10} {'MB on wire':>11}")
    print(header)
    print("-" * len(header))
    rows = {}
    for key in keys:
        median = statistics.median(seconds[key])
        ratio = median / base
        pairs = [s / a for s, a in zip(seconds[key], seconds["a"])]
        paired = statistics.median(pairs)
        low, high = paired_interval(pairs)
        interval = f"{low:.3f}-{high:.3f}"
        goal = f"<={GOALS[key]:.2f}" if key in GOALS else "-"
        info = extra.get(key, {})
        rate = f"{info['events'] / median:,.0f}" if "events" in info else "-"
        page_rate = f"{info['pages'] / median:,.0f}" if "pages" in info else "-"
        wire = f"{info['bytes'] / 1e6:,.1f}" if "bytes" in info else "-"
        print(f"{SETTINGS[key][0]:<48} {median:>9.3f} {ratio:>7.3f} {paired:>7.3f} {interval:>13} {goal:>6} "
              f"{rate:>9} {page_rate:>10} {wire:>11}")
        rows[key] = {"name": SETTINGS[key][0], "seconds": seconds[key], "median_seconds": median, "ratio": ratio,
                     "paired_ratio": paired, "paired_interval_95": [low, high], "goal": GOALS.get(key),
                     "info": info}
    for key, reason in skipped.items():
        print(f"{SETTINGS[key][0]}: not run, {reason}")
    scrape = None
    if "b" in keys:
        stats_s, scrape_s, text_bytes, pages = scrape_cost(path, args.page_size)
        scrape = {"stats_metrics_s": stats_s, "generate_latest_s": scrape_s, "exposition_bytes": text_bytes,
                  "num_pages": pages}
        print(f"one scrape of the cache a 2,000-request replay leaves ({pages:,} pages), medians of 15: "
              f"stats(metrics=True) {stats_s * 1e6:.1f} us (the lock's whole hold), generate_latest "
              f"{scrape_s * 1e3:.2f} ms ({text_bytes:,} bytes of text)")
    for key in ("d", "e"):
        if key in extra:
            d = extra[key]
            print(f"({key}): {d['batches']:,} batches, {d['events']:,} events ({d['pages']:,} page hashes) received "
                  f"in full by the subscriber process ({d['received']['replayed']} replayed)")
    print(f"load average {load_before[0]:.2f} before, {load_after[0]:.2f} after ({os.cpu_count()} CPUs, shared)")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "trace": str(path), "limit": args.limit, "requests": len(trace), "capacity_tokens": args.capacity_tokens,
        "page_size": args.page_size, "repeats": args.repeats, "settings": rows, "skipped": skipped, "scrape": scrape,
        "load_average_before": load_before, "load_average_after": load_after, "cpu_count": os.cpu_count(),
        "python": platform.python_version(), "platform": platform.platform(),
    }, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
