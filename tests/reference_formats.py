"""NumPy reference of pagedkv's page formats (pagedkv_c/page_formats.h), the oracle of the tests.

Written from the format's description, independently of the C code: a head row
of ``head_dim`` values becomes ``row_bytes(fmt, head_dim)`` bytes. Encoding
and decoding work on arrays of rows ``[..., head_dim]`` (float64 or float32
values; bfloat16 given as uint16 bit patterns).
"""
from __future__ import annotations

import numpy as np

FORMATS = ("float32", "float16", "bfloat16", "int8", "int4")
INT4_BLOCK = 32
ROTATED = {"int8", "int4"}


def row_bytes(fmt: str, head_dim: int) -> int:
    """Bytes of one head row of ``head_dim`` values in format ``fmt``."""
    return {
        "float32": 4 * head_dim,
        "float16": 2 * head_dim,
        "bfloat16": 2 * head_dim,
        "int8": head_dim + 2,
        "int4": (head_dim + 1) // 2 + 2 * -(-head_dim // INT4_BLOCK),
    }[fmt]


def bf16_bits_to_float(bits: np.ndarray) -> np.ndarray:
    """uint16 bfloat16 bit patterns -> float32."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def float_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits, round to nearest even; NaN stays NaN."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    nan = (bits & 0x7FFFFFFF) > 0x7F800000
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF
    out = np.where(nan, ((bits >> 16) | 0x40) & 0xFFFF, rounded)
    return out.astype(np.uint16)


def bf16_round_up(x: np.ndarray) -> np.ndarray:
    """Smallest bfloat16 >= x for finite x >= 0, as bits."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    up = (bits >> 16) + ((bits & 0xFFFF) != 0)
    return up.astype(np.uint16)


def rotation_block(head_dim: int) -> int:
    """The Walsh-Hadamard block: the largest power of two dividing head_dim, at most 256."""
    p = 1
    while p < 256 and head_dim % (2 * p) == 0:
        p *= 2
    return p


def hadamard(p: int) -> np.ndarray:
    """Orthonormal Sylvester Hadamard matrix of order p (float64)."""
    h = np.ones((1, 1))
    while h.shape[0] < p:
        h = np.block([[h, h], [h, -h]])
    return h / np.sqrt(p)


def rotate(x: np.ndarray) -> np.ndarray:
    """R x over the last axis (block-diagonal Hadamard), float64."""
    x = np.asarray(x, dtype=np.float64)
    d = x.shape[-1]
    p = rotation_block(d)
    blocks = x.reshape(*x.shape[:-1], d // p, p)
    return (blocks @ hadamard(p)).reshape(x.shape)  # hadamard(p) is symmetric


def rotate_f32(x: np.ndarray) -> np.ndarray:
    """R x over the last axis in float32, with the butterflies of page_formats.h in their order (bit for bit)."""
    x = np.array(x, dtype=np.float32)
    d = x.shape[-1]
    p = rotation_block(d)
    if p == 1:
        return x
    blocks = x.reshape(*x.shape[:-1], d // p, p)
    h = 1
    while h < p:
        pairs = blocks.reshape(*blocks.shape[:-1], p // (2 * h), 2, h)
        a, c = pairs[..., 0, :], pairs[..., 1, :]
        blocks = np.stack([a + c, a - c], axis=-2).reshape(blocks.shape)
        h *= 2
    norm = np.float32(1) / np.sqrt(np.float32(p))
    return (blocks * norm).reshape(x.shape)


def _quantize(x32: np.ndarray, limit: int) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric quantization of the last axis: (integers, bfloat16 scale bits) per row."""
    finite = np.isfinite(x32).all(axis=-1)
    amax = np.where(np.isfinite(x32), np.abs(x32), 0).max(axis=-1).astype(np.float32)
    scale_bits = bf16_round_up(amax / np.float32(limit))
    d = bf16_bits_to_float(scale_bits)
    with np.errstate(divide="ignore", invalid="ignore"):
        inv = np.where(d > 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
        q = np.rint(np.where(np.isfinite(x32), x32, 0) * inv[..., None])
    q = np.clip(q, -limit, limit)
    q[~finite] = 0
    scale_bits = np.where(finite, scale_bits, np.uint16(0x7FC0)).astype(np.uint16)
    return q.astype(np.int32), scale_bits


CLIPS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75)


def _quantize_q4(x32: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One int4 block per row of ``x32`` [..., n]: (levels in [-8, 7], bfloat16 scale bits).

    llama.cpp's q4_0 grid, ``d = f * m / -8`` with ``m`` the value of largest magnitude (first on
    ties), levels ``clamp(floor(x / d + 8.5), 0, 15) - 8``, the clip factor ``f`` of least squared
    error (first on ties); non-finite rows: NaN scale, zero levels.
    """
    finite = np.isfinite(x32).all(axis=-1)
    safe = np.where(np.isfinite(x32), x32, np.float32(0))
    m = np.take_along_axis(safe, np.abs(safe).argmax(axis=-1)[..., None], axis=-1)[..., 0]
    best_q = np.zeros(x32.shape, np.int32)
    best_bits = np.zeros(x32.shape[:-1], np.uint16)
    best_err = np.full(x32.shape[:-1], np.inf)
    for c, f in enumerate(CLIPS):
        bits = float_to_bf16_bits((np.float32(f) * m / np.float32(-8)).astype(np.float32))
        d = bf16_bits_to_float(bits)
        with np.errstate(divide="ignore", invalid="ignore"):
            inv = np.where(d != 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
        q = np.clip(np.floor(safe * inv[..., None] + np.float32(8.5)), 0, 15).astype(np.int32) - 8
        e = d[..., None].astype(np.float64) * q - safe.astype(np.float64)
        err = np.zeros(x32.shape[:-1])
        for i in range(x32.shape[-1]):  # in order, in float64, as the C loop adds
            err = err + e[..., i] * e[..., i]
        take = (err < best_err) | (c == 0)
        best_err = np.where(take, err, best_err)
        best_bits = np.where(take, bits, best_bits)
        best_q = np.where(take[..., None], q, best_q)
    best_q[~finite] = 0
    best_bits = np.where(finite, best_bits, np.uint16(0x7FC0)).astype(np.uint16)
    return best_q, best_bits


def encode(x: np.ndarray, fmt: str) -> np.ndarray:
    """Rows ``[..., head_dim]`` (float) -> uint8 ``[..., row_bytes]``."""
    x = np.asarray(x)
    d = x.shape[-1]
    lead = x.shape[:-1]
    if fmt == "float32":
        return np.ascontiguousarray(x, dtype=np.float32).view(np.uint8).reshape(*lead, 4 * d)
    if fmt == "float16":
        return np.ascontiguousarray(x, dtype=np.float16).view(np.uint8).reshape(*lead, 2 * d)
    if fmt == "bfloat16":
        return float_to_bf16_bits(x).view(np.uint8).reshape(*lead, 2 * d)
    x32 = np.asarray(x, dtype=np.float32)
    if fmt in ROTATED:
        x32 = rotate_f32(x32)
    if fmt == "int8":
        q, scale = _quantize(x32, 127)
        out = np.empty((*lead, d + 2), dtype=np.uint8)
        out[..., :d] = q.astype(np.int8).view(np.uint8)
        out[..., d:] = scale[..., None].view(np.uint8).reshape(*lead, 2)
        return out
    if fmt == "int4":
        packed = (d + 1) // 2
        nblocks = -(-d // INT4_BLOCK)
        q = np.empty(x32.shape, dtype=np.int32)
        scales = np.empty((*lead, nblocks), dtype=np.uint16)
        for b in range(nblocks):
            sl = slice(b * INT4_BLOCK, min(d, (b + 1) * INT4_BLOCK))
            q[..., sl], scales[..., b] = _quantize_q4(x32[..., sl])
        scales[~np.isfinite(x32).all(axis=-1)] = 0x7FC0  # one non-finite value: the whole row NaN
        nib = (q + 8).astype(np.uint8)
        if d % 2:
            nib = np.concatenate([nib, np.zeros((*lead, 1), np.uint8)], axis=-1)
        out = np.empty((*lead, row_bytes("int4", d)), dtype=np.uint8)
        out[..., :packed] = nib[..., 0::2] | (nib[..., 1::2] << 4)
        out[..., packed:] = scales.view(np.uint8).reshape(*lead, 2 * nblocks)
        return out
    raise ValueError(fmt)


def decode(raw: np.ndarray, fmt: str, head_dim: int) -> np.ndarray:
    """uint8 rows ``[..., row_bytes]`` -> float64 values ``[..., head_dim]``."""
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    lead = raw.shape[:-1]
    d = head_dim
    if fmt == "float32":
        return raw.view(np.float32).reshape(*lead, d).astype(np.float64)
    if fmt == "float16":
        return raw.view(np.float16).reshape(*lead, d).astype(np.float64)
    if fmt == "bfloat16":
        return bf16_bits_to_float(raw.view(np.uint16).reshape(*lead, d)).astype(np.float64)
    if fmt == "int8":
        scale = bf16_bits_to_float(np.ascontiguousarray(raw[..., d:]).view(np.uint16)[..., 0])
        return rotate(raw[..., :d].view(np.int8).astype(np.float64) * scale[..., None].astype(np.float64))
    if fmt == "int4":
        packed = (d + 1) // 2
        nblocks = -(-d // INT4_BLOCK)
        nib = np.empty((*lead, 2 * packed), dtype=np.int32)
        nib[..., 0::2] = raw[..., :packed] & 0xF
        nib[..., 1::2] = raw[..., :packed] >> 4
        q = nib[..., :d] - 8
        scales = bf16_bits_to_float(np.ascontiguousarray(raw[..., packed:]).view(np.uint16)).astype(np.float64)
        per_value = np.repeat(scales, INT4_BLOCK, axis=-1)[..., :d]
        return rotate(q * per_value)
    raise ValueError(fmt)


def read_back(x: np.ndarray, fmt: str) -> tuple[np.ndarray, float]:
    """What ``KVCache.gather`` returns for rows ``x`` stored in format ``fmt`` (float64), and the absolute
    difference allowed: 0 (bit for bit), except where int8/int4 undo their rotation, in float32 in C and
    in float64 here: ``2e-6 * max|x|``."""
    rotated = fmt in ROTATED and rotation_block(x.shape[-1]) > 1
    return decode(encode(x, fmt), fmt, x.shape[-1]), (2e-6 * float(np.abs(x).max()) if rotated else 0.0)


def error_bound(x: np.ndarray, fmt: str) -> np.ndarray:
    """Largest allowed |decode(encode(x)) - x| per finite row ``[..., head_dim]`` of a float format (float64)."""
    x = np.asarray(x, dtype=np.float64)
    if fmt == "float32":
        return np.abs(x).max(axis=-1) * 2.0**-24
    if fmt == "float16":
        return np.maximum(np.abs(x).max(axis=-1) * 2.0**-11, 2.0**-25)
    if fmt == "bfloat16":
        return np.abs(x).max(axis=-1) * 2.0**-8
    raise ValueError(fmt)


def quantize_query(q: np.ndarray, fmt: str = "int8") -> np.ndarray:
    """The query that int8 integer scores use (``kernel_info()["int8_scores"]`` not ``"float32"``), float64.

    Per row of the last axis: ``d * rint(q / d)`` with ``d = max|q| / 127`` in float32 (llama.cpp
    quantizes its query to int8 the same way for int8 keys). For a rotated format the kernels
    quantize ``R q`` (the rows hold ``R k``): the result is ``R`` of that, in the query's frame.
    """
    if fmt in ROTATED:
        return rotate(quantize_query(rotate_f32(q), "float32"))
    q = np.asarray(q, dtype=np.float32)
    d = (np.abs(q).max(axis=-1, keepdims=True) / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(d > 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
    levels = np.clip(np.rint(q * inv), -127, 127)
    return levels.astype(np.float64) * d.astype(np.float64)
