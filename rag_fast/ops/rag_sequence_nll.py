"""RAG-Sequence loss (paper eq. 1): one passage for the whole target sequence.

    S[b,k]   = sum_t m' (x[b,k,t,y] - L[b,k,t])
    nll[b]   = -logsumexp_k (a[b,k] + S[b,k])
    smooth[b]= -logsumexp_k (V a[b,k] + sum_t m (sum_v x[b,k,t,v] - V L[b,k,t]))
    loss[b]  = (1 - eps) nll + (eps / V) smooth

Trade-off: everything follows from per-row statistics (one read of the logits forward; the
backward is a per-row scaled cross-entropy gradient, one read and one write), at the cost of
re-running the O(B*K*T) small graph in the backward.
"""
from __future__ import annotations

import torch

from rag_fast import reference
from rag_fast._validation import reduce
from rag_fast.ops._common import prepare_loss
from rag_fast.ops._fused_loss import check_inplace_grad, fused_rag_loss


def _sequence_small_graph(mask, nll_mask, epsilon: float, V: int, reduction: str):
    def small_graph(lse, x_tgt, x_sum, sum_m, a):
        zero = lse.new_zeros(())
        S = torch.where(nll_mask[:, None, :], x_tgt - lse, zero).sum(-1)  # [B, K]
        loss = -(1.0 - epsilon) * torch.logsumexp(a + S, dim=1)
        if epsilon > 0:
            Q = torch.where(mask[:, None, :], x_sum - V * lse, zero).sum(-1)  # [B, K]
            loss = loss - (epsilon / V) * torch.logsumexp(V * a + Q, dim=1)
        return reduce(loss, reduction)

    return small_graph


def rag_sequence_nll(
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
    """RAG-Sequence negative log-likelihood with optional label smoothing, fused.

    Same arguments, shapes, return value and errors as :func:`rag_fast.rag_token_nll`;
    ``inplace_grad=True`` is likewise refused (ValueError) for logits that are a leaf, a view
    of a leaf that requires grad (a ``[B*K, T, V]`` leaf included), or (impl "cpp" /
    "triton") share their storage with one.
    """
    p = prepare_loss(logits, doc_scores, targets, n_docs, epsilon, ignore_index, exclude_bos,
                     reduction, impl)
    check_inplace_grad("rag_sequence_nll", logits, inplace_grad)
    if p.impl == "torch":
        return reference.rag_sequence_nll(p.logits, p.doc_scores, p.targets, epsilon=epsilon,
                                          ignore_index=ignore_index, exclude_bos=exclude_bos,
                                          reduction=reduction)
    graph = _sequence_small_graph(p.mask, p.nll_mask, float(epsilon), p.logits.shape[-1],
                                  reduction)
    return fused_rag_loss(p, graph, False, inplace_grad)
