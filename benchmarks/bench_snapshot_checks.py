"""Cost of validating untrusted snapshots and exported sequences (issue 29).

Times, as medians of ``--repeats`` runs:

* ``import_sequence`` of one sequence of ``--tokens`` tokens (pages of 16
  tokens, 2 layers, 2 KV heads, head dim 64, float16, prefix caching with
  the token ids known, so the whole hash chain comes along) into a fresh
  cache, with XXH3-128 and with SHA-256 prefix hashes;
* the hash-chain rebuild alone (``SequenceHashes._from_state``, which now
  hashes every page again from the salt and token ids);
* ``load``, ``load(mmap=True)`` and ``verify`` of a cache of ``--sequences``
  windowed sequences of 40 tokens with prefix caching.

Runs against whichever pagedkv is first on the path, so the same command
measures a checkout before and after the checks (an older core without the
``extra_key`` of ``import_sequence`` or the hash argument of ``_from_state``
is called without them).

Run: python benchmarks/bench_snapshot_checks.py [--tokens N] [--sequences N] [--repeats N]
"""
import argparse
import os
import statistics
import tempfile
import time

import numpy as np

import pagedkv
from pagedkv import KVCache, snapshot
from pagedkv_c._prefix import ALGORITHMS, SequenceHashes


def median_ms(call, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def import_costs(tokens: int, repeats: int) -> None:
    for algorithm in ("xxh3_128", "sha256"):
        kwargs = dict(num_layers=2, num_kv_heads=2, head_dim=64, num_pages=tokens // 16 + 8, page_size=16,
                      dtype=np.float16, enable_prefix_caching=True, prefix_hash=algorithm)
        source = KVCache(**kwargs)
        prompt = np.random.default_rng(0).integers(0, 32000, tokens).astype(np.int32)
        source.add_sequence(0, prompt, extra_key="tenant")
        source.append([0], [tokens], return_slot_mapping=False)
        blob = source.export_sequence(0)
        hash_state = source._export_state()["sequences"][0][2]

        def one_import():
            target = KVCache(**kwargs)
            try:
                target.import_sequence(1, blob, extra_key="tenant")
            except TypeError:  # a core without extra_key
                target.import_sequence(1, blob)

        def rebuild():
            try:
                SequenceHashes._from_state(hash_state, 16, tokens, ALGORITHMS[algorithm])
            except TypeError:  # a core that takes the chain as stored
                SequenceHashes._from_state(hash_state, 16, tokens)

        print(f"import_sequence, {tokens} tokens ({len(blob) / 2**20:.0f} MiB), {algorithm}: "
              f"{median_ms(one_import, repeats):.1f} ms; chain rebuild alone {median_ms(rebuild, 3 * repeats):.2f} ms")


def load_costs(sequences: int, repeats: int) -> None:
    cache = KVCache(2, 2, 64, sequences * 4 + 64, page_size=16, dtype=np.float16, enable_prefix_caching=True,
                    window=32, sink_tokens=4)
    rng = np.random.default_rng(0)
    for seq_id in range(sequences):
        cache.add_sequence(seq_id, rng.integers(0, 1000, 40).astype(np.int32))
    cache.append(list(range(sequences)), [40] * sequences, return_slot_mapping=False)
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "cache.pkv")
        cache.save(path)
        size = os.path.getsize(path) / 2**20
        for name, call in (("load", lambda: KVCache.load(path)), ("load(mmap=True)", lambda: KVCache.load(path, mmap=True)),
                           ("verify", lambda: snapshot.verify(path))):
            print(f"{name}, {sequences} sequences ({size:.0f} MiB): {median_ms(call, repeats):.0f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=100_000)
    parser.add_argument("--sequences", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    print(f"pagedkv from {os.path.dirname(pagedkv.__file__)}")
    import_costs(args.tokens, args.repeats)
    load_costs(args.sequences, args.repeats)


if __name__ == "__main__":
    main()
