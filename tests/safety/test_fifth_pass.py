"""Breaks found by the fifth hostile pass, one test each (they failed before the fix): reseal
sealing replaced weights whose record was removed by hand, --overwrite deleting a user's link
at a listed name, a killed writer's temporary left after the next write, error lines naming
no flag, and a full disk in training naming the temporary."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from conftest import one_error, run_cli


def _copy(src, tmp_path, name):
    dest = tmp_path / name
    shutil.copytree(src, dest)
    return dest


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


@pytest.mark.parametrize("name", ["model.safetensors", "config.json"])
def test_reseal_does_not_seal_weights_whose_record_was_removed(world, tmp_path, name):
    """R06: replace model.safetensors, delete its entry from rag_fast.json, reseal: the new
    weights were listed as a file added on purpose, sealed, and answered with."""
    model = _copy(world["model"], tmp_path, "m")
    side = model / "rag_fast.json"
    record = json.loads(side.read_text())
    del record["files"][name]
    side.write_text(json.dumps(record))
    with open(model / name, "ab") as f:
        f.write(b" ")
    code, err = run_cli("reseal", model)
    one_error(code, err, name, "a model's save always writes it")
    code, err = run_cli("generate", "--model", model, "--question", "x", "--max-new-tokens", "2")
    assert code == 2, err


def test_reseal_still_lists_a_file_added_on_purpose(world, tmp_path):
    model = _copy(world["model"], tmp_path, "m")
    (model / "README.md").write_text("my notes on this model")
    code, err = run_cli("reseal", model)
    assert code == 0, err
    assert "README.md" in json.loads((model / "rag_fast.json").read_text())["files"]


def test_overwrite_keeps_a_link_of_the_user_at_a_listed_name(world, tmp_path):
    """O22/O23: a link the user put at a file name the folder's marker lists was deleted by
    --overwrite (its target untouched)."""
    kb = _copy(world["kb"], tmp_path, "kb")
    outside = tmp_path / "outside.jsonl"
    outside.write_text("mine")
    store = kb / "passages"
    listed = sorted(p for p in store.iterdir() if p.name != "manifest.json")[0]
    listed.unlink()
    listed.symlink_to(outside)
    code, err = run_cli("index", "build", "--passages", world["passages"], "--encoder",
                        world["encoder"], "--out", kb, "--no-progress", "--max-length", "32",
                        "--overwrite")
    one_error(code, err, "did not write")
    assert listed.is_symlink() and outside.read_text() == "mine"


def test_the_next_write_removes_a_killed_writer_s_temporary(world, tmp_path):
    """KL04: after a SIGKILL, the next `generate --out` into the same folder left the dead
    writer's NAME.tmp-PID behind."""
    out = tmp_path / "a.jsonl"
    dead = _dead_pid()
    stale = tmp_path / f"a.jsonl.tmp-{dead}-0123abcd"
    stale.write_text('{"question"')
    alive = tmp_path / "a.jsonl.tmp-1-0123abcd"  # (process 1 is alive)
    alive.write_text("a live writer's")
    # sixth pass, O01: a user's file that only looks like one (no random tag) stays
    lookalike = tmp_path / f"a.jsonl.tmp-{dead}"
    lookalike.write_text("my draft")
    code, err = run_cli("generate", "--model", world["model"], "--question", "x",
                        "--max-new-tokens", "2", "--out", out, "--no-progress")
    assert code == 0, err
    assert not stale.exists() and alive.exists() and out.is_file()
    assert lookalike.read_text() == "my draft"


@pytest.mark.parametrize("plant", ["fifo", "dev-zero", "index-folder"])
def test_generate_tokenizer_that_is_no_tokenizer_names_the_flag(world, tmp_path, plant):
    """V42-V44: transformers' connection message or its backend-tokenizer message, naming no
    flag."""
    if plant == "fifo":
        tok = tmp_path / "fifo"
        os.mkfifo(tok)
    elif plant == "dev-zero":
        tok = tmp_path / "zero"
        tok.symlink_to("/dev/zero")
    else:
        tok = world["kb"]
    code, err = run_cli("generate", "--model", world["model"], "--question", "x",
                        "--max-new-tokens", "2", "--tokenizer", tok)
    one_error(code, err, "--tokenizer")


def test_generate_seed_past_64_bits_names_the_flag(world):
    """V49: "Overflow when unpacking long long"."""
    code, err = run_cli("generate", "--model", world["model"], "--question", "x",
                        "--max-new-tokens", "2", "--do-sample", "--seed", str(10**20))
    one_error(code, err, "--seed", "2**63")


def test_a_full_disk_in_training_names_the_checkpoint_not_its_temporary(world, real_disk):
    """F-r-0: the one line named checkpoint-last.pt.tmp-PID."""
    out = real_disk.path / "r"
    code, err = run_cli("train", "--config", world["config"], "--model", world["model"],
                        "--output-dir", out, "--set", "train.progress=false")
    line = one_error(code, err)
    assert ".tmp-" not in line, line


def test_a_nan_in_the_training_sample_is_named_by_its_corpus_row():
    """An IVF build checks its k-means sample first: the row it named was the sample's, not
    the corpus row holding the NaN (a merge names the staged shard and row from it)."""
    import numpy as np

    from rag_fast.retrieval import DenseIndex
    from rag_fast.retrieval.inputs import NonFiniteError

    x = np.random.default_rng(0).standard_normal((4000, 8)).astype(np.float32)
    x[3777, 5] = np.nan
    with pytest.raises(NonFiniteError, match=r"\(row 3777\)") as info:
        DenseIndex.build(x, "IVF16,Flat", progress=False)
    assert info.value.row == 3777
