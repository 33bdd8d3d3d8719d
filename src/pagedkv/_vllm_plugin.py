"""vLLM ``vllm.general_plugins`` entry point: pagedkv's attention backend behind one switch.

vLLM calls :func:`register` in each of its processes (front end, engine core, workers). With
``PAGEDKV_VLLM_ATTENTION=1`` in the environment it overrides the CPU platform's attention
backend (``AttentionBackendEnum.CPU_ATTN``, which vLLM's CPU platform always selects) with
``pagedkv.vllm.PagedAttentionBackend``; with the variable unset, ``0`` or empty it does
nothing, and vLLM runs as without pagedkv. Nothing is imported from vLLM unless it is set.
"""
from __future__ import annotations

import os

ENV_VARIABLE = "PAGEDKV_VLLM_ATTENTION"
BACKEND_PATH = "pagedkv.vllm.PagedAttentionBackend"


def enabled() -> bool:
    """True when ``PAGEDKV_VLLM_ATTENTION`` asks for the backend (``1``, ``true``, ``yes``, ``on``)."""
    value = os.environ.get(ENV_VARIABLE, "").strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"Invalid value of {ENV_VARIABLE}: expected 1 or 0, got {os.environ[ENV_VARIABLE]!r}")


def register() -> None:
    """Register the override when the switch is on (idempotent; vLLM may call it more than once)."""
    if not enabled():
        return
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
    register_backend(AttentionBackendEnum.CPU_ATTN, BACKEND_PATH)
