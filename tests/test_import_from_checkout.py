"""Importing pagedkv from the root of a source checkout that was installed, not built in place."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

import pagedkv
import pagedkv_c

BUILT_CORE = Path(pagedkv_c.__file__).resolve().parent
FACADE = Path(pagedkv.__file__).resolve().parent
COMPILED = ("*.so", "*.pyd")


def test_unbuilt_source_directory_defers_to_the_installed_core(tmp_path):
    # An installed copy (compiled core + facade) in its own site directory ...
    site = tmp_path / "site"
    shutil.copytree(BUILT_CORE, site / "pagedkv_c", ignore=shutil.ignore_patterns("__pycache__", "build"))
    shutil.copytree(FACADE, site / "pagedkv", ignore=shutil.ignore_patterns("__pycache__"))
    # A repaired wheel keeps bundled libraries (libgomp) beside the packages, found by rpath.
    bundled = BUILT_CORE.parent / "pagedkv.libs"
    if bundled.is_dir():
        shutil.copytree(bundled, site / "pagedkv.libs")
    # ... and a checkout root whose pagedkv_c holds sources only, as after `pip install .`.
    checkout = tmp_path / "checkout"
    shutil.copytree(BUILT_CORE, checkout / "pagedkv_c",
                    ignore=shutil.ignore_patterns(*COMPILED, "__pycache__", "build"))
    # -S: no site hooks (an editable install's finder would hide the shadowing);
    # the checkout root comes first on sys.path, as with `python -c` run there.
    numpy_site = Path(np.__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), str(numpy_site)]))
    code = ("import pagedkv, pagedkv_c._pool as p; "
            "c = pagedkv.KVCache(1, 1, 4, 4); c.add_sequence(0); print(c.append([0], [3]).tolist()); "
            "print(p.__file__)")
    done = subprocess.run([sys.executable, "-S", "-c", code], cwd=checkout, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    slots, module_file = done.stdout.splitlines()
    assert slots == "[0, 1, 2]"
    assert Path(module_file).resolve().is_relative_to(site / "pagedkv_c")
