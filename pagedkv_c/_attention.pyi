# Type stub of the compiled module pagedkv_c._attention (see _attention.pyx and
# pagedkv/attention.py for the documentation).
from collections.abc import Hashable, Sequence
from typing import Any, Literal, Protocol, TypeAlias, overload

import numpy as np
from numpy.typing import ArrayLike, NDArray
from typing_extensions import disjoint_base

_Int: TypeAlias = int | np.integer[Any]
_F32: TypeAlias = NDArray[np.float32]
_Query: TypeAlias = ArrayLike  # real numbers, converted to float32

class _PageTableLike(Protocol):
    """The CSR page table that ``cache.page_table(seq_ids)`` returns."""
    @property
    def indptr(self) -> NDArray[np.int32]: ...
    @property
    def indices(self) -> NDArray[np.int32]: ...
    @property
    def page_positions(self) -> NDArray[np.int64]: ...
    @property
    def seq_lens(self) -> NDArray[np.int64]: ...

class _AttentionCache(Protocol):
    """What the kernels read from a cache (``pagedkv.KVCache`` has it all).

    Optional, read when present: ``chunk_size`` (int or None), or a method
    ``layer_attention_view(layer, seq_ids) -> (pages, view, window,
    sink_tokens, chunk_size)`` that replaces everything below.
    """
    @property
    def kv(self) -> NDArray[np.floating[Any]]: ...
    @property
    def window(self) -> int | None: ...
    @property
    def sink_tokens(self) -> int: ...
    def page_table(self, seq_ids: Sequence[int]) -> _PageTableLike: ...

def kernel_info() -> dict[str, Any]: ...
@overload
def decode(q: _Query, cache: _AttentionCache, layer: _Int, seq_ids: Sequence[Hashable],
           scale: float | None = None, num_threads: _Int | None = None,
           return_lse: Literal[False] = False, *, q_sink: _Query | None = None,
           sink_logits: ArrayLike | None = None, softcap: float | None = None) -> _F32: ...
@overload
def decode(q: _Query, cache: _AttentionCache, layer: _Int, seq_ids: Sequence[Hashable],
           scale: float | None, num_threads: _Int | None, return_lse: Literal[True], *,
           q_sink: _Query | None = None,
           sink_logits: ArrayLike | None = None, softcap: float | None = None) -> tuple[_F32, _F32]: ...
@overload
def decode(q: _Query, cache: _AttentionCache, layer: _Int, seq_ids: Sequence[Hashable],
           scale: float | None = None, num_threads: _Int | None = None, *,
           return_lse: Literal[True], q_sink: _Query | None = None,
           sink_logits: ArrayLike | None = None, softcap: float | None = None) -> tuple[_F32, _F32]: ...
@overload
def prefill(q: _Query, cache: _AttentionCache, layer: _Int, seq_ids: Sequence[Hashable],
            qo_indptr: Sequence[_Int] | NDArray[np.integer[Any]], scale: float | None = None,
            num_threads: _Int | None = None, return_lse: Literal[False] = False, *,
            q_sink: _Query | None = None,
            sink_logits: ArrayLike | None = None, softcap: float | None = None) -> _F32: ...
@overload
def prefill(q: _Query, cache: _AttentionCache, layer: _Int, seq_ids: Sequence[Hashable],
            qo_indptr: Sequence[_Int] | NDArray[np.integer[Any]], scale: float | None,
            num_threads: _Int | None, return_lse: Literal[True], *,
            q_sink: _Query | None = None,
            sink_logits: ArrayLike | None = None, softcap: float | None = None) -> tuple[_F32, _F32]: ...
@overload
def prefill(q: _Query, cache: _AttentionCache, layer: _Int, seq_ids: Sequence[Hashable],
            qo_indptr: Sequence[_Int] | NDArray[np.integer[Any]], scale: float | None = None,
            num_threads: _Int | None = None, *, return_lse: Literal[True],
            q_sink: _Query | None = None,
            sink_logits: ArrayLike | None = None, softcap: float | None = None) -> tuple[_F32, _F32]: ...

@disjoint_base
class StepTable:
    """A page table checked once and shared by the layers of one step."""
    @property
    def indptr(self) -> NDArray[np.int32]: ...
    @property
    def indices(self) -> NDArray[np.int32]: ...
    @property
    def page_positions(self) -> NDArray[np.int64]: ...
    @property
    def seq_lens(self) -> NDArray[np.int64]: ...
    @property
    def qo_indptr(self) -> NDArray[np.int64] | None: ...
    @property
    def batch_size(self) -> int: ...
    def __init__(self, indptr: ArrayLike, indices: ArrayLike, page_positions: ArrayLike, seq_lens: ArrayLike,
                 qo_indptr: ArrayLike | None = None) -> None: ...

def decode_step(q: NDArray[Any], pages: NDArray[Any], table: StepTable, window: int | None, scale: float,
                num_threads: int, out: _F32 | None = None, *, sink_logits: ArrayLike | None = None,
                softcap: float | None = None) -> _F32: ...
def prefill_step(q: NDArray[Any], pages: NDArray[Any], table: StepTable, window: int | None, scale: float,
                 num_threads: int, out: _F32 | None = None, *, sink_logits: ArrayLike | None = None,
                 softcap: float | None = None) -> _F32: ...
