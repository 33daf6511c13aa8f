"""Defaults the command line's parsers show and the library applies, in a module that imports
nothing heavy: ``rag-fast --help`` builds every command's parser without loading torch."""
from __future__ import annotations

# decoding: beam search with 4 beams, at most 32 new tokens (eval, generate, serve alike)
DEFAULT_BEAMS, DEFAULT_NEW_TOKENS = 4, 32

# `index build --preset`: the named index kinds (rag_fast.retrieval.factory turns each into a
# faiss factory string for the corpus' size); any other value is a faiss factory string
PRESETS = ("exact", "hnsw", "ivfpq")

# `tokenizer fit --vocab-size`: at least the 256 byte values and BART's 5 special tokens
# (rag_fast.tokenization), at most 2**20
MIN_VOCAB_SIZE, MAX_VOCAB_SIZE = 256 + 5, 1 << 20

# `index search|eval --mode`: how passages are found (rag_fast.retrieval.search)
RETRIEVAL_MODES = ("dense", "bm25", "hybrid", "weighted")

__all__ = ["DEFAULT_BEAMS", "DEFAULT_NEW_TOKENS", "MAX_VOCAB_SIZE", "MIN_VOCAB_SIZE", "PRESETS",
           "RETRIEVAL_MODES"]
