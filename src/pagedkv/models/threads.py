"""Thread settings for running a model on the CPU: BLAS threads and attention threads.

A forward pass alternates between two thread pools: NumPy's BLAS (OpenBLAS, its own
pthreads) for the weight products and OpenMP for the paged attention kernels. Idle
workers of either pool spin for a while before they sleep, so when both pools have more
than one thread, or when other processes share the cores, the spinning workers of one
pool steal the cores the other pool needs, and every parallel region waits for a
descheduled worker. On a shared 2-core machine this made a decode step several times
slower than running both pools with a single thread (see the README section on
SmolLM2-135M for the measurements). One thread for both is therefore the default of the
library (``LlamaModel(num_threads=1)``, ``PagedBackend(num_threads=1)``) and of the
``pagedkv`` commands.

For more threads, ``import pagedkv`` makes the idle workers of both pools sleep at once
instead of spinning, so that they neither take the cores the other pool needs nor
fight a neighbouring process (and a sleeping worker, once woken, is scheduled sooner
than one that has used its time slice spinning):

- ``OMP_WAIT_POLICY=PASSIVE``, set before the compiled core loads the OpenMP runtime,
  which reads it once, at load;
- ``OPENBLAS_THREAD_TIMEOUT=4`` (OpenBLAS's minimum: workers spin 2**4 cycles, instead
  of 2**28, before they sleep), set only if NumPy has not been imported yet, since
  OpenBLAS reads it when NumPy loads it.

A variable the environment already sets is left as it is.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

DEFAULT_NUM_THREADS = 1
"""BLAS and attention threads of the models and the commands unless told otherwise."""


class BlasThreadLimit:
    """Reusable context manager: NumPy's BLAS runs ``num_threads`` threads inside each ``with`` block.

    Unlike :func:`blas_threads`, the loaded BLAS libraries are looked up once per
    process (a ``threadpoolctl.ThreadpoolController`` made on first use, so a BLAS
    library loaded after that is not limited), so entering and leaving the block costs
    tens of microseconds (60 us measured on a busy 2-core machine) and can wrap every
    forward pass (tens of milliseconds for SmolLM2-135M).

    Parameters
    ----------
    num_threads : int or None
        Threads, >= 1; None makes the block do nothing.

    Raises
    ------
    ValueError
        If ``num_threads`` is neither None nor an int >= 1.
    ModuleNotFoundError
        If ``num_threads`` is not None and ``threadpoolctl`` is not installed.
    """

    _controller: Any = None  # one ThreadpoolController for the process, made on first use

    def __init__(self, num_threads: int | None) -> None:
        if num_threads is not None:
            _check_num_threads(num_threads)
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


def _check_num_threads(num_threads) -> None:
    if isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 1:
        raise ValueError(f"Invalid value of num_threads: expected None or an int >= 1, got {num_threads!r}")


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
def blas_threads(num_threads: int | None) -> Iterator[None]:
    """Limit NumPy's BLAS to ``num_threads`` threads inside the ``with`` block.

    Parameters
    ----------
    num_threads : int or None
        Threads, >= 1; None leaves the BLAS library alone.

    Raises
    ------
    ValueError
        If ``num_threads`` is not None and < 1.
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
    if num_threads is None:
        yield
        return
    if isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 1:
        raise ValueError(f"Invalid value of num_threads: expected None or an int >= 1, got {num_threads!r}")
    try:
        from threadpoolctl import threadpool_limits
    except ModuleNotFoundError as exc:
        raise ModuleNotFoundError(
            "threadpoolctl is needed to set the BLAS thread count: pip install threadpoolctl "
            "(or the 'cli' extra of pagedkv)"
        ) from exc
    with threadpool_limits(limits=num_threads, user_api="blas"):
        yield
