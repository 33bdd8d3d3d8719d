"""pagedkv: a paged KV cache for transformer inference.

Public API
----------
KVCache
    Paged K/V storage for many sequences and layers (page tables, sliding
    window with attention sinks, copy-on-write forks, FlashInfer/vLLM exports).
PageTableView
    A batch of page tables in FlashInfer's CSR form (``KVCache.page_table``).
PagePool
    Free-list page allocator with ref counts.
OutOfPagesError
    Raised when a pool cannot satisfy a call (subclass of MemoryError).
PagedKVCache
    Classic single-stream KV store indexed by token, with FIFO page eviction.
attention
    Paged attention kernels (``decode``, ``prefill``, ``kernel_info``).
"""
from pagedkv_c._classic import PagedKVCache
from pagedkv_c._kv_cache import KVCache, PageTableView
from pagedkv_c._pool import OutOfPagesError, PagePool
from pagedkv import attention

__all__ = ["KVCache", "OutOfPagesError", "PagePool", "PageTableView", "PagedKVCache", "attention"]
__version__ = "0.1.0"
