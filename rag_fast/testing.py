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


def tiny_hf_rag(mode: str, seed: int = 0, **config_kwargs) -> torch.nn.Module:
    """A ``RagTokenForGeneration`` (mode "token") or ``RagSequenceForGeneration`` ("sequence")."""
    from transformers import RagSequenceForGeneration, RagTokenForGeneration

    classes = {"token": RagTokenForGeneration, "sequence": RagSequenceForGeneration}
    if mode not in classes:
        raise ValueError(f"mode must be 'token' or 'sequence', got {mode!r}")
    torch.manual_seed(seed)
    return classes[mode](tiny_rag_config(**config_kwargs)).eval()
