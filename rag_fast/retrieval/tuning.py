"""Tuning statistics of rag_fast's index: recall@k, the confidence a search setting must show
on a sample of queries (and the fewest queries that can show it), and the sweep over an
index's search settings that :meth:`~rag_fast.retrieval.index.DenseIndex.tune` and
:meth:`~rag_fast.retrieval.index.DenseIndex.measure` run, as functions taking the index.
"""
from __future__ import annotations

import math
import numbers
import time
import warnings
from typing import Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

from rag_fast.retrieval._exact import exact_search
from rag_fast.retrieval.inputs import check_finite, check_int, check_queries

# Re-rank factors :meth:`DenseIndex.tune` tries. Up to 64: on real text (14,708 documentation
# passages embedded with all-MiniLM-L6-v2, the index bench's corpus) the ivfpq preset's 4-bit
# PQ ranks near-duplicate passages too coarsely for the true top 5 to survive among 160
# candidates: with factors up to 16 no setting reached recall@10 and same top 5 of 0.95 even
# probing every list (0.941 / 0.865 at nprobe = nlist = 128), with 64 nprobe 64 does (0.988 /
# 0.959 on held-out queries, 0.034 ms per query against 0.108 for exact search).
RERANK_FACTORS = (1, 2, 4, 8, 16, 32, 64)


def recall_at_k(found: np.ndarray, truth: np.ndarray) -> float:
    """Mean over queries of ``|found_i ∩ truth_i| / k`` (``[Q, k]`` int ids each)."""
    found, truth = np.asarray(found), np.asarray(truth)
    hits = sum(len(set(f[f >= 0].tolist()) & set(t.tolist())) for f, t in zip(found, truth))
    return hits / truth.size


def _reaches(per_query: tuple[np.ndarray, ...], target: float) -> bool:
    """Whether each per-query measure's mean reaches ``target`` with 95% confidence: its
    one-sided lower bound, mean - 1.645 * std / sqrt(n), is >= ``target`` (so a setting that
    only just passes on this sample of queries is not chosen over one that surely does).

    This normal approximation says nothing on a small sample whose queries all match exact
    search (its std is 0, its bound the mean, 1): :func:`min_tuning_queries` is the sample
    below which that 95% cannot hold, and :meth:`DenseIndex.tune` warns below it."""
    return all(v.mean() - 1.645 * v.std() / math.sqrt(len(v)) >= target for v in per_query)


TUNING_CONFIDENCE = 0.95  # the confidence _reaches asks of a setting


class SmallSampleWarning(UserWarning):
    """Too few tuning queries to show the target at the tuner's confidence (see
    :func:`min_tuning_queries`)."""


def min_tuning_queries(target: float, confidence: float = TUNING_CONFIDENCE) -> int | None:
    """The fewest queries on which search quality ``target`` can be shown with ``confidence``:
    the smallest Q whose exact one-sided (Clopper-Pearson) lower bound with all Q queries
    matching exact search, ``(1 - confidence) ** (1 / Q)``, reaches ``target``. With fewer,
    not even a perfect result shows the target (27 queries: 0.895 at most, short of 0.95,
    which needs 59). None for ``target`` 1, which no finite sample shows."""
    if not 0.0 < target <= 1.0 or not 0.0 < confidence < 1.0:
        raise ValueError(f"target must be in (0, 1] and confidence in (0, 1), got {target!r}, "
                         f"{confidence!r}")
    if target >= 1.0:
        return None
    alpha = 1.0 - confidence
    q = max(1, math.ceil(math.log(alpha) / math.log(target)))
    while alpha ** (1.0 / q) < target:  # the float log ratio may land one off either way
        q += 1
    while q > 1 and alpha ** (1.0 / (q - 1)) >= target:
        q -= 1
    return q


def small_sample_message(count: int, target: float, name: str = "queries") -> str | None:
    """One line when ``count`` tuning queries are fewer than :func:`min_tuning_queries`
    needs for ``target`` (naming ``name``: the argument or flag that gave them), else None."""
    need = min_tuning_queries(float(target))
    if need is None or count >= need:
        return None
    bound = (1.0 - TUNING_CONFIDENCE) ** (1.0 / max(1, count))
    return (f"{name}: {count} queries are too few to show recall and same top 5 >= {target} "
            f"with {TUNING_CONFIDENCE:.0%} confidence (even if all {count} matched exact search, "
            f"the exact one-sided lower bound would be {bound:.3f}); give at least {need} "
            "queries for this target, or the tuned settings may fall short of it on new ones")


def _leave_out(ids: np.ndarray, own: np.ndarray, k: int) -> np.ndarray:
    """``[Q, k]``: each row of ``ids`` ``[Q, k + 1]`` without the query's own id ``own[i]``
    (or without its last entry when the own id is not there)."""
    keep = ids != own[:, None]
    keep[keep.all(1), -1] = False
    return ids[keep].reshape(len(ids), k)


def _time_ms(fn, repeats: int = 3) -> float:
    """Median milliseconds of ``repeats`` calls of ``fn``."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return float(np.median(times))


def _warn_small_sample(count: int, target: float) -> None:
    """A :class:`SmallSampleWarning` when ``count`` given queries cannot show ``target``,
    pointing at the caller of :meth:`DenseIndex.tune` or :meth:`DenseIndex.measure`."""
    message = small_sample_message(count, target)
    if message is not None:
        warnings.warn(message, SmallSampleWarning, stacklevel=4)


def _tuning_queries(index, queries, k: int, n_queries: int, seed: int):
    """(queries ``[Q, d]`` float32, the stored row each one is or None): the given queries,
    or a seeded sample of stored vectors for a leave-one-out measurement."""
    if queries is None:
        n_queries = check_int("n_queries", n_queries)
        rows = np.sort(np.random.default_rng(seed).choice(
            index.ntotal, min(n_queries, index.ntotal), replace=False))
        return index.embeddings[rows].astype(np.float32), rows
    q = check_queries(queries, min(k, index.ntotal), index.dim, index.ntotal)
    q = np.ascontiguousarray(q.cpu().numpy() if isinstance(q, torch.Tensor) else q,
                             dtype=np.float32)
    if len(q) == 0:
        raise ValueError("queries must hold at least one row")
    check_finite("queries", q)
    return q, None


def _truth(index, q: np.ndarray, k: int, exclude: np.ndarray | None) -> np.ndarray | None:
    """Exact top ids for :func:`_quality` (``k + 1`` when leaving each query's own row out);
    None when there is nothing to find (a one-vector corpus searched leave-one-out)."""
    k = min(k, index.ntotal - (exclude is not None))
    if k < 1:
        return None
    return exact_search(index.embeddings, torch.from_numpy(q), k + (exclude is not None))[1].numpy()


def _quality(index, q: np.ndarray, truth: np.ndarray | None, exclude: np.ndarray | None,
             **settings) -> tuple[np.ndarray, np.ndarray, float]:
    """Per query: recall@k and whether the top 5 are exact search's top 5, of
    :meth:`DenseIndex.search` with ``settings`` against ``truth`` (:func:`_truth`), and that
    search's milliseconds per query (without the scoring around it); leave-one-out when
    ``exclude`` names each query's own row."""
    if truth is None:
        return np.ones(len(q)), np.ones(len(q)), 0.0
    start = time.perf_counter()
    found = index.search(q, truth.shape[1], **settings)[1]
    ms = (time.perf_counter() - start) * 1e3 / len(q)
    if exclude is not None:
        k = truth.shape[1] - 1
        truth, found = _leave_out(truth, exclude, k), _leave_out(found, exclude, k)
    top = min(5, truth.shape[1])
    recall = np.array([len(set(f[f >= 0].tolist()) & set(t.tolist())) / len(t)
                       for f, t in zip(found, truth)])
    same = np.array([set(f[:top].tolist()) == set(t[:top].tolist())
                     for f, t in zip(found, truth)], float)
    return recall, same, ms


def measure_quality(index, target_recall: float, *, tune: bool, k: int, n_queries: int, queries,
                    query_source: str | None, seed: int, progress: bool, nlist: int | None,
                    hnsw: bool, reranks: bool) -> dict:
    """What :meth:`DenseIndex.measure` returns (and records) for ``index``: its search quality
    against exact search, after :func:`tune_settings` when ``tune`` (``nlist``, ``hnsw``,
    ``reranks``: the index's structure, see :func:`tune_settings`)."""
    k = check_int("k", k)
    q, exclude = _tuning_queries(index, queries, k, n_queries, seed)
    source = query_source or ("given" if exclude is None else "corpus (leave-one-out)")
    approximate = index.factory != "Flat"
    if approximate and exclude is None:
        _warn_small_sample(len(q), target_recall)
    if tune and approximate:
        if progress:
            tqdm.write(f"tuning search settings: recall@{k} and same top 5 >= {target_recall} "
                       f"against exact search on {len(q)} queries ({source})")
        tune_settings(index, target_recall, queries=q, k=k, seed=seed, nlist=nlist, hnsw=hnsw,
                      reranks=reranks, exclude=exclude, warned=True)
    per_query = (_quality(index, q, _truth(index, q, k, exclude), exclude)[:2] if approximate
                 else None)
    recall, same = (float(v.mean()) for v in per_query) if per_query else (1.0, 1.0)
    reached = _reaches(per_query, target_recall) if per_query else True
    timed = q[:256]  # a batch, as the tuning timed it
    ms = _time_ms(lambda: index.search(timed, min(k, index.ntotal))) / max(1, len(timed))
    return {
        "target_recall": float(target_recall), "k": int(min(k, index.ntotal)),
        "queries": int(len(q)), "query_source": source, "recall": round(float(recall), 4),
        "same_top5": round(float(same), 4),
        "ms_per_query": round(float(ms), 4) if math.isfinite(ms) else None,
        "reached": bool(reached),
        "settings": {key: int(v) for key, v in index.params.items()},
    }


def tune_settings(index, target_recall: float = 0.95, queries=None, k: int = 10,
                  n_queries: int = 1000, rerank_factors: Sequence[int] = RERANK_FACTORS,
                  seed: int = 0, *, nlist: int | None, hnsw: bool, reranks: bool,
                  exclude: np.ndarray | None = None, warned: bool = False) -> dict:
    """:meth:`DenseIndex.tune` of ``index``, whose structure says what to sweep: ``nlist``, the
    lists of its IVF (``nprobe`` 1, 2, 4 ... ``nlist``; None: no IVF), ``hnsw`` (``ef_search``
    16 to 2048), ``reranks`` (whether it re-ranks: the factors of ``rerank_factors``). The
    chosen settings become ``index.params``. ``exclude``: the stored row of each of the given
    ``queries`` (already sampled by :func:`measure_quality`, searched leave-one-out);
    ``warned``: the small-sample warning was given already."""
    if (isinstance(target_recall, bool) or not isinstance(target_recall, numbers.Real)
            or not 0.0 < float(target_recall) <= 1.0):
        raise ValueError(f"target_recall must be a number in (0, 1], got {target_recall!r}")
    k = check_int("k", k, 1, max(1, index.ntotal))
    n_queries = check_int("n_queries", n_queries)
    if isinstance(rerank_factors, (str, bytes)) or not isinstance(rerank_factors, Sequence):
        raise ValueError(f"rerank_factors must be a sequence of ints >= 1, got {rerank_factors!r}")
    rerank_factors = [check_int(f"rerank_factors[{i}]", f, 0)
                      for i, f in enumerate(rerank_factors)]
    if reranks and not any(f >= 1 for f in rerank_factors):
        raise ValueError(f"rerank_factors must hold at least one int >= 1, got {rerank_factors!r}")
    if exclude is None:
        q, exclude = _tuning_queries(index, queries, k, n_queries, seed)
    else:
        q = queries
    if queries is not None and exclude is None and not warned and (nlist is not None or hnsw):
        _warn_small_sample(len(q), target_recall)
    if nlist is not None:
        knob, grid = "nprobe", [2**i for i in range(int(math.log2(nlist)) + 1)]
    elif hnsw:
        knob, grid = "ef_search", [max(k, 2**i) for i in range(4, 12)]
    else:
        recall, same, _ = _quality(index, q, _truth(index, q, k, exclude), exclude)
        recall, same = float(recall.mean()), float(same.mean())
        return {"recall": recall, "same_top5": same, "reached": True,
                "ms_per_query": _time_ms(lambda: index.search(q, k)) / len(q)}
    # largest re-rank first: it reaches the target at the smallest nprobe / ef_search, and
    # its time then bounds the search of the others (a setting already slower than the
    # best found stops its factor's sweep: larger values only cost more)
    factors = sorted({f for f in rerank_factors if f >= 1}, reverse=True) if reranks else [None]
    truth = _truth(index, q, k, exclude)
    best, fallback = None, None
    for factor in factors:
        for value in grid:
            kw = {knob: value, "rerank": factor}
            *per_query, search_ms = _quality(index, q, truth, exclude, **kw)
            rec, same = (float(v.mean()) for v in per_query)
            if best is not None and search_ms > 1.5 * best["ms_per_query"]:
                break
            if fallback is None or min(rec, same) > min(fallback["recall"], fallback["same_top5"]):
                fallback = {**kw, "recall": rec, "same_top5": same, "reached": False,
                            "ms_per_query": math.nan}
            if _reaches(per_query, target_recall):
                ms = _time_ms(lambda: index.search(q[:256], k, **kw)) / len(q[:256])
                if best is None or ms < best["ms_per_query"]:
                    best = {**kw, "recall": rec, "same_top5": same, "reached": True,
                            "ms_per_query": ms}
                break
    choice = best or fallback
    index.params[knob] = choice[knob]
    if choice.get("rerank") is not None:
        index.params["rerank"] = choice["rerank"]
    return {key: v for key, v in choice.items() if v is not None}
