"""RAG-Token marginal log-probabilities ``M[b,t,v] = logsumexp_k (a + x - L)``.

The output itself is ``[B, T, V]`` float32, so this op is for decoding and inspection; the
losses never materialise it. Trade-off: the forward reads the logits twice (row normalisers,
then the marginal with the K rows of each (b,t) together); the backward reads them twice more
(posterior-weighted sums c = sum_v R * g, then the gradient R * g - P * c) and writes once.
The kernels are ``torch.ops.rag_fast.token_marginal`` and its registered backward,
``token_marginal_grad``; the passage log-prior's gradient ``sum_t c`` flows on to the scores
through an ordinary ``log_softmax``.
"""
from __future__ import annotations

import torch

from rag_fast import reference
from rag_fast._validation import check_loss_inputs
from rag_fast.ops import _custom_ops  # noqa: F401  (registers torch.ops.rag_fast.*)
from rag_fast.ops._dispatch import resolve_impl


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
    a = torch.log_softmax(inp.doc_scores.float(), dim=1)  # [B, K] passage log-prior
    marginal, _ = torch.ops.rag_fast.token_marginal(x, a, resolved)
    return marginal
