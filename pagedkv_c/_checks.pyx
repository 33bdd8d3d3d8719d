"""Argument validation shared by the public entry points of the core.

Every check runs before any state changes and raises an error whose message
reads ``Invalid <what> of <name>: expected ..., got ...``.
"""
import math
import numbers
import operator

import numpy as np

cimport numpy as cnp
from libc.stdint cimport int64_t

cnp.import_array()


cdef str invalid(str what, str name):
    """The start of an error message: ``Invalid <what> of <name>``.

    When the argument is named after the property being checked (``dtype``),
    the message reads ``Invalid dtype`` rather than ``Invalid dtype of dtype``.
    """
    return f"Invalid {what}" if what == name else f"Invalid {what} of {name}"


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
            f"{invalid('type', name)}: expected an integer, got {type(value).__name__}"
        )
    cdef object v = operator.index(value)
    if v < low or v > high:
        raise ValueError(f"{invalid('value', name)}: expected {low} <= {name} <= {high}, got {v}")
    return <int64_t>v


cdef int64_t check_index(object value, str name, int64_t size) except? -1:
    """Return ``value`` as a C integer in ``[0, size)`` (an index, e.g. a layer).

    Raises TypeError for a non-integer (bools and floats included) and
    IndexError for an integer outside the range.
    """
    try:
        return check_int(value, name, 0, size - 1)
    except ValueError:  # check_int's only ValueError: out of range
        raise IndexError(f"{invalid('value', name)}: expected 0 <= {name} < {size}, got {value}") from None


cdef bint check_bool(object value, str name) except -1:
    """Return ``value`` as a C flag: True, False or a NumPy bool; TypeError for anything else (1, 1.0, None)."""
    if value is True:
        return True
    if value is False:
        return False
    if isinstance(value, np.bool_):
        return bool(value)
    raise TypeError(f"{invalid('type', name)}: expected a bool, got {type(value).__name__}")


def checked_int(value, str name, low=None, high=None):
    """Return ``value`` as a Python int in ``[low, high]`` (None: no bound on that side).

    The rule of every scalar integer argument, for the Python modules of
    the package: a Python int or a NumPy integer is accepted; a bool, a
    float (even a whole one), a string, None or any other object raises
    TypeError (``Invalid type of <name>: expected an integer, got
    <type>``); an integer outside the range raises ValueError (``Invalid
    value of <name>: expected ..., got <value>``), never OverflowError.
    """
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{invalid('type', name)}: expected an integer, got {type(value).__name__}")
    v = operator.index(value)
    if (low is not None and v < low) or (high is not None and v > high):
        if high is None:
            expected = f"{name} >= {low}"
        elif low is None:
            expected = f"{name} <= {high}"
        else:
            expected = f"{low} <= {name} <= {high}"
        raise ValueError(f"{invalid('value', name)}: expected {expected}, got {v}")
    return v


def checked_flag(value, str name):
    """Return ``value`` as a Python bool: True, False or a NumPy bool; TypeError for anything else."""
    return True if check_bool(value, name) else False


# Longest duration argument, in seconds: 2**31 - 1 ms, the largest int32 of
# milliseconds (ZeroMQ's linger, poll and socket timeouts are int milliseconds).
MAX_SECONDS = (2**31 - 1) / 1000


def checked_seconds(value, str name, double low=0.0, bint low_inclusive=False, double high=MAX_SECONDS):
    """Return a duration argument as a float number of seconds in ``(low, high]`` (``[low, high]``
    when ``low_inclusive``).

    A real number (Python or NumPy int or float) is accepted; a bool, a
    string, a complex number or None raises TypeError; NaN, an infinity or
    a value out of range raises ValueError, never OverflowError.
    """
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{invalid('type', name)}: expected a number of seconds, got {type(value).__name__}")
    try:
        v = float(value)
    except OverflowError:  # an int past the float range
        v = math.inf if value > 0 else -math.inf
    if not (v >= low if low_inclusive else v > low) or not v <= high:
        raise ValueError(
            f"{invalid('value', name)}: expected a finite number of seconds with "
            f"{low:g} {'<=' if low_inclusive else '<'} {name} <= {high!r}, got {value!r}"
        )
    return v


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
        raise ValueError(f"{invalid('shape', name)}: expected {_shape_text(shape)}, got {arr.shape}")
    return 0


cdef object check_array(object arr, str name, object dtype, tuple shape):
    """Check that ``arr`` is a C-contiguous ndarray of ``dtype`` and ``shape``.

    ``shape`` entries of -1 match any length. Returns ``arr`` unchanged.
    Raises TypeError (not an ndarray, wrong dtype) or ValueError (shape,
    contiguity).
    """
    if not isinstance(arr, np.ndarray):
        raise TypeError(f"{invalid('type', name)}: expected numpy.ndarray, got {type(arr).__name__}")
    if arr.dtype != dtype:
        raise TypeError(f"{invalid('dtype', name)}: expected {np.dtype(dtype)}, got {arr.dtype}")
    _check_shape(arr, name, shape)
    if not arr.flags.c_contiguous:
        raise ValueError(f"{invalid('layout', name)}: expected a C-contiguous array, got strides {arr.strides}")
    return arr


cdef object as_int_array(object values, str name, object dtype):
    """Convert a 1-D sequence of integers to a C-contiguous array of ``dtype``.

    An ndarray that already has ``dtype`` and that layout is returned as is
    (callers only read it).

    The rule for every integer array argument of the API (sequence ids,
    token ids, counts, slot mappings, page ids, offsets): any 1-D array-like
    of integers (list, tuple, range, ndarray of any integer dtype, byte order
    or layout), every value fitting ``dtype``. As in NumPy indexing, floats
    (even whole ones such as ``2.0``), bools and object arrays are refused
    with TypeError; values outside ``dtype`` and other shapes with
    ValueError.
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
            raise TypeError(f"{invalid('type', name)}: expected a 1-D sequence of integers, got {type(values).__name__}") from exc
        if arr.size == 0:
            arr = arr.astype(dtype)
        elif arr.ndim == 1 and arr.dtype.kind in "iu" and isinstance(values, (list, tuple)):
            # NumPy turns [1, True] into [1, 1]: a bool where an integer is
            # meant is refused, as it is alone and in a bool array.
            kinds = set(map(type, values))
            if bool in kinds or np.bool_ in kinds:
                raise TypeError(f"{invalid('type', name)}: expected integers, got a bool among them")
        elif arr.ndim == 1 and arr.dtype.kind in "fO":
            items = list(values)
            if all(isinstance(v, numbers.Integral) and not isinstance(v, (bool, np.bool_)) for v in items):
                # Python ints beyond int64, which NumPy turned into floats or
                # objects: a range error, not a dtype one.
                _check_range(items, name, dtype)
                arr = np.asarray(items, dtype=dtype)
    if arr.ndim == 0 and not isinstance(values, (np.ndarray, np.generic, numbers.Number)):  # None, a string
        raise TypeError(f"{invalid('type', name)}: expected a 1-D sequence of integers, got {type(values).__name__}")
    if arr.ndim != 1:
        raise ValueError(f"{invalid('shape', name)}: expected a 1-D sequence, got shape {arr.shape}")
    if arr.dtype.kind not in "iu":
        raise TypeError(
            f"{invalid('dtype', name)}: expected integers (floats, bools and objects are refused), got {arr.dtype}"
        )
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
            f"{invalid('value', name)}: expected values in [{info.min}, {info.max}], got range [{lo}, {hi}]"
        )
    return 0


cdef object check_float_array(object arr, str name, tuple shape, object pool_dtype, str shape_names=None):
    """Convert a K/V or query argument to a C-contiguous array of ``pool_dtype``.

    The rule for every floating array argument of the API: any array-like of
    real numbers (an ndarray of float16, float32, float64 or an integer
    dtype, in any layout, or nested lists and tuples) with exactly ``shape``
    (entries of -1 match any length; nothing is reshaped or broadcast),
    converted to ``pool_dtype`` as ``numpy.asarray`` would (float64 rounds
    to the nearest float16/float32). Bools, complex numbers, strings and
    objects are refused. An ndarray that already has ``pool_dtype`` and a
    C-contiguous layout is returned as is; anything else is copied.

    ``shape_names`` spells the expected shape in words (``"(n, dim)"``) for
    the message. Raises TypeError (not numbers) or ValueError (shape,
    ragged nesting).
    """
    cdef object a
    if isinstance(arr, np.ndarray):
        a = arr
        if (cnp.PyArray_ISCARRAY_RO(<cnp.ndarray>a) and a.dtype == pool_dtype
                and _shape_matches(a, shape)):
            return a
    else:
        expected = _shape_text(shape) if shape_names is None else f"{shape_names} = {_shape_text(shape)}"
        try:
            a = np.asarray(arr)
        except ValueError as exc:  # NumPy: "inhomogeneous shape"
            raise ValueError(f"{invalid('shape', name)}: expected {expected}, got a ragged sequence") from exc
        except TypeError as exc:
            raise TypeError(f"{invalid('type', name)}: expected an array of numbers, got {type(arr).__name__}") from exc
        if a.dtype.kind == "O" or a.ndim == 0 and a.dtype.kind not in "iuf":
            raise TypeError(f"{invalid('type', name)}: expected an array of numbers, got {type(arr).__name__}")
        if a.shape == (0,) and len(shape) > 1 and shape[0] == 0 and min(shape) >= 0:
            # An empty sequence carries no row length: it is an empty batch.
            a = a.reshape(shape)
    if a.dtype.kind not in "iuf":
        raise TypeError(
            f"{invalid('dtype', name)}: expected real numbers (float16, float32, float64 or integers), got {a.dtype}"
        )
    if not _shape_matches(a, shape):
        expected = _shape_text(shape) if shape_names is None else f"{shape_names} = {_shape_text(shape)}"
        raise ValueError(f"{invalid('shape', name)}: expected {expected}, got {a.shape}")
    return np.ascontiguousarray(a, dtype=pool_dtype)


cdef bint _shape_matches(object arr, tuple shape):
    cdef Py_ssize_t i
    if arr.ndim != len(shape):
        return False
    for i in range(len(shape)):
        if shape[i] >= 0 and arr.shape[i] != shape[i]:
            return False
    return True


cdef object check_pool_dtype(object dtype, str name, tuple allowed):
    """Return ``numpy.dtype(dtype)`` if it is one of ``allowed`` (numpy dtypes).

    None is refused rather than read as float64, as ``numpy.dtype(None)`` would.
    Raises TypeError naming the allowed dtypes.
    """
    cdef str expected = " or ".join([str(d) for d in allowed])
    if dtype is None:
        raise TypeError(f"{invalid('dtype', name)}: expected {expected}, got None")
    try:
        np_dtype = np.dtype(dtype)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{invalid('dtype', name)}: expected {expected}, got {dtype!r}") from exc
    if np_dtype not in allowed:
        raise TypeError(f"{invalid('dtype', name)}: expected {expected}, got {np_dtype}")
    return np_dtype


def check_sink_window(window, sink_tokens, str sinks_name="sink_tokens", str window_name="window=W"):
    """Refuse attention sinks without a sliding window.

    The one check shared by ``KVCache``, ``PagedBackend`` and the command
    line (which passes ``"--sinks"`` and ``"--window W"`` as the names):
    sinks are the first positions a windowed query keeps seeing
    (StreamingLLM, Xiao et al., 2023); without a window every position is
    visible, so sinks would silently do nothing.

    Parameters
    ----------
    window : int or None
        Sliding window in tokens, None for full attention.
    sink_tokens : int
        Attention-sink tokens requested.
    sinks_name, window_name : str
        How the two arguments are named in the message.

    Raises
    ------
    ValueError
        ``sink_tokens > 0`` and ``window`` is None.
    """
    if window is None and sink_tokens:
        raise ValueError(
            f"{invalid('value', sinks_name)}: expected 0 without a sliding window (attention sinks "
            f"only exist with one: add {window_name}), got {sink_tokens}"
        )
