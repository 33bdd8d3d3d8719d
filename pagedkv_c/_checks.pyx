"""Argument validation shared by the public entry points of the core.

Every check runs before any state changes and raises an error whose message
reads ``Invalid <what> of <name>: expected ..., got ...``.
"""
import numbers
import operator

import numpy as np

cimport numpy as cnp
from libc.stdint cimport int64_t

cnp.import_array()


cdef int64_t check_int(object value, str name, int64_t low, int64_t high) except? -1:
    """Return ``value`` as a C integer in ``[low, high]``.

    Raises TypeError for a non-integer (bools and floats included) and
    ValueError for an integer outside the range.
    """
    cdef int64_t fast
    if type(value) is int:  # the common case, without the generic checks
        try:
            fast = value
        except OverflowError:
            pass
        else:
            if low <= fast <= high:
                return fast
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(
            f"Invalid type of {name}: expected an integer, got {type(value).__name__}"
        )
    cdef object v = operator.index(value)
    if v < low or v > high:
        raise ValueError(f"Invalid value of {name}: expected {low} <= {name} <= {high}, got {v}")
    return <int64_t>v


cdef int64_t check_index(object value, str name, int64_t size) except? -1:
    """Return ``value`` as a C integer in ``[0, size)`` (an index, e.g. a layer).

    Raises TypeError for a non-integer (bools and floats included) and
    IndexError for an integer outside the range.
    """
    try:
        return check_int(value, name, 0, size - 1)
    except ValueError:  # check_int's only ValueError: out of range
        raise IndexError(f"Invalid value of {name}: expected 0 <= {name} < {size}, got {value}") from None


cdef str _shape_text(tuple shape):
    return "(" + ", ".join(["*" if d < 0 else str(d) for d in shape]) + (",)" if len(shape) == 1 else ")")


cdef int _check_shape(object arr, str name, tuple shape) except -1:
    cdef Py_ssize_t i
    cdef bint ok = arr.ndim == len(shape)
    if ok:
        for i in range(len(shape)):
            if shape[i] >= 0 and arr.shape[i] != shape[i]:
                ok = False
                break
    if not ok:
        raise ValueError(f"Invalid shape of {name}: expected {_shape_text(shape)}, got {arr.shape}")
    return 0


cdef object check_array(object arr, str name, object dtype, tuple shape):
    """Check that ``arr`` is a C-contiguous ndarray of ``dtype`` and ``shape``.

    ``shape`` entries of -1 match any length. Returns ``arr`` unchanged.
    Raises TypeError (not an ndarray, wrong dtype) or ValueError (shape,
    contiguity).
    """
    if not isinstance(arr, np.ndarray):
        raise TypeError(f"Invalid type of {name}: expected numpy.ndarray, got {type(arr).__name__}")
    if arr.dtype != dtype:
        raise TypeError(f"Invalid dtype of {name}: expected {np.dtype(dtype)}, got {arr.dtype}")
    _check_shape(arr, name, shape)
    if not arr.flags.c_contiguous:
        raise ValueError(f"Invalid layout of {name}: expected a C-contiguous array, got strides {arr.strides}")
    return arr


cdef object as_int_array(object values, str name, object dtype):
    """Convert a 1-D sequence of integers to a C-contiguous array of ``dtype``.

    An ndarray that already has ``dtype`` and that layout is returned as is
    (callers only read it).

    Accepts lists, tuples and integer ndarrays; rejects floats, bools and
    values that do not fit ``dtype``. Raises TypeError or ValueError.
    """
    cdef object arr
    cdef int type_num = cnp.NPY_INT64 if dtype is np.int64 else (cnp.NPY_INT32 if dtype is np.int32 else -1)
    if isinstance(values, np.ndarray):
        arr = values
        # Fast paths: already the right dtype and layout, nothing to check or
        # copy. The C checks first (per-call cost matters to schedulers); the
        # ISCARRAY_RO test also requires native byte order.
        if (type_num >= 0 and cnp.PyArray_TYPE(<cnp.ndarray>arr) == type_num
                and cnp.PyArray_NDIM(<cnp.ndarray>arr) == 1 and cnp.PyArray_ISCARRAY_RO(<cnp.ndarray>arr)):
            return arr
        if arr.dtype == dtype and arr.ndim == 1 and arr.flags.c_contiguous:
            return arr
    else:
        try:
            arr = np.asarray(values)
        except (TypeError, ValueError) as exc:
            raise TypeError(f"Invalid type of {name}: expected a 1-D sequence of integers, got {type(values).__name__}") from exc
        if arr.size == 0:
            arr = arr.astype(dtype)
        elif arr.ndim == 1 and arr.dtype.kind in "fO":
            items = list(values)
            if all(isinstance(v, numbers.Integral) and not isinstance(v, (bool, np.bool_)) for v in items):
                # Python ints beyond int64, which NumPy turned into floats or
                # objects: a range error, not a dtype one.
                _check_range(items, name, dtype)
                arr = np.asarray(items, dtype=dtype)
    if arr.ndim == 0 and not isinstance(values, (np.ndarray, np.generic, numbers.Number)):  # None, a string
        raise TypeError(f"Invalid type of {name}: expected a 1-D sequence of integers, got {type(values).__name__}")
    if arr.ndim != 1:
        raise ValueError(f"Invalid shape of {name}: expected a 1-D sequence, got shape {arr.shape}")
    if arr.dtype.kind not in "iu":
        raise TypeError(f"Invalid dtype of {name}: expected integers, got {arr.dtype}")
    if arr.size:
        _check_range([arr.min(), arr.max()], name, dtype)
    return np.ascontiguousarray(arr, dtype=dtype)


cdef int _check_range(object values, str name, object dtype) except -1:
    """Raise ValueError naming ``name`` unless every integer in ``values`` fits ``dtype``."""
    info = np.iinfo(dtype)
    lo = int(min(values))
    hi = int(max(values))
    if lo < info.min or hi > info.max:
        raise ValueError(
            f"Invalid value of {name}: expected values in [{info.min}, {info.max}], got range [{lo}, {hi}]"
        )
    return 0


cdef object check_float_array(object arr, str name, tuple shape, object pool_dtype):
    """Check a K/V or query array: float16 or float32 ndarray of ``shape``.

    Returns a C-contiguous array of ``pool_dtype``; converts (float32 into a
    float16 pool) or copies (non-contiguous) only when needed.
    Raises TypeError for a non-array or a non-float dtype, ValueError for a
    shape mismatch.
    """
    if not isinstance(arr, np.ndarray):
        raise TypeError(f"Invalid type of {name}: expected numpy.ndarray, got {type(arr).__name__}")
    if arr.dtype != np.float32 and arr.dtype != np.float16:
        raise TypeError(f"Invalid dtype of {name}: expected float16 or float32, got {arr.dtype}")
    _check_shape(arr, name, shape)
    if arr.dtype != pool_dtype or not arr.flags.c_contiguous:
        arr = np.ascontiguousarray(arr, dtype=pool_dtype)
    return arr
