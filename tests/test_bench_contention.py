"""The contention bench: rows, slowdowns, render, and which provider gets rag_fast's thread
policy (the timing itself is the benchmark's, not a test's)."""
from __future__ import annotations

import pathlib
import sys

import pytest

BENCH_DIR = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH_DIR))

import bench_contention as bc  # noqa: E402
import harness  # noqa: E402


def _fake_time(provider, busy, target, steps, allocator):
    base = {bc.EAGER: 1000.0, bc.OURS: 500.0, bc.OURS_FIXED: 500.0}[provider]
    factor = {bc.EAGER: 5.0, bc.OURS: 1.9, bc.OURS_FIXED: 3.3}[provider] if busy else 1.0
    return {"times_ms": [base * factor * (1 + 0.01 * i) for i in range(steps)],
            "threads": [1 if busy and provider == bc.OURS else 2] * steps,
            "wait policy": "default (spin)"}


def test_rows_slowdowns_and_render(monkeypatch):
    monkeypatch.setattr(bc, "_time", _fake_time)
    rows = bc.run(harness.Context(device="cpu", quick=True, repeats=5, warmup=1))
    assert len(rows) == 6 and {r.provider for r in rows} == set(bc.PROVIDERS)
    busy = {r.provider: r for r in rows if r.case.endswith(bc.BUSY)}
    assert busy[bc.OURS].extra["slowdown"] == pytest.approx(1.9, rel=1e-6)
    assert busy[bc.EAGER].extra["slowdown"] == pytest.approx(5.0, rel=1e-6)
    assert busy[bc.OURS].extra["threads"] == [1]
    assert busy[bc.OURS].extra["speedup vs eager"] == pytest.approx(1000 * 5 / (500 * 1.9))
    results = {"machine": {"cpu": "test cpu", "cpu_count": 2, "torch": "2.13.0+cpu"},
               "args": {"quick": True, "only": ["contention"]},
               "rows": [harness.asdict(r) for r in rows]}
    assert bc.slowdowns(results) == pytest.approx({bc.EAGER: 5.0, bc.OURS: 1.9,
                                                   bc.OURS_FIXED: 3.3})
    text = bc.render(results, "local/x.json")
    assert "(`local/x.json`)" in text
    ours = next(line for line in text.splitlines() if line.startswith("| rag_fast | "))
    assert ours.startswith("| rag_fast | 508 (3%) | 964 (3%) | **1.90x** | 1, default (spin) |")
    assert "| transformers | 1,015 (3%) | 5,075 (3%) | **5.00x** |" in text
    with pytest.raises(ValueError, match="no rows of the 'contention' bench"):
        bc.render({**results, "rows": []}, "x.json")
    assert bc.run(harness.Context(device="cuda", quick=True, repeats=5, warmup=1)) == []


def test_only_rag_fast_gets_the_thread_policy(monkeypatch):
    """timed_steps runs AutoThreads for rag_fast alone, and _time gives rag_fast's process
    the wait policy the command would choose (faked: a busy machine)."""
    import bench_training

    from rag_fast import _threads

    made, stepped = [], []  # the provider each AutoThreads was made for / each after_step ran for
    monkeypatch.setattr(bench_training, "_provider_step",
                        lambda *a, **k: (lambda: None))
    real = _threads.AutoThreads

    class Watched(real):
        def __init__(self, *a, **k):
            made.append(provider)
            super().__init__(*a, **k)

        def after_step(self, *a, **k):
            stepped.append(provider)
            return super().after_step(*a, **k)

    monkeypatch.setattr(_threads, "AutoThreads", Watched)
    for provider in bc.PROVIDERS:
        got = bc.timed_steps(provider, 16, steps=2, warmup=1)
        assert len(got["times_ms"]) == 2 and len(got["threads"]) == 2
    assert made == [bc.OURS]  # rag_fast alone, after every one of its 1 + 2 steps
    assert stepped == [bc.OURS] * 3
    calls = []
    monkeypatch.setattr(_threads, "other_cores_now", lambda seconds=0.1: 2.0)
    import memory

    monkeypatch.setattr(memory, "call_fresh", lambda *a, env=None, **k: calls.append(env) or
                        {"times_ms": [1.0], "threads": [2]})
    monkeypatch.setattr(bc, "BUSY_START_S", 0.0)
    for provider in bc.PROVIDERS:
        got = bc._time(provider, False, 16, 1, "default")
        assert got["wait policy"] == ("PASSIVE" if provider == bc.OURS else "default (spin)")
    assert [e.get("OMP_WAIT_POLICY") for e in calls] == [None, "PASSIVE", None]
