"""The training and losses benches: their rows' ratios against both baselines, and the README
sections their renderers write from a results file."""
from __future__ import annotations

import dataclasses
import pathlib
import sys

import pytest

BENCH_DIR = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH_DIR))

import bench_losses  # noqa: E402
import bench_training  # noqa: E402
import harness  # noqa: E402
from memory import StepMemory  # noqa: E402

MACHINE = {"cpu": "Test CPU", "cpu_count": 2, "torch": "2.13.0+cpu", "rag_fast_simd": "avx2"}


def _m(times):
    return harness.Measurement.of(times)


def _results(rows, quick=False):
    return {"machine": MACHINE, "args": {"quick": quick, "repeats": None, "only": ["training"]},
            "rows": [dataclasses.asdict(r) for r in rows]}


def _training_rows(with_compiled=True):
    measured = {"transformers": _m([1000, 1010, 990, 1005, 995]),
                "rag_fast": _m([500, 505, 495, 502, 498]),
                "rag_fast materialized": _m([450, 455, 445, 452, 448])}
    mem = {"transformers": StepMemory(1000.0, 400.0, 600.0, 300.0),
           "rag_fast": StepMemory(700.0, 100.0, 600.0, 300.0),
           "rag_fast materialized": StepMemory(760.0, 100.0, 660.0, 300.0)}
    if with_compiled:
        measured["transformers compiled"] = _m([800, 810, 790, 805, 795])
        mem["transformers compiled"] = StepMemory(900.0, 300.0, 600.0, 300.0)
        measured["rag_fast compiled"] = _m([420, 425, 415, 422, 418])
        mem["rag_fast compiled"] = StepMemory(800.0, 200.0, 600.0, 300.0)
    case = "bart-base sequence B=4 K=5 L=64 T=32"
    compile_s = {"transformers compiled": 42.0, "rag_fast compiled": 30.0} if with_compiled \
        else None
    return bench_training._rows(case, measured, mem, compile_s)


def test_training_rows_carry_both_ratios_and_whole_step_memory():
    rows = {r.provider: r for r in _training_rows()}
    ours = rows["rag_fast"]
    assert ours.extra["speedup vs eager"] == pytest.approx(1000 / 500)
    assert ours.extra["speedup vs compiled"] == pytest.approx(800 / 500)
    assert ours.peak_mb == 700.0  # the whole-step peak, not the step's extra
    assert ours.extra["memory vs eager"] == pytest.approx(0.7)
    assert ours.extra["memory vs compiled"] == pytest.approx(700 / 900)
    assert ours.extra["step extra MB"] == 100.0
    assert rows["transformers compiled"].extra["compile s"] == 42.0
    assert "compile s" not in ours.extra
    assert ours.noisy == [] and len(ours.runs_ms) == 5


def test_training_ratio_within_noise_is_flagged():
    measured = {"transformers": _m([1000, 1300, 900, 1000, 1000]),
                "rag_fast": _m([950, 960, 940, 950, 955])}
    rows = bench_training._rows("small token B=4 K=5 L=64 T=16", measured, {}, None)
    eager, ours = rows
    assert "timing" in eager.noisy
    assert "speedup vs eager" in ours.noisy and "speedup vs compiled" not in ours.extra


def test_training_render_states_method_and_both_baselines():
    text = bench_training.render(_results(_training_rows()), "cpu-training-full.json")
    caption, table = text.split("\n\n")
    assert "`benchmarks/results/cpu-training-full.json`" in caption
    assert "Test CPU, 2 cores, rag_fast avx2, torch 2.13.0" in caption
    assert "fresh process" in caption and "warm step keeping its gradients" in caption
    assert "bare process" in caption and "--full --only training" in caption
    assert "materialized" in caption and "logits_to_keep" in caption
    lines = table.splitlines()
    assert len(lines) == 3
    # logits of 4*5*31 rows x 50265 entries (125 MB): the default path is the materialized one
    assert bench_training.default_path("bart-base sequence B=4 K=5 L=64 T=32") == "materialized"
    assert lines[2] == ("| BART-base-sized (d 768, 6+6 layers) | RAG-Sequence | materialized logits "
                        "| 450 | 2% | 2.22x | 1.78x | 760 / 1,000 / 900 | 0.76x | 0.84x "
                        "| fused: 2.00x, 700 | 420 ms: 2.38x eager, 1.90x compiled, 800 MB "
                        "| - | 42 / 30 |")


def test_training_render_without_compiled_says_so():
    rows = _training_rows(with_compiled=False)
    rows[1].noisy.append("speedup vs eager")
    text = bench_training.render(_results(rows, quick=True), "x.json")
    assert "--quick --only training" in text and "compiled baseline was not run" in text
    row = text.splitlines()[-1]
    assert ("| materialized logits | 450 | 2% | 2.22x | not run | 760 / 1,000 / - | 0.76x | - "
            "| fused: 2.00x (noisy), 700 | not run | - | - / - |") in row


def _loss_rows():
    read = _m([10, 10.5, 9.8, 10.1, 10.2])
    measured = {"transformers": _m([380, 385, 379, 390, 381]),
                "transformers compiled": _m([132, 135, 131, 140, 133]),
                "rag_fast torch": _m([300, 301, 305, 299, 302]),
                "rag_fast fused": _m([32, 33, 31, 32, 32.5])}
    for name, m in measured.items():
        m.peak_mb = {"transformers": 123 * 5.4, "rag_fast fused": 123.0}.get(name, 200.0)
    case = "token eps=0.1 float32 B4 K5 T32 V50265"
    rows = [harness.Row.of("losses", f"{case} fwd", "read (floor)", read, {"vs read": 1.0})]
    rows += bench_losses._rows(f"{case} fwd+bwd", measured, read, 123.0, "fwd+bwd", 7.5)
    return rows


def test_loss_rows_and_render():
    rows = {r.provider: r for r in _loss_rows()}
    fused = rows["rag_fast fused"]
    assert fused.extra["speedup vs eager"] == pytest.approx(381 / 32)
    assert fused.extra["speedup vs compiled"] == pytest.approx(133 / 32)
    assert fused.extra["extra mem % logits"] == pytest.approx(0.0)
    assert rows["transformers"].extra["extra mem % logits"] == pytest.approx(440)
    assert rows["transformers compiled"].extra["compile s"] == 7.5
    text = bench_losses.render(_results(_loss_rows()), "cpu-losses-full.json")
    caption, table = text.split("\n\n")
    assert "`torch.compile`" in caption and "compile time" in caption and "B4, K5, T32" in caption
    assert table.splitlines()[2] == ("| RAG-Token, eps 0.1 | float32 | fwd+bwd | 32.0 | 6% | 11.9x "
                                     "| 4.2x | 3.2x | 0.0% / 440% / 63% | 8 |")


def test_quick_loss_rows_without_the_compiled_baseline():
    """--quick times no compiled baseline: its rows carry the eager ratio only."""
    read = _m([10, 10.5, 9.8, 10.1, 10.2])
    measured = {"transformers": _m([380, 385, 379, 390, 381]),
                "rag_fast fused": _m([32, 33, 31, 32, 32.5])}
    rows = bench_losses._rows("token eps=0.1 float32 B4 K5 T8 V50265 fwd", measured, read, 30.0,
                              "fwd", None)
    fused = next(r for r in rows if r.provider == "rag_fast fused")
    assert fused.extra["speedup vs eager"] == pytest.approx(381 / 32)
    assert "speedup vs compiled" not in fused.extra and fused.noisy == []


def test_decoder_only_baseline_loss_equals_the_reference():
    """The decoder-only case's baseline computes the RAG loss as transformers' RAG models do:
    it must equal rag_fast's reference on the same logits (else the row compares nothing)."""
    import torch

    from rag_fast import reference

    g = torch.Generator().manual_seed(0)
    B, K, T, V = 2, 3, 5, 40
    logits = torch.randn(B * K, T, V, generator=g, dtype=torch.float64)
    scores = torch.randn(B, K, generator=g, dtype=torch.float64)
    answers = torch.randint(3, V, (B, T), generator=g)
    answers[0, -2:] = 1  # padding
    for mode, ref in (("token", reference.rag_token_nll), ("sequence", reference.rag_sequence_nll)):
        got = bench_training.materialized_rag_loss(logits, scores, answers, mode, pad=1)
        want = ref(logits.view(B, K, T, V), scores, answers, ignore_index=1, reduction="mean")
        torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6, msg=mode)


def test_training_caption_says_how_the_steps_were_timed():
    rows = _training_rows()
    results = _results(rows)
    # files from before the timing processes
    assert "the providers' steps alternating in one process" in bench_training.render(results,
                                                                                        "x.json")
    cases = [("allocator", "glibc default", "allocator as it is by default"),
             ("allocator", "glibc, 1 MiB mmap threshold", "unmap freed blocks of 1 MiB or more"),
             # files from before the other benches recorded it named the field so
             ("time allocator", "glibc default", "allocator as it is by default")]
    for field, words, said in cases:
        for r in results["rows"]:
            r["extra"].pop("allocator", None)
            r["extra"].pop("time allocator", None)
            r["extra"][field] = words
            for key in ("warm-up steps", "rounds", "timed steps/process"):
                r["extra"].pop(key, None)
        text = bench_training.render(results, "x.json")
        assert said in text and "each provider alone in fresh processes (2 rounds" in text
        # a file without the warm-up count ran one warm-up step; a newer one says its count
        assert "take turns, one warm-up step then 3 timed ones" in text
        for r in results["rows"]:
            r["extra"]["warm-up steps"] = 3
        assert "take turns, 3 warm-up steps then 3 timed ones" in bench_training.render(
            results, "x.json")
        # a quick run's rows record one round of 5 timed steps, and the caption says so
        for r in results["rows"]:
            r["extra"].update({"rounds": 1, "timed steps/process": 5})
        assert ("fresh processes (one process per provider, the providers taking turns, "
                "3 warm-up steps then 5 timed ones per process)") in bench_training.render(
            results, "x.json")


def test_a_case_is_timed_provider_by_provider_in_fresh_processes(monkeypatch):
    """``time_case`` with a stand-in for ``memory.call_fresh``: rounds in which the providers
    take turns, every process's steps kept, the work and compile time of the first round."""
    import memory

    calls = []

    def fake(function, mode, size, target, provider, device, steps, warmup, first, *, env,
             timeout, label):
        calls.append((provider, first, env, warmup))
        n = len(calls)
        return {"times_ms": [float(n)] * steps, "gflop": 7.0 if first else None,
                "compile_s": (3.0 if first else 1.0) if provider.endswith(" compiled")
                else None, "allocator": env[harness.ALLOCATOR_ENV],
                "faults": [n] * steps, "system_s": [0.5] * steps}

    monkeypatch.setattr(memory, "call_fresh", fake)
    providers = ["transformers", "transformers compiled", "rag_fast", "rag_fast compiled"]
    got = bench_training.time_case("token", "small", 16, providers, "cpu", "default", rounds=2,
                                   steps=3)
    assert [c[0] for c in calls] == providers * 2
    assert [c[1] for c in calls] == [True] * 4 + [False] * 4
    # every process settles for WARMUP_STEPS untimed steps (3: a fresh process's allocations
    # took that long to settle)
    assert [c[3] for c in calls] == [bench_training.WARMUP_STEPS] * 8
    assert bench_training.WARMUP_STEPS == 3
    assert got["times_ms"]["rag_fast"] == [3.0] * 3 + [7.0] * 3
    assert got["faults"]["transformers"] == 3.0 and got["system_s"]["rag_fast"] == 0.5
    # each compiled provider's compile time of its first round
    assert got["compile_s"] == {"transformers compiled": 3.0, "rag_fast compiled": 3.0}
    assert got["gflop"] == {p: 7.0 for p in providers}
    assert got["allocator"] == "default"


def test_training_rows_record_the_allocator_of_their_timing_processes(monkeypatch):
    """``run`` (quick) with stand-ins for the timing, the loss check and the matmul rate: every
    row records the allocator of the processes that timed it, which run.py's stamp keeps."""
    import memory

    def fake_time_case(mode, size_name, target, providers, device, allocator, rounds, steps):
        return {"times_ms": {p: [100.0 + i] * steps for i, p in enumerate(providers)},
                "gflop": {}, "compile_s": None, "allocator": allocator,
                "faults": dict.fromkeys(providers, 10), "system_s": dict.fromkeys(providers, 0.1)}

    monkeypatch.setattr(bench_training, "time_case", fake_time_case)
    monkeypatch.setattr(bench_training, "gemm_rate", lambda device: 100.0)
    monkeypatch.setattr(memory, "call_fresh", lambda *args, **kwargs: True)
    ctx = harness.Context(device="cpu", quick=True, repeats=5, warmup=1)
    for setting, words in (("default", "glibc default"), ("fixed", "glibc, 1 MiB mmap threshold")):
        monkeypatch.setenv(bench_training.TIME_ALLOCATOR_ENV, setting)
        rows = bench_training.run(ctx)
        assert len(rows) == 2 * 2 * 2  # quick: 2 sizes x 2 modes x 2 providers
        assert {r.extra["allocator"] for r in harness.stamp_allocator(rows)} == {words}
    monkeypatch.delenv(bench_training.TIME_ALLOCATOR_ENV)  # the default: as a user's process
    assert {r.extra["allocator"] for r in bench_training.run(ctx)} == {"glibc default"}


@pytest.mark.slow
def test_a_provider_is_timed_in_a_fresh_process_with_the_default_allocator():
    """What ``time_case`` asks ``memory.call_fresh`` for: the steps timed, the matmul work
    counted, in a process that left glibc alone; and the decoder-only loss check passes."""
    import memory

    got = {p: memory.call_fresh(
        "bench_training:time_provider", "sequence", "causal-small", 4, p, "cpu", 2, 1, True,
        env={harness.ALLOCATOR_ENV: "default"}) for p in ("transformers", "rag_fast materialized")}
    for r in got.values():
        assert r["allocator"] == "default" and r["compile_s"] is None
        assert len(r["times_ms"]) == 2 and min(r["times_ms"]) > 0
        assert len(r["faults"]) == 2 and min(r["system_s"]) >= 0
    # the same matmuls on both sides (the baseline keeps only the answers' logits too)
    assert got["transformers"]["gflop"] == pytest.approx(got["rag_fast materialized"]["gflop"],
                                                         rel=0.05)
    assert bench_training.check_case("sequence", "causal-small", 4,
                                     ["transformers", "rag_fast materialized"], "cpu") is True


def test_decoder_only_rows_name_their_shape():
    measured = {"transformers": _m([1000, 1010, 990, 1005, 995]),
                "rag_fast": _m([500, 505, 495, 502, 498])}
    rows = bench_training._rows("qwen2-0.5b-2l token B=2 K=5 L=64 T=32", measured, {}, None,
                                batch=2)
    assert rows[1].extra["examples/s"] == pytest.approx(2 / 0.5)
    text = bench_training.render(_results(_training_rows() + rows), "x.json")
    assert "decoder-only, Qwen2-0.5B-shaped" in text and "logits_to_keep" in text
    assert "B=4, K=5, L=64, T=32" in text  # the caption keeps the encoder-decoder shape


def test_default_path_follows_the_logits_size(monkeypatch):
    from rag_fast.models import options

    case = "qwen2-0.5b-2l token B=2 K=5 L=64 T=32"  # 2*5*32 rows x 151936 x 4 B = 194 MB
    assert bench_training.default_path(case) == "materialized"
    monkeypatch.setattr(options, "FUSED_LOGITS_BYTES", 194 * 10**6)
    assert bench_training.default_path(case) == "fused"


def test_quick_rows_name_the_lm_head_path_each_ran():
    """Plain ``rag_fast`` runs the fused path; at the quick shapes ``RagModel``'s default takes
    the materialized one: the rows (the table run.py prints) say which path is which."""
    measured = {"transformers": _m([1000, 1010, 990, 1005, 995]),
                "rag_fast": _m([500, 505, 495, 502, 498]),
                "rag_fast materialized": _m([450, 455, 445, 452, 448])}
    for case in ("small token B=4 K=5 L=64 T=16", "causal-small sequence B=2 K=5 L=64 T=16"):
        assert bench_training.default_path(case) == "materialized"
        rows = {r.provider: r for r in bench_training._rows(case, measured, {}, None)}
        assert "LM-head path" not in rows["transformers"].extra
        assert rows["rag_fast"].extra["LM-head path"] == "fused"
        assert (rows["rag_fast materialized"].extra["LM-head path"]
                == "materialized (RagModel default)")
        table = harness.markdown_table(list(rows.values()))
        assert "| LM-head path |" in table.splitlines()[0]
        assert "| rag_fast | 500.000 |" in table and "| fused |" in table
    # where the logits reach FUSED_LOGITS_BYTES the default is the fused path
    case = "qwen2-0.5b-2l token B=2 K=5 L=64 T=1000"
    assert bench_training.path_label(case, "rag_fast") == "fused (RagModel default)"
    assert bench_training.path_label(case, "rag_fast materialized") == "materialized"


def test_quick_mode_times_the_default_path_only():
    """--quick times eager and the rag_fast provider of RagModel's default path at the case."""
    assert bench_training.quick_providers("small token B=4 K=5 L=64 T=16") == [
        "transformers", "rag_fast materialized"]
    assert bench_training.quick_providers("qwen2-0.5b-2l token B=2 K=5 L=64 T=1000") == [
        "transformers", "rag_fast"]


def test_gemm_floor_rows_cell_and_caption():
    """The GEMM floor: the least matmul work of the providers over the best matmul rate; each
    row's time over it, the table's cell (rag_fast / eager) and the caption's sentence."""
    measured = {"transformers": _m([1000, 1010, 990, 1005, 995]),
                "rag_fast": _m([500, 505, 495, 502, 498]),
                "rag_fast materialized": _m([450, 455, 445, 452, 448])}
    floor = bench_training.GemmFloor(
        {"transformers": 40.0, "rag_fast": 42.0, "rag_fast materialized": 39.0}, 130.0)
    assert floor.ms == pytest.approx(39.0 / 130.0 * 1e3)  # 300 ms
    rows = bench_training._rows("bart-base token B=4 K=5 L=64 T=32", measured, {}, None,
                                floor=floor)
    by = {r.provider: r for r in rows}
    assert by["transformers"].extra["x GEMM floor"] == pytest.approx(1000 / 300)
    assert by["rag_fast materialized"].extra["x GEMM floor"] == pytest.approx(450 / 300)
    assert by["rag_fast"].extra["GFLOP"] == 42.0 and by["rag_fast"].extra["GEMM floor ms"] == 300
    text = bench_training.render(_results(rows), "x.json")
    caption, table = text.split("\n\n")
    # materialized is the default here; neither compiled provider ran
    assert "| 1.50x / - / - / 3.33x |" in table.splitlines()[-1]
    assert "(BART-base-sized: 39 GFLOP per step)" in caption
    assert "4096x4096 fp32 matmul in the same run (130 GFLOP/s" in caption


def test_step_gflop_counts_a_known_step():
    """One step of a linear layer [m, k] x [k, n]: forward 2mkn, backward 4mkn (input and
    weight gradients) flops."""
    import torch

    m, k, n = 8, 16, 4
    lin = torch.nn.Linear(k, n, bias=False)
    x = torch.randn(m, k, requires_grad=True)

    def step():
        lin(x).sum().backward()

    assert bench_training.step_gflop(step) * 1e9 == pytest.approx(6 * m * k * n)
    assert bench_training.gemm_rate("cpu", n=64, calls=2) > 0

    # in-place accumulations count too (torch's counter leaves addmm_ / baddbmm_ out)
    acc, acc3 = torch.zeros(m, n), torch.zeros(3, m, n)
    a, b = torch.randn(m, k), torch.randn(k, n)
    a3, b3 = torch.randn(3, m, k), torch.randn(3, k, n)

    def accumulate():
        acc.addmm_(a, b)
        acc3.baddbmm_(a3, b3)

    assert bench_training.step_gflop(accumulate) * 1e9 == pytest.approx(2 * m * k * n * 4)


# ---- benchmarks/profile_training.py: where a step's time goes ------------------------------

def test_profile_groups_split_gemms_by_the_vocabulary():
    import profile_training as pt

    V = 50265
    assert pt.group("aten::mm", [[620, 256], [256, 1024], [620, 1024]], V) == "other GEMMs"
    # rag_fast's LM head computes its logits 512 columns at a time (the last slice: V % 512)
    assert pt.group("aten::mm", [[620, 256], [256, 512], [620, 512]], V) == "LM-head GEMMs"
    assert pt.group("aten::mm", [[620, 256], [256, 89], [620, 89]], V) == "LM-head GEMMs"
    assert pt.group("aten::mm", [[50265, 620], [620, 256], [50265, 256]], V) == "LM-head GEMMs"
    assert pt.group("aten::addmm_", [[620, 256], [620, 50265], [50265, 256], [], []], V) \
        == "LM-head GEMMs"
    assert pt.group("aten::_scaled_dot_product_flash_attention_for_cpu_backward", [], V) \
        == "attention"
    assert pt.group("graph_0_cpp_fused_gelu_view_5", [], V) == "compiled kernels"
    assert pt.group("## Call CompiledFxGraph fabc", [], V) == "compiled kernels"
    assert pt.group("rag_fast::row_grad", [], V) == "rag_fast kernels"
    assert pt.group("aten::_fused_adamw_", [], V) == "optimizer"
    assert pt.group("Optimizer.zero_grad#AdamW.zero_grad", [], V) == "optimizer"
    assert pt.group("aten::gelu", [[1280, 1024]], V) == "other"
    assert pt.group("aten::mm", None, V) == "other GEMMs"  # no shapes recorded


def test_profile_render_has_a_table_per_case_with_the_floor():
    import profile_training as pt

    groups = dict.fromkeys(pt.GROUPS, 10.0)
    rows = [{"case": "small token B=4 K=5 L=64 T=32", "provider": p, "step_ms": ms,
             "groups": groups, "gemm_floor_ms": 250.0, "gemm_gflops": 198.0}
            for p, ms in (("transformers", 1000.0), ("rag_fast compiled", 500.0))]
    text = pt.render({"machine": MACHINE, "warmup": 3, "steps": 2, "rows": rows},
                     "cpu-training-profile.json")
    assert "benchmarks/results/cpu-training-profile.json" in text and "Test CPU" in text
    assert "small token B=4 K=5 L=64 T=32 (GEMM floor 250 ms at 198 GFLOP/s)" in text
    assert "| rag_fast compiled | 500 | 2.00x | 10 | 10 | 10 | 10 | 10 | 10 | 10 |" in text
    assert "| transformers | 1,000 | 4.00x |" in text


def test_profile_command_refuses_unknown_cases_and_modes(capsys):
    import profile_training as pt

    for argv, word in ((["--cases", "huge", "--out", "x.json"], "--cases"),
                       (["--modes", "tok", "--out", "x.json"], "--modes")):
        with pytest.raises(SystemExit) as exc:
            pt.main(argv)
        assert exc.value.code == 2 and word in capsys.readouterr().err


# ---- benchmarks/step_variants.py: the step's optional mechanisms one at a time ------------

def test_lean_switch_turns_each_recipe_off_and_restores_it():
    """Each variant of step_variants changes what the lean activations store (their registry's
    count of tensors stored by recipe), and closing the switch restores the default."""
    import torch
    from transformers import BartConfig, BartForConditionalGeneration

    import step_variants as sv
    from rag_fast.models import RagModel, _lean

    cfg = BartConfig(vocab_size=64, d_model=32, encoder_layers=1, decoder_layers=1,
                     encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64,
                     decoder_ffn_dim=64, max_position_embeddings=64)
    torch.manual_seed(0)
    model = RagModel(BartForConditionalGeneration(cfg), mode="token", n_docs=2).train()
    contexts, mask = torch.randint(3, 60, (4, 9)), torch.ones(4, 9, dtype=torch.long)
    scores, labels = torch.randn(2, 2, requires_grad=True), torch.randint(3, 60, (2, 5))
    seen = []
    real = _lean._Registry.close

    def close(registry):
        seen.append(registry.recipes)
        real(registry)

    def recipes(variant=None):
        seen.clear()
        if variant is not None:
            switch.set(variant)
        model.loss_from_contexts(contexts, mask, scores, labels).sum().backward()
        return seen[0] if seen else 0

    _lean._Registry.close = close
    switch = sv._LeanSwitch()
    try:
        counts = {v: recipes(v) for v in sv.LEAN_VARIANTS}
    finally:
        switch.close()
        try:
            after = recipes()
        finally:
            _lean._Registry.close = real
    full = counts["all recipes"]
    assert counts["off"] == 0 < full, counts
    for variant in sv.LEAN_VARIANTS[2:]:
        assert 0 < counts[variant] < full, (variant, counts)
    assert after == full  # restored


def test_step_variants_render_and_clipping_agree():
    import step_variants as sv

    clip = sv.clip_variants("small", "token", calls=1)
    assert clip["max_parameter_difference"] < 1e-6  # the scaling inside AdamW: same step
    assert set(clip["times_ms"]) == set(sv.CLIP_VARIANTS)
    lean = {v: [100.0 + i, 110.0 + i] for i, v in enumerate(sv.LEAN_VARIANTS)}
    heap = {"glibc default": {"times_ms": [500.0, 520.0], "faults": [7000, 7200],
                              "peak_rss_mb": [950.0, 951.0]},
            "freed memory kept": {"times_ms": [480.0, 490.0], "faults": [0, 2],
                                  "peak_rss_mb": [948.0, 949.0]}}
    text = sv.render({"machine": MACHINE, "case": "small token", "rounds": 2, "warmup": 2,
                      "lean_ms": lean, "clip": clip, "heap": heap, "heap_processes": 1,
                      "heap_warmup": 3}, "cpu-step-variants.json")
    assert "benchmarks/results/cpu-step-variants.json" in text and "Test CPU" in text
    assert "| all recipes | 105.0 | 100.0 - 110.0 | 1.000 |" in text
    assert "| off | 106.0 | 101.0 - 111.0 | 1.010 |" in text
    assert "| clip + step | " in text and "17M parameters" in text
    assert "| glibc default | 510.0 | 500.0 - 520.0 | 1.000 | 7,100 | 950, 951 |" in text
    assert "1 of each, alternating; 2 timed steps per process after 3 untimed" in text
    assert "| freed memory kept | 485.0 | 480.0 - 490.0 | 0.951 | 1 | 948, 949 |" in text


def test_step_variants_refuse_an_inherited_allocator_setting(monkeypatch):
    import step_variants as sv

    for name, value in (("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=0"),
                        ("RAG_FAST_BENCH_ALLOCATOR", "fixed")):
        with monkeypatch.context() as m:
            m.setenv(name, value)
            with pytest.raises(RuntimeError, match=f"{name} is set here"):
                sv.heap_variants("small", "token", processes=1)


def test_quick_training_table_has_a_row_per_case():
    """--quick times only the default path's provider (materialized at its shapes): each case
    still gets its row (the table was once empty there)."""
    measured = {"transformers": _m([1000, 1010, 990, 1005, 995]),
                "rag_fast materialized": _m([450, 455, 445, 452, 448])}
    rows = []
    for case in ("small token B=4 K=5 L=64 T=16", "small sequence B=4 K=5 L=64 T=16"):
        rows += bench_training._rows(case, measured, {}, None)
    text = bench_training.render(_results(rows, quick=True), "x.json")
    lines = text.split("\n\n")[1].splitlines()
    assert len(lines) == 4, lines
    assert "| RAG-Token | materialized logits | 450 |" in lines[2]
    assert "| RAG-Sequence | materialized logits | 450 |" in lines[3]
    assert "| 2.22x | not run |" in lines[2] and "| - | not run |" in lines[2]


def test_results_files_are_written_whole_or_not_at_all(tmp_path, monkeypatch):
    """profile_training and step_variants write their JSON through harness.write_json_file:
    a write that fails midway (a value JSON cannot hold, as a full disk would fail it) leaves
    the previous file as it was and no temp file behind."""
    target = tmp_path / "results" / "x.json"
    harness.write_json_file(str(target), {"rows": [1]}, indent=1)
    assert target.read_text(encoding="utf-8") == '{\n "rows": [\n  1\n ]\n}'
    with pytest.raises(TypeError):
        harness.write_json_file(str(target), {"rows": [object()]})
    assert target.read_text(encoding="utf-8").startswith('{\n "rows"')
    assert sorted(p.name for p in target.parent.iterdir()) == ["x.json"]
