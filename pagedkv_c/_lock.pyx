"""CacheLock: the lock that serialises the calls of one cache.

A cache holds its lock for the whole of a call that reads or changes its
state, so calls from several threads run one after another. The lock knows
which thread holds it. That matters for one kind of caller: a finalizer
(``__del__``) that the garbage collector runs *inside* a call of the cache,
on the same thread, because the call allocated a Python object while it held
the lock. A plain lock would block that finalizer forever (its own thread
holds the lock and cannot go on until the finalizer returns). Here such a
re-entrant call is refused with RuntimeError, or, for the calls a cache
chooses to defer (``KVCache.remove_sequence``), queued and run when the
running call leaves the lock, before any other thread can take it.
"""
from cpython.pythread cimport (
    PyThread_acquire_lock, PyThread_allocate_lock, PyThread_free_lock, PyThread_release_lock, WAIT_LOCK,
)


cdef class CacheLock:
    """Non-reentrant lock of one cache with re-entry detection and deferred calls.

    Parameters
    ----------
    owner_name : str
        Name of the class whose calls the lock serialises, used in messages.
    reentry_hint : str
        Sentence telling a re-entrant caller what it may do instead.

    Raises
    ------
    MemoryError
        The operating system lock that waiting threads block on could not be
        allocated.

    Notes
    -----
    Use it as a context manager (``with lock:``) or, from Cython, through
    ``acquire`` and ``leave`` (or ``release``, which runs no deferred call),
    which skip the context-manager protocol's method lookups and calls. A
    thread blocked on the lock releases the GIL while it waits, so the
    holder can finish. Entering the lock on the thread
    that already holds it raises RuntimeError instead of blocking forever.
    Calls queued with ``defer`` run, in order, when the holder leaves
    (``leave`` or the end of the ``with`` block), still under the lock;
    calls that they queue in turn run too.

    The state (holder, number of waiting threads) is read and changed only
    with the GIL held, which the core relies on anyway, so taking and
    letting go of a free lock are a few field accesses, inline in the
    caller (see ``_lock.pxd``), with no atomic operation and no call into
    the operating system. Only a thread that finds the lock held blocks, on
    an operating system lock (``_wakeup``) and without the GIL. A holder
    that lets go while threads wait hands the lock to one of them: it stays
    taken (threads that arrive meanwhile wait too) until the woken thread
    has the GIL again and takes it. Without the hand-over, a thread that
    takes the lock again and again, releasing the GIL only while it holds
    the lock, would keep the waiting threads out indefinitely.
    """

    def __cinit__(self, str owner_name not None, str reentry_hint not None):
        self.owner_name = owner_name
        self._reentry_hint = reentry_hint
        self._owner = 0
        self._num_waiting = 0
        self._deferred = []
        self._wakeup = PyThread_allocate_lock()
        if self._wakeup == NULL:
            raise MemoryError("could not allocate the lock that threads waiting for a CacheLock block on")
        # Held from now on, except between a hand-over and the waiter that takes it.
        PyThread_acquire_lock(self._wakeup, WAIT_LOCK)

    def __dealloc__(self):
        # No thread waits here any more (a waiter holds a reference to the lock).
        if self._wakeup != NULL:
            PyThread_free_lock(self._wakeup)

    cdef int _acquire_contended(self, unsigned long me) except -1:
        """The lock is held: raise if by this thread, else wait (without the GIL) until this thread takes it."""
        if self._owner == me:
            raise RuntimeError(
                f"{self.owner_name} was called again on a thread that is still inside one of its "
                f"calls (from a finalizer that the garbage collector ran during that call, or from "
                f"a callback), while the cache's state is mid-change; {self._reentry_hint}"
            )
        self._num_waiting += 1
        with nogil:
            PyThread_acquire_lock(self._wakeup, WAIT_LOCK)
        # Each hand-over releases _wakeup once, and only the thread that then
        # acquires it takes the lock: _owner is ULONG_MAX here.
        self._num_waiting -= 1
        self._owner = me
        return 0

    cdef void _hand_over(self) noexcept:
        """Let go of the lock by giving it to one of the waiting threads (there is one)."""
        self._owner = ULONG_MAX
        PyThread_release_lock(self._wakeup)

    cdef bint defer(self, object function, object argument) except -1:
        """Queue ``function(argument)`` to run before the holder leaves; False if already queued."""
        cdef tuple item = (function, argument)
        if item in self._deferred:
            return False
        self._deferred.append(item)
        return True

    cdef int run_deferred(self) except -1:
        """Run the queued calls in order, including those they queue (the caller holds the lock)."""
        while self._deferred:
            function, argument = self._deferred.pop(0)
            function(argument)
        return 0

    cdef int _leave_deferred(self) except -1:
        """``leave`` when calls are queued: run them, then let go of the lock even if one raised."""
        try:
            self.run_deferred()
        finally:
            self.release()
        return 0

    def __enter__(self):
        self.acquire()

    def __exit__(self, exc_type, exc, traceback):
        self.leave()
        return False

    def __reduce__(self):
        raise TypeError("CacheLock cannot be pickled or copied")

    def __repr__(self):
        return f"CacheLock(owner_name={self.owner_name!r}, held={self._owner != 0})"
