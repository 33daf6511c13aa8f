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
                               {bd.TOKEN: (1, 3), bd.SEQUENCE: (2, 3)}, rate=50.0)
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
    for case in by_case.values():  # the floor: rag_fast's work, the least, at the run's rate
        ours, theirs = case["rag_fast"].extra, case["transformers"].extra
        assert 0 < ours["GFLOP"] <= theirs["GFLOP"] and ours["GEMM GFLOP/s"] > 0
        assert ours["GEMM floor ms"] == pytest.approx(
            ours["GFLOP"] / ours["GEMM GFLOP/s"] * 1e3, rel=0.02, abs=0.01)
        assert ours["x GEMM floor"] == pytest.approx(
            case["rag_fast"].median_ms / ours["GEMM floor ms"], rel=0.02)
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
                        "| - | yes, every run | 5 / 20 |")  # a file without the floor: "-"
    assert lines[3] == (f"| {seq} | 20 (10%) | 100 (3%) | 91 (66%) | 5.00x | 4.55x (noisy) "
                        "| - | yes, every run | 5 / 20 |")
    assert "GEMM floor" not in caption
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


def test_render_gives_each_rows_distance_to_the_gemm_floor():
    case = "RAG-Token beam search, small generator, B=8 K=5 beams=4 new=20"
    floor = {"GEMM GFLOP/s": 200.0, "GEMM floor ms": 25.0}
    common = {"same ids": True, "distinct top beams": 5, "distinct hypotheses": 20}
    rows = [_row(case, "transformers", [100.0] * 5, **common, **floor, GFLOP=6.0,
                 **{"x GEMM floor": 4.0}),
            _row(case, "rag_fast", [50.0] * 5, **common, **floor, GFLOP=5.0,
                 **{"x GEMM floor": 2.0})]
    results = {"machine": harness.machine_description("cpu"),
               "rows": [dataclasses.asdict(r) for r in rows]}
    caption, table = bd.render(results, "x.json").split("\n\n")
    assert "| 2.00x / 4.00x (25 ms) |" in table.splitlines()[2]
    assert "fp32 matmul measured in the same run (200 GFLOP/s" in caption


# ---- benchmarks/profile_decoding.py: where a decoding's time goes -------------------------

def test_profile_groups_name_what_the_floor_counts_and_what_it_does_not():
    import profile_decoding as pd

    V = 50265
    assert pd.group("aten::addmm", [[160, 768], [768, 50265]], V) == "LM-head GEMMs"
    assert pd.group("aten::mm", [[160, 768], [768, 3072]], V) == "other GEMMs"
    assert pd.group("aten::_scaled_dot_product_flash_attention_for_cpu", [], V) == "attention"
    assert pd.group("aten::bmm", [[48, 1, 64], [48, 64, 7]], V) == "attention"
    assert pd.group("aten::_log_softmax", [[160, 50265]], V) == "log-softmax"
    assert pd.group("rag_fast::beam_step", [], V) == "beam step"
    assert pd.group("aten::topk", [[8, 201060]], V) == "beam step"
    assert pd.group("aten::index_select", [], V) == "cache reorders"
    assert pd.group("aten::copy_", [], V) == "copies"
    assert pd.group("aten::layer_norm", [], V) == "other ops"
    assert set(pd.GROUPS) >= {"LM-head GEMMs", "Python and dispatch"}


def test_profile_runs_a_case_and_renders(monkeypatch, tmp_path):
    import profile_decoding as pd

    monkeypatch.setattr(bd, "VOCAB", 4000)  # the bench's case, on a smaller vocabulary
    out = tmp_path / "profile.json"
    monkeypatch.setattr(pd.bd, "QUICK_SIZES", {"small": {bd.TOKEN: (1, 2)}})
    rate = pd.bt.gemm_rate
    monkeypatch.setattr(pd.bt, "gemm_rate", lambda device: rate(device, n=256))  # CI time
    assert pd.main(["--quick", "--out", str(out)]) == 0
    import json

    results = json.loads(out.read_text())
    assert [r["provider"] for r in results["rows"]] == ["rag_fast", "transformers"]
    for r in results["rows"]:
        assert set(r["groups"]) == set(pd.GROUPS) and r["gflop"] > 0
        assert sum(r["groups"].values()) == pytest.approx(sum(r["runs_ms"]) / len(r["runs_ms"]),
                                                          rel=0.05)
        assert r["groups"]["LM-head GEMMs"] > 0 and r["groups"]["other GEMMs"] > 0
    assert results["rows"][0]["gemm_floor_ms"] == pytest.approx(
        min(r["gflop"] for r in results["rows"]) / results["rows"][0]["gemm_gflops"] * 1e3)
    text = pd.render(results, "profile.json")
    assert "| provider | GFLOP | call ms | x floor | LM-head GEMMs |" in text
    assert "RAG-Token beam search, small generator, B=1 K=5 beams=4 new=2" in text


def test_decoder_only_rows_time_rag_fast_alone_with_their_floor(monkeypatch):
    label = "decoder-only, small"
    monkeypatch.setattr(bd, "CAUSAL_GENERATORS", {label: "causal-small"})
    ctx = dataclasses.replace(CTX, repeats=2)
    rows = bd._generation_rows(ctx, label, None, {bd.TOKEN: (1, 2), bd.SEQUENCE: (1, 2)},
                               rate=50.0)
    assert [r.provider for r in rows] == ["rag_fast", "rag_fast"]
    for r in rows:
        e = r.extra
        assert e["same ids"] is True and e["distinct top beams"] >= 2
        assert e["GFLOP"] > 0 and e["x GEMM floor"] == pytest.approx(
            r.median_ms / (e["GFLOP"] / 50.0 * 1e3), rel=0.02)
    results = {"machine": harness.machine_description("cpu"),
               "rows": [dataclasses.asdict(r) for r in rows]}
    caption, table = bd.render(results, "x.json").split("\n\n")
    line = table.splitlines()[2]
    assert "| no RAG in transformers | - | - | - |" in line and "| same every run |" in line
    assert "Decoder-only rows: a Qwen2-shaped generator" in caption
