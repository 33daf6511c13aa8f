"""BM25 over an index directory's passages, and its fusion with dense search.

:class:`BM25Index` scores passages with BM25 (bm25s: Lucene's variant, ``k1 = 1.5``,
``b = 0.75``) over words: lowercased, runs of two or more word characters (the regular
expression ``(?u)\\b\\w\\w+\\b``), English stop words left out, no stemming (so nothing beyond
bm25s and numpy is needed, and a word matches only itself). A passage is read as its title and
its text. Saved as a part of an index directory (``bm25/``): bm25s' arrays and vocabulary,
listed with their sizes and SHA-256 in a sealed ``manifest.json``, checked on load and
memory-mapped.

Fusion (:func:`reciprocal_rank_fusion`, :func:`weighted_fusion`) merges the dense and BM25
rankings of each question into one. Training keeps the passage prior ``p(z|x)`` on the dense
inner product whatever picked the passages: its gradient reaches the question encoder only
through that product.

Shapes: ``Q`` questions, ``k`` passages each; rows are passage store rows (int64), ``-1`` where
fewer than ``k`` were found (BM25 finds only passages sharing a word with the question).
"""
from __future__ import annotations

import contextlib
import io
import os
from pathlib import Path
from typing import Sequence

import numpy as np

from rag_fast._validation import brief_error
from rag_fast.retrieval import factory
from rag_fast.storage import (MANIFEST, StorageError, describe_files, read_manifest,
                              write_manifest)

BM25_KIND = "rag_fast.bm25"
TOKEN_PATTERN = r"(?u)\b\w\w+\b"
K1, B = 1.5, 0.75
RRF_C = 60  # reciprocal rank fusion's constant (Cormack et al., 2009)
DEFAULT_WEIGHT = 0.5  # the weighted fusion's dense weight where none was tuned
WEIGHTS = tuple(i / 20 for i in range(21))  # the weights tune_weight tries: 0, 0.05, ..., 1
TUNE_K = 5  # tune_weight's cut-off: recall@5 of the gold passages
HYBRID_DEPTH = 100  # the candidates each ranking gives the fusion (at least k)
# the peak memory of BM25Index.build per byte of passage text, rounded up from what the hybrid
# bench measures over 14,700 passages of documentation prose (docs/benchmarks.md)
BYTES_PER_CHAR = 6
_FILES = ("data.csc.index.npy", "indices.csc.index.npy", "indptr.csc.index.npy",
          "vocab.index.json", "params.index.json")


def _bm25s():
    import bm25s  # deferred: its import is slow (scipy), and only BM25 search needs it

    return bm25s


def words(texts: Sequence[str]) -> list[list[str]]:
    """Each text as the words BM25 scores (lowercased, stop words out); see the module doc."""
    with contextlib.redirect_stderr(io.StringIO()):  # bm25s' own progress and notes
        return _bm25s().tokenize(list(texts), lower=True, token_pattern=TOKEN_PATTERN,
                                 stopwords="en", stemmer=None, return_ids=False,
                                 show_progress=False)


class BM25Index:
    """BM25 scores over ``N`` passages (build with :meth:`build`, or :meth:`load` a saved one).

    Args:
        model: a ``bm25s.BM25`` indexed over the passages, in store order.
        count: ``N``.
    """

    def __init__(self, model, count: int, fusion: dict | None = None):
        self.model, self.count = model, count
        self.fusion = fusion  # how the weighted fusion's weight was tuned (None: not tuned)

    @property
    def weight(self) -> float:
        """Mode ``weighted``'s dense weight: the one tuned when the part was built
        (:func:`tune_weight`), else :data:`DEFAULT_WEIGHT`."""
        return float(self.fusion["weight"]) if self.fusion else DEFAULT_WEIGHT

    def __len__(self) -> int:
        return self.count

    @classmethod
    def build(cls, titles: Sequence[str], texts: Sequence[str]) -> "BM25Index":
        """Index passages (``titles[i]`` and ``texts[i]`` are passage ``i``'s)."""
        if len(titles) != len(texts):
            raise ValueError(f"titles has {len(titles)} entries and texts {len(texts)}")
        if not texts:
            raise ValueError("no passages to index")
        bm25s = _bm25s()
        model = bm25s.BM25(k1=K1, b=B, method="lucene")
        indexed = words([f"{t} {x}" for t, x in zip(titles, texts)])
        if not any(indexed):
            raise ValueError(f"--bm25: none of the {len(texts):,} passages holds a word BM25 "
                             "indexes (two or more letters or digits, not an English stop "
                             "word)")
        with contextlib.redirect_stderr(io.StringIO()):
            model.index(indexed, show_progress=False)
        return cls(model, len(texts))

    def scores(self, question: str) -> np.ndarray:
        """``[N]`` float32: every passage's BM25 score for ``question`` (0: no word shared)."""
        found = self.model.get_tokens_ids(words([question])[0])
        if not found:
            return np.zeros(self.count, np.float32)
        return np.asarray(self.model.get_scores(found), np.float32)

    def search(self, questions: Sequence[str], k: int) -> tuple[np.ndarray, np.ndarray]:
        """``(scores, rows)``, each ``[Q, k]``: the ``k`` best passages per question, best
        first, ties by row; a row is -1 (its score 0) past the passages sharing a word with
        the question."""
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"k must be a positive int, got {k!r}")
        out_scores = np.zeros((len(questions), k), np.float32)
        out_rows = np.full((len(questions), k), -1, np.int64)
        for q, question in enumerate(questions):
            scores = self.scores(question)
            hits = np.flatnonzero(scores > 0)
            if len(hits) > k:  # the k best, then sorted: score down, row up
                part = np.argpartition(-scores[hits], k - 1)[:k]
                # every row scoring as the k-th best competes for the last places
                hits = hits[scores[hits] >= scores[hits[part]].min()]
            best = hits[np.lexsort((hits, -scores[hits]))][:k]
            out_scores[q, :len(best)], out_rows[q, :len(best)] = scores[best], best
        return out_scores, out_rows

    def save(self, folder: str | os.PathLike) -> None:
        """Write the part into ``folder`` (created; it must not exist): bm25s' files and a
        sealed manifest listing them (with :attr:`fusion`, the tuned weight, when set)."""
        folder = Path(folder)
        folder.mkdir()
        with contextlib.redirect_stderr(io.StringIO()):
            self.model.save(str(folder), show_progress=False)
        written = sorted(p.name for p in folder.iterdir())
        if written != sorted(_FILES):
            raise RuntimeError(f"bm25s wrote {written}, expected {sorted(_FILES)}")
        write_manifest(folder / MANIFEST, {
            "kind": BM25_KIND, "format": 1, "passages": self.count,
            "settings": {"k1": K1, "b": B, "method": "lucene", "token_pattern": TOKEN_PATTERN,
                         "lowercase": True, "stopwords": "en", "stemmer": None},
            **({"fusion": self.fusion} if self.fusion else {}),
            "files": describe_files(folder, list(_FILES))})

    @classmethod
    def load(cls, folder: str | os.PathLike, verify: bool = True,
             expected_count: int | None = None) -> "BM25Index":
        """A saved part, checked against its manifest (``verify``: every file's SHA-256, else
        the sizes) and memory-mapped; ``expected_count``: the passages it must cover."""
        folder = Path(folder)
        manifest = read_manifest(folder, BM25_KIND, verify=verify)
        if sorted(manifest["files"]) != sorted(_FILES):
            raise StorageError(f"{folder / MANIFEST} lists {sorted(manifest['files'])}, "
                               f"expected bm25s' files {sorted(_FILES)}")
        count = manifest.get("passages")
        if type(count) is not int or count < 1 or (expected_count is not None
                                                     and count != expected_count):
            raise StorageError(f"{folder / MANIFEST}: key 'passages' is {count!r}, expected "
                               f"{expected_count or 'a positive int'} (the index directory's "
                               "passages)")
        try:  # (files that passed their checksums, or only their sizes with verify=False)
            with contextlib.redirect_stderr(io.StringIO()):
                model = _bm25s().BM25.load(str(folder), mmap=True, show_progress=False,
                                           override_params={"backend": "numpy"})
        except Exception as e:  # noqa: BLE001  (bm25s' failure on edited files)
            raise StorageError(f"{folder}: its BM25 files do not load ({brief_error(e, 120)}): "
                               "edited or damaged; rebuild the index directory") from None
        fusion = manifest.get("fusion")
        if fusion is not None and not (isinstance(fusion, dict) and _is_weight(
                fusion.get("weight"))):
            raise StorageError(f"{folder / MANIFEST}: key 'fusion' is {fusion!r}, expected an "
                               "object with a 'weight' in [0, 1]")
        if not verify:  # what the checksums would have vouched for
            _check_arrays(folder, model.scores, count)
        columns, vocabulary = len(model.scores["indptr"]) - 1, len(model.vocab_dict)
        if model.scores.get("num_docs") != count or columns not in (vocabulary - 1, vocabulary):
            raise StorageError(f"{folder}: its arrays ({model.scores.get('num_docs')!r} "
                               f"passages, {columns} words) do not match its manifest and "
                               f"vocabulary ({count} passages, {vocabulary} words)")
        return cls(model, count, fusion)


def _is_weight(value: object) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and 0.0 <= value <= 1.0)


BM25_PART = "bm25"  # the part's folder in an index directory
BM25_MANIFEST = f"{BM25_PART}/{MANIFEST}"  # as the index directory's manifest lists it


def check_memory(store, available=None) -> None:
    """Refuse, before any work, a corpus whose BM25 index would not fit in memory: bm25s
    holds every word of every passage at once, about :data:`BYTES_PER_CHAR` bytes per byte of
    text at its peak. ``available``: ``(bytes, where from)`` (default: what the system says,
    :func:`~rag_fast.retrieval.factory.available_memory`; nothing is checked where it says
    nothing).

    Raises:
        ValueError: naming ``--bm25``, the memory needed and what is available.
    """
    found = available if available is not None else factory.available_memory()
    text = int(store.text_lengths().sum())
    need = BYTES_PER_CHAR * text
    if found is not None and need > found[0]:
        raise ValueError(f"--bm25: indexing {len(store):,} passages ({factory._bytes(text)} of "
                         f"text) needs about {factory._bytes(need)} of memory at once (about "
                         f"{BYTES_PER_CHAR} bytes per byte of text), and "
                         f"{factory._bytes(found[0])} is "
                         f"available ({found[1]}): build without --bm25 (dense search only), or "
                         "on a machine with more memory")


def build_part(store, folder: str | os.PathLike, tune=None) -> None:
    """BM25 over a :class:`~rag_fast.retrieval.passages.PassageStore`'s passages, saved as an
    index directory's part in ``folder``; ``tune(part)``, when given, runs before the save
    (to set the part's :attr:`~BM25Index.fusion`, :mod:`~rag_fast.retrieval.weights`)."""
    rows = range(len(store))
    part = BM25Index.build([store.title(i) for i in rows], [store.text(i) for i in rows])
    if tune is not None:
        tune(part)
    part.save(folder)


def load_part(root: str | os.PathLike, manifest: dict, count: int,
              verify: bool = True) -> BM25Index | None:
    """The BM25 part of the index directory ``root`` (whose checked manifest is ``manifest``,
    over ``count`` passages), or None when it was built without one."""
    if BM25_MANIFEST not in manifest["files"]:
        return None
    return BM25Index.load(Path(root) / BM25_PART, verify=verify, expected_count=count)


def _check_arrays(folder: Path, scores: dict, count: int) -> None:
    """bm25s' sparse arrays whole and in range (read once, memory-mapped)."""
    data, indices, indptr = scores["data"], scores["indices"], scores["indptr"]
    fine = (len(indptr) >= 1 and indptr[0] == 0 and int(indptr[-1]) == len(data) == len(indices)
            and bool(np.all(np.diff(indptr) >= 0))
            and (len(indices) == 0 or (int(indices.min()) >= 0 and int(indices.max()) < count))
            and bool(np.all(np.isfinite(data))))
    if not fine:
        raise StorageError(f"{folder}: its BM25 arrays are out of range or inconsistent: edited "
                           "or damaged; rebuild the index directory")


def _ranked(rows: np.ndarray) -> dict[int, int]:
    """{row: rank from 1} of one question's ranking (rows -1 left out)."""
    return {int(r): i + 1 for i, r in enumerate(rows) if r >= 0}


def reciprocal_rank_fusion(rankings: Sequence[np.ndarray], k: int,
                           c: int = RRF_C) -> tuple[np.ndarray, np.ndarray]:
    """``(scores, rows)`` ``[Q, k]``: each question's passages by their fused score ``sum over
    rankings of 1 / (c + rank)`` (rank from 1; a passage missing from a ranking adds nothing),
    ties by the first ranking's rank (a passage it lacks after those it has), then by row;
    rows -1 (scores 0) past the candidates.

    Args:
        rankings: ``[Q, k_i]`` rows each (best first, -1 for none), the dense ranking first.
    """
    first, out = rankings[0], np.full((len(rankings[0]), k), -1, np.int64)
    fused_scores = np.zeros((len(first), k), np.float32)
    for q in range(len(first)):
        ranks = [_ranked(r[q]) for r in rankings]
        fused: dict[int, float] = {}
        for ranked in ranks:
            for row, rank in ranked.items():
                fused[row] = fused.get(row, 0.0) + 1.0 / (c + rank)
        missing = len(first[q]) + 1
        order = sorted(fused, key=lambda row: (-fused[row], ranks[0].get(row, missing), row))
        out[q, :min(k, len(order))] = order[:k]
        fused_scores[q, :min(k, len(order))] = [fused[row] for row in order[:k]]
    return fused_scores, out


def _min_max(scores: np.ndarray, rows: np.ndarray) -> dict[int, float]:
    """{row: score scaled to [0, 1] over this ranking's candidates} (all 1 when equal)."""
    kept = rows >= 0
    if not kept.any():
        return {}
    s = scores[kept].astype(np.float64)
    span = s.max() - s.min()
    scaled = (s - s.min()) / span if span > 0 else np.ones_like(s)
    return {int(r): float(v) for r, v in zip(rows[kept], scaled)}


def weighted_fusion(dense: tuple[np.ndarray, np.ndarray], lexical: tuple[np.ndarray, np.ndarray],
                    k: int, weight: float) -> tuple[np.ndarray, np.ndarray]:
    """``(scores, rows)`` ``[Q, k]``: each question's candidates by their fused score
    ``weight * dense + (1 - weight) * bm25``, each score min-max scaled to [0, 1] over its own
    ranking's candidates (a passage missing from a ranking has 0 there), ties by dense score,
    then row; rows -1 (scores 0) past the candidates.

    Args:
        dense, lexical: ``(scores, rows)`` ``[Q, k_i]`` each, best first, -1 for none.
        weight: in [0, 1]; 1 is dense alone over the candidates, 0 BM25 alone.
    """
    if not 0.0 <= weight <= 1.0:
        raise ValueError(f"weight must be in [0, 1], got {weight!r}")
    out = np.full((len(dense[1]), k), -1, np.int64)
    fused_scores = np.zeros((len(dense[1]), k), np.float32)
    for q in range(len(dense[1])):
        d, b = _min_max(dense[0][q], dense[1][q]), _min_max(lexical[0][q], lexical[1][q])
        fused = {row: weight * d.get(row, 0.0) + (1.0 - weight) * b.get(row, 0.0)
                 for row in d.keys() | b.keys()}
        order = sorted(fused, key=lambda row: (-fused[row], -d.get(row, -1.0), row))
        out[q, :min(k, len(order))] = order[:k]
        fused_scores[q, :min(k, len(order))] = [fused[row] for row in order[:k]]
    return fused_scores, out


def fuse(mode: str, lexical: BM25Index, questions: Sequence[str],
         dense: tuple[np.ndarray, np.ndarray], k: int) -> tuple[np.ndarray, np.ndarray]:
    """``(scores, rows)`` ``[Q, k]`` of mode ``hybrid`` (:func:`reciprocal_rank_fusion`) or
    ``weighted`` (:func:`weighted_fusion` with ``lexical.weight``): the dense ranking
    ``dense`` (``(scores, rows)`` ``[Q, depth]``) fused with BM25's as deep."""
    found = lexical.search(questions, dense[1].shape[1])
    if mode == "hybrid":
        return reciprocal_rank_fusion([dense[1], found[1]], k)
    if mode == "weighted":
        return weighted_fusion(dense, found, k, lexical.weight)
    raise ValueError(f"fuse: mode must be hybrid or weighted, got {mode!r}")


def tune_weight(dense: tuple[np.ndarray, np.ndarray], lexical: tuple[np.ndarray, np.ndarray],
                gold: Sequence[set[int]], k: int = TUNE_K) -> tuple[float, dict[float, float]]:
    """The dense weight of :func:`weighted_fusion` that finds the most gold passages in the
    top ``k`` of questions with known answers, and the recall@k of every weight tried.

    Each of :data:`WEIGHTS` is tried; among the weights of the best recall, the one nearest
    :data:`DEFAULT_WEIGHT` (the lower of two as near) is kept, so that a flat curve (a tuning
    set too small or too easy to tell them apart) keeps an even mix.

    Args:
        dense, lexical: ``(scores, rows)`` ``[Q, depth]`` of each ranking (see
            :func:`weighted_fusion`), ``depth >= k``.
        gold: per question, the rows of its gold passages (a non-empty set each).
    Raises:
        ValueError: no questions, lists of other lengths, or a question without gold rows.
    """
    if not len(gold) or len(gold) != len(dense[1]) or len(gold) != len(lexical[1]):
        raise ValueError(f"tune_weight: {len(gold)} gold sets for {len(dense[1])} dense and "
                         f"{len(lexical[1])} BM25 rankings (at least one question)")
    if not all(gold):
        raise ValueError("tune_weight: every question needs at least one gold passage row")
    recall = {}
    for weight in WEIGHTS:
        rows = weighted_fusion(dense, lexical, k, weight)[1]
        recall[weight] = sum(bool(g & set(r.tolist())) for g, r in zip(gold, rows)) / len(gold)
    best = max(recall.values())
    chosen = min((w for w, r in recall.items() if r == best),
                 key=lambda w: (abs(w - DEFAULT_WEIGHT), w))
    return chosen, recall


__all__ = ["B", "BM25Index", "BM25_KIND", "BM25_MANIFEST", "BM25_PART", "BYTES_PER_CHAR",
           "DEFAULT_WEIGHT", "HYBRID_DEPTH", "K1", "RRF_C", "TOKEN_PATTERN", "TUNE_K", "WEIGHTS",
           "build_part", "check_memory", "fuse", "load_part", "reciprocal_rank_fusion",
           "tune_weight", "weighted_fusion", "words"]
