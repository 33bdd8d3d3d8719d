# Type stub of the compiled module pagedkv_c._prefix_serving (see _prefix_serving.pyx for the documentation).
from typing_extensions import disjoint_base

from pagedkv_c._prefix import PrefixIndex

PREFIX_HIT_BUCKETS: tuple[int, ...]

@disjoint_base
class PrefixServer:
    @property
    def index(self) -> PrefixIndex: ...
