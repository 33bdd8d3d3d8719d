# Validators shared by every public entry point of the core. They run with the
# GIL, before any state changes, and raise "Invalid <what> of <name>: expected
# ..., got ..." so that every message has the same shape.
from libc.stdint cimport int64_t

cdef int64_t check_int(object value, str name, int64_t low, int64_t high) except? -1
cdef bint check_bool(object value, str name) except -1
cdef int64_t check_index(object value, str name, int64_t size) except? -1
cdef object check_array(object arr, str name, object dtype, tuple shape)
cdef object as_int_array(object values, str name, object dtype)
cdef object check_float_array(object arr, str name, tuple shape, object pool_dtype, str shape_names=*)
cdef object check_pool_dtype(object dtype, str name, tuple allowed)
cdef str invalid(str what, str name)
