"""BM25 (rag_fast.retrieval.lexical) against a plain-Python Lucene BM25 in float64, its
saved part verified on load, and both fusions against plain-Python versions, ties included."""
from __future__ import annotations

import json
import math
import random
from collections import Counter

import numpy as np
import pytest

from rag_fast.retrieval.lexical import (B, K1, RRF_C, BM25Index, reciprocal_rank_fusion,
                                        weighted_fusion, words)
from rag_fast.storage import StorageError

TITLES = ["Paris", "Rome", "Berlin", "Misc", "Paris", "Nile", "Seine"]
TEXTS = ["the city of paris lies on the seine, the seine flows through paris",
         "rome lies on the tiber river", "berlin is on the spree river", "nothing here at all",
         "paris paris paris", "the nile river flows north through cairo and many other cities "
         "of egypt", "the seine river"]
QUESTIONS = ["which river is paris on", "river", "seine seine", "zzz unknown words",
             "the and of", "cairo egypt nile river"]


def oracle_scores(question: str) -> list[float]:
    """Lucene's BM25 in float64: idf = ln(1 + (N - df + 0.5) / (df + 0.5)), a word's part
    tf / (tf + k1 (1 - b + b |d| / avg |d|)), summed over the question's words (repeats
    count again)."""
    docs = [Counter(w) for w in words([f"{t} {x}" for t, x in zip(TITLES, TEXTS)])]
    lengths = [sum(d.values()) for d in docs]
    average = sum(lengths) / len(docs)
    out = []
    for doc, length in zip(docs, lengths):
        total = 0.0
        for word in words([question])[0]:
            df = sum(word in d for d in docs)
            if df == 0 or word not in doc:
                continue
            idf = math.log(1 + (len(docs) - df + 0.5) / (df + 0.5))
            tf = doc[word]
            total += idf * tf / (tf + K1 * (1 - B + B * length / average))
        out.append(total)
    return out


@pytest.fixture(scope="module")
def bm25():
    return BM25Index.build(TITLES, TEXTS)


def test_the_words_scored_are_lowercased_without_stop_words():
    assert words(["The Seine's banks, in 1889!"]) == [["seine", "banks", "1889"]]


@pytest.mark.parametrize("question", QUESTIONS)
def test_scores_equal_lucene_bm25_in_float64(bm25, question):
    np.testing.assert_allclose(bm25.scores(question), oracle_scores(question), rtol=1e-5,
                               atol=1e-6)


@pytest.mark.parametrize("k", [1, 2, 3, 7, 9])
def test_search_is_the_best_first_ties_by_row_and_minus_one_past_the_matches(bm25, k):
    scores, rows = bm25.search(QUESTIONS, k)
    assert scores.shape == rows.shape == (len(QUESTIONS), k)
    for q, question in enumerate(QUESTIONS):
        exact = oracle_scores(question)
        ranked = sorted((i for i in range(len(TEXTS)) if exact[i] > 0),
                        key=lambda i: (-round(exact[i], 5), i))[:k]
        assert rows[q].tolist() == ranked + [-1] * (k - len(ranked)), question
        assert (scores[q, len(ranked):] == 0).all()


def test_equal_scores_are_ordered_by_row():
    ties = BM25Index.build(["a"] * 5, ["red apple", "green pear", "red apple", "blue",
                                       "red apple"])
    assert ties.search(["red apple"], 2)[1].tolist() == [[0, 2]]
    assert ties.search(["red apple"], 5)[1].tolist() == [[0, 2, 4, -1, -1]]
    # many equal scores past the k-th place: the first rows, whatever a partial sort picks
    better = {23, 97, 99}
    many = BM25Index.build(["a"] * 200, ["red apple apple" if i in better else "red apple pear"
                                         for i in range(200)])
    assert many.search(["red apple"], 5)[1].tolist() == [[23, 97, 99, 0, 1]]


def test_bad_arguments_are_named(bm25):
    with pytest.raises(ValueError, match="k must be a positive int"):
        bm25.search(["x"], 0)
    with pytest.raises(ValueError, match="titles has 1 entries and texts 2"):
        BM25Index.build(["a"], ["b", "c"])
    with pytest.raises(ValueError, match="no passages"):
        BM25Index.build([], [])


def test_a_saved_part_loads_memory_mapped_and_searches_the_same(bm25, tmp_path):
    bm25.save(tmp_path / "bm25")
    loaded = BM25Index.load(tmp_path / "bm25", expected_count=len(TEXTS))
    assert isinstance(loaded.model.scores["data"], np.memmap)
    for a, b in zip(loaded.search(QUESTIONS, 4), bm25.search(QUESTIONS, 4)):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(FileExistsError):
        bm25.save(tmp_path / "bm25")


@pytest.mark.parametrize("file", ["data.csc.index.npy", "indices.csc.index.npy",
                                  "vocab.index.json", "params.index.json"])
def test_an_edited_file_of_the_part_is_refused_naming_it(bm25, tmp_path, file):
    bm25.save(tmp_path / "bm25")
    path = tmp_path / "bm25" / file
    data = bytearray(path.read_bytes())
    data[-2] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(StorageError, match=f"{file}.*SHA-256"):
        BM25Index.load(tmp_path / "bm25")
    path.write_bytes(bytes(data[:-1]))
    with pytest.raises(StorageError, match=f"{file}.*bytes"):
        BM25Index.load(tmp_path / "bm25", verify=False)


def test_a_part_of_another_size_or_an_edited_count_is_refused(bm25, tmp_path):
    bm25.save(tmp_path / "bm25")
    with pytest.raises(StorageError, match="key 'passages' is 7, expected 8"):
        BM25Index.load(tmp_path / "bm25", expected_count=8)
    manifest = tmp_path / "bm25" / "manifest.json"
    payload = json.loads(manifest.read_text())
    payload["passages"] = 6
    manifest.write_text(json.dumps(payload))
    with pytest.raises(StorageError, match="manifest.json"):
        BM25Index.load(tmp_path / "bm25")


# ---- fusion against plain Python ------------------------------------------------------------

def plain_rrf(rankings, k, c=RRF_C):
    out = []
    for q in range(len(rankings[0])):
        score, first = {}, {}
        for n, ranking in enumerate(rankings):
            for rank, row in enumerate(ranking[q], start=1):
                if row < 0:
                    continue
                score[row] = score.get(row, 0) + 1 / (c + rank)
                if n == 0:
                    first[row] = rank
        best = sorted(score, key=lambda r: (-score[r], first.get(r, len(rankings[0][q]) + 1),
                                            r))[:k]
        pad = k - len(best)
        out.append((best + [-1] * pad, [score[r] for r in best] + [0] * pad))
    return out


def plain_weighted(dense, lexical, k, weight):
    out = []
    for q in range(len(dense[1])):
        scaled = []
        for scores, rows in (dense, lexical):
            kept = [(float(s), int(r)) for s, r in zip(scores[q], rows[q]) if r >= 0]
            if not kept:
                scaled.append({})
                continue
            low, high = min(s for s, _ in kept), max(s for s, _ in kept)
            scaled.append({r: (s - low) / (high - low) if high > low else 1.0 for s, r in kept})
        d, b = scaled
        total = {r: weight * d.get(r, 0) + (1 - weight) * b.get(r, 0) for r in {*d, *b}}
        best = sorted(total, key=lambda r: (-total[r], -d.get(r, -1), r))[:k]
        out.append(best + [-1] * (k - len(best)))
    return out


def _rankings(seed, questions=6, depth=5, rows=9):
    rng = random.Random(seed)
    out = []
    for _ in range(2):
        ranking = np.full((questions, depth), -1, np.int64)
        scores = np.zeros((questions, depth), np.float32)
        for q in range(questions):
            found = rng.sample(range(rows), rng.randint(0, depth))
            ranking[q, :len(found)] = found
            # a few equal scores: ties in the weighted fusion
            values = sorted((rng.choice([0.5, 1.0, 1.5, 2.0, rng.random()]) for _ in found),
                            reverse=True)
            scores[q, :len(found)] = values
        out.append((scores, ranking))
    return out


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("k", [1, 3, 10])
def test_reciprocal_rank_fusion_equals_plain_python(seed, k):
    (_, dense), (_, lexical) = _rankings(seed)
    scores, rows = reciprocal_rank_fusion([dense, lexical], k)
    expected = plain_rrf([dense, lexical], k)
    assert rows.tolist() == [r for r, _ in expected]
    np.testing.assert_allclose(scores, [s for _, s in expected], rtol=1e-6)


def test_reciprocal_rank_fusion_breaks_ties_by_the_dense_rank_then_the_row():
    dense = np.array([[3, 1, -1]])
    lexical = np.array([[1, 3, 8]])
    # 3 and 1 tie (ranks 1+2 each): the dense ranking's first wins; 8 alone comes last
    assert reciprocal_rank_fusion([dense, lexical], 3)[1].tolist() == [[3, 1, 8]]
    scores, rows = reciprocal_rank_fusion([np.array([[-1]]), np.array([[5]])], 2)
    assert rows.tolist() == [[5, -1]] and scores.tolist() == [[np.float32(1 / 61), 0.0]]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("weight", [0.0, 0.3, 0.5, 1.0])
def test_weighted_fusion_equals_plain_python(seed, weight):
    dense, lexical = _rankings(seed)
    assert weighted_fusion(dense, lexical, 4, weight)[1].tolist() == \
        plain_weighted(dense, lexical, 4, weight)


def test_weighted_fusion_ties_and_bounds():
    dense = (np.array([[2.0, 1.0]], np.float32), np.array([[4, 6]]))
    lexical = (np.array([[3.0, 1.0]], np.float32), np.array([[6, 4]]))
    # at 0.5 rows 4 and 6 tie at 0.5: the higher dense score first
    scores, rows = weighted_fusion(dense, lexical, 2, 0.5)
    assert rows.tolist() == [[4, 6]] and scores.tolist() == [[0.5, 0.5]]
    assert weighted_fusion(dense, lexical, 2, 0.0)[1].tolist() == [[6, 4]]
    with pytest.raises(ValueError, match="weight must be in"):
        weighted_fusion(dense, lexical, 2, 1.5)


# ---- the weighted fusion's weight, tuned --------------------------------------------------

def plain_tune(dense, lexical, gold, k):
    """Every weight 0, 0.05, ..., 1 tried by plain_weighted; the best recall@k, the weight
    nearest 0.5 (the lower of two) among those that reach it."""
    recall = {}
    for i in range(21):
        weight = i / 20
        rows = plain_weighted(dense, lexical, k, weight)
        recall[weight] = sum(bool(set(r) & g) for r, g in zip(rows, gold)) / len(gold)
    best = max(recall.values())
    return sorted((w for w in recall if recall[w] == best), key=lambda w: (abs(w - 0.5), w))[0]


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("k", [1, 2])
def test_tune_weight_equals_plain_python(seed, k):
    from rag_fast.retrieval.lexical import tune_weight

    dense, lexical = _rankings(seed, questions=12)
    rng = random.Random(seed)
    gold = [{rng.randrange(9)} | {rng.randrange(9)} for _ in range(12)]
    weight, recall = tune_weight(dense, lexical, gold, k)
    assert weight == plain_tune(dense, lexical, gold, k)
    assert len(recall) == 21 and recall[weight] == max(recall.values())


def test_tune_weight_follows_the_ranking_that_finds_the_gold():
    from rag_fast.retrieval.lexical import tune_weight

    scores = np.array([[3.0, 2.0, 1.0]] * 4, np.float32)
    dense = (scores, np.array([[0, 1, 2]] * 4))
    lexical = (scores, np.array([[2, 1, 0]] * 4))
    # rows 0 and 2 tie at 0.5, the dense ranking's first wins: 0.5 finds dense's best
    assert tune_weight(dense, lexical, [{0}] * 4, 1)[0] == 0.5
    assert tune_weight(dense, lexical, [{2}] * 4, 1)[0] == 0.45  # BM25's best needs less
    assert tune_weight(dense, lexical, [{1}] * 4, 1)[0] == 0.5  # never first: an even mix
    with pytest.raises(ValueError, match="at least one gold"):
        tune_weight(dense, lexical, [{0}, set(), {0}, {0}], 1)
    with pytest.raises(ValueError, match="3 gold sets for 4"):
        tune_weight(dense, lexical, [{0}] * 3, 1)
    # row 0: dense 1, BM25 0; row 3: dense 0.75, BM25 0.5 (scaled): row 0 first past 2/3
    dense = (np.array([[1.0, 0.75, 0.0]], np.float32), np.array([[0, 3, 1]]))
    lexical = (np.array([[1.0, 0.5, 0.0]], np.float32), np.array([[2, 3, 0]]))
    weight, recall = tune_weight(dense, lexical, [{0}], 1)
    assert weight == 0.7 and recall[0.65] == 0.0 and recall[1.0] == 1.0


def test_the_tuned_weight_is_saved_sealed_and_checked(bm25, tmp_path):
    part = BM25Index.build(TITLES, TEXTS)
    assert part.weight == 0.5 and part.fusion is None
    part.fusion = {"weight": 0.35, "k": 5, "tuned_on": "a test"}
    part.save(tmp_path / "bm25")
    assert BM25Index.load(tmp_path / "bm25").weight == 0.35
    manifest = tmp_path / "bm25" / "manifest.json"
    payload = json.loads(manifest.read_text())
    payload["fusion"]["weight"] = 0.9  # edited: the seal no longer holds
    manifest.write_text(json.dumps(payload))
    with pytest.raises(StorageError, match="manifest.json"):
        BM25Index.load(tmp_path / "bm25")
    from rag_fast.storage import write_manifest

    for bad in (1.5, "0.5", None, True):  # resealed, a weight out of range is still refused
        payload["fusion"]["weight"] = bad
        payload.pop("sha256", None)
        write_manifest(manifest, {k: v for k, v in payload.items() if k != "seal"})
        with pytest.raises(StorageError, match="key 'fusion'"):
            BM25Index.load(tmp_path / "bm25")
