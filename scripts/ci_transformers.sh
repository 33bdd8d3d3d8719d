#!/usr/bin/env bash
# CI step for the Hugging Face transformers integration (pagedkv.transformers).
# Runs inside the CI virtual environment after the main test steps: installs the
# `transformers` extra with a CPU-only torch, then runs its tests with the skip turned
# into a failure (PAGEDKV_REQUIRE_TRANSFORMERS=1).
set -euo pipefail
cd "$(dirname "$0")/.."

# CPU torch without the CUDA libraries. On this CI image pip resolves torch==2.13.0 to
# the CPU build kept on the machine (192 MB wheel, ~750 MB installed). Elsewhere PyPI's
# Linux x86-64 torch wheel needs the nvidia-* packages (several GB): there, take the CPU
# build from the PyTorch index instead, as the README's install section says.
pip install "torch==2.13.0"
# The extra's other requirements; pagedkv itself is already installed (no rebuild).
pip install -r <(python scripts/extra_requirements.py transformers)

export PAGEDKV_REQUIRE_TRANSFORMERS=1 HF_HUB_OFFLINE=1
pytest -q tests/test_transformers.py
