# Type stub of the compiled module pagedkv_c._checks (see _checks.pyx for the
# documentation). Its other validators are cdef functions, cimported by the core.
from typing import Any

import numpy as np

def check_sink_window(
    window: int | np.integer[Any] | None,
    sink_tokens: int | np.integer[Any],
    sinks_name: str = "sink_tokens",
    window_name: str = "window=W",
) -> None: ...

MAX_SECONDS: float

def checked_int(value: object, name: str, low: int | None = None, high: int | None = None) -> int: ...
def checked_flag(value: object, name: str) -> bool: ...
def checked_seconds(
    value: object, name: str, low: float = 0.0, low_inclusive: bool = False, high: float = ...
) -> float: ...
