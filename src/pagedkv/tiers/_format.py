"""The page value of a shared tier: key naming, header layout and verification.

A tier stores one value per sealed page (a full page whose K/V is complete in every
layer), under a key made of the namespace and the page's chained 128-bit prefix hash:

``b"pagedkv:" + <24 hex digits of the namespace digest> + b":" + <32 hex digits of the hash>``

The namespace digest is the SHA-256 of the user's model fingerprint together with the
cache layout (layers, KV heads, head dim, page size, dtype, page hash algorithm) and the
format version, so caches that could not use each other's bytes never read each other's
keys. Tenants' pages differ already in the hash (the salt is chained into it).

Value (all integers little-endian):

=====================  =====  ===================================================
field                  bytes  meaning
=====================  =====  ===================================================
magic                  8      ``b"PKVPAGE\\x00"``
version                2      format version, 1
flags                  2      bit 0: token ids follow the header; other bits zero
num_layers             4      layout of the writing cache ...
num_kv_heads           4
head_dim               4
page_size              4      tokens per page
dtype                  1      page format: 1 = float16, 2 = float32, 3 = bfloat16, 4 = int8, 5 = int4
hash algorithm         1      0 = xxh3_128, 1 = sha256
reserved               2      zero
page hash              16     the chained hash (lo, hi), equal to the key's
checksum               8      page checksum of the K/V bytes (see below)
body length            8      ``num_layers * 2 * page_size * num_kv_heads * row_bytes`` (a head row's bytes in the page format)
token ids              4 * page_size, int32, when flag bit 0 is set (token-keyed pages)
body                   body length: for each layer in order, the page's K then V
                       rows as laid out in the pool (``kv[layer, page]``, C order)
=====================  =====  ===================================================

The checksum is the project's page checksum (``pagedkv_c._checksum``, XXH3-128 of
each layer's page bytes, then the low 64 bits of XXH3-128 over those digests), the
same that snapshots record. A reader verifies every field against what it expects
before it changes anything: a value of another layout, another hash, other token
ids, a wrong length or a wrong checksum is rejected. A cache without layers
(``num_layers=0``, trace replay) stores headers only: the body is empty.
"""
from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

import numpy as np

MAGIC = b"PKVPAGE\x00"
FORMAT_VERSION = 1
FLAG_TOKENS = 1
# magic, version, flags, layers, kv heads, head dim, page size, dtype, hash, reserved,
# page hash, checksum, body length.
HEADER = struct.Struct("<8sHHIIIIBBH16sQQ")
# Byte offsets of the page hash and the checksum in a header.
HASH_OFFSET = struct.calcsize("<8sHHIIIIBBH")
CHECKSUM_OFFSET = HASH_OFFSET + 16
_DTYPE_CODES = {"float16": 1, "float32": 2, "bfloat16": 3, "int8": 4, "int4": 5}
_HASH_CODES = {"xxh3_128": 0, "sha256": 1}

# Why a value was not used (the counters and log messages of a tier use these names).
REJECT_KINDS = ("missing", "truncated", "format", "layout", "hash", "tokens", "checksum")


@dataclass(frozen=True)
class PageLayout:
    """The layout a page value must match to be copied into a cache.

    Attributes
    ----------
    num_layers, num_kv_heads, head_dim : int
        As in :class:`pagedkv.KVCache`.
    page_size : int
        Tokens per page.
    dtype : numpy.dtype
        The pool's element dtype: float16 or float32, uint16 for bfloat16 pages,
        uint8 for int8 and int4 pages.
    hash_algorithm : str
        ``"xxh3_128"`` or ``"sha256"`` (``KVCache(prefix_hash=...)``).
    kv_dtype : str
        The page format (``KVCache.kv_dtype``); pages of two formats never
        match, even where their element dtypes do.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: np.dtype
    hash_algorithm: str
    kv_dtype: str

    @classmethod
    def of_cache(cls, num_layers, num_kv_heads, head_dim, page_size, dtype, hash_algorithm):
        """A layout from a cache's parameters (validated: format and algorithm must be known).

        ``dtype`` is the page format: a name of ``KVCache.kv_dtype`` or the
        numpy dtype float16 / float32.
        """
        from pagedkv_c._page_store import format_layout

        kv_dtype = dtype if isinstance(dtype, str) else np.dtype(dtype).name
        if kv_dtype not in _DTYPE_CODES:
            raise ValueError(f"Invalid value of dtype: expected one of {sorted(_DTYPE_CODES)}, got {dtype}")
        if hash_algorithm not in _HASH_CODES:
            raise ValueError(
                f"Invalid value of hash_algorithm: expected one of {sorted(_HASH_CODES)}, got {hash_algorithm!r}")
        element, _ = format_layout(kv_dtype, int(head_dim))
        return cls(int(num_layers), int(num_kv_heads), int(head_dim), int(page_size), element, hash_algorithm,
                   kv_dtype)

    @property
    def page_bytes(self) -> int:
        """Bytes of one page in one layer, K and V: ``2 * page_size * num_kv_heads * row_bytes``."""
        from pagedkv_c._page_store import format_layout

        _, row_items = format_layout(self.kv_dtype, self.head_dim)
        return 2 * self.page_size * self.num_kv_heads * row_items * self.dtype.itemsize

    @property
    def body_bytes(self) -> int:
        """Bytes of one page across all layers (the value's body)."""
        return self.num_layers * self.page_bytes

    def describe(self) -> str:
        """The layout as text, e.g. ``L30-H3-D64-P16-float16-xxh3_128``."""
        return (f"L{self.num_layers}-H{self.num_kv_heads}-D{self.head_dim}-P{self.page_size}-"
                f"{self.kv_dtype}-{self.hash_algorithm}")

    def key_prefix(self, namespace: str) -> bytes:
        """``b"pagedkv:<digest>:"``: the start of every key of this namespace and layout."""
        text = f"pagedkv-tier-v{FORMAT_VERSION}\x00{namespace}\x00{self.describe()}"
        return b"pagedkv:" + hashlib.sha256(text.encode()).hexdigest()[:24].encode() + b":"

    def header_fields(self) -> tuple:
        """The layout fields of a value header: layers, KV heads, head dim, page size, dtype and hash codes."""
        return (self.num_layers, self.num_kv_heads, self.head_dim, self.page_size,
                _DTYPE_CODES[self.kv_dtype], _HASH_CODES[self.hash_algorithm])


def page_keys(prefix: bytes, page_hashes: np.ndarray) -> list[bytes]:
    """Keys of pages: ``prefix`` + the 32 hex digits of each hash (lo then hi, little-endian bytes).

    Parameters
    ----------
    page_hashes : numpy.ndarray
        uint64, shape ``[n, 2]``: (lo, hi) of each chained page hash.
    """
    raw = np.ascontiguousarray(page_hashes, dtype="<u8").tobytes()
    return [prefix + raw[16 * i:16 * i + 16].hex().encode() for i in range(len(page_hashes))]


def encode_header(layout: PageLayout, page_hash, token_ids, checksum: int) -> bytes:
    """The header (and token ids) of one page value; the body follows it.

    Parameters
    ----------
    page_hash : numpy.ndarray
        uint64, shape ``[2]``: (lo, hi).
    token_ids : numpy.ndarray or None
        int32, shape ``[page_size]``, or None for a block-keyed page.
    checksum : int
        The page checksum (uint64) of the body.
    """
    flags = FLAG_TOKENS if token_ids is not None else 0
    head = HEADER.pack(MAGIC, FORMAT_VERSION, flags, *layout.header_fields(), 0,
                       np.ascontiguousarray(page_hash, dtype="<u8").tobytes(), int(checksum),
                       layout.body_bytes)
    if token_ids is None:
        return head
    return head + np.ascontiguousarray(token_ids, dtype="<i4").tobytes()


def expected_header(layout: PageLayout, with_tokens: bool) -> bytes:
    """The header every value of ``layout`` carries, with zero page hash and checksum fields.

    A reader compares a value's header with it outside those two fields
    (``HASH_OFFSET``, ``CHECKSUM_OFFSET``), which hold each page's own.

    Parameters
    ----------
    with_tokens : bool
        Token-keyed pages (the flag bit and the token ids after the header)
        or block-keyed ones.
    """
    return HEADER.pack(MAGIC, FORMAT_VERSION, FLAG_TOKENS if with_tokens else 0, *layout.header_fields(), 0,
                       bytes(16), 0, layout.body_bytes)


def check_value(value, layout: PageLayout, page_hash, token_ids):
    """Verify one value's header against what the reader expects.

    Parameters
    ----------
    value : bytes or None
        What the store returned for the page's key (None: no such key).
    layout : PageLayout
    page_hash : numpy.ndarray
        uint64, shape ``[2]``: the hash the reader asked for.
    token_ids : numpy.ndarray or None
        int32, shape ``[page_size]``: the prompt's tokens of this page, or
        None for a block-keyed page (then the value must carry none).

    Returns
    -------
    (str or None, int, int)
        The reject kind (one of ``REJECT_KINDS``) or None when the header is
        good; the body's offset in ``value``; the checksum the header states.
        The checksum itself is verified by the caller, over the body.
    """
    if value is None:
        return "missing", 0, 0
    if len(value) < HEADER.size:
        return "truncated", 0, 0
    (magic, version, flags, num_layers, num_kv_heads, head_dim, page_size, dtype_code, hash_code,
     reserved, stored_hash, checksum, body_length) = HEADER.unpack_from(value)
    if magic != MAGIC or version != FORMAT_VERSION or flags & ~FLAG_TOKENS or reserved:
        return "format", 0, 0
    if (num_layers, num_kv_heads, head_dim, page_size, dtype_code, hash_code) != layout.header_fields() \
            or body_length != layout.body_bytes:
        return "layout", 0, 0
    if stored_hash != np.ascontiguousarray(page_hash, dtype="<u8").tobytes():
        return "hash", 0, 0
    offset = HEADER.size
    if token_ids is not None:
        if not flags & FLAG_TOKENS:
            return "tokens", 0, 0
        offset += 4 * layout.page_size
        if len(value) != offset + body_length:
            return "truncated", 0, 0
        stored = np.frombuffer(value, dtype="<i4", count=layout.page_size, offset=HEADER.size)
        if not np.array_equal(stored, token_ids):
            return "tokens", 0, 0
    elif flags & FLAG_TOKENS:
        return "tokens", 0, 0
    if len(value) != offset + body_length:
        return "truncated", 0, 0
    return None, offset, checksum
