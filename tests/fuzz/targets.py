"""Fuzz targets of pagedkv's public API, driven by bytes (see fuzz_pagedkv.py).

Each input is a byte string that a ``FuzzedDataProvider`` turns into one
object under test (a ``KVCache`` with ``pagedkv.attention``, a
``PagedKVCache`` or a ``PagePool``) and a sequence of calls on it, with
arguments that range from valid to hostile (huge, negative and boundary
integers, wrong types, dtypes and shapes, repeated and unknown ids).

After every call:

* an expected exception (ValueError, TypeError, KeyError, IndexError,
  OutOfPagesError; RuntimeError where documented) must leave the observable
  state exactly as it was (a digest taken before the call is compared);
* ``check_invariants()`` must pass;
* the contents must equal a plain-Python reference model
  (``tests/reference_cache.py``), and attention must equal dense NumPy
  softmax attention over the keys the mask admits.

Anything else raises out of :func:`one_input`: a :class:`Finding`, an
unexpected exception, or (on the sanitizer build) a sanitizer report.
"""
import math
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # tests/, for reference_cache

import pagedkv  # noqa: E402
from pagedkv import KVCache, OutOfPagesError, PagedKVCache, PagePool  # noqa: E402
from reference_cache import OutOfPages, RefCache, RefClassicCache, RefPagePool  # noqa: E402
import reference_formats  # noqa: E402

EXPECTED = (ValueError, TypeError, KeyError, IndexError, OutOfPagesError)

# Integers that sit on the limits of the C types the core uses.
BOUNDARY_INTS = (
    0, 1, 2, 3, -1, -2, 7, 8, 15, 16, 17, 255, 256, 2**15, 2**16, 2**20,
    2**31 - 2, 2**31 - 1, 2**31, 2**32 - 1, 2**32, -2**31, -2**31 - 1,
    2**62, 2**63 - 1, 2**63, 2**64 - 1, 2**64, -2**63, -2**63 - 1, 10**30, -10**30,
)

# Sizes for hostile constructor calls: out of range, of the wrong type, or
# small. Valid but huge sizes are left out on purpose: they build pools of
# gigabytes, which is a resource limit, not a bug.
# Known bugs not fixed yet on this branch, each skipped by the exact input
# shape that reaches it, so that the fuzzer can look past them. TEMPORARY:
# delete an entry, and the code that consults it, once its fix is merged.

BAD_OR_SMALL_SIZES = (0, -1, -2**31, 2**31, 2**32, 2**63, 2**64, -2**63 - 1, 10**30, 1, 2, 3,
                      1.0, True, None, "1", np.uint64(2**64 - 1), np.int64(2), np.float64(3.0))


class Finding(AssertionError):
    """A contract violation found by the fuzzer (not an expected exception)."""


def check(condition, message):
    if not condition:
        raise Finding(message)


def plain_int(value):
    """``value`` as an int if the API accepts it as an integer (int or NumPy integer, not bool), else None."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        return None
    return int(value)


class Bytes:
    """Argument generator over atheris' FuzzedDataProvider."""

    def __init__(self, fdp):
        self.fdp = fdp

    def left(self):
        return self.fdp.remaining_bytes()

    def int_in(self, low, high):
        return self.fdp.ConsumeIntInRange(low, high)

    def flag(self, one_in=2):
        """True about once in ``one_in`` draws (never when out of bytes)."""
        return self.left() > 0 and self.int_in(0, one_in - 1) == 0

    def pick(self, options):
        return options[self.int_in(0, len(options) - 1)]

    def boundary_int(self):
        return self.pick(BOUNDARY_INTS)

    def hostile_int(self):
        """A value that is not a plain in-range int: a boundary int or another type."""
        kind = self.int_in(0, 9)
        if kind <= 5:
            return self.boundary_int()
        return self.pick([1.0, True, None, "1", np.int64(1), np.uint64(2**64 - 1), np.float32(2.0),
                          np.int32(-1), np.bool_(False), [1], (), b"\x01"])

    def int_or_hostile(self, low, high, hostile_one_in=12):
        return self.hostile_int() if self.flag(hostile_one_in) else self.int_in(low, high)

    def int_list(self, low, high, max_len):
        n = self.int_in(0, max_len)
        return [self.int_or_hostile(low, high, 40) for _ in range(n)]

    def as_array_like(self, values):
        """The same integers as a list, tuple or ndarray of some integer dtype."""
        kind = self.int_in(0, 5)
        if kind == 0:
            return tuple(values)
        if kind >= 3 and all(type(v) is int for v in values):
            dtype = self.pick([np.int64, np.int32, np.uint32, np.int16, np.uint64])
            try:
                return np.array(values, dtype=dtype)
            except OverflowError:
                return values
        return values

    def floats(self, shape, dtype):
        """Small values exactly representable in float16."""
        n = int(np.prod(shape))
        raw = self.fdp.ConsumeBytes(n)
        vals = np.frombuffer(raw + bytes(n - len(raw)), dtype=np.uint8).astype(np.float32)
        return ((vals % 33 - 16) / 8).reshape(shape).astype(dtype)


# ----------------------------------------------------------------- KVCache
class PrefixContent:
    """What every cached K/V row must hold, by the identity of its content.

    A row's content key is (layer, salt, its sequence's token keys up to and
    including its position): the K/V a model computes for a token depends on
    every earlier token. Tokens appended without known ids get a unique
    nonce, so their rows can match no other sequence's; block-keyed prompts
    use (block_tokens, chained block ids). Rows are stored with values
    derived from the key, so a page that prefix caching serves to the wrong
    request shows as a content mismatch.
    """

    def __init__(self):
        self.registry = {}
        self.nonces = 0

    def nonce(self):
        self.nonces += 1
        return ("nonce", self.nonces)

    def rows(self, keys, layer, heads, dim):
        """K and V rows (float32, shape [len(keys), heads, dim]) for these content keys."""
        ids = np.array([self.registry.setdefault((layer, key), len(self.registry)) for key in keys],
                       dtype=np.int64)
        lane = np.arange(heads * dim, dtype=np.int64)
        k = ((ids[:, None] * 31 + lane * 3 + layer * 7) % 61 - 30) / 16
        v = ((ids[:, None] * 17 + lane * 11 + layer * 5) % 53 - 26) / 8
        shape = (len(keys), heads, dim)
        return k.reshape(shape).astype(np.float32), v.reshape(shape).astype(np.float32)


class SeqModel:
    """Token identities of one sequence (see PrefixContent)."""

    def __init__(self, salt, prompt=None, blocks=None, nonce=None):
        self.salt = salt
        self.prompt = prompt  # token ids assumed for positions < len(prompt) unless replaced
        self.blocks = blocks  # (block_tokens, ids, num_prompt_tokens) for block-keyed prompts
        self.tokens = []  # one token key per position, the chain of content keys
        self.keys = []
        self.nonce = nonce

    def copy(self):
        other = SeqModel(self.salt, self.prompt, self.blocks, self.nonce)
        other.tokens = list(self.tokens)
        other.keys = list(self.keys)
        return other

    def truncate(self, new_len):
        del self.tokens[new_len:]
        del self.keys[new_len:]

    def extend(self, count, token_ids, content):
        for i in range(count):
            pos = len(self.tokens)
            if self.blocks is not None:
                block_tokens, ids, num_prompt = self.blocks
                if pos < num_prompt:
                    token = ("block", block_tokens, tuple(ids[:pos // block_tokens + 1]), pos)
                else:
                    token = content.nonce()
            elif token_ids is not None:
                token = ("token", int(token_ids[i]))
            elif self.prompt is not None and pos < len(self.prompt):
                token = ("token", int(self.prompt[pos]))
            else:
                token = content.nonce()
            self.tokens.append(token)
            previous = self.keys[-1] if self.keys else ("salt", self.salt, self.nonce)
            self.keys.append((previous, token))


def salt_key(extra_key):
    if extra_key is None:
        return None
    if isinstance(extra_key, (int, np.integer)):
        return ("int", int(extra_key))
    return (type(extra_key).__name__, extra_key)


def kv_digest(cache):
    """Everything observable about a KVCache, for 'nothing changed' checks."""
    ids = cache.seq_ids()
    view = cache.page_table(ids)
    stats = cache.stats()
    index = cache.prefix_index
    return (
        stats,
        cache.pool.free_pages().tolist(),
        [cache.pool.ref_count(p) for p in range(cache.num_pages)],
        ids,
        view.indptr.tolist(), view.indices.tolist(), view.page_positions.tolist(), view.seq_lens.tolist(),
        cache.kv.tobytes(),
        None if index is None else (index.cached_pages().tolist(),
                                    [index.page_hash(p) for p in range(cache.num_pages)]),
    )


class KVCacheProgram:
    """Drive one KVCache and the attention kernels with fuzzed calls."""

    def __init__(self, data):
        self.data = data
        d = data
        self.num_layers = d.int_in(0, 2)
        self.heads = d.int_in(1, 2)
        self.head_dim = d.int_in(1, 5)
        self.num_pages = d.int_in(1, 12)
        self.page_size = d.int_in(1, 5)
        self.kv_dtype = d.pick(["float16", "float32", "bfloat16", "int8", "int4"])
        # What store is given when the fuzzer casts first: the pool's own float dtype, else float32
        # (a float16 cast would round the rows before the format encodes them).
        self.dtype = np.dtype(self.kv_dtype) if self.kv_dtype in ("float16", "float32") else np.dtype(np.float32)
        self.window = None if d.flag(2) else (d.int_in(1, 12) if not d.flag(15) else
                                              d.pick([2**31 - 1, 2**31, 2**62 - 1, 2**62]))  # 2**62: the documented limit
        self.sinks = 0
        if self.window is not None:
            self.sinks = d.int_in(0, 6) if not d.flag(15) else d.pick([2**31 - 1, 2**31, 2**62])
        self.prefix = d.flag(2)
        self.prefix_hash = d.pick(["xxh3_128", "sha256"])
        self.cache = KVCache(self.num_layers, self.heads, self.head_dim, self.num_pages,
                             page_size=self.page_size, kv_dtype=self.kv_dtype, window=self.window,
                             sink_tokens=self.sinks, enable_prefix_caching=self.prefix,
                             prefix_hash=self.prefix_hash)
        # The paging reference does not model prefix hits: it runs without prefix caching only.
        self.ref = None if self.prefix else RefCache(self.num_pages, self.page_size, self.window, self.sinks)
        self.content = PrefixContent()
        self.seqs = {}
        self.last_append = {}
        self.next_id = 0

    # -- helpers
    def stored(self, rows):
        """What gather returns for float32 ``rows`` in this cache's page format (the NumPy reference)."""
        if self.kv_dtype in ("float16", "float32"):
            return rows.astype(self.kv_dtype)
        return reference_formats.decode(reference_formats.encode(rows, self.kv_dtype), self.kv_dtype,
                                        rows.shape[-1]).astype(np.float32)

    def rows_differ(self, got, want):
        """Per row: not equal (bit for bit; rotated formats within float32 rounding of the rotation)."""
        if self.kv_dtype in reference_formats.ROTATED and reference_formats.rotation_block(self.head_dim) > 1:
            close = np.isclose(got, want, rtol=0, atol=1e-5 * (1 + np.abs(want).max(initial=0)), equal_nan=True)
            return (~close).any(axis=(1, 2))
        return ((got != want) & ~(np.isnan(got) & np.isnan(want))).any(axis=(1, 2))

    def live(self):
        return sorted(self.seqs)

    def some_id(self):
        d = self.data
        if self.seqs and not d.flag(6):
            return d.pick(self.live())
        return d.int_or_hostile(-3, self.next_id + 2, 4)

    def id_list(self, unique):
        d = self.data
        live = self.live()
        if not live or d.flag(10):
            return d.as_array_like(d.int_list(-2, self.next_id + 2, 6))
        n = d.int_in(0, len(live) if unique else 2 * len(live) + 1)
        ids = []
        for _ in range(n):
            sid = d.pick(live)
            if unique and sid in ids:
                continue
            ids.append(sid)
        return d.as_array_like(ids)

    def call(self, fn, *args, allowed=EXPECTED, **kwargs):
        """Run one call; on an allowed exception check that nothing changed and return it."""
        before = kv_digest(self.cache)
        try:
            return fn(*args, **kwargs), None
        except allowed as exc:
            after = kv_digest(self.cache)
            check(after == before, f"{fn.__name__} raised {exc!r} but changed the cache state")
            return None, exc

    def store_all_layers(self, appended, slots):
        """Store the content-keyed K/V of the tokens just appended, in every layer."""
        keys = [self.seqs[sid].keys[pos] for sid, pos in appended]
        for layer in range(self.num_layers):
            k, v = self.content.rows(keys, layer, self.heads, self.head_dim)
            if self.data.flag(3):
                k, v = k.astype(self.dtype), v.astype(self.dtype)
            self.cache.store(layer, slots, k, v)

    # -- operations
    def op_add(self):
        d = self.data
        sid = self.next_id if not d.flag(8) else self.some_id()
        prompt = blocks = extra_key = None
        kwargs = {}
        if d.flag(3):
            extra_key = d.pick([None, 0, 1, "1", b"1", "tenant", np.int64(1), 2**63 - 1, -1, 1.5, True])
        if d.flag(2):
            prompt = d.int_list(-2, 6, 3 * self.page_size + 2)
            if d.flag(30):
                prompt.append(d.boundary_int())
            kwargs["prompt_token_ids"] = d.as_array_like(prompt)
        elif d.flag(3):
            block_tokens = self.page_size * d.int_in(1, 2) if not d.flag(10) else d.hostile_int()
            blocks = d.int_list(-1, 4, 4)
            if d.flag(20):
                blocks.append(d.boundary_int())
            kwargs["block_hashes"] = d.as_array_like(blocks)
            kwargs["block_tokens"] = block_tokens
            kwargs["num_prompt_tokens"] = d.int_or_hostile(0, len(blocks) * (block_tokens if type(block_tokens) is int and block_tokens > 0 else 1))
        result, exc = self.call(self.cache.add_sequence, sid, extra_key=extra_key, **kwargs)
        new_id = plain_int(sid)
        if exc is not None:
            check(kwargs or extra_key is not None or new_id is None or new_id in self.seqs
                  or not -2**63 <= new_id < 2**63, f"add_sequence({sid!r}) raised {exc!r}")
            return
        key = int(sid)
        check(key not in self.seqs, f"add_sequence accepted existing id {key}")
        model = SeqModel(salt_key(extra_key), nonce=None if self.prefix else self.content.nonce())
        if prompt is not None:
            model.prompt = [int(t) for t in prompt]
        if blocks is not None:
            model.blocks = (int(kwargs["block_tokens"]), [int(b) & (2**64 - 1) for b in blocks],
                            int(kwargs["num_prompt_tokens"]))
        cached = result
        check(cached == (0 if not self.prefix else cached), "add_sequence served tokens without prefix caching")
        check(cached % self.page_size == 0 and cached >= 0, f"add_sequence returned {cached} tokens served")
        if prompt is not None or blocks is not None:
            prompt_len = len(prompt) if prompt is not None else model.blocks[2]
            check(cached <= max(0, prompt_len - 1), f"served {cached} of a {prompt_len}-token prompt")
        model.extend(cached, None, self.content)
        self.seqs[key] = model
        self.last_append[key] = 0
        if self.ref is not None:
            self.ref.add(key)
        self.next_id = max(self.next_id, key + 1) if key < 2**40 else self.next_id

    def op_append(self):
        d = self.data
        ids = self.id_list(unique=not d.flag(12))
        ids_list = list(ids) if not isinstance(ids, list) else ids
        n = len(ids_list) if not d.flag(12) else d.int_in(0, len(ids_list) + 1)
        counts = [d.int_or_hostile(0, 2 * self.page_size + 2, 25) for _ in range(n)]
        token_ids = None
        if d.flag(3):
            total = min(sum(c for c in counts if type(c) is int), 4096)  # beyond the pool anyway
            token_ids = [d.int_in(-2, 6) for _ in range(total + (d.int_in(-1, 1) if d.flag(12) else 0))]
            if token_ids and d.flag(20):
                token_ids[d.int_in(0, len(token_ids) - 1)] = d.boundary_int()
        slots, exc = self.call(self.cache.append, ids, d.as_array_like(counts), token_ids)
        plain_ids = [plain_int(i) for i in ids_list]
        valid_ids = all(i is not None and i in self.seqs for i in plain_ids) and len(set(plain_ids)) == len(plain_ids)
        plain_counts = [plain_int(c) for c in counts]
        if None in plain_counts or any(c >= 2**63 for c in plain_counts):
            plain_counts = None
        if self.ref is not None and exc is not None and valid_ids and plain_counts is not None \
                and len(plain_counts) == len(ids_list) and all(c >= 0 for c in plain_counts) \
                and (token_ids is None or (len(token_ids) == sum(plain_counts)
                                           and all(-2**31 <= t < 2**31 for t in token_ids))):
            try:
                self.ref.append([int(i) for i in ids_list], plain_counts)
            except OutOfPages:
                check(isinstance(exc, OutOfPagesError), f"append raised {exc!r}, reference ran out of pages")
                return
            raise Finding(f"append raised {exc!r}; the reference accepts it")
        if exc is not None:
            return
        check(valid_ids and plain_counts is not None, f"append accepted ids {ids_list!r} counts {counts!r}")
        appended = []
        for sid, count in zip(ids_list, plain_counts):
            model = self.seqs[int(sid)]
            first = len(model.tokens)
            mine = token_ids[len(appended):len(appended) + count] if token_ids is not None else None
            model.extend(count, mine, self.content)
            appended += [(int(sid), p) for p in range(first, first + count)]
            if count:
                self.last_append[int(sid)] = count
        check(slots.shape == (len(appended),) and slots.dtype == np.int64, f"slot mapping {slots.shape} {slots.dtype}")
        if self.ref is not None:
            want = self.ref.append([int(i) for i in ids_list], plain_counts)
            check(want == appended, "append: reference appended other tokens")
        self.store_all_layers(appended, slots)
        if self.ref is not None:
            for layer in range(self.num_layers):
                k, v = self.content.rows([self.seqs[s].keys[p] for s, p in appended], layer, self.heads, self.head_dim)
                self.ref.store(layer, appended, self.stored(k), self.stored(v))

    def op_store_hostile(self):
        """A store that must be refused: bad layer, slots, shapes or dtypes."""
        d = self.data
        n = d.int_in(0, 4)
        layer = d.int_or_hostile(0, max(0, self.num_layers - 1), 3)
        slots = [d.int_in(-1, self.num_pages * self.page_size - 1) for _ in range(n)]
        kind = d.int_in(0, 5)
        shape = (n, self.heads, self.head_dim)
        k = np.zeros(shape, np.float32)
        v = np.zeros(shape, np.float32)
        if kind == 0:
            slots.append(d.pick([-2, self.num_pages * self.page_size, 2**62, -2**63]))
            k = np.zeros((n + 1, self.heads, self.head_dim), np.float32)
            v = k.copy()
        elif kind == 1:
            k = np.zeros((n, self.heads, self.head_dim + 1), np.float32)
        elif kind == 2:
            # The array rule: any real numbers convert; bools and complex numbers do not.
            v = np.zeros(shape, d.pick([np.complex64, np.bool_]))
        elif kind == 3:
            k = np.zeros((n + 1, self.heads), np.float32).tolist()  # a nesting of the wrong depth
        elif kind == 4:
            v = np.zeros((n + 1,) + shape[1:], np.float32)
        else:
            layer = d.pick([-1, self.num_layers, 2**31, 1.0])
        _, exc = self.call(self.cache.store, layer, d.as_array_like(slots), k, v)
        check(exc is not None, f"store accepted hostile input (kind {kind}, layer {layer!r})")

    def op_fork(self):
        d = self.data
        parent = self.some_id()
        child = self.next_id if not d.flag(6) else self.some_id()
        _, exc = self.call(self.cache.fork, parent, child)
        if exc is not None:
            return
        child = int(child)
        self.seqs[child] = self.seqs[int(parent)].copy()
        self.last_append[child] = self.last_append.get(int(parent), 0)
        if self.ref is not None:
            self.ref.fork(int(parent), child)
        self.next_id = max(self.next_id, child + 1) if child < 2**40 else self.next_id

    def op_truncate(self):
        d = self.data
        sid = self.some_id()
        key = plain_int(sid)
        length = len(self.seqs[key].tokens) if key in self.seqs else 4
        new_len = d.int_or_hostile(0, length + 1, 8)
        _, exc = self.call(self.cache.truncate, sid, new_len)
        known = key in self.seqs and plain_int(new_len) is not None
        sid, new_len = key, plain_int(new_len)
        if known and self.ref is not None and new_len < 2**63:
            allowed = self.ref.truncate_allowed(sid, new_len)
            check(allowed == (exc is None), f"truncate({sid}, {new_len}): reference allows={allowed}, got {exc!r}")
        if exc is not None:
            return
        check(known, f"truncate accepted {sid!r}, {new_len!r}")
        self.seqs[sid].truncate(new_len)
        self.last_append[sid] = 0
        if self.ref is not None:
            self.ref.truncate(sid, new_len)

    def op_remove(self):
        sid = self.some_id()
        _, exc = self.call(self.cache.remove_sequence, sid)
        if exc is not None:
            check(plain_int(sid) not in self.seqs, f"remove_sequence({sid!r}) raised {exc!r}")
            return
        del self.seqs[int(sid)]
        if self.ref is not None:
            self.ref.remove(int(sid))

    def op_page_table(self):
        d = self.data
        ids = self.id_list(unique=False)
        view, exc = self.call(self.cache.page_table, ids)
        if exc is None:
            pad = d.int_or_hostile(-1, 5, 6)
            self.call(view.block_tables, pad)
            tables, _ = self.call(view.block_tables)
            check(tables.shape[0] == view.batch_size, "block_tables rows")

    def op_pool(self):
        """The pool of a KVCache is read-only: mutators raise RuntimeError, readers work."""
        d = self.data
        pool = self.cache.pool
        which = d.int_in(0, 4)
        if which == 0:
            _, exc = self.call(pool.allocate, d.int_or_hostile(0, 3), allowed=EXPECTED + (RuntimeError,))
            check(exc is not None, "KVCache.pool.allocate was accepted")
        elif which == 1:
            _, exc = self.call(pool.free, d.int_list(0, self.num_pages, 3), allowed=EXPECTED + (RuntimeError,))
            check(exc is not None, "KVCache.pool.free was accepted")
        elif which == 2:
            _, exc = self.call(pool.incref, d.int_list(0, self.num_pages, 3), allowed=EXPECTED + (RuntimeError,))
            check(exc is not None, "KVCache.pool.incref was accepted")
        elif which == 3:
            self.call(pool.ref_count, d.int_or_hostile(0, self.num_pages - 1))
        else:
            check(pool.num_free == len(pool.free_pages()), "pool.num_free != len(free_pages())")

    def op_gather(self):
        layer = self.data.int_or_hostile(0, max(0, self.num_layers - 1), 6)
        self.call(self.cache.gather, layer, self.some_id())

    def op_misc(self):
        d = self.data
        sid = self.some_id()
        for fn in (self.cache.seq_len, self.cache.num_cached_tokens):
            value, exc = self.call(fn, sid)
            check((exc is None) == (plain_int(sid) in self.seqs), f"{fn.__name__}({sid!r}) raised {exc!r}")
            if exc is None:
                check(value == len(self.seqs[int(sid)].tokens) or fn.__name__ != "seq_len",
                      f"seq_len({sid}) = {value}, model {len(self.seqs[int(sid)].tokens)}")
        check((sid in self.cache) == (plain_int(sid) in self.seqs), f"__contains__({sid!r})")
        check(len(self.cache) == len(self.seqs), "len(cache)")

    # -- attention
    def attention_case(self, prefill):
        d = self.data
        ids = self.id_list(unique=not d.flag(10))
        group = d.int_in(1, 3)
        layer = d.int_or_hostile(0, max(0, self.num_layers - 1), 10)
        ids_list = list(ids)
        qo_lens = []
        if prefill:
            for sid in ids_list:
                most = self.last_append.get(sid, 0) if type(sid) is int else 1
                qo_lens.append(d.int_in(0, most + (1 if d.flag(10) else 0)))
            indptr = [0] + list(np.cumsum(qo_lens, dtype=np.int64).tolist()) if qo_lens else [0]
            if d.flag(15):
                indptr[d.int_in(0, len(indptr) - 1)] = d.boundary_int()
            num_q = indptr[-1] if qo_lens and 0 <= indptr[-1] < 10**4 else sum(qo_lens)
        else:
            num_q = len(ids_list)
        qshape = (num_q, self.heads * group, self.head_dim)
        q = d.floats(qshape, d.pick([np.float32, np.float16]))
        if d.flag(15):
            q = d.pick([q.astype(np.float64), q[..., :-1] if self.head_dim > 1 else q[:, :0], q.reshape(-1), q.tolist()])
        scale = None if d.flag(2) else d.pick([0.5, 1.0, -0.25, 2.0, float("nan"), float("inf"), 1e39, "x", 0])
        num_threads = None if d.flag(2) else d.int_or_hostile(1, 2, 8)
        return_lse = d.flag(2) if not d.flag(20) else 1
        args = (q, self.cache, layer, ids)
        if prefill:
            result, exc = self.call(pagedkv.attention.prefill, *args, d.as_array_like(indptr), scale, num_threads, return_lse)
        else:
            result, exc = self.call(pagedkv.attention.decode, *args, scale, num_threads, return_lse)
        if exc is not None or not isinstance(q, np.ndarray):
            return
        # The call succeeded: it must equal dense attention over the admitted keys.
        scale_value = 1 / math.sqrt(self.head_dim) if scale is None else float(scale)
        out, lse = result if return_lse else (result, None)
        if prefill:
            passed = [int(x) for x in indptr]
            check(passed[0] == 0 and all(b >= a for a, b in zip(passed, passed[1:])),
                  f"prefill accepted qo_indptr {passed}")
            qo_lens = [b - a for a, b in zip(passed, passed[1:])]
        check(out.shape == qshape and out.dtype == np.float32, f"attention output {out.shape} {out.dtype}")
        q64 = q.astype(np.float64)
        if self.kv_dtype == "int8" and pagedkv.attention.kernel_info()["int8_scores"] != "float32":
            q64 = reference_formats.quantize_query(q)  # the integer scores read the int8-rounded query
        row = 0
        for b, sid in enumerate(ids_list):
            length = len(self.seqs[int(sid)].tokens)
            count = qo_lens[b] if prefill else 1
            check(count <= length, f"attention accepted {count} queries for sequence {sid} of length {length}")
            keys, values, positions = self.cache.gather(layer, sid)
            for j in range(count):
                p = length - count + j
                mask = positions <= p
                if self.window is not None:
                    mask &= (positions >= p - self.window + 1) | (positions < self.sinks)
                needed = set(range(max(0, p - self.window + 1) if self.window else 0, p + 1))
                needed |= set(range(min(self.sinks, p + 1)))
                check(needed <= set(positions.tolist()),
                      f"attention ran for sequence {sid} query {p} without keys {sorted(needed - set(positions.tolist()))}")
                k = keys[mask].astype(np.float64)
                v = values[mask].astype(np.float64)
                kv_head = np.arange(self.heads * group) // group
                scores = scale_value * np.einsum("hd,khd->hk", q64[row], k[:, kv_head])
                top = scores.max(axis=1, keepdims=True)
                weights = np.exp(scores - top)
                total = weights.sum(axis=1, keepdims=True)
                want = np.einsum("hk,khd->hd", weights / total, v[:, kv_head])
                tol = 2e-3 * (1 + np.abs(v).max(initial=0))
                check(np.allclose(out[row], want, rtol=2e-3, atol=tol, equal_nan=True),
                      f"attention of sequence {sid} query {p}: max error {np.abs(out[row] - want).max()}")
                if lse is not None:
                    want_lse = (top + np.log(total))[:, 0]
                    check(np.allclose(lse[row], want_lse, rtol=2e-3, atol=2e-3, equal_nan=True),
                          f"attention LSE of sequence {sid} query {p}")
                row += 1

    def op_decode(self):
        self.attention_case(prefill=False)

    def op_prefill(self):
        self.attention_case(prefill=True)

    # -- checks after every call
    def verify(self):
        cache = self.cache
        cache.check_invariants()
        live = self.live()
        check(sorted(cache.seq_ids()) == live, f"seq_ids {sorted(cache.seq_ids())} != model {live}")
        ref = self.ref
        if ref is not None:
            stats = cache.stats()
            check(stats["pages_in_use"] == ref.pages_in_use, f"pages_in_use {stats['pages_in_use']} != {ref.pages_in_use}")
            check(stats["evictions"] == ref.evictions, "evictions differ from the reference")
            check(stats["cow_copies"] == ref.cow_copies, "cow_copies differ from the reference")
            for key in ("pages_allocated", "ring_reuses", "sequences_added", "tokens_appended", "pages_peak"):
                check(stats[key] == getattr(ref, key), f"{key} {stats[key]} != reference {getattr(ref, key)}")
        if not live:
            return
        view = cache.page_table(live)
        ps = self.page_size
        for b, sid in enumerate(live):
            model = self.seqs[sid]
            length = len(model.tokens)
            check(cache.seq_len(sid) == length, f"seq_len({sid}) = {cache.seq_len(sid)}, model {length}")
            check(view.last_page_len[b] == ((length - 1) % ps + 1 if length else 0), "last_page_len")
            if ref is not None:
                listed = (view.page_positions[view.indptr[b]:view.indptr[b + 1]] // ps).tolist()
                check(listed == sorted(ref.seqs[sid].pages), f"sequence {sid} lists pages {listed}, reference {sorted(ref.seqs[sid].pages)}")
            for layer in range(self.num_layers):
                keys, values, positions = cache.gather(layer, sid)
                if ref is not None:
                    check(positions.tolist() == ref.cached_positions(sid), f"sequence {sid}: cached positions differ")
                if not len(positions):
                    continue
                k, v = self.content.rows([model.keys[p] for p in positions.tolist()], layer, self.heads, self.head_dim)
                bad = np.flatnonzero(self.rows_differ(keys, self.stored(k)) | self.rows_differ(values, self.stored(v)))
                check(bad.size == 0, f"sequence {sid} layer {layer}: K/V at position "
                                     f"{positions[bad[0]] if bad.size else -1} is not what was stored for it")

    OPS = ("op_add", "op_append", "op_append", "op_fork", "op_truncate", "op_remove", "op_page_table",
           "op_gather", "op_misc", "op_pool", "op_store_hostile", "op_decode", "op_prefill")

    def run(self, max_ops):
        for _ in range(max_ops):
            if self.data.left() == 0:
                break
            getattr(self, self.data.pick(self.OPS))()
            self.verify()


# -------------------------------------------------------------- PagedKVCache
def classic_digest(cache, ref_tokens):
    tokens = sorted(set(ref_tokens) | {0, 1})
    keys, values, present = cache.get_many(tokens)
    return (len(cache), cache.resident_pages.tolist(), cache.evictions,
            keys.tobytes(), values.tobytes(), present.tolist())


def run_classic(data, max_ops):
    d = data
    max_pages, dim, page_size = d.int_in(1, 6), d.int_in(1, 4), d.int_in(1, 5)
    dtype = np.dtype(d.pick([np.float16, np.float32, np.float64]))
    cache = PagedKVCache(max_pages, dim, page_size=page_size, dtype=dtype)
    ref = RefClassicCache(max_pages, dim, page_size, dtype)
    base = d.pick([0, 0, 0, 2**31 - 8, 2**62, 2**63 - 1 - 4 * page_size])

    def token():
        if d.flag(10):
            return d.hostile_int()
        return base + d.int_in(0, 4 * page_size)

    def call(fn, *args):
        before = classic_digest(cache, ref.tokens())
        try:
            return fn(*args), None
        except EXPECTED as exc:
            check(classic_digest(cache, ref.tokens()) == before, f"{fn.__name__} raised {exc!r} but changed the cache")
            return None, exc

    def valid_token(t):
        return isinstance(t, (int, np.integer)) and not isinstance(t, (bool, np.bool_)) and 0 <= int(t) <= 2**63 - 1

    for _ in range(max_ops):
        if d.left() == 0:
            break
        op = d.int_in(0, 6)
        if op == 0:
            t = token()
            key, value = d.floats((dim,), np.float32), d.floats((dim,), np.float32)
            if d.flag(12):
                key = d.pick([key[:-1], key.astype(np.complex64), "k", None, np.stack([key, key])])
            _, exc = call(cache.put, t, key, value)
            if exc is None:
                check(valid_token(t) and isinstance(key, np.ndarray) and key.shape == (dim,), f"put accepted {t!r}")
                ref.put(int(t), key, value)
        elif op == 1:
            t = token()
            got, exc = call(cache.get, t)
            if exc is None:
                want = ref.get(int(t))
                check((got is None) == (want is None), f"get({t}) presence differs from the reference")
                if got is not None:
                    check(np.array_equal(got[0], want[0], equal_nan=True) and np.array_equal(got[1], want[1], equal_nan=True),
                          f"get({t}) differs from the reference")
        elif op == 2:
            n = d.int_in(0, 3 * page_size)
            tokens = [token() for _ in range(n)]
            keys, values = d.floats((n, dim), np.float32), d.floats((n, dim), np.float32)
            if d.flag(12):
                keys = d.pick([keys[:, :-1] if dim > 1 else keys[:0], keys.astype(np.complex64), keys.tolist(), "k"])
            _, exc = call(cache.put_many, d.as_array_like(tokens), keys, values)
            if exc is None:
                for i, t in enumerate(tokens):
                    ref.put(int(t), np.asarray(keys[i]), values[i])
        elif op == 3:
            tokens = [token() for _ in range(d.int_in(0, 3 * page_size))]
            got, exc = call(cache.get_many, d.as_array_like(tokens))
            if exc is None:
                keys, values, present = got
                for i, t in enumerate(tokens):
                    want = ref.get(int(t))
                    check(bool(present[i]) == (want is not None), f"get_many presence of {t}")
                    if want is not None:
                        check(np.array_equal(keys[i], want[0]) and np.array_equal(values[i], want[1]),
                              f"get_many({t}) differs from the reference")
        elif op == 4:
            t = token()
            try:
                present = t in cache
            except (TypeError, ValueError):  # documented for non-integers and negative indices
                check(not valid_token(t), f"{t!r} in cache raised")
            else:
                check(valid_token(t) and present == (ref.get(int(t)) is not None), f"{t!r} in cache")
        elif op == 5:
            if d.flag(4):
                cache.clear()
                ref.clear()
        else:
            check(cache.resident_pages.tolist() == ref.fifo, "resident_pages differ from the reference FIFO")
        cache.check_invariants()
        check(len(cache) == len(ref), f"len(cache) {len(cache)} != reference {len(ref)}")
        check(cache.evictions == ref.evictions, "evictions differ from the reference")
        check(cache.resident_pages.tolist() == ref.fifo, "resident pages differ from the reference FIFO")


# ------------------------------------------------------------------ PagePool
def run_pool(data, max_ops):
    d = data
    num_pages = d.int_in(1, 16)
    pool = PagePool(num_pages)
    ref = RefPagePool(num_pages)

    def digest():
        return pool.num_free, pool.free_pages().tolist(), [pool.ref_count(p) for p in range(num_pages)]

    def call(fn, *args):
        before = digest()
        try:
            return fn(*args), None
        except EXPECTED as exc:
            check(digest() == before, f"{fn.__name__} raised {exc!r} but changed the pool")
            return None, exc

    for _ in range(max_ops):
        if d.left() == 0:
            break
        op = d.int_in(0, 3)
        if op == 0:
            n = d.int_or_hostile(0, num_pages, 8)
            got, exc = call(pool.allocate, n)
            plain = type(n) is int or (isinstance(n, np.integer) and not isinstance(n, np.bool_))
            if exc is None:
                check(plain, f"allocate accepted {n!r}")
                check(got.tolist() == ref.allocate(int(n)), f"allocate({n}) gave {got.tolist()}, not least recently freed first")
            elif plain and 0 <= int(n) <= num_pages:
                check(isinstance(exc, OutOfPagesError) and int(n) > len(ref.free_queue), f"allocate({n}) raised {exc!r}")
        elif op in (1, 2):
            held = [p for p in range(num_pages) if ref.refs[p]]
            ids = [d.pick(held) if held and not d.flag(6) else d.int_or_hostile(-1, num_pages, 4)
                                       for _ in range(d.int_in(0, 4))]
            fn = pool.free if op == 1 else pool.incref
            _, exc = call(fn, d.as_array_like(ids))
            plain = [plain_int(i) for i in ids]
            ok = None not in plain and ref.valid(plain, op == 1)
            check(ok == (exc is None), f"{fn.__name__}({ids}): reference accepts={ok}, got {exc!r}")
            if exc is None:
                (ref.free if op == 1 else ref.incref)(plain)
        else:
            p = d.int_or_hostile(0, num_pages - 1, 6)
            got, exc = call(pool.ref_count, p)
            if exc is None:
                check(got == ref.refs[int(p)], f"ref_count({p})")
        pool.check_invariants()
        check(pool.free_pages().tolist() == ref.free_queue, "free queue differs from the reference")
        check([pool.ref_count(p) for p in range(num_pages)] == ref.refs, "ref counts differ from the reference")


# ------------------------------------------------------------ construction
def construct_hostile(data):
    """Constructors given hostile sizes must raise an expected error (or build a usable object)."""
    d = data
    which = d.int_in(0, 2)
    args = [d.pick(BAD_OR_SMALL_SIZES) for _ in range(5)]
    window = None if d.flag(2) else d.hostile_int()
    sink_tokens = d.int_or_hostile(0, 4, 2)
    try:
        if which == 0:
            obj = KVCache(args[0], args[1], args[2], args[3], page_size=args[4],
                          window=window,
                          sink_tokens=sink_tokens, dtype=d.pick([np.float16, np.float32, np.float64, None]))
        elif which == 1:
            obj = PagedKVCache(args[0], args[1], page_size=args[2], dtype=d.pick([np.float16, np.float64, np.int32, "f4"]))
        else:
            obj = PagePool(args[0])
    except EXPECTED + (MemoryError,):
        return
    obj.check_invariants()
    if which == 0:
        # Whatever the constructor accepted, the first calls must work or raise an expected error.
        obj.add_sequence(0)
        try:
            obj.append([0], [d.int_in(0, 8)])
        except OutOfPagesError:
            pass
        obj.page_table([0])
        obj.check_invariants()


def one_input(data_bytes):
    """Run the program that ``data_bytes`` encodes; raise on any finding."""
    import atheris
    data = Bytes(atheris.FuzzedDataProvider(data_bytes))
    target = data.int_in(0, 7)
    if target <= 4:
        KVCacheProgram(data).run(40)
    elif target == 5:
        run_classic(data, 60)
    elif target == 6:
        run_pool(data, 60)
    else:
        construct_hostile(data)
