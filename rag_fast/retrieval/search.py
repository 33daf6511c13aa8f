"""Searching an index directory for questions: dense (its question encoder and index), BM25
(its ``bm25/`` part, from ``rag-fast index build --bm25``), or both fused (``hybrid``).

What ``rag-fast index search`` and ``rag-fast index eval`` search with
(:func:`open_bundle_search`). ``hybrid`` and ``weighted`` take the best :data:`HYBRID_DEPTH`
passages of each (fewer in a smaller corpus) and rank them by reciprocal rank fusion
(:func:`~rag_fast.retrieval.lexical.reciprocal_rank_fusion`), or by a weighted sum of the
scaled scores with the weight the BM25 part records
(:func:`~rag_fast.retrieval.lexical.weighted_fusion`); their scores are the fused ones.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from rag_fast._defaults import RETRIEVAL_MODES as MODES  # dense, bm25, hybrid, weighted
from rag_fast.retrieval.bundle import load_index_bundle
from rag_fast.retrieval.encoders import Encoder
from rag_fast.retrieval.index import DenseIndex
from rag_fast.retrieval.lexical import HYBRID_DEPTH, BM25Index, fuse, load_part
from rag_fast.retrieval.passages import PassageStore



def check_mode(mode: str, flag: str = "--mode") -> str:
    """``mode`` if one of :data:`MODES`, else a ValueError naming ``flag``."""
    if mode not in MODES:
        raise ValueError(f"{flag} must be one of {', '.join(MODES)}, got {mode!r}")
    return mode


class BundleSearch:
    """An index directory opened to answer questions: its passages (``store``), its dense
    index, the question encoder its manifest records (``encoder``) and its BM25 part (``bm25``,
    None when built without one); ``name``: the directory as given, for messages."""

    def __init__(self, manifest: dict, store: PassageStore, index: DenseIndex, encoder: Encoder,
                 bm25: BM25Index | None = None, name: str = "the index directory"):
        self.manifest, self.store, self.index, self.encoder = manifest, store, index, encoder
        self.bm25, self.name = bm25, name

    def search(self, questions: list[str], k: int, *, mode: str = "dense",
               nprobe: int | None = None, ef_search: int | None = None,
               chunk: int = 1024) -> tuple[np.ndarray, np.ndarray]:
        """``(scores, rows)`` ``[Q, k]`` of ``questions``, best first; a row is -1 where fewer
        than ``k`` were found (its score -inf for dense, 0 for the others). Dense: the
        questions encoded in batches (``chunk`` at a time, each a batch search). ``nprobe``,
        ``ef_search``: the dense index's (its defaults when None).

        Raises:
            ValueError: an unknown ``mode``, bm25/hybrid on a directory without BM25, or (for
                those) ``k`` above the passages held.
        """
        self.check_mode(mode)
        if mode != "dense" and k > len(self.store):
            raise ValueError(f"-k {k} is more passages than {self.name} holds "
                             f"({len(self.store)}); use at most {len(self.store)}")
        if mode == "bm25":
            return self.bm25.search(questions, k)
        if mode == "dense":
            return self._dense(questions, k, nprobe, ef_search, chunk)
        depth = min(max(k, HYBRID_DEPTH), len(self.store))
        dense = self._dense(questions, depth, nprobe, ef_search, chunk)
        return fuse(mode, self.bm25, questions, dense, k)

    def check_mode(self, mode: str) -> None:
        """A ValueError naming ``--mode`` unless this directory can search that way."""
        check_mode(mode)
        if mode != "dense" and self.bm25 is None:
            raise ValueError(f"--mode {mode}: {self.name} has no BM25 part (build it with "
                             "`rag-fast index build --bm25`)")

    def _dense(self, questions, k, nprobe, ef_search, chunk):
        settings = {key: v for key, v in (("nprobe", nprobe), ("ef_search", ef_search))
                    if v is not None}
        scores, rows = [], []
        for start in range(0, len(questions), chunk):
            q = self.encoder.encode_queries(list(questions[start:start + chunk])).numpy()
            found = self.index.search(q, k, **settings)
            scores.append(found[0])
            rows.append(found[1])
        if not rows:
            return np.zeros((0, k), np.float32), np.zeros((0, k), np.int64)
        return np.concatenate(scores), np.concatenate(rows)


def open_bundle_search(directory: str | Path, *, device: str | None = None,
                       verify: bool = True) -> BundleSearch:
    """An index directory with the question encoder its manifest records, on ``device``
    (default: CUDA when available), and its BM25 part if it has one, to search questions with
    (``verify``: every file's SHA-256, else the sizes)."""
    manifest, store, index = load_index_bundle(directory, verify=verify)
    spec = manifest["query_encoder"]
    encoder = Encoder(spec["name"], pooling=spec["pooling"], normalize=spec["normalize"],
                      max_length=spec["max_length"], device=device)
    bm25 = load_part(directory, manifest, len(store), verify=verify)
    return BundleSearch(manifest, store, index, encoder, bm25, name=str(directory))


__all__ = ["HYBRID_DEPTH", "MODES", "BundleSearch", "check_mode", "open_bundle_search"]
