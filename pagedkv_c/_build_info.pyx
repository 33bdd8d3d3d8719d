"""How the compiled core was built: OpenMP and the XXH3 page hash.

OpenMP parallelises the kernels that loop over a batch (attention over batch
x heads). Wheels for Linux and Windows are built with it (GCC's libgomp,
bundled into Linux wheels by auditwheel; MSVC's ``/openmp`` runtime on
Windows); macOS wheels are built without it, because Apple Clang ships no
OpenMP runtime, and run those loops on one thread. Set ``PAGEDKV_OPENMP=1``
when building from source to force it on (macOS then needs libomp), ``0`` to
force it off.
"""
from pagedkv_c._prefix import xxh3_in_c

__all__ = ["build_info", "openmp_enabled", "openmp_max_threads", "xxh3_in_c"]


def openmp_enabled():
    """Whether the core was compiled with OpenMP.

    Returns
    -------
    bool
        True when parallel kernels can use several threads; False for a
        single-thread build (the default on macOS), where they run serially
        and give the same results.
    """
    return bool(PKV_OPENMP)


def openmp_max_threads():
    """Number of threads an OpenMP parallel region of the core would use.

    Returns
    -------
    int
        ``omp_get_max_threads()`` (honours ``OMP_NUM_THREADS``) in an OpenMP
        build, 1 in a single-thread build.
    """
    cdef int threads
    with nogil:
        threads = pkv_openmp_max_threads()
    return threads


def build_info():
    """Facts about this build of the core, for bug reports and tests.

    Returns
    -------
    dict
        ``openmp`` (bool, see :func:`openmp_enabled`), ``openmp_version``
        (int, the ``_OPENMP`` date ``yyyymm`` of the specification the
        compiler implements, 0 without OpenMP), ``openmp_max_threads`` (int,
        see :func:`openmp_max_threads`) and ``xxh3_in_c`` (bool: XXH3-128,
        the page hash of prefix caching, runs in C; True in every build, as
        the core carries its own implementation).
    """
    return {
        "openmp": openmp_enabled(),
        "openmp_version": PKV_OPENMP_VERSION,
        "openmp_max_threads": openmp_max_threads(),
        "xxh3_in_c": xxh3_in_c(),
    }
