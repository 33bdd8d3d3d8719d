"""The fuzzer's committed seeds replay without a finding, and its checks can fail.

Runs where atheris is installed (``pip install ".[fuzz]"``; the sanitizer pass of CI).
"""
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("atheris", reason="the fuzz targets read their input through atheris (pagedkv[fuzz])")

HERE = Path(__file__).parent
sys.path[:0] = [str(HERE), str(HERE.parent)]
import targets  # noqa: E402

SEEDS = sorted((HERE / "corpus").iterdir())


def test_there_are_seeds():
    assert len(SEEDS) >= 10


@pytest.mark.parametrize("seed", SEEDS, ids=[p.name[:20] for p in SEEDS])
def test_seed_replays_without_finding(seed):
    targets.one_input(seed.read_bytes())


def test_a_content_mismatch_is_reported(monkeypatch):
    """Expected K/V that differ from what was stored (by one ulp-sized step) must raise a Finding."""
    rows = targets.PrefixContent.rows
    calls = {"n": 0}

    def drifting_rows(self, keys, layer, heads, dim):
        k, v = rows(self, keys, layer, heads, dim)
        calls["n"] += 1
        return k + np.float32(calls["n"] % 2) / 8, v  # stored and expected rows no longer agree

    monkeypatch.setattr(targets.PrefixContent, "rows", drifting_rows)
    found = 0
    for seed in SEEDS:
        try:
            targets.one_input(seed.read_bytes())
        except targets.Finding as exc:
            assert "is not what was stored" in str(exc) or "attention" in str(exc)
            found += 1
    assert found, "no seed stores and reads back K/V: the seeds do not exercise the content check"
