"""A training run writes only inside its output folder, each file once.

The files a config names (``train.metrics_file``, ``train.plot_file``, set in the file or by
``--set``) are paths inside ``output_dir``: an absolute path, ``..``, ``~``, a name the run
itself writes (the checkpoint and its manifest, the marker, ``model/``, ``index/``,
``index-refresh/``) or the other option's file is refused in one line naming the key, before
anything is written; a symbolic link planted in the run folder that leads out of it is refused
too. A checkpoint manifest is verified field by field: an edited one is refused, not ignored.
"""
from __future__ import annotations

import json
import re

import pytest

from conftest import one_error, run_cli, start_command

from rag_fast.training.checkpoint import CheckpointError, load_checkpoint


def _train(world, out, *extra):
    return run_cli("train", "--config", world["config"], "--model", world["model"],
                   "--output-dir", out, *extra)


@pytest.mark.parametrize("key,value", [
    ("train.plot_file", "../mine/photo.png"),   # the hostile pass: replaced the user's photo
    ("train.metrics_file", "../mine/a.txt"),    # appended a JSON line to the user's file
    ("train.metrics_file", "PLACEHOLDER_ABS"),  # an absolute path to the same file
    ("train.metrics_file", "~/.bashrc"),
    ("train.metrics_file", "logs/../../mine/a.txt"),
])
def test_a_config_path_out_of_the_run_is_refused(world, tmp_path, key, value, monkeypatch):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "photo.png").write_bytes(b"my photo")
    (mine / "a.txt").write_text("my text\n")
    value = str(mine / "a.txt") if value == "PLACEHOLDER_ABS" else value
    monkeypatch.chdir(tmp_path)  # ../mine from the run folder r/ is tmp_path/mine
    code, err = _train(world, "r", "--set", f"{key}={value}")
    one_error(code, err, key, "inside output_dir")
    assert (mine / "photo.png").read_bytes() == b"my photo"
    assert (mine / "a.txt").read_text() == "my text\n"
    assert not (tmp_path / "r").exists()  # refused before anything was written


@pytest.mark.parametrize("key,value,clash", [
    ("train.metrics_file", "checkpoint-last.json", "checkpoint-last"),  # the hostile pass
    ("train.metrics_file", "checkpoint-last.pt", "checkpoint-last"),
    ("train.metrics_file", "Checkpoint-Last.JSON", "checkpoint-last"),  # case-insensitive disks
    ("train.metrics_file", "rag_fast-output.json", "rag_fast-output.json"),
    ("train.metrics_file", "model/metrics.jsonl", "model"),
    ("train.plot_file", "index/plot.png", "index"),
    ("train.plot_file", "index-refresh/plot.png", "index-refresh"),
])
def test_a_config_path_onto_the_runs_own_files_is_refused(world, tmp_path, key, value, clash):
    code, err = _train(world, tmp_path / "r", "--set", f"{key}={value}")
    one_error(code, err, key, "would overwrite what the run itself writes", clash)
    assert not (tmp_path / "r").exists()


def test_metrics_and_plot_may_not_be_one_file(world, tmp_path):
    code, err = _train(world, tmp_path / "r", "--set", "train.metrics_file=logs/run.png",
                       "--set", "train.plot_file=./logs//run.png")
    one_error(code, err, "train.plot_file", "same file as metrics_file")


def test_a_config_file_naming_a_path_out_of_the_run_is_refused(world, tmp_path):
    """The same rule for a value in the config file itself (a shared config)."""
    config = json.loads(world["config"].read_text())
    config["train"]["metrics_file"] = "../../.bashrc"
    path = world["root"] / "hostile.json"
    path.write_text(json.dumps(config))
    code, err = run_cli("train", "--config", path, "--model", world["model"],
                        "--output-dir", tmp_path / "r")
    one_error(code, err, "metrics_file", str(path))


def test_a_subfolder_of_the_run_is_allowed(world, tmp_path):
    out = tmp_path / "r"
    code, err = _train(world, out, "--set", "train.metrics_file=logs/m.jsonl")
    assert code == 0, err
    assert len((out / "logs" / "m.jsonl").read_text().splitlines()) >= 2


def test_a_symbolic_link_in_the_run_folder_leading_out_is_refused(world, tmp_path):
    """A run folder resumed after someone planted a link where the metrics go: nothing is
    appended to the link's target."""
    out = tmp_path / "r"
    assert _train(world, out)[0] == 0
    target = tmp_path / "bashrc"
    target.write_text("mine\n")
    (out / "metrics.jsonl").unlink()
    (out / "metrics.jsonl").symlink_to(target)
    code, err = _train(world, out, "--max-steps", "3")
    one_error(code, err, "metrics.jsonl", "leads out of it")
    assert target.read_text() == "mine\n"


def test_a_symbolic_link_to_a_folder_in_the_run_is_refused(world, tmp_path):
    out = tmp_path / "r"
    assert _train(world, out)[0] == 0
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (out / "logs").symlink_to(elsewhere, target_is_directory=True)
    code, err = _train(world, out, "--max-steps", "3", "--set", "train.metrics_file=logs/m.jsonl")
    one_error(code, err, "logs/m.jsonl", "leads out of it")
    assert list(elsewhere.iterdir()) == []


# ---- the checkpoint's manifest ------------------------------------------------------------
@pytest.mark.parametrize("edit", [
    {"payload": "other.pt"},          # the hostile pass: an edited payload name was ignored
    {"payload": 7},
    {"extra": "field"},
    {"step": -1},
    {"step": True},
    {"size": 1.5},
    {"sha256": "not-a-digest"},
])
def test_an_edited_checkpoint_manifest_is_refused(world, tmp_path, edit):
    out = tmp_path / "r"
    assert _train(world, out)[0] == 0
    manifest = out / "checkpoint-last.json"
    record = json.loads(manifest.read_text())
    pure = dict(record)
    record.update(edit)
    if "step" in edit and edit["step"] is not True:
        pure = None  # the step is also checked against the payload
    manifest.write_text(json.dumps(record))
    with pytest.raises(CheckpointError):
        load_checkpoint(str(out / "checkpoint-last.pt"))
    code, err = _train(world, out, "--max-steps", "3")
    one_error(code, err, "checkpoint")
    if pure is not None:  # the untouched manifest is accepted again
        manifest.write_text(json.dumps(pure))
        load_checkpoint(str(out / "checkpoint-last.pt"))


def test_the_run_s_last_line_states_the_loss_unit(world, tmp_path, capsys):
    """The line that ends a run says what its loss is per (a newcomer could not tell)."""
    assert _train(world, tmp_path / "r")[0] == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert re.search(r"loss \d+\.\d{4} per question, \d+\.\d{4} per token", line), line


def test_a_checkpoint_past_the_file_size_limit_is_one_line(world, tmp_path):
    """The hostile pass: under `ulimit -f`, torch.save's writer failed with "unexpected pos"
    and the command took the "unexpected error, please report it" path."""
    import resource


    limit = 200 << 10  # bytes: less than the tiny model's checkpoint
    proc = start_command(
        "train", "--config", world["config"], "--model", world["model"], "--output-dir",
        tmp_path / "r",
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit)))
    _, err = proc.communicate(timeout=300)
    line = one_error(proc.returncode, err.strip().splitlines()[-1] if err.strip() else err,
                     "file too large writing", "checkpoint-last.pt", f"{limit} bytes",
                     "ulimit -f")
    assert "unexpected" not in err, line
    assert not list((tmp_path / "r").glob("*.tmp-*"))  # no temporary left behind


def test_one_run_file_inside_a_folder_named_like_the_other_is_refused(world, tmp_path):
    """The hostile pass: metrics_file p.png/m.jsonl beside plot_file p.png trained, then lost
    the plot to an IsADirectoryError."""
    code, err = _train(world, tmp_path / "r", "--set", "train.metrics_file=p.png/m.jsonl",
                       "--set", "train.plot_file=p.png")
    one_error(code, err, "plot_file", "metrics_file")
    assert not (tmp_path / "r").exists()


def test_ctrl_c_inside_a_library_write_stays_an_interrupt(tmp_path):
    """The hostile pass: Ctrl-C while torch.save wrote a checkpoint surfaced as torch's own
    RuntimeError ("unexpected pos") and an "unexpected error" (exit 1), not exit 130."""
    from rag_fast import storage

    with pytest.raises(KeyboardInterrupt):
        with storage.disk_errors(tmp_path / "x.pt"):
            try:
                raise KeyboardInterrupt
            finally:
                raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos")
