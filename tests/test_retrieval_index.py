"""DenseIndex: recall against exact search on seeded clustered data, persistence and its
failure modes, and input validation."""
from __future__ import annotations

import json
import os
import warnings

import faiss
import numpy as np
import pytest
import torch

from rag_fast.retrieval import DenseIndex, StorageError, exact_search, recall_at_k
from rag_fast.retrieval.index import plan_factory

D = 64


def clustered(n: int, seed: int, centres: int = 50) -> np.ndarray:
    """Seeded mixture of Gaussians: unit centres, noise of norm ~0.5."""
    rng = np.random.default_rng(1234)
    c = rng.standard_normal((centres, D)).astype(np.float32)
    c /= np.linalg.norm(c, axis=1, keepdims=True)
    rng = np.random.default_rng(seed)
    return (c[rng.integers(0, centres, n)] + 0.5 / np.sqrt(D) * rng.standard_normal((n, D))).astype(np.float32)


@pytest.fixture(scope="module")
def data():
    return clustered(4000, 0), clustered(200, 1), clustered(200, 2)


@pytest.fixture(scope="module")
def exact(data):
    return DenseIndex.build(data[0], "exact", progress=False)


@pytest.fixture(scope="module")
def ivfpq(data):
    return DenseIndex.build(data[0], "ivfpq", progress=False)


def truth(exact, q, k=10):
    return exact.search(q, k)[1]


def test_exact_matches_torch_exact_search(data, exact):
    xb, q, _ = data
    scores, ids = exact.search(q, 10)
    t_scores, t_ids = exact_search(exact.embeddings, torch.from_numpy(q), 10)
    assert scores.dtype == np.float32 and ids.dtype == np.int64 and ids.shape == (200, 10)
    # faiss exact runs on float32, the torch path on the fp16 copy: ranks may swap at ties.
    assert recall_at_k(t_ids.numpy(), ids) >= 0.99
    np.testing.assert_allclose(scores, np.einsum("bd,bkd->bk", q, xb[ids]), rtol=1e-4, atol=1e-4)


def _calls(monkeypatch):
    """Count the exact preset's matmul searches (rag_fast.retrieval.index.exact_search)."""
    import rag_fast.retrieval.index as index_module

    calls = []
    real = index_module.exact_search

    def counted(*args, **kwargs):
        calls.append(kwargs.get("chunk"))
        return real(*args, **kwargs)

    monkeypatch.setattr(index_module, "exact_search", counted)
    return calls


@pytest.mark.parametrize("chunk", [1 << 16, 1000])  # one block; several, merged
def test_exact_preset_searches_with_rag_fasts_kernel_as_faiss_does(data, exact, monkeypatch,
                                                                    chunk):
    """The exact preset scores faiss's own vectors with rag_fast's inner-product kernel:
    faiss IndexFlatIP's results (the same ids wherever scores are not within rounding of each
    other, scores to float32 rounding), for numpy and torch queries, a batch or one query."""
    import rag_fast.retrieval.index as index_module

    xb, q, _ = data
    monkeypatch.setattr(index_module, "FLAT_CHUNK", chunk)
    calls = _calls(monkeypatch)
    k = 17
    want_s, want_i = exact.faiss_index.search(q, k)  # faiss IndexFlatIP itself
    scores, ids = exact.search(q, k)
    assert calls == [chunk]
    assert scores.dtype == np.float32 and ids.dtype == np.int64 and ids.shape == (len(q), k)
    np.testing.assert_allclose(scores, want_s, rtol=0, atol=2e-6)
    np.testing.assert_allclose(scores, np.einsum("bd,bkd->bk", q, xb[ids]), rtol=0, atol=2e-6)
    gap = np.minimum(np.diff(want_s, axis=1, prepend=np.inf), -np.diff(want_s, axis=1, append=-np.inf))
    clear = np.abs(gap) > 1e-5  # a rank whose score is apart from both neighbours'
    assert clear.mean() > 0.9 and np.array_equal(ids[clear], want_i[clear])
    t_scores, t_ids = exact.search(torch.from_numpy(q), k)
    assert torch.equal(t_ids, torch.from_numpy(ids)) and torch.equal(t_scores, torch.from_numpy(scores))
    s_one, i_one = exact.search(q[7:8], k)  # a query alone: its row of the batch, bit for bit
    assert len(calls) == 3 and np.array_equal(s_one, scores[7:8]) and np.array_equal(i_one, ids[7:8])
    import rag_fast.retrieval._exact as exact_module

    monkeypatch.setattr(exact_module, "PER_PAIR_SCORE_BYTES", 4 * 1000 * 7)  # 7 queries at a time
    s_blocks, i_blocks = exact.search(q, k)
    assert np.array_equal(s_blocks, scores) and np.array_equal(i_blocks, ids)


def test_exact_scores_do_not_depend_on_the_batch_or_the_shard(data):
    """A (question, passage) score is the same bit for bit whichever questions share the batch
    and however the corpus is cut (pieces of one vector, of a partial tile, of thousands)."""
    xb, q, _ = data
    whole = DenseIndex.build(xb, "exact", progress=False)
    s, i = whole.search(q[:60], len(xb))
    full = np.empty((60, len(xb)), np.float32)
    np.put_along_axis(full, i, s, 1)
    for b0, b1 in ((0, 1), (3, 4), (5, 29), (0, 60)):
        s_b, i_b = whole.search(q[b0:b1], 40)
        assert np.array_equal(s_b, np.take_along_axis(full[b0:b1], i_b, 1))
    for a, b in ((0, 1), (1, 8), (8, 1001), (1001, 3999), (3999, 4000)):
        piece = DenseIndex.build(xb[a:b], "exact", progress=False)
        s_p, i_p = piece.search(q[:60], b - a)
        assert np.array_equal(s_p, np.take_along_axis(full[:, a:b], i_p, 1)), (a, b)


def test_exact_batch_lists_ties_by_descending_id_as_faiss(monkeypatch):
    """0/1 vectors tie in whole numbers, exactly in float32: the exact preset lists equal scores
    by descending id, as faiss does, with faiss's scores; the other presets never take its
    path."""
    rng = np.random.default_rng(5)
    xb = (rng.random((700, 16)) < 0.3).astype(np.float32)
    q = (rng.random((40, 16)) < 0.3).astype(np.float32)
    index = DenseIndex.build(xb, "exact", progress=False)
    calls = _calls(monkeypatch)
    k = 12
    scores, ids = index.search(q, k)
    assert len(calls) == 1
    want_s, want_i = index.faiss_index.search(q, k)
    assert np.array_equal(scores, want_s)
    exact_scores = q @ xb.T
    for row in range(len(q)):
        assert np.array_equal(exact_scores[row, ids[row]], scores[row])
        for a, b, sa, sb in zip(ids[row], ids[row][1:], scores[row], scores[row][1:]):
            assert sa > sb or (sa == sb and a > b), (row, ids[row], scores[row])
        kth = scores[row, -1]  # above the k-th score the lists hold the same ids
        assert np.array_equal(ids[row][scores[row] > kth], want_i[row][want_s[row] > kth])
    from rag_fast import _ext
    from rag_fast.retrieval import index as index_module

    monkeypatch.setattr(index_module, "_warned", set())
    for stale in (False, True):  # no compiled extension, or one built before the kernel
        monkeypatch.setattr(_ext, "available", lambda: stale)
        if stale:
            monkeypatch.setattr(_ext, "get", lambda: object())
        calls.clear()
        with warnings.catch_warnings(record=True) as seen:  # the fallback is said once
            warnings.simplefilter("always")
            assert [a.tolist() for a in index.search(q, k)] == [want_s.tolist(), want_i.tolist()]
        assert len(seen) == (0 if stale else 1) and calls == []
    monkeypatch.undo()
    calls = _calls(monkeypatch)
    hnsw = DenseIndex.build(clustered(800, 3), "hnsw", progress=False)
    calls.clear()
    hnsw.search(clustered(40, 4), 5)
    assert calls == []


def test_exact_preset_without_the_kernel_warns_once_and_searches_with_faiss(data, monkeypatch):
    """Without rag_fast's inner-product kernel the exact preset searches with faiss IndexFlatIP,
    whose scores depend on the batch: one warning per process says so, the cause and the fix;
    the results stay faiss's exact ones. Approximate indexes never take that path: no warning."""
    from rag_fast.retrieval import index as index_module

    xb, q, _ = data
    monkeypatch.setattr(index_module, "_warned", set())
    monkeypatch.setattr(index_module, "_has_inner_products", lambda: False)
    calls = _calls(monkeypatch)
    index, other = (DenseIndex.build(xb[:n], "exact", progress=False) for n in (4000, 3000))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        results = [index.search(q[:b], 10) for b in (1, 7, 200)] + [other.search(q, 5)]
    said = [str(w.message) for w in seen]
    assert len(said) == 1 and seen[0].category is RuntimeWarning, said
    assert seen[0].filename == __file__  # points at the search call
    assert said[0].startswith("exact index searched with faiss IndexFlatIP instead of rag_fast's "
                              "inner-product kernel (rag_fast._C has no inner_products")
    for part in ("depends on the batch", "distance_compute_blas_threshold",
                 "ShardedIndex's exact results may differ", "ties and last bits", "`pip install .`",
                 "`pip install -e .`", "repository root"):
        assert part in said[0], part
    assert calls == []  # faiss searched, not the kernel
    for (scores, ids), (b, k) in zip(results, ((1, 10), (7, 10), (200, 10))):
        want_s, want_i = index.faiss_index.search(q[:b], k)
        assert np.array_equal(ids, want_i) and np.array_equal(scores, want_s)
        np.testing.assert_allclose(scores, np.einsum("bd,bkd->bk", q[:b], xb[ids]), rtol=1e-4,
                                   atol=1e-4)
    assert recall_at_k(results[2][1], exact_search(xb, torch.from_numpy(q), 10)[1].numpy()) >= 0.99
    monkeypatch.setattr(index_module, "_warned", set())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for preset in ("hnsw", "IVF32,Flat"):
            DenseIndex.build(xb, preset, progress=False).search(q, 10)


def test_ivfpq_recall_against_exact(data, exact, ivfpq):
    _, q, _ = data
    assert ivfpq.factory.startswith("IVF64,PQ8x4fs")
    found = ivfpq.search(q, 10, nprobe=8, rerank=8)[1]
    # observed 0.985 (4000 x 64, 50 clusters, seed 0)
    assert recall_at_k(found, truth(exact, q)) >= 0.95
    # Re-ranking is what makes 4-bit codes usable: without it recall drops (observed 0.18).
    assert recall_at_k(ivfpq.search(q, 10, nprobe=8, rerank=1)[1], truth(exact, q)) < 0.9


def test_tune_reaches_target_on_held_out(data, exact):
    xb, q, held_out = data
    index = DenseIndex.build(xb, "ivfpq", progress=False)
    choice = index.tune(0.95, queries=held_out, k=10)
    assert choice["reached"] and choice["recall"] >= 0.95
    assert index.params["nprobe"] == choice["nprobe"] and index.params["rerank"] == choice["rerank"]
    # the tuned defaults hold on other queries; observed 0.996 (tuned: nprobe=2, rerank=16)
    assert recall_at_k(index.search(q, 10)[1], truth(exact, q)) >= 0.93


@pytest.mark.parametrize("preset, floor", [("hnsw", 0.95), ("IVF32,Flat", 0.95)])  # observed 1.0, 1.0
def test_other_presets_recall(data, exact, preset, floor):
    xb, q, _ = data
    index = DenseIndex.build(xb, preset, progress=False)
    kw = {"ef_search": 64} if preset == "hnsw" else {"nprobe": 8}
    assert recall_at_k(index.search(q, 10, **kw)[1], truth(exact, q)) >= floor


def test_torch_queries_give_torch_results(data, ivfpq):
    _, q, _ = data
    scores, ids = ivfpq.search(torch.from_numpy(q).double(), 5)
    assert scores.dtype == torch.float32 and ids.dtype == torch.int64 and ids.shape == (200, 5)
    np_scores, np_ids = ivfpq.search(q, 5)
    np.testing.assert_array_equal(ids.numpy(), np_ids)


def test_missing_results_are_minus_one_and_minus_inf():
    # Two far-apart clusters in 64 lists: nprobe=1 sees too few vectors for k=100 (no re-rank).
    xb = clustered(2000, 3)
    index = DenseIndex.build(xb, "IVF64,Flat", progress=False)
    scores, ids = index.search(xb[:3], 100, nprobe=1)
    assert (ids == -1).any()
    assert np.all(np.isneginf(scores[ids == -1])) and np.all(np.isfinite(scores[ids >= 0]))


def test_save_load_round_trip_identical(tmp_path, data, ivfpq):
    _, q, _ = data
    ivfpq.save(tmp_path / "idx")
    loaded = DenseIndex.load(tmp_path / "idx")
    for a, b in zip(ivfpq.search(q, 10), loaded.search(q, 10)):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(loaded.embeddings, ivfpq.embeddings)
    assert loaded.params == ivfpq.params and loaded.factory == ivfpq.factory
    assert sorted(os.listdir(tmp_path / "idx")) == ["index.faiss", "manifest.json", "vectors.faiss"]


def _saved(tmp_path, index) -> str:
    path = tmp_path / "idx"
    index.save(path)
    return path


@pytest.mark.parametrize("name", ["index.faiss", "vectors.faiss"])
def test_flipped_byte_is_a_clear_error(tmp_path, exact, name):
    path = _saved(tmp_path, exact)
    with open(path / name, "r+b") as f:
        f.seek(os.path.getsize(path / name) // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x10]))
    with pytest.raises(StorageError, match=f"{name}.*checksum"):
        DenseIndex.load(path)


def test_truncated_file_is_a_clear_error(tmp_path, exact):
    path = _saved(tmp_path, exact)
    size = os.path.getsize(path / "vectors.faiss")
    os.truncate(path / "vectors.faiss", size - 100)
    with pytest.raises(StorageError, match="truncated"):
        DenseIndex.load(path, verify=False)


def test_dimension_mismatch_is_a_clear_error(tmp_path, exact):
    from rag_fast.storage import sealed

    path = _saved(tmp_path, exact)
    with pytest.raises(ValueError, match="expected_dim=384 does not match the index dimension 64"):
        DenseIndex.load(path, expected_dim=384)
    # Files of a 32-d index under a 64-d manifest whose checksums were updated to match.
    other = DenseIndex.build(np.eye(32, dtype=np.float32), "exact", progress=False)
    other.save(tmp_path / "other")
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"] = json.loads((tmp_path / "other" / "manifest.json").read_text())["files"]
    (path / "manifest.json").write_text(json.dumps(sealed(manifest)))  # resealed, as if accepted
    for name in ("index.faiss", "vectors.faiss"):
        os.replace(tmp_path / "other" / name, path / name)
    with pytest.raises(StorageError, match="dimension mismatch"):
        DenseIndex.load(path)


def test_not_an_index_is_a_clear_error(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(StorageError, match="no manifest.json"):
        DenseIndex.load(tmp_path / "empty")
    with pytest.raises(StorageError, match="not a directory"):
        DenseIndex.load(tmp_path / "missing")


def test_interrupted_save_leaves_nothing(tmp_path, exact, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    real = faiss.write_index
    calls = []

    def write_then_interrupt(index, path):  # the first file is written, the second is not
        calls.append(path)
        if len(calls) == 2:
            interrupted()
        real(index, path)

    monkeypatch.setattr(faiss, "write_index", write_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        exact.save(tmp_path / "idx")
    assert not (tmp_path / "idx").exists()
    assert os.listdir(tmp_path) == []  # no temporary directory left either


def test_bad_input_names_the_argument(data, exact):
    xb, q, _ = data
    with pytest.raises(ValueError, match="queries must have d=64 columns"):
        exact.search(q[:, :32], 5)
    with pytest.raises(ValueError, match=r"queries must have shape \[B, d=64\]"):
        exact.search(q[0], 5)
    with pytest.raises(ValueError, match="k=5000 must be <= the number of indexed vectors"):
        exact.search(q, 5000)
    with pytest.raises(ValueError, match="k must be a positive int"):
        exact.search(q, 0)
    bad = q.copy()
    bad[3, 7] = np.nan
    with pytest.raises(ValueError, match=r"queries contain NaN or inf \(row 3\)"):
        exact.search(bad, 5)
    with pytest.raises(ValueError, match="queries must be a floating"):
        exact.search(q.astype(np.int64), 5)
    with pytest.raises(ValueError, match="queries must be a numpy array or torch tensor"):
        exact.search(q.tolist(), 5)
    with pytest.raises(ValueError, match="embeddings: the corpus is empty"):
        DenseIndex.build(np.zeros((0, D), np.float32), "exact", progress=False)
    with pytest.raises(ValueError, match=r"embeddings must have shape \[N, d\]"):
        DenseIndex.build(np.zeros(D, np.float32), "exact", progress=False)
    with pytest.raises(ValueError, match=r"embeddings contain NaN or inf \(row 2\)"):
        DenseIndex.build(np.where(np.arange(10)[:, None] == 2, np.inf, xb[:10]), "exact", progress=False)
    with pytest.raises(ValueError, match="has 256 inverted lists but the corpus has 100 vectors"):
        plan_factory("IVF256,Flat", 100, D)  # checked before anything is encoded
    with pytest.raises(ValueError) as e:
        DenseIndex.build(xb, "nonsense", progress=False)
    # faiss's reason without its source location
    assert str(e.value) == ("preset 'nonsense' is not a preset ('exact', 'hnsw', 'ivfpq') nor a "
                            "valid faiss factory string: could not parse index string nonsense")


@pytest.mark.parametrize("n", [1, 2, 100, 623])
@pytest.mark.parametrize("preset", ["ivfpq", "hnsw", "exact"])
def test_presets_adapt_to_a_small_corpus(data, n, preset):
    """No preset fails on a small corpus: below 624 vectors every preset is exact search."""
    xb = data[0][:n]
    assert plan_factory(preset, n, D) == "Flat"
    index = DenseIndex.build(xb, preset, progress=False, target_recall=0.95)
    quality = index.describe()["search_quality"]
    assert index.factory == "Flat" and quality["recall"] == 1.0 and quality["k"] == min(10, n)
    assert index.search(xb[:1], min(5, n))[1][0, 0] == 0


def test_build_measures_and_stores_the_cheapest_settings_reaching_the_target(data, tmp_path):
    xb, q, held_out = data
    index = DenseIndex.build(xb, "ivfpq", progress=False, target_recall=0.95)
    quality = index.describe()["search_quality"]
    assert quality["reached"] and quality["recall"] >= 0.95 and quality["queries"] == 1000
    assert quality["settings"] == index.params and quality["ms_per_query"] > 0
    assert quality["query_source"] == "corpus (leave-one-out)"
    # the measured recall is the leave-one-out recall of the stored defaults on those vectors:
    # each sampled vector's own row is left out of its exact and approximate top 10
    rows = np.sort(np.random.default_rng(0).choice(len(xb), 1000, replace=False))
    sample = index.embeddings[rows].astype(np.float32)
    truth = exact_search(index.embeddings, torch.from_numpy(sample), 11)[1].numpy()
    found = index.search(sample, 11)[1]

    def without_self(ids):
        return np.stack([[i for i in row if i != own][:10] for row, own in zip(ids, rows)])

    assert recall_at_k(without_self(found), without_self(truth)) == pytest.approx(
        quality["recall"], abs=1e-4)
    same = np.mean([set(f[:5]) == set(t[:5]) for f, t in zip(without_self(found), without_self(truth))])
    assert same == pytest.approx(quality["same_top5"], abs=1e-4) and same >= 0.95
    index.save(tmp_path / "idx")
    assert DenseIndex.load(tmp_path / "idx").describe()["search_quality"] == quality


def test_build_tunes_on_given_queries(data):
    """Given real query vectors, the stored settings reach the target on those queries."""
    xb, q, held_out = data
    index = DenseIndex.build(xb, "ivfpq", progress=False, target_recall=0.95, queries=held_out)
    quality = index.describe()["search_quality"]
    assert quality["query_source"] == "given" and quality["queries"] == len(held_out)
    truth = exact_search(index.embeddings, torch.from_numpy(held_out), 10)[1].numpy()
    assert recall_at_k(index.search(held_out, 10)[1], truth) == pytest.approx(quality["recall"], abs=1e-4)
    assert quality["recall"] >= 0.95
    with pytest.raises(ValueError, match=r"queries must have shape \[Q >= 1, d=64\]"):
        DenseIndex.build(xb, "ivfpq", progress=False, target_recall=0.95, queries=held_out[:, :8])


def test_too_few_tuning_queries_are_warned_with_the_count_needed(data):
    """The tuner asks each measure's 95% lower bound to reach the target; with Q queries all
    matching exact search the exact one-sided bound is 0.05 ** (1 / Q), so below Q = 59 no
    result shows 0.95 (27 queries: 0.895), though the normal-approximation bound of the tuner
    is then 1. Explicit queries fewer than that are warned about once, naming the count needed."""
    from rag_fast.retrieval.tuning import (SmallSampleWarning, _reaches, min_tuning_queries,
                                           small_sample_message)

    assert [min_tuning_queries(t) for t in (0.5, 0.9, 0.95, 0.99)] == [5, 29, 59, 299]
    for target in (0.5, 0.9, 0.95, 0.99, 0.999):
        need = min_tuning_queries(target)
        assert 0.05 ** (1 / need) >= target > 0.05 ** (1 / (need - 1))
    assert min_tuning_queries(0.04) == 1 and min_tuning_queries(1.0) is None
    with pytest.raises(ValueError, match="target must be in"):
        min_tuning_queries(0.0)
    assert _reaches((np.ones(27), np.ones(27)), 0.95)  # what the warning is about
    assert small_sample_message(59, 0.95) is None and small_sample_message(27, 1.0) is None
    assert small_sample_message(27, 0.95, "--queries") == (
        "--queries: 27 queries are too few to show recall and same top 5 >= 0.95 with 95% "
        "confidence (even if all 27 matched exact search, the exact one-sided lower bound would "
        "be 0.895); give at least 59 queries for this target, or the tuned settings may fall "
        "short of it on new ones")

    xb, q, _ = data
    index = DenseIndex.build(xb[:2000], "IVF8,Flat", progress=False)
    with pytest.warns(SmallSampleWarning, match=r"^queries: 27 queries are too few .* give at "
                                                r"least 59 queries") as said:
        index.tune(0.95, queries=q[:27])
    assert len(said) == 1
    with pytest.warns(SmallSampleWarning, match=r"^queries: 30 queries .* at least 59") as said:
        index.measure(0.95, queries=q[:30])  # tunes too: said once
    assert len(said) == 1
    with pytest.warns(SmallSampleWarning, match=r"at least 29 queries"):
        index.measure(0.9, tune=False, queries=q[:28])
    with warnings.catch_warnings():
        warnings.simplefilter("error", SmallSampleWarning)
        index.tune(0.95, queries=q[:59])
        index.measure(0.9, queries=q[:29])
        index.measure(0.95, n_queries=100)  # its own vectors, not given queries
        DenseIndex.build(xb[:50], "exact", progress=False, target_recall=0.95, queries=q[:5])


def test_build_from_shards_equals_build_from_whole(data):
    xb = data[0][:1000]
    whole = DenseIndex.build(xb, "exact", progress=False)
    shards = DenseIndex.build([xb[:300], xb[300:700], xb[700:]], "exact", progress=False, batch_size=128)
    np.testing.assert_array_equal(whole.embeddings, shards.embeddings)


def test_gpu_search_or_clear_error(data, exact):
    """On a GPU: faiss GPU or exact torch search gives the CPU's ids; without one, a clear error."""
    _, q, _ = data
    index = DenseIndex.build(data[0], "ivfpq", progress=False)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device must be 'cpu' or an available CUDA device"):
            index.to("cuda")
        return
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # "faiss has no GPU support" is expected
        index.to("cuda")
    scores, ids = index.search(torch.from_numpy(q).cuda(), 10)
    assert ids.is_cuda and scores.dtype == torch.float32
    assert recall_at_k(ids.cpu().numpy(), truth(exact, q)) >= 0.95


# ---- memory safety: arrays handed out keep their owner alive ----------------------------------
_OUTLIVE = r"""
import gc, sys
import numpy as np
from rag_fast.retrieval import DenseIndex
x = np.random.default_rng(0).standard_normal((2000, 64)).astype(np.float32)
index = DenseIndex.build(x, "exact", progress=False)
if sys.argv[2] == "load":
    index.save(sys.argv[1])
    index = DenseIndex.load(sys.argv[1])
emb = index.embeddings
expected = np.array(emb)  # a copy
del index
gc.collect()
junk = [np.full(2000 * 64, 7, np.float16) for _ in range(50)]  # reuse the freed memory
assert np.array_equal(emb, expected), "embeddings changed after the index was collected"
print("OK")
"""


@pytest.mark.parametrize("how", ["build", "load"])
def test_embeddings_outlive_the_index(tmp_path, how):
    """Defect: ``DenseIndex.load(p).embeddings`` was a raw view of faiss memory: reading it after
    the index was collected segfaulted (loaded: unmapped) or read garbage (built: freed)."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _OUTLIVE, str(tmp_path / "idx"), how],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "OK" in proc.stdout, (proc.returncode, proc.stderr[-2000:])


def test_embeddings_are_read_only_views_holding_their_owner(exact):
    import gc
    import weakref

    index = DenseIndex.build(exact.embeddings[:50].astype(np.float32), "exact", progress=False)
    owner = weakref.ref(index._vectors)
    emb = index.embeddings
    del index
    gc.collect()
    assert owner() is not None  # the faiss store lives as long as the array
    assert not emb.flags.writeable
    del emb
    gc.collect()
    assert owner() is None  # and no longer


def test_a_setting_must_reach_the_target_with_confidence():
    """The tuner takes a setting only when the lower 95% bound of each per-query measure
    reaches the target: a sample mean just at the target is not enough."""
    from rag_fast.retrieval.tuning import _reaches

    at = np.r_[np.ones(950), np.zeros(50)]  # mean 0.95 exactly
    assert not _reaches((at,), 0.95)
    surely = np.r_[np.ones(970), np.zeros(30)]  # 0.97 - 1.645 * 0.171 / sqrt(1000) = 0.961
    assert _reaches((surely,), 0.95) and not _reaches((surely, at), 0.95)
    assert _reaches((np.ones(4),), 1.0)  # a perfect small sample reaches any target


def test_a_small_k_reranks_as_many_candidates_as_the_tuned_k(data):
    """Defect: a top-5 search re-ranked 5 * rerank candidates, half of what the build measured
    (its top 10), and found fewer of exact search's top 5 than measured. Now its results are
    the first 5 of the top-10 search."""
    xb, q, _ = data
    index = DenseIndex.build(xb, "ivfpq", progress=False, nprobe=2)
    ten, five = index.search(q, 10)[1], index.search(q, 5)[1]
    np.testing.assert_array_equal(five, ten[:, :5])
    assert index.search_parameters(5).k_factor == 2 * index.search_parameters(10).k_factor
    assert index.search_parameters(20).k_factor == index.params["rerank"]


def test_ivfpq_builds_skip_polysemous_training_and_search_the_same():
    """faiss's factory turns on polysemous training for 8-bit IVF-PQ (a reordering of the
    centroids for Hamming filtering no search here uses; most of the training time). The build
    turns it off; its searches equal those of the index faiss trains with it."""
    rng = np.random.default_rng(3)
    xb = rng.standard_normal((2000, 16)).astype(np.float32)
    q = rng.standard_normal((20, 16)).astype(np.float32)
    ours = DenseIndex.build(xb, "IVF8,PQ1", rerank=1, nprobe=8, progress=False)
    assert faiss.downcast_index(faiss.extract_index_ivf(ours.faiss_index)).do_polysemous_training \
        is False
    theirs = faiss.index_factory(16, "IVF8,PQ1", faiss.METRIC_INNER_PRODUCT)
    ivf = faiss.downcast_index(faiss.extract_index_ivf(theirs))
    assert ivf.do_polysemous_training  # faiss's default, which the build changes
    sample = np.sort(np.random.default_rng(0).choice(2000, size=2000, replace=False))
    theirs.train(xb[sample])
    theirs.add(xb)
    ivf.nprobe = 8
    d_ours, i_ours = ours.search(q, 10)
    d_theirs, i_theirs = theirs.search(q, 10)
    np.testing.assert_allclose(np.asarray(d_ours), d_theirs, rtol=1e-4, atol=1e-4)
    assert (np.asarray(i_ours) == i_theirs).mean() > 0.98  # equal up to ties
