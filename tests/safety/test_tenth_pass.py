"""The breaks found by the tenth hostile pass; each test failed before the fix:

- I31, I44: ``eval --predictions`` kept a prediction line of any length (up to the 64 MiB line
  bound) where every other reader cuts a text to ``MAX_TEXT_CHARS`` and says so once per file;
- I43: ROUGE-L over a huge prediction and a long gold answer ran out of memory (rouge-score's
  longest-common-subsequence table grows with the product of the two token counts);
- T64: ``eval --out`` into an evaluation folder whose ``metrics.json`` is a folder ran the whole
  evaluation, then failed naming a temporary file; it is refused first, naming metrics.json.
"""
from __future__ import annotations

import json
import warnings

import pytest

from conftest import run_cli

pytestmark = pytest.mark.filterwarnings("default::UserWarning")  # the command says it, one line


def test_eval_predictions_cuts_a_long_line_and_says_so_once(world, tmp_path, monkeypatch):
    from rag_fast import _jsonl

    monkeypatch.setattr(_jsonl, "MAX_TEXT_CHARS", 50)
    data = tmp_path / "dev.jsonl"
    data.write_text(json.dumps({"question": "q1", "answers": ["seine " * 20]}) + "\n"
                    + json.dumps({"question": "q2", "answers": ["tiber"]}) + "\n")
    predictions = tmp_path / "p.txt"
    predictions.write_text("seine " * 20 + "\ntiber\n")  # 120 characters: cut to 50
    code, err = run_cli("eval", "--data", data, "--predictions", predictions, "--json")
    assert code == 0, err
    said = [line for line in err.splitlines() if "cut 1 prediction " in line]
    assert len(said) == 1 and said[0].startswith("rag-fast: warning: "), err
    assert str(predictions) in said[0]


def test_rouge_l_scores_a_bounded_prefix_of_each_text(monkeypatch):
    from rag_fast.evaluation import metrics

    monkeypatch.setattr(metrics, "ROUGE_MAX_TOKENS", 4)
    long_prediction = "a b c d e f g h"  # 8 tokens: a b c d kept
    long_answer = "x a b c y y y y"  # 8 tokens: x a b c kept
    with pytest.warns(metrics.RougeCutWarning, match="first 4 tokens of 2 texts"):
        score = metrics.rouge_l([long_prediction], [[long_answer]])
    assert score == pytest.approx(0.75)  # LCS "a b c" of 4 and 4 tokens
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # short texts: scored whole, nothing said
        assert metrics.rouge_l(["a b"], [["a b"]]) == pytest.approx(1.0)


def test_rouge_l_on_a_huge_pair_is_bounded():
    """A 200,000-token prediction against a 200,000-token answer: a 4e10-cell table before;
    now the first ROUGE_MAX_TOKENS of each, scored in bounded time and memory."""
    import resource

    from rag_fast.evaluation import metrics

    text = " ".join(f"w{i % 997}" for i in range(200_000))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.warns(metrics.RougeCutWarning):
        assert metrics.rouge_l([text], [[text]]) == pytest.approx(1.0)
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert grown_mib < 1024, grown_mib


def test_eval_out_with_metrics_json_a_folder_is_refused_before_the_work(world, tmp_path,
                                                                        monkeypatch):
    out = tmp_path / "ev"
    code, err = run_cli("eval", "--data", world["dev"], "--model", world["model"], "--out", out,
                        "--max-new-tokens", "2", "--device", "cpu", "--no-progress")
    assert code == 0, err
    (out / "metrics.json").unlink()
    (out / "metrics.json").mkdir()
    (out / "metrics.json" / "keep.txt").write_text("mine")
    predictions = (out / "predictions.jsonl").read_bytes()
    from rag_fast.cli import eval as eval_command

    def evaluate(*args, **kwargs):
        raise AssertionError("the evaluation ran before the refusal")

    monkeypatch.setattr(eval_command, "evaluate", evaluate)
    code, err = run_cli("eval", "--data", world["dev"], "--model", world["model"], "--out", out,
                        "--max-new-tokens", "2", "--device", "cpu", "--no-progress")
    assert code != 0
    assert "metrics.json" in err and "refused" in err, err
    assert "evaluation ran" not in err
    assert (out / "metrics.json" / "keep.txt").read_text() == "mine"
    assert (out / "predictions.jsonl").read_bytes() == predictions


def test_standard_output_on_a_full_device_is_named(world):
    """O37, O38 (notes): ``> /dev/full`` said a bare "No space left on device"."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(sys.executable).parent / "rag-fast"
    with open("/dev/full", "w") as full:
        done = subprocess.run([str(script), "index", "search", str(world["kb"]), "paris"],
                              stdout=full, stderr=subprocess.PIPE, text=True, timeout=120,
                              env={"HF_HUB_OFFLINE": "1", **os.environ})
    err = done.stderr
    assert done.returncode == 2, err
    assert err.strip().splitlines() == [
        "rag-fast: error: writing standard output: No space left on device (the command's "
        "output is lost)"], err


@pytest.mark.parametrize("flag,value", [("--top-k", "-1"), ("--top-p", "1.5"),
                                        ("--temperature", "0"), ("--repetition-penalty", "-1"),
                                        ("--no-repeat-ngram-size", "-2")])
def test_a_sampling_flag_out_of_range_is_refused_without_sampling(world, flag, value):
    """V42 (a note): ``--top-k -1`` was taken with beam search (and printed as a setting)."""
    code, err = run_cli("generate", "--model", world["model"], "--question", "x",
                        "--max-new-tokens", "2", "--device", "cpu", flag, value)
    assert code == 2
    assert err.startswith(f"rag-fast: error: {flag} must"), err
