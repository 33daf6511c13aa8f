"""Breaks found by the eighth hostile pass outside `rag-fast serve` (whose own is in
tests/serving/test_answerer.py), one test each; they failed before the fix: a resumed run's
metrics file opened unchecked, a Ctrl-C lost in a progress bar's finalizer, and a Ctrl-C after
`index search --out` or `index eval --out` wrote saying nothing was written."""
from __future__ import annotations

import json
import os

import pytest

from conftest import one_error, run_cli


@pytest.fixture
def trained_run(world, tmp_path):
    """A finished 2-step run of the world's model (its checkpoint and metrics.jsonl)."""
    out = tmp_path / "run"
    code, err = run_cli("train", "--config", world["config"], "--model", world["model"],
                        "--output-dir", out)
    assert code == 0, err
    assert (out / "metrics.jsonl").is_file()
    return out


def _resume(world, out):
    return run_cli("train", "--config", world["config"], "--model", world["model"],
                   "--output-dir", out, "--max-steps", "3")


def test_a_resumed_runs_metrics_file_that_is_a_pipe_is_refused(world, trained_run):
    """T16: a named pipe in place of metrics.jsonl made the resumed run wait forever."""
    metrics = trained_run / "metrics.jsonl"
    metrics.unlink()
    os.mkfifo(metrics)
    code, err = _resume(world, trained_run)
    one_error(code, err, "train.metrics_file", "metrics.jsonl", "is a named pipe")


def test_a_resumed_runs_metrics_file_past_the_bound_is_refused(world, trained_run,
                                                               monkeypatch):
    """F10: a 20 GB sparse metrics.jsonl was read whole, and the error named --batch-size."""
    from rag_fast.training import trainer

    monkeypatch.setattr(trainer, "MAX_METRICS_BYTES", 64)  # the file holds more already
    code, err = _resume(world, trained_run)
    one_error(code, err, "train.metrics_file", "metrics.jsonl", "more than a run's metrics")
    assert json.loads((trained_run / "checkpoint-last.json").read_text())  # kept


def test_a_ctrl_c_inside_a_progress_bars_finalizer_is_not_lost(world, tmp_path, monkeypatch):
    """R-X06: a Ctrl-C that reached `generate --out` while its progress bar was being
    finalised printed "Exception ignored in tqdm.__del__ ... KeyboardInterrupt" and exited 0."""
    from rag_fast.cli import generate

    class Bar(generate.tqdm):
        def __del__(self):  # where the signal landed: Python cannot raise from here
            raise KeyboardInterrupt

    monkeypatch.setattr(generate, "tqdm", Bar)
    out = tmp_path / "a.jsonl"
    code, err = run_cli("generate", "--model", world["model"], "--question", "which river",
                        "--max-new-tokens", "2", "--device", "cpu", "--out", out)
    assert code == 130, err
    lines = [line for line in err.splitlines() if line.startswith("rag-fast")]
    assert lines[-1] == f"rag-fast: interrupted; the answers were written whole to {out}"
    assert "Exception ignored" not in err and "Traceback" not in err
    assert json.loads(out.read_text().splitlines()[0])["question"] == "which river"


def test_a_ctrl_c_after_index_search_wrote_its_file_says_so(world, tmp_path, monkeypatch):
    """X15: a Ctrl-C just after `index search --out` wrote said "nothing was written"."""
    from rag_fast.cli import index

    real = index.atomic_write_bytes

    def interrupted(path, data):
        real(path, data)
        raise KeyboardInterrupt

    monkeypatch.setattr(index, "atomic_write_bytes", interrupted)
    queries = tmp_path / "q.jsonl"
    queries.write_text(json.dumps({"question": "which river"}) + "\n")
    out = tmp_path / "found.jsonl"
    code, err = run_cli("index", "search", world["kb"], "--queries", queries, "--out", out)
    assert code == 130
    assert err.strip().splitlines() == [
        f"rag-fast: interrupted; the results were written whole to {out}"]
    assert json.loads(out.read_text())["question"] == "which river"


@pytest.mark.parametrize("when", ["after", "between"])
def test_a_ctrl_c_while_index_eval_writes_says_what_was_written(world, tmp_path, monkeypatch,
                                                                when):
    """X17: a Ctrl-C just after `index eval --out` wrote said "nothing was written"; one
    between its two files says which one is this run's."""
    from rag_fast.cli import index
    from rag_fast.evaluation import retrieval

    out = tmp_path / "ev"
    if when == "after":
        real = index.write_mode_reports

        def interrupted(*args, **kwargs):
            real(*args, **kwargs)
            raise KeyboardInterrupt

        monkeypatch.setattr(index, "write_mode_reports", interrupted)
    else:  # an earlier evaluation there; the Ctrl-C lands once retrieval.jsonl is replaced
        assert run_cli("index", "eval", "--data", world["dev"], "--index", world["kb"],
                       "--out", out)[0] == 0
        real = retrieval.atomic_write_bytes

        def interrupted(path, data):
            real(path, data)
            if str(path).endswith("retrieval.jsonl"):
                raise KeyboardInterrupt

        monkeypatch.setattr(retrieval, "atomic_write_bytes", interrupted)
    code, err = run_cli("index", "eval", "--data", world["dev"], "--index", world["kb"],
                        "--out", out)
    assert code == 130
    said = [line for line in err.splitlines() if line.startswith("rag-fast:")]
    if when == "after":
        assert said == [f"rag-fast: interrupted; the evaluation was written whole to {out}"]
        assert json.loads((out / "metrics.json").read_text())["questions"] == 8
    else:
        assert said == [f"rag-fast: interrupted; only {out / 'retrieval.jsonl'} of this run's "
                        "outputs were written"]


# ---- the pass's notes ---------------------------------------------------------------------

@pytest.mark.parametrize("where", ["inside", "outside"])
def test_a_linked_manifest_is_never_resealed_nor_loaded(world, tmp_path, where):
    """T47, T47c, T47d: `reseal` sealed a manifest.json or rag_fast.json that is a symbolic
    link to a regular file (replacing it, or leaving it pointing outside), and `index search`
    loaded an index through such a link, where `generate` and `serve` refuse it."""
    import shutil

    kb, model = tmp_path / "kb", tmp_path / "model"
    shutil.copytree(world["kb"], kb)
    shutil.copytree(world["model"], model)
    for folder, name in ((kb, "manifest.json"), (model, "rag_fast.json")):
        real = (folder / "real.json") if where == "inside" else (tmp_path / f"{folder.name}.json")
        (folder / name).rename(real)
        (folder / name).symlink_to(real)
        code, err = run_cli("reseal", folder)
        one_error(code, err, f"{folder / name} is a symbolic link", "not resealed")
        assert (folder / name).is_symlink()  # left as it was
    code, err = run_cli("index", "search", kb, "which river")
    one_error(code, err, f"{kb / 'manifest.json'} is a symbolic link")


def test_a_full_disk_without_inodes_says_so(tmp_path, monkeypatch):
    """F05-F09: a filesystem out of inodes said "no space left ... 52428800 free (50.0 MiB)",
    which reads as a contradiction."""
    import errno

    from rag_fast.storage import disk

    assert disk.inodes_free(tmp_path) is None or disk.inodes_free(tmp_path) > 0
    assert "inodes free" not in str(disk.NoSpaceError(tmp_path / "f", 10, 1 << 26))
    monkeypatch.setattr(disk, "inodes_free", lambda path: 0)
    message = str(disk.NoSpaceError(tmp_path / "f", 10, 1 << 26, errno.ENOSPC))
    assert message == (f"no space left on device writing {tmp_path / 'f'}: needs 10 bytes (0.0 "
                       "MiB), 67108864 free (64.0 MiB); no inodes free: the filesystem can hold "
                       "no more files")
    # ninth pass, R-F05: counted after the writer's temporaries were removed, a few are free
    monkeypatch.setattr(disk, "inodes_free", lambda path: 2)
    assert str(disk.NoSpaceError(tmp_path / "f", None, 1 << 26)).endswith(
        "67108864 free (64.0 MiB); only 2 inodes free: the filesystem can hold no more files")
    monkeypatch.setattr(disk, "inodes_free", lambda path: 10_000)
    assert "inodes free" not in str(disk.NoSpaceError(tmp_path / "f", None, 1 << 26))
