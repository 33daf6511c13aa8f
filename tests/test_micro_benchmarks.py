"""The pytest-benchmark micro-benchmarks (benchmarks/test_micro.py) run, check their results and
save every case: one quick pass (one round each) in a child pytest, as
``pytest benchmarks --benchmark-only`` runs them, with the project's pytest settings. And the
tuning command (benchmarks/tune.py, docs/tuning.md) sweeps, reports and restores each setting."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest
import torch
from utils import requires_ext

ROOT = Path(__file__).resolve().parents[1]
BENCH_DIR = ROOT / "benchmarks"

# group prefix -> the providers each such group must hold
EXPECTED = {
    "token loss eps=0.0 fwd ": {"cpp", "torch"},
    "token loss eps=0.0 fwd+bwd ": {"cpp", "torch"},
    "token loss eps=0.1 fwd ": {"cpp", "torch"},
    "token loss eps=0.1 fwd+bwd ": {"cpp", "torch"},
    "sequence loss eps=0.1 fwd ": {"cpp", "torch"},
    "sequence loss eps=0.1 fwd+bwd ": {"cpp", "torch"},
    "token marginal fwd ": {"cpp", "torch"},
    "token marginal fwd+bwd ": {"cpp", "torch"},
    "token beam step ": {"cpp", "torch"},
    "index search ": {"rag_fast exact", "rag_fast ivfpq", "torch exact"},
}


def _provider(benchmark: dict) -> str:
    params = benchmark["params"]
    return params.get("impl") or params["provider"]


@requires_ext
def test_micro_benchmarks_run_and_save_every_case(tmp_path):
    out = tmp_path / "micro.json"
    # (not as a worker of a parallel run, `pytest -n N`: pytest-benchmark would then skip)
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")},
           "RAG_FAST_MICRO_SIZE": "small"}
    # cwd outside the checkout: the child imports the installed rag_fast, as this process does
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", str(BENCH_DIR), "-q", "-p", "no:cacheprovider",
         "--benchmark-only", "--benchmark-min-rounds=1", "--benchmark-max-time=0",
         "--benchmark-warmup=off", f"--benchmark-storage={tmp_path / 'storage'}",
         f"--benchmark-json={out}"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert "skipped" not in proc.stdout.splitlines()[-1], proc.stdout[-2000:]
    report = json.loads(out.read_text())
    assert report["machine_info"]["rag_fast"]["micro_size"] == "small"

    groups: dict[str, set[str]] = defaultdict(set)
    for bench in report["benchmarks"]:
        # only the test modules are collected, never the bench_*.py of benchmarks/run.py
        assert bench["fullname"].startswith("benchmarks/test_"), bench["fullname"]
        assert bench["stats"]["rounds"] >= 1 and bench["stats"]["median"] > 0, bench["name"]
        groups[bench["group"]].add(_provider(bench))
    for prefix, providers in EXPECTED.items():
        found = [g for g in groups if g.startswith(prefix)]
        assert len(found) == 1, f"expected one group {prefix!r}..., found {found} in {sorted(groups)}"
        assert groups[found[0]] == providers, (found[0], groups[found[0]])
    assert len(groups) == len(EXPECTED), sorted(groups)



def test_micro_check_rejects_one_wrong_entry():
    """The micro-benchmarks' result check sees a single entry off by 1% among 50,000 small ones
    (a gradient's size), and passes the float32 rounding of the oracle."""
    spec = importlib.util.spec_from_file_location("rag_fast_micro", BENCH_DIR / "test_micro.py")
    micro = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(micro)
    g = torch.Generator().manual_seed(0)
    want = torch.randn(5, 10_000, generator=g, dtype=torch.float64) / 10_000
    micro.assert_close(want.float(), want, "rounded")
    wrong = want.float().clone()
    wrong[3, 1234] *= 1.01
    with pytest.raises(AssertionError, match="1 of 50000 elements"):
        micro.assert_close(wrong, want, "planted")


# ---- benchmarks/tune.py (docs/tuning.md) -----------------------------------------------------
TINY_KERNELS = ["--batch", "1", "--docs", "2", "--tokens", "3", "--vocab", "70", "--beam-batch", "1",
                "--beams", "2", "--rounds", "1"]


@pytest.fixture(scope="module")
def tune():
    spec = importlib.util.spec_from_file_location("rag_fast_tune", BENCH_DIR / "tune.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _tune(tune, tmp_path, capsys, *args: str) -> dict:
    out = tmp_path / "tune.json"
    assert tune.main([*args, "--json", str(out)]) == 0
    assert "best here" in capsys.readouterr().out
    return json.loads(out.read_text())


def test_tune_lm_head_chunk_times_every_candidate_and_the_value_in_use(tune, tmp_path, capsys):
    from rag_fast.models import _seq2seq

    before = _seq2seq.LM_HEAD_CHUNK
    result = _tune(tune, tmp_path, capsys, "lm-head-chunk", "--rows", "6", "--dim", "8",
                   "--vocab", "300", "--candidates", "64,300", "--rounds", "2")
    assert _seq2seq.LM_HEAD_CHUNK == before == result["current"]  # restored after the sweep
    values = [r["value"] for r in result["rows"]]
    assert values == [str(v) for v in sorted({64, 300, before})]
    assert min(r["vs_best"] for r in result["rows"]) == 1.0
    assert all(r["min_ms"] <= r["median_ms"] <= r["max_ms"] for r in result["rows"])


def test_tune_lm_head_tile_times_every_tile_size_and_the_one_in_use(tune, tmp_path, capsys):
    lin = importlib.import_module("rag_fast.ops.linear_rag_nll")  # the module, not the function

    result = _tune(tune, tmp_path, capsys, "lm-head-tile", "--batch", "1", "--docs", "2",
                   "--tokens", "3", "--dim", "8", "--vocab", "700", "--candidates", "1,2",
                   "--rounds", "1")
    assert result["setting"] == "TILE_BYTES" and result["current"] == lin.TILE_BYTES
    assert [r["value"] for r in result["rows"]] == [
        str(v) for v in sorted({1, 2, lin.TILE_BYTES >> 20})]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_tune_lm_head_tile_on_cuda_without_a_gpu_says_so(tune, capsys):
    assert tune.main(["lm-head-tile", "--device", "cuda"]) == 2
    assert "no CUDA device" in capsys.readouterr().err


@requires_ext
def test_tune_cpp_threads_times_each_kernel_and_restores_the_count(tune, tmp_path, capsys):
    from rag_fast import _ext

    before = _ext.get().num_threads()
    result = _tune(tune, tmp_path, capsys, "cpp-threads", "--candidates", "1,2", *TINY_KERNELS)
    assert _ext.get().num_threads() == before
    assert set(result["totals_ms"]) == {"1", "2"}
    assert len(result["kernels"]) == 5
    assert all({r["value"] for r in rows} == {"1", "2"} for rows in result["kernels"].values())


@requires_ext
def test_tune_cpp_simd_runs_the_variant_asked_for(tune, tmp_path, capsys):
    result = _tune(tune, tmp_path, capsys, "cpp-simd", "--candidates", "generic", *TINY_KERNELS)
    assert set(result["totals_ms"]) == {"generic"}  # the child ran the variant it was given


def test_tune_help_lists_only_the_public_commands(tune, capsys):
    with pytest.raises(SystemExit):
        tune.main(["--help"])
    out = capsys.readouterr().out
    assert "lm-head-tile" in out and "cpp-simd" in out
    assert "SUPPRESS" not in out and "_kernel-times" not in out


@pytest.mark.parametrize(("args", "name"), [
    (["lm-head-chunk", "--candidates", "0,512"], "--candidates"),
    (["cpp-simd", "--candidates", "sse"], "--candidates"),
    (["cpp-threads", "--rounds", "0"], "--rounds"),
])
def test_tune_rejects_bad_arguments_naming_them(tune, capsys, args, name):
    with pytest.raises(SystemExit) as exc:
        tune.main(args)
    assert exc.value.code == 2 and name in capsys.readouterr().err
