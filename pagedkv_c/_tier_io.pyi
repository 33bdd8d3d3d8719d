# Type stub of the compiled module pagedkv_c._tier_io (see _tier_io.pyx for the documentation).
from typing import Self

import numpy as np
import numpy.typing as npt
from typing_extensions import disjoint_base

__all__ = ["PageValueChecker", "record_checksums"]

def record_checksums(
    records: npt.NDArray[np.uint8], body_offset: int, num_layers: int, page_bytes: int
) -> npt.NDArray[np.uint64]: ...

@disjoint_base
class PageValueChecker:
    @property
    def checksums(self) -> npt.NDArray[np.uint64]: ...
    def __new__(
        cls,
        records: npt.NDArray[np.uint8],
        expected_header: bytes,
        hash_offset: int,
        checksum_offset: int,
        page_hashes: npt.NDArray[np.uint64],
        token_ids: npt.NDArray[np.int32] | None,
        num_layers: int,
        page_bytes: int,
    ) -> Self: ...
    @property
    def body_offset(self) -> int: ...
    def check(self, row: int) -> bool: ...
