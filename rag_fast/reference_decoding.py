"""The RAG-Token beam step in plain PyTorch: oracle of the beam-step kernels and their fallback.

For question b, beam j, passage k, token v (docs/design.md, "RAG-Token beam step"):

    L[b,j,k]   = logsumexp_v x[b,j,k,v]                         row normaliser
    M[b,j,v]   = logsumexp_k (a[b,k] + x[b,j,k,v] - L[b,j,k])    marginal log-probs
    c[b,j,v]   = (M[b,j,v] + bias[b*W+j, v]) + beam_score[b,j]  candidate score

The step returns the ``n`` best candidates ``(c, j, v)`` of each question over all ``(j, v)``,
sorted by score descending; equal scores are broken by the lower flat index ``j*V + v`` first.
A passage with prior ``-inf`` (missing) contributes nothing; when every passage of a question is
missing, every candidate scores ``-inf`` and the first ``n`` flat indices are returned.
Imports no Triton and no extension.
"""
from __future__ import annotations

import torch

__all__ = ["rag_token_beam_candidates", "rag_token_beam_step", "select_top"]


def rag_token_beam_candidates(
    logits: torch.Tensor,
    log_prior: torch.Tensor,
    beam_scores: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Every candidate score ``c`` as ``[B, W, V]`` (float64 for float64 logits, else float32).

    Args:
        logits: ``[B, W, K, V]`` step logits.
        log_prior: ``[B, K]`` passage log-priors ``a`` (``-inf``: missing passage).
        beam_scores: ``[B, W]`` running beam scores.
        bias: ``[B*W, V]`` additive bias (logits processors), or None.
    """
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    x = logits.to(dtype)
    B, W, K, V = x.shape
    logp = torch.log_softmax(x, dim=-1)  # [B, W, K, V]
    a = log_prior.to(dtype)[:, None, :, None]  # [B, 1, K, 1]
    # A -inf prior would give -inf + finite = -inf: logsumexp handles it without NaN.
    marginal = torch.logsumexp(logp + a, dim=2)  # [B, W, V]
    if bias is not None:
        marginal = marginal + bias.to(dtype).view(B, W, V)
    return marginal + beam_scores.to(dtype)[:, :, None]


def select_top(scores: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``n`` best entries of each row of ``scores [B, N]``: (values, flat indices).

    Sorted by value descending, ties by lower index first (a stable sort; NaN sorts last).
    """
    key = torch.where(torch.isnan(scores), torch.full_like(scores, float("-inf")), scores)
    order = torch.sort(key, dim=1, descending=True, stable=True).indices[:, :n]
    return scores.gather(1, order), order


def rag_token_beam_step(
    logits: torch.Tensor,
    log_prior: torch.Tensor,
    beam_scores: torch.Tensor,
    bias: torch.Tensor | None = None,
    n: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top ``n`` (default ``2W``, at most ``W*V``) candidates per question.

    Returns:
        ``(scores [B, n], beams [B, n] int64, tokens [B, n] int64)``.
    """
    B, W, _, V = logits.shape
    n = min(2 * W if n is None else n, W * V)
    c = rag_token_beam_candidates(logits, log_prior, beam_scores, bias).reshape(B, W * V)
    scores, flat = select_top(c, n)
    return scores, flat // V, flat % V
