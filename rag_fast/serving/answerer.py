"""A loaded model and index answering lists of questions: what ``rag-fast serve`` wraps.

:class:`Answerer` owns one :class:`~rag_fast.models.RagModel` and the index it retrieves from
(a :class:`ServedIndex`). ``answer(questions, settings)`` encodes the questions together,
retrieves their passages in one search and decodes them in one batch (``max_batch`` questions
at most per batch); ``retrieve`` stops after the search. Every record names the index it was
answered from (``"index"``: the checksum of the index's sealed manifest), and a batch reads the
index once, so no answer mixes passages of two indexes.

``swap_index(path)`` loads and verifies another index beside the one serving (its manifest's
checksums, the same encoder and dimension), then replaces it between two batches; the old one
is freed once the batch using it ends. A failed load leaves the old index serving.

Settings that may differ per request (:class:`AnswerSettings`: passages per question, beams,
new tokens, RAG mode) are checked against the :class:`Limits` the owner sets. Questions with
equal settings can share a batch; a question's answer does not depend on the others in its
batch (token-identical to the question asked alone; the passage scores agree to rounding).

Shapes: questions ``B`` strings; each record ``{"question", "answer", "passages": [{"title",
"id", "score", "text"}] * n_docs, "index", "decoding"}``.
"""
from __future__ import annotations

import contextlib
import gc
import hashlib
import math
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from rag_fast._jsonl import lone_surrogate
from rag_fast._stages import StageClock
from rag_fast.evaluation.report import passage_record
from rag_fast.models.checkpoint import resolve_model_dir
from rag_fast.models.inference import (DEFAULT_BEAMS, DEFAULT_NEW_TOKENS, check_new_tokens,
                                       load_for_inference)
from rag_fast.models.retriever_io import (check_same_encoder, load_retriever,
                                          read_bundle_manifest)
from rag_fast.training.trainer import resolve_device
from rag_fast.storage import REFRESHED_KIND, folder_kind

MODES = ("token", "sequence")


@dataclass(frozen=True)
class Limits:
    """What one request may ask for; the server's owner sets them (``rag-fast serve``
    options of the same names)."""

    max_questions: int = 64
    max_question_chars: int = 2000
    max_n_docs: int = 32
    max_beams: int = 8
    max_new_tokens: int = 128


@dataclass(frozen=True)
class AnswerSettings:
    """The settings a batch shares (hashable: requests with equal settings are batched)."""

    n_docs: int
    num_beams: int
    max_new_tokens: int
    mode: str

    def record(self) -> dict:
        """How the answers were decoded, as each record says."""
        out = {"rag_mode": self.mode, "n_docs": self.n_docs, "num_beams": self.num_beams,
               "max_new_tokens": self.max_new_tokens}
        if self.mode == "sequence":
            out["decoding"] = "thorough"
            out["mask_searches"] = True
        return out


@dataclass(frozen=True)
class ServedIndex:
    """An index directory opened for answering: its retriever, and the checksum that names it
    (SHA-256 of its sealed ``manifest.json``, which lists every file's own SHA-256)."""

    path: str
    checksum: str
    retriever: Any
    encoder: dict | None
    size: int


def index_checksum(path: str | Path) -> str:
    """The hex SHA-256 naming an index directory: of its ``manifest.json`` (a bundle from
    ``rag-fast index build``), else of its parts' manifests (``index/`` and ``passages/``)."""
    root = Path(path)
    h = hashlib.sha256()
    names = (["manifest.json"] if (root / "manifest.json").is_file()
             else ["index/manifest.json", "passages/manifest.json"])
    for name in names:
        with open(root / name, "rb") as f:
            h.update(f.read(1 << 24))
    return h.hexdigest()


def open_index(path: str | Path, *, n_docs: int = 1, verify: bool = True,
               expect_encoder: dict | None = None, expect_dim: int | None = None,
               n_docs_from: str | None = None, retrieval_mode: str = "dense",
               bound: bool = False) -> ServedIndex:
    """Open and verify the index directory ``path`` for answering.

    Args:
        expect_encoder: the encoder the serving index records (name, dimension, pooling,
            normalisation); an index built with another is refused.
        expect_dim: the question encoder's output dimension.
        n_docs, n_docs_from: passages per question the index must hold at least, and where
            that number comes from (for the message).
        retrieval_mode: how its retriever picks passages (all but dense need its BM25 part).
        bound: refuse a directory whose parts nothing binds together (neither the manifest of
            `rag-fast index build` nor the marker of a training run's refreshed ``index/``):
            a hot swap, whose index nothing else vouches for.
    Raises:
        FileNotFoundError, ValueError, rag_fast.retrieval.StorageError: not an index
            directory, a file that fails its checksum, another encoder or dimension.
    """
    path = str(path)
    if not Path(path).is_dir():
        raise FileNotFoundError(f"index {path!r} is not a directory (expected an index "
                                "directory from `rag-fast index build`)")
    manifest = read_bundle_manifest(path)
    if bound and manifest is None and folder_kind(path) != REFRESHED_KIND:
        raise ValueError(f"index {path!r} has no manifest.json binding its parts (not a "
                         "directory of `rag-fast index build` or a training run's index/): "
                         "refused for a swap; build it with `rag-fast index build`")
    encoder = manifest.get("encoder") if isinstance(manifest, dict) else None
    check_same_encoder(expect_encoder, encoder, path, "the serving index")
    retriever = load_retriever(path, n_docs=n_docs, verify=verify, n_docs_from=n_docs_from,
                               mode=retrieval_mode, mode_flag="--retrieval-mode")
    dim = retriever.index.dim
    if expect_dim is not None and dim != expect_dim:
        raise ValueError(f"index {path!r} holds {dim}-d vectors, the model's question encoder "
                         f"gives {expect_dim}-d")
    return ServedIndex(path, index_checksum(path), retriever, encoder, len(retriever.index))


def _question_dim(model) -> int | None:
    config = getattr(getattr(model, "question_encoder", None), "config", None)
    dim = getattr(config, "hidden_size", None)
    return dim if isinstance(dim, int) else None


def _free_memory() -> None:
    """Return what the old index held to the system (glibc keeps freed heap otherwise)."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)


class Answerer:
    """A model and its index answering lists of questions (see the module docstring).

    Thread-safe: batches run one at a time (a lock); ``swap_index`` may be called from any
    thread while batches run.

    Args:
        model: a RagModel with a question encoder and a generator tokenizer.
        index: the ServedIndex to answer from (:func:`open_index`).
        max_batch: questions decoded together at most.
        limits: what a request may ask for.
    """

    def __init__(self, model, index: ServedIndex, *, max_batch: int = 16,
                 limits: Limits = Limits()) -> None:
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"max_batch must be an integer >= 1, got {max_batch!r}")
        if model.generator_tokenizer is None:
            raise ValueError("the model has no generator tokenizer: answers need one")
        self.model = model
        # a request's defaults, read once: a batch sets the model's n_docs and mode to its own
        # settings while it runs, which a request checked meanwhile must not take for them
        self.n_docs, self.mode = int(model.n_docs), model.mode
        self.max_batch = max_batch
        self.limits = limits
        self._index = index
        self._batch_lock = threading.Lock()
        self._swap_lock = threading.Lock()
        self.swaps = 0

    @classmethod
    def load(cls, model_dir: str, index: str | None = None, *, device: str | None = None,
             verify: bool = True, retrieval_mode: str = "dense", **kwargs) -> "Answerer":
        """An Answerer over the model directory ``model_dir`` (a training run's folder too)
        and ``index`` (default: the index the model records), on ``device`` (default: CUDA
        when available), picking passages by ``retrieval_mode`` (``dense``, ``bm25``,
        ``hybrid``, ``weighted``; an index swapped in must then have a BM25 part too).
        ``kwargs`` go to the constructor."""
        model_dir = resolve_model_dir(model_dir)
        model = load_for_inference(model_dir, index, resolve_device(device, "--device"),
                                   retrieval_mode=retrieval_mode)
        served = ServedIndex(model.index_path, index_checksum(model.index_path), model.retriever,
                             (read_bundle_manifest(model.index_path) or {}).get("encoder"),
                             len(model.retriever.index))
        return cls(model, served, **kwargs)

    # ---------------------------------------------------------------------- settings
    @property
    def index(self) -> ServedIndex:
        """The index answering now."""
        return self._index

    def settings(self, n_docs: int | None = None, num_beams: int | None = None,
                 max_new_tokens: int | None = None, mode: str | None = None) -> AnswerSettings:
        """Checked settings, the defaults filled in (the model's ``n_docs`` and mode, 4 beams,
        32 new tokens, as ``rag-fast generate``; a server limited below those defaults to its
        limits, so that a request that names none is answered).

        Raises:
            ValueError: a value of the wrong type or past the limits, naming the field.
        """
        lim = self.limits
        n_docs = self.n_docs if n_docs is None else n_docs
        top = min(lim.max_n_docs, self._index.size)
        values = {"n_docs": (n_docs, top, "passages"),
                  "num_beams": (min(DEFAULT_BEAMS, lim.max_beams) if num_beams is None
                                else num_beams, lim.max_beams, "beams"),
                  "max_new_tokens": (min(DEFAULT_NEW_TOKENS, lim.max_new_tokens)
                                     if max_new_tokens is None else max_new_tokens,
                                     lim.max_new_tokens, "new tokens")}
        for name, (value, bound, what) in values.items():
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name} must be an integer, got {type(value).__name__}")
            if not 1 <= value <= bound:
                shown = str(value) if abs(value) < 10**12 else f"{str(value)[:12]}... (a number " \
                    f"of {len(str(abs(value)))} digits)"
                raise ValueError(f"{name} must be in [1, {bound}] (the server's limit on "
                                 f"{what}), got {shown}")
        mode = self.mode if mode is None else mode
        if mode not in MODES:
            raise ValueError(f"mode must be 'token' or 'sequence', got {str(mode)[:40]!r}")
        out = AnswerSettings(values["n_docs"][0], values["num_beams"][0],
                             values["max_new_tokens"][0], mode)
        check_new_tokens(self.model, out.max_new_tokens, flag="max_new_tokens")
        return out

    def check_questions(self, questions: Sequence[str]) -> list[str]:
        """The questions as a list, each a non-empty string within the limits.

        Raises:
            ValueError: naming the question at fault.
        """
        if isinstance(questions, str):
            questions = [questions]
        questions = list(questions)
        lim = self.limits
        if not questions:
            raise ValueError("question: give at least one question")
        if len(questions) > lim.max_questions:
            raise ValueError(f"question: at most {lim.max_questions} questions per request "
                             f"(the server's limit), got {len(questions)}")
        for i, q in enumerate(questions):
            if not isinstance(q, str) or not q.strip():
                raise ValueError(f"question[{i}]: expected a non-empty string")
            bad = lone_surrogate(q)
            if bad is not None:
                raise ValueError(f"question[{i}]: not valid Unicode: a lone surrogate "
                                 f"\\u{ord(bad[2]):04x} at character {bad[1] + 1}")
            if len(q) > lim.max_question_chars:
                raise ValueError(f"question[{i}]: {len(q)} characters, more than the server's "
                                 f"limit of {lim.max_question_chars}")
        return questions

    # ---------------------------------------------------------------------- answering
    def answer(self, questions: Sequence[str], settings: AnswerSettings | None = None, *,
               on_stage: Callable[[str, float], None] | None = None) -> list[dict]:
        """One record per question, in order (``max_batch`` questions per batch).
        ``on_stage(stage, seconds)`` hears how long each stage took (``encode``,
        ``retrieve``, ``contexts``, ``decode``)."""
        questions = self.check_questions(questions)
        settings = settings or self.settings()
        out: list[dict] = []
        for start in range(0, len(questions), self.max_batch):
            out.extend(self._batch(questions[start:start + self.max_batch], settings, True,
                                   on_stage))
        return out

    def retrieve(self, questions: Sequence[str], n_docs: int | None = None, *,
                 on_stage: Callable[[str, float], None] | None = None) -> list[dict]:
        """Passages only: one ``{"question", "passages", "index"}`` per question."""
        questions = self.check_questions(questions)
        settings = self.settings(n_docs=n_docs)
        out: list[dict] = []
        for start in range(0, len(questions), self.max_batch):
            out.extend(self._batch(questions[start:start + self.max_batch], settings, False,
                                   on_stage))
        return out

    def run_batch(self, questions: list[str], settings: AnswerSettings, decode: bool,
                  on_stage: Callable[[str, float], None] | None = None) -> list[dict]:
        """One batch of checked questions (at most ``max_batch``): what the server's worker
        calls for the questions of several requests."""
        return self._batch(questions, settings, decode, on_stage)

    def _batch(self, questions, settings, decode, on_stage) -> list[dict]:
        model = self.model
        with self._batch_lock:
            served = self._index  # read once: the whole batch answers from this index
            if settings.n_docs > served.size:
                raise ValueError(f"n_docs must be at most {served.size}, the passages of the "
                                 f"index now serving, got {settings.n_docs}")
            saved = (model.n_docs, model.mode)
            model.retriever = served.retriever  # (the old index is not kept alive through it)
            model.n_docs, model.mode = settings.n_docs, settings.mode
            try:
                return self._answer_batch(questions, settings, decode, served, on_stage)
            finally:
                model.n_docs, model.mode = saved

    def _answer_batch(self, questions, settings, decode, served, on_stage) -> list[dict]:
        model = self.model
        clock = StageClock(on_stage)
        with torch.no_grad():
            q_inputs = model.tokenize_questions(questions)
            q = model.encode_questions(q_inputs["input_ids"], q_inputs["attention_mask"])
            clock.lap("encode")
            found = model.retrieve(q, questions)
            passages = [list(p) for p in found.passages]
            doc_scores = model.score_passages(q, passages, found.embeddings)
            clock.lap("retrieve")
            texts = None
            if decode:
                ctx = model.build_contexts(questions, passages)
                clock.lap("contexts")
                kwargs: dict = dict(num_beams=settings.num_beams,
                                    max_new_tokens=settings.max_new_tokens)
                if settings.mode == "sequence":
                    # searches that mask the contexts' padding: an answer independent of the
                    # questions batched with it (transformers attends to the padding)
                    kwargs.update(decoding="thorough", mask_searches=True)
                result = model.generate(questions, context_input_ids=ctx["input_ids"],
                                        context_attention_mask=ctx["attention_mask"],
                                        doc_scores=doc_scores, **kwargs)
                texts = result.texts
                clock.lap("decode")
        records = []
        decoding = settings.record() if decode else None
        for i, question in enumerate(questions):
            row: dict = {"question": question}
            if decode:
                row["answer"] = texts[i]
            row["passages"] = [passage_record(p, s) for p, s in
                               zip(passages[i], doc_scores[i].tolist()) if math.isfinite(s)]
            row["index"] = served.checksum
            if decode:
                row["decoding"] = decoding
            records.append(row)
        return records

    # ---------------------------------------------------------------------- the index
    def swap_index(self, path: str | Path, *, verify: bool = True) -> ServedIndex:
        """Load and verify the index directory ``path`` beside the one serving, then answer
        from it from the next batch on. Returns the new ServedIndex. One swap at a time.

        Raises:
            RuntimeError: another swap is loading.
            FileNotFoundError, ValueError, rag_fast.retrieval.StorageError: the new index
                cannot serve (the old one keeps serving).
        """
        if not self._swap_lock.acquire(blocking=False):
            raise RuntimeError("another index is loading; try again once it has swapped")
        try:
            old = self._index
            # as at start-up: an index holding fewer passages than the model's n_docs (the
            # default of every request) is refused, not served to fail each such request
            new = open_index(path, n_docs=self.n_docs, n_docs_from="the served model",
                             verify=verify, expect_encoder=old.encoder,
                             expect_dim=_question_dim(self.model) or old.retriever.index.dim,
                             retrieval_mode=getattr(old.retriever, "mode", "dense"),
                             bound=True)
            with self._batch_lock:  # between two batches
                self._index = new
                self.model.retriever = new.retriever
                self.model.index_path = new.path
                self.swaps += 1
            del old
            _free_memory()
            return new
        finally:
            self._swap_lock.release()

    def describe(self) -> dict:
        """What is serving: the model, the index (path, checksum, passages), the limits."""
        return {"index": {"path": self._index.path, "checksum": self._index.checksum,
                          "passages": self._index.size},
                "mode": self.mode, "n_docs": self.n_docs,
                "retrieval_mode": getattr(self.model.retriever, "mode", "dense"),
                "family": self.model.family.name, "max_batch": self.max_batch,
                "limits": asdict(self.limits), "swaps": self.swaps}


__all__ = ["AnswerSettings", "Answerer", "Limits", "ServedIndex", "index_checksum", "open_index"]
