"""Decoder-only generators (any ``*ForCausalLM``) in RagModel: training losses, gradients and
decoding against tests/reference_causal.py, an fp64 oracle that runs the generator's
own forward once per (question, passage[, hypothesis]) unpadded, without cache.

Tiny random Llama, Qwen2 and GPT-2 configs (2 layers, no hub), in float64; prompts of different
lengths per passage (left-padded here), a missing passage (score -inf) and padded answers.
"""
from __future__ import annotations

import pytest
import torch

import reference_causal as rc
from rag_fast.generation import causal
from rag_fast.generation.causal import _resolve_settings, causal_generate
from rag_fast.models import RagModel, _causal

PAD, BOS, EOS = 0, 1, 2
TOL = dict(rtol=1e-9, atol=1e-10)


def _generator(family: str, seed: int = 0, sharpen: float = 1.0):
    from transformers import (GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM,
                              Qwen2Config, Qwen2ForCausalLM)

    ids = dict(pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS)
    if family == "llama":
        cfg, cls = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64,
                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                               max_position_embeddings=128, **ids), LlamaForCausalLM
    elif family == "qwen2":
        cfg, cls = Qwen2Config(vocab_size=131, hidden_size=48, intermediate_size=96,
                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                               max_position_embeddings=128, tie_word_embeddings=True,
                               **ids), Qwen2ForCausalLM
    else:
        cfg, cls = GPT2Config(vocab_size=113, n_embd=32, n_layer=2, n_head=4, n_positions=128,
                              resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                              **ids), GPT2LMHeadModel
    torch.manual_seed(seed)
    g = cls(cfg).double().eval()
    if sharpen != 1.0:  # peakier next-token distributions: decoding paths that differ more
        with torch.no_grad():
            g.get_output_embeddings().weight.mul_(sharpen)
    return g


def _prompts(V: int, lengths: list[list[int]], seed: int = 1):
    """Unpadded prompts[b][k] and their left-padded ``[B*K, S]`` ids and mask."""
    gen = torch.Generator().manual_seed(seed)
    prompts = [[torch.randint(3, V, (n,), generator=gen) for n in row] for row in lengths]
    B, K = len(lengths), len(lengths[0])
    S = max(max(row) for row in lengths)
    ids = torch.full((B * K, S), PAD, dtype=torch.long)
    mask = torch.zeros((B * K, S), dtype=torch.long)
    for b in range(B):
        for k in range(K):
            n = lengths[b][k]
            ids[b * K + k, S - n:] = prompts[b][k]
            mask[b * K + k, S - n:] = 1
    return prompts, ids, mask


LENGTHS = [[5, 9, 3], [7, 2, 6]]  # B=2 questions, K=3 passages of different lengths


# ------------------------------------------------------------------------------- states
@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2"])
def test_left_padded_rows_give_the_unpadded_logits(family):
    """answer_states of a left-padded row == the generator's own logits of the row unpadded
    (position ids count real tokens), through lm_head."""
    g = _generator(family)
    V = g.config.vocab_size
    prompts, ids, mask = _prompts(V, LENGTHS)
    answers = torch.tensor([[5, 6, 7, EOS], [8, EOS, PAD, PAD]])
    states = _causal.answer_states(g, ids, mask, answers)  # [B*K, T, d]
    head = causal.decoder_only_lm_head(g)
    logits = torch.nn.functional.linear(states, head.weight, head.bias)
    assert logits.shape == (6, 4, V)
    for b in range(2):
        n = 4 if b == 0 else 2
        for k in range(3):
            want = rc.answer_log_probs(g, prompts[b][k], answers[b, :n])
            torch.testing.assert_close(logits[b * 3 + k, :n], want, **TOL)
    # the same prompts padded more (an extra column of padding) give the same states
    wider = torch.cat([torch.full((6, 2), PAD), ids], 1)
    wider_mask = torch.cat([torch.zeros((6, 2), dtype=torch.long), mask], 1)
    torch.testing.assert_close(_causal.answer_states(g, wider, wider_mask, answers), states, **TOL)


# ------------------------------------------------------------------------------- losses
def _scores(missing: bool = True):
    s = torch.tensor([[0.3, -0.2, 1.1], [0.5, 0.1, -0.4]], dtype=torch.float64)
    if missing:
        s[1, 2] = float("-inf")  # question 1 has two passages
    return s


@pytest.mark.parametrize("lm_head_loss", ["fused", "materialized"])
@pytest.mark.parametrize("mode", ["token", "sequence"])
@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2"])
def test_loss_and_gradients_match_reference(family, mode, lm_head_loss):
    g = _generator(family)
    V = g.config.vocab_size
    prompts, ids, mask = _prompts(V, LENGTHS)
    labels = torch.tensor([[5, 6, 7, 9, EOS], [8, 11, EOS, PAD, -100]])
    model = RagModel(g, mode=mode, n_docs=3, epsilon=0.1, lm_head_loss=lm_head_loss)
    params = [p for p in g.parameters() if p.requires_grad]

    scores = _scores().requires_grad_(True)
    loss = model.loss_from_contexts(ids, mask, scores, labels, reduction="none")
    grads = torch.autograd.grad(loss.sum() + 0.5 * loss[0], [scores, *params])

    ref_scores = _scores().requires_grad_(True)
    ref = rc.rag_loss(g, prompts, ref_scores, labels, mode=mode, pad_token_id=PAD, epsilon=0.1)
    ref_grads = torch.autograd.grad(ref.sum() + 0.5 * ref[0], [ref_scores, *params])

    assert loss.shape == (2,) and torch.isfinite(loss).all()
    torch.testing.assert_close(loss, ref, **TOL)
    for got, want in zip(grads, ref_grads):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, **TOL)
    assert float(grads[0][1, 2]) == 0.0  # the missing passage gets no weight, no NaN
    # the mean reduction through forward()
    out = model(labels, context_input_ids=ids, context_attention_mask=mask, doc_scores=_scores())
    torch.testing.assert_close(out.loss, ref.detach().mean(), **TOL)


@pytest.mark.parametrize("mode", ["token", "sequence"])
@pytest.mark.parametrize("family", ["qwen2", "llama"])  # tied and untied LM heads
def test_fused_tiles_in_float32_equal_the_reference(family, mode, monkeypatch):
    """float64 runs the materialized reference; in float32 the fused LM-head loss runs its
    vocabulary tiles (and, for a tied head, the late weight gradient): every gradient of the
    generator and of the scores against the float64 oracle."""
    import sys

    from rag_fast.models import _seq2seq

    lin = sys.modules["rag_fast.ops.linear_rag_nll"]
    g64 = _generator(family)
    g = _generator(family).float()
    V = g.config.vocab_size
    prompts, ids, mask = _prompts(V, LENGTHS)
    labels = torch.tensor([[5, 6, 7, 9, EOS], [8, 11, EOS, PAD, -100]])
    calls = []  # the tile loop, under the custom op or the deferred-gradient Function
    statistics = lin._statistics
    monkeypatch.setattr(lin, "_statistics",
                        lambda *a, **k: calls.append(1) or statistics(*a, **k))
    model = RagModel(g, mode=mode, n_docs=3, epsilon=0.1, lm_head_loss="fused")
    assert (_seq2seq.split_tied_weight(g) is not None) == (family == "qwen2")
    scores = _scores().float().requires_grad_(True)
    loss = model.loss_from_contexts(ids, mask, scores, labels, reduction="none")
    params = list(g.parameters())
    grads = torch.autograd.grad(loss.sum() + 0.5 * loss[0], [scores, *params])
    assert calls, "the tiled op ran"
    ref_scores = _scores().requires_grad_(True)
    ref = rc.rag_loss(g64, prompts, ref_scores, labels, mode=mode, pad_token_id=PAD, epsilon=0.1)
    ref_grads = torch.autograd.grad(ref.sum() + 0.5 * ref[0], [ref_scores, *g64.parameters()])
    torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=1e-5)
    names = ["doc_scores"] + [n for n, _ in g.named_parameters()]
    for name, got, want in zip(names, grads, ref_grads):
        scale = max(1.0, float(want.abs().max()))
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=2e-5 * scale, msg=name)


@pytest.mark.parametrize("mode", ["token", "sequence"])
def test_pad_equal_to_eos_keeps_the_eos_target(mode):
    """Many decoder-only models pad with their EOS token. Then a pad id in the labels is the EOS
    target (not ignored) and padding is -100; the loss equals the reference's."""
    g = _generator("llama")
    g.config.pad_token_id = EOS
    V = g.config.vocab_size
    prompts, ids, mask = _prompts(V, LENGTHS)
    ids = ids.masked_fill(mask == 0, EOS)
    labels = torch.tensor([[5, 6, EOS, -100], [8, 11, 12, EOS]])
    model = RagModel(g, mode=mode, n_docs=3, lm_head_loss="fused")
    loss = model.loss_from_contexts(ids, mask, _scores(), labels, reduction="none")
    ref = rc.rag_loss(g, prompts, _scores(), labels, mode=mode, pad_token_id=EOS,
                      eos_token_id=EOS)
    torch.testing.assert_close(loss, ref, **TOL)
    without_eos = model.loss_from_contexts(ids, mask, _scores(),
                                           labels.masked_fill(labels == EOS, -100),
                                           reduction="none")
    assert bool((loss > without_eos).all())  # the EOS targets count


def test_a_question_with_no_passage_is_refused():
    g = _generator("llama")
    prompts, ids, mask = _prompts(g.config.vocab_size, LENGTHS)
    scores = _scores()
    scores[1] = float("-inf")
    model = RagModel(g, mode="token", n_docs=3)
    with pytest.raises(ValueError, match="doc_scores: question 1 has every passage score -inf"):
        model.loss_from_contexts(ids, mask, scores, torch.tensor([[5, EOS], [6, EOS]]))


def _word_tokenizer(words: list[str]):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": PAD, "<s>": BOS, "</s>": EOS, "<unk>": 3}
    for w in words:
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>", unk_token="<unk>")


def test_build_contexts_left_pads_and_trains_on_text():
    """Texts -> left-padded prompts (truncated on the left, keeping the question); the loss of
    forward(questions, passages) equals the reference on each prompt tokenised alone."""
    g = _generator("llama")
    words = "/ // who is where does live in ann bob cid x y z the long title text".split()
    tok = _word_tokenizer(words)
    questions = ["who is ann", "where does bob live"]
    passages = [[{"title": "x", "text": "ann is z"}, {"title": "y", "text": "the long text"}],
                [{"title": "z", "text": "bob live in cid"}]]  # question 1: one passage
    model = RagModel(g, mode="token", n_docs=2, generator_tokenizer=tok, max_context_length=9)
    ctx = model.build_contexts(questions, passages)
    assert tok.padding_side == "right" and tok.truncation_side == "right"  # restored
    ids, mask = ctx["input_ids"], ctx["attention_mask"]
    assert bool(mask[:, -1].all())  # left-padded
    assert ids.shape[1] == 9  # truncated: "x / ann is z // who is ann" is 8 tokens, row 1 more
    texts = ["x / ann is z // who is ann", "y / the long text // who is ann",
             "z / bob live in cid // where does bob live", "where does bob live"]
    prompts = []
    for text in texts:
        row = torch.tensor(tok(text)["input_ids"])[-9:]  # left truncation keeps the end
        prompts.append(row)
    for r, p in enumerate(prompts):
        assert ids[r, mask[r].bool()].tolist() == p.tolist()
    labels = torch.tensor([[10, 11, EOS], [12, EOS, PAD]])
    scores = torch.tensor([[0.2, -0.3], [0.4, float("-inf")]], dtype=torch.float64)
    loss = model(labels, context_input_ids=ids, context_attention_mask=mask,
                 doc_scores=scores, reduction="none").loss
    ref = rc.rag_loss(g, [prompts[:2], prompts[2:]], scores, labels, mode="token",
                      pad_token_id=PAD)
    torch.testing.assert_close(loss, ref, **TOL)


# ------------------------------------------------------------------------------- errors
def test_bad_generators_and_inputs_are_refused():
    g = _generator("llama")
    g.config.pad_token_id = None
    with pytest.raises(ValueError, match="pad_token_id"):
        RagModel(g, n_docs=3)
    g.config.pad_token_id = PAD
    g.config.final_logit_softcapping = 30.0
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        RagModel(g, n_docs=3)
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        causal.decoder_only_lm_head(g)
    g.config.final_logit_softcapping = None
    model = RagModel(g, n_docs=3)
    assert model.is_causal
    _, ids, mask = _prompts(g.config.vocab_size, LENGTHS)
    right = torch.flip(ids, [1]), torch.flip(mask, [1])  # right-padded
    with pytest.raises(ValueError, match="left-padded"):
        model.loss_from_contexts(*right, _scores(), torch.tensor([[5, EOS], [6, EOS]]))
    with pytest.raises(ValueError, match="positions"):
        model.loss_from_contexts(ids, mask, _scores(), torch.full((2, 125), 5))
    with pytest.raises(ValueError, match="labels must be"):
        model.loss_from_contexts(ids, mask, _scores(), torch.tensor([5, EOS]))
    with pytest.raises(ValueError, match="question_encoder"):  # saving needs a transformers one
        model.save("unused-path")
    with pytest.raises(ValueError, match="left-padded"):
        causal_generate(g, *right, _scores(), max_new_tokens=2)
    with pytest.raises(ValueError, match="positions"):
        causal_generate(g, ids, mask, _scores(), max_new_tokens=200)


# ----------------------------------------------------------------------------- decoding
def _decoding_case(family: str, **settings):
    """A sharpened generator, prompts, scores with a missing passage, and an EOS id with which
    decoding with ``settings`` returns an answer that stops early (one of the tokens that
    decoding produces without EOS, tried in order), so that answers end at different lengths."""
    g = _generator(family, seed=3, sharpen=8.0)
    prompts, ids, mask = _prompts(g.config.vocab_size, LENGTHS, seed=4)
    scores = _scores()
    width = settings["max_new_tokens"]
    probe = causal_generate(g, ids, mask, scores, **{**settings, "eos_token_id": EOS})
    for eos in dict.fromkeys(probe[:, 1:].reshape(-1).tolist()):
        out = causal_generate(g, ids, mask, scores, **{**settings, "eos_token_id": eos})
        if any(eos in row[:width - 1] for row in out.tolist()):
            return g, prompts, ids, mask, scores, eos
    raise AssertionError("no token of the answers ends one early")


def _ids(rows: list[list[int]], pad: int = PAD) -> torch.Tensor:
    width = max(len(r) for r in rows)
    return torch.tensor([r + [pad] * (width - len(r)) for r in rows])


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_rag_token_greedy_matches_reference(family):
    g, prompts, ids, mask, scores, eos = _decoding_case(family, max_new_tokens=6)
    model = RagModel(g, mode="token", n_docs=3)
    out = model.generate(context_input_ids=ids, context_attention_mask=mask, doc_scores=scores,
                         max_new_tokens=6, eos_token_id=eos).sequences
    ref = rc.rag_token_greedy(g, prompts, scores, max_new_tokens=6, eos_token_id=eos,
                              pad_token_id=PAD)
    assert any(r[-1] == eos and len(r) < 6 for r in ref)  # an answer stopped early
    assert out.tolist() == _ids(ref).tolist()


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_rag_token_beam_matches_reference(family):
    g, prompts, ids, mask, scores, eos = _decoding_case(
        family, num_beams=3, max_new_tokens=6, num_return_sequences=2)
    model = RagModel(g, mode="token", n_docs=3)
    settings = dict(num_beams=3, max_new_tokens=6, num_return_sequences=2, eos_token_id=eos)
    out = model.generate(context_input_ids=ids, context_attention_mask=mask, doc_scores=scores,
                         **settings).sequences
    s = _resolve_settings(g, None, g.config.vocab_size, PAD, settings)
    ref = rc.rag_token_beam(g, prompts, scores, s)
    assert out.tolist() == _ids(ref).tolist()
    assert any(r[-1] == eos and len(r) < 6 for r in ref)  # some answer stopped early


@pytest.mark.parametrize("decoding", ["thorough", "fast"])
@pytest.mark.parametrize("num_beams", [1, 3])
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_rag_sequence_matches_reference(family, num_beams, decoding, monkeypatch):
    g, prompts, ids, mask, scores, eos = _decoding_case(
        family, mode="sequence", num_beams=num_beams, max_new_tokens=5, decoding=decoding,
        num_return_sequences=2)
    model = RagModel(g, mode="sequence", n_docs=3)
    settings = dict(num_beams=num_beams, max_new_tokens=5, eos_token_id=eos)
    out = model.generate(context_input_ids=ids, context_attention_mask=mask, doc_scores=scores,
                         decoding=decoding, num_return_sequences=2, **settings).sequences
    s = _resolve_settings(g, None, g.config.vocab_size, PAD,
                          {**settings, "num_return_sequences": num_beams})
    ref = rc.rag_sequence_decode(g, prompts, scores, s, decoding=decoding,
                                 num_return_sequences=2)
    assert all(len(per_question) >= 1 for per_question in ref)
    assert sum(len(per_question) for per_question in ref) >= 3  # hypotheses to rank
    want = [tokens for per_question in ref
            for tokens in [t for t, _ in per_question] + [[]] * (2 - len(per_question))]
    assert out.tolist() == _ids(want).tolist()
    if decoding == "thorough":  # rescoring one question at a time gives the same answers
        import rag_fast.generation.causal as causal

        monkeypatch.setattr(causal, "SCORE_CHUNK_BYTES", 1)
        again = model.generate(context_input_ids=ids, context_attention_mask=mask,
                               doc_scores=scores, decoding=decoding, num_return_sequences=2,
                               **settings).sequences
        assert again.tolist() == out.tolist()


# ------------------------------------------------------------------------------ float32
def test_float32_kernels_agree_with_the_plain_paths():
    """A float32 generator: the fused losses (C++ kernels, "auto") equal the fp64 reference to
    float32 precision, and decoding with the C++ beam step ("auto") gives the ids of the
    plain-PyTorch step ("torch")."""
    g = _generator("llama", seed=3, sharpen=8.0)
    prompts, ids, mask = _prompts(g.config.vocab_size, LENGTHS, seed=4)
    labels = torch.tensor([[5, 6, 7, 9, EOS], [8, 11, EOS, PAD, -100]])
    ref = {mode: rc.rag_loss(g, prompts, _scores(), labels, mode=mode, pad_token_id=PAD,
                             epsilon=0.1).detach() for mode in ("token", "sequence")}
    g = g.float()
    for mode in ("token", "sequence"):
        for lm_head_loss in ("fused", "materialized"):
            model = RagModel(g, mode=mode, n_docs=3, epsilon=0.1, lm_head_loss=lm_head_loss)
            loss = model.loss_from_contexts(ids, mask, _scores().float(), labels,
                                            reduction="none")
            assert loss.dtype == torch.float32
            torch.testing.assert_close(loss.double(), ref[mode], rtol=1e-5, atol=1e-5)
    scores = _scores().float()
    for mode, settings in (("token", dict(num_beams=1)), ("token", dict(num_beams=3)),
                           ("sequence", dict(num_beams=3, num_return_sequences=2))):
        model = RagModel(g, mode=mode, n_docs=3)
        runs = [model.generate(context_input_ids=ids, context_attention_mask=mask,
                               doc_scores=scores, max_new_tokens=5, impl=impl,
                               **settings).sequences for impl in ("auto", "torch")]
        assert runs[0].tolist() == runs[1].tolist()
