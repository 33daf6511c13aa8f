"""The README's command-line workflow, verbatim, in a temporary folder: index build -> init ->
train -> eval -> generate on the corpus under examples/workflow, each step checked.

The block is the fenced code after ``<!-- workflow -->`` in README.md; it runs with bash from a
folder holding a copy of ``examples/`` (so the README's relative paths resolve) and the
installed ``rag-fast`` on PATH. The trained model must load in ``transformers``.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def workflow_block(marker: str = "<!-- workflow -->") -> str:
    """The README's commands of the first fenced block after ``marker``."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    assert marker in text, f"README.md lost its {marker} block"
    after = text.split(marker, 1)[1]
    fence = after.index("```")
    body = after[after.index("\n", fence) + 1:]
    return body[:body.index("```")]


@pytest.fixture(scope="module")
def ran(tmp_path_factory):
    root = tmp_path_factory.mktemp("workflow")
    shutil.copytree(REPO / "examples", root / "examples")
    env = dict(os.environ)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    script = "set -euo pipefail\n" + workflow_block()
    proc = subprocess.run(["bash", "-c", script], cwd=root, env=env, capture_output=True,
                          text=True, timeout=1500)
    assert proc.returncode == 0, f"workflow failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return root, proc.stdout, proc.stderr


def test_block_reads_only_what_the_previous_step_wrote():
    block = workflow_block()
    steps = [line.split()[1] for line in block.splitlines() if line.startswith("rag-fast ")]
    assert steps[:5] == ["index", "init", "train", "eval", "generate"], steps


@pytest.mark.slow  # the README's workflow, run once: minutes on 2 cores
def test_index_and_starting_model(ran):
    root, out, _ = ran
    from rag_fast.retrieval import DenseIndex

    manifest = json.loads((root / "work/kb/manifest.json").read_text())
    assert manifest["kind"] == "rag_fast.index_bundle"
    quality = DenseIndex.load(root / "work/kb/index").describe()["search_quality"]
    assert quality["recall"] == 1.0 and quality["k"] == 10  # 300 passages: the default is exact
    assert "preset ivfpq: 300 passages are fewer than 624" in out  # and the build says why
    side = json.loads((root / "work/model0/rag_fast.json").read_text())
    assert side["index"] == str((root / "work/kb").resolve())
    assert side["options"]["question_pooling"] == "mean" and side["options"]["normalize_questions"]


@pytest.mark.slow  # the README's workflow, run once: minutes on 2 cores
def test_training_outputs(ran):
    root, out, err = ran
    run = root / "work/run"
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [x for x in lines if "loss" in x]
    evals = [x for x in lines if "eval" in x]
    assert losses and evals and losses[-1]["loss"] < losses[0]["loss"]
    assert (run / "training.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "; model: work/run/model " in out  # the one closing line says where the model is
    assert "Loading weights" not in err  # third-party bars are quiet by default


@pytest.mark.slow  # the README's workflow, run once: minutes on 2 cores
def test_trained_model_loads_in_transformers(ran):
    import torch
    from transformers import RagTokenForGeneration

    from rag_fast.models import RagModel

    root, _, _ = ran
    hf = RagTokenForGeneration.from_pretrained(str(root / "work/run/model"))
    ours = RagModel.load(str(root / "work/run/model"))
    trained = dict(ours.generator.state_dict())
    for name, value in hf.rag.generator.state_dict().items():
        assert torch.equal(value, trained[name]), name
    start = RagModel.load(str(root / "work/model0"))
    assert not torch.equal(start.generator.lm_head.weight, ours.generator.lm_head.weight)
    # frozen in the example: the question encoder did not move
    for a, b in zip(start.question_encoder.parameters(), ours.question_encoder.parameters()):
        assert torch.equal(a, b)


@pytest.mark.slow  # the README's workflow, run once: minutes on 2 cores
def test_eval_writes_predictions_with_passage_titles(ran):
    root, out, _ = ran
    rows = [json.loads(x) for x in (root / "work/eval/predictions.jsonl").read_text().splitlines()]
    dev = (root / "examples/workflow/dev.jsonl").read_text().splitlines()
    assert len(rows) == len(dev)
    titles = {json.loads(x)["title"] for x in (root / "examples/workflow/passages.jsonl")
              .read_text().splitlines()}
    assert all(len(r["passages"]) == 3 and all(p["title"] in titles for p in r["passages"])
               for r in rows)
    metrics = json.loads((root / "work/eval/metrics.json").read_text())["metrics"]
    assert metrics["recall@3"] >= 0.8  # real MiniLM retrieval over real prose
    assert all(len(repr(v)) <= 6 for v in metrics.values())  # rounded, no 0.0400000001


@pytest.mark.slow  # the README's workflow, run once: minutes on 2 cores
def test_generate_answers_with_the_trained_model(ran):
    from rag_fast.models import RagModel
    from rag_fast.models.retriever_io import load_retriever

    root, out, _ = ran
    answers = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
    assert answers, out
    got = answers[-1]
    assert got["passages"] and isinstance(got["answer"], str)
    model = RagModel.load(str(root / "work/run/model"))
    model.retriever = load_retriever(root / "work/kb", n_docs=model.n_docs)
    expected = model.generate([got["question"]], num_beams=4, max_new_tokens=32)
    assert expected.texts[0] == got["answer"]
    assert [p["title"] for p in got["passages"]] == [p.title for p in expected.passages[0]]


@pytest.fixture(scope="module")
def served(ran):
    """The README's Serve block, verbatim, in the workflow's folder (after the workflow)."""
    root = ran[0]
    env = dict(os.environ)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    script = "set -euo pipefail\n" + workflow_block("<!-- serve -->")
    proc = subprocess.run(["bash", "-c", script], cwd=root, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, \
        f"serve block failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return root, proc.stdout, proc.stderr


@pytest.mark.slow  # the README's workflow, run once: minutes on 2 cores
def test_serve_block_answers_swaps_and_stops(served):
    from rag_fast.serving.answerer import index_checksum

    root, out, err = served
    first, swap, second = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    kb, later = index_checksum(root / "work/kb"), index_checksum(root / "work/kb-later")
    assert first["index"] == kb and swap == {"index": later, "previous": kb,
                                             "path": "work/kb-later", "passages": 200}
    assert second["index"] == later
    ids_later = {json.loads(x)["id"] for x in (root / "work/passages-later.jsonl").read_text(
        encoding="utf-8").splitlines()}
    before = [p["id"] for p in first["answers"][0]["passages"]]
    after = [p["id"] for p in second["answers"][0]["passages"]]
    assert set(after) <= ids_later and not set(before) <= ids_later  # the other index answered
    # the server said where it listened and that it stopped, nothing else
    said = [line for line in err.splitlines() if line.startswith("rag-fast serve:")]
    assert "on http://127.0.0.1:8000" in said[0]
    assert said[-1] == "rag-fast serve: SIGTERM: answered the requests in flight and stopped"


# ---- the README documents what the code does ----------------------------------------------
def schema_markdown() -> str:
    """The ``train`` section's fields as a Markdown table, as README.md holds it."""
    from rag_fast.training import TrainConfig

    rows = ["| field | type | default | meaning |", "|---|---|---|---|"]
    for name, kind, default, text in TrainConfig.schema():
        shown = json.dumps(list(default) if isinstance(default, tuple) else default)
        cells = [f"`{name}`", kind, f"`{shown}`", text]
        rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(rows)


def test_readme_holds_the_training_schema_and_the_example_config():
    text = (REPO / "README.md").read_text(encoding="utf-8")
    assert "<!-- train-schema -->\n" + schema_markdown() + "\n" in text
    example = (REPO / "examples/workflow/train.json").read_text(encoding="utf-8").strip()
    assert "```json\n" + example + "\n```" in text
    json.loads(example)


@pytest.mark.parametrize("marker,command", [
    ("run-command", 'pip install ".[bench]" && python benchmarks/run.py'),
    ("test-command",
     'pip install ".[test]" && pytest tests -m "not slow" -n auto --maxprocesses 8 --dist loadfile'),
])
def test_ci_finds_the_two_commands_in_the_readme(marker, command):
    """.ci/run reads each command as the line after its marker and the fence (grep -A2)."""
    got = subprocess.run(
        ["bash", "-c", f"grep -A2 -- '<!-- {marker} -->' README.md | grep -v '^<!--' "
                       "| grep -v '^```' | head -1"],
        cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()
    assert got == command


def test_train_help_prints_the_schema(capsys):
    from rag_fast import cli

    with pytest.raises(SystemExit):
        cli.main(["train", "--help"])
    printed = capsys.readouterr().out
    for name in ("freeze_question_encoder", "question_encoder_lr", "device", "metrics_file"):
        assert name in printed


@pytest.mark.parametrize("config,message", [
    ({"data": {"train": "t.jsonl"}, "modle": "m"}, "unknown key 'modle'"),
    ({"data": {"train": "t.jsonl"}, "train": {"max_step": 3}}, "train: unknown"),
    ({"data": {"train": "t.jsonl"}, "train": {"max_steps": "3"}}, "max_steps must be an int"),
    ({"data": {"train": "t.jsonl"}, "train": {"freeze_question_encoder": "yes"}},
     "freeze_question_encoder"),
    ({"data": {"train": "t.jsonl"}, "model": {"path": "m", "ndocs": 3}}, "model.ndocs"),
    ({"data": {"train": "t.jsonl"}, "index": 5}, "index: expected"),
    ({"data": {"tran": "t.jsonl"}}, "data: expected"),
    ({"data": {"train": "t.jsonl"}, "resume": "no"}, "resume: expected true or false"),
])
def test_bad_config_names_the_file_and_the_key(tmp_path, config, message, capsys):
    from rag_fast import cli

    path = tmp_path / "bad.json"
    path.write_text(json.dumps(config))
    assert cli.main(["train", "--config", str(path), "--model", "m", "--output-dir", "o"]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and message in err, err


def test_config_that_is_not_json_names_the_line(tmp_path, capsys):
    from rag_fast import cli

    path = tmp_path / "bad.json"
    path.write_text('{\n  "data": {"train": "t.jsonl"},\n  "train": {max_steps: 3}\n}\n')
    assert cli.main(["train", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{path}: not valid JSON" in err and "line 3" in err, err


def test_docs_question_encoder_table_matches_the_committed_runs():
    """docs/workflow.md's recall figures are those of the metrics files it names."""
    text = (REPO / "docs/workflow.md").read_text(encoding="utf-8")
    table = text.split("<!-- question-encoder-runs -->\n", 1)[1].split("\n\n", 1)[0]
    rows = [r for r in table.splitlines()[2:] if r.startswith("|")]
    assert len(rows) == 3
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        recalls, path = [float(c) for c in cells[2:5]], cells[5].strip("`")
        evals = [json.loads(x)["eval"] for x in (REPO / path).read_text().splitlines()
                 if '"eval"' in x]
        assert [round(e["recall@3"], 3) for e in evals] == recalls, path
    start = json.loads((REPO / "docs/workflow/eval-start.json").read_text())["metrics"]
    assert f"before training was {start['recall@3']:.3f}" in " ".join(text.split())
