"""DenseIndex manifests are validated on load (keys, types, ranges, format number, faiss
version) and search settings are validated before they reach faiss, from a manifest, from
``search`` or from ``tune``: no setting may abort the process."""
from __future__ import annotations

import json
import subprocess
import sys
import warnings

import faiss
import numpy as np
import pytest

from rag_fast.retrieval import DenseIndex, StorageError

D = 16


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """{preset: path} of saved small indexes (ivfpq re-ranks; hnsw has ef_search)."""
    x = np.random.default_rng(0).standard_normal((1000, D)).astype(np.float32)
    root = tmp_path_factory.mktemp("manifests")
    out = {}
    for preset in ("ivfpq", "hnsw", "exact"):
        out[preset] = DenseIndex.build(x, preset, progress=False).save(root / preset)
    return out


def edited(saved, tmp_path, preset: str, edit) -> str:
    """A copy of the saved ``preset`` index whose manifest went through ``edit(manifest)`` and
    was sealed again (as ``rag-fast reseal`` accepts an edit): loading still checks every key."""
    import shutil

    from rag_fast.storage import sealed

    path = tmp_path / f"{preset}-edited"
    shutil.copytree(saved[preset], path)
    manifest = json.loads((path / "manifest.json").read_text())
    edit(manifest)
    (path / "manifest.json").write_text(json.dumps(sealed(manifest)))
    return str(path)


def _set(key, value):
    def edit(m):
        target = m
        *parents, last = key.split(".") if isinstance(key, str) else key
        for p in parents:
            target = target[p]
        target[last] = value
    return edit


def _drop(key):
    def edit(m):
        target = m
        *parents, last = key.split(".") if isinstance(key, str) else key
        for p in parents:
            target = target[p]
        del target[last]
    return edit


BAD = [  # (preset, edit, words the error must contain)
    ("ivfpq", _set("params.nprobe", 0), ["'params.nprobe'", "int >= 1"]),
    ("ivfpq", _set("params.nprobe", "4"), ["'params.nprobe'", "int >= 1"]),
    ("ivfpq", _set("params.rerank", 0), ["'params.rerank'", "int >= 1"]),
    ("ivfpq", _set("params.rerank", 2.5), ["'params.rerank'", "int >= 1"]),
    ("ivfpq", _drop("params.nprobe"), ["'params.nprobe'", "missing"]),
    ("ivfpq", _set("params.n_probe", 4), ["params.n_probe", "unknown"]),
    ("hnsw", _set("params.ef_search", -1), ["'params.ef_search'", "int >= 1"]),
    ("hnsw", _set("params.ef_search", 2**40), ["'params.ef_search'", "<= 2147483647"]),
    ("hnsw", _drop("params.ef_search"), ["'params.ef_search'", "missing"]),
    ("exact", _drop("params"), ["missing key", "params"]),
    ("exact", _drop("dim"), ["missing key", "dim"]),
    ("exact", _drop("count"), ["missing key", "count"]),
    ("exact", _drop("preset"), ["missing key", "preset"]),
    ("exact", _drop("faiss_version"), ["missing key", "faiss_version"]),
    ("exact", _drop("files"), ["'files'", "missing"]),
    ("exact", _set("files", {}), ["'files'", "non-empty"]),
    ("exact", _drop(("files", "index.faiss")), ["'files'", "index.faiss"]),
    ("exact", _set(("files", "vectors.faiss"), {"bytes": "12", "sha256": "0" * 64}), ["bytes", "int >= 0"]),
    ("exact", _set(("files", "vectors.faiss"), {"bytes": 1, "sha256": "xyz"}), ["sha256", "hex"]),
    ("exact", _set("count", "1000"), ["'count'", "int >= 1"]),
    ("exact", _set("dim", 0), ["'dim'", "int >= 1"]),
    ("exact", _set("metric", "l2"), ["'metric'", "inner_product"]),
    ("exact", _set("meta", []), ["'meta'", "object"]),
    ("exact", _set("format", 2), ["'format'", "format 1"]),
    ("exact", _set("format", "1"), ["'format'", "int 1"]),
    ("exact", _set("surprise", 1), ["unknown key", "surprise"]),
]


@pytest.mark.parametrize("preset, edit, words", BAD, ids=[f"{p}-{i}" for i, (p, _, _) in enumerate(BAD)])
def test_bad_manifest_is_a_clear_error(saved, tmp_path, preset, edit, words):
    """Defect: these loaded (a bare KeyError, or silently, the process aborting on search)."""
    path = edited(saved, tmp_path, preset, edit)
    with pytest.raises(StorageError) as info:
        DenseIndex.load(path)
    message = str(info.value)
    assert "manifest.json" in message and path in message, message
    for word in words:
        assert word in message, message


def test_other_faiss_version_warns_once(saved, tmp_path):
    """Defect: an index built by another faiss loaded silently."""
    path = edited(saved, tmp_path, "exact", _set("faiss_version", "0.0.1-test"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        DenseIndex.load(path)
        DenseIndex.load(path)
    said = [w for w in caught if "faiss 0.0.1-test" in str(w.message)]
    assert len(said) == 1 and faiss.__version__ in str(said[0].message) and path in str(said[0].message)
    assert issubclass(said[0].category, RuntimeWarning)


_NO_ABORT = r"""
import json, sys, warnings
import numpy as np
from rag_fast.retrieval import DenseIndex
path, hnsw = sys.argv[1], sys.argv[2]
q = np.random.default_rng(1).standard_normal((64, 16)).astype(np.float32)
try:
    DenseIndex.load(sys.argv[3]).search(q, 5)  # the manifest says nprobe 0
    print("manifest nprobe=0: loaded and searched")
except ValueError as exc:
    print("manifest nprobe=0:", type(exc).__name__)
index, graph = DenseIndex.load(path), DenseIndex.load(hnsw)
cases = {
    "nprobe=0": lambda: index.search(q, 5, nprobe=0),
    "nprobe=-3": lambda: index.search(q, 5, nprobe=-3),
    "nprobe=2**40": lambda: index.search(q, 5, nprobe=2**40),
    "rerank=0": lambda: index.search(q, 5, rerank=0),
    "rerank='8'": lambda: index.search(q, 5, rerank="8"),
    "rerank=2**40": lambda: index.search(q, 5, rerank=2**40),
    "k=0": lambda: index.search(q, 0),
    "k=True": lambda: index.search(q, True),
    "ef_search=0": lambda: graph.search(q, 5, ef_search=0),
    "ef_search=2**40": lambda: graph.search(q, 5, ef_search=2**40),
    "ef_search=1.5": lambda: graph.search(q, 5, ef_search=1.5),
    "hnsw rerank='x'": lambda: graph.search(q, 5, rerank="x"),
    "params nprobe=0": lambda: (index.params.__setitem__("nprobe", 0), index.search(q, 5)),
    "params rerank=0": lambda: (index.params.update(nprobe=4, rerank=0), index.search(q, 5)),
    "search_parameters k=0": lambda: (index.params.update(rerank=8), index.search_parameters(0)),
    "tune n_queries=0": lambda: index.tune(0.9, n_queries=0),
    "tune rerank_factors=[0]": lambda: index.tune(0.9, rerank_factors=[0]),
    "tune rerank_factors='8'": lambda: index.tune(0.9, rerank_factors="8"),
    "tune k=0": lambda: index.tune(0.9, k=0),
    "tune target_recall='x'": lambda: index.tune("x"),
}
for name, case in cases.items():
    try:
        case()
        print(name + ": no error")
    except Exception as exc:
        print(name + ":", type(exc).__name__)
    sys.stdout.flush()
print("SURVIVED")
"""


def test_no_setting_aborts_the_process(saved, tmp_path):
    """Defect: ``"nprobe": 0`` in a manifest loaded, then the first search aborted the process
    (an uncaught faiss exception in a parallel region); other bad settings leaked TypeError or
    overflowed. Run in a subprocess: an abort fails the test instead of killing pytest."""
    zero = edited(saved, tmp_path, "ivfpq", _set("params.nprobe", 0))
    proc = subprocess.run([sys.executable, "-c", _NO_ABORT, str(saved["ivfpq"]), str(saved["hnsw"]), zero],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "SURVIVED" in proc.stdout, (proc.returncode, proc.stdout, proc.stderr[-2000:])
    lines = [line for line in proc.stdout.splitlines() if ": " in line]
    assert lines and all(line.endswith(": ValueError") or line.endswith(": StorageError") for line in lines), lines


def test_valid_settings_still_work(saved):
    index = DenseIndex.load(saved["ivfpq"])
    q = np.random.default_rng(2).standard_normal((4, D)).astype(np.float32)
    assert index.search(q, 5, nprobe=10**6, rerank=10**6)[1].shape == (4, 5)  # clamped, not rejected
    graph = DenseIndex.load(saved["hnsw"])
    assert graph.search(q, 5, ef_search=1)[1].shape == (4, 5)


# ---- load_retriever (training, evaluation, serving) verifies content by default -------------
@pytest.fixture()
def index_dir(tmp_path):
    """An index directory as `rag-fast index build` lays it out, bundle manifest included."""
    from rag_fast.models.retriever_io import BUNDLE_KIND
    from rag_fast.retrieval import Passage, PassageStore
    from rag_fast.storage import describe_files, write_manifest

    root = tmp_path / "kb"
    PassageStore.create([Passage(f"p{i}", f"title {i}", f"text {i}") for i in range(50)],
                        root / "passages", progress=False)
    vectors = np.random.default_rng(0).standard_normal((50, D)).astype(np.float32)
    DenseIndex.build(vectors, "exact", progress=False).save(root / "index")
    write_manifest(root / "manifest.json", {
        "kind": BUNDLE_KIND, "format": 1, "encoder": {"dim": D}, "query_encoder": {"dim": D},
        "files": describe_files(root, ["passages/manifest.json", "index/manifest.json"])})
    return root


def _poke(path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def test_load_retriever_rejects_a_nan_in_the_stored_vectors(index_dir):
    """Defect: load_retriever (rag-fast train/eval/generate) did not verify checksums, so a NaN
    written into the stored vectors flowed into passage embeddings with no error."""
    from rag_fast.models.retriever_io import load_retriever

    assert np.isfinite(load_retriever(index_dir).index.embeddings.astype(np.float32)).all()
    vectors = index_dir / "index" / "vectors.faiss"
    _poke(vectors, vectors.stat().st_size - 2, np.array([np.nan], np.float16).tobytes())  # last row
    with pytest.raises(StorageError, match="vectors.faiss.*checksum"):
        load_retriever(index_dir)
    # the explicit opt-out checks sizes only (and so lets the NaN through)
    emb = load_retriever(index_dir, verify=False).index.embeddings
    assert np.isnan(emb[-1].astype(np.float32)).any()


@pytest.mark.parametrize("target", ["passages/texts.values.bin", "index/index.faiss"])
def test_load_retriever_rejects_flipped_bytes(index_dir, target):
    from rag_fast.models.retriever_io import load_retriever

    path = index_dir / target
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(StorageError, match=target.split("/")[-1].replace(".", r"\.")):
        load_retriever(index_dir)


def test_load_retriever_checks_the_bundle_manifest(index_dir):
    """A part's manifest edited after the build (still valid JSON) fails the bundle's checksum."""
    from rag_fast.models.retriever_io import load_retriever

    path = index_dir / "passages" / "manifest.json"
    path.write_text(path.read_text().replace('"count": 50', '"count":50 '))  # same size and meaning
    with pytest.raises(StorageError, match=r"passages/manifest\.json.*checksum"):
        load_retriever(index_dir)
    assert len(load_retriever(index_dir, verify=False).store) == 50


def test_build_rejects_zero_settings():
    """``nprobe=0`` / ``ef_search=0`` given to build were silently replaced by the defaults."""
    x = np.random.default_rng(0).standard_normal((700, D)).astype(np.float32)
    with pytest.raises(ValueError, match="nprobe"):
        DenseIndex.build(x, "ivfpq", nprobe=0, progress=False)
    with pytest.raises(ValueError, match="ef_search"):
        DenseIndex.build(x, "hnsw", ef_search=0, progress=False)
