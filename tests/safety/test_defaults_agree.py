"""`rag-fast eval` and `rag-fast generate` decode the same way unless told otherwise: one set of
decoding options with one default (beam search, 4 beams, at most 32 new tokens), said in both
``--help`` texts and in a line of each command's output (eval's first, generate's last on
stderr), and recorded with the answers.

A newcomer saw `eval` print "RFCFCFC" (greedy) and `generate` "RFC 4122" (4 beams) for one
question of one model, with nothing at either command saying why.
"""
from __future__ import annotations

import json

import pytest

from conftest import run_cli

from rag_fast.cli import build_parser
from rag_fast.cli.common import DEFAULT_BEAMS, DEFAULT_NEW_TOKENS


@pytest.fixture(scope="module")
def trained(world, tmp_path_factory):
    out = tmp_path_factory.mktemp("agree") / "run"
    code, err = run_cli("train", "--config", world["config"], "--model", world["model"],
                        "--output-dir", out, "--max-steps", "2")
    assert code == 0, err
    return out


def read_answers(world, trained, tmp_path, capsys, *extra):
    """(eval's predictions, generate's answers, eval's stdout, generate's stderr, records)."""
    code, err = run_cli("eval", "--data", world["dev"], "--model", trained, "--out",
                        tmp_path / "eval", "--no-progress", *extra)
    assert code == 0, err
    eval_out = capsys.readouterr().out
    predictions = [json.loads(line)["prediction"] for line in
                   (tmp_path / "eval" / "predictions.jsonl").read_text().splitlines()]
    metrics = json.loads((tmp_path / "eval" / "metrics.json").read_text())
    questions = tmp_path / "q.jsonl"
    questions.write_text(world["dev"].read_text())
    code, err = run_cli("generate", "--model", trained, "--questions", questions, "--out",
                        tmp_path / "answers.jsonl", "--no-progress", *extra)
    assert code == 0, err
    rows = [json.loads(line) for line in (tmp_path / "answers.jsonl").read_text().splitlines()]
    return predictions, [r["answer"] for r in rows], eval_out, err, metrics["decoding"], rows


@pytest.mark.parametrize("extra", [(), ("--num-beams", "1"), ("--num-beams", "3",
                                                               "--max-new-tokens", "5")])
def test_eval_and_generate_answer_alike(world, trained, tmp_path, capsys, extra):
    predictions, answers, eval_out, gen_err, recorded, rows = read_answers(
        world, trained, tmp_path, capsys, *extra)
    assert predictions == answers and any(predictions)
    beams = int(extra[1]) if extra else DEFAULT_BEAMS
    # each output says how it decoded, and records it
    said = "greedy" if beams == 1 else f"beam search, {beams} beams"
    assert eval_out.splitlines()[0].startswith(f"decoding: {said}"), eval_out
    assert f"rag-fast: 8 answer(s) -> {tmp_path / 'answers.jsonl'}; decoding: {said}" in gen_err, \
        gen_err
    assert recorded["num_beams"] == beams and all(r["decoding"] == recorded for r in rows)
    assert recorded["max_new_tokens"] == (int(extra[3]) if len(extra) > 2 else
                                          DEFAULT_NEW_TOKENS)


def test_the_default_differs_from_greedy_on_this_model(world, trained, tmp_path, capsys):
    """The agreement above is not vacuous: on this model, greedy and 4 beams answer some
    question differently, which is what the newcomer saw between the two commands."""
    default, *_ = read_answers(world, trained, tmp_path / "a", capsys)
    greedy, *_ = read_answers(world, trained, tmp_path / "b", capsys, "--num-beams", "1")
    assert default != greedy


@pytest.mark.parametrize("command", ["eval", "generate"])
def test_both_help_texts_state_the_one_default(command):
    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    text = sub.choices[command].format_help()
    assert f"default {DEFAULT_BEAMS}, in eval and generate alike" in " ".join(text.split())
