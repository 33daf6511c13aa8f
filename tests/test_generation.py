"""RAG-Token and RAG-Sequence generation give transformers' token ids, and reject bad input.

The tiny random generators are re-initialised with larger weights (and a per-seed EOS bias) so
that answers depend on the passages and some stop early: with the default initialisation every
question gets the same repeated token, which would make equality tests vacuous.
"""
from __future__ import annotations

import pytest
import torch

from rag_fast.generation import (
    UnsupportedGeneratorError,
    rag_sequence_generate,
    rag_token_generate,
)
from rag_fast.testing import tiny_hf_rag

V, K, B, S = 60, 3, 3, 9


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def _model(mode: str, seed: int):
    model = tiny_hf_rag(mode, seed=seed, n_docs=K, vocab_size=V, d_model=32, layers=2)
    torch.manual_seed(100 + seed)
    with torch.no_grad():
        for p in model.rag.generator.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.3)
        model.rag.generator.final_logits_bias[0, 2] = float(seed % 3)  # EOS more or less likely
    return model


def _inputs(seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, V, (B * K, S), generator=g)
    mask = torch.ones_like(ids)
    # Questions of different lengths: rows padded (pad id 1) after 4, 6 and 9 tokens.
    for row, length in ((0, 4), (4, 6), (8, 9)):
        ids[row, length:] = 1
        mask[row, length:] = 0
    return ids, mask, torch.randn(B, K, generator=g)


def _hf(model, ids, mask, scores, **kw):
    return model.generate(context_input_ids=ids, context_attention_mask=mask, doc_scores=scores,
                          **kw)


# (seed, settings): greedy and plain beam search on several seeds, each other rule once.
CASES = [
    pytest.param(0, dict(num_beams=1, max_length=10), id="greedy-seed0"),
    pytest.param(1, dict(num_beams=1, max_length=10), id="greedy-seed1"),
    pytest.param(0, dict(num_beams=3, max_length=10), id="beam3-seed0"),
    pytest.param(2, dict(num_beams=3, max_length=10), id="beam3-seed2"),
    pytest.param(1, dict(num_beams=4, max_length=8, num_return_sequences=2), id="beam4-return2"),
    pytest.param(2, dict(num_beams=3, max_length=9, min_length=5), id="beam3-min-length"),
    pytest.param(0, dict(num_beams=2, max_length=10, length_penalty=0.5, early_stopping=True),
                 id="beam2-penalty-early-stop"),
]


@pytest.mark.parametrize("seed,settings", CASES)
def test_rag_token_same_ids_as_transformers(seed, settings):
    model = _model("token", seed)
    ids, mask, scores = _inputs(seed)
    expected = _hf(model, ids, mask, scores, **settings)
    got = rag_token_generate(model, ids, mask, scores, **settings)
    assert torch.equal(got, expected), f"\n{got}\n!=\n{expected}"


@pytest.mark.parametrize("seed,settings", CASES)
def test_rag_sequence_thorough_same_ids_as_transformers(seed, settings):
    model = _model("sequence", seed)
    ids, mask, scores = _inputs(seed)
    expected = _hf(model, ids, mask, scores, **settings)
    got = rag_sequence_generate(model, ids, mask, scores, **settings)
    assert torch.equal(got, expected), f"\n{got}\n!=\n{expected}"


@pytest.mark.parametrize("seed,settings", [
    pytest.param(0, dict(num_beams=3, max_length=10), id="beam3-seed0"),
    pytest.param(1, dict(num_beams=4, max_length=8, num_return_sequences=2), id="beam4-return2"),
    pytest.param(2, dict(num_beams=3, max_length=9, min_length=5), id="beam3-min-length"),
])
def test_rag_sequence_thorough_pruned_rescoring_same_ids(seed, settings):
    # Unpadded passages: the beams and the rescoring read the same encoder outputs, so the
    # rescoring prunes (hypothesis, passage) pairs with the beams' scores as lower bounds.
    model = _model("sequence", seed)
    ids, _, scores = _inputs(seed)
    ids = ids.masked_fill(ids == 1, 5)
    mask = torch.ones_like(ids)
    expected = _hf(model, ids, mask, scores, **settings)
    got = rag_sequence_generate(model, ids, mask, scores, **settings)
    assert torch.equal(got, expected), f"\n{got}\n!=\n{expected}"


def test_rag_token_min_new_tokens_and_impls_agree():
    model = _model("token", 1)
    ids, mask, scores = _inputs(1)
    expected = _hf(model, ids, mask, scores, num_beams=3, max_length=9, min_new_tokens=6)
    for impl in ("torch", "auto"):
        got = rag_token_generate(model, ids, mask, scores, num_beams=3, max_new_tokens=8,
                                 min_new_tokens=6, impl=impl)
        assert torch.equal(got, expected)


def test_rag_token_missing_passage():
    # A -inf score removes a passage; the result equals dropping it from the inputs.
    model = _model("token", 0)
    ids, mask, scores = _inputs(0)
    scores[1, 2] = float("-inf")
    got = rag_token_generate(model, ids, mask, scores, num_beams=2, max_length=8)
    expected = _hf(model, ids, mask, scores, num_beams=2, max_length=8)
    assert torch.equal(got, expected)


def test_rag_sequence_fast_decoding():
    model = _model("sequence", 2)
    ids, mask, scores = _inputs(2)
    out = rag_sequence_generate(model, ids, mask, scores, num_beams=3, max_length=8,
                                num_return_sequences=2, decoding="fast")
    assert out.shape[0] == B * 2 and out.shape[1] <= 8
    assert bool((out[:, 0] == 2).all())  # every answer starts with the decoder start token


def test_bad_inputs():
    model = _model("token", 0)
    ids, mask, scores = _inputs(0)
    with pytest.raises(ValueError, match="larger than the vocabulary"):
        rag_token_generate(model, ids, mask, scores, num_beams=V + 1)
    with pytest.raises(ValueError, match="not above the decoder prompt"):
        rag_token_generate(model, ids, mask, scores, max_length=1)
    with pytest.raises(ValueError, match="max_new_tokens"):
        rag_sequence_generate(model, ids, mask, scores, max_new_tokens=0)
    with pytest.raises(ValueError, match="rows, expected B\\*K"):
        rag_token_generate(model, ids[:-1], mask[:-1], scores)
    with pytest.raises(ValueError, match="decoding must be"):
        rag_sequence_generate(model, ids, mask, scores, decoding="greedy")


def test_generator_without_encoder():
    from transformers import GPT2Config, GPT2LMHeadModel

    decoder_only = GPT2LMHeadModel(GPT2Config(vocab_size=V, n_embd=16, n_layer=1, n_head=2))
    ids, mask, scores = _inputs(0)
    with pytest.raises(UnsupportedGeneratorError, match="encoder-decoder"):
        rag_token_generate(decoder_only, ids, mask, scores, n_docs=K)
    assert issubclass(UnsupportedGeneratorError, ValueError)


@pytest.mark.parametrize("one_thread_steps", [True, False])
def test_step_threads_give_transformers_ids(one_thread_steps, monkeypatch):
    # With two intra-op threads a step runs on one or both; the ids never change.
    from rag_fast.generation import _decoder

    torch.set_num_threads(2)  # the autouse fixture restores the caller's setting
    monkeypatch.setattr(_decoder, "STEP_ONE_THREAD", one_thread_steps)
    settings = dict(num_beams=3, max_length=12)
    for kind, generate in (("token", rag_token_generate), ("sequence", rag_sequence_generate)):
        model = _model(kind, 0)
        ids, mask, scores = _inputs(0)
        expected = _hf(model, ids, mask, scores, **settings)
        assert torch.equal(generate(model, ids, mask, scores, **settings), expected), kind
        assert torch.get_num_threads() == 2  # restored after every step
