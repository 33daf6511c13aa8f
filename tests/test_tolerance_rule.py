"""The tolerance rule of tests/utils.py sees every element: an error planted in 1% of a correct
gradient's entries at V = 50265 is rejected, while the gradient itself passes."""
from __future__ import annotations

import pytest
import torch

import rag_fast
from rag_fast import reference as ref
from utils import RTOL, assert_close_rule, tolerance_violations

F32 = torch.float32


def _grads(fn, logits, scores, targets, **kw):
    x = logits.clone().requires_grad_()
    fn(x, scores, targets, epsilon=0.1, **kw).sum().backward()
    return x.grad


@pytest.fixture(scope="module")
def logit_gradients():
    """RAG-Token (epsilon 0.1) logit gradients at V = 50265: the op's (impl="auto": the C++
    kernels where built), the plain float32 reference's and the float64 oracle."""
    g = torch.Generator().manual_seed(0)
    B, K, T, V = 1, 3, 2, 50265
    logits = 3 * torch.randn(B, K, T, V, generator=g)
    scores = torch.randn(B, K, generator=g)
    targets = torch.randint(0, V, (B, T), generator=g)
    actual = _grads(rag_fast.rag_token_nll, logits, scores, targets)
    plain = _grads(ref.rag_token_nll, logits, scores, targets)
    oracle = _grads(ref.rag_token_nll, logits.double(), scores.double(), targets)
    return actual, plain, oracle


def _small_entries(oracle: torch.Tensor, fraction: float, seed: int) -> torch.Tensor:
    """Flat indices of ``fraction`` of all entries, drawn among those below 1e-5 of the
    largest (most of them): where a floor scaled to the largest value sees nothing."""
    small = torch.nonzero(oracle.abs().flatten() < 1e-5 * oracle.abs().max()).squeeze(1)
    pick = torch.randperm(small.numel(), generator=torch.Generator().manual_seed(seed))
    return small[pick[: int(fraction * oracle.numel())]]


def test_correct_gradient_passes(logit_gradients):
    actual, plain, oracle = logit_gradients
    assert_close_rule(actual, plain, oracle, F32, "d logits")


@pytest.mark.parametrize("planted,caught", [("zeroed", 0.95), ("scaled by 1.01", 0.5)])
def test_error_in_one_percent_of_entries_is_rejected(logit_gradients, planted, caught):
    actual, plain, oracle = logit_gradients
    idx = _small_entries(oracle, 0.01, seed=1)
    wrong = actual.clone().flatten()
    wrong[idx] = 0.0 if planted == "zeroed" else wrong[idx] * 1.01
    wrong = wrong.view_as(actual)
    # A floor scaled to the tensor's largest value (this rule's predecessor) misses it ...
    largest_floor = 1e-5 * float(oracle.abs().max())
    assert float((wrong - actual).abs().max()) < largest_floor
    # ... this rule flags the planted entries (observed: 2918 of the 3015 zeroed ones, those
    # above about 1e-5 of the tensor's mean magnitude; 2283 of the 3015 scaled ones, those
    # above about 1e-3 of it) and nothing else.
    bad = tolerance_violations(wrong, plain, oracle, F32).flatten()
    flagged = int(bad[idx].sum())
    assert flagged >= caught * idx.numel(), f"{flagged} of {idx.numel()} planted entries flagged"
    assert int(bad.sum()) == flagged, "an entry that was not perturbed was flagged"
    with pytest.raises(AssertionError, match="out of tolerance"):
        assert_close_rule(wrong, plain, oracle, F32, "d logits")


def test_infinities_and_nans_must_match():
    oracle = torch.tensor([float("-inf"), float("nan"), 1.0], dtype=torch.float64)
    plain = oracle.float()
    assert_close_rule(plain.clone(), plain, oracle, F32, "matching")
    for wrong in ([0.0, float("nan"), 1.0], [float("-inf"), 0.0, 1.0],
                  [float("-inf"), float("nan"), float("nan")]):
        with pytest.raises(AssertionError, match="1 of 3 elements"):
            assert_close_rule(torch.tensor(wrong), plain, oracle, F32, "mismatch")


def test_floor_is_relative_to_each_element():
    # A row of V = 50265: one entry of 1, the others 1e-7 (mean 2e-5). An error of a quarter
    # of the floor passes everywhere; halving one small entry fails there.
    oracle = torch.full((50265,), 1e-7, dtype=torch.float64)
    oracle[0] = 1.0
    plain = oracle.float()
    assert_close_rule(plain * (1 + RTOL[F32] / 4), plain, oracle, F32, "within the floor")
    wrong = plain.clone()
    wrong[7] = 0.5e-7
    with pytest.raises(AssertionError, match=r"1 of 50265 elements .* worst at \(7,\)"):
        assert_close_rule(wrong, plain, oracle, F32, "half an entry")
