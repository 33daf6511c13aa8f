"""Batches of question-answer examples for RagModel training."""
from __future__ import annotations

import warnings
from typing import Callable, Sequence

import torch

from rag_fast._validation import generator_positions
from rag_fast.evaluation.data import QAExample


class AnswerCutWarning(UserWarning):
    """Training answers were cut to the positions of the generator's decoder."""


def encode_targets(model, texts: Sequence[str]) -> torch.Tensor:
    """Labels ``[B, T]`` of the answer texts, padded with the pad token (seq2seq) or -100
    (decoder-only, whose pad token may be its EOS token, a target).

    Seq2seq generator: ``start + [bos] + tokens + eos`` per text, ``start`` the decoder start
    token every decoded answer starts with (``RagModel.decoder_start_token_id``), ``bos`` the
    model's BOS when it has one that differs from ``start`` (a pretrained BART: start 2, BOS 0,
    as ``transformers`` trains it: the decoder input is the BOS-first target shifted right
    after the start token, and decoding from ``start`` then produces BOS first).
    Decoder-only generator: ``tokens + eos`` (no start token: the labels are the answer ids
    themselves, the first one predicted from the prompt's last token; docs/decoder_only.md).
    With a list of EOS ids the first one ends the answers.

    Raises:
        ValueError: a model without a generator tokenizer, a generator config without
            ``eos_token_id``.
    """
    tokenizer = model.generator_tokenizer
    if tokenizer is None:
        raise ValueError("the model needs generator_tokenizer= to encode answers")
    eos = getattr(model.generator.config, "eos_token_id", None)
    if isinstance(eos, (list, tuple)):
        eos = eos[0] if eos else None
    if eos is None:
        raise ValueError("generator.config.eos_token_id is not set: answers end with EOS")
    eos = int(eos)
    head = model.family.answer_start(model)  # [start (, BOS)], or nothing for decoder-only
    rows = [[*head, *tokenizer(t, add_special_tokens=False)["input_ids"], eos] for t in texts]
    # an encoder-decoder's decoder reads row[:-1]: at most its positions (a decoder-only
    # generator's prompt and answer share them; its length check names both)
    positions = (None if model.family.decoder_only
                 else generator_positions(model.generator.config, "answer"))
    if positions is not None and any(len(row) > positions + 1 for row in rows):
        rows = [row if len(row) <= positions + 1 else [*row[:positions], eos] for row in rows]
        warnings.warn(f"answers longer than the generator's decoder has positions for "
                      f"({positions}) are cut to fit them, their end token kept",
                      AnswerCutWarning, stacklevel=2)
    fill = model.family.label_padding(model.pad_token_id)
    labels = torch.full((len(rows), max(map(len, rows))), fill, dtype=torch.long)
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
