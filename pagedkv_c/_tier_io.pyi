# Type stub of the compiled module pagedkv_c._tier_io (see _tier_io.pyx for the documentation).
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["body_checksums", "record_checksums"]

def record_checksums(
    records: npt.NDArray[np.uint8], body_offset: int, num_layers: int, page_bytes: int
) -> npt.NDArray[np.uint64]: ...
def body_checksums(
    values: Sequence[bytes | bytearray | memoryview],
    offsets: Sequence[int] | npt.NDArray[np.integer[Any]],
    num_layers: int,
    page_bytes: int,
) -> npt.NDArray[np.uint64]: ...
