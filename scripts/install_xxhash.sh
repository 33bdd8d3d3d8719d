#!/usr/bin/env bash
# Provide xxhash.h (xxHash >= 0.8.0) so that the build compiles XXH3-128 into
# the prefix cache (see PAGEDKV_XXHASH in setup.py). Best effort: without the
# header the build still works and the Python xxhash package computes the same
# hashes, one call per page; builds that must have it set PAGEDKV_XXHASH=1.
#
# Order: an existing header; the system package manager (Debian/Ubuntu
# libxxhash-dev, AlmaLinux/RHEL xxhash-devel from EPEL, Alpine xxhash-dev,
# Homebrew xxhash); else the header bundled in the Python xxhash package's
# source distribution, fetched with pip and copied to /usr/local/include.
# Used by .ci/run, .github/workflows/tests.yml and cibuildwheel's before-all.
# With --check it installs nothing and exits 0 if a suitable header is there, 1 if not.
set -uo pipefail

header_ok() {  # $1: directory; true if it holds xxhash.h of version >= 0.8.0
    local h="$1/xxhash.h" major minor
    [ -f "$h" ] || return 1
    major=$(sed -n 's/^#[[:space:]]*define[[:space:]]*XXH_VERSION_MAJOR[[:space:]]*\([0-9]*\).*/\1/p' "$h")
    minor=$(sed -n 's/^#[[:space:]]*define[[:space:]]*XXH_VERSION_MINOR[[:space:]]*\([0-9]*\).*/\1/p' "$h")
    [ -n "$major" ] && [ -n "$minor" ] && { [ "$major" -gt 0 ] || [ "$minor" -ge 8 ]; }
}

found() {
    local dir
    for dir in "${XXHASH_INCLUDE_DIR:-}" "${XXHASH_FALLBACK_DIR:-}" /usr/include /usr/local/include /opt/homebrew/include; do
        if [ -n "$dir" ] && header_ok "$dir"; then
            echo "install_xxhash: using $dir/xxhash.h"
            return 0
        fi
    done
    return 1
}

if [ "${1:-}" = "--check" ]; then
    found
    exit
fi
found && exit 0

SUDO=""
if [ "$(id -u)" != 0 ] && command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    SUDO="sudo"
fi
can_install() { [ "$(id -u)" = 0 ] || [ -n "$SUDO" ]; }

if command -v brew >/dev/null 2>&1; then
    HOMEBREW_NO_AUTO_UPDATE=1 HOMEBREW_NO_INSTALL_CLEANUP=1 brew install xxhash
elif can_install && command -v apt-get >/dev/null 2>&1; then
    $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq libxxhash-dev
elif can_install && command -v dnf >/dev/null 2>&1; then
    $SUDO dnf install -y -q epel-release; $SUDO dnf install -y -q xxhash-devel
elif can_install && command -v yum >/dev/null 2>&1; then
    $SUDO yum install -y -q epel-release; $SUDO yum install -y -q xxhash-devel
elif can_install && command -v apk >/dev/null 2>&1; then
    $SUDO apk add --no-cache xxhash-dev
fi
found && exit 0

# Fallback: the header that the Python xxhash package bundles (deps/xxhash/xxhash.h).
target=${XXHASH_FALLBACK_DIR:-/usr/local/include}
python=$(command -v python3 || command -v python || true)
if [ -n "$python" ] && { [ -w "$target" ] || { can_install && $SUDO mkdir -p "$target"; }; }; then
    tmp=$(mktemp -d)
    if "$python" -m pip download --quiet --no-deps --no-binary :all: "xxhash>=3" -d "$tmp"; then
        "$python" - "$tmp" <<'PY'
import pathlib, sys, tarfile
tmp = pathlib.Path(sys.argv[1])
with tarfile.open(next(tmp.glob("xxhash-*.tar.gz"))) as sdist:
    member = next(m for m in sdist.getmembers() if m.name.endswith("/deps/xxhash/xxhash.h"))
    (tmp / "xxhash.h").write_bytes(sdist.extractfile(member).read())
PY
        $SUDO cp "$tmp/xxhash.h" "$target/xxhash.h" \
            && echo "install_xxhash: copied xxhash.h from the Python xxhash package's sdist to $target"
    fi
    rm -rf "$tmp"
fi
found && exit 0
echo "install_xxhash: no xxhash.h >= 0.8.0 available; the build will use the Python xxhash package"
exit 0
