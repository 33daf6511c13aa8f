"""One writer at a time: an output is locked while a command writes it; a second command given
the same output (by any path) is refused at once, naming the holder's process id; the lock goes
with its holder, killed or not.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import TESTS, one_line, run_cli, start_command

from rag_fast import storage


_HOLD = ("import sys, time; from rag_fast import storage\n"
         "with storage.output_lock(sys.argv[1]):\n"
         "    print('held', flush=True); time.sleep(60)\n")


def _holder(path: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", _HOLD, str(path)], cwd=TESTS, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout.readline().strip() == "held", proc.stderr.read()
    return proc


def test_a_second_writer_is_refused_at_once_naming_the_holder(world, tmp_path):
    out = tmp_path / "kb"
    holder = _holder(out)
    try:
        start = time.monotonic()
        code, err = run_cli("index", "build", "--passages", world["passages"], "--encoder",
                            world["encoder"], "--out", out, "--no-progress")
        assert time.monotonic() - start < 10
        assert code == 2, err
        line = one_line(err)
        assert f"process {holder.pid}" in line and "--out" in line and str(out) in line, line
        assert not out.exists()
        # the same folder by another path is the same lock
        (tmp_path / "link").symlink_to(tmp_path, target_is_directory=True)
        code, err = run_cli("init", "--index", world["kb"], "--generator", "g.json",
                            "--out", tmp_path / "link" / "kb")
        assert code == 2 and f"process {holder.pid}" in err, err
    finally:
        holder.kill()
        holder.communicate()
    # a killed holder's lock is gone with it
    code, err = run_cli("index", "build", "--passages", world["passages"], "--encoder",
                        world["encoder"], "--out", out, "--no-progress", "--max-length", "32")
    assert code == 0, err


@pytest.mark.parametrize("command", ["init", "eval", "generate", "index eval",
                                     "tokenizer fit", "reseal", "index search"])
def test_every_writing_command_takes_the_lock(world, tmp_path, command):
    out = tmp_path / "out"
    args = {"init": ["init", "--index", world["kb"], "--generator", "g.json", "--out", out],
            "eval": ["eval", "--data", world["dev"], "--model", world["model"], "--out", out],
            "generate": ["generate", "--model", world["model"], "--question", "q",
                         "--out", out],
            "index eval": ["index", "eval", "--data", world["dev"], "--index", world["kb"],
                           "--out", out],
            "tokenizer fit": ["tokenizer", "fit", "--passages", world["passages"],
                              "--vocab-size", "300", "--out", out],
            "reseal": ["reseal", out],
            "index search": ["index", "search", world["kb"], "q", "--out", out]}[command]
    holder = _holder(out)
    try:
        code, err = run_cli(*args)
    finally:
        holder.kill()
        holder.communicate()
    assert code == 2 and f"process {holder.pid}" in one_line(err), err


def test_two_trainings_into_one_folder(world, tmp_path):
    """The hostile pass: two `train --output-dir run` at once; the loser failed with a
    confusing missing-temporary-file error. Now the second is refused at once, naming the
    first, which goes on undisturbed (stopped here by Ctrl-C, its checkpoint intact)."""
    from rag_fast.training.checkpoint import load_checkpoint

    out = tmp_path / "run"
    args = ["train", "--config", world["config"], "--model", world["model"], "--output-dir",
            out, "--max-steps", "1000000", "--set", "train.checkpoint_every=5"]
    first = start_command(*args)
    try:
        deadline = time.monotonic() + 120
        while not (out / "checkpoint-last.json").exists() and time.monotonic() < deadline:
            assert first.poll() is None, first.communicate()
            time.sleep(0.2)
        second = start_command(*args)
        _, err2 = second.communicate(timeout=120)
        assert first.poll() is None  # still training
        first.send_signal(signal.SIGINT)
        _, err1 = first.communicate(timeout=120)
    finally:
        first.kill()
    assert second.returncode == 2, err2
    assert f"process {first.pid}" in one_line(err2), err2
    assert first.returncode == 130, err1
    assert "rag-fast: interrupted" in err1 and "Traceback" not in err1, err1
    assert load_checkpoint(str(out / "checkpoint-last.pt"))["state"]["step"] >= 5


def test_a_lock_folder_that_is_not_ours_is_refused(tmp_path, monkeypatch):
    import tempfile

    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path))
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / f"rag_fast-locks-{os.getuid()}").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(OSError, match="not a folder of this user's"):
        with storage.output_lock(tmp_path / "out"):
            pass
    assert list((tmp_path / "elsewhere").iterdir()) == []
