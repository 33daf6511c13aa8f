"""A generator's LM head as RagModel and the decoders apply it: ``logits = (scale * h) @ W^T +
bias``, read once per architecture (shared by decoding, here, and training, in
``rag_fast.models``).

Encoder-decoder generators (BART, mBART, Pegasus, Marian, T5, mT5, ...): the output embedding,
BART-style ``final_logits_bias`` when the generator has one, T5's ``d_model ** -0.5`` output
scale when its forward applies it. Decoder-only generators (``*ForCausalLM``): a plain
``nn.Linear`` (see :func:`rag_fast.generation.causal.decoder_only_lm_head`).
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


def encoder_decoder_lm_head(generator: nn.Module) -> LMHead:
    """An encoder-decoder generator's LM head as ``(weight, bias, scale)``."""
    head = generator.get_output_embeddings()
    bias = head.bias
    final_bias = getattr(generator, "final_logits_bias", None)  # BART family: [1, V] buffer
    if (final_bias is not None and not final_bias.requires_grad
            and not torch.compiler.is_compiling() and not bool(final_bias.any())):
        final_bias = None  # all zeros (as BART initialises it): skip a [N, V] pass in the matmul
    if final_bias is not None:
        final_bias = final_bias.reshape(-1)
        bias = final_bias if bias is None else bias + final_bias
    return LMHead(head.weight, bias, output_scale(generator.config))


def output_scale(config) -> float:
    """The factor the generator's forward applies to the decoder states before its LM head:
    T5's ``d_model ** -0.5`` where the forward applies it, else 1.

    transformers 5 says so in the config (``scale_decoder_outputs``: T5, UMT5); a config without
    it (mT5, the BART family) is not scaled there. Before version 5 the T5 family scaled exactly
    when its input and output embeddings were tied."""
    scale = getattr(config, "scale_decoder_outputs", None)
    if scale is None:
        import transformers

        if int(transformers.__version__.split(".")[0]) >= 5:
            scale = False
        else:
            scale = (getattr(config, "model_type", None) in _T5_FAMILY
                     and getattr(config, "tie_word_embeddings", True))
    return float(config.d_model) ** -0.5 if scale else 1.0


def head_logits(head: LMHead, states: torch.Tensor) -> torch.Tensor:
    """``[..., V]`` logits of decoder states ``[..., d]`` (autocast applies to the matmul)."""
    h = states * head.scale if head.scale != 1.0 else states
    return nn.functional.linear(h, head.weight, head.bias)


__all__ = ["LMHead", "encoder_decoder_lm_head", "head_logits", "output_scale"]
