"""The autograd Function behind rag_token_nll and rag_sequence_nll.

A RAG loss depends on the logits only through per-row statistics (lse, target logit, sum of
logits: one read, see ``row_stats``), plus, for RAG-Token with label smoothing, the per-(b,t)
sums of the marginal log-probs (``token_smooth_forward`` computes both in one read, holding the
K rows of one (b,t) together). The forward computes those statistics with a kernel, then the loss from them
with ordinary PyTorch ops on ``O(B*K*T)`` scalars ("the small graph", given by each op file).

The backward re-runs the small graph with autograd to get the gradient of the loss with respect
to each statistic, then one kernel writes the logits' gradient once:

    d loss / d x = g_lse * P + g_tgt * onehot(y) + g_sum + g_summ[b,t] * R

where P = softmax_v(x) and R is the passage posterior per vocabulary entry. The statistic
``sum_m`` enters the small graph through a linearisation whose gradient with respect to the
passage log-prior ``a`` and ``lse`` is exact (d sum_m / d a = rho, d sum_m / d lse = -rho).
"""
from __future__ import annotations

from typing import Callable

import torch

from rag_fast.ops._dispatch import backend

# small_graph(lse, x_tgt, x_sum, sum_m, doc_scores) -> loss (reduced); all [B, K, T] or [B, T]
SmallGraph = Callable[..., torch.Tensor]


def linearised_sum_m(
    sum_m: torch.Tensor, rho: torch.Tensor, a: torch.Tensor, lse: torch.Tensor
) -> torch.Tensor:
    """``sum_m`` (value) with the exact gradient in ``a`` ``[B, K]`` and ``lse`` ``[B, K, T]``."""
    delta = a[:, :, None] - lse  # [B, K, T]
    # rho == 0 exactly for a missing passage (a = -inf): keep 0 * -inf out of the graph.
    term = torch.where(rho == 0, torch.zeros_like(rho), rho * delta).sum(1)  # [B, T]
    return sum_m + term - term.detach()


def fused_rag_loss(
    logits: torch.Tensor,
    doc_scores: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int,
    small_graph: SmallGraph,
    needs_sum_m: bool,
    impl: str,
    inplace_grad: bool,
) -> torch.Tensor:
    """The loss through FusedRagLossFunction; statistics only the backward uses (``rho``) are
    computed only when a gradient will be asked for."""
    will_backward = torch.is_grad_enabled() and (logits.requires_grad or doc_scores.requires_grad)
    return FusedRagLossFunction.apply(logits, doc_scores, targets, ignore_index, small_graph,
                                      needs_sum_m, impl, inplace_grad, will_backward)


class FusedRagLossFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        logits: torch.Tensor,
        doc_scores: torch.Tensor,
        targets: torch.Tensor,
        ignore_index: int,
        small_graph: SmallGraph,
        needs_sum_m: bool,
        impl: str,
        inplace_grad: bool,
        will_backward: bool = True,
    ) -> torch.Tensor:
        kernels = backend(impl)
        sum_m = rho = None
        if needs_sum_m:
            a = torch.log_softmax(doc_scores.detach().float(), dim=1)
            lse, x_tgt, x_sum, sum_m, rho = kernels.token_smooth_forward(
                logits, targets, ignore_index, a, need_rho=will_backward
            )
        else:
            lse, x_tgt, x_sum = kernels.row_stats(logits, targets, ignore_index)
        loss = small_graph(lse, x_tgt, x_sum, sum_m, doc_scores.detach())
        ctx.save_for_backward(logits, doc_scores, targets, lse, x_tgt, x_sum, sum_m, rho)
        ctx.small_graph, ctx.ignore_index, ctx.impl = small_graph, ignore_index, impl
        ctx.inplace_grad = inplace_grad
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        logits, doc_scores, targets, lse, x_tgt, x_sum, sum_m, rho = ctx.saved_tensors
        leaves = [t.detach().requires_grad_() for t in (lse, x_tgt, x_sum)]
        scores = doc_scores.detach().requires_grad_()
        a = None
        with torch.enable_grad():
            sm = None
            if sum_m is not None:
                leaves.append(sum_m.detach().requires_grad_())
                a = torch.log_softmax(scores.float(), dim=1)
                sm = linearised_sum_m(leaves[3], rho, a, leaves[0])
            loss = ctx.small_graph(*leaves[:3], sm, scores)
            grads = torch.autograd.grad(loss, leaves + [scores], grad_loss, allow_unused=True)
            g_lse, g_tgt, g_sum, *g_rest = (
                torch.zeros_like(t) if g is None else g for t, g in zip(leaves + [scores], grads)
            )
        g_scores = g_rest[-1] if ctx.needs_input_grad[1] else None

        g_logits = None
        if ctx.needs_input_grad[0]:
            kernels = backend(ctx.impl)
            out = logits if ctx.inplace_grad else torch.empty_like(logits)
            if sum_m is None:
                kernels.row_grad(logits, targets, ctx.ignore_index, lse, g_lse, g_tgt, g_sum, out)
            else:
                kernels.token_smooth_grad(logits, targets, ctx.ignore_index, a.detach(), lse,
                                          g_lse, g_tgt, g_sum, g_rest[0], out)
            g_logits = out
        return g_logits, g_scores, None, None, None, None, None, None, None
