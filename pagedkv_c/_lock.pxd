# CacheLock: the lock that serialises the calls of one cache, aware of the
# thread that holds it so that a re-entrant call fails or waits instead of hanging.
cimport cython


cdef class CacheLock:
    cdef cython.pymutex _mutex        # the lock itself; a thread blocked on it releases the GIL
    cdef unsigned long _owner         # thread ident of the holder, 0 while free (read and written with the GIL)
    cdef readonly str owner_name      # class whose calls it serialises ("KVCache"), for messages
    cdef str _reentry_hint            # what a re-entrant caller may do instead, for messages
    cdef list _deferred               # (function, argument) pairs to run before the holder lets go

    cdef int acquire(self) except -1
    cdef void release(self) noexcept
    cdef int leave(self) except -1
    cdef bint held_by_this_thread(self) noexcept
    cdef bint defer(self, object function, object argument) except -1
    cdef int run_deferred(self) except -1
