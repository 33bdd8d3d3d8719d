"""Forge snapshot files and exported sequences: edit their sections, then recompute every checksum.

The checksums of the format detect accidents, not forgers: a forged input
passes them, so these helpers test what the loader validates beyond them.
They use the format's own reader and writer pieces in ``pagedkv.snapshot``.
"""
import struct

import numpy as np

from pagedkv import snapshot as snap


def sections_of(data: bytes) -> tuple[bytes, dict]:
    """(magic, {tag: value}) of a container, in file order: metadata sections as {name: array} (copies),
    ``checksums`` as a uint64 array, ``pages`` as bytes."""
    magic, num_sections = bytes(data[:8]), struct.unpack_from("<I", data, 16)[0]
    out = {}
    for i in range(num_sections):
        tag, offset, length, _ = snap._ENTRY.unpack_from(data, snap._HEADER_BYTES + snap._ENTRY.size * i)
        tag = tag.rstrip(b"\0").decode()
        raw = bytes(data[offset:offset + length])
        if tag == "pages":
            out[tag] = raw
        elif tag == "checksums":
            out[tag] = np.frombuffer(raw, dtype="<u8").astype(np.uint64)
        else:
            out[tag] = {name: np.array(value) for name, value in snap._decode(tag, raw).items()}
    return magic, out


def assemble(magic: bytes, sections: dict) -> bytes:
    """A container of ``sections`` (as from :func:`sections_of`) with every checksum valid."""
    metadata = [(tag, snap._encode(value)) for tag, value in sections.items() if tag not in ("checksums", "pages")]
    checksums = np.asarray(sections["checksums"], dtype="<u8").tobytes()
    pages = sections["pages"]
    align = 8 if magic == snap.MAGIC_SEQUENCE else snap._PAGE_ALIGN
    prefix, length = snap._container(magic, metadata, checksums, len(pages), align)
    assert length == len(prefix) + len(pages)
    return prefix + pages


def forge(data: bytes, edit) -> bytes:
    """``data`` with ``edit(sections)`` applied to its sections (see :func:`sections_of`), checksums recomputed."""
    magic, sections = sections_of(data)
    edit(sections)
    return assemble(magic, sections)


def forge_file(path, edit) -> None:
    """Rewrite the snapshot file ``path`` with ``edit`` applied (see :func:`forge`)."""
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(forge(data, edit))


def page_checksums(sections: dict) -> np.ndarray:
    """The page checksums of a KVCache snapshot's or exported sequence's ``pages`` bytes (to re-record them)."""
    config = sections["config"]
    num_pages = sections["checksums"].shape[0]
    shape = (int(config["num_layers"]), num_pages, 2, int(config["page_size"]), int(config["num_kv_heads"]),
             int(config["head_dim"]))
    dtype = np.dtype(bytes(config["dtype"]).decode())
    kv = np.frombuffer(sections["pages"], dtype=dtype).reshape(shape) if sections["pages"] else np.zeros(shape, dtype)
    return snap.page_checksums(np.ascontiguousarray(kv), np.arange(num_pages, dtype=np.int32))
