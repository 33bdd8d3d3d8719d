"""Small-batch float32 matrix products that stream each weight once: validation and OpenMP dispatch.

The arithmetic lives in ``matmul_kernels.c``; this module checks every
argument and runs the column blocks of the output over OpenMP threads. A
decode step multiplies a few activation rows (one per sequence) by each
weight matrix; BLAS GEMM packs and re-reads the weights for such small row
counts, these kernels read every weight once and apply it to all rows. Each
output element is computed by one block on one thread with arithmetic that
depends neither on the other rows nor on the thread count, so results do not
depend on the batch composition or on ``num_threads``.
"""
import os

import numpy as np

cimport numpy as cnp
from cython.parallel cimport prange
from libc.stdint cimport int64_t

from pagedkv_c._checks cimport check_int
# Imported first so that its fork hook runs before this module's (see _after_fork_in_child).
from pagedkv_c import _attention

cnp.import_array()


cdef extern from "matmul_kernels.h" nogil:
    enum: PKV_MM_BLOCK_COLS
    ctypedef enum pkv_mm_isa:
        PKV_MM_ISA_SCALAR
        PKV_MM_ISA_AVX2
        PKV_MM_ISA_AVX512
    ctypedef void (*pkv_mm_block_kernel)(const float* x, const float* w, float* out, int64_t m,
                                        int64_t k, int64_t n, int64_t n_begin,
                                        int64_t n_end) noexcept nogil
    int pkv_mm_isa_available(pkv_mm_isa isa)
    pkv_mm_isa pkv_mm_best_isa()
    const char* pkv_mm_isa_name(pkv_mm_isa isa)
    pkv_mm_block_kernel pkv_mm_get_kernel(pkv_mm_isa isa, int transpose_w)


cdef extern from *:
    """
    #if defined(_OPENMP)
    #include <omp.h>
    static int pkv_mm_omp_max_threads(void) { return omp_get_max_threads(); }
    static int pkv_mm_have_openmp(void) { return 1; }
    #else
    static int pkv_mm_omp_max_threads(void) { return 1; }
    static int pkv_mm_have_openmp(void) { return 0; }
    #endif
    """
    int pkv_mm_omp_max_threads() nogil
    int pkv_mm_have_openmp() nogil


_MAX_THREADS_ARG = 1024
_ISA_BY_NAME = {"scalar": PKV_MM_ISA_SCALAR, "avx2": PKV_MM_ISA_AVX2, "avx512": PKV_MM_ISA_AVX512}
cdef pkv_mm_isa _isa = PKV_MM_ISA_SCALAR
# GNU OpenMP's thread pool does not survive fork(): a child whose parent had
# run a team of several threads hangs in its first parallel region. Once this
# process has run such a team (here or in the attention kernels), a child
# forked from it runs these products on one thread.
cdef bint _ran_team = False
cdef bint _forked_after_team = False


def _after_fork_in_child():
    global _forked_after_team
    # The attention module's hook ran first (it was imported first): a
    # max_threads of 1 there means its kernels ran a team before the fork.
    if _ran_team or (_attention.kernel_info()["max_threads"] == 1 and pkv_mm_omp_max_threads() > 1):
        _forked_after_team = True


os.register_at_fork(after_in_child=_after_fork_in_child)


cdef pkv_mm_isa _capped_isa(str cap):
    """Best available path not above ``cap`` (a name from _ISA_BY_NAME)."""
    cdef pkv_mm_isa best = pkv_mm_best_isa()
    cdef int limit = <int>_ISA_BY_NAME.get(cap, <int>best)
    cdef int i
    for i in range(min(<int>best, limit), -1, -1):
        if pkv_mm_isa_available(<pkv_mm_isa>i):
            return <pkv_mm_isa>i
    return PKV_MM_ISA_SCALAR


# The attention kernels' switch caps these paths too (one knob for "run the portable code").
_isa_cap = os.environ.get("PAGEDKV_ATTENTION_ISA", "").strip().lower()
_isa = _capped_isa(_isa_cap if _isa_cap in _ISA_BY_NAME else "")


def kernel_info():
    """Describe the matrix-product kernels this process uses.

    Returns
    -------
    dict
        ``isa`` (str: "scalar", "avx2" or "avx512", the path in use; capped by
        the ``PAGEDKV_ATTENTION_ISA`` environment variable like the attention
        kernels), ``available_isas`` (list of str), ``block_cols`` (int, output
        columns per work block, the unit spread over threads), ``openmp``
        (bool) and ``max_threads`` (int, threads of ``num_threads=None``).
    """
    return {
        "isa": pkv_mm_isa_name(_isa).decode(),
        "available_isas": [
            pkv_mm_isa_name(<pkv_mm_isa>i).decode() for i in range(3) if pkv_mm_isa_available(<pkv_mm_isa>i)
        ],
        "block_cols": PKV_MM_BLOCK_COLS,
        "openmp": bool(pkv_mm_have_openmp()),
        "max_threads": 1 if _forked_after_team else pkv_mm_omp_max_threads(),
    }


def _set_isa(name):
    """Select the kernel path by name; returns the previous name (tests, benchmarks).

    Raises ValueError if the path is unknown or this CPU/build cannot run it.
    """
    global _isa
    if name not in _ISA_BY_NAME or not pkv_mm_isa_available(<pkv_mm_isa><int>_ISA_BY_NAME[name]):
        raise ValueError(
            f"Invalid value of name: expected one of {kernel_info()['available_isas']}, got {name!r}"
        )
    previous = pkv_mm_isa_name(_isa).decode()
    _isa = <pkv_mm_isa><int>_ISA_BY_NAME[name]
    return previous


cdef int _check_matrix(object arr, str name) except -1:
    """A C-contiguous 2-D float32 ndarray, else TypeError/ValueError naming ``name``."""
    if not isinstance(arr, np.ndarray):
        raise TypeError(f"Invalid type of {name}: expected numpy.ndarray, got {type(arr).__name__}")
    if cnp.PyArray_TYPE(<cnp.ndarray>arr) != cnp.NPY_FLOAT32 or not cnp.PyArray_ISNOTSWAPPED(<cnp.ndarray>arr):
        raise TypeError(f"Invalid dtype of {name}: expected float32 (native byte order), got {arr.dtype}")
    if cnp.PyArray_NDIM(<cnp.ndarray>arr) != 2:
        raise ValueError(f"Invalid shape of {name}: expected a 2-D array, got shape {arr.shape}")
    if not cnp.PyArray_IS_C_CONTIGUOUS(<cnp.ndarray>arr) or not cnp.PyArray_ISALIGNED(<cnp.ndarray>arr):
        raise ValueError(
            f"Invalid layout of {name}: expected a C-contiguous, aligned array, got strides {arr.strides}"
        )
    return 0


def matmul(x, w, *, transpose_w=False, num_threads=1):
    """``x @ w`` (or ``x @ w.T``) in float32, reading each element of ``w`` once from memory.

    For few rows of ``x`` (a decode batch) this costs about what one row costs
    while the rows' arithmetic hides under the weight reads; BLAS is faster for
    many rows (prefill). Each output element is a float32 sum computed the same
    way whatever the other rows and the thread count (see the module).

    Parameters
    ----------
    x : numpy.ndarray
        float32, shape ``[M, K]``, C-contiguous.
    w : numpy.ndarray
        float32, C-contiguous: shape ``[K, N]``, or ``[N, K]`` with ``transpose_w``.
    transpose_w : bool
        Compute ``x @ w.T`` from ``w`` stored ``[N, K]``.
    num_threads : int or None
        OpenMP threads, 1 to 1024 (at most one per block of 64 output columns
        is used); None: OpenMP's default (``OMP_NUM_THREADS``).

    Returns
    -------
    numpy.ndarray
        float32, shape ``[M, N]``, a new C-contiguous array.

    Raises
    ------
    TypeError
        If ``x`` or ``w`` is not a float32 ndarray (in native byte order), or
        ``num_threads`` is not an integer (or None).
    ValueError
        If ``x`` or ``w`` is not 2-D, C-contiguous and aligned, their inner
        dimensions differ, or ``num_threads`` is outside 1 to 1024.
    """
    global _ran_team
    _check_matrix(x, "x")
    _check_matrix(w, "w")
    cdef bint nt = bool(transpose_w)
    cdef int64_t m = x.shape[0]
    cdef int64_t k = x.shape[1]
    cdef int64_t n = w.shape[0] if nt else w.shape[1]
    cdef int64_t wk = w.shape[1] if nt else w.shape[0]
    if wk != k:
        expected = f"({'N, ' if nt else ''}{k}{'' if nt else ', N'})"
        raise ValueError(
            f"Invalid shape of w: expected {expected} to match x of shape {x.shape}"
            f"{' (transpose_w)' if nt else ''}, got {w.shape}"
        )
    cdef int threads
    if num_threads is None:
        threads = pkv_mm_omp_max_threads()
    else:
        threads = <int>check_int(num_threads, "num_threads", 1, _MAX_THREADS_ARG)
    if k == 0 or m == 0 or n == 0:
        return np.zeros((m, n), dtype=np.float32)
    out = np.empty((m, n), dtype=np.float32)  # every element is written by exactly one block
    cdef int64_t num_blocks = (n + PKV_MM_BLOCK_COLS - 1) // PKV_MM_BLOCK_COLS
    if not pkv_mm_have_openmp() or _forked_after_team:
        threads = 1
    if threads > num_blocks:
        threads = <int>num_blocks
    cdef pkv_mm_block_kernel kernel = pkv_mm_get_kernel(_isa, 1 if nt else 0)
    cdef const float* xp = <const float*>cnp.PyArray_DATA(<cnp.ndarray>x)
    cdef const float* wp = <const float*>cnp.PyArray_DATA(<cnp.ndarray>w)
    cdef float* op = <float*>cnp.PyArray_DATA(<cnp.ndarray>out)
    cdef int t
    cdef int64_t b0, b1
    if threads <= 1:
        with nogil:
            kernel(xp, wp, op, m, k, n, 0, n)
        return out
    _ran_team = True
    # One call per thread over its contiguous run of blocks: each thread streams its own
    # part of w, and the kernel's prefetches run ahead across the blocks of the run.
    with nogil:
        for t in prange(threads, schedule="static", num_threads=threads):
            b0 = num_blocks * t // threads
            b1 = num_blocks * (t + 1) // threads
            kernel(xp, wp, op, m, k, n, b0 * PKV_MM_BLOCK_COLS, min(n, b1 * PKV_MM_BLOCK_COLS))
    return out
