"""Sampling, repetition penalty and no-repeat n-grams with a decoder-only generator.

There is no ``transformers`` RAG model with a decoder-only generator to compare with, so the
ids are checked against tests/reference_causal.py: fresh unpadded fp64 forwards per
step, the processors written out over token lists of ``prompt_k ++ answer``, draws from the same
seeded ``torch.Generator``. With one passage, RAG-Sequence is the generator's own ``generate``
on the prompt, which is checked against ``transformers`` too (its repetition penalty and n-gram
ban read the prompt as well as the answer).
"""
from __future__ import annotations

import pytest
import torch

import reference_causal as rc
from rag_fast.generation.causal import _resolve_settings, causal_generate
from rag_fast.models import RagModel
from test_causal import EOS, LENGTHS, PAD, _generator, _ids, _prompts, _scores


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


SETTINGS = [
    pytest.param(dict(do_sample=True, temperature=0.8, top_k=12, top_p=0.9), id="sample"),
    pytest.param(dict(repetition_penalty=3.0), id="rep"),
    pytest.param(dict(repetition_penalty=0.5), id="rep-reward"),
    pytest.param(dict(no_repeat_ngram_size=2), id="ngram2"),
    pytest.param(dict(no_repeat_ngram_size=1, min_new_tokens=3), id="ngram1-min"),
    pytest.param(dict(do_sample=True, repetition_penalty=1.5, no_repeat_ngram_size=3,
                      temperature=1.3), id="sample-rep-ngram3"),
]


def _case(family: str = "llama", seed: int = 3):
    g = _generator(family, seed=seed, sharpen=4.0)
    prompts, ids, mask = _prompts(g.config.vocab_size, LENGTHS, seed=4)
    return g, prompts, ids, mask, _scores()


def _rng(seed: int = 11) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("settings", SETTINGS)
@pytest.mark.parametrize("num_beams", [1, 3])
def test_rag_token_matches_reference(settings, num_beams):
    g, prompts, ids, mask, scores = _case()
    model = RagModel(g, mode="token", n_docs=3)
    full = dict(num_beams=num_beams, max_new_tokens=6, eos_token_id=EOS, **settings)
    if num_beams > 1:
        full["num_return_sequences"] = 2
    out = model.generate(context_input_ids=ids, context_attention_mask=mask, doc_scores=scores,
                         rng=_rng(), **full).sequences
    s = _resolve_settings(g, None, g.config.vocab_size, PAD, full)
    if num_beams == 1:
        ref = rc.rag_token_processed_greedy(g, prompts, scores, s, rng=_rng())
    else:
        ref = rc.rag_token_beam(g, prompts, scores, s, rng=_rng())
    assert out.tolist() == _ids(ref).tolist()
    # the processors changed something: the same call without them answers otherwise
    plain = {k: v for k, v in full.items()
             if k not in ("do_sample", "temperature", "top_k", "top_p", "repetition_penalty",
                          "no_repeat_ngram_size")}
    unprocessed = causal_generate(g, ids, mask, scores, **plain)
    assert unprocessed.tolist() != out.tolist()


@pytest.mark.parametrize("decoding", ["thorough", "fast"])
@pytest.mark.parametrize("settings", SETTINGS)
@pytest.mark.parametrize("num_beams", [1, 3])
def test_rag_sequence_matches_reference(settings, num_beams, decoding):
    g, prompts, ids, mask, scores = _case()
    model = RagModel(g, mode="sequence", n_docs=3)
    full = dict(num_beams=num_beams, max_new_tokens=5, eos_token_id=EOS, **settings)
    out = model.generate(context_input_ids=ids, context_attention_mask=mask, doc_scores=scores,
                         decoding=decoding, num_return_sequences=2, rng=_rng(),
                         **full).sequences
    s = _resolve_settings(g, None, g.config.vocab_size, PAD,
                          {**full, "num_return_sequences": num_beams})
    ref = rc.rag_sequence_decode(g, prompts, scores, s, decoding=decoding,
                                 num_return_sequences=2, rng=_rng())
    want = [tokens for per_question in ref
            for tokens in [t for t, _ in per_question] + [[]] * (2 - len(per_question))]
    assert sum(len(per_question) for per_question in ref) >= 3  # hypotheses to rank
    assert out.tolist() == _ids(want).tolist()


@pytest.mark.parametrize("family", ["qwen2", "gpt2"])
@pytest.mark.parametrize("mode", ["token", "sequence"])
def test_other_families_match_reference(family, mode):
    g, prompts, ids, mask, scores = _case(family, seed=5)
    settings = dict(num_beams=2, max_new_tokens=5, eos_token_id=EOS, do_sample=True, top_k=20,
                    repetition_penalty=1.4, no_repeat_ngram_size=2)
    out = causal_generate(g, ids, mask, scores, mode=mode, rng=_rng(3), **settings)
    if mode == "token":
        s = _resolve_settings(g, None, g.config.vocab_size, PAD, settings)
        want = rc.rag_token_beam(g, prompts, scores, s, rng=_rng(3))
    else:
        s = _resolve_settings(g, None, g.config.vocab_size, PAD,
                              {**settings, "num_return_sequences": 2})
        want = [t for per_question in rc.rag_sequence_decode(g, prompts, scores, s,
                                                             rng=_rng(3))
                for t, _ in per_question]
    assert out.tolist() == _ids(want).tolist()


# ------------------------------------------------------------- the definitions themselves
def test_no_repeat_ngram_holds_over_prompt_and_answer():
    """No n-gram ending in the answer occurs earlier in ``prompt_k ++ answer``, for any k."""
    g, prompts, ids, mask, scores = _case()
    n = 2
    for mode in ("token", "sequence"):
        out = causal_generate(g, ids, mask, scores, mode=mode, num_beams=1, max_new_tokens=8,
                              eos_token_id=EOS, no_repeat_ngram_size=n, do_sample=True,
                              rng=_rng(5))
        for b, row in enumerate(out.tolist()):
            answer = [t for t in row if t != PAD]
            for k in range(3) if mode == "token" else ():
                seq = prompts[b][k].tolist() + answer
                P = len(prompts[b][k])
                grams = [tuple(seq[i:i + n]) for i in range(len(seq) - n + 1)]
                for end in range(P, len(seq)):
                    assert tuple(seq[end - n + 1:end + 1]) not in grams[:end - n + 1]
            if mode == "sequence":  # the chosen answer came from one passage's search
                assert any(
                    all(tuple((prompts[b][k].tolist() + answer)[e - n + 1:e + 1])
                        not in [tuple((prompts[b][k].tolist() + answer)[i:i + n])
                                for i in range(e - n + 1)]
                        for e in range(len(prompts[b][k]), len(prompts[b][k]) + len(answer)))
                    for k in range(3))


def test_repetition_penalty_counts_the_prompt():
    """A huge penalty on RAG-Token's marginal log-probabilities (all negative): no answer token
    repeats a token of the question's prompts or of the answer itself."""
    g, prompts, ids, mask, scores = _case()
    out = causal_generate(g, ids, mask, scores, num_beams=1, max_new_tokens=8,
                          eos_token_id=None, repetition_penalty=1e4)
    for b, row in enumerate(out.tolist()):
        seen = {t for k in range(3) for t in prompts[b][k].tolist()}
        for t in row:
            assert t not in seen
            seen.add(t)


@pytest.mark.parametrize("settings", [dict(repetition_penalty=1.7),
                                      dict(repetition_penalty=0.6, no_repeat_ngram_size=1),
                                      dict(no_repeat_ngram_size=2), dict(no_repeat_ngram_size=3),
                                      dict(repetition_penalty=2.0, no_repeat_ngram_size=4)])
def test_prompt_processors_match_the_plain_definitions(settings):
    """The vectorised rules on random scores, left-padded prompts of different lengths (the
    pad id also occurring as a real token in one) and answers of 0 to 5 tokens, against the
    reference's token-list definitions: padding is not a token of the sequence."""
    from rag_fast.generation._search import settings_from
    from rag_fast.generation.causal import prompt_processors

    V, E, W, K, S = 13, 2, 3, 2, 6
    s = settings_from(None, V, decoder_start_token_id=PAD, allow_processors=True, **settings)
    gen = _rng(8)
    lengths = [[6, 2], [4, 3]]
    ids = torch.full((E, K, S), PAD, dtype=torch.long)
    mask = torch.zeros((E, K, S), dtype=torch.long)
    for e in range(E):
        for k in range(K):
            n = lengths[e][k]
            ids[e, k, S - n:] = torch.randint(1, 5, (n,), generator=gen)
            mask[e, k, S - n:] = 1
    ids[0, 0, 0] = PAD  # a real pad token (mask 1) counts
    for A in range(6):
        scores = torch.randn(E, W, V, generator=gen) * 3
        answers = torch.randint(0, 5, (E, W, A), generator=gen)
        got = prompt_processors(s, scores, ids, mask, answers)
        for e in range(E):
            for j in range(W):
                seqs = [ids[e, k][mask[e, k].bool()].tolist() + answers[e, j].tolist()
                        for k in range(K)]
                want = rc.prompt_rules(s, scores[e, j], seqs)
                assert torch.equal(got[e, j], want), (settings, A, e, j)
    if settings.get("repetition_penalty", 1.0) > 1.0:  # padding alone does not penalise PAD
        scores = torch.ones(E, W, V)
        got = prompt_processors(s, scores, ids, mask, torch.zeros((E, W, 0), dtype=torch.long))
        assert got[1, :, PAD].eq(1.0).all() and got[0, :, PAD].lt(1.0).all()


@pytest.mark.parametrize("settings", [
    pytest.param(dict(num_beams=1, do_sample=True, top_k=0), id="sample"),
    pytest.param(dict(num_beams=1, repetition_penalty=2.0, no_repeat_ngram_size=2),
                 id="greedy-rep-ngram"),
    pytest.param(dict(num_beams=1, do_sample=True, top_p=0.8, top_k=10,
                      repetition_penalty=1.3, no_repeat_ngram_size=3), id="sample-all"),
])
def test_one_passage_rag_sequence_is_the_generators_own_generate(settings):
    """K = 1: RAG-Sequence's one search is ``generator.generate`` on the unpadded prompt, with
    the same processors (over prompt and answer) and, seeded alike, the same draws."""
    g = _generator("llama", seed=2, sharpen=3.0)
    prompt = torch.randint(3, g.config.vocab_size, (7,), generator=_rng(9))
    scores = torch.zeros(1, 1, dtype=torch.float64)
    torch.manual_seed(21)
    want = g.generate(input_ids=prompt[None], attention_mask=torch.ones(1, 7, dtype=torch.long),
                      max_new_tokens=8, pad_token_id=PAD, eos_token_id=EOS, **settings)[0, 7:]
    torch.manual_seed(21)
    got = causal_generate(g, prompt[None], None, scores, mode="sequence", max_new_tokens=8,
                          eos_token_id=EOS, **settings)[0]
    want = want.tolist()
    if EOS in want:
        want = want[:want.index(EOS) + 1]
    assert got.tolist()[:len(want)] == want and set(got.tolist()[len(want):]) <= {PAD}


def test_seeds_and_rng():
    g, prompts, ids, mask, scores = _case()
    kw = dict(num_beams=1, max_new_tokens=6, eos_token_id=None, do_sample=True)
    a = causal_generate(g, ids, mask, scores, rng=_rng(1), **kw)
    assert torch.equal(a, causal_generate(g, ids, mask, scores, rng=_rng(1), **kw))
    assert not torch.equal(a, causal_generate(g, ids, mask, scores, rng=_rng(2), **kw))
    with torch.random.fork_rng():  # the global generator is left as it was for later tests
        torch.manual_seed(4)  # rng=None: torch's global generator
        b = causal_generate(g, ids, mask, scores, **kw)
        torch.manual_seed(4)
        assert torch.equal(b, causal_generate(g, ids, mask, scores, **kw))
    with pytest.raises(ValueError, match="rng must be a torch.Generator"):
        causal_generate(g, ids, mask, scores, rng=3, **kw)
    with pytest.raises(ValueError, match="top_p"):
        causal_generate(g, ids, mask, scores, top_p=1.5, **kw)
    with pytest.raises(ValueError, match="repetition_penalty"):
        causal_generate(g, ids, mask, scores, **{**kw, "repetition_penalty": 0.0})
