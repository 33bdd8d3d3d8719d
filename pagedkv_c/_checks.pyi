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
