"""Bad input on the command line gets one clear `rag-fast: error:` line that names the option
or file and what was expected, not a traceback from a library underneath."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
TOKENIZER = REPO / "examples" / "workflow" / "generator-tokenizer"


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TOKENIZER)


@pytest.mark.parametrize("config,words", [
    ({"model_type": "bart", "d_model": "big"}, ["field 'd_model'", "expected int, got str"]),
    ({"model_type": "bartt"}, ["model_type 'bartt' is not a model type transformers"]),
    ({"model_type": "bart", "d_model": 10, "encoder_attention_heads": 3, "encoder_layers": 1,
      "decoder_layers": 1}, ["cannot build a 'bart' model", "divisible"]),
])
def test_a_generator_config_transformers_refuses_names_the_file(tmp_path, tokenizer, config,
                                                                 words):
    from rag_fast.models.build import _generator_from_config

    path = tmp_path / "g.json"
    path.write_text(json.dumps(config))
    with pytest.raises(ValueError) as exc:
        _generator_from_config(str(path), tokenizer, seed=0)
    message = str(exc.value)
    assert message.startswith(f"generator config {path}: ") and "\n" not in message, message
    assert all(w in message for w in words), message
    assert len(message) < 500  # not transformers' list of every model type


def test_init_reports_a_bad_generator_config_as_an_error_line(tmp_path, capsys):
    from rag_fast import cli

    path = tmp_path / "g.json"
    path.write_text(json.dumps({"model_type": "bart", "d_model": "big"}))
    # the index is checked after the generator config: a missing one must not be reached
    code = cli.main(["init", "--index", str(tmp_path / "no-index"), "--generator", str(path),
                     "--generator-tokenizer", str(TOKENIZER), "--out", str(tmp_path / "m")])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("rag-fast: error: "), err
    assert "Traceback" not in err


def test_an_encoder_that_is_not_there_is_named_before_the_passages_are_read(tmp_path, capsys):
    from rag_fast import cli

    args = ["index", "build", "--passages", str(tmp_path / "missing.jsonl"), "--out",
            str(tmp_path / "kb")]
    assert cli.main([*args, "--encoder", str(tmp_path / "no-such-encoder")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rag-fast: error: --encoder: encoder ") and "no such folder" in err, err
    (tmp_path / "empty").mkdir()
    assert cli.main([*args, "--encoder", str(tmp_path / "empty")]) == 2
    err = capsys.readouterr().err
    assert "--encoder" in err and "has no config.json" in err, err
    assert not (tmp_path / "kb").exists() and not (tmp_path / "kb.staging").exists()


def test_a_malformed_jsonl_line_is_described_once(tmp_path):
    from rag_fast.retrieval.passages import read_passages

    path = tmp_path / "p.jsonl"
    path.write_text('{"text": "a"}\n{"text": "line\tbreak\x01"}\n')  # a raw control character
    with pytest.raises(ValueError, match=r"p\.jsonl:2: malformed JSON line") as exc:
        list(read_passages(path))
    assert " at at " not in str(exc.value), exc.value


@pytest.mark.parametrize("flag", ["--batch-size", "--num-beams", "--max-new-tokens"])
def test_generate_names_the_option_below_one(tmp_path, flag):
    from rag_fast.cli import generate as generation_cli
    from rag_fast.cli import build_parser

    args = build_parser().parse_args(["generate", "--model", str(tmp_path), "--question", "q",
                                      flag, "0"])
    with pytest.raises(ValueError, match=f"^{flag} must be >= 1, got 0$"):
        generation_cli.run(args)


def _train_config(tmp_path, model, index="kb") -> Path:
    path = tmp_path / "train.json"
    path.write_text(json.dumps({"model": model, "index": index, "data": {"train": "qa.jsonl"},
                                "train": {"output_dir": "run"}}))
    return path


@pytest.mark.parametrize("section,flag", [("model", "--model"), ("index", "--index")])
def test_a_section_without_path_names_the_flag_that_gives_it(tmp_path, capsys, section, flag):
    model, index = {"n_docs": 3}, "kb"
    if section == "index":
        model, index = "m", {"verify": False}
    path = _train_config(tmp_path, model, index)
    from rag_fast import cli

    assert cli.main(["train", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"rag-fast: error: {path}: {section}: ") and "Traceback" not in err, err
    assert '"path"' in err and f"{flag} DIR" in err, err


@pytest.mark.parametrize("key,value,expected", [
    ("lean_activations", "yes", "true or false"),
    ("normalize_questions", 1, "true or false"),
    ("n_docs", "3", "a positive integer"),
    ("n_docs", True, "a positive integer"),
    ("max_context_length", 0, "a positive integer"),
    ("epsilon", "0.1", "a number in [0, 1]"),
    ("epsilon", 1.5, "a number in [0, 1]"),
    ("epsilon", -0.1, "a number in [0, 1]"),
    ("exclude_bos", 0, "true or false"),
    ("max_question_length", 12.5, "a positive integer"),
    ("mode", "tokens", "one of token, sequence"),
    ("lm_head_loss", "fast", "one of auto, fused, materialized"),
    ("loss_impl", "cuda", "one of auto, cpp, triton, torch"),
    ("question_pooling", "max", "one of auto, cls, mean"),
    ("n_docs", None, "a positive integer"),  # JSON null: said as null
    ("lean_activations", None, "true or false"),
])
def test_a_wrongly_typed_model_option_names_the_file_and_key(tmp_path, capsys, key, value,
                                                             expected):
    from rag_fast import cli

    path = _train_config(tmp_path, {"path": "no-model", key: value})
    # refused when the config is read: the model directory (missing here) is never opened
    assert cli.main(["train", "--config", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    got = "null" if value is None else repr(value)
    assert err == f"rag-fast: error: {path}: model.{key}: expected {expected}, got {got}", err


@pytest.mark.parametrize("line,column", [
    ('{"question": "who?", "answers": ["x"]', 38),  # truncated: the end of the line
    ('{"text": "an unclosed string', 10),  # where the string starts
])
def test_a_malformed_jsonl_line_names_its_own_column(tmp_path, line, column):
    from rag_fast.retrieval.passages import read_passages

    path = tmp_path / "p.jsonl"
    path.write_text('{"text": "a"}\n' + line + "\n")
    with pytest.raises(ValueError, match=rf"p\.jsonl:2: malformed JSON line \(.* at column "
                                         rf"{column}\)$"):
        list(read_passages(path))


@pytest.mark.parametrize("argv,message", [
    (["--n-docs", "0"], "--n-docs must be a positive int, got 0"),
    (["--max-context-length", "0"], "--max-context-length must be a positive int, got 0"),
    (["--label-smoothing", "1.5"], "--label-smoothing must be a float in [0, 1], got 1.5"),
])
def test_init_names_the_flag_of_a_bad_value(tmp_path, capsys, argv, message):
    from rag_fast import cli

    code = cli.main(["init", "--generator", "facebook/bart-base", "--out", str(tmp_path / "m"),
                     *argv])  # refused before any model is looked for
    assert code == 2
    assert capsys.readouterr().err.strip() == f"rag-fast: error: {message}"


def test_init_refuses_more_passages_per_question_than_the_index_holds(tmp_path, capsys):
    """Checked when init reads the index, before any model is looked for (generate would
    otherwise be the first to fail, naming neither the flag nor the model)."""
    from rag_fast import cli
    from rag_fast.models.build import build_rag_model
    from rag_fast.retrieval import DenseIndex

    index_dir = tmp_path / "kb"
    vectors = np.random.default_rng(0).standard_normal((7, 8)).astype(np.float32)
    DenseIndex.build(vectors, "exact", progress=False).save(index_dir / "index")
    argv = ["init", "--index", str(index_dir), "--generator", "facebook/bart-base",
            "--out", str(tmp_path / "m")]
    assert cli.main([*argv, "--n-docs", "8"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"rag-fast: error: --n-docs=8 is more passages per question than the index "
        f"{str(index_dir)!r} holds (7)")
    with pytest.raises(ValueError, match=r"^n_docs=9 is more passages per question"):
        build_rag_model(generator="facebook/bart-base", index=str(index_dir), n_docs=9)


def test_init_with_a_generator_config_asks_for_the_tokenizer_flag(tmp_path, capsys):
    from rag_fast import cli

    path = tmp_path / "g.json"
    path.write_text(json.dumps({"model_type": "bart"}))
    assert cli.main(["init", "--generator", str(path), "--out", str(tmp_path / "m")]) == 2
    err = capsys.readouterr().err
    assert "give --generator-tokenizer" in err and str(path) in err, err


def test_train_names_the_device_flag_not_the_config(tmp_path, capsys):
    from rag_fast import cli

    path = _train_config(tmp_path, "no-model")
    assert cli.main(["train", "--config", str(path), "--device", "gpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "rag-fast: error: --device must be cpu, cuda or cuda:N, got 'gpu'", err


@pytest.mark.parametrize("command", ["eval", "generate"])
def test_eval_and_generate_name_the_device_flag(tmp_path, capsys, command):
    from rag_fast import cli

    args = (["--data", str(tmp_path / "qa.jsonl"), "--out", str(tmp_path / "e")]
            if command == "eval" else ["--question", "q"])
    (tmp_path / "qa.jsonl").write_text('{"question": "q", "answers": ["a"]}\n')
    assert cli.main([command, "--model", str(tmp_path), "--device", "gpu", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "rag-fast: error: --device must be cpu, cuda or cuda:N, got 'gpu'", err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the message for a machine without CUDA")
@pytest.mark.parametrize("command", ["train", "eval"])
def test_device_cuda_without_cuda_names_the_flag(tmp_path, capsys, command):
    from rag_fast import cli

    if command == "train":
        argv = ["train", "--config", str(_train_config(tmp_path, "no-model")), "--device", "cuda"]
    else:
        (tmp_path / "qa.jsonl").write_text('{"question": "q", "answers": ["a"]}\n')
        argv = ["eval", "--model", str(tmp_path), "--data", str(tmp_path / "qa.jsonl"), "--out",
                str(tmp_path / "e"), "--device", "cuda"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("rag-fast: error: --device is 'cuda' but CUDA is not available here; use "
                   "--device cpu (or leave it out to choose)"), err


def test_a_missing_dataset_file_is_named_with_its_key_before_anything_loads(tmp_path, capsys):
    from rag_fast import cli

    # the model directory is missing too: the dataset is checked first, before any loading
    path = _train_config(tmp_path, "no-model")
    assert cli.main(["train", "--config", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"rag-fast: error: {path}: data.train: dataset file not found: "
                   f"{tmp_path / 'qa.jsonl'} (a relative path is read from the config file's "
                   "folder)"), err


def test_a_dataset_path_that_is_a_folder_says_so(tmp_path, capsys):
    from rag_fast import cli

    (tmp_path / "qa.jsonl").mkdir()
    path = _train_config(tmp_path, "no-model")
    assert cli.main(["train", "--config", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"rag-fast: error: {path}: data.train: {tmp_path / 'qa.jsonl'} is not a file "
                   "(a relative path is read from the config file's folder)"), err


def test_init_names_the_flag_of_a_missing_path_or_an_unloadable_name(tmp_path, capsys,
                                                                     monkeypatch):
    """A mistyped generator path is "no such file or folder", not the hub's complaint about the
    form of a repository id; a name that neither is a folder nor loads is one line naming the
    flag, with the loader's reason."""
    import transformers

    from rag_fast import cli
    from rag_fast.models.build import build_rag_model
    from utils import save_tiny_bert

    out = str(tmp_path / "m")
    assert cli.main(["init", "--question-encoder", "bert", "--generator",
                     "examples/workflow/generatr.json", "--out", out]) == 2
    assert capsys.readouterr().err.strip() == (
        "rag-fast: error: --generator 'examples/workflow/generatr.json': no such file or folder "
        "(expected a model name, a folder holding a transformers model, or a JSON config for "
        "random weights)")
    assert cli.main(["init", "--question-encoder", "./no/such/encoder", "--generator",
                     "facebook/bart-base", "--out", out]) == 2
    assert capsys.readouterr().err.strip().startswith(
        "rag-fast: error: --question-encoder './no/such/encoder': no such file or folder")
    with pytest.raises(ValueError, match=r"^generator_tokenizer '/no/tok': no such file"):
        build_rag_model(question_encoder="bert", generator="facebook/bart-base",
                        generator_tokenizer="/no/tok")

    (tmp_path / "enc").mkdir()
    encoder = save_tiny_bert(tmp_path / "enc")
    real = transformers.AutoTokenizer.from_pretrained

    def from_pretrained(name, *args, **kwargs):
        if name == "no-such-model":  # what the hub client raises, offline or unknown
            raise OSError("We couldn't connect to 'https://huggingface.co' to load the files,\n"
                          "and couldn't find them in the cached files.")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", from_pretrained)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    assert cli.main(["init", "--question-encoder", encoder, "--generator", "no-such-model",
                     "--out", out]) == 2
    assert capsys.readouterr().err.strip() == (
        "rag-fast: error: --generator 'no-such-model': not a model folder, and no model of that "
        "name could be loaded: We couldn't connect to 'https://huggingface.co' to load the "
        "files, and couldn't find them in the cached files.")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert cli.main(["init", "--question-encoder", encoder, "--generator", "facebook/bart-base",
                     "--generator-tokenizer", "no-such-model", "--out", out]) == 2
    assert capsys.readouterr().err.strip().startswith(
        "rag-fast: error: --generator-tokenizer 'no-such-model': not a model folder, and no model "
        "of that name could be loaded (HF_HUB_OFFLINE is set: only models already in the local "
        "cache load by name): We couldn't connect")
    assert not Path(out).exists()


def test_an_unknown_option_is_reported_with_its_commands_usage_and_closest_option(capsys):
    from rag_fast import cli

    with pytest.raises(SystemExit) as e:
        cli.main(["init", "--ndocs", "3", "--generator", "g", "--out", "o"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err == ("rag-fast init: error: unrecognized arguments: --ndocs 3 (--ndocs: did you "
                   "mean --n-docs?) (see `rag-fast init --help`)\n")
    with pytest.raises(SystemExit):
        cli.main(["index", "search", "kb", "a question", "--nprobes=3"])
    err = capsys.readouterr().err
    assert err.startswith("rag-fast index search: ") and err.count("\n") == 1
    assert "error: unrecognized arguments: --nprobes=3 (--nprobes: did you mean --nprobe?)" in err
    # a typo of a required option is the typo, not the required option missing
    with pytest.raises(SystemExit) as e:
        cli.main(["--verbose", "index", "build", "--encoderr", "x", "--passages", "p.jsonl",
                  "--out", "kb"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err == ("rag-fast index build: error: unrecognized arguments: --encoderr "
                   "(--encoderr: did you mean --encoder?) (see `rag-fast index build --help`)\n")
    # a required option that is simply missing is still reported as missing
    with pytest.raises(SystemExit):
        cli.main(["index", "build", "--passages", "p.jsonl", "--out", "kb"])
    assert "the following arguments are required: --encoder" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["train", "--config", "c.json", "stray"])
    assert capsys.readouterr().err == ("rag-fast train: error: unrecognized arguments: stray "
                                       "(see `rag-fast train --help`)\n")


def test_a_quiet_command_silences_the_hubs_retry_warnings():
    """Without network, the hub logs each HTTP retry as a warning before the command's own
    one-line error; a command without --verbose keeps only that line."""
    import logging

    from rag_fast._quiet import set_verbose

    logger = logging.getLogger("huggingface_hub")
    before = logger.level
    try:
        logger.setLevel(logging.NOTSET)
        set_verbose(False)
        assert logger.getEffectiveLevel() >= logging.ERROR
    finally:
        logger.setLevel(before)


def test_an_unknown_option_before_the_command_is_named(capsys):
    """`rag-fast --frobnicate` names the option, not only the missing command."""
    from rag_fast import cli

    with pytest.raises(SystemExit) as exc:
        cli.main(["--frobnicate"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "unrecognized arguments: --frobnicate" in err, err
    with pytest.raises(SystemExit):
        cli.main([])
    assert "the following arguments are required" in capsys.readouterr().err


def test_a_command_without_overwrite_never_suggests_it(tmp_path):
    """eval and train write into their own folder again; refusing another folder they do not
    point at an --overwrite they lack."""
    from rag_fast.storage import EVAL_KIND, check_output_folder

    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("x")
    with pytest.raises(FileExistsError) as exc:
        check_output_folder(tmp_path / "mine", EVAL_KIND, reuse=True, flag="--out")
    assert "--overwrite" not in str(exc.value) and "refused" in str(exc.value), exc.value
    with pytest.raises(FileExistsError, match="even with --overwrite"):
        check_output_folder(tmp_path / "mine", EVAL_KIND, overwrite=True, flag="--out")


def test_errors_name_the_flags_not_the_library_arguments(tmp_path, capsys):
    """A new user's pass found library parameter names in command errors."""
    from rag_fast import cli

    assert cli.main(["init", "--generator", str(tmp_path / "g.json"), "--out",
                     str(tmp_path / "m")]) == 2
    err = capsys.readouterr().err
    assert "--question-encoder" in err and "--index" in err and "question_encoder" not in err, err
    assert cli.main(["index", "search", str(tmp_path), "a question", "-k", "0"]) == 2
    assert "-k must be >= 1, got 0" in capsys.readouterr().err


def test_a_missing_passages_file_is_said_as_the_flag(tmp_path, capsys, monkeypatch):
    from rag_fast import cli
    from rag_fast.cli import index as index_command

    def missing(passages, *args, **kwargs):  # what the passage reader raises
        raise FileNotFoundError(f"passages: {passages!r} does not exist")

    monkeypatch.setattr(index_command, "build_index_bundle", missing)
    assert cli.main(["index", "build", "--passages", str(tmp_path / "p.jsonl"), "--encoder",
                     "e", "--out", str(tmp_path / "kb")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rag-fast: error: --passages: ") and "does not exist" in err, err


def test_an_abbreviated_option_is_a_typo_not_a_prefix(tmp_path, capsys):
    """argparse would take `--dat` for `--data`; rag-fast names it instead."""
    from rag_fast import cli

    with pytest.raises(SystemExit) as exc:
        cli.main(["eval", "--dat", str(tmp_path / "d.jsonl"), "--model", str(tmp_path)])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "unrecognized arguments: --dat" in err, err
    assert "did you mean --data?" in err, err


@pytest.mark.parametrize("argv,message", [
    # an unknown key, top level or in a section
    (["--set", "foo=1"], "--set foo=1: unknown key 'foo' (expected: model, index, data, train, "
                         "resume)"),
    (["--set", "train.lrr=1"], "--set train.lrr=1: train: unknown training option 'lrr' (did "
                               "you mean 'lr'?)"),
    (["--set", "data.dev=x"], "--set data.dev=x: data.dev: unknown key (expected train, eval)"),
    # a value of the wrong type, said with the option (not the file) that gave it
    (["--set", "train.lr=fast"], "--set train.lr=fast: train: lr must be a finite float, got "
                                 "'fast'"),
    (["--set", "train.max_steps=2.5"], "--set train.max_steps=2.5: train: max_steps must be an "
                                       "int, got 2.5"),
    (["--max-steps", "0"], "--max-steps 0: train: max_steps must be >= 1, got 0"),
    (["--lr", "nan"], "--lr nan: train: lr must be a finite float, got nan"),
    (["--set", "index.verify=maybe"], "--set index.verify=maybe: index.verify: expected true or "
                                      "false, got 'maybe'"),
    # a directory string is a section: its options can be set (and checked)
    (["--set", "model.n_docs=0"], "--set model.n_docs=0: model.n_docs: expected a positive "
                                  "integer, got 0"),
    # a key under a value that is not an object
    (["--set", "train.output_dir.x=1"], "--set train.output_dir.x=1: train.output_dir is "
                                        "\"run\", not an object, so it has no key 'x'"),
    (["--set", "data.train.name=x"], "--set data.train.name=x: data.train is \"qa.jsonl\", not "
                                     "an object, so it has no key 'name'"),
    (["--set", "train.seed=1", "--set", "train.seed.x=1"],
     "--set train.seed.x=1: train.seed is 1, not an object, so it has no key 'x'"),
    # the later of two values wins, and is the one named
    (["--set", "train.lr=x", "--lr", "0.1", "--set", "train.lr=y"],
     "--set train.lr=y: train: lr must be a finite float, got 'y'"),
    # a problem of the file is still the file's
    (["--set", "train.lr=0.1", "--set", "model.n_docs=2"],
     "{path}: data.train: dataset file not found: {tmp}/qa.jsonl (a relative path is read from "
     "the config file's folder)"),
    (["--set", "data.train=nope.jsonl"],
     "--set data.train=nope.jsonl: data.train: dataset file not found: {cwd}/nope.jsonl (a "
     "relative path is read from the current folder, as the command line gives it)"),
])
def test_set_errors_name_the_option_and_the_key(tmp_path, capsys, argv, message):
    import os

    from rag_fast import cli

    path = _train_config(tmp_path, "no-model")
    assert cli.main(["train", "--config", str(path), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "rag-fast: error: " + message.format(path=path, tmp=tmp_path, cwd=os.getcwd())


@pytest.mark.parametrize("argv,message", [
    (["--set", "train.lr"], "argument --set: expected KEY=VALUE with KEY a dotted path into the "
                            "training config (such as train.lr=1e-4 or model.n_docs=3), got "
                            "'train.lr'"),
    (["--set", "train..lr=1"], "argument --set: expected KEY=VALUE with KEY a dotted path into "
                               "the training config (such as train.lr=1e-4 or model.n_docs=3), "
                               "got 'train..lr=1'"),
    (["--max-steps", "ten"], "argument --max-steps: invalid int value: 'ten'"),
    (["--seed", "1.5"], "argument --seed: invalid int value: '1.5'"),
])
def test_set_syntax_errors_are_usage_errors(tmp_path, capsys, argv, message):
    from rag_fast import cli

    with pytest.raises(SystemExit) as exit_:
        cli.main(["train", "--config", str(_train_config(tmp_path, "no-model")), *argv])
    assert exit_.value.code == 2  # one line, not argparse's usage block
    assert capsys.readouterr().err == (f"rag-fast train: error: {message} (see `rag-fast train "
                                       "--help`)\n")


def test_no_parser_accepts_a_prefix_of_an_option(capsys):
    """argparse's prefix matching is off everywhere: `--n-doc` and `--passage` are typos to
    name, not silent `--n-docs` and `--passages`."""
    import argparse

    from rag_fast.cli import build_parser, main

    parsers, todo = [], [build_parser()]
    while todo:
        p = todo.pop()
        parsers.append(p)
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                todo += list(action.choices.values())
    assert len(parsers) > 10 and all(p.allow_abbrev is False for p in parsers)
    for argv, words in (
            (["eval", "--data", "d.jsonl", "--model", "m", "--n-doc", "3"],
             "unrecognized arguments: --n-doc 3 (--n-doc: did you mean --n-docs?)"),
            (["index", "build", "--passage", "p.jsonl", "--encoder", "e", "--out", "o"],
             "--passage: did you mean --passages?")):
        with pytest.raises(SystemExit) as exit_:  # argparse's usage error
            main(argv)
        assert exit_.value.code == 2 and words in capsys.readouterr().err
