"""``pagedkv tier``: see what a shared prefix tier (Redis, Valkey) holds."""
from __future__ import annotations

import argparse
import sys
from collections import Counter

from pagedkv.commands._model_options import counted
from pagedkv.commands._paths import redacted_in, redacted_url

# Longest --timeout: RedisTier's limit (a longer one overflows the clients' deadlines).
MAX_TIMEOUT_SECONDS = 86400


def _namespace(text: str) -> str:
    """argparse type of ``--namespace``: a non-empty string (RedisTier refuses an empty one)."""
    if not text:
        raise argparse.ArgumentTypeError("expected a non-empty namespace, got ''")
    return text


def _timeout_seconds(text: str) -> float:
    """argparse type of ``--timeout``: seconds, a number in (0, 86400]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not 0 < value <= MAX_TIMEOUT_SECONDS:
        raise argparse.ArgumentTypeError(f"expected a number of seconds in (0, {MAX_TIMEOUT_SECONDS}], got {text}")
    return value

DESCRIPTION = """\
Look at what a shared prefix tier holds before trusting it: `info` scans the server (every
node of a cluster) for pagedkv's page keys (pagedkv:<namespace digest>:<page hash>) and
prints, per namespace digest, the number of pages, their bytes and the cache layout read
from one page's header. A namespace digest covers a model fingerprint and a cache layout
(see docs/tier.md); with --namespace NS the digest that NS gives for that layout is marked,
so a wrong URL or namespace shows as pages missing from the line you expected.

    pagedkv tier info redis://127.0.0.1:6379/0 --namespace NS
    pagedkv tier info redis+cluster://127.0.0.1:30001,127.0.0.1:30002,127.0.0.1:30003

`pagedkv generate --tier URL` prints its URL, its namespace (by default gguf-sha256:<the
SHA-256 of the GGUF file>, see --model-fingerprint) and the `tier info` command that marks it.
"""

#: Keys fetched per round trip (SCAN COUNT, and STRLEN / GETRANGE pipelines).
_BATCH = 1000


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``tier`` subcommand (with ``info``) to ``subparsers`` and return its parser."""
    parser = subparsers.add_parser(
        "tier",
        help="show what a shared prefix tier (Redis, Valkey) holds, per namespace",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    actions = parser.add_subparsers(dest="tier_command", required=True, metavar="ACTION")
    info = actions.add_parser(
        "info", help="count the pages and bytes of each namespace on a tier",
        description="Scan URL for pagedkv page keys; print pages, bytes and layout per namespace digest.")
    info.add_argument("url", metavar="URL",
                      help="redis://HOST:PORT/DB, rediss://..., or redis+cluster://HOST:PORT[,HOST:PORT...]")
    info.add_argument("--namespace", action="append", default=[], metavar="NS", type=_namespace,
                      help="mark the digest of this namespace (a model fingerprint; repeatable)")
    info.add_argument("--timeout", type=_timeout_seconds, default=5.0, metavar="SECONDS",
                      help="connect and read timeout per command, in seconds, at most 86400 (default 5)")
    info.set_defaults(info_parser=info)
    return parser


def _layout_of(header: bytes):
    """The PageLayout a value header states, or None if it is not a page value header."""
    from pagedkv.tiers import _format

    if len(header) < _format.HEADER.size:
        return None
    (magic, version, _flags, layers, heads, dim, page_size, dtype_code, hash_code, *_rest) = \
        _format.HEADER.unpack_from(header)
    dtypes = {code: dtype for dtype, code in _format._DTYPE_CODES.items()}
    hashes = {code: name for name, code in _format._HASH_CODES.items()}
    if magic != _format.MAGIC or version != _format.FORMAT_VERSION or dtype_code not in dtypes \
            or hash_code not in hashes:
        return None
    if dtypes[dtype_code] in ("int8", "int4") and dim > 256:
        return None
    return _format.PageLayout.of_cache(layers, heads, dim, page_size, dtypes[dtype_code], hashes[hash_code])


def _nodes(client, is_cluster: bool) -> list:
    """One plain client per primary of a cluster, or the client itself."""
    if not is_cluster:
        return [client]
    return [client.get_redis_connection(node) for node in client.get_primaries()]


def tier_info(url: str, namespaces: list[str], timeout: float, out=None) -> int:
    """Print the namespaces that ``url`` holds pages of; return the number of pages found.

    Raises
    ------
    ValueError
        ``url`` is not a Redis URL.
    redis.exceptions.RedisError, redis.exceptions.RedisClusterException, OSError
        The server (or every node of the cluster) cannot be reached, or answers with an error.
    """
    from pagedkv.tiers.redis import _connect

    out = sys.stdout if out is None else out
    client, is_cluster = _connect(url, timeout)
    if callable(client) and is_cluster:
        client = client()
    pages: Counter = Counter()
    value_bytes: Counter = Counter()
    first_key: dict = {}
    for node in _nodes(client, is_cluster):
        for keys in _scan(node):
            with node.pipeline(transaction=False) as pipe:
                for key in keys:
                    pipe.strlen(key)
                sizes = pipe.execute()
            for key, size in zip(keys, sizes):
                digest = key.split(b":")[1]
                pages[digest] += 1
                value_bytes[digest] += int(size)
                first_key.setdefault(digest, (node, key))
    print(f"tier {redacted_url(url)}: {counted(sum(pages.values()), 'page')} in "
          f"{counted(len(pages), 'namespace')}", file=out)
    marked = set()
    for digest in sorted(pages, key=lambda d: -pages[d]):
        node, key = first_key[digest]
        layout = _layout_of(node.getrange(key, 0, 127) or b"")
        described = layout.describe() if layout is not None else "unknown layout (not a page value header)"
        mine = [ns for ns in namespaces
                if layout is not None and layout.key_prefix(ns) == b"pagedkv:" + digest + b":"]
        marked.update(mine)
        note = "".join(f"  <- namespace {ns!r}" for ns in mine)
        print(f"  pagedkv:{digest.decode()}:  {counted(pages[digest], 'page')}, {_format_bytes(value_bytes[digest])}, "
              f"{described}{note}", file=out)
    for ns in namespaces:
        if ns not in marked:
            print(f"  namespace {ns!r}: no pages here (for any layout found on this tier)", file=out)
    if not is_cluster and _is_cluster_node(client):
        print(f"  note: this server is one node of a Redis Cluster, and these counts are only its share "
              f"of the keys; count every primary with redis+cluster://{_host_port(client)}", file=out)
    return sum(pages.values())


def _is_cluster_node(client) -> bool:
    """True when a plain ``redis://`` connection reached a node with cluster mode enabled."""
    try:
        return int(client.info("cluster").get("cluster_enabled", 0)) == 1
    except Exception:  # an INFO section a proxy or an older server does not answer: no note
        return False


def _host_port(client) -> str:
    kwargs = client.connection_pool.connection_kwargs
    return f"{kwargs.get('host', '127.0.0.1')}:{kwargs.get('port', 6379)}"


def _scan(node):
    """The page keys of one node, in batches."""
    cursor = 0
    while True:
        cursor, keys = node.scan(cursor=cursor, match=b"pagedkv:*", count=_BATCH)
        keys = [key for key in keys if key.count(b":") == 2]
        if keys:
            yield keys
        if cursor == 0:
            return


def _format_bytes(count: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= size:
            return f"{count / size:.1f} {unit}"
    return f"{count} bytes"


def run(args: argparse.Namespace) -> int:
    """Run ``pagedkv tier info``; return the exit status (0, or 2 on an error)."""
    try:
        import redis
    except ModuleNotFoundError as exc:
        print(f"pagedkv tier: {exc.name} is not installed: pip install 'pagedkv[redis]'", file=sys.stderr)
        return 2
    try:
        tier_info(args.url, args.namespace, args.timeout)
    except ValueError as exc:
        # the client's reason (a bad port, database or node address) after the forms it takes
        reason = str(exc).split(": ", 1)[-1] if str(exc).startswith("Invalid value of url_or_client") else str(exc)
        reason = redacted_in(reason.split("; expected redis://")[0], args.url)  # the forms are said once
        # a reason that is only the forms again adds nothing
        detail = "" if reason.startswith("expected ") else f" ({reason})"
        args.info_parser.error(f"argument URL: expected redis://HOST:PORT/DB, rediss://... or "
                               f"redis+cluster://HOST:PORT[,HOST:PORT...], got {redacted_url(args.url)!r}{detail}")
    except (redis.exceptions.RedisError, redis.exceptions.RedisClusterException, OSError) as exc:
        # RedisClusterException (a cluster none of whose nodes answers) is not a RedisError
        print(f"pagedkv tier: cannot read {redacted_url(args.url)}: {exc}", file=sys.stderr)
        return 2
    return 0
