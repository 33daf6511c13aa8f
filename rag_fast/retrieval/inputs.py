"""What callers hand rag_fast's index, checked and read before faiss sees any of it: ints
(faiss takes search settings as C ints), finite vectors, batches of queries, and corpora given
as arrays, memmaps, tensors or lists of shards (their shape, and their rows as float32).
"""
from __future__ import annotations

import numbers

import numpy as np
import torch

MAX_SETTING = 2**31 - 1  # faiss takes nprobe, efSearch and k as C ints


def check_int(name: str, value: object, low: int = 1, high: int = MAX_SETTING) -> int:
    """``value`` as an int in ``[low, high]``.

    Raises:
        ValueError: naming ``name``, for a non-int (bools included) or an out-of-range value.
    """
    if (isinstance(value, bool) or not isinstance(value, numbers.Integral)
            or not low <= value <= high):
        bound = f" and <= {high}" if high < MAX_SETTING else ""
        raise ValueError(f"{name} must be an int >= {low}{bound}, got {value!r}")
    return int(value)


class NonFiniteError(ValueError):
    """Vectors holding NaN or inf; ``row``: the first such row."""

    def __init__(self, message: str, row: int):
        super().__init__(message)
        self.row = row


def check_finite(name: str, x: np.ndarray, offset: int = 0) -> None:
    """Raise a :class:`NonFiniteError` naming ``name`` and the first row (plus ``offset``)
    with NaN or inf."""
    # The sum is NaN or inf when any entry is (or on overflow): a cheap test, then locate.
    if not np.isfinite(x.sum(dtype=np.float64)) and not np.isfinite(x).all():
        row = int(np.argwhere(~np.isfinite(x))[0][0]) + offset
        raise NonFiniteError(f"{name} contain NaN or inf (row {row})", row)


def check_queries(queries, k, dim: int, ntotal: int) -> np.ndarray | torch.Tensor:
    """``queries`` ``[B, dim]`` (a floating numpy array or tensor, as given) checked for a
    search of ``k`` among ``ntotal`` vectors; a ValueError names what is wrong."""
    if isinstance(queries, torch.Tensor):
        if not queries.is_floating_point():
            raise ValueError(f"queries must be a floating tensor, got dtype {queries.dtype}")
        q = queries.detach()
    elif isinstance(queries, np.ndarray):
        if not np.issubdtype(queries.dtype, np.floating):
            raise ValueError(f"queries must be a floating array, got dtype {queries.dtype}")
        q = queries
    else:
        raise ValueError("queries must be a numpy array or torch tensor [B, d], got "
                         f"{type(queries).__name__}")
    if q.ndim != 2:
        raise ValueError(f"queries must have shape [B, d={dim}], got {tuple(q.shape)}")
    if q.shape[1] != dim:
        raise ValueError(f"queries must have d={dim} columns (the index dimension), "
                         f"got {q.shape[1]}")
    if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 1:
        raise ValueError(f"k must be a positive int, got {k!r}")
    if k > ntotal:
        raise ValueError(f"k={k} must be <= the number of indexed vectors ({ntotal})")
    return q


def corpus_rows(embeddings, start: int, stop: int) -> np.ndarray:
    """Rows ``[start, stop)`` of an array, tensor or list of shards, as float32 numpy."""
    if isinstance(embeddings, (list, tuple)):
        parts, offset = [], 0
        for shard in embeddings:
            lo, hi = max(start - offset, 0), min(stop - offset, len(shard))
            if lo < hi:
                parts.append(corpus_rows(shard, lo, hi))
            offset += len(shard)
        return np.concatenate(parts) if len(parts) != 1 else parts[0]
    chunk = embeddings[start:stop]
    if isinstance(chunk, torch.Tensor):
        chunk = chunk.detach().to("cpu", torch.float32).numpy()
    return np.ascontiguousarray(chunk, dtype=np.float32)


def reads_a_copy(embeddings) -> bool:
    """Whether :func:`corpus_rows` of all the rows copies them (not float32 C-contiguous in RAM)."""
    if isinstance(embeddings, (list, tuple)):
        return len(embeddings) != 1 or reads_a_copy(embeddings[0])
    if isinstance(embeddings, torch.Tensor):
        return (embeddings.dtype != torch.float32 or embeddings.device.type != "cpu"
                or not embeddings.is_contiguous())
    return not (isinstance(embeddings, np.ndarray) and not isinstance(embeddings, np.memmap)
                and embeddings.dtype == np.float32 and embeddings.flags.c_contiguous)


def corpus_shape(embeddings) -> tuple[int, int]:
    """``(N, d)`` of an array, tensor or list of shards of one dimension (else a ValueError)."""
    if isinstance(embeddings, (list, tuple)):
        if not embeddings:
            raise ValueError("embeddings: the corpus is empty (an empty list of shards)")
        shapes = [corpus_shape(s) for s in embeddings]
        if len({d for _, d in shapes}) != 1:
            raise ValueError("embeddings shards must share one dimension, got "
                             f"{[d for _, d in shapes]}")
        return sum(n for n, _ in shapes), shapes[0][1]
    shape = tuple(getattr(embeddings, "shape", ()))
    if len(shape) != 2:
        raise ValueError(f"embeddings must have shape [N, d], got {shape}")
    return int(shape[0]), int(shape[1])
