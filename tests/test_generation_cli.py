"""``rag-fast generate`` end to end on a saved tiny RAG model and an offline word tokenizer."""
from __future__ import annotations

import argparse
import json

import pytest

from rag_fast.cli import generate as cli
from rag_fast.testing import tiny_hf_rag


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rag-fast")
    cli.register(parser.add_subparsers(dest="command", required=True))
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
