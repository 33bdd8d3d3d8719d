# Type stub of the compiled module pagedkv_c._lock (see _lock.pyx for the documentation).
from types import TracebackType
from typing import Self

from typing_extensions import disjoint_base

@disjoint_base
class CacheLock:
    def __new__(cls, owner_name: str, reentry_hint: str) -> Self: ...
    @property
    def owner_name(self) -> str: ...
    def __enter__(self) -> None: ...
    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None) -> bool: ...
