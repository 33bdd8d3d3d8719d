"""A small NumPy stand-in for the attention contract of ``pagedkv.KVCache``.

Test and benchmark helper only. It exposes exactly what the attention kernels
read from a cache, with the same names and types as ``pagedkv.KVCache``:

- ``kv``: C-contiguous pool ``(num_layers, num_pages, 2, page_size,
  num_kv_heads, head_dim)``, float16 or float32, K at index 0 of axis 2;
- ``num_layers``, ``num_kv_heads``, ``head_dim``, ``page_size``, ``window``
  (int or None), ``sink_tokens``, ``chunk_size`` (int or None: chunked
  attention, never with a window);
- ``page_table(seq_ids)`` -> view with ``indptr`` int32[B+1], ``indices``
  int32[nnz], ``last_page_len`` int32[B], ``page_positions`` int64[nnz],
  ``seq_lens`` int64[B]; unknown id -> KeyError;
- ``gather(layer, seq_id)`` -> ``(k[n, Hkv, D], v[n, Hkv, D], positions
  int64[n])`` of the cached tokens in position order.

Sequences are built whole rather than appended token by token: a sequence of
``length`` tokens holds its sink pages plus every page from the one holding
position ``hold_from`` to its last page, like a windowed sequence whose old
pages were released. Page ids come from a shuffled free list, the whole pool
starts filled with random numbers (so unwritten slots and pages that belong to
nobody hold garbage, not zeros), and ``fork`` shares the parent's pages with
the child, copying only the partly filled page that the child writes into.
"""
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class FakePageTableView:
    """FlashInfer CSR page table of a batch plus the first position of each page."""

    indptr: np.ndarray  # int32 [B + 1]
    indices: np.ndarray  # int32 [nnz]
    last_page_len: np.ndarray  # int32 [B]
    page_positions: np.ndarray  # int64 [nnz]
    seq_lens: np.ndarray  # int64 [B]


class FakeCache:
    """Pool plus per-sequence page lists; see the module docstring."""

    def __init__(self, num_layers, num_kv_heads, head_dim, num_pages, page_size=16,
                 dtype=np.float16, window=None, sink_tokens=0, seed=0, chunk_size=None):
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.page_size = page_size
        self.window = window
        self.sink_tokens = sink_tokens
        self.chunk_size = chunk_size
        self._rng = np.random.default_rng(seed)
        shape = (num_layers, num_pages, 2, page_size, num_kv_heads, head_dim)
        self.kv = self._rng.standard_normal(shape, dtype=np.float32).astype(dtype)
        self._free = [int(p) for p in self._rng.permutation(num_pages)]
        self._seqs = {}  # seq_id -> (length, {logical page index: page id})
        self._lists = {}  # id(page dict) -> (page dict, page ids, positions)

    # -- building sequences (test side only) ---------------------------------
    def _take_page(self):
        if not self._free:
            raise MemoryError("fake cache: pool exhausted")
        return self._free.pop()

    def _held_logical_pages(self, length, hold_from):
        """Logical pages a sequence of ``length`` tokens keeps: sinks + [hold_from page, last]."""
        if length == 0:
            return []
        ps = self.page_size
        last = (length - 1) // ps
        if hold_from is None:
            if self.window is not None:
                hold_from = max(0, length - self.window)
            elif self.chunk_size is not None:
                hold_from = (length - 1) - (length - 1) % self.chunk_size
            else:
                hold_from = 0
        first = min(max(0, hold_from) // ps, last)
        sinks = range((self.sink_tokens + ps - 1) // ps) if self.window is not None else range(0)
        return sorted(set(i for i in sinks if i <= last) | set(range(first, last + 1)))

    def add_sequence(self, seq_id, length, hold_from=None):
        """Add a sequence of ``length`` random tokens.

        ``hold_from``: first position whose page must still be held (default:
        what a decode query needs, ``length - window``, or the start of the
        last token's chunk; 0 without a window or chunks).
        """
        if seq_id in self._seqs:
            raise ValueError(f"duplicate seq id {seq_id!r}")
        pages = {i: self._take_page() for i in self._held_logical_pages(length, hold_from)}
        self._seqs[seq_id] = (length, pages)

    def fork(self, parent_id, child_id, extra_tokens, hold_from=None):
        """Add ``child_id`` = the parent's tokens plus ``extra_tokens`` new ones.

        Pages the child still needs are shared with the parent (same page id),
        except the parent's partly filled last page when the child writes into
        it: that page is copied (copy-on-write) and the copy gets new data in
        the slots past the parent's length.
        """
        parent_len, parent_pages = self._seqs[parent_id]
        if child_id in self._seqs:
            raise ValueError(f"duplicate seq id {child_id!r}")
        length = parent_len + extra_tokens
        ps = self.page_size
        pages = {}
        for i in self._held_logical_pages(length, hold_from):
            shared = parent_pages.get(i)
            page_end = (i + 1) * ps
            if shared is not None and (page_end <= parent_len or extra_tokens == 0):
                pages[i] = shared
            elif shared is not None:
                copy = self._take_page()
                self.kv[:, copy] = self.kv[:, shared]
                fresh_from = parent_len - i * ps
                noise = self._rng.standard_normal(self.kv[:, copy, :, fresh_from:].shape)
                self.kv[:, copy, :, fresh_from:] = noise.astype(self.kv.dtype)
                pages[i] = copy
            else:
                pages[i] = self._take_page()
        self._seqs[child_id] = (length, pages)

    # -- the KVCache contract ------------------------------------------------
    def seq_len(self, seq_id):
        return self._seqs[seq_id][0]

    def page_table(self, seq_ids):
        entries = [self._seqs[s] for s in seq_ids]  # KeyError for an unknown id
        ps = self.page_size
        lists = [self._page_list(pages) for _, pages in entries]
        counts = np.array([len(ids) for ids, _ in lists], dtype=np.int64)
        indptr = np.zeros(len(entries) + 1, dtype=np.int32)
        indptr[1:] = np.cumsum(counts)
        seq_lens = np.array([length for length, _ in entries], dtype=np.int64)
        last_page_len = np.where(seq_lens > 0, (seq_lens - 1) % ps + 1, 0).astype(np.int32)
        return FakePageTableView(
            indptr=indptr,
            indices=np.concatenate([ids for ids, _ in lists] + [np.zeros(0, np.int32)]),
            last_page_len=last_page_len,
            page_positions=np.concatenate([pos for _, pos in lists] + [np.zeros(0, np.int64)]),
            seq_lens=seq_lens,
        )

    def _page_list(self, pages):
        """(page ids int32, first positions int64) in position order, memoised per sequence."""
        key = id(pages)
        cached = self._lists.get(key)
        if cached is None or cached[0] is not pages:
            logical = np.array(sorted(pages), dtype=np.int64)
            ids = np.array([pages[i] for i in logical.tolist()], dtype=np.int32)
            cached = (pages, ids, logical * self.page_size)
            self._lists[key] = cached
        return cached[1], cached[2]

    def gather(self, layer, seq_id):
        length, pages = self._seqs[seq_id]
        ps = self.page_size
        ks, vs, pos = [], [], []
        for i in sorted(pages):
            n = min(ps, length - i * ps)
            ks.append(self.kv[layer, pages[i], 0, :n])
            vs.append(self.kv[layer, pages[i], 1, :n])
            pos.append(np.arange(i * ps, i * ps + n, dtype=np.int64))
        shape = (0, self.num_kv_heads, self.head_dim)
        if not ks:
            return np.zeros(shape, self.kv.dtype), np.zeros(shape, self.kv.dtype), np.zeros(0, np.int64)
        return np.concatenate(ks), np.concatenate(vs), np.concatenate(pos)
