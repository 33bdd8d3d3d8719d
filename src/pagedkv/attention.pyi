# Type stub of pagedkv.attention: the module is plain Python that forwards to the
# compiled pagedkv_c._attention, whose stub holds the signatures.
from pagedkv_c._attention import decode as decode, kernel_info as kernel_info, prefill as prefill

__all__ = ["decode", "prefill", "kernel_info"]
