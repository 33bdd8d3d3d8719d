"""``--metrics-port``, ``--metrics-addr`` and ``--metrics-file`` of the commands that drive a cache.

While a command runs, prometheus_client's own HTTP server serves ``/metrics``
for the cache it drives (:class:`pagedkv.metrics.Collector`); at the end the
exposition text is written to ``--metrics-file``. A command that drives
several caches one after another (``replay`` over several capacities) labels
each cache's samples (``capacity_tokens``) and keeps the final values of the
finished ones, so the server and the file show every cache of the run.
"""
from __future__ import annotations

import argparse
import sys
from typing import Any

from pagedkv.commands._paths import output_file

DEFAULT_ADDR = "127.0.0.1"


def port_number(text: str) -> int:
    """argparse type: a TCP port, 0 (any free port) to 65535."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number 0..65535, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port number 0..65535, got {value}")
    return value


def add_metrics_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--metrics-port N``, ``--metrics-addr A`` and ``--metrics-file F`` to ``parser``."""
    parser.add_argument("--metrics-port", type=port_number, default=None, metavar="N",
                        help="serve Prometheus metrics of the cache at http://ADDR:N/metrics while the "
                             "command runs (0: any free port, printed on stderr); needs prometheus_client: "
                             'pip install "pagedkv[metrics]"')
    parser.add_argument("--metrics-addr", default=DEFAULT_ADDR, metavar="ADDR",
                        help=f"address the metrics server binds (default {DEFAULT_ADDR}, this machine only; "
                             "0.0.0.0 for every interface)")
    parser.add_argument("--metrics-file", type=output_file, default=None, metavar="F",
                        help="write the final Prometheus exposition text of the run's metrics to F")


def _merge(groups: list[list[Any]]) -> list[Any]:
    """One family per name with the samples of every group (each group is one collector's families)."""
    from prometheus_client import Metric

    merged: dict[str, Any] = {}
    for families in groups:
        for family in families:
            if family.name not in merged:
                merged[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
            merged[family.name].samples.extend(family.samples)
    return list(merged.values())


class RunMetrics:
    """The metrics of one command run: an optional HTTP server and the final text file.

    Parameters
    ----------
    args : argparse.Namespace
        With ``metrics_port``, ``metrics_addr`` and ``metrics_file`` (see
        :func:`add_metrics_arguments`).
    command : str
        The subcommand's name, for messages.

    Raises
    ------
    CommandError
        prometheus_client is missing while an option asks for metrics, or the
        server cannot bind ``--metrics-addr:--metrics-port``.
    """

    def __init__(self, args: argparse.Namespace, command: str) -> None:
        from pagedkv.commands._model_options import CommandError

        self.enabled = args.metrics_port is not None or args.metrics_file is not None
        self._file = args.metrics_file
        self._finished: list[list[Any]] = []
        self._live: Any = None
        self._live_cache: Any = None  # kept alive until detach() freezes its final values
        self._server: Any = None
        if not self.enabled:
            return
        try:
            import prometheus_client
        except ImportError:
            raise CommandError('--metrics-port and --metrics-file need prometheus_client: '
                               'pip install "pagedkv[metrics]"') from None
        self._registry = prometheus_client.CollectorRegistry(auto_describe=False)
        self._registry.register(self)
        if args.metrics_port is not None:
            try:
                self._server, _ = prometheus_client.start_http_server(
                    args.metrics_port, addr=args.metrics_addr, registry=self._registry)
            except OSError as exc:
                raise CommandError(f"cannot serve metrics on {args.metrics_addr}:{args.metrics_port}: "
                                   f"{exc.strerror or exc}") from None
            host = args.metrics_addr if ":" not in args.metrics_addr else f"[{args.metrics_addr}]"
            print(f"pagedkv {command}: serving metrics at http://{host}:{self._server.server_port}/metrics",
                  file=sys.stderr)

    def attach(self, cache: Any, labels: dict[str, str] | None = None) -> None:
        """Report ``cache`` from now on (the previous cache's final values are kept)."""
        if not self.enabled:
            return
        from pagedkv.metrics import Collector

        self.detach()
        self._live = Collector(cache, labels=labels)
        self._live_cache = cache

    def detach(self) -> None:
        """Freeze the current cache's values (call when its run ends, while it is alive)."""
        if self._live is not None:
            self._finished.append(list(self._live.collect()))
            self._live = self._live_cache = None

    def collect(self) -> list[Any]:
        """The families of every cache of the run (``prometheus_client`` collector protocol)."""
        groups = list(self._finished)
        live = self._live
        if live is not None:
            groups.append(list(live.collect()))
        return _merge(groups)

    def close(self) -> str | None:
        """Write ``--metrics-file`` and stop the server; return an error message, or None.

        The message says why the file could not be written (the server is
        stopped either way).
        """
        if not self.enabled:
            return None
        self.detach()
        error = None
        if self._file is not None:
            from prometheus_client import generate_latest

            try:
                with open(self._file, "wb") as out:
                    out.write(generate_latest(self._registry))
            except OSError as exc:
                error = f"cannot write --metrics-file {self._file!r}: {exc.strerror or exc}"
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        return error
