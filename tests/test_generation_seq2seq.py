"""RAG-Token and RAG-Sequence decoding with non-BART generators (T5, Marian, Pegasus, mBART)
give transformers' token ids.

Every generator is a tiny random model built from a config (no hub access), its weights
re-drawn larger so that answers depend on the passages and some stop early; transformers'
``RagTokenForGeneration.generate`` / ``RagSequenceForGeneration.generate`` with the same weights
and inputs is the oracle. The contexts are padded differently per row, so the encoder masks
matter.
"""
from __future__ import annotations

import pytest
import torch

from rag_fast.generation import rag_sequence_generate, rag_token_generate
from rag_fast.generation._decoder import BartDecoder
from rag_fast.generation.encoder_decoder import make_decoder
from rag_fast.generation._generic_decoder import GenericDecoder

V, K, B, S = 60, 3, 3, 9


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def generator_config(kind: str):
    """A tiny generator config of family ``kind`` (pad, EOS and start tokens set)."""
    import transformers as tf

    bart_like = dict(vocab_size=V, d_model=32, encoder_layers=2, decoder_layers=2,
                     encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64,
                     decoder_ffn_dim=64, max_position_embeddings=64, forced_eos_token_id=None)
    # bos_token_id=None spelled out: transformers' RAG-Sequence reads the attribute.
    t5_like = dict(vocab_size=V, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
                   num_heads=4, relative_attention_num_buckets=8, pad_token_id=0,
                   eos_token_id=1, decoder_start_token_id=0, bos_token_id=None)
    if kind == "t5":  # tied embeddings: the decoder output is scaled by d_model ** -0.5
        return tf.T5Config(**t5_like)
    if kind == "flan-t5":  # Flan-T5 / T5 v1.1 layout: gated FFN, untied head, no scale
        return tf.T5Config(feed_forward_proj="gated-gelu", tie_word_embeddings=False, **t5_like)
    if kind == "mt5":
        return tf.MT5Config(**t5_like)
    if kind == "umt5":
        return tf.UMT5Config(**t5_like)
    if kind == "marian":
        return tf.MarianConfig(pad_token_id=V - 1, eos_token_id=2, decoder_start_token_id=V - 1,
                               **bart_like)
    if kind == "pegasus":
        return tf.PegasusConfig(pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
                                bos_token_id=None, **bart_like)
    if kind == "mbart":
        return tf.MBartConfig(pad_token_id=1, eos_token_id=2, bos_token_id=0,
                              decoder_start_token_id=2, forced_bos_token_id=None, **bart_like)
    if kind in ("bert2bert", "bert2gpt2"):  # composites: the decoder carries the LM head
        from rag_fast.testing import tiny_composite_config

        return tiny_composite_config(kind.removeprefix("bert2"), vocab_size=V)
    if kind == "bart":
        return tf.BartConfig(pad_token_id=1, eos_token_id=2, bos_token_id=0,
                             decoder_start_token_id=2, forced_bos_token_id=None, **bart_like)
    raise ValueError(kind)


def tiny_rag(kind: str, mode: str, seed: int):
    """A transformers RAG model (``mode`` "token" / "sequence") with a tiny ``kind`` generator."""
    from transformers import (DPRConfig, RagConfig, RagSequenceForGeneration,
                              RagTokenForGeneration)

    q = DPRConfig(vocab_size=99, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                  intermediate_size=32, max_position_embeddings=128)
    config = RagConfig.from_question_encoder_generator_configs(q, generator_config(kind),
                                                               n_docs=K)
    torch.manual_seed(seed)
    cls = RagTokenForGeneration if mode == "token" else RagSequenceForGeneration
    model = cls(config).eval()
    torch.manual_seed(100 + seed)
    with torch.no_grad():
        for p in model.rag.generator.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.3)
        eos = model.rag.generator.config.eos_token_id
        bias = getattr(model.rag.generator, "final_logits_bias", None)
        if bias is not None:  # EOS more or less likely, per seed
            bias[0, eos] = float(seed % 3)
        else:  # T5 has no logits bias: a longer EOS output row makes EOS's logit swing more
            model.rag.generator.get_output_embeddings().weight[eos] *= 2.0
    return model


def tiny_inputs(seed: int, pad: int, padded: bool = True):
    """``(context ids [B*K, S], mask, doc scores [B, K])``, rows padded after 4, 6, 9 tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, V - 1, (B * K, S), generator=g)
    mask = torch.ones_like(ids)
    if padded:
        for row, length in ((0, 4), (4, 6), (8, 9)):
            ids[row, length:] = pad
            mask[row, length:] = 0
    return ids, mask, torch.randn(B, K, generator=g)


def hf_generate(model, ids, mask, scores, **settings):
    return model.generate(context_input_ids=ids, context_attention_mask=mask, doc_scores=scores,
                          **settings)


def _check(kind, mode, seed, settings, padded=True):
    model = tiny_rag(kind, mode, seed)
    ids, mask, scores = tiny_inputs(seed, model.rag.generator.config.pad_token_id, padded)
    expected = hf_generate(model, ids, mask, scores, **settings)
    generate = rag_token_generate if mode == "token" else rag_sequence_generate
    got = generate(model, ids, mask, scores, **settings)
    assert got.shape == expected.shape and torch.equal(got, expected), f"\n{got}\n!=\n{expected}"
    return got


SETTINGS = [
    pytest.param(0, dict(num_beams=1, max_length=10), id="greedy-seed0"),
    pytest.param(1, dict(num_beams=1, max_length=10), id="greedy-seed1"),
    pytest.param(0, dict(num_beams=3, max_length=10), id="beam3-seed0"),
    pytest.param(2, dict(num_beams=3, max_length=10), id="beam3-seed2"),
    pytest.param(1, dict(num_beams=4, max_length=8, num_return_sequences=2), id="beam4-return2"),
    pytest.param(2, dict(num_beams=3, max_length=9, min_length=5), id="beam3-min-length"),
    pytest.param(0, dict(num_beams=2, max_length=10, length_penalty=0.5, early_stopping=True),
                 id="beam2-penalty-early-stop"),
]


@pytest.mark.parametrize("seed,settings", SETTINGS)
@pytest.mark.parametrize("mode", ["token", "sequence"])
def test_t5_same_ids_as_transformers(mode, seed, settings):
    got = _check("t5", mode, seed, settings)
    assert got[:, 0].eq(0).all()  # T5 starts decoding with the pad token


@pytest.mark.parametrize("kind", ["flan-t5", "mt5", "umt5", "marian", "pegasus", "mbart",
                                  "bert2bert", "bert2gpt2"])
@pytest.mark.parametrize("mode", ["token", "sequence"])
@pytest.mark.parametrize("seed,settings", [
    pytest.param(0, dict(num_beams=1, max_length=10), id="greedy"),
    pytest.param(1, dict(num_beams=3, max_length=10), id="beam3"),
    pytest.param(2, dict(num_beams=2, max_length=9, min_length=4), id="beam2-min-length"),
])
def test_other_seq2seq_same_ids_as_transformers(kind, mode, seed, settings):
    _check(kind, mode, seed, settings)


@pytest.mark.parametrize("seed,settings", [
    pytest.param(0, dict(num_beams=3, max_length=10), id="beam3"),
    pytest.param(1, dict(num_beams=4, max_length=8, num_return_sequences=2), id="beam4-return2"),
])
def test_t5_sequence_unpadded_contexts_same_ids(seed, settings):
    # Unpadded contexts: the beams and the rescoring read the same encoder outputs.
    _check("t5", "sequence", seed, settings, padded=False)


def test_answers_are_not_vacuous():
    # The equality tests mean something only if answers differ across questions and some stop
    # before the maximum length.
    model = tiny_rag("t5", "token", 1)
    ids, mask, scores = tiny_inputs(1, 0)
    out = rag_token_generate(model, ids, mask, scores, num_beams=3, max_length=12)
    assert len({tuple(r) for r in out.tolist()}) == B
    assert (out == 1).any()  # some answer ended with EOS (T5's id 1)
    model = tiny_rag("t5", "sequence", 0)
    ids, mask, scores = tiny_inputs(0, 0)
    out = rag_sequence_generate(model, ids, mask, scores, num_beams=3, max_length=12,
                                num_return_sequences=2)
    assert (out == 1).any()
    assert len({tuple(r) for r in out.tolist()}) > B


def test_decoder_choice_and_lm_head():
    # BART keeps the lean fast path; everything else runs its own decoder. The generic
    # decoder's step logits equal the generator's forward (T5: scaled output, no bias).
    bart = tiny_rag("bart", "token", 0).rag.generator
    assert isinstance(make_decoder(bart), BartDecoder)
    for kind in ("t5", "flan-t5", "mt5", "umt5", "marian", "pegasus", "mbart", "bert2bert",
                 "bert2gpt2"):
        gen = tiny_rag(kind, "token", 0).rag.generator
        dec = make_decoder(gen)
        assert isinstance(dec, GenericDecoder)
        ids, mask, _ = tiny_inputs(0, gen.config.pad_token_id)
        start = gen.config.decoder_start_token_id
        target = torch.randint(3, V - 1, (B * K, 4), generator=torch.Generator().manual_seed(1))
        target[:, 0] = start
        with torch.no_grad():
            expected = gen(input_ids=ids, attention_mask=mask, decoder_input_ids=target).logits
            cross = dec.cross_state(dec.encode(ids, mask), mask)
            forced = dec.logits(dec.teacher_forced(target, cross, Q=1))
            cache = dec.new_cache(B * K, 4)
            steps = [dec.step_logits(dec.step(target[:, t], t, cache, cross, Q=1))
                     for t in range(4)]
        torch.testing.assert_close(forced, expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(torch.stack(steps, 1), expected, rtol=1e-5, atol=1e-5)


def test_t5_fast_decoding_and_bare_generator():
    model = tiny_rag("t5", "sequence", 2)
    ids, mask, scores = tiny_inputs(2, 0)
    out = rag_sequence_generate(model, ids, mask, scores, num_beams=3, max_length=8,
                                num_return_sequences=2, decoding="fast")
    assert out.shape[0] == B * 2 and out.shape[1] <= 8 and out[:, 0].eq(0).all()
    # A bare T5 generator (no RAG wrapper) decodes with its own generation config.
    token = tiny_rag("t5", "token", 2)
    expected = hf_generate(token, ids, mask, scores, num_beams=2, max_length=8)
    got = rag_token_generate(token.rag.generator, ids, mask, scores, n_docs=K, num_beams=2,
                             max_length=8, decoder_start_token_id=0)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("mode", ["token", "sequence"])
def test_rag_model_with_t5_generator(mode):
    # RagModel.generate (through its transformers view) decodes a T5 generator like
    # transformers. The modules are shared: transformers runs first, while they are in eval
    # mode (RagModel.generate puts them back in the RagModel's mode afterwards).
    from rag_fast.models.rag_model import RagModel

    hf = tiny_rag("t5", mode, 1)
    ids, mask, scores = tiny_inputs(1, 0)
    model = RagModel.from_transformers(hf)
    hf.eval()
    for settings in (dict(num_beams=2, max_length=9), dict(max_length=9, do_sample=True, top_k=5)):
        torch.manual_seed(3)
        expected = hf_generate(hf, ids, mask, scores, **settings)
        torch.manual_seed(3)
        out = model.generate(context_input_ids=ids, context_attention_mask=mask,
                             doc_scores=scores, **settings)
        assert torch.equal(out.sequences, expected), settings
        hf.eval()


@pytest.mark.parametrize("kind", ["bart", "t5"])
@pytest.mark.parametrize("seed,settings", SETTINGS[:4])
def test_masked_sequence_searches_do_not_depend_on_padding(kind, seed, settings):
    """``mask_searches=True``: RAG-Sequence's searches read the encoder with the context mask,
    so more padding columns (as a longer question elsewhere in the batch adds) change no
    answer; the default, ``transformers``' unmasked searches, is what padding can change. With
    no padding both are the same."""
    model = tiny_rag(kind, "sequence", seed)
    pad = model.rag.generator.config.pad_token_id
    ids, mask, scores = tiny_inputs(seed, pad)
    more_ids = torch.cat([ids, torch.full((B * K, 7), pad)], dim=1)
    more_mask = torch.cat([mask, torch.zeros(B * K, 7, dtype=mask.dtype)], dim=1)
    masked = rag_sequence_generate(model, ids, mask, scores, mask_searches=True, **settings)
    padded = rag_sequence_generate(model, more_ids, more_mask, scores, mask_searches=True,
                                   **settings)
    assert torch.equal(masked, padded), f"\n{masked}\n!=\n{padded}"
    full_ids, full_mask, _ = tiny_inputs(seed, pad, padded=False)
    assert torch.equal(
        rag_sequence_generate(model, full_ids, full_mask, scores, mask_searches=True, **settings),
        hf_generate(model, full_ids, full_mask, scores, **settings))


def test_unmasked_searches_do_depend_on_padding():
    """Why mask_searches exists: transformers' RAG-Sequence answers change with padding."""
    changed = 0
    for seed in range(4):
        model = tiny_rag("bart", "sequence", seed)
        ids, mask, scores = tiny_inputs(seed, 1)
        more_ids = torch.cat([ids, torch.full((B * K, 7), 1)], dim=1)
        more_mask = torch.cat([mask, torch.zeros(B * K, 7, dtype=mask.dtype)], dim=1)
        a = rag_sequence_generate(model, ids, mask, scores, num_beams=1, max_length=10)
        b = rag_sequence_generate(model, more_ids, more_mask, scores, num_beams=1, max_length=10)
        changed += not torch.equal(a, b)
    assert changed
