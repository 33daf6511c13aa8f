"""Throughput tables for rag_fast: ``python benchmarks/run.py [--full] [--device cuda] [--only NAME]``.

Runs every ``benchmarks/bench_*.py`` (each defines ``NAME`` and ``run(ctx) -> list[Row]``),
prints one Markdown table per bench and writes all rows, with the machine's description, to
``benchmarks/results/local/<device>-<time>.json`` (ignored by git, so running the benchmarks
leaves the checkout clean; ``--out PATH`` writes elsewhere, e.g. a results file to commit next to
``benchmarks/results/*.json``). ``--quick`` (the default) keeps the whole run within about 3
minutes on 2 CPU cores, plus about 2 minutes the first time, when the index bench embeds its
real-text corpus (cached under the git-ignored ``benchmarks/results/local/cache``).

Every row records the allocator its times were taken with (``extra["allocator"]``): glibc's as it
is by default, unless the bench set its own (the training bench times in fresh processes) or
``RAG_FAST_BENCH_ALLOCATOR=fixed`` fixed glibc's mmap threshold (``harness.py``).
"""
from __future__ import annotations

import argparse
import importlib
import pathlib
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
LOCAL_RESULTS = HERE / "results" / "local"  # in .gitignore
sys.path.insert(0, str(HERE))

from harness import (Context, machine_description, markdown_table, plot_curves,  # noqa: E402
                     stamp_allocator, write_json)


def available_benches() -> dict[str, str]:
    """bench NAME -> module name, for every benchmarks/bench_NAME.py. Nothing is imported
    here: a bench's dependencies (faiss for the index) are only needed when it runs."""
    return {path.stem.removeprefix("bench_"): path.stem for path in sorted(HERE.glob("bench_*.py"))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", dest="quick", action="store_true", default=True,
                      help="small sizes, about 3 minutes on 2 CPU cores (default; +2 the first time)")
    size.add_argument("--full", dest="quick", action="store_false",
                      help="the sizes named in the issues' acceptance lists")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--only", action="append", default=None, metavar="NAME",
                        help="run only this bench (repeatable)")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per provider")
    parser.add_argument("--out", default=None,
                        help="JSON path (default benchmarks/results/local/<device>-<time>.json)")
    args = parser.parse_args(argv)

    import torch

    from rag_fast import _quiet

    # no "Loading weights" bars between the tables, unless RAG_FAST_VERBOSE=1 asks for them
    _quiet.set_verbose(_quiet._VERBOSE)

    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available")
    benches = available_benches()
    names = args.only or list(benches)
    unknown = [n for n in names if n not in benches]
    if unknown:
        parser.error(f"unknown bench {unknown}; available: {sorted(benches)}")

    repeats = args.repeats or (5 if args.quick else 10)
    ctx = Context(device=args.device, quick=args.quick, repeats=repeats, warmup=2)
    machine = machine_description(args.device)
    print(f"# rag_fast benchmarks ({'quick' if args.quick else 'full'}, {args.device})\n")
    print("machine: " + ", ".join(f"{k}={v}" for k, v in machine.items()) + "\n")
    all_rows = []
    for name in names:
        start = time.perf_counter()
        module = importlib.import_module(benches[name])
        assert module.NAME == name, f"{benches[name]}.py must set NAME = {name!r}"
        rows = stamp_allocator(module.run(ctx))  # the allocator of the times, on every row
        all_rows += rows
        print(f"## {name}  ({time.perf_counter() - start:.0f} s)\n")
        print(markdown_table(rows) + "\n", flush=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = args.out or str(LOCAL_RESULTS / f"{args.device}-{stamp}.json")
    write_json(out, all_rows, machine, vars(args))
    note = "" if args.out else " (not tracked by git; --out PATH to choose)"
    print(f"results written to {out}{note}")
    plot = str(pathlib.Path(out).with_suffix("")) + "-recall-qps.png"
    if plot_curves(all_rows, plot):
        print(f"recall/throughput plot written to {plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
