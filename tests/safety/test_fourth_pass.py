"""Breaks found by the fourth hostile pass, one test each (they failed before the fix): JSON
nested too deeply in every file a command reads (Python's decoder recursed into an unexpected
RecursionError), and a reseal of an index manifest whose "parts" is not an object."""
from __future__ import annotations

import json
import shutil

import pytest

from conftest import TOKENIZER, one_error, run_cli

DEEP = '{"a":' * 50000 + "1" + "}" * 50000


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


@pytest.mark.parametrize("key", ["max_steps", "checkpoint_every", "warmup_steps"])
def test_a_step_count_no_checkpoint_could_record_is_refused(world, tmp_path, key):
    """`--set train.max_steps=99999999999999999999999` was accepted and trained until killed;
    a checkpoint's manifest records steps below 2**63."""
    code, err = run_cli("train", "--config", world["config"], "--model", world["model"],
                        "--output-dir", tmp_path / "r", "--set", f"train.{key}={10**23}")
    one_error(code, err, key, "2**63")
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("craft", ["objects", "other-dim", "nan", "not-npy"])
def test_a_crafted_staged_shard_with_a_forged_record_is_named(world, staged_shards, tmp_path,
                                                              craft):
    """A staged shard replaced by a crafted array whose record was forged to match (sizes,
    SHA-256, seal): the merge refused it in a line naming no file."""
    import hashlib

    import numpy as np

    from rag_fast.storage import sealed

    staging = tmp_path / "kb.staging"
    shutil.copytree(staged_shards, staging)
    shard, record = staging / "embeddings-0-of-2.npy", staging / "shard-0-of-2.json"
    rows, dim = np.load(shard).shape
    if craft == "objects":
        np.save(shard, np.array([{"a": 1}] * rows, dtype=object), allow_pickle=True)
    elif craft == "other-dim":
        np.save(shard, np.zeros((rows, dim + 3), dtype=np.float16))
    elif craft == "nan":
        values = np.zeros((rows, dim), dtype=np.float16)
        values[rows - 1, 2] = np.nan
        np.save(shard, values)
    else:
        shard.write_bytes(b"\x93NUMPY garbage" * 40)
    payload = json.loads(record.read_text())
    data = shard.read_bytes()
    payload["files"][shard.name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    record.write_text(json.dumps(sealed({k: v for k, v in payload.items() if k != "seal"})))
    code, err = run_cli("index", "build", "--passages", world["passages"], "--encoder",
                        world["encoder"], "--out", tmp_path / "kb", "--no-progress")
    one_error(code, err, str(shard))
    assert not (tmp_path / "kb").exists()


def test_an_eval_killed_while_writing_its_first_file_leaves_a_folder_a_rerun_takes(world,
                                                                                    tmp_path):
    """SIGKILLed while it wrote its marker, `eval` left --out holding only
    rag_fast-output.json.tmp-PID-HEX; every re-run refused the folder as holding files rag_fast
    did not write. A dead writer's temporary is rag_fast's: the re-run removes it and writes."""
    import subprocess
    import sys

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    out = tmp_path / "ev"
    out.mkdir()
    leftover = out / f"rag_fast-output.json.tmp-{dead.pid}-0123abcd"
    leftover.write_text('{"kind": "rag_fa')
    code, err = run_cli("eval", "--data", world["dev"], "--model", world["model"], "--out", out,
                        "--max-new-tokens", "2", "--no-progress")
    assert code == 0, err
    assert not leftover.exists() and (out / "metrics.json").is_file()


def test_a_live_writers_temporary_is_still_refused(world, tmp_path):
    import os

    out = tmp_path / "ev"
    out.mkdir()
    (out / f"rag_fast-output.json.tmp-{os.getpid()}-0123abcd").write_text("{}")
    code, err = run_cli("eval", "--data", world["dev"], "--model", world["model"], "--out", out,
                        "--max-new-tokens", "2", "--no-progress")
    one_error(code, err, "--out", "did not write")


def test_generate_out_that_is_a_link_is_refused_and_kept(world, tmp_path):
    """`generate --out LINK` (the user's link to an earlier answers file) replaced the link by
    a regular file."""
    answers = tmp_path / "a.jsonl"
    code, err = run_cli("generate", "--model", world["model"], "--question", "x",
                        "--max-new-tokens", "2", "--out", answers, "--no-progress")
    assert code == 0, err
    link = tmp_path / "link.jsonl"
    link.symlink_to(answers)
    before = answers.read_bytes()
    code, err = run_cli("generate", "--model", world["model"], "--question", "y",
                        "--max-new-tokens", "2", "--out", link, "--no-progress")
    one_error(code, err, "--out", "symbolic link")
    assert link.is_symlink() and answers.read_bytes() == before



@pytest.mark.parametrize("factory", ["IVF99999999,PQ64", "IVF4,Flat"])
def test_a_recorded_factory_that_does_not_describe_the_index_is_refused(world, tmp_path,
                                                                        factory):
    """T21d: an index manifest's factory edited (and resealed) to an IVF over an exact index
    loaded and searched, and `index info` reported the false factory."""
    kb = _copy(world["kb"], tmp_path, "kb")
    manifest = kb / "index" / "manifest.json"
    record = json.loads(manifest.read_text())
    assert "IVF" not in record["factory"]  # (the world's small corpus: exact search)
    record["factory"] = factory
    manifest.write_text(json.dumps(record))
    code, err = run_cli("reseal", kb)
    assert code == 0, err
    code, err = run_cli("index", "search", kb, "river")
    one_error(code, err, "factory", "no inverted file")


def test_reseal_refuses_a_pipe_added_to_a_model_folder(world, tmp_path):
    """M14: `reseal` said every seal matched while `generate` refused the pipe and told the user
    to list it with `reseal`: advice that looped."""
    import os

    model = _copy(world["model"], tmp_path, "m")
    os.mkfifo(model / "extra.json")
    code, err = run_cli("reseal", model)
    one_error(code, err, "extra.json", "not a regular file")


@pytest.mark.parametrize("plant", ["empty", "link"])
def test_index_search_out_keeps_an_empty_file_or_a_link_of_the_user(world, tmp_path, plant):
    """`index search --out` took an empty file of the user's for an earlier results file (no
    line to check) and replaced it, and replaced a link by a file; `generate --out` already
    refused both. One rule (storage.check_output_file) serves both commands now."""
    mine = tmp_path / "mine.jsonl"
    mine.write_text("")
    out = mine
    if plant == "link":
        out = tmp_path / "link.jsonl"
        out.symlink_to(mine)
    queries = tmp_path / "q.jsonl"
    queries.write_text('{"question": "which river is paris on"}\n')
    code, err = run_cli("index", "search", world["kb"], "--queries", queries, "--out", out)
    one_error(code, err, "--out")
    assert mine.read_text() == "" and out.is_symlink() == (plant == "link")


def _trained(world, out):
    code, err = run_cli("train", "--config", world["config"], "--model", world["model"],
                        "--output-dir", out)
    assert code == 0, err
    return out


@pytest.mark.parametrize("name", ["checkpoint-last.json", "checkpoint-last.pt"])
def test_a_pipe_in_a_checkpoint_file_s_place_is_named_as_one(world, tmp_path, name):
    """C16/C17: a FIFO as the checkpoint's manifest was "has no manifest", as its payload
    "is missing": true, but not what the user has to look at."""
    import os

    out = _trained(world, tmp_path / "r")
    (out / name).unlink()
    os.mkfifo(out / name)
    code, err = run_cli("train", "--config", world["config"], "--model", world["model"],
                        "--output-dir", out, "--max-steps", "3")
    one_error(code, err, name, "not a regular file")


def test_a_generator_that_is_a_device_is_named_as_one(world, tmp_path):
    """I42: `init --generator` a link to /dev/zero was "no model of that name could be
    loaded", with transformers' long message after it."""
    link = tmp_path / "zlink.jsonl"
    link.symlink_to("/dev/zero")
    code, err = run_cli("init", "--index", world["kb"], "--generator", link,
                        "--generator-tokenizer", TOKENIZER, "--out", tmp_path / "m")
    one_error(code, err, "--generator", "not a regular file")


def test_a_metrics_file_that_is_a_link_inside_the_run_is_named_as_one(world, tmp_path):
    """L02: a metrics.jsonl linked to a file inside the run was refused with the system's
    'Too many levels of symbolic links' (O_NOFOLLOW's ELOOP)."""
    out = _trained(world, tmp_path / "r")
    (out / "mine.jsonl").write_text("")
    (out / "metrics.jsonl").unlink()
    (out / "metrics.jsonl").symlink_to("mine.jsonl")
    code, err = run_cli("train", "--config", world["config"], "--model", world["model"],
                        "--output-dir", out, "--max-steps", "3", "--set", "train.progress=false")
    one_error(code, err, "metrics.jsonl", "is a symbolic link (to")
    assert (out / "metrics.jsonl").is_symlink() and (out / "mine.jsonl").read_text() == ""
