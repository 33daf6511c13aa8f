"""Notes of the fifth hostile pass made into checks, one test each (they failed before the
fix), and the breaks of the sixth pass: a context length that leaves a decoder-only generator
no position for an answer, refused by ``init`` and named by ``generate``."""
from __future__ import annotations

import json

from conftest import TOKENIZER, one_error, run_cli

GPT2 = {"model_type": "gpt2", "n_embd": 16, "n_layer": 1, "n_head": 2, "n_positions": 64}


def test_init_refuses_a_context_that_fills_a_decoder_only_generators_positions(world, tmp_path):
    """V34: `init --max-context-length 1000` for a GPT-2 with 64 positions was accepted, and
    `generate` then said "use at most 1" although not even one token fitted."""
    (tmp_path / "g.json").write_text(json.dumps(GPT2))
    args = ["init", "--index", world["kb"], "--generator", tmp_path / "g.json",
            "--generator-tokenizer", TOKENIZER, "--n-docs", "2"]
    for length in ("64", "1000", str(10**11)):
        code, err = run_cli(*args, "--max-context-length", length, "--out", tmp_path / "m")
        one_error(code, err, "--max-context-length", "64 positions", "use at most 63")
        assert not (tmp_path / "m").exists()
    code, err = run_cli(*args, "--max-context-length", "48", "--out", tmp_path / "m")
    assert code == 0, err


def test_generate_names_a_model_whose_prompts_fill_the_positions(world, tmp_path):
    """A model folder made by the library with such a context length: `generate` says the
    prompts fill the positions (not "use at most 1")."""
    from rag_fast.models import RagModel

    (tmp_path / "g.json").write_text(json.dumps(GPT2))
    code, err = run_cli("init", "--index", world["kb"], "--generator", tmp_path / "g.json",
                        "--generator-tokenizer", TOKENIZER, "--n-docs", "2",
                        "--max-context-length", "32", "--out", tmp_path / "m")
    assert code == 0, err
    model = RagModel.load(str(tmp_path / "m"))
    model.replace(max_context_length=64).save(str(tmp_path / "m2"))
    code, err = run_cli("generate", "--model", tmp_path / "m2", "--question", "which river",
                        "--device", "cpu")
    one_error(code, err, "fill all 64 positions", "--max-context-length")


def _copy(src, tmp_path, name):
    import shutil

    dest = tmp_path / name
    shutil.copytree(src, dest)
    return dest


def test_reseal_does_not_seal_a_tokenizer_file_whose_record_was_removed(world, tmp_path):
    """T01-T03: an edited generator_tokenizer/tokenizer_config.json, its record deleted from
    rag_fast.json, was sealed by `reseal` and `generate` ran with it."""
    model = _copy(world["model"], tmp_path, "m")
    name = "generator_tokenizer/tokenizer_config.json"
    config = json.loads((model / name).read_text())
    config["model_max_length"] = 4
    (model / name).write_text(json.dumps(config))
    side = json.loads((model / "rag_fast.json").read_text())
    del side["files"][name]
    (model / "rag_fast.json").write_text(json.dumps(side))
    code, err = run_cli("reseal", model)
    one_error(code, err, "tokenizer_config.json", "always writes", "not resealed")
    assert name not in json.loads((model / "rag_fast.json").read_text())["files"]


def test_a_run_whose_marker_is_a_link_is_not_resumed(world, tmp_path):
    """T42: rag_fast-output.json as a link to another run's marker was taken as the run's."""
    config = json.loads(world["config"].read_text())
    config["data"] = {k: str(world["root"] / v) for k, v in config["data"].items()}
    (tmp_path / "c.json").write_text(json.dumps(config))
    first = tmp_path / "first"
    code, err = run_cli("train", "--config", tmp_path / "c.json", "--model", world["model"],
                        "--output-dir", first)
    assert code == 0, err
    second = _copy(first, tmp_path, "second")
    (second / "rag_fast-output.json").unlink()
    (second / "rag_fast-output.json").symlink_to(first / "rag_fast-output.json")
    before = (first / "rag_fast-output.json").read_bytes()
    code, err = run_cli("train", "--config", tmp_path / "c.json", "--model", world["model"],
                        "--output-dir", second, "--max-steps", "3")
    one_error(code, err, "rag_fast-output.json")
    assert (first / "rag_fast-output.json").read_bytes() == before


def test_a_run_file_named_like_a_temporary_is_refused(world, tmp_path):
    """O39: metrics_file=training.png.tmp-999999 was accepted, then removed by the plot's
    save as a dead writer's temporary: the run lost its metrics with exit status 0."""
    for value in ("training.png.tmp-999999", "logs/m.jsonl.tmp-1-0123abcd", ".x.new-5"):
        code, err = run_cli("train", "--config", world["config"], "--model", world["model"],
                            "--output-dir", tmp_path / "r", "--set",
                            f"train.metrics_file={value}")
        one_error(code, err, "metrics_file", "temporary")
        assert not (tmp_path / "r").exists()


def test_a_failed_shard_build_removes_the_staging_folder_it_created(world, tmp_path):
    """V43: a --shard build refused as empty left OUT.staging/ (key.json, passages/)."""
    code, err = run_cli("index", "build", "--passages", world["passages"], "--encoder",
                        world["encoder"], "--out", tmp_path / "kb", "--no-progress",
                        "--shard", "0/99999999999999999999")
    one_error(code, err, "empty")
    assert not (tmp_path / "kb.staging").exists() and not (tmp_path / "kb").exists()


def test_a_failed_shard_build_keeps_shards_staged_there(world, tmp_path):
    """A failed --shard build never removes what other shard builds staged."""
    base = ["index", "build", "--passages", world["passages"], "--encoder", world["encoder"],
            "--out", tmp_path / "kb", "--no-progress"]
    code, err = run_cli(*base, "--shard", "0/2")
    assert code == 0, err
    staged = sorted(p.name for p in (tmp_path / "kb.staging").iterdir())
    code, err = run_cli(*base, "--shard", "0/99999999999999999999")
    one_error(code, err, "empty")
    assert sorted(p.name for p in (tmp_path / "kb.staging").iterdir()) == staged


def test_a_staging_passages_link_is_named(world, tmp_path):
    """O40: OUT.staging/passages as a link to a user's folder: the line named the build's own
    temporary and no flag."""
    code, err = run_cli("index", "build", "--passages", world["passages"], "--encoder",
                        world["encoder"], "--out", tmp_path / "kb", "--no-progress",
                        "--shard", "0/2")
    assert code == 0, err
    staging = tmp_path / "kb.staging"
    import shutil

    shutil.rmtree(staging / "passages")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "note.txt").write_text("mine")
    (staging / "passages").symlink_to(tmp_path / "mine")
    code, err = run_cli("index", "build", "--passages", world["passages"], "--encoder",
                        world["encoder"], "--out", tmp_path / "kb", "--no-progress",
                        "--shard", "1/2")
    line = one_error(code, err, "--out's staging folder", "symbolic link")
    assert ".tmp-" not in line
    assert (tmp_path / "mine" / "note.txt").read_text() == "mine"


def test_ctrl_c_after_eval_wrote_its_folder_says_so(world, tmp_path, monkeypatch):
    """X22: a Ctrl-C once the evaluation was written said "nothing was written"."""
    from rag_fast.cli import eval as eval_command

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(eval_command, "_print_metrics", interrupted)
    out = tmp_path / "ev"
    code, err = run_cli("eval", "--data", world["dev"], "--model", world["model"], "--out", out,
                        "--max-new-tokens", "2", "--no-progress")
    assert code == 130
    assert err.strip().splitlines() == [
        f"rag-fast: interrupted; the evaluation was written whole to {out}"]
    assert (out / "metrics.json").is_file() and (out / "predictions.jsonl").is_file()


def test_the_busy_machine_notice_goes_to_stdout(capsys):
    """Sixth pass note: train's notice went to stderr (safety.md: stdout, with the log)."""
    from rag_fast.training import Trainer

    Trainer._say("other processes are using 1.0 of the cores", None, None)
    captured = capsys.readouterr()
    assert captured.err == "" and "other processes" in captured.out
