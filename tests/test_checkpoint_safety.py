"""Trainer checkpoints are safe and verified (weights_only loading, SHA-256 manifest, atomic
writes), the metrics file and plot, question-encoder options, and TrainConfig validation."""
from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shlex
import subprocess
import sys
import warnings
from dataclasses import asdict, fields
from pathlib import Path

import numpy as np
import pytest
import torch

import rag_fast.training.plot as plot_module
from rag_fast.training import (CheckpointError, TrainConfig, Trainer, load_checkpoint, lr_lambda,
                               plot_training, resolve_device)
from test_training import collate, loss_fn, make_dataset, make_model, params
from test_training import config as make_config

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


class Killed(Exception):
    """Stands for a kill after a step (its metrics line written, its checkpoint maybe not)."""


class Exploit:
    """Unpickling this runs a shell command: a checkpoint from elsewhere must not."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {shlex.quote(self.marker)}",))


def trained(out_dir: Path, **kw) -> tuple[Trainer, str]:
    """A 2-step run checkpointed in ``out_dir``; returns the trainer and the checkpoint path."""
    trainer = Trainer(make_model(), make_dataset(), collate, loss_fn,
                      make_config(**{"max_steps": 2, "output_dir": str(out_dir), **kw}))
    trainer.train()
    return trainer, trainer.checkpoint_path()


def fresh(out_dir: Path, **kw) -> Trainer:
    return Trainer(make_model(), make_dataset(), collate, loss_fn,
                   make_config(**{"max_steps": 2, "output_dir": str(out_dir), **kw}))


def rewrite_manifest(path: str) -> None:
    """Forge the manifest so that it matches the payload as it is now."""
    manifest = path[:-len(".pt")] + ".json"
    record = json.loads(Path(manifest).read_text())
    data = Path(path).read_bytes()
    record.update(size=len(data), sha256=hashlib.sha256(data).hexdigest())
    Path(manifest).write_text(json.dumps(record))


def metrics_lines(out_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


# ------------------------------------------------------------------ integrity and safety
def test_checkpoint_files_and_manifest(tmp_path):
    trainer, path = trained(tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-last.json", "checkpoint-last.pt",
                                            "metrics.jsonl", "rag_fast-output.json",
                                            "training.png"]
    record = json.loads((tmp_path / "checkpoint-last.json").read_text())
    data = Path(path).read_bytes()
    assert record["size"] == len(data) and record["step"] == 2
    assert record["sha256"] == hashlib.sha256(data).hexdigest()
    torch.load(path, weights_only=True)  # tensors and plain data only
    ckpt = load_checkpoint(path)
    assert ckpt["state"]["step"] == 2 and ckpt["config"] == json.loads(
        json.dumps(asdict(trainer.config)))
    resumed = fresh(tmp_path)
    assert resumed.resume() and resumed.state.step == 2
    for name, value in params(trainer.model).items():
        assert torch.equal(params(resumed.model)[name], value), name


def test_pickled_object_is_refused_without_running_it(tmp_path):
    _, path = trained(tmp_path)
    marker = tmp_path / "exploit-ran"
    payload = torch.load(path, weights_only=True)
    payload["model"]["evil"] = Exploit(str(marker))
    torch.save(payload, path)
    # the manifest no longer matches: refused before loading
    with pytest.raises(CheckpointError, match=re.escape(path) + ".* is corrupt"):
        fresh(tmp_path).resume()
    assert not marker.exists()
    # a manifest forged to match: weights_only refuses the object
    rewrite_manifest(path)
    with pytest.raises(CheckpointError, match=re.escape(path) + " was refused.*nothing in it "
                                              r"was run.*(posix|nt)\.system"):
        fresh(tmp_path).resume()
    with pytest.raises(CheckpointError, match="was refused"):
        load_checkpoint(path)
    assert not marker.exists()
    torch.load(path, weights_only=False)  # the exploit is real: a plain torch.load runs it
    assert marker.exists()


def test_flipped_byte_anywhere_is_corrupt(tmp_path):
    _, path = trained(tmp_path)
    good = Path(path).read_bytes()
    for position in (0, len(good) // 3, len(good) // 2, len(good) - 1):
        bad = bytearray(good)
        bad[position] ^= 0x01
        Path(path).write_bytes(bytes(bad))
        with pytest.raises(CheckpointError, match=re.escape(path) + " is corrupt: its SHA-256"):
            fresh(tmp_path).resume()
    Path(path).write_bytes(good)
    manifest = tmp_path / "checkpoint-last.json"
    text = manifest.read_text()
    sha = json.loads(text)["sha256"]
    manifest.write_text(text.replace(sha, sha[:-1] + ("0" if sha[-1] != "0" else "1")))
    with pytest.raises(CheckpointError, match=re.escape(path) + " is corrupt"):
        fresh(tmp_path).resume()
    manifest.write_text(text[:-5])
    with pytest.raises(CheckpointError, match=re.escape(str(manifest)) + " is corrupt"):
        fresh(tmp_path).resume()
    manifest.write_text(text)
    trainer = fresh(tmp_path)
    assert trainer.resume() and trainer.state.step == 2  # restored: it loads again


def test_truncated_checkpoint_is_corrupt(tmp_path):
    _, path = trained(tmp_path)
    good = Path(path).read_bytes()
    for size in (len(good) - 1, len(good) // 2, 0):
        Path(path).write_bytes(good[:size])
        with pytest.raises(CheckpointError, match=re.escape(path) + r" is corrupt \(truncated\)"):
            fresh(tmp_path).resume()


def test_missing_manifest_or_payload_is_an_error(tmp_path):
    _, path = trained(tmp_path)
    manifest = tmp_path / "checkpoint-last.json"
    saved = manifest.read_text()
    manifest.unlink()
    with pytest.raises(CheckpointError, match=re.escape(path) + " has no manifest"):
        fresh(tmp_path).resume()
    manifest.write_text(saved)
    os.remove(path)
    with pytest.raises(CheckpointError, match=re.escape(path) + " is missing but its manifest"):
        fresh(tmp_path).resume()
    manifest.unlink()
    assert fresh(tmp_path).resume() is False  # nothing there: start from scratch


def test_save_killed_between_renames_is_completed_on_resume(tmp_path):
    manifests = {}

    def keep_manifest(state):
        if state.step % 2 == 0:
            manifests[state.step] = (tmp_path / "checkpoint-last.json").read_text()

    Trainer(make_model(), make_dataset(), collate, loss_fn,
            make_config(max_steps=4, checkpoint_every=2, output_dir=str(tmp_path)),
            on_step_end=keep_manifest).train()
    manifest = tmp_path / "checkpoint-last.json"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a process id no process holds now: the killed writer's
    pending = f"checkpoint-last.json.tmp-{dead.pid}"
    # killed after the payload of step 4 was renamed, before its manifest was
    manifest.rename(tmp_path / pending)
    manifest.write_text(manifests[2])
    trainer = fresh(tmp_path, max_steps=4)
    assert trainer.resume() and trainer.state.step == 4
    # the resume finished the save: the manifest is in place, the temporary gone
    assert json.loads(manifest.read_text())["step"] == 4
    assert not (tmp_path / pending).exists()
    # the same for a first save: no manifest yet
    manifest.rename(tmp_path / pending)
    trainer = fresh(tmp_path, max_steps=4)
    assert trainer.resume() and trainer.state.step == 4
    trainer.save_checkpoint()  # writes the pair and clears the temporary
    assert sorted(p for p in os.listdir(tmp_path) if p.startswith("checkpoint")) == [
        "checkpoint-last.json", "checkpoint-last.pt"]
    # a temporary manifest of another payload does not vouch for this one
    (tmp_path / "checkpoint-last.json.tmp-1").write_text(manifests[2])
    manifest.unlink()
    with pytest.raises(CheckpointError, match="has no manifest"):
        fresh(tmp_path, max_steps=4).resume()


def test_stale_temporaries_are_removed_by_the_next_save(tmp_path):
    stale = ["checkpoint-last.pt.tmp-99999", "checkpoint-last.json.tmp-99998",
             "checkpoint-last.pt.tmp-1"]
    from rag_fast.storage import RUN_KIND, write_marker

    write_marker(tmp_path, RUN_KIND)  # a run's folder, where the user keeps a file of theirs
    for name in stale + ["other.tmp-1"]:
        (tmp_path / name).write_bytes(b"partial")
    trainer, path = trained(tmp_path)
    names = set(os.listdir(tmp_path))
    assert not names & set(stale)
    assert "other.tmp-1" in names  # only the checkpoint's temporaries
    assert load_checkpoint(path)["state"]["step"] == 2


def test_resume_restores_every_rng_state(tmp_path):
    seen = {}

    def record(state):
        if state.step == 2:  # just checkpointed
            seen.update(python=random.getstate(), numpy=np.random.get_state(),
                        torch=torch.get_rng_state())
            raise Killed
        random.random(), np.random.rand()  # e.g. a data pipeline's own randomness

    with pytest.raises(Killed):
        Trainer(make_model(), make_dataset(), collate, loss_fn,
                make_config(max_steps=4, checkpoint_every=2, output_dir=str(tmp_path)),
                on_step_end=record).train()
    random.random(), np.random.rand(3), torch.rand(3)  # move every RNG on
    assert fresh(tmp_path, max_steps=4).resume()
    assert random.getstate() == seen["python"]
    now = np.random.get_state()
    assert now[0] == seen["numpy"][0] and np.array_equal(now[1], seen["numpy"][1])
    assert now[2:] == seen["numpy"][2:]
    assert torch.equal(torch.get_rng_state(), seen["torch"])


# ------------------------------------------------------------------ metrics and plot
def test_metrics_file_after_a_run_and_after_resume(tmp_path):
    base = dict(max_steps=6, log_every=1, eval_every=2, checkpoint_every=2,
                output_dir=str(tmp_path))
    evals = lambda m: {"em": 1 / 3, "f1": np.float32(0.123456), "note": "x"}  # noqa: E731

    def kill(state):
        if state.step == 3:  # logged and evaluated up to 3, checkpointed at 2
            raise Killed

    reference = Trainer(make_model(), make_dataset(), collate, loss_fn,
                        make_config(**{**base, "output_dir": None}), eval_fn=evals)
    reference.train()
    with pytest.raises(Killed):
        Trainer(make_model(), make_dataset(), collate, loss_fn, make_config(**base),
                eval_fn=evals, on_step_end=kill).train()
    lines = metrics_lines(tmp_path)
    assert [r["step"] for r in lines if "loss" in r] == [1, 2, 3]
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "lo')  # a line cut short by the kill

    trainer = Trainer(make_model(), make_dataset(), collate, loss_fn, make_config(**base),
                      eval_fn=evals)
    assert trainer.resume() and trainer.state.step == 2
    trainer.train()
    lines = metrics_lines(tmp_path)
    steps = [r for r in lines if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6]  # no duplicates
    assert all(set(r) == {"step", "loss", "loss_per_token", "lr", "examples_per_s", "elapsed_s",
                          "threads"}
               for r in steps)
    factor = lr_lambda(trainer.config)
    assert [r["lr"] for r in steps] == [1e-2 * factor(s - 1) for s in range(1, 7)]
    assert all(r["examples_per_s"] > 0 and r["elapsed_s"] >= 0 for r in steps)
    assert [(r["step"], r["loss"]) for r in steps] == reference.state.history
    assert [r for r in lines if "eval" in r] == [
        {"step": s, "eval": {"em": 0.3333, "f1": 0.1235, "note": "x"}} for s in (2, 4, 6)]
    assert trainer.state.history == reference.state.history  # resumed exactly
    assert [s for s, _ in trainer.state.evals] == [2, 4, 6]
    for name, value in params(reference.model).items():
        assert torch.equal(params(trainer.model)[name], value), name


def test_metrics_file_restarts_with_a_fresh_run_and_can_be_off(tmp_path):
    trained(tmp_path, log_every=1)
    trained(tmp_path, log_every=1)  # not resumed: its own log
    assert [r["step"] for r in metrics_lines(tmp_path)] == [1, 2]
    other = tmp_path / "off"
    trained(other, metrics_file=None, plot_file=None)
    assert sorted(os.listdir(other)) == ["checkpoint-last.json", "checkpoint-last.pt",
                                         "rag_fast-output.json"]


def test_plot_is_a_png_with_an_eval_panel(tmp_path):
    from matplotlib.image import imread

    trainer = Trainer(make_model(), make_dataset(), collate, loss_fn,
                      make_config(max_steps=3, log_every=1, eval_every=1, output_dir=str(tmp_path),
                                  plot_file="plots/run.png"),
                      eval_fn=lambda m: {"em": 0.5, "f1": 0.25})
    trainer.train()
    png = tmp_path / "plots" / "run.png"
    assert png.read_bytes()[:8] == PNG_SIGNATURE
    assert imread(str(png)).shape[:2] == (650, 700)  # two panels: loss, the [0, 1] metrics
    assert not [p for p in os.listdir(png.parent) if ".tmp-" in p]
    trained(tmp_path / "no_evals")
    single = tmp_path / "no_evals" / "training.png"
    assert single.read_bytes()[:8] == PNG_SIGNATURE
    assert imread(str(single)).shape[:2] == (400, 700)  # loss only


def test_no_matplotlib_warns_once_and_skips_the_plot(tmp_path, monkeypatch):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setattr(plot_module, "_warned_no_matplotlib", False)
    with pytest.warns(UserWarning, match="matplotlib is not installed"):
        trainer, _ = trained(tmp_path)
    assert not (tmp_path / "training.png").exists()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert plot_training(trainer.state, str(tmp_path / "again.png")) is False


# ------------------------------------------------------------------ question encoder
def test_freeze_question_encoder(tmp_path):
    model = make_model()
    before = params(model)
    trainer = Trainer(model, make_dataset(), collate, loss_fn,
                      make_config(max_steps=3, freeze_question_encoder=True))
    in_optimizer = {id(p) for g in trainer.optimizer.param_groups for p in g["params"]}
    assert not in_optimizer & {id(p) for p in model.question_encoder.parameters()}
    trainer.train()
    after = params(model)
    encoder = [n for n in before if n.startswith("question_encoder.")]
    assert encoder and all(torch.equal(after[n], before[n]) for n in encoder)
    assert not any(p.requires_grad for p in model.question_encoder.parameters())
    generator = [n for n in before if n.startswith("generator.")]
    assert any(not torch.equal(after[n], before[n]) for n in generator)
    # without freezing, the same run changes the question encoder
    control = make_model()
    Trainer(control, make_dataset(), collate, loss_fn, make_config(max_steps=3)).train()
    assert any(not torch.equal(params(control)[n], before[n]) for n in encoder)


def test_question_encoder_options_need_a_question_encoder():
    plain = torch.nn.Linear(4, 2)
    with pytest.raises(ValueError, match="freeze_question_encoder is set but the model "
                                         r"\(Linear\) has no question_encoder"):
        Trainer(plain, list(range(8)), collate, loss_fn,
                make_config(freeze_question_encoder=True))
    model = make_model()
    model.question_encoder = None
    with pytest.raises(ValueError, match="question_encoder_lr is set but the model"):
        Trainer(model, make_dataset(), collate, loss_fn, make_config(question_encoder_lr=1e-3))


def test_question_encoder_lr_param_groups(tmp_path):
    model = make_model()
    config = make_config(max_steps=3, weight_decay=0.1, question_encoder_lr=1e-4,
                         output_dir=str(tmp_path))
    trainer = Trainer(model, make_dataset(), collate, loss_fn, config)
    groups = trainer.optimizer.param_groups
    assert [g["initial_lr"] for g in groups] == [1e-2, 1e-2, 1e-4, 1e-4]
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0, 0.1, 0.0]
    encoder = {id(p) for p in model.question_encoder.parameters()}
    assert {id(p) for g in groups[2:] for p in g["params"]} == encoder
    assert not {id(p) for g in groups[:2] for p in g["params"]} & encoder
    assert all(p.dim() >= 2 for p in groups[2]["params"])
    assert all(p.dim() < 2 for p in groups[3]["params"])
    trainer.train()
    factor = lr_lambda(config)(3)  # the schedule applies to every group
    assert [g["lr"] for g in groups] == pytest.approx([1e-2 * factor] * 2 + [1e-4 * factor] * 2)
    assert fresh(tmp_path, max_steps=3, weight_decay=0.1, question_encoder_lr=1e-4).resume()
    with pytest.raises(CheckpointError, match="does not fit this model and optimizer"):
        fresh(tmp_path, max_steps=3, weight_decay=0.1).resume()  # two groups, not four


# ------------------------------------------------------------------ configuration
@pytest.mark.parametrize("values, message", [
    ({"max_steps": "10"}, "max_steps must be an int, got '10'"),
    ({"max_steps": 2.5}, "max_steps must be an int, got 2.5"),
    ({"seed": True}, "seed must be an int, got True"),
    ({"lr": "fast"}, "lr must be a finite float, got 'fast'"),
    ({"lr": float("nan")}, "lr must be a finite float, got nan"),
    ({"lr": -1.0}, "lr must be >= 0, got -1.0"),
    ({"progress": 1}, r"progress must be a bool \(true or false\), got 1"),
    ({"betas": [0.9]}, r"betas must be a pair of floats, got \[0.9\]"),
    ({"betas": [0.9, 1.5]}, r"betas must both be in \[0, 1\)"),
    ({"max_grad_norm": "none"}, "max_grad_norm must be a finite float or None, got 'none'"),
    ({"output_dir": 3}, "output_dir must be a str or None, got 3"),
    ({"device": "gpu"}, "device must be cpu, cuda, cuda:N or None, got 'gpu'"),
    ({"device": 0}, "device must be a str or None, got 0"),
    ({"metrics_file": ""}, "metrics_file must be a non-empty path or None"),
    ({"plot_file": "run.svg"}, "plot_file must end in .png"),
    ({"freeze_question_encoder": "yes"}, "freeze_question_encoder must be a bool"),
    ({"question_encoder_lr": -1}, "question_encoder_lr must be >= 0 or None, got -1.0"),
    ({"freeze_question_encoder": True, "question_encoder_lr": 1e-3},
     "question_encoder_lr must be None when freeze_question_encoder is true"),
    ({"log_every": -1}, "log_every must be >= 0, got -1"),
    ({"extra": []}, r"extra must be a dict \(a JSON object\), got \[\]"),
    ({"extra": {"a": float("inf")}}, "extra must be JSON-serialisable"),
    ({"max_step": 3}, r"^unknown training option 'max_step' \(did you mean 'max_steps'\?\)$"),
    ({"max_step": 3, "zzz": 1}, r"^unknown training options 'max_step' \(did you mean "
                                r"'max_steps'\?\), 'zzz'; known: adam_eps, .*max_steps"),
])
def test_bad_config_values_name_the_key(values, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig.from_dict(values)


def test_config_values_are_normalised_to_json():
    config = TrainConfig.from_dict({"lr": 1, "max_steps": np.int64(5), "betas": [0.8, 0.9],
                                    "output_dir": Path("runs/a"), "device": "cuda:1"})
    assert config.lr == 1.0 and type(config.lr) is float and type(config.max_steps) is int
    assert config.betas == (0.8, 0.9) and config.output_dir == os.path.join("runs", "a")
    assert TrainConfig.from_dict(json.loads(json.dumps(asdict(config)))) == config
    with pytest.raises(ValueError, match="must be a JSON object, got list"):
        TrainConfig.from_dict([("lr", 1)])


def test_schema_lists_every_option_with_help():
    schema = TrainConfig.schema()
    assert [row[0] for row in schema] == [f.name for f in fields(TrainConfig)]
    defaults = asdict(TrainConfig())
    for name, kind, default, help in schema:
        assert default == defaults[name] and help and "\n" not in help, name
    rows = {row[0]: row for row in schema}
    assert rows["max_steps"][1] == "int" and rows["max_grad_norm"][1] == "float | None"
    assert rows["device"][1:3] == ("str | None", None) and "LOCAL_RANK" in rows["device"][3]
    assert rows["metrics_file"][2] == "metrics.jsonl" and rows["plot_file"][2] == "training.png"
    assert rows["freeze_question_encoder"][2] is False and rows["question_encoder_lr"][2] is None


def test_resolve_device(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device(None) == torch.device("cpu")
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="device is 'cuda' but CUDA is not available"):
        resolve_device("cuda")
    with pytest.raises(ValueError, match="device must be cpu, cuda, cuda:N or None, got 'gpu'"):
        resolve_device("gpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device(None) == torch.device("cuda", 0)
    monkeypatch.setenv("LOCAL_RANK", "1")  # torchrun's second local process
    assert resolve_device(None) == torch.device("cuda", 1)
    assert resolve_device("cuda") == torch.device("cuda", 1)
    assert resolve_device("cuda:0") == torch.device("cuda", 0)
    with pytest.raises(ValueError, match=r"device is 'cuda:5' \(cuda:5\) but only 2 CUDA"):
        resolve_device("cuda:5")


def test_last_checkpoint_is_read_from_the_manifest(tmp_path):
    """The checkpoint a resume would start from, for messages: its manifest's step when the
    payload has the recorded size (also from the temporary manifest of a save killed between
    its renames); None when there is no payload or no manifest matches it."""
    import json

    from rag_fast.training.checkpoint import CHECKPOINT_FORMAT, last_checkpoint

    def manifest(name, size, step):
        (tmp_path / name).write_text(json.dumps({
            "format": CHECKPOINT_FORMAT, "payload": "checkpoint-last.pt", "size": size,
            "sha256": "0" * 64, "step": step}))

    assert last_checkpoint(str(tmp_path)) is None
    manifest("checkpoint-last.json", 10, 4)
    assert last_checkpoint(str(tmp_path)) is None  # no payload
    (tmp_path / "checkpoint-last.pt").write_bytes(b"x" * 10)
    assert last_checkpoint(str(tmp_path)) == (str(tmp_path / "checkpoint-last.pt"), 4)
    (tmp_path / "checkpoint-last.pt").write_bytes(b"x" * 12)  # a newer payload, renamed in
    assert last_checkpoint(str(tmp_path)) is None
    manifest("checkpoint-last.json.tmp-77", 12, 6)
    assert last_checkpoint(str(tmp_path)) == (str(tmp_path / "checkpoint-last.pt"), 6)
    (tmp_path / "checkpoint-last.json").write_text("{not json")
    assert last_checkpoint(str(tmp_path)) == (str(tmp_path / "checkpoint-last.pt"), 6)
