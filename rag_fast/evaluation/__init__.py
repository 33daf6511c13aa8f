"""Metrics (EM, F1, BLEU-1, ROUGE-L, label accuracy, retrieval recall@k), datasets, eval loop,
and retrieval on its own (gold-id and answer-string recall@k of an index: ``retrieval_report``)."""
from rag_fast.evaluation.data import DatasetError, QAExample, load_qa
from rag_fast.evaluation.evaluate import EvalResult, evaluate
from rag_fast.evaluation.metrics import (answer_metrics, bleu1, exact_match, f1, label_accuracy,
                                         match_tokens, normalize_answer, retrieval_recall,
                                         rouge_l)
from rag_fast.evaluation.retrieval import (RetrievalExample, RetrievalReport, load_retrieval_data,
                                           retrieval_report)

__all__ = [
    "DatasetError", "EvalResult", "QAExample", "RetrievalExample", "RetrievalReport",
    "answer_metrics", "bleu1", "evaluate", "exact_match", "f1", "label_accuracy", "load_qa",
    "load_retrieval_data", "match_tokens", "normalize_answer", "retrieval_recall", "retrieval_report", "rouge_l",
]
