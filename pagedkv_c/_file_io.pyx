"""File I/O helpers of snapshots: start writing a file's dirty range to the disk early, fault in memory.

A snapshot is written in runs of a few MiB and made durable by one fsync at
the end. Without a hint the kernel keeps the written pages dirty in memory
until that fsync (or until the dirty memory passes the background
threshold, often gigabytes), so the disk idles while the file is written and
the fsync then waits for all of it. Asking the kernel to start the write-back
of each run as soon as it is written (Linux ``sync_file_range`` with
``SYNC_FILE_RANGE_WRITE``, what PostgreSQL's ``*_flush_after`` settings and
RocksDB's ``bytes_per_sync`` do) lets the disk write while later runs are
copied. It is only a hint: durability still comes from the fsync.
"""
from libc.stdint cimport int64_t, uintptr_t
cimport numpy as cnp
import numpy as np

from pagedkv_c._checks cimport check_int

cnp.import_array()

__all__ = ["prefault", "start_writeback"]

cdef extern from "populate.h":
    int pkv_populate_write(void* p, size_t n) noexcept nogil

cdef extern from *:
    """
    #if defined(__linux__)
    #include <fcntl.h>
    /* Python.h defines _GNU_SOURCE on Linux, which declares sync_file_range. */
    static int pkv_start_writeback(int fd, int64_t offset, int64_t nbytes)
    {
        return sync_file_range(fd, (off_t)offset, (off_t)nbytes, SYNC_FILE_RANGE_WRITE) == 0;
    }
    #else
    static int pkv_start_writeback(int fd, int64_t offset, int64_t nbytes)
    {
        (void)fd; (void)offset; (void)nbytes;
        return 0;
    }
    #endif
    """
    int pkv_start_writeback(int fd, int64_t offset, int64_t nbytes) nogil


def start_writeback(fd, offset, nbytes):
    """Ask the kernel to start writing bytes ``[offset, offset + nbytes)`` of a file to its disk.

    Returns at once (it does not wait for the disk) and releases the GIL.
    A hint only: call ``os.fsync`` for durability. On Linux it is
    ``sync_file_range(fd, offset, nbytes, SYNC_FILE_RANGE_WRITE)``; elsewhere,
    and where the file system refuses it, it does nothing.

    Parameters
    ----------
    fd : int
        An open file descriptor, ``>= 0``.
    offset : int
        First byte of the range, ``>= 0`` (bytes).
    nbytes : int
        Length of the range, ``>= 0`` (bytes); 0 means up to the end of the file.

    Returns
    -------
    bool
        True if the kernel accepted the request.

    Raises
    ------
    TypeError
        An argument is not an integer.
    ValueError
        An argument is negative (or ``fd`` above ``2**31 - 1``).
    """
    cdef int c_fd = <int>check_int(fd, "fd", 0, 2**31 - 1)
    cdef int64_t c_offset = check_int(offset, "offset", 0, 2**63 - 1)
    cdef int64_t c_nbytes = check_int(nbytes, "nbytes", 0, 2**63 - 1)
    cdef int accepted
    with nogil:
        accepted = pkv_start_writeback(c_fd, c_offset, c_nbytes)
    return accepted != 0


def prefault(array):
    """Fault in the memory of ``array`` for writing, so that a later copy into it takes no page fault.

    A snapshot copies the pool into a new array while it holds the cache's
    lock; faulting that array in first, without the lock, keeps the kernel's
    page faults (and its zeroing of the new memory) out of the time other
    threads wait. Linux 5.14 and later: ``madvise(MADV_POPULATE_WRITE)``
    over the whole 4096-byte pages of the array, 4 MiB per call (so that
    other threads that need the process's memory-map lock wait for one
    step, not for the whole array); elsewhere (or where the kernel
    refuses) one byte of every 4096 is rewritten with its own value.
    The array's bytes do not change. Runs without the GIL.

    Parameters
    ----------
    array : numpy.ndarray
        C-contiguous and writeable, any dtype and shape.

    Raises
    ------
    TypeError
        ``array`` is not a numpy.ndarray.
    ValueError
        ``array`` is not C-contiguous or not writeable.
    """
    if not isinstance(array, np.ndarray):
        raise TypeError(f"Invalid type of array: expected a numpy.ndarray, got {type(array).__name__}")
    if not (array.flags.c_contiguous and array.flags.writeable):
        raise ValueError("Invalid layout of array: expected a C-contiguous, writeable array")
    cdef char* data = <char*>cnp.PyArray_DATA(array)
    cdef size_t nbytes = <size_t>array.nbytes
    cdef uintptr_t start, end, first, last, at, step
    if not nbytes:
        return
    with nogil:
        start = <uintptr_t>data
        end = start + nbytes
        first = (start + 4095) & ~(<uintptr_t>4095)  # whole pages only: madvise takes aligned ranges
        last = end & ~(<uintptr_t>4095)
        _touch(start, min(first, end))  # the partial page before them
        # In steps of 4 MiB: madvise holds the process's memory-map lock for
        # its whole range, and a thread that needs that lock for writing
        # (malloc growing an arena, mmap) would wait, and make every later
        # page fault of the process wait, until the range is done.
        at = first
        while at < last:
            step = min(last - at, <uintptr_t>(4 << 20))
            if pkv_populate_write(<void*>at, step) != 0:
                break  # the kernel cannot: the rest is touched below
            at += step
        _touch(at, end)


cdef void _touch(uintptr_t begin, uintptr_t end) noexcept nogil:
    """Rewrite one byte of every 4096-byte page of ``[begin, end)`` with its own value (a write fault)."""
    cdef volatile char* byte = <volatile char*>begin
    while <uintptr_t>byte < end:
        byte[0] = byte[0]
        byte = <volatile char*>((<uintptr_t>byte + 4096) & ~(<uintptr_t>4095))
