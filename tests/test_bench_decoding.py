"""The decoding benchmark: its weights exercise RAG decoding, its baselines are transformers'
own code, every row carries its runs, and its README section renders from the JSON."""
from __future__ import annotations

import dataclasses
import pathlib
import sys

import pytest

BENCH_DIR = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH_DIR))

import bench_decoding as bd  # noqa: E402
import harness  # noqa: E402

CTX = harness.Context(device="cpu", quick=True, repeats=5, warmup=1)


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


@pytest.mark.parametrize("label", list(bd.GENERATORS))
def test_bench_weights_give_different_beams_per_passage(label):
    token, _ = bd._models(*bd.GENERATORS[label], n_docs=bd.K_DOCS, init_std=bd.INIT_STD)
    ids, _, _ = bd._inputs(1, bd.K_DOCS, 16)
    counts = bd.distinct_beams(token.rag.generator, ids, 1, bd.K_DOCS, bd.BEAMS, 3)
    bd.check_exercised(counts, bd.BEAMS, label)  # raises when they do not
    assert counts["distinct top beams"] >= 2 and counts["distinct hypotheses"] > bd.BEAMS


def test_default_initialisation_is_refused():
    # transformers' default initialisation: every passage gives the same beams.
    token, _ = bd._models(*bd.GENERATORS["small"], n_docs=bd.K_DOCS, init_std=None)
    ids, _, _ = bd._inputs(1, bd.K_DOCS, 16)
    counts = bd.distinct_beams(token.rag.generator, ids, 1, bd.K_DOCS, bd.BEAMS, 3)
    with pytest.raises(AssertionError, match="do not exercise"):
        bd.check_exercised(counts, bd.BEAMS, "small")


def test_beam_step_rows_against_transformers_code():
    rows = bd._beam_step_rows(CTX, 2, bd.BEAMS, bd.K_DOCS, reference=False)
    assert [r.provider for r in rows] == ["transformers", "rag_fast (cpp)"]
    assert all(len(r.runs_ms) == 5 and r.spread is not None for r in rows)
    assert rows[1].extra["same candidates"] is True
    assert rows[1].extra["speedup"] == pytest.approx(rows[0].median_ms / rows[1].median_ms)


@pytest.mark.slow
def test_generation_rows_same_ids_every_run_and_static_cache_baseline(monkeypatch):
    monkeypatch.setattr(bd, "VOCAB", 4000)  # the bench's rows, on a smaller vocabulary (CI time)
    ctx = dataclasses.replace(CTX)
    rows = bd._generation_rows(ctx, "small", bd.GENERATORS["small"],
                               {bd.TOKEN: (1, 3), bd.SEQUENCE: (2, 3)})
    by_case: dict[str, dict[str, harness.Row]] = {}
    for r in rows:
        by_case.setdefault(r.case.split(",")[0], {})[r.provider] = r
    assert set(by_case) == {"RAG-Token beam search", "RAG-Sequence thorough"}
    for case in by_case.values():
        for r in case.values():
            assert len(r.runs_ms) == 5 and r.extra["same ids"] is True
            assert r.extra["distinct top beams"] >= 2
        assert case["rag_fast"].extra["x transformers"] == pytest.approx(
            case["transformers"].median_ms / case["rag_fast"].median_ms)
    # transformers' static cache keeps its RAG-Sequence ids (a baseline), not RAG-Token's.
    seq, tok = by_case["RAG-Sequence thorough"], by_case["RAG-Token beam search"]
    assert "transformers (static cache)" in seq and "x static cache" in seq["rag_fast"].extra
    assert "transformers (static cache)" not in tok
    assert tok["rag_fast"].extra["static cache same ids"] is False


def _row(case, provider, times, **extra):
    return harness.Row.of("decoding", case, provider, harness.Measurement.of(times), extra)


def test_render_states_method_ratios_and_noise():
    base = harness.Measurement.of([100.0, 101, 102, 99, 100])
    fast = harness.Measurement.of([20.0, 21, 20, 22, 20])
    static = harness.Measurement.of([90.0, 91, 150, 92, 90])  # noisy
    common = {"same ids": True, "distinct top beams": 5, "distinct hypotheses": 20}
    tok = "RAG-Token beam search, small generator, B=8 K=5 beams=4 new=20"
    seq = "RAG-Sequence thorough, small generator, B=8 K=5 beams=4 new=20"
    rows = [harness.Row.of("decoding", tok, "transformers", base, common),
            harness.Row.of("decoding", tok, "rag_fast", fast, common)]
    harness.add_ratio(rows[1], "x transformers", base, fast)
    rows += [harness.Row.of("decoding", seq, "transformers", base, common),
             harness.Row.of("decoding", seq, "transformers (static cache)", static, common),
             harness.Row.of("decoding", seq, "rag_fast", fast, common)]
    harness.add_ratio(rows[-1], "x transformers", base, fast)
    harness.add_ratio(rows[-1], "x static cache", static, fast)
    results = {"machine": harness.machine_description("cpu"),
               "args": {"quick": False, "only": ["decoding"], "device": "cpu"},
               "rows": [dataclasses.asdict(r) for r in rows]}
    text = bd.render(results, "cpu-decoding.json")
    caption, table = text.split("\n\n")
    assert "`benchmarks/results/cpu-decoding.json`" in caption
    assert "`python benchmarks/run.py --full --only decoding`" in caption
    assert results["machine"]["cpu"] in caption and "5 timed runs" in caption
    lines = table.splitlines()
    assert lines[2] == (f"| {tok} | 20 (10%) | 100 (3%) | ids differ: not timed | 5.00x | - "
                        "| yes, every run | 5 / 20 |")
    assert lines[3] == (f"| {seq} | 20 (10%) | 100 (3%) | 91 (66%) | 5.00x | 4.55x (noisy) "
                        "| yes, every run | 5 / 20 |")
    assert "noisy (timing)" in caption
    with pytest.raises(ValueError, match="no 'decoding' rows"):
        bd.render({"machine": results["machine"], "rows": []}, "x.json")


def test_render_says_when_ids_differ():
    m = harness.Measurement.of([10.0] * 5)
    case = "RAG-Token beam search, small generator, B=1 K=5 beams=4 new=3"
    extra = {"distinct top beams": 5, "distinct hypotheses": 20}
    rows = [_row(case, "transformers", [10.0] * 5, **{"same ids": True, **extra}),
            _row(case, "rag_fast", [10.0] * 5, **{"same ids": False, **extra})]
    harness.add_ratio(rows[1], "x transformers", m, m)
    results = {"machine": harness.machine_description("cpu"),
               "rows": [dataclasses.asdict(r) for r in rows]}
    assert "| NO |" in bd.render(results, "x.json")


def test_bench_decoding_generators_are_the_issue_sizes():
    assert bd.GENERATORS["small"] == (256, 2, 4, 1024)
    assert bd.GENERATORS["BART-base-sized"] == (768, 6, 12, 3072)
    assert bd.VOCAB == 50265 and bd.K_DOCS == 5 and bd.BEAMS == 4 and bd.GEN_REPEATS >= 5
