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


@dataclass(frozen=True)
class DecoderParts:
    """Where an encoder-decoder generator's decoder states for the LM head come from.

    ``body``: the decoder module whose ``last_hidden_state`` ``[N, T, d]`` is read; ``transform``:
    a module applied to those states before the LM head's ``nn.Linear`` (None: nothing);
    ``project``: a module applied to the encoder's states before the decoder reads them (None:
    nothing). For BART, T5 and the like the body is ``get_decoder()`` and the other two are
    None. A composite (``transformers.EncoderDecoderModel``, the BERT2BERT warm start) has a
    decoder that carries its own LM head: the body is that decoder's base model, the transform
    what its head does before the Linear (BERT's dense layer, activation and layer norm), the
    projection the composite's ``enc_to_dec_proj`` when the two widths differ.
    """

    body: nn.Module
    transform: nn.Module | None = None
    project: nn.Module | None = None


def decoder_parts(generator: nn.Module) -> DecoderParts:
    """:class:`DecoderParts` of ``generator`` (an encoder-decoder LM).

    Raises:
        ValueError: a composite whose decoder's LM head is neither a plain ``nn.Linear`` on
            the decoder's states nor BERT's prediction head (a ``transform`` then the Linear),
            naming the classes.
    """
    decoder = generator.get_decoder()
    head = generator.get_output_embeddings()
    own = getattr(decoder, "get_output_embeddings", None)
    if decoder is generator or not callable(own) or own() is not head:
        return DecoderParts(decoder)
    body = getattr(decoder, "base_model", None)
    parent = head_parent(decoder, head)
    if body is None or body is decoder or parent is None:
        raise ValueError(f"generator {type(generator).__name__}: its decoder "
                         f"{type(decoder).__name__} carries an LM head but no base model to "
                         "read states from; rag_fast cannot drive it")
    transform = None if parent is decoder else getattr(parent, "transform", None)
    if parent is not decoder and not isinstance(transform, nn.Module):
        raise ValueError(
            f"generator {type(generator).__name__}: the LM head of its decoder "
            f"{type(decoder).__name__} ({type(parent).__name__}) is neither a plain Linear nor "
            "BERT's prediction head (a transform, then the Linear); rag_fast cannot split it "
            "into states and a head")
    project = getattr(generator, "enc_to_dec_proj", None)
    return DecoderParts(body, transform, project if isinstance(project, nn.Module) else None)


def head_parent(model: nn.Module, head: nn.Module) -> nn.Module | None:
    """The module that holds ``head`` as a child (``model`` itself for a top-level LM head);
    None when ``head`` is not in ``model``."""
    path = next((name for name, m in model.named_modules() if m is head), None)
    if path is None:
        return None
    return model.get_submodule(path.rpartition(".")[0]) if "." in path else model


def check_decoder_parts(generator: nn.Module) -> None:
    """Raise ValueError unless a composite generator's :class:`DecoderParts` reproduce its
    decoder's own logits (on four tokens, in eval mode, without gradients): the body's states,
    the transform, then the LM head, against the decoder's forward. Nothing is checked for
    BART, T5 and the like (their head reads the decoder's states directly) or on the meta
    device."""
    parts = decoder_parts(generator)
    decoder = generator.get_decoder()
    if parts.body is decoder:
        return
    weight = generator.get_output_embeddings().weight
    if weight.device.type == "meta":
        return
    ids = torch.arange(4, device=weight.device).remainder(weight.shape[0])[None]
    mask = torch.ones_like(ids)
    was_training = generator.training
    generator.eval()
    try:
        with torch.no_grad():
            enc = generator.get_encoder()(input_ids=ids, attention_mask=mask,
                                          return_dict=True).last_hidden_state
            if parts.project is not None:
                enc = parts.project(enc)
            want = decoder(input_ids=ids, encoder_hidden_states=enc, encoder_attention_mask=mask,
                           use_cache=False, return_dict=True).logits
            states = parts.body(input_ids=ids, encoder_hidden_states=enc,
                                encoder_attention_mask=mask, use_cache=False,
                                return_dict=True).last_hidden_state
            if parts.transform is not None:
                states = parts.transform(states)
            got = head_logits(encoder_decoder_lm_head(generator), states)
    finally:
        generator.train(was_training)
    tolerance = 1e-3 if weight.dtype == torch.float32 else 5e-2
    scale = float(want.abs().max()) if want.numel() else 0.0
    if got.shape != want.shape or not torch.allclose(got.float(), want.float(), rtol=tolerance,
                                                     atol=tolerance * max(1.0, scale)):
        raise ValueError(
            f"generator {type(generator).__name__}: its decoder {type(decoder).__name__}'s "
            "logits are not its base model's states through its head's transform and Linear, "
            "which is how rag_fast reads them; rag_fast cannot drive this decoder")


def head_logits(head: LMHead, states: torch.Tensor) -> torch.Tensor:
    """``[..., V]`` logits of decoder states ``[..., d]`` (autocast applies to the matmul)."""
    h = states * head.scale if head.scale != 1.0 else states
    return nn.functional.linear(h, head.weight, head.bias)


__all__ = ["DecoderParts", "LMHead", "check_decoder_parts", "decoder_parts",
           "encoder_decoder_lm_head", "head_logits", "head_parent", "output_scale"]
