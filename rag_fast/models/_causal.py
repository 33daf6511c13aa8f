"""The pieces of a Hugging Face decoder-only generator (any ``*ForCausalLM``) that RagModel drives.

For a decoder-only generator the passage and the question are a prompt and the answer continues
it. One row per (question, passage):

    prompt[b, k] = tokens of join_context(title, text, question)     left-padded to S columns
    row[b, k]    = prompt[b, k] ++ answer[b, :T-1]                    S + T - 1 columns
    state[b,k,t] = backbone(row)[S - 1 + t]                           t = 0 .. T-1

so answer position t is predicted from the token before it (the last prompt token for t = 0)
and its target is ``answer[b, t]``. Left padding puts every row's last prompt token in column
S - 1, so the answer positions line up across the K rows. The padding is masked and the
position ids count real tokens only, so a padded row gives the states of the same row unpadded
(checked in tests/test_causal.py against an unpadded fp64 run).

The states are the backbone's last hidden states (its final norm applied): what the LM head
reads. RagModel applies the LM head itself (:func:`lm_head`, a plain linear map); heads that are
not one (final-logit soft-capping, logit scaling) are refused.
"""
from __future__ import annotations

import inspect

import torch
from torch import nn

from rag_fast.models._seq2seq import LMHead, TiedWeight, _call

# Config fields that make the logits a non-linear or rescaled function of the last hidden
# state (RagModel's linear LM head would silently differ from the generator's own logits), with
# the values that leave them a plain linear map: soft-capping off (None or 0), scales of 1.
_NONLINEAR_HEAD_FIELDS = {"final_logit_softcapping": (None, 0, 0.0), "logit_scale": (None, 1, 1.0),
                          "logits_scaling": (None, 1, 1.0),
                          "output_multiplier_scale": (None, 1, 1.0)}


def is_causal(generator: nn.Module) -> bool:
    """Whether ``generator`` is a decoder-only model (its config says not encoder-decoder)."""
    config = getattr(generator, "config", None)
    return config is not None and not getattr(config, "is_encoder_decoder", False)


def backbone(generator: nn.Module) -> nn.Module:
    """The transformer under the LM head (``model`` for Llama/Qwen2/Mistral, ``transformer`` for
    GPT-2), which returns the final-normed hidden states."""
    for name in (getattr(generator, "base_model_prefix", None), "model", "transformer"):
        module = getattr(generator, name, None) if name else None
        if isinstance(module, nn.Module) and module is not generator:
            return module
    raise ValueError(
        f"generator {type(generator).__name__} has no 'model' or 'transformer' backbone: "
        "RagModel drives Hugging Face *ForCausalLM models")


def check_causal(generator: nn.Module) -> None:
    """Raise ValueError unless ``generator`` is a decoder-only LM RagModel can drive: a
    ``*ForCausalLM`` with a backbone, an ``nn.Linear`` LM head, a linear logits map and a
    ``pad_token_id``."""
    config = getattr(generator, "config", None)
    if config is None or getattr(config, "is_encoder_decoder", False):
        raise ValueError(f"generator {type(generator).__name__} is not a decoder-only model "
                         "(config.is_encoder_decoder must be False)")
    if not callable(getattr(generator, "get_output_embeddings", None)):
        raise ValueError(f"generator must be a Hugging Face *ForCausalLM with "
                         f"get_output_embeddings(); got {type(generator).__name__}")
    head = generator.get_output_embeddings()
    if not isinstance(head, nn.Linear):
        raise ValueError(f"generator's output embeddings must be nn.Linear, got "
                         f"{type(head).__name__}")
    body = backbone(generator)
    try:
        accepts = inspect.signature(body.forward).parameters
    except (TypeError, ValueError):  # no introspectable signature: trust the call
        accepts = {"position_ids": None}
    if "position_ids" not in accepts:
        raise ValueError(
            f"generator {type(generator).__name__}'s backbone takes no position_ids: RagModel "
            "left-pads prompts and needs positions that count real tokens only")
    _check_linear_logits(config)
    if getattr(config, "pad_token_id", None) is None:
        raise ValueError(
            "generator.config.pad_token_id is None: a decoder-only generator needs a pad token "
            "to pad prompts and answers; set generator.config.pad_token_id (e.g. to "
            "generator.config.eos_token_id, or the tokenizer's pad_token_id)")


def _check_linear_logits(config) -> None:
    for name, neutral in _NONLINEAR_HEAD_FIELDS.items():
        value = getattr(config, name, None)
        if value not in neutral:
            raise ValueError(
                f"generator config sets {name}={value!r}: its logits are not a plain linear map "
                "of the last hidden state, which RagModel's LM head (and its fused loss) assume")


def lm_head(generator: nn.Module) -> LMHead:
    """The generator's LM head as ``(weight [V, d], bias [V] or None, scale=1.0)``.

    Raises:
        ValueError: a head that is not ``nn.Linear`` or logits that are not linear in the
            hidden state (final-logit soft-capping, logit scaling).
    """
    head = generator.get_output_embeddings()
    if not isinstance(head, nn.Linear):
        raise ValueError(f"generator's output embeddings must be nn.Linear, got "
                         f"{type(head).__name__}")
    _check_linear_logits(generator.config)
    return LMHead(head.weight, head.bias, 1.0)


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions counting real tokens only: ``cumsum(mask) - 1``, 0 on leading padding."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def check_prompts(context_input_ids: torch.Tensor, context_attention_mask: torch.Tensor) -> None:
    """Prompts ``[N, S]`` must be integer ids with a mask of the same shape, left-padded: every
    row's last column a real token."""
    if context_input_ids.dim() != 2:
        raise ValueError(f"context_input_ids must be [B*K, S], got "
                         f"{tuple(context_input_ids.shape)}")
    if context_attention_mask is None or (tuple(context_attention_mask.shape)
                                          != tuple(context_input_ids.shape)):
        raise ValueError("context_attention_mask must have the shape of context_input_ids "
                         f"{tuple(context_input_ids.shape)}")
    if context_input_ids.shape[1] == 0:
        raise ValueError("context_input_ids has no columns: a decoder-only generator needs "
                         "a prompt")
    if not torch.compiler.is_compiling() and not bool(context_attention_mask[:, -1].bool().all()):
        raise ValueError(
            "context_input_ids must be left-padded for a decoder-only generator (the last "
            "column of every row a real token, context_attention_mask 1 there): tokenize with "
            "padding_side='left' (RagModel.build_contexts does)")


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
    N, S = prompt_ids.shape
    T = answer_ids.shape[1]
    ids = torch.cat([prompt_ids, answer_ids[:, : T - 1]], dim=1)
    mask = torch.cat([prompt_mask.to(torch.long),
                      prompt_mask.new_ones((N, T - 1), dtype=torch.long)], dim=1)
    out = _call(backbone(generator), tied, input_ids=ids, attention_mask=mask,
                position_ids=position_ids(mask), use_cache=False, return_dict=True)
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


__all__ = ["answer_states", "backbone", "check_causal", "check_prompts", "is_causal", "lm_head",
           "position_ids", "run_answers"]
