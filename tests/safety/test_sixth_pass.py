"""Notes of the fifth hostile pass made into checks, one test each (they failed before the
fix), and the breaks of the sixth pass: a context length that leaves a decoder-only generator
no position for an answer, refused by ``init`` and named by ``generate``."""
from __future__ import annotations

import json

from conftest import TOKENIZER, one_error, run_cli

GPT2 = {"model_type": "gpt2", "n_embd": 16, "n_layer": 1, "n_head": 2, "n_positions": 64}


def test_init_refuses_a_context_that_fills_a_decoder_only_generators_positions(world, tmp_path):
    """V34: `init --max-context-length 1000` for a GPT-2 with 64 positions was accepted, and
    `generate` then said "use at most 1" although not even one token fitted."""
    (tmp_path / "g.json").write_text(json.dumps(GPT2))
    args = ["init", "--index", world["kb"], "--generator", tmp_path / "g.json",
            "--generator-tokenizer", TOKENIZER, "--n-docs", "2"]
    for length in ("64", "1000", str(10**11)):
        code, err = run_cli(*args, "--max-context-length", length, "--out", tmp_path / "m")
        one_error(code, err, "--max-context-length", "64 positions", "use at most 63")
        assert not (tmp_path / "m").exists()
    code, err = run_cli(*args, "--max-context-length", "48", "--out", tmp_path / "m")
    assert code == 0, err


def test_generate_names_a_model_whose_prompts_fill_the_positions(world, tmp_path):
    """A model folder made by the library with such a context length: `generate` says the
    prompts fill the positions (not "use at most 1")."""
    from rag_fast.models import RagModel

    (tmp_path / "g.json").write_text(json.dumps(GPT2))
    code, err = run_cli("init", "--index", world["kb"], "--generator", tmp_path / "g.json",
                        "--generator-tokenizer", TOKENIZER, "--n-docs", "2",
                        "--max-context-length", "32", "--out", tmp_path / "m")
    assert code == 0, err
    model = RagModel.load(str(tmp_path / "m"))
    model.replace(max_context_length=64).save(str(tmp_path / "m2"))
    code, err = run_cli("generate", "--model", tmp_path / "m2", "--question", "which river",
                        "--device", "cpu")
    one_error(code, err, "fill all 64 positions", "--max-context-length")
