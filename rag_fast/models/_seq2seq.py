"""The pieces of a Hugging Face seq2seq generator that RagModel drives itself.

RagModel never asks the generator for its logits: it runs the encoder and the decoder, then
applies the LM head (weight, bias and output scale, read here once per architecture) to the
decoder states of the positions that have a target, and hands those logits to a fused RAG loss
that writes their gradient in place. ``transformers`` keeps the logits, their log-softmax and
the marginalisation's temporaries alive at once; this path keeps one logits-sized buffer.

Supported: every ``*ForConditionalGeneration`` with ``get_encoder``/``get_decoder``/
``get_output_embeddings`` whose logits are ``scale * h @ W^T + bias`` (BART, mBART, Pegasus,
Marian, T5, mT5, ...). ``lm_logits`` is checked against the generator's own forward in the tests.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

_T5_FAMILY = ("t5", "mt5", "umt5", "longt5")


@dataclass(frozen=True)
class LMHead:
    """``logits = (scale * h) @ weight^T + bias``; weight ``[V, d]``, bias ``[V]`` or None."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    scale: float


def check_seq2seq(generator: nn.Module) -> None:
    """Raise ValueError unless ``generator`` is a seq2seq LM RagModel can drive."""
    for name in ("get_encoder", "get_decoder", "get_output_embeddings"):
        if not callable(getattr(generator, name, None)):
            raise ValueError(
                f"generator must be a Hugging Face seq2seq LM (BART, T5, ...) with {name}(); "
                f"got {type(generator).__name__}"
            )
    if not getattr(getattr(generator, "config", None), "is_encoder_decoder", False):
        raise ValueError(f"generator {type(generator).__name__} is not an encoder-decoder model")
    head = generator.get_output_embeddings()
    if not isinstance(head, nn.Linear):
        raise ValueError(f"generator's output embeddings must be nn.Linear, got {type(head).__name__}")


def vocab_size(generator: nn.Module) -> int:
    return int(generator.get_output_embeddings().weight.shape[0])


def lm_head(generator: nn.Module) -> LMHead:
    """The generator's LM head as ``(weight, bias, scale)``."""
    head = generator.get_output_embeddings()
    bias = head.bias
    final_bias = getattr(generator, "final_logits_bias", None)  # BART family: [1, V] buffer
    if final_bias is not None and not final_bias.requires_grad and not bool(final_bias.any()):
        final_bias = None  # all zeros (as BART initialises it): skip a [N, V] pass in the matmul
    if final_bias is not None:
        final_bias = final_bias.reshape(-1)
        bias = final_bias if bias is None else bias + final_bias
    config = generator.config
    scale_outputs = getattr(config, "scale_decoder_outputs", None)
    if scale_outputs is None:  # transformers < 5: T5 scales exactly when embeddings are tied
        scale_outputs = config.model_type in _T5_FAMILY and config.tie_word_embeddings
    scale = float(config.d_model) ** -0.5 if scale_outputs else 1.0
    return LMHead(head.weight, bias, scale)


def encode(generator: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor):
    """Encoder states ``[N, L, d]`` of the contexts ``[N, L]``."""
    out = generator.get_encoder()(input_ids=input_ids, attention_mask=attention_mask,
                                  return_dict=True)
    return out.last_hidden_state


def decode(
    generator: nn.Module,
    decoder_input_ids: torch.Tensor,
    encoder_states: torch.Tensor,
    encoder_mask: torch.Tensor,
) -> torch.Tensor:
    """Decoder states ``[N, T, d]`` (before the LM head's scale)."""
    out = generator.get_decoder()(
        input_ids=decoder_input_ids,
        encoder_hidden_states=encoder_states,
        encoder_attention_mask=encoder_mask,
        use_cache=False,
        return_dict=True,
    )
    return out.last_hidden_state


def lm_logits(head: LMHead, states: torch.Tensor) -> torch.Tensor:
    """``[..., V]`` logits of decoder states ``[..., d]`` (autocast applies to the matmul)."""
    h = states * head.scale if head.scale != 1.0 else states
    return nn.functional.linear(h, head.weight, head.bias)
