"""The Triton beam step (rag_fast/kernels/beam_step.py) on bf16 logits, under Triton's CPU
interpreter where there is no GPU (conftest.py sets TRITON_INTERPRET=1), against the float64
reference (rag_fast/reference_decoding.py).

The kernel loads bf16 logits and computes in float32, writing float32 candidate scores: the
inputs are exactly representable in float64, so the scores are held to the float32 rule with
the plain version computed in float32 from the same bf16 values (a kernel that rounded a
normaliser or a sum to bf16 on the way fails it), and to the bf16 rule against the plain
version computed in bf16 (as tests/test_beam_step.py::test_bf16_cpp holds the C++ kernel).
Shapes stay tiny because the interpreter is slow: V = 70 is two full 32-wide tiles and a ragged
one.
"""
from __future__ import annotations

import pytest
import torch

from rag_fast.ops import rag_token_beam_step
from rag_fast.reference_decoding import rag_token_beam_candidates
from rag_fast.reference_decoding import rag_token_beam_step as reference_step
from test_beam_step import _inputs
from utils import assert_close_rule, requires_triton

pytestmark = requires_triton

BF16 = torch.bfloat16


# (B, W, K, V, missing prior, bias, num_candidates)
CASES = [
    (2, 2, 3, 70, False, False, None),
    (2, 3, 2, 37, True, True, 5),
]


@pytest.mark.parametrize("B,W,K,V,missing,bias,n", CASES,
                         ids=["plain", "-inf-prior-bias-n5"])
def test_bf16_triton_matches_reference(B, W, K, V, missing, bias, n):
    x, a, beam, b = _inputs(B, W, K, V, seed=V + K, missing=missing, bias=bias, dtype=BF16)
    assert x.dtype == BF16
    scores, beams, tokens = rag_token_beam_step(x, a, beam, b, num_candidates=n, impl="triton")
    dbl = None if b is None else b.double()
    ref_scores, ref_beams, ref_tokens = reference_step(x.double(), a.double(), beam.double(), dbl, n)
    assert scores.shape == ref_scores.shape == beams.shape == tokens.shape
    assert scores.dtype == torch.float32 and torch.isfinite(scores).all()
    # float32 arithmetic on the bf16 values...
    plain32, _, _ = reference_step(x.float(), a, beam, b, n)
    assert_close_rule(scores, plain32, ref_scores, torch.float32, "bf16 scores (float32 rule)")
    # ...and no worse than the reference run in bf16
    plain16, _, _ = reference_step(x, a, beam, b, n)
    assert_close_rule(scores, plain16, ref_scores, BF16, "bf16 scores (bf16 rule)")
    # every returned (beam, token) pair scores what it says, and is the reference's pair except
    # where two scores tie within rounding
    cand = rag_token_beam_candidates(x.double(), a.double(), beam.double(), dbl)
    got = cand[torch.arange(B)[:, None], beams, tokens]
    assert_close_rule(got.float(), plain32, ref_scores, torch.float32, "bf16 pair scores")
    exact = (beams == ref_beams) & (tokens == ref_tokens)
    tol = 1e-4 * (1 + ref_scores.abs())
    diffs = (ref_scores[:, 1:] - ref_scores[:, :-1]).abs() <= tol[:, 1:]
    near_tie = torch.zeros_like(exact)
    near_tie[:, 1:] |= diffs
    near_tie[:, :-1] |= diffs
    assert bool((exact | near_tie).all()), (beams, ref_beams, tokens, ref_tokens)
