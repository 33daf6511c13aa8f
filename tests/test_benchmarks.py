"""The benchmark harness: timing, tables and the JSON it writes."""
from __future__ import annotations

import json
import pathlib
import sys

import pytest

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
    assert table[0] == "| bench | case | provider | median ms | peak MB | speedup | GB/s |"
    assert table[3] == "| b | case | fast | 1.000 | - | 2 | 3.5 |"
    out = tmp_path / "r" / "x.json"
    harness.write_json(str(out), rows, harness.machine_description("cpu"), {"quick": True})
    payload = json.loads(out.read_text())
    assert payload["rows"][1]["extra"]["GB/s"] == 3.5 and "cpu" in payload["machine"]
    assert [p.name for p in out.parent.iterdir()] == ["x.json"]  # no temp file left behind


def test_every_bench_is_discovered_and_unknown_names_are_refused(capsys):
    assert set(bench_run.available_benches()) >= {"losses", "index", "decoding", "training"}
    with pytest.raises(SystemExit):
        bench_run.main(["--only", "no-such-bench"])
    assert "unknown bench" in capsys.readouterr().err


def test_curves_are_plotted_not_tabled(tmp_path):
    rows = [harness.Row("index", "data batch (B=128)", "rag_fast exact", 10.0, None, {"QPS": 100.0, "x exact": 1.0}),
            harness.Row("index", "data batch (B=128)", "rag_fast ivfpq", 1.0, None,
                        {"QPS": 1000.0, "x exact": 10.0, "curve": [[1, 0.8, 3000.0], [8, 0.97, 1000.0]]})]
    assert "curve" not in harness.markdown_table(rows)
    png = tmp_path / "plot.png"
    assert harness.plot_curves(rows, str(png)) and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not harness.plot_curves(rows[:1], str(tmp_path / "none.png"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plot.png"]


def test_readme_tables_are_what_the_committed_results_render_to(tmp_path):
    """The README's generated sections equal what benchmarks/render.py makes of the committed
    JSON; an edited figure is caught and named."""
    import render

    readme = BENCH_DIR.parent / "README.md"
    for name in render.SECTIONS:
        assert render.readme_section(readme.read_text(), name) == render.rendered(name), name
    assert render.main(["--check"]) == 0
    edited = tmp_path / "README.md"
    text = readme.read_text()
    section = render.readme_section(text, "index")
    line = next(line for line in section.splitlines() if line.startswith("| real text"))
    cells = line.split(" | ")
    cells[2] = "0.999"  # a hand-typed recall
    edited.write_text(text.replace(line, " | ".join(cells)))
    assert render.main(["--check", "--readme", str(edited)]) == 1
    assert render.main(["--readme", str(edited)]) == 0 and edited.read_text() == text
