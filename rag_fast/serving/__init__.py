"""Answering over HTTP (``rag-fast serve``) and without it.

:class:`Answerer` holds a loaded model and index and answers lists of questions in batches,
naming the index each answer came from, with the index swapped between batches
(``swap_index``). :class:`Batcher` joins the questions of concurrent requests into those
batches. ``rag_fast.serving.app.create_app`` is the Starlette app ``rag-fast serve`` runs
(importing it needs Starlette and prometheus_client; this package does not).
docs/serving.md describes the routes, the batching and the swap.
"""
from rag_fast.serving.answerer import AnswerSettings, Answerer, Limits, ServedIndex, open_index
from rag_fast.serving.batcher import Batcher, Overloaded

__all__ = ["AnswerSettings", "Answerer", "Batcher", "Limits", "Overloaded", "ServedIndex",
           "open_index"]
