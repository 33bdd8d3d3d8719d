"""Build facts of the compiled core (OpenMP, XXH3 in C) and where it was imported from.

Packaging checks set expectations through the environment, so that a wheel
built without what its platform should have fails here:

PAGEDKV_EXPECT_OPENMP=0/1
    ``pagedkv.openmp_enabled()`` must say this.
PAGEDKV_EXPECT_INSTALLED=1
    ``pagedkv`` and ``pagedkv_c`` must be imported from this interpreter's
    site-packages (an installed wheel), not from a source tree.
"""
import importlib.machinery
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

import pagedkv
import pagedkv_c
from pagedkv_c import _build_info, _prefix


def _expected(name):
    value = os.environ.get(name)
    if value is None:
        pytest.skip(f"CI-only packaging check, not a misconfiguration: {name} is unset here; .ci/run, "
                    "scripts/check_wheel.sh and cibuildwheel (pyproject.toml) set it to 0 or 1, what an "
                    "installed build for their platform must report")
    assert value in ("0", "1"), f"{name} must be 0 or 1, got {value!r}"
    return value == "1"


def test_public_openmp_enabled_is_the_build_fact():
    assert pagedkv.openmp_enabled is _build_info.openmp_enabled
    assert isinstance(pagedkv.openmp_enabled(), bool)


def test_build_info_agrees_with_its_parts():
    info = pagedkv.build_info()
    assert set(info) == {"openmp", "openmp_version", "openmp_max_threads", "xxh3_in_c"}
    assert info["openmp"] is _build_info.openmp_enabled()
    assert info["xxh3_in_c"] is _prefix.xxh3_in_c()
    assert info["openmp_max_threads"] == _build_info.openmp_max_threads() >= 1
    if info["openmp"]:
        # _OPENMP is a yyyymm date; MSVC reports 200203 (OpenMP 2.0), GCC 201511 (4.5) or later.
        assert 199700 <= info["openmp_version"] <= 210012
    else:
        assert info["openmp_version"] == 0
        assert info["openmp_max_threads"] == 1


def test_openmp_runtime_honours_omp_num_threads():
    """OMP_NUM_THREADS reaches the OpenMP runtime the core links (a single-thread build reports 1)."""
    code = "from pagedkv_c._build_info import openmp_max_threads; print(openmp_max_threads())"
    env = dict(os.environ, OMP_NUM_THREADS="3")
    # -P: the working directory (maybe a checkout with its own pagedkv_c/) must not shadow the package.
    out = subprocess.run([sys.executable, "-P", "-c", code], env=env, capture_output=True, text=True, check=True)
    assert int(out.stdout) == (3 if pagedkv.openmp_enabled() else 1)


def test_openmp_matches_expectation():
    assert pagedkv.openmp_enabled() is _expected("PAGEDKV_EXPECT_OPENMP")


def test_xxh3_in_c_in_every_build():
    """XXH3-128 is part of the core (xxh3.h): no build, wheel or source, lacks it."""
    assert pagedkv.build_info()["xxh3_in_c"] is True


def test_imported_from_site_packages():
    """The tests exercise the installed wheel, not a checkout that shadows it."""
    if not _expected("PAGEDKV_EXPECT_INSTALLED"):
        pytest.skip("PAGEDKV_EXPECT_INSTALLED=0")
    paths = sysconfig.get_paths()
    site_dirs = {Path(paths["purelib"]).resolve(), Path(paths["platlib"]).resolve()}
    compiled = Path(_build_info.__file__)
    assert compiled.name.endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES)), compiled
    for name, path in [("pagedkv", pagedkv.__file__), ("pagedkv_c", pagedkv_c.__file__),
                       ("pagedkv_c._build_info", _build_info.__file__)]:
        location = Path(path).resolve()
        assert any(location.is_relative_to(site) for site in site_dirs), (
            f"{name} was imported from {location}, outside site-packages {sorted(map(str, site_dirs))}"
        )
