"""Type stubs of the compiled core, checked with mypy against the installed package.

mypy runs in a subprocess from a temporary directory, so it resolves
``pagedkv`` and ``pagedkv_c`` the way a user's type checker would: from
site-packages (PEP 561: ``py.typed`` plus the ``.pyi`` stubs shipped in the
wheel). An editable install keeps the packages in the source tree, where mypy
cannot follow the import hook, so their source directories are then passed
through MYPYPATH instead.
"""
import importlib
import importlib.machinery
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import types
from pathlib import Path

import pytest

import pagedkv
import pagedkv_c

HERE = Path(__file__).resolve().parent
# Compiled modules with no Python-level API (only cdef functions), hence no stub.
NO_PYTHON_API: set[str] = set()


def _mypy_env():
    paths = sysconfig.get_paths()
    site_dirs = {Path(paths["purelib"]).resolve(), Path(paths["platlib"]).resolve()}
    roots = []
    for package in (pagedkv, pagedkv_c):
        root = Path(package.__file__).resolve().parent.parent
        if root not in site_dirs and str(root) not in roots:
            roots.append(str(root))
    env = {k: v for k, v in os.environ.items() if k != "MYPYPATH"}
    if roots:
        env["MYPYPATH"] = os.pathsep.join(roots)
    return env


@pytest.fixture(scope="module")
def run_mypy(tmp_path_factory):
    """Run ``mypy --strict`` on files in a scratch directory; share one cache."""
    work = tmp_path_factory.mktemp("mypy")
    env = _mypy_env()

    def run(*files):
        cmd = [sys.executable, "-m", "mypy", "--strict", "--no-color-output", "--no-error-summary",
               "--cache-dir", str(work / ".mypy_cache"), *files]
        return subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=900)

    run.work = work
    return run


def test_typing_example_passes_mypy_strict(run_mypy):
    shutil.copy(HERE / "typing_example.py", run_mypy.work)
    result = run_mypy("typing_example.py")
    assert result.returncode == 0, f"mypy --strict failed:\n{result.stdout}{result.stderr}"


def test_typing_example_runs():
    """The example's runtime asserts hold: the stubs' dtypes are the real ones."""
    example = importlib.import_module("typing_example")
    example.main()


def _public_names():
    """(expression, runtime object) for every name in pagedkv.__all__, and the public
    names of modules listed there."""
    names = []
    for name in pagedkv.__all__:
        obj = getattr(pagedkv, name)
        names.append((f"pagedkv.{name}", obj))
        if isinstance(obj, types.ModuleType):
            inner = getattr(obj, "__all__", [n for n in vars(obj) if not n.startswith("_")])
            names += [(f"pagedkv.{name}.{n}", getattr(obj, n)) for n in inner]
    return names


def test_every_public_name_has_a_type(run_mypy):
    """mypy sees a real type (not Any, not an unannotated def) for each public name."""
    names = _public_names()
    source = "import pagedkv\n" + "".join(f"reveal_type({expr})\n" for expr, _ in names)
    (run_mypy.work / "reveal_public_api.py").write_text(source)
    result = run_mypy("reveal_public_api.py")
    revealed = {}
    for line in result.stdout.splitlines():
        match = re.match(r'reveal_public_api\.py:(\d+): note: Revealed type is "(.*)"$', line)
        if match:
            revealed[names[int(match.group(1)) - 2][0]] = match.group(2)
    errors = [line for line in result.stdout.splitlines() if ": error:" in line]
    assert not errors, "\n".join(errors)
    assert sorted(revealed) == sorted(expr for expr, _ in names), result.stdout
    untyped = {expr: t for expr, t in revealed.items() if t == "Any" or t.endswith("-> Any")}
    assert not untyped, f"public names without a stub or annotations: {untyped}"


def _compiled_modules():
    package_dir = Path(pagedkv_c.__file__).parent
    suffixes = tuple(importlib.machinery.EXTENSION_SUFFIXES)
    modules = sorted({p.name.split(".")[0] for p in package_dir.iterdir() if p.name.endswith(suffixes)})
    assert "_pool" in modules, f"no compiled modules found in {package_dir}"
    return package_dir, modules


def test_every_compiled_module_with_a_python_api_has_a_stub():
    package_dir, modules = _compiled_modules()
    missing = [m for m in modules if m not in NO_PYTHON_API and not (package_dir / f"{m}.pyi").is_file()]
    assert not missing, f"compiled modules without a .pyi stub in {package_dir}: {missing}"
    assert (package_dir / "py.typed").is_file()
    assert (Path(pagedkv.__file__).parent / "py.typed").is_file()


def test_stubs_match_the_compiled_modules(run_mypy):
    """mypy's stubtest: every public runtime name is in a stub, with the same parameters."""
    package_dir, modules = _compiled_modules()
    stubbed = [f"pagedkv_c.{m}" for m in modules if (package_dir / f"{m}.pyi").is_file()]
    # Python modules of the facade that carry a stub beside them (e.g. pagedkv/attention.pyi).
    facade_dir = Path(pagedkv.__file__).parent
    stubbed += [f"pagedkv.{'.'.join(stub.relative_to(facade_dir).with_suffix('').parts)}"
                for stub in sorted(facade_dir.rglob("*.pyi"))]
    cmd = [sys.executable, "-m", "mypy.stubtest", "--allowlist", str(HERE / "stubtest_allowlist.txt"),
           *stubbed]
    result = subprocess.run(cmd, cwd=run_mypy.work, env=_mypy_env(), capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, f"stubtest found differences:\n{result.stdout}{result.stderr}"
