"""benchmarks/bench_serve.py's load generator and checks, on the tiny serving model: locust's
figures are read back, and the swap case's check counts an answer whose passages are not the
named index's as "mixed" (so 0 mixed answers in the committed results means something)."""
from __future__ import annotations

import json
import pathlib
import sys

import pytest

BENCH_DIR = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH_DIR))

import bench_serve  # noqa: E402

from rag_fast.serving.answerer import index_checksum  # noqa: E402


def _ids(path: pathlib.Path) -> list[str]:
    return [json.loads(x)["id"] for x in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def server(serving_world):
    s = bench_serve._Server(serving_world["bart"], 8)
    yield s
    s.stop()
    assert s.proc.returncode == 0


def _locust(url, body, tmp_path, indexes) -> dict:
    """A 2 s locust run at 2 clients; once more over 10 s when none was answered in 2 s (a busy
    machine: locust's start-up and the first answers share the cores with other tests)."""
    try:
        return bench_serve._locust(url, 2, 2, body, tmp_path, indexes)
    except RuntimeError as e:
        if "no request was answered" not in str(e):
            raise
        return bench_serve._locust(url, 2, 10, body, tmp_path, indexes)


def test_locust_run_is_read_back_and_mixed_answers_are_counted(server, serving_world, tmp_path):
    checksum = index_checksum(serving_world["kb_a"])
    right = tmp_path / "right.json"
    right.write_text(json.dumps({checksum: _ids(serving_world["root"] / "a.jsonl")}))
    body = {"num_beams": 1, "max_new_tokens": 2}
    good = _locust(server.url, body, tmp_path, right)
    assert good["requests"] > 0 and good["failures"] == 0 and good["mixed"] == 0
    assert good["rps"] > 0 and 0 < good["p50"] <= good["p99"]
    wrong = tmp_path / "wrong.json"  # the index's checksum, another index's passages
    wrong.write_text(json.dumps({checksum: _ids(serving_world["root"] / "b.jsonl")}))
    bad = _locust(server.url, body, tmp_path, wrong)
    assert bad["requests"] > 0 and bad["mixed"] == bad["failures"] == bad["requests"]


def test_stages_and_resident_memory_are_read_from_the_server(server):
    server.post("/v1/answer", {"question": "paris", "num_beams": 1, "max_new_tokens": 2})
    stages = server.stages()
    assert set(stages) == {"encode", "retrieve", "contexts", "decode"}
    assert all(v > 0 for v in stages.values())
    assert server.rss_mb() > 10


def test_render_names_every_case_and_the_swap_figures():
    row = {"bench": "serve", "case": "workflow model, greedy, 8 clients", "provider":
           "batching on", "median_ms": 10.0, "spread": 0.05, "runs_ms": [10.0, 10.5],
           "extra": {"req/s": 100.0, "req/s runs": [99.0, 101.0], "p50 ms": 50.0, "p99 ms": 90.0,
                     "failures": 0, "x 1 client": 4.2, "x batching off": 2.6,
                     "server ms per question by stage": {"encode": 1.0, "retrieve": 0.1,
                                                         "contexts": 0.2, "decode": 8.0}}}
    swap = {**row, "case": "swap case", "extra": {
        **row["extra"], "swaps ok": 10, "swaps": 10, "mixed answers": 0, "RSS MB before": 500.0,
        "RSS MB after": 510.0, "RSS change": 0.02}}
    results = {"rows": [row, swap], "args": {"quick": False},
               "machine": {"cpu": "a CPU", "cpu_count": 2, "torch": "2.13.0"}}
    text = bench_serve.render(results, "cpu-serve-full.json")
    assert ("| workflow model, greedy, 8 clients | on | 100.00 (5%) | 50 | 90 | 4.20x | 2.60x"
            in text)
    assert "10 of 10 swaps answered 200, 0 failed requests, 0 mixed answers" in text
    assert "(+2.0%)" in text and "benchmarks/results/cpu-serve-full.json" in text
