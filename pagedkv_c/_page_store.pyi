# Type stub of the compiled module pagedkv_c._page_store (see _page_store.pyx for the documentation).
from typing import Any

import numpy as np
from numpy.typing import NDArray
from typing_extensions import disjoint_base

PAGE_FORMATS: tuple[str, ...]
ROW_KINDS: tuple[str, ...]
MAX_QUANTIZED_HEAD_DIM: int

def format_layout(kv_dtype: str, head_dim: int) -> tuple[np.dtype[Any], int]: ...

@disjoint_base
class PageStore:
    @property
    def kv(self) -> NDArray[Any]: ...
