"""Ctrl-C during a command: a one-line notice on stderr, exit status 130, no traceback."""
import os
import signal
import subprocess
import sys

import pytest

from pagedkv import cli
from pagedkv.commands import data as data_command


def test_keyboard_interrupt_in_a_command_returns_130_with_a_notice(monkeypatch, capsys):
    def interrupted(args):
        print("partial output")
        raise KeyboardInterrupt

    monkeypatch.setattr(data_command, "run", interrupted)  # the parser binds ``run`` when it is built
    assert cli.main(["data", "list"]) == 130
    captured = capsys.readouterr()
    assert captured.out == "partial output\n"  # what was printed before the interrupt stays
    assert captured.err == "\npagedkv data: interrupted\n"


# The child replaces the run of `pagedkv data list` with a wait, says so, and the test sends
# it a real SIGINT: the path a user's Ctrl-C takes through the interpreter into cli.main.
CHILD = """
import sys, time
from pagedkv import cli
from pagedkv.commands import data

def wait(args):
    print("ready", flush=True)
    time.sleep(60)
    return 0

data.run = wait
sys.exit(cli.main(["data", "list"]))
"""


@pytest.mark.skipif(os.name != "posix", reason="sends SIGINT with os.kill")
def test_sigint_exits_130_without_a_traceback():
    child = subprocess.Popen([sys.executable, "-P", "-c", CHILD], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "ready\n"
        child.send_signal(signal.SIGINT)
        out, err = child.communicate(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
            child.communicate()
    assert child.returncode == 130
    assert "Traceback" not in err
    assert err == "\npagedkv data: interrupted\n"
