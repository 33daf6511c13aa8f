"""Breaks found by the fifteenth hostile pass (at 5d37161); each test failed before the fix:

- G03/G03q/G06/G07: a sentence-transformers pooling config (``1_Pooling/config.json``) that is
  a named pipe hung `index build --encoder` and `init --question-encoder`; its module path in
  modules.json was not kept inside the folder;
- G01/G02/G08/G40/G41: a modules.json whose "type" or "path" is no string: "unexpected
  error" (AttributeError, TypeError);
- G04/G05/G42/G13: a pooling config or a model.safetensors.index.json far past any real size
  was read whole;
- A16: a `--shard` build could start while a full build of the same --out imported its
  modules, between its --out lock and its staging lock (the runner now imports the command's
  module before it locks);
- V08: `--set train.foo.bar=1` beside `--max-steps 1` was blamed on `--max-steps 1`.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from conftest import one_error, run_cli


@pytest.fixture(scope="module")
def st_encoder(tmp_path_factory):
    """A tiny encoder laid out as sentence-transformers saves one (mean pooling)."""
    from utils import save_tiny_bert

    root = tmp_path_factory.mktemp("enc15")
    folder = save_tiny_bert(root, ["paris", "seine", "rome", "tiber", "river"])
    (root / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling",
         "type": "sentence_transformers.models.Pooling"},
    ]))
    (root / "1_Pooling").mkdir()
    (root / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    return folder


def _copy(st_encoder, tmp_path):
    folder = tmp_path / "enc"
    shutil.copytree(st_encoder, folder)
    return folder


def _build(world, folder, tmp_path):
    return run_cli("index", "build", "--passages", world["passages"], "--encoder", folder,
                   "--out", tmp_path / "kb", "--no-progress")


def test_the_sentence_transformers_layout_still_sets_mean_pooling(st_encoder):
    from rag_fast.retrieval.encoders import sentence_transformers_pooling
    from pathlib import Path

    assert sentence_transformers_pooling(Path(st_encoder)) == ("mean", False)


def test_a_pipe_as_the_pooling_config_is_refused_not_waited_on(world, st_encoder, tmp_path):
    folder = _copy(st_encoder, tmp_path)
    (folder / "1_Pooling" / "config.json").unlink()
    os.mkfifo(folder / "1_Pooling" / "config.json")
    done = subprocess.run([sys.executable, "-m", "rag_fast.cli", "index", "build", "--passages",
                           str(world["passages"]), "--encoder", str(folder), "--out",
                           str(tmp_path / "kb"), "--no-progress"],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    # (cwd outside the checkout: the child imports the installed rag_fast, as this process does)
    line = one_error(done.returncode, done.stderr, "encoder", str(folder), "config.json")
    assert "not a regular file" in line
    assert not (tmp_path / "kb").exists()


@pytest.mark.parametrize("modules", [
    [{"type": 5, "path": "1_Pooling"}], [{"type": "x.Pooling", "path": None}],
    [{"type": ["Pooling"]}], {"type": "x.Pooling"}, [3]])
def test_a_modules_json_of_the_wrong_shape_is_one_line(world, st_encoder, tmp_path, modules):
    folder = _copy(st_encoder, tmp_path)
    (folder / "modules.json").write_text(json.dumps(modules))
    code, err = _build(world, folder, tmp_path)
    one_error(code, err, "encoder", str(folder), "modules.json")
    code, err = run_cli("init", "--question-encoder", folder, "--generator",
                        world["root"] / "g.json", "--generator-tokenizer", st_encoder,
                        "--out", tmp_path / "m")
    one_error(code, err, "--question-encoder", str(folder), "modules.json")


def test_a_pooling_module_out_of_the_folder_is_refused(world, st_encoder, tmp_path):
    folder = _copy(st_encoder, tmp_path)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    (folder / "modules.json").write_text(json.dumps(
        [{"type": "sentence_transformers.models.Pooling", "path": "../elsewhere"}]))
    code, err = _build(world, folder, tmp_path)
    one_error(code, err, "encoder", str(folder), "out of the folder")


@pytest.mark.parametrize("file", ["1_Pooling/config.json", "model.safetensors.index.json"])
def test_a_huge_pooling_config_or_weights_index_is_refused_unread(world, st_encoder, tmp_path,
                                                                   file):
    from rag_fast.storage import MAX_JSON_FILE_BYTES

    folder = _copy(st_encoder, tmp_path)
    with open(folder / file, "ab") as f:
        f.truncate(MAX_JSON_FILE_BYTES + 1)
    code, err = _build(world, folder, tmp_path)
    line = one_error(code, err, "encoder", str(folder), file.split("/")[-1],
                     f"{MAX_JSON_FILE_BYTES + 1:,} bytes")
    assert "memory" not in line


def test_the_runner_imports_the_command_before_it_locks_the_output(monkeypatch, tmp_path):
    """A16: the import of the command's module (seconds on a busy machine) happens before the
    --out lock, so a full build takes its staging lock right after that one."""
    from rag_fast.cli import parsers, runner

    order = []
    load = parsers._Runs.load
    monkeypatch.setattr(parsers._Runs, "load", lambda self: order.append("load") or load(self))
    lock = runner.output_lock

    def output_lock(*args, **kwargs):
        order.append("lock")
        return lock(*args, **kwargs)

    monkeypatch.setattr(runner, "output_lock", output_lock)
    code, _ = run_cli("index", "build", "--passages", tmp_path / "missing.jsonl", "--encoder",
                      "e", "--out", tmp_path / "kb")
    assert code == 2 and order[:2] == ["load", "lock"], order


def test_an_unknown_key_a_set_made_names_that_set(world, tmp_path):
    code, err = run_cli("train", "--config", world["config"], "--max-steps", "1",
                        "--output-dir", tmp_path / "run", "--set", "train.foo.bar=1")
    line = one_error(code, err, "--set train.foo.bar=1", "'foo'")
    assert "--max-steps" not in line.split(": train:")[0], line
    assert not (tmp_path / "run").exists()
