"""Structure-aware fuzzer of snapshot files and exported sequences (``pagedkv.snapshot``).

Usage (see README.md)::

    python tests/fuzz/fuzz_snapshots.py --cases 2000 --seed 1          # a fixed set of cases
    python tests/fuzz/fuzz_snapshots.py --seconds 60                   # random seed, bounded time
    python tests/fuzz/fuzz_snapshots.py --replay fuzz-artifacts/snapshot-....bin   # one case, traceback

Each case is a valid file written by a real cache (``snapshot_mutator.seed_files``)
with one to three structural mutations, every checksum recomputed. It is
checked in a worker process that reads cases from its stdin and answers each
(restarted when it dies): the outcome must be either a refusal by the
documented exception (``SnapshotError``; for an import also
``OutOfPagesError``, leaving the target cache exactly as it was), or a cache
that passes ``check_invariants()`` and survives appends with stores that read
back, a fork, a truncate, ``add_sequence`` with a prompt, ``gather``,
``remove_sequence``, and a save that loads again (``verify`` agreeing with
``load`` on both files), with no counter gone negative, no sealed page
reported corrupt by ``verify_pages``, no other sequence's K/V changed, and no
prefix hit for a tenant's request that no seed cache made (forged hashes).
A ``SnapshotError`` must name the file section it is about.
Classic ``PagedKVCache`` snapshots get puts and gets that read back and a
save/load round trip. Anything else is a finding: another exception, a failed
check, a crash (signal) or sanitizer report, a case that runs past the
timeout, or a load or import whose peak memory exceeds the bound of the
module notes (the pool, plus twice the file's length or 256 MiB).

Findings are listed by class at the end; each class's first cases are saved
in ``--artifacts`` (``snapshot-<kind>-<sha1>.bin`` with a ``.json`` beside it
naming the seed file, the mutations and the finding). Exit status 1 if any.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
for _path in (HERE, os.path.dirname(HERE)):  # snapshot_mutator; reference_formats (tests/)
    if _path not in sys.path:
        sys.path.insert(0, _path)

import numpy as np  # noqa: E402

import reference_formats as rf  # noqa: E402
import snapshot_mutator as sm  # noqa: E402

#: A load or import may allocate the pool plus this much, or twice the file's length (module notes).
EXTRA_FLOOR = 256 << 20
#: Measurement slack on top of the bound (allocator and interpreter noise).
RSS_SLACK = 64 << 20
MAX_POSITION = 2**62


class Finding(Exception):
    """A contract violation: ``kind`` names the class (no case-specific numbers), the text the details."""

    def __init__(self, kind: str, text: str):
        super().__init__(f"{kind}: {text}")
        self.kind = kind
        self.text = text


# ----------------------------------------------------------------- memory
def _status(field: str) -> int:
    """A ``/proc/self/status`` memory field in bytes (0 where there is none)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _reset_peak() -> bool:
    """Reset the peak RSS of this process (Linux ``clear_refs``); False where it cannot be."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class PeakMemory:
    """Peak RSS growth over a block: ``VmHWM`` after a reset, else ``getrusage``'s lifetime peak."""

    def __enter__(self):
        self.start = _status("VmRSS")
        self.exact = _reset_peak()
        self.before = _lifetime_peak()
        return self

    def __exit__(self, *exc):
        if self.exact:
            self.extra = max(0, _status("VmHWM") - self.start)
        else:
            self.extra = max(0, _lifetime_peak() - self.before)
        return False


def _lifetime_peak() -> int:
    """``getrusage``'s peak RSS in bytes (KiB on Linux, bytes on macOS), 0 where there is none (Windows)."""
    try:
        import resource
    except ImportError:
        return 0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


#: Peak RSS growth of the last load or import (bytes, without the pool), for the run's summary.
LAST_PEAK = [0]


def _check_memory(meter: PeakMemory, pool_bytes: int, size: int, what: str) -> None:
    LAST_PEAK[0] = max(0, meter.extra - pool_bytes)
    bound = pool_bytes + max(2 * size, EXTRA_FLOOR) + RSS_SLACK
    if meter.extra > bound:
        raise Finding(f"{what}:memory-over-bound",
                      f"peak RSS grew by {meter.extra >> 20} MiB for a file of {size} bytes (pool {pool_bytes} "
                      f"bytes; bound {bound >> 20} MiB with slack)")


# ------------------------------------------------------------ the checks
def _call(stage: str, f, *args, allowed=(), **kwargs):
    """``f(*args)``; an exception of a type in ``allowed`` is returned, any other is a finding."""
    try:
        return f(*args, **kwargs)
    except allowed as exc:
        return exc
    except Finding:
        raise
    except BaseException as exc:
        raise Finding(f"{stage}:raised-{type(exc).__name__}", f"{exc!r}\n{traceback.format_exc(limit=6)}") from None


def _names_section(error, stage: str) -> None:
    """A SnapshotError names the file section it is about (the module notes: "section '<name>': ...")."""
    if not str(error).startswith("section '"):
        raise Finding(f"{stage}:error-names-no-section", str(error)[:500])


def _invariants(cache, stage: str) -> None:
    try:
        cache.check_invariants()
    except BaseException as exc:
        raise Finding(f"{stage}:check_invariants", f"{type(exc).__name__}: {exc}") from None


def _counters(cache, stage: str) -> None:
    stats = _call(f"{stage}:stats", cache.stats)
    for key, value in stats.items():
        if isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value < 0:
            raise Finding(f"{stage}:counter-negative", f"stats()[{key!r}] = {value}")


def _contents(cache, skip=()) -> dict:
    """Every sequence's gathered K/V and positions (all layers), for the isolation checks."""
    out = {}
    for seq_id in cache.seq_ids():
        if seq_id in skip:
            continue
        out[seq_id] = [tuple(np.array(x, copy=True) for x in cache.gather(layer, seq_id))
                       for layer in range(cache.num_layers)]
    return out


def _same_contents(before: dict, cache, stage: str) -> None:
    for seq_id, layers in before.items():
        if seq_id not in cache.seq_ids():
            raise Finding(f"{stage}:sequence-vanished", f"sequence {seq_id}")
        for layer, old in enumerate(layers):
            new = cache.gather(layer, seq_id)
            if not all(np.array_equal(a, b, equal_nan=True) for a, b in zip(old, new)):
                raise Finding(f"{stage}:other-sequence-changed",
                              f"sequence {seq_id} layer {layer} changed by a call on another sequence")


def _row_matches(got: np.ndarray, want: tuple[np.ndarray, float]) -> bool:
    """``got`` equals ``want`` = ``(rows, atol)`` of ``reference_formats.read_back``."""
    expected, atol = want
    if not atol:
        return np.array_equal(got, expected.astype(got.dtype))
    return bool(np.all(np.abs(got.astype(np.float64) - expected) <= atol))


def _append_store(cache, seq_id, n: int, rng, stage: str, token_ids=None) -> bool:
    """Append ``n`` tokens to ``seq_id`` and store K/V; the stored rows must read back. False: out of pages."""
    from pagedkv import OutOfPagesError
    others = _contents(cache, skip=(seq_id,))
    length = cache.seq_len(seq_id)
    result = _call(f"{stage}:append", cache.append, [seq_id], [n], token_ids, allowed=(OutOfPagesError, ValueError))
    if isinstance(result, ValueError):
        if length + n <= MAX_POSITION:
            raise Finding(f"{stage}:append:raised-ValueError", f"length {length} + {n}: {result}")
        _invariants(cache, f"{stage}:after-refused-append")
        return False
    if isinstance(result, OutOfPagesError):
        _invariants(cache, f"{stage}:after-out-of-pages")
        return False
    _invariants(cache, f"{stage}:after-append")
    if cache.seq_len(seq_id) != length + n:
        raise Finding(f"{stage}:append:length", f"{length} + {n} != {cache.seq_len(seq_id)}")
    slots = result
    if cache.num_layers:
        shape = (n, cache.num_kv_heads, cache.head_dim)
        stored = []
        for layer in range(cache.num_layers):
            k, v = (rng.standard_normal(shape).astype(np.float32) for _ in range(2))
            _call(f"{stage}:store", cache.store, layer, slots, k, v)
            stored.append((rf.read_back(k, cache.kv_dtype), rf.read_back(v, cache.kv_dtype)))
        for layer, (k, v) in enumerate(stored):
            gk, gv, pos = _call(f"{stage}:gather", cache.gather, layer, seq_id)
            if not len(pos) or pos[-1] != length + n - 1:
                raise Finding(f"{stage}:gather:last-position", f"positions {pos[-5:]} after {length + n} tokens")
            for j in range(n):
                row = np.flatnonzero(pos == length + j)
                if row.size and not (_row_matches(gk[row[0]], (k[0][j], k[1])) and
                                     _row_matches(gv[row[0]], (v[0][j], v[1]))):
                    raise Finding(f"{stage}:gather:stored-row-differs",
                                  f"sequence {seq_id} layer {layer} position {length + j}")
    _same_contents(others, cache, stage)
    return True


def _victim_probe(cache, stage: str) -> None:
    """A tenant's request that no seed cache made must get no prefix hit: a hit means the file planted K/V
    under hashes that do not belong to the content (the hash chain was trusted, not recomputed)."""
    from pagedkv import OutOfPagesError
    probe = 2 * 10**6
    block_tokens = 2 * cache.page_size
    requests = [((probe, sm.VICTIM_PROMPT, sm.VICTIM_SALT), {}),
                ((probe + 1,), dict(extra_key=sm.VICTIM_SALT, block_hashes=sm.VICTIM_BLOCKS, block_tokens=block_tokens,
                                    num_prompt_tokens=len(sm.VICTIM_BLOCKS) * block_tokens))]
    from pagedkv import KVCache
    # What the request gets from an empty cache of the same prefix caching geometry: with a window of 1
    # a hit needs no cached page at all.
    empty = KVCache(0, 1, 1, cache.num_pages, page_size=cache.page_size, window=cache.window,
                    sink_tokens=cache.sink_tokens, enable_prefix_caching=True,
                    prefix_hash=cache.prefix_index.algorithm_name)
    for args, kwargs in requests:
        others = _contents(cache)
        baseline = empty.add_sequence(*args, **kwargs)
        hit = _call(f"{stage}:probe-add_sequence", cache.add_sequence, *args, allowed=(OutOfPagesError,), **kwargs)
        _invariants(cache, f"{stage}:after-probe")
        if not isinstance(hit, OutOfPagesError):
            if hit > baseline:
                raise Finding(f"{stage}:forged-hash-served",
                              f"a request with salt {sm.VICTIM_SALT!r} that no cache made got {hit} tokens from "
                              f"cache, an empty cache {baseline} ({'blocks' if kwargs else 'tokens'})")
            _call(f"{stage}:probe-remove", cache.remove_sequence, args[0])
            _invariants(cache, f"{stage}:after-probe-remove")
        _same_contents(others, cache, f"{stage}:probe")


def exercise_cache(cache, rng, stage: str, protected: dict | None = None) -> None:
    """The calls a restored cache must survive, each followed by ``check_invariants``."""
    from pagedkv import KVCache, OutOfPagesError, SnapshotError
    from pagedkv import snapshot as snap
    _invariants(cache, f"{stage}:after-load")
    _counters(cache, f"{stage}:after-load")
    if cache.page_checksums_enabled:
        report = _call(f"{stage}:verify_pages", cache.verify_pages)
        if report:
            raise Finding(f"{stage}:verify_pages-reports-loaded-page",
                          f"verify_pages() right after the load: {report!r}"[:400])
    if cache.num_layers:
        _contents(cache)  # every gather runs
    if cache.prefix_caching:
        _victim_probe(cache, stage)
    if protected:
        _same_contents(protected, cache, f"{stage}:after-load")
    ids = sorted(cache.seq_ids())
    for seq_id in ids[:4]:
        tokens = [rng.integers(0, 1000) for _ in range(2)] if cache.prefix_caching else None
        _append_store(cache, seq_id, 2, rng, f"{stage}:append-each", tokens)
    new_id = 10**6
    if ids:
        parent = ids[0]
        others = _contents(cache)
        result = _call(f"{stage}:fork", cache.fork, parent, new_id, allowed=(ValueError,))
        _invariants(cache, f"{stage}:after-fork")
        _same_contents(others, cache, f"{stage}:fork")
        if not isinstance(result, ValueError):
            _append_store(cache, new_id, 1, rng, f"{stage}:append-child")
            _same_contents({parent: others[parent]} if parent in others else {}, cache, f"{stage}:cow")
        seq = ids[-1]
        length = cache.seq_len(seq)
        if length:
            others = _contents(cache, skip=(seq,))
            _call(f"{stage}:truncate", cache.truncate, seq, max(0, length - 1 - int(rng.integers(0, 3))),
                  allowed=(ValueError,))
            _invariants(cache, f"{stage}:after-truncate")
            _same_contents(others, cache, f"{stage}:truncate")
            _append_store(cache, seq, 1, rng, f"{stage}:append-after-truncate")
    prompt = sm.PROMPTS[int(rng.integers(0, len(sm.PROMPTS)))]
    others = _contents(cache)
    salt = "tenant-a" if rng.random() < 0.5 else None
    result = _call(f"{stage}:add_sequence", cache.add_sequence, new_id + 1, prompt, salt if cache.prefix_caching
                   else None, allowed=(OutOfPagesError,))
    _invariants(cache, f"{stage}:after-add_sequence")
    _same_contents(others, cache, f"{stage}:add_sequence")
    if not isinstance(result, OutOfPagesError):
        rest = len(prompt) - cache.seq_len(new_id + 1)
        while rest > 0:
            if not _append_store(cache, new_id + 1, min(rest, 3), rng, f"{stage}:append-prompt"):
                break
            rest -= 3
    if ids:
        others = _contents(cache, skip=(ids[0],))
        _call(f"{stage}:remove_sequence", cache.remove_sequence, ids[0])
        _invariants(cache, f"{stage}:after-remove")
        _same_contents(others, cache, f"{stage}:remove")
    _counters(cache, f"{stage}:after-calls")
    # Save and load again: the file must load, equal the cache, and verify() must agree.
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "again.snap")
        _call(f"{stage}:save", cache.save, path)
        verified = _call(f"{stage}:verify-resaved", snap.verify, path, allowed=(SnapshotError,))
        again = _call(f"{stage}:load-resaved", KVCache.load, path, allowed=(SnapshotError,))
        if isinstance(again, SnapshotError):
            raise Finding(f"{stage}:resaved-file-refused", str(again))
        if isinstance(verified, SnapshotError):
            raise Finding(f"{stage}:resaved-file-fails-verify", str(verified))
        _invariants(again, f"{stage}:resaved-load")
        if sorted(again.seq_ids()) != sorted(cache.seq_ids()) or again.stats() != cache.stats():
            raise Finding(f"{stage}:resaved-differs", "sequences or stats differ after save/load")
        if cache.num_layers:
            before = _contents(cache)
            _same_contents(before, again, f"{stage}:resaved-contents")


def check_cache_file(path: str, rng) -> str:
    """Load a KVCache snapshot; ``"refused"`` or ``"accepted"`` (raises Finding)."""
    from pagedkv import KVCache, SnapshotError
    from pagedkv import snapshot as snap
    size = os.path.getsize(path)
    verified = _call("cache:verify", snap.verify, path, allowed=(SnapshotError,))
    with PeakMemory() as meter:
        cache = _call("cache:load", KVCache.load, path, allowed=(SnapshotError,))
    pool = cache.kv.nbytes if not isinstance(cache, SnapshotError) else 0
    _check_memory(meter, pool, size, "cache:load")
    if isinstance(verified, SnapshotError) != isinstance(cache, SnapshotError):
        raise Finding("cache:verify-load-disagree",
                      f"verify: {verified if verified is not None else 'accepts'}; load: "
                      f"{cache if isinstance(cache, SnapshotError) else 'accepts'}")
    if isinstance(cache, SnapshotError):
        _names_section(cache, "cache:load")
        _names_section(verified, "cache:verify")
        return "refused"
    _invariants(cache, "cache:after-load")
    mapped = _call("cache:load-mmap", KVCache.load, path, mmap=True, allowed=(SnapshotError,))
    if isinstance(mapped, SnapshotError):
        raise Finding("cache:mmap-load-refuses-accepted-file", str(mapped))
    _invariants(mapped, "cache:mmap")
    if rng.random() < 0.25:  # the copy-on-write map of the file's pages must survive the same calls
        del cache
        exercise_cache(mapped, rng, "cache-mmap")
    else:
        del mapped
        exercise_cache(cache, rng, "cache")
    return "accepted"


def _target_cache(target: dict, rng):
    """The import target: a fresh cache of the seed's geometry holding one filled sequence (id 100)."""
    from pagedkv import KVCache
    cache = KVCache(**sm.cache_kwargs(target))
    prompt = sm.PROMPTS[3]
    hit = cache.add_sequence(100, prompt) if cache.prefix_caching else cache.add_sequence(100)
    rest = len(prompt) - hit
    while rest > 0:
        step = min(rest, 2)
        slots = cache.append([100], [step])
        shape = (step, cache.num_kv_heads, cache.head_dim)
        for layer in range(cache.num_layers):
            cache.store(layer, slots, rng.standard_normal(shape), rng.standard_normal(shape))
        rest -= step
    return cache


def check_sequence(data: bytes, target: dict, extra_key, rng) -> str:
    """Import exported-sequence bytes (added with salt ``extra_key``) into a fresh cache of the seed's
    geometry; refused or accepted."""
    from pagedkv import OutOfPagesError, SnapshotError
    target = dict(target)
    variant = rng.random()
    if variant < 0.15:  # the chain is dropped: another hash function, or no prefix caching
        target["prefix_hash"] = "sha256" if target.get("prefix_hash", "xxh3_128") == "xxh3_128" else "xxh3_128"
    elif variant < 0.3:
        target["enable_prefix_caching"] = not target.get("enable_prefix_caching", False)
    cache = _target_cache(target, rng)
    before = (cache.stats(), cache.pool.free_pages().tolist(), sorted(cache.seq_ids()), _contents(cache))
    salt = {} if extra_key is None else {"extra_key": extra_key}

    def import_sequence():
        try:
            return cache.import_sequence(7, data, **salt)
        except TypeError as exc:  # a pagedkv whose import_sequence takes no extra_key (before issue 29)
            if not salt or "extra_key" not in str(exc):
                raise
            return cache.import_sequence(7, data)

    with PeakMemory() as meter:
        result = _call("sequence:import", import_sequence, allowed=(SnapshotError, OutOfPagesError))
    _check_memory(meter, 0, len(data), "sequence:import")
    if isinstance(result, BaseException):
        if isinstance(result, SnapshotError):
            _names_section(result, "sequence:import")
        _invariants(cache, "sequence:after-refused-import")
        after = (cache.stats(), cache.pool.free_pages().tolist(), sorted(cache.seq_ids()))
        if after != before[:3]:
            raise Finding("sequence:refused-import-changed-cache", f"{type(result).__name__}: {result}")
        _same_contents(before[3], cache, "sequence:refused-import")
        return "refused"
    if 7 not in cache.seq_ids():
        raise Finding("sequence:import-accepted-without-sequence", "sequence 7 missing")
    exercise_cache(cache, rng, "sequence", protected=before[3])
    return "accepted"


def check_classic(path: str, rng) -> str:
    """Load a PagedKVCache snapshot; refused, or puts, gets and a save/load round trip that read back."""
    from pagedkv import PagedKVCache, SnapshotError
    size = os.path.getsize(path)
    with PeakMemory() as meter:
        cache = _call("classic:load", PagedKVCache.load, path, allowed=(SnapshotError,))
    _check_memory(meter, 0 if isinstance(cache, SnapshotError) else cache.nbytes, size, "classic:load")
    if isinstance(cache, SnapshotError):
        _names_section(cache, "classic:load")
        return "refused"
    _invariants(cache, "classic:after-load")
    stats = _call("classic:stats", cache.stats)
    for key, value in stats.items():
        if isinstance(value, (int, np.integer)) and value < 0:
            raise Finding("classic:after-load:counter-negative", f"stats()[{key!r}] = {value}")
    tokens = _call("classic:iter", list, cache)
    for t in tokens[:64]:
        got = _call("classic:get", cache.get, t)
        if got is None:
            raise Finding("classic:present-token-missing", f"token {t} iterated but get() is None")
    dim = cache.dim
    written = {}
    for t in [0, 5, max(tokens, default=0) + 1, 2**40 + 3, int(rng.integers(0, 10**6))]:
        k, v = rng.standard_normal(dim), rng.standard_normal(dim)
        _call("classic:put", cache.put, t, k, v)
        _invariants(cache, "classic:after-put")
        written[t] = (k.astype(cache.dtype), v.astype(cache.dtype))
        got = _call("classic:get", cache.get, t)
        if got is None or not (np.array_equal(got[0], written[t][0]) and np.array_equal(got[1], written[t][1])):
            raise Finding("classic:put-get-differs", f"token {t}")
    stats = _call("classic:stats", cache.stats)
    for key, value in stats.items():
        if isinstance(value, (int, np.integer)) and value < 0:
            raise Finding("classic:after-calls:counter-negative", f"stats()[{key!r}] = {value}")
    with tempfile.TemporaryDirectory() as tmp:
        again_path = os.path.join(tmp, "again.snap")
        _call("classic:save", cache.save, again_path)
        again = _call("classic:load-resaved", PagedKVCache.load, again_path, allowed=(SnapshotError,))
        if isinstance(again, SnapshotError):
            raise Finding("classic:resaved-file-refused", str(again))
        _invariants(again, "classic:resaved-load")
        if list(again) != list(cache):
            raise Finding("classic:resaved-differs", "present tokens differ after save/load")
    _call("classic:clear", cache.clear)
    _invariants(cache, "classic:after-clear")
    return "accepted"


def _crash() -> str:
    import ctypes
    ctypes.string_at(0)  # a read at address 0: SIGSEGV
    return "accepted"


def _hang() -> str:
    time.sleep(3600)
    return "accepted"


def _allocate() -> str:
    block = np.ones(768 << 20 >> 3)  # touched
    time.sleep(60)
    return str(block.size)


#: Cases that test the harness itself (tests/test_snapshot_fuzz.py): a crash, a hang, memory growth.
_SELF_TESTS = {"crash": _crash, "hang": _hang, "allocate": _allocate}


def check_case(kind: str, path: str, target: dict | None, seed: int, extra_key=None) -> str:
    """Run one case in this process: ``"refused"`` or ``"accepted"``; a contract violation raises Finding."""
    rng = np.random.default_rng(seed)
    if kind in _SELF_TESTS:
        return _SELF_TESTS[kind]()
    if kind == "cache":
        return check_cache_file(path, rng)
    if kind == "sequence":
        with open(path, "rb") as f:
            data = f.read()
        return check_sequence(data, target, extra_key, rng)
    return check_classic(path, rng)


# ---------------------------------------------------------------- worker
def _limit_memory() -> None:
    """Cap the worker's address space (not under AddressSanitizer, which reserves terabytes of shadow)."""
    if "asan" in os.environ.get("LD_PRELOAD", "") or os.environ.get("PAGEDKV_SNAPSHOT_FUZZ_NO_RLIMIT"):
        return
    try:
        import resource
        limit = int(os.environ.get("PAGEDKV_SNAPSHOT_FUZZ_AS_MIB", "6144")) << 20
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    except (ImportError, ValueError, OSError):
        pass


def worker_main() -> None:
    """Read one JSON case per line on stdin, answer one ``@@`` line per case on stdout."""
    _limit_memory()
    import pagedkv  # noqa: F401  (imported once, before the first case is timed)
    out = sys.stdout
    for line in sys.stdin:
        case = json.loads(line)
        started = time.perf_counter()
        LAST_PEAK[0] = 0
        try:
            outcome = check_case(case["kind"], case["path"], case.get("target"), case["seed"], case.get("extra_key"))
            reply = {"outcome": outcome}
        except Finding as finding:
            reply = {"outcome": "finding", "class": finding.kind, "text": finding.text[:4000]}
        except BaseException as exc:  # a bug of the fuzzer itself is reported too
            reply = {"outcome": "finding", "class": f"harness:{type(exc).__name__}",
                     "text": traceback.format_exc()[-4000:]}
        reply["seconds"] = time.perf_counter() - started
        reply["peak_extra"] = LAST_PEAK[0]
        out.write("@@" + json.dumps(reply) + "\n")
        out.flush()


class Worker:
    """A worker process: ``run(case)`` sends one case and waits for its answer (timeout, RSS watchdog)."""

    def __init__(self, log_path: str, env: dict):
        self.log_path = log_path
        self.log = open(log_path, "ab")
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, env=env)
        # A thread reads the answers (select() cannot wait on a pipe on Windows); None marks the end.
        self.lines: queue.Queue = queue.Queue()
        self.reader = threading.Thread(target=self._read, name="snapfuzz-reader", daemon=True)
        self.reader.start()

    def _read(self) -> None:
        try:
            for line in self.proc.stdout:
                self.lines.put(line)
        except (OSError, ValueError):
            pass
        self.lines.put(None)

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()
            except OSError:
                pass
        self.log.close()

    def _rss(self) -> int:
        try:
            with open(f"/proc/{self.proc.pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        return 0

    def run(self, case: dict, timeout: float, rss_limit: int) -> dict:
        """The worker's answer, or a finding of the parent's own: crash (the exit signal), timeout, memory."""
        log_start = os.path.getsize(self.log_path)
        try:
            self.proc.stdin.write((json.dumps(case) + "\n").encode())
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self.proc.kill()
                self.proc.wait()
                return {"outcome": "finding", "class": f"{case['kind']}:timeout",
                        "text": f"no answer within {timeout} s (killed)"}
            rss = self._rss() if rss_limit else 0
            if rss > rss_limit > 0:
                self.proc.kill()
                self.proc.wait()
                return {"outcome": "finding", "class": f"{case['kind']}:memory-watchdog",
                        "text": f"worker RSS {rss >> 20} MiB > limit {rss_limit >> 20} MiB (killed)"}
            try:
                line = self.lines.get(timeout=min(left, 0.1))
            except queue.Empty:
                continue
            if line is None:  # the worker died
                code = self.proc.wait()
                with open(self.log_path, "rb") as f:
                    f.seek(log_start)
                    tail = f.read()[-3000:].decode("utf-8", "replace")
                what = f"signal-{signal.Signals(-code).name}" if code < 0 else f"exit-{code}"
                if "AddressSanitizer" in tail or "UndefinedBehaviorSanitizer" in tail or "runtime error:" in tail:
                    what = "sanitizer"
                return {"outcome": "finding", "class": f"{case['kind']}:crash-{what}", "text": tail}
            if line.startswith(b"@@"):
                return json.loads(line[2:])

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None


# --------------------------------------------------------------- driver
def case_for(seeds: list, master: int, index: int) -> tuple[dict, bytes, list]:
    """The seed file and mutated bytes of case ``index`` of run ``master`` (deterministic)."""
    rng = random.Random(f"{master}:{index}")
    kind = rng.choices(["cache", "sequence", "classic"], [0.45, 0.35, 0.2])[0]  # not by seed count
    seed = rng.choice([s for s in seeds if s["kind"] == kind] or seeds)
    data, mutations = sm.mutate(seed["data"], rng)
    return seed, data, mutations


def run(*, cases: int | None = None, seconds: float | None = None, master: int = 0, artifacts: str | None = None,
        timeout: float = 30.0, rss_limit_mib: int = 3072, keep_per_class: int = 3, log=print,
        env: dict | None = None) -> dict:
    """Fuzz ``cases`` cases (or for ``seconds``) of run ``master``; returns a summary with the findings.

    ``{"cases", "refused", "accepted", "findings": {class: [{"index", "seed", "mutations", "text",
    "artifact"}]}, "seconds"}``.
    """
    env = dict(os.environ if env is None else env)
    started = time.monotonic()
    summary = {"cases": 0, "refused": 0, "accepted": 0, "findings": {}, "master": master, "by_kind": {},
               "peak_extra": [0, None, 0], "slowest": [0.0, None, None, []]}
    with tempfile.TemporaryDirectory(prefix="pagedkv-snapfuzz-") as tmp:
        seeds = sm.seed_files(tmp)
        worker = None
        index = 0
        try:
            while True:
                if cases is not None and index >= cases:
                    break
                if seconds is not None and time.monotonic() - started >= seconds:
                    break
                seed, data, mutations = case_for(seeds, master, index)
                path = os.path.join(tmp, f"case-{index}.bin")
                with open(path, "wb") as f:
                    f.write(data)
                if worker is None or not worker.alive:
                    if worker is not None:
                        worker.stop()
                    worker = Worker(os.path.join(tmp, "worker.log"), env)
                case = {"kind": seed["kind"], "path": path, "target": seed["target"], "seed": index,
                        "extra_key": seed["extra_key"]}
                reply = worker.run(case, timeout, rss_limit_mib << 20)
                summary["cases"] += 1
                if reply.get("seconds", 0) > summary["slowest"][0]:
                    summary["slowest"] = [reply["seconds"], index, seed["name"], mutations]
                if reply.get("peak_extra", 0) > summary["peak_extra"][0]:
                    summary["peak_extra"] = [reply["peak_extra"], index, len(data)]
                outcome = reply["outcome"]
                counts = summary["by_kind"].setdefault(seed["kind"], {"refused": 0, "accepted": 0, "finding": 0})
                counts[outcome if outcome in counts else "finding"] += 1
                if outcome in ("refused", "accepted"):
                    summary[outcome] += 1
                else:
                    found = summary["findings"].setdefault(reply["class"], [])
                    entry = {"index": index, "seed": seed["name"], "mutations": mutations,
                             "text": reply.get("text", "")[:2000], "artifact": None}
                    if artifacts and len(found) < keep_per_class:
                        entry["artifact"] = _save_artifact(artifacts, seed, data, mutations, reply, master, index)
                    if not found:
                        log(f"[snapfuzz] case {index}: new finding {reply['class']} ({seed['name']}: "
                            f"{'; '.join(mutations)})")
                    found.append(entry)
                try:
                    os.unlink(path)
                except OSError:  # still mapped by the worker (Windows): the directory goes at the end
                    pass
                index += 1
        finally:
            if worker is not None:
                worker.stop()
    summary["seconds"] = time.monotonic() - started
    return summary


def _save_artifact(directory: str, seed: dict, data: bytes, mutations: list, reply: dict, master: int,
                   index: int) -> str:
    os.makedirs(directory, exist_ok=True)
    digest = hashlib.sha1(data).hexdigest()[:16]
    base = os.path.join(directory, f"snapshot-{seed['kind']}-{digest}")
    with open(base + ".bin", "wb") as f:
        f.write(data)
    with open(base + ".json", "w") as f:
        json.dump({"kind": seed["kind"], "target": seed["target"], "extra_key": seed["extra_key"],
                   "seed_file": seed["name"], "master": master,
                   "index": index, "mutations": mutations, "class": reply["class"], "text": reply.get("text", "")},
                  f, indent=1)
    return base + ".bin"


def replay(path: str) -> int:
    """Run one saved case in this process and print the outcome (a finding with its traceback)."""
    with open(path[:-4] + ".json" if path.endswith(".bin") else path + ".json") as f:
        meta = json.load(f)
    print(f"{path}: {meta['seed_file']}: {'; '.join(meta['mutations'])}")
    try:
        outcome = check_case(meta["kind"], path, meta["target"], meta["index"], meta.get("extra_key"))
    except Finding as finding:
        print(f"FINDING {finding.kind}\n{finding.text}")
        return 1
    print(f"no finding ({outcome})")
    return 0


def report(summary: dict, log=print) -> None:
    log(f"[snapfuzz] {summary['cases']} cases in {summary['seconds']:.1f} s (run {summary['master']}): "
        f"{summary['refused']} refused, {summary['accepted']} accepted, "
        f"{sum(len(v) for v in summary['findings'].values())} findings in {len(summary['findings'])} classes")
    peak, index, size = summary["peak_extra"]
    log(f"  largest peak RSS growth of a load or import besides the pool: {peak / 2**20:.1f} MiB (case {index}, "
        f"a file of {size} bytes; the bound is max(2 x file, 256 MiB))")
    seconds, index, name, mutations = summary["slowest"]
    log(f"  slowest case: {seconds:.2f} s (case {index}, {name}: {'; '.join(mutations)})")
    log("  by kind: " + ", ".join(f"{kind} {c['refused']} refused / {c['accepted']} accepted / {c['finding']} findings"
                                  for kind, c in sorted(summary["by_kind"].items())))
    for kind, entries in sorted(summary["findings"].items()):
        first = entries[0]
        log(f"  {kind}: {len(entries)} cases, first #{first['index']} ({first['seed']}: "
            f"{'; '.join(first['mutations'])})")
        log("    " + first["text"].strip().splitlines()[0][:300] if first["text"].strip() else "")
        if first["artifact"]:
            log(f"    artifact {first['artifact']}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--cases", type=int, help="number of cases (default: until --seconds)")
    parser.add_argument("--seconds", type=float, help="time budget in seconds")
    parser.add_argument("--seed", type=int, help="run seed (default: random, printed)")
    parser.add_argument("--artifacts", default=None, help="directory for failing cases (default: none saved)")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds per case before it is a hang")
    parser.add_argument("--rss-limit-mib", type=int, default=3072, help="worker RSS that counts as a finding")
    parser.add_argument("--replay", nargs="+", help="rerun saved cases in this process")
    args = parser.parse_args(argv)
    if args.worker:
        worker_main()
        return 0
    if args.replay:
        return max(replay(p) for p in args.replay)
    if args.cases is None and args.seconds is None:
        parser.error("give --cases, --seconds or both")
    master = args.seed if args.seed is not None else random.SystemRandom().randrange(2**32)
    print(f"[snapfuzz] run seed {master} (rerun with --seed {master})", flush=True)
    summary = run(cases=args.cases, seconds=args.seconds, master=master, artifacts=args.artifacts,
                  timeout=args.timeout, rss_limit_mib=args.rss_limit_mib,
                  log=lambda text: print(text, flush=True))
    report(summary)
    return 1 if summary["findings"] else 0


if __name__ == "__main__":
    sys.exit(main())
