"""RAG decoding: RAG-Token greedy/beam search, RAG-Sequence thorough and fast decoding."""
from rag_fast.generation._decoder import UnsupportedGeneratorError
from rag_fast.generation.rag_sequence import rag_sequence_generate
from rag_fast.generation.rag_token import rag_token_generate

__all__ = ["UnsupportedGeneratorError", "rag_sequence_generate", "rag_token_generate"]
