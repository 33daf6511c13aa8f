"""Answer metrics: exact match and F1 (SQuAD v1.1's answer normalisation), BLEU-1 (sacrebleu),
ROUGE-L (rouge-score), label accuracy, and retrieval recall@k.

Every metric takes predictions and, per example, a list of acceptable answers; an example's
score is its best over the answers (as in SQuAD and the RAG paper). Corpus values are means over
examples, in [0, 1] (BLEU-1 and ROUGE-L included).
"""
from __future__ import annotations

import re
import string
import unicodedata
from collections import Counter
from typing import Any, Sequence

# SQuAD v1.1's answer normalisation: its punctuation is exactly string.punctuation (ASCII),
# its articles the whole words a, an, the (\b as Python's re reads it on str: Unicode words)
_DROP_PUNCTUATION = str.maketrans("", "", string.punctuation)
_ARTICLE_WORDS = re.compile(r"\b(?:a|an|the)\b")
# answer matching's tokens: runs of letters and digits, and every other visible character alone
_MATCH_TOKEN = re.compile(r"[^\W_]+|[^\w\s]|_")


def normalize_answer(text: str) -> str:
    """An answer as SQuAD v1.1's official evaluation script (``evaluate-v1.1.py``) compares
    it, in its order: lower case (``str.lower``); every character of ``string.punctuation``
    (ASCII punctuation) removed, not replaced by a space, so "a.b" becomes "ab" and
    "Saint-Étienne" "saintétienne"; the words "a", "an" and "the" removed where they stand as
    whole words; runs of whitespace collapsed to one space, none at either end.

    Exact match compares these strings; F1 counts the words they split into at whitespace.
    (Punctuation is dropped with ``str.translate``, about twice as fast on prose as a loop
    over characters: ``index eval`` normalises a whole corpus.)
    """
    without_articles = _ARTICLE_WORDS.sub(" ", text.lower().translate(_DROP_PUNCTUATION))
    return " ".join(without_articles.split())


def _check_pairs(predictions: Sequence[str], answers: Sequence[Sequence[str]]) -> None:
    if len(predictions) != len(answers):
        raise ValueError(f"{len(predictions)} predictions for {len(answers)} examples")
    if not predictions:
        raise ValueError("no examples to score (empty dataset)")
    for i, a in enumerate(answers):
        if isinstance(a, str) or not len(a):
            raise ValueError(f"example {i}: answers must be a non-empty list of strings")


def exact_match_one(prediction: str, answers: Sequence[str]) -> float:
    """1.0 when the normalised prediction (:func:`normalize_answer`) equals a normalised
    answer, else 0.0."""
    p = normalize_answer(prediction)
    return float(any(p == normalize_answer(a) for a in answers))


def f1_one(prediction: str, answers: Sequence[str]) -> float:
    """The best token F1 over the answers: the normalised strings (:func:`normalize_answer`)
    split at whitespace, the tokens they share counted with multiplicity, F1 = 2PR / (P + R),
    as SQuAD's script. A side that normalises to nothing scores 1.0 against another such side
    and 0.0 otherwise (SQuAD v2.0's rule; v1.1's script gives 0.0 even when both are empty,
    where exact match gives 1.0)."""
    def f1(pred_tokens: list[str], gold_tokens: list[str]) -> float:
        if not pred_tokens or not gold_tokens:
            return float(pred_tokens == gold_tokens)
        common = sum((Counter(pred_tokens) & Counter(gold_tokens)).values())
        if common == 0:
            return 0.0
        precision, recall = common / len(pred_tokens), common / len(gold_tokens)
        return 2 * precision * recall / (precision + recall)

    pred = normalize_answer(prediction).split()
    return max(f1(pred, normalize_answer(a).split()) for a in answers)


def exact_match(predictions: Sequence[str], answers: Sequence[Sequence[str]]) -> float:
    """Mean exact match after normalisation."""
    _check_pairs(predictions, answers)
    return sum(exact_match_one(p, a) for p, a in zip(predictions, answers)) / len(predictions)


def f1(predictions: Sequence[str], answers: Sequence[Sequence[str]]) -> float:
    """Mean token F1 after normalisation."""
    _check_pairs(predictions, answers)
    return sum(f1_one(p, a) for p, a in zip(predictions, answers)) / len(predictions)


def bleu1(predictions: Sequence[str], answers: Sequence[Sequence[str]]) -> float:
    """Mean sentence BLEU-1 (unigram precision with brevity penalty, sacrebleu), best answer."""
    _check_pairs(predictions, answers)
    import sacrebleu

    metric = sacrebleu.BLEU(max_ngram_order=1, effective_order=True)
    total = 0.0
    for p, refs in zip(predictions, answers):
        total += max(metric.sentence_score(p, [r]).score for r in refs) / 100.0
    return total / len(predictions)


# ROUGE-L's longest common subsequence costs time and memory in the product of the two token
# counts (rouge-score keeps the whole table), so each side is scored on its first
# ROUGE_MAX_TOKENS tokens: 4 Mi table cells at most, about a second and some 100 MB per pair.
# Answers and generated text are far shorter; a longer one is said once per call.
ROUGE_MAX_TOKENS = 2048


class RougeCutWarning(UserWarning):
    """ROUGE-L scored only the first :data:`ROUGE_MAX_TOKENS` tokens of some texts."""


def _rouge_bounded(tokenizer, text: str) -> tuple[str, bool]:
    """``text`` as rouge-score reads it, cut to its first :data:`ROUGE_MAX_TOKENS` tokens (the
    tokens joined by spaces, which rouge-score's tokenizer reads back unchanged), and whether
    the cut left any out. A text of at most ``ROUGE_MAX_TOKENS`` characters is returned as is
    (it cannot hold more tokens)."""
    if len(text) <= ROUGE_MAX_TOKENS:
        return text, False
    tokens = tokenizer.tokenize(text)
    if len(tokens) <= ROUGE_MAX_TOKENS:
        return text, False
    return " ".join(tokens[:ROUGE_MAX_TOKENS]), True


def rouge_l(predictions: Sequence[str], answers: Sequence[Sequence[str]]) -> float:
    """Mean ROUGE-L F-measure (rouge-score), best answer. Each text is scored on its first
    :data:`ROUGE_MAX_TOKENS` tokens (rouge-score's tokens; a ``RougeCutWarning`` says how many
    texts were longer), which bounds the cost of a pair whatever the texts' lengths."""
    _check_pairs(predictions, answers)
    import warnings

    from rouge_score import rouge_scorer, tokenizers

    tokenizer = tokenizers.DefaultTokenizer(use_stemmer=False)
    scorer = rouge_scorer.RougeScorer(["rougeL"], tokenizer=tokenizer)
    total, cut = 0.0, 0
    for p, refs in zip(predictions, answers):
        p, p_cut = _rouge_bounded(tokenizer, p)
        best = 0.0
        for r in refs:
            r, r_cut = _rouge_bounded(tokenizer, r)
            cut += r_cut
            best = max(best, scorer.score(r, p)["rougeL"].fmeasure)
        total += best
        cut += p_cut
    if cut:
        warnings.warn(f"ROUGE-L scored the first {ROUGE_MAX_TOKENS:,} tokens of {cut:,} "
                      f"text{'' if cut == 1 else 's'} longer than that (its cost grows with the "
                      "product of two texts' lengths; rag_fast.evaluation.metrics."
                      "ROUGE_MAX_TOKENS)", RougeCutWarning, stacklevel=2)
    return total / len(predictions)


def label_accuracy(predictions: Sequence[str], labels: Sequence[str]) -> float:
    """Accuracy for classification-style targets (labels compared after normalisation)."""
    if len(predictions) != len(labels):
        raise ValueError(f"{len(predictions)} predictions for {len(labels)} labels")
    if not predictions:
        raise ValueError("no examples to score (empty dataset)")
    hits = sum(normalize_answer(p) == normalize_answer(l) for p, l in zip(predictions, labels))
    return hits / len(predictions)


def passage_text(passage: Any) -> str:
    if isinstance(passage, str):
        return passage
    if isinstance(passage, dict):
        return f"{passage.get('title', '')} {passage['text']}"
    return f"{getattr(passage, 'title', '')} {passage.text}"


def match_tokens(text: str) -> str:
    """Text as answer matching reads it, the tokens joined by single spaces: Unicode NFC, lower
    case, then runs of letters and digits, and every other character that is not a space on
    its own (the way DPR's ``has_answer`` tokenizes). Punctuation so separates words instead
    of gluing them: ``">>> R.dup_gcd(x)"`` is ``"> > > r . dup _ gcd ( x )"``, where
    SQuAD's normalisation (:func:`normalize_answer`) would give ``"rdupgcdx"``."""
    return " ".join(_MATCH_TOKEN.findall(unicodedata.normalize("NFC", text).lower()))


def answer_in_passage(passage: Any, answers: Sequence[str]) -> bool:
    """Does an answer's token sequence (:func:`match_tokens`) occur in the passage's (title and
    text), as consecutive whole tokens? "5" is not found in "15" nor "France" in
    "Francesca", but "dup_gcd" is in "R.dup_gcd(x)" and "2.5 million" in "2.5 million km"."""
    text = f" {match_tokens(passage_text(passage))} "
    return any(f" {tokens} " in text for tokens in map(match_tokens, answers) if tokens)


def retrieval_recall(
    passages: Sequence[Sequence[Any]], answers: Sequence[Sequence[str]], k: int | None = None
) -> float:
    """Fraction of questions with an answer string in one of their top-``k`` passages.

    Args:
        passages: per question, retrieved passages best first (str, dict or objects with
            ``title``/``text``).
        answers: per question, a non-empty list of answer strings.
        k: how many passages count (None: all).
    """
    if k is not None and k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if len(passages) != len(answers):
        raise ValueError(f"retrieved passages for {len(passages)} questions, answers for "
                         f"{len(answers)}")
    if not passages:
        raise ValueError("no examples to score (empty dataset)")
    hits = sum(any(answer_in_passage(p, a) for p in found[:k]) for found, a in zip(passages, answers))
    return hits / len(passages)


def answer_metrics(predictions: Sequence[str], answers: Sequence[Sequence[str]]) -> dict:
    """``{"em", "f1", "bleu1", "rougeL"}`` for generated answers."""
    return {"em": exact_match(predictions, answers), "f1": f1(predictions, answers),
            "bleu1": bleu1(predictions, answers), "rougeL": rouge_l(predictions, answers)}
