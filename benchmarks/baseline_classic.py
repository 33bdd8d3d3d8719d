"""Pure-Python baseline of the classic paged KV store, for benchmarks.

The same algorithm and semantics as ``pagedkv.PagedKVCache``, written the
straightforward way: a ``dict`` page table (logical page -> page), a
``collections.deque`` of resident logical pages for FIFO eviction, and each
page a Python list of ``page_size`` slots holding ``(key, value)`` array pairs
or None. It validates what the semantics need (integer, non-negative token
index; 1-D key/value of length ``dim``) and copies on the way in and out, as
the compiled cache does, so that timings compare like with like.
"""
from collections import deque

import numpy as np


class BaselinePagedKVCache:
    """Token-indexed KV store with FIFO page eviction, in pure Python.

    Parameters
    ----------
    max_pages : int
        Page limit (in pages), >= 1.
    dim : int
        Length of each key and value vector (in elements), >= 1.
    page_size : int
        Tokens per page, >= 1.
    dtype : numpy dtype
        Element type keys and values are stored as.
    """

    def __init__(self, max_pages, dim, page_size=64, dtype=np.float32):
        if max_pages < 1 or dim < 1 or page_size < 1:
            raise ValueError("max_pages, dim and page_size must be >= 1")
        self.max_pages = max_pages
        self.dim = dim
        self.page_size = page_size
        self.dtype = np.dtype(dtype)
        self.page_table = {}       # logical page -> list of page_size slots
        self.fifo = deque()        # resident logical pages, oldest first
        self.evictions = 0
        self.num_tokens = 0

    def put(self, token_idx, key, value):
        """Store one token's key and value (copies), evicting the oldest page if needed."""
        if not isinstance(token_idx, int) or token_idx < 0:
            raise ValueError(f"token_idx must be a non-negative int, got {token_idx!r}")
        key = np.array(key, dtype=self.dtype)
        value = np.array(value, dtype=self.dtype)
        if key.shape != (self.dim,) or value.shape != (self.dim,):
            raise ValueError(f"key and value must have shape ({self.dim},)")
        logical_page, offset = divmod(token_idx, self.page_size)
        page = self.page_table.get(logical_page)
        if page is None:
            if len(self.fifo) == self.max_pages:
                oldest = self.fifo.popleft()
                evicted = self.page_table.pop(oldest)
                self.num_tokens -= sum(slot is not None for slot in evicted)
                self.evictions += 1
            page = [None] * self.page_size
            self.page_table[logical_page] = page
            self.fifo.append(logical_page)
        if page[offset] is None:
            self.num_tokens += 1
        page[offset] = (key, value)

    def get(self, token_idx):
        """Return fresh copies ``(key, value)`` of one token, or None if absent."""
        if not isinstance(token_idx, int) or token_idx < 0:
            raise ValueError(f"token_idx must be a non-negative int, got {token_idx!r}")
        logical_page, offset = divmod(token_idx, self.page_size)
        page = self.page_table.get(logical_page)
        if page is None:
            return None
        slot = page[offset]
        if slot is None:
            return None
        return slot[0].copy(), slot[1].copy()

    def put_many(self, token_idxs, keys, values):
        """Per-token loop of ``put`` (row ``i`` of keys/values belongs to ``token_idxs[i]``)."""
        for i, token_idx in enumerate(token_idxs):
            self.put(int(token_idx), keys[i], values[i])

    def get_many(self, token_idxs):
        """Per-token loop of ``get``, each result copied into its output row.

        Absent tokens get zero rows and ``present`` False.
        """
        n = len(token_idxs)
        keys = np.zeros((n, self.dim), dtype=self.dtype)
        values = np.zeros((n, self.dim), dtype=self.dtype)
        present = np.zeros(n, dtype=bool)
        get = self.get
        for i, token_idx in enumerate(token_idxs):
            found = get(int(token_idx))
            if found is not None:
                keys[i], values[i] = found
                present[i] = True
        return keys, values, present

    def get_many_inlined(self, token_idxs):
        """``get_many`` with the page-table lookup inlined and each row copied once.

        A stronger baseline than the loop of ``get``: it skips the call and
        the two intermediate arrays ``get`` allocates per token.
        """
        n = len(token_idxs)
        keys = np.zeros((n, self.dim), dtype=self.dtype)
        values = np.zeros((n, self.dim), dtype=self.dtype)
        present = np.zeros(n, dtype=bool)
        page_size = self.page_size
        for i, token_idx in enumerate(token_idxs):
            token_idx = int(token_idx)
            if token_idx < 0:
                raise ValueError(f"token_idxs[{i}] must be >= 0, got {token_idx}")
            page = self.page_table.get(token_idx // page_size)
            if page is not None:
                slot = page[token_idx % page_size]
                if slot is not None:
                    keys[i] = slot[0]
                    values[i] = slot[1]
                    present[i] = True
        return keys, values, present

    def __contains__(self, token_idx):
        return self.get(token_idx) is not None

    def __len__(self):
        return self.num_tokens

    def resident_pages(self):
        """Logical pages of the resident pages, oldest first."""
        return list(self.fifo)

    def clear(self):
        self.page_table.clear()
        self.fifo.clear()
        self.num_tokens = 0
