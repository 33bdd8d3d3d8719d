"""Build script: declares the compiled core (package ``pagedkv_c``) and its flags.

Environment switches
--------------------
PAGEDKV_DEBUG=1
    Turn Cython's bounds, wraparound and initialized checks back on and compile
    without optimisation (-O1 with PAGEDKV_SANITIZE), so that an out-of-range index
    inside the core raises IndexError instead of corrupting memory. Used once per CI run.
PAGEDKV_SANITIZE=1
    Compile and link the core with AddressSanitizer and UndefinedBehaviorSanitizer
    (GCC/Clang only; any undefined behaviour aborts). Python itself is not
    instrumented, so run it with the compiler's ASan runtime preloaded:
    ``LD_PRELOAD=$(gcc -print-file-name=libasan.so) ASAN_OPTIONS=detect_leaks=0``
    (see scripts/sanitize.sh). Combine with PAGEDKV_DEBUG=1 for the Cython checks.
PAGEDKV_OPENMP=0 / 1
    Force OpenMP off or on. Default: on with GCC/Clang on Linux and with MSVC on
    Windows, off on macOS (Apple Clang ships no OpenMP runtime).

Build speed
-----------
Cython translates the modules in parallel and ``build_ext`` compiles them in
parallel, one job per CPU (``os.cpu_count()``; ``build_ext -j N`` overrides),
and release builds carry no debug information (``-g0``: about a third less
compile time, smaller wheels). Installing again from the same checkout reuses
its generated C and compiled modules (see ``_use_current_c_files``).
"""

import json
import multiprocessing
import os
import sys
from pathlib import Path

import Cython
import numpy as np
from Cython.Build import cythonize
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

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
    compile_args = ["-O0", "-g"] if DEBUG else ["-O3", "-g0"]
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
        # -O1, also with PAGEDKV_DEBUG: readable reports at a bearable speed (at -O0 the
        # SIMD kernels keep every accumulator in memory: a real-model test of 16 sequences
        # took 120 s under ASan at -O0 against 31 s at -O1 on a 2-core AVX2 machine)
        compile_args[0] = "-O1"
        compile_args += [*sanitizers, "-fno-omit-frame-pointer", "-g"]
        link_args += sanitizers
if SANITIZE and IS_MSVC:
    raise SystemExit("PAGEDKV_SANITIZE=1 needs GCC or Clang")

define_macros = [
    ("NPY_NO_DEPRECATED_API", "NPY_2_0_API_VERSION"),
    ("PAGEDKV_HAVE_OPENMP", "1" if OPENMP else "0"),
]

# Extra C sources per module (hand-written kernels called from Cython).
EXTRA_SOURCES: dict[str, list[str]] = {
    "_attention": ["pagedkv_c/attention_kernels.c"],
    "_matmul": ["pagedkv_c/matmul_kernels.c"],
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
            include_dirs=[np.get_include(), "pagedkv_c"],
            define_macros=define_macros,
            extra_compile_args=compile_args,
            extra_link_args=link_args,
        )
    )


def _cython_jobs() -> int:
    """Worker processes for Cython's translation: one per CPU on Linux, else 0 (serial).

    cythonize starts its pool with multiprocessing's default start method;
    spawn and forkserver (the defaults on macOS and Windows, and on Linux from
    Python 3.14) would run this script again in every worker, so the pool is
    used only where fork can be made the start method before anything else
    chose one.
    """
    if not sys.platform.startswith("linux") or "fork" not in multiprocessing.get_all_start_methods():
        return 0
    if multiprocessing.get_start_method(allow_none=True) is None:
        multiprocessing.set_start_method("fork")
    return (os.cpu_count() or 1) if multiprocessing.get_start_method() == "fork" else 0


class ParallelBuildExt(build_ext):
    """build_ext that compiles the extension modules in parallel, one job per CPU by default."""

    def finalize_options(self):
        if self.parallel is None:
            self.parallel = os.cpu_count() or 1
        super().finalize_options()


directives = {
    "language_level": 3,
    "embedsignature": True,
    "cdivision": True,
    "boundscheck": DEBUG,
    "wraparound": DEBUG,
    "initializedcheck": DEBUG,
}

# What the generated C depends on besides the project's own .pyx/.pxd files,
# recorded by the last translation.
CYTHON_STAMP = HERE / "build" / "cython-stamp.json"
# The compiler flags are part of it: C files are translated again, and so compiled
# again, when a switch (debug, sanitizers, OpenMP) changes them.
CYTHON_INPUTS = json.dumps({"cython": Cython.__version__, "numpy": np.__version__, "directives": directives,
                            "compile_args": compile_args, "link_args": link_args,
                            "define_macros": define_macros}, sort_keys=True)


def _use_current_c_files(modules: list[Extension]) -> None:
    """Point each module whose generated C is current at that C file, so Cython skips it.

    Current: translated by this Cython, against this NumPy, with these
    directives (the stamp), after the last change to any .pyx/.pxd of
    pagedkv_c. Cython's own check would translate every module that cimports
    numpy again on each ``pip install``: build isolation installs NumPy's
    .pxd afresh, newer than the C files, and the C compiler then rebuilds
    those modules too.
    """
    own_sources = [*(HERE / "pagedkv_c").glob("*.pyx"), *(HERE / "pagedkv_c").glob("*.pxd")]
    newest_source = max(path.stat().st_mtime for path in own_sources)
    for module in modules:
        c_file = Path(module.sources[0]).with_suffix(".c")
        if (HERE / c_file).is_file() and (HERE / c_file).stat().st_mtime >= newest_source:
            module.sources[0] = c_file.as_posix()


# Translate everything again when the stamp differs (another Cython, NumPy,
# directives or compiler flags) and for every debug or sanitizer build.
STAMP_MATCHES = CYTHON_STAMP.is_file() and CYTHON_STAMP.read_text() == CYTHON_INPUTS
if STAMP_MATCHES and not (DEBUG or SANITIZE):
    _use_current_c_files(extensions)
ext_modules = cythonize(
    extensions,
    compiler_directives=directives,
    nthreads=_cython_jobs(),
    force=DEBUG or SANITIZE or not STAMP_MATCHES,
)
CYTHON_STAMP.parent.mkdir(exist_ok=True)
CYTHON_STAMP.write_text(CYTHON_INPUTS)

setup(
    ext_modules=ext_modules,
    cmdclass={"build_ext": ParallelBuildExt},
)
