"""Argument checking shared by the reference and every op.

Each check raises ValueError naming the argument and what was expected, so a user sees
"logits must be ..." instead of a shape error from deep inside a kernel.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

REDUCTIONS = ("none", "sum", "mean")
IMPLS = ("auto", "cpp", "triton", "torch")


@dataclass(frozen=True)
class LossInputs:
    """Validated loss inputs in canonical shapes (views, no copies)."""

    logits: torch.Tensor  # [B, K, T, V]
    doc_scores: torch.Tensor  # [B, K]
    targets: torch.Tensor | None  # [B, T] int64, or None for the marginal


def check_impl(impl: str) -> None:
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")


def check_reduction(reduction: str) -> None:
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")


def check_epsilon(epsilon: float) -> None:
    if not isinstance(epsilon, (int, float)) or not 0.0 <= float(epsilon) <= 1.0:
        raise ValueError(f"epsilon must be a float in [0, 1], got {epsilon!r}")


def _as_tensor(name: str, value: object) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def check_loss_inputs(
    logits: torch.Tensor,
    doc_scores: torch.Tensor,
    targets: torch.Tensor | None,
    n_docs: int | None,
    ignore_index: int = -100,
    check_target_values: bool = True,
) -> LossInputs:
    """Validate and reshape RAG loss inputs.

    Args:
        logits: ``[B, K, T, V]`` or ``[B*K, T, V]`` floating generator logits.
        doc_scores: ``[B, K]`` floating passage scores (``-inf`` marks a missing passage).
        targets: ``[B, T]`` integer targets aligned with the logits, or None.
        n_docs: K; required to match ``doc_scores.shape[1]`` when given.
        check_target_values: also check that targets lie in ``[0, V)`` or equal ignore_index
            (reads the targets on the host: one synchronisation on a GPU).

    Returns:
        LossInputs with ``logits`` as a ``[B, K, T, V]`` view and ``targets`` as int64.

    Raises:
        ValueError: naming the offending argument.
    """
    logits = _as_tensor("logits", logits)
    doc_scores = _as_tensor("doc_scores", doc_scores)
    if not logits.is_floating_point():
        raise ValueError(f"logits must be a floating tensor, got dtype {logits.dtype}")
    if not doc_scores.is_floating_point():
        raise ValueError(f"doc_scores must be a floating tensor, got dtype {doc_scores.dtype}")
    if doc_scores.dim() != 2:
        raise ValueError(f"doc_scores must have shape [B, K], got {tuple(doc_scores.shape)}")
    B, K = doc_scores.shape
    if n_docs is not None:
        if not isinstance(n_docs, int) or n_docs < 1:
            raise ValueError(f"n_docs must be a positive int, got {n_docs!r}")
        if n_docs != K:
            raise ValueError(f"n_docs={n_docs} does not match doc_scores.shape[1]={K}")
    if logits.device != doc_scores.device:
        raise ValueError(
            f"doc_scores must be on the logits' device {logits.device}, got {doc_scores.device}"
        )
    if logits.dim() == 3:
        if K == 0 or logits.shape[0] != B * K:
            raise ValueError(
                f"logits.shape[0]={logits.shape[0]} must equal B*K={B}*{K}={B * K}, the "
                f"questions and passages of doc_scores {tuple(doc_scores.shape)}"
            )
        logits = logits.view(B, K, logits.shape[1], logits.shape[2])  # split B*K: always a view
    elif logits.dim() == 4:
        if tuple(logits.shape[:2]) != (B, K):
            raise ValueError(
                f"logits [B, K, T, V] must have B, K = {B}, {K} from doc_scores, "
                f"got {tuple(logits.shape)}"
            )
    else:
        raise ValueError(
            f"logits must have shape [B, K, T, V] or [B*K, T, V], got {tuple(logits.shape)}"
        )
    if logits.shape[-1] < 1:
        raise ValueError("logits must have a vocabulary of at least 1 entry (V >= 1)")
    if K < 1:
        raise ValueError("doc_scores must have at least one passage (K >= 1)")
    T, V = logits.shape[2], logits.shape[3]

    if targets is not None:
        targets = _as_tensor("targets", targets)
        if targets.dtype.is_floating_point or targets.dtype.is_complex or targets.dtype == torch.bool:
            raise ValueError(f"targets must be an integer tensor, got dtype {targets.dtype}")
        if tuple(targets.shape) != (B, T):
            raise ValueError(f"targets must have shape [B, T] = [{B}, {T}], got {tuple(targets.shape)}")
        if targets.device != logits.device:
            raise ValueError(
                f"targets must be on the logits' device {logits.device}, got {targets.device}"
            )
        targets = targets.long()
        if check_target_values and targets.numel():
            bad = (targets != ignore_index) & ((targets < 0) | (targets >= V))
            if bool(bad.any()):
                value = int(targets[bad][0])
                raise ValueError(
                    f"targets must lie in [0, V={V}) or equal ignore_index={ignore_index}, "
                    f"found {value}"
                )
    return LossInputs(logits, doc_scores, targets)


def reduce(loss: torch.Tensor, reduction: str) -> torch.Tensor:
    """Reduce a per-question loss ``[B]``: none -> [B], sum -> [], mean -> [] (sum / B)."""
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.mean()


def generator_positions(config, side: str = "context") -> int | None:
    """The positions a generator's config allows on one ``side``: ``"context"`` (what its
    encoder reads; a decoder-only generator's prompt and answer share its one table) or
    ``"answer"`` (its decoder's). A composite encoder-decoder (``EncoderDecoderModel``) keeps
    one config per side (``config.encoder``, ``config.decoder``). None: no fixed bound (T5's
    relative positions)."""
    sub = getattr(config, "encoder" if side == "context" else "decoder", None)
    if sub is not None and callable(getattr(sub, "to_dict", None)):  # a composite's own config
        config = sub
    for name in ("max_position_embeddings", "n_positions"):
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def check_context_length(context_input_ids: torch.Tensor, max_positions: int | None) -> None:
    """Contexts ``[N, S]`` must fit the generator's position embeddings (S <= max_positions);
    past them a decoder indexes out of its position table."""
    if max_positions is not None and context_input_ids.shape[-1] > max_positions:
        raise ValueError(
            f"context_input_ids have {context_input_ids.shape[-1]} tokens but the generator has "
            f"{max_positions} positions (config.max_position_embeddings); truncate the contexts "
            f"(tokenizer truncation=True, max_length={max_positions}, or RagModel's "
            "max_context_length)")


def check_decoding_scores(doc_scores: torch.Tensor, questions=None) -> None:
    """Passage scores ``[B, K]`` for decoding: finite or ``-inf`` (a missing passage), and at
    least one finite score per question; errors name the question (its text if given)."""
    bad_nan = torch.isnan(doc_scores) | torch.isposinf(doc_scores)
    none_finite = ~torch.isfinite(doc_scores).any(dim=1)
    for b in range(doc_scores.shape[0]):
        if bool(bad_nan[b].any()) or bool(none_finite[b]):
            name = f"question {b}" + (f" ({questions[b]!r})" if questions is not None else "")
            row = [round(float(v), 4) for v in doc_scores[b].tolist()]
            what = ("a NaN or +inf passage score" if bool(bad_nan[b].any())
                    else "no passage with a finite score (all -inf: nothing retrieved)")
            raise ValueError(f"doc_scores: {name} has {what}: {row}")


def not_a_file(path) -> str:
    """Why ``path``, which should be a readable file, is not one: missing, a folder, or not a
    regular file (a device, a pipe)."""
    import os

    if not os.path.exists(path):
        return "no such file"
    if os.path.isdir(path):
        return "is a folder, not a file"
    return "is not a regular file (a device or a pipe?)"


def not_a_folder(path) -> str:
    """Why ``path``, which should be a folder, is not one: missing, a file, or not a regular
    file (a device, a pipe)."""
    import os

    if not os.path.exists(path):
        return "does not exist"
    if os.path.isfile(path):
        return "is a file, not a folder"
    return "is not a folder (a device or a pipe?)"


def out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is an allocation that failed for want of memory: Python's MemoryError,
    torch's CPU allocator ("can't allocate memory") or its CUDA OutOfMemoryError."""
    if isinstance(exc, MemoryError):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and (
        "can't allocate memory" in text or type(exc).__name__ == "OutOfMemoryError")


def brief_error(exc: BaseException, limit: int = 300) -> str:
    """An exception's message on one line (whitespace collapsed), at most ``limit`` characters:
    a library's multi-line or very long message inside one of ours. torch's C++ context
    ("Exception raised from ... frame #0 ...") is left out."""
    text = str(exc).split("Exception raised from ")[0]
    text = " ".join(text.split()) or type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."

