"""What a retriever gives RagModel and how passages become generator inputs: the
:class:`Retrieved` record, the retriever protocol, a passage's fields, the ``title / text //
question`` context ``transformers`` builds, and decoded answers."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

@dataclass
class Retrieved:
    """What a retriever returns for B questions.

    passages: B lists of at most K passages (objects with ``title`` and ``text`` attributes, or
        dicts with those keys); a shorter list means fewer passages were found.
    embeddings: ``[B, K, d]`` float passage embeddings (rows past a question's passages are
        ignored), the vectors the index was built from.
    """

    passages: list[list[Any]]
    embeddings: torch.Tensor


class RetrieverLike(Protocol):
    """``rag_fast.retrieval.Retriever`` fits (its RetrievedPassages are adapted)."""

    def retrieve(self, question_embeddings: torch.Tensor, *, n_docs: int) -> Any: ...


def passage_fields(passage: Any) -> tuple[str, str]:
    """``(title, text)`` of a passage object or dict."""
    if isinstance(passage, dict):
        return str(passage.get("title", "")), str(passage["text"])
    return str(getattr(passage, "title", "")), str(passage.text)


def join_context(title: str, text: str, question: str, prefix: str = "") -> str:
    """The generator input for one passage, exactly as ``transformers``' RagRetriever builds it:
    ``title / text // question`` (title without surrounding quotes, double spaces collapsed)."""
    title = title.removeprefix('"').removesuffix('"')
    return (prefix + title + " / " + text + " // " + question).replace("  ", " ")


def decode_answers(tokenizer: Any, sequences: Any) -> list[str]:
    """The answers' text of generated ``sequences`` (ids ``[N, T]``): the tokenizer's own
    decoding with the special tokens (start, end, padding) left out and the surrounding
    whitespace stripped, nothing more. ``transformers``' clean-up of spaces before punctuation
    (``clean_up_tokenization_spaces``, on in some tokenizers' configs) is off: it turns
    "2 . 5" into "2. 5" and "a , b" into "a, b", so an answer the tokenizer gives back exactly
    (a byte-level one, as ``rag-fast tokenizer fit`` makes) would not come back as written."""
    return [t.strip() for t in tokenizer.batch_decode(
        sequences, skip_special_tokens=True, clean_up_tokenization_spaces=False)]


def from_retrieved_passages(retriever: Any, found: Any) -> Retrieved:
    """Adapt ``rag_fast.retrieval.RetrievedPassages`` (store rows ``ids`` ``[B, K]``, -1 where
    missing, and ``doc_embeddings``) to :class:`Retrieved`, reading texts from the retriever's
    store of the same knowledge version (a hot swap in between raises; retry)."""
    if getattr(retriever, "version", found.version) != found.version:
        raise RuntimeError("the retriever's index was swapped during retrieval; retry")
    store = retriever.store
    ids = found.ids.cpu()
    # Retrieved keeps each question's passages first: move missing ones (-1) to the end
    order = torch.sort((ids < 0).to(torch.int8), dim=1, stable=True).indices  # [B, K]
    ids = ids.gather(1, order)
    embeddings = found.doc_embeddings.gather(
        1, order.to(found.doc_embeddings.device)[:, :, None].expand_as(found.doc_embeddings))
    passages = [[store[int(i)] for i in row if int(i) >= 0] for row in ids.tolist()]
    return Retrieved(passages, embeddings)


__all__ = ["Retrieved", "RetrieverLike", "decode_answers", "from_retrieved_passages", "join_context", "passage_fields"]
