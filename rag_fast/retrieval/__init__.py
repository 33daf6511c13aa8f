"""Retrieval: passage store, encoders, the FAISS index and the retriever (with hot swap).

    PassageStore, Passage, read_passages, split_words   passages on disk (rag_fast.retrieval.passages)
    Encoder, encode_passages, parse_shard              Hugging Face encoders (.encoders)
    DenseIndex, PRESETS, recall_at_k                   FAISS inner-product index (.index, .factory, .tuning)
    exact_search                                       exact top-k in torch, any device, no faiss (._exact)
    Retriever, RetrievedPassages                       ids, exact embeddings, generator inputs (.retriever)
    ShardedIndex, ShardedRetriever, search_exact_ties  one index over a torch.distributed group (.sharded)
    BM25Index, reciprocal_rank_fusion, weighted_fusion BM25 over the passages, fusion (.lexical)
    open_bundle_search, MODES                          an index directory's dense, bm25, hybrid search (.search)
    StorageError                                       a stored directory is corrupt or mismatched
    NoSpaceError                                       a full disk (an OSError, ENOSPC), naming the file

Names are imported on first use, so that ``exact_search`` and the passage store work where
faiss is not installed.
"""
from __future__ import annotations

from rag_fast._lazy import lazy_attributes

_LAZY = {
    "StorageError": "rag_fast.storage",
    "NoSpaceError": "rag_fast.storage",
    "Encoder": "rag_fast.retrieval.encoders",
    "encode_passages": "rag_fast.retrieval.encoders",
    "parse_shard": "rag_fast.retrieval.encoders",
    "PRESETS": "rag_fast.retrieval.factory",
    "DenseIndex": "rag_fast.retrieval.index",
    "recall_at_k": "rag_fast.retrieval.tuning",
    "exact_search": "rag_fast.retrieval._exact",
    "Passage": "rag_fast.retrieval.passages",
    "PassageStore": "rag_fast.retrieval.passages",
    "read_passages": "rag_fast.retrieval.passages",
    "split_words": "rag_fast.retrieval.passages",
    "RetrievedPassages": "rag_fast.retrieval.retriever",
    "Retriever": "rag_fast.retrieval.retriever",
    "ShardedIndex": "rag_fast.retrieval.sharded",
    "ShardedRetriever": "rag_fast.retrieval.sharded",
    "search_exact_ties": "rag_fast.retrieval.sharded",
    "BM25Index": "rag_fast.retrieval.lexical",
    "reciprocal_rank_fusion": "rag_fast.retrieval.lexical",
    "weighted_fusion": "rag_fast.retrieval.lexical",
    "MODES": "rag_fast.retrieval.search",
    "open_bundle_search": "rag_fast.retrieval.search",
}
__all__ = sorted(_LAZY)


__getattr__, __dir__ = lazy_attributes(__name__, _LAZY, globals())
