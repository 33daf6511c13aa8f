"""``rag-fast generate --num-beams 1`` answers what ``eval`` (``evaluate()``) predicts, for an
encoder-decoder generator whose decoder start token (2) is not its BOS (0), as in a pretrained
BART, and for a decoder-only generator; answers start where ``transformers`` starts them and
training labels start with the same token; and the answers are the tokenizer's decoding, with
no clean-up of spaces before punctuation."""
from __future__ import annotations

import json

import pytest
import torch
from test_generation_cli import _tokenizer as word_tokenizer

from rag_fast import cli
from rag_fast.evaluation import QAExample, evaluate
from rag_fast.models import RagModel, Retrieved
from rag_fast.testing import tiny_hf_rag
from rag_fast.training import encode_targets

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

V, K, DIM = 40, 2, 16
QUESTIONS = ["w5 w6", "w12 w7 w9"]
PASSAGES = [[{"title": "w7", "text": "w8 w9"}, {"title": "w10", "text": "w11 w20 w21"}],
            [{"title": "w13", "text": "w14 w15 w16"}]]  # question 1: one passage of two


class _Passages:
    """A retriever returning fixed passages (question 1 one fewer than K)."""

    def __init__(self, dim: int) -> None:
        self.embeddings = torch.randn(len(QUESTIONS), K, dim,
                                      generator=torch.Generator().manual_seed(3))

    def retrieve(self, q, n_docs):
        return Retrieved([list(p) for p in PASSAGES], self.embeddings[: q.shape[0]])


def _tokenizer():
    return word_tokenizer(V)


def _cli_answers(tmp_path, model_dir, doc_scores, max_new_tokens) -> list[str]:
    """``rag-fast generate --num-beams 1`` on the passages and scores ``eval`` used."""
    rows = []
    for q, found, scores in zip(QUESTIONS, PASSAGES, doc_scores):
        rows.append({"question": q, "passages": found, "scores": scores[:len(found)]})
    questions = tmp_path / "q.jsonl"
    questions.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = tmp_path / "answers.jsonl"
    assert cli.main(["generate", "--model", str(model_dir), "--questions", str(questions),
                     "--num-beams", "1", "--max-new-tokens", str(max_new_tokens),
                     "--device", "cpu", "--out", str(out), "--no-progress"]) == 0
    return [json.loads(x)["answer"] for x in out.read_text().splitlines()]


def _seq2seq_dir(tmp_path, mode: str):
    hf = tiny_hf_rag(mode, seed=1, n_docs=K, vocab_size=V, d_model=DIM, layers=2)
    torch.manual_seed(7)
    with torch.no_grad():  # larger weights: answers that depend on the passages
        for p in hf.rag.generator.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.3)
    config = hf.rag.generator.config
    assert (config.decoder_start_token_id, config.bos_token_id) == (2, 0)  # as pretrained BART
    hf.save_pretrained(tmp_path / "model")
    _tokenizer().save_pretrained(tmp_path / "model")
    return hf, tmp_path / "model"


@pytest.mark.parametrize("mode", ["token", "sequence"])
def test_seq2seq_generate_one_beam_is_eval(tmp_path, mode):
    hf, model_dir = _seq2seq_dir(tmp_path, mode)
    model = RagModel.load(str(model_dir))
    model.question_tokenizer = _tokenizer()
    model.retriever = _Passages(model.question_encoder.config.hidden_size)
    examples = [QAExample(q, ("w8",)) for q in QUESTIONS]
    result = evaluate(model, examples, batch_size=2, max_new_tokens=4)
    out = model.generate(QUESTIONS, num_beams=1, max_new_tokens=4)
    assert out.texts == result.predictions
    assert len(set(result.predictions)) > 1  # not vacuous: the answers differ
    # answers start from decoder_start_token_id, as transformers' do, with its ids
    assert out.sequences[:, 0].tolist() == [2, 2]
    ctx = model.build_contexts(QUESTIONS, PASSAGES)
    want = hf.generate(context_input_ids=ctx["input_ids"],
                       context_attention_mask=ctx["attention_mask"], doc_scores=out.doc_scores,
                       num_beams=1, max_length=5)
    assert torch.equal(out.sequences, want), (out.sequences, want)
    # training labels start with the token decoding starts from, then BOS (transformers' BART)
    assert model.decoder_start_token_id == 2
    assert encode_targets(model, ["w8 w9", "w5"]).tolist() == [[2, 0, 8, 9, 2], [2, 0, 5, 2, 1]]
    # the command line, on the same passages and scores
    assert _cli_answers(tmp_path, model_dir, result.doc_scores, 4) == result.predictions


@pytest.mark.parametrize("mode", ["token", "sequence"])
def test_decoder_only_generate_one_beam_is_eval(tmp_path, mode):
    from transformers import BertConfig, BertModel, Qwen2Config, Qwen2ForCausalLM

    tok = _tokenizer()
    torch.manual_seed(0)
    g = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=V, hidden_size=DIM, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
        tie_word_embeddings=True, pad_token_id=1, bos_token_id=0, eos_token_id=2))
    with torch.no_grad():
        for p in g.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.3)
    q = BertModel(BertConfig(vocab_size=V, hidden_size=DIM, num_hidden_layers=1,
                             num_attention_heads=2, intermediate_size=32, pad_token_id=1))
    model = RagModel(g, q, _Passages(DIM), mode=mode, n_docs=K, generator_tokenizer=tok,
                     question_tokenizer=tok, question_pooling="mean",
                     max_context_length=32).eval()
    examples = [QAExample(x, ("w8",)) for x in QUESTIONS]
    result = evaluate(model, examples, batch_size=2, max_new_tokens=4)
    out = model.generate(QUESTIONS, num_beams=1, max_new_tokens=4)
    assert out.texts == result.predictions
    assert len(set(result.predictions)) > 1
    # a decoder-only answer continues the prompt: no start token, in decoding and training
    assert model.decoder_start_token_id is None
    assert encode_targets(model, ["w8 w9"])[0].tolist() == [8, 9, 2]
    model.save(str(tmp_path / "model"))
    assert _cli_answers(tmp_path, tmp_path / "model", result.doc_scores, 4) == result.predictions


# ---- the answer is the tokenizer's decoding, nothing more ------------------------------------
def test_generated_answers_are_not_cleaned_up():
    """transformers' `clean_up_tokenization_spaces` turns "x . ." into "x.."; a tokenizer
    whose config turns it on must not change what `generate` and `eval` answer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from rag_fast.models.contexts import decode_answers

    words = ["<s>", "<pad>", "</s>", "<unk>", ".", ",", "x", "what", "is", "/", "//", "p"]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                  pad_token="<pad>", unk_token="<unk>",
                                  clean_up_tokenization_spaces=True)
    ids = torch.tensor([[0, 6, 4, 5, 4, 2, 1]])
    assert tok.batch_decode(ids, skip_special_tokens=True) == ["x.,."]  # what it would do
    assert decode_answers(tok, ids) == ["x . , ."]

    hf = tiny_hf_rag("token", n_docs=2, vocab_size=len(words))
    with torch.no_grad():  # every step's best token is "."
        hf.rag.generator.final_logits_bias[0, words.index(".")] = 1e4
    model = RagModel(hf.rag.generator, hf.rag.question_encoder, None, mode="token", n_docs=2,
                     generator_tokenizer=tok, question_tokenizer=tok)
    passages = [[{"title": "p", "text": "x"}, {"title": "p", "text": "x ."}]]
    emb = torch.randn(1, 2, hf.rag.question_encoder.config.hidden_size)
    out = model.generate(["what is x"], passages=passages, passage_embeddings=emb,
                         num_beams=1, max_new_tokens=3)
    assert out.texts == [". . ."]

    class _Retriever:
        def retrieve(self, q, n_docs):
            return Retrieved(passages * q.shape[0], emb.expand(q.shape[0], -1, -1))

    model.retriever = _Retriever()
    result = evaluate(model, [QAExample("what is x", (". . .",))], max_new_tokens=3)
    assert result.predictions == [". . ."]
