# Type stub of the compiled module pagedkv_c._checksum (see _checksum.pyx for the documentation).
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["combine_digests", "layer_digests", "page_checksums"]

def page_checksums(
    kv: npt.NDArray[np.float16] | npt.NDArray[np.float32],
    page_ids: Sequence[int] | npt.NDArray[np.integer[Any]],
) -> npt.NDArray[np.uint64]: ...
def layer_digests(
    kv: npt.NDArray[np.float16] | npt.NDArray[np.float32],
    layer: int,
    first: int,
    stop: int,
    digests: npt.NDArray[np.uint8],
    skip: npt.NDArray[np.uint8] | None = None,
) -> None: ...
def combine_digests(
    digests: npt.NDArray[np.uint8],
    out: npt.NDArray[np.uint64],
    skip: npt.NDArray[np.uint8] | None = None,
) -> None: ...
