"""Shared tiers below a cache's prefix cache: pages sealed by one process, reused by others.

RedisTier
    Redis or Valkey, standalone or cluster (``pip install "pagedkv[redis]"``).

A tier is given to :class:`pagedkv.KVCache` (``tier=``). Importing this package does not
import the store's client library; ``pagedkv.tiers.RedisTier`` does, on first use.
"""

__all__ = ["RedisTier"]


def __getattr__(name):
    if name == "RedisTier":
        try:
            import redis  # noqa: F401
        except ModuleNotFoundError as exc:
            raise ImportError('pagedkv.tiers.RedisTier needs redis-py, which is not installed: pip install '
                              '"pagedkv[redis]" (from a checkout: pip install ".[redis]")') from exc
        from pagedkv.tiers.redis import RedisTier

        return RedisTier
    raise AttributeError(f"module 'pagedkv.tiers' has no attribute {name!r}")
