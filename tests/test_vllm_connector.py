"""pagedkv.vllm.PagedKVConnector in real vLLM instances (CPU) over a real redis-server.

Each vLLM instance runs in its own process (this file run as a script: ``build`` makes the
model, ``run`` one instance); the tests compare their greedy float32 tokens and the
connector's counters. The model is a random-weight 2-layer Llama (head_dim 64) with
``initializer_range=0.4``, so its output depends on the context (checked below): with the
default 0.02 it repeats one token whatever K/V it sees, and wrong K/V would go unnoticed.

One scenario runs once per session (vLLM start-ups cost about a minute each here):

- ``cold``: no connector, the reference tokens.
- ``first``: the connector over redis-server S, stores the prompts' full blocks.
- ``first_pagedkv``: the same with pagedkv's attention backend (``PAGEDKV_VLLM_ATTENTION=1``,
  its own block layout), storing P into database 1 of S: the same tier values.
- then one stored value of prompt R gets a flipped byte in its K/V.
- ``second``: another instance over S: tenant B (another ``cache_salt``) gets no block of the
  unsalted prompts; a prompt sharing two blocks with P loads them; P then hits two blocks in
  the local prefix cache and loads the other two from the tier; R loads its first block,
  rejects the corrupted one and vLLM computes the rest.
- ``other_model``: another model fingerprint over S: no hit.
- ``chunked``: prefix caching off, chunked prefill in 64-token chunks: P loads from the tier,
  a new prompt is stored chunk by chunk, and its second run loads every block.
- ``pagedkv_loads_native`` and ``native_loads_pagedkv``: each attention backend loads P from
  the values the other stored.
- S is killed; ``dead``: an instance whose tier is down computes everything.

Skips, saying why, when vLLM, transformers, redis-py or redis-server is missing; with
``PAGEDKV_REQUIRE_VLLM=1`` (CI) a missing piece is a failure instead.
"""
from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))

from _vllm_support import (  # noqa: E402
    build_tiny_model,
    finish_instance,
    instance_env,
    missing_redis_server,
    missing_vllm,
    start_instance,
)

BLOCK = 32
MAX_TOKENS = 8

# Prompts (token ids < 512, the model's vocabulary). P has 4 full blocks vLLM may load
# ((150 - 1) // 32), R 3, Q shares P's first 2 blocks and then differs.
P = [(i * 37 + 11) % 500 + 3 for i in range(150)]
P_EDIT = P[:3] + [(P[3] + 1) % 500 + 3] + P[4:]
R = [(i * 91 + 5) % 497 + 7 for i in range(120)]
Q = P[:64] + [(i * 13 + 1) % 450 + 20 for i in range(40)]
# 6 full blocks, computed in 64-token chunks.
LONG = [(i * 53 + 29) % 490 + 9 for i in range(200)]


# ------------------------------------------------------------------ the instance processes
def _run_instance(spec_path, out_path):
    """One vLLM instance: generate each batch in turn, wait for the connector's writes, dump results."""
    spec = json.loads(Path(spec_path).read_text())
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    kwargs = {}
    if spec.get("extra") is not None:
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="PagedKVConnector", kv_connector_module_path="pagedkv.vllm", kv_role="kv_both",
            kv_connector_extra_config=spec["extra"])
    llm = LLM(model=spec["model"], dtype="float32", max_model_len=512, enforce_eager=True,
              skip_tokenizer_init=True, block_size=BLOCK, kv_cache_memory_bytes=2**26, seed=0,
              **spec.get("llm", {}), **kwargs)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, detokenize=False, ignore_eos=True)
    stats_path = (spec.get("extra") or {}).get("stats_path")
    results = []
    for prompt in spec["prompts"]:
        request = {"prompt_token_ids": prompt["tokens"]}
        if prompt.get("salt"):
            request["cache_salt"] = prompt["salt"]
        (output,) = llm.generate([request], params, use_tqdm=False)
        results.append({"tokens": list(output.outputs[0].token_ids),
                        "num_cached_tokens": output.num_cached_tokens})
        if stats_path:
            _wait_for_writes(stats_path)
    stats = _read_stats(stats_path) if stats_path else {}
    Path(out_path).write_text(json.dumps({"results": results, "stats": stats}))


def _wait_for_writes(stats_path, timeout=120):
    """Wait until the worker has written (or dropped, or failed) every block the scheduler planned."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = _read_stats(stats_path)
        worker, scheduler = stats.get("worker", {}), stats.get("scheduler", {})
        done = worker.get("written_blocks", 0) + worker.get("dropped_blocks", 0) + worker.get("write_errors", 0)
        if done >= scheduler.get("stored_blocks", 0) and worker.get("pending_blocks", 1) == 0:
            return
        time.sleep(0.1)


def _read_stats(path):
    stats = {}
    for file in glob.glob(os.path.join(path, "*.json")):
        role = os.path.basename(file).split("-")[0]
        stats[role] = json.loads(Path(file).read_text())
    return stats


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if sys.argv[1] == "build":
        build_tiny_model(sys.argv[2], "llama")
    else:
        _run_instance(sys.argv[2], sys.argv[3])
    sys.exit(0)


# ------------------------------------------------------------------ the tests
import numpy as np  # noqa: E402
import pytest  # noqa: E402

REQUIRED = os.environ.get("PAGEDKV_REQUIRE_VLLM") == "1"


def _missing():
    return missing_vllm(extra=[("redis", "the redis package (pip install 'pagedkv[vllm]')")]) + missing_redis_server()


if _missing():
    if REQUIRED:
        raise ImportError(f"PAGEDKV_REQUIRE_VLLM=1 but these are missing: {_missing()}")
    pytest.skip(f"missing {', '.join(_missing())}", allow_module_level=True)

import redis  # noqa: E402

from pagedkv.tiers._format import HEADER, PageLayout, check_value  # noqa: E402
from pagedkv_c._checksum import page_checksums  # noqa: E402
from pagedkv_c._prefix import token_page_input, xxh3_128_intdigest  # noqa: E402


# ------------------------------------------------------------------ redis-server
def _free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_redis(port, data_dir):
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", str(data_dir)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = redis.Redis(port=port, socket_connect_timeout=0.2)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            if client.ping():
                return proc
        except redis.exceptions.ConnectionError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"redis-server on port {port} does not answer PING")


def _stop(proc):
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()

LAYOUT = PageLayout.of_cache(2, 1, 64, BLOCK, np.float32, "xxh3_128")


def _start(tmp, name, model, prompts, extra, llm=None, env=None):
    return start_instance(HERE, tmp, name, {"model": str(model), "prompts": prompts, "extra": extra, "llm": llm or {}},
                          env)


_finish = finish_instance


def _hash_hex(tokens, salt=None):
    """The 32 hex digits of each full block's chained hash (the end of its tier key)."""
    from pagedkv_c._prefix import salt_digest
    salt_value = salt_digest("xxh3_128", salt)
    parent, out = 0, []
    for k in range(len(tokens) // BLOCK):
        parent = xxh3_128_intdigest(token_page_input(parent, salt_value, tokens[k * BLOCK:(k + 1) * BLOCK]))
        out.append(np.array([parent & (2**64 - 1), parent >> 64], dtype="<u8").tobytes().hex())
    return out


def _key_of(client, hash_hex):
    keys = [k for k in client.keys("pagedkv:*") if k.decode().endswith(hash_hex)]
    assert len(keys) == 1, keys
    return keys[0]


def _verify(value, tokens, k):
    """True when ``value`` is a valid page of block ``k`` of ``tokens`` (header, tokens, checksum)."""
    page_hash = np.frombuffer(bytes.fromhex(_hash_hex(tokens)[k]), dtype="<u8")
    kind, offset, checksum = check_value(value, LAYOUT, page_hash,
                                         np.asarray(tokens[k * BLOCK:(k + 1) * BLOCK], dtype=np.int32))
    if kind is not None:
        return False
    body = np.frombuffer(value, dtype=np.float32, offset=offset).reshape(2, 1, 2, BLOCK, 1, 64)
    return int(page_checksums(body, [0])[0]) == checksum


@pytest.fixture(scope="module")
def scenario(tmp_path_factory):
    """Run every instance of the module's scenario once; yields their results and findings."""
    tmp = tmp_path_factory.mktemp("vllm")
    model = tmp / "tiny-llama"
    subprocess.run([sys.executable, str(HERE), "build", str(model)], check=True, env=instance_env(), timeout=300)
    port = _free_port()
    server = _start_redis(port, tmp)
    url = f"redis://127.0.0.1:{port}/0"
    client = redis.Redis(port=port)
    found = {}
    try:
        def extra(name, **more):
            return {"tier": url, "namespace": "test", "stats_path": str(tmp / f"stats-{name}"), **more}

        pagedkv_env = instance_env(PAGEDKV_VLLM_ATTENTION="1")
        started = [_start(tmp, "cold", model, [{"tokens": P}, {"tokens": P_EDIT}, {"tokens": R}], None),
                   _start(tmp, "first", model, [{"tokens": P}, {"tokens": R}], extra("first")),
                   # pagedkv's attention backend (its own block layout) storing P into database 1
                   _start(tmp, "first_pagedkv", model, [{"tokens": P}],
                          extra("first_pagedkv", tier=url[:-1] + "1"), env=pagedkv_env)]
        found["cold"], found["first"], found["first_pagedkv"] = (_finish(tmp, s) for s in started)
        other_db = redis.Redis(port=port, db=1)
        found["pagedkv_values"] = [(client.get(_key_of(client, h)), other_db.get(_key_of(other_db, h)))
                                   for h in _hash_hex(P)]
        found["keys_after_first"] = sorted(client.keys("pagedkv:*"))

        # Flip one byte of the K/V of R's block 1.
        key = _key_of(client, _hash_hex(R)[1])
        value = bytearray(client.get(key))
        found["corrupt_was_valid"] = _verify(bytes(value), R, 1)
        value[-1] ^= 0x40
        client.set(key, bytes(value))
        found["corrupt_is_valid"] = _verify(bytes(value), R, 1)

        started = [_start(tmp, "second", model,
                          [{"tokens": P, "salt": "tenant-b"}, {"tokens": Q}, {"tokens": P}, {"tokens": R}],
                          extra("second")),
                   _start(tmp, "other_model", model, [{"tokens": P}],
                          extra("other_model", model_fingerprint="another-model")),
                   _start(tmp, "chunked", model, [{"tokens": P}, {"tokens": LONG}, {"tokens": LONG}],
                          extra("chunked"), llm={"enable_prefix_caching": False, "max_num_batched_tokens": 64}),
                   # each backend loads the blocks the other one stored
                   _start(tmp, "pagedkv_loads_native", model, [{"tokens": P}], extra("pagedkv_loads_native"),
                          env=pagedkv_env),
                   _start(tmp, "native_loads_pagedkv", model, [{"tokens": P}],
                          extra("native_loads_pagedkv", tier=url[:-1] + "1"))]
        (found["second"], found["other_model"], found["chunked"], found["pagedkv_loads_native"],
         found["native_loads_pagedkv"]) = (_finish(tmp, s) for s in started)
        found["repaired_is_valid"] = _verify(client.get(key), R, 1)
        found["salted_keys"] = [client.exists(_key_of_any(client, h)) for h in _hash_hex(P, "tenant-b")]

        _stop(server)
        server = None
        found["dead"] = _finish(tmp, _start(tmp, "dead", model, [{"tokens": P}], extra("dead")))
        yield found
    finally:
        if server is not None:
            _stop(server)


def _key_of_any(client, hash_hex):
    keys = [k for k in client.keys("pagedkv:*") if k.decode().endswith(hash_hex)]
    return keys[0] if keys else b"none"


def tokens(found, run, i):
    return found[run]["results"][i]["tokens"]


def cached(found, run, i):
    return found[run]["results"][i]["num_cached_tokens"]


def test_model_output_depends_on_context(scenario):
    # Otherwise wrong K/V would not change the tokens and the other tests could not see it.
    assert tokens(scenario, "cold", 0) != tokens(scenario, "cold", 1)


def test_first_instance_stores_every_full_prompt_block_once(scenario):
    first = scenario["first"]
    assert tokens(scenario, "first", 0) == tokens(scenario, "cold", 0)
    assert tokens(scenario, "first", 1) == tokens(scenario, "cold", 2)
    assert cached(scenario, "first", 0) == 0
    # 150 // 32 + 120 // 32 full prompt blocks, each written once.
    assert first["stats"]["scheduler"]["stored_blocks"] == 7
    assert first["stats"]["worker"]["written_blocks"] == 7
    assert first["stats"]["worker"]["dropped_blocks"] == 0
    assert first["stats"]["worker"]["bytes_written"] == 7 * (HEADER.size + 4 * BLOCK + LAYOUT.body_bytes)
    assert len(scenario["keys_after_first"]) == 7
    suffixes = {k.decode()[-32:] for k in scenario["keys_after_first"]}
    assert suffixes == set(_hash_hex(P) + _hash_hex(R))


def test_second_instance_loads_blocks_past_its_local_prefix_cache(scenario):
    # Q: its two blocks shared with P come from the tier.
    assert cached(scenario, "second", 1) == 2 * BLOCK
    # P: blocks 0-1 from vLLM's local prefix cache (Q put them there), 2-3 from the tier:
    # every full block P's first run stored, with one prompt token left to compute.
    assert cached(scenario, "second", 2) == 4 * BLOCK
    assert tokens(scenario, "second", 2) == tokens(scenario, "first", 0) == tokens(scenario, "cold", 0)
    scheduler = scenario["second"]["stats"]["scheduler"]
    worker = scenario["second"]["stats"]["worker"]
    # Lookups: P of tenant B (4 blocks, no hit), Q (3, 2 hits), P (the 2 past the local
    # hits, 2 hits), R (3, 3 hits by length: the corruption is found on load).
    assert scheduler["lookup_blocks"] == 4 + 3 + 2 + 3
    assert scheduler["hit_blocks"] == 0 + 2 + 2 + 3
    assert worker["loaded_blocks"] == 2 + 2 + 1
    assert worker["bytes_read"] == 5 * (HEADER.size + 4 * BLOCK + LAYOUT.body_bytes)


def test_tenants_never_share_a_block(scenario):
    # The unsalted P was in the tier; tenant B's P found none of it and computed all.
    assert cached(scenario, "second", 0) == 0
    assert tokens(scenario, "second", 0) == tokens(scenario, "cold", 0)
    # ... and stored its own 4 blocks under other keys.
    assert scenario["salted_keys"] == [1, 1, 1, 1]
    assert not set(_hash_hex(P, "tenant-b")) & set(_hash_hex(P))


def test_corrupted_value_is_recomputed_and_rewritten(scenario):
    assert scenario["corrupt_was_valid"] and not scenario["corrupt_is_valid"]
    assert tokens(scenario, "second", 3) == tokens(scenario, "cold", 2)
    worker = scenario["second"]["stats"]["worker"]
    assert worker["reject_checksum"] == 1
    # The corrupted block and the one after it went back to vLLM.
    assert worker["load_errors"] == 2
    # The recomputed block was written again, valid.
    assert scenario["repaired_is_valid"]


def test_other_model_fingerprint_gets_no_hit(scenario):
    scheduler = scenario["other_model"]["stats"]["scheduler"]
    assert scheduler["lookup_blocks"] == 4 and scheduler["hit_blocks"] == 0
    assert cached(scenario, "other_model", 0) == 0
    assert tokens(scenario, "other_model", 0) == tokens(scenario, "cold", 0)


def test_dead_tier_is_a_miss(scenario):
    scheduler = scenario["dead"]["stats"]["scheduler"]
    worker = scenario["dead"]["stats"]["worker"]
    assert scheduler["lookup_errors"] == 1 and scheduler["hit_blocks"] == 0
    assert cached(scenario, "dead", 0) == 0
    assert tokens(scenario, "dead", 0) == tokens(scenario, "cold", 0)
    # Its writes failed and were counted, the request was not.
    assert worker["write_errors"] == 4


def test_chunked_prefill_without_prefix_caching(scenario):
    chunked = scenario["chunked"]
    # P: every loadable block from the tier (none from a local prefix cache: it is off).
    assert cached(scenario, "chunked", 0) == 4 * BLOCK
    assert tokens(scenario, "chunked", 0) == tokens(scenario, "cold", 0)
    # LONG: computed in 64-token chunks and stored as they completed its 6 blocks, then
    # loaded whole by its second run.
    assert cached(scenario, "chunked", 1) == 0
    assert cached(scenario, "chunked", 2) == 6 * BLOCK
    assert tokens(scenario, "chunked", 2) == tokens(scenario, "chunked", 1)
    assert chunked["stats"]["scheduler"]["stored_blocks"] == 6
    assert chunked["stats"]["worker"]["written_blocks"] == 6
    assert chunked["stats"]["worker"]["loaded_blocks"] == 4 + 6


# ------------------------------------------------------------------ in-process parts
@pytest.fixture(scope="module")
def connector_module():
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")     # vLLM's and torch's imports warn about their own deprecations
        import pagedkv.vllm as module
    return module


@pytest.mark.parametrize("extra, key", [
    ({}, "tier"),
    ({"tier": ""}, "tier"),
    ({"tier": "redis://h:1", "hash_algorithm": "md5"}, "hash_algorithm"),
    ({"tier": "redis://h:1", "ttl_seconds": 0}, "ttl_seconds"),
    ({"tier": "redis://h:1", "timeout_seconds": 0}, "timeout_seconds"),
    ({"tier": "redis://h:1", "max_queue_bytes": -1}, "max_queue_bytes"),
    ({"tier": "redis://h:1", "load_failure_policy": "ignore"}, "load_failure_policy"),
    ({"tier": "redis://h:1", "namespace": 3}, "namespace"),
    ({"tier": "redis://h:1", "tire": "x"}, "tire"),
])
def test_bad_extra_config_names_the_key(connector_module, extra, key):
    with pytest.raises(ValueError, match=key):
        connector_module.ConnectorOptions.from_extra_config(extra)


def test_stats_aggregate_and_reach_prometheus(connector_module):
    from types import SimpleNamespace

    import prometheus_client
    stats = connector_module.PagedKVConnector.build_kv_connector_stats({"hit_blocks": 2, "loaded_blocks": 2})
    stats.aggregate(connector_module.PagedKVConnectorStats(data={"hit_blocks": 1, "reject_checksum": 1}))
    assert stats.reduce() == {"hit_blocks": 3, "loaded_blocks": 2, "reject_checksum": 1}
    assert not stats.is_empty() and connector_module.PagedKVConnectorStats(data={"lookups": 0}).is_empty()
    registry_before = set(prometheus_client.REGISTRY._names_to_collectors)
    metrics = connector_module.PagedKVConnector.build_prom_metrics(
        SimpleNamespace(kv_transfer_config=None),
        {prometheus_client.Gauge: prometheus_client.Gauge, prometheus_client.Counter: prometheus_client.Counter,
         prometheus_client.Histogram: prometheus_client.Histogram},
        ["model_name", "engine"], {0: ["tiny", "0"]})
    try:
        metrics.observe(stats.data, 0)
        value = prometheus_client.REGISTRY.get_sample_value("vllm:pagedkv_hit_blocks_total",
                                                            {"model_name": "tiny", "engine": "0"})
        assert value == 3
    finally:
        for name, collector in list(prometheus_client.REGISTRY._names_to_collectors.items()):
            if name not in registry_before:
                try:
                    prometheus_client.REGISTRY.unregister(collector)
                except KeyError:
                    pass


# ------------------------------------------------------------------ with pagedkv's attention backend
def test_pagedkv_attention_backend_stores_the_same_pages(scenario):
    # PAGEDKV_VLLM_ATTENTION=1: vLLM's blocks hold pagedkv's page layout; the connector stores
    # the same tier values as with vLLM's own attention (K/V equal up to float rounding).
    assert tokens(scenario, "first_pagedkv", 0) == tokens(scenario, "cold", 0)
    assert scenario["first_pagedkv"]["stats"]["worker"]["written_blocks"] == 4
    for k, (native, pagedkv) in enumerate(scenario["pagedkv_values"]):
        assert _verify(native, P, k) and _verify(pagedkv, P, k)
        offset = len(native) - LAYOUT.body_bytes
        # the same header (layout, hash) and token ids; the checksums follow the bodies
        assert native[:HEADER.size - 16] == pagedkv[:HEADER.size - 16]
        assert native[HEADER.size - 8:offset] == pagedkv[HEADER.size - 8:offset]
        np.testing.assert_allclose(np.frombuffer(pagedkv, np.float32, offset=offset),
                                   np.frombuffer(native, np.float32, offset=offset), rtol=1e-4, atol=1e-4)


def test_each_attention_backend_loads_the_pages_of_the_other(scenario):
    for run in ("pagedkv_loads_native", "native_loads_pagedkv"):
        assert cached(scenario, run, 0) == 4 * BLOCK, run
        assert scenario[run]["stats"]["worker"]["loaded_blocks"] == 4, run
        assert tokens(scenario, run, 0) == tokens(scenario, "cold", 0), run


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("pagedkv_pages", [False, True])
def test_block_layouts_convert_to_pagedkv_pages_and_back(connector_module, dtype, pagedkv_pages):
    # The K/V vLLM's own CPU kernels (or pagedkv's backend) write, read back as pagedkv pages
    # [2, block_size, H, D] and written again through the load path.
    import torch
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    heads, block, dim, num_blocks = 3, 32, 64, 4
    torch_dtype = getattr(torch, dtype)
    connector = object.__new__(connector_module.PagedKVConnector)
    connector.num_kv_heads, connector.block_size, connector.head_dim = heads, block, dim
    connector._uses_pagedkv_pages = pagedkv_pages
    connector.layer_names = ["layer"]
    gen = torch.Generator().manual_seed(0)
    key = torch.randn(num_blocks * block, heads, dim, generator=gen).to(torch_dtype)
    value = torch.randn(num_blocks * block, heads, dim, generator=gen).to(torch_dtype)
    kv = torch.zeros(num_blocks, heads, block, 2 * dim, dtype=torch_dtype)
    if pagedkv_pages:
        kv.view(num_blocks, 2, block, heads, dim).copy_(torch.stack((key, value)).view(2, num_blocks, block, heads, dim)
                                                        .transpose(0, 1))
    else:
        caches = kv.view(num_blocks, heads, 2 * block, dim).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(key, value, *caches, torch.arange(num_blocks * block),
                                       _get_attn_isa(torch_dtype, block, dim, "auto"), k_scale=1.0, v_scale=1.0,
                                       kv_cache_dtype="auto")
    ids = torch.tensor([2, 0])
    pages = connector._block_view(kv, ids)
    want = torch.stack((key.view(num_blocks, block, heads, dim), value.view(num_blocks, block, heads, dim)), dim=1)
    assert torch.equal(pages, want[ids])
    connector._kv_caches = {"layer": torch.zeros_like(kv)}
    for i, block_id in enumerate(ids.tolist()):
        connector._copy_in(block_id, pages[i].numpy()[None, None])
    assert torch.equal(connector._kv_caches["layer"][ids], kv[ids])
