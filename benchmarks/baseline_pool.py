"""Pure-Python baseline of the page allocator, for benchmarks.

The same contract as ``pagedkv.PagePool`` for ``allocate``/``free`` (least
recently freed first, all-or-nothing, freeing an unallocated or repeated page
is an error), written the straightforward way: a ``collections.deque`` free
queue and a list of ref counts.
"""
from collections import deque

import numpy as np


class BaselinePagePool:
    """Free-queue page allocator with ref counts, in pure Python.

    Parameters
    ----------
    num_pages : int
        Number of pages (ids ``0 .. num_pages-1``), >= 1.
    """

    def __init__(self, num_pages):
        if num_pages < 1:
            raise ValueError("num_pages must be >= 1")
        self.num_pages = num_pages
        self.free_queue = deque(range(num_pages))
        self.ref_count = [0] * num_pages

    def allocate(self, n):
        """Take ``n`` pages, least recently freed first; int32 array of shape (n,)."""
        if n > len(self.free_queue):
            raise MemoryError(f"cannot allocate {n} pages: only {len(self.free_queue)} are free")
        pop = self.free_queue.popleft
        ids = [pop() for _ in range(n)]
        for page_id in ids:
            self.ref_count[page_id] = 1
        return np.array(ids, dtype=np.int32)

    def free(self, page_ids):
        """Drop one reference to each page (validated first, all-or-nothing)."""
        ids = [int(p) for p in page_ids]
        if len(set(ids)) != len(ids):
            raise ValueError("a page is listed more than once")
        for page_id in ids:
            if not 0 <= page_id < self.num_pages or self.ref_count[page_id] == 0:
                raise ValueError(f"page {page_id} is not allocated")
        for page_id in ids:
            self.ref_count[page_id] -= 1
            if self.ref_count[page_id] == 0:
                self.free_queue.append(page_id)
