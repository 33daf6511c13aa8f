"""RAG-Token loss (paper eq. 2): the passage is marginalised per target token.

    M[b,t,v] = logsumexp_k (a[b,k] + x[b,k,t,v] - L[b,k,t])
    loss[b]  = -(1 - eps) sum_t m' M[b,t,y] - (eps / V) sum_t m sum_v M[b,t,v]

Trade-off: with eps == 0 only per-row statistics are needed (one read of the logits forward,
one read + one write backward). With eps > 0 the sum over v of M needs the K rows of each
(b,t) together, so the forward reads the logits twice; memory stays O(B*K*T) either way.
"""
from __future__ import annotations

import torch

from rag_fast import reference
from rag_fast._validation import reduce
from rag_fast.ops._common import prepare_loss
from rag_fast.ops._fused_loss import check_inplace_grad, fused_rag_loss


def _token_small_graph(mask, nll_mask, epsilon: float, V: int, reduction: str):
    def small_graph(lse, x_tgt, x_sum, sum_m, a):
        target_lp = torch.logsumexp(a[:, :, None] + (x_tgt - lse), dim=1)  # [B, T] = M[.., y]
        zero = target_lp.new_zeros(())
        loss = -(1.0 - epsilon) * torch.where(nll_mask, target_lp, zero).sum(1)
        if sum_m is not None:
            loss = loss - (epsilon / V) * torch.where(mask, sum_m, zero).sum(1)
        return reduce(loss, reduction)

    return small_graph


def rag_token_nll(
    logits: torch.Tensor,
    doc_scores: torch.Tensor,
    targets: torch.Tensor,
    *,
    n_docs: int | None = None,
    epsilon: float = 0.0,
    ignore_index: int = -100,
    exclude_bos: bool = False,
    reduction: str = "none",
    impl: str = "auto",
    inplace_grad: bool = False,
) -> torch.Tensor:
    """RAG-Token negative log-likelihood with optional label smoothing, fused.

    Args:
        logits: ``[B, K, T, V]`` or ``[B*K, T, V]`` generator logits (fp32, bf16, fp16, fp64).
        doc_scores: ``[B, K]`` passage scores ``q . d`` (``-inf``: missing passage).
        targets: ``[B, T]`` integer targets aligned with the logits (the caller shifts);
            positions equal to ``ignore_index`` are masked.
        n_docs: K, optional; checked against ``doc_scores.shape[1]``.
        epsilon: label smoothing in ``[0, 1]``.
        ignore_index: masked target value.
        exclude_bos: leave target position 0 out of the NLL term.
        reduction: ``"none"`` -> ``[B]``; ``"sum"`` / ``"mean"`` (over B) -> scalar.
        impl: ``"auto"`` | ``"cpp"`` | ``"triton"`` | ``"torch"`` (the reference).
        inplace_grad: write the logits' gradient into the logits' storage (saves one
            logits-sized buffer; the logits hold the gradient after backward). For logits an
            op computed (``logits = lm_head(h)``), never for a leaf: refused when the logits
            require grad and are a leaf, a view of a leaf that requires grad (e.g. a
            ``[B*K, T, V]`` leaf, which is split into ``[B, K, T, V]``; any reshape, slice,
            transpose or other chain of views), or (impl "cpp" / "triton") share their storage
            with a leaf that requires grad in their autograd graph. Any later use of the
            overwritten logits by autograd (a second loss on them, ``retain_graph``) raises;
            ignored under ``torch.compile``.

    Returns:
        float32 loss (float64 for float64 logits under impl="torch").

    Raises:
        ValueError: bad shapes, dtypes, devices, options, or targets outside ``[0, V)``;
            ``inplace_grad`` on logits that overlap in memory (expanded), or whose memory is
            a leaf's (see ``inplace_grad``).
        RuntimeError: a backward that needs logits an ``inplace_grad`` backward overwrote.
    """
    p = prepare_loss(logits, doc_scores, targets, n_docs, epsilon, ignore_index, exclude_bos,
                     reduction, impl)
    check_inplace_grad("rag_token_nll", logits, inplace_grad)
    if p.impl == "torch":
        return reference.rag_token_nll(p.logits, p.doc_scores, p.targets, epsilon=epsilon,
                                       ignore_index=ignore_index, exclude_bos=exclude_bos,
                                       reduction=reduction)
    graph = _token_small_graph(p.mask, p.nll_mask, float(epsilon), p.logits.shape[-1], reduction)
    return fused_rag_loss(p, graph, epsilon > 0, inplace_grad)
