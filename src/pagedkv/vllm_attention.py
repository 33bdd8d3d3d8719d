"""pagedkv's paged attention as vLLM's attention backend on the CPU.

:class:`PagedAttentionBackend` replaces vLLM's native CPU attention (``CPU_ATTN``) when
``PAGEDKV_VLLM_ATTENTION=1`` is set in the environment of the process that creates the
``LLM`` (vLLM's engine and worker processes inherit it; the ``vllm.general_plugins`` entry
point of the ``pagedkv`` distribution registers the override, see :mod:`pagedkv._vllm_plugin`).
It is re-exported as ``pagedkv.vllm.PagedAttentionBackend``.

Layout. vLLM hands each layer one tensor of logical shape ``(num_blocks, num_kv_heads,
block_size, 2 * head_dim)`` in its ``LBHNC`` layout, every block one contiguous run of
bytes. This backend reads each block as pagedkv's page, ``(2, block_size, num_kv_heads,
head_dim)`` (K then V, token-major), so the layer tensor viewed as ``(num_blocks, 2,
block_size, num_kv_heads, head_dim)`` is the pool the kernels of :mod:`pagedkv.attention`
read in place (a NumPy view of vLLM's tensor, no copy). Only this backend (and
:class:`pagedkv.vllm.PagedKVConnector`, which knows both layouts) reads the bytes.

Per step, the metadata builder turns vLLM's block table, sequence lengths and query start
locations into the kernels' CSR page table once per KV cache group and window (the pages of
each sequence from the first one its earliest query's window reaches, so the blocks a
sliding-window KV cache manager released are never listed); each layer then runs
:func:`pagedkv.attention.decode` (every query of the step is a sequence's only new token) or
:func:`pagedkv.attention.prefill` (mixed batches, chunked prefill, prefix-cache hits: the
queries of a sequence are its last ``query_len`` tokens).

Supported: decoder self-attention, float32 and float16 models with K/V in the model's dtype
(``kv_cache_dtype="auto"``), head sizes 1 to 256, GQA/MQA, sliding windows (per layer),
logit soft-capping, attention sinks (``sinks``, gpt-oss), the scale vLLM passes. Refused
with a ``NotImplementedError`` naming the feature when the model's layers are built: ALiBi,
encoder, encoder-only and cross attention, quantized (FP8) or other KV cache dtypes, bfloat16,
head sizes past 256, KV sharing between layers, fused output quantization, other KV cache
layouts (``VLLM_KV_CACHE_LAYOUT``).
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar

import numpy as np
import torch
from vllm.logger import init_logger
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.kv_cache_layout import KVCacheLayout

from pagedkv_c import _attention

__all__ = ["PagedAttentionBackend", "PagedAttentionImpl", "PagedAttentionMetadata",
           "PagedAttentionMetadataBuilder"]

logger = init_logger("vllm.pagedkv")

_MAX_HEAD_DIM = 256
_announced = False


def _announce(block_size, dtype):
    global _announced
    if not _announced:
        _announced = True
        logger.info("pagedkv: PagedAttentionBackend replaces vLLM's CPU attention (PAGEDKV_VLLM_ATTENTION=1): "
                    "pagedkv kernels (%s) over vLLM's KV cache in pagedkv's page layout, %d-token pages, %s",
                    _attention.kernel_info()["isa"], block_size, dtype)


@dataclasses.dataclass
class PagedAttentionMetadata:
    """One step's batch for every layer of a KV cache group.

    Attributes
    ----------
    num_actual_tokens : int
        Query tokens of the step (vLLM may pass more rows, padding, which are not computed).
    num_reqs : int
        Sequences of the step.
    max_query_len : int
        Most query tokens of one sequence; 1 means a decode step (the decode kernel runs).
    qo_indptr : numpy.ndarray, int64, shape ``(num_reqs + 1,)``
        vLLM's query start locations: sequence ``b``'s queries are rows
        ``qo_indptr[b] .. qo_indptr[b + 1] - 1``, its last tokens.
    seq_lens : numpy.ndarray, int64, shape ``(num_reqs,)``
        Tokens of each sequence, the step's new ones included.
    block_table : numpy.ndarray, int32, shape ``(num_reqs, max_blocks)``
        vLLM's block table: block ``j`` of sequence ``b`` holds positions
        ``j * block_size .. (j + 1) * block_size - 1``.
    block_size : int
        Tokens per block (page).
    query_start_loc, seq_lens_tensor : torch.Tensor
        vLLM's tensors, for code that reads them from the metadata.
    """

    num_actual_tokens: int
    num_reqs: int
    max_query_len: int
    qo_indptr: np.ndarray
    seq_lens: np.ndarray
    block_table: np.ndarray
    block_size: int
    query_start_loc: torch.Tensor
    seq_lens_tensor: torch.Tensor
    _tables: dict = dataclasses.field(default_factory=dict)

    def page_table(self, window):
        """The CSR page table for layers with ``window`` (tokens, or None), built and checked once per
        step (a ``pagedkv_c._attention.StepTable``, with the query offsets unless the step is a decode).

        Each sequence lists its blocks from the one holding the first key its earliest query
        attends to (position ``seq_len - query_len - window + 1``, or 0) to its last token's,
        with their first positions; vLLM's sliding-window manager keeps exactly those blocks.
        """
        table = self._tables.get(window)
        if table is None:
            table = self._tables[window] = self._build(window)
        return table

    def _build(self, window):
        n = self.block_size
        seq_lens = self.seq_lens
        last = (seq_lens + (n - 1)) // n
        if window is None:
            first = np.zeros_like(last)
        else:
            first_query = seq_lens - np.diff(self.qo_indptr)
            first = np.maximum(first_query - window + 1, 0) // n
            first = np.minimum(first, last)
        counts = last - first
        indptr = np.zeros(self.num_reqs + 1, dtype=np.int32)
        np.cumsum(counts, out=indptr[1:])
        nnz = int(indptr[-1])
        rows = np.repeat(np.arange(self.num_reqs), counts)
        cols = np.arange(nnz, dtype=np.int64) - np.repeat(indptr[:-1] - first, counts)
        if nnz and int(cols.max()) >= self.block_table.shape[1]:
            raise ValueError(f"PagedAttentionBackend: a sequence of {int(seq_lens.max())} tokens needs more than "
                             f"the {self.block_table.shape[1]} blocks of vLLM's block table")
        indices = np.ascontiguousarray(self.block_table[rows, cols], dtype=np.int32)
        qo = None if self.max_query_len == 1 and self.num_actual_tokens == self.num_reqs else self.qo_indptr
        return _attention.StepTable(indptr, indices, cols * n, seq_lens, qo)


class PagedAttentionMetadataBuilder(AttentionMetadataBuilder[PagedAttentionMetadata]):
    """Builds :class:`PagedAttentionMetadata` from vLLM's ``CommonAttentionMetadata`` once per step."""

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        if device.type != "cpu":
            raise NotImplementedError(f"PagedAttentionBackend runs on the CPU, got device {device}")
        self.block_size = int(kv_cache_spec.block_size)
        self.windows = self._group_windows()
        _announce(self.block_size, kv_cache_spec.dtype)

    def _group_windows(self):
        """The sliding windows (None: full attention) of this group's layers, or None when unknown."""
        if self.vllm_config is None:
            return None
        from vllm.config import get_layers_from_vllm_config
        from vllm.model_executor.layers.attention import Attention
        layers = get_layers_from_vllm_config(self.vllm_config, Attention, self.layer_names)
        return {layer.impl.sliding_window for layer in layers.values() if isinstance(layer.impl, PagedAttentionImpl)}

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> PagedAttentionMetadata:
        """One step's metadata from vLLM's: query start offsets (int64 ``[num_reqs + 1]``, tokens), sequence
        lengths (int64 ``[num_reqs]``, tokens) and the block table, with the pagedkv page table of every
        layer window built now (vLLM reuses its block-table buffer after this call).

        Raises NotImplementedError for non-causal attention (which the backend does not compute).
        """
        common = common_attn_metadata
        num_reqs = int(common.num_reqs)
        qo = common.query_start_loc_cpu[:num_reqs + 1].numpy().astype(np.int64)
        seq_lens = common.seq_lens[:num_reqs].cpu().numpy().astype(np.int64)
        block_table = common.block_table_tensor[:num_reqs].cpu().numpy()
        if isinstance(common.causal, torch.Tensor) or not common.causal:
            raise NotImplementedError("PagedAttentionBackend computes causal attention only, got non-causal")
        metadata = PagedAttentionMetadata(
            num_actual_tokens=int(qo[-1]), num_reqs=num_reqs, max_query_len=int(common.max_query_len),
            qo_indptr=qo, seq_lens=seq_lens, block_table=block_table, block_size=self.block_size,
            query_start_loc=common.query_start_loc, seq_lens_tensor=common.seq_lens)
        if self.windows is None:
            # Layers unknown: tables are built on first use, from a copy of the block table.
            metadata.block_table = block_table.copy()
        else:
            # Now, while vLLM's block table buffer holds this step's tables.
            for window in self.windows:
                metadata.page_table(window)
        return metadata


class PagedAttentionBackend(AttentionBackend):
    """vLLM attention backend (CPU) running pagedkv's paged decode and prefill kernels.

    Selected by vLLM's CPU platform in place of its native ``CPU_ATTN`` when
    ``PAGEDKV_VLLM_ATTENTION=1`` (see the module docstring and docs/vllm.md); ``get_name``
    answers ``"CPU_ATTN"``, the slot it fills.
    """

    forward_includes_kv_cache_update: bool = False
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float32, torch.float16]
    supported_kv_cache_dtypes: ClassVar[list] = ["auto"]

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list:
        """Any block size (tokens per block): the kernels take any page size."""
        return [MultipleOf(1)]

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        """Head sizes 1 to 256 (values per head), the kernels' range."""
        return list(range(1, _MAX_HEAD_DIM + 1))

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple:
        """vLLM's LBHNC layout: each layer's blocks contiguous, each block one pagedkv page."""
        return (KVCacheLayout.LBHNC,)

    @staticmethod
    def get_name() -> str:
        """``"CPU_ATTN"``: vLLM looks the backend up by the enum name of the slot it fills."""
        return "CPU_ATTN"

    @classmethod
    def supports_sliding_window(cls) -> bool:
        """True: per-layer sliding windows, as vLLM passes them."""
        return True

    @classmethod
    def supports_sink(cls) -> bool:
        """True: learned sink logits per query head (gpt-oss), the kernels' ``sink_logits``."""
        return True

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        """True for decoder self-attention only; encoder and cross attention are not computed."""
        return attn_type == AttentionType.DECODER

    @staticmethod
    def get_impl_cls() -> type[PagedAttentionImpl]:
        """:class:`PagedAttentionImpl`, the per-layer implementation vLLM instantiates."""
        return PagedAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[PagedAttentionMetadataBuilder]:
        """:class:`PagedAttentionMetadataBuilder`, which turns vLLM's per-step metadata into page tables."""
        return PagedAttentionMetadataBuilder


class PagedAttentionImpl(AttentionImpl[PagedAttentionMetadata]):
    """One attention layer: writes the step's K/V into vLLM's blocks, runs pagedkv's kernels.

    Parameters are vLLM's (``vllm.v1.attention.backend.AttentionImpl``).

    Raises
    ------
    NotImplementedError
        A feature the kernels cannot compute, named in the message: ALiBi slopes, an attention
        type other than decoder self-attention, a KV cache dtype other than ``"auto"``, a
        model dtype other than float32 or float16, a head size past 256, KV sharing between
        layers, or unknown extra arguments.
    """

    def __init__(self, num_heads, head_size, scale, num_kv_heads=None, alibi_slopes=None, sliding_window=None,
                 kv_cache_dtype="auto", logits_soft_cap=None, attn_type=AttentionType.DECODER,
                 kv_sharing_target_layer_name=None, sinks=None, **extra):
        unsupported = []
        if alibi_slopes is not None:
            unsupported.append("ALiBi (alibi_slopes)")
        if attn_type != AttentionType.DECODER:
            unsupported.append(f"attention type {attn_type!r} (decoder self-attention only: no encoder, "
                               "encoder-only or cross attention)")
        if kv_cache_dtype != "auto":
            unsupported.append(f"kv_cache_dtype={kv_cache_dtype!r} (K/V in the model's dtype only: no FP8 KV)")
        if not 1 <= head_size <= _MAX_HEAD_DIM:
            unsupported.append(f"head size {head_size} (at most {_MAX_HEAD_DIM})")
        if kv_sharing_target_layer_name is not None:
            unsupported.append(f"KV sharing with layer {kv_sharing_target_layer_name!r}")
        dtype = torch.get_default_dtype()
        if dtype not in PagedAttentionBackend.supported_dtypes:
            unsupported.append(f"model dtype {dtype} (float32 or float16)")
        extra = {k: v for k, v in extra.items() if v is not None and v is not False}
        if extra:
            unsupported.append(f"the arguments {sorted(extra)}")
        if unsupported:
            raise NotImplementedError("PagedAttentionBackend (PAGEDKV_VLLM_ATTENTION=1) does not support "
                                      + "; ".join(unsupported) + ". Unset PAGEDKV_VLLM_ATTENTION to use vLLM's "
                                      "own CPU attention.")
        self.num_heads = int(num_heads)
        self.head_size = int(head_size)
        self.scale = float(scale)
        self.num_kv_heads = int(num_heads if num_kv_heads is None else num_kv_heads)
        self.sliding_window = None if sliding_window is None or sliding_window <= 0 else int(sliding_window)
        self.kv_cache_dtype = kv_cache_dtype
        self.logits_soft_cap = float(logits_soft_cap) if logits_soft_cap else None
        self.attn_type = attn_type
        self.kv_sharing_target_layer_name = None
        self.alibi_slopes = None
        if sinks is not None and sinks.shape != (self.num_heads,):
            raise ValueError(f"PagedAttentionBackend: sinks of shape {tuple(sinks.shape)}, expected "
                             f"({self.num_heads},), one logit per query head")
        self.sinks = sinks
        self._sink_logits = None
        self._pages_of = (None, None)

    def _pages(self, kv_cache: torch.Tensor) -> np.ndarray:
        """vLLM's layer tensor as pagedkv's pool ``(num_blocks, 2, block_size, H, D)`` (a NumPy view)."""
        key = (kv_cache.data_ptr(), tuple(kv_cache.shape))
        if self._pages_of[0] == key:
            return self._pages_of[1]
        num_blocks, heads, block_size, content = kv_cache.shape
        if heads != self.num_kv_heads or content != 2 * self.head_size or kv_cache.device.type != "cpu":
            raise ValueError(f"PagedAttentionBackend: KV cache of shape {tuple(kv_cache.shape)} on "
                             f"{kv_cache.device}, expected a CPU tensor (num_blocks, {self.num_kv_heads}, block_size, "
                             f"{2 * self.head_size})")
        if not kv_cache.is_contiguous():
            raise NotImplementedError(
                "PagedAttentionBackend reads each layer's KV cache as one contiguous pool; vLLM laid this "
                f"layer out with strides {kv_cache.stride()} (a padded or interleaved KV cache layout, "
                "e.g. from VLLM_KV_CACHE_LAYOUT or a hybrid model's page padding)")
        pages = kv_cache.view(num_blocks, 2, block_size, heads, self.head_size).numpy()
        self._pages_of = (key, pages)
        return pages

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
        """Write the step's K/V rows into their slots (``slot = block * block_size + offset``)."""
        if kv_cache.numel() == 0:
            return
        pages = self._pages(kv_cache)
        n = slot_mapping.shape[0]
        if n == 0:
            return
        # NumPy: for the few rows of a step its calls cost less than torch's dispatch.
        slots = slot_mapping.numpy()
        key, value = key.numpy()[:n], value.numpy()[:n]
        if slots.min() < 0:
            # Padding rows (vLLM's PAD_SLOT_ID) are not stored.
            keep = slots >= 0
            slots, key, value = slots[keep], key[keep], value[keep]
        block_size = pages.shape[2]
        # Row r of the (num_blocks * 2 * block_size, H, D) view: K of slot s is row s + block * block_size.
        rows = slots + (slots // block_size) * block_size
        flat = pages.reshape(-1, self.num_kv_heads, self.head_size)
        flat[rows] = key
        flat[rows + block_size] = value

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        """Attention of the step's queries over vLLM's KV cache; writes ``output[:num_actual_tokens]``."""
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("PagedAttentionBackend does not support fused output quantization")
        if attn_metadata is None:
            return output
        n = attn_metadata.num_actual_tokens
        if n == 0:
            return output
        pages = self._pages(kv_cache)
        if pages.shape[2] != attn_metadata.block_size:
            raise ValueError(f"PagedAttentionBackend: KV cache blocks of {pages.shape[2]} tokens, block table of "
                             f"{attn_metadata.block_size}-token blocks")
        table = attn_metadata.page_table(self.sliding_window)
        # NumPy views: torch's slicing costs more than the kernel call's checks at decode sizes.
        q = query.numpy()[:n]
        rows = output.numpy()[:n]
        # The kernels write vLLM's output rows in place when they are one C-contiguous block.
        out = rows.reshape(n, self.num_heads, self.head_size) if rows.flags.c_contiguous else None
        if self.sinks is not None and self._sink_logits is None:
            self._sink_logits = self.sinks.detach().to(torch.float64).numpy().copy()
        threads = torch.get_num_threads()
        step = _attention.prefill_step if table.qo_indptr is not None else _attention.decode_step
        result = step(q, pages, table, self.sliding_window, self.scale, threads, out,
                      sink_logits=self._sink_logits, softcap=self.logits_soft_cap)
        if out is None:
            rows[...] = result.reshape(rows.shape)
        return output
