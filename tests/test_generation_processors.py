"""Sampling, repetition penalty and no-repeat n-grams in RAG-Token and RAG-Sequence decoding.

transformers' RAG generate supports all of them (RAG-Token processes the passage-marginal
log-probabilities, RAG-Sequence runs the generator's own generate per question), so with the
same seed, weights and inputs the token ids must be transformers' ones, for the BART fast path
and for the generic decoder (T5). The processors themselves are checked against transformers'
processor classes on random scores.
"""
from __future__ import annotations

import pytest
import torch

from rag_fast.generation import rag_sequence_generate, rag_token_generate
from rag_fast.generation._search import apply_processors, settings_from
from test_generation_seq2seq import hf_generate, tiny_inputs, tiny_rag


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


GENERATE = {"token": rag_token_generate, "sequence": rag_sequence_generate}


def _same_as_transformers(kind, mode, seed, settings, draw_seed=7):
    model = tiny_rag(kind, mode, seed)
    ids, mask, scores = tiny_inputs(seed, model.rag.generator.config.pad_token_id)
    torch.manual_seed(draw_seed)
    expected = hf_generate(model, ids, mask, scores, **settings)
    torch.manual_seed(draw_seed)
    got = GENERATE[mode](model, ids, mask, scores, **settings)
    assert got.shape == expected.shape and torch.equal(got, expected), f"\n{got}\n!=\n{expected}"
    return got


PROCESSED = [
    pytest.param(0, dict(num_beams=1, max_length=10, do_sample=True), id="sample"),
    pytest.param(1, dict(num_beams=1, max_length=10, do_sample=True, temperature=0.7, top_k=8),
                 id="sample-temperature-top-k"),
    pytest.param(2, dict(num_beams=1, max_length=10, do_sample=True, top_p=0.8, top_k=0),
                 id="sample-top-p"),
    pytest.param(0, dict(num_beams=3, max_length=10, do_sample=True, top_p=0.9,
                         temperature=1.3), id="beam-sample"),
    pytest.param(1, dict(num_beams=1, max_length=10, repetition_penalty=1.8), id="greedy-rep"),
    pytest.param(2, dict(num_beams=3, max_length=10, repetition_penalty=0.7), id="beam-rep-reward"),
    pytest.param(0, dict(num_beams=1, max_length=12, no_repeat_ngram_size=2), id="greedy-ngram2"),
    pytest.param(1, dict(num_beams=2, max_length=12, no_repeat_ngram_size=1, min_length=4),
                 id="beam-ngram1-min-length"),
    pytest.param(2, dict(num_beams=3, max_length=10, no_repeat_ngram_size=3,
                         repetition_penalty=1.3, num_return_sequences=2), id="beam-ngram3-rep"),
    pytest.param(0, dict(num_beams=1, max_length=10, do_sample=True, repetition_penalty=1.5,
                         no_repeat_ngram_size=2, temperature=0.8), id="sample-all"),
]


@pytest.mark.parametrize("seed,settings", PROCESSED)
@pytest.mark.parametrize("mode", ["token", "sequence"])
@pytest.mark.parametrize("kind", ["bart", "t5"])
def test_processed_decoding_same_ids_as_transformers(kind, mode, seed, settings):
    _same_as_transformers(kind, mode, seed, settings)


@pytest.mark.parametrize("mode", ["token", "sequence"])
def test_sampling_depends_on_the_seed_and_rng_is_honoured(mode):
    # Different seeds draw different answers (the sampling tests are not vacuous), and a
    # torch.Generator seeded like the global generator gives transformers' ids.
    settings = dict(num_beams=1, max_length=10, do_sample=True, temperature=1.5, top_k=0)
    model = tiny_rag("t5", mode, 0)
    ids, mask, scores = tiny_inputs(0, 0)
    outs = set()
    for seed in (1, 2, 3):
        out = GENERATE[mode](model, ids, mask, scores, rng=torch.Generator().manual_seed(seed),
                             **settings)
        outs.add(tuple(out.flatten().tolist()))
    assert len(outs) > 1
    torch.manual_seed(5)
    expected = hf_generate(model, ids, mask, scores, **settings)
    torch.manual_seed(1234)  # the global generator is not used when rng is given
    got = GENERATE[mode](model, ids, mask, scores, rng=torch.Generator().manual_seed(5),
                         **settings)
    assert torch.equal(got, expected)


def test_no_repeat_ngram_holds_in_the_answers():
    for mode in ("token", "sequence"):
        model = tiny_rag("bart", mode, 0)
        ids, mask, scores = tiny_inputs(0, 1)
        plain = GENERATE[mode](model, ids, mask, scores, num_beams=2, max_length=14)
        out = GENERATE[mode](model, ids, mask, scores, num_beams=2, max_length=14,
                             no_repeat_ngram_size=2)
        assert not torch.equal(out, plain)  # the tiny model does repeat bigrams unconstrained
        for row in out.tolist():
            end = row.index(2, 1) + 1 if 2 in row[1:] else len(row)  # up to EOS (id 2)
            bigrams = list(zip(row[:end], row[1:end]))
            assert len(bigrams) == len(set(bigrams)), row


def _oracle(settings, seqs, scores):
    """transformers' processors, in generate's order, applied to ``scores``."""
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        MinLengthLogitsProcessor,
        NoRepeatNGramLogitsProcessor,
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    s = settings
    keep = 2 if s.num_beams > 1 else 1
    procs = LogitsProcessorList()
    if s.repetition_penalty != 1.0:
        procs.append(RepetitionPenaltyLogitsProcessor(s.repetition_penalty))
    if s.no_repeat_ngram_size:
        procs.append(NoRepeatNGramLogitsProcessor(s.no_repeat_ngram_size))
    if s.min_length:
        procs.append(MinLengthLogitsProcessor(s.min_length, s.eos_token_id))
    if s.do_sample:
        if s.temperature != 1.0:
            procs.append(TemperatureLogitsWarper(s.temperature))
        if s.top_k:
            procs.append(TopKLogitsWarper(s.top_k, min_tokens_to_keep=keep))
        if s.top_p < 1.0:
            procs.append(TopPLogitsWarper(s.top_p, min_tokens_to_keep=keep))
    return procs(seqs, scores.clone())


@pytest.mark.parametrize("kw", [
    dict(repetition_penalty=1.7),
    dict(repetition_penalty=0.6),
    dict(no_repeat_ngram_size=1),
    dict(no_repeat_ngram_size=2),
    dict(no_repeat_ngram_size=3, min_length=9),
    dict(do_sample=True, temperature=0.6, top_k=7),
    dict(do_sample=True, top_p=0.7, top_k=0),
    dict(do_sample=True, top_p=0.0, top_k=0, num_beams=2),
    dict(do_sample=True, top_k=1, num_beams=3),
    dict(do_sample=True, repetition_penalty=1.2, no_repeat_ngram_size=2, temperature=1.4,
         top_k=20, top_p=0.9),
])
def test_processors_match_transformers_definitions(kw):
    s = settings_from(None, 30, max_length=20, decoder_start_token_id=0, eos_token_id=2,
                      allow_processors=True, **kw)
    g = torch.Generator().manual_seed(3)
    for cur_len in (1, 3, 8):
        seqs = torch.randint(0, 6, (5, cur_len), generator=g)  # few ids: n-grams repeat
        scores = torch.randn(5, 30, generator=g) * 3
        got = apply_processors(s, seqs, scores, cur_len)
        assert torch.equal(got, _oracle(s, seqs, scores)), (kw, cur_len)


def test_bad_settings_name_the_argument():
    model = tiny_rag("t5", "token", 0)
    ids, mask, scores = tiny_inputs(0, 0)
    bad = [
        (dict(do_sample=True, temperature=0.0), "temperature"),
        (dict(do_sample=True, temperature=float("nan")), "temperature"),
        (dict(do_sample=True, top_k=-1), "top_k"),
        (dict(do_sample=True, top_k=2.5), "top_k"),
        (dict(do_sample=True, top_p=1.5), "top_p"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(repetition_penalty=-1.0), "repetition_penalty"),
        (dict(no_repeat_ngram_size=-2), "no_repeat_ngram_size"),
        (dict(no_repeat_ngram_size=1.5), "no_repeat_ngram_size"),
        (dict(do_sample="yes"), "do_sample"),
    ]
    for mode in ("token", "sequence"):
        for kw, name in bad:
            with pytest.raises(ValueError, match=name):
                GENERATE[mode](model, ids, mask, scores, max_length=6, **kw)
        with pytest.raises(ValueError, match="rng must be a torch.Generator"):
            GENERATE[mode](model, ids, mask, scores, max_length=6, do_sample=True, rng=7)
    model.generation_config.bad_words_ids = [[5]]
    with pytest.raises(ValueError, match="bad_words_ids"):
        rag_token_generate(model, ids, mask, scores, max_length=6)


def test_settings_without_processor_support_are_refused():
    # A search that does not apply the processors (allow_processors=False, the default) gets
    # a clear error instead of silently ignoring them.
    for kw, name in ((dict(do_sample=True), "do_sample"),
                     (dict(repetition_penalty=1.2), "repetition_penalty"),
                     (dict(no_repeat_ngram_size=2), "no_repeat_ngram_size")):
        with pytest.raises(ValueError, match=name):
            settings_from(None, 30, decoder_start_token_id=0, **kw)
    assert settings_from(None, 30, decoder_start_token_id=0, top_k=3).top_k == 0  # not sampling


def test_sampling_warpers_are_ignored_without_do_sample():
    # As in transformers: temperature / top_k / top_p only shape sampling.
    model = tiny_rag("bart", "token", 1)
    ids, mask, scores = tiny_inputs(1, 1)
    plain = rag_token_generate(model, ids, mask, scores, num_beams=2, max_length=9)
    warped = rag_token_generate(model, ids, mask, scores, num_beams=2, max_length=9,
                                temperature=0.3, top_k=2, top_p=0.5)
    assert torch.equal(plain, warped)
    assert torch.equal(warped, hf_generate(model, ids, mask, scores, num_beams=2, max_length=9,
                                           temperature=0.3, top_k=2, top_p=0.5))
