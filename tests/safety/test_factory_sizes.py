"""A faiss factory string is sized before faiss allocates any of it: its inverted lists, PQ, HNSW,
transform and scalar quantiser sizes against their bounds, its k-means centroids against the
training vectors, and the build's estimated memory against the memory available. A string
that fails is one ``ValueError`` naming the preset, the value, the bound and (where known) the
corpus size, at once; through ``rag-fast index build`` it is one ``rag-fast: error:`` line and
exit status 2, before any passage is encoded."""
from __future__ import annotations

import contextlib
import csv
import io
import time
import warnings

import numpy as np
import pytest

from rag_fast import cli
from rag_fast.retrieval import DenseIndex
from rag_fast.retrieval import factory as factory_module
from rag_fast.retrieval.factory import (
    HNSW_DEGREES,
    MAX_LISTS,
    PQ_BITS,
    check_corpus,
    factory_sizes,
    plan_factory,
)
from rag_fast.retrieval.factory import factory_index
from utils import save_tiny_bert

FAST = 5.0  # seconds: a refused factory string is refused before faiss does any work
WORDS = "paris france tower iron river water mountain nepal chess board game planet gas red".split()


def _refused(call, *args, **kwargs) -> tuple[str, float]:
    start = time.perf_counter()
    with pytest.raises(ValueError) as e:
        call(*args, **kwargs)
    return str(e.value), time.perf_counter() - start


def test_many_lists_and_a_pq_that_does_not_divide_d_fail_at_once():
    # faiss alone allocates 16 GB of empty lists for this string, then fails on PQ3
    message, elapsed = _refused(DenseIndex.build, np.ones((10, 8), np.float32), "IVF99999999,PQ3",
                                progress=False)
    assert elapsed < FAST, elapsed
    assert "preset 'IVF99999999,PQ3'" in message and "99999999 inverted lists" in message
    assert str(MAX_LISTS) in message and "10 vectors" in message, message
    assert "\n" not in message


def test_more_lists_than_vectors_names_both_numbers():
    message, elapsed = _refused(DenseIndex.build, np.ones((10, 8), np.float32), "IVF64,Flat",
                                progress=False)
    assert elapsed < FAST
    assert "preset 'IVF64,Flat' has 64 inverted lists but the corpus has 10 vectors" in message
    assert "IVF10" in message, message  # the bound, as a factory to use instead
    message, _ = _refused(plan_factory, "IVF2k,Flat", 2000, 16)  # k: 1024 lists
    assert "has 2048 inverted lists but the corpus has 2000 vectors" in message


def test_a_train_size_below_the_lists_is_named():
    x = np.random.default_rng(0).standard_normal((500, 8)).astype(np.float32)
    message, _ = _refused(DenseIndex.build, x, "IVF64,Flat", train_size=32, progress=False)
    assert "has 64 inverted lists but it trains on train_size=32 of the corpus's 500 vectors" in message


@pytest.mark.parametrize("factory, n, d, expected", [
    ("IVF16,PQ3", 1000, 8, ["PQ3 has M=3 sub-quantisers, which must divide the dimension d=8",
                            "[1, 2, 4, 8]"]),
    ("IVF16,PQ4x20", 1000, 16, ["PQ4x20 has 20-bit codes", f"{PQ_BITS[0]} to {PQ_BITS[1]} bits"]),
    ("PQ4x12", 1000, 16, [("PQ4x12 has 2**12 = 4096 centroids per sub-quantiser but the corpus "
                           "has 1000 vectors"), "PQ4x9"]),
    ("IVF16,PQ8", 100, 16, ["PQ8 has 2**8 = 256 centroids", "the corpus has 100 vectors"]),
    ("HNSW1", 1000, 16, ["HNSW1 has degree M=1", f"{HNSW_DEGREES[0]} to {HNSW_DEGREES[1]}"]),
    ("HNSW5000", 1000, 16, ["HNSW5000 has degree M=5000"]),
    ("IVF16_HNSW1,Flat", 1000, 16, ["HNSW1 has degree M=1"]),
    ("OPQ3,IVF16,PQ4", 1000, 16, [("OPQ3 has M=3 sub-quantisers, which must divide its output "
                                   "dimension 16")]),
    ("OPQ4,IVF16,PQ4x4", 100, 16, ["OPQ4 trains an 8-bit PQ (256 centroids", "100 vectors"]),
    ("PCA32,Flat", 1000, 16, ["PCA32 outputs 32 dimensions; a PCA outputs 1 to d=16"]),
    ("SQ3", 1000, 16, ["'SQ3' is not a faiss scalar quantiser", "SQ8"]),
    ("IVF16,PQ4x4fs_48", 1000, 16, ["blocks of 48 vectors", "a multiple of 32"]),
    ("IVF0,Flat", 1000, 16, ["has 0 inverted lists", f"1 to {MAX_LISTS} lists"]),
    ("IVF8M,Flat", 1000, 16, ["has 8388608 inverted lists", str(MAX_LISTS)]),
    ("IVF99999999999,Flat", 1000, 16, ["99999999999 is larger than faiss reads"]),
    ("IMI2x10,Flat", 1000, 16, [("'IMI2x10' is not a part of a faiss factory string that "
                                 "rag_fast sizes")]),
    ("IVF16(PQ4),Flat", 1000, 16, ["in parentheses"]),
    ("IVF16", 1000, 16, ["an IVF needs its codes after a comma"]),
    ("IDMap,Flat", 1000, 16, ["drop the IDMap"]),
])
def test_each_size_is_checked_against_its_bound(factory, n, d, expected):
    message, elapsed = _refused(plan_factory, factory, n, d)
    assert elapsed < FAST
    assert message.startswith(f"preset {factory!r}"), message
    for part in expected:
        assert part in message, message
    assert "\n" not in message


def test_the_estimate_above_the_available_memory_is_refused(monkeypatch):
    monkeypatch.setattr(factory_module, "available_memory", lambda: (1 << 20, "MemAvailable (test)"))
    x = np.random.default_rng(0).standard_normal((4000, 32)).astype(np.float32)
    message, elapsed = _refused(DenseIndex.build, x, "IVF16,Flat", progress=False)
    assert elapsed < FAST
    assert message.startswith("preset 'IVF16,Flat' needs about ")
    assert "for 4000 vectors of d=32" in message and "fp16 vectors" in message
    assert "more than the 1.0 MiB available (MemAvailable (test))" in message, message
    # the presets are estimated too
    message, _ = _refused(plan_factory, "ivfpq", 10**6, 768)
    assert message.startswith("preset 'ivfpq' (faiss factory 'IVF1024,PQ96x4fs') needs about ")
    # and what faiss allocates while parsing, where the corpus is not known yet
    message, _ = _refused(factory_index, "IVF4M,Flat", "IVF4M,Flat", 16)
    assert "needs about 640.0 MiB of memory to parse it" in message, message


def test_the_estimate_counts_lists_codes_and_links():
    sizes = factory_sizes("IVF1024_HNSW16,PQ8", "IVF1024_HNSW16,PQ8", 64)
    assert sizes.nlist == 1024 and sizes.train_min == 1024
    parts = sizes.estimate(n=10**6, train=50_000)
    assert parts["coarse centroids"] == 1024 * 64 * 4
    assert parts["codes and ids"] == 10**6 * (8 + 8)
    assert parts["PQ centroid tables"] == 64 * 256 * 4
    assert parts["coarse HNSW graph links"] == 1024 * (4 * (2 * 16 + 2) + 16)
    hnsw = factory_sizes("HNSW32", "HNSW32", 64).estimate(n=1000, train=0)
    assert hnsw["HNSW graph links"] == 1000 * (4 * 66 + 16) and hnsw["codes"] == 1000 * 64 * 4
    check_corpus("HNSW32", "HNSW32", factory_sizes("HNSW32", "HNSW32", 64), 1000, 64)


@pytest.mark.parametrize("factory", ["IVF16,PQ4x4fs,RFlat", "IVF16,PQ4x4np,Refine(SQ8)",
                                     "OPQ4_32,IVF16,PQ4", "RR32,Pad40,Flat", "IVF1k,SQ8_direct"])
def test_refines_and_transforms_are_sized(factory):
    sizes = factory_sizes(factory, factory, 16)
    check_corpus(factory, factory, sizes, 2000, 16)
    assert sum(sizes.estimate(2000, 2000).values()) > 2000 * 16


@pytest.mark.parametrize("factory", ["IVF16_HNSW8,Flat", "HNSW8,SQ8", "HNSW8_PQ4x4", "PCA8,IVF16,Flat",
                                     "IVF16,SQfp16", "L2norm,IVF16,FlatDedup", "IVF16,PQ4x4fsr",
                                     "RaBitQ"])
def test_sized_factories_still_build(factory):
    x = np.random.default_rng(0).standard_normal((1000, 16)).astype(np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        index = DenseIndex.build(x, factory, progress=False)
    assert index.factory == factory and index.search(x[:2], 3)[1].shape == (2, 3)


def test_an_unknown_string_without_numbers_is_faiss_s_to_refuse():
    message, _ = _refused(plan_factory, "nonsense", 100, 8)
    assert message == ("preset 'nonsense' is not a preset ('exact', 'hnsw', 'ivfpq') nor a valid "
                       "faiss factory string: could not parse index string nonsense")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("factory-sizes")
    (root / "enc").mkdir()
    encoder = save_tiny_bert(root / "enc", WORDS)
    passages = root / "p.tsv"
    with open(passages, "w", newline="") as f:
        w = csv.writer(f, delimiter="\t")
        w.writerow(["id", "text", "title"])
        for i in range(20):
            w.writerow([f"d{i}", " ".join(WORDS[(i + j) % len(WORDS)] for j in range(5)), f"t{i}"])
    return root, passages, encoder


def _build(corpus, preset: str, out) -> tuple[int, str, float]:
    _, passages, encoder = corpus
    err = io.StringIO()
    start = time.perf_counter()
    with contextlib.redirect_stderr(err):
        code = cli.main(["index", "build", "--passages", str(passages), "--encoder", encoder,
                         "--preset", preset, "--out", str(out), "--no-progress", "--device", "cpu"])
    return code, err.getvalue(), time.perf_counter() - start


def test_the_command_refuses_many_lists_before_reading_the_passages(corpus, tmp_path):
    code, err, elapsed = _build(corpus, "IVF99999999,Flat", tmp_path / "idx")
    assert code == 2 and elapsed < FAST, (code, elapsed)
    assert err.count("\n") == 1 and err.startswith("rag-fast: error: preset 'IVF99999999,Flat' has "
                                                   "99999999 inverted lists"), err
    assert str(MAX_LISTS) in err
    assert not (tmp_path / "idx").exists() and not (tmp_path / "idx.staging").exists()


def test_the_command_refuses_more_lists_than_passages_before_encoding(corpus, tmp_path):
    code, err, elapsed = _build(corpus, "IVF64,Flat", tmp_path / "idx")
    assert code == 2 and elapsed < FAST, (code, elapsed)
    assert err == ("rag-fast: error: preset 'IVF64,Flat' has 64 inverted lists but the corpus has "
                   "20 vectors (k-means needs at least one training vector per centroid, and faiss "
                   "recommends 39: 2496); use at most 20 lists (IVF20), or preset 'exact'\n"), err
    assert not list((tmp_path / "idx.staging").glob("*.npy")) and not (tmp_path / "idx").exists()
