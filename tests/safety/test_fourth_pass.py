"""Breaks found by the fourth hostile pass, one test each (they failed before the fix): JSON
nested too deeply in every file a command reads (Python's decoder recursed into an unexpected
RecursionError), and a reseal of an index manifest whose "parts" is not an object."""
from __future__ import annotations

import json
import shutil

import pytest

from conftest import TOKENIZER, one_error, run_cli

DEEP = '{"a":' * 50000 + "1" + "}" * 50000


@pytest.fixture(scope="module")
def fitted_tokenizer(world, tmp_path_factory):
    out = tmp_path_factory.mktemp("tok") / "tok"
    code, err = run_cli("tokenizer", "fit", "--passages", world["passages"], "--vocab-size",
                        "300", "--out", out)
    assert code == 0, err
    return out


def _copy(src, tmp_path, name):
    dest = tmp_path / name
    shutil.copytree(src, dest)
    return dest


@pytest.mark.parametrize("file,words", [
    ("manifest.json", "nested too deeply"),
    ("index/manifest.json", "index/manifest.json"),  # (the folder's manifest records its size)
])
def test_an_index_manifest_nested_too_deeply_is_one_line(world, tmp_path, file, words):
    kb = _copy(world["kb"], tmp_path, "kb")
    (kb / file).write_text(DEEP)
    code, err = run_cli("index", "search", kb, "river")
    one_error(code, err, words)


@pytest.mark.parametrize("file", ["rag_fast.json", "config.json"])
def test_a_model_file_nested_too_deeply_is_one_line_naming_it(world, tmp_path, file):
    model = _copy(world["model"], tmp_path, "m")
    (model / file).write_text(DEEP)
    code, err = run_cli("generate", "--model", model, "--question", "x", "--max-new-tokens",
                        "2")
    one_error(code, err, file, "nested too deeply")


def test_a_tokenizer_marker_nested_too_deeply_is_one_line(world, tmp_path, fitted_tokenizer):
    tok = _copy(fitted_tokenizer, tmp_path, "tok")
    (tok / "rag_fast-output.json").write_text(DEEP)
    code, err = run_cli("init", "--index", world["kb"], "--generator",
                        world["root"] / "g.json", "--generator-tokenizer", tok, "--out",
                        tmp_path / "out")
    one_error(code, err, "rag_fast-output.json", "nested too deeply")


def test_an_eval_folder_marker_nested_too_deeply_is_one_line(world, tmp_path):
    out = tmp_path / "ev"
    out.mkdir()
    (out / "rag_fast-output.json").write_text(DEEP)
    code, err = run_cli("eval", "--data", world["dev"], "--model", world["model"], "--out", out,
                        "--max-new-tokens", "2", "--no-progress")
    one_error(code, err, "--out", "holds files rag_fast did not write")
    assert (out / "rag_fast-output.json").read_text() == DEEP


def test_a_generator_file_nested_too_deeply_is_one_line_whatever_its_name(world, tmp_path):
    """`--generator deep.jsonl` (not named .json) is read by transformers as a model's config."""
    deep = tmp_path / "deep.jsonl"
    deep.write_text("[" * 100000)
    code, err = run_cli("init", "--index", world["kb"], "--generator", deep,
                        "--generator-tokenizer", TOKENIZER, "--out", tmp_path / "m")
    one_error(code, err, "--generator", "nested too deeply")


def test_a_set_value_nested_too_deeply_is_one_line(world, tmp_path, capsys):
    from rag_fast import cli

    with pytest.raises(SystemExit) as exit_:
        cli.main(["train", "--config", str(world["config"]), "--model", str(world["model"]),
                  "--output-dir", str(tmp_path / "r"), "--set", "train.lr=" + "[" * 100000])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith("rag-fast train: error: argument --set: ") and "nested too deeply" in err
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("parts", [5, 10**400, [1], "x"])
def test_reseal_refuses_an_index_manifest_whose_parts_is_no_object(world, tmp_path, parts):
    kb = _copy(world["kb"], tmp_path, "kb")
    manifest = kb / "manifest.json"
    record = json.loads(manifest.read_text())
    record["parts"] = parts
    manifest.write_text(json.dumps(record))
    before = manifest.read_bytes()
    code, err = run_cli("reseal", kb)
    one_error(code, err, "parts")
    assert manifest.read_bytes() == before


@pytest.mark.filterwarnings("ignore:.*has gold passage ids")  # (the dev file has none)
@pytest.mark.parametrize("command", ["eval", "index eval"])
def test_an_output_folder_written_again_keeps_a_link_planted_in_it(world, tmp_path, command):
    """An eval (or index eval) folder of rag_fast's own, one of whose files the user replaced by
    a symbolic link: writing it again replaced the link by a regular file (exit 0). It is
    refused now, naming the link, which stays."""
    out = tmp_path / "ev"
    args = (["eval", "--data", world["dev"], "--model", world["model"], "--max-new-tokens", "2",
             "--no-progress"] if command == "eval" else
            ["index", "eval", "--data", world["dev"], "--index", world["kb"]])
    code, err = run_cli(*args, "--out", out)
    assert code == 0, err
    victim = sorted(p for p in out.iterdir() if p.name != "rag_fast-output.json")[0]
    outside = tmp_path / "outside.txt"
    outside.write_text("mine")
    victim.unlink()
    victim.symlink_to(outside)
    code, err = run_cli(*args, "--out", out)
    one_error(code, err, "--out", "symbolic link", victim.name)
    assert victim.is_symlink() and outside.read_text() == "mine"
