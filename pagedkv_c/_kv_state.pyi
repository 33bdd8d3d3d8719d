# Type stub of the compiled module pagedkv_c._kv_state (see _kv_state.pyx for the documentation).

class StateError(ValueError):
    section: str
    def __init__(self, section: str, text: str) -> None: ...
