"""pagedkv: a paged KV cache for transformer inference.

Public API
----------
PagePool
    Free-list page allocator with ref counts.
OutOfPagesError
    Raised when a pool cannot satisfy a call (subclass of MemoryError).
PagedKVCache
    Classic single-stream KV store indexed by token, with FIFO page eviction.
"""
from pagedkv_c._classic import PagedKVCache
from pagedkv_c._pool import OutOfPagesError, PagePool

__all__ = ["OutOfPagesError", "PagePool", "PagedKVCache"]
__version__ = "0.1.0"
