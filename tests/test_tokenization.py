"""Answers that survive tokenization: `rag-fast tokenizer fit` (rag_fast.tokenization), the
example's generator tokenizer it made, and how `init` takes a tokenizer's vocabulary and
special ids (the answers' decoding in `generate` / `eval`: tests/test_eval_generate.py).

Exact match compares the generator's decoded answer with the gold one: a tokenizer that
lower-cases, strips accents, splits "3.7.15" into "3. 7. 15" or maps "[" to [UNK] makes some
answers impossible to produce, whatever the model learns.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from rag_fast import cli
from rag_fast.tokenization import (MIN_VOCAB_SIZE, SPECIAL_TOKENS, fit_tokenizer,
                                   fit_tokenizer_folder)

REPO = Path(__file__).resolve().parents[1]
WORKFLOW = REPO / "examples" / "workflow"
TOKENIZER = WORKFLOW / "generator-tokenizer"
TRICKY = ["3.7.15", "Saint-Étienne", "[a]/b", "2.5 million light-years", "  two spaces  ",
          " leading", "trailing ", "line\nbreak\r\nand\ttab", "emoji 🎉👍🏽 and 中文",
          "a . b , c ! d ?", "don't", "l'Hôpital", "C++ / C# // R", "<s> </s> <pad> <mask>",
          "ÅNGSTRÖM Ⅻ ﬁ", "", " ", "\n", "x\u200by"]
TEXTS = ["Cairo lies on the Nile.", "The Andromeda galaxy is 2.5 million light-years away.",
         "Version 3.7.15 was released in Saint-Étienne.", "Use [brackets] and a/b paths."] * 5


def _roundtrip(tok, text: str) -> str:
    return tok.decode(tok(text, add_special_tokens=False)["input_ids"])


def _run(capsys, *args) -> tuple[int, str, str]:
    code = cli.main(["tokenizer", "fit", *[str(a) for a in args]])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# ---- the shipped example tokenizer ---------------------------------------------------------
@pytest.fixture(scope="module")
def example():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(TOKENIZER))


def _qa_texts(name: str) -> list[str]:
    rows = [json.loads(line) for line in (WORKFLOW / name).read_text("utf-8").splitlines()]
    return [text for row in rows for text in [row["question"], *row["answers"]]]


@pytest.mark.parametrize("name", ["train.jsonl", "dev.jsonl"])
def test_every_question_and_answer_of_the_example_round_trips(example, name):
    texts = _qa_texts(name)
    assert len(texts) >= 2 * len((WORKFLOW / name).read_text("utf-8").splitlines())  # q + a
    broken = [t for t in texts if _roundtrip(example, t) != t]
    assert not broken, broken[:5]
    # as an answer comes out of decoding: after the start token, before the end token
    ids = [[0, *example(t, add_special_tokens=False)["input_ids"], 2, 1, 1] for t in texts]
    assert example.batch_decode(ids, skip_special_tokens=True) == texts
    assert example.unk_token_id not in {i for row in ids for i in row}


def test_the_example_passages_round_trip_and_the_dev_set_has_the_reported_answer(example):
    rows = [json.loads(x) for x in (WORKFLOW / "passages.jsonl").read_text("utf-8").splitlines()]
    broken = [r["id"] for r in rows for t in (r["title"], r["text"]) if _roundtrip(example, t) != t]
    assert not broken, broken[:5]
    assert "2.5 million light-years" in _qa_texts("dev.jsonl")  # the example answer


def test_the_example_tokenizer_is_what_the_documented_command_makes(tmp_path, capsys):
    """The README / docs command, run again, writes the shipped tokenizer byte for byte."""
    marker = json.loads((TOKENIZER / "rag_fast-output.json").read_text("utf-8"))
    assert marker["kind"] == "rag_fast.tokenizer" and marker["vocab_size"] == 4000
    assert marker["passages"] == "examples/workflow/passages.jsonl"
    assert marker["data"] == ["examples/workflow/train.jsonl"]
    out = tmp_path / "tok"
    code, printed, err = _run(capsys, "--passages", WORKFLOW / "passages.jsonl", "--data",
                              WORKFLOW / "train.jsonl", "--vocab-size", 4000, "--out", out)
    assert code == 0, err
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (out / name).read_bytes() == (TOKENIZER / name).read_bytes(), name
    assert {n: f["sha256"] for n, f in marker["files"].items()} == {
        n: f["sha256"] for n, f in json.loads((out / "rag_fast-output.json").read_text())
        ["files"].items()}


def test_the_example_tokenizer_has_the_ids_the_example_generator_gets(example):
    from rag_fast.models.build import _generator_from_config

    assert len(example) == 4000
    assert [example.convert_tokens_to_ids(t) for t, _ in SPECIAL_TOKENS] == [0, 1, 2, 3, 4]
    assert (example.bos_token_id, example.pad_token_id, example.eos_token_id) == (0, 1, 2)
    torch.manual_seed(0)
    generator = _generator_from_config(str(WORKFLOW / "generator.json"), example, seed=0)
    c = generator.config
    assert c.vocab_size == 4000 and generator.get_input_embeddings().num_embeddings == 4000
    assert (c.pad_token_id, c.bos_token_id, c.eos_token_id, c.decoder_start_token_id) == (1, 0, 2, 0)
    context = example("a question")["input_ids"]
    assert context[0] == 0 and context[-1] == 2  # <s> text </s>, as BART encodes


# ---- fit_tokenizer: decode(encode(text)) == text --------------------------------------------
@pytest.fixture(scope="module")
def fitted():
    return fit_tokenizer(TEXTS, vocab_size=300)


@pytest.mark.parametrize("text", TRICKY)
def test_any_text_round_trips(fitted, text):
    assert _roundtrip(fitted, text) == text
    ids = fitted(text)["input_ids"]  # with <s> and </s>
    assert ids[0] == 0 and ids[-1] == 2
    assert fitted.decode(ids, skip_special_tokens=True) == text
    assert fitted.unk_token_id not in ids


def test_a_fit_is_deterministic_and_bounded_by_vocab_size(fitted):
    again = fit_tokenizer(TEXTS, vocab_size=300)
    assert again.backend_tokenizer.to_str() == fitted.backend_tokenizer.to_str()
    assert len(fitted) <= 300
    assert len(fit_tokenizer(["tiny"], vocab_size=5000)) < 5000  # no more merges to make


@pytest.mark.parametrize("vocab_size,message", [
    (MIN_VOCAB_SIZE - 1, f"vocab_size must be at least {MIN_VOCAB_SIZE}"),
    (0, "at least"), (-5, "at least"), (300.0, "must be an int"), (True, "must be an int"),
])
def test_a_bad_vocab_size_is_refused(vocab_size, message):
    with pytest.raises(ValueError, match=message):
        fit_tokenizer(TEXTS, vocab_size=vocab_size)


def test_the_smallest_vocabulary_still_round_trips():
    tok = fit_tokenizer(TEXTS, vocab_size=MIN_VOCAB_SIZE)
    assert len(tok) == MIN_VOCAB_SIZE
    assert all(_roundtrip(tok, t) == t for t in TRICKY)


# ---- rag-fast tokenizer fit -----------------------------------------------------------------
@pytest.fixture
def corpus(tmp_path):
    passages = tmp_path / "passages.jsonl"
    passages.write_text("".join(json.dumps({"id": str(i), "title": f"T{i}", "text": t}) + "\n"
                                for i, t in enumerate(TEXTS)), encoding="utf-8")
    qa = tmp_path / "qa.jsonl"
    qa.write_text(json.dumps({"question": "Which version?", "answers": ["3.7.15"]}) + "\n"
                  + json.dumps({"question": "Where?", "answers": ["Saint-Étienne", "[a]/b"]})
                  + "\n", encoding="utf-8")
    return passages, qa


def test_the_command_writes_a_folder_transformers_opens(tmp_path, corpus, capsys):
    from transformers import AutoTokenizer

    passages, qa = corpus
    out = tmp_path / "tok"
    code, printed, err = _run(capsys, "--passages", passages, "--data", qa, "--vocab-size", 300,
                              "--out", out)
    assert code == 0, err
    assert printed.startswith("fitted a byte-level BPE tokenizer of 300 tokens on 20 passages "
                              "and 2 questions with their answers (") and str(out) in printed
    assert sorted(p.name for p in out.iterdir()) == [
        "rag_fast-output.json", "special_tokens_map.json", "tokenizer.json",
        "tokenizer_config.json"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tok.")]  # no temporaries
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert config["clean_up_tokenization_spaces"] is False
    assert json.loads((out / "special_tokens_map.json").read_text()) == {
        "bos_token": "<s>", "cls_token": "<s>", "eos_token": "</s>", "sep_token": "</s>",
        "pad_token": "<pad>", "unk_token": "<unk>", "mask_token": "<mask>"}
    tok = AutoTokenizer.from_pretrained(str(out))
    assert len(tok) == 300
    for text in TRICKY:
        assert _roundtrip(tok, text) == text, text
    marker = json.loads((out / "rag_fast-output.json").read_text())
    assert marker["kind"] == "rag_fast.tokenizer" and marker["data"] == [str(qa)]
    assert set(marker["files"]) == {"special_tokens_map.json", "tokenizer.json",
                                    "tokenizer_config.json"}


def test_the_data_files_text_is_fitted_on(tmp_path, corpus):
    passages, qa = corpus
    rare = "Zyxwvutsrq"
    qa.write_text("".join(json.dumps({"question": f"{rare}?", "answers": [rare]}) + "\n"
                          for _ in range(30)), encoding="utf-8")
    without = fit_tokenizer_folder(passages, tmp_path / "a", vocab_size=400)
    with_data = fit_tokenizer_folder(passages, tmp_path / "b", vocab_size=400, data=[qa])
    assert (without.questions, with_data.questions) == (0, 30)
    from transformers import AutoTokenizer

    a, b = (AutoTokenizer.from_pretrained(str(tmp_path / n)) for n in "ab")
    assert len(b(rare, add_special_tokens=False)["input_ids"]) == 1  # learnt as one token
    assert len(a(rare, add_special_tokens=False)["input_ids"]) > 1


@pytest.mark.parametrize("kind", ["tsv", "txt", "folder"])
def test_the_passage_formats_of_index_build(tmp_path, capsys, kind):
    if kind == "tsv":
        path = tmp_path / "p.tsv"
        path.write_text("id\ttext\ttitle\n" + "".join(f"{i}\t{t}\tT{i}\n"
                                                      for i, t in enumerate(TEXTS)))
    else:
        folder = tmp_path / "docs"
        folder.mkdir()
        (folder / "doc_one.txt").write_text(" ".join(TEXTS), encoding="utf-8")
        path = folder if kind == "folder" else folder / "doc_one.txt"
    code, printed, err = _run(capsys, "--passages", path, "--vocab-size", 280, "--out",
                              tmp_path / "tok")
    assert code == 0, err
    assert "tokens on " in printed and " passages (" in printed  # no QA files: not named
    # fitted on every passage's title and text, read as index build reads the format: TSV rows
    # (the header is no passage) with their titles; a raw document in runs of 100 words, each
    # titled by the file's stem
    if kind == "tsv":
        titles, texts = [f"T{i}" for i in range(len(TEXTS))], TEXTS
    else:
        words = " ".join(TEXTS).split()
        texts = [" ".join(words[i:i + 100]) for i in range(0, len(words), 100)]
        titles = ["doc one"] * len(texts)
    characters = sum(map(len, titles)) + sum(map(len, texts))
    assert f" on {len(texts)} passages ({characters:,} characters) -> " in printed, printed
    from transformers import AutoTokenizer  # and what it learnt is those texts' tokenizer

    expected = fit_tokenizer([t for pair in zip(titles, texts) for t in pair], 280)
    assert AutoTokenizer.from_pretrained(str(tmp_path / "tok")).get_vocab() == expected.get_vocab()


def _one_error(code, err, *words):
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rag-fast: error: "), err
    for word in words:
        assert word in lines[0], lines[0]


def test_a_missing_passages_or_data_file_is_named(tmp_path, corpus, capsys):
    passages, qa = corpus
    code, _, err = _run(capsys, "--passages", tmp_path / "nope.jsonl", "--vocab-size", 300,
                        "--out", tmp_path / "tok")
    _one_error(code, err, "--passages: ", "nope.jsonl", "does not exist")
    code, _, err = _run(capsys, "--passages", passages, "--data", qa, "--data",
                        tmp_path / "gone.jsonl", "--vocab-size", 300, "--out", tmp_path / "tok")
    _one_error(code, err, "--data: ", "gone.jsonl", "does not exist")
    assert not (tmp_path / "tok").exists()


def test_malformed_inputs_are_named_with_their_line(tmp_path, corpus, capsys):
    passages, qa = corpus
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "q", "answers": ["a"]}) + "\n{not json\n")
    code, _, err = _run(capsys, "--passages", passages, "--data", bad, "--vocab-size", 300,
                        "--out", tmp_path / "tok")
    _one_error(code, err, f"{bad}:2")
    broken = tmp_path / "broken.jsonl"
    broken.write_text(passages.read_text() + '{"id": "x", "title": 3}\n')
    code, _, err = _run(capsys, "--passages", broken, "--vocab-size", 300, "--out",
                        tmp_path / "tok")
    _one_error(code, err, f"{broken}:{len(TEXTS) + 1}")
    unknown = tmp_path / "passages.csv"
    unknown.write_text("a,b\n")
    code, _, err = _run(capsys, "--passages", unknown, "--vocab-size", 300, "--out",
                        tmp_path / "tok")
    _one_error(code, err, "--passages: cannot tell the format")
    assert not (tmp_path / "tok").exists()


def test_passages_without_text_are_refused(tmp_path, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    code, _, err = _run(capsys, "--passages", empty, "--vocab-size", 300, "--out",
                        tmp_path / "tok")
    _one_error(code, err, "hold no text to fit a tokenizer on")
    assert not (tmp_path / "tok").exists()


@pytest.mark.parametrize("value,words", [
    ("100", ["--vocab-size must be at least 261", "got 100"]),
    ("0", ["--vocab-size must be at least 261"]),
    ("-3", ["--vocab-size must be at least 261"]),
])
def test_a_bad_vocab_size_is_named_as_the_flag(tmp_path, corpus, capsys, value, words):
    passages, _ = corpus
    code, _, err = _run(capsys, "--passages", passages, "--vocab-size", value, "--out",
                        tmp_path / "tok")
    _one_error(code, err, *words)
    assert not (tmp_path / "tok").exists()


def test_a_vocab_size_that_is_not_a_number_is_an_argparse_error(tmp_path, corpus, capsys):
    passages, _ = corpus
    with pytest.raises(SystemExit) as exc:
        _run(capsys, "--passages", passages, "--vocab-size", "4k", "--out", tmp_path / "tok")
    assert exc.value.code == 2
    assert "--vocab-size: invalid int value: '4k'" in capsys.readouterr().err


def test_a_folder_the_command_did_not_make_is_never_written(tmp_path, corpus, capsys):
    passages, _ = corpus
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    for extra in ([], ["--overwrite"]):
        code, _, err = _run(capsys, "--passages", passages, "--vocab-size", 300, "--out", out,
                            *extra)
        _one_error(code, err, "--out", "holds files rag_fast did not write")
        assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    # a hand-made tokenizer folder (transformers' files, no marker) is not the command's either
    shutil.copy(TOKENIZER / "tokenizer.json", out / "tokenizer.json")
    code, _, err = _run(capsys, "--passages", passages, "--vocab-size", 300, "--out", out,
                        "--overwrite")
    _one_error(code, err, "--out", "did not write")
    # a file, and a rag_fast folder of another kind (an evaluation's)
    (tmp_path / "file").write_text("x")
    code, _, err = _run(capsys, "--passages", passages, "--vocab-size", 300, "--out",
                        tmp_path / "file", "--overwrite")
    _one_error(code, err, "--out", "is not a folder")
    evaluation = tmp_path / "eval"
    evaluation.mkdir()
    (evaluation / "rag_fast-output.json").write_text(json.dumps({"kind": "rag_fast.eval"}))
    code, _, err = _run(capsys, "--passages", passages, "--vocab-size", 300, "--out",
                        evaluation, "--overwrite")
    _one_error(code, err, "--out", "is an evaluation's folder", "not a tokenizer folder")
    assert (tmp_path / "file").read_text() == "x"
    assert [p.name for p in evaluation.iterdir()] == ["rag_fast-output.json"]


def test_its_own_folder_is_replaced_only_with_overwrite(tmp_path, corpus, capsys):
    passages, qa = corpus
    out = tmp_path / "tok"
    assert _run(capsys, "--passages", passages, "--vocab-size", 300, "--out", out)[0] == 0
    before = (out / "tokenizer.json").read_bytes()
    code, _, err = _run(capsys, "--passages", passages, "--vocab-size", 280, "--out", out)
    _one_error(code, err, "--out", "already exists (pass --overwrite to replace it)")
    assert (out / "tokenizer.json").read_bytes() == before
    code, _, err = _run(capsys, "--passages", passages, "--data", qa, "--vocab-size", 280,
                        "--out", out, "--overwrite")
    assert code == 0, err
    assert json.loads((out / "rag_fast-output.json").read_text())["vocab_size"] == 280
    # a file added to it afterwards is the user's: --overwrite would delete it, so refused
    (out / "notes.txt").write_text("mine")
    code, _, err = _run(capsys, "--passages", passages, "--vocab-size", 300, "--out", out,
                        "--overwrite")
    _one_error(code, err, "--out", "'notes.txt'", "that rag_fast did not write")
    assert (out / "notes.txt").read_text() == "mine"


def test_an_output_overlapping_an_input_is_refused(tmp_path, corpus, capsys):
    passages, qa = corpus
    code, _, err = _run(capsys, "--passages", passages, "--vocab-size", 300, "--out", tmp_path)
    _one_error(code, err, "--out", "contains --passages")
    code, _, err = _run(capsys, "--passages", passages, "--data", qa, "--vocab-size", 300,
                        "--out", qa)
    _one_error(code, err, "--out", f"is --data {qa}")
    assert passages.exists() and qa.exists()


def test_the_library_names_its_arguments(tmp_path, corpus):
    passages, _ = corpus
    with pytest.raises(FileNotFoundError, match="^passages: "):
        fit_tokenizer_folder(tmp_path / "none.jsonl", tmp_path / "tok", vocab_size=300)
    with pytest.raises(FileNotFoundError, match="^data: "):
        fit_tokenizer_folder(passages, tmp_path / "tok", vocab_size=300, data=[tmp_path / "x"])
    with pytest.raises(ValueError, match="^vocab_size must be at least"):
        fit_tokenizer_folder(passages, tmp_path / "tok", vocab_size=3)
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "a").write_text("a")
    with pytest.raises(FileExistsError, match="^out "):
        fit_tokenizer_folder(passages, tmp_path / "tok", vocab_size=300, overwrite=True)


# ---- init: the generator config and the tokenizer agree --------------------------------------
@pytest.mark.parametrize("extra,words", [
    ({"vocab_size": 3999}, ["vocab_size 3999 is smaller than the generator tokenizer's 4000",
                            "at least 4000"]),
    ({"vocab_size": "4000"}, ["vocab_size", "int"]),  # (transformers 5 checks it first)
    ({"pad_token_id": 0}, ["pad_token_id 0 differs from the generator tokenizer's (1)"]),
    ({"eos_token_id": 5}, ["eos_token_id 5 differs", "(2)"]),
    ({"bos_token_id": 2}, ["bos_token_id 2 differs", "(0)"]),
])
def test_a_generator_config_that_disagrees_with_the_tokenizer_is_refused(tmp_path, example,
                                                                        extra, words):
    from rag_fast.models.build import _generator_from_config

    config = json.loads((WORKFLOW / "generator.json").read_text()) | extra
    path = tmp_path / "g.json"
    path.write_text(json.dumps(config))
    with pytest.raises(ValueError) as exc:
        _generator_from_config(str(path), example, seed=0)
    message = str(exc.value)
    assert message.startswith(f"generator config {path}: "), message
    assert all(w in message for w in words), message


def test_a_generator_config_that_agrees_with_the_tokenizer_is_kept(tmp_path, example):
    from rag_fast.models.build import _generator_from_config

    config = {"model_type": "bart", "d_model": 16, "encoder_layers": 1, "decoder_layers": 1,
              "encoder_attention_heads": 2, "decoder_attention_heads": 2,
              "encoder_ffn_dim": 32, "decoder_ffn_dim": 32, "vocab_size": 4096,
              "pad_token_id": 1, "bos_token_id": 0, "eos_token_id": [2]}
    path = tmp_path / "g.json"
    path.write_text(json.dumps(config))
    generator = _generator_from_config(str(path), example, seed=0)
    assert generator.config.vocab_size == 4096  # larger than the tokenizer: allowed


def test_init_says_the_config_is_too_small_for_the_tokenizer(tmp_path, capsys):
    from utils import save_tiny_bert

    (tmp_path / "enc").mkdir()
    encoder = save_tiny_bert(tmp_path / "enc", ["what"])
    config = json.loads((WORKFLOW / "generator.json").read_text()) | {"vocab_size": 1000}
    path = tmp_path / "g.json"
    path.write_text(json.dumps(config))
    code = cli.main(["init", "--question-encoder", encoder, "--generator", str(path),
                     "--generator-tokenizer", str(TOKENIZER), "--out", str(tmp_path / "m")])
    err = capsys.readouterr().err
    _one_error(code, err, "vocab_size 1000 is smaller than the generator tokenizer's 4000",
               str(path))
    assert not (tmp_path / "m").exists()
