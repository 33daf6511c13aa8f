"""Breaks found by the seventh hostile pass outside `rag-fast serve` (whose own are in
tests/serving), one test each; they failed before the fix: an index manifest that is no
regular file or is missing lets another encoder's index answer, command-line text that is not
UTF-8, and a Ctrl-C after `generate --out` wrote its file."""
from __future__ import annotations

import json
import os
import shutil

import pytest

from conftest import one_error, run_cli


@pytest.fixture
def foreign_kb(world, tmp_path):
    """A copy of the world's index whose manifest names another encoder (resealed)."""
    kb = tmp_path / "kbe"
    shutil.copytree(world["kb"], kb)
    manifest = json.loads((kb / "manifest.json").read_text())
    manifest["encoder"]["name"] = "other/encoder"
    (kb / "manifest.json").write_text(json.dumps(manifest))
    code, err = run_cli("reseal", kb)
    assert code == 0, err
    return kb


def _generate(world, index):
    return run_cli("generate", "--model", world["model"], "--index", index, "--question",
                   "which river", "--max-new-tokens", "2", "--device", "cpu")


@pytest.mark.parametrize("plant", ["dev-zero", "folder", "fifo", "link-to-file"])
def test_an_index_manifest_that_is_no_regular_file_is_refused(world, tmp_path, plant):
    """S55, T01, T31, T32: `generate --index` served an index whose manifest.json was a link
    to /dev/zero, a folder or a pipe as one without a manifest (no encoder check)."""
    kb = tmp_path / "kbz"
    shutil.copytree(world["kb"], kb)
    manifest = kb / "manifest.json"
    (tmp_path / "copy.json").write_bytes(manifest.read_bytes())
    manifest.unlink()
    if plant == "dev-zero":
        manifest.symlink_to("/dev/zero")
    elif plant == "folder":
        manifest.mkdir()
    elif plant == "fifo":
        os.mkfifo(manifest)
    else:
        manifest.symlink_to(tmp_path / "copy.json")
    code, err = _generate(world, kb)
    one_error(code, err, "manifest.json", "refused")


def test_an_index_of_another_encoder_is_refused_with_or_without_its_manifest(world,
                                                                           foreign_kb):
    """S59, T02: deleting a foreign-encoder index's manifest.json let `generate --index` use
    it (the model's questions searched in another encoder's space)."""
    code, err = _generate(world, foreign_kb)
    one_error(code, err, "another encoder", "other/encoder")
    (foreign_kb / "manifest.json").unlink()
    code, err = _generate(world, foreign_kb)
    one_error(code, err, "records no encoder")


@pytest.mark.parametrize("text,word", [("\udcff where", "byte 0xff"),
                                       ("\udced\udca0\udc80", "byte 0xed")])
def test_command_line_text_that_is_not_utf8_is_one_line(world, text, word):
    """I01, I02, I11: `--question $'\\xff...'` and `index search KB $'\\xff...'` exited 1 with
    the tokenizer's TypeError."""
    code, err = run_cli("generate", "--model", world["model"], "--question", text,
                        "--max-new-tokens", "2", "--device", "cpu")
    one_error(code, err, "--question", "not valid UTF-8", word)
    code, err = run_cli("index", "search", world["kb"], text)
    one_error(code, err, "question", "not valid UTF-8", word)


def test_ctrl_c_after_generate_wrote_its_file_says_so(world, tmp_path, monkeypatch):
    """X06: a Ctrl-C just after `generate --out` renamed its file into place said "nothing
    was written"."""
    from rag_fast.storage import disk

    real = disk.fsync_dir

    def interrupted(folder):  # after the rename: the file is whole
        real(folder)
        raise KeyboardInterrupt

    monkeypatch.setattr(disk, "fsync_dir", interrupted)
    out = tmp_path / "a.jsonl"
    code, err = run_cli("generate", "--model", world["model"], "--question", "which river",
                        "--max-new-tokens", "2", "--device", "cpu", "--out", out,
                        "--no-progress")
    assert code == 130
    assert err.strip().splitlines() == [
        f"rag-fast: interrupted; the answers were written whole to {out}"]
    assert json.loads(out.read_text().splitlines()[0])["question"] == "which river"
