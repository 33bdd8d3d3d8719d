"""The structure-aware snapshot fuzzer (tests/fuzz/fuzz_snapshots.py) on fixed seeds, and its own parts.

Every case is a valid snapshot, exported sequence or ``PagedKVCache``
snapshot from a real cache with structural mutations and every checksum
recomputed, loaded in a worker process: it must be refused with
``SnapshotError`` (``OutOfPagesError`` for an import) or give a cache that
passes ``check_invariants()`` and survives appends, stores, a fork, a
truncate, ``add_sequence``, gathers and a save/load round trip. The fixed
runs below take a few seconds; ``scripts/sanitize.sh`` runs the fuzzer for
longer with random seeds on the sanitizer build.
"""
import os
import random
import sys
import tempfile

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "fuzz"))

import fuzz_snapshots as fs  # noqa: E402
import snapshot_mutator as sm  # noqa: E402

from pagedkv import KVCache, SnapshotError  # noqa: E402
from pagedkv import snapshot as snap  # noqa: E402

#: Which item of issue 29 a finding class belongs to (for the failure message only: any finding fails).
ISSUE_ITEMS = {
    "check_invariants": "item 1 (forged table geometry accepted: validate as strictly as check_invariants)",
    "verify-load-disagree": "item 2 (verify and load must share one validator)",
    "verify_pages-reports-loaded-page": "item 3 (recorded seal checksums not cross-checked at load)",
    "counter-negative": "item 4 (counters wrap past 2**63 - 1)",
    "resaved-file-refused": "item 4 (a loaded cache writes a file it cannot read back)",
    "raised-ValueError": "a bare ValueError instead of SnapshotError naming the section",
    "crash": "a crash: see the worker's stderr in the finding",
    "timeout": "a hang (item 1: append spinning on a forged ring)",
    "memory": "an allocation beyond the bound of the module notes",
}

#: Fixed runs: (run seed, cases). 900 cases, a few seconds.
RUNS = [(1, 300), (2, 300), (29, 300)]


# ------------------------------------------------ one case of each class the fuzzer found
# Each builds (kind, bytes, import target, extra_key) from a seed cache with the edit that first showed the
# class (checksums recomputed); the worker must answer it without a finding.
def _seed(name):
    cache = sm.make_cache(name)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "seed.snap")
        cache.save(path)
        with open(path, "rb") as f:
            return cache, sm.parse(f.read())


def _edit(c, section, name, change):
    e = c.section(section).entry(name)
    a = e.array().copy()
    a = change(a)
    e.set(a)


def _case_window_length_snapshot():
    """Item 1: a windowed, forked sequence's length raised by 2 (window 8, 3 sink tokens, pages of 2)."""
    _, c = _seed("window-sinks-fork-f32")
    row = c.section("tables").entry("seq_ids").array().tolist().index(4)
    _edit(c, "tables", "fields", lambda a: (a.__setitem__((row, 0), a[row, 0] + 2), a)[1])
    return "cache", c.build(), None, None


def _case_window_length_import():
    """Item 1 through import_sequence: the same edit in exported bytes."""
    cache = sm.make_cache("window-sinks-fork-f32")
    c = sm.parse(cache.export_sequence(4))
    _edit(c, "tables", "fields", lambda a: (a.__setitem__((0, 0), a[0, 0] + 2), a)[1])
    return "sequence", c.build(), sm.CACHE_CONFIGS["window-sinks-fork-f32"], "tenant-a"


def _case_chain_count():
    """Item 2: one hash more in a chain (count and chain consistent): verify and load must agree."""
    _, c = _seed("window1-sha256")
    fields = c.section("hashes").entry("fields").array()
    _edit(c, "hashes", "chain", lambda a: np.insert(a, int(fields[0, 1]), [1, 2], axis=0).astype(np.uint64))
    _edit(c, "hashes", "fields", lambda a: (a.__setitem__((0, 1), a[0, 1] + 1), a)[1])
    return "cache", c.build(), None, None


def _case_seal_checksum():
    """Item 3: the recorded checksum of a sealed page forged to 0, the page intact."""
    _, c = _seed("blocks-prefix-checksums")
    page = int(np.flatnonzero(c.section("sealed").entry("sealed").array())[0])
    _edit(c, "sealed", "checksums", lambda a: (a.__setitem__(page, 0), a)[1])
    return "cache", c.build(), None, None


def _case_counter(name):
    def build():
        """Item 4: a counter at 2**63 - 1."""
        _, c = _seed("plain-f32")
        _edit(c, "counters", name, lambda a: np.asarray(2**63 - 1, dtype=np.int64))
        return "cache", c.build(), None, None
    return build


def _case_classic_counter():
    """Item 4, PagedKVCache: hits at 2**63 - 1."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "classic.snap")
        sm.make_classic("float32").save(path)
        with open(path, "rb") as f:
            c = sm.parse(f.read())
    _edit(c, "counters", "hits", lambda a: np.asarray(2**63 - 1, dtype=np.int64))
    return "classic", c.build(), None, None


def _case_pages_sealed():
    """Item 4: the seal counter at 2**63 - 2 (the re-saved file must load)."""
    _, c = _seed("window1-sha256")
    _edit(c, "sealed", "pages_sealed", lambda a: np.asarray(2**63 - 2, dtype=np.int64))
    return "cache", c.build(), None, None


def _forged(c):
    for i in range(40):
        c2 = sm.parse(c.build())
        what = sm.m_forge_chain(c2, random.Random(i))
        if what and "token ids" in what:
            return c2
    raise AssertionError("m_forge_chain never forged the token ids")


def _case_forged_chain_import():
    """Item 9: an exported chain and kept token ids forged to another tenant's (salt 'victim')."""
    cache = sm.make_cache("full-prefix-f16")
    return "sequence", _forged(sm.parse(cache.export_sequence(1))).build(), sm.CACHE_CONFIGS["full-prefix-f16"], \
        "tenant-a"


def _case_forged_chain_snapshot():
    """Item 9 in a snapshot: the chain, kept token ids and prefix index hashes forged."""
    _, c = _seed("full-prefix-f16")
    return "cache", _forged(c).build(), None, None


def _case_huge_extent(kind):
    def build():
        """The metadata decoder: an entry of shape (0, 2**63) has no bytes, so the size check passes."""
        if kind == "sequence":
            c = sm.parse(sm.make_cache("plain-f32").export_sequence(1))
        else:
            _, c = _seed("plain-f32")
        e = c.section("tables").entry("pages")
        e.shape, e.raw = [0, 2**63], b""
        return kind, c.build(), sm.CACHE_CONFIGS["plain-f32"], None
    return build


FOUND = {
    "cache:after-load:check_invariants": _case_window_length_snapshot,
    "sequence:after-load:check_invariants": _case_window_length_import,
    "cache:verify-load-disagree": _case_chain_count,
    "cache:verify_pages-reports-loaded-page": _case_seal_checksum,
    "cache:after-calls:counter-negative(tokens_appended)": _case_counter("tokens_appended"),
    "cache:after-calls:counter-negative(pages_allocated)": _case_counter("pages_allocated"),
    "classic:after-calls:counter-negative": _case_classic_counter,
    "cache:resaved-file-refused": _case_pages_sealed,
    "sequence:forged-hash-served": _case_forged_chain_import,
    "cache:forged-hash-served": _case_forged_chain_snapshot,
    "sequence:import:raised-ValueError": _case_huge_extent("sequence"),
    "cache:verify:raised-ValueError": _case_huge_extent("cache"),
}


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    log = tmp_path_factory.mktemp("worker") / "worker.log"
    box = [fs.Worker(str(log), dict(os.environ))]
    yield box
    box[0].stop()


def test_a_page_shared_at_two_positions_is_refused_before_a_save_could_fail(tmp_path):
    """Found by a run on the sanitizer build (run 196064263, case 10986: a sink page of a windowed
    sequence replaced by a page the prefix index holds under another sequence's hash). The load
    accepted it, and the sequence's next append registered the page under the wrong hash, so
    save refused the file it was writing. The load must refuse it."""
    seeds = sm.seeds_before_formats(sm.seed_files(str(tmp_path)))  # the seeds of that run
    seed, data, mutations = fs.case_for(seeds, 196064263, 10986)
    assert "tables.pages[16] 1 -> 40" in mutations, mutations  # the case as found
    path = tmp_path / "case.bin"
    path.write_bytes(data)
    with pytest.raises(SnapshotError, match="section 'prefix': .*page 40, held by sequence 4 as logical page 1"):
        KVCache.load(str(path))


@pytest.mark.parametrize("found", sorted(FOUND))
def test_found_class_has_no_finding(worker, tmp_path, found):
    """Each class the fuzzer found, as one fixed case: the loader refuses it, or the cache survives."""
    kind, data, target, extra_key = FOUND[found]()
    path = tmp_path / "case.bin"
    path.write_bytes(data)
    if not worker[0].alive:
        worker[0].stop()
        worker[0] = fs.Worker(worker[0].log_path, dict(os.environ))
    reply = worker[0].run({"kind": kind, "path": str(path), "target": target, "seed": 0, "extra_key": extra_key},
                          60, 0)
    assert reply["outcome"] in ("refused", "accepted"), f"{reply['class']}: {reply['text'][:1500]}"


def _explain(summary) -> str:
    lines = [f"{sum(len(v) for v in summary['findings'].values())} findings in {summary['cases']} cases:"]
    for kind, entries in sorted(summary["findings"].items()):
        item = next((text for key, text in ISSUE_ITEMS.items() if key in kind), "not an item of issue 29")
        first = entries[0]
        lines.append(f"- {kind} [{item}]: {len(entries)} cases; first #{first['index']} of run "
                     f"{summary['master']} ({first['seed']}: {'; '.join(first['mutations'])})")
        lines.append("    " + (first["text"].strip().splitlines() or [""])[0][:300])
        if first["artifact"]:
            lines.append(f"    replay: python tests/fuzz/fuzz_snapshots.py --replay {first['artifact']}")
    return "\n".join(lines)


@pytest.mark.parametrize("master,cases", RUNS)
def test_fixed_fuzz_run_has_no_finding(tmp_path, master, cases):
    summary = fs.run(cases=cases, master=master, artifacts=str(tmp_path / "artifacts"), timeout=60,
                     log=lambda text: None)
    assert summary["cases"] == cases
    # The run reaches both outcomes: mutations that the checks refuse and ones that still load.
    assert summary["refused"] > cases // 4 and summary["accepted"] > cases // 20, summary
    assert not summary["findings"], _explain(summary)


def test_seed_files_round_trip_through_the_mutator(tmp_path):
    """Parsing and rebuilding a valid file gives the same bytes, and every kind of seed is there."""
    seeds = sm.seed_files(str(tmp_path))
    assert {s["kind"] for s in seeds} == {"cache", "sequence", "classic"}
    for seed in seeds:
        assert sm.parse(seed["data"]).build() == seed["data"], seed["name"]


def test_every_seed_file_passes_unmutated(tmp_path):
    """Each seed file, as written, loads (or imports with its salt) and survives every check: a finding on
    a mutated case is then the mutation's doing."""
    for index, seed in enumerate(sm.seed_files(str(tmp_path))):
        path = tmp_path / "seed.bin"
        path.write_bytes(seed["data"])
        assert fs.check_case(seed["kind"], str(path), seed["target"], index, seed["extra_key"]) == "accepted", \
            seed["name"]


def test_every_mutation_applies_and_keeps_checksums_valid(tmp_path):
    """Each mutation changes some seed file; a metadata edit leaves all checksums right, so the loader
    refuses it for its structure (never a checksum mismatch of a metadata section, the table or the header)."""
    seeds = [s for s in sm.seed_files(str(tmp_path)) if s["kind"] == "cache"]
    rng = random.Random(5)
    for mutation, _ in sm.MUTATIONS:
        if mutation in (sm.m_container_fields, sm.m_meta_bytes, sm.m_classic_state):
            continue
        changed = 0
        for i in range(40):
            seed = seeds[i % len(seeds)]
            c = sm.parse(seed["data"])
            if mutation(c, rng) is None:
                continue
            data = c.build()
            if data == seed["data"]:
                continue
            changed += 1
            path = tmp_path / "case.snap"
            path.write_bytes(data)
            try:
                KVCache.load(path)
            except SnapshotError as exc:
                assert "checksum mismatch (the" not in str(exc), (mutation.__name__, str(exc))
        assert changed, f"{mutation.__name__} changed no file"


def test_recomputed_page_checksums_make_flipped_pages_load(tmp_path):
    """Page bytes flipped with the page checksums (and the seal checksums) recomputed load: only structure
    is tested. Without the recomputation the same file is refused for the page."""
    cache = sm.make_cache("plain-f32")
    path = tmp_path / "a.snap"
    cache.save(path)
    c = sm.parse(path.read_bytes())
    pages = c.section("pages")
    raw = bytearray(pages.raw)
    raw[-1] ^= 0x40
    pages.raw = bytes(raw)
    path.write_bytes(c.build())
    with pytest.raises(SnapshotError, match="page"):
        KVCache.load(path)
    assert sm.recompute_page_checksums(c, seals=True)
    path.write_bytes(c.build())
    snap.verify(path)
    assert not np.array_equal(np.asarray(KVCache.load(path).kv), np.asarray(cache.kv))


def test_worker_reports_each_kind_of_failure(tmp_path):
    """The worker answers a finding, a crash (signal), a hang and over-limit memory, and is restarted after
    each death; a valid case then passes."""
    env = dict(os.environ)
    log = str(tmp_path / "worker.log")
    seeds = sm.seed_files(str(tmp_path))
    seed = next(s for s in seeds if s["name"] == "plain-f32")
    good = tmp_path / "good.snap"
    good.write_bytes(seed["data"])
    case = {"kind": "cache", "path": str(good), "target": seed["target"], "seed": 0}
    worker = fs.Worker(log, env)
    try:
        assert worker.run(case, 60, 0)["outcome"] == "accepted"
        assert worker.run({**case, "kind": "classic"}, 60, 0)["outcome"] == "refused"  # another kind's file
        crash = worker.run({**case, "kind": "crash"}, 60, 0)
        # SIGSEGV; on the sanitizer build AddressSanitizer catches it and reports; on Windows an exit code
        assert crash["outcome"] == "finding" and crash["class"].startswith("crash:crash-"), crash
        if sys.platform.startswith("linux") and "asan" not in os.environ.get("LD_PRELOAD", ""):
            assert crash["class"] == "crash:crash-signal-SIGSEGV", crash
        assert not worker.alive
    finally:
        worker.stop()
    worker = fs.Worker(log, env)
    try:
        hang = worker.run({**case, "kind": "hang"}, 2, 0)
        assert hang["class"] == "hang:timeout"
    finally:
        worker.stop()
    if os.path.exists(f"/proc/{os.getpid()}/status"):  # the watchdog reads the worker's RSS there
        worker = fs.Worker(log, env)
        try:
            memory = worker.run({**case, "kind": "allocate"}, 60, 400 << 20)
            assert memory["class"] == "allocate:memory-watchdog", memory
        finally:
            worker.stop()


_MEASURE = """
import sys
sys.path.insert(0, sys.argv[1])
import numpy as np
import fuzz_snapshots as fs
with fs.PeakMemory() as meter:
    block = np.ones(400 << 20 >> 3)  # 400 MiB, touched
print(int(meter.exact), meter.extra)
"""


def test_memory_bound_is_checked():
    """A load whose peak RSS exceeds the pool plus max(2 x file, 256 MiB) is a finding; on Linux the peak
    is measured per case (the peak is reset before it). Measured in a fresh interpreter, as in a worker:
    here, memory that earlier tests freed but the allocator kept would take the block without growth."""
    import subprocess
    out = subprocess.run([sys.executable, "-c", _MEASURE, os.path.dirname(fs.__file__)], capture_output=True,
                         text=True, check=True).stdout.split()
    exact, extra = int(out[0]), int(out[1])
    if exact:
        assert extra >= 380 << 20
    meter = fs.PeakMemory()
    meter.extra = max(extra, 400 << 20)
    with pytest.raises(fs.Finding, match="memory-over-bound"):
        fs._check_memory(meter, 0, 1000, "cache:load")
    fs._check_memory(meter, 200 << 20, 1000, "cache:load")  # the pool counts
