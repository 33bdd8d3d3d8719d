"""The scripts the README runs as programs are executable, in the checkout and in git."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROGRAMS = ["scripts/check_wheel.sh", "scripts/redis_cluster.sh"]


@pytest.mark.skipif(not (ROOT / "scripts").is_dir(), reason="scripts/ is not beside the tests (installed-wheel run)")
@pytest.mark.parametrize("program", PROGRAMS)
def test_script_is_executable_with_a_shebang(program):
    path = ROOT / program
    assert path.read_text(encoding="utf-8").startswith("#!"), f"{program} has no #! line"
    if sys.platform != "win32":
        assert os.stat(path).st_mode & 0o111 == 0o111, f"{program} is not executable (chmod +x)"


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(),
                    reason="not a git checkout (sdist or installed-wheel run): no index to read the mode from")
@pytest.mark.parametrize("program", PROGRAMS)
def test_script_is_executable_in_the_git_index(program):
    """A fresh clone gets the mode recorded in git (100755), whatever this checkout's file mode."""
    listing = subprocess.run(["git", "-C", str(ROOT), "ls-files", "--stage", "--", program],
                             capture_output=True, text=True, check=True).stdout
    assert listing, f"{program} is not tracked by git"
    assert listing.split()[0] == "100755", f"{program} is stored as {listing.split()[0]}; git update-index --chmod=+x"
