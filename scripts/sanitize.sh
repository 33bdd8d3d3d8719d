#!/usr/bin/env bash
# Sanitizer pass of CI: build the core once with AddressSanitizer, UndefinedBehaviorSanitizer
# and Cython's bounds/wraparound/initialized checks (PAGEDKV_SANITIZE=1 PAGEDKV_DEBUG=1),
# install it with the test and fuzz extras into the active environment, run the test suite on
# it, then run the coverage-guided fuzzer (tests/fuzz/fuzz_pagedkv.py) and the structure-aware
# snapshot fuzzer (tests/fuzz/fuzz_snapshots.py) for a fixed time each on the same build.
#
# Any sanitizer report aborts the process that hit it, so the step fails. A fuzzer finding
# leaves its input in $PAGEDKV_FUZZ_ARTIFACTS (default: fuzz-artifacts/ in the checkout) as
# crash-*, timeout-* or oom-* (coverage-guided fuzzer) or snapshot-*.bin with a .json beside it
# (snapshot fuzzer); rerun it with the command printed at the end.
#
# Usage: bash scripts/sanitize.sh [--skip-build] [--skip-tests] [--skip-fuzz]
# Environment: PAGEDKV_FUZZ_SECONDS (default 120), PAGEDKV_SNAPSHOT_FUZZ_SECONDS (default 60),
# PAGEDKV_FUZZ_ARTIFACTS, CC (default gcc).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
FUZZ_SECONDS=${PAGEDKV_FUZZ_SECONDS:-120}
SNAPSHOT_FUZZ_SECONDS=${PAGEDKV_SNAPSHOT_FUZZ_SECONDS:-60}
ARTIFACTS=${PAGEDKV_FUZZ_ARTIFACTS:-$ROOT/fuzz-artifacts}
BUILD=1 TESTS=1 FUZZ=1
for arg in "$@"; do
    case "$arg" in
        --skip-build) BUILD=0 ;;
        --skip-tests) TESTS=0 ;;
        --skip-fuzz) FUZZ=0 ;;
        *) echo "sanitize.sh: unknown argument $arg" >&2; exit 2 ;;
    esac
done
step() { printf '\n==== sanitize: %s\n' "$*"; }

# Python is not instrumented, so the compiler's ASan runtime has to be loaded first;
# libstdc++ is preloaded with it so that ASan finds the real __cxa_throw for C++
# extensions loaded later (matplotlib's ft2font otherwise aborts ASan on its first throw).
CC=${CC:-gcc}
LIBASAN=$("$CC" -print-file-name=libasan.so)
LIBSTDCXX=$("$CC" -print-file-name=libstdc++.so)
[ -f "$LIBASAN" ] || { echo "sanitize.sh: $CC has no libasan.so (got '$LIBASAN')" >&2; exit 1; }
[ -f "$LIBSTDCXX" ] || LIBSTDCXX=""
# CPython keeps memory until exit by design: no leak report. Huge NumPy requests must
# fail with MemoryError as without ASan. Undefined behaviour aborts with a stack trace.
export ASAN_OPTIONS=detect_leaks=0:allocator_may_return_null=1:abort_on_error=0
export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1

if [ "$BUILD" = 1 ]; then
    step "build and install with PAGEDKV_SANITIZE=1 PAGEDKV_DEBUG=1 (+ test and fuzz extras)"
    start=$SECONDS
    PAGEDKV_SANITIZE=1 PAGEDKV_DEBUG=1 python -m pip install ".[test,fuzz]"
    echo "sanitize: build took $((SECONDS - start)) s"
fi

if [ "$TESTS" = 1 ]; then
    step "test suite on the sanitizer build"
    start=$SECONDS
    # --capture=sys: a sanitizer report goes to the log even though it ends the process.
    # The pytest command, not python -m pytest: the checkout must not shadow the installed core.
    # torch is not built with the sanitizers: the transformers tests run on the release build.
    # The tier tests (real Redis servers, subprocesses) ran on the release build too.
    LD_PRELOAD="$LIBASAN $LIBSTDCXX" pytest -q --capture=sys -p no:cacheprovider \
        --ignore=tests/test_transformers.py --ignore=tests/test_transformers_hybrid.py --ignore=tests/test_tier.py --ignore=tests/test_tier_hostile.py --ignore=tests/test_tier_cli.py
    echo "sanitize: test suite took $((SECONDS - start)) s"
fi

if [ "$FUZZ" = 1 ]; then
    step "fuzz for $FUZZ_SECONDS s (tests/fuzz, atheris) on the sanitizer build"
    start=$SECONDS
    # atheris' own libFuzzer must come before libasan: GCC's libasan also defines
    # libFuzzer's coverage hooks (as no-ops), and whichever is loaded first wins.
    # Its extension needs libpython's symbols at preload time when Python links it.
    read -r LIBPYTHON ATHERIS_CORE < <(python - <<'PY'
import glob, os, sysconfig
import atheris
shared = sysconfig.get_config_var("Py_ENABLE_SHARED")
lib = os.path.join(sysconfig.get_config_var("LIBDIR"), sysconfig.get_config_var("LDLIBRARY")) if shared else "-"
core = glob.glob(os.path.join(os.path.dirname(atheris.__file__), "core_with_libfuzzer*.so"))[0]
print(lib, core)
PY
)
    [ "$LIBPYTHON" = "-" ] && LIBPYTHON=""
    mkdir -p "$ARTIFACTS"
    corpus=$(mktemp -d "${TMPDIR:-/tmp}/pagedkv-fuzz-corpus.XXXXXX")
    status=0
    LD_PRELOAD="$LIBPYTHON $ATHERIS_CORE $LIBASAN $LIBSTDCXX" \
        ASAN_OPTIONS="$ASAN_OPTIONS:verify_asan_link_order=0" \
        python tests/fuzz/fuzz_pagedkv.py "$corpus" tests/fuzz/corpus \
            -max_total_time="$FUZZ_SECONDS" -timeout=60 -rss_limit_mb=4096 -detect_leaks=0 \
            -artifact_prefix="$ARTIFACTS/" -print_final_stats=1 || status=$?
    rm -rf "$corpus"
    echo "sanitize: fuzzing took $((SECONDS - start)) s"

    step "snapshot fuzzer for $SNAPSHOT_FUZZ_SECONDS s (tests/fuzz/fuzz_snapshots.py) on the sanitizer build"
    start=$SECONDS
    # Mutated snapshots, exported sequences and PagedKVCache snapshots, loaded in worker
    # processes that inherit the preloaded ASan runtime: a crash, sanitizer report, hang or
    # allocation past the bound is a finding, as is any other contract violation. A random run
    # seed each time (printed, to rerun the same cases with --seed).
    snapshot_status=0
    LD_PRELOAD="$LIBASAN $LIBSTDCXX" python tests/fuzz/fuzz_snapshots.py --seconds "$SNAPSHOT_FUZZ_SECONDS" \
        --timeout 120 --artifacts "$ARTIFACTS" || snapshot_status=$?
    echo "sanitize: snapshot fuzzing took $((SECONDS - start)) s"
    if [ "$status" != 0 ]; then
        echo "sanitize: FAILED: the fuzzer found an input that breaks pagedkv (exit $status):" >&2
        ls -l "$ARTIFACTS" >&2
        echo "rerun it: LD_PRELOAD=\"$LIBASAN $LIBSTDCXX\" python tests/fuzz/fuzz_pagedkv.py --replay $ARTIFACTS/<file>" >&2
    fi
    if [ "$snapshot_status" != 0 ]; then
        echo "sanitize: FAILED: the snapshot fuzzer found files that break pagedkv (exit $snapshot_status):" >&2
        ls -l "$ARTIFACTS" >&2
        echo "rerun one: LD_PRELOAD=\"$LIBASAN $LIBSTDCXX\" python tests/fuzz/fuzz_snapshots.py --replay $ARTIFACTS/snapshot-<...>.bin" >&2
    fi
    if [ "$status" != 0 ] || [ "$snapshot_status" != 0 ]; then
        exit 1
    fi
fi
