"""The fused RAG-Token beam step: the best next (score, beam, token) of every question.

For question b, beam j, passage k and token v (docs/design.md, "RAG-Token beam step"):

    M[b,j,v] = logsumexp_k (a[b,k] + x[b,j,k,v] - logsumexp_v' x[b,j,k,v'])
    c[b,j,v] = (M[b,j,v] + bias[b*W+j, v]) + beam_score[b,j]

and the step returns the ``n`` (default ``2W``) best ``(j, v)`` of each question, sorted by
score descending, equal scores broken by the lower flat index ``j*V + v`` first. This is what
``transformers`` computes every beam-search step of ``RagTokenForGeneration`` with a
log_softmax over ``[B*W*K, V]``, a logsumexp over K, another log_softmax, an addition and a
top-k over ``[B, W*V]``; the fused step never materialises any ``[B, W, K, V]`` or
``[B, W, V]`` float tensor.

Trade-off: the C++ kernel reads the logits twice (row normalisers, then the marginal with a
running top-n that skips a vector of tokens after its K maxima when it cannot beat the n-th
best); the Triton kernel reads them twice and writes ``[B*W, V]`` float32 scores, then a
stable sort selects. No autograd: decoding only. Both run as ``torch.ops.rag_fast.beam_step``
(C++ for CPU tensors, Triton for CUDA ones).
"""
from __future__ import annotations

import torch

from rag_fast import reference_decoding
from rag_fast.ops import _custom_ops  # noqa: F401  (registers torch.ops.rag_fast.*)
from rag_fast.ops._dispatch import resolve_impl


def _check(
    logits: torch.Tensor,
    log_prior: torch.Tensor,
    beam_scores: torch.Tensor,
    bias: torch.Tensor | None,
    num_candidates: int | None,
) -> int:
    for name, t in (("logits", logits), ("log_prior", log_prior), ("beam_scores", beam_scores)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise ValueError(f"{name} must be a floating torch.Tensor")
    if logits.dim() != 4:
        raise ValueError(f"logits must have shape [B, W, K, V], got {tuple(logits.shape)}")
    B, W, K, V = logits.shape
    if min(B, W, K, V) < 1:
        raise ValueError(f"logits [B, W, K, V] must have every size >= 1, got {tuple(logits.shape)}")
    if tuple(log_prior.shape) != (B, K):
        raise ValueError(f"log_prior must have shape [B, K] = [{B}, {K}], got {tuple(log_prior.shape)}")
    if tuple(beam_scores.shape) != (B, W):
        raise ValueError(
            f"beam_scores must have shape [B, W] = [{B}, {W}], got {tuple(beam_scores.shape)}"
        )
    tensors = [log_prior, beam_scores]
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or not bias.is_floating_point():
            raise ValueError("bias must be a floating torch.Tensor or None")
        if tuple(bias.shape) != (B * W, V):
            raise ValueError(f"bias must have shape [B*W, V] = [{B * W}, {V}], got {tuple(bias.shape)}")
        tensors.append(bias)
    for t in tensors:
        if t.device != logits.device:
            raise ValueError(f"every input must be on the logits' device {logits.device}")
    n = 2 * W if num_candidates is None else num_candidates
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"num_candidates must be a positive int, got {num_candidates!r}")
    return min(n, W * V)


def rag_token_beam_step(
    logits: torch.Tensor,
    log_prior: torch.Tensor,
    beam_scores: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    num_candidates: int | None = None,
    impl: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One RAG-Token beam-search step: the best candidates of each question.

    Args:
        logits: ``[B, W, K, V]`` generator logits of the step (question, beam, passage, token);
            float32 or bfloat16 for the kernels (float64 runs the reference). Finite.
        log_prior: ``[B, K]`` passage log-priors ``log_softmax(doc_scores)``; ``-inf`` marks a
            missing passage (weight 0).
        beam_scores: ``[B, W]`` running beam scores (log-probabilities).
        bias: ``[B*W, V]`` additive bias applied to the marginal before the beam score (e.g.
            ``-inf`` on EOS below the minimum length), or None.
        num_candidates: candidates per question, default ``2W``; clipped to ``W*V``.
        impl: ``"auto"`` | ``"cpp"`` | ``"triton"`` | ``"torch"`` (the reference).

    Returns:
        ``(scores, beams, tokens)``, each ``[B, n]`` with ``n = min(num_candidates, W*V)``:
        float32 scores (float64 under "torch" for float64 logits) sorted descending, ties by the
        lower flat index ``beam*V + token`` first; int64 beam and token indices.

    Raises:
        ValueError: bad ranks or shapes, non-floating inputs, tensors on different devices,
            a non-positive ``num_candidates``, an impl that cannot run here.
    """
    n = _check(logits, log_prior, beam_scores, bias, num_candidates)
    resolved = resolve_impl(impl, logits)
    if resolved == "torch":
        return reference_decoding.rag_token_beam_step(logits, log_prior, beam_scores, bias, n)
    x = logits if logits.stride(-1) == 1 else logits.contiguous()
    b = None if bias is None else bias.detach()
    return torch.ops.rag_fast.beam_step(x.detach(), log_prior.detach(), beam_scores.detach(), b,
                                        n, resolved)
