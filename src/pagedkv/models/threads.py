"""Thread settings for running a model on the CPU: BLAS threads and attention threads.

A forward pass alternates between two thread pools: NumPy's BLAS (OpenBLAS, its own
pthreads) for the weight products and OpenMP for the paged attention kernels. Idle
workers of either pool spin for a while before they sleep, so when both pools have more
than one thread, or when other processes share the cores, the spinning workers of one
pool steal the cores the other pool needs, and every parallel region waits for a
descheduled worker. On a shared 2-core machine this made a decode step several times
slower than running both pools with a single thread (see the README section on
SmolLM2-135M for the measurements). One thread for both is therefore the default of the
``pagedkv`` commands.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

DEFAULT_NUM_THREADS = 1


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
