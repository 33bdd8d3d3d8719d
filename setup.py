"""Build script: declares the compiled core (package ``pagedkv_c``) and its flags.

Environment switches
--------------------
PAGEDKV_DEBUG=1
    Turn Cython's bounds, wraparound and initialized checks back on and compile
    without optimisation, so that an out-of-range index inside the core raises
    IndexError instead of corrupting memory. Used once per CI run.
PAGEDKV_SANITIZE=1
    Compile and link the core with AddressSanitizer and UndefinedBehaviorSanitizer
    (GCC/Clang only; any undefined behaviour aborts). Python itself is not
    instrumented, so run it with the compiler's ASan runtime preloaded:
    ``LD_PRELOAD=$(gcc -print-file-name=libasan.so) ASAN_OPTIONS=detect_leaks=0``
    (see scripts/sanitize.sh). Combine with PAGEDKV_DEBUG=1 for the Cython checks.
PAGEDKV_OPENMP=0 / 1
    Force OpenMP off or on. Default: on with GCC/Clang on Linux and with MSVC on
    Windows, off on macOS (Apple Clang ships no OpenMP runtime).
PAGEDKV_XXHASH=0 / 1, XXHASH_INCLUDE_DIR=...
    XXH3-128 for prefix caching, compiled in from xxhash.h (version 0.8.0 or
    later; Debian: libxxhash-dev) when the build finds it, else computed by the
    Python ``xxhash`` package. 0: never compile it in; 1: require it (the build
    fails without a suitable xxhash.h); unset: use it when found.
    XXHASH_INCLUDE_DIR names the directory to look in first.
"""

import os
import re
import sys
from pathlib import Path

import numpy as np
from Cython.Build import cythonize
from setuptools import Extension, setup

HERE = Path(__file__).parent
DEBUG = os.environ.get("PAGEDKV_DEBUG", "0") == "1"
SANITIZE = os.environ.get("PAGEDKV_SANITIZE", "0") == "1"
IS_MSVC = sys.platform == "win32"


def _openmp_enabled() -> bool:
    forced = os.environ.get("PAGEDKV_OPENMP")
    if forced is not None:
        return forced == "1"
    return sys.platform != "darwin"


OPENMP = _openmp_enabled()

if IS_MSVC:
    compile_args = ["/Od"] if DEBUG else ["/O2"]
    link_args: list[str] = []
    if OPENMP:
        compile_args.append("/openmp")
else:
    compile_args = ["-O0", "-g"] if DEBUG else ["-O3"]
    compile_args += ["-std=c11", "-Wno-unused-function", "-Wno-unreachable-code"]
    link_args = []
    if OPENMP:
        if sys.platform == "darwin":
            compile_args += ["-Xpreprocessor", "-fopenmp"]
            link_args += ["-lomp"]
        else:
            compile_args.append("-fopenmp")
            link_args.append("-fopenmp")
    if SANITIZE:
        sanitizers = ["-fsanitize=address,undefined", "-fno-sanitize-recover=undefined"]
        if not DEBUG:
            compile_args[0] = "-O1"  # readable reports at a bearable speed
        compile_args += [*sanitizers, "-fno-omit-frame-pointer", "-g"]
        link_args += sanitizers
if SANITIZE and IS_MSVC:
    raise SystemExit("PAGEDKV_SANITIZE=1 needs GCC or Clang")


# XXH3's output is frozen from xxHash 0.8.0 on; older headers hash differently
# from the Python xxhash package, so they are never used.
XXH3_MIN_VERSION = (0, 8, 0)


def _xxhash_version(header: str) -> tuple[int, ...] | None:
    """(major, minor, release) from the XXH_VERSION_* macros of an xxhash.h."""
    text = Path(header).read_text(errors="replace")
    parts = [re.search(rf"#\s*define\s+XXH_VERSION_{part}\s+(\d+)", text) for part in ("MAJOR", "MINOR", "RELEASE")]
    return tuple(int(m.group(1)) for m in parts) if all(parts) else None


def _find_xxhash_include() -> str | None:
    """Directory holding a usable xxhash.h (XXH3-128 for prefix caching), if any.

    Without it the build still works: page hashes then go through the Python
    ``xxhash`` package, which computes the same values, one call per page.
    """
    mode = os.environ.get("PAGEDKV_XXHASH", "")
    if mode == "0":
        return None
    candidates = [os.environ.get("XXHASH_INCLUDE_DIR", ""), "/usr/include", "/usr/local/include",
                  "/opt/homebrew/include", os.path.join(sys.prefix, "include")]
    rejected = []
    for directory in candidates:
        header = os.path.join(directory, "xxhash.h") if directory else ""
        if header and os.path.isfile(header):
            version = _xxhash_version(header)
            if version is not None and version >= XXH3_MIN_VERSION:
                print(f"pagedkv: XXH3-128 compiled in from {header} (xxHash {'.'.join(map(str, version))})",
                      file=sys.stderr)
                return directory
            rejected.append(f"{header} (version {version})")
    if mode == "1":
        raise SystemExit(
            "PAGEDKV_XXHASH=1 but no xxhash.h >= 0.8.0 was found (install libxxhash-dev / xxhash-devel / "
            f"xxhash-dev, or set XXHASH_INCLUDE_DIR); looked in {[c for c in candidates if c]}, "
            f"rejected {rejected or 'nothing'}"
        )
    return None


XXHASH_INCLUDE = _find_xxhash_include()
# The system directory is searched anyway; naming it again can break #include_next.
EXTRA_INCLUDES = [XXHASH_INCLUDE] if XXHASH_INCLUDE not in (None, "/usr/include") else []

define_macros = [
    ("NPY_NO_DEPRECATED_API", "NPY_2_0_API_VERSION"),
    ("PAGEDKV_HAVE_OPENMP", "1" if OPENMP else "0"),
    ("PAGEDKV_HAVE_XXHASH", "1" if XXHASH_INCLUDE else "0"),
]

# Extra C sources per module (hand-written kernels called from Cython).
EXTRA_SOURCES: dict[str, list[str]] = {
    "_attention": ["pagedkv_c/attention_kernels.c"],
}
# Hand-written C headers: rebuild on change and ship them in the sdist.
C_HEADERS = sorted(f"pagedkv_c/{h.name}" for h in (HERE / "pagedkv_c").glob("*.h"))

extensions = []
for pyx in sorted((HERE / "pagedkv_c").glob("*.pyx")):
    name = pyx.stem
    extensions.append(
        Extension(
            f"pagedkv_c.{name}",
            sources=[f"pagedkv_c/{pyx.name}", *EXTRA_SOURCES.get(name, [])],
            depends=C_HEADERS,
            include_dirs=[np.get_include(), "pagedkv_c", *EXTRA_INCLUDES],
            define_macros=define_macros,
            extra_compile_args=compile_args,
            extra_link_args=link_args,
        )
    )

directives = {
    "language_level": 3,
    "embedsignature": True,
    "cdivision": True,
    "boundscheck": DEBUG,
    "wraparound": DEBUG,
    "initializedcheck": DEBUG,
}

setup(
    ext_modules=cythonize(
        extensions,
        compiler_directives=directives,
        # Rebuild when the debug or sanitizer switch flips, even if sources did not change.
        force=DEBUG or SANITIZE,
    ),
)
