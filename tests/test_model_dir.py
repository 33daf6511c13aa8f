"""The model directory: rag_fast and transformers read each other's folders (same loss in
float64, same generated tokens), every file is verified, RagModel.generate retrieves with the
model's own question encoder, and bad scores or contexts give errors that name them."""
from __future__ import annotations

import json
import os

import pytest
import torch

from rag_fast.models import ModelDirError, RagModel, Retrieved
from rag_fast.testing import tiny_hf_rag

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: one thread for tiny models

V, K, B, S, T = 60, 3, 2, 9, 6


def _spread(model: torch.nn.Module, seed: int) -> None:
    """Weights large enough that passages give different answers (default init: all equal)."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.3)


def _bert_question_encoder(dim: int = 16):
    from transformers import BertConfig, BertModel

    torch.manual_seed(7)
    return BertModel(BertConfig(vocab_size=99, hidden_size=dim, num_hidden_layers=1,
                                num_attention_heads=2, intermediate_size=32))


def _ours(mode: str, epsilon: float = 0.1) -> RagModel:
    """A RagModel with a BART generator and a BERT (not DPR) question encoder."""
    hf = tiny_hf_rag(mode, n_docs=K, vocab_size=V, d_model=16)
    _spread(hf.rag.generator, 3)
    return RagModel(hf.rag.generator, _bert_question_encoder(), mode=mode, n_docs=K,
                    epsilon=epsilon, exclude_bos=mode == "sequence", question_pooling="mean",
                    normalize_questions=True, max_context_length=40)


def _batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, V, (B * K, S), generator=g)
    mask = torch.ones_like(ids)
    ids[1, 5:], mask[1, 5:] = 1, 0
    scores = torch.randn(B, K, generator=g, dtype=torch.float64)
    labels = torch.randint(3, V, (B, T), generator=g)
    labels[:, 0] = 0
    labels[1, -2:] = 1
    return ids, mask, scores, labels


@pytest.mark.parametrize("mode", ["token", "sequence"])
def test_saved_model_loads_in_transformers_with_the_same_loss(mode, tmp_path):
    from transformers import RagSequenceForGeneration, RagTokenForGeneration

    ours = _ours(mode).double()
    ours.save(str(tmp_path / "m"))
    files = set(os.listdir(tmp_path / "m"))
    assert {"config.json", "model.safetensors", "rag_fast.json"} <= files
    assert not any(f.endswith((".pt", ".bin")) for f in files)  # no pickles
    cls = RagTokenForGeneration if mode == "token" else RagSequenceForGeneration
    hf = cls.from_pretrained(str(tmp_path / "m")).double().eval()
    assert type(hf.rag.question_encoder).__name__ == "BertModel"
    assert hf.config.label_smoothing == 0.1 and hf.config.n_docs == K
    ids, mask, scores, labels = _batch()
    ref = hf(context_input_ids=ids, context_attention_mask=mask, doc_scores=scores,
             labels=labels).loss
    out = ours.eval()(labels, context_input_ids=ids, context_attention_mask=mask,
                      doc_scores=scores, reduction="none").loss
    assert ref.dtype == out.dtype == torch.float64
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-9)
    # and back: rag_fast reads it with every option it saved
    again = RagModel.load(str(tmp_path / "m"))
    assert again.options() == ours.options()
    for (n, a), b in zip(ours.state_dict().items(), again.state_dict().values()):
        assert torch.equal(a.float(), b.float()), n


@pytest.mark.parametrize("mode,settings", [
    ("token", dict(num_beams=4, max_length=8)),
    ("token", dict(num_beams=1, max_length=8)),
    ("sequence", dict(num_beams=3, max_length=8)),
])
def test_transformers_folder_loads_and_generates_the_same_tokens(mode, settings, tmp_path):
    hf = tiny_hf_rag(mode, n_docs=K, vocab_size=V, d_model=32, layers=2)
    _spread(hf.rag.generator, 5)
    hf.save_pretrained(str(tmp_path / "hf"))
    ours = RagModel.load(str(tmp_path / "hf"))
    assert ours.mode == mode and ours.n_docs == K
    ids, mask, scores, _ = _batch(1)
    scores = scores.float()
    ref = hf.generate(context_input_ids=ids, context_attention_mask=mask, doc_scores=scores,
                      **settings)
    out = ours.generate(context_input_ids=ids, context_attention_mask=mask, doc_scores=scores,
                        **settings).sequences
    assert out.tolist() == ref.tolist()


def test_every_file_is_verified(tmp_path):
    from rag_fast.storage import sealed

    path = tmp_path / "m"
    _ours("token").save(str(path))
    RagModel.load(str(path))

    def fails(match):
        with pytest.raises(ModelDirError, match=match):
            RagModel.load(str(path))

    weights = path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:-10])  # truncated
    fails(r"corrupt: model.safetensors has \d+ bytes")
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0x01  # one bit
    weights.write_bytes(bytes(flipped))
    fails("corrupt: model.safetensors does not match its SHA-256")
    weights.write_bytes(data)
    config = (path / "config.json").read_text()
    (path / "config.json").write_text(config.replace('"n_docs": 3', '"n_docs": 4'))
    fails("corrupt: config.json")
    (path / "config.json").write_text(config)
    side = json.loads((path / "rag_fast.json").read_text())
    (path / "rag_fast.json").write_text(json.dumps({**side, "format": 99}))  # not resealed
    fails("rag_fast.json was changed after rag_fast wrote it")
    # edits accepted with `rag-fast reseal` (sealed again) are still checked key by key
    (path / "rag_fast.json").write_text(json.dumps(sealed({**side, "format": 99})))
    fails("rag_fast.json: unknown format 99")
    (path / "rag_fast.json").write_text("{not json")
    fails("rag_fast.json is not valid JSON")
    # a hand-edited option RagModel refuses: named with the file
    (path / "rag_fast.json").write_text(json.dumps(sealed(
        {**side, "options": {**side["options"], "epsilon": 1.5}})))
    fails(r"rag_fast.json: options do not fit RagModel: epsilon must be a float in \[0, 1\]")
    (path / "rag_fast.json").write_text(json.dumps(side))
    os.remove(path / "generation_config.json")
    fails("incomplete: generation_config.json is missing")
    with pytest.raises(ModelDirError, match="does not exist"):
        RagModel.load(str(tmp_path / "nowhere"))
    with pytest.raises(ModelDirError, match="not a model directory: no config.json"):
        RagModel.load(str(tmp_path))


def test_save_is_atomic_and_removes_stale_temporaries(tmp_path):
    model = _ours("sequence")
    stale = tmp_path / ".m.tmp-999999999-0abc"  # a writer that was killed (no such process)
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"partial")
    model.save(str(tmp_path / "m"))
    model.save(str(tmp_path / "m"), index=str(tmp_path / "kb"))  # overwrite in place
    assert sorted(os.listdir(tmp_path)) == ["m"]
    assert RagModel.load(str(tmp_path / "m")).index_path == str(tmp_path / "kb")


def test_a_model_without_transformers_modules_cannot_be_saved(tmp_path):
    hf = tiny_hf_rag("token", n_docs=K, vocab_size=V)
    with pytest.raises(ModelDirError, match="question_encoder is None"):
        RagModel(hf.rag.generator, None, n_docs=K).save(str(tmp_path / "m"))


class _Retriever:
    """Fixed passages and embeddings; records the question vectors it was asked with."""

    def __init__(self, n: int, dim: int = 16, missing: int | None = None):
        g = torch.Generator().manual_seed(4)
        self.embeddings = torch.randn(n, K, dim, generator=g)
        self.missing = missing
        self.asked = None

    def retrieve(self, q, n_docs):
        self.asked = q.clone()
        passages = [[{"title": f"t{b}{k}", "text": f"passage {b} {k}"} for k in range(n_docs)]
                    for b in range(q.shape[0])]
        if self.missing is not None:
            passages[self.missing] = []
        return Retrieved(passages, self.embeddings[:q.shape[0]])


def _word_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3}
    for w in "who what is where passage / // t00 t01 t02 t10 t11 t12 0 1 2 a b c".split():
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>", unk_token="<unk>")


def _answering_model(retriever) -> RagModel:
    model = _ours("token")
    tok = _word_tokenizer()
    return RagModel(model.generator, model.question_encoder, retriever, mode="token", n_docs=K,
                    generator_tokenizer=tok, question_tokenizer=tok, question_pooling="mean",
                    max_context_length=12)


def test_generate_retrieves_with_the_models_question_encoder():
    retriever = _Retriever(2)
    model = _answering_model(retriever)
    questions = ["who is a", "where is b"]
    out = model.generate(questions, num_beams=2, max_new_tokens=4)
    assert model.training  # back in the mode it was in
    model.eval()
    q_inputs = model.tokenize_questions(questions)
    q = model.encode_questions(q_inputs["input_ids"], q_inputs["attention_mask"])
    torch.testing.assert_close(retriever.asked, q)  # the model's own encoder, not another
    expected = torch.bmm(q[:, None], retriever.embeddings[:2].transpose(1, 2))[:, 0]
    torch.testing.assert_close(out.doc_scores, expected)
    assert out.sequences.shape[0] == 2 and len(out.texts) == 2 and len(out.passages[0]) == K
    # the same answers as decoding the same contexts and scores directly
    ctx = model.build_contexts(questions, out.passages)
    direct = model.generate(context_input_ids=ctx["input_ids"],
                            context_attention_mask=ctx["attention_mask"],
                            doc_scores=out.doc_scores, num_beams=2, max_new_tokens=4)
    assert direct.sequences.tolist() == out.sequences.tolist()


def test_generate_names_the_question_without_finite_scores():
    model = _answering_model(_Retriever(2))
    ctx = model.build_contexts(["who is a", "where is b"], [[{"text": "a"}] * K] * 2)
    scores = torch.zeros(2, K)
    scores[1] = float("-inf")
    with pytest.raises(ValueError, match=r"question 1 \('where is b'\) has no passage with a finite"):
        model.generate(["who is a", "where is b"], context_input_ids=ctx["input_ids"],
                       context_attention_mask=ctx["attention_mask"], doc_scores=scores)
    scores[1] = 0.0
    scores[0, 2] = float("nan")
    with pytest.raises(ValueError, match=r"question 0 has a NaN or \+inf passage score"):
        model.generate(context_input_ids=ctx["input_ids"],
                       context_attention_mask=ctx["attention_mask"], doc_scores=scores)
    # the functional API checks too
    from rag_fast.generation import rag_token_generate

    with pytest.raises(ValueError, match="question 0 has a NaN"):
        rag_token_generate(model.generator, ctx["input_ids"], ctx["attention_mask"], scores)


def test_overlong_contexts_are_truncated_or_rejected():
    model = _answering_model(_Retriever(1))
    limit = model.generator.config.max_position_embeddings
    long_text = " ".join(["a"] * (limit + 50))
    model.max_context_length = limit + 100  # above what the generator can read
    ctx = model.build_contexts(["who is a"], [[{"title": "t", "text": long_text}] * K])
    assert ctx["input_ids"].shape[1] == limit  # truncated to the generator's positions
    too_long = torch.full((K, limit + 1), 5)
    with pytest.raises(ValueError, match=f"{limit + 1} tokens but the generator has {limit} "
                                         "positions"):
        model.generate(context_input_ids=too_long, context_attention_mask=torch.ones_like(too_long),
                       doc_scores=torch.zeros(1, K))
    labels = torch.tensor([[0, 5, 2]])
    with pytest.raises(ValueError, match="positions"):
        model(labels, context_input_ids=too_long, context_attention_mask=torch.ones_like(too_long),
              doc_scores=torch.zeros(1, K))
