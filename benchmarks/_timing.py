"""Shared timing helpers for the benchmarks in this folder.

Every figure a benchmark reports is a median over repetitions (at least 5)
measured in the same run as its baseline. The ``np.copyto`` probe gives the
memory bandwidth a copy of the same bytes achieves on this machine right now,
the physical limit for store/gather kernels.
"""
import datetime
import gc
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

MIN_REPEATS = 5
RESULTS_DIR = Path(__file__).resolve().parent / "results"


def measure(fn, *, repeats=7, number=None, min_seconds=0.02, setup=None):
    """Time ``fn()`` and return per-call statistics over ``repeats`` repetitions.

    Parameters
    ----------
    fn : callable
        Called with no arguments.
    repeats : int
        Number of repetitions, at least 5; the median is the reported figure.
    number : int or None
        Calls per repetition. None: calibrated so that one repetition takes
        at least ``min_seconds`` (in seconds).
    min_seconds : float
        Target duration of one repetition when calibrating (in seconds).
    setup : callable or None
        Called before each repetition, outside the timed region.

    Returns
    -------
    dict
        ``median``, ``min``, ``max`` (in seconds per call), ``repeats``,
        ``number`` (calls per repetition) and ``samples`` (per-call seconds of
        every repetition).

    Notes
    -----
    The garbage collector is disabled while timing, as ``timeit`` does.
    """
    if repeats < MIN_REPEATS:
        raise ValueError(f"Invalid value of repeats: expected >= {MIN_REPEATS}, got {repeats}")
    if number is None:
        number = _calibrate(fn, min_seconds, setup)
    samples = []
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        for _ in range(repeats):
            if setup is not None:
                setup()
            start = time.perf_counter()
            for _ in range(number):
                fn()
            samples.append((time.perf_counter() - start) / number)
    finally:
        if gc_was_enabled:
            gc.enable()
    return {
        "median": statistics.median(samples),
        "min": min(samples),
        "max": max(samples),
        "repeats": repeats,
        "number": number,
        "samples": samples,
    }


def _calibrate(fn, min_seconds, setup=None):
    """Calls per repetition so that one repetition takes >= min_seconds."""
    number = 1
    while True:
        if setup is not None:
            setup()
        start = time.perf_counter()
        for _ in range(number):
            fn()
        elapsed = time.perf_counter() - start
        if elapsed >= min_seconds or number >= 1 << 30:
            return number
        number *= 2 if elapsed <= 0 else max(2, min(10, int(1.2 * min_seconds / elapsed) + 1))


def compare(candidates, *, repeats=7, min_seconds=0.02, number=None, clock=time.perf_counter):
    """Time several callables in interleaved rounds; return per-call statistics for each.

    Parameters
    ----------
    candidates : dict of str -> callable
        The callables to compare (each called with no arguments).
    repeats : int
        Rounds, at least 5. In each round every candidate runs one
        repetition, so a change in the machine's load during the run hits
        all candidates alike and their ratios stay meaningful.
    min_seconds : float
        Target duration of one repetition when calibrating (in seconds).
    number : int or None
        Calls per repetition for every candidate; None calibrates each.
    clock : callable
        Returns the time in seconds: ``time.perf_counter`` (wall time, the
        default) or ``time.thread_time`` (CPU time of this thread, which a
        busy neighbour on a shared machine does not inflate).

    Returns
    -------
    dict of str -> dict
        For each name, the statistics of :func:`measure` (seconds per call).
    """
    if repeats < MIN_REPEATS:
        raise ValueError(f"Invalid value of repeats: expected >= {MIN_REPEATS}, got {repeats}")
    numbers = {name: number or _calibrate(fn, min_seconds) for name, fn in candidates.items()}
    samples = {name: [] for name in candidates}
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        for _ in range(repeats):
            for name, fn in candidates.items():
                count = numbers[name]
                start = clock()
                for _ in range(count):
                    fn()
                samples[name].append((clock() - start) / count)
    finally:
        if gc_was_enabled:
            gc.enable()
    return {
        name: {
            "median": statistics.median(values),
            "min": min(values),
            "max": max(values),
            "repeats": repeats,
            "number": numbers[name],
            "samples": values,
        }
        for name, values in samples.items()
    }


def copyto_task(sources):
    """Return ``(copy_all, nbytes)``: a callable that ``np.copyto``-s every source
    array into a preallocated twin, and the bytes it reads per call (= bytes
    written). Use it as a candidate of :func:`compare` beside the kernel that
    moves the same bytes."""
    pairs = [(np.empty_like(src), src) for src in sources]

    def copy_all():
        for dst, src in pairs:
            np.copyto(dst, src)

    return copy_all, sum(src.nbytes for src in sources)


def copyto_probe(sources, *, repeats=7, min_seconds=0.02):
    """Time ``np.copyto`` of every array in ``sources`` into a preallocated twin.

    Parameters
    ----------
    sources : sequence of numpy.ndarray
        The arrays to copy (the same bytes the measured kernel moves).
    repeats, min_seconds
        As for :func:`measure`.

    Returns
    -------
    dict
        :func:`measure`'s statistics for one round of copies, plus ``bytes``
        (bytes read per round, = bytes written) and ``gbps`` (GB/s of bytes
        read, 1 GB = 1e9 bytes, at the median).
    """
    copy_all, nbytes = copyto_task(sources)
    stats = measure(copy_all, repeats=repeats, min_seconds=min_seconds)
    stats["bytes"] = nbytes
    stats["gbps"] = nbytes / stats["median"] / 1e9
    return stats


def machine_info():
    """Describe the machine and software a result was measured on (dict)."""
    try:
        load = os.getloadavg()
    except OSError:
        load = None
    return {
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "load_average": load,
        "python": sys.version.split()[0],
        "numpy": np.__version__,
    }


def write_json(name, payload):
    """Write ``payload`` to ``benchmarks/results/<name>.json``; return the path."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2, default=_json_default) + "\n")
    return path


def _json_default(obj):
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    raise TypeError(f"cannot serialise {type(obj).__name__}")


def format_table(headers, rows):
    """Render rows as a GitHub-flavoured Markdown table (str)."""
    cells = [[str(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    lines = [
        "| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths)) + " |",
        "|" + "|".join("-" * (w + 2) for w in widths) + "|",
    ]
    for row in cells:
        lines.append("| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |")
    return "\n".join(lines)


def fmt_time(seconds):
    """Format a duration with a unit that keeps 3 significant digits."""
    if seconds < 1e-6:
        return f"{seconds * 1e9:.1f} ns"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.2f} us"
    if seconds < 1:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds:.2f} s"
