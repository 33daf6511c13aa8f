"""rag_fast.reference against transformers' RAG methods and against the closed-form
gradients of docs/design.md ("Gradients"), in float64."""
from __future__ import annotations

import math

import pytest
import torch

from rag_fast import reference as ref
from rag_fast.testing import shift_targets_left, tiny_hf_rag

PAD, BOS = 1, 0
F64 = torch.float64


def _inputs(B=3, K=3, T=6, V=50, seed=0, bos_first=False, missing=False):
    """Random fp64 logits [B*K, T, V], scores [B, K] and HF-style (unshifted) targets with
    trailing padding of different lengths per question (position 1 always a real token)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B * K, T, V, generator=g, dtype=F64) * 2
    scores = torch.randn(B, K, generator=g, dtype=F64)
    if missing:
        scores[0, -1] = -float("inf")  # a question with a missing passage
    target = torch.randint(3, V, (B, T), generator=g)
    if bos_first:
        target[:, 1] = BOS  # after the left shift, every target starts with BOS
    for b in range(B):
        target[b, T - b:] = PAD  # question b has b padded positions
    return logits, scores, target


@pytest.fixture(scope="module")
def hf_token():
    return tiny_hf_rag("token", pad_token_id=PAD, bos_token_id=BOS)


@pytest.fixture(scope="module")
def hf_sequence():
    return tiny_hf_rag("sequence", pad_token_id=PAD, bos_token_id=BOS)


@pytest.mark.parametrize("missing", [False, True])
def test_marginal_equals_transformers(hf_token, missing):
    logits, scores, _ = _inputs(missing=missing)
    expected = hf_token.marginalize(logits, scores, n_docs=3)
    torch.testing.assert_close(ref.rag_token_marginal(logits, scores, n_docs=3), expected)
    # The [B, K, T, V] layout gives the same result.
    torch.testing.assert_close(ref.rag_token_marginal(logits.view(3, 3, 6, 50), scores), expected)


@pytest.mark.parametrize("epsilon", [0.0, 0.1])
@pytest.mark.parametrize("reduce_loss", [False, True])
@pytest.mark.parametrize("missing", [False, True])
def test_token_nll_equals_transformers(hf_token, epsilon, reduce_loss, missing):
    logits, scores, target = _inputs(missing=missing, seed=1)
    expected = hf_token.get_nll(logits, scores, target, reduce_loss=reduce_loss,
                                epsilon=epsilon, n_docs=3)
    ours = ref.rag_token_nll(logits, scores, shift_targets_left(target, PAD), n_docs=3,
                             epsilon=epsilon, ignore_index=PAD,
                             reduction="sum" if reduce_loss else "none")
    torch.testing.assert_close(ours, expected)


@pytest.mark.parametrize("epsilon", [0.0, 0.1])
@pytest.mark.parametrize("exclude_bos", [False, True])
@pytest.mark.parametrize("reduce_loss", [False, True])
@pytest.mark.parametrize("missing", [False, True])
def test_sequence_nll_equals_transformers(hf_sequence, epsilon, exclude_bos, reduce_loss, missing):
    logits, scores, target = _inputs(missing=missing, seed=2, bos_first=True)
    expected = hf_sequence.get_nll(logits, scores, target, reduce_loss=reduce_loss,
                                   epsilon=epsilon, exclude_bos_score=exclude_bos, n_docs=3)
    ours = ref.rag_sequence_nll(logits, scores, shift_targets_left(target, PAD), n_docs=3,
                                epsilon=epsilon, ignore_index=PAD, exclude_bos=exclude_bos,
                                reduction="sum" if reduce_loss else "none")
    torch.testing.assert_close(ours, expected)


def test_sequence_prior_kept_where_transformers_drops_it(hf_sequence):
    # Position 1 of the shifted targets is padding: transformers loses the passage prior there
    # (documented in reference.py); we keep it, so the two differ by exactly that prior.
    logits, scores, target = _inputs(B=1, seed=3)
    target[0, 2:] = PAD
    shifted = shift_targets_left(target, PAD)
    ours = ref.rag_sequence_nll(logits, scores, shifted, ignore_index=PAD)
    theirs = hf_sequence.get_nll(logits, scores, target, n_docs=3)
    # A uniform prior adds log K to -logsumexp_k S; transformers adds nothing.
    uniform = ref.rag_sequence_nll(logits, torch.zeros_like(scores), shifted, ignore_index=PAD)
    assert not torch.allclose(ours, theirs)
    torch.testing.assert_close(theirs, uniform - math.log(3))


# ---- gradients against the closed forms of docs/design.md, "Gradients" ---------------


def _closed_form(logits4, scores, y, eps, mode):
    """d loss / d x and d loss / d s for upstream 1 per question (docs/design.md, "Gradients")."""
    V = logits4.shape[-1]
    m = (y != -100).double()[:, None, :, None]  # [B,1,T,1]
    safe = y.clamp(min=0)
    a = torch.log_softmax(scores, 1)[:, :, None, None]  # [B,K,1,1]
    lp = torch.log_softmax(logits4, -1)  # x - L
    P = lp.exp()
    onehot = torch.nn.functional.one_hot(safe, V).double()[:, None]  # [B,1,T,V]
    M = torch.logsumexp(a + lp, 1, keepdim=True)  # [B,1,T,V]
    if mode == "token":
        l = lp.gather(-1, safe[:, None, :, None].expand(-1, lp.shape[1], -1, 1))
        w = torch.exp(a + l - M.gather(-1, safe[:, None, :, None]))  # [B,K,T,1]
        R = torch.exp(a + lp - M)
        rho = R.sum(-1, keepdim=True)
        gx = (1 - eps) * (-m * w * (onehot - P)) + eps / V * (-m * (R - P * rho))
        ga = (1 - eps) * -(m * w).sum((2, 3)) + eps / V * -(m * rho).sum((2, 3))
    else:
        l = lp.gather(-1, safe[:, None, :, None].expand(-1, lp.shape[1], -1, 1))
        S = (m * l).sum((2, 3))
        u = torch.softmax(a[:, :, 0, 0] + S, 1)[:, :, None, None]
        Q = (m * lp.sum(-1, keepdim=True)).sum((2, 3))
        u2 = torch.softmax(V * a[:, :, 0, 0] + Q, 1)[:, :, None, None]
        gx = (1 - eps) * (-m * u * (onehot - P)) + eps / V * (-m * u2 * (1 - V * P))
        ga = (1 - eps) * -u[:, :, 0, 0] + eps / V * -V * u2[:, :, 0, 0]
    p = torch.softmax(scores, 1)
    gs = ga - p * ga.sum(1, keepdim=True)
    return gx, gs


@pytest.mark.parametrize("mode", ["token", "sequence"])
@pytest.mark.parametrize("epsilon", [0.0, 0.2])
def test_reference_gradients_equal_closed_forms(mode, epsilon):
    logits, scores, target = _inputs(seed=4)
    y = shift_targets_left(target, PAD).masked_fill(shift_targets_left(target, PAD) == PAD, -100)
    x4 = logits.view(3, 3, 6, 50).clone().requires_grad_()
    s = scores.clone().requires_grad_()
    fn = ref.rag_token_nll if mode == "token" else ref.rag_sequence_nll
    fn(x4, s, y, epsilon=epsilon, reduction="sum").backward()
    gx, gs = _closed_form(x4.detach(), scores, y, epsilon, mode)
    torch.testing.assert_close(x4.grad, gx)
    torch.testing.assert_close(s.grad, gs)


@pytest.mark.parametrize("fn", [ref.rag_token_nll, ref.rag_sequence_nll])
def test_missing_passages_get_zero_weight_and_no_nan(fn):
    logits, scores, target = _inputs(B=2, seed=5)
    y = shift_targets_left(target, PAD)
    scores[1, 1:] = -float("inf")  # question 1 keeps only passage 0
    y[0, :] = PAD  # question 0: every target ignored
    x4 = logits.view(2, 3, 6, 50).clone().requires_grad_()
    s = scores.clone().requires_grad_()
    loss = fn(x4, s, y, ignore_index=PAD, epsilon=0.1)
    loss.sum().backward()
    assert torch.isfinite(loss).all() and torch.isfinite(x4.grad).all()
    assert torch.isfinite(s.grad).all()
    assert x4.grad[1, 1:].abs().max() == 0  # missing passages get no gradient
    assert x4.grad[0].abs().max() == 0  # fully ignored question: no gradient to its logits
    if fn is ref.rag_token_nll:
        assert loss[0] == 0  # (RAG-Sequence keeps the prior's smoothing term -logsumexp(V a))
    # Question 1 equals plain token-level cross-entropy on passage 0 alone.
    ce = torch.nn.functional.cross_entropy(logits.view(2, 3, 6, 50)[1, 0], y[1], ignore_index=PAD,
                                           reduction="none", label_smoothing=0.1)
    if fn is ref.rag_token_nll:
        torch.testing.assert_close(loss[1], ce.sum())


def test_reductions():
    logits, scores, target = _inputs(seed=6)
    y = shift_targets_left(target, PAD)
    none = ref.rag_token_nll(logits, scores, y, ignore_index=PAD)
    assert none.shape == (3,)
    torch.testing.assert_close(ref.rag_token_nll(logits, scores, y, ignore_index=PAD,
                                                 reduction="sum"), none.sum())
    torch.testing.assert_close(ref.rag_token_nll(logits, scores, y, ignore_index=PAD,
                                                 reduction="mean"), none.mean())


def test_half_inputs_are_computed_in_float32():
    logits, scores, target = _inputs(seed=7)
    y = shift_targets_left(target, PAD)
    out = ref.rag_sequence_nll(logits.bfloat16(), scores.float(), y, ignore_index=PAD)
    assert out.dtype == torch.float32
    expected = ref.rag_sequence_nll(logits.bfloat16().double(), scores, y, ignore_index=PAD)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-4)


# ---- bad input --------------------------------------------------------------------------


@pytest.mark.parametrize("fn", [ref.rag_token_nll, ref.rag_sequence_nll])
@pytest.mark.parametrize(
    "case, match",
    [
        ("logits_rank", "logits must have shape"),
        ("k_not_divisor", r"logits.shape\[0\]=\d+ must equal B\*K=.*doc_scores"),
        ("n_docs_mismatch", "n_docs=4 does not match"),
        ("target_range", "targets must lie in"),
        ("int_logits", "logits must be a floating tensor"),
        ("float_targets", "targets must be an integer tensor"),
        ("target_shape", r"targets must have shape \[B, T\]"),
        ("scores_rank", r"doc_scores must have shape \[B, K\]"),
        ("epsilon", "epsilon must be"),
        ("reduction", "reduction must be one of"),
    ],
)
def test_bad_input_raises_value_error_naming_argument(fn, case, match):
    logits, scores, target = _inputs(seed=8)
    y = shift_targets_left(target, PAD)
    kwargs = {"ignore_index": PAD}
    if case == "logits_rank":
        logits = logits[0]
    elif case == "k_not_divisor":
        logits = logits[:-1]
    elif case == "n_docs_mismatch":
        kwargs["n_docs"] = 4
    elif case == "target_range":
        y[0, 0] = 50
    elif case == "int_logits":
        logits = logits.long()
    elif case == "float_targets":
        y = y.double()
    elif case == "target_shape":
        y = y[:, :-1]
    elif case == "scores_rank":
        scores = scores[0]
    elif case == "epsilon":
        kwargs["epsilon"] = 1.5
    elif case == "reduction":
        kwargs["reduction"] = "avg"
    with pytest.raises(ValueError, match=match):
        fn(logits, scores, y, **kwargs)
