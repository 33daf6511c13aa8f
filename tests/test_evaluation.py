"""Metrics, dataset loading errors, the eval loop and the `eval` / `train` subcommands."""
from __future__ import annotations

import json

import pytest
import torch

from rag_fast.evaluation import (DatasetError, bleu1, evaluate, exact_match, f1, label_accuracy,
                                 load_qa, match_tokens, normalize_answer, retrieval_recall,
                                 rouge_l)
from rag_fast.evaluation.metrics import answer_in_passage


def test_squad_normalisation_em_and_f1():
    assert normalize_answer("The  Eiffel-Tower!") == "eiffeltower"
    assert normalize_answer("an apple, a pear") == "apple pear"
    assert exact_match(["the Paris", "Lyon"], [["Paris"], ["Marseille", "lyon."]]) == 1.0
    assert exact_match(["Paris"], [["London"]]) == 0.0
    # tokens "new york" vs "new york city": P = 1, R = 2/3 -> F1 = 0.8
    assert f1(["New York"], [["New York City"]]) == pytest.approx(0.8)
    assert f1(["x"], [["y", "x"]]) == 1.0  # best over answers


@pytest.mark.parametrize("text,expected", [
    ("The Cat!", "cat"),                      # lower case, punctuation, article
    ("an apple", "apple"), ("A pear", "pear"),
    ("a.b", "ab"),                            # punctuation removed, not made a space
    ("Saint-Étienne", "saintétienne"),        # the hyphen goes; non-ASCII letters stay
    ("3.7.15", "3715"), ("2.5 million light-years", "25 million lightyears"),
    ("[a]/b", "ab"),                          # one word "ab", so no article "a" left
    ("  lots \t of\n\nspace  ", "lots of space"),
    ("theatre, anthem, atheist", "theatre anthem atheist"),  # articles only as whole words
    ("the-end", "theend"),                    # joined by the removed hyphen: not an article
    ("The a an THE", ""),
    ("l'Hôpital — «ça»", "lhôpital — «ça»"),  # only ASCII punctuation (string.punctuation)
    ("", ""),
])
def test_normalisation_is_squad_v1_1s(text, expected):
    assert normalize_answer(text) == expected


def test_normalisation_matches_squad_step_by_step_on_random_text():
    """The official order (lower, punctuation, articles, whitespace), written out here with
    str methods, agrees with normalize_answer on random strings of tricky characters."""
    import random
    import re
    import string

    def official_steps(s: str) -> str:
        s = s.lower()
        s = "".join(ch for ch in s if ch not in set(string.punctuation))
        s = re.sub(r"\b(a|an|the)\b", " ", s)
        return " ".join(s.split())

    rng = random.Random(0)
    alphabet = list("aAnNtThHeE .,-'!?\t\n/[]") + ["É", "ß", "—", "İ", "ﬁ", "3"]
    for _ in range(2000):
        s = "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 20)))
        assert normalize_answer(s) == official_steps(s), repr(s)


def test_em_and_f1_score_the_normalised_strings():
    from rag_fast.evaluation.metrics import exact_match_one, f1_one

    assert exact_match_one("The Cat!", ["cat"]) == 1.0
    assert exact_match_one("Saint Etienne", ["Saint-Étienne"]) == 0.0  # accents are kept
    assert exact_match_one("saint-étienne", ["Saint-Étienne"]) == 1.0
    assert exact_match_one("3.7.15", ["3 7 15"]) == 0.0  # "3715" vs "3 7 15"
    # F1 splits the normalised strings at whitespace: "a.b c" -> ["ab", "c"]
    assert f1_one("a.b c", ["ab d"]) == pytest.approx(0.5)
    assert f1_one("2.5 million light-years", ["25 lightyears"]) == pytest.approx(0.8)
    assert f1_one("the the cat", ["cat cat"]) == pytest.approx(2 * (1 / 1) * (1 / 2) / 1.5)
    # nothing left after normalising: 1.0 only against nothing
    assert f1_one("the", ["an"]) == 1.0 and f1_one("the", ["cat"]) == 0.0


def test_bleu1_and_rouge_l_from_libraries():
    # sacrebleu: 3/3 unigrams match, brevity penalty exp(1 - 5/3)
    assert bleu1(["the cat sat"], [["the cat sat on mat"]]) == pytest.approx(0.5134, abs=1e-3)
    # rouge-score: LCS 3, P = 1, R = 3/5 -> F = 0.75
    assert rouge_l(["the cat sat"], [["the cat sat on mat"]]) == pytest.approx(0.75)
    assert bleu1(["a b"], [["c d", "a b"]]) == pytest.approx(1.0)


def test_label_accuracy_and_retrieval_recall():
    assert label_accuracy(["SUPPORTS", "refutes"], ["supports", "supports"]) == 0.5
    passages = [[{"title": "Paris", "text": "capital of France"}, "nothing"], ["x", "Lyon is big"]]
    assert retrieval_recall(passages, [["France"], ["Lyon"]]) == 1.0
    assert retrieval_recall(passages, [["France"], ["Lyon"]], k=1) == 0.5
    assert retrieval_recall([["francesca"]], [["France"]]) == 0.0  # whole tokens only


@pytest.mark.parametrize("passage, answer, found", [
    # punctuation separates words: names in code, paths, hyphens (SQuAD's normalisation glued
    # them to their neighbours: ">>> R.dup_inner_gcd(x" became "rdupinnergcdx")
    (">>> R.dup_inner_gcd(x**2 - 1, x)", "dup_inner_gcd", True),
    (":func:`rational_algorithm`", "rational_algorithm", True),
    ("``CGate.control_value``", "CGate.control_value", True),
    ("It lies 2.5 million light-years away.", "2.5 million light-years", True),
    ("Saint-Étienne is a city.", "saint-étienne", True),
    ("Saint-E\u0301tienne is a city.", "Saint-Étienne", True),  # NFD text, NFC answer
    ("x=5.", "5", True),
    ("in 15 days", "5", False),  # whole tokens: "5" is not in "15"
    ("Francesca", "France", False),
    ("the dup_gcd function", "dup", True),  # a whole token before "_"
    ("The Beatles played", "the beatles", True),
    ("Beatles played", "the Beatles", False),  # articles are tokens too, as in DPR
    ("anything", "...", False),  # punctuation-only answers still need their tokens
    ("anything", "", False)])
def test_answers_are_found_as_consecutive_whole_tokens(passage, answer, found):
    assert answer_in_passage({"title": "", "text": passage}, [answer]) is found


def test_match_tokens_splits_punctuation_off():
    assert match_tokens(">>> R.dup_gcd(x)") == "> > > r . dup _ gcd ( x )"
    assert match_tokens("  Light-Years ") == "light - years"


def test_metric_errors():
    with pytest.raises(ValueError, match="empty dataset"):
        exact_match([], [])
    with pytest.raises(ValueError, match="2 predictions for 1 examples"):
        f1(["a", "b"], [["a"]])
    with pytest.raises(ValueError, match="non-empty list of strings"):
        exact_match(["a"], ["a"])


def test_load_jsonl_and_tsv(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text('{"question": "q1", "answers": ["a", "b"]}\n\n{"question": "q2", "answer": "c", '
                 '"label": "L"}\n')
    data = load_qa(str(p))
    assert [(e.question, e.answers, e.label) for e in data] == [("q1", ("a", "b"), None),
                                                                ("q2", ("c",), "L")]
    assert data[1].target == "L" and data[0].target == "a"
    t = tmp_path / "d.tsv"
    t.write_text('question\tanswers\nq1\t["a", "b"]\nq2\tc\td\n')
    assert [e.answers for e in load_qa(str(t))] == [("a", "b"), ("c", "d")]


@pytest.mark.parametrize("content, message", [
    ('{"question": "q", "answers": ["a"]}\n{"question": "q2", "answers": [\n', r"d.jsonl:2: malformed JSON"),
    ('{"question": "q"}\n', r"d.jsonl:1: no answers: looked for 'answers', 'answer', 'label'"),
    ('{"answers": ["a"]}\n', r"d.jsonl:1: no 'question' field"),
    ('{"question": " ", "answers": ["a"]}\n', r"d.jsonl:1: an empty 'question'"),
    ('[1, 2]\n', r"d.jsonl:1: expected a JSON object"),
    ('\n\n', r"empty dataset"),
])
def test_bad_jsonl_names_the_line(tmp_path, content, message):
    p = tmp_path / "d.jsonl"
    p.write_text(content)
    with pytest.raises(DatasetError, match=message):
        load_qa(str(p))


def test_bad_files(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_qa(str(tmp_path / "none.jsonl"))
    p = tmp_path / "d.csv"
    p.write_text("q,a\n")
    with pytest.raises(DatasetError, match="cannot tell the format"):
        load_qa(str(p))
    t = tmp_path / "d.tsv"
    t.write_text("only a question\n")
    with pytest.raises(DatasetError, match=r"d.tsv:1: expected 'question<TAB>answers'"):
        load_qa(str(t))


def _parser():
    from rag_fast.cli import build_parser

    return build_parser()


def test_eval_subcommand_scores_predictions(tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text('{"question": "q1", "answers": ["Paris"]}\n{"question": "q2", "answers": ["b c"]}\n')
    preds = tmp_path / "p.txt"
    preds.write_text("paris\nb\n")
    args = _parser().parse_args(["eval", "--data", str(data), "--predictions", str(preds), "--json"])
    assert args.func(args) == 0
    metrics = json.loads(capsys.readouterr().out)
    assert metrics["em"] == 0.5 and metrics["f1"] == round((1 + 2 / 3) / 2, 4)  # rounded
    preds.write_text("paris\n")
    with pytest.raises(ValueError, match="has 1 lines for 2 examples"):
        args.func(args)


def test_train_subcommand_config_errors(tmp_path):
    cfg = tmp_path / "c.json"
    cfg.write_text('{"model": {}, "train": {}}')
    args = _parser().parse_args(["train", "--config", str(cfg)])
    with pytest.raises(ValueError, match=r'c.json: model: no "path": .* or pass --model DIR'):
        args.func(args)
    cfg.write_text('{"model": 3, "train": {}}')
    with pytest.raises(ValueError, match=r"c.json: model: expected a model directory"):
        args.func(args)
    cfg.write_text('{"model": "m", "train": {}}')
    with pytest.raises(ValueError, match=r"c.json: data: expected \{'train': FILE"):
        args.func(args)
    cfg.write_text("{nope")
    with pytest.raises(ValueError, match="not valid JSON"):
        args.func(args)


def test_evaluate_loop_with_greedy_decoding():
    # reuses the fixed retriever and word tokenizer of the model tests
    from test_models import _FixedRetriever, _hf, _word_tokenizer

    from rag_fast.evaluation import QAExample
    from rag_fast.models import RagModel

    tok = _word_tokenizer()
    for mode in ("token", "sequence"):
        hf = _hf(mode)
        model = RagModel(hf.rag.generator, hf.rag.question_encoder, _FixedRetriever(16),
                         mode=mode, n_docs=3, generator_tokenizer=tok, question_tokenizer=tok)
        examples = [QAExample("what is x", ("passage",)), QAExample("what is y", ("nothing",))]
        result = evaluate(model, examples, batch_size=2, max_new_tokens=3)
        assert len(result.predictions) == 2
        assert result.metrics["recall@3"] == 0.5  # "passage" is in question 0's passages
        assert set(result.metrics) == {"em", "f1", "bleu1", "rougeL", "recall@3"}
        assert all(0.0 <= v <= 1.0 for v in result.metrics.values())
    with pytest.raises(ValueError, match="empty dataset"):
        evaluate(model, [])
    assert torch.is_grad_enabled()
