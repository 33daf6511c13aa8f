"""RagModel's options: their allowed values, the checks the constructor and ``build_rag_model``
share, and the choices derived from them (the LM-head path of a step, the decoder-only loss's
ignored target)."""
from __future__ import annotations

import numbers
from typing import Any

import numpy as np

from rag_fast._validation import IMPLS

MODES = ("token", "sequence")
POOLINGS = ("auto", "cls", "mean")
LM_HEAD_LOSSES = ("auto", "fused", "materialized")
# lm_head_loss="auto" fuses the LM head into the loss once a step's logits would take this
# many bytes. Below it the materialized path is faster (one LM-head GEMM fewer; measured in
# docs/lm_head_loss.md) for at most this much memory; above it the memory matters more.
FUSED_LOGITS_BYTES = 1 << 30


def lm_head_path(choice: str, logits_bytes: int) -> str:
    """``"fused"`` or ``"materialized"``: what ``lm_head_loss=choice`` runs for a step whose
    logits would take ``logits_bytes``."""
    if choice != "auto":
        return choice
    return "fused" if logits_bytes >= FUSED_LOGITS_BYTES else "materialized"
# The ignored target of a decoder-only generator's loss (its labels may use the pad token as
# the EOS target: see RagModel.prepare_labels).
CAUSAL_IGNORE = -100


def eos_ids(config) -> tuple[int, ...]:
    """The generator config's EOS token ids (none, one, or a list)."""
    eos = getattr(config, "eos_token_id", None)
    if eos is None:
        return ()
    return tuple(int(e) for e in eos) if isinstance(eos, (list, tuple)) else (int(eos),)


def is_int(value: Any) -> bool:
    """An integer (Python's or numpy's), not a bool, a float or a string of digits."""
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def check_arguments(*, mode: str = "token", n_docs: int = 5, question_pooling: str = "auto",
                    lm_head_loss: str = "auto", loss_impl: str = "auto",
                    max_context_length: int = 128, max_question_length: int = 64,
                    epsilon: float = 0.0, exclude_bos: bool = False,
                    normalize_questions: bool = False, lean_activations: bool = True,
                    bos_token_id: int | None = None) -> None:
    """RagModel's checks of its options (the constructor's defaults for those not given), for
    callers that want them before loading any model (``build_rag_model``).

    Raises:
        ValueError: naming the argument (see :class:`RagModel`).
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if not is_int(n_docs) or n_docs < 1:
        raise ValueError(f"n_docs must be a positive int, got {n_docs!r}")
    if question_pooling not in POOLINGS:
        raise ValueError(f"question_pooling must be one of {POOLINGS}, got {question_pooling!r}")
    if lm_head_loss not in LM_HEAD_LOSSES:
        raise ValueError(f"lm_head_loss must be one of {LM_HEAD_LOSSES}, got {lm_head_loss!r}")
    if not isinstance(loss_impl, str) or loss_impl not in IMPLS:
        raise ValueError(f"loss_impl must be one of {IMPLS}, got {loss_impl!r}")
    for name, value in (("max_context_length", max_context_length),
                        ("max_question_length", max_question_length)):
        if not is_int(value) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    # the range the loss ops take (rag_fast._validation.check_epsilon)
    if (not isinstance(epsilon, numbers.Real) or isinstance(epsilon, (bool, np.bool_))
            or not 0.0 <= epsilon <= 1.0):
        raise ValueError(f"epsilon must be a float in [0, 1], got {epsilon!r}")
    for name, value in (("exclude_bos", exclude_bos),
                        ("normalize_questions", normalize_questions),
                        ("lean_activations", lean_activations)):
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be True or False, got {value!r}")
    if bos_token_id is not None and (not is_int(bos_token_id) or bos_token_id < 0):
        raise ValueError(f"bos_token_id must be None or a non-negative int, "
                         f"got {bos_token_id!r}")


__all__ = ["CAUSAL_IGNORE", "FUSED_LOGITS_BYTES", "LM_HEAD_LOSSES", "MODES", "POOLINGS", "check_arguments", "eos_ids", "is_int", "lm_head_path"]
