"""The evaluation loop: answer questions with a RagModel and score them."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from rag_fast.evaluation.data import QAExample
from rag_fast.evaluation.metrics import answer_metrics, label_accuracy, retrieval_recall


# Greedy decoding: one beam and one answer, RAG-Sequence's thorough rescoring, no sampling and
# no penalties (a model directory's generation config may set them for `rag-fast generate`).
GREEDY = dict(num_beams=1, num_return_sequences=1, min_new_tokens=0, decoding="thorough",
              do_sample=False, repetition_penalty=1.0, no_repeat_ngram_size=0)


@dataclass
class EvalResult:
    """metrics; per question: the predicted answer, the passages retrieved and their scores."""

    metrics: dict
    predictions: list[str]
    passages: list[list]
    doc_scores: list[list[float]]


def evaluate(
    model,
    examples: Sequence[QAExample],
    *,
    batch_size: int = 16,
    max_new_tokens: int = 16,
    progress: bool = False,
    **settings,
) -> EvalResult:
    """Answers of ``model`` (a RagModel with a retriever and tokenizers) on ``examples``.

    Without ``settings``, greedy: ``model.generate`` with one beam, no sampling and no
    penalties whatever the generation config says (:data:`GREEDY`; the quick evaluation a
    training run makes every ``eval_every`` steps). ``settings``: ``model.generate``'s keyword
    arguments instead (``rag-fast eval`` passes those of ``rag-fast generate``, so that both
    give the same answers); ``max_new_tokens`` applies to both.

    ``progress``: a progress bar over the questions (stderr).

    Returns metrics ``em``, ``f1``, ``bleu1``, ``rougeL``, ``recall@K`` (an answer string in one
    of the K retrieved passages) and ``accuracy`` when examples carry labels.

    Raises:
        ValueError: no examples, a model without a generator tokenizer, max_new_tokens < 1.
    """
    if not examples:
        raise ValueError("no examples to evaluate (empty dataset)")
    if model.generator_tokenizer is None:
        raise ValueError("evaluate needs the model's generator_tokenizer (to write the "
                         "contexts and decode the answers)")
    decode = dict(settings or GREEDY, max_new_tokens=max_new_tokens)
    was_training = model.training
    model.eval()
    predictions, passages, scores = [], [], []
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(examples), desc="eval", unit="q", dynamic_ncols=True)
    try:
        with torch.no_grad():
            for start in range(0, len(examples), batch_size):
                batch = examples[start:start + batch_size]
                out = model.generate([e.question for e in batch], **decode)
                predictions += out.texts
                passages += out.passages
                scores += out.doc_scores.float().cpu().tolist()
                if bar is not None:
                    bar.update(len(batch))
    finally:
        model.train(was_training)
        if bar is not None:
            bar.close()
    answers = [list(e.answers) for e in examples]
    metrics = answer_metrics(predictions, answers)
    metrics[f"recall@{model.n_docs}"] = retrieval_recall(passages, answers)
    if all(e.label is not None for e in examples):
        metrics["accuracy"] = label_accuracy(predictions, [e.label for e in examples])
    return EvalResult(metrics, predictions, passages, scores)
