# Type stub of the compiled module pagedkv_c._matmul (see _matmul.pyx for the documentation).
from typing import Any, TypeAlias

import numpy as np
from numpy.typing import NDArray

_Int: TypeAlias = int | np.integer[Any]

def kernel_info() -> dict[str, Any]: ...
def matmul(x: NDArray[np.float32], w: NDArray[np.float32], *, transpose_w: bool = False,
           num_threads: _Int | None = 1) -> NDArray[np.float32]: ...
