"""Exact top-k inner product in torch, on any device: the oracle of every index measurement
and the GPU search where faiss GPU cannot serve. It needs no faiss (a GPU machine may have
none), so it lives apart from :mod:`rag_fast.retrieval.index`."""
from __future__ import annotations

import math

import numpy as np
import torch


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


def inner_products(queries: torch.Tensor, vectors: torch.Tensor,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """``out[b, n] = queries[b] . vectors[n]`` (float32, CPU) by rag_fast's C++ kernel: every
    score by the same sequence of operations (``csrc/inner_products.cpp``), so a pair's score
    is the same bit for bit whatever the other queries and vectors, unlike a BLAS matrix
    product's on some CPUs (its speed against torch's matmul: ``docs/retrieval.md``).

    Args:
        queries: ``[B, d]``; vectors: ``[N, d]``; both float32 on the CPU with rows of
            contiguous elements (any row stride). out: ``[B, N]`` float32, rows contiguous.
    Raises:
        ValueError: naming the argument whose dtype, device, shape or layout is wrong.
        ExtensionUnavailableError: the compiled extension did not load.
    """
    from rag_fast.ops import _cpp

    for name, t in (("queries", queries), ("vectors", vectors)):
        if t.dtype != torch.float32 or t.device.type != "cpu" or t.ndim != 2 or (
                t.shape[1] > 1 and t.stride(1) != 1):
            raise ValueError(f"{name} must be a [rows, d] float32 CPU tensor with contiguous "
                             f"rows, got {tuple(t.shape)} {t.dtype} on {t.device} "
                             f"(strides {t.stride()})")
    B, d = queries.shape
    N = vectors.shape[0]
    if vectors.shape[1] != d:
        raise ValueError(f"vectors must have d={d} columns (the queries'), got {vectors.shape[1]}")
    if out is None:
        out = torch.empty((B, N), dtype=torch.float32)
    elif (out.dtype != torch.float32 or out.device.type != "cpu" or tuple(out.shape) != (B, N)
          or (N > 1 and out.stride(1) != 1) or (B > 1 and out.stride(0) < N)):
        raise ValueError(f"out must be a [{B}, {N}] float32 CPU tensor with contiguous, "
                         f"non-overlapping rows, got {tuple(out.shape)} {out.dtype} on "
                         f"{out.device} (strides {out.stride()})")
    elif B and N and any(out.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
                         for t in (queries, vectors)):
        raise ValueError("out must not share memory with queries or vectors (the kernel reads "
                         "them while it writes out)")
    if B and N:
        _cpp.inner_products(queries, vectors, out)
    return out
