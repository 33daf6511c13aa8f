"""`rag-fast index build` staging cannot go stale: the staged passages and embeddings are keyed
by the passages' content, the encoder and the settings; a staging left behind (by --shard
builds, or a killed build) is reused only by a build with the same key, discarded otherwise,
and shard runs never mix keys. A failed build removes the staging it created. A tiny random
BERT encoder saved to a temporary folder keeps this fast."""
from __future__ import annotations

import csv
import json

import numpy as np
import pytest

from rag_fast import cli
from rag_fast.retrieval import DenseIndex, Encoder
from utils import save_tiny_bert

WORDS = "paris france tower iron river water mountain nepal chess board game planet gas red".split()
PASSAGES = [("d0", "Paris", "paris france tower iron"), ("d1", "River", "river water gas planet"),
            ("d2", "Chess", "chess board game red"), ("d3", "Nepal", "nepal mountain water river")]


@pytest.fixture(scope="module")
def encoder_dir(tmp_path_factory):
    return save_tiny_bert(tmp_path_factory.mktemp("tiny_bert"), WORDS)


def _write_corpus(path, passages):
    with open(path, "w", newline="") as f:
        w = csv.writer(f, delimiter="\t")
        w.writerow(["id", "text", "title"])
        for pid, title, text in passages:
            w.writerow([pid, text, title])
    return path


def _fresh_vectors(encoder_dir, passages, pooling):
    enc = Encoder(encoder_dir, pooling=pooling, device="cpu")
    return enc.encode([t for _, _, t in passages], [ti for _, ti, _ in passages]).numpy()


def _build(corpus, encoder_dir, out, *extra):
    return cli.main(["index", "build", "--passages", str(corpus), "--encoder", encoder_dir,
                     "--preset", "exact", "--out", str(out), "--no-progress", "--device", "cpu", *extra])


def _fail_after_encoding(monkeypatch):
    def fail(*args, **kwargs):
        raise ValueError("simulated failure after encoding")

    monkeypatch.setattr(DenseIndex, "build", fail)


def _stored(out):
    return DenseIndex.load(out / "index").embeddings.astype(np.float32)


def test_edited_passages_after_a_failed_build_are_re_encoded(tmp_path, encoder_dir, monkeypatch, capsys):
    corpus = _write_corpus(tmp_path / "psgs.tsv", PASSAGES)
    out = tmp_path / "idx"
    with monkeypatch.context() as m:
        _fail_after_encoding(m)
        assert _build(corpus, encoder_dir, out) == 2
    assert not (tmp_path / "idx.staging").exists() and not out.exists()  # went with the build
    assert _build(corpus, encoder_dir, out, "--shard", "0/1") == 0  # a staging that stays
    edited = [*PASSAGES[:2], ("d2", "Chess", "planet gas red tower"), PASSAGES[3]]
    _write_corpus(corpus, edited)
    capsys.readouterr()
    assert _build(corpus, encoder_dir, out, "--overwrite") == 0
    np.testing.assert_allclose(_stored(out), _fresh_vectors(encoder_dir, edited, "cls"), atol=2e-3)
    assert "discarding stale staging" in capsys.readouterr().out
    assert json.loads((out / "manifest.json").read_text())["passages_sha256"]
    assert not (tmp_path / "idx.staging").exists()


def test_pooling_change_after_a_failed_build_is_re_encoded(tmp_path, encoder_dir, monkeypatch):
    corpus = _write_corpus(tmp_path / "psgs.tsv", PASSAGES)
    out = tmp_path / "idx"
    with monkeypatch.context() as m:
        _fail_after_encoding(m)
        assert _build(corpus, encoder_dir, out, "--pooling", "cls") == 2
    assert _build(corpus, encoder_dir, out, "--pooling", "mean") == 0
    mean = _fresh_vectors(encoder_dir, PASSAGES, "mean")
    assert not np.allclose(mean, _fresh_vectors(encoder_dir, PASSAGES, "cls"), atol=1e-2)
    np.testing.assert_allclose(_stored(out), mean, atol=2e-3)
    assert json.loads((out / "manifest.json").read_text())["encoder"]["pooling"] == "mean"


def test_same_settings_resume_the_staging(tmp_path, encoder_dir, capsys):
    corpus = _write_corpus(tmp_path / "psgs.tsv", PASSAGES)
    out = tmp_path / "idx"
    assert _build(corpus, encoder_dir, out, "--max-length", "16", "--shard", "0/1") == 0
    staged = tmp_path / "idx.staging" / "embeddings-0-of-1.npy"
    mtime = staged.stat().st_mtime_ns
    capsys.readouterr()
    assert _build(corpus, encoder_dir, out, "--max-length", "16") == 0
    assert "discarding" not in capsys.readouterr().out
    assert not staged.exists()  # used (not re-encoded: the build would have rewritten it first)
    assert mtime  # the file existed before the resumed build
    np.testing.assert_allclose(_stored(out), _fresh_vectors(encoder_dir, PASSAGES, "cls"), atol=2e-3)


def test_shards_share_a_staging_only_with_the_same_key(tmp_path, encoder_dir, capsys):
    corpus = _write_corpus(tmp_path / "psgs.tsv", PASSAGES)
    out = tmp_path / "idx"
    assert _build(corpus, encoder_dir, out, "--shard", "0/2", "--pooling", "mean") == 0
    capsys.readouterr()
    assert _build(corpus, encoder_dir, out, "--shard", "1/2", "--pooling", "cls") == 2
    err = capsys.readouterr().err
    assert "another build with other settings is in progress" in err and "pooling" in err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "idx.staging" / "embeddings-1-of-2.npy").exists()
    assert _build(corpus, encoder_dir, out, "--shard", "1/2", "--pooling", "mean") == 0
    assert _build(corpus, encoder_dir, out, "--pooling", "mean") == 0
    np.testing.assert_allclose(_stored(out), _fresh_vectors(encoder_dir, PASSAGES, "mean"), atol=2e-3)


def test_a_staging_without_a_key_is_stale(tmp_path, encoder_dir, capsys):
    """A staging without key.json is never reused: discarded when everything in it is what
    builds staged (its key was lost), refused when it holds embeddings no build recorded (an
    older version's, or the user's), which are kept."""
    corpus = _write_corpus(tmp_path / "psgs.tsv", PASSAGES)
    assert _build(corpus, encoder_dir, tmp_path / "kb", "--shard", "0/1") == 0
    (tmp_path / "kb.staging" / "key.json").unlink()
    capsys.readouterr()
    assert _build(corpus, encoder_dir, tmp_path / "kb") == 0
    assert "discarding stale staging" in capsys.readouterr().out
    np.testing.assert_allclose(_stored(tmp_path / "kb"), _fresh_vectors(encoder_dir, PASSAGES, "cls"),
                               atol=2e-3)
    staging = tmp_path / "idx.staging"
    staging.mkdir()
    np.save(staging / "embeddings-0-of-1.npy", np.zeros((len(PASSAGES), 16), np.float16))
    assert _build(corpus, encoder_dir, tmp_path / "idx") == 2
    err = capsys.readouterr().err
    assert "'embeddings-0-of-1.npy' that rag_fast did not write" in err
    assert (staging / "embeddings-0-of-1.npy").is_file() and not (tmp_path / "idx").exists()


def _staged(tmp_path):
    staging = tmp_path / "idx.staging"
    return sorted(p.name for p in staging.iterdir()) if staging.exists() else None


def test_a_shard_build_names_both_ways_on(tmp_path, encoder_dir, capsys):
    """After a shard, the line says how to train on the shards (the staging folder as a sharded
    index) and how to merge them (without --shard, which keeps the staging)."""
    import os

    corpus = _write_corpus(tmp_path / "psgs.tsv", PASSAGES)
    assert _build(corpus, encoder_dir, tmp_path / "idx", "--shard", "0/2") == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    staging = os.path.abspath(tmp_path / "idx.staging")
    assert line.startswith(f"encoded shard 0/2 -> {staging}{os.sep}embeddings-0-of-2.npy. ")
    assert "under torchrun with 2 processes" in line
    assert f'{{"path": {json.dumps(staging)}, "sharded": true}}' in line
    assert "docs/distributed.md" in line
    assert f"merge them into one index directory {tmp_path / 'idx'}: run this command " \
           "without --shard" in line
    assert f"keeps {tmp_path / 'idx.staging'} unless given --remove-staging" in line


def test_merging_keeps_the_staged_shards_unless_asked(tmp_path, encoder_dir, capsys):
    corpus = _write_corpus(tmp_path / "psgs.tsv", PASSAGES)
    out = tmp_path / "idx"
    for i in range(2):
        assert _build(corpus, encoder_dir, out, "--shard", f"{i}/2") == 0
    staged = _staged(tmp_path)
    capsys.readouterr()
    assert _build(corpus, encoder_dir, out) == 0
    assert _staged(tmp_path) == staged == [  # untouched: what sharded training reads
        "embeddings-0-of-2.npy", "embeddings-1-of-2.npy", "key.json", "passages",
        "shard-0-of-2.json", "shard-1-of-2.json"]
    said = capsys.readouterr().out
    assert f"kept the staging folder {tmp_path / 'idx.staging'} with its 2 of 2 shards" in said
    assert "--remove-staging to remove it" in said
    np.testing.assert_allclose(_stored(out), _fresh_vectors(encoder_dir, PASSAGES, "cls"), atol=2e-3)
    # asked: the merge removes the staging folder
    assert _build(corpus, encoder_dir, out, "--overwrite", "--remove-staging") == 0
    assert _staged(tmp_path) is None and "kept the staging" not in capsys.readouterr().out
    np.testing.assert_allclose(_stored(out), _fresh_vectors(encoder_dir, PASSAGES, "cls"), atol=2e-3)


def test_a_single_build_removes_only_its_own_staging(tmp_path, encoder_dir, capsys):
    """Without shards the build's staging is its own and goes; an incomplete shard set another
    build is writing stays (only the single build's embeddings go)."""
    corpus = _write_corpus(tmp_path / "psgs.tsv", PASSAGES)
    assert _build(corpus, encoder_dir, tmp_path / "solo") == 0
    assert not (tmp_path / "solo.staging").exists()
    assert _build(corpus, encoder_dir, tmp_path / "idx", "--shard", "1/3") == 0
    assert _build(corpus, encoder_dir, tmp_path / "idx") == 0
    assert _staged(tmp_path) == ["embeddings-1-of-3.npy", "key.json", "passages",
                                 "shard-1-of-3.json"]
    assert "with its 1 of 3 shards" in capsys.readouterr().out


def test_remove_staging_is_refused_with_shard(tmp_path, encoder_dir, capsys):
    corpus = _write_corpus(tmp_path / "psgs.tsv", PASSAGES)
    assert _build(corpus, encoder_dir, tmp_path / "idx", "--shard", "0/2",
                  "--remove-staging") == 2
    assert capsys.readouterr().err.strip() == (
        "rag-fast: error: --remove-staging: only for the build without --shard (the one that "
        "merges the staged shards into --out); a --shard build adds its shard to the staging "
        "folder")
    assert list(tmp_path.iterdir()) == [tmp_path / "psgs.tsv"]
