"""Inner products with a fixed order of operations: the exact index preset's per-pair scores
(``rag_fast/retrieval/_exact.py``). Its kernel: ``csrc/inner_products.cpp``; its reference:
``queries @ vectors.T`` up to rounding (tests/test_inner_products.py)."""
from __future__ import annotations

import torch

from rag_fast import _ext


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
        cpp.inner_products(queries, vectors, out)
    return out


class cpp:  # a namespace: the launcher of csrc/inner_products.cpp
    """The C++ launcher, on arguments :func:`inner_products` has checked."""

    @staticmethod
    def inner_products(q: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> None:
        B, d = q.shape
        _ext.get().inner_products(q.data_ptr(), B, q.stride(0), v.data_ptr(), v.shape[0],
                                  v.stride(0), d, out.data_ptr(), out.stride(0))
