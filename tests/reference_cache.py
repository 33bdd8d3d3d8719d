"""A plain-Python reference model of KVCache's paging, used as the test oracle.

It keeps, per sequence, which logical pages are held (as abstract page
objects shared by forks), and the K/V of every cached position per layer.
It follows the window, sink and release rules directly, without rings, free queues or
slot arithmetic:

* a sequence's position p lives in logical page p // page_size;
* an append of T >= 1 tokens at length n0 first releases every held logical
  page k whose positions are all < n0 - W + 1 and that holds no sink
  position (k * page_size >= S); a batch releases for all its sequences
  before any of them takes pages;
* then, sequence by sequence, a shared partial last page is copied, and new
  logical pages are taken; the call fails, changing nothing, if the pool's
  free pages plus the pages its releases free do not cover what it takes.

Sealed pages (KVCache.seal): a page is sealed at the start of an append
that adds tokens to a sequence holding it as a full page (k + 1) * page_size
<= length, by an explicit seal of such a sequence, and by its removal; it
stops being sealed when an append hands out slots in it again (a new page,
a copy-on-write copy, or a partial last page written in place).
"""
import itertools
import math

import numpy as np


class OutOfPages(Exception):
    pass


class RefSequence:
    def __init__(self):
        self.length = 0
        self.pages = {}  # logical page index -> abstract page id
        self.kv = {}  # position -> {layer: (k, v)}

    def copy(self):
        other = RefSequence()
        other.length = self.length
        other.pages = dict(self.pages)
        other.kv = {p: dict(layers) for p, layers in self.kv.items()}
        return other


class RefCache:
    def __init__(self, num_pages, page_size, window=None, sink_tokens=0):
        self.num_pages = num_pages
        self.page_size = page_size
        self.window = window
        self.sink_tokens = sink_tokens if window is not None else 0
        self.seqs = {}
        self.refs = {}  # abstract page id -> ref count
        self._ids = itertools.count()
        self.evictions = 0
        self.cow_copies = 0
        self.sealed = set()  # abstract page ids
        # Counters of KVCache.stats() for metrics.
        self.pages_allocated = 0  # pages taken from the free pool (new and copy-on-write pages)
        self.ring_reuses = 0  # released pages a sequence reused for its own new pages in the same append
        self.out_of_pages_errors = 0
        self.sequences_added = 0
        self.tokens_appended = 0
        self.pages_peak = 0

    # -- helpers
    def _new_page(self):
        page = next(self._ids)
        self.refs[page] = 1
        return page

    def _drop(self, page):
        self.refs[page] -= 1
        if self.refs[page] == 0:
            del self.refs[page]

    def _released_by(self, seq, num_new):
        if num_new == 0 or self.window is None:
            return []
        bound = seq.length - self.window + 1
        ps = self.page_size
        return sorted(
            k for k in seq.pages if (k + 1) * ps <= bound and k * ps >= self.sink_tokens
        )

    @property
    def pages_in_use(self):
        return len(self.refs)

    def cached_positions(self, seq_id):
        seq = self.seqs[seq_id]
        ps = self.page_size
        return [p for p in range(seq.length) if p // ps in seq.pages]

    # -- operations
    def add(self, seq_id):
        assert seq_id not in self.seqs
        self.seqs[seq_id] = RefSequence()
        self.sequences_added += 1

    def _seal_full_pages(self, seq):
        """Seal the sequence's held full pages; return the newly sealed abstract ids in logical order."""
        new = [page for k, page in sorted(seq.pages.items())
               if (k + 1) * self.page_size <= seq.length and page not in self.sealed]
        self.sealed.update(new)
        return new

    def seal(self, seq_ids=None):
        """KVCache.seal: the number of pages newly sealed."""
        ids = sorted(self.seqs) if seq_ids is None else seq_ids
        return sum(len(self._seal_full_pages(self.seqs[sid])) for sid in ids)

    def sealed_logical_pages(self, seq_id):
        """Logical pages of the sequence whose page is sealed (sorted)."""
        return sorted(k for k, page in self.seqs[seq_id].pages.items() if page in self.sealed)

    def remove(self, seq_id):
        self._seal_full_pages(self.seqs[seq_id])
        seq = self.seqs.pop(seq_id)
        for page in seq.pages.values():
            self._drop(page)

    def fork(self, parent, child):
        seq = self.seqs[parent].copy()
        for page in seq.pages.values():
            self.refs[page] += 1
        self.seqs[child] = seq
        self.sequences_added += 1

    def append(self, seq_ids, counts):
        """Return [(seq_id, position)] of the new tokens, or raise OutOfPages."""
        ps = self.page_size
        refs = dict(self.refs)
        free = self.num_pages - len(refs)
        releases = {}
        for sid, t in zip(seq_ids, counts):
            releases[sid] = self._released_by(self.seqs[sid], t)
            for k in releases[sid]:
                page = self.seqs[sid].pages[k]
                refs[page] -= 1
                if refs[page] == 0:
                    free += 1
        needed = 0
        copies = {}
        for sid, t in zip(seq_ids, counts):
            seq = self.seqs[sid]
            if t == 0:
                continue
            n0 = seq.length
            copies[sid] = False
            if n0 % ps:
                page = seq.pages[n0 // ps]
                if refs[page] > 1:
                    copies[sid] = True
                    refs[page] -= 1
                    needed += 1
            needed += math.ceil((n0 + t) / ps) - math.ceil(n0 / ps)
        if needed > free:
            self.out_of_pages_errors += 1
            raise OutOfPages(needed, free)
        # apply: the seal comes first, then releases, copies and new pages
        for sid, t in zip(seq_ids, counts):
            if t:
                self._seal_full_pages(self.seqs[sid])
        new_tokens = []
        freed_by = {}  # pages whose last reference a sequence's release dropped: it reuses them first
        for sid, t in zip(seq_ids, counts):
            seq = self.seqs[sid]
            freed_by[sid] = 0
            for k in releases[sid]:
                page = seq.pages.pop(k)
                self._drop(page)
                freed_by[sid] += page not in self.refs
                for p in range(k * ps, (k + 1) * ps):
                    seq.kv.pop(p, None)
                self.evictions += 1
        for sid, t in zip(seq_ids, counts):
            seq = self.seqs[sid]
            if t == 0:
                continue
            n0 = seq.length
            new_pages = int(copies[sid]) + math.ceil((n0 + t) / ps) - math.ceil(n0 / ps)
            reused = min(new_pages, freed_by[sid])
            self.ring_reuses += reused
            self.pages_allocated += new_pages - reused
            if copies[sid]:
                self._drop(seq.pages[n0 // ps])
                seq.pages[n0 // ps] = self._new_page()
                self.cow_copies += 1
            elif n0 % ps and n0 // ps in seq.pages:
                self.sealed.discard(seq.pages[n0 // ps])  # written in place again
            for k in range(math.ceil(n0 / ps), math.ceil((n0 + t) / ps)):
                seq.pages[k] = self._new_page()
            seq.length = n0 + t
            new_tokens += [(sid, p) for p in range(n0, n0 + t)]
        self.tokens_appended += sum(counts)
        self.pages_peak = max(self.pages_peak, self.pages_in_use)
        return new_tokens

    def truncate_allowed(self, seq_id, new_len):
        seq = self.seqs[seq_id]
        if not 0 <= new_len <= seq.length:
            return False
        if new_len == 0 or self.window is None:
            return True
        lo = max(0, new_len - self.window + 1)
        if not all(p // self.page_size in seq.pages for p in range(lo, new_len)):
            return False
        # The ring never moves back onto a released page: below the first held
        # window page, only lengths inside the sink pages are allowed (this
        # matters for window 1, whose next query needs no cached key).
        ps = self.page_size
        sink_end = -(-self.sink_tokens // ps) * ps
        window_pages = [k for k in seq.pages if k * ps >= sink_end]
        if new_len <= sink_end or not window_pages:
            return True
        ring_first = min(window_pages)
        return ring_first * ps <= sink_end or new_len >= ring_first * ps + self.window - 1

    def truncate(self, seq_id, new_len):
        seq = self.seqs[seq_id]
        keep = math.ceil(new_len / self.page_size)
        for k in sorted(seq.pages, reverse=True):
            if k >= keep:
                self._drop(seq.pages.pop(k))
        for p in list(seq.kv):
            if p >= new_len:
                del seq.kv[p]
        seq.length = new_len

    def store(self, layer, tokens, k, v):
        for (sid, pos), key, value in zip(tokens, k, v):
            self.seqs[sid].kv.setdefault(pos, {})[layer] = (key.copy(), value.copy())


class RefClassicCache:
    """The classic single-stream cache (``PagedKVCache``) in plain Python.

    A dict of logical pages and a FIFO list of resident logical pages, oldest
    first: a put into a page that is not resident, with ``max_pages``
    resident, evicts the oldest page and all of its tokens.

    Each page is a dict offset -> (key, value); keys and values are stored as
    arrays of the cache dtype, as ``numpy.array(x, dtype)`` casts them.
    """

    def __init__(self, max_pages, dim, page_size, dtype):
        self.max_pages, self.dim, self.page_size = max_pages, dim, page_size
        self.dtype = np.dtype(dtype)
        self.pages = {}
        self.fifo = []  # logical pages, oldest first
        self.evictions = 0
        self.hits = 0  # lookups by get/get_many that found the token (counted by the caller)
        self.misses = 0

    def put(self, token, key, value):
        logical_page, offset = divmod(token, self.page_size)
        if logical_page not in self.pages:
            if len(self.fifo) == self.max_pages:
                del self.pages[self.fifo.pop(0)]
                self.evictions += 1
            self.pages[logical_page] = {}
            self.fifo.append(logical_page)
        self.pages[logical_page][offset] = (
            np.array(key, dtype=self.dtype),
            np.array(value, dtype=self.dtype),
        )

    def get(self, token):
        logical_page, offset = divmod(token, self.page_size)
        return self.pages.get(logical_page, {}).get(offset)

    def lookup(self, token):
        """``get`` that counts a hit or a miss, as the cache's get and get_many do."""
        found = self.get(token)
        if found is None:
            self.misses += 1
        else:
            self.hits += 1
        return found

    def clear(self):
        self.pages.clear()
        self.fifo.clear()

    def tokens(self):
        """Present token indices, ascending."""
        return sorted(page * self.page_size + offset for page, slots in self.pages.items() for offset in slots)

    def __len__(self):
        return sum(len(page) for page in self.pages.values())


class RefPagePool:
    """PagePool in plain Python: ref counts and a FIFO free queue (least recently freed first)."""

    def __init__(self, num_pages):
        self.num_pages = num_pages
        self.refs = [0] * num_pages
        self.free_queue = list(range(num_pages))

    def allocate(self, n):
        if n > len(self.free_queue):
            raise OutOfPages(n, len(self.free_queue))
        taken, self.free_queue = self.free_queue[:n], self.free_queue[n:]
        for page in taken:
            self.refs[page] = 1
        return taken

    def valid(self, ids, forbid_duplicates):
        """Whether ``free`` (forbid_duplicates) or ``incref`` accepts these page ids."""
        if any(not 0 <= p < self.num_pages or self.refs[p] == 0 for p in ids):
            return False
        return not forbid_duplicates or len(set(ids)) == len(ids)

    def free(self, ids):
        for page in ids:
            self.refs[page] -= 1
            if self.refs[page] == 0:
                self.free_queue.append(page)

    def incref(self, ids):
        for page in ids:
            self.refs[page] += 1


class RefSealedPages:
    """The seal rule of KVCache over physical page ids, driven by observed page tables.

    Where the abstract RefCache cannot follow the pages (prefix-cache hits
    start a sequence on pages other sequences filled), this model takes the
    page tables observed around each call (``{seq_id: ({logical page: page
    id}, length)}``) and applies the seal rule of the module docstring to
    them: which pages each call seals, in which order, and which it unseals.
    """

    def __init__(self, page_size):
        self.page_size = page_size
        self.sealed = set()

    def _seal(self, held, length, order):
        for k in sorted(held):
            page = held[k]
            if (k + 1) * self.page_size <= length and page not in self.sealed:
                self.sealed.add(page)
                order.append(page)

    def seal(self, observed):
        """An explicit seal of the observed sequences; the pages newly sealed, in seal order."""
        order = []
        for held, length in observed:
            self._seal(held, length, order)
        return order

    def append(self, before, after, counts):
        """A successful append: ``before``/``after`` observed per listed sequence, in call order."""
        order = []
        for (held, length), t in zip(before, counts):
            if t:
                self._seal(held, length, order)
        ps = self.page_size
        for (held_before, n0), (held, length), t in zip(before, after, counts):
            if t:
                for k in range(n0 // ps, -(-length // ps)):
                    if k in held:
                        self.sealed.discard(held[k])
        return order
