"""Batches of question-answer examples for RagModel training."""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from rag_fast.evaluation.data import QAExample


def encode_targets(model, texts: Sequence[str]) -> torch.Tensor:
    """Labels ``[B, T]``: ``start + tokens + eos`` per text, padded with the pad token.

    ``start`` is the generator's BOS (or its decoder start token, for T5), matching how
    ``rag_fast.models.decoding`` starts an answer.
    """
    from rag_fast.models.decoding import start_token_id

    tokenizer = model.generator_tokenizer
    if tokenizer is None:
        raise ValueError("the model needs generator_tokenizer= to encode answers")
    start, eos = start_token_id(model), int(model.generator.config.eos_token_id)
    rows = [[start, *tokenizer(t, add_special_tokens=False)["input_ids"], eos] for t in texts]
    labels = torch.full((len(rows), max(map(len, rows))), model.pad_token_id, dtype=torch.long)
    for i, row in enumerate(rows):
        labels[i, :len(row)] = torch.tensor(row)
    return labels


def rag_collate(model) -> Callable[[list[QAExample]], dict]:
    """Collate QAExamples into ``{"questions": [...], "labels": [B, T]}``."""
    def collate(examples: list[QAExample]) -> dict:
        return {"questions": [e.question for e in examples],
                "labels": encode_targets(model, [e.target for e in examples])}

    return collate


def rag_loss(module, batch: dict) -> torch.Tensor:
    """Mean RAG loss of a batch from :func:`rag_collate` (module: a RagModel or its DDP)."""
    device = next(module.parameters()).device
    return module(batch["labels"].to(device), questions=batch["questions"]).loss
