"""File I/O helpers of snapshots: start writing a file's dirty range to the disk early.

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
from libc.stdint cimport int64_t

from pagedkv_c._checks cimport check_int

__all__ = ["start_writeback"]

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
