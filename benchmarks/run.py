"""Throughput tables for rag_fast: ``python benchmarks/run.py [--full] [--device cuda] [--only NAME]``.

Runs every ``benchmarks/bench_*.py`` (each defines ``NAME`` and ``run(ctx) -> list[Row]``),
prints one Markdown table per bench and writes all rows, with the machine's description, to
``benchmarks/results/local/<device>-<time>.json`` (ignored by git, so running the benchmarks
leaves the checkout clean; ``--out PATH`` writes elsewhere, e.g. a results file to commit next to
``benchmarks/results/*.json``). ``--quick`` (the default) took 306 s on 2 idle CPU cores the
first time, when the index bench embeds its real-text corpus (cached under the git-ignored
``benchmarks/results/local/cache``), and about 260 s after (one run, an estimate:
docs/benchmarks.md), before the serving bench added its own quick run (about 150 s) and the
hybrid bench its own (211 s in one CI run on a shared 2-core machine, the real-text corpus
embedded then, which the index bench reuses).

Every row records the allocator its times were taken with (``extra["allocator"]``): glibc's as it
is by default, unless the bench set its own (the training bench times in fresh processes) or
``RAG_FAST_BENCH_ALLOCATOR=fixed`` fixed glibc's mmap threshold (``harness.py``).

Nothing is timed (exit status 1, one message naming what is missing and the fix) where the
rag_fast rows would time the plain-PyTorch fallback: the compiled extension does not load or
lacks a kernel the chosen benches run (:data:`CPP_KERNELS`; a new bench adds its own), or,
under ``--device cuda``, Triton is not usable (:func:`refusal`).

A bench that fails (it raises, or a process it started fails or dies) does not end the run: its
traceback is printed at once, the benches after it run, the summary names it with its error,
and run.py exits with status 1 (:func:`run_bench`). One whose error says a thread or process
could not start (:func:`could_not_start`) is first retried once with
:data:`RETRY_THREADS` thread per process.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import errno
import importlib
import os
import pathlib
import statistics
import sys
import time
import traceback
from types import ModuleType

HERE = pathlib.Path(__file__).resolve().parent
LOCAL_RESULTS = HERE / "results" / "local"  # in .gitignore
sys.path.insert(0, str(HERE))

from harness import (Context, LoadMonitor, Row, machine_description, markdown_table,  # noqa: E402
                     plot_curves, stamp_allocator, write_json)

# The retry of a bench that could not start a thread or process: this many threads per process,
# set by these variables in the environment of the processes it starts.
RETRY_THREADS = 1
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS",
                    "RAG_FAST_THREADS")
# what an error says when a thread or process could not start: Python's, strerror(EAGAIN),
# libgomp's, and the errno as OSError and C++ exceptions print it
START_FAILURES = ("can't start new thread", "resource temporarily unavailable",
                  "thread creation failed", "eagain", "[errno 11]")


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
    "contention": _LOSS + ("bits_mask", "bits_unmask"),  # the training bench's step
    "decoding": ("rag_token_beam_step", "row_stats"),  # the beam step; RAG-Sequence's scores
    "index": ("inner_products",),  # the exact preset
    "distributed": ("inner_products",),
    "serve": ("rag_token_beam_step", "inner_products"),  # the server's decoding and search
    "hybrid": ("inner_products",),  # the re-rank of the ivfpq preset's candidates
}
# benches whose rag_fast rows run on the CPU whatever --device says; the others run Triton's
# kernels under --device cuda
CPU_ONLY = ("decoding", "index", "distributed", "contention", "serve", "hybrid")


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


# Each bench's headline ratios for the closing summary: (provider, ratio key in its rows'
# extra, what it compares). A ratio > 1 means the provider is faster than what it is against.
HEADLINES: dict[str, tuple[tuple[str, str, str], ...]] = {
    "losses": (("rag_fast fused", "speedup vs eager", "fused loss vs transformers eager"),
               ("rag_fast fused", "speedup vs compiled", "fused loss vs transformers compiled")),
    "lm_head": (("rag_fast fused LM head", "speedup vs transformers",
                 "fused LM head + loss vs transformers"),
                ("rag_fast materialized", "speedup vs transformers",
                 "materialized logits + fused loss vs transformers")),
    "training": (("rag_fast", "speedup vs eager", "training step vs transformers eager"),
                 ("rag_fast", "speedup vs compiled", "training step vs transformers compiled"),
                 ("rag_fast materialized", "speedup vs eager",
                  "training step (materialized logits) vs transformers eager"),
                 ("rag_fast materialized", "speedup vs compiled",
                  "training step (materialized logits) vs transformers compiled")),
    "decoding": (("rag_fast", "x transformers", "decoding vs transformers"),
                 ("rag_fast (cpp)", "speedup", "one beam step vs transformers'")),
    "index": (("rag_fast exact", "x faiss", "exact search vs faiss IndexFlatIP"),
              ("rag_fast exact", "x torch", "exact search vs torch matmul + topk"),
              ("rag_fast ivfpq", "x exact", "ivfpq vs the fastest exact search"),
              ("rag_fast hnsw", "x exact", "hnsw vs the fastest exact search")),
    "distributed": (("sharded", "vs full, same W", "sharded vs a full index per rank"),),
    "contention": (("rag_fast", "slowdown", "SLOWDOWN of rag_fast's training step beside a "
                                            "busy process (lower is better)"),
                   ("transformers", "slowdown", "SLOWDOWN of transformers' training step beside "
                                                "a busy process (lower is better)")),
}
BUSY_CORES = 0.25  # other processes' use, in cores, above which the summary calls a bench busy


def _x(value: float) -> str:
    return f"{value:.2f}x" if value < 10 else f"{value:.1f}x"


def summary(rows: list[Row], loads: dict[str, dict], cores: int | None = None,
            failed: dict[str, str] | None = None, retried: dict[str, str] | None = None) -> str:
    """The closing summary: per bench, its wall time, the other processes' load on the machine
    while it ran (:class:`harness.LoadMonitor`), how many rows are flagged noisy, and each of
    its :data:`HEADLINES` ratios as the range and median over the bench's cases; a bench in
    ``failed`` gets one line with its error instead, and one in ``retried`` says why it was."""
    failed, retried = failed or {}, retried or {}
    lines = ["## summary", ""]
    for name, load in loads.items():
        if name in failed:
            again = f", {retried[name]}" if name in retried else ""
            lines.append(f"- **{name}** FAILED ({load.get('seconds', 0):.0f} s{again}): "
                         f"{failed[name]}")
            continue
        mine = [r for r in rows if r.bench == name]
        noisy = sum(1 for r in mine if r.noisy)
        others = load.get("other_cores")
        if others is None:
            busy = "the machine's load unknown"
        else:
            busy = f"other processes used {others:.2f}"
            busy += f" of {cores} cores" if cores else " cores"
            if others > BUSY_CORES:
                busy += " (BUSY: its ratios may be off, rerun on a quiet machine)"
        lines.append(f"- **{name}** ({load.get('seconds', 0):.0f} s; {busy}; "
                     f"{noisy} of {len(mine)} rows noisy)")
        if name in retried:
            lines.append(f"  - {retried[name]}")
        for provider, key, words in HEADLINES.get(name, ()):
            values = [(r.extra[key], key in r.noisy) for r in mine
                      if r.provider == provider and isinstance(r.extra.get(key), (int, float))]
            if not values:
                continue
            ratios = sorted(v for v, _ in values)
            flagged = sum(1 for _, n in values if n)
            span = _x(ratios[0]) if len(ratios) == 1 else f"{_x(ratios[0])} to {_x(ratios[-1])}"
            median = "" if len(ratios) < 3 else f", median {_x(statistics.median(ratios))}"
            cases = f"{len(ratios)} case{'s' if len(ratios) > 1 else ''}"
            lines.append(f"  - {words}: {span}{median} ({cases}"
                         + (f", {flagged} noisy" if flagged else "") + ")")
    lines.append("")
    lines.append("x > 1: rag_fast faster (except a SLOWDOWN). A ratio is noisy when a side's runs spread by more "
                 "than 20% or overlap the other side's.")
    if failed:
        lines.append(f"{len(failed)} of {len(loads)} benches failed ({', '.join(failed)}; their "
                     "tracebacks went to stderr): they have no rows, and run.py exits with "
                     "status 1.")
    return "\n".join(lines)


def tables(module, rows: list[Row], machine: dict, args: dict, source: str) -> str:
    """A bench's rows as the README shows them (its ``render``: the README's columns, with the
    caption saying what was measured); a bench without ``render`` gets every field as a
    table. A ``render`` that fails prints the raw table after one line naming the error."""
    render = getattr(module, "render", None)
    if render is None:
        return markdown_table(rows)
    results = {"machine": machine, "args": args, "rows": [dataclasses.asdict(r) for r in rows]}
    try:
        return render(results, source)
    except Exception as e:  # a bug to report, not a reason to lose the run's output
        return (f"(could not render the {module.NAME} tables: {type(e).__name__}: {e}; every "
                f"field follows)\n\n" + markdown_table(rows))


def could_not_start(error: BaseException) -> bool:
    """Whether ``error``, or an error it was raised from or while handling, says that a thread
    or process could not start: an OSError with errno EAGAIN, or a message (a worker's
    traceback, which a bench's error quotes, included) holding one of :data:`START_FAILURES`."""
    seen: set[int] = set()
    cause: BaseException | None = error
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, OSError) and cause.errno == errno.EAGAIN:
            return True
        if any(words in str(cause).lower() for words in START_FAILURES):
            return True
        cause = cause.__cause__ or cause.__context__
    return False


def one_line(error: BaseException, width: int = 240) -> str:
    """``Type: message`` on one line, for the summary: the message's first line, cut at
    ``width`` characters (the whole traceback was printed when the bench failed)."""
    lines = str(error).strip().splitlines()
    text = f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__
    return text if len(text) <= width else text[: width - 3] + "..."


@contextlib.contextmanager
def fewer_threads(n: int):
    """Within: torch on ``n`` threads in this process, and :data:`THREAD_VARIABLES` set to
    ``n`` in the environment of the processes it starts; all restored after."""
    import torch

    threads = torch.get_num_threads()
    saved = {name: os.environ.get(name) for name in THREAD_VARIABLES}
    torch.set_num_threads(n)
    os.environ.update({name: str(n) for name in THREAD_VARIABLES})
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@dataclasses.dataclass
class Outcome:
    """What running one bench gave: its module and rows, or (``error``, :func:`one_line`) the
    error that stopped it; ``retry`` says why it was retried, if it was; ``load`` is the
    machine's load meanwhile (:class:`harness.LoadMonitor`)."""
    module: ModuleType | None
    rows: list[Row]
    error: str | None = None
    retry: str | None = None
    load: dict = dataclasses.field(default_factory=dict)


def _report_failure(name: str, error: BaseException) -> None:
    print(f"\nbench {name} failed:", file=sys.stderr)
    traceback.print_exception(error, file=sys.stderr)
    sys.stderr.flush()


def _attempts(name: str, module_name: str, ctx: Context) -> Outcome:
    """:func:`run_bench` without the load monitor."""
    retry = None
    try:
        module = importlib.import_module(module_name)
        assert module.NAME == name, f"{module_name}.py must set NAME = {name!r}"
        try:
            return Outcome(module, stamp_allocator(module.run(ctx)))
        except Exception as error:
            if not could_not_start(error):
                raise
            first = error
        # retried outside the handler, so that a second error does not print the first again
        _report_failure(name, first)
        retry = f"retried once with {RETRY_THREADS} thread per process after {one_line(first)}"
        print(f"{name}: a thread or process could not start ({one_line(first)}): retrying "
              f"once with {RETRY_THREADS} thread per process\n", flush=True)
        with fewer_threads(RETRY_THREADS):
            rows = module.run(dataclasses.replace(ctx, threads=RETRY_THREADS))
        for row in rows:
            row.extra["retried with threads"] = RETRY_THREADS
        return Outcome(module, stamp_allocator(rows), retry=retry)
    except Exception as error:
        _report_failure(name, error)
        return Outcome(None, [], error=one_line(error), retry=retry)


def run_bench(name: str, module_name: str, ctx: Context) -> Outcome:
    """Bench ``name`` (module ``module_name``) run under a :class:`harness.LoadMonitor`. An
    error (importing it, or in its ``run``) ends the bench, not the run: its traceback goes to
    stderr at once and the outcome carries it. An error that says a thread or process could not
    start (:func:`could_not_start`) first gets one retry, said on stdout, with ``ctx.threads``
    and every process's threads at :data:`RETRY_THREADS` (:func:`fewer_threads`); the retry's
    rows say so (``extra["retried with threads"]``). Ctrl-C still ends the run."""
    with LoadMonitor() as monitor:
        outcome = _attempts(name, module_name, ctx)
    outcome.load = monitor.result
    return outcome


def available_benches() -> dict[str, str]:
    """bench NAME -> module name, for every benchmarks/bench_NAME.py. Nothing is imported
    here: a bench's dependencies (faiss for the index) are only needed when it runs."""
    return {path.stem.removeprefix("bench_"): path.stem for path in sorted(HERE.glob("bench_*.py"))}


def main(argv: list[str] | None = None) -> int:
    """Run the chosen benches; 0 when every one gave its rows, 1 when one failed (after the
    summary) or nothing was timed (:func:`refusal`), 2 for bad arguments."""
    benches = available_benches()
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", dest="quick", action="store_true", default=True,
                      help="small sizes (default): about 5 minutes on 2 idle CPU cores the "
                           "first time, 4.3 once the index bench's corpus is embedded (one "
                           "run: docs/benchmarks.md)")
    size.add_argument("--full", dest="quick", action="store_false",
                      help="the sizes of the full tables (docs/benchmarks.md): far longer "
                           "(the training bench alone took 43 minutes on 2 cores); use --only "
                           "NAME")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--only", action="append", default=None, metavar="NAME",
                        help="run only this bench (repeatable), one of: " + ", ".join(benches))
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
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = args.out or str(LOCAL_RESULTS / f"{args.device}-{stamp}.json")
    shown = os.path.relpath(out)  # as the captions name the results file
    shown = out if shown.startswith("..") else shown
    all_rows, loads, failed, retried = [], {}, {}, {}
    for name in names:
        outcome = run_bench(name, benches[name], ctx)
        all_rows += outcome.rows
        loads[name] = outcome.load
        if outcome.retry:
            retried[name] = outcome.retry
        if outcome.error:
            failed[name] = outcome.error
        # after every bench, so that a later failure or Ctrl-C keeps the benches done
        write_json(out, all_rows, machine, vars(args), load=loads, failed=failed)
        seconds = f"{outcome.load['seconds']:.0f} s"
        if outcome.error:
            print(f"## {name}  FAILED ({seconds}): {outcome.error}\n", flush=True)
        else:
            print(f"## {name}  ({seconds})\n")
            print(tables(outcome.module, outcome.rows, machine, vars(args), shown) + "\n",
                  flush=True)
    print(summary(all_rows, loads, machine.get("cpu_count"), failed, retried))
    note = "" if args.out else " (not tracked by git; --out PATH to choose)"
    print(f"\nresults written to {out}{note}; `python benchmarks/render.py {out}` prints these "
          "tables again, and the JSON holds every raw field")
    plot = str(pathlib.Path(out).with_suffix("")) + "-recall-qps.png"
    if plot_curves(all_rows, plot):
        print(f"recall/throughput plot written to {plot}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
