"""A full disk is an error, not a signal: the embeddings of ``rag-fast index build`` are allocated
on disk before they are written (and written with ordinary writes, never through a memory
map), and faiss's error on a full disk while saving an index is converted, so a disk without
room is one ``OSError`` (errno ENOSPC) naming the file, the bytes it needs and the bytes free,
never a SIGBUS, and no temporary file is left behind.

The disk is a real tmpfs of a few hundred KiB where this process may mount one (root on Linux);
elsewhere (a container without the right to mount) the same tests run against a folder whose
allocations fail as a full disk's do (``os.posix_fallocate`` raises ENOSPC there, for a
filesystem that cannot allocate ahead so do the writes past its size, and faiss's write of a
file too large for it fails as faiss does on a full disk), and assert the same.
"""
from __future__ import annotations

import contextlib
import csv
import errno
import io
import os
from pathlib import Path

import numpy as np
import pytest

from rag_fast import cli
from rag_fast.retrieval import DenseIndex, Encoder, PassageStore, encode_passages

WORDS = "paris france tower iron river water mountain nepal chess board game planet gas red".split()
DIM = 256  # a row of fp16 embeddings is 512 bytes: the embeddings outgrow the passages
PASSAGES = 400  # 200 KiB of embeddings


def _save_bert(root: Path) -> str:
    """A random BERT of width ``DIM`` (one layer) and its word-level tokenizer in ``root``."""
    import torch
    from transformers import BertConfig, BertModel, BertTokenizerFast

    root.mkdir(parents=True, exist_ok=True)
    vocab = root / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", ".", *WORDS]) + "\n")
    tok = BertTokenizerFast(vocab=str(vocab))
    torch.manual_seed(0)
    BertModel(BertConfig(vocab_size=len(tok), hidden_size=DIM, num_hidden_layers=1,
                         num_attention_heads=4, intermediate_size=64)).save_pretrained(str(root))
    tok.save_pretrained(str(root))
    return str(root)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("full-disk")
    encoder = _save_bert(root / "enc")
    passages = root / "p.tsv"
    with open(passages, "w", newline="") as f:
        w = csv.writer(f, delimiter="\t")
        w.writerow(["id", "text", "title"])
        for i in range(PASSAGES):
            w.writerow([f"d{i}", " ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(4 + i % 5)),
                        f"t{i}"])
    store = PassageStore.from_file(passages, root / "store", progress=False)
    return {"encoder": encoder, "passages": passages, "store": store}


def _needs() -> int:
    return PASSAGES * DIM * 2 + 128  # the rows and the .npy header


def test_encoding_onto_a_full_disk_is_one_error_before_any_passage_is_encoded(world, disk):
    encoder = Encoder(world["encoder"], device="cpu")
    out = disk.path / "emb.npy"
    calls = []
    with pytest.MonkeyPatch.context() as m:
        m.setattr(Encoder, "embed", lambda self, **kw: calls.append(1))
        with pytest.raises(OSError) as e:
            encode_passages(encoder, world["store"], out, progress=False)
    assert e.value.errno == errno.ENOSPC and not calls  # refused before encoding anything
    message = str(e.value)
    assert message.startswith(f"no space left on device writing {out}: needs {_needs()} bytes")
    assert " free (" in message and "\n" not in message, message
    assert not out.exists() and disk.leftovers() == [] and not list(disk.path.iterdir())


def test_a_disk_that_fills_while_encoding_is_one_error_too(world, disk):
    """Where the filesystem cannot allocate ahead, the full disk shows in an ordinary write
    (never in a write through a memory map, which would be a SIGBUS)."""
    disk.cannot_allocate_ahead()
    encoder = Encoder(world["encoder"], device="cpu")
    out = disk.path / "emb.npy"
    with pytest.raises(OSError) as e:
        encode_passages(encoder, world["store"], out, batch_size=32, progress=False)
    assert e.value.errno == errno.ENOSPC
    assert str(e.value).startswith(f"no space left on device writing {out}: needs {_needs()} bytes")
    assert not out.exists() and disk.leftovers() == [] and not list(disk.path.iterdir())


def test_the_encoded_file_is_unchanged_where_there_is_room(world, tmp_path):
    encoder = Encoder(world["encoder"], device="cpu")
    path = encode_passages(encoder, world["store"], tmp_path / "emb.npy", batch_size=32, progress=False)
    written = np.load(path)
    store = world["store"]
    expected = encoder.encode([store.text(i) for i in range(len(store))],
                              [store.title(i) for i in range(len(store))]).numpy().astype(np.float16)
    assert written.shape == (PASSAGES, DIM) and written.dtype == np.float16
    np.testing.assert_allclose(written.astype(np.float32), expected.astype(np.float32), atol=2e-3)
    assert os.path.getsize(path) == _needs() and sorted(os.listdir(tmp_path)) == ["emb.npy"]


def test_index_build_onto_a_full_disk_exits_2_with_one_line(world, disk):
    out = disk.path / "kb"
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = cli.main(["index", "build", "--passages", str(world["passages"]), "--encoder",
                         world["encoder"], "--preset", "exact", "--out", str(out), "--no-progress",
                         "--device", "cpu"])
    staged = out.with_name("kb.staging") / "embeddings-0-of-1.npy"
    assert code == 2, err.getvalue()
    assert err.getvalue().startswith(f"rag-fast: error: no space left on device writing {staged}: "
                                     f"needs {_needs()} bytes")
    assert err.getvalue().count("\n") == 1, err.getvalue()
    assert disk.leftovers() == [] and not out.exists()
    assert not staged.parent.exists()  # the staging this build created went with it


def test_saving_an_index_onto_a_full_disk_names_the_file(disk):
    x = np.random.default_rng(0).standard_normal((1000, 64)).astype(np.float32)  # 256 KiB flat
    index = DenseIndex.build(x, "exact", progress=False)
    with pytest.raises(OSError) as e:
        index.save(disk.path / "idx")
    assert e.value.errno == errno.ENOSPC
    message = str(e.value)
    assert message.startswith(f"no space left on device writing {disk.path / 'idx' / 'index.faiss'}"
                              f": needs {1000 * 64 * 4 + 45} bytes"), message
    assert " free (" in message and "\n" not in message
    assert not list(disk.path.iterdir())  # the temporary directory is gone, nothing is at idx
    small = DenseIndex.build(x[:100], "exact", progress=False)  # and a smaller index fits
    small.save(disk.path / "idx")
    assert DenseIndex.load(disk.path / "idx").search(x[:1], 1)[1][0, 0] == 0
