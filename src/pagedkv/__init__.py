"""pagedkv: a paged KV cache for transformer inference.

Public API
----------
PagePool
    Free-list page allocator with ref counts.
OutOfPagesError
    Raised when a pool cannot satisfy a call (subclass of MemoryError).
"""
from pagedkv_c._pool import OutOfPagesError, PagePool

__all__ = ["OutOfPagesError", "PagePool"]
__version__ = "0.1.0"
