# Type stub of the compiled module pagedkv_c._page_store (see _page_store.pyx for the documentation).
from typing import Any

import numpy as np
from numpy.typing import NDArray
from typing_extensions import disjoint_base

@disjoint_base
class PageStore:
    @property
    def kv(self) -> NDArray[np.floating[Any]]: ...
