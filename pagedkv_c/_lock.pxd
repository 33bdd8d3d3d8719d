# CacheLock: the lock that serialises the calls of one cache, aware of the
# thread that holds it so that a re-entrant call fails or waits instead of hanging.
# The uncontended acquire and release are inline here: they run in the caller's
# module with no vtable call, and touch only fields that the GIL protects.
from cpython.pythread cimport PyThread_type_lock, PyThread_get_thread_ident
from libc.limits cimport ULONG_MAX


cdef class CacheLock:
    cdef unsigned long _owner         # thread ident of the holder, 0 while free, ULONG_MAX while handed to
                                      # a waiting thread that has not woken yet (read and written with the GIL)
    cdef Py_ssize_t _num_waiting      # threads blocked in acquire until the lock is handed to them (with the GIL)
    cdef PyThread_type_lock _wakeup   # held except between a hand-over and the waiter that takes it;
                                      # waiting threads block on it without the GIL
    cdef readonly str owner_name      # class whose calls it serialises ("KVCache"), for messages
    cdef str _reentry_hint            # what a re-entrant caller may do instead, for messages
    cdef list _deferred               # (function, argument) pairs to run before the holder lets go

    cdef int _acquire_contended(self, unsigned long me) except -1
    cdef void _hand_over(self) noexcept
    cdef int _leave_deferred(self) except -1
    cdef bint defer(self, object function, object argument) except -1
    cdef int run_deferred(self) except -1

    cdef inline int acquire(self) except -1:
        """Take the lock, waiting (without the GIL) while another thread holds it.

        Raises
        ------
        RuntimeError
            This thread already holds the lock (a re-entrant call).
        """
        cdef unsigned long me = <unsigned long>PyThread_get_thread_ident()
        if self._owner == 0:
            self._owner = me
            return 0
        return self._acquire_contended(me)

    cdef inline void release(self) noexcept:
        """Let go of the lock (the caller holds it); deferred calls are not run here."""
        if self._num_waiting:
            self._hand_over()
        else:
            self._owner = 0

    cdef inline int leave(self) except -1:
        """Run the deferred calls, then let go of the lock (the caller holds it)."""
        if self._deferred:
            return self._leave_deferred()
        self.release()
        return 0

    cdef inline bint held_by_this_thread(self) noexcept:
        """Whether the calling thread holds the lock (so a call now would re-enter)."""
        return self._owner == <unsigned long>PyThread_get_thread_ident()
