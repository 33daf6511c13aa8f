"""No command destroys what it did not write.

Every command that writes a folder or file refuses: a folder that holds files rag_fast did
not write (even with ``--overwrite``), a folder of another kind, and an output that is,
contains or lies inside one of its inputs (before anything is read). ``--overwrite`` replaces
only a folder of the command's own kind; ``train`` resumes only its own runs and keeps every
line of ``metrics.jsonl`` it did not write.
"""
from __future__ import annotations

import json
import shutil

import pytest

from conftest import TOKENIZER, one_error, run_cli


def _init_args(world, out, *extra):
    return ["init", "--index", world["kb"], "--generator", world["root"] / "g.json",
            "--generator-tokenizer", TOKENIZER, "--n-docs", "2", "--max-context-length", "48",
            "--out", out, *extra]


def _build_args(world, passages, out, *extra):
    return ["index", "build", "--passages", passages, "--encoder", world["encoder"], "--out", out,
            "--no-progress", "--max-length", "32", *extra]


# ---- train -------------------------------------------------------------------------------
def test_train_refuses_a_folder_holding_foreign_files(world, tmp_path):
    """Probe 1: `rag-fast train --output-dir out` replaced out/model/ (deleting notes.txt) and
    kept only its own lines of out/metrics.jsonl."""
    out = tmp_path / "out"
    (out / "model").mkdir(parents=True)
    (out / "model" / "notes.txt").write_text("notes")
    (out / "metrics.jsonl").write_text("my line\n")
    code, err = run_cli("train", "--config", world["config"], "--model", world["model"],
                        "--output-dir", out)
    one_error(code, err, "--output-dir", "holds files rag_fast did not write")
    assert (out / "model" / "notes.txt").read_text() == "notes"
    assert (out / "metrics.jsonl").read_text() == "my line\n"
    assert sorted(p.name for p in out.iterdir()) == ["metrics.jsonl", "model"]


def test_train_refuses_a_folder_of_another_kind(world, tmp_path, copy_of):
    model = copy_of(world["model"])
    before = sorted(p.name for p in model.iterdir())
    code, err = run_cli("train", "--config", world["config"], "--model", world["model"],
                        "--output-dir", model)
    one_error(code, err, "is a model directory", "not a training run")
    assert sorted(p.name for p in model.iterdir()) == before


@pytest.mark.parametrize("where", ["model", "kb", "root"])
def test_train_refuses_an_output_that_is_contains_or_lies_inside_an_input(world, where):
    out = {"model": world["model"] / "run", "kb": world["kb"], "root": world["root"]}[where]
    before = sorted(p.name for p in world["root"].rglob("*"))
    code, err = run_cli("train", "--config", world["config"], "--model", world["model"],
                        "--index", world["kb"], "--output-dir", out)
    one_error(code, err, "--output-dir")
    assert sorted(p.name for p in world["root"].rglob("*")) == before


def test_train_resumes_its_own_run_and_keeps_lines_it_did_not_write(world, tmp_path):
    """A resumed run drops only its own records after the checkpoint's step; a line the user
    added to metrics.jsonl stays."""
    out = tmp_path / "run"
    code, err = run_cli("train", "--config", world["config"], "--model", world["model"],
                        "--output-dir", out)
    assert code == 0, err
    assert json.loads((out / "rag_fast-output.json").read_text())["kind"] == "rag_fast.train_run"
    metrics = out / "metrics.jsonl"
    ours = metrics.read_text().splitlines()
    assert len(ours) >= 2
    # a user's note, then a record of a step past the checkpoint (as a killed run leaves)
    metrics.write_text("\n".join(ours) + "\nmy note\n" + json.dumps({"step": 99}) + "\n")
    code, err = run_cli("train", "--config", world["config"], "--model", world["model"],
                        "--output-dir", out)
    assert code == 0, err
    lines = metrics.read_text().splitlines()
    assert "my note" in lines and json.dumps({"step": 99}) not in lines
    assert lines[:len(ours)] == ours


def test_train_resumes_a_run_of_an_earlier_version_without_a_marker(world, tmp_path):
    out = tmp_path / "run"
    assert run_cli("train", "--config", world["config"], "--model", world["model"],
                   "--output-dir", out)[0] == 0
    (out / "rag_fast-output.json").unlink()  # as an earlier rag_fast left it
    code, err = run_cli("train", "--config", world["config"], "--model", world["model"],
                        "--output-dir", out)
    assert code == 0, err
    assert (out / "rag_fast-output.json").is_file()


def test_config_output_dir_empty_string_is_refused(world, tmp_path):
    """Probe 9: "output_dir": "" was taken as the config file's folder."""
    config = json.loads(world["config"].read_text())
    config["train"]["output_dir"] = ""
    path = tmp_path / "c.json"
    path.write_text(json.dumps({**config, "data": {
        "train": str(world["train"]), "eval": str(world["dev"])}}))
    code, err = run_cli("train", "--config", path, "--model", world["model"])
    one_error(code, err, "train.output_dir")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.json"]


# ---- index build ---------------------------------------------------------------------------
def test_index_build_overwrite_never_deletes_its_inputs(world, tmp_path):
    """Probe 2: `--out data --overwrite` with --passages data/p.jsonl deleted data/."""
    data = tmp_path / "data"
    data.mkdir()
    shutil.copy(world["passages"], data / "p.jsonl")
    (data / "notes.txt").write_text("notes")
    code, err = run_cli(*_build_args(world, data / "p.jsonl", data, "--overwrite"))
    one_error(code, err, "--out", "contains --passages")
    assert sorted(p.name for p in data.iterdir()) == ["notes.txt", "p.jsonl"]
    # the output inside the encoder's folder
    code, err = run_cli(*_build_args(world, world["passages"], world["encoder"] / "kb"))
    one_error(code, err, "lies inside --encoder")
    assert not (world["encoder"] / "kb").exists()


def test_index_build_overwrite_replaces_only_an_index_directory(world, tmp_path):
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "thesis.tex").write_text("years of work")
    code, err = run_cli(*_build_args(world, world["passages"], foreign, "--overwrite"))
    one_error(code, err, "holds files rag_fast did not write", "even with --overwrite")
    assert (foreign / "thesis.tex").read_text() == "years of work"
    code, err = run_cli(*_build_args(world, world["passages"], world["model"], "--overwrite"))
    one_error(code, err, "is a model directory")
    # an empty folder is taken; an index directory is replaced with --overwrite only
    (tmp_path / "empty").mkdir()
    assert run_cli(*_build_args(world, world["passages"], tmp_path / "empty"))[0] == 0
    code, err = run_cli(*_build_args(world, world["passages"], tmp_path / "empty"))
    one_error(code, err, "already exists", "--overwrite")
    assert run_cli(*_build_args(world, world["passages"], tmp_path / "empty", "--overwrite"))[0] == 0


def test_index_build_keeps_a_staging_folder_it_did_not_write(world, tmp_path):
    staging = tmp_path / "kb.staging"
    staging.mkdir()
    (staging / "mine.txt").write_text("mine")
    code, err = run_cli(*_build_args(world, world["passages"], tmp_path / "kb"))
    one_error(code, err, "kb.staging", "did not write")
    assert (staging / "mine.txt").read_text() == "mine"


# ---- init ---------------------------------------------------------------------------------
def test_init_overwrite_never_deletes_the_index_it_reads(world, tmp_path, copy_of):
    """Probe 2: `init --index kb --out kb --overwrite` deleted the index it had just read."""
    kb = copy_of(world["kb"])
    before = sorted(str(p.relative_to(kb)) for p in kb.rglob("*"))
    args = _init_args(world, kb, "--overwrite")
    args[args.index("--index") + 1] = kb
    code, err = run_cli(*args)
    one_error(code, err, "--out", "is --index")
    assert sorted(str(p.relative_to(kb)) for p in kb.rglob("*")) == before


def test_init_overwrite_replaces_only_a_model_directory(world, tmp_path, copy_of):
    kb = copy_of(world["kb"])
    code, err = run_cli(*_init_args(world, kb, "--overwrite"))
    one_error(code, err, "is an index directory", "not a model directory")
    assert (kb / "manifest.json").is_file()
    model = copy_of(world["model"])
    code, err = run_cli(*_init_args(world, model))
    one_error(code, err, "already exists")
    assert run_cli(*_init_args(world, model, "--overwrite"))[0] == 0


def test_model_save_never_replaces_a_foreign_folder(world, tmp_path):
    from rag_fast.models import RagModel

    model = RagModel.load(str(world["model"]))
    (tmp_path / "notes.txt").write_text("notes")
    with pytest.raises(FileExistsError, match="holds files rag_fast did not write"):
        model.save(str(tmp_path))
    assert (tmp_path / "notes.txt").read_text() == "notes"


# ---- eval and generate ---------------------------------------------------------------------
def test_eval_out_refuses_foreign_folders_and_inputs(world, tmp_path):
    out = tmp_path / "e"
    out.mkdir()
    (out / "predictions.jsonl").write_text("mine\n")
    (out / "paper.md").write_text("mine")
    code, err = run_cli("eval", "--data", world["dev"], "--model", world["model"], "--out", out,
                        "--no-progress")
    one_error(code, err, "--out", "did not write")
    assert (out / "predictions.jsonl").read_text() == "mine\n"
    code, err = run_cli("eval", "--data", world["dev"], "--model", world["model"], "--out",
                        world["model"], "--no-progress")
    one_error(code, err, "--out", "is --model")
    ok = tmp_path / "ok"
    for _ in range(2):  # written, then written again into its own folder
        code, err = run_cli("eval", "--data", world["dev"], "--model", world["model"], "--out",
                            ok, "--no-progress")
        assert code == 0, err
    assert sorted(p.name for p in ok.iterdir()) == ["metrics.json", "predictions.jsonl",
                                                   "rag_fast-output.json"]


def test_generate_out_never_replaces_a_file_it_did_not_write(world, tmp_path):
    questions = tmp_path / "q.jsonl"
    questions.write_text(json.dumps({"question": "which river is paris on"}) + "\n")
    mine = tmp_path / "mine.jsonl"
    mine.write_text("my data\n")
    base = ["generate", "--model", world["model"], "--num-beams", "1", "--max-new-tokens", "2",
            "--no-progress"]
    code, err = run_cli(*base, "--questions", questions, "--out", mine)
    one_error(code, err, "--out", "not an answers file")
    assert mine.read_text() == "my data\n"
    code, err = run_cli(*base, "--questions", questions, "--out", questions)
    one_error(code, err, "--out", "is --questions")
    assert json.loads(questions.read_text()) == {"question": "which river is paris on"}
    answers = tmp_path / "a.jsonl"
    for _ in range(2):  # written, then replaced: it is rag-fast generate's own
        code, err = run_cli(*base, "--questions", questions, "--out", answers)
        assert code == 0, err
    assert json.loads(answers.read_text())["question"] == "which river is paris on"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.jsonl", "mine.jsonl", "q.jsonl"]


def test_a_symbolic_link_as_an_output_folder_is_refused(world, tmp_path):
    """Second hostile pass: `--out LINK` swapped the link itself for a new folder (leaving
    `.LINK.tmp-*` behind) and wrote nothing where it pointed."""
    from rag_fast.models import RagModel

    target = tmp_path / "target"
    target.mkdir()
    link = tmp_path / "link"
    link.symlink_to(target)
    code, err = run_cli(*_build_args(world, world["passages"], link))
    one_error(code, err, "--out", "symbolic link")
    code, err = run_cli(*_init_args(world, link, "--overwrite"))
    one_error(code, err, "--out", "symbolic link")
    with pytest.raises(FileExistsError, match="symbolic link"):
        RagModel.load(str(world["model"])).save(str(link))
    assert link.is_symlink() and sorted(p.name for p in tmp_path.iterdir()) == ["link", "target"]


def test_generate_out_keeps_a_question_answer_file_of_the_user(world, tmp_path):
    """Second hostile pass: a user's QA file (NQ-open style: "question" and "answer") was taken
    for an answers file of `rag-fast generate` and replaced."""
    gold = tmp_path / "gold.jsonl"
    gold.write_text(json.dumps({"question": "capital of france?", "answer": "paris"}) + "\n")
    code, err = run_cli("generate", "--model", world["model"], "--question", "q", "--out", gold,
                        "--num-beams", "1", "--max-new-tokens", "1", "--no-progress")
    one_error(code, err, "not an answers file")
    assert json.loads(gold.read_text()) == {"question": "capital of france?", "answer": "paris"}


def test_a_marker_vouches_only_for_the_kinds_its_file_holds(world, tmp_path):
    """Third hostile pass: a hand-made rag_fast-output.json naming kind "rag_fast.model" made
    `init --out --overwrite` delete the folder's files."""
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "rag_fast-output.json").write_text(json.dumps({"kind": "rag_fast.model"}))
    (folder / "thesis.txt").write_text("years of work")
    code, err = run_cli(*_init_args(world, folder, "--overwrite"))
    one_error(code, err, "did not write")
    assert (folder / "thesis.txt").read_text() == "years of work"


@pytest.mark.parametrize("which", ["kb", "model"])
def test_overwrite_keeps_files_added_to_a_folder_of_its_kind(world, copy_of, which):
    """Third hostile pass: an index or model directory holding the user's NOTES.md was replaced
    whole by --overwrite."""
    folder = copy_of(world[which])
    (folder / "NOTES.md").write_text("mine")
    args = (_build_args(world, world["passages"], folder, "--overwrite") if which == "kb" else
            _init_args(world, folder, "--overwrite"))
    code, err = run_cli(*args)
    one_error(code, err, "NOTES.md", "did not write")
    assert (folder / "NOTES.md").read_text() == "mine"


def test_train_marks_nothing_it_then_refuses(world, tmp_path):
    """Third hostile pass: a user folder with a stray checkpoint-last.json was taken for an
    earlier run: the marker was written before the refusal, and the next try trained there."""
    out = tmp_path / "mine"
    out.mkdir()
    (out / "checkpoint-last.json").write_text("{}")
    (out / "training.png").write_text("my plot")
    code, err = run_cli("train", "--config", world["config"], "--model", world["model"],
                        "--output-dir", out)
    one_error(code, err, "did not write")
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-last.json", "training.png"]
    (out / "model").mkdir()
    (out / "checkpoint-last.json").unlink()
    (out / "training.png").unlink()
    (out / "model" / "notes.txt").write_text("mine")  # a foreign model/: refused before training
    (out / "rag_fast-output.json").write_text(json.dumps({"kind": "rag_fast.train_run"}))
    code, err = run_cli("train", "--config", world["config"], "--model", world["model"],
                        "--output-dir", out)
    one_error(code, err, "model/")
    assert sorted(p.name for p in out.rglob("*")) == ["model", "notes.txt", "rag_fast-output.json"]


@pytest.mark.parametrize("added", [
    {"web/manifest.json": '{"name": "my app"}'},
    {"notes/manifest.json": '{"files": {"thesis.txt": {}}}', "notes/thesis.txt": "mine"},
    {".thesis.old-backup": "mine"},
    {"draft.tmp-2024": "mine"},
    {"link": None},
], ids=["foreign-manifest", "foreign-manifest-listing", "hidden-old", "tmp-like", "dir-link"])
def test_overwrite_takes_no_lookalike_for_its_own_file(world, copy_of, added):
    """Final hostile pass: a user's manifest.json in a subfolder, and names that looked like
    rag_fast's temporaries, were deleted by --overwrite as rag_fast's own."""
    kb = copy_of(world["kb"])
    for name, text in added.items():
        (kb / name).parent.mkdir(parents=True, exist_ok=True)
        if text is None:  # a link to a folder of the user's
            (kb / name).symlink_to(world["root"], target_is_directory=True)
        else:
            (kb / name).write_text(text)
    code, err = run_cli(*_build_args(world, world["passages"], kb, "--overwrite"))
    one_error(code, err, "did not write")
    for name, text in added.items():
        assert (kb / name).is_symlink() if text is None else (kb / name).read_text() == text


def test_generate_out_keeps_an_empty_file_of_the_user(world, tmp_path):
    """The hostile pass: an empty file passed the answers-file check vacuously and was
    replaced."""
    mine = tmp_path / "user_empty.txt"
    mine.write_text("")
    code, err = run_cli("generate", "--model", world["model"], "--question", "q", "--out", mine)
    one_error(code, err, "--out", "empty file")
    assert mine.read_text() == ""
