"""pagedkv: a paged KV cache for transformer inference.

Public API
----------
KVCache
    Paged K/V storage for many sequences and layers (page tables, sliding
    window with attention sinks, copy-on-write forks, FlashInfer/vLLM exports).
AttentionSetting
    One layer's attention setting (full, sliding window with sinks, or
    chunks), for ``KVCache(..., layer_attention=...)`` (hybrid models).
PageTableView
    A batch of page tables in FlashInfer's CSR form (``KVCache.page_table``).
PageCheckReport, BadPage
    Result of ``KVCache.verify_pages`` (pages whose bytes changed since their seal).
PagePool
    Free-list page allocator with ref counts.
OutOfPagesError
    Raised when a pool cannot satisfy a call (subclass of MemoryError).
SnapshotError
    Raised when a snapshot file or exported sequence is damaged or of an
    unknown format (subclass of ValueError); see :mod:`pagedkv.snapshot`.
PagedKVCache
    Classic single-stream KV store indexed by token, with FIFO page eviction.
attention
    Paged attention kernels (``decode``, ``prefill``, ``kernel_info``).
openmp_enabled, build_info
    Whether the compiled core uses OpenMP (not in macOS wheels), and the
    other facts of its build.
"""
import os as _os
import sys as _sys

# Idle workers of the two thread pools a model alternates between sleep instead of spinning, so
# that they do not take the cores the other pool or other processes need (pagedkv.models.threads).
# Each runtime reads its variable once, when it loads: OpenMP when the compiled core below loads
# it, OpenBLAS when NumPy is first imported (so only if it has not been yet). Values the
# environment already sets are kept.
_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
if "numpy" not in _sys.modules:
    _os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")  # OpenBLAS's minimum: 2**4 cycles of spinning

from pagedkv_c._build_info import build_info, openmp_enabled
from pagedkv_c._classic import PagedKVCache
from pagedkv_c._kv_cache import AttentionSetting, BadPage, KVCache, PageCheckReport, PageTableView
from pagedkv_c._pool import OutOfPagesError, PagePool
from pagedkv import attention
from pagedkv.snapshot import SnapshotError

__all__ = ["AttentionSetting", "BadPage", "KVCache", "OutOfPagesError", "PageCheckReport", "PagePool", "PageTableView",
           "PagedKVCache", "SnapshotError", "attention", "build_info", "openmp_enabled"]
__version__ = "0.1.0"
