"""Composite encoder-decoders (``transformers.EncoderDecoderModel``, the BERT2BERT warm start) as
generators: the same loss and gradients as ``transformers``' RAG (both modes, both LM-head
paths), decoding through RagModel, a model folder ``transformers`` loads, the warm-start recipe
of ``rag-fast init --generator-from-encoder`` and what ``init`` refuses.

The decoder of a composite carries its own LM head (BERT's: a transform, then a Linear; GPT-2's:
a plain Linear), so RagModel reads its base model's states, applies the transform and leaves the
Linear to the fused loss (``rag_fast.generation.heads.decoder_parts``). Token-identical decoding
against ``transformers`` is in tests/test_generation_seq2seq.py (kinds "bert2bert", "bert2gpt2").
"""
from __future__ import annotations

import json

import pytest
import torch

from rag_fast.generation.heads import check_decoder_parts, decoder_parts
from rag_fast.models import RagModel
from rag_fast.testing import tiny_composite_config

B, K, S, T, V = 2, 3, 7, 6, 60


def _hf(decoder: str, mode: str, seed: int = 0, dtype=torch.float32):
    from transformers import (DPRConfig, RagConfig, RagSequenceForGeneration,
                              RagTokenForGeneration)

    q = DPRConfig(vocab_size=99, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                  intermediate_size=32, max_position_embeddings=128)
    config = RagConfig.from_question_encoder_generator_configs(
        q, tiny_composite_config(decoder, vocab_size=V), n_docs=K)
    torch.manual_seed(seed)
    cls = RagTokenForGeneration if mode == "token" else RagSequenceForGeneration
    model = cls(config).eval().to(dtype)
    with torch.no_grad():  # larger weights: passages then matter to the answer
        g = torch.Generator().manual_seed(seed + 1)
        for p in model.rag.generator.parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64).to(dtype) * 0.3)
    return model


def _inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    contexts = torch.randint(3, V, (B * K, S), generator=g)
    mask = torch.ones_like(contexts)
    mask[1, -2:] = 0
    scores = torch.randn(B, K, generator=g)
    labels = torch.randint(3, V, (B, T), generator=g)
    labels[:, 0] = 2  # the decoder start token
    labels[1, -2:] = 0  # padding
    return contexts, mask, scores, labels


def _loss_and_grads(forward, params, scores):
    scores = scores.clone().requires_grad_()
    loss = forward(scores)
    grads = torch.autograd.grad(loss.sum(), [*params, scores], allow_unused=True)
    return loss.detach(), grads


@pytest.mark.parametrize("decoder", ["bert", "gpt2"])
@pytest.mark.parametrize("mode", ["token", "sequence"])
@pytest.mark.parametrize("lm_head_loss", ["fused", "materialized"])
def test_loss_and_gradients_equal_transformers(decoder, mode, lm_head_loss):
    hf = _hf(decoder, mode)
    contexts, mask, scores, labels = _inputs()
    ours = RagModel.from_transformers(hf, lm_head_loss=lm_head_loss)
    assert type(ours.generator).__name__ == "EncoderDecoderModel"
    params = [p for p in hf.rag.generator.parameters()]

    def theirs(s):
        return hf(context_input_ids=contexts, context_attention_mask=mask, doc_scores=s,
                  labels=labels).loss

    def mine(s):
        return ours(labels, context_input_ids=contexts, context_attention_mask=mask,
                    doc_scores=s, reduction="none").loss

    ours.eval()  # dropout off on both sides (the modules are shared)
    want, want_grads = _loss_and_grads(theirs, params, scores)
    got, got_grads = _loss_and_grads(mine, params, scores)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # float32 sums in another order; a gradient that is zero up to rounding (attention keys'
    # biases: softmax ignores a shift) compares against the largest gradient of its tensor
    for (name, _), g_got, g_want in zip(hf.rag.generator.named_parameters(), got_grads,
                                        want_grads):
        assert (g_got is None) == (g_want is None), name  # (the encoder's pooler: unused)
        if g_want is None:
            continue
        scale = float(g_want.abs().max())
        torch.testing.assert_close(g_got, g_want, rtol=1e-4, atol=1e-5 + 2e-4 * scale, msg=name)
    torch.testing.assert_close(got_grads[-1], want_grads[-1], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("mode", ["token", "sequence"])
def test_float64_oracle(mode):
    """The fused loss on float32 against the float64 transformers loss (the oracle)."""
    hf32, hf64 = _hf("bert", mode), _hf("bert", mode, dtype=torch.float64)
    contexts, mask, scores, labels = _inputs(1)
    want = hf64(context_input_ids=contexts, context_attention_mask=mask,
                doc_scores=scores.double(), labels=labels).loss
    ours = RagModel.from_transformers(hf32).eval()
    got = ours(labels, context_input_ids=contexts, context_attention_mask=mask,
               doc_scores=scores, reduction="none").loss
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)


def test_decoder_parts_of_each_head():
    bert = _hf("bert", "token").rag.generator
    parts = decoder_parts(bert)
    assert parts.body is bert.decoder.bert
    assert parts.transform is bert.decoder.cls.predictions.transform
    assert parts.project is None  # equal widths
    gpt2 = _hf("gpt2", "token").rag.generator
    parts = decoder_parts(gpt2)
    assert parts.body is gpt2.decoder.transformer and parts.transform is None
    assert parts.project is gpt2.enc_to_dec_proj  # 32-d encoder, 24-d decoder
    check_decoder_parts(bert)
    check_decoder_parts(gpt2)


def test_a_head_that_is_not_read_right_is_refused():
    # A decoder whose head does more than its transform and Linear: the check sees it
    gen = _hf("bert", "token").rag.generator
    head = gen.decoder.cls.predictions
    forward = head.forward
    head.forward = lambda hidden: forward(hidden) + 1.0
    with pytest.raises(ValueError, match="rag_fast cannot drive this decoder"):
        RagModel(gen, mode="token", n_docs=K)
    # and a head rag_fast does not split (RoBERTa's: dense, layer norm, Linear, no transform)
    from transformers import EncoderDecoderModel

    roberta = EncoderDecoderModel(config=tiny_composite_config("roberta", vocab_size=V))
    with pytest.raises(ValueError, match=r"EncoderDecoderModel: the LM head of its decoder "
                                         r"RobertaForCausalLM \(RobertaLMHead\)"):
        RagModel(roberta, mode="token", n_docs=K)


@pytest.mark.parametrize("mode", ["token", "sequence"])
def test_rag_model_generate_equals_transformers(mode):
    hf = _hf("bert", mode, seed=3)
    contexts, mask, scores, _ = _inputs(3)
    model = RagModel.from_transformers(hf)
    for settings in (dict(num_beams=1, max_length=8), dict(num_beams=3, max_length=8)):
        hf.eval()
        expected = hf.generate(context_input_ids=contexts, context_attention_mask=mask,
                               doc_scores=scores, **settings)
        got = model.generate(context_input_ids=contexts, context_attention_mask=mask,
                             doc_scores=scores, **settings)
        assert torch.equal(got.sequences, expected), settings
    assert len({tuple(r) for r in expected.tolist()}) > 1  # answers differ: not vacuous


@pytest.mark.parametrize("mode", ["token", "sequence"])
def test_saved_model_loads_in_transformers_and_back(tmp_path, mode):
    from transformers import RagSequenceForGeneration, RagTokenForGeneration

    hf = _hf("gpt2", mode)
    contexts, mask, scores, labels = _inputs()
    model = RagModel.from_transformers(hf).eval()
    want = model(labels, context_input_ids=contexts, context_attention_mask=mask,
                 doc_scores=scores, reduction="none").loss
    model.save(str(tmp_path / "m"))
    cls = RagTokenForGeneration if mode == "token" else RagSequenceForGeneration
    theirs = cls.from_pretrained(str(tmp_path / "m")).eval()
    assert type(theirs.rag.generator).__name__ == "EncoderDecoderModel"
    got = theirs(context_input_ids=contexts, context_attention_mask=mask, doc_scores=scores,
                 labels=labels).loss
    torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-5)
    back = RagModel.load(str(tmp_path / "m")).eval()
    again = back(labels, context_input_ids=contexts, context_attention_mask=mask,
                 doc_scores=scores, reduction="none").loss
    torch.testing.assert_close(again, want, rtol=0, atol=0)


# ------------------------------------------------------------------ the warm start, from the CLI
@pytest.fixture(scope="module")
def encoder(tmp_path_factory):
    from utils import save_tiny_bert

    root = tmp_path_factory.mktemp("warm")
    words = ["paris", "seine", "rome", "tiber", "river", "city", "which", "is", "on", "the",
             "of", "lies"]
    (root / "enc").mkdir()
    return root, save_tiny_bert(root / "enc", words)


def _cli(*args) -> tuple[int, str]:
    import contextlib
    import io

    from rag_fast import cli

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = cli.main([str(a) for a in args])
    return code, err.getvalue()


def test_warm_start_wires_the_special_tokens(encoder, tmp_path):
    from transformers import AutoTokenizer, BertModel

    from rag_fast.models.build import build_rag_model

    root, enc = encoder
    model = build_rag_model(generator_from_encoder=enc, question_encoder=enc, n_docs=2,
                            max_context_length=32)
    tok = AutoTokenizer.from_pretrained(enc)
    gen = model.generator
    assert type(gen).__name__ == "EncoderDecoderModel"
    for config in (gen.config, gen.generation_config):
        assert config.decoder_start_token_id == tok.cls_token_id == 2
        assert config.eos_token_id == tok.sep_token_id == 3
        assert config.pad_token_id == tok.pad_token_id == 0
    assert gen.config.decoder.is_decoder and gen.config.decoder.add_cross_attention
    assert model.family.decoder_start_token_id(model) == tok.cls_token_id
    assert model.generator_tokenizer.cls_token_id == tok.cls_token_id  # its tokenizer recorded
    pretrained = BertModel.from_pretrained(enc).state_dict()
    for side in (gen.encoder.state_dict(), {k.removeprefix("bert."): v for k, v in
                                            gen.decoder.state_dict().items()}):
        for name in ("embeddings.word_embeddings.weight",
                     "encoder.layer.0.attention.self.query.weight"):
            assert torch.equal(side[name], pretrained[name]), name  # warm: the checkpoint's
    # the answers it trains on start and end as it decodes
    ids = model.generator_tokenizer("paris")["input_ids"]
    assert ids[0] == gen.config.decoder_start_token_id and ids[-1] == gen.config.eos_token_id


@pytest.mark.parametrize("mode", ["token", "sequence"])
def test_init_from_encoder_then_train_eval_generate(encoder, tmp_path, mode):
    root, enc = encoder
    passages = tmp_path / "p.jsonl"
    passages.write_text("".join(json.dumps({"id": f"p{i}", "title": c, "text": f"the city of {c} "
                                            f"lies on the {r} river"}) + "\n"
                                for i, (c, r) in enumerate([("paris", "seine"),
                                                            ("rome", "tiber")] * 3)))
    qa = [{"question": "which river is paris on", "answers": ["seine"]},
          {"question": "which river is rome on", "answers": ["tiber"]}] * 2
    (tmp_path / "qa.jsonl").write_text("".join(json.dumps(q) + "\n" for q in qa))
    (tmp_path / "train.json").write_text(json.dumps({
        "data": {"train": "qa.jsonl", "eval": "qa.jsonl"},
        "train": {"max_steps": 2, "micro_batch_size": 2, "lr": 1e-3, "log_every": 1,
                  "checkpoint_every": 2, "eval_every": 0, "seed": 0, "device": "cpu",
                  "plot_file": None}}))
    code, err = _cli("index", "build", "--passages", passages, "--encoder", enc, "--out",
                     tmp_path / "kb", "--no-progress", "--max-length", "32")
    assert code == 0, err
    code, err = _cli("init", "--index", tmp_path / "kb", "--generator-from-encoder", enc,
                     "--n-docs", "2", "--mode", mode, "--max-context-length", "32", "--out",
                     tmp_path / "model")
    assert code == 0, err
    code, err = _cli("train", "--config", tmp_path / "train.json", "--model", tmp_path / "model",
                     "--output-dir", tmp_path / "run")
    assert code == 0, err
    code, err = _cli("eval", "--data", tmp_path / "qa.jsonl", "--model", tmp_path / "run",
                     "--out", tmp_path / "ev", "--max-new-tokens", "3", "--no-progress")
    assert code == 0, err
    assert json.loads((tmp_path / "ev" / "metrics.json").read_text())["examples"] == 4
    for beams in ("1", "2"):
        out = tmp_path / f"answers-{beams}.jsonl"
        code, err = _cli("generate", "--model", tmp_path / "run", "--questions",
                         tmp_path / "qa.jsonl", "--max-new-tokens", "3", "--num-beams", beams,
                         "--out", out, "--no-progress")
        assert code == 0, err
        assert len(out.read_text().splitlines()) == 4


def test_init_refuses_what_no_family_drives(encoder, tmp_path):
    root, enc = encoder
    # an encoder given as the generator: its causal-LM class has BERT's head, which a
    # decoder-only generator cannot have (it would also attend both ways)
    code, err = _cli("init", "--question-encoder", enc, "--generator", enc, "--out",
                     tmp_path / "m1")
    assert code == 2 and "--generator BertLMHeadModel's LM head (BertLMPredictionHead)" in err, err
    assert "warm-start an encoder-decoder" in err
    assert not (tmp_path / "m1").exists()
    # an encoder-decoder given to warm-start from
    bart = tmp_path / "bart"
    from transformers import BartConfig, BartForConditionalGeneration

    BartForConditionalGeneration(BartConfig(vocab_size=20, d_model=16, encoder_layers=1,
                                            decoder_layers=1, encoder_attention_heads=2,
                                            decoder_attention_heads=2, encoder_ffn_dim=32,
                                            decoder_ffn_dim=32)).save_pretrained(str(bart))
    code, err = _cli("init", "--question-encoder", enc, "--generator-from-encoder", bart,
                     "--generator-tokenizer", enc, "--out", tmp_path / "m2")
    assert code == 2, err
    assert "--generator-from-encoder" in err and "is an encoder-decoder model (BartConfig)" in err
    # both, or neither
    with pytest.raises(SystemExit) as exit_:
        _cli("init", "--question-encoder", enc, "--generator", enc,
             "--generator-from-encoder", enc, "--out", tmp_path / "m3")
    assert exit_.value.code == 2
