"""Prometheus metrics of a cache: a custom collector for ``prometheus_client``.

:class:`Collector` reads a cache's counters when Prometheus scrapes, with one
``stats()`` call (the only time it takes the cache's lock); nothing runs in
the cache's own calls beyond the plain C counters the core always keeps.

Names follow the Prometheus conventions (base units, ``_total`` on counters,
``_info`` on the configuration) and mirror vLLM's v1 engine metrics where the
meaning is the same, so a dashboard written for ``vllm:kv_cache_usage_perc``,
``vllm:prefix_cache_queries_total`` or ``vllm:prefix_cache_hits_total``
translates by swapping the prefix. The full table is in ``docs/operating.md``.

``prometheus_client`` is an optional dependency (``pip install
"pagedkv[metrics]"``): this module imports without it, and creating a
:class:`Collector` without it raises ImportError naming the extra.

Example
-------
>>> from prometheus_client import start_http_server
>>> from pagedkv.metrics import Collector
>>> Collector(cache, labels={"model_name": "smollm2"}).register()  # doctest: +SKIP
>>> start_http_server(9400, addr="127.0.0.1")  # doctest: +SKIP
"""
from __future__ import annotations

import re
import weakref
from collections.abc import Iterator, Mapping
from typing import Any

from pagedkv_c._classic import PagedKVCache
from pagedkv_c._kv_cache import PREFIX_HIT_BUCKETS, KVCache

__all__ = ["Collector", "exposition_text"]

INSTALL_HINT = 'pip install "pagedkv[metrics]" (from a checkout: pip install ".[metrics]")'
_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")


def _prometheus() -> Any:
    """The ``prometheus_client`` module; ImportError naming the extra without it."""
    try:
        import prometheus_client
        import prometheus_client.core
    except ImportError as exc:
        raise ImportError(
            f"pagedkv.metrics needs prometheus_client, which is not installed: {INSTALL_HINT}"
        ) from exc
    return prometheus_client


def _check_labels(labels: Mapping[str, str] | None, reserved: set[str]) -> dict[str, str]:
    if labels is None:
        return {}
    if not isinstance(labels, Mapping):
        raise TypeError(f"Invalid type of labels: expected a mapping of str to str, got {type(labels).__name__}")
    out = {}
    for name, value in labels.items():
        if not isinstance(name, str) or not isinstance(value, str):
            raise TypeError(
                f"Invalid type of labels: expected str names and values, got {name!r}: {value!r}"
            )
        if not _NAME.fullmatch(name) or name.startswith("__"):
            raise ValueError(
                f"Invalid value of labels: expected label names matching [a-zA-Z_][a-zA-Z0-9_]* "
                f"and not starting with '__', got {name!r}"
            )
        if name in reserved:
            raise ValueError(
                f"Invalid value of labels: {name!r} is a label of the collector's own metrics "
                f"(reserved: {sorted(reserved)})"
            )
        out[name] = value
    return out


def _config_of(cache: KVCache | PagedKVCache) -> dict[str, str]:
    """The cache's configuration as the labels of the info metric (read once: it never changes)."""
    if isinstance(cache, KVCache):
        index = cache.prefix_index
        return {
            "cache": "KVCache",
            "num_layers": str(cache.num_layers),
            "num_kv_heads": str(cache.num_kv_heads),
            "head_dim": str(cache.head_dim),
            "num_pages": str(cache.num_pages),
            "page_size": str(cache.page_size),
            "dtype": cache.kv_dtype,  # the page format: bfloat16, int8 and int4 pools hold uint16/uint8
            "window": "none" if cache.window is None else str(cache.window),
            "sink_tokens": str(cache.sink_tokens),
            "prefix_caching": "true" if index is not None else "false",
            "prefix_hash": index.algorithm_name if index is not None else "none",
        }
    return {
        "cache": "PagedKVCache",
        "num_pages": str(cache.max_pages),
        "page_size": str(cache.page_size),
        "dim": str(cache.dim),
        "dtype": str(cache.dtype),
    }


class Collector:
    """A ``prometheus_client`` custom collector of one cache's metrics.

    Parameters
    ----------
    cache : pagedkv.KVCache or pagedkv.PagedKVCache
        The cache to report. Held by a weak reference: the collector does not
        keep the cache alive, and once the cache is garbage collected a scrape
        reports nothing for it and drops the collector from the registries it
        joined through :meth:`register`.
    namespace : str
        Prefix of every metric name, ``[a-zA-Z_][a-zA-Z0-9_]*``; default
        ``"pagedkv"`` (``pagedkv_kv_cache_usage_perc``, ...). Two collectors
        in one registry need different namespaces (the registry refuses
        duplicate names).
    labels : mapping of str to str, optional
        Constant labels attached to every sample of every family, e.g.
        ``{"model_name": "smollm2-135m"}``. Names follow Prometheus's rule
        and may not be ``le`` (histogram buckets) or a label of the
        configuration info metric.

    Raises
    ------
    ImportError
        ``prometheus_client`` is not installed (``pip install
        "pagedkv[metrics]"``).
    TypeError
        ``cache`` is not a ``KVCache`` or ``PagedKVCache``; ``namespace`` is
        not a str; ``labels`` is not a mapping of str to str.
    ValueError
        A namespace or label name that Prometheus does not allow, or a
        reserved label name.

    Notes
    -----
    A scrape calls ``cache.stats(metrics=True)`` once (``stats()`` for a
    ``PagedKVCache``): the cache's lock is held for that call only, and the
    metric families are built after it returns. The families are listed in
    ``docs/operating.md``; counters carry ``_total``, the usage fraction is
    ``kv_cache_usage_perc`` (0 to 1, vLLM's name and scale), and prefix
    cache queries and hits are counters in tokens as in vLLM v1
    (``vllm:prefix_cache_queries`` / ``vllm:prefix_cache_hits``), so the hit
    rate is a PromQL ratio of their rates, never a gauge that hides the
    window.
    """

    def __init__(self, cache: KVCache | PagedKVCache, *, namespace: str = "pagedkv",
                 labels: Mapping[str, str] | None = None) -> None:
        self._prom = _prometheus()
        if not isinstance(cache, (KVCache, PagedKVCache)):
            raise TypeError(
                f"Invalid type of cache: expected pagedkv.KVCache or pagedkv.PagedKVCache, "
                f"got {type(cache).__name__}"
            )
        if not isinstance(namespace, str):
            raise TypeError(f"Invalid type of namespace: expected str, got {type(namespace).__name__}")
        if not _NAME.fullmatch(namespace):
            raise ValueError(
                f"Invalid value of namespace: expected a name matching [a-zA-Z_][a-zA-Z0-9_]*, got {namespace!r}"
            )
        self._config = _config_of(cache)
        self._labels = _check_labels(labels, {"le", *self._config})
        self._namespace = namespace
        self._cache_ref = weakref.ref(cache)
        self._classic = isinstance(cache, PagedKVCache)
        self._registries: list[Any] = []

    # -------------------------------------------------------------- registry
    def register(self, registry: Any = None) -> Collector:
        """Register with ``registry`` (default: ``prometheus_client.REGISTRY``); return self.

        A collector registered this way leaves the registry at the first
        scrape after its cache was garbage collected.

        Raises
        ------
        ValueError
            The registry already has a metric of one of these names
            (``prometheus_client``'s duplicate check).
        """
        if registry is None:
            registry = self._prom.REGISTRY
        registry.register(self)
        self._registries.append(registry)
        return self

    @property
    def cache(self) -> KVCache | PagedKVCache | None:
        """The cache, or None once it was garbage collected."""
        return self._cache_ref()

    # ------------------------------------------------------------ collecting
    def describe(self) -> list[Any]:
        """The metric families without samples (``prometheus_client`` checks names with it)."""
        return list(self._families(None))

    def collect(self) -> Iterator[Any]:
        """Yield the metric families with the cache's current values (one ``stats()`` call)."""
        cache = self._cache_ref()
        if cache is None:
            self._leave_registries()
            return iter(())
        stats: dict[str, Any] = cache.stats(metrics=True) if isinstance(cache, KVCache) else cache.stats()
        del cache  # the weak reference alone decides the collector's life
        return self._families(stats)

    def _leave_registries(self) -> None:
        # Called while a registry iterates a copy of its collectors, outside its lock.
        registries, self._registries = self._registries, []
        for registry in registries:
            try:
                registry.unregister(self)
            except KeyError:  # the user unregistered it already
                pass

    def _families(self, stats: dict[str, Any] | None) -> Iterator[Any]:
        core = self._prom.core
        ns = self._namespace
        keys = list(self._labels)
        values = list(self._labels.values())

        def family(kind: Any, name: str, doc: str, value: float) -> Any:
            """A metric family ``<namespace>_<name>`` of ``kind`` with the user labels and one sample ``value``."""
            metric = kind(f"{ns}_{name}", doc, labels=keys)
            if stats is not None:
                metric.add_metric(values, value)
            return metric

        def counter(name: str, doc: str, key: str) -> Any:
            """A counter family read from ``stats()[key]`` (0 when the key is absent)."""
            return family(core.CounterMetricFamily, name, doc, stats.get(key, 0) if stats else 0)

        def gauge(name: str, doc: str, value: float) -> Any:
            """A gauge family holding ``value``."""
            return family(core.GaugeMetricFamily, name, doc, value)

        info = core.InfoMetricFamily(f"{ns}_cache_config", "Configuration of the cache.", labels=keys)
        if stats is not None:
            info.add_metric(values, self._config)
        yield info
        get = (lambda key: stats[key]) if stats is not None else (lambda key: 0)
        if self._classic:
            capacity = get("max_pages") or 1
            yield gauge("num_pages", "Page limit of the cache, in pages.", get("max_pages"))
            yield gauge("pages_in_use", "Resident pages.", get("num_resident_pages"))
            yield gauge("kv_cache_usage_perc", "Fraction of the page limit resident, from 0 to 1.",
                        get("num_resident_pages") / capacity)
            yield gauge("tokens", "Tokens present in the cache.", get("num_tokens"))
            yield counter("cache_hits", "Token lookups (get, get_many) that found the token.", "hits")
            yield counter("cache_misses", "Token lookups (get, get_many) that did not find the token.", "misses")
            yield counter("pages_evicted", "Resident pages evicted (oldest first) to make room.", "evictions")
            return
        num_pages = get("num_pages") or 1
        yield gauge("num_pages", "Pages in the pool (one page id covers every layer).", get("num_pages"))
        yield gauge("pages_free", "Pages in the free queue, cached free pages included.", get("pages_free"))
        yield gauge("pages_in_use", "Pages referenced by at least one sequence.", get("pages_in_use"))
        yield gauge("pages_cached_free", "Free pages still findable by prefix hash.",
                    stats.get("prefix_cached_free_pages", 0) if stats else 0)
        yield gauge("pages_in_use_peak", "Most pages in use at once since the cache was made.", get("pages_peak"))
        yield gauge("kv_cache_usage_perc", "Fraction of the pool's pages in use, from 0 to 1.",
                    get("pages_in_use") / num_pages)
        yield gauge("kv_cache_used_bytes", "Bytes of K/V in the pages in use, all layers.", get("bytes_in_use"))
        yield gauge("prefix_cache_pages", "Pages findable by prefix hash, in use or free.",
                    stats.get("prefix_cached_pages", 0) if stats else 0)
        yield gauge("sequences", "Sequences in the cache.", get("num_sequences"))
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", "prefix_queries")
        yield counter("prefix_cache_hits", "Prompt tokens served from cached pages.", "prefix_hits")
        yield counter("pages_allocated", "Pages taken from the free queue (new pages and copy-on-write copies).",
                      "pages_allocated")
        yield counter("prefix_cache_pages_evicted",
                      "Cached pages dropped from the prefix index because the allocator reused them.",
                      "prefix_evictions")
        yield counter("window_pages_released", "Page-table entries released by the sliding window.", "evictions")
        yield counter("window_pages_reused", "Window pages a sequence's ring reused in place.", "ring_reuses")
        yield counter("pages_copied_on_write", "Shared pages copied before a write (copy-on-write).",
                      "cow_copies")
        yield counter("out_of_pages_errors", "Appends refused with OutOfPagesError.", "out_of_pages_errors")
        yield counter("sequences_added", "Sequences created by add_sequence and fork.", "sequences_added")
        yield counter("tokens_appended", "Tokens reserved by append.", "tokens_appended")
        if stats is not None and "kv_events_dropped" in stats:  # KVCache(enable_kv_events=True)
            yield counter("kv_events_recorded", "Page-level KV events recorded for take_kv_events.",
                          "kv_events_recorded")
            yield counter("kv_events_dropped", "Page-level KV events dropped because the event log was full.",
                          "kv_events_dropped")
        if self._config["prefix_caching"] == "true":
            hist = core.HistogramMetricFamily(
                f"{ns}_prefix_cache_hit_tokens", "Tokens served from the prefix cache per prompt lookup.",
                labels=keys)
            if stats is not None:
                counts = stats["prefix_hit_histogram"]
                cumulative, buckets = 0, []
                for bound, count in zip([*PREFIX_HIT_BUCKETS, float("inf")], counts):
                    cumulative += count
                    buckets.append(("+Inf" if bound == float("inf") else str(bound), cumulative))
                hist.add_metric(values, buckets, sum_value=stats["prefix_hits"])
            yield hist


def exposition_text(collector: Collector) -> str:
    """The Prometheus text exposition of one collector's metrics (what ``/metrics`` serves).

    Raises
    ------
    TypeError
        ``collector`` is not a :class:`Collector`.
    """
    if not isinstance(collector, Collector):
        raise TypeError(f"Invalid type of collector: expected pagedkv.metrics.Collector, got {type(collector).__name__}")
    prom = _prometheus()
    registry = prom.CollectorRegistry(auto_describe=False)
    registry.register(collector)
    text: bytes = prom.generate_latest(registry)
    return text.decode()
