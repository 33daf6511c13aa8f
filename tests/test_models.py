"""RagModel: same loss and gradients as transformers' RAG models, checkpoints, bad input."""
from __future__ import annotations

import os

import pytest
import torch

from rag_fast.generation.heads import encoder_decoder_lm_head
from rag_fast.models import ModelDirError, RagModel, Retrieved, options
from rag_fast.testing import tiny_hf_rag

B, K, L, T = 2, 3, 7, 6


def _spread_weights(model: torch.nn.Module, seed: int = 1) -> None:
    """Larger random weights: with the default init std 0.02 (or 0.3) every passage gives nearly the
    same distribution, and RAG-Token and RAG-Sequence losses agree to 4 digits."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))


def _inputs(seed: int = 0, vocab: int = 50):
    g = torch.Generator().manual_seed(seed)
    contexts = torch.randint(3, vocab, (B * K, L), generator=g)
    mask = torch.ones_like(contexts)
    mask[1, -2:] = 0  # a padded context
    scores = torch.randn(B, K, generator=g)
    labels = torch.randint(3, vocab, (B, T), generator=g)
    labels[:, 0] = 0  # BOS, as BART tokenizers produce
    labels[1, -2:] = 1  # padding (pad_token_id=1)
    return contexts, mask, scores, labels


def _hf(mode: str):
    hf = tiny_hf_rag(mode, n_docs=K)
    _spread_weights(hf)
    return hf


def _losses(hf, ours, contexts, mask, scores, labels):
    s_hf, s_ours = scores.clone().requires_grad_(), scores.clone().requires_grad_()
    ref = hf(context_input_ids=contexts, context_attention_mask=mask, doc_scores=s_hf,
             labels=labels).loss
    out = ours(labels, context_input_ids=contexts, context_attention_mask=mask,
               doc_scores=s_ours, reduction="none").loss
    return ref, out, s_hf, s_ours


@pytest.mark.parametrize("mode", ["token", "sequence"])
@pytest.mark.parametrize("epsilon", [0.0, 0.1])  # 0.1: the label-smoothing branch
@pytest.mark.parametrize("lm_head_loss", ["fused", "materialized"])
def test_loss_and_gradients_equal_transformers(mode, epsilon, lm_head_loss):
    hf = _hf(mode)
    hf.config.label_smoothing = epsilon
    ours = RagModel.from_transformers(hf, lm_head_loss=lm_head_loss)
    assert ours.lm_head_loss == lm_head_loss
    assert ours.mode == mode and ours.epsilon == epsilon
    ref, out, s_hf, s_ours = _losses(hf, ours, *_inputs())
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    ref.sum().backward()
    hf_grads = {n: p.grad.clone() for n, p in hf.rag.generator.named_parameters()}
    hf.zero_grad()
    out.sum().backward()
    torch.testing.assert_close(s_ours.grad, s_hf.grad, rtol=1e-4, atol=1e-6)
    for n, p in ours.generator.named_parameters():
        # atol: some gradients are zero up to rounding (e.g. attention key biases)
        scale = max(1.0, float(hf_grads[n].abs().max()))
        torch.testing.assert_close(p.grad, hf_grads[n], rtol=1e-4, atol=1e-5 * scale, msg=n)


def test_token_and_sequence_losses_differ():
    # guards the test above against weights too small to tell the modes apart
    inputs = _inputs()
    token = _losses(_hf("token"), RagModel.from_transformers(_hf("token")), *inputs)[1]
    seq = _losses(_hf("sequence"), RagModel.from_transformers(_hf("sequence")), *inputs)[1]
    assert (token - seq).abs().max() > 1e-2


@pytest.mark.parametrize("mode", ["token", "sequence"])
def test_save_pretrained_checkpoint_gives_same_loss(mode, tmp_path):
    hf = _hf(mode)
    hf.save_pretrained(tmp_path / "hf")
    ours = RagModel.from_transformers(str(tmp_path / "hf"))
    assert ours.mode == mode and ours.n_docs == K
    ref, out, _, _ = _losses(hf, ours.eval(), *_inputs())
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", ["token", "sequence"])
def test_own_checkpoint_roundtrip_and_verification(mode, tmp_path):
    ours = RagModel.from_transformers(_hf(mode))
    inputs = _inputs()
    before = _losses(_hf(mode), ours, *inputs)[1]
    path = tmp_path / "ckpt"
    ours.save(str(path))
    ours.save(str(path))  # overwriting an existing checkpoint is atomic too
    assert not [p for p in os.listdir(tmp_path) if p != "ckpt"]  # no temporaries left
    loaded = RagModel.load(str(path))
    assert loaded.options() == ours.options()
    torch.testing.assert_close(_losses(_hf(mode), loaded, *inputs)[1], before)
    with open(path / "model.safetensors", "r+b") as f:  # flip a byte
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(ModelDirError, match="corrupt: model.safetensors does not match"):
        RagModel.load(str(path))
    with pytest.raises(ModelDirError, match="not a model directory: no config.json"):
        RagModel.load(str(tmp_path))


def test_missing_passages_get_zero_weight():
    hf = _hf("token")
    for mode in ("token", "sequence"):
        ours = RagModel.from_transformers(hf, mode=mode)
        contexts, mask, scores, labels = _inputs()
        scores[0, 2] = float("-inf")  # question 0 found only 2 passages
        s = scores.clone().requires_grad_()
        loss = ours(labels, context_input_ids=contexts, context_attention_mask=mask,
                    doc_scores=s, reduction="none").loss
        changed = contexts.clone()
        changed[2] = 5  # the missing passage's context must not matter
        loss2 = ours(labels, context_input_ids=changed, context_attention_mask=mask,
                     doc_scores=scores, reduction="none").loss
        loss.sum().backward()
        assert torch.isfinite(loss).all() and torch.isfinite(s.grad).all()
        assert s.grad[0, 2] == 0
        torch.testing.assert_close(loss, loss2)


class _FixedRetriever:
    """Returns given passages/embeddings; question 1 gets one passage fewer than K."""

    def __init__(self, dim: int):
        g = torch.Generator().manual_seed(3)
        self.embeddings = torch.randn(B, K, dim, generator=g)
        self.calls = 0

    def retrieve(self, q, n_docs):
        k = n_docs
        assert not q.requires_grad  # no gradient through the index
        self.calls += 1
        passages = [[{"title": f"t{b}{j}", "text": f"passage {b} {j}"} for j in range(k)]
                    for b in range(q.shape[0])]
        passages[1] = passages[1][:-1]
        return Retrieved(passages, self.embeddings[: q.shape[0]])


def _word_tokenizer():
    """A tiny word-level tokenizer (no downloads): pad=1, bos=0, eos=2 like BART."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<s>", "<pad>", "</s>", "<unk>", "/", "//", "passage", "what", "is", "x", "y"]
    words += [str(i) for i in range(10)] + [f"t{i}{j}" for i in range(B) for j in range(K)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>", unk_token="<unk>")


def test_retriever_path_scores_with_gradient_to_question_encoder():
    hf = _hf("sequence")
    tok = _word_tokenizer()
    retriever = _FixedRetriever(dim=16)
    model = RagModel(hf.rag.generator, hf.rag.question_encoder, retriever, mode="sequence",
                     n_docs=K, generator_tokenizer=tok, question_tokenizer=tok)
    labels = torch.tensor([[0, 5, 6, 2], [0, 7, 2, 1]])
    out = model(labels, questions=["what is x", "what is y"])
    assert retriever.calls == 1
    assert out.doc_scores.shape == (B, K) and torch.isinf(out.doc_scores[1, -1])
    assert out.passages[1][0]["text"] == "passage 1 0"
    out.loss.backward()
    grads = [p.grad for p in model.question_encoder.parameters() if p.grad is not None]
    assert grads and any(g.abs().sum() > 0 for g in grads)


def test_lm_head_matches_generator_logits_for_bart_and_t5():
    from transformers import MT5Config, MT5ForConditionalGeneration, T5Config, T5ForConditionalGeneration

    from rag_fast.models import _seq2seq

    small = dict(vocab_size=40, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2)
    t5 = T5ForConditionalGeneration(T5Config(**small)).eval()
    # Flan-T5 style (untied head, no output scale) and mT5 (whose forward never scales)
    flan = T5ForConditionalGeneration(T5Config(**small, tie_word_embeddings=False)).eval()
    mt5 = MT5ForConditionalGeneration(MT5Config(**small)).eval()
    bart = _hf("token").rag.generator
    ids = torch.randint(3, 40, (2, 5))
    dec = torch.randint(3, 40, (2, 4))
    for gen in (t5, flan, mt5, bart):
        mask = torch.ones_like(ids)
        expected = gen(input_ids=ids, attention_mask=mask, decoder_input_ids=dec).logits
        states = _seq2seq.decode(gen, dec, _seq2seq.encode(gen, ids, mask), mask)
        got = _seq2seq.lm_logits(encoder_decoder_lm_head(gen), states)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def _t5_generator():
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    return T5ForConditionalGeneration(T5Config(vocab_size=50, d_model=16, d_kv=8, d_ff=32,
                                               num_layers=1, num_heads=2)).eval()


def _generator_grads(model, contexts, mask, scores, labels) -> dict[str, torch.Tensor]:
    """Gradients of two backward passes (the second accumulates into ``.grad``)."""
    model.zero_grad(set_to_none=True)
    for _ in range(2):
        model(labels, context_input_ids=contexts, context_attention_mask=mask,
              doc_scores=scores).loss.backward()
    return {n: p.grad.clone() for n, p in model.generator.named_parameters()}


@pytest.mark.parametrize("mode", ["token", "sequence"])
@pytest.mark.parametrize("generator", ["bart", "t5"])  # both tie the LM head to the embeddings
@pytest.mark.parametrize("lm_head_loss", ["fused", "materialized"])
def test_tied_embedding_gradient_equals_plain_autograd(mode, generator, lm_head_loss,
                                                       monkeypatch):
    from rag_fast.models import _seq2seq

    gen = _hf(mode).rag.generator if generator == "bart" else _t5_generator()
    weight = gen.get_output_embeddings().weight
    assert gen.get_input_embeddings().weight is weight
    model = RagModel(gen, mode=mode, n_docs=K, lm_head_loss=lm_head_loss)
    inputs = _inputs()
    assert _seq2seq.split_tied_weight(gen) is not None  # the split path is taken
    with torch.no_grad():
        assert _seq2seq.split_tied_weight(gen) is None
    taken = []
    take = _seq2seq.DeferredHeadGrad.take
    # the LM head's weight gradient is computed late, by the tied weight's backward
    monkeypatch.setattr(_seq2seq.DeferredHeadGrad, "take",
                        lambda self: taken.append(take(self)) or taken[-1])
    got = _generator_grads(model, *inputs)
    assert len(taken) == 2 and all(t is not None and t.shape == weight.shape for t in taken)
    assert weight.grad.layout == torch.strided  # dense, as optimizers need
    assert not any(m.sparse for m in gen.modules() if isinstance(m, torch.nn.Embedding))
    monkeypatch.setattr(_seq2seq, "split_tied_weight", lambda generator: None)
    want = _generator_grads(model, *inputs)
    # float32 rounding only: with the split, the fused path takes the decoder states' gradient
    # from its forward pass (the online softmax product) rather than from its backward's
    # vocabulary tiles, summing the same terms in another order, which the layers below carry
    # on. Against the float64 model, both paths' gradients err by up to 2-4e-5 of each tensor's
    # largest element (BART, RAG-Token); they differ from each other by up to 2.1e-5 of it, so
    # each element may differ by 5e-5 of that here; and by 1e-5 where a gradient is zero up to
    # rounding (the attention keys' bias: softmax does not see a shift of its scores)
    for n, g in want.items():
        torch.testing.assert_close(got[n], g, rtol=1e-5, atol=max(1e-5, 5e-5 * g.abs().max()),
                                   msg=n)


@pytest.mark.parametrize("mode", ["token", "sequence"])
@pytest.mark.parametrize("lm_head_loss", ["fused", "materialized"])
def test_untied_lm_head_gradients_equal_transformers(mode, lm_head_loss):
    # an LM head with its own weight: split_tied_weight does not apply, the plain path runs
    from rag_fast.models import _seq2seq

    hf = _hf(mode)
    gen = hf.rag.generator
    gen.lm_head.weight = torch.nn.Parameter(gen.lm_head.weight.detach().clone() + 0.5)
    assert _seq2seq.split_tied_weight(gen) is None
    ours = RagModel.from_transformers(hf, lm_head_loss=lm_head_loss)
    ref, out, _, _ = _losses(hf, ours, *_inputs())
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    ref.sum().backward()
    hf_grads = {n: p.grad.clone() for n, p in gen.named_parameters()}
    hf.zero_grad()
    out.sum().backward()
    for n, p in ours.generator.named_parameters():
        scale = max(1.0, float(hf_grads[n].abs().max()))
        torch.testing.assert_close(p.grad, hf_grads[n], rtol=1e-4, atol=1e-5 * scale, msg=n)


def test_bad_input_gives_clear_errors():
    hf = _hf("token")
    model = RagModel.from_transformers(hf)
    contexts, mask, scores, labels = _inputs()
    with pytest.raises(ValueError, match="retrieved passages are for 1 questions but the "
                                         "question batch has 2"):
        model.score_passages(torch.randn(2, 16), [[{"text": "a"}]], torch.randn(1, K, 16))
    with pytest.raises(ValueError, match=r"context_input_ids must be \[B\*K, L\]"):
        model(labels, context_input_ids=contexts[:-1], context_attention_mask=mask[:-1],
              doc_scores=scores)
    with pytest.raises(ValueError, match="outside the generator's vocabulary"):
        model(labels + 100, context_input_ids=contexts, context_attention_mask=mask,
              doc_scores=scores)
    big = _word_tokenizer()
    big.add_tokens([f"w{i}" for i in range(100)])
    with pytest.raises(ValueError, match="tokens but the generator's vocabulary has 50"):
        RagModel(hf.rag.generator, hf.rag.question_encoder, generator_tokenizer=big)
    with pytest.raises(ValueError, match="mode must be one of"):
        RagModel(hf.rag.generator, mode="tokens")
    with pytest.raises(ValueError, match="seq2seq LM"):
        RagModel(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="question 0 has no retrieved passage"):
        model.score_passages(torch.randn(1, 16), [[]], torch.randn(1, K, 16))


def test_logits_workspace_is_reused_only_when_free():
    """Training steps share one logits buffer; a forward whose predecessor's graph is still alive
    gets its own, so accumulating two losses before one backward stays correct."""
    import copy

    from rag_fast.models import _seq2seq

    hf = _hf("token")
    model = RagModel.from_transformers(hf, lm_head_loss="materialized")  # the logits' buffer
    contexts, mask, scores, labels = _inputs()
    seen = []
    claim = _seq2seq.LogitsWorkspace.claim

    def spy(self, *args):
        out = claim(self, *args)
        seen.append(out.data_ptr())
        return out

    def loss():
        return model(labels, context_input_ids=contexts, context_attention_mask=mask,
                     doc_scores=scores).loss

    _seq2seq.LogitsWorkspace.claim = spy
    try:
        loss().backward()
        loss().backward()
        assert seen[0] == seen[1], "a free buffer is reused"
        grads_two_steps = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        both = loss() + loss()  # the first graph still holds its logits
        assert seen[2] != seen[3], "a buffer still in use is never handed out again"
        both.backward()
    finally:
        _seq2seq.LogitsWorkspace.claim = claim
    for n, p in model.named_parameters():
        if n in grads_two_steps:
            torch.testing.assert_close(p.grad, grads_two_steps[n], rtol=1e-5, atol=1e-6, msg=n)
    model.release_buffers()
    assert model._logits_workspace._buf is None
    clone = copy.deepcopy(model)  # the workspace (a lock, a buffer) is not copied
    assert clone._logits_workspace is not model._logits_workspace
    torch.testing.assert_close(
        clone(labels, context_input_ids=contexts, context_attention_mask=mask,
              doc_scores=scores).loss, loss())


def test_auto_lm_head_loss_fuses_once_the_logits_are_large(monkeypatch):
    import sys

    lin = sys.modules["rag_fast.ops.linear_rag_nll"]
    assert options.lm_head_path("auto", options.FUSED_LOGITS_BYTES) == "fused"
    assert options.lm_head_path("auto", options.FUSED_LOGITS_BYTES - 1) == "materialized"
    assert options.lm_head_path("fused", 1) == "fused"
    assert options.lm_head_path("materialized", 1 << 40) == "materialized"
    hf = _hf("token")
    model = RagModel.from_transformers(hf)
    assert model.lm_head_loss == "auto"
    calls = []  # the fused op's tile loop (under its custom op or the deferred-gradient path)
    statistics = lin._statistics
    monkeypatch.setattr(lin, "_statistics",
                        lambda *a, **k: calls.append(1) or statistics(*a, **k))
    contexts, mask, scores, labels = _inputs()

    def loss():
        return model(labels, context_input_ids=contexts, context_attention_mask=mask,
                     doc_scores=scores).loss

    small = loss()  # tiny logits: the materialized path
    assert not calls
    monkeypatch.setattr(options, "FUSED_LOGITS_BYTES", 1)
    fused = loss()  # every step's logits now count as large
    assert calls
    torch.testing.assert_close(fused, small, rtol=1e-5, atol=1e-6)
