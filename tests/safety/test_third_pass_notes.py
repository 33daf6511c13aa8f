"""The notes of the third hostile pass, one test each (they failed before the fix): a full
build and --shard builds of one index never share its staging folder at once, `generate
--out` into a missing folder names --out, a crafted huge value is not echoed in full, and a
resume settles what a killed checkpoint save left."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import one_error, run_cli
from rag_fast import storage
from rag_fast.retrieval.bundle import staging_folder


def _build(world, out, *extra):
    return run_cli("index", "build", "--passages", world["passages"], "--encoder",
                   world["encoder"], "--out", out, "--no-progress", "--max-length", "32", *extra)


@pytest.mark.parametrize("held,extra,words", [
    # a full build held: a --shard build is refused (it found its staging discarded before)
    (False, ("--shard", "0/2"), "a full build of the same --out"),
    # --shard builds held: a full build neither discards nor removes their staging folder
    (True, (), "--shard builds of the same --out"),
])
def test_a_full_build_and_shard_builds_never_write_one_staging_at_once(world, tmp_path, held,
                                                                        extra, words):
    out = tmp_path / "kb"
    staging = staging_folder(out)
    with storage.shared_lock(staging, held, "staging", "the test"):
        code, err = _build(world, out, *extra)
    one_error(code, err, "--out's staging folder", words, f"process {os.getpid()}")
    assert not out.exists() and not staging.exists()


def test_shard_builds_share_their_staging_folder(world, tmp_path):
    out = tmp_path / "kb"
    with storage.shared_lock(staging_folder(out), True, "staging", "another shard"):
        code, err = _build(world, out, "--shard", "0/2")
    assert code == 0, err
    assert (staging_folder(out) / "shard-0-of-2.json").is_file()


@pytest.mark.parametrize("out,words", [
    ("missing/answers.jsonl", "its folder 'missing' does not exist"),
    ("answers.jsonl/", "ends with a path separator"),
    ("afile/answers.jsonl", "its folder 'afile' is a file, not a folder"),
])
def test_generate_out_in_no_folder_names_out_not_a_temporary(world, tmp_path, monkeypatch,
                                                             out, words):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("mine")
    code, err = run_cli("generate", "--model", world["model"], "--question", "x",
                        "--max-new-tokens", "2", "--out", out)
    line = one_error(code, err, f"--out {out!r}", words)
    assert ".tmp-" not in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


def test_generate_out_is_written_through_the_storage_layer(world, tmp_path, monkeypatch):
    """The answers file is an fsynced temporary renamed into place (storage.atomic_file)."""
    opened = []
    real = storage.atomic_file

    def spy(path, mode="w"):
        opened.append(os.fspath(path))
        return real(path, mode)

    monkeypatch.setattr("rag_fast.cli.generate.atomic_file", spy)
    out = tmp_path / "a.jsonl"
    code, err = run_cli("generate", "--model", world["model"], "--question", "x",
                        "--max-new-tokens", "2", "--out", out, "--no-progress")
    assert code == 0, err
    assert opened == [str(out)] and json.loads(out.read_text())["question"] == "x"
    assert [p.name for p in tmp_path.iterdir()] == ["a.jsonl"]


def _train(world, out, *extra):
    return run_cli("train", "--config", world["config"], "--model", world["model"],
                   "--output-dir", out, *extra)


@pytest.mark.parametrize("key,value", [("step", 10**400), ("size", 2**63),
                                       ("payload", "p" * 100_000)])
def test_a_crafted_huge_manifest_value_is_refused_and_not_echoed_in_full(world, tmp_path, key,
                                                                         value):
    out = tmp_path / "r"
    assert _train(world, out)[0] == 0
    manifest = out / "checkpoint-last.json"
    record = json.loads(manifest.read_text())
    record[key] = value
    manifest.write_text(json.dumps(record))
    code, err = _train(world, out, "--max-steps", "3")
    line = one_error(code, err, "checkpoint-last")
    assert "2**63" in line or key == "payload", line
    assert len(line.replace(str(out), "OUT")) < 400, line  # (it was 470 and 100,290)


def test_an_error_line_shortens_a_crafted_value_it_echoes():
    from rag_fast.cli import one_line

    line = one_line(ValueError(f"--data {'x' * 100_000!r} is not a file"))
    assert len(line) < 400 and line.startswith("--data 'xxx") and "characters" in line
    assert line.endswith("is not a file")


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_resume_removes_what_a_killed_save_left(world, tmp_path):
    """A save SIGKILLed while writing left a payload temporary (gigabytes for a large model)
    until the next save; a resume that saves nothing (the run is already at its last step)
    now removes it, and keeps a live writer's."""
    out = tmp_path / "r"
    assert _train(world, out)[0] == 0
    dead = out / f"checkpoint-last.pt.tmp-{_dead_pid()}"
    dead.write_bytes(b"\0" * 4096)
    alive = out / f"checkpoint-last.pt.tmp-{os.getpid()}"
    alive.write_bytes(b"\0")
    code, err = _train(world, out)  # max_steps 2: resumes at its last step, saves nothing
    assert code == 0, err
    assert not dead.exists() and alive.exists()


def test_a_resume_finishes_a_save_killed_between_its_renames(world, tmp_path):
    """Killed after the payload's rename and before the manifest's: the new payload's
    manifest is a temporary; the resume verifies against it and now renames it into place."""
    out = tmp_path / "r"
    assert _train(world, out, "--max-steps", "1")[0] == 0
    first = (out / "checkpoint-last.json").read_text()
    assert _train(world, out)[0] == 0
    second = out / "checkpoint-last.json"
    pending = out / f"checkpoint-last.json.tmp-{_dead_pid()}"
    second.rename(pending)
    second.write_text(first)  # the old manifest beside the new payload
    code, err = _train(world, out)
    assert code == 0, err
    assert not pending.exists() and json.loads(second.read_text())["step"] == 2
