"""Markdown tables from benchmark results. ``python benchmarks/render.py FILE [FILE ...]`` prints
any results file of ``run.py`` (a local run's, under ``benchmarks/results/local/``) as the full
tables show it, on stdout. Without files it rewrites the generated sections of README.md and
docs/benchmarks.md from the JSON committed under ``benchmarks/results/``; ``--check`` only
compares and exits 1, naming every section that differs from what its JSON renders to (or is
missing).

A generated section sits between ``<!-- bench:NAME -->`` and ``<!-- /bench:NAME -->``.
:data:`DOCS_SECTIONS` maps each section of ``docs/benchmarks.md`` to its results file and the
module whose ``render(results, source) -> str`` turns that file into the section's Markdown (the
full table with its caption): a bench (``benchmarks/bench_*.py``) or an example
(``examples/*.py``) that writes its own results. :data:`SECTIONS` maps each section of the
README to the full sections it summarises and the function here that makes one short table (or
list) of their tables: the README's figures are the full tables' own cells, from the same JSON.
Adding a bench: one line in :data:`DOCS_SECTIONS` and the two markers in docs/benchmarks.md, a
summary function and its line in :data:`SECTIONS` and the two markers in the README, then run
this script.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import pathlib
import re
import sys
from typing import Callable

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
MODULE_DIRS = (HERE, ROOT / "examples")  # where a renderer's module is looked up, in order

# docs/benchmarks.md: section NAME -> (results file under benchmarks/results/, module defining
# render). "The full tables": the runs the README summarises; "Other machines": runs on CPUs other
# than those, and with instruction sets capped to stand in for older CPUs.
DOCS_FILE = "docs/benchmarks.md"
DOCS_SECTIONS: dict[str, tuple[str, str]] = {
    "losses": ("cpu-losses-full.json", "bench_losses"),
    "training": ("cpu-training-full.json", "bench_training"),
    "contention": ("cpu-contention-full.json", "bench_contention"),
    "lm_head": ("cpu-lm-head-full.json", "bench_lm_head"),
    "decoding": ("cpu-decoding-full.json", "bench_decoding"),
    "index": ("cpu-index-full.json", "bench_index"),
    "distributed": ("cpu-distributed-full.json", "bench_distributed"),
    "serve": ("cpu-serve-full.json", "bench_serve"),
    "hybrid": ("cpu-hybrid-full.json", "bench_hybrid"),
    "knowledge-swap": ("knowledge-swap.json", "knowledge_swap"),
    "knowledge-swap-causal": ("knowledge-swap-causal.json", "knowledge_swap"),
    "losses-xeon": ("cpu-full.json", "bench_losses"),
    "training-epyc": ("cpu-training-epyc.json", "bench_training"),
    "decoding-epyc": ("cpu-decoding-epyc.json", "bench_decoding"),
    "decoding-epyc-avx2": ("cpu-decoding-epyc-avx2.json", "bench_decoding"),
    # where a training step's time goes (benchmarks/profile_training.py)
    "training-profile": ("cpu-training-profile.json", "profile_training"),
    # the step's optional mechanisms one at a time (benchmarks/step_variants.py)
    "step-variants": ("cpu-step-variants.json", "step_variants"),
}

def _module(name: str):
    """The module ``name`` from the first of :data:`MODULE_DIRS` that has ``name.py``."""
    if name in sys.modules:
        return sys.modules[name]
    if str(HERE) not in sys.path:  # the benches import the harness as a top-level module
        sys.path.insert(0, str(HERE))
    for folder in MODULE_DIRS:
        path = folder / f"{name}.py"
        if path.is_file():
            spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module  # dataclasses look their module up while it executes
            try:
                spec.loader.exec_module(module)
            except BaseException:
                del sys.modules[name]
                raise
            return module
    raise ModuleNotFoundError(f"no {name}.py in {', '.join(map(str, MODULE_DIRS))}")


def rendered(name: str) -> str:
    """Section ``name`` (of either file) as its committed results file renders it."""
    if name in SECTIONS:
        fulls, summarise = SECTIONS[name]
        return summarise(*(_full(n) for n in fulls))
    source, module = DOCS_SECTIONS[name]
    with open(RESULTS / source, encoding="utf-8") as f:
        results = json.load(f)
    return _module(module).render(results, source)


def sources(name: str) -> list[str]:
    """The results files (under ``benchmarks/results/``) section ``name`` is made from."""
    if name in SECTIONS:
        return [DOCS_SECTIONS[n][0] for n in SECTIONS[name][0]]
    return [DOCS_SECTIONS[name][0]]


# ------------------------------------------------------------------ the README's short tables
@dataclasses.dataclass
class Full:
    """A full section of docs/benchmarks.md: its results file, the JSON, the rendered Markdown."""

    name: str
    source: str
    results: dict
    text: str

    @property
    def machine(self) -> str:
        return _module("harness").machine_words(self.results["machine"])

    @property
    def path(self) -> str:
        return _module("harness").source_path(self.source)

    @property
    def rows(self) -> list[dict]:
        """The results file's rows of this bench (raw JSON)."""
        return [r for r in self.results.get("rows", []) if r.get("bench") == self.name]

    def table(self, i: int = 0) -> list[dict[str, str]]:
        """The ``i``-th Markdown table of the section, a dict per row keyed by the header (a
        header seen before gets `` #2``, `` #3``, ...)."""
        tables = []
        for block in self.text.split("\n\n"):
            lines = block.strip("\n").splitlines()
            if len(lines) < 2 or not all(x.startswith("|") for x in lines) \
                    or set(lines[1]) - set("|-: "):
                continue
            keys, seen = [], {}
            for cell in _cells(lines[0]):
                seen[cell] = seen.get(cell, 0) + 1
                keys.append(cell if seen[cell] == 1 else f"{cell} #{seen[cell]}")
            tables.append([_Row(self.name, zip(keys, _cells(x))) for x in lines[2:]])
        if len(tables) <= i:
            raise ValueError(f"section {self.name!r} renders {len(tables)} table(s), not {i + 1}")
        return tables[i]


class _Row(dict):
    """A row of a full table; a column it lacks is an error naming the section and the column."""

    def __init__(self, section: str, items):
        super().__init__(items)
        self.section = section

    def __missing__(self, key):
        raise KeyError(f"section {self.section!r} has no column {key!r} (columns: "
                       f"{', '.join(self)}): update benchmarks/render.py's summary")


def _full(name: str) -> Full:
    source = DOCS_SECTIONS[name][0]
    with open(RESULTS / source, encoding="utf-8") as f:
        results = json.load(f)
    return Full(name, source, results, rendered(name))


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip()[1:-1].split(" | ")]


def _markdown(header: list[str], rows: list[list[str]]) -> str:
    return "\n".join(["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
                     + ["| " + " | ".join(r) + " |" for r in rows])


def _with_spread(ms: str, spread: str) -> str:
    """A median cell with its spread: ``"4.6 (10%)"``; ``"4.6"`` when there is none."""
    return ms if spread in ("", "-") else f"{ms} ({spread})"


def _x(cell: str) -> float | None:
    """The ratio at the start of a cell (``"0.72x (noisy) vs faiss"`` -> 0.72), or None."""
    m = re.match(r"\**([0-9][0-9,]*(?:\.[0-9]+)?)x", cell.strip())
    return None if m is None else float(m.group(1).replace(",", ""))


def _shape(words: str) -> str:
    """``"B4 K5 T32"`` or ``"B=4 K=5"`` as ``"B=4, K=5, T=32"``."""
    return ", ".join(re.sub(r"^([A-Za-z]+)=?([0-9])", r"\1=\2", w) for w in words.split())


def _and(items: list[str]) -> str:
    items = list(items)
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def _span(values: list[str]) -> str:
    """Ratio cells as a range by value: ``"1.33x to 1.68x"`` (one cell: itself)."""
    ordered = sorted(values, key=_x)
    return ordered[0] if len(ordered) == 1 else f"{ordered[0]} to {ordered[-1]}"


def _docs(anchor: str) -> str:
    return f"[{DOCS_FILE}]({DOCS_FILE}#{anchor})"


def _losses(full: Full) -> str:
    rows = full.table()
    dtypes = list(dict.fromkeys(r["dtype"] for r in rows))
    shown = dtypes[0]
    shape = _shape(" ".join(full.rows[0]["case"].split()[3:-1])) if full.rows else ""
    caption = (
        "The fused RAG losses (`rag_fast.rag_token_nll`, `rag_fast.rag_sequence_nll`) against "
        f"`transformers`' own `get_nll`, eager and under `torch.compile`, on random {shown} "
        f"logits of {shape}; extra memory is the peak above the inputs, as a share of the "
        f"logits. {full.machine} (`{full.path}`); "
        + (f"the {_and(dtypes[1:])} rows and the method: " if dtypes[1:] else "the method: ")
        + f"{_docs('losses')}.")
    table = _markdown(
        ["loss", "pass", "rag_fast ms (spread)", "vs `transformers` eager",
         "vs `torch.compile`d `transformers`", "extra memory (rag_fast / eager / compiled)"],
        [[r["case"], r["pass"], _with_spread(r["rag_fast ms"], r["spread"]),
          r["vs `transformers` eager"], r["vs `torch.compile`d `transformers`"],
          r["extra memory (rag_fast / eager / compiled)"]] for r in rows if r["dtype"] == shown])
    return f"{caption}\n\n{table}"


def _training_shapes(full: Full) -> tuple[str, str]:
    """The encoder-decoder cases' shape, and the decoder-only cases' where it differs ('')."""
    sizes = _module("bench_training").SIZES
    shapes: dict[bool, list[str]] = {False: [], True: []}
    for r in full.rows:
        size, _, *shape = r["case"].split()
        mine = shapes[bool(sizes.get(size, {}).get("causal"))]
        if _shape(" ".join(shape)) not in mine:
            mine.append(_shape(" ".join(shape)))
    seq2seq, causal = " or ".join(shapes[False]), " or ".join(shapes[True])
    return seq2seq, "" if causal in ("", seq2seq) else causal


def _training(full: Full) -> str:
    rows = full.table()
    vocab = _module("bench_training").VOCAB
    seq2seq, causal = _training_shapes(full)
    caption = (
        "One training step (forward, backward, AdamW) of `RagModel` against `transformers`' RAG "
        "model on the same generator, passages and labels, eager and with its loss step under "
        f"`torch.compile`, at {seq2seq} and V={vocab} for the encoder-decoder generators"
        + (f" ({causal} for the decoder-only one)" if causal else "")
        + f". {full.machine} (`{full.path}`); peak memory, `RagModel.compile()`, the "
        f"other LM-head path, the matrix-product floor and the method: {_docs('training-step')}.")
    table = _markdown(
        ["generator", "mode", "rag_fast step ms (spread)", "vs `transformers` eager",
         "vs `torch.compile`d `transformers`", "peak memory vs eager"],
        [[r["generator"], r["mode"], _with_spread(r["step ms"], r["spread"]),
          r["vs `transformers` eager"], r["vs `torch.compile`d `transformers`"],
          r["memory vs eager"]] for r in rows])
    return f"{caption}\n\n{table}"


def _contention(full: Full) -> str:
    rows = full.table()
    busy = next((r["extra"].get("busy process") for r in full.rows
                 if r["extra"].get("busy process")), "another process")
    caption = (
        "One training step of the small generator alone and beside a process that keeps the "
        f"cores busy ({busy}); `rag_fast` is `RagModel` under the thread policy `rag-fast train` "
        f"uses by default, slowdown = beside / alone. {full.machine} (`{full.path}`); the "
        f"policy and the method: {_docs('training-beside-a-busy-process')}.")
    table = _markdown(
        ["provider", "alone ms (spread)", "beside a busy process ms (spread)", "slowdown",
         "vs `transformers`, alone / beside"],
        [[r["provider"], r["alone ms (spread)"], r["beside a busy process ms (spread)"],
          r["slowdown"].strip("*"), r["speedup vs `transformers`, alone / beside"]]
         for r in rows])
    return f"{caption}\n\n{table}"


def _lm_head(full: Full) -> str:
    rows = full.table()
    shape = _shape(" ".join(full.rows[0]["case"].split()[3:-1])) if full.rows else ""
    caption = (
        "The LM head and the RAG loss as one op (`rag_fast.linear_rag_nll`, which never holds "
        "the `[B*K, T, V]` logits) against the materialized path (the logits in a reused "
        "buffer, then the fused loss) and `F.linear` + `transformers`' `get_nll`, forward and "
        f"backward at {shape}; time vs the materialized path above 1x means the fused op is "
        f"slower. {full.machine} (`{full.path}`); the method: {_docs('lm-head-and-loss')}.")
    table = _markdown(
        ["loss", "fused ms (spread)", "vs `transformers`", "time vs the materialized path",
         "extra memory, fused / materialized / `transformers`"],
        [[r["case"], _with_spread(r["fused ms"], r["spread"]), r["speedup vs `transformers`"],
          r["time vs materialized"],
          r["extra memory, fused / materialized / `transformers` (% of the logits)"]]
         for r in rows])
    return f"{caption}\n\n{table}"


def _decoding(full: Full) -> str:
    rows = [r for r in full.table() if "(torch)" not in r["case"]]
    caption = (
        "RAG-Token beam search and RAG-Sequence thorough decoding against `transformers`' "
        "`generate` on the same weights and passages (B questions, K passages, beams and new "
        "tokens as each case says), and one RAG-Token beam step alone against `transformers`' "
        f"own. {full.machine} (`{full.path}`); the static-cache baseline, the torch fallback "
        f"and the method: {_docs('decoding')}.")
    table = _markdown(
        ["case", "rag_fast ms (spread)", "`generate` ms (spread)", "vs `generate`",
         "same token ids"],
        [[r["case"], r["rag_fast ms (spread)"], r["transformers ms (spread)"],
          r["vs `generate`"], r["same ids"]] for r in rows])
    return f"{caption}\n\n{table}"


def _serve(full: Full) -> str:
    swap = [x for x in full.text.split("\n\n")[0].split(". ") if x.startswith("Swap case")]
    caption = (
        f"`rag-fast serve` on loopback under locust users asking one question at a time, "
        f"batching on (`--max-batch 32`) against off (`--max-batch 1`) in the same run. "
        f"{full.machine} (`{full.path}`)"
        + (f"; {swap[0].rstrip('.').replace('Swap case:', 'index swaps under load:')}"
           if swap else "")
        + f"; every case, the stages and the method: {_docs('serving')}.")
    table = _markdown(
        ["case", "requests/s (spread)", "p50 ms", "p99 ms", "x 1 client", "x batching off"],
        [[r["case"], r["requests/s (spread)"], r["p50 ms"], r["p99 ms"], r["x 1 client"],
          r["x batching off"]] for r in full.table() if r["batching"] == "on"])
    return f"{caption}\n\n{table}"


def _index(full: Full) -> str:
    rows = full.table(0)
    caption = (
        "The approximate presets of `DenseIndex`, their search settings tuned as "
        "`rag-fast index build` tunes them, against the fastest exact search at the same batch "
        "size (named): real text is documentation prose embedded with all-MiniLM-L6-v2, "
        "synthetic is 768-d vectors made as hard for IVF as that text. "
        f"{full.machine} (`{full.path}`); same top 5, bytes per vector and the method: "
        f"{_docs('index')}.")
    table = _markdown(
        ["data", "preset (tuned settings)", "recall@10", "batch queries/s (spread)",
         "vs exact", "one query ms (spread)", "vs exact"],
        [[r["data"], r["preset (faiss factory, tuned search settings)"], r["recall@10"],
          _with_spread(r["batch queries/s"], r["spread"]), r["vs exact"],
          _with_spread(r["single query"].removesuffix(" ms"), r["spread #2"]),
          r["vs exact #2"]] for r in rows])
    return f"{caption}\n\n{table}"


def _hybrid(full: Full) -> str:
    """Per data set and mode: gold recall@5 and @20, against dense, and ms per question."""
    rows = full.table(0)
    timed = [r["extra"] for r in full.rows if r["provider"] == "hybrid"
             and r["extra"].get("batch") == 128]
    cost = (f"; a hybrid search of 128 questions takes {timed[0]['time_vs_dense']:.2f}x a dense "
            "one's time" if timed else "")
    caption = (
        "Dense, BM25 and both fused (`hybrid`: reciprocal rank fusion; `weighted`: a weighted "
        "sum, its weight tuned at build on questions with gold passages, else 0.5) on "
        "questions written in other words than their "
        "passages, over Python's documentation prose, and on the workflow example. "
        f"{full.machine} (`{full.path}`){cost}; the data, recall@1, answer recall and search "
        f"times: {_docs('hybrid-retrieval')}.")
    table = _markdown(
        ["data", "mode", "gold recall@5", "@20", "@5 vs dense"],
        [[r["data"], r["mode"], r["@5"], r["@20"], r["@5 vs dense"]] for r in rows])
    return f"{caption}\n\n{table}"


def _batch(row: dict) -> int:
    return int(row["queries per call"].replace(",", ""))


def _exact_rows(full: Full) -> list[dict]:
    """The exact-search rows the README shows: per data set, the smallest, the middle and the
    largest batch."""
    rows, chosen = full.table(1), []
    for data in dict.fromkeys(r["data"] for r in rows):
        mine = sorted((r for r in rows if r["data"] == data), key=_batch)
        picks = {0, len(mine) // 2, len(mine) - 1}
        chosen += [r for i, r in enumerate(mine) if i in picks]
    return chosen


def _exact(full: Full) -> str:
    rows = _exact_rows(full)
    batches = sorted({_batch(r) for r in rows})
    caption = (
        "Exact inner-product search three ways: rag_fast's `exact` preset (its kernel over "
        "faiss's vectors), faiss `IndexFlatIP` (the faster of 1 thread and all cores) and a "
        f"torch matmul with `topk`, at {_and([f'{b:,}' for b in batches])} queries per call. "
        f"{full.machine} (`{full.path}`); every batch size, faiss's thread counts and the "
        f"method: {_docs('index')}.")

    def ms(cell: str) -> str:
        return cell.split(" (")[0]  # faiss's cell names its thread count: "0.962 (1)"

    table = _markdown(
        ["data", "queries per call", "rag_fast ms (spread)", "faiss ms (spread)",
         "torch ms (spread)", "rag_fast vs faiss", "rag_fast vs torch"],
        [[r["data"], r["queries per call"], _with_spread(r["rag_fast exact ms"], r["spread"]),
          _with_spread(ms(r["faiss `IndexFlatIP` ms (threads)"]), r["spread #2"]),
          _with_spread(r["torch matmul ms"], r["spread #3"]), r["rag_fast vs faiss"],
          r["rag_fast vs torch"]] for r in rows])
    return f"{caption}\n\n{table}"


def _pairs(full: Full) -> list[tuple[dict, dict]]:
    """The distributed table's rows as (sharded, full index per rank) pairs of one preset and W."""
    rows = full.table()
    full_rows = {(r["preset, corpus"], r["W"]): r for r in rows if r["layout"] != "sharded"}
    return [(r, full_rows[(r["preset, corpus"], r["W"])]) for r in rows
            if r["layout"] == "sharded" and (r["preset, corpus"], r["W"]) in full_rows]


def _distributed(full: Full) -> str:
    caption = (
        "Retrieval time of one training step when each of W processes holds 1/W of the corpus "
        "(`ShardedIndex`) against each holding all of it, on one machine: with more processes "
        "than cores (oversubscribed) they share the cores, so those rows show the collectives' "
        f"cost, not the speed-up of W machines. {full.machine} (`{full.path}`); memory per "
        f"rank, bytes received and the method: {_docs('retrieval-over-several-processes')}.")
    table = _markdown(
        ["preset, corpus", "W", "sharded ms (spread)", "full index per rank ms (spread)",
         "sharded vs full index"],
        [[s["preset, corpus"], s["W"], _with_spread(s["ms per step (median)"], s["spread"]),
          _with_spread(f["ms per step (median)"], f["spread"]), s["vs full index, same W"]]
         for s, f in _pairs(full)])
    return f"{caption}\n\n{table}"


CLOSE = 1.25  # "where it loses" lists a win smaller than this too


def _losing(losses: Full, training: Full, lm_head: Full, decoding: Full, index: Full,
            distributed: Full) -> str:
    """Where rag_fast is slower than a baseline, or less than :data:`CLOSE` times faster, by
    rules over the full tables, so that the list follows the committed results: each bullet
    appears only while its rule holds. ``RagModel.compile()`` counts against the eager
    ``RagModel`` step, the fused LM-head loss against the materialized path, the approximate
    presets against exact search, the sharded index against a full index per process."""
    items = []
    slow = [r for r in losses.table() for key in ("vs `transformers` eager",
                                                   "vs `torch.compile`d `transformers`")
            if _x(r[key]) is not None and _x(r[key]) < CLOSE]
    if slow:
        items.append(f"RAG losses: {len(slow)} of the comparisons below {CLOSE}x "
                     f"(`{losses.path}`).")
    close: dict[str, list[str]] = {}
    for r in training.table():
        cells = {"eager": r["vs `transformers` eager"],
                 "compiled": r["vs `torch.compile`d `transformers`"]}
        if any(_x(v) is not None and _x(v) < CLOSE for v in cells.values()):
            close.setdefault(r["generator"], []).append(
                f"{r['mode']} {', '.join(f'{v} {k}' for k, v in cells.items())}")
    for generator, modes in close.items():
        items.append(f"Training step, {generator}, against `transformers`: {'; '.join(modes)} "
                     f"(`{training.path}`).")
    compiled = []
    for r in training.table():
        m = re.match(r"([0-9][0-9,]*) ms:",
                     r["`RagModel.compile()`: step, vs `transformers` eager and compiled, peak"])
        if m:
            compiled.append(float(m.group(1).replace(",", ""))
                            / float(r["step ms"].replace(",", "")))
    if compiled and min(compiled) > 1 / CLOSE:  # compiling never saves a fifth of the step
        items.append(f"`RagModel.compile()` (off by default) takes {min(compiled):.2f}x to "
                     f"{max(compiled):.2f}x the time of the eager `RagModel` step "
                     f"(`{training.path}`).")
    times = [r["time vs materialized"] for r in lm_head.table()]
    if any(_x(t) is not None and _x(t) > 1 for t in times):
        items.append("The fused LM head + loss (what `RagModel` runs once the logits would "
                     f"reach 1 GiB) takes {_span(times)} the time of the materialized path: "
                     f"it buys memory, not speed (`{lm_head.path}`).")
    for r in decoding.table():
        if "(torch)" in r["case"]:
            continue
        if _x(r["vs `generate`"]) is not None and _x(r["vs `generate`"]) < CLOSE:
            items.append(f"Decoding, {r['case']}: {r['vs `generate`']} `generate` "
                         f"(`{decoding.path}`).")
    exact = index.table(1)
    for data in dict.fromkeys(r["data"] for r in exact):
        lost = [r for r in exact if r["data"] == data and r["fastest"] != "rag_fast"]
        for other in dict.fromkeys(r["fastest"] for r in lost):
            mine = [r for r in lost if r["fastest"] == other]
            key = "rag_fast vs faiss" if other == "faiss" else "rag_fast vs torch"
            name = "faiss `IndexFlatIP`" if other == "faiss" else "a torch matmul"
            items.append(
                f"Exact search, {data}: {name} is faster at "
                f"{_and([r['queries per call'] for r in mine])} queries per call (rag_fast "
                f"{_and([r[key] for r in mine])} of its speed; `{index.path}`).")
    for r in index.table(0):
        for key, what in (("vs exact", "batches"), ("vs exact #2", "one query")):
            if _x(r[key]) is not None and _x(r[key]) < 1:
                preset = r["preset (faiss factory, tuned search settings)"].split(" (")[0]
                ratio, _, exact = r[key].partition(" vs ")
                exact = {"faiss": "faiss `IndexFlatIP`", "rag_fast": "rag_fast's exact preset",
                         "torch": "a torch matmul"}.get(exact, exact or "exact search")
                items.append(f"Index, {r['data']}: the {preset} preset answers {what} at "
                             f"{ratio} the speed of {exact}, which also finds the true "
                             f"neighbours (`{index.path}`).")
    pairs = _pairs(distributed)
    slower = [s["vs full index, same W"] for s, _ in pairs
              if _x(s["vs full index, same W"]) is not None and _x(s["vs full index, same W"]) < 1]
    if slower:
        items.append(f"On one machine the sharded index is slower than a full index per process "
                     f"in {len(slower)} of {len(pairs)} cases ({_span(slower)}): it is for "
                     f"corpora too large for one machine (`{distributed.path}`).")
    intro = (f"Every comparison of the full tables where rag_fast is slower than its baseline or "
             f"less than {CLOSE}x faster (its torch fallback aside), found by rules over the same "
             "results files:")
    if not items:
        return f"{intro} none."
    return intro + "\n\n" + "\n".join(f"- {item}" for item in items)


# README.md: section NAME -> (the full sections it summarises, the function that does it)
SECTIONS: dict[str, tuple[tuple[str, ...], Callable[..., str]]] = {
    "losses-summary": (("losses",), _losses),
    "training-summary": (("training",), _training),
    "contention-summary": (("contention",), _contention),
    "lm_head-summary": (("lm_head",), _lm_head),
    "decoding-summary": (("decoding",), _decoding),
    "serve-summary": (("serve",), _serve),
    "index-summary": (("index",), _index),
    "hybrid-summary": (("hybrid",), _hybrid),
    "exact-summary": (("index",), _exact),
    "distributed-summary": (("distributed",), _distributed),
    "where-it-loses": (("losses", "training", "lm_head", "decoding", "index", "distributed"),
                       _losing),
}


def _pattern(name: str) -> re.Pattern:
    n = re.escape(name)
    return re.compile(rf"<!-- bench:{n} -->\n(.*?)\n?<!-- /bench:{n} -->", re.S)


def _markers(name: str, section: str) -> str:
    return f"<!-- bench:{name} -->\n{section}\n<!-- /bench:{name} -->"


def readme_section(text: str, name: str) -> str | None:
    """The text between section ``name``'s markers (each on its own line), or None when the
    README lacks them."""
    m = _pattern(name).search(text)
    return None if m is None else m.group(1)


def _files(name: str) -> str:
    return _and([f"benchmarks/results/{s}" for s in dict.fromkeys(sources(name))])


def _update(path: str, sections: dict, check: bool) -> bool:
    """Compare (``check``) or rewrite the generated sections of the file ``path``; print every
    section that is missing or differs. True when the file is as its results render."""
    text = pathlib.Path(path).read_text(encoding="utf-8")
    missing = [name for name in sections if readme_section(text, name) is None]
    for name in missing:
        print(f"{path}: no section {name!r} (<!-- bench:{name} --> ... <!-- /bench:{name} -->) "
              f"for {_files(name)}", file=sys.stderr)
    new, differing = text, []
    for name in sections:
        if name in missing:
            continue
        try:
            section = rendered(name)
        except FileNotFoundError as e:  # the results file was not committed (or was renamed)
            print(f"section {name!r}: {e}", file=sys.stderr)
            missing.append(name)
            continue
        if readme_section(text, name) != section:
            differing.append(name)
            new = _pattern(name).sub(lambda m, name=name, s=section: _markers(name, s), new)
    if check:
        for name in differing:
            print(f"{path}: section {name!r} differs from what {_files(name)} renders to "
                  "(run python benchmarks/render.py)", file=sys.stderr)
        return not (missing or differing)
    if missing:  # nothing written: a section without its place is the file's mistake
        return False
    if new != text:
        tmp = f"{path}.tmp.{os.getpid()}"
        pathlib.Path(tmp).write_text(new, encoding="utf-8")
        os.replace(tmp, path)
        print(f"updated {path}: {', '.join(differing)}")
    return True


def render_file(path: str) -> str:
    """Every bench of a results file (``run.py``'s JSON), each as its ``render`` shows it (the
    full tables and captions of docs/benchmarks.md), in the file's order.

    Raises:
        ValueError: the file is not a results file (no ``rows``, or rows without ``bench``),
            naming the file.
    """
    with open(path, encoding="utf-8") as f:
        try:
            results = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not JSON ({e})") from None
    rows = results.get("rows") if isinstance(results, dict) else None
    if not isinstance(rows, list) or not all(isinstance(r, dict) and "bench" in r for r in rows):
        raise ValueError(f"{path}: not a benchmarks/run.py results file (expected an object "
                         "with \"rows\", each naming its \"bench\")")
    parts = []
    for bench in dict.fromkeys(r["bench"] for r in rows):
        mine = {**results, "rows": [r for r in rows if r["bench"] == bench]}
        try:
            module = _module(f"bench_{bench.replace('-', '_')}")
        except ModuleNotFoundError:
            raise ValueError(f"{path}: rows of a bench {bench!r} that has no "
                             f"benchmarks/bench_{bench}.py to render them") from None
        parts.append(f"## {bench}\n\n" + module.render(mine, path))
    if not parts:
        raise ValueError(f"{path}: the file holds no rows")
    return "\n\n".join(parts) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        allow_abbrev=False, description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("files", nargs="*", metavar="FILE",
                        help="results files to print as Markdown (leaves README.md and the docs alone)")
    parser.add_argument("--check", action="store_true",
                        help="only compare; exit 1 naming every section that differs")
    parser.add_argument("--readme", default=str(ROOT / "README.md"))
    parser.add_argument("--docs", default=str(ROOT / DOCS_FILE),
                        help=f"the file of DOCS_SECTIONS (default {DOCS_FILE})")
    args = parser.parse_args(argv)
    if args.files:
        if args.check:
            parser.error("--check compares the README and the docs with the committed results; "
                         "it takes no FILE")
        for path in args.files:
            try:
                sys.stdout.write(render_file(path))
            except (OSError, ValueError) as e:
                print(f"render.py: {e}", file=sys.stderr)
                return 1
        return 0
    ok = _update(args.readme, SECTIONS, args.check)
    ok = _update(args.docs, DOCS_SECTIONS, args.check) and ok
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
