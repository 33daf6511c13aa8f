"""A decoder-only generator's (any ``*ForCausalLM``) answer states for RagModel's training loss.

The layout (a left-padded prompt per (question, passage) continued by the answer, position ids
counting real tokens only) and the generator checks are the decoding adapter's
(:mod:`rag_fast.generation.causal`); here the states of given answers, with the split tied
LM-head weight of a training step.
"""
from __future__ import annotations

import torch
from torch import nn

from rag_fast.generation.causal import answer_inputs, backbone, check_prompts
from rag_fast.models._seq2seq import TiedWeight, call_with_tied


def run_answers(
    generator: nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    answer_ids: torch.Tensor,
    tied: TiedWeight | None = None,
) -> torch.Tensor:
    """States ``[N, T, d]`` of prompts ``[N, S]`` (left-padded) continued by ``answer_ids``
    ``[N, T]`` (row-aligned with the prompts): state t predicts ``answer_ids[:, t]``.
    Answer padding needs no mask: it only follows the real answer tokens. ``tied``: the split
    LM-head weight of a training step (``rag_fast.models._seq2seq.split_tied_weight``), whose
    embedding lookups then give sparse gradients added into the LM head's."""
    S = prompt_ids.shape[1]
    out = call_with_tied(backbone(generator), tied,
                         **answer_inputs(prompt_ids, prompt_mask, answer_ids),
                         use_cache=False, return_dict=True)
    return out.last_hidden_state[:, S - 1:]


def answer_states(
    generator: nn.Module,
    context_input_ids: torch.Tensor,
    context_attention_mask: torch.Tensor,
    answer_ids: torch.Tensor,
    tied: TiedWeight | None = None,
) -> torch.Tensor:
    """Hidden states ``[B*K, T, d]`` (final norm applied: what the LM head reads) of the K
    prompts of each question (``context_input_ids`` ``[B*K, S]``, left-padded, K consecutive
    rows per question) continued by that question's answer ``answer_ids`` ``[B, T]`` (padding:
    any valid id, e.g. ``pad_token_id``). State t predicts ``answer_ids[:, t]``.

    Raises:
        ValueError: shapes that disagree, prompts not left-padded, an empty answer.
    """
    check_prompts(context_input_ids, context_attention_mask)
    if answer_ids.dim() != 2 or answer_ids.shape[1] < 1:
        raise ValueError(f"answer_ids must be [B, T] with T >= 1, got {tuple(answer_ids.shape)}")
    B = answer_ids.shape[0]
    if B == 0:
        raise ValueError("answer_ids (labels) must have B >= 1 rows, got an empty batch")
    if context_input_ids.shape[0] % B:
        raise ValueError(f"context_input_ids has {context_input_ids.shape[0]} rows, not a "
                         f"multiple of the {B} answers")
    K = context_input_ids.shape[0] // B
    return run_answers(generator, context_input_ids, context_attention_mask,
                       answer_ids.repeat_interleave(K, dim=0), tied)


__all__ = ["answer_states", "run_answers"]
