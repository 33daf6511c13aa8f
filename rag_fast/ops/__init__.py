"""Fused RAG ops. Each takes ``impl="auto" | "cpp" | "triton" | "torch"``.

Importing this package registers the kernels as PyTorch custom ops, ``torch.ops.rag_fast.*``
(see ``rag_fast/ops/_custom_ops.py``).
"""
from rag_fast.ops import _custom_ops  # noqa: F401
from rag_fast.ops.linear_rag_nll import linear_rag_nll
from rag_fast.ops.rag_sequence_nll import rag_sequence_nll
from rag_fast.ops.rag_token_beam_step import rag_token_beam_step
from rag_fast.ops.rag_token_marginal import rag_token_marginal
from rag_fast.ops.rag_token_nll import rag_token_nll

__all__ = ["linear_rag_nll", "rag_sequence_nll", "rag_token_beam_step", "rag_token_marginal",
           "rag_token_nll"]
