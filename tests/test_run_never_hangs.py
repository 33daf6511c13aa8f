"""benchmarks/run.py never sits out a time-out on a bench that failed (issue #42, item 1).

A bench that raises, or whose worker process dies or cannot start, is reported at once; the
benches after it still run; the closing summary names every failed bench and its error, and
run.py exits with status 1. A failure that says a thread or process could not start is retried
once with fewer threads first. ``--help`` lists the names ``--only`` accepts.

The distributed bench runs for real here (forkserver ranks, a 2,000-passage corpus) with its rank
function replaced by the stubs below, which fail the ways a machine short of threads and
processes makes a rank fail; the other benches are stub modules in run.py's registry.
"""
from __future__ import annotations

import errno
import json
import multiprocessing.context
import os
import pathlib
import sys
import time
import types

import pytest
import torch

TESTS_DIR = pathlib.Path(__file__).resolve().parent
BENCH_DIR = TESTS_DIR.parent / "benchmarks"
sys.path.insert(0, str(BENCH_DIR))

import harness  # noqa: E402
import run as bench_run  # noqa: E402

TIMEOUT_S = 60  # the distributed bench's group time-out in these tests: a report must beat it


# ---- rank stubs: module-level, so that the forkserver's ranks can import them -------------------
def _rank_0_dies(rank, world, port, job, report):
    """Rank 0's process ends at once without a word (as one whose interpreter could not start a
    thread it needs); the other ranks wait, as they would in a collective for rank 0."""
    if rank == 0:
        os._exit(errno.EAGAIN)
    time.sleep(10 * TIMEOUT_S)


def _rank_short_of_threads(rank, world, port, job, report):
    """The real rank, whose process group cannot start its threads while the rank runs more
    than one torch thread (gloo's init raising as Python does when no thread can start)."""
    import bench_distributed
    import torch.distributed as dist

    if job["threads"] > 1:
        def init_process_group(*args, **kwargs):
            raise RuntimeError("can't start new thread")

        dist.init_process_group = init_process_group
    bench_distributed._rank(rank, world, port, job, report)


def needs_one_thread() -> int:
    """Called in a fresh process (benchmarks/memory.py's ``call_fresh``): fails as a process that
    cannot start its threads does, unless its environment asks for one thread."""
    if os.environ.get("OMP_NUM_THREADS") != "1":
        raise RuntimeError("can't start new thread")
    return torch.get_num_threads()


# ---- helpers ------------------------------------------------------------------------------------
def _stub(name: str, run=None) -> types.ModuleType:
    """A bench module ``name`` whose ``run`` is ``run``, by default one giving one row."""
    module = types.ModuleType(f"stub_bench_{name}")
    module.NAME = name
    module.run = run or (lambda ctx: [harness.Row.of(name, "case", "provider",
                                                     harness.Measurement.of([1.0, 1.0, 1.0]))])
    return module


def _register(monkeypatch, benches: dict) -> None:
    """run.py's registry replaced by ``benches`` (name -> a stub module, or the module name of a
    real bench), in that order; no check of the compiled kernels (stubs run none)."""
    registry = {}
    for name, bench in benches.items():
        if isinstance(bench, types.ModuleType):
            monkeypatch.setitem(sys.modules, bench.__name__, bench)
            bench = bench.__name__
        registry[name] = bench
    monkeypatch.setattr(bench_run, "available_benches", lambda: registry)
    monkeypatch.setattr(bench_run, "refusal", lambda names, device: None)


def _small_distributed(monkeypatch, rank, worlds: tuple[int, ...]):
    """The real distributed bench on 2,000 passages, its ranks running ``rank``."""
    bench = pytest.importorskip("bench_distributed")  # needs faiss, like the bench
    monkeypatch.chdir(BENCH_DIR.parent)  # as the README runs run.py
    monkeypatch.setattr(bench, "SIZES", {True: (2_000, ("exact",))})
    monkeypatch.setattr(bench, "WORLDS", worlds)
    monkeypatch.setattr(bench, "TIMEOUT_S", TIMEOUT_S)
    monkeypatch.setattr(bench, "_rank", rank)
    return bench


def _summary(text: str) -> str:
    return text[text.index("## summary"):]


# ---- tests --------------------------------------------------------------------------------------
def test_help_lists_every_name_only_accepts(monkeypatch, capsys):
    with pytest.raises(SystemExit) as done:
        bench_run.main(["--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    only = " ".join(text[text.index("\n  --only NAME"):text.index("\n  --repeats")].split())
    assert all(name in only for name in bench_run.available_benches()), only
    # the names come from the registry, not from a second list
    _register(monkeypatch, {"alpha_stub": _stub("alpha_stub"),
                            "beta_stub": _stub("beta_stub")})
    with pytest.raises(SystemExit):
        bench_run.main(["--help"])
    text = capsys.readouterr().out
    assert "alpha_stub" in text and "beta_stub" in text


def test_a_failing_bench_is_named_in_the_summary_and_the_others_still_run(
        tmp_path, monkeypatch, capsys):
    def broken(ctx):
        raise ValueError("bad shape\nsecond line")

    _register(monkeypatch, {"broken": _stub("broken", broken), "fine": _stub("fine")})
    out = tmp_path / "r.json"
    assert bench_run.main(["--out", str(out)]) == 1
    captured = capsys.readouterr()
    assert "## broken  FAILED" in captured.out and "bad shape" in captured.err  # its traceback
    summary = _summary(captured.out)
    assert "**broken** FAILED" in summary and "ValueError: bad shape" in summary
    assert "second line" not in summary  # one line per failure
    assert "**fine**" in summary and "1 of 2 benches failed" in summary
    payload = json.loads(out.read_text())  # the bench that succeeded is on disk
    assert [r["bench"] for r in payload["rows"]] == ["fine"]
    assert payload["failed"] == {"broken": "ValueError: bad shape"}


def test_a_rank_that_dies_is_reported_at_once_and_the_run_goes_on(tmp_path, monkeypatch, capsys):
    _small_distributed(monkeypatch, _rank_0_dies, worlds=(2,))
    _register(monkeypatch, {"distributed": "bench_distributed", "after": _stub("after")})
    out = tmp_path / "r.json"
    start = time.monotonic()
    assert bench_run.main(["--out", str(out)]) == 1
    elapsed = time.monotonic() - start
    assert elapsed < TIMEOUT_S / 3, elapsed  # seen when it died, not at the time-out
    summary = _summary(capsys.readouterr().out)
    assert "**distributed** FAILED" in summary
    assert f"rank 0 failed: ended without reporting (exit status {errno.EAGAIN})" in summary
    assert "**after**" in summary
    assert [r["bench"] for r in json.loads(out.read_text())["rows"]] == ["after"]


def test_a_rank_that_cannot_start_a_thread_is_retried_once_with_fewer_threads(
        tmp_path, monkeypatch, capsys):
    bench = _small_distributed(monkeypatch, _rank_short_of_threads, worlds=(1,))
    monkeypatch.setattr(bench, "_cores", lambda: 4)  # more than one thread per rank at first
    _register(monkeypatch, {"distributed": "bench_distributed", "after": _stub("after")})
    out = tmp_path / "r.json"
    assert bench_run.main(["--repeats", "5", "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert "can't start new thread" in captured.err  # the first attempt's error, at once
    assert captured.out.count("retrying once with 1 thread per process") == 1
    summary = _summary(captured.out)
    assert "FAILED" not in summary
    assert "retried once with 1 thread per process after RuntimeError" in summary
    rows = [r for r in json.loads(out.read_text())["rows"] if r["bench"] == "distributed"]
    assert len(rows) == 2 and all(r["extra"]["threads/rank"] == 1 for r in rows)
    assert all(r["extra"]["retried with threads"] == 1 for r in rows)


def test_a_thread_failure_is_retried_once_then_reported(tmp_path, monkeypatch, capsys):
    seen = []

    def starved(ctx):
        seen.append((ctx.threads, torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")))
        raise RuntimeError("Thread creation failed: Resource temporarily unavailable")

    threads = torch.get_num_threads()
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    _register(monkeypatch, {"starved": _stub("starved", starved), "fine": _stub("fine")})
    assert bench_run.main(["--out", str(tmp_path / "r.json")]) == 1
    # the retry ran with 1 thread here and in the processes it starts; then all was restored
    assert seen == [(None, threads, "7"), (1, 1, "1")]
    assert torch.get_num_threads() == threads and os.environ["OMP_NUM_THREADS"] == "7"
    summary = _summary(capsys.readouterr().out)
    assert "**starved** FAILED" in summary and "retried once with 1 thread per process" in summary
    assert "RuntimeError: Thread creation failed" in summary and "**fine**" in summary


def test_a_rank_process_that_cannot_start_is_reported_at_once(tmp_path, monkeypatch, capsys):
    _small_distributed(monkeypatch, _rank_0_dies, worlds=(2,))
    starts = []

    def start(process):
        starts.append(process)
        raise BlockingIOError(errno.EAGAIN, os.strerror(errno.EAGAIN))

    monkeypatch.setattr(multiprocessing.context.ForkServerProcess, "start", start)
    _register(monkeypatch, {"distributed": "bench_distributed", "after": _stub("after")})
    assert bench_run.main(["--out", str(tmp_path / "r.json")]) == 1
    assert len(starts) == 2  # rank 0 of the first group, once more in the retry
    summary = _summary(capsys.readouterr().out)
    assert "**distributed** FAILED" in summary and "rank 0 could not start: BlockingIOError" in summary
    assert "**after**" in summary


def test_the_retry_reaches_the_fresh_processes_a_bench_starts(tmp_path, monkeypatch, capsys):
    """A bench whose fresh process cannot start its threads (the training and contention benches
    time in such processes) is retried with one thread in the processes it starts."""
    import memory

    def run(ctx):
        threads = memory.call_fresh(f"{__name__}:needs_one_thread", path=(str(TESTS_DIR),))
        m = harness.Measurement.of([1.0, 1.0, 1.0])
        return [harness.Row.of("fresh", "case", "provider", m, {"child threads": threads})]

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    _register(monkeypatch, {"fresh": _stub("fresh", run)})
    out = tmp_path / "r.json"
    assert bench_run.main(["--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert "RuntimeError: can't start new thread" in captured.err  # the child's, at once
    assert "retried once with 1 thread per process after FreshProcessError" in captured.out
    [row] = json.loads(out.read_text())["rows"]
    assert row["extra"]["child threads"] == 1 and row["extra"]["retried with threads"] == 1
    assert "OMP_NUM_THREADS" not in os.environ  # restored after the retry
