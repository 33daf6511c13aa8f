"""The LM-head loss bench: its ratios and memory accounting, and the README section its
renderer writes from a results file."""
from __future__ import annotations

import dataclasses
import pathlib
import sys

import pytest

BENCH_DIR = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH_DIR))

import bench_lm_head  # noqa: E402
import harness  # noqa: E402

MACHINE = {"cpu": "Test CPU", "cpu_count": 2, "torch": "2.13.0+cpu", "rag_fast_simd": "avx512"}


def _m(times, peak):
    return harness.Measurement.of(times, peak)


def _rows():
    measured = {
        bench_lm_head.FUSED: _m([5000, 5050, 4990, 5010, 5005], 560.0),
        bench_lm_head.MATERIALIZED: _m([4000, 4020, 3990, 4010, 4005], 1300.0),
        bench_lm_head.EAGER: _m([30000, 30500, 29900, 30100, 30050], 4500.0),
    }
    case = "token eps=0.1 float32 B4 K5 T64 d896 V151936 fwd+bwd"
    # gradients returned: 540 MiB; logits: 742 MiB
    return bench_lm_head._rows(case, measured, grads_mb=540.0, logits_mb=742.0)


def test_rows_carry_both_ratios_and_memory_beyond_the_gradients():
    rows = {r.provider: r for r in _rows()}
    fused = rows[bench_lm_head.FUSED]
    assert fused.extra["speedup vs materialized"] == pytest.approx(4005 / 5005)
    assert fused.extra["speedup vs transformers"] == pytest.approx(30050 / 5005)
    assert fused.extra["extra MiB"] == pytest.approx(20.0)
    assert fused.extra["extra % logits"] == pytest.approx(20 / 742 * 100)
    assert rows[bench_lm_head.MATERIALIZED].extra["extra MiB"] == pytest.approx(760.0)


def test_render_states_the_method_and_the_time_ratio_as_fused_over_materialized():
    results = {"machine": MACHINE, "args": {"quick": False, "repeats": 5, "only": ["lm_head"]},
               "rows": [dataclasses.asdict(r) for r in _rows()]}
    caption, table = bench_lm_head.render(results, "cpu-lm-head-full.json").split("\n\n")
    assert "`benchmarks/results/cpu-lm-head-full.json`" in caption
    assert "--full --only lm_head --repeats 5" in caption
    assert "B4, K5, T64, d896, V151936" in caption and "`log_softmax`" in caption
    line = table.splitlines()[2]
    assert line == ("| RAG-Token, eps 0.1 | 5005 | 1% | 1.25x | 6.0x "
                    "| 20 MiB (2.7%) / 760 MiB (102.4%) / 3960 MiB (533.7%) |")
