# Type stub of the compiled module pagedkv_c._tier_link (see _tier_link.pyx for the documentation).
from typing import Any

from typing_extensions import disjoint_base

@disjoint_base
class TierLink:
    @property
    def tier(self) -> Any: ...
