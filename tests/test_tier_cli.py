"""`pagedkv tier info` and the tier line of `pagedkv generate --tier`, against real servers
(the standalone redis-server and the 3-node cluster of tests/test_tier.py)."""
import uuid

import numpy as np
import pytest

from test_tier import cluster, standalone  # noqa: F401  (fixtures: real servers on loopback)

from pagedkv import KVCache
from pagedkv.cli import main
from pagedkv.tiers import RedisTier


def _write_pages(url, namespace, num_pages, page_size=4):
    """Seal ``num_pages`` full pages of one prompt into the tier under ``namespace``; return the layout text."""
    tier = RedisTier(url, namespace=namespace)
    cache = KVCache(2, 1, 8, num_pages=64, page_size=page_size, enable_prefix_caching=True, tier=tier)
    tokens = list(range(num_pages * page_size + 1))
    cache.add_sequence(0, tokens)
    slots = cache.append([0], [len(tokens)], token_ids=tokens)
    rng = np.random.default_rng(0)
    for layer in range(2):
        k = rng.standard_normal((len(tokens), 1, 8)).astype(np.float16)
        cache.store(layer, slots, k, k)
    cache.append([0], [1], token_ids=[7])  # seals the full pages: they are written to the tier
    assert tier.flush(timeout=10)
    tier.close()
    return "L2-H1-D8-P4-float16-xxh3_128"


@pytest.mark.parametrize("kind", ["standalone", "cluster"])
def test_tier_info_counts_each_namespace_and_marks_the_one_asked(kind, request, capsys):
    url = request.getfixturevalue("standalone") if kind == "standalone" else request.getfixturevalue("cluster").url
    mine, other = f"mine-{uuid.uuid4().hex}", f"other-{uuid.uuid4().hex}"
    layout = _write_pages(url, mine, 5)
    _write_pages(url, other, 3)
    assert main(["tier", "info", url, "--namespace", mine, "--namespace", "nobody"]) == 0
    out = capsys.readouterr().out
    line = [text for text in out.splitlines() if f"<- namespace {mine!r}" in text]
    assert len(line) == 1, out
    assert "5 pages" in line[0] and layout in line[0], out
    # Each page value: a header, 4 token ids and 2 layers x K,V x 4 tokens x 8 float16 values.
    assert any("3 pages" in text and "<-" not in text for text in out.splitlines()), out
    assert "namespace 'nobody': no pages here" in out


@pytest.mark.parametrize("url", ["redis://127.0.0.1:1/0", "redis+cluster://127.0.0.1:1,127.0.0.1:2"])
def test_tier_info_names_a_server_it_cannot_reach(url, capsys):
    # A cluster none of whose nodes answers raised RedisClusterUnreachableError, not a RedisError,
    # and the command printed a traceback.
    assert main(["tier", "info", url, "--timeout", "0.5"]) == 2
    err = capsys.readouterr().err
    assert f"pagedkv tier: cannot read {url}: " in err and "Traceback" not in err


def test_tier_info_refuses_a_url_that_is_not_redis(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["tier", "info", "http://127.0.0.1:6379"])
    assert exc.value.code == 2
    assert "argument URL: expected redis://HOST:PORT/DB, rediss://... or redis+cluster://" in capsys.readouterr().err


@pytest.mark.parametrize("timeout", ["inf", "0", "-1", "99999999999", "nan"])
def test_tier_info_timeout_out_of_range_is_a_usage_error(timeout, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["tier", "info", "redis://127.0.0.1:6379/0", "--timeout", timeout])
    assert exc.value.code == 2
    assert "argument --timeout: expected a number of seconds in (0, 86400]" in capsys.readouterr().err


@pytest.mark.parametrize("url, reason", [
    ("redis://127.0.0.1:6379/abc", "(the database of 'redis://127.0.0.1:6379/abc' is 'abc'; expected /DB with DB a "
                                   "number in 0 .. 2147483647 (the server's own limit, 16 databases by default, "
                                   "may be lower), or none (database 0))"),
    ("redis+cluster://127.0.0.1:7000/3", "a Redis Cluster has database 0 only (give /0 or none))"),
    ("redis+cluster://127.0.0.1:x", "(bad node address '127.0.0.1:x' in 'redis+cluster://127.0.0.1:x')"),
])
def test_tier_info_says_what_is_wrong_with_a_url(url, reason, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["tier", "info", url])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"argument URL: expected redis://HOST:PORT/DB, rediss://... or redis+cluster://HOST:PORT[,HOST:PORT...], " \
           f"got {url!r} " in err and err.rstrip().endswith(reason), err


def test_tier_info_on_one_cluster_node_says_the_counts_are_its_share(cluster, capsys):
    node = cluster.nodes[0]
    assert main(["tier", "info", f"redis://{node}/0"]) == 0
    out = capsys.readouterr().out
    assert "one node of a Redis Cluster" in out and f"redis+cluster://{node}" in out, out


def test_tier_info_on_a_standalone_server_adds_no_cluster_note(standalone, capsys):
    assert main(["tier", "info", standalone]) == 0
    assert "Redis Cluster" not in capsys.readouterr().out


def test_tier_info_never_prints_a_password(capsys):
    assert main(["tier", "info", "redis://user:secret@127.0.0.1:1/0", "--timeout", "0.5"]) == 2
    err = capsys.readouterr().err
    assert "secret" not in err and "redis://user:***@127.0.0.1:1/0" in err
    with pytest.raises(SystemExit):
        main(["tier", "info", "redis://user:secret@127.0.0.1:1/0?foo=1"])
    assert "secret" not in capsys.readouterr().err
