"""pagedkv.metrics: the Prometheus collector, scraped over HTTP, against reference models.

References:

* ``reference_cache.RefCache`` (plain-Python paging with windows, sinks,
  forks and copy-on-write) for the page, window, ring-reuse, copy-on-write,
  out-of-pages and sequence counters;
* ``reference_replayer.ReferenceReplayer`` (prefix caching over block ids)
  for the prefix cache's queries, hits, evictions, cached pages and the
  hit-length histogram;
* ``reference_cache.RefClassicCache`` for the classic cache's hits, misses
  and evictions.

Every scrape goes through prometheus_client's own HTTP server on a loopback
port and is parsed with prometheus_client's text parser. Without
prometheus_client the tests that need it are skipped (with
``PAGEDKV_REQUIRE_METRICS=1``, as in CI, they fail instead).
"""
import gc
import math
import os
import random
import re
import socket
import subprocess
import sys
import textwrap
import urllib.request

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from _llama_support import data_file_or_skip
from pagedkv import KVCache, OutOfPagesError, PagedKVCache
from pagedkv.replay import replay
from pagedkv.traces import Trace
from reference_cache import OutOfPages, RefCache, RefClassicCache
from reference_replayer import ReferenceReplayer

REQUIRED = os.environ.get("PAGEDKV_REQUIRE_METRICS") == "1"
INSTALL = 'pip install "pagedkv[metrics]"'

try:
    import prometheus_client
    from prometheus_client.parser import text_string_to_metric_families
except ImportError:
    if REQUIRED:
        raise
    prometheus_client = None

needs_prometheus = pytest.mark.skipif(prometheus_client is None,
                                      reason=f"prometheus_client is not installed: {INSTALL}")
# Upper bounds of the prefix-hit histogram, written out from the documented rule
# (0, then powers of two from 16 to 2**20 tokens).
BOUNDS = [0] + [2**k for k in range(4, 21)]


# ------------------------------------------------------------------ helpers
@pytest.fixture
def serve():
    """``serve(registry) -> scrape``: prometheus_client's HTTP server on a free loopback port."""
    servers = []

    def start(registry):
        server, thread = prometheus_client.start_http_server(0, addr="127.0.0.1", registry=registry)
        servers.append((server, thread))

        def scrape():
            url = f"http://127.0.0.1:{server.server_port}/metrics"
            with urllib.request.urlopen(url, timeout=10) as response:
                assert response.status == 200
                return parse(response.read().decode())

        return scrape

    yield start
    for server, thread in servers:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def parse(text):
    """{sample name: {frozenset(labels): value}} of an exposition text."""
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, {})[frozenset(sample.labels.items())] = sample.value
    return out


def value(scraped, name, **labels):
    return scraped[name][frozenset(labels.items())]


def new_registry(cache, **kwargs):
    from pagedkv.metrics import Collector

    registry = prometheus_client.CollectorRegistry()
    Collector(cache, **kwargs).register(registry)
    return registry


def bucket_counts(hit_tokens):
    """Cumulative counts per ``le`` of the hit-length histogram, from the per-lookup hits."""
    counts = {str(b): sum(1 for h in hit_tokens if h <= b) for b in BOUNDS}
    counts["+Inf"] = len(hit_tokens)
    return counts


# ------------------------------------------------- paging against RefCache
def check_paging(scraped, ref, labels, bytes_per_page):
    num_pages = ref.num_pages
    in_use = ref.pages_in_use
    expected = {
        "pagedkv_num_pages": num_pages,
        "pagedkv_pages_in_use": in_use,
        "pagedkv_pages_free": num_pages - in_use,
        "pagedkv_pages_cached_free": 0,
        "pagedkv_pages_in_use_peak": ref.pages_peak,
        "pagedkv_kv_cache_usage_perc": in_use / num_pages,
        "pagedkv_kv_cache_used_bytes": in_use * bytes_per_page,
        "pagedkv_sequences": len(ref.seqs),
        "pagedkv_pages_allocated_total": ref.pages_allocated,
        "pagedkv_window_pages_released_total": ref.evictions,
        "pagedkv_window_pages_reused_total": ref.ring_reuses,
        "pagedkv_pages_copied_on_write_total": ref.cow_copies,
        "pagedkv_out_of_pages_errors_total": ref.out_of_pages_errors,
        "pagedkv_sequences_added_total": ref.sequences_added,
        "pagedkv_tokens_appended_total": ref.tokens_appended,
        "pagedkv_prefix_cache_queries_total": 0,
        "pagedkv_prefix_cache_hits_total": 0,
        "pagedkv_prefix_cache_pages_evicted_total": 0,
        "pagedkv_prefix_cache_pages": 0,
    }
    got = {name: value(scraped, name, **labels) for name in expected}
    assert got == pytest.approx(expected)


LAYERS, HEADS, DIM = 2, 1, 4


@needs_prometheus
@pytest.mark.parametrize("window, sinks", [(None, 0), (6, 0), (5, 3)])
def test_paging_counters_over_http_equal_the_reference_model(serve, window, sinks):
    num_pages, page_size = 12, 2
    cache = KVCache(LAYERS, HEADS, DIM, num_pages, page_size=page_size, dtype=np.float32,
                    window=window, sink_tokens=sinks)
    bytes_per_page = LAYERS * 2 * page_size * HEADS * DIM * 4  # K and V of every layer, float32
    ref = RefCache(num_pages, page_size, window, sinks)
    labels = {"model_name": "test-model", "replica": "0"}
    scrape = serve(new_registry(cache, labels=labels))
    check_paging(scrape(), ref, labels, bytes_per_page)
    rng = random.Random(17 + (window or 0) + sinks)
    next_id = 0
    saw = {"release": 0, "reuse": 0, "cow": 0, "oop": 0, "fork": 0}
    for step in range(400):
        op = rng.random()
        live = sorted(ref.seqs)
        if op < 0.15 or not live:
            cache.add_sequence(next_id)
            ref.add(next_id)
            next_id += 1
        elif op < 0.25:
            parent = rng.choice(live)
            cache.fork(parent, next_id)
            ref.fork(parent, next_id)
            next_id += 1
            saw["fork"] += 1
        elif (op < 0.35 or ref.pages_in_use > 0.75 * num_pages and op < 0.6) and len(live) > 1:
            victim = rng.choice(live)
            cache.remove_sequence(victim)
            ref.remove(victim)
        else:
            batch = rng.sample(live, rng.randint(1, min(3, len(live))))
            counts = [rng.choice([0, 1, 1, 1, 2, 3, 7]) for _ in batch]
            try:
                ref.append(batch, counts)
            except OutOfPages:
                with pytest.raises(OutOfPagesError):
                    cache.append(batch, counts, return_slot_mapping=False)
                saw["oop"] += 1
            else:
                cache.append(batch, counts, return_slot_mapping=False)
        if step % 25 == 0:
            check_paging(scrape(), ref, labels, bytes_per_page)
    check_paging(scrape(), ref, labels, bytes_per_page)
    cache.check_invariants()
    saw.update(release=ref.evictions, reuse=ref.ring_reuses, cow=ref.cow_copies)
    # The run exercised what the counters count.
    assert saw["fork"] and saw["cow"] and saw["oop"], saw
    if window is not None:
        assert saw["release"] and saw["reuse"], saw


@needs_prometheus
def test_the_info_metric_names_the_configuration_and_carries_the_user_labels(serve):
    cache = KVCache(3, 2, 8, 64, page_size=16, dtype=np.float32, window=128, sink_tokens=4,
                    enable_prefix_caching=True, prefix_hash="sha256")
    scraped = serve(new_registry(cache, namespace="kv", labels={"model_name": "m"}))()
    info = {dict(labels)["num_layers"]: dict(labels) for labels in scraped["kv_cache_config_info"]}
    assert info["3"] == {
        "model_name": "m", "cache": "KVCache", "num_layers": "3", "num_kv_heads": "2", "head_dim": "8",
        "num_pages": "64", "page_size": "16", "dtype": "float32", "window": "128", "sink_tokens": "4",
        "prefix_caching": "true", "prefix_hash": "sha256",
    }
    # Every sample of every family carries the user's label, under the chosen namespace.
    for name, samples in scraped.items():
        assert name.startswith("kv_"), name
        for labels in samples:
            assert ("model_name", "m") in labels, name


# ------------------------------------- prefix caching against the reference
def random_trace(rng, num_requests, block_tokens):
    """Prompts that share leading blocks with an earlier prompt about half the time."""
    inputs, outputs, hash_ids, next_block = [], [], [], 0
    for _ in range(num_requests):
        prompt = rng.randint(1, 6 * block_tokens)
        num_blocks = -(-prompt // block_tokens)
        base = rng.choice(hash_ids) if hash_ids and rng.random() < 0.7 else []
        shared = min(rng.randint(0, num_blocks), len(base))
        ids = base[:shared] + list(range(next_block, next_block + num_blocks - shared))
        next_block += num_blocks
        inputs.append(prompt)
        outputs.append(rng.randint(0, 2 * block_tokens))
        hash_ids.append(ids)
    offsets = np.zeros(num_requests + 1, dtype=np.int64)
    np.cumsum([len(ids) for ids in hash_ids], out=offsets[1:])
    return Trace(format="mooncake", source="<test>", arrival_seconds=np.zeros(num_requests),
                 input_lengths=np.asarray(inputs, dtype=np.int64),
                 output_lengths=np.asarray(outputs, dtype=np.int64),
                 block_ids=np.asarray([i for ids in hash_ids for i in ids], dtype=np.int64),
                 block_offsets=offsets, block_tokens=block_tokens)


def check_prefix(scraped, reference, cache_free_cached, labels):
    hits = [h for h in reference.cached_tokens if h >= 0]
    expected = {
        "pagedkv_prefix_cache_queries_total": reference.prompt_tokens,
        "pagedkv_prefix_cache_hits_total": reference.hit_tokens,
        "pagedkv_pages_allocated_total": reference.pages_allocated,
        "pagedkv_prefix_cache_pages_evicted_total": reference.evictions,
        "pagedkv_prefix_cache_pages": len(reference.cached_pages()),
        "pagedkv_pages_cached_free": cache_free_cached,
        "pagedkv_pages_free": len(reference.free_queue()),
        "pagedkv_sequences_added_total": len(hits),
        "pagedkv_prefix_cache_hit_tokens_count": len(hits),
        "pagedkv_prefix_cache_hit_tokens_sum": sum(hits),
    }
    got = {name: value(scraped, name, **labels) for name in expected}
    assert got == expected
    buckets = {dict(k)["le"]: v for k, v in scraped["pagedkv_prefix_cache_hit_tokens_bucket"].items()
               if set(labels.items()) <= k}
    assert buckets == bucket_counts(hits)


def reference_cached_free(reference):
    return sum(1 for page in reference.free_queue() if reference.key_of_page[page] is not None)


@needs_prometheus
@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), num_pages=st.integers(8, 60))
def test_prefix_counters_over_http_equal_the_reference_replayer(seed, num_pages):
    rng = random.Random(seed)
    page_size, block_tokens = 4, 8
    trace = random_trace(rng, 40, block_tokens)
    reference = ReferenceReplayer(num_pages, page_size, block_tokens)
    for prompt, output, blocks in zip(trace.input_lengths.tolist(), trace.output_lengths.tolist(),
                                      trace.request_blocks()):
        reference.run(prompt, output, blocks)
    registry = prometheus_client.CollectorRegistry()
    labels = {"capacity": str(num_pages)}
    from pagedkv.metrics import Collector

    result = replay(trace, num_pages * page_size, page_size=page_size, keep_cache=True,
                    on_cache=lambda cache: Collector(cache, labels=labels).register(registry))
    server, thread = prometheus_client.start_http_server(0, addr="127.0.0.1", registry=registry)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.server_port}/metrics", timeout=10) as response:
            scraped = parse(response.read().decode())
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
    check_prefix(scraped, reference, reference_cached_free(reference), labels)
    result.cache.check_invariants()


@needs_prometheus
def test_mooncake_replay_scraped_while_running_ends_equal_to_the_reference(serve):
    """Real traffic: the first 400 conversation requests under eviction pressure, scraped every 50."""
    from pagedkv.traces import load_trace

    trace = load_trace(data_file_or_skip("mooncake_conversation_trace.jsonl"), limit=400)
    page_size, num_pages = 16, 200_000 // 16
    reference = ReferenceReplayer(num_pages, page_size, trace.block_tokens)
    for prompt, output, blocks in zip(trace.input_lengths.tolist(), trace.output_lengths.tolist(),
                                      trace.request_blocks()):
        reference.run(prompt, output, blocks)
    registry = prometheus_client.CollectorRegistry()
    scrape = serve(registry)
    seen = []
    from pagedkv.metrics import Collector

    def progress(n):  # called every 256 requests, from inside the replay: the cache is live
        seen.append(value(scrape(), "pagedkv_prefix_cache_queries_total"))

    result = replay(trace, num_pages * page_size, page_size=page_size, keep_cache=True, progress=progress,
                    on_cache=lambda cache: Collector(cache).register(registry))
    check_prefix(scrape(), reference, reference_cached_free(reference), {})
    assert reference.evictions > 0 and reference.hit_tokens > 0
    assert seen and 0 < seen[0] <= reference.prompt_tokens and seen == sorted(seen)
    assert result.cache.stats()["prefix_cached_free_pages"] == reference_cached_free(reference)


# --------------------------------------------------------- classic cache
@needs_prometheus
def test_classic_cache_hits_misses_and_evictions_equal_a_python_count(serve):
    max_pages, dim, page_size = 4, 3, 2
    cache = PagedKVCache(max_pages, dim, page_size=page_size)
    ref = RefClassicCache(max_pages, dim, page_size, np.float32)
    scrape = serve(new_registry(cache, labels={"model_name": "classic"}))
    rng = random.Random(5)
    for step in range(300):
        token = rng.randrange(40)
        if rng.random() < 0.5:
            row = np.full(dim, step, dtype=np.float32)
            cache.put(token, row, row)
            ref.put(token, row, row)
        elif rng.random() < 0.5:
            cache.get(token)
            ref.lookup(token)
        else:
            tokens = [rng.randrange(40) for _ in range(rng.randint(1, 5))]
            cache.get_many(tokens)
            for t in tokens:
                ref.lookup(t)
    scraped = scrape()
    labels = {"model_name": "classic"}
    got = {name: value(scraped, name, **labels) for name in (
        "pagedkv_cache_hits_total", "pagedkv_cache_misses_total", "pagedkv_pages_evicted_total",
        "pagedkv_pages_in_use", "pagedkv_tokens", "pagedkv_num_pages", "pagedkv_kv_cache_usage_perc")}
    assert got == {
        "pagedkv_cache_hits_total": ref.hits, "pagedkv_cache_misses_total": ref.misses,
        "pagedkv_pages_evicted_total": ref.evictions, "pagedkv_pages_in_use": len(ref.fifo),
        "pagedkv_tokens": len(ref), "pagedkv_num_pages": max_pages,
        "pagedkv_kv_cache_usage_perc": len(ref.fifo) / max_pages,
    }
    assert ref.hits and ref.misses and ref.evictions
    assert dict(next(iter(scraped["pagedkv_cache_config_info"]))) == {
        "model_name": "classic", "cache": "PagedKVCache", "num_pages": "4", "page_size": "2", "dim": "3",
        "dtype": "float32"}
    assert cache.resident_pages.tolist() == ref.fifo


# ----------------------------------------------------------- bad input
@needs_prometheus
@pytest.mark.parametrize("kwargs, exc, match", [
    ({"namespace": 3}, TypeError, "Invalid type of namespace"),
    ({"namespace": "1pagedkv"}, ValueError, "Invalid value of namespace"),
    ({"namespace": "paged-kv"}, ValueError, "Invalid value of namespace"),
    ({"labels": ["model_name"]}, TypeError, "Invalid type of labels"),
    ({"labels": {"model_name": 1}}, TypeError, "Invalid type of labels"),
    ({"labels": {"model name": "x"}}, ValueError, "Invalid value of labels"),
    ({"labels": {"__name": "x"}}, ValueError, "Invalid value of labels"),
    ({"labels": {"le": "x"}}, ValueError, "reserved"),
    ({"labels": {"page_size": "x"}}, ValueError, "reserved"),
])
def test_bad_collector_arguments_raise_naming_the_argument(kwargs, exc, match):
    from pagedkv.metrics import Collector

    with pytest.raises(exc, match=match):
        Collector(KVCache(1, 1, 4, 8), **kwargs)


@needs_prometheus
def test_a_collector_needs_a_cache_and_a_registry_refuses_duplicate_names():
    from pagedkv.metrics import Collector, exposition_text

    with pytest.raises(TypeError, match="Invalid type of cache"):
        Collector({"pages": 1})
    with pytest.raises(TypeError, match="Invalid type of collector"):
        exposition_text("pagedkv")
    registry = new_registry(KVCache(1, 1, 4, 8))
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        Collector(KVCache(1, 1, 4, 8)).register(registry)
    Collector(KVCache(1, 1, 4, 8), namespace="second").register(registry)  # another namespace is fine


@needs_prometheus
def test_a_collected_cache_leaves_the_registry_without_breaking_a_scrape(serve):
    from pagedkv.metrics import Collector

    registry = prometheus_client.CollectorRegistry()
    scrape = serve(registry)
    cache = KVCache(1, 1, 4, 8)
    collector = Collector(cache).register(registry)
    other = Collector(KVCache(1, 1, 4, 8), namespace="other")
    registry.register(other)  # registered directly: the collector cannot leave by itself
    assert value(scrape(), "pagedkv_num_pages") == 8
    del cache
    gc.collect()
    assert collector.cache is None and other.cache is None
    scraped = scrape()  # no error, and nothing of either cache
    assert not [name for name in scraped if name.startswith(("pagedkv_", "other_"))]
    # The collector left the registry: its names are free again.
    Collector(KVCache(1, 1, 4, 8)).register(registry)
    assert list(collector.collect()) == []


# ------------------------------------------------ optional dependency
def run_python(code):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env=env, timeout=120)


def test_import_pagedkv_does_not_import_prometheus_client():
    result = run_python("""
        import sys
        import pagedkv
        assert "prometheus_client" not in sys.modules, "import pagedkv imported prometheus_client"
    """)
    assert result.returncode == 0, result.stderr


def test_without_prometheus_client_the_collector_raises_importerror_naming_the_extra():
    result = run_python("""
        import sys

        class Block:
            def find_spec(self, name, path=None, target=None):
                if name == "prometheus_client" or name.startswith("prometheus_client."):
                    raise ImportError(f"blocked {name}")
                return None

        sys.meta_path.insert(0, Block())
        import pagedkv
        import pagedkv.metrics  # importing the module works without the dependency
        try:
            pagedkv.metrics.Collector(pagedkv.KVCache(1, 1, 4, 8))
        except ImportError as exc:
            print(exc)
        else:
            raise SystemExit("no ImportError")
    """)
    assert result.returncode == 0, result.stderr
    assert INSTALL in result.stdout


# ---------------------------------------------------------------- CLI
@needs_prometheus
def test_replay_cli_writes_the_final_exposition_equal_to_the_reference(tmp_path, capsys):
    from pagedkv.cli import main

    rng = random.Random(3)
    trace = random_trace(rng, 60, 16)
    path = tmp_path / "trace.jsonl"
    with open(path, "w") as out:
        for i, (p, o, ids) in enumerate(zip(trace.input_lengths.tolist(), trace.output_lengths.tolist(),
                                            trace.request_blocks())):
            out.write(f'{{"timestamp": {i}, "input_length": {p}, "output_length": {o}, '
                      f'"hash_ids": {[int(x) for x in ids]}}}\n')
    metrics_file = tmp_path / "metrics.prom"
    capacities = [160, 640]
    status = main(["replay", str(path), "--block-tokens", "16", "--page-size", "4", "--no-progress",
                   "--capacity-tokens", *map(str, capacities), "--metrics-port", "0",
                   "--metrics-file", str(metrics_file)])
    assert status == 0
    assert "serving metrics at http://127.0.0.1:" in capsys.readouterr().err
    scraped = parse(metrics_file.read_text())
    for capacity in capacities:
        reference = ReferenceReplayer(capacity // 4, 4, 16)
        for prompt, output, blocks in zip(trace.input_lengths.tolist(), trace.output_lengths.tolist(),
                                          trace.request_blocks()):
            reference.run(prompt, output, blocks)
        check_prefix(scraped, reference, reference_cached_free(reference), {"capacity_tokens": str(capacity)})


@needs_prometheus
def test_replay_cli_reports_a_port_it_cannot_bind(tmp_path, capsys):
    from pagedkv.cli import main

    path = tmp_path / "trace.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 20, "output_length": 3, "hash_ids": [0]}\n')
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        status = main(["replay", str(path), "--no-progress", "--capacity-tokens", "1024",
                       "--metrics-port", str(port)])
    assert status == 2
    assert f"cannot serve metrics on 127.0.0.1:{port}" in capsys.readouterr().err


def test_metrics_port_out_of_range_is_a_usage_error(capsys):
    from pagedkv.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["replay", "trace.jsonl", "--metrics-port", "70000"])
    assert exit_info.value.code == 2
    assert "expected a port number 0..65535, got 70000" in capsys.readouterr().err


# ---------------------------------------------------- histogram in stats
def test_prefix_hit_histogram_in_stats_counts_each_lookup_once():
    cache = KVCache(0, 1, 1, 64, page_size=4, enable_prefix_caching=True)
    prompt = list(range(41))
    served = []
    for seq_id, length in enumerate([41, 41, 9, 17, 1, 0, 40]):
        served.append(cache.add_sequence(seq_id, prompt[:length]))
        cache.append([seq_id], [length - served[-1]], return_slot_mapping=False)
    stats = cache.stats(metrics=True)
    assert "prefix_hit_histogram" not in cache.stats() and "out_of_pages_errors" not in cache.stats()
    per_bucket = [sum(1 for h in served if (BOUNDS[i - 1] if i else -1) < h <= b) for i, b in enumerate(BOUNDS)]
    assert list(stats["prefix_hit_histogram"]) == per_bucket + [0]
    assert stats["prefix_lookups"] == len(served) and sum(served) == stats["prefix_hits"]
    assert served == [0, 40, 8, 16, 0, 0, 36]
    assert math.isclose(stats["prefix_hit_rate"], sum(served) / sum([41, 41, 9, 17, 1, 0, 40]))


@needs_prometheus
def test_generate_cli_serves_metrics_and_writes_the_state_its_report_prints(smollm2, tmp_path, capsys,
                                                                             monkeypatch):
    from pagedkv import cli
    from pagedkv.models import LlamaModel

    model, tokenizer = smollm2
    monkeypatch.setattr(LlamaModel, "from_gguf", classmethod(lambda cls, path=None: (model, tokenizer)))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("The capital of France is\nOnce upon a time\n")
    metrics_file = tmp_path / "generate.prom"
    status = cli.main(["generate", "--prompts", str(prompts), "--max-new-tokens", "12", "--window", "8",
                       "--sinks", "2", "--page-size", "4", "--dtype", "float32", "--metrics-port", "0",
                       "--metrics-file", str(metrics_file)])
    err = capsys.readouterr().err
    assert status == 0
    assert "pagedkv generate: serving metrics at http://127.0.0.1:" in err
    scraped = parse(metrics_file.read_text())
    info = dict(next(iter(scraped["pagedkv_cache_config_info"])))
    assert info == {"cache": "KVCache", "num_layers": str(model.config.num_layers),
                    "num_kv_heads": str(model.config.num_kv_heads), "head_dim": str(model.config.head_dim),
                    "num_pages": info["num_pages"], "page_size": "4", "dtype": "float32", "window": "8",
                    "sink_tokens": "2", "prefix_caching": "false", "prefix_hash": "none"}
    # The file holds the state the report on stderr describes (before the sequences are released).
    report = re.search(r"pages in use (\d+) .*peak (\d+) .*evictions (\d+), tokens appended (\d+)", err)
    in_use, peak, released, appended = map(int, report.groups())
    assert value(scraped, "pagedkv_pages_in_use") == in_use
    assert value(scraped, "pagedkv_pages_in_use_peak") == peak
    assert value(scraped, "pagedkv_window_pages_released_total") == released > 0
    assert value(scraped, "pagedkv_tokens_appended_total") == appended
    assert value(scraped, "pagedkv_sequences") == value(scraped, "pagedkv_sequences_added_total") == 2
    assert value(scraped, "pagedkv_out_of_pages_errors_total") == 0
    assert value(scraped, "pagedkv_num_pages") == int(info["num_pages"])
