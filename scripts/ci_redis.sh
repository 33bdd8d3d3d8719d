#!/usr/bin/env bash
# CI step for the shared prefix tier (pagedkv.tiers.RedisTier). Runs inside the CI virtual
# environment after the main test steps: installs the `redis` extra (redis-py, hiredis), then
# runs tests/test_tier.py and tests/test_tier_hostile.py against real redis-server processes on loopback (one standalone
# server and 3-node clusters made by scripts/redis_cluster.sh), with the skip turned into a
# failure (PAGEDKV_REQUIRE_REDIS=1). redis-server itself comes from the distribution (.ci/run).
set -euo pipefail
cd "$(dirname "$0")/.."

command -v redis-server >/dev/null || { echo "ci_redis.sh: redis-server is not installed" >&2; exit 1; }
redis-server --version
# The extra's requirements; pagedkv itself is already installed (no rebuild).
pip install -r <(python scripts/extra_requirements.py redis)

export PAGEDKV_REQUIRE_REDIS=1
pytest -q tests/test_tier.py tests/test_tier_hostile.py tests/test_tier_cli.py
