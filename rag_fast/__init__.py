"""rag_fast: fast Retrieval-Augmented Generation (Lewis et al., 2020).

Public API:
    rag_token_nll, rag_sequence_nll, rag_token_marginal   fused losses / marginal (rag_fast.ops)
    reference                                             the paper's math in plain PyTorch
    use_fused_losses                                      switch transformers' RAG models to them
"""
from rag_fast import reference
from rag_fast.integrations import use_fused_losses
from rag_fast.ops import rag_sequence_nll, rag_token_marginal, rag_token_nll
from rag_fast.ops import rag_token_beam_step

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "rag_sequence_nll",
    "rag_token_beam_step",
    "rag_token_marginal",
    "rag_token_nll",
    "reference",
    "use_fused_losses",
]
