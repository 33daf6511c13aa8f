"""Breaks found by the thirteenth hostile pass (at 9dec150) in the warm-start family and the
encoder loaders; each test failed before the fix:

- C202, C203: an encoder folder whose tokenizer is a tokenizer_config.json alone, or an empty
  vocab.txt, was warm-started from (a tokenizer of only its special tokens); `generate` then
  ended in "unexpected error: WordPiece error: Missing [UNK] token";
- C209b, C209c: an encoder folder with a damaged model.safetensors: "unexpected error:
  SafetensorError" from `init --question-encoder` and `index build --encoder`.
"""
from __future__ import annotations

import shutil

import pytest

from conftest import one_error, run_cli


@pytest.fixture(scope="module")
def tiny_encoder(tmp_path_factory):
    from utils import save_tiny_bert

    root = tmp_path_factory.mktemp("enc13")
    return save_tiny_bert(root, ["paris", "seine", "rome", "tiber", "river"])


@pytest.mark.parametrize("tokenizer", ["config-only", "empty-vocab"])
def test_warm_start_from_a_tokenizer_without_a_vocabulary_is_refused(tiny_encoder, tmp_path,
                                                                      tokenizer):
    folder = tmp_path / "enc"
    shutil.copytree(tiny_encoder, folder)
    for name in ("tokenizer.json", "special_tokens_map.json"):
        (folder / name).unlink(missing_ok=True)
    if tokenizer == "config-only":
        (folder / "vocab.txt").unlink()
    else:
        (folder / "vocab.txt").write_text("")
    code, err = run_cli("init", "--question-encoder", tiny_encoder, "--generator-from-encoder",
                        folder, "--out", tmp_path / "m")
    assert code == 2, err
    line = one_error(code, err, "--generator-from-encoder")
    assert "unexpected" not in line
    assert not (tmp_path / "m").exists()


@pytest.mark.parametrize("damage", ["cut", "pickle"])
@pytest.mark.parametrize("command", ["index build", "init", "warm start"])
def test_an_encoder_with_damaged_weights_is_one_line(world, tiny_encoder, tmp_path, command,
                                                     damage):
    """C209 (a cut model.safetensors) and C210 (a pickled pytorch_model.bin, which is never
    unpickled) through the three ways an encoder folder is read."""
    import pickle

    folder = tmp_path / "enc"
    shutil.copytree(tiny_encoder, folder)
    weights = folder / "model.safetensors"
    if damage == "cut":
        weights.write_bytes(weights.read_bytes()[:64])  # a header promising more than is there
    else:
        weights.unlink()
        (folder / "pytorch_model.bin").write_bytes(pickle.dumps({"x": 1}))
    if command == "warm start":
        code, err = run_cli("init", "--question-encoder", tiny_encoder,
                            "--generator-from-encoder", folder, "--out", tmp_path / "m")
        one_error(code, err, "--generator-from-encoder", str(folder))
    elif command == "index build":
        code, err = run_cli("index", "build", "--passages", world["passages"], "--encoder",
                            folder, "--out", tmp_path / "kb", "--no-progress")
        one_error(code, err, "encoder", str(folder))
    else:
        code, err = run_cli("init", "--question-encoder", folder, "--generator",
                            world["root"] / "g.json", "--generator-tokenizer", tiny_encoder,
                            "--out", tmp_path / "m")
        one_error(code, err, "--question-encoder", str(folder))
