"""The fused path behind rag_token_nll and rag_sequence_nll.

A RAG loss depends on the logits only through per-row statistics (lse, target logit, sum of
logits: one read, ``torch.ops.rag_fast.row_stats``), plus, for RAG-Token with label smoothing,
the per-(b,t) sums of the marginal log-probs (``torch.ops.rag_fast.token_smooth_forward``
computes both in one read, holding the K rows of one (b,t) together). A custom op computes
those statistics; the loss follows from them by ordinary PyTorch ops on ``O(B*K*T)`` scalars
("the small graph", given by each op file), which autograd differentiates as usual.

The statistics ops carry their own registered backward: from the gradients of the loss with
respect to the statistics, one kernel writes the logits' gradient once,

    d loss / d x = g_lse * P + g_tgt * onehot(y) + g_sum + g_sum_m[b,t] * (R - rho * P)

where P = softmax_v(x), R is the passage posterior per vocabulary entry and rho = sum_v R.
Everything here is traceable by ``torch.compile`` without a graph break.
"""
from __future__ import annotations

from typing import Callable

import torch

from rag_fast.ops import _custom_ops  # registers torch.ops.rag_fast.*
from rag_fast.ops._common import PreparedLoss

# small_graph(lse, x_tgt, x_sum, sum_m, log_prior) -> loss (reduced)
#   lse, x_tgt, x_sum: [B, K, T]; sum_m: [B, T] or None; log_prior: [B, K] float32
SmallGraph = Callable[..., torch.Tensor]


def check_inplace_grad(op: str, logits: torch.Tensor, inplace_grad: bool) -> None:
    """Refuse ``inplace_grad=True`` (ValueError naming ``rag_fast.<op>``) for the logits a public
    loss was given when they are a leaf that requires grad or a view of one (any layout, any
    chain of views), whichever impl then runs: the reference writes nothing, but it refuses
    the same logits, so a call does not pass on one machine and fail on another. The
    statistics ops, which do the write, check again and also compare storages
    (``_custom_ops.inplace_grad_refusal``). Nothing is checked where no backward will run
    (grad disabled, logits that do not require grad) or under ``torch.compile``, where
    ``inplace_grad`` is ignored."""
    if (inplace_grad and isinstance(logits, torch.Tensor) and torch.is_grad_enabled()
            and not torch.compiler.is_compiling()):
        _custom_ops.check_inplace_grad_target(f"rag_fast.{op}", logits, True, storage=False)


def fused_rag_loss(
    p: PreparedLoss, small_graph: SmallGraph, needs_sum_m: bool, inplace_grad: bool
) -> torch.Tensor:
    """The loss of the prepared inputs ``p`` (impl "cpp" or "triton") through the statistics
    ops. Statistics only the backward uses (``rho``) are computed only when a gradient will be
    asked for. Under ``torch.compile`` ``inplace_grad`` is ignored: the compiler plans the
    gradient's memory itself, and a compiled backward cannot write into its saved inputs.
    Elsewhere the statistics ops refuse it for logits whose memory is a leaf's
    (``_custom_ops.inplace_grad_refusal``)."""
    x, y, ignore = p.logits, p.targets, p.ignore_index
    inplace_grad = inplace_grad and not torch.compiler.is_compiling()
    a = torch.log_softmax(p.doc_scores.float(), dim=1)  # [B, K] passage log-prior
    if needs_sum_m:
        will_backward = torch.is_grad_enabled() and (x.requires_grad or a.requires_grad)
        lse, x_tgt, x_sum, sum_m, _ = torch.ops.rag_fast.token_smooth_forward(
            x, y, ignore, a, will_backward, p.impl, inplace_grad)
    else:
        lse, x_tgt, x_sum = torch.ops.rag_fast.row_stats(x, y, ignore, p.impl, inplace_grad)
        sum_m = None
    # lse is float64 (the row max plus the log of a sum, never rounded at the logits' size):
    # the small graph runs in float64 on its O(B*K*T) scalars; the loss is float32.
    return small_graph(lse, x_tgt, x_sum, sum_m, a).to(torch.float32)
