"""Index presets on seeded synthetic 768-d vectors: recall, speed against exact search and raw
faiss, build time, size.

Data: a seeded two-level mixture of Gaussians, as real passage embeddings cluster by topic
and, within a topic, by near-paraphrase: 1000 unit-norm topic centres, 10 sub-topics per
topic (offset 0.6), points with isotropic noise of norm 0.6 around their sub-topic. Queries
are fresh draws from the same mixture; the ``tune`` queries are another, disjoint draw.
Sizes: 20k vectors with --quick, 200k outside it.

Rows per preset (exact, hnsw, ivfpq tuned by ``tune(0.95)`` on the held-out queries):
recall@10 against exact search; batch queries/s and single-query latency with the ratio to
exact search (``x exact``: > 1 is faster); overhead of ``DenseIndex.search`` over calling
``faiss_index.search`` directly with the same parameters (the ``faiss`` rows); build seconds
per million vectors; bytes per vector of the search structure (the fp16 vectors kept beside
every index for re-ranking and exact passage scores add 2*d bytes, reported as ``+fp16 B/vec``).
"""
from __future__ import annotations

import dataclasses
import time

import numpy as np
import torch
from harness import Context, Measurement, Row, measure

from rag_fast.retrieval import DenseIndex, recall_at_k

NAME = "index"
D, K, TOPICS, SUBTOPICS, SPREAD = 768, 10, 1000, 10, 0.6


def clustered_vectors(n: int, rng: np.random.Generator, centres: np.ndarray) -> np.ndarray:
    """``[n, D]`` float32 draws from the mixture whose sub-topic centres are ``centres``."""
    x = rng.standard_normal((n, D), dtype=np.float32)
    x *= SPREAD / np.sqrt(D)
    x += centres[rng.integers(0, len(centres), n)]
    return x


def _unit(rng: np.random.Generator, n: int) -> np.ndarray:
    x = rng.standard_normal((n, D), dtype=np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def _paired(ours, direct, ctx: Context, rounds: int) -> tuple[Measurement, Measurement]:
    """Time two providers in alternating rounds and keep each one's best median, so that load
    drifting on a shared machine does not favour whichever ran first."""
    a: list[Measurement] = []
    b: list[Measurement] = []
    for _ in range(rounds):
        a.append(measure(ours, ctx, memory=False))
        b.append(measure(direct, ctx, memory=False))
    return min(a, key=lambda m: m.median_ms), min(b, key=lambda m: m.median_ms)


def run(ctx: Context) -> list[Row]:
    n, n_eval, batch = (20_000, 200, 128) if ctx.quick else (200_000, 1000, 128)
    rng = np.random.default_rng(0)
    centres = np.repeat(_unit(rng, TOPICS), SUBTOPICS, 0) + SPREAD * _unit(rng, TOPICS * SUBTOPICS)
    xb = clustered_vectors(n, rng, centres)
    queries = clustered_vectors(n_eval, rng, centres)
    held_out = clustered_vectors(n_eval, rng, centres)
    q_batch, q_one = queries[:batch], queries[:1]
    # Exact search is slow at full size: time it with fewer repeats.
    slow = dataclasses.replace(ctx, repeats=min(ctx.repeats, 3), warmup=0)

    rows: list[Row] = []
    case = f"{n // 1000}k x {D}"
    exact_ms: dict[str, float] = {}
    truth = None
    for preset in ("exact", "hnsw", "ivfpq"):
        torch.manual_seed(0)
        start = time.perf_counter()
        index = DenseIndex.build(xb, preset, progress=False)
        build_s = time.perf_counter() - start
        info = {}
        if preset == "ivfpq":
            start = time.perf_counter()
            info = index.tune(0.95, queries=held_out, k=K)
            info["tune_s"] = round(time.perf_counter() - start, 1)
        found = index.search(queries, K)[1]
        if truth is None:
            truth = found
        params = {key: index.params[key] for key in ("nprobe", "ef_search", "rerank") if key in index.params}
        common = {
            "recall@10": recall_at_k(found, truth),
            "build s/M": build_s / n * 1e6,
            "B/vec": index.index_bytes() / n,
            "+fp16 B/vec": 2 * D,
            "params": " ".join(f"{key}={v}" for key, v in params.items()),
        }
        raw = index.faiss_index
        raw_params = index.search_parameters(K)
        for mode, q in (("batch", q_batch), ("single", q_one)):
            timing_ctx = slow if preset == "exact" else ctx
            ours, direct = _paired(lambda: index.search(q, K), lambda: raw.search(q, K, params=raw_params),
                                   timing_ctx, rounds=1 if preset == "exact" else 2)
            if preset == "exact":
                exact_ms[mode] = ours.median_ms
            extra = {
                **common,
                "QPS": len(q) / ours.median_ms * 1e3,
                "x exact": exact_ms[mode] / ours.median_ms,
                "overhead vs faiss": ours.median_ms / direct.median_ms - 1,
            }
            if preset == "ivfpq" and mode == "batch":
                extra["tune"] = (f"target 0.95: held-out recall {info['recall']:.3f} "
                                 f"reached={info['reached']} in {info['tune_s']} s")
            label = f"{case} {mode} (B={len(q)})"
            rows.append(Row(NAME, label, f"rag_fast {preset}", ours.median_ms, ours.peak_mb, extra))
            rows.append(Row(NAME, label, f"faiss {preset} (direct)", direct.median_ms, None,
                            {"QPS": len(q) / direct.median_ms * 1e3}))
        del index
    return rows
