"""The cache stored in ``tests/data/snapshot_v1.pkv``, a snapshot of format version 1.

The file was written by the pagedkv release that wrote version 1 (before
per-layer attention settings), with this module's :func:`build`:
``PYTHONPATH=<that checkout>/src:<that checkout> python tests/_snapshot_v1_fixture.py``.
Tests load it with the current reader and compare with :func:`expected_rows`.
"""
import sys

import numpy as np

SEQUENCES = {1: 11, 2: 6}  # seq_id -> tokens appended before the fork
FORK = (1, 3, 3)  # parent, child, tokens appended to the child after the fork
PROMPT = list(range(100, 111))


def row(layer, seq_id, position):
    """K of one token (V is its negative): small integers, exact in float16."""
    return np.full((2, 4), layer * 64 + seq_id * 16 + position % 16, dtype=np.float16)


def build(KVCache):
    """The cache: 2 layers, window 6 with 2 sink tokens, prefix caching, page checksums, a fork."""
    cache = KVCache(2, 2, 4, 12, page_size=4, window=6, sink_tokens=2, enable_prefix_caching=True,
                    page_checksums=True)
    for seq_id, n in SEQUENCES.items():
        cache.add_sequence(seq_id, PROMPT[:n] if seq_id == 1 else None)
        for t in range(n):  # one token per append: the window releases pages as it goes
            slots = cache.append([seq_id], [1])
            for layer in range(2):
                k = row(layer, seq_id, t)[None]
                cache.store(layer, slots, k, -k)
    parent, child, extra = FORK
    cache.fork(parent, child)
    for t in range(extra):
        position = cache.seq_len(child)
        slots = cache.append([child], [1])
        for layer in range(2):
            k = row(layer, child, position)[None]
            cache.store(layer, slots, k, -k)
    cache.seal()
    return cache


def expected_rows(layer, seq_id, positions):
    """K rows the cache holds for ``positions`` of ``seq_id`` (a child holds its parent's before the fork)."""
    parent, child, _ = FORK
    fork_len = SEQUENCES[parent]
    owner = [parent if seq_id == child and p < fork_len else seq_id for p in positions]
    return np.stack([row(layer, s, p) for s, p in zip(owner, positions)]) if len(positions) else None


if __name__ == "__main__":
    from pagedkv import KVCache

    build(KVCache).save(sys.argv[1] if len(sys.argv) > 1 else "tests/data/snapshot_v1.pkv")
