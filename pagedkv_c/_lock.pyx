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
from cpython.pythread cimport PyThread_get_thread_ident


cdef class CacheLock:
    """Non-reentrant lock of one cache with re-entry detection and deferred calls.

    Parameters
    ----------
    owner_name : str
        Name of the class whose calls the lock serialises, used in messages.
    reentry_hint : str
        Sentence telling a re-entrant caller what it may do instead.

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
    """

    def __cinit__(self, str owner_name not None, str reentry_hint not None):
        self.owner_name = owner_name
        self._reentry_hint = reentry_hint
        self._owner = 0
        self._deferred = []

    cdef int acquire(self) except -1:
        """Take the lock, waiting (without the GIL) while another thread holds it.

        Raises
        ------
        RuntimeError
            This thread already holds the lock (a re-entrant call).
        """
        cdef unsigned long me = PyThread_get_thread_ident()
        if self._owner == me:
            raise RuntimeError(
                f"{self.owner_name} was called again on a thread that is still inside one of its "
                f"calls (from a finalizer that the garbage collector ran during that call, or from "
                f"a callback), while the cache's state is mid-change; {self._reentry_hint}"
            )
        self._mutex.acquire()
        self._owner = me
        return 0

    cdef void release(self) noexcept:
        """Let go of the lock (the caller holds it); deferred calls are not run here."""
        self._owner = 0
        self._mutex.release()

    cdef bint held_by_this_thread(self) noexcept:
        """Whether the calling thread holds the lock (so a call now would re-enter)."""
        return self._owner == PyThread_get_thread_ident()

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

    cdef int leave(self) except -1:
        """Run the deferred calls, then let go of the lock (the caller holds it)."""
        try:
            if self._deferred:
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
