"""pagedkv: a paged KV cache for transformer inference.

Public API
----------
PagePool
    Free-list page allocator with ref counts.
OutOfPagesError
    Raised when a pool cannot satisfy a call (subclass of MemoryError).
attention
    Paged attention kernels (``decode``, ``prefill``, ``kernel_info``).
"""
from pagedkv_c._pool import OutOfPagesError, PagePool
from pagedkv import attention

__all__ = ["OutOfPagesError", "PagePool", "attention"]
__version__ = "0.1.0"
