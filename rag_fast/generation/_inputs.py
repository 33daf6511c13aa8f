"""Input checking shared by RAG-Token and RAG-Sequence generation."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from rag_fast._validation import check_context_length, check_decoding_scores, generator_positions
from rag_fast.generation._decoder import check_generator


@dataclass(frozen=True)
class GenerationInputs:
    generator: torch.nn.Module
    generation_config: object  # transformers.GenerationConfig (or None)
    rag_config: object | None  # transformers.RagConfig when a RAG model was given
    context_input_ids: torch.Tensor  # [B*K, S] int64
    context_attention_mask: torch.Tensor  # [B*K, S]
    doc_scores: torch.Tensor  # [B, K]
    B: int
    K: int


def resolve_inputs(
    model: torch.nn.Module,
    context_input_ids: torch.Tensor,
    context_attention_mask: torch.Tensor | None,
    doc_scores: torch.Tensor,
    n_docs: int | None,
    use_generator_config: bool,
) -> GenerationInputs:
    """Accept a ``transformers`` RAG model (``.rag.generator``) or a bare encoder-decoder
    generator (BART, T5, Pegasus, Marian, mBART, ...).

    Raises:
        ValueError: shapes that disagree, non-integer ids, a generator without an encoder,
            contexts longer than the generator's positions, a NaN / +inf passage score or a
            question whose passages all score -inf (named).
    """
    rag = getattr(model, "rag", None)
    generator = rag.generator if rag is not None else model
    check_generator(generator)
    rag_config = model.config if rag is not None else None
    if rag is not None and not use_generator_config:
        gen_config = model.generation_config
    else:
        gen_config = getattr(generator, "generation_config", None)
    if not isinstance(context_input_ids, torch.Tensor) or context_input_ids.dim() != 2:
        raise ValueError("context_input_ids must be a [B*K, S] integer tensor")
    if context_input_ids.dtype.is_floating_point or context_input_ids.dtype == torch.bool:
        raise ValueError(f"context_input_ids must be integer, got {context_input_ids.dtype}")
    if not isinstance(doc_scores, torch.Tensor) or doc_scores.dim() != 2:
        raise ValueError("doc_scores must be a [B, K] floating tensor")
    B, K = doc_scores.shape
    if n_docs is None and rag_config is not None:
        n_docs = rag_config.n_docs
    if n_docs is not None and n_docs != K:
        raise ValueError(f"n_docs={n_docs} does not match doc_scores.shape[1]={K}")
    if context_input_ids.shape[0] != B * K:
        raise ValueError(
            f"context_input_ids has {context_input_ids.shape[0]} rows, expected B*K = {B}*{K}"
        )
    if context_attention_mask is None:
        context_attention_mask = torch.ones_like(context_input_ids)
    if tuple(context_attention_mask.shape) != tuple(context_input_ids.shape):
        raise ValueError("context_attention_mask must have the shape of context_input_ids")
    if doc_scores.dtype.is_floating_point is False:
        raise ValueError(f"doc_scores must be floating point, got {doc_scores.dtype}")
    check_decoding_scores(doc_scores)
    check_context_length(context_input_ids, generator_positions(generator.config, "context"))
    return GenerationInputs(generator, gen_config, rag_config, context_input_ids.long(),
                            context_attention_mask, doc_scores, B, K)


def check_rng(rng) -> None:
    """Raise ValueError unless ``rng`` is None or a ``torch.Generator``."""
    if rng is not None and not isinstance(rng, torch.Generator):
        raise ValueError(
            f"rng must be a torch.Generator (or None for torch's global generator), got "
            f"{type(rng).__name__}"
        )
