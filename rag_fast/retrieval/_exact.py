"""Exact top-k inner product in torch, on any device: the oracle of every index measurement
and the GPU search where faiss GPU cannot serve. It needs no faiss (a GPU machine may have
none), so it lives apart from :mod:`rag_fast.retrieval.index`."""
from __future__ import annotations

import math

import numpy as np
import torch


def exact_search(
    vectors: np.ndarray | torch.Tensor,
    queries: torch.Tensor,
    k: int,
    chunk: int = 16384,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact top-k inner product in torch, chunked over the vectors (any device).

    Args:
        vectors: ``[N, d]`` (fp16 or fp32; numpy or a tensor on ``queries.device``).
        queries: ``[B, d]`` float tensor.
    Returns:
        scores ``[B, k]`` float32 and ids ``[B, k]`` int64, on ``queries.device``.
    """
    q = queries.float()
    best_s = torch.full((q.shape[0], 0), -math.inf, device=q.device)
    best_i = torch.zeros((q.shape[0], 0), dtype=torch.int64, device=q.device)
    for start in range(0, len(vectors), chunk):
        block = vectors[start : start + chunk]
        if isinstance(block, np.ndarray):  # a float32 copy: the vectors may be a read-only map
            block = torch.from_numpy(np.array(block, dtype=np.float32))
        s = q @ block.to(q.device, torch.float32).T  # [B, chunk]
        top_s, top_i = s.topk(min(k, s.shape[1]), dim=1)
        best_s, pos = torch.cat([best_s, top_s], 1).topk(min(k, best_s.shape[1] + top_s.shape[1]), dim=1)
        best_i = torch.cat([best_i, top_i + start], 1).gather(1, pos)
    return best_s, best_i
