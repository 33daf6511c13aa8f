"""README tables from committed benchmark results: ``python benchmarks/render.py`` rewrites the
README's generated sections from the JSON under ``benchmarks/results/``; ``--check`` exits 1
(naming the section) when the README differs from what the JSON renders to.

A generated section sits between ``<!-- bench:NAME -->`` and ``<!-- /bench:NAME -->``; each
renderer below turns one results file into that section's Markdown.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import sys

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"


def _load(name: str) -> dict:
    with open(RESULTS / name) as f:
        return json.load(f)


def _machine(m: dict) -> str:
    simd = f", rag_fast {m['rag_fast_simd']}" if m.get("rag_fast_simd") else ""
    return f"{m['cpu']}, {m['cpu_count']} cores{simd}, torch {m['torch'].split('+')[0]}"


def render_index(results: dict, source: str) -> str:
    """The index table: one line per data set and preset (batch and single-query rows joined)."""
    rows = [r for r in results["rows"] if r["bench"] == "index"]
    lines = [
        "| data | preset (faiss factory, search settings) | recall@10 | same top 5 | batch queries/s "
        "| vs exact | single query | vs exact | bytes/vector |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "batch" not in r["case"]:
            continue
        single = next(s for s in rows if s["provider"] == r["provider"]
                      and s["case"] == r["case"].replace("batch (B=128)", "single (B=1)"))
        e, es = r["extra"], single["extra"]
        data = r["case"].split(" batch")[0]
        settings = f", {e['params']}" if e["params"] else ""
        how = f" ({e['factory']}{settings})" if e["factory"] else ""
        lines.append(
            f"| {data} | {r['provider'].removeprefix('rag_fast ')}{how} "
            f"| {e['recall@10']:.3f} | {e['same top5']:.1%} | {e['QPS']:,.0f} | {e['x exact']:.1f}x "
            f"| {single['median_ms']:.3f} ms | {es['x exact']:.1f}x | {e['B/vec']:,.0f} |"
        )
    plot = source.removesuffix(".json") + "-recall-qps.png"
    caption = (
        f"Measured by `python benchmarks/run.py --full --only index` on {_machine(results['machine'])} "
        f"(`benchmarks/results/{source}`; recall and throughput curves: "
        f"`benchmarks/results/{plot}`). Recall and same top 5 on the evaluation queries against "
        "exact search; queries/s for batches of 128 and milliseconds for one query, medians of "
        "repeated runs, each against the faster exact search (faiss `IndexFlatIP` or a torch matmul "
        "over the fp32 vectors) timed in the same run; "
        "bytes per vector of everything a search reads (the index, plus the fp16 vectors when it "
        "re-ranks). Each index was built as `rag-fast index build` builds it, settings tuned to "
        "recall@10 and same top 5 >= 0.95 on stand-in questions (real text: a sentence of 1000 "
        "sampled passages, encoded; synthetic: 1000 stored vectors, leave-one-out)."
    )
    return caption + "\n\n" + "\n".join(lines)


SECTIONS = {"index": ("cpu-index-full.json", render_index)}


def rendered(name: str) -> str:
    source, render = SECTIONS[name]
    return render(_load(source), source)


def _pattern(name: str) -> re.Pattern:
    return re.compile(rf"(<!-- bench:{name} -->\n)(.*?)(\n<!-- /bench:{name} -->)", re.S)


def readme_section(text: str, name: str) -> str | None:
    m = _pattern(name).search(text)
    return None if m is None else m.group(2)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 on a difference")
    parser.add_argument("--readme", default=str(ROOT / "README.md"))
    args = parser.parse_args(argv)
    text = pathlib.Path(args.readme).read_text(encoding="utf-8")
    new = text
    for name in SECTIONS:
        if readme_section(text, name) is None:
            print(f"{args.readme}: no <!-- bench:{name} --> ... <!-- /bench:{name} --> section", file=sys.stderr)
            return 1
        new = _pattern(name).sub(lambda m, name=name: m.group(1) + rendered(name) + m.group(3), new)
        if args.check and readme_section(text, name) != rendered(name):
            print(f"{args.readme}: section {name!r} differs from benchmarks/results/{SECTIONS[name][0]} "
                  "(run python benchmarks/render.py)", file=sys.stderr)
            return 1
    if not args.check and new != text:
        tmp = f"{args.readme}.tmp.{os.getpid()}"
        pathlib.Path(tmp).write_text(new, encoding="utf-8")
        os.replace(tmp, args.readme)
        print(f"updated {args.readme}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
