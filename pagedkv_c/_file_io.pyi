# Type stub of the compiled module pagedkv_c._file_io (see _file_io.pyx for the documentation).

__all__ = ["prefault", "start_writeback"]

import numpy as np

def start_writeback(fd: int, offset: int, nbytes: int) -> bool: ...
def prefault(array: np.ndarray) -> None: ...
