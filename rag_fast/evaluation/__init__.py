"""Metrics (EM, F1, BLEU-1, ROUGE-L, label accuracy, retrieval recall@k), datasets, eval loop."""
from rag_fast.evaluation.data import DatasetError, QAExample, load_qa
from rag_fast.evaluation.evaluate import EvalResult, evaluate
from rag_fast.evaluation.metrics import (answer_metrics, bleu1, exact_match, f1, label_accuracy,
                                         normalize_answer, retrieval_recall, rouge_l)

__all__ = [
    "DatasetError", "EvalResult", "QAExample", "answer_metrics", "bleu1", "evaluate",
    "exact_match", "f1", "label_accuracy", "load_qa", "normalize_answer", "retrieval_recall",
    "rouge_l",
]
