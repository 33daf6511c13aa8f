"""Switch ``transformers``' RAG models to rag_fast's fused losses in one line.

    import rag_fast
    model = RagTokenForGeneration.from_pretrained(...)
    rag_fast.use_fused_losses(model)        # this model only
    rag_fast.use_fused_losses()             # every RagToken/RagSequence model, class-wide

Afterwards the model's ``get_nll`` (and RAG-Token's ``marginalize``) run through
:func:`rag_fast.rag_token_nll`, :func:`rag_fast.rag_sequence_nll` and
:func:`rag_fast.rag_token_marginal`, with the same arguments, target shift, padding mask and
results as the originals (see rag_fast/reference.py for the one degenerate case where
RAG-Sequence differs: a target whose second position is padding). Gradients flow to the logits
and doc_scores as before, without the ``[B*K, T, V]`` fp32 temporaries.
"""
from __future__ import annotations

import types

import torch

from rag_fast.ops import rag_sequence_nll, rag_token_marginal, rag_token_nll


def shift_targets_left(target: torch.Tensor, pad_token_id: int) -> torch.Tensor:
    """The target alignment ``transformers``' ``get_nll`` uses: drop position 0, pad the end.

    ``get_nll(seq_logits, doc_scores, target)`` equals our losses on
    ``shift_targets_left(target, pad)`` with ``ignore_index=pad``.
    """
    pad = target.new_full((target.shape[0], 1), pad_token_id)
    return torch.cat([target[:, 1:], pad], dim=1)


def _token_get_nll(self, seq_logits, doc_scores, target, reduce_loss=False, epsilon=0.0,
                   n_docs=None):
    pad = self.config.generator.pad_token_id
    return rag_token_nll(
        seq_logits, doc_scores, shift_targets_left(target, pad),
        n_docs=n_docs if n_docs is not None else self.config.n_docs, epsilon=epsilon,
        ignore_index=pad, reduction="sum" if reduce_loss else "none",
    )


def _token_marginalize(self, seq_logits, doc_scores, n_docs=None):
    return rag_token_marginal(
        seq_logits, doc_scores, n_docs if n_docs is not None else self.config.n_docs
    )


def _sequence_get_nll(self, seq_logits, doc_scores, target, reduce_loss=False, epsilon=0.0,
                      exclude_bos_score=False, n_docs=None):
    pad = self.config.generator.pad_token_id
    shifted = shift_targets_left(target, pad)
    bos = self.config.bos_token_id or self.config.generator.bos_token_id
    # Same data-dependent rule as transformers: drop BOS only if every target starts with it,
    # decided on the device (no host read, so no synchronisation or graph break).
    exclude_bos = False
    if exclude_bos_score and bos is not None and shifted.shape[1] > 0:
        exclude_bos = shifted[:, 0].eq(bos).all()
    return rag_sequence_nll(
        seq_logits, doc_scores, shifted,
        n_docs=n_docs if n_docs is not None else self.config.n_docs, epsilon=epsilon,
        ignore_index=pad, exclude_bos=exclude_bos, reduction="sum" if reduce_loss else "none",
    )


def use_fused_losses(model: torch.nn.Module | None = None) -> torch.nn.Module | None:
    """Route a ``transformers`` RAG model's losses through rag_fast.

    Args:
        model: a ``RagTokenForGeneration`` or ``RagSequenceForGeneration`` to patch, or None to
            patch both classes (every instance, existing and future).

    Returns:
        The model (patched in place), or None when patching the classes.

    Raises:
        ValueError: ``model`` is not one of the two RAG generation classes.
    """
    from transformers import RagSequenceForGeneration, RagTokenForGeneration

    if model is None:
        RagTokenForGeneration.get_nll = _token_get_nll
        RagTokenForGeneration.marginalize = _token_marginalize
        RagSequenceForGeneration.get_nll = _sequence_get_nll
        return None
    if isinstance(model, RagTokenForGeneration):
        model.get_nll = types.MethodType(_token_get_nll, model)
        model.marginalize = types.MethodType(_token_marginalize, model)
    elif isinstance(model, RagSequenceForGeneration):
        model.get_nll = types.MethodType(_sequence_get_nll, model)
    else:
        raise ValueError(
            "model must be a transformers RagTokenForGeneration or RagSequenceForGeneration, "
            f"got {type(model).__name__}"
        )
    return model
