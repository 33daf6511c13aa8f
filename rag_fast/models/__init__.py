"""RagModel over any Hugging Face seq2seq generator and question encoder, and its checkpoints."""
from rag_fast.models.build import build_rag_model
from rag_fast.models.checkpoint import CheckpointError, from_transformers, load_rag_model, save_rag_model
from rag_fast.models.rag_model import (
    Generation,
    RagModel,
    RagOutput,
    Retrieved,
    Retriever,
    join_context,
)
from rag_fast.models.retriever_io import load_retriever

__all__ = [
    "CheckpointError",
    "Generation",
    "RagModel",
    "RagOutput",
    "Retrieved",
    "Retriever",
    "build_rag_model",
    "from_transformers",
    "join_context",
    "load_rag_model",
    "load_retriever",
    "save_rag_model",
]
