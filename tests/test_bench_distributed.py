"""benchmarks/bench_distributed.py on a tiny corpus: real gloo process groups of 1 and 2 ranks,
both layouts and both presets; rows carry every timed step, memory per rank that follows the
sharding, and the renderer writes one line per row. The 21M-passage plan: docs/scale.md is what
the committed rates render to, and its figures follow the rates."""
from __future__ import annotations

import json
import pathlib
import sys

import pytest

BENCH = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))

bench = pytest.importorskip("bench_distributed")  # noqa: E402  (needs faiss, like the bench)
from harness import Context  # noqa: E402


@pytest.mark.slow
def test_rows_memory_and_render(monkeypatch):
    # run from the repository root, as the README runs benchmarks/run.py: the ranks must still
    # import the installed rag_fast (with its compiled kernels), not the source folder there
    # (each rank raises if it lacks the kernels the parent has)
    monkeypatch.chdir(BENCH.parent)
    monkeypatch.setattr(bench, "SIZES", {True: (3_000, ("exact", "ivfpq"))})
    monkeypatch.setattr(bench, "WORLDS", (1, 2))
    rows = bench.run(Context(device="cpu", quick=True, repeats=5, warmup=2))
    assert [(r.extra["preset"], r.extra["W"], r.provider) for r in rows] == [
        (p, w, layout) for p in ("exact", "ivfpq") for w in (1, 2)
        for layout in ("full index per rank", "sharded")]
    for r in rows:
        assert len(r.runs_ms) == 5 and all(t > 0 for t in r.runs_ms)
        assert r.median_ms == sorted(r.runs_ms)[2]
        assert r.extra["RSS MB/rank"] > r.extra["index MB/rank"] > 0
    exact = {(r.extra["W"], r.provider): r.extra["index MB/rank"] for r in rows if r.extra["preset"] == "exact"}
    full = exact[(1, "full index per rank")]
    # exact: 4 d bytes (fp32 flat) + 2 d bytes (fp16 vectors) per passage
    assert full == pytest.approx(3_000 * 6 * bench.D / 2**20, abs=0.05)  # rounded to 0.1 MB
    assert exact[(2, "full index per rank")] == full
    assert exact[(2, "sharded")] == pytest.approx(full / 2, abs=0.1)  # the larger of 1500 + 1500
    for r in rows:
        assert (r.extra["recv KB/rank"] > 0) == (r.provider == "sharded")
        assert r.extra["vs full, same W"] == pytest.approx(
            next(f.median_ms for f in rows if f.case == r.case and f.provider != "sharded") / r.median_ms)
    text = bench.render({"machine": {"cpu": "test cpu", "cpu_count": 2, "torch": "2.0+cpu"},
                         "args": {"quick": True, "only": ["distributed"]}, "rows": [vars(r) for r in rows]}, "x.json")
    assert text.count("\n| exact, 3,000 x 768 |") == 4 and text.count("\n| ivfpq, 3,000 x 768 |") == 4
    assert "`benchmarks/results/x.json`" in text and "--only distributed" in text


def test_questions_come_from_the_saved_space():
    """A rank draws its questions from the topics and basis the parent saved: seeded by rank
    and step, of the corpus's dimension, around the topics' directions (not sub-topics)."""
    import bench_index
    import numpy as np

    space = bench_index.SyntheticSpace.for_corpus(2000)
    q = bench._questions(space.topics, space.basis, 1, 3)
    assert q.shape == (bench.QUESTIONS, bench_index.D) and q.dtype == np.float32
    assert np.array_equal(q, bench._questions(space.topics, space.basis, 1, 3))
    assert not np.array_equal(q, bench._questions(space.topics, space.basis, 0, 3))
    latent = q @ space.basis.T  # back in the latent space: near a topic
    assert (latent @ space.topics.T).max(1).min() > 0.3


def test_step_bytes_formula():
    # queries all-gathered (4 d W n) dominate; results 12 k W n; fetched fp16 vectors 2 d n k
    w, n, k, d = 4, 8, 5, 768
    expected = 48 * w + 4 * d * w * n + 8 + 12 * k * w * n + 8 + 8 * w + 8 * n * k + 2 * d * n * k + 8 * w
    assert bench.step_bytes(w, n, k, d) == expected
    assert bench.step_bytes(8, n, k, d) > bench.step_bytes(4, n, k, d)


def test_render_rejects_results_without_rows():
    with pytest.raises(ValueError, match="no rows of the 'distributed' bench"):
        bench.render({"machine": {}, "rows": []}, "empty.json")


# ---- the 21M-passage plan (benchmarks/measure_rates.py, docs/scale.md) --------------------------
def _rates():
    import json

    import measure_rates

    with open(measure_rates.DEFAULT_OUT, encoding="utf-8") as f:
        return measure_rates, json.load(f)


def test_scale_doc_is_what_the_committed_rates_render_to():
    measure_rates, _ = _rates()
    assert measure_rates.main(["--check"]) == 0


def test_plan_figures_follow_the_rates(tmp_path):
    measure_rates, rates = _rates()
    n = measure_rates.N_PLAN
    sections = measure_rates.plan_sections(rates)
    codes = measure_rates.per_passage(rates)["ivfpq codes+ids"]
    assert 48 <= codes < 64  # 96 x 4-bit codes + an 8-byte id, measured
    row = next(line for line in sections["memory"].splitlines() if line.startswith("| ivfpq"))
    assert row.strip("| ").split(" | ")[1:5] == [measure_rates._gb(n / w * codes) for w in measure_rates.WORLDS]
    # twice the encoding rate halves the encoding rows; the exact preset's size does not move
    faster = json.loads(json.dumps(rates))
    for e in faster["encoding"].values():
        e["per_s"] *= 2
    enc = lambda s: [line for line in s["time"].splitlines() if line.startswith("| encode")]  # noqa: E731
    first = enc(measure_rates.plan_sections(faster))[0].split(" | ")[1]
    assert first == measure_rates._hours(n / (2 * rates["encoding"]["all-MiniLM-L6-v2"]["per_s"]))
    assert measure_rates.plan_sections(faster)["bytes"] == sections["bytes"]
    # a doc whose generated table was edited by hand fails --check and is rewritten by --render
    doc = tmp_path / "scale.md"
    doc.write_text(measure_rates.DOC.read_text().replace("| exact | faiss `Flat`", "| exact | edited"))
    assert measure_rates.main(["--check", "--doc", str(doc)]) == 1
    assert measure_rates.main(["--render", "--doc", str(doc)]) == 0
    assert doc.read_text() == measure_rates.DOC.read_text()


def _count_worker(rank, world, emb, n, k, totals):
    """One sharded retrieval step with every collective's received bytes counted."""
    import numpy as np
    import torch
    import torch.distributed as dist

    from rag_fast.retrieval import DenseIndex, ShardedIndex

    lo, hi = bench._shard_bounds(len(emb), world, rank)
    sharded = ShardedIndex(DenseIndex.build(emb[lo:hi], "exact", progress=False), lo)
    received = [0]
    real = {name: getattr(dist, name) for name in ("all_gather", "all_reduce", "all_to_all_single")}

    def all_gather(out, tensor, *a, **kw):
        received[0] += sum(t.numel() * t.element_size() for t in out)
        return real["all_gather"](out, tensor, *a, **kw)

    def all_reduce(tensor, *a, **kw):
        received[0] += tensor.numel() * tensor.element_size()
        return real["all_reduce"](tensor, *a, **kw)

    def all_to_all_single(out, tensor, *a, **kw):
        received[0] += out.numel() * out.element_size()
        return real["all_to_all_single"](out, tensor, *a, **kw)

    for name, fn in (("all_gather", all_gather), ("all_reduce", all_reduce),
                     ("all_to_all_single", all_to_all_single)):
        setattr(dist, name, fn)
    q = torch.from_numpy(np.random.default_rng(rank).standard_normal((n, emb.shape[1])).astype(np.float32))
    sharded.retrieve(q, n_docs=k)
    for name, fn in real.items():
        setattr(dist, name, fn)
    every = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(every, torch.tensor([received[0]]))
    if rank == 0:
        totals.put([int(t) for t in every])


@pytest.mark.parametrize("world", [2, 4])
def test_step_bytes_counts_what_the_collectives_receive(world):
    """Summed over the ranks, the bytes a sharded step's collectives receive are W times
    step_bytes (which spreads the winners evenly; the real spread only moves the asked ids
    between ranks, never their total)."""
    import multiprocessing

    import numpy as np
    from test_retrieval_sharded import run_ranks

    n, k, d = 3, 4, 32
    emb = np.random.default_rng(0).standard_normal((200, d)).astype(np.float32)
    totals = multiprocessing.get_context("forkserver").Manager().Queue()
    run_ranks(world, _count_worker, emb, n, k, totals)
    per_rank = totals.get(timeout=5)
    assert len(per_rank) == world and min(per_rank) > 0
    assert sum(per_rank) == world * bench.step_bytes(world, n, k, d)
