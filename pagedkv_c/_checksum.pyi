# Type stub of the compiled module pagedkv_c._checksum (see _checksum.pyx for the documentation).
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["page_checksums"]

def page_checksums(
    kv: npt.NDArray[np.float16] | npt.NDArray[np.float32],
    page_ids: Sequence[int] | npt.NDArray[np.integer[Any]],
) -> npt.NDArray[np.uint64]: ...
