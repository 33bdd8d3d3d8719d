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
openmp_enabled, build_info
    Whether the compiled core uses OpenMP (not in macOS wheels), and the
    other facts of its build.
"""
import os as _os

# Idle OpenMP workers of the attention kernels sleep instead of spinning, so that they do not
# take the cores that NumPy's BLAS threads or other processes need (pagedkv.models.threads).
# The OpenMP runtime reads the variable once, when the compiled core below loads it; a value
# the environment already sets is kept.
_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from pagedkv_c._build_info import build_info, openmp_enabled
from pagedkv_c._classic import PagedKVCache
from pagedkv_c._kv_cache import KVCache, PageTableView
from pagedkv_c._pool import OutOfPagesError, PagePool
from pagedkv import attention

__all__ = ["KVCache", "OutOfPagesError", "PagePool", "PageTableView", "PagedKVCache", "attention",
           "build_info", "openmp_enabled"]
__version__ = "0.1.0"
