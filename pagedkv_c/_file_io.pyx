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

``GuardedMap`` is the pool of ``KVCache.load(path, mmap=True)``: a
copy-on-write map of a snapshot's pages that stays the file's bytes as they
were at the load, whatever another process does to the file (see its
docstring).
"""
from libc.stdint cimport int64_t, uintptr_t
cimport numpy as cnp
import logging
import os
import threading
import weakref

import numpy as np

from pagedkv_c._checks cimport check_int

cnp.import_array()

__all__ = ["GuardedMap", "LEASE_SIGNAL", "prefault", "start_writeback"]

cdef extern from "Python.h":
    int PyBuffer_FillInfo(Py_buffer* view, object exporter, void* buf, Py_ssize_t length, int readonly,
                          int flags) except -1

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

cdef extern from *:
    """
    /* Guarded maps (GuardedMap below). A private (copy-on-write) map of a file
     * is not the process's own memory: its untouched pages are read from the
     * file when first accessed, and when the file is truncated the kernel
     * unmaps even the pages already copied, so the next access past the new
     * end raises SIGBUS; a rewrite in place changes the untouched pages. A
     * read lease on the file makes the kernel hold any process that opens the
     * file for writing or truncates it, and signal this one; the handler
     * writes the guard's slot to a pipe, a thread of pagedkv moves the map's
     * bytes into anonymous memory at the same address (under the cache's
     * lock, so no store is lost) and releases the lease; only then does the
     * writer go on. Linux only (F_SETLEASE, mremap). */
    #if defined(__linux__)
    #include <errno.h>
    #include <fcntl.h>
    #include <signal.h>
    #include <stdatomic.h>
    #include <string.h>
    #include <sys/mman.h>
    #include <unistd.h>
    #define PKV_HAVE_LEASES 1
    #define PKV_MAX_GUARDS 1024
    static atomic_int pkv_guard_fds[PKV_MAX_GUARDS];  /* leased descriptor per slot, -1 while free */
    static atomic_int pkv_guard_broken[PKV_MAX_GUARDS];  /* a writer broke the slot's lease */
    static int pkv_guard_pipe = -1;  /* write end, non-blocking; the lease thread reads the other */
    static int pkv_lease_signal(void) { return SIGRTMAX - 4; }

    static void pkv_lease_handler(int sig, siginfo_t *info, void *context)
    {
        int saved = errno, fd = info ? info->si_fd : -1, i;
        (void)sig; (void)context;
        if (fd < 0)
            return;
        for (i = 0; i < PKV_MAX_GUARDS; i++) {
            if (atomic_load(&pkv_guard_fds[i]) != fd)
                continue;
            atomic_store(&pkv_guard_broken[i], 1);
            if (write(pkv_guard_pipe, &i, sizeof(i)) != (ssize_t)sizeof(i)) {
                /* the pipe is full of slot numbers already: the thread scans every slot's flag */
            }
        }
        errno = saved;
    }

    /* Install the handler once, with the pipe's write end. 0, or an errno
     * value (EBUSY: another handler is installed on the signal). */
    static int pkv_guards_install(int pipe_fd)
    {
        struct sigaction action, old;
        int i;
        if (pkv_guard_pipe >= 0)
            return 0;
        if (sigaction(pkv_lease_signal(), NULL, &old) != 0)
            return errno;
        if ((old.sa_flags & SA_SIGINFO) ? old.sa_sigaction != pkv_lease_handler : old.sa_handler != SIG_DFL)
            return EBUSY;
        for (i = 0; i < PKV_MAX_GUARDS; i++) {
            atomic_store(&pkv_guard_fds[i], -1);
            atomic_store(&pkv_guard_broken[i], 0);
        }
        pkv_guard_pipe = pipe_fd;
        memset(&action, 0, sizeof(action));
        action.sa_sigaction = pkv_lease_handler;
        action.sa_flags = SA_SIGINFO | SA_RESTART;
        sigemptyset(&action.sa_mask);
        if (sigaction(pkv_lease_signal(), &action, NULL) != 0) {
            pkv_guard_pipe = -1;
            return errno;
        }
        return 0;
    }

    /* Take a slot and a read lease on fd (open for reading only): the slot,
     * or -errno (EAGAIN: the file is open for writing somewhere; EACCES:
     * another user's file; EINVAL: leases are off or unsupported here). */
    static int pkv_guard_take(int fd)
    {
        int i, err;
        for (i = 0; i < PKV_MAX_GUARDS; i++) {
            int expected = -1;
            if (atomic_load(&pkv_guard_fds[i]) != -1)
                continue;
            atomic_store(&pkv_guard_broken[i], 0);
            if (!atomic_compare_exchange_strong(&pkv_guard_fds[i], &expected, fd))
                continue;
            if (fcntl(fd, F_SETSIG, pkv_lease_signal()) != 0 || fcntl(fd, F_SETLEASE, F_RDLCK) != 0) {
                err = errno;
                atomic_store(&pkv_guard_fds[i], -1);
                return -err;
            }
            return i;
        }
        return -EMFILE;
    }

    static int pkv_guard_is_broken(int slot) { return atomic_load(&pkv_guard_broken[slot]); }

    /* Let the writer go on (the caller moved the map's bytes first). */
    static void pkv_guard_unlease(int slot)
    {
        int fd = atomic_load(&pkv_guard_fds[slot]);
        if (fd >= 0)
            fcntl(fd, F_SETLEASE, F_UNLCK);
    }

    static void pkv_guard_free(int slot) { atomic_store(&pkv_guard_fds[slot], -1); }

    static void *pkv_map_private(int fd, int64_t offset, size_t len)
    {
        void *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, (off_t)offset);
        return p == MAP_FAILED ? NULL : p;
    }

    /* Replace the map at addr by anonymous memory holding the same bytes, at
     * the same address (views of it stay valid). 0, or an errno value
     * (nothing changed). */
    static int pkv_map_to_anonymous(void *addr, size_t len)
    {
        void *fresh = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (fresh == MAP_FAILED)
            return errno;
        memcpy(fresh, addr, len);
        if (mremap(fresh, len, len, MREMAP_MAYMOVE | MREMAP_FIXED, addr) == MAP_FAILED) {
            int err = errno;
            munmap(fresh, len);
            return err;
        }
        return 0;
    }

    static void pkv_unmap(void *p, size_t len) { munmap(p, len); }
    static void pkv_close(int fd) { close(fd); }
    #else
    #define PKV_HAVE_LEASES 0
    static int pkv_lease_signal(void) { return 0; }
    static int pkv_guards_install(int pipe_fd) { (void)pipe_fd; return 38; /* ENOSYS */ }
    static int pkv_guard_take(int fd) { (void)fd; return -38; }
    static int pkv_guard_is_broken(int slot) { (void)slot; return 0; }
    static void pkv_guard_unlease(int slot) { (void)slot; }
    static void pkv_guard_free(int slot) { (void)slot; }
    static void *pkv_map_private(int fd, int64_t offset, size_t len) { (void)fd; (void)offset; (void)len; return NULL; }
    static int pkv_map_to_anonymous(void *addr, size_t len) { (void)addr; (void)len; return 38; }
    static void pkv_unmap(void *p, size_t len) { (void)p; (void)len; }
    static void pkv_close(int fd) { (void)fd; }
    #endif
    """
    int PKV_HAVE_LEASES
    int pkv_lease_signal() noexcept nogil
    int pkv_guards_install(int pipe_fd) noexcept nogil
    int pkv_guard_take(int fd) noexcept nogil
    int pkv_guard_is_broken(int slot) noexcept nogil
    void pkv_guard_unlease(int slot) noexcept nogil
    void pkv_guard_free(int slot) noexcept nogil
    void* pkv_map_private(int fd, int64_t offset, size_t len) noexcept nogil
    int pkv_map_to_anonymous(void* addr, size_t len) noexcept nogil
    void pkv_unmap(void* p, size_t len) noexcept nogil
    void pkv_close(int fd) noexcept nogil

#: The real-time signal that the kernel sends this process when another
#: process opens a guarded snapshot for writing or truncates it (Linux
#: ``SIGRTMAX - 4``; 0 elsewhere). pagedkv installs its handler on it at the
#: first guarded map (and refuses to guard if another handler is there); do
#: not install another one.
LEASE_SIGNAL = pkv_lease_signal()

# slot -> weak reference to its GuardedMap; the lease thread looks guards up here.
_guards = {}
_guards_lock = threading.Lock()
_lease_thread = None


def _serve_lease_breaks(int read_fd):
    """Body of the lease thread: for each slot the handler reports, move that map into process memory."""
    while True:
        data = os.read(read_fd, 4096)
        if not data:
            return
        with _guards_lock:
            # Every slot whose lease broke (the pipe may have dropped numbers when full); list() copies
            # the dict at once, as a guard freed by another thread meanwhile removes its entry.
            guards = [ref() for slot, ref in list(_guards.items()) if pkv_guard_is_broken(slot)]
        guard = None
        for guard in guards:
            if guard is not None and not (<GuardedMap>guard)._private:
                try:
                    (<GuardedMap>guard)._on_break()
                except BaseException:  # logged; the writer is let go regardless, the other guards served
                    logging.getLogger("pagedkv.snapshot").exception(
                        "a mapped snapshot could not be copied into memory before another process changed "
                        "its file; the cache may read changed bytes or fault")
                    (<GuardedMap>guard)._unlease()
        del guards, guard  # (outside the lock: a guard may be freed here)


cdef int _start_lease_thread() except -1:
    """Install the signal handler and start the lease thread, once (the caller holds _guards_lock)."""
    global _lease_thread
    cdef int err
    if _lease_thread is not None:
        return 0
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)  # the handler must never block
    err = pkv_guards_install(write_fd)
    if err:
        os.close(read_fd)
        os.close(write_fd)
        raise OSError(err, f"cannot install the handler of signal {LEASE_SIGNAL}: {os.strerror(err)}")
    _lease_thread = threading.Thread(target=_serve_lease_breaks, args=(read_fd,), name="pagedkv-lease",
                                     daemon=True)
    _lease_thread.start()
    return 0


cdef class GuardedMap:
    """A copy-on-write map of a file's bytes that keeps those bytes whatever is done to the file (Linux).

    ``GuardedMap(fd)`` opens its own descriptor of the file that ``fd``
    refers to and takes a read lease on it (``F_SETLEASE``): from then on
    the kernel holds any process (this one too) that opens the file for
    writing or truncates it, and signals this process first
    (:data:`LEASE_SIGNAL`). A thread of pagedkv then copies the map's bytes
    into anonymous memory at the same address (``mremap``; views stay
    valid), under the lock of the cache that uses the map
    (:meth:`attach`), so that no store is lost, and releases the lease; the
    writer goes on after that. So no access to the map ever faults on a
    shrunken file (SIGBUS) or reads bytes written after the lease was taken.
    Take it before reading anything of the file, then :meth:`map` the range
    to use. The lease ends when the object is freed (it unmaps and closes
    its descriptor).

    Limits: Linux only; the file must be this user's (or the process has
    ``CAP_LEASE``), on a file system with leases (not NFS), and open for
    writing nowhere when the lease is taken (a writer that opened it before
    would not be held). The copy must be done within
    ``/proc/sys/fs/lease-break-time`` (45 s by default), after which the
    kernel lets the writer go anyway; it takes a read of the map's untouched
    pages and a copy of the whole range, and as much memory as the range.
    Writes to the mapped array that bypass the cache's calls (which hold its
    lock) while the copy runs may be lost. A child made by ``fork()`` after
    the map shares the map but not the guard (the kernel signals the
    parent); load in the child instead.

    Parameters
    ----------
    fd : int
        A descriptor of the file, open for reading, ``>= 0``.

    Raises
    ------
    OSError
        The lease cannot be taken; its errno says why: ``EAGAIN`` the file is
        open for writing, ``EACCES`` another user's file, ``EINVAL`` leases
        are off or the file system has none, ``EBUSY`` another handler is
        installed on :data:`LEASE_SIGNAL`, ``ENOSYS`` not Linux, ``EMFILE``
        1024 guarded maps at once.
    """
    cdef int _fd          # this object's own descriptor (holds the lease), -1 once closed
    cdef int _slot        # guard slot, -1 if none
    cdef void* _addr      # the map, NULL until map()
    cdef size_t _length   # bytes mapped
    cdef bint _private    # the bytes were moved into anonymous memory (the file no longer matters)
    cdef object _owner    # weak reference to the cache whose lock guards writes into the map, or None
    cdef object __weakref__

    def __cinit__(self, fd):
        self._fd = -1
        self._slot = -1
        self._addr = NULL
        self._length = 0
        self._private = False
        self._owner = None
        cdef int source = <int>check_int(fd, "fd", 0, 2**31 - 1)
        cdef int own, slot
        if not PKV_HAVE_LEASES:
            raise OSError(38, "file leases are Linux only")
        with _guards_lock:
            _start_lease_thread()
            # /proc/self/fd reopens the very file (even if its name was replaced meanwhile) as a new
            # open file description, whose lease ends with this object, not with the caller's file.
            own = os.open(f"/proc/self/fd/{source}", os.O_RDONLY | os.O_CLOEXEC)
            mine, theirs = os.fstat(own), os.fstat(source)
            if (mine.st_dev, mine.st_ino) != (theirs.st_dev, theirs.st_ino):
                os.close(own)
                raise OSError(116, "the file changed while it was opened")
            slot = pkv_guard_take(own)
            if slot < 0:
                os.close(own)
                raise OSError(-slot, f"cannot take a read lease on the file: {os.strerror(-slot)}")
            self._fd = own
            self._slot = slot
            _guards[slot] = weakref.ref(self)

    def map(self, offset, length):
        """Map bytes ``[offset, offset + length)`` of the file, copy-on-write; once per object.

        Parameters
        ----------
        offset : int
            Byte offset, a multiple of 4096, ``>= 0``.
        length : int
            Bytes, ``>= 1``.

        Raises
        ------
        ValueError
            ``offset`` not a multiple of 4096, or already mapped.
        OSError
            The map cannot be made, or the file was opened for writing or
            truncated after the lease was taken (errno ``ESTALE``): what was
            read of it may no longer be its bytes.
        """
        cdef int64_t c_offset = check_int(offset, "offset", 0, 2**62)
        cdef int64_t c_length = check_int(length, "length", 1, 2**62)
        cdef void* addr
        if c_offset % 4096:
            raise ValueError(f"Invalid value of offset: expected a multiple of 4096, got {c_offset}")
        if self._addr != NULL or self._fd < 0:
            raise ValueError("Invalid call of map: this GuardedMap is already mapped or closed")
        if pkv_guard_is_broken(self._slot):
            raise OSError(116, "the file was opened for writing or truncated while it was loaded")
        with nogil:
            addr = pkv_map_private(self._fd, c_offset, <size_t>c_length)
        if addr == NULL:
            raise OSError(12, f"cannot map the file: {os.strerror(12)}")
        with _guards_lock:  # (the lease thread takes it before it looks at _addr)
            self._addr = addr
            self._length = <size_t>c_length
        if pkv_guard_is_broken(self._slot):  # broke while mapping: the bytes mapped may be new ones
            raise OSError(116, "the file was opened for writing or truncated while it was loaded")

    def attach(self, owner):
        """Copy the map under ``owner``'s lock when a writer comes: ``owner._make_pool_private(self)``.

        ``owner`` (a ``KVCache``) is held by a weak reference; until it is
        attached, or after it is gone, the copy takes no lock.
        """
        self._owner = weakref.ref(owner)

    def make_private(self):
        """Move the map's bytes into anonymous memory now and release the lease (the caller holds the
        lock of the cache that writes into the map, if any). Idempotent.

        Raises
        ------
        OSError
            No memory for the copy (nothing changed; the lease is kept).
        """
        cdef int err = 0
        if self._addr != NULL and not self._private:
            with nogil:
                err = pkv_map_to_anonymous(self._addr, self._length)
            if err:
                raise OSError(err, f"cannot copy a mapped snapshot into memory: {os.strerror(err)}")
            self._private = True
        self._unlease()

    def _unlease(self):
        if self._slot >= 0:
            pkv_guard_unlease(self._slot)

    def _on_break(self):
        """A writer waits on the file: copy the map (under the owner's lock), then let the writer go."""
        owner = self._owner() if self._owner is not None else None
        if owner is not None:
            owner._make_pool_private(self)
        else:
            self.make_private()

    @property
    def broken(self):
        """True once a writer broke the lease (a mapped range is then in anonymous memory)."""
        return self._slot >= 0 and bool(pkv_guard_is_broken(self._slot))

    @property
    def private(self):
        """True once the mapped bytes were moved into anonymous memory."""
        return bool(self._private)

    def __getbuffer__(self, Py_buffer* view, int flags):
        if self._addr == NULL:
            raise BufferError("this GuardedMap maps nothing yet")
        PyBuffer_FillInfo(view, self, self._addr, <Py_ssize_t>self._length, 0, flags)

    def __releasebuffer__(self, Py_buffer* view):
        pass

    def __len__(self):
        return self._length

    def __reduce__(self):
        raise TypeError("GuardedMap cannot be pickled or copied")

    def __dealloc__(self):
        # No lease thread can be working on this object: it holds a strong reference meanwhile.
        if self._slot >= 0:
            _guards.pop(self._slot, None)
            pkv_guard_free(self._slot)
            self._slot = -1
        if self._addr != NULL:
            pkv_unmap(self._addr, self._length)
            self._addr = NULL
        if self._fd >= 0:
            pkv_close(self._fd)  # drops the lease
            self._fd = -1


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
