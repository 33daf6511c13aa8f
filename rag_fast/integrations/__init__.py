"""Drop-in integrations with other libraries."""
from rag_fast.integrations.transformers import use_fused_losses

__all__ = ["use_fused_losses"]
