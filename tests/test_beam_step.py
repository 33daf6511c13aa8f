"""The fused RAG-Token beam step against its reference, for every impl.

Scores are compared with the tolerance rule; (beam, token) pairs are checked against the
float64 candidates (a pair may differ from the reference only where two candidates tie within
rounding), and exact ties use inputs whose every value is exactly representable.
"""
from __future__ import annotations

import pytest
import torch

from rag_fast.ops import rag_token_beam_step
from rag_fast.reference_decoding import rag_token_beam_candidates
from rag_fast.reference_decoding import rag_token_beam_step as reference_step
from utils import assert_close_rule, requires_ext, requires_triton

IMPLS = [
    pytest.param("torch", id="torch"),
    pytest.param("cpp", id="cpp", marks=requires_ext),
    pytest.param("triton", id="triton", marks=requires_triton),
]

# (B, W, K, V, why)
SHAPES = [
    (2, 3, 4, 37, "odd vocabulary: vector body plus scalar tail"),
    (1, 1, 1, 1, "V=1, W=1, K=1: a single candidate"),
    (3, 2, 1, 50, "K=1: plain beam search"),
    (2, 1, 3, 19, "W=1: greedy"),
    (2, 4, 3, 1, "V=1: fewer candidates (W) than 2W"),
    (2, 4, 5, 1100, "several 512-wide blocks and a tail; the skip path"),
]


def _inputs(B, W, K, V, seed, missing=False, bias=False, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(B, W, K, V, generator=g) * 3).to(dtype)
    scores = torch.randn(B, K, generator=g)
    if missing and K > 1:  # -inf prior: question 0 loses passage 0 (K=1: see every_prior_missing)
        scores[0, 0] = float("-inf")
    a = torch.log_softmax(scores, dim=1)
    beam = torch.randn(B, W, generator=g) * 2
    b = None
    if bias:
        b = torch.zeros(B * W, V)
        b[:, 0] = float("-inf")  # e.g. EOS below the minimum length
        b[:, V // 2] = -1.5
    return x, a, beam, b


def _check(impl, x, a, beam, b, n=None):
    scores, beams, tokens = rag_token_beam_step(x, a, beam, b, num_candidates=n, impl=impl)
    ref_scores, ref_beams, ref_tokens = reference_step(x.double(), a.double(), beam.double(),
                                                       None if b is None else b.double(), n)
    plain, _, _ = reference_step(x, a, beam, b, n)  # float32 PyTorch
    assert scores.shape == ref_scores.shape == beams.shape == tokens.shape
    assert_close_rule(scores, plain, ref_scores, torch.float32, "scores")
    # Every returned pair scores what it says, and the set is the best one up to rounding.
    cand = rag_token_beam_candidates(x.double(), a.double(), beam.double(),
                                     None if b is None else b.double())
    got = cand[torch.arange(x.shape[0])[:, None], beams, tokens]
    assert_close_rule(got.float(), plain, ref_scores, torch.float32, "pair scores")
    exact = (beams == ref_beams) & (tokens == ref_tokens)
    tol = 1e-4 * (1 + ref_scores.abs().nan_to_num(0, 0, 0))
    near_tie = torch.zeros_like(exact)
    diffs = (ref_scores[:, 1:] - ref_scores[:, :-1]).abs() <= tol[:, 1:]
    near_tie[:, 1:] |= diffs
    near_tie[:, :-1] |= diffs
    assert bool((exact | near_tie).all()), "beam/token differ where no scores tie"


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("B,W,K,V,why", SHAPES, ids=[s[-1] for s in SHAPES])
@pytest.mark.parametrize("missing", [False, True], ids=["all-passages", "-inf-prior"])
def test_matches_reference(impl, B, W, K, V, why, missing):
    x, a, beam, _ = _inputs(B, W, K, V, seed=V + K, missing=missing)
    _check(impl, x, a, beam, None)


@pytest.mark.parametrize("impl", IMPLS)
def test_bart_vocabulary(impl):
    """V=50265 (BART): the long-row paths of every impl (the Triton one under the interpreter
    in CI) against the reference under the per-element rule."""
    x, a, beam, _ = _inputs(1, 2, 2, 50265, seed=3)
    _check(impl, x, a, beam, None)


@pytest.mark.parametrize("impl", IMPLS)
def test_bias_and_num_candidates(impl):
    x, a, beam, b = _inputs(2, 3, 4, 41, seed=1, bias=True)
    _check(impl, x, a, beam, b)
    _check(impl, x, a, beam, b, n=5)


@pytest.mark.parametrize("impl", IMPLS)
def test_exact_ties_lower_index_first(impl):
    # Every logit 0: every candidate of a beam ties; beams 0 and 2 also tie with each other.
    B, W, K, V = 2, 3, 2, 7
    x = torch.zeros(B, W, K, V)
    a = torch.log_softmax(torch.zeros(B, K), dim=1)
    beam = torch.tensor([[0.0, -1.0, 0.0], [-2.0, -2.0, -2.0]])
    scores, beams, tokens = rag_token_beam_step(x, a, beam, impl=impl)
    flat = beams * V + tokens
    assert torch.equal(flat[0], torch.tensor([0, 1, 2, 3, 4, 5]))  # beam 0 before beam 2
    assert torch.equal(flat[1], torch.arange(6))
    assert torch.all(scores[:, :-1] >= scores[:, 1:])


@pytest.mark.parametrize("impl", IMPLS)
def test_every_prior_missing(impl):
    # No passage left: every candidate is -inf, returned in flat-index order, no NaN.
    x, a, beam, _ = _inputs(1, 2, 3, 5, seed=3)
    a[:] = float("-inf")
    scores, beams, tokens = rag_token_beam_step(x, a, beam, impl=impl)
    assert torch.all(scores == float("-inf"))
    assert torch.equal(beams[0] * 5 + tokens[0], torch.arange(4))


@requires_ext
def test_bf16_cpp():
    x, a, beam, _ = _inputs(2, 2, 3, 300, seed=4, dtype=torch.bfloat16)
    scores, _, _ = rag_token_beam_step(x, a, beam, impl="cpp")
    ref, _, _ = reference_step(x.double(), a.double(), beam.double())
    plain, _, _ = reference_step(x, a, beam)
    assert_close_rule(scores, plain, ref, torch.bfloat16, "bf16 scores")


def test_bad_inputs():
    x, a, beam, _ = _inputs(2, 2, 3, 5, seed=0)
    with pytest.raises(ValueError, match=r"logits must have shape \[B, W, K, V\]"):
        rag_token_beam_step(x[0], a, beam)
    with pytest.raises(ValueError, match="log_prior must have shape"):
        rag_token_beam_step(x, a[:, :2], beam)
    with pytest.raises(ValueError, match="beam_scores must have shape"):
        rag_token_beam_step(x, a, beam[:, :1])
    with pytest.raises(ValueError, match="bias must have shape"):
        rag_token_beam_step(x, a, beam, torch.zeros(3, 5))
    with pytest.raises(ValueError, match="num_candidates"):
        rag_token_beam_step(x, a, beam, num_candidates=0)
    with pytest.raises(ValueError, match="impl must be one of"):
        rag_token_beam_step(x, a, beam, impl="cuda")
