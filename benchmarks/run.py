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

Nothing is timed (exit status 1, one message naming what is missing and the fix) where the
rag_fast rows would time the plain-PyTorch fallback: the compiled extension does not load or
lacks a kernel the chosen benches run (:data:`CPP_KERNELS`; a new bench adds its own), or,
under ``--device cuda``, Triton is not usable (:func:`refusal`).
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


# The compiled kernels (attributes of rag_fast._C: csrc's RAG_FAST_KERNEL registrations, and the
# one-bit masks of csrc/masks.cpp) that each bench's rag_fast rows run on CPU tensors. Without
# one, the op falls back to the plain-PyTorch reference after one warning, and the row would
# time that fallback under rag_fast's name: run.py refuses instead (refusal()).
_LOSS = ("row_stats", "row_grad")  # the losses without smoothing (and RAG-Sequence's)
_SMOOTH = ("token_smooth_forward", "token_smooth_grad")  # RAG-Token with epsilon > 0
CPP_KERNELS: dict[str, tuple[str, ...]] = {
    "losses": _LOSS + _SMOOTH,
    "lm_head": _LOSS + _SMOOTH + ("token_smooth_stats",),  # linear_rag_nll; materialized path
    "training": _LOSS + ("bits_mask", "bits_unmask"),  # RagModel (eps 0), lean activations
    "decoding": ("rag_token_beam_step", "row_stats"),  # the beam step; RAG-Sequence's scores
    "index": ("inner_products",),  # the exact preset
    "distributed": ("inner_products",),
}
# benches whose rag_fast rows run on the CPU whatever --device says; the others run Triton's
# kernels under --device cuda
CPU_ONLY = ("decoding", "index", "distributed")


def refusal(names: list[str], device: str) -> str | None:
    """Why the rag_fast rows of benches ``names`` would time a fallback instead of rag_fast's
    kernels under ``--device device``: the C++ extension does not load or lacks a kernel they
    run (:data:`CPP_KERNELS`), or (``cuda``) Triton is not usable. None when all is there."""
    import warnings

    import rag_fast.kernels as kernels
    from rag_fast import _ext

    problems = []
    cpp = [n for n in names if device == "cpu" or n in CPU_ONLY]
    needed = sorted({k for n in cpp for k in CPP_KERNELS.get(n, ())})
    if needed:
        with warnings.catch_warnings():  # the extension's own warning is part of the message
            warnings.simplefilter("ignore")
            loaded = _ext.available()
        if not loaded:
            why = _ext.diagnosis() or f"rag_fast C++ extension unavailable. {_ext.FIX}"
            problems.append(f"the benches {cpp} run rag_fast's compiled C++ kernels {needed}: "
                            + why.replace(" Until then rag_fast falls back to its PyTorch "
                                          "reference path (slower, more memory).", ""))
        else:
            C = _ext.get()
            missing = [k for k in needed if not hasattr(C, k)]
            if missing:
                users = [n for n in cpp if set(CPP_KERNELS.get(n, ())) & set(missing)]
                problems.append(
                    f"the extension {getattr(C, '__file__', 'rag_fast._C')} lacks the kernels "
                    f"{missing} that the benches {users} run: it was built from older sources. "
                    "Fix: rebuild it, `pip install .` (`pip install -e .` in a checkout, which "
                    "builds rag_fast/_C in place; Python started in the repository root imports "
                    "the source folder and its in-place build, not the installed package).")
    triton = [n for n in names if device == "cuda" and n not in CPU_ONLY]
    if triton and not kernels.triton_usable_for("cuda"):
        version, status = kernels.triton_status()
        why = ("Triton is not installed (a CUDA build of torch brings it, or `pip install "
               "'rag_fast[gpu]'`)" if version == "not installed" else
               f"Triton {version} is not usable: {status}")
        problems.append(f"the benches {triton} run rag_fast's Triton kernels on CUDA: {why}.")
    if not problems:
        return None
    return ("benchmarks/run.py: nothing timed. Without its compiled kernels every rag_fast op "
            "falls back to the plain-PyTorch reference, and its rows would still be labelled "
            "rag_fast:\n- " + "\n- ".join(problems) + "\n")


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
    refused = refusal(names, args.device)
    if refused:
        parser.exit(1, refused)

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
