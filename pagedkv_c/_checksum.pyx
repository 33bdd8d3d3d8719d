"""Page checksums of a K/V pool: what a sealed page records and a scrub recomputes.

One 64-bit value per page id over its K/V bytes in every layer (see
``page_checksum.h``): for each layer, XXH3-128 of the page's bytes in that
layer (K then V, as laid out in the pool) as its 16-byte canonical digest;
the checksum is the low 64 bits of XXH3-128 over the concatenated digests
(over the empty string with zero layers). XXH3 is the xxHash family's hash
(Yann Collet, https://github.com/Cyan4973/xxHash); the core carries its own
implementation (``xxh3.h``), the one prefix caching uses for its page hashes.
"""
import numpy as np

cimport numpy as cnp
from libc.stdint cimport int32_t, int64_t, uint8_t, uint64_t

from pagedkv_c._checks cimport as_int_array, check_int, invalid

cnp.import_array()

__all__ = ["combine_digests", "layer_digests", "page_checksums"]


def page_checksums(kv, page_ids):
    """Checksum of each listed page over its K/V bytes in every layer.

    Runs in C without the GIL. The same function records the checksum of a
    sealed page in ``KVCache(..., page_checksums=True)``, so a value computed
    here for a pool's page equals the one the cache recorded while the bytes
    are unchanged.

    Parameters
    ----------
    kv : numpy.ndarray, float16, float32, uint16 or uint8, shape ``(num_layers, num_pages, 2, page_size, num_kv_heads, row_items)``
        A K/V pool in the layout of ``KVCache.kv`` (index 0 of the third
        axis is K, 1 is V), C-contiguous; read only, so a read-only array or
        a memory map is accepted. ``num_layers`` may be 0.
    page_ids : sequence of int or numpy.ndarray of integers, shape ``(n,)``
        Page ids in ``[0, num_pages - 1]``; repeats are allowed.

    Returns
    -------
    numpy.ndarray, uint64, shape ``(n,)``
        ``out[i]`` is the checksum of page ``page_ids[i]``: for each layer L,
        ``d_L = xxh3_128(kv[L, page].tobytes()).digest()`` (16 bytes); the
        checksum is ``xxh3_128(d_0 + ... + d_{L-1}).intdigest() & (2**64 - 1)``.

    Raises
    ------
    TypeError
        ``kv`` is not an ndarray of float16 or float32; ``page_ids`` is not a
        1-D sequence of integers.
    ValueError
        ``kv`` is not 6-D with 2 on its third axis, or not C-contiguous;
        ``page_ids`` is not 1-D or holds an id outside ``[0, num_pages - 1]``.

    Notes
    -----
    XXH3 is not a cryptographic hash: it detects corruption (bit flips,
    torn or swapped pages), not a forger who chooses the bytes.
    """
    cdef cnp.ndarray pool = _checked_pool(kv, "kv")
    cdef int64_t num_pages = pool.shape[1]
    cdef cnp.ndarray ids = as_int_array(page_ids, "page_ids", np.int64)
    if ids.size:
        lo = int(ids.min())
        hi = int(ids.max())
        if lo < 0 or hi >= num_pages:
            bad = lo if lo < 0 else hi
            raise ValueError(
                f"{invalid('value', 'page_ids')}: expected page ids in [0, {num_pages - 1}], got {bad}"
            )
    ids = np.ascontiguousarray(ids, dtype=np.int32)
    cdef int64_t n = ids.shape[0]
    cdef cnp.ndarray out = np.empty(n, dtype=np.uint64)
    cdef int64_t num_layers = pool.shape[0]
    cdef cnp.ndarray scratch = np.empty(max(num_layers, 1) * 16, dtype=np.uint8)
    # From the shape, not the strides: NumPy calls every empty array C-contiguous whatever its strides.
    cdef size_t page_bytes = <size_t>(2 * pool.shape[3] * pool.shape[4] * pool.shape[5] * pool.itemsize)
    cdef size_t layer_stride = <size_t>num_pages * page_bytes
    cdef const uint8_t* data = <const uint8_t*>cnp.PyArray_DATA(pool)
    cdef const int32_t* id_data = <const int32_t*>cnp.PyArray_DATA(ids)
    cdef uint64_t* out_data = <uint64_t*>cnp.PyArray_DATA(out)
    cdef uint8_t* scratch_data = <uint8_t*>cnp.PyArray_DATA(scratch)
    with nogil:
        pkv_page_checksums(data, layer_stride, page_bytes, num_layers, id_data, n, out_data, scratch_data)
    return out


cdef cnp.ndarray _checked_pool(object kv, str name):
    """Check that ``kv`` is a C-contiguous 6-D pool array (float16, float32, or uint16 / uint8 pages of
    the bfloat16, int8 and int4 formats: checksums read bytes)."""
    if not isinstance(kv, np.ndarray):
        raise TypeError(f"{invalid('type', name)}: expected numpy.ndarray, got {type(kv).__name__}")
    if kv.dtype not in (np.float16, np.float32, np.uint16, np.uint8):
        raise TypeError(f"{invalid('dtype', name)}: expected float16, float32, uint16 or uint8, got {kv.dtype}")
    if kv.ndim != 6 or kv.shape[2] != 2:
        raise ValueError(
            f"{invalid('shape', name)}: expected (num_layers, num_pages, 2, page_size, num_kv_heads, "
            f"head_dim), got {kv.shape}"
        )
    if not kv.flags.c_contiguous:
        raise ValueError(f"{invalid('layout', name)}: expected a C-contiguous array, got strides {kv.strides}")
    return <cnp.ndarray>kv


# ------------------------------------------------------------------------
# Page checksums one layer at a time (page_digests.h): a snapshot hashes
# each run of pages right after reading it from a file, or right before
# writing it, while the bytes are still in the CPU's cache.
cdef extern from "page_digests.h":
    void pkv_layer_digests(const uint8_t* layer_base, size_t page_bytes, int64_t first, int64_t n,
                           int64_t layer, int64_t num_layers, const uint8_t* skip, uint8_t* digests) noexcept nogil
    void pkv_combine_digests(const uint8_t* digests, int64_t num_layers, int64_t n, const uint8_t* skip,
                             uint64_t* out) noexcept nogil


cdef object _checked_skip(object skip, int64_t num_pages):
    """``skip`` checked to be None or a C-contiguous uint8 array of shape ``(num_pages,)``."""
    if skip is None:
        return None
    if not isinstance(skip, np.ndarray) or skip.dtype != np.uint8:
        raise TypeError(f"{invalid('type', 'skip')}: expected a numpy.ndarray of uint8, got "
                        f"{getattr(skip, 'dtype', type(skip).__name__)}")
    if skip.shape != (num_pages,) or not skip.flags.c_contiguous:
        raise ValueError(f"{invalid('shape', 'skip')}: expected C-contiguous ({num_pages},), got {skip.shape}")
    return skip


cdef const uint8_t* _skip_data(object skip):
    """Data of a checked ``skip`` array, NULL for None."""
    if skip is None:
        return NULL
    return <const uint8_t*>cnp.PyArray_DATA(<cnp.ndarray>skip)


def layer_digests(kv, layer, first, stop, digests, skip=None):
    """Digest of each page in ``[first, stop)`` of one layer, the first step of :func:`page_checksums`.

    Writes ``digests[p, layer] = xxh3_128(kv[layer, p].tobytes()).digest()``
    for each page ``p`` in ``[first, stop)`` whose ``skip[p]`` is 0. Runs in C
    without the GIL. :func:`combine_digests` of a full ``digests`` array
    equals ``page_checksums(kv, range(num_pages))``.

    Parameters
    ----------
    kv : numpy.ndarray, float16, float32, uint16 or uint8, shape ``(num_layers, num_pages, 2, page_size, num_kv_heads, row_items)``
        A C-contiguous K/V pool (read only; a memory map is accepted).
    layer : int
        In ``[0, num_layers - 1]``.
    first, stop : int
        Page ids, ``0 <= first <= stop <= num_pages``.
    digests : numpy.ndarray, uint8, shape ``(num_pages, num_layers, 16)``
        C-contiguous, written in place.
    skip : numpy.ndarray of uint8, shape ``(num_pages,)``, optional
        Nonzero for pages to leave alone.

    Raises
    ------
    TypeError
        An argument of the wrong type or dtype.
    ValueError
        A shape, layout or range other than the above.
    """
    cdef cnp.ndarray pool = _checked_pool(kv, "kv")
    cdef int64_t num_layers = pool.shape[0], num_pages = pool.shape[1]
    if num_layers == 0:
        raise ValueError(f"{invalid('value', 'layer')}: the pool has no layers, got {layer}")
    cdef int64_t the_layer = check_int(layer, "layer", 0, num_layers - 1)
    cdef int64_t lo = check_int(first, "first", 0, num_pages)
    cdef int64_t hi = check_int(stop, "stop", lo, num_pages)
    cdef cnp.ndarray out = _checked_digests(digests, num_pages, num_layers)
    cdef object skip_array = _checked_skip(skip, num_pages)
    cdef const uint8_t* skip_data = _skip_data(skip_array)
    cdef size_t page_bytes = <size_t>(2 * pool.shape[3] * pool.shape[4] * pool.shape[5] * pool.itemsize)
    cdef const uint8_t* base = <const uint8_t*>cnp.PyArray_DATA(pool) + <size_t>the_layer * <size_t>num_pages * page_bytes
    cdef uint8_t* out_data = <uint8_t*>cnp.PyArray_DATA(out)
    with nogil:
        pkv_layer_digests(base, page_bytes, lo, hi - lo, the_layer, num_layers, skip_data, out_data)


def combine_digests(digests, out, skip=None):
    """Page checksums from per-layer digests, the second step of :func:`page_checksums`.

    Writes ``out[p] = xxh3_128(digests[p].tobytes()).intdigest() & (2**64 - 1)``
    for each page ``p`` whose ``skip[p]`` is 0 (over the empty string with
    zero layers). Runs in C without the GIL.

    Parameters
    ----------
    digests : numpy.ndarray, uint8, shape ``(num_pages, num_layers, 16)``
        C-contiguous, as :func:`layer_digests` fills it.
    out : numpy.ndarray, uint64, shape ``(num_pages,)``
        C-contiguous, written in place.
    skip : numpy.ndarray of uint8, shape ``(num_pages,)``, optional
        Nonzero for pages to leave alone.

    Raises
    ------
    TypeError, ValueError
        An argument of the wrong type, dtype, shape or layout.
    """
    if not isinstance(digests, np.ndarray) or digests.ndim != 3:
        raise TypeError(f"{invalid('type', 'digests')}: expected a 3-D numpy.ndarray of uint8")
    cdef int64_t num_pages = digests.shape[0], num_layers = digests.shape[1]
    cdef cnp.ndarray table = _checked_digests(digests, num_pages, num_layers)
    if not isinstance(out, np.ndarray) or out.dtype != np.uint64:
        raise TypeError(f"{invalid('type', 'out')}: expected a numpy.ndarray of uint64")
    if out.shape != (num_pages,) or not out.flags.c_contiguous or not out.flags.writeable:
        raise ValueError(f"{invalid('shape', 'out')}: expected a writeable C-contiguous ({num_pages},), got {out.shape}")
    cdef object skip_array = _checked_skip(skip, num_pages)
    cdef const uint8_t* skip_data = _skip_data(skip_array)
    cdef const uint8_t* digest_data = <const uint8_t*>cnp.PyArray_DATA(table)
    cdef uint64_t* out_data = <uint64_t*>cnp.PyArray_DATA(<cnp.ndarray>out)
    with nogil:
        pkv_combine_digests(digest_data, num_layers, num_pages, skip_data, out_data)


cdef cnp.ndarray _checked_digests(object digests, int64_t num_pages, int64_t num_layers):
    """Check that ``digests`` is a writeable C-contiguous uint8 array of shape (num_pages, num_layers, 16)."""
    if not isinstance(digests, np.ndarray) or digests.dtype != np.uint8:
        raise TypeError(f"{invalid('type', 'digests')}: expected a numpy.ndarray of uint8, got "
                        f"{getattr(digests, 'dtype', type(digests).__name__)}")
    if (digests.shape != (num_pages, num_layers, 16) or not digests.flags.c_contiguous
            or not digests.flags.writeable):
        raise ValueError(f"{invalid('shape', 'digests')}: expected a writeable C-contiguous "
                         f"({num_pages}, {num_layers}, 16), got {digests.shape}")
    return <cnp.ndarray>digests
