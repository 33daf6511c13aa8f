"""Ctrl-C at any moment: SIGINT while the command starts (importing torch) or works gives one
line and exit 130, never a traceback; a library user's process keeps Python's own handler.
(Ctrl-C while a training works: tests/safety/test_one_writer.py's two trainings.)
"""
from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from conftest import TESTS, one_line, start_command


@pytest.mark.parametrize("delay", [0.3, 0.8, 1.5])
def test_ctrl_c_while_the_command_starts_is_one_line_and_130(delay, tmp_path):
    """The hostile pass: Ctrl-C in the first seconds (while rag_fast imports torch) printed a
    17-54 line KeyboardInterrupt traceback."""
    proc = start_command("index", "build", "--passages", tmp_path / "p.jsonl", "--encoder", "x",
                  "--out", tmp_path / "kb")
    time.sleep(delay)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert one_line(err).startswith("rag-fast: interrupted"), err
    assert not (tmp_path / "kb").exists()


def test_a_library_user_keeps_python_s_handler():
    """(Python's handler, or SIG_IGN in a process a shell started in the background.)"""
    code = ("import signal; before = signal.getsignal(signal.SIGINT); import rag_fast; "
            "print(signal.getsignal(signal.SIGINT) is before)")
    out = subprocess.run([sys.executable, "-c", code], cwd=TESTS, capture_output=True,
                         text=True, check=True)
    assert out.stdout.strip() == "True"


def test_a_command_that_ignores_sigint_keeps_ignoring_it(tmp_path):
    """A command started in the background by a shell (SIGINT ignored) stays immune, as the
    shell meant: SIGINT does not end it."""
    proc = start_command("index", "build", "--passages", tmp_path / "p.jsonl", "--encoder", "x",
                         "--out", tmp_path / "kb",
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    time.sleep(0.8)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2 and "interrupted" not in err, err  # ran on to its own error
