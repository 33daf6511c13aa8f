"""Retriever: question embeddings -> K passages, their exact embeddings and generator inputs.

For B questions it returns the passage ids ``[B, K]``, the exact fp16 passage vectors as
``[B, K, d]`` float32 on the questions' device (so ``doc_scores = q · d`` carries gradient
to the question encoder), and the generator's ``input_ids``/``attention_mask`` ``[B*K, L]``
assembled from pre-tokenised pieces as ``title + " / " + text + " // " + question`` (the
Hugging Face RAG retriever's string), padded to the longest row of the batch.

Modes: ``dense`` (the index's best K), ``bm25`` (the BM25 part's best K sharing a word with the
question, then the dense ranking's best to fill K), ``hybrid`` (reciprocal rank fusion of
both rankings, :data:`~rag_fast.retrieval.lexical.HYBRID_DEPTH` deep) and ``weighted`` (the
same candidates by a weighted sum of their scaled scores, the part's weight). Whatever picks the
passages, the scores and embeddings are the dense ones: the passage prior ``p(z|x)`` stays the
inner product whose gradient reaches the question encoder.

Hot swap: the index, store, BM25 part and tokenised passages form one immutable snapshot that
:meth:`Retriever.swap` replaces with a single reference assignment. Each call reads the
snapshot once, so a search running in another thread sees either the old knowledge or the
new one, never a mix, and never waits for a swap.
"""
from __future__ import annotations

import threading
import warnings
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from rag_fast._defaults import RETRIEVAL_MODES
from rag_fast.retrieval.index import DenseIndex
from rag_fast.retrieval.lexical import HYBRID_DEPTH, BM25Index, fuse
from rag_fast.retrieval.passages import PassageStore, TokenizedPassages, tokenizer_key



def special_tokens(tokenizer) -> tuple[np.ndarray, np.ndarray]:
    """The ids the tokenizer puts before and after a single text (e.g. [CLS] ... [SEP])."""
    probe = "retrieval"
    plain = tokenizer(probe, add_special_tokens=False)["input_ids"]
    full = tokenizer(probe)["input_ids"]
    at = next(i for i in range(len(full) - len(plain) + 1) if full[i : i + len(plain)] == plain)
    return np.asarray(full[:at], np.int64), np.asarray(full[at + len(plain) :], np.int64)


@dataclass(frozen=True)
class _Knowledge:
    index: DenseIndex
    store: PassageStore
    tokens: TokenizedPassages | None
    version: int
    lexical: BM25Index | None = None


@dataclass
class RetrievedPassages:
    """One retrieval for B questions and K passages each.

    ids: ``[B, K]`` int64 store rows (-1: no passage). scores: ``[B, K]`` float32 index scores
    (``-inf`` where missing; no gradient). doc_embeddings: ``[B, K, d]`` float32 exact passage
    vectors (zeros where missing). input_ids, attention_mask: ``[B*K, L]`` int64 generator
    inputs, or None when no questions or tokenizer were given. version: the knowledge snapshot
    that served every field.
    """

    ids: torch.Tensor
    scores: torch.Tensor
    doc_embeddings: torch.Tensor
    input_ids: torch.Tensor | None
    attention_mask: torch.Tensor | None
    version: int


class QuestionCutWarning(UserWarning):
    """Generator contexts too long for ``max_length`` lost the question at their end."""


def _check_mode(mode: str, lexical: BM25Index | None) -> str:
    if mode not in RETRIEVAL_MODES:
        raise ValueError(f"mode must be one of {', '.join(RETRIEVAL_MODES)}, got {mode!r}")
    if mode != "dense" and lexical is None:
        raise ValueError(f"mode {mode!r} needs the index directory's BM25 part (build it with "
                         "`rag-fast index build --bm25`)")
    return mode


def _lexical_rows(lexical: BM25Index, questions: list[str], dense: tuple[np.ndarray, np.ndarray],
                  k: int, mode: str) -> np.ndarray:
    """``[B, k]`` rows of modes ``bm25`` (its hits, then the dense ranking's to fill k),
    ``hybrid`` and ``weighted`` (the dense ranking ``dense``, ``(scores, rows)``, fused with
    BM25's as deep: :func:`~rag_fast.retrieval.lexical.fuse`)."""
    if mode != "bm25":
        return fuse(mode, lexical, questions, dense, k)[1]
    dense = dense[1]
    rows = lexical.search(questions, k)[1]
    for b in range(len(rows)):
        found = [int(r) for r in rows[b] if r >= 0]
        fill = [int(r) for r in dense[b] if r >= 0 and int(r) not in found]
        rows[b, :] = -1
        chosen = (found + fill)[:k]
        rows[b, :len(chosen)] = chosen
    return rows


class Retriever:
    """Retrieve K passages per question from a :class:`DenseIndex` and :class:`PassageStore`.

    Args:
        index, store: the same N passages (index ids are store rows).
        tokenizer: the generator's Hugging Face tokenizer (None: no generator inputs).
        n_docs: K, the passages per question.
        max_length: generator input length cap (tokens, special tokens included).
        title_sep, doc_sep: the separators of ``title + title_sep + text + doc_sep + question``.
        lexical: the BM25 part over the same passages (needed by every mode but ``dense``).
        mode: ``dense``, ``bm25``, ``hybrid`` or ``weighted`` (see the module doc): the default of
            :meth:`retrieve`.
    Raises:
        ValueError: index and store of different sizes, bad ``n_docs``/``max_length``, a
            tokenizer without a pad token, an unknown mode or one without its BM25 part.
    """

    def __init__(self, index: DenseIndex, store: PassageStore, tokenizer=None, *, n_docs: int = 5,
                 max_length: int = 300, title_sep: str = " / ", doc_sep: str = " // ",
                 progress: bool = True, lexical: BM25Index | None = None, mode: str = "dense"):
        if not isinstance(n_docs, int) or isinstance(n_docs, bool) or n_docs < 1:
            raise ValueError(f"n_docs must be a positive int, got {n_docs!r}")
        self.n_docs, self.tokenizer, self.progress = n_docs, tokenizer, progress
        self.mode = _check_mode(mode, lexical)
        self._swap_lock = threading.Lock()
        if tokenizer is not None:
            if tokenizer.pad_token_id is None:
                raise ValueError("tokenizer must have a pad token (set tokenizer.pad_token)")
            self._tokenizer_key = tokenizer_key(tokenizer)
            self._prefix, self._suffix = special_tokens(tokenizer)
            specials = len(self._prefix) + len(self._suffix)
            if not isinstance(max_length, int) or max_length <= specials:
                raise ValueError(f"max_length must be an int > the {specials} special tokens, got {max_length!r}")
            # Stored texts are tokenised with a leading space, so each separator's trailing
            # space belongs to the next piece (as in the joined string).
            self._title_sep = self._encode(title_sep.rstrip())
            self._doc_sep = self._encode(doc_sep.rstrip())
        self.max_length = max_length
        self._warned_cut = False  # QuestionCutWarning said (once per retriever)
        self._state = self._snapshot(index, store, version=0, lexical=lexical)

    def _encode(self, text: str) -> np.ndarray:
        return np.asarray(self.tokenizer(text, add_special_tokens=False)["input_ids"], np.int64)

    def _snapshot(self, index: DenseIndex, store: PassageStore, version: int,
                  lexical: BM25Index | None = None) -> _Knowledge:
        if not isinstance(index, DenseIndex):
            raise ValueError(f"index must be a DenseIndex, got {type(index).__name__}")
        if not isinstance(store, PassageStore):
            raise ValueError(f"store must be a PassageStore, got {type(store).__name__}")
        if len(index) != len(store):
            raise ValueError(f"index has {len(index)} vectors but store has {len(store)} passages; "
                             "they must describe the same passages")
        if lexical is not None and len(lexical) != len(store):
            raise ValueError(f"the BM25 part has {len(lexical)} passages but store has "
                             f"{len(store)}; they must describe the same passages")
        tokens = None
        if self.tokenizer is not None:
            tokens = store.tokenized(self.tokenizer, self.progress, key=self._tokenizer_key)
        return _Knowledge(index, store, tokens, version, lexical)

    # ---- knowledge ------------------------------------------------------------------------
    @property
    def index(self) -> DenseIndex:
        return self._state.index

    @property
    def store(self) -> PassageStore:
        return self._state.store

    @property
    def version(self) -> int:
        return self._state.version

    @property
    def lexical(self) -> BM25Index | None:
        """The BM25 part searched by the modes other than ``dense`` (None without one)."""
        return self._state.lexical

    def swap(self, index: DenseIndex, store: PassageStore, lexical: BM25Index | None = None) -> int:
        """Replace the knowledge (index, store and BM25 part) atomically; returns the new
        version. ``lexical`` None with the current store (an index refresh: the same passages,
        newly encoded) keeps the current BM25 part.

        The new store is tokenised before the swap, so searches never wait. Searches already
        running finish on the old knowledge.

        Raises:
            ValueError: a mismatched pair, a dimension other than the current index's, or no
                BM25 part where the retriever's mode needs one.
        """
        with self._swap_lock:
            if index.dim != self._state.index.dim:
                raise ValueError(f"index dimension {index.dim} differs from the current {self._state.index.dim} "
                                 "(the question encoder would not match)")
            if lexical is None and store is self._state.store:
                lexical = self._state.lexical
            _check_mode(self.mode, lexical)
            state = self._snapshot(index, store, self._state.version + 1, lexical)
            self._state = state  # one reference assignment: the atomic swap
            return state.version

    # ---- retrieval ------------------------------------------------------------------------
    def retrieve(
        self,
        question_embeddings: torch.Tensor,
        questions: Sequence[str] | None = None,
        n_docs: int | None = None,
        mode: str | None = None,
        **search_kwargs,
    ) -> RetrievedPassages:
        """Retrieve for B questions.

        Args:
            question_embeddings: ``[B, d]`` float tensor (any device; not modified, no grad
                needed).
            questions: B question strings for the generator inputs (None: skip them) and the
                BM25 search (every mode but ``dense`` needs them).
            n_docs: K (default: the retriever's).
            mode: ``dense``, ``bm25``, ``hybrid`` or ``weighted`` (default: the retriever's).
            search_kwargs: ``nprobe``, ``ef_search``, ``rerank`` for :meth:`DenseIndex.search`.
        Returns:
            :class:`RetrievedPassages` (see there for shapes and dtypes); its scores are the
            dense inner products whatever the mode.
        Raises:
            ValueError: naming ``question_embeddings``, ``questions``, ``n_docs`` or ``mode``.
        """
        state = self._state  # read once: every field below comes from this snapshot
        mode = _check_mode(self.mode if mode is None else mode, state.lexical)
        if not isinstance(question_embeddings, torch.Tensor):
            raise ValueError("question_embeddings must be a torch.Tensor [B, d], got "
                             f"{type(question_embeddings).__name__}")
        k = self.n_docs if n_docs is None else n_docs
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"n_docs must be a positive int, got {k!r}")
        if question_embeddings.ndim != 2:
            raise ValueError(f"question_embeddings must have shape [B, d], got {tuple(question_embeddings.shape)}")
        if questions is not None:
            if isinstance(questions, str) or len(questions) != question_embeddings.shape[0]:
                raise ValueError(f"questions must be a list of {question_embeddings.shape[0]} strings "
                                 "(one per question embedding)")
        if mode != "dense" and questions is None:
            raise ValueError(f"mode {mode!r} searches the question texts: pass questions= (B "
                             "strings)")
        try:
            scores, ids = state.index.search(question_embeddings.detach(), k if mode == "dense"
                                             else min(len(state.store), max(k, HYBRID_DEPTH)),
                                             **search_kwargs)
        except ValueError as exc:
            raise ValueError(str(exc).replace("queries", "question_embeddings", 1)
                             .replace("k=", "n_docs=", 1)) from None
        device = question_embeddings.device
        ids_np = ids.cpu().numpy()
        if mode != "dense":
            ids_np = _lexical_rows(state.lexical, list(questions),
                                   (scores.float().cpu().numpy(), ids_np), k, mode)
            ids = torch.from_numpy(ids_np).to(ids.device)
        rows = np.where(ids_np >= 0, ids_np, 0).reshape(-1)
        vectors = state.index.embeddings[rows].astype(np.float32)  # [B*K, d]
        vectors[ids_np.reshape(-1) < 0] = 0
        if mode != "dense":  # the dense inner products of the passages picked
            q = question_embeddings.detach().float().cpu().numpy()
            dots = np.einsum("bkd,bd->bk", vectors.reshape(*ids_np.shape, -1), q)
            scores = torch.from_numpy(np.where(ids_np >= 0, dots, -np.inf).astype(np.float32))
            scores = scores.to(ids.device)
        doc_embeddings = torch.from_numpy(vectors).view(*ids_np.shape, -1).to(device)
        input_ids = attention_mask = None
        if questions is not None and state.tokens is not None:
            input_ids, attention_mask = self._generator_inputs(state.tokens, ids_np, questions)
            input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
        return RetrievedPassages(ids, scores, doc_embeddings, input_ids, attention_mask, state.version)

    __call__ = retrieve

    def _generator_inputs(self, tokens: TokenizedPassages, ids: np.ndarray,
                          questions: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """``[B*K, L]`` input ids and attention mask, row ``b*K + k`` = passage k of question b."""
        budget = self.max_length - len(self._prefix) - len(self._suffix)
        encoded = self.tokenizer([" " + q for q in questions], add_special_tokens=False)["input_ids"]
        rows, cut = [], 0
        for b, question in enumerate(encoded):
            question = np.asarray(question, np.int64)
            for row in ids[b]:
                title = tokens.titles[row] if row >= 0 else np.zeros(0, np.int32)
                text = tokens.texts[row] if row >= 0 else np.zeros(0, np.int32)
                content = np.concatenate([title, self._title_sep, text, self._doc_sep, question])
                cut += len(content) > budget  # the end goes: the question, first
                rows.append(np.concatenate([self._prefix, content[:budget].astype(np.int64),
                                            self._suffix]))
        if cut and not self._warned_cut:
            self._warned_cut = True
            warnings.warn(
                f"{cut} of {len(rows)} generator contexts in a batch lost their question, or part "
                f"of it, to max_length {self.max_length}: a context is title, passage, then "
                "question, cut from its end as transformers' RagRetriever cuts it. Give the "
                "generator more room (rag-fast init --max-context-length) or index shorter "
                "passages (said once per retriever)", QuestionCutWarning, stacklevel=3)
        length = max(len(r) for r in rows)
        input_ids = torch.full((len(rows), length), self.tokenizer.pad_token_id, dtype=torch.int64)
        mask = torch.zeros((len(rows), length), dtype=torch.int64)
        left = getattr(self.tokenizer, "padding_side", "right") == "left"
        for i, r in enumerate(rows):
            span = slice(length - len(r), length) if left else slice(0, len(r))
            input_ids[i, span] = torch.from_numpy(r)
            mask[i, span] = 1
        return input_ids, mask
