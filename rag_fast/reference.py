"""The RAG equations in plain PyTorch: the oracle of every test and the fallback of every op.

Notation (docs/design.md, "Notation"): B questions, K passages each, T target positions,
V vocabulary.
``x[b,k,t,v]`` generator logits given passage k, ``s[b,k]`` passage scores, ``y[b,t]`` targets
aligned with the logits (the caller shifts), ``m[b,t] = (y != ignore_index)``.

    a[b,k]   = log_softmax_k s                          passage log-prior log p(z|x)
    L[b,k,t] = logsumexp_v x                            row normaliser
    l[b,k,t] = x[b,k,t,y] - L                           target log-prob given passage k
    M[b,t,v] = logsumexp_k (a + x - L)                  RAG-Token marginal log-probs

    RAG-Token:    nll = -sum_t m M[y]       smooth = -sum_t m sum_v M
    RAG-Sequence: nll = -logsumexp_k (a + sum_t m l)
                  smooth = -logsumexp_k (V a + sum_t m sum_v (x - L))
    loss = (1 - eps) nll + (eps / V) smooth

Everything is computed in float64 for float64 inputs and in float32 otherwise (bf16/fp16 inputs
are upcast), materializing full ``[B, K, T, V]`` tensors: this module is written to be obviously
right, not fast. It imports no Triton and no extension.

A missing passage has score ``-inf``: it gets weight 0 and produces no NaN, provided each
question has at least one finite score.

Deliberate differences from ``transformers`` (whose ``get_nll`` methods shift the targets left
themselves and mask with ``pad_token_id``):

* RAG-Sequence adds the passage prior once per sequence. ``transformers`` adds it to every
  vocabulary entry at target position 1, so its loss equals ours whenever position 1 is a real
  token; when position 1 is padding (or T == 1) ``transformers`` silently drops the prior,
  which is a bug we do not reproduce.
* ``exclude_bos=True`` drops target position 0 from the NLL term (not the smoothing term),
  as ``transformers``' ``exclude_bos_score`` does when every target starts with BOS; here the
  caller decides, with no data-dependent test. RAG-Token applies the same rule.
"""
from __future__ import annotations

import numpy as np
import torch

from rag_fast._validation import (
    check_epsilon,
    check_loss_inputs,
    check_reduction,
    reduce,
)

__all__ = [
    "passage_log_prior",
    "rag_token_marginal",
    "rag_token_nll",
    "rag_sequence_nll",
]


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def passage_log_prior(doc_scores: torch.Tensor) -> torch.Tensor:
    """Passage log-prior ``a = log_softmax_k(doc_scores)``.

    Args:
        doc_scores: ``[B, K]`` floating passage scores; ``-inf`` marks a missing passage.

    Returns:
        ``[B, K]`` log-probabilities in float32 (float64 for float64 input).
    """
    if not isinstance(doc_scores, torch.Tensor) or not doc_scores.is_floating_point():
        raise ValueError("doc_scores must be a floating torch.Tensor")
    if doc_scores.dim() != 2:
        raise ValueError(f"doc_scores must have shape [B, K], got {tuple(doc_scores.shape)}")
    return torch.log_softmax(doc_scores.to(_compute_dtype(doc_scores.dtype)), dim=1)


def _log_probs(logits: torch.Tensor) -> torch.Tensor:
    """``x - L`` per row, ``[B, K, T, V]`` in the compute dtype."""
    return torch.log_softmax(logits.to(_compute_dtype(logits.dtype)), dim=-1)


def rag_token_marginal(
    logits: torch.Tensor, doc_scores: torch.Tensor, n_docs: int | None = None
) -> torch.Tensor:
    """RAG-Token marginal log-probabilities ``M[b,t,v] = logsumexp_k (a + x - L)``.

    Args:
        logits: ``[B, K, T, V]`` or ``[B*K, T, V]`` floating generator logits.
        doc_scores: ``[B, K]`` floating passage scores.
        n_docs: K, optional (taken from ``doc_scores``); checked when given.

    Returns:
        ``[B, T, V]`` marginal log-probs, float32 (float64 for float64 logits).

    Raises:
        ValueError: bad ranks or shapes, non-floating inputs, tensors on different devices.
    """
    inp = check_loss_inputs(logits, doc_scores, None, n_docs)
    a = passage_log_prior(inp.doc_scores)
    return torch.logsumexp(_log_probs(inp.logits) + a[:, :, None, None], dim=1)


def target_masks(targets: torch.Tensor, ignore_index: int,
                 exclude_bos: bool | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mask, nll_mask)``, both ``[B, T]`` bool: the real target positions, and those counted
    in the NLL term (position 0 left out when ``exclude_bos`` holds).

    ``exclude_bos`` is a bool (Python's or NumPy's), or a 0-dim bool tensor on the targets'
    device or the CPU, which decides on the device without reading a value on the host (no
    synchronisation, and no graph break under ``torch.compile``): e.g. ``transformers``' rule
    ``targets[:, 0].eq(bos).all()``. Anything else raises ValueError naming ``exclude_bos``."""
    mask = targets != ignore_index
    if isinstance(exclude_bos, torch.Tensor):
        if (exclude_bos.dim() != 0 or exclude_bos.dtype != torch.bool
                or exclude_bos.device not in (targets.device, torch.device("cpu"))):
            raise ValueError(
                "exclude_bos must be a bool or a 0-dim bool tensor on the targets' device "
                f"({targets.device}) or the CPU, got a {exclude_bos.dtype} tensor of shape "
                f"{tuple(exclude_bos.shape)} on {exclude_bos.device}")
        # a CPU scalar with device targets: copied without waiting (no host read)
        exclude = exclude_bos.to(targets.device, non_blocking=True)
        first = torch.arange(targets.shape[1], device=targets.device) == 0  # [T]
        return mask, mask & ~(first & exclude)
    if not isinstance(exclude_bos, (bool, np.bool_)):
        raise ValueError("exclude_bos must be a bool or a 0-dim bool tensor, got "
                         f"{type(exclude_bos).__module__}.{type(exclude_bos).__qualname__} "
                         f"{exclude_bos!r}")
    nll_mask = mask.clone()
    if exclude_bos and nll_mask.shape[1] > 0:
        nll_mask[:, 0] = False
    return mask, nll_mask


def _target_mask(targets: torch.Tensor, ignore_index: int, exclude_bos: bool | torch.Tensor):
    """``(mask, nll_mask, safe_targets)``: :func:`target_masks`, and the targets with ignored
    positions replaced by 0 so that they can index."""
    mask, nll_mask = target_masks(targets, ignore_index, exclude_bos)
    safe = torch.where(mask, targets, torch.zeros_like(targets))
    return mask, nll_mask, safe


def rag_token_nll(
    logits: torch.Tensor,
    doc_scores: torch.Tensor,
    targets: torch.Tensor,
    *,
    n_docs: int | None = None,
    epsilon: float = 0.0,
    ignore_index: int = -100,
    exclude_bos: bool | torch.Tensor = False,
    reduction: str = "none",
) -> torch.Tensor:
    """RAG-Token loss (paper eq. 2) with optional label smoothing.

    Args:
        logits: ``[B, K, T, V]`` or ``[B*K, T, V]`` floating generator logits.
        doc_scores: ``[B, K]`` floating passage scores (``-inf``: missing passage).
        targets: ``[B, T]`` integer targets aligned with the logits; ``ignore_index`` masks.
        n_docs: K, optional; checked against ``doc_scores`` when given.
        epsilon: label smoothing in ``[0, 1]``.
        ignore_index: target value that marks a position to ignore.
        exclude_bos: leave target position 0 out of the NLL term; a bool, or a 0-dim bool
            tensor (on the targets' device or the CPU) that decides without a host read.
        reduction: ``"none"`` -> ``[B]``, ``"sum"`` or ``"mean"`` (over B) -> scalar.

    Returns:
        The loss, float32 (float64 for float64 logits).

    Raises:
        ValueError: bad shapes, dtypes, devices, targets outside ``[0, V)``, bad options.
    """
    check_epsilon(epsilon)
    check_reduction(reduction)
    inp = check_loss_inputs(logits, doc_scores, targets, n_docs, ignore_index)
    V = inp.logits.shape[-1]
    mask, nll_mask, safe = _target_mask(inp.targets, ignore_index, exclude_bos)
    M = rag_token_marginal(inp.logits, inp.doc_scores)  # [B, T, V]
    zero = M.new_zeros(())
    target_lp = M.gather(-1, safe[..., None]).squeeze(-1)  # [B, T]
    nll = -torch.where(nll_mask, target_lp, zero).sum(1)
    loss = (1.0 - epsilon) * nll
    if epsilon > 0:
        smooth = -torch.where(mask, M.sum(-1), zero).sum(1)
        loss = loss + (epsilon / V) * smooth
    return reduce(loss, reduction)


def rag_sequence_nll(
    logits: torch.Tensor,
    doc_scores: torch.Tensor,
    targets: torch.Tensor,
    *,
    n_docs: int | None = None,
    epsilon: float = 0.0,
    ignore_index: int = -100,
    exclude_bos: bool | torch.Tensor = False,
    reduction: str = "none",
) -> torch.Tensor:
    """RAG-Sequence loss (paper eq. 1) with optional label smoothing.

    Same arguments, shapes and errors as :func:`rag_token_nll`.
    """
    check_epsilon(epsilon)
    check_reduction(reduction)
    inp = check_loss_inputs(logits, doc_scores, targets, n_docs, ignore_index)
    V = inp.logits.shape[-1]
    mask, nll_mask, safe = _target_mask(inp.targets, ignore_index, exclude_bos)
    a = passage_log_prior(inp.doc_scores)  # [B, K]
    lp = _log_probs(inp.logits)  # [B, K, T, V]
    K = lp.shape[1]
    zero = lp.new_zeros(())
    target_lp = lp.gather(-1, safe[:, None, :, None].expand(-1, K, -1, 1)).squeeze(-1)
    S = torch.where(nll_mask[:, None, :], target_lp, zero).sum(-1)  # [B, K]
    nll = -torch.logsumexp(a + S, dim=1)
    loss = (1.0 - epsilon) * nll
    if epsilon > 0:
        Q = torch.where(mask[:, None, :], lp.sum(-1), zero).sum(-1)  # [B, K]
        smooth = -torch.logsumexp(V * a + Q, dim=1)
        loss = loss + (epsilon / V) * smooth
    return reduce(loss, reduction)
