"""Thread settings for running a model on the CPU: BLAS threads and attention threads.

A forward pass alternates between two thread pools: NumPy's BLAS (OpenBLAS, its own
pthreads) for the weight products of long prefill chunks, and OpenMP for the paged
attention kernels and the small-batch weight products of decode steps and short chunks
(``pagedkv_c._matmul``, up to ``LlamaModel.kernel_max_rows`` rows). Every
parallel region waits for its slowest worker, so a worker that has to wait for a core
held by another process stalls the whole step: next to a busy neighbour on a 2-core
machine, two threads of each made a decode step up to 2.1x slower than one thread, while
on the idle machine they made it up to 1.5x faster (see docs/smollm2.md, "Threads").

The default thread count (``num_threads="auto"`` of ``LlamaModel`` and ``PagedBackend``,
and of the ``pagedkv`` commands) is therefore the number of cores this process can have
to itself, chosen once per process by :func:`choose_num_threads`: the CPUs of its
affinity mask, capped by the CPU quota of its cgroup and by the cores that a short
``/proc/stat`` sample finds idle. Where the load cannot be measured (no ``/proc/stat``),
the default is one thread. An explicit thread count always wins.

Under ``"auto"``, a decode step of fewer than :data:`SMALL_BATCH_ROWS` sequences (and a
forward pass of that few tokens) runs its weight products and attention on one thread
(:func:`threads_for_rows`): each of its roughly 240 parallel regions per step wakes a
sleeping worker, which costs more than the second core gives to a product of one row.
Measured on the idle 2-core machine with SmolLM2-135M: ``pagedkv generate`` (float16
pages) decoded 1.06x to 1.13x faster on one thread than on two at 1 sequence, 1.04x to
1.10x at 4 and 1.08x to 1.12x at 8, and the same at 16; steps of a fixed batch over a
float32 pool (context 64 to 1,024 tokens) were 5% to 12% faster on one thread at 1 to 3
sequences, 1% to 6% slower at 4, 5% slower at 8, and 1.3x to 1.5x slower at 16 and 32.

``import pagedkv`` also makes the idle workers of both pools sleep at once instead of
spinning, so that they neither take the cores the other pool needs nor fight a
neighbouring process (and a sleeping worker, once woken, is scheduled sooner than one
that has used its time slice spinning):

- ``OMP_WAIT_POLICY=PASSIVE``, set before the compiled core loads the OpenMP runtime,
  which reads it once, at load;
- ``OPENBLAS_THREAD_TIMEOUT=4`` (OpenBLAS's minimum: workers spin 2**4 cycles, instead
  of 2**28, before they sleep), set only if NumPy has not been imported yet, since
  OpenBLAS reads it when NumPy loads it.

A variable the environment already sets is left as it is.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

from pagedkv_c._checks import checked_int

AUTO: Literal["auto"] = "auto"
"""``num_threads`` value that asks for :func:`default_num_threads` (the default of the models)."""

SMALL_BATCH_ROWS = 8
"""Under ``"auto"``, forward passes of fewer rows (tokens) than this run on one thread (:func:`threads_for_rows`)."""

LOAD_SAMPLE_SECONDS = 0.03
"""Length of the ``/proc/stat`` sample of :func:`choose_num_threads`, in seconds (3 ticks of 10 ms)."""

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ThreadChoice:
    """The thread count :func:`choose_num_threads` picked, and why.

    Attributes
    ----------
    num_threads : int
        Threads for NumPy's BLAS and for the attention kernels, >= 1.
    usable_cores : int
        CPUs of the affinity mask, capped by the cgroup CPU quota (whole cores, >= 1).
    idle_cores : float or None
        Cores found idle by the ``/proc/stat`` sample, summed over the CPUs of the
        affinity mask (0.0 to their count); None if the load could not be measured.
    reason : str
        One line for a log or a command's report.
    """

    num_threads: int
    usable_cores: int
    idle_cores: float | None
    reason: str


def _read_text(path: str) -> str | None:
    """Contents of a small system file, or None if it cannot be read."""
    try:
        with open(path, encoding="ascii", errors="replace") as file:
            return file.read()
    except OSError:
        return None


def _affinity() -> set[int] | None:
    """CPUs this process may run on (``os.sched_getaffinity``), or None where unavailable."""
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # macOS, Windows
        return None


def usable_cpus(cpus: set[int] | None, cpu_count: Callable[[], int | None] = os.cpu_count) -> int:
    """CPUs this process may run on: those of its affinity mask ``cpus``, else the machine's; at least 1.

    The cgroup CPU quota is not applied here (see :func:`choose_num_threads`).
    """
    return len(cpus) if cpus else max(cpu_count() or 1, 1)


def _cgroup_dirs(root: str, path: str) -> list[str]:
    """``root + path`` and each of its ancestors up to ``root`` (the nearest first)."""
    parts = [p for p in path.strip().split("/") if p and p != ".."]
    return [root + "".join("/" + p for p in parts[:i]) for i in range(len(parts), -1, -1)]


def _quota_cores(quota: str, period: str) -> float | None:
    """``quota / period`` as cores, or None for no limit ("max" or a negative quota) or bad text."""
    try:
        quota_us, period_us = int(quota), int(period)
    except ValueError:
        return None
    return quota_us / period_us if quota_us > 0 and period_us > 0 else None


def cgroup_cpu_limit(read_text: Callable[[str], str | None] = _read_text) -> float | None:
    """CPU quota of this process's cgroup, in cores (quota / period); None if there is none.

    The smallest limit along the cgroup's path is taken (a parent's quota binds its
    children), from ``cpu.max`` (cgroup v2) or ``cpu.cfs_quota_us`` /
    ``cpu.cfs_period_us`` (cgroup v1). The path comes from ``/proc/self/cgroup``; the
    mount's root is read too, which is the container's own cgroup when the container
    does not see the host's hierarchy.

    Parameters
    ----------
    read_text : callable
        ``read_text(path) -> str or None``: a file's contents, None if it cannot be read.

    Returns
    -------
    float or None
        Cores (for example 1.5 for ``150000 100000``), or None without a quota.
    """
    v2_path, v1_path = "", ""
    for line in (read_text("/proc/self/cgroup") or "").splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and not controllers:
            v2_path = path
        elif "cpu" in controllers.split(","):
            v1_path = path
    limits = []
    for directory in _cgroup_dirs("/sys/fs/cgroup", v2_path):
        fields = (read_text(directory + "/cpu.max") or "").split()
        if len(fields) == 2:
            limits.append(_quota_cores(*fields))
    for directory in _cgroup_dirs("/sys/fs/cgroup/cpu", v1_path):
        quota, period = read_text(directory + "/cpu.cfs_quota_us"), read_text(directory + "/cpu.cfs_period_us")
        if quota is not None and period is not None:
            limits.append(_quota_cores(quota.strip(), period.strip()))
    limits = [limit for limit in limits if limit is not None]
    return min(limits) if limits else None


def _cpu_times(stat_text: str | None, cpus: set[int] | None) -> dict[int, tuple[int, int]]:
    """Per CPU of ``cpus`` (all if None): (idle ticks, total ticks) from ``/proc/stat`` text.

    Idle is ``idle + iowait``; total adds ``user nice system irq softirq steal`` (``guest``
    is already part of ``user``), so time a hypervisor stole counts as busy.
    """
    times = {}
    for line in (stat_text or "").splitlines():
        name, *fields = line.split()
        if not name.startswith("cpu") or not name[3:].isdigit() or len(fields) < 4:
            continue
        cpu = int(name[3:])
        if cpus is not None and cpu not in cpus:
            continue
        try:
            ticks = [int(f) for f in fields[:8]]
        except ValueError:
            continue
        idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)
        times[cpu] = (idle, sum(ticks))
    return times


def idle_cores(cpus: set[int] | None, read_text: Callable[[str], str | None] = _read_text,
               sleep: Callable[[float], None] = time.sleep, seconds: float = LOAD_SAMPLE_SECONDS) -> float | None:
    """Cores left idle by everything else running, from two reads of ``/proc/stat``.

    This process sleeps between the reads, so its own main thread is not counted; every
    other thread and process is, whatever its nice value.

    Parameters
    ----------
    cpus : set of int or None
        CPU numbers to look at (the affinity mask); None: every CPU.
    read_text : callable
        ``read_text(path) -> str or None``, called for ``/proc/stat`` before and after.
    sleep : callable
        ``sleep(seconds)`` between the two reads.
    seconds : float
        Length of the sample in seconds; the kernel counts in ticks of 10 ms, so each
        CPU's share is known to about one tick (a third of a CPU over the default 30 ms).

    Returns
    -------
    float or None
        The sum over the CPUs of the share of the sample each spent idle (0.0 to
        ``len(cpus)``); None if ``/proc/stat`` cannot be read or no tick passed.
    """
    before = _cpu_times(read_text("/proc/stat"), cpus)
    if not before:
        return None
    sleep(seconds)
    after = _cpu_times(read_text("/proc/stat"), cpus)
    shares = []
    for cpu, (idle_after, total_after) in after.items():
        if cpu in before:
            idle_delta, total_delta = idle_after - before[cpu][0], total_after - before[cpu][1]
            if total_delta > 0:
                shares.append(min(max(idle_delta / total_delta, 0.0), 1.0))
    return sum(shares) if shares else None


def choose_num_threads(*, read_text: Callable[[str], str | None] = _read_text,
                       affinity: Callable[[], set[int] | None] = _affinity,
                       cpu_count: Callable[[], int | None] = os.cpu_count,
                       sleep: Callable[[float], None] = time.sleep,
                       sample_seconds: float = LOAD_SAMPLE_SECONDS) -> ThreadChoice:
    """Pick the number of threads this process can run without waiting for cores held by others.

    1. Usable cores: the CPUs of the affinity mask (``os.sched_getaffinity``, else
       ``os.cpu_count()``), capped by the cgroup CPU quota rounded down to whole cores
       (threads beyond the quota are throttled at the end of each period, and a step
       waits for the throttled one); at least 1.
    2. Idle cores: a ``sample_seconds`` sample of ``/proc/stat`` over the CPUs of the
       mask (see :func:`idle_cores`).
    3. Threads: the idle cores rounded to the nearest whole core, between 1 and the
       usable cores; 1 if the load cannot be measured (not Linux), since one thread is
       never slowed by a busy neighbour's hold on a second core.

    The 1-minute load average is not used: it lags a neighbour that started seconds ago,
    counts this program's own previous run, and covers every CPU of the host rather than
    those of the mask. The sample costs ``sample_seconds`` (30 ms) of waiting, and it
    sees only the moment of the call: a neighbour that starts later is not seen.

    Parameters
    ----------
    read_text : callable
        ``read_text(path) -> str or None``: reads ``/proc/stat``, ``/proc/self/cgroup``
        and the cgroup CPU files (tests pass fake readings).
    affinity : callable
        ``affinity() -> set of int or None``: CPU numbers this process may run on.
    cpu_count : callable
        ``cpu_count() -> int or None``: CPUs of the machine, used without a mask.
    sleep : callable
        ``sleep(seconds)`` between the two ``/proc/stat`` reads.
    sample_seconds : float
        Length of the load sample in seconds, > 0.

    Returns
    -------
    ThreadChoice

    Raises
    ------
    ValueError
        If ``sample_seconds`` is not a finite number > 0.
    """
    if not (isinstance(sample_seconds, (int, float)) and 0 < sample_seconds < math.inf):
        raise ValueError(f"Invalid value of sample_seconds: expected a finite number > 0, got {sample_seconds!r}")
    cpus = affinity()
    usable = usable_cpus(cpus, cpu_count)
    where = f"{usable} CPU{'s' * (usable != 1)}" + (" in the affinity mask" if cpus else "")
    quota = cgroup_cpu_limit(read_text)
    if quota is not None and math.floor(quota) < usable:
        usable = max(math.floor(quota), 1)
        where += f", cgroup CPU quota {quota:g} cores"
    if usable == 1:
        return ThreadChoice(1, 1, None, f"1 usable core: {where}")
    idle = idle_cores(cpus or None, read_text, sleep, sample_seconds)
    if idle is None:
        return ThreadChoice(1, usable, None, f"{usable} usable cores: {where}; the load is unknown (no /proc/stat), "
                                             "and one thread cannot wait for a core a neighbour holds")
    threads = min(max(math.floor(idle + 0.5), 1), usable)
    return ThreadChoice(threads, usable, idle, f"{usable} usable cores: {where}; "
                                               f"{idle:.1f} idle in a {sample_seconds * 1e3:.0f} ms sample")


@functools.lru_cache(maxsize=1)
def _default_choice() -> ThreadChoice:
    choice = choose_num_threads()
    _log.info("pagedkv default threads: %d (%s)", choice.num_threads, choice.reason)
    return choice


def default_num_threads() -> ThreadChoice:
    """The default thread count of this process: :func:`choose_num_threads`, run once and kept.

    The first call samples the load (30 ms) and logs the choice and its reason at INFO
    level on the ``pagedkv.models.threads`` logger; later calls return the same choice.

    Returns
    -------
    ThreadChoice
    """
    return _default_choice()


def resolve_num_threads(num_threads: int | Literal["auto"] | None) -> int | None:
    """The thread count a ``num_threads`` argument stands for.

    Parameters
    ----------
    num_threads : int, "auto" or None
        An int >= 1 is kept; ``"auto"`` gives :func:`default_num_threads`; None stays
        None (leave the runtime's own setting).

    Returns
    -------
    int or None

    Raises
    ------
    ValueError
        If ``num_threads`` is none of these.
    """
    if isinstance(num_threads, str) and num_threads == AUTO:
        return default_num_threads().num_threads
    return None if num_threads is None else _check_num_threads(num_threads)


def threads_for_rows(num_threads: int | None, auto: bool, rows: int) -> int | None:
    """The threads of one call of a forward pass of ``rows`` rows (tokens).

    Parameters
    ----------
    num_threads : int or None
        The resolved thread count of the model or backend (None: the runtime's own).
    auto : bool
        Whether ``num_threads`` came from ``"auto"``.
    rows : int
        Rows of the call: the tokens of a weight product, the sequences of a decode step.

    Returns
    -------
    int or None
        1 under ``"auto"`` for fewer than :data:`SMALL_BATCH_ROWS` rows (see the module
        notes for the measurement); ``num_threads`` otherwise.
    """
    return 1 if auto and rows < SMALL_BATCH_ROWS else num_threads


class BlasThreadLimit:
    """Reusable context manager: NumPy's BLAS runs ``num_threads`` threads inside each ``with`` block.

    Unlike :func:`blas_threads`, the loaded BLAS libraries are looked up once per
    process (a ``threadpoolctl.ThreadpoolController`` made on first use, so a BLAS
    library loaded after that is not limited), so entering and leaving the block costs
    tens of microseconds (60 us measured on a busy 2-core machine) and can wrap every
    forward pass (tens of milliseconds for SmolLM2-135M).

    Parameters
    ----------
    num_threads : int, "auto" or None
        Threads, >= 1; ``"auto"``: :func:`default_num_threads`; None makes the block
        do nothing.

    Raises
    ------
    ValueError
        If ``num_threads`` is neither "auto", None nor an int >= 1.
    ModuleNotFoundError
        If ``num_threads`` is not None and ``threadpoolctl`` is not installed.
    """

    _controller: Any = None  # one ThreadpoolController for the process, made on first use

    def __init__(self, num_threads: int | Literal["auto"] | None) -> None:
        num_threads = resolve_num_threads(num_threads)
        if num_threads is not None:
            _import_threadpoolctl()
        self.num_threads = num_threads
        self._limiter = None

    def __enter__(self) -> BlasThreadLimit:
        if self.num_threads is not None:
            if BlasThreadLimit._controller is None:
                BlasThreadLimit._controller = _import_threadpoolctl().ThreadpoolController()
            self._limiter = BlasThreadLimit._controller.limit(limits=self.num_threads, user_api="blas")
        return self

    def __exit__(self, *exc_info) -> None:
        limiter, self._limiter = self._limiter, None
        if limiter is not None:
            limiter.restore_original_limits()


def _check_num_threads(num_threads) -> int:
    """``num_threads`` as an int (NumPy integers too): TypeError for a float, a bool or another
    type, ValueError outside ``[1, 2**31 - 1]``."""
    if isinstance(num_threads, str):
        raise ValueError(f"Invalid value of num_threads: expected 'auto', None or an int >= 1, got {num_threads!r}")
    return checked_int(num_threads, "num_threads", 1, 2**31 - 1)


def _import_threadpoolctl():
    try:
        import threadpoolctl
    except ModuleNotFoundError as exc:
        raise ModuleNotFoundError(
            "threadpoolctl is needed to set the BLAS thread count: pip install threadpoolctl "
            "(or the 'cli' extra of pagedkv); or pass num_threads=None to leave NumPy's BLAS alone",
            name="threadpoolctl",
        ) from exc
    return threadpoolctl


@contextlib.contextmanager
def blas_threads(num_threads: int | Literal["auto"] | None) -> Iterator[None]:
    """Limit NumPy's BLAS to ``num_threads`` threads inside the ``with`` block.

    Parameters
    ----------
    num_threads : int, "auto" or None
        Threads, >= 1; ``"auto"``: :func:`default_num_threads`; None leaves the BLAS
        library alone.

    Raises
    ------
    ValueError
        If ``num_threads`` is neither "auto", None nor an int >= 1.
    ModuleNotFoundError
        If ``threadpoolctl`` (extras ``cli`` and ``test``) is not installed and a limit
        is asked for.

    Notes
    -----
    Uses ``threadpoolctl.threadpool_limits(limits=num_threads, user_api="blas")``, which
    changes the thread count of every BLAS library loaded in the process and restores it
    on exit. The OpenMP threads of the attention kernels are set per call instead
    (``num_threads`` of :class:`~pagedkv.models.paged_backend.PagedBackend`).
    """
    num_threads = resolve_num_threads(num_threads)
    if num_threads is None:
        yield
        return
    try:
        from threadpoolctl import threadpool_limits
    except ModuleNotFoundError as exc:
        raise ModuleNotFoundError(
            "threadpoolctl is needed to set the BLAS thread count: pip install threadpoolctl "
            "(or the 'cli' extra of pagedkv)"
        ) from exc
    with threadpool_limits(limits=num_threads, user_api="blas"):
        yield
