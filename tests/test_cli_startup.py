"""The ``rag-fast`` command loads torch only once its arguments are parsed: ``--help`` (of
every command but ``train``, whose help ends with the config schema), a usage error and a
mistyped flag answer without it. Checked in fresh processes, by what they import (not timed:
the time is a benchmark's figure)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

HEAVY = ("torch", "numpy", "transformers", "faiss", "tokenizers", "safetensors", "starlette",
         "uvicorn", "tqdm", "rag_fast.ops")

# run the command's entry point in a fresh process as the installed script does (argv[0] is
# `rag-fast`), once per command line given, and report after each which heavy modules are
# loaded and how it exited (one process for them all: none of them may load anything heavy)
_PROBE = """
import contextlib, io, json, sys
from rag_fast.cli import main
for args in json.loads(sys.argv[1]):
    sys.argv = ["rag-fast"] + args
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = main()
        except SystemExit as e:
            status = e.code
    heavy = [m for m in HEAVY if m in sys.modules]
    print(json.dumps({"status": status, "heavy": heavy, "out": out.getvalue(),
                      "err": err.getvalue()}))
"""


def _run(*command_lines: list[str]) -> list[dict]:
    code = f"HEAVY = {HEAVY!r}\n" + _PROBE
    # argv[0] is `rag-fast` from the start: rag_fast's import takes the command's path
    # (in the tests' folder: `python -c` puts its folder first on the path, and the checkout's
    # root would give the source rag_fast, without the compiled extension)
    done = subprocess.run([sys.executable, "-c", f"import sys; sys.argv[0] = 'rag-fast'\n{code}",
                           json.dumps(command_lines)], capture_output=True, text=True,
                          timeout=120, cwd=os.path.dirname(os.path.abspath(__file__)))
    results = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(results) == len(command_lines), done.stderr[-2000:]
    return results


COMMANDS = [[], ["index"], ["index", "build"], ["index", "search"], ["index", "eval"],
            ["index", "info"], ["tokenizer", "fit"], ["init"], ["eval"], ["generate"],
            ["serve"], ["reseal"]]
USAGE_ERRORS = [["index", "build", "--passsages", "p.jsonl"], ["generate", "--model"],
                ["frobnicate"], ["eval", "--data", "d.jsonl", "--n-doc", "3"]]


def test_help_and_usage_errors_import_nothing_heavy():
    """Every command's ``--help`` (``train``'s aside) and a typo, a missing value, an unknown
    command and an unknown flag, one after another in one fresh process: none loads torch or
    any other heavy library, and each says what it says as before."""
    results = _run(*[c + ["--help"] for c in COMMANDS], *USAGE_ERRORS)
    for command, r in zip(COMMANDS, results):
        assert r["status"] == 0 and "usage: rag-fast" in r["out"], (command, r["err"])
    for args, r in zip(USAGE_ERRORS, results[len(COMMANDS):]):
        said = r["err"].splitlines()
        assert r["status"] == 2 and len(said) == 1 and "error:" in said[0], (args, said)
    assert results[-1]["heavy"] == [], f"rag-fast imported {results[-1]['heavy']}"
    assert "did you mean --passages?" in results[len(COMMANDS)]["err"]


def test_train_help_and_a_command_load_torch_as_they_need_it(tmp_path):
    """``train --help`` still ends with the config schema, made when the help is shown (it
    needs TrainConfig, which loads torch); and once parsed, a command runs as before: torch,
    the extension and the ops are loaded before its work, and its errors keep the contract."""
    # the command first (nothing loaded before it), then train's help
    info, help_ = _run(["index", "info", str(tmp_path / "missing")], ["train", "--help"])
    assert help_["status"] == 0
    assert "train (TrainConfig) fields:" in help_["out"]
    assert "example: examples/workflow/train.json" in help_["out"]
    assert info["status"] == 2 and "torch" in info["heavy"]
    assert "rag_fast.ops" in info["heavy"]  # torch.ops.rag_fast.*, as `import rag_fast` does
    said = info["err"].splitlines()
    assert len(said) == 1 and "missing" in said[0], said


def test_library_import_loads_the_ops_at_once():
    """``import rag_fast`` outside the command (this process) loads torch and the ops at once,
    as before: only the command defers them."""
    import rag_fast

    assert "rag_fast.ops" in sys.modules and "rag_fast.reference" in sys.modules
    assert rag_fast.rag_token_nll is sys.modules["rag_fast.ops"].rag_token_nll


def test_the_parsers_bounds_are_the_library_s():
    """The values the parsers show, kept in rag_fast._defaults, are the ones the library uses."""
    from rag_fast import tokenization
    from rag_fast.models import inference
    from rag_fast.retrieval import factory

    assert tokenization.MIN_VOCAB_SIZE == tokenization.BYTES + len(tokenization.SPECIAL_TOKENS)
    assert tokenization.check_vocab_size(tokenization.MIN_VOCAB_SIZE) == 261
    assert (inference.DEFAULT_BEAMS, inference.DEFAULT_NEW_TOKENS) == (4, 32)
    assert factory.PRESETS == ("exact", "hnsw", "ivfpq")
