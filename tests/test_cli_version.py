"""``pagedkv --version`` prints the package version and exits 0."""
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import pagedkv
from pagedkv.cli import main

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def test_version_flag_prints_the_package_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out == f"pagedkv {pagedkv.__version__}\n"


def test_version_flag_through_python_dash_m():
    # -P: a checkout in the working directory must not shadow the package under test.
    out = subprocess.run([sys.executable, "-P", "-m", "pagedkv", "--version"], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == f"pagedkv {pagedkv.__version__}"


@pytest.mark.skipif(not PYPROJECT.is_file(), reason="pyproject.toml is not beside the tests")
def test_package_version_is_the_project_version():
    project = tomllib.loads(PYPROJECT.read_text(encoding="utf-8"))["project"]
    assert pagedkv.__version__ == project["version"]
