"""``rag-fast generate`` end to end on a saved tiny RAG model and an offline word tokenizer."""
from __future__ import annotations

import argparse
import json

import pytest
import torch

from rag_fast.cli import generate as cli
from rag_fast.cli.parsers import add_generate
from rag_fast.testing import tiny_hf_rag


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rag-fast")
    add_generate(parser.add_subparsers(dest="command", required=True))
    return parser


def _tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3}
    vocab.update({f"w{i}": i for i in range(4, vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", pad_token="<pad>",
                                   eos_token="</s>", unk_token="<unk>")


@pytest.mark.parametrize("mode", ["token", "sequence"])
def test_generate_jsonl(tmp_path, mode, capsys):
    model = tiny_hf_rag(mode, n_docs=2, vocab_size=40, d_model=16)
    model.save_pretrained(tmp_path / "model")
    _tokenizer(40).save_pretrained(tmp_path / "model")
    questions = tmp_path / "q.jsonl"
    rows = [
        {"question": "w5 w6", "passages": [{"title": "w7", "text": "w8 w9"}, {"title": "w10",
                                                                              "text": "w11"}],
         "scores": [1.0, 0.5]},
        {"question": "w12", "passages": [{"title": "w13", "text": "w14 w15 w16"}]},  # 1 of 2
    ]
    questions.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    args = _parser().parse_args(["generate", "--model", str(tmp_path / "model"), "--questions",
                                 str(questions), "--num-beams", "2", "--max-new-tokens", "4",
                                 "--device", "cpu"])
    assert args.func(args) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [x["question"] for x in lines] == ["w5 w6", "w12"]
    assert all(isinstance(x["answer"], str) for x in lines)
    # the passages and scores each answer used; the missing second passage is not listed
    assert [p["title"] for p in lines[0]["passages"]] == ["w7", "w10"]
    assert [p["score"] for p in lines[0]["passages"]] == [1.0, 0.5]
    assert [p["title"] for p in lines[1]["passages"]] == ["w13"]
    # each passage as eval writes it: title, id (none given here), score and text
    assert lines[0]["passages"][0] == {"title": "w7", "id": None, "score": 1.0, "text": "w8 w9"}
    # the same answers as the Python API on the same contexts and scores
    from rag_fast.models import RagModel

    ours = RagModel.load(str(tmp_path / "model"))
    ctx = ours.build_contexts(["w5 w6"], [rows[0]["passages"]])
    import torch

    direct = ours.generate(context_input_ids=ctx["input_ids"],
                           context_attention_mask=ctx["attention_mask"],
                           doc_scores=torch.tensor([[1.0, 0.5]]), num_beams=2, max_new_tokens=4)
    assert direct.texts[0] == lines[0]["answer"]


def test_bad_question_files(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"q": 1}\n')
    args = _parser().parse_args(["generate", "--model", str(tmp_path), "--questions", str(bad)])
    with pytest.raises(ValueError, match="string 'question'"):
        cli.read_questions(args)
    model = tiny_hf_rag("token", n_docs=2, vocab_size=40, d_model=16)
    model.save_pretrained(tmp_path / "model")
    _tokenizer(40).save_pretrained(tmp_path / "model")
    args = _parser().parse_args(["generate", "--model", str(tmp_path / "model"), "--question", "q"])
    with pytest.raises(ValueError, match="no passages: give --index"):
        cli.run(args)
    (tmp_path / "empty").mkdir()
    args = _parser().parse_args(["generate", "--model", str(tmp_path / "empty"), "--question", "q"])
    with pytest.raises(ValueError, match="not a model directory"):
        cli.run(args)


def test_join_context_matches_hf_retriever_format():
    from rag_fast.models import join_context

    assert join_context("T", "body", "q?") == "T / body // q?"


def test_timings_name_every_stage_and_add_up_to_the_wall_time(serving_world, tmp_path):
    """``generate --timings``: one line on stderr, every stage from the process's start to the
    answers written, adding up to the command's wall time up to that line (measured outside
    it, from before the process started) within 10%."""
    import os
    import re
    import subprocess
    import sys
    import time
    from pathlib import Path

    questions = tmp_path / "q.jsonl"
    questions.write_text("".join(json.dumps({"question": q}) + "\n" for q in
                                 ["which river is paris on", "which river is rome on"] * 3))
    script = Path(sys.executable).parent / "rag-fast"
    start = time.perf_counter()
    proc = subprocess.Popen([str(script), "generate", "--model", str(serving_world["bart"]),
                             "--questions", str(questions), "--out", str(tmp_path / "a.jsonl"),
                             "--timings", "--device", "cpu", "--batch-size", "4",
                             "--max-new-tokens", "3"],
                            stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    line, wall, err = [], None, []
    for text in proc.stderr:  # the wall time up to the line (not the interpreter's exit after)
        err.append(text)
        if text.startswith("rag-fast: timings: "):
            wall = time.perf_counter() - start
            line.append(text.strip())
    proc.stderr.close()
    assert proc.wait(timeout=300) == 0, "".join(err)
    assert len(line) == 1 and wall is not None, "".join(err)
    stages = dict((name, float(s)) for name, s in re.findall(
        r"(?:^|, )([a-z][a-z ,]*?) (\d+\.\d\d) s", line[0].split(": ", 2)[2]))
    assert list(stages) == ["start, imports and options", "reading questions",
                            "model and index load", "question encoding", "retrieval",
                            "contexts", "decoding", "writing"], line
    total = float(re.search(r"; (\d+\.\d\d) s in all since the process started", line[0])[1])
    assert abs(sum(stages.values()) - total) <= 0.01 * len(stages)
    assert stages["start, imports and options"] > 0.2 and stages["decoding"] > 0  # torch, answers
    assert abs(total - wall) <= 0.1 * wall, (total, wall, line)


def test_generate_tells_each_stage_to_on_stage(serving_world):
    """The Python API's stages: a call from questions runs all four, one given its contexts
    and scores only the decoding."""
    from rag_fast.models.inference import load_for_inference

    model = load_for_inference(str(serving_world["bart"]), None, "cpu")
    seen = []
    out = model.generate(["which river is paris on"], num_beams=1, max_new_tokens=2,
                         on_stage=lambda stage, s: seen.append((stage, s)))
    assert [stage for stage, _ in seen] == ["encode", "retrieve", "contexts", "decode"]
    assert all(s >= 0 for _, s in seen)
    ctx = model.build_contexts(["which river is paris on"], out.passages)
    seen.clear()
    again = model.generate(["which river is paris on"], context_input_ids=ctx["input_ids"],
                           context_attention_mask=ctx["attention_mask"],
                           doc_scores=out.doc_scores, num_beams=1, max_new_tokens=2,
                           on_stage=lambda stage, s: seen.append((stage, s)))
    assert [stage for stage, _ in seen] == ["decode"]
    assert torch.equal(again.sequences, out.sequences)
