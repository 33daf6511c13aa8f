"""RagModel over any Hugging Face seq2seq generator and question encoder, and its checkpoints."""
from rag_fast.models.build import build_rag_model
from rag_fast.models.checkpoint import ModelDirError, save_rag_model
from rag_fast.models.contexts import Retrieved, RetrieverLike, join_context
from rag_fast.models.rag_model import Generation, RagModel, RagOutput
from rag_fast.models.retriever_io import load_retriever

load_rag_model = RagModel.load  # a model directory, verified (RagModel.load)
from_transformers = RagModel.from_transformers  # a transformers RAG model's weights and options

__all__ = [
    "ModelDirError",
    "Generation",
    "RagModel",
    "RagOutput",
    "Retrieved",
    "RetrieverLike",
    "build_rag_model",
    "from_transformers",
    "join_context",
    "load_rag_model",
    "load_retriever",
    "save_rag_model",
]
