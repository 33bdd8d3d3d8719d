# Type stub of the compiled module pagedkv_c._seals (see _seals.pyx for the documentation).
from typing_extensions import disjoint_base

class BadPage:
    page_id: int
    expected: int
    actual: int
    seq_ids: list[int]
    def __init__(self, page_id: int, expected: int, actual: int, seq_ids: list[int]) -> None: ...
    def __eq__(self, other: object) -> bool: ...
    __hash__: None  # type: ignore[assignment]

class PageCheckReport:
    num_pages_checked: int
    bad_pages: list[BadPage]
    def __init__(self, num_pages_checked: int, bad_pages: list[BadPage]) -> None: ...
    def __bool__(self) -> bool: ...

@disjoint_base
class SealTracker: ...
