"""Structure-aware mutations of pagedkv snapshot files and exported sequences.

Used by ``fuzz_snapshots.py``. Three parts:

- ``seed_files()``: valid files written by real caches of varied
  configurations (windows and attention sinks, prefix caching with token
  prompts, salts and external block hashes, page checksums, forks, sealed
  pages, float16 and float32, ``num_layers=0``, an empty cache), classic
  ``PagedKVCache`` snapshots, and every sequence of those caches exported with
  ``KVCache.export_sequence``.
- ``Container``: the file parsed into its header, section table, named-array
  metadata sections, page checksum table and pages (the format of the
  ``pagedkv.snapshot`` module notes), rebuilt with every checksum recomputed:
  the metadata sections', the section table's, the header's and, where a
  mutation touched pages or the pool's geometry, the page checksums
  (``pagedkv_c._checksum.page_checksums``). So a mutated file tests the
  loader's structural checks, not its checksums.
- ``mutate(data, rng)``: one to three mutations of the structure: header
  fields, section offsets and lengths, entry names, dtypes and shapes, counts,
  lengths, ids, ref counts, the free queue, ring fields, hash chains, seal
  flags, recorded checksums, counters near ``2**63``, byte flips in pages;
  some are single-field edits, others keep the neighbouring fields consistent
  (a page added to a table also gets its ref count and leaves the free queue)
  so that the edit gets past the first checks and reaches the deeper ones.

Everything is deterministic for a given ``random.Random`` state. The
checksums of metadata, table and header are computed with the ``xxhash``
package (the low 64 bits of XXH3-128), independently of pagedkv's own code.
"""
from __future__ import annotations

import random
import struct
from dataclasses import dataclass, field

import numpy as np
import xxhash

MAGIC_CACHE = b"PKVSNAP\x00"
MAGIC_SEQUENCE = b"PKVSEQ\x00\x00"
MAGIC_CLASSIC = b"PKVCLAS\x00"
KINDS = {MAGIC_CACHE: "cache", MAGIC_SEQUENCE: "sequence", MAGIC_CLASSIC: "classic"}
HEADER = struct.Struct("<8sIIIIQQ16s")
ENTRY = struct.Struct("<16sQQQ")
CODES = {1: np.dtype("<i4"), 2: np.dtype("<i8"), 3: np.dtype("<u8"), 4: np.dtype("u1")}
MASK64 = (1 << 64) - 1
#: Prompts shared by the seed caches and the fuzzer's later add_sequence calls, so that those hit cached pages.
PROMPTS = [list(range(100, 137)), list(range(100, 112)) + list(range(500, 520)), [7] * 21, list(range(1, 9))]


def checksum(data) -> int:
    """Low 64 bits of XXH3-128 (the metadata, table and header checksum of the format)."""
    return xxhash.xxh3_128_intdigest(bytes(data)) & MASK64


# ------------------------------------------------------------------ container
@dataclass
class Entry:
    """One named array of a metadata section: raw bytes, so that any code, shape or length can be written."""
    name: bytes
    code: int
    shape: list
    raw: bytes

    def array(self) -> np.ndarray | None:
        """The entry as an array, or None when its code or byte count does not make one."""
        dtype = CODES.get(self.code)
        if dtype is None:
            return None
        count = int(np.prod(self.shape, dtype=object)) if self.shape else 1
        if count * dtype.itemsize != len(self.raw):
            return None
        return np.frombuffer(self.raw, dtype=dtype).reshape(self.shape).astype(dtype.newbyteorder("="))

    def set(self, array, code: int | None = None) -> None:
        """Replace the entry by ``array`` (written with ``code``'s dtype, default the entry's own)."""
        code = self.code if code is None else code
        array = np.asarray(array)
        self.code = code
        self.shape = list(array.shape)
        self.raw = array.astype(CODES[code]).tobytes()


def encode_entries(entries: list[Entry]) -> bytes:
    """A metadata section: per entry the header, name, padding, shape, bytes, padding (module notes)."""
    out = bytearray()
    for e in entries:
        out += struct.pack("<HBB", len(e.name), e.code & 0xFF, len(e.shape) & 0xFF) + e.name
        out += bytes(-len(out) % 8)
        out += struct.pack(f"<{len(e.shape)}Q", *[s & MASK64 for s in e.shape])
        out += e.raw
        out += bytes(-len(out) % 8)
    return bytes(out)


def decode_entries(data: bytes) -> list[Entry] | None:
    """The entries of a valid metadata section, or None when it does not parse."""
    entries, pos = [], 0
    while pos < len(data):
        if len(data) - pos < 4:
            return None
        name_length, code, ndim = struct.unpack_from("<HBB", data, pos)
        name_end = pos + 4 + name_length
        shape_at = name_end + (-name_end % 8)
        if code not in CODES or ndim > 4 or shape_at + 8 * ndim > len(data):
            return None
        shape = list(struct.unpack_from(f"<{ndim}Q", data, shape_at))
        start = shape_at + 8 * ndim
        count = int(np.prod(shape, dtype=object)) if shape else 1
        end = start + count * CODES[code].itemsize
        if end > len(data):
            return None
        entries.append(Entry(data[pos + 4:name_end], code, shape, data[start:end]))
        pos = end + (-end % 8)
    return entries


@dataclass
class Section:
    tag: bytes
    entries: list | None = None  # metadata sections
    raw: bytes = b""             # checksums, pages, or metadata that did not parse

    def payload(self) -> bytes:
        return encode_entries(self.entries) if self.entries is not None else self.raw

    def entry(self, name: str) -> Entry | None:
        for e in self.entries or ():
            if e.name == name.encode():
                return e
        return None


@dataclass
class Container:
    """A parsed file; ``build()`` lays it out again with every checksum recomputed."""
    magic: bytes
    version: int = 1
    header_bytes: int = 64
    zero: int = 0
    reserved: bytes = bytes(16)
    sections: list = field(default_factory=list)
    align: int = 4096
    pad_extra: int = 0  # extra zero bytes before pages (beyond the alignment)

    @property
    def kind(self) -> str:
        return KINDS.get(self.magic, "cache")

    def section(self, tag: str) -> Section | None:
        for s in self.sections:
            if s.tag == tag.encode():
                return s
        return None

    def build(self) -> bytes:
        """Header, section table, sections (pages aligned), with all checksums computed over what is written."""
        payloads = [s.payload() for s in self.sections]
        n = len(self.sections)
        offset = 64 + 40 * n
        table = bytearray()
        checks = next((p for s, p in zip(self.sections, payloads) if s.tag == b"checksums"), b"")
        layout = []
        for s, p in zip(self.sections, payloads):
            if s.tag == b"pages":
                offset += -offset % self.align + self.pad_extra
                table += ENTRY.pack(s.tag, offset, len(p), checksum(checks))
            else:
                table += ENTRY.pack(s.tag, offset, len(p), checksum(p))
            layout.append(offset)
            offset += len(p)
        file_length = offset
        head = HEADER.pack(self.magic, self.version, self.header_bytes, n, self.zero, file_length,
                           checksum(table), self.reserved)
        head += struct.pack("<Q", checksum(head))
        out = bytearray(file_length)
        out[:64] = head
        out[64:64 + len(table)] = table
        for at, p in zip(layout, payloads):
            out[at:at + len(p)] = p
        return bytes(out)


def parse(data: bytes) -> Container:
    """The container of a valid file (as written by pagedkv)."""
    magic, version, header_bytes, num_sections, zero, file_length, _, reserved = HEADER.unpack_from(data)
    c = Container(magic, version, header_bytes, zero, reserved, align=8 if magic == MAGIC_SEQUENCE else 4096)
    end = 64 + 40 * num_sections
    for i in range(num_sections):
        tag, offset, length, _ = ENTRY.unpack_from(data, 64 + 40 * i)
        raw = data[offset:offset + length]
        tag = tag.rstrip(b"\x00")
        if tag in (b"checksums", b"pages"):
            c.sections.append(Section(tag, raw=raw))
        else:
            entries = decode_entries(raw)
            c.sections.append(Section(tag, entries=entries, raw=raw if entries is None else b""))
        if tag == b"pages":
            c.pad_extra = max(0, offset - end - (-end % c.align))
        end = offset + length
    return c


def rewrite_fields(data: bytes, edits: dict) -> bytes:
    """Edit raw header or table fields of a built file, then recompute the table and header checksums.

    ``edits``: ``("header", name) -> value`` for ``version``, ``header_bytes``,
    ``num_sections``, ``zero``, ``file_length``; ``(index, "offset"|"length"|"tag")
    -> value`` for the section table. A section whose place changed gets the
    checksum of the bytes now at that place (when they lie inside the file).
    """
    out = bytearray(data)
    magic, version, header_bytes, num_sections, zero, file_length, _, reserved = HEADER.unpack_from(out)
    h = {"version": version, "header_bytes": header_bytes, "num_sections": num_sections, "zero": zero,
         "file_length": file_length}
    real_sections = min(num_sections, (len(out) - 64) // 40)  # (an earlier edit may have raised the count)
    for key, value in edits.items():
        if key[0] == "header":
            h[key[1]] = value & (MASK64 if key[1] == "file_length" else 0xFFFFFFFF)
    for i in range(real_sections):
        at = 64 + 40 * i
        tag, offset, length, check = ENTRY.unpack_from(out, at)
        changed = False
        if (i, "offset") in edits:
            offset, changed = edits[(i, "offset")] & MASK64, True
        if (i, "length") in edits:
            length, changed = edits[(i, "length")] & MASK64, True
        if (i, "tag") in edits:
            tag = edits[(i, "tag")]
        if changed and tag.rstrip(b"\x00") != b"pages" and offset + length <= len(out):
            check = checksum(out[offset:offset + length])
        if at + 40 <= len(out):
            ENTRY.pack_into(out, at, tag, offset, length, check)
    table_len = 40 * h["num_sections"]
    table = bytes(out[64:64 + table_len]) if 64 + table_len <= len(out) else b""
    head = HEADER.pack(magic, h["version"], h["header_bytes"], h["num_sections"], h["zero"], h["file_length"],
                       checksum(table), reserved)
    out[:56] = head
    out[56:64] = struct.pack("<Q", checksum(head))
    return bytes(out)


# ------------------------------------------------------------- page geometry
def pool_view(c: Container) -> np.ndarray | None:
    """The pages section as the 6-D array that page checksums read, or None if the config does not fit it."""
    pages = c.section("pages")
    config = c.section("config")
    checks = c.section("checksums")
    if pages is None or config is None or config.entries is None or checks is None:
        return None
    num_pages = len(checks.raw) // 8

    def scalar(name):
        e = config.entry(name)
        a = e.array() if e is not None else None
        return int(a) if a is not None and a.ndim == 0 else None

    def text(name):
        e = config.entry(name)
        return e.raw.decode("ascii", "replace") if e is not None else None

    try:
        if c.kind == "classic":
            dim, page_size, dtype = scalar("dim"), scalar("page_size"), text("dtype")
            if None in (dim, page_size) or dtype not in ("float16", "float32", "float64"):
                return None
            width = 2 if dtype == "float16" else 4
            elems = dim * (2 if dtype == "float64" else 1)
            shape = (1, num_pages, 2, page_size, 1, elems)
            dt = np.float16 if width == 2 else np.float32
        else:
            dims = [scalar(k) for k in ("num_layers", "num_kv_heads", "head_dim", "page_size")]
            dtype = text("dtype")
            if None in dims or dtype not in ("float16", "float32") or min(dims) < 0:
                return None
            layers, heads, head_dim, page_size = dims
            shape = (layers, num_pages, 2, page_size, heads, head_dim)
            dt = np.dtype(dtype)
        if int(np.prod(shape, dtype=object)) * np.dtype(dt).itemsize != len(pages.raw):
            return None
        return np.frombuffer(pages.raw, dtype=dt).reshape(shape).copy()
    except (ValueError, OverflowError):
        return None


def recompute_page_checksums(c: Container, seals: bool) -> bool:
    """Set the ``checksums`` section to the page checksums of the pages (and, with ``seals``, the recorded
    checksums of sealed pages too); False when the config does not describe the pages section."""
    from pagedkv_c._checksum import page_checksums
    kv = pool_view(c)
    if kv is None:
        return False
    ids = np.arange(kv.shape[1], dtype=np.int32)
    actual = page_checksums(np.ascontiguousarray(kv), ids) if kv.shape[1] else np.zeros(0, np.uint64)
    c.section("checksums").raw = actual.astype("<u8").tobytes()
    sealed = c.section("sealed")
    if seals and sealed is not None and sealed.entries is not None:
        flags, recorded = sealed.entry("sealed"), sealed.entry("checksums")
        if flags is not None and recorded is not None:
            f, r = flags.array(), recorded.array()
            if f is not None and r is not None and f.shape == r.shape == actual.shape:
                r = r.copy()
                r[f != 0] = actual[f != 0]
                recorded.set(r)
    return True


# ------------------------------------------------------------------ seeds
def _fill(cache, seq_ids, counts, rng, token_ids=None) -> None:
    """Append ``counts`` tokens to ``seq_ids`` and store random K/V in every layer."""
    slots = cache.append(seq_ids, counts, token_ids)
    if slots is None or not slots.shape[-1]:  # [T], or [num_groups, T] with page groups
        return
    shape = (slots.shape[-1], cache.num_kv_heads, cache.head_dim)
    for layer in range(cache.num_layers):
        cache.store(layer, slots, rng.standard_normal(shape), rng.standard_normal(shape))


def _prompted(cache, seq_id, prompt, rng, extra_key=None) -> None:
    """Add ``seq_id`` with ``prompt`` (prefix caching) and append the rest of the prompt."""
    hit = cache.add_sequence(seq_id, prompt, extra_key) if cache.prefix_caching else cache.add_sequence(seq_id)
    rest = len(prompt) - hit
    while rest:  # in chunks, so that a window releases pages between appends
        step = min(rest, 3)
        _fill(cache, [seq_id], [step], rng)
        rest -= step


#: Seed cache configurations (keyword arguments of KVCache) and the script that fills each.
CACHE_CONFIGS = {
    "window-sinks-fork-f32": dict(num_layers=2, num_kv_heads=1, head_dim=2, num_pages=32, page_size=2, window=8,
                                  sink_tokens=3, enable_prefix_caching=True, dtype="float32", page_checksums=True),
    "full-prefix-f16": dict(num_layers=1, num_kv_heads=2, head_dim=2, num_pages=24, page_size=4,
                            enable_prefix_caching=True, dtype="float16"),
    "window1-sha256": dict(num_layers=1, num_kv_heads=1, head_dim=3, num_pages=48, page_size=1, window=5,
                           sink_tokens=2, enable_prefix_caching=True, prefix_hash="sha256", dtype="float16"),
    "window-nosink-checksums": dict(num_layers=2, num_kv_heads=1, head_dim=1, num_pages=16, page_size=4, window=6,
                                    dtype="float32", page_checksums=True),
    "no-layers-prefix": dict(num_layers=0, num_kv_heads=1, head_dim=1, num_pages=40, page_size=4,
                             enable_prefix_caching=True, dtype="float16"),
    "plain-f32": dict(num_layers=1, num_kv_heads=1, head_dim=4, num_pages=40, page_size=3, dtype="float32"),
    "empty": dict(num_layers=1, num_kv_heads=1, head_dim=1, num_pages=4, page_size=2, dtype="float16",
                  window=4, sink_tokens=1),
    "blocks-prefix-checksums": dict(num_layers=1, num_kv_heads=1, head_dim=2, num_pages=24, page_size=2,
                                    enable_prefix_caching=True, dtype="float32", page_checksums=True),
    # Encoded page formats: rows are bytes with their scale inside (int8: 2 + 4 bytes, int4: 2 + 4).
    "int8-window-sinks-prefix": dict(num_layers=2, num_kv_heads=1, head_dim=4, num_pages=32, page_size=2, window=8,
                                     sink_tokens=2, enable_prefix_caching=True, kv_dtype="int8",
                                     page_checksums=True),
    "int4-prefix": dict(num_layers=1, num_kv_heads=2, head_dim=8, num_pages=24, page_size=4,
                        enable_prefix_caching=True, kv_dtype="int4"),
    "bf16-window": dict(num_layers=1, num_kv_heads=1, head_dim=3, num_pages=24, page_size=2, window=6,
                        kv_dtype="bfloat16", page_checksums=True),
    # Per-layer attention: two sliding layers and one full layer form page groups (JSON-friendly settings,
    # turned into AttentionSetting by cache_kwargs).
    "hybrid-groups-prefix": dict(num_layers=3, num_kv_heads=1, head_dim=2, num_pages=128, page_size=2,
                                 enable_prefix_caching=True, dtype="float32", page_checksums=True,
                                 layer_attention=[{"window": 4}, {}, {"window": 4}]),
    "hybrid-sinks-chunks": dict(num_layers=2, num_kv_heads=1, head_dim=2, num_pages=96, page_size=2,
                                dtype="float16", layer_attention=[{"window": 6, "sink_tokens": 2},
                                                                  {"chunk_size": 4}]),
}


def cache_kwargs(config: dict) -> dict:
    """``KVCache`` keyword arguments of a ``CACHE_CONFIGS`` entry (``layer_attention`` dicts become
    ``AttentionSetting`` objects; a ``dtype`` name becomes a numpy dtype)."""
    from pagedkv import AttentionSetting
    kwargs = dict(config)
    if "layer_attention" in kwargs:
        kwargs["layer_attention"] = [AttentionSetting(**setting) for setting in kwargs["layer_attention"]]
    if "dtype" in kwargs:
        kwargs["dtype"] = np.dtype(kwargs["dtype"])
    return kwargs


#: The configurations of the seed files before the page-format and hybrid seeds joined: a case
#: recorded as (run, index) by those runs is replayed on their seeds only (the choice of a seed
#: depends on how many there are of its kind).
CONFIGS_BEFORE_FORMATS = ("window-sinks-fork-f32", "full-prefix-f16", "window1-sha256", "window-nosink-checksums",
                          "no-layers-prefix", "plain-f32", "empty", "blocks-prefix-checksums")


def seeds_before_formats(seeds: list[dict]) -> list[dict]:
    """The seeds of :func:`seed_files` that runs before the page-format seeds had, in their order."""
    return [s for s in seeds if s["kind"] == "classic" or s["name"].split("/")[0] in CONFIGS_BEFORE_FORMATS]


#: The salt (add_sequence's extra_key) of each salted sequence of the seed caches: sequence 1, its prefix
#: hit 3 and its fork 4, where the cache has prefix caching.
SALTS = {(name, seq_id): "tenant-a" for name, kwargs in CACHE_CONFIGS.items()
         if kwargs.get("enable_prefix_caching") and name != "blocks-prefix-checksums" for seq_id in (1, 3, 4)}


def make_cache(name: str):
    """A KVCache of configuration ``name`` filled by a fixed script (deterministic)."""
    from pagedkv import KVCache
    cache = KVCache(**cache_kwargs(CACHE_CONFIGS[name]))
    rng = np.random.default_rng(sum(map(ord, name)))
    if name == "empty":
        return cache
    if name == "blocks-prefix-checksums":
        cache.add_sequence(1, block_hashes=[11, 12, 13], block_tokens=4, num_prompt_tokens=12)
        _fill(cache, [1], [12], rng)
        cache.add_sequence(2, block_hashes=[11, 12, 99], block_tokens=4, num_prompt_tokens=12)
        _fill(cache, [2], [12 - cache.seq_len(2)], rng)
        cache.fork(1, 3)
        _fill(cache, [3], [3], rng)
        cache.seal()
        cache.remove_sequence(2)
        return cache
    prefix = cache.prefix_caching
    _prompted(cache, 1, PROMPTS[0], rng, "tenant-a" if prefix else None)
    _prompted(cache, 2, PROMPTS[1], rng)
    if prefix:
        _prompted(cache, 3, PROMPTS[0], rng, "tenant-a")  # a prefix hit on sequence 1's pages
    else:
        cache.add_sequence(3)
        _fill(cache, [3], [5], rng)
    cache.fork(1, 4)
    _fill(cache, [4, 1], [3, 1], rng)
    cache.add_sequence(5)
    tokens = PROMPTS[2][:9]
    for i in range(0, len(tokens), 3):
        _fill(cache, [5], [len(tokens[i:i + 3])], rng, tokens[i:i + 3] if prefix else None)
    cache.seal()
    cache.remove_sequence(2)  # its pages go back to the free queue, still findable by hash
    _fill(cache, [3], [2], rng)
    return cache


def make_classic(dtype: str):
    """A PagedKVCache with resident, partly filled and evicted pages."""
    from pagedkv import PagedKVCache
    cache = PagedKVCache(4, 3, page_size=4, dtype=np.dtype(dtype))
    rng = np.random.default_rng(7)
    for t in [0, 1, 2, 5, 9, 17, 18, 40, 41, 2**40, 3, 100]:
        cache.put(t, rng.standard_normal(3), rng.standard_normal(3))
    cache.get(1)
    cache.get(999)
    return cache


def seed_files(tmpdir) -> list[dict]:
    """Every seed: ``{"name", "kind", "data", "target", "extra_key"}`` (``target``: KVCache kwargs for
    imports; ``extra_key``: the salt an exported sequence was added with, which its import must name)."""
    import os
    seeds = []
    for name in CACHE_CONFIGS:
        cache = make_cache(name)
        path = os.path.join(tmpdir, f"seed-{name}.snap")
        cache.save(path)
        with open(path, "rb") as f:
            seeds.append({"name": name, "kind": "cache", "data": f.read(), "target": CACHE_CONFIGS[name],
                          "extra_key": None})
        for seq_id in (cache.seq_ids() if cache.num_groups == 1 else ()):  # no export with page groups
            seeds.append({"name": f"{name}/seq{seq_id}", "kind": "sequence", "data": cache.export_sequence(seq_id),
                          "target": CACHE_CONFIGS[name], "extra_key": SALTS.get((name, seq_id))})
        os.unlink(path)
    for dtype in ("float32", "float16", "float64"):
        path = os.path.join(tmpdir, f"seed-classic-{dtype}.snap")
        make_classic(dtype).save(path)
        with open(path, "rb") as f:
            seeds.append({"name": f"classic-{dtype}", "kind": "classic", "data": f.read(), "target": None,
                          "extra_key": None})
        os.unlink(path)
    return seeds


# --------------------------------------------------------------- mutations
def interesting(rng: random.Random, current: int, num_pages: int) -> int:
    """A value likely to hit a boundary: near 0, the pool size, int32 and int64 limits, or the current value."""
    choices = [0, 1, -1, 2, current + 1, current - 1, current + 2, current - 2, current * 2, current // 2,
               num_pages, num_pages - 1, num_pages + 1, 2**31 - 1, 2**31, -2**31, 2**32, 2**62, 2**62 + 1,
               2**63 - 1, 2**63 - 2, -2**63, 2**64 - 1, rng.randrange(-2**31, 2**31), rng.randrange(0, 64)]
    return rng.choice(choices)


def _fit(value: int, code: int) -> int:
    """``value`` wrapped into the range of dtype ``code`` (as a C cast would)."""
    bits = CODES[code].itemsize * 8
    value &= (1 << bits) - 1
    if code in (1, 2) and value >= 1 << (bits - 1):
        value -= 1 << bits
    return value


def _meta_sections(c: Container) -> list[Section]:
    return [s for s in c.sections if s.entries is not None]


def _num_pages(c: Container) -> int:
    checks = c.section("checksums")
    return len(checks.raw) // 8 if checks is not None else 8


def _arr(section: Section | None, name: str) -> tuple[Entry | None, np.ndarray | None]:
    e = section.entry(name) if section is not None else None
    return e, (e.array() if e is not None else None)


# Each mutation edits the container ``c`` in place and returns a short description, or None when it
# does not apply to this file (the caller then draws another).
def m_entry_value(c, rng):
    """One element (or scalar) of a named array set to a boundary value."""
    sections = [s for s in _meta_sections(c) if s.entries]
    if not sections:
        return None
    s = rng.choice(sections)
    e = rng.choice(s.entries)
    a = e.array()
    if a is None or a.size == 0:
        return None
    a = a.copy()
    flat = a.reshape(-1)
    i = rng.randrange(flat.size)
    value = _fit(interesting(rng, int(flat[i]), _num_pages(c)), e.code)
    flat[i] = value
    e.set(a)
    return f"{s.tag.decode()}.{e.name.decode()}[{i}] = {value}"


def m_entry_delta(c, rng):
    """One element moved by a small step (a count, length or id off by one or two)."""
    sections = [s for s in _meta_sections(c) if s.entries]
    if not sections:
        return None
    s = rng.choice(sections)
    e = rng.choice(s.entries)
    a = e.array()
    if a is None or a.size == 0 or e.code == 4 and s.tag == b"config":
        return None
    a = a.copy()
    flat = a.reshape(-1)
    i = rng.randrange(flat.size)
    delta = rng.choice([-2, -1, 1, 2, 3, -3, 4, 8])
    flat[i] = _fit(int(flat[i]) + delta, e.code)
    e.set(a)
    return f"{s.tag.decode()}.{e.name.decode()}[{i}] += {delta}"


def m_entry_permute(c, rng):
    """Two elements swapped, or one copied over another (duplicated ids, reordered queues)."""
    s = rng.choice(_meta_sections(c) or [None])
    if s is None or not s.entries:
        return None
    e = rng.choice(s.entries)
    a = e.array()
    if a is None or a.ndim == 0 or a.shape[0] < 2:
        return None
    a = a.copy()
    i, j = rng.sample(range(a.shape[0]), 2)
    if rng.random() < 0.5:
        a[[i, j]] = a[[j, i]]
        what = "swap"
    else:
        a[j] = a[i]
        what = "copy"
    e.set(a)
    return f"{s.tag.decode()}.{e.name.decode()} {what} rows {i},{j}"


def m_entry_shape(c, rng):
    """An array one row longer or shorter, flattened, reshaped, or its shape field alone changed."""
    s = rng.choice(_meta_sections(c) or [None])
    if s is None or not s.entries:
        return None
    e = rng.choice(s.entries)
    a = e.array()
    if a is None:
        return None
    choice = rng.randrange(5)
    if choice == 0 and a.ndim:
        e.set(a[:-1] if a.shape[0] else a)
        return f"{s.tag.decode()}.{e.name.decode()} drop last row"
    if choice == 1 and a.ndim:
        extra = a[-1:] if a.shape[0] else np.zeros((1,) + a.shape[1:], a.dtype)
        e.set(np.concatenate([a, extra]))
        return f"{s.tag.decode()}.{e.name.decode()} repeat last row"
    if choice == 2:
        e.set(a.reshape(-1) if a.ndim != 1 else a.reshape(1, -1))
        return f"{s.tag.decode()}.{e.name.decode()} reshape to {e.shape}"
    if choice == 3 and a.ndim:
        dim = rng.randrange(a.ndim)
        e.shape = list(e.shape)
        e.shape[dim] = interesting(rng, e.shape[dim], _num_pages(c)) & MASK64
        return f"{s.tag.decode()}.{e.name.decode()} shape[{dim}] = {e.shape[dim]} (bytes unchanged)"
    if choice == 4:
        e.set(np.asarray(a.reshape(-1)[0]) if a.size else np.asarray(0))
        return f"{s.tag.decode()}.{e.name.decode()} to a scalar"
    return None


def m_entry_dtype(c, rng):
    """An array written with another dtype code (values converted), or an unknown code."""
    s = rng.choice(_meta_sections(c) or [None])
    if s is None or not s.entries:
        return None
    e = rng.choice(s.entries)
    a = e.array()
    if a is None:
        return None
    if rng.random() < 0.15:
        e.code = rng.choice([0, 5, 255])
        return f"{s.tag.decode()}.{e.name.decode()} dtype code {e.code}"
    code = rng.choice([k for k in CODES if k != e.code])
    e.set(a.astype(np.int64), code)
    return f"{s.tag.decode()}.{e.name.decode()} as dtype code {code}"


def m_entry_list(c, rng):
    """An entry removed, duplicated, renamed to another entry's name, or a new unknown one added."""
    s = rng.choice(_meta_sections(c) or [None])
    if s is None or not s.entries:
        return None
    i = rng.randrange(len(s.entries))
    choice = rng.randrange(4)
    name = s.entries[i].name.decode()
    if choice == 0:
        del s.entries[i]
        return f"{s.tag.decode()}: drop {name}"
    if choice == 1:
        s.entries.insert(i, Entry(s.entries[i].name, s.entries[i].code, list(s.entries[i].shape), s.entries[i].raw))
        return f"{s.tag.decode()}: {name} twice"
    if choice == 2 and len(s.entries) > 1:
        j = rng.choice([k for k in range(len(s.entries)) if k != i])
        s.entries[i].name = s.entries[j].name
        return f"{s.tag.decode()}: {name} renamed {s.entries[j].name.decode()}"
    s.entries.append(Entry(b"unknown_entry", 2, [], struct.pack("<q", 5)))
    return f"{s.tag.decode()}: add unknown entry"


def m_section_list(c, rng):
    """A section dropped, duplicated or two sections swapped (the table is rebuilt consistently)."""
    i = rng.randrange(len(c.sections))
    choice = rng.randrange(3)
    tag = c.sections[i].tag.decode()
    if choice == 0:
        del c.sections[i]
        return f"drop section {tag}"
    if choice == 1:
        s = c.sections[i]
        c.sections.insert(i, Section(s.tag, [Entry(e.name, e.code, list(e.shape), e.raw) for e in s.entries]
                                     if s.entries is not None else None, s.raw))
        return f"section {tag} twice"
    j = rng.randrange(len(c.sections))
    c.sections[i], c.sections[j] = c.sections[j], c.sections[i]
    return f"swap sections {tag} and {c.sections[i].tag.decode()}"


def m_container_fields(c, rng):
    """Marker: a raw header or section-table field edit, applied after the build (see ``mutate``)."""
    return "raw"


def m_meta_bytes(c, rng):
    """Bytes of one metadata section flipped (its checksum recomputed): the entry decoder's own checks."""
    s = rng.choice(_meta_sections(c) or [None])
    if s is None:
        return None
    raw = bytearray(s.payload())
    if not raw:
        return None
    n = rng.choice([1, 1, 2, 4])
    for _ in range(n):
        raw[rng.randrange(len(raw))] ^= 1 << rng.randrange(8)
    s.entries, s.raw = None, bytes(raw)
    return f"{s.tag.decode()}: {n} bit flips"


def m_pages(c, rng):
    """Bytes flipped in the pages; page checksums recomputed (and the recorded seal checksums, or not)."""
    pages = c.section("pages")
    if pages is None or not pages.raw:
        return None
    raw = bytearray(pages.raw)
    for _ in range(rng.choice([1, 3])):
        raw[rng.randrange(len(raw))] ^= 1 << rng.randrange(8)
    pages.raw = bytes(raw)
    seals = rng.random() < 0.5
    if not recompute_page_checksums(c, seals):
        return None
    return f"page bytes flipped, checksums recomputed{' with the seal checksums' if seals else ''}"


def m_tables_length(c, rng):
    """A sequence's length moved (window geometry: the length of defect 1)."""
    e, fields = _arr(c.section("tables"), "fields")
    if fields is None or fields.ndim != 2 or not fields.shape[0] or fields.shape[1] < 1:
        return None
    fields = fields.copy()
    r = rng.randrange(fields.shape[0])
    page_size = _config_int(c, "page_size") or 1
    delta = rng.choice([1, 2, -1, -2, page_size, -page_size, 2 * page_size + 1])
    fields[r, 0] = _fit(int(fields[r, 0]) + delta, 2)
    e.set(fields)
    return f"tables.fields[{r}].length += {delta}"


def m_tables_ring(c, rng):
    """A ring field (sink_count, ring_first, ring_capacity) of one sequence changed."""
    e, fields = _arr(c.section("tables"), "fields")
    if fields is None or fields.ndim != 2 or not fields.shape[0] or fields.shape[1] < 4:
        return None
    fields = fields.copy()
    r = rng.randrange(fields.shape[0])
    col = rng.choice([1, 2, 3])
    value = int(fields[r, col])
    new = _fit(rng.choice([value + 1, value - 1, value * 2, value // 2, 0, 1, 2**16, 2**30, 2**62]), 2)
    fields[r, col] = new
    e.set(fields)
    return f"tables.fields[{r}][{('length', 'sink_count', 'ring_first', 'ring_capacity')[col]}] = {new}"


def _pool_arrays(c):
    pool = c.section("pool")
    return _arr(pool, "ref_counts"), _arr(pool, "free_queue")


def m_tables_add_page(c, rng):
    """A page added to a sequence's table with its ref count raised (and taken out of the free queue), so the
    pool stays consistent and only the table's geometry is wrong."""
    tables = c.section("tables")
    (fe, fields), (pe, pages) = _arr(tables, "fields"), _arr(tables, "pages")
    if fields is None or pages is None or fields.ndim != 2 or not fields.shape[0] or fields.shape[1] < 5:
        return None
    num_pages = _num_pages(c)
    fields, pages = fields.copy(), pages.copy()
    r = rng.randrange(fields.shape[0])
    start = int(fields[:r, 4].sum())
    at = start + rng.randint(0, int(fields[r, 4]))
    (re, refs), (qe, queue) = _pool_arrays(c)
    if queue is not None and queue.size and rng.random() < 0.7:
        page = int(queue[rng.randrange(queue.size)])
    else:
        page = rng.randrange(num_pages)
    pages = np.insert(pages, at, page)
    fields[r, 4] += 1
    if rng.random() < 0.5:
        fields[r, 0] = _fit(int(fields[r, 0]) + (_config_int(c, "page_size") or 1), 2)
    fe.set(fields)
    pe.set(pages)
    if refs is not None and 0 <= page < refs.size:
        refs = refs.copy()
        refs[page] += 1
        re.set(refs)
        if queue is not None:
            qe.set(queue[queue != page])
    return f"tables: sequence row {r} gets page {page} at {at - start}"


def m_tables_drop_page(c, rng):
    """A page removed from a sequence's table, its ref count lowered (and queued when it reaches 0)."""
    tables = c.section("tables")
    (fe, fields), (pe, pages) = _arr(tables, "fields"), _arr(tables, "pages")
    if fields is None or pages is None or fields.ndim != 2 or not pages.size or fields.shape[1] < 5:
        return None
    fields, pages = fields.copy(), pages.copy()
    rows = [r for r in range(fields.shape[0]) if fields[r, 4] > 0]
    if not rows:
        return None
    r = rng.choice(rows)
    start = int(fields[:r, 4].sum())
    at = start + rng.randrange(int(fields[r, 4]))
    page = int(pages[at])
    pages = np.delete(pages, at)
    fields[r, 4] -= 1
    fe.set(fields)
    pe.set(pages)
    (re, refs), (qe, queue) = _pool_arrays(c)
    if refs is not None and 0 <= page < refs.size:
        refs = refs.copy()
        refs[page] -= 1
        re.set(refs)
        if refs[page] == 0 and queue is not None:
            qe.set(np.append(queue, page).astype(np.int32))
    return f"tables: sequence row {r} loses page {page} at {at - start}"


def m_tables_swap_page(c, rng):
    """A table entry replaced by another page id (ref counts moved along), or by an out-of-range id."""
    tables = c.section("tables")
    pe, pages = _arr(tables, "pages")
    if pages is None or not pages.size:
        return None
    pages = pages.copy()
    i = rng.randrange(pages.size)
    old = int(pages[i])
    num_pages = _num_pages(c)
    new = rng.choice([rng.randrange(num_pages), rng.randrange(num_pages), -1, num_pages, 2**31 - 1])
    pages[i] = new
    pe.set(pages)
    (re, refs), (qe, queue) = _pool_arrays(c)
    if refs is not None and 0 <= new < refs.size and rng.random() < 0.8:
        refs = refs.copy()
        refs[old] -= 1
        refs[new] += 1
        re.set(refs)
        if queue is not None:
            queue = queue[queue != new]
            if refs[old] == 0:
                queue = np.append(queue, old)
            qe.set(queue.astype(np.int32))
    return f"tables.pages[{i}] {old} -> {new}"


def m_seq_ids(c, rng):
    """A sequence id changed: duplicated, negative, huge."""
    e, ids = _arr(c.section("tables"), "seq_ids")
    if ids is None or not ids.size:
        return None
    ids = ids.copy()
    i = rng.randrange(ids.size)
    ids[i] = rng.choice([int(ids[0]), -1, 2**63 - 1, -2**63, int(ids[i]) + 1000])
    e.set(ids)
    return f"tables.seq_ids[{i}] = {int(ids[i])}"


def m_pool(c, rng):
    """A ref count off by one, a page moved into or out of the free queue, or the queue reordered."""
    (re, refs), (qe, queue) = _pool_arrays(c)
    if refs is None or queue is None or not refs.size:
        return None
    choice = rng.randrange(4)
    if choice == 0:
        refs = refs.copy()
        p = rng.randrange(refs.size)
        refs[p] += rng.choice([1, -1, 2**31 - 1 - int(refs[p])])
        re.set(refs)
        return f"pool.ref_counts[{p}] = {int(refs[p])}"
    if choice == 1 and queue.size:
        p = int(queue[rng.randrange(queue.size)])
        qe.set(queue[queue != p])
        return f"pool: page {p} leaves the free queue"
    if choice == 2:
        p = rng.randrange(refs.size)
        qe.set(np.append(queue, p).astype(np.int32))
        return f"pool: page {p} queued"
    queue = queue.copy()
    random.Random(rng.random()).shuffle(queue)
    qe.set(queue)
    return "pool: free queue shuffled"


def m_prefix(c, rng):
    """The prefix index: a cached page's id, hash, kept tokens or flag changed, or a row dropped everywhere."""
    s = c.section("prefix")
    if s is None:
        return None
    (pe, pages), (he, hashes) = _arr(s, "pages"), _arr(s, "hashes")
    (te, tokens), (fe, flags) = _arr(s, "tokens"), _arr(s, "has_tokens")
    if pages is None or hashes is None or tokens is None or flags is None or not pages.size:
        return None
    i = rng.randrange(pages.size)
    choice = rng.randrange(5)
    if choice == 0:
        keep = np.arange(pages.size) != i
        pe.set(pages[keep]), he.set(hashes[keep]), te.set(tokens[keep]), fe.set(flags[keep])
        return f"prefix: cached row {i} dropped"
    if choice == 1:
        pages = pages.copy()
        pages[i] = rng.randrange(_num_pages(c))
        pages.sort()
        pe.set(pages)
        return f"prefix.pages[{i}] changed"
    if choice == 2 and pages.size > 1:
        hashes = hashes.copy()
        hashes[i] = hashes[(i + 1) % pages.size]
        he.set(hashes)
        return f"prefix.hashes[{i}] duplicates the next"
    if choice == 3:
        tokens = tokens.copy()
        tokens[i, rng.randrange(tokens.shape[1])] += 1
        te.set(tokens)
        return f"prefix.tokens[{i}] changed"
    flags = flags.copy()
    flags[i] ^= 1
    fe.set(flags)
    return f"prefix.has_tokens[{i}] flipped"


def m_hashes(c, rng):
    """A hash chain: a count changed with the arrays kept consistent, a chain entry or salt forged."""
    s = c.section("hashes")
    if s is None:
        return None
    (fe, fields), (ce, chain) = _arr(s, "fields"), _arr(s, "chain")
    (te, tokens), (se, salts) = _arr(s, "token_ids"), _arr(s, "salts")
    if fields is None or chain is None or tokens is None or salts is None or not fields.shape[0]:
        return None
    fields = fields.copy()
    r = rng.randrange(fields.shape[0])
    choice = rng.randrange(6)
    if choice == 0:  # one hash more or fewer in the chain of row r
        at = int(fields[:r, 1].sum()) + int(fields[r, 1])
        if rng.random() < 0.5 and fields[r, 1] > 0:
            ce.set(np.delete(chain, at - 1, axis=0))
            fields[r, 1] -= 1
        else:
            ce.set(np.insert(chain, at, [rng.getrandbits(64), rng.getrandbits(64)], axis=0).astype(np.uint64))
            fields[r, 1] += 1
        fe.set(fields)
        return f"hashes: chain of row {r} has {int(fields[r, 1])} entries"
    if choice == 1:  # kept token ids longer or shorter
        at = int(fields[:r, 2].sum()) + int(fields[r, 2])
        if rng.random() < 0.5 and fields[r, 2] > 0:
            te.set(np.delete(tokens, at - 1))
            fields[r, 2] -= 1
        else:
            te.set(np.insert(tokens, at, rng.randrange(1000)).astype(np.int32))
            fields[r, 2] += 1
        fe.set(fields)
        return f"hashes: row {r} keeps {int(fields[r, 2])} token ids"
    if choice == 2 and chain.size:
        chain = chain.copy()
        chain[rng.randrange(chain.shape[0]), rng.randrange(2)] ^= 1 << rng.randrange(64)
        ce.set(chain)
        return "hashes: a chain entry forged"
    if choice == 3:
        salts = salts.copy()
        salts[r, rng.randrange(2)] ^= 1
        se.set(salts)
        return f"hashes: salt of row {r} changed"
    if choice == 4:
        col = rng.randrange(4, fields.shape[1]) if fields.shape[1] > 4 else 0
        fields[r, col] = rng.choice([0, 1, int(fields[r, col]) + 1, int(fields[r, col]) - 1, 2**40, 2**62])
        fe.set(fields)
        return f"hashes.fields[{r}][{col}] = {int(fields[r, col])}"
    fields[r, 0] ^= 1
    fe.set(fields)
    return f"hashes: external flag of row {r} flipped"


def m_sealed(c, rng):
    """A seal flag flipped, a recorded page checksum forged (0, another page's), or the seal counter changed."""
    s = c.section("sealed")
    if s is None:
        return None
    (fe, flags), (ce, recorded), (ne, count) = _arr(s, "sealed"), _arr(s, "checksums"), _arr(s, "pages_sealed")
    choice = rng.randrange(3)
    if choice == 0 and recorded is not None and recorded.size:
        recorded = recorded.copy()
        sealed = np.flatnonzero(flags) if flags is not None and flags.shape == recorded.shape else []
        p = int(rng.choice(list(sealed))) if len(sealed) else rng.randrange(recorded.size)
        recorded[p] = rng.choice([0, int(recorded[(p + 1) % recorded.size]), int(recorded[p]) ^ 1])
        ce.set(recorded)
        return f"sealed.checksums[{p}] forged"
    if choice == 1 and flags is not None and flags.size:
        flags = flags.copy()
        p = rng.randrange(flags.size)
        flags[p] ^= 1
        fe.set(flags)
        if recorded is not None and recorded.shape == flags.shape and rng.random() < 0.7:
            # the recorded checksum made right for the new seal: only the seal's place is wrong
            checks = np.frombuffer(c.section("checksums").raw, dtype="<u8")
            if p < checks.size:
                recorded = recorded.copy()
                recorded[p] = checks[p] if flags[p] else 0
                ce.set(recorded)
                return f"sealed.sealed[{p}] flipped, its recorded checksum kept consistent"
        return f"sealed.sealed[{p}] flipped"
    if ne is not None:
        value = rng.choice([2**63 - 1, -1, 0, int(count) + 1])
        ne.set(np.asarray(value, dtype=np.int64))
        return f"sealed.pages_sealed = {value}"
    return None


def m_counters(c, rng):
    """A counter set near 2**63 (or negative): it must not wrap after a few more calls."""
    s = c.section("counters")
    if s is None or not s.entries:
        return None
    e = rng.choice(s.entries)
    a = e.array()
    if a is None:
        return None
    a = a.copy()
    value = rng.choice([2**63 - 1, 2**63 - 2, 2**63 - 100, 2**62, -1])
    if a.ndim == 0:
        a = np.asarray(value, dtype=a.dtype)
    elif a.size:
        a.reshape(-1)[rng.randrange(a.size)] = value
    else:
        return None
    e.set(a)
    return f"counters.{e.name.decode()} has {value}"


def _config_int(c, name):
    e, a = _arr(c.section("config"), name)
    return int(a) if a is not None and a.ndim == 0 else None


def m_config(c, rng):
    """A configuration value changed (window, sinks, page size, layers, dtype, flags); the page checksums are
    recomputed for the new geometry where it still describes the pages section."""
    s = c.section("config")
    if s is None or not s.entries:
        return None
    e = rng.choice(s.entries)
    name = e.name.decode()
    if e.code == 4:
        options = {"dtype": ["float16", "float32", "float64", "bfloat16", "int8", "int4"], "prefix_hash": ["sha256", "xxh3_128", "md5"]}
        value = rng.choice(options.get(name, ["x"]))
        e.set(np.frombuffer(value.encode(), dtype=np.uint8))
    else:
        a = e.array()
        if a is None or a.ndim:
            return None
        value = rng.choice([int(a) + 1, int(a) - 1, int(a) * 2, 0, 1, -1, 2**20, 2**31 - 2, 2**62])
        e.set(np.asarray(value, dtype=np.int64))
    recompute_page_checksums(c, seals=True)
    return f"config.{name} = {value!r}"


def m_classic_state(c, rng):
    """The classic cache's state: a resident page's logical page or id, the free queue, presence bits."""
    s = c.section("state")
    if s is None or not s.entries:
        return None
    e = rng.choice(s.entries)
    a = e.array()
    if a is None or not a.size:
        return None
    a = a.copy()
    flat = a.reshape(-1)
    i = rng.randrange(flat.size)
    if e.name == b"present":
        flat[i] = rng.choice([0, 1, 2])
    else:
        flat[i] = _fit(rng.choice([int(flat[i]) + 1, int(flat[i]) - 1, 0, -1, _num_pages(c),
                                   int(flat[(i + 1) % flat.size]), 2**62, 2**63 - 1]), e.code)
    e.set(a)
    return f"state.{e.name.decode()}[{i}] = {int(flat[i])}"


#: A request no seed cache made (a tenant's salt and content): after any load or import, prefix caching must
#: serve it nothing, whatever hashes the file claims (``fuzz_snapshots`` probes it).
VICTIM_SALT = "victim"
VICTIM_PROMPT = list(range(900, 964))
VICTIM_BLOCKS = [777, 778, 779]
_VICTIM_CHAINS: dict = {}


def victim_chains(c: Container) -> dict | None:
    """The hash chains (and token ids) of the victim's token prompt and block prompt under the prefix
    caching configuration of ``c``, from a scratch cache's exported sequences; None without prefix caching."""
    config = c.section("config")
    if config is None or config.entries is None:
        return None
    ints = {k: _config_int(c, k) for k in ("page_size", "window", "sink_tokens", "prefix_caching")}
    e = config.entry("prefix_hash")
    algorithm = e.raw.decode("ascii", "replace") if e is not None else None
    if None in ints.values() or not ints["prefix_caching"] or algorithm not in ("xxh3_128", "sha256"):
        return None
    if not 1 <= ints["page_size"] <= 64:  # a page size an earlier mutation made huge: no scratch cache for it
        return None
    key = (ints["page_size"], ints["window"], ints["sink_tokens"], algorithm)
    if key not in _VICTIM_CHAINS:
        from pagedkv import KVCache
        page_size = ints["page_size"]
        try:
            cache = KVCache(0, 1, 1, 512, page_size=page_size, window=None if ints["window"] == -1 else ints["window"],
                            sink_tokens=ints["sink_tokens"], enable_prefix_caching=True, prefix_hash=algorithm)
            cache.add_sequence(1, VICTIM_PROMPT, VICTIM_SALT)
            block_tokens = 2 * page_size
            cache.add_sequence(2, block_hashes=VICTIM_BLOCKS, block_tokens=block_tokens,
                               num_prompt_tokens=len(VICTIM_BLOCKS) * block_tokens, extra_key=VICTIM_SALT)
            for seq_id, total in ((1, len(VICTIM_PROMPT)), (2, len(VICTIM_BLOCKS) * block_tokens)):
                total -= cache.seq_len(seq_id)
                while total > 0:  # a page at a time, so that a window releases pages between appends
                    step = min(total, page_size)
                    cache.append([seq_id], [step], return_slot_mapping=False)
                    total -= step
            out = {}
            for seq_id, name in ((1, "tokens"), (2, "blocks")):
                hashes = parse(cache.export_sequence(seq_id)).section("hashes")
                out[name] = _arr(hashes, "chain")[1]
                out[name + "_ids"] = _arr(hashes, "token_ids")[1]
        except (ValueError, MemoryError):
            out = None
        _VICTIM_CHAINS[key] = out
    return _VICTIM_CHAINS[key]


def m_forge_chain(c, rng):
    """A sequence's hash chain replaced by the victim's hashes (its token ids too, or not), the prefix index's
    hashes of its pages with it: the file plants its K/V under another tenant's salted hashes."""
    s = c.section("hashes")
    victim = victim_chains(c)
    if s is None or victim is None:
        return None
    (_, fields), (ce, chain), (te, tokens) = _arr(s, "fields"), _arr(s, "chain"), _arr(s, "token_ids")
    if fields is None or chain is None or tokens is None or not fields.shape[0] or fields.shape[1] < 3:
        return None
    rows = [r for r in range(fields.shape[0]) if fields[r, 1] > 0]
    if not rows:
        return None
    r = rng.choice(rows)
    external = bool(fields[r, 0])
    forged = victim["blocks" if external else "tokens"]
    n = min(int(fields[r, 1]), forged.shape[0])
    start = int(fields[:r, 1].sum())
    old = chain[start:start + n].copy()
    chain = chain.copy()
    chain[start:start + n] = forged[:n]
    ce.set(chain)
    what = f"hashes: chain of row {r} forged to the victim's ({n} pages)"
    page_size = _config_int(c, "page_size") or 1
    if not external and rng.random() < 0.7:
        first = int(fields[:r, 2].sum())
        count = min(int(fields[r, 2]), n * page_size, victim["tokens_ids"].shape[0])
        tokens = tokens.copy()
        tokens[first:first + count] = victim["tokens_ids"][:count]
        te.set(tokens)
        what += ", with the victim's token ids"
    prefix = c.section("prefix")
    if prefix is not None:  # the index's entries of those pages: found by their old hash
        (_, pages), (he, hashes) = _arr(prefix, "pages"), _arr(prefix, "hashes")
        (ke, kept) = _arr(prefix, "tokens")
        if pages is not None and hashes is not None:
            hashes = hashes.copy()
            kept = kept.copy() if kept is not None else None
            for j in range(n):
                hit = np.flatnonzero((hashes == old[j]).all(axis=1))
                if hit.size:
                    hashes[hit[0]] = forged[j]
                    if kept is not None and not external and "token ids" in what and kept.shape[1] == page_size:
                        kept[hit[0]] = victim["tokens_ids"][j * page_size:(j + 1) * page_size]
            he.set(hashes)
            if kept is not None:
                ke.set(kept)
    return what


#: (mutation, weight): structural edits of the decoded sections first.
MUTATIONS = [
    (m_entry_value, 6), (m_entry_delta, 6), (m_entry_permute, 3), (m_entry_shape, 3), (m_entry_dtype, 2),
    (m_entry_list, 2), (m_section_list, 1), (m_container_fields, 2), (m_meta_bytes, 2), (m_pages, 2),
    (m_tables_length, 5), (m_tables_ring, 4), (m_tables_add_page, 4), (m_tables_drop_page, 3),
    (m_tables_swap_page, 3), (m_seq_ids, 1), (m_pool, 4), (m_prefix, 3), (m_hashes, 4), (m_sealed, 4),
    (m_counters, 3), (m_config, 3), (m_classic_state, 4), (m_forge_chain, 3),
]


def _raw_edit(data: bytes, c: Container, rng: random.Random) -> tuple[bytes, str]:
    """An edit of a header or section-table field of the built file (checksums recomputed)."""
    n = len(c.sections)
    choice = rng.randrange(4)
    if choice == 0:
        name = rng.choice(["version", "header_bytes", "num_sections", "zero", "file_length"])
        current = {"version": c.version, "header_bytes": 64, "num_sections": n, "zero": 0,
                   "file_length": len(data)}[name]
        value = rng.choice([current + 1, current - 1, 0, 2**32 - 1, current + 40, 2**63])
        return rewrite_fields(data, {("header", name): value}), f"header.{name} = {value}"
    i = rng.randrange(n)
    _, offset, length, _ = ENTRY.unpack_from(data, 64 + 40 * i)
    if choice == 1:
        value = rng.choice([offset + 8, offset - 8, offset + 1, 0, len(data), 2**64 - 8, offset + 4096])
        return rewrite_fields(data, {(i, "offset"): value}), f"table[{i}].offset = {value}"
    if choice == 2:
        value = rng.choice([length + 8, length - 8, 0, length + 1, 2**63, 2**64 - 1, len(data)])
        return rewrite_fields(data, {(i, "length"): value}), f"table[{i}].length = {value}"
    tag = rng.choice([b"pages", b"config", b"checksums", b"tables", b"bogus", b""])
    return rewrite_fields(data, {(i, "tag"): tag.ljust(16, b"\x00")}), f"table[{i}].tag = {tag!r}"


def mutate(data: bytes, rng: random.Random, count: int | None = None) -> tuple[bytes, list[str]]:
    """``data`` with ``count`` (default 1 to 3) structural mutations, all checksums recomputed.

    Returns the new bytes and a description of each mutation applied.
    """
    c = parse(data)
    count = count if count is not None else rng.choice([1, 1, 2, 3])
    funcs, weights = zip(*MUTATIONS)
    applied, raw_edits = [], 0
    for _ in range(count):
        for _attempt in range(20):  # (int64 edits wrap on purpose: np.errstate below)
            f = rng.choices(funcs, weights)[0]
            try:
                with np.errstate(all="ignore"):
                    what = f(c, rng)
            except (ValueError, IndexError, OverflowError, TypeError):
                what = None
            if what == "raw":
                raw_edits += 1
                break
            if what is not None:
                applied.append(what)
                break
    out = c.build()
    for _ in range(raw_edits):
        out, what = _raw_edit(out, c, rng)
        applied.append(what)
    return out, applied
