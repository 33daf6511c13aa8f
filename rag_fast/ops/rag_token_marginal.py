"""RAG-Token marginal log-probabilities ``M[b,t,v] = logsumexp_k (a + x - L)``.

The output itself is ``[B, T, V]`` float32, so this op is for decoding and inspection; the
losses never materialise it. Trade-off: the forward reads the logits twice (row normalisers,
then the marginal with the K rows of each (b,t) together); the backward reads them twice more
(posterior-weighted sums c = sum_v R * g, then the gradient R * g - P * c) and writes once.
"""
from __future__ import annotations

import torch

from rag_fast import reference
from rag_fast._validation import check_loss_inputs
from rag_fast.ops._dispatch import backend, resolve_impl


class RagTokenMarginalFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, doc_scores: torch.Tensor, impl: str) -> torch.Tensor:
        kernels = backend(impl)
        a = torch.log_softmax(doc_scores.detach().float(), dim=1)
        lse, _, _ = kernels.row_stats(logits, None, -100)
        marginal = kernels.token_marginal(logits, a, lse)
        ctx.save_for_backward(logits, doc_scores, a, lse, marginal)
        ctx.impl = impl
        return marginal

    @staticmethod
    def backward(ctx, grad_marginal: torch.Tensor):
        logits, doc_scores, a, lse, marginal = ctx.saved_tensors
        kernels = backend(ctx.impl)
        out = torch.empty_like(logits)
        c = kernels.token_marginal_grad(
            logits, a, lse, marginal, grad_marginal.float().contiguous(), out
        )  # [B, K, T]
        g_scores = None
        if ctx.needs_input_grad[1]:
            scores = doc_scores.detach().requires_grad_()
            with torch.enable_grad():
                a_graph = torch.log_softmax(scores.float(), dim=1)
                (g_scores,) = torch.autograd.grad(a_graph, scores, c.sum(-1))
        return (out if ctx.needs_input_grad[0] else None), g_scores, None


def rag_token_marginal(
    logits: torch.Tensor,
    doc_scores: torch.Tensor,
    n_docs: int | None = None,
    *,
    impl: str = "auto",
) -> torch.Tensor:
    """RAG-Token marginal log-probabilities over passages.

    Args:
        logits: ``[B, K, T, V]`` or ``[B*K, T, V]`` generator logits.
        doc_scores: ``[B, K]`` passage scores (``-inf``: missing passage).
        n_docs: K, optional; checked against ``doc_scores.shape[1]``.
        impl: ``"auto"`` | ``"cpp"`` | ``"triton"`` | ``"torch"`` (the reference).

    Returns:
        ``[B, T, V]`` float32 log-probabilities (float64 for float64 logits under "torch");
        equals ``transformers``' ``RagTokenForGeneration.marginalize``.

    Raises:
        ValueError: bad ranks or shapes, non-floating inputs, tensors on different devices.
    """
    inp = check_loss_inputs(logits, doc_scores, None, n_docs)
    resolved = resolve_impl(impl, inp.logits)
    if resolved == "torch":
        return reference.rag_token_marginal(inp.logits, inp.doc_scores)
    x = inp.logits if inp.logits.stride(-1) == 1 else inp.logits.contiguous()
    return RagTokenMarginalFunction.apply(x, inp.doc_scores, resolved)
