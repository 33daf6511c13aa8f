"""Helpers for tests and benchmarks: tiny ``transformers`` RAG models built from configs.

No weights are downloaded: every model has random weights (throughput and the equality of
losses do not depend on them).
"""
from __future__ import annotations

import torch

from rag_fast.integrations.transformers import shift_targets_left  # noqa: F401 (re-export)


def tiny_rag_config(
    vocab_size: int = 50,
    n_docs: int = 3,
    d_model: int = 16,
    layers: int = 1,
    pad_token_id: int = 1,
    bos_token_id: int | None = 0,
    eos_token_id: int = 2,
):
    """A ``RagConfig`` with a tiny DPR question encoder and a tiny BART generator."""
    from transformers import BartConfig, DPRConfig, RagConfig

    q = DPRConfig(vocab_size=99, hidden_size=d_model, num_hidden_layers=1,
                  num_attention_heads=2, intermediate_size=2 * d_model,
                  max_position_embeddings=128)
    g = BartConfig(vocab_size=vocab_size, d_model=d_model, encoder_layers=layers,
                   decoder_layers=layers, encoder_attention_heads=2, decoder_attention_heads=2,
                   encoder_ffn_dim=2 * d_model, decoder_ffn_dim=2 * d_model,
                   max_position_embeddings=128, pad_token_id=pad_token_id,
                   bos_token_id=bos_token_id, eos_token_id=eos_token_id,
                   decoder_start_token_id=eos_token_id, forced_bos_token_id=None,
                   forced_eos_token_id=None)
    return RagConfig.from_question_encoder_generator_configs(q, g, n_docs=n_docs)


def tiny_composite_config(decoder: str = "bert", vocab_size: int = 60, d_model: int = 32,
                          layers: int = 2, pad_token_id: int = 0, eos_token_id: int = 1,
                          decoder_start_token_id: int = 2):
    """An ``EncoderDecoderConfig`` (the BERT2BERT composite) with a tiny BERT encoder and a
    tiny decoder that carries its own LM head: ``"bert"`` (BERT's head: a transform, then a
    Linear), ``"gpt2"`` (a plain Linear, on a narrower decoder, so the encoder's states are
    projected) or ``"roberta"`` (a head rag_fast does not split)."""
    import transformers as tf

    common = dict(vocab_size=vocab_size, num_hidden_layers=layers, num_attention_heads=2,
                  max_position_embeddings=64)
    encoder = tf.BertConfig(hidden_size=d_model, intermediate_size=2 * d_model, **common)
    if decoder == "bert":
        dec = tf.BertConfig(hidden_size=d_model, intermediate_size=2 * d_model, is_decoder=True,
                            add_cross_attention=True, **common)
    elif decoder == "roberta":
        dec = tf.RobertaConfig(hidden_size=d_model, intermediate_size=2 * d_model,
                               is_decoder=True, add_cross_attention=True, pad_token_id=pad_token_id,
                               **{**common, "max_position_embeddings": 66})
    elif decoder == "gpt2":
        dec = tf.GPT2Config(vocab_size=vocab_size, n_embd=d_model - 8, n_layer=layers, n_head=2,
                            n_positions=64, is_decoder=True, add_cross_attention=True,
                            bos_token_id=None, eos_token_id=eos_token_id)
    else:
        raise ValueError(f"decoder must be 'bert', 'gpt2' or 'roberta', got {decoder!r}")
    config = tf.EncoderDecoderConfig.from_encoder_decoder_configs(encoder, dec)
    config.pad_token_id, config.eos_token_id = pad_token_id, eos_token_id
    config.decoder_start_token_id, config.bos_token_id = decoder_start_token_id, None
    return config


def tiny_hf_rag(mode: str, seed: int = 0, **config_kwargs) -> torch.nn.Module:
    """A ``RagTokenForGeneration`` (mode "token") or ``RagSequenceForGeneration`` ("sequence")."""
    from transformers import RagSequenceForGeneration, RagTokenForGeneration

    classes = {"token": RagTokenForGeneration, "sequence": RagSequenceForGeneration}
    if mode not in classes:
        raise ValueError(f"mode must be 'token' or 'sequence', got {mode!r}")
    torch.manual_seed(seed)
    return classes[mode](tiny_rag_config(**config_kwargs)).eval()
