"""GPU parity of the index, with the device boundary mocked (this machine has no GPU; the
real-GPU check is ``test_retrieval_index.py::test_gpu_search_or_clear_error``).

faiss GPU is stood in for by the CPU index itself behind the interface faiss GPU has with
torch tensors, and the "GPU" tensors live on the CPU: what is tested is everything rag_fast
does around faiss GPU (which index types move, with which options, the settings passed, the
exact re-rank, the fallback and its one warning).
"""
from __future__ import annotations

import warnings

import faiss
import numpy as np
import pytest
import torch

from rag_fast.retrieval import DenseIndex
from rag_fast.retrieval import index as index_module
from rag_fast.retrieval.index import exact_search, faiss_gpu_supports

D = 32


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(7)
    centres = rng.standard_normal((40, D)).astype(np.float32)
    xb = centres[rng.integers(0, 40, 3000)] + 0.4 * rng.standard_normal((3000, D)).astype(np.float32)
    q = centres[rng.integers(0, 40, 64)] + 0.4 * rng.standard_normal((64, D)).astype(np.float32)
    return xb, q


class _FakeGpuIndex:
    """faiss GPU's raw search (pointers to the query and result memory) on a CPU clone."""

    def __init__(self, cpu_index, calls):
        self.cpu_index, self.calls = faiss.clone_index(cpu_index), calls

    def search_c(self, n, x, k, distances, labels, params=None):
        self.calls.append({"k": k, "nprobe": getattr(params, "nprobe", None)})
        self.cpu_index.search_c(n, x, k, distances, labels, params)


# What faiss GPU's cloner (faiss/gpu/GpuCloner.cpp, ToGpuCloner::clone_Index) moves, written
# out here rather than asked of rag_fast's faiss_gpu_supports, so the fake refuses what faiss
# refuses even where rag_fast's own list is wrong: flat, IVF-Flat, IVF-SQ, and IVF-PQ whose
# codes are 8 bits ("Bits per code must be 8"); HNSW, fast-scan PQ and plain PQ have no GPU
# version.
_FAISS_GPU_TYPES = ("IndexFlat", "IndexFlatIP", "IndexFlatL2", "IndexIVFFlat", "IndexIVFScalarQuantizer")


def _faiss_gpu_has(index) -> bool:
    index = faiss.downcast_index(index)
    name = type(index).__name__
    if name == "IndexIVFPQ":
        return index.pq.nbits == 8
    return name in _FAISS_GPU_TYPES


@pytest.fixture
def fake_gpu(monkeypatch):
    """faiss with one GPU; returns the list of moves (options) and searches made."""
    moves, calls = [], []

    def to_all_gpus(index, co=None):
        if not _faiss_gpu_has(index):  # what faiss GPU itself refuses
            raise RuntimeError("This index type is not implemented on the GPU")
        moves.append({"shard": co.shard, "useFloat16": co.useFloat16})
        return _FakeGpuIndex(index, calls)

    class ClonerOptions:  # faiss.GpuMultipleClonerOptions' fields that matter here
        shard, useFloat16 = False, True

    monkeypatch.setattr(index_module, "faiss_gpu_count", lambda: 1)
    monkeypatch.setattr(faiss, "index_cpu_to_all_gpus", to_all_gpus, raising=False)
    monkeypatch.setattr(faiss, "GpuMultipleClonerOptions", ClonerOptions, raising=False)
    monkeypatch.setattr(index_module, "_warned", set())
    return moves, calls


def _on_gpu(index):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        index._attach(torch.device("cpu"))  # the CPU stands in for the GPU
    return [str(w.message) for w in seen if issubclass(w.category, RuntimeWarning)]


def _same_ids_up_to_ties(gpu, cpu, tol=1e-4):
    """The GPU's scores are the CPU's, and so are its ids, except at a position whose CPU score
    ties with another position's of the same query: there the GPU may hold any id the CPU put
    in that tie (a mismatch elsewhere, or an id from outside the tie, fails)."""
    (gs, gi), (cs, ci) = gpu, cpu
    gs, gi = gs.numpy(), gi.numpy()
    np.testing.assert_allclose(gs, cs, rtol=0, atol=tol)
    for i, j in zip(*np.nonzero(gi != ci)):
        tie = np.abs(cs[i] - cs[i, j]) < tol  # the positions of query i tied with position j
        assert tie.sum() > 1 and gi[i, j] in ci[i][tie], (
            f"query {i}, position {j}: GPU id {gi[i, j]} != CPU id {ci[i, j]} where the scores do "
            f"not tie (CPU scores {cs[i].tolist()}, ids {ci[i].tolist()}; GPU ids {gi[i].tolist()})")


@pytest.mark.parametrize("factory,rerank", [("Flat", None), ("IVF32,Flat", None),
                                            ("IVF32,PQ8", 4), ("IVF32,SQ8", 2)])
def test_faiss_gpu_types_search_like_the_cpu(data, fake_gpu, factory, rerank):
    """The types faiss GPU has move there and give the CPU's ids, with the same nprobe and the
    same exact re-rank (rerank * max(k, 10) candidates re-scored against the fp16 vectors)."""
    moves, calls = fake_gpu
    xb, q = data
    index = DenseIndex.build(xb, factory, rerank=rerank, nprobe=2, progress=False)
    assert _on_gpu(index) == [] and index._gpu[0] == "faiss"
    assert moves == [{"shard": True, "useFloat16": False}]
    qt = torch.from_numpy(q)
    for kw in ({}, {"nprobe": 8}, {"nprobe": 32}) if "IVF" in factory else ({},):
        for extra in ({}, {"rerank": 2}) if rerank else ({},):
            calls.clear()
            gpu = index._search_gpu(qt, 10, kw.get("nprobe"), None, extra.get("rerank"))
            cpu = index.search(q, 10, **kw, **extra)
            _same_ids_up_to_ties(gpu, cpu)
            factor = extra.get("rerank", rerank) or 1
            assert calls == [{"k": 10 * factor,
                              "nprobe": kw.get("nprobe", 2) if "IVF" in factory else None}]
    if rerank:  # the re-rank is what makes the results exact-ish: without it they differ
        assert (index._search_gpu(qt, 10, 32, None, None)[1].numpy()
                == exact_search(index.embeddings, qt, 10)[1].numpy()).mean() > 0.95


@pytest.mark.parametrize("preset,says", [("ivfpq", "faiss GPU has no version of 'IVF64,PQ4x4fs'"),
                                         ("hnsw", "faiss GPU has no version of 'HNSW32'")])
def test_types_without_faiss_gpu_fall_back_to_exact_search_with_one_warning(data, fake_gpu, preset, says):
    moves, calls = fake_gpu
    xb, q = data
    index = DenseIndex.build(xb, preset, progress=False)
    said = _on_gpu(index)
    assert len(said) == 1 and said[0].startswith(says) and "searched exactly with torch" in said[0]
    assert _on_gpu(DenseIndex.build(xb, preset, progress=False)) == []  # said once
    qt = torch.from_numpy(q)
    scores, ids = index._search_gpu(qt, 10, None, None, None)
    truth = exact_search(index.embeddings, qt, 10)
    assert torch.equal(ids, truth[1]) and moves == [] and calls == []


def test_faiss_without_gpu_support_or_a_failed_move_fall_back_with_the_reason(data, fake_gpu, monkeypatch):
    xb, q = data
    index = DenseIndex.build(xb, "IVF32,Flat", progress=False)
    monkeypatch.setattr(index_module, "faiss_gpu_count", lambda: 0)
    said = _on_gpu(index)
    assert len(said) == 1 and said[0].startswith("faiss has no GPU support (pip install faiss-gpu")
    monkeypatch.setattr(index_module, "faiss_gpu_count", lambda: 1)

    def out_of_memory(index, co=None):
        raise RuntimeError("Error in ...: cudaMalloc error out of memory")

    monkeypatch.setattr(faiss, "index_cpu_to_all_gpus", out_of_memory, raising=False)
    said = _on_gpu(index)
    assert len(said) == 1 and "cannot hold 'IVF32,Flat' (Error in ...: cudaMalloc error out of memory)" in said[0]
    assert index._gpu[0] == "torch"


def test_gpu_search_validates_like_the_cpu(data, fake_gpu):
    xb, q = data
    index = DenseIndex.build(xb, "IVF32,PQ8", rerank=4, progress=False)
    _on_gpu(index)
    qt = torch.from_numpy(q)
    for kw, match in (({"nprobe": 0}, "nprobe must be an int >= 1"), ({"rerank": 0}, "rerank must be an int >= 1"),
                      ({"ef_search": 0}, "ef_search must be an int >= 1")):
        with pytest.raises(ValueError, match=match):
            index._search_gpu(qt, 10, kw.get("nprobe"), kw.get("ef_search"), kw.get("rerank"))
    with pytest.raises(ValueError, match="queries contain NaN or inf"):
        index._search_gpu(torch.full_like(qt, float("nan")), 10, None, None, None)
    no_rerank = DenseIndex.build(xb, "IVF32,Flat", progress=False)
    _on_gpu(no_rerank)
    with pytest.raises(ValueError, match="built without re-ranking"):
        no_rerank._search_gpu(qt, 10, None, None, 4)


def test_moving_to_a_gpu_leaves_cpu_searches_working(data, fake_gpu):
    """Defect: the GPU move imported faiss.contrib.torch_utils, which replaces ``search`` on
    every faiss class with one that takes no ``params``: every CPU search after it raised."""
    xb, q = data
    index = DenseIndex.build(xb, "IVF32,PQ8", rerank=4, progress=False)
    before = index.search(q, 10, nprobe=4)
    _on_gpu(index)
    other = DenseIndex.build(xb, "ivfpq", progress=False)
    for idx in (index, other):
        idx.search(q, 10, nprobe=4)
    np.testing.assert_array_equal(index.search(q, 10, nprobe=4)[1], before[1])


def test_supported_types():
    def make(f):
        return faiss.index_factory(D, f, faiss.METRIC_INNER_PRODUCT)

    assert [faiss_gpu_supports(make(f)) for f in ("Flat", "IVF16,Flat", "IVF16,PQ8", "IVF16,SQ8")] == [True] * 4
    assert [faiss_gpu_supports(make(f)) for f in ("HNSW32", "IVF16,PQ8x4fs", "IVF16,PQ8x4", "PQ8")] == [False] * 4


def test_describe_says_what_a_search_runs_and_is_never_saved(data, fake_gpu, tmp_path, monkeypatch):
    """``describe()`` carries what the search actually runs, on the CPU and, after ``to``, for
    CUDA queries (faiss GPU, or exact torch search and why); ``cuda_search`` says the latter
    before anything moves; ``to("cpu")`` forgets it; and none of it reaches the manifest."""
    import json

    xb, _ = data
    ivfpq = DenseIndex.build(xb, "ivfpq", progress=False)
    factory = ivfpq.factory
    d = ivfpq.describe()
    assert d["search"] == f"faiss {factory} on the CPU, re-ranked exactly over the fp16 vectors"
    assert d["searched_by"] == {"cpu": "faiss", "cuda": None}
    why = f"faiss GPU has no version of {factory!r} (HNSW and fast-scan PQ stay on the CPU"
    assert ivfpq.cuda_search().startswith(f"exact, torch over the fp16 vectors on cuda, as {why}")
    _on_gpu(ivfpq)
    d = ivfpq.describe()
    assert d["searched_by"] == {"cpu": "faiss", "cuda": "torch_exact"}
    assert d["search"].startswith(f"faiss {factory} on the CPU, re-ranked exactly over the fp16 "
                                  f"vectors; CUDA queries: exact, torch over the fp16 vectors on "
                                  f"cpu, as {why}")  # the CPU stands in for cuda:0
    ivfpq.save(tmp_path / "ivfpq")  # runtime state, not saved
    manifest = json.loads((tmp_path / "ivfpq" / "manifest.json").read_text())
    assert not {"search", "searched_by", "search_quality"} & set(manifest)
    loaded = DenseIndex.load(tmp_path / "ivfpq")
    assert loaded.describe()["searched_by"] == {"cpu": "faiss", "cuda": None}
    assert ivfpq.to("cpu").describe()["searched_by"]["cuda"] is None

    pq8 = DenseIndex.build(xb, "IVF32,PQ8", rerank=4, nprobe=2, progress=False)
    assert pq8.cuda_search() == "faiss GPU IVF32,PQ8 over 1 GPU, re-ranked exactly over the fp16 vectors"
    _on_gpu(pq8)
    assert pq8.describe()["searched_by"] == {"cpu": "faiss", "cuda": "faiss_gpu"}
    assert pq8.describe()["search"].endswith("; CUDA queries: faiss GPU IVF32,PQ8 over 1 GPU, "
                                             "re-ranked exactly over the fp16 vectors")

    exact = DenseIndex.build(xb, "exact", progress=False)
    assert exact.describe()["searched_by"] == {"cpu": "rag_fast.inner_products", "cuda": None}
    assert exact.describe()["search"] == ("exact, rag_fast's inner-product kernel over the fp32 "
                                          "vectors on the CPU")
    monkeypatch.setattr(index_module, "faiss_gpu_count", lambda: 0)
    assert exact.cuda_search() == ("exact, torch over the fp16 vectors on cuda, as faiss has no "
                                   "GPU support (pip install faiss-gpu to search IVF indexes on "
                                   "the GPU)")
    monkeypatch.setattr(index_module, "_has_inner_products", lambda: False)
    assert exact.describe()["searched_by"]["cpu"] == "faiss"
    assert exact.describe()["search"].startswith("exact, faiss IndexFlatIP on the CPU (rag_fast's "
                                                 "inner-product kernel is missing")
