#!/usr/bin/env bash
# CI step for the Hugging Face transformers integration (pagedkv.transformers).
# Runs inside the CI virtual environment after the main test steps: installs the
# `transformers` extra with a CPU-only torch, then runs its tests with the skip turned
# into a failure (PAGEDKV_REQUIRE_TRANSFORMERS=1): all of them on the newest transformers
# the extra resolves to, a smoke subset on the oldest supported release.
set -euo pipefail
cd "$(dirname "$0")/.."

# Oldest transformers release the extra supports (pyproject.toml: transformers>=5.0).
OLDEST_TRANSFORMERS=5.0.0

# CPU torch without the CUDA libraries. On this CI image pip resolves torch==2.13.0 to
# the CPU build kept on the machine (192 MB wheel, ~750 MB installed). Elsewhere PyPI's
# Linux x86-64 torch wheel needs the nvidia-* packages (several GB): there, take the CPU
# build from the PyTorch index instead, as the README's install section says.
pip install "torch==2.13.0"

export PAGEDKV_REQUIRE_TRANSFORMERS=1 HF_HUB_OFFLINE=1

# The oldest release first, on the tests that meet what changed across 5.x (the cache
# argument's name, position_ids reaching update(), get_mask_sizes, positive crop counts,
# the pad token of the GGUF tokenizer); pagedkv itself is already installed (no rebuild).
pip install -r <(python scripts/extra_requirements.py transformers) "transformers==$OLDEST_TRANSFORMERS"
pytest -q tests/test_transformers.py -k "(chat_prompt and not eager) or left_padded or (beam_search and pagedkv) \
or prompt_lookup or streaming_oracle or random_edits"

# Then the newest the extra resolves to (torch stays the CPU build), on every test.
pip install --upgrade -r <(python scripts/extra_requirements.py transformers) "torch==2.13.0" huggingface-hub
pytest -q tests/test_transformers.py tests/test_transformers_hybrid.py
