"""Fused RAG ops. Each takes ``impl="auto" | "cpp" | "triton" | "torch"``; one rule picks the
backend for every op (``rag_fast/ops/backend.py``).

One home per op family, holding its public function(s), its custom ops
(``torch.ops.rag_fast.*``: CPU, CUDA, fake, autograd) and its C++ launchers:

    rag_losses.py           rag_token_nll, rag_sequence_nll, rag_token_marginal
    linear_rag_nll.py       the LM head fused into the RAG losses (their custom ops, tile by tile)
    rag_token_beam_step.py  rag_token_beam_step
    masks.py                one-bit masks (the lean activations' dropout masks)
    inner_products.py       the exact index's per-pair scores

Importing this package registers the custom ops.
"""
from rag_fast.ops.linear_rag_nll import linear_rag_nll
from rag_fast.ops.rag_losses import rag_sequence_nll, rag_token_marginal, rag_token_nll
from rag_fast.ops.rag_token_beam_step import rag_token_beam_step

__all__ = ["linear_rag_nll", "rag_sequence_nll", "rag_token_beam_step", "rag_token_marginal",
           "rag_token_nll"]
