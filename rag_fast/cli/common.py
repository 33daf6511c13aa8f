"""What several ``rag-fast`` commands share: the device a ``--device`` names, a model
directory opened for answering, the checks on counts given as options, and how a warning is
said."""
from __future__ import annotations

import sys

from rag_fast.models.inference import check_new_tokens, load_for_inference
from rag_fast.training.trainer import resolve_device


def check_positive(*options: tuple[str, int]) -> None:
    """Each ``(flag, value)`` at least 1, else a ValueError naming the flag."""
    for flag, value in options:
        if value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")


def warn(message: str) -> None:
    """A command's warning: one line on stderr, ``rag-fast: warning: MESSAGE``."""
    print(f"rag-fast: warning: {message}", file=sys.stderr)


def load_model(model_dir: str, index: str | None, device: str | None,
               require_index: bool = True, n_docs: int | None = None):
    """A model directory with its retriever (``--index``, else the one the model records; none
    when the model records none and ``require_index`` is False) on ``--device`` (default: CUDA
    when available), retrieving ``--n-docs`` passages per question (None: the model's
    ``n_docs``), for ``eval`` and ``generate``."""
    device = resolve_device(device, "--device")  # a bad --device fails before the model loads
    return load_for_inference(model_dir, index, device, require_index=require_index,
                              n_docs=n_docs)


__all__ = ["check_new_tokens", "check_positive", "load_model", "resolve_device", "warn"]
