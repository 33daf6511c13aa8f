"""Retrieval: passage store, encoders, the FAISS index and the retriever (with hot swap).

    PassageStore, Passage, read_passages, split_words   passages on disk (rag_fast.retrieval.passages)
    Encoder, encode_passages, parse_shard              Hugging Face encoders (.encoders)
    DenseIndex, PRESETS, exact_search, recall_at_k     FAISS inner-product index (.index)
    Retriever, RetrievedPassages                       ids, exact embeddings, generator inputs (.retriever)
    StorageError                                       a stored directory is corrupt or mismatched
"""
from rag_fast.retrieval._files import StorageError
from rag_fast.retrieval.encoders import Encoder, encode_passages, parse_shard
from rag_fast.retrieval.index import PRESETS, DenseIndex, exact_search, recall_at_k
from rag_fast.retrieval.passages import Passage, PassageStore, read_passages, split_words
from rag_fast.retrieval.retriever import RetrievedPassages, Retriever

__all__ = [
    "PRESETS",
    "DenseIndex",
    "Encoder",
    "Passage",
    "PassageStore",
    "RetrievedPassages",
    "Retriever",
    "StorageError",
    "encode_passages",
    "exact_search",
    "parse_shard",
    "read_passages",
    "recall_at_k",
    "split_words",
]
