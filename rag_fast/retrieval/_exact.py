"""Exact top-k inner product in torch, on any device: the oracle of every index measurement
and the GPU search where faiss GPU cannot serve. It needs no faiss (a GPU machine may have
none), so it lives apart from :mod:`rag_fast.retrieval.index`."""
from __future__ import annotations

import math

import numpy as np
import torch

from rag_fast.ops.inner_products import inner_products


# Scores held at a time by a per_pair search (queries x vectors of one chunk, float32).
PER_PAIR_SCORE_BYTES = 64 << 20


def exact_search(
    vectors: np.ndarray | torch.Tensor,
    queries: torch.Tensor,
    k: int,
    chunk: int = 16384,
    per_pair: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact top-k inner product in torch, chunked over the vectors (any device).

    Args:
        vectors: ``[N, d]`` (fp16 or fp32; numpy or a tensor on ``queries.device``).
        queries: ``[B, d]`` float tensor.
        per_pair: score with rag_fast's CPU kernel (:func:`inner_products`), whose score of a
            (query, vector) pair does not depend on the other queries or vectors, instead of
            a matrix product, whose rounding may (CPU queries only).
    Returns:
        scores ``[B, k]`` float32 and ids ``[B, k]`` int64, on ``queries.device``.
    """
    q = queries.float()
    if per_pair:
        if q.device.type != "cpu":
            raise ValueError(f"per_pair: the kernel runs on the CPU, queries are on {q.device}")
        q = q.contiguous()
        width = max(1, min(chunk, len(vectors)))
        rows = max(1, PER_PAIR_SCORE_BYTES // (4 * width))  # queries per pass over the vectors
        if q.shape[0] > rows:  # each query's result is its own: blocks of them change nothing
            parts = [exact_search(vectors, q[i : i + rows], k, chunk, per_pair=True)
                     for i in range(0, q.shape[0], rows)]
            return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        buf = torch.empty((q.shape[0], width), dtype=torch.float32)
        if len(vectors) <= chunk and isinstance(vectors, torch.Tensor) \
                and vectors.dtype == torch.float32 and vectors.device.type == "cpu":
            # one block of float32 vectors (a small index): no merging of blocks' results
            s = inner_products(q, vectors, out=buf)
            return s.topk(min(k, s.shape[1]), dim=1)
    best_s = torch.full((q.shape[0], 0), -math.inf, device=q.device)
    best_i = torch.zeros((q.shape[0], 0), dtype=torch.int64, device=q.device)
    for start in range(0, len(vectors), chunk):
        block = vectors[start : start + chunk]
        if isinstance(block, np.ndarray):  # a float32 copy: the vectors may be a read-only map
            block = torch.from_numpy(np.array(block, dtype=np.float32))
        block = block.to(q.device, torch.float32)
        if per_pair:
            s = inner_products(q, block, out=buf[:, : len(block)])
        else:
            s = q @ block.T  # [B, n]
        top_s, top_i = s.topk(min(k, s.shape[1]), dim=1)
        best_s, pos = torch.cat([best_s, top_s], 1).topk(min(k, best_s.shape[1] + top_s.shape[1]), dim=1)
        best_i = torch.cat([best_i, top_i + start], 1).gather(1, pos)
    return best_s, best_i
