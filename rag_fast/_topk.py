"""The one top-n selection of the decoding searches and the beam-step kernels' fallback
(``rag_fast.reference_decoding.select_top`` is the oracle's own, kept apart)."""
from __future__ import annotations

import torch


def select_top(scores: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``n`` best entries of each row of ``scores [B, N]``: (values, flat indices).

    Sorted by value descending, ties by lower index first (a stable sort; NaN sorts last).
    """
    key = torch.where(torch.isnan(scores), torch.full_like(scores, float("-inf")), scores)
    order = torch.sort(key, dim=1, descending=True, stable=True).indices[:, :n]
    return scores.gather(1, order), order


__all__ = ["select_top"]
