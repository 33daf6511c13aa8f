"""Breaks found by the seventeenth hostile pass (at bcf72db); each test failed before the fix:

- G738: a special_tokens_map.json listing 300,000 special tokens (3.8 MB, within the settings
  files' bound) kept `init --question-encoder` busy for minutes: loading added tokens takes
  time growing with the square of their count;
- G723/G723q/G723g: a pytorch_model.bin that is a pickle was refused by torch's safe loading
  in two stderr lines (torch's "Detected pickle protocol 4" warning, then an error passing on
  torch's advice to load it unsafely);
- G716: a safetensors file whose header truly promises 20 GB, under an address-space limit,
  gave the generic out-of-memory line naming neither the flag nor the folder.
"""
from __future__ import annotations

import json
import os
import pickle
import shutil
import struct

import pytest
import torch

from conftest import build_with_memory_limit, one_error, run_cli


class Exploit:
    """Unpickling this creates a file: a weights file must never run it."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _copy(world, tmp_path):
    folder = tmp_path / "enc"
    shutil.copytree(world["encoder"], folder)
    return folder


def _build(world, folder, tmp_path):
    return run_cli("index", "build", "--passages", world["passages"], "--encoder", folder,
                   "--out", tmp_path / "kb", "--no-progress")


@pytest.mark.parametrize("file, key", [
    ("special_tokens_map.json", "additional_special_tokens"),
    ("tokenizer_config.json", "additional_special_tokens"),
    ("tokenizer_config.json", "added_tokens_decoder"), ("added_tokens.json", None),
    ("tokenizer.json", "added_tokens")])
def test_a_tokenizer_file_listing_too_many_added_tokens_is_refused_at_once(world, tmp_path,
                                                                           file, key):
    from rag_fast.retrieval.encoders import MAX_ADDED_TOKENS

    folder = _copy(world, tmp_path)
    path = folder / file
    data = json.loads(path.read_text()) if path.exists() else {}
    many = [f"<extra_{i}>" for i in range(MAX_ADDED_TOKENS + 1)]
    if file == "added_tokens.json":
        data = {token: 100 + i for i, token in enumerate(many)}
    elif key == "added_tokens_decoder":
        data[key] = {str(100 + i): {"content": t, "special": True} for i, t in enumerate(many)}
    elif key == "added_tokens":
        data[key] = [{"id": 100 + i, "content": t, "special": True} for i, t in enumerate(many)]
    else:
        data[key] = many
    path.write_text(json.dumps(data))
    code, err = _build(world, folder, tmp_path)
    one_error(code, err, "encoder", str(folder), file, f"{MAX_ADDED_TOKENS + 1:,}")
    assert not (tmp_path / "kb").exists()


def test_a_few_added_special_tokens_still_load(world, tmp_path):
    from rag_fast.retrieval.encoders import Encoder

    folder = _copy(world, tmp_path)
    (folder / "special_tokens_map.json").write_text(json.dumps(
        {"additional_special_tokens": [f"<extra_{i}>" for i in range(50)]}))
    assert len(Encoder(str(folder), device="cpu").tokenizer) >= 50


def _pickled_weights(folder, marker, protocol, zipped):
    (folder / "model.safetensors").unlink()
    payload = {"embeddings.word_embeddings.weight": Exploit(str(marker))}
    if zipped:  # as torch.save writes, the pickle inside a zip archive
        torch.save(payload, folder / "pytorch_model.bin", pickle_protocol=protocol)
    else:
        (folder / "pytorch_model.bin").write_bytes(pickle.dumps(payload, protocol=protocol))


@pytest.mark.parametrize("zipped", [False, True])
def test_pickled_weights_are_refused_in_one_line_without_running(world, tmp_path, zipped):
    folder = _copy(world, tmp_path)
    marker = tmp_path / "ran"
    _pickled_weights(folder, marker, 4, zipped)
    code, err = _build(world, folder, tmp_path)
    line = one_error(code, err, "encoder", str(folder))
    assert ("zip archive" in line and "pytorch_model.bin" in line) if not zipped else \
        "something other than tensors" in line
    assert "weights_only=False" not in line and "weights_only" not in line.replace(
        "torch's safe loading", "")
    assert not marker.exists()


@pytest.mark.parametrize("flag", ["--question-encoder", "--generator"])
def test_pickled_weights_are_one_line_for_every_pretrained_folder(world, tmp_path, flag):
    import transformers

    from conftest import TOKENIZER

    if flag == "--question-encoder":
        folder = _copy(world, tmp_path)
    else:  # a small GPT-2
        folder = tmp_path / "gpt2"
        transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_layer=1, n_head=2, n_embd=16, n_positions=64, vocab_size=300)).save_pretrained(
            folder)
        (folder / "pytorch_model.bin").write_bytes(b"")
        (folder / "pytorch_model.bin").unlink()
    marker = tmp_path / "ran"
    _pickled_weights(folder, marker, 4, zipped=True)
    args = (["--question-encoder", folder, "--generator", world["root"] / "g.json"]
            if flag == "--question-encoder" else ["--generator", folder])
    code, err = run_cli("init", "--index", world["kb"], *args, "--generator-tokenizer",
                        TOKENIZER, "--n-docs", "2", "--out", tmp_path / "m")
    line = one_error(code, err, flag, str(folder),
                     "something other than tensors")
    assert "weights_only" not in line and not marker.exists()


def _with_huge_tensor(path, size):
    """``path``'s safetensors header with one more tensor of ``size`` bytes, truly held."""
    data = path.read_bytes()
    length = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + length])
    end = max(v["data_offsets"][1] for k, v in header.items() if k != "__metadata__")
    header["zzz.extra"] = {"dtype": "U8", "shape": [size], "data_offsets": [end, end + size]}
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + data[8 + length:])
        f.truncate(8 + len(text) + end + size)


def test_weights_too_large_for_the_memory_limit_name_the_folder(world, tmp_path):
    folder = _copy(world, tmp_path)
    _with_huge_tensor(folder / "model.safetensors", 20 << 30)
    code, err = build_with_memory_limit(world, folder, tmp_path / "kb")
    line = one_error(code, err, "encoder", str(folder), "20.0 GiB",
                     "do not fit in this process's memory")
    assert "--batch-size" not in line
