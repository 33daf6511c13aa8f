"""Fixtures of the serving tests (tests/serving; the root conftest.py imports the fixture, so
that no second module named ``conftest`` replaces the safety suite's): a tiny encoder, two index directories over different
passages (ids ``a*`` and ``b*``, so every answer's passages show which index it came from),
and model directories of both generator families, built once through the ``rag-fast`` command.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from utils import save_tiny_bert

REPO = Path(__file__).resolve().parents[1]
TOKENIZER = REPO / "examples" / "workflow" / "generator-tokenizer"
WORDS = ["paris", "seine", "river", "city", "capital", "france", "rome", "tiber", "what", "which",
         "is", "on", "the", "of", "lies", "nile", "cairo", "thames", "london"]
BART = {"model_type": "bart", "d_model": 16, "encoder_layers": 1, "decoder_layers": 1,
        "encoder_attention_heads": 2, "decoder_attention_heads": 2, "encoder_ffn_dim": 32,
        "decoder_ffn_dim": 32, "max_position_embeddings": 128}
QWEN2 = {"model_type": "qwen2", "hidden_size": 16, "intermediate_size": 32,
         "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
         "max_position_embeddings": 256, "tie_word_embeddings": True}
QUESTIONS = ["which river is paris on", "which river is rome on", "what city lies on the nile",
             "the capital of france", "which river is london on", "cairo"]


def run_cli(*args) -> tuple[int, str]:
    import contextlib
    import io

    from rag_fast import cli

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = cli.main([str(a) for a in args])
    return code, err.getvalue()


def _passages(path: Path, prefix: str, places) -> Path:
    with open(path, "w", encoding="utf-8") as f:
        for i in range(16):
            city, river = places[i % len(places)]
            f.write(json.dumps({"id": f"{prefix}{i}", "title": city,
                                "text": f"the city of {city} lies on the {river} river {i}"})
                    + "\n")
    return path


@pytest.fixture(scope="session")
def serving_world(tmp_path_factory) -> dict[str, Path]:
    """{"root", "encoder", "kb_a", "kb_b", "bart", "qwen2"}: index directories ``kb_a`` (ids
    a0..a15) and ``kb_b`` (b0..b15) of one encoder, both under ``root/indexes``; model
    directories recording ``kb_a``."""
    root = tmp_path_factory.mktemp("serving")
    (root / "enc").mkdir()
    encoder = save_tiny_bert(root / "enc", WORDS)
    a = _passages(root / "a.jsonl", "a", [("paris", "seine"), ("rome", "tiber")])
    b = _passages(root / "b.jsonl", "b", [("cairo", "nile"), ("london", "thames")])
    out = {"root": root, "encoder": Path(encoder)}
    for name, passages in (("kb_a", a), ("kb_b", b)):
        out[name] = root / "indexes" / name
        code, err = run_cli("index", "build", "--passages", passages, "--encoder", encoder,
                            "--out", out[name], "--no-progress", "--max-length", "32")
        assert code == 0, err
    for name, config in (("bart", BART), ("qwen2", QWEN2)):
        (root / f"{name}.json").write_text(json.dumps(config))
        out[name] = root / name
        code, err = run_cli("init", "--index", out["kb_a"], "--generator", root / f"{name}.json",
                            "--generator-tokenizer", TOKENIZER, "--n-docs", "2",
                            "--max-context-length", "48", "--out", out[name])
        assert code == 0, err
        _sharpen(out[name])
    return out


def _sharpen(model_dir: Path) -> None:
    """Larger random generator weights, so that answers differ between questions and
    passages (near-uniform logits would make every answer the same few tokens)."""
    import torch

    from rag_fast.models import RagModel

    model = RagModel.load(str(model_dir))
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.generator.parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    model.save(str(model_dir))
