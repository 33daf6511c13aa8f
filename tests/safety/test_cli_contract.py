"""The command line's error contract: an expected failure (bad data, bad file, no space, a
corrupt or crafted artefact) exits 2 with one ``rag-fast: error:`` line naming the file, line
or key; an unexpected exception exits 1 with one line saying where its full traceback was
written (or the traceback itself with ``--verbose``)."""
from __future__ import annotations

import json
import os
import struct

import pytest
import torch

from conftest import run_cli


def _one_line(code, err, status=2):
    assert code == status, err
    lines = [line for line in err.strip().splitlines() if "rag-fast" in line]  # (no bars)
    assert len(lines) == 1, err
    assert "Traceback" not in err and lines[0].startswith("rag-fast:"), err
    return lines[0]


def test_an_unexpected_exception_is_one_line_and_a_traceback_file(world, monkeypatch, capsys):
    import rag_fast.cli.generate as generate

    def broken(args):
        raise KeyError("a bug")

    monkeypatch.setattr(generate, "read_questions", broken)
    code, err = run_cli("generate", "--model", world["model"], "--question", "q")
    line = _one_line(code, err, status=1)
    assert line.startswith("rag-fast: unexpected error: KeyError: ") and "a bug" in line, line
    where = line.split("the full traceback is in ", 1)[1].split(" ")[0]
    with open(where, encoding="utf-8") as f:
        text = f.read()
    assert "Traceback" in text and "broken" in text and "KeyError" in text
    code, err = run_cli("--verbose", "generate", "--model", world["model"], "--question", "q")
    assert code == 1 and "Traceback" in err and "broken" in err, err


@pytest.mark.parametrize("error,said", [
    (RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't "
                  "allocate memory: you tried to allocate 42096353280 bytes. Error code 12 "
                  "(Cannot allocate memory)"), "an allocation of 42,096,353,280 bytes failed"),
    (MemoryError(), "MemoryError"),
])
def test_a_request_too_large_for_the_memory_is_one_line_not_a_bug(world, monkeypatch, error,
                                                                   said):
    """The hostile pass: generate with thousands of beams and passages asked torch for 42 GB
    and took the "unexpected error, please report it" path."""
    import rag_fast.cli.generate as generate

    def too_large(args):
        raise error

    monkeypatch.setattr(generate, "read_questions", too_large)
    code, err = run_cli("generate", "--model", world["model"], "--question", "q")
    line = _one_line(code, err, status=2)
    assert line.startswith(f"rag-fast: error: out of memory ({said})") and "--num-beams" in line


def test_a_multi_line_library_error_is_folded_into_one_line(world, monkeypatch):
    import rag_fast.cli.generate as generate

    def broken(args):
        raise ValueError("first line\n  second line\n\nthird")

    monkeypatch.setattr(generate, "read_questions", broken)
    line = _one_line(*run_cli("generate", "--model", world["model"], "--question", "q"))
    assert line == "rag-fast: error: first line second line third", line


def test_a_safetensors_header_of_2_62_bytes_is_one_error(world, copy_of):
    """Probe 9: a crafted header length gave a traceback (files re-listed and resealed, as a
    hostile folder would be)."""
    from rag_fast.storage import describe_files, sealed

    model = copy_of(world["model"])
    weights = model / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(struct.pack("<Q", 2 ** 62) + data[8:])
    side = json.loads((model / "rag_fast.json").read_text())
    side["files"].update(describe_files(model, ["model.safetensors"]))
    (model / "rag_fast.json").write_text(json.dumps(sealed(side)))
    line = _one_line(*run_cli("eval", "--data", world["dev"], "--model", model, "--out",
                              model.parent / "e", "--no-progress"))
    assert "the weights do not load" in line and str(model) in line, line


@pytest.mark.parametrize("change", ["extra-meta", "state-field", "state-not-object"])
def test_a_checkpoint_with_unexpected_metadata_is_one_error(world, tmp_path, change):
    """Probe 9: a checkpoint whose metadata held something unexpected gave a traceback."""
    from rag_fast.training.checkpoint import _write_checkpoint

    out = tmp_path / "run"
    assert run_cli("train", "--config", world["config"], "--model", world["model"],
                   "--output-dir", out)[0] == 0
    path = out / "checkpoint-last.pt"
    payload = torch.load(path, weights_only=True)
    meta = json.loads(payload["meta"])
    if change == "extra-meta":
        meta["surprise"] = 1
    elif change == "state-field":
        meta["state"]["surprise"] = 1
    else:
        meta["state"] = [1, 2]
    payload["meta"] = json.dumps(meta)
    step = meta["state"]["step"] if isinstance(meta["state"], dict) else 2
    _write_checkpoint(payload, str(path), step)  # its manifest made again: it verifies
    line = _one_line(*run_cli("train", "--config", world["config"], "--model", world["model"],
                              "--output-dir", out))
    assert str(path) in line and "not a valid rag_fast training checkpoint" in line, line


def test_a_config_that_is_not_utf8_or_nested_too_deeply_is_one_error(world, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_bytes(b'{"train": {"seed": "\xff"}}')
    line = _one_line(*run_cli("train", "--config", bad, "--model", world["model"]))
    assert f"{bad}:1: not valid UTF-8" in line, line
    bad.write_text("[" * 100000 + "]" * 100000)
    line = _one_line(*run_cli("train", "--config", bad, "--model", world["model"]))
    assert str(bad) in line and "RecursionError" in line, line
    bad.write_bytes(b"\xef\xbb\xbf" + world["config"].read_bytes())  # a BOM is fine
    code, err = run_cli("train", "--config", bad, "--model", world["model"], "--output-dir",
                        tmp_path / "run", "--device", "cpu")
    assert "BOM" not in err and "not valid JSON" not in err, err


def test_init_onto_a_full_disk_is_one_line_and_leaves_nothing(world, real_disk):
    """Probe 9: ENOSPC while `init` wrote the model gave a traceback (safetensors' own error)."""
    from conftest import TOKENIZER

    out = real_disk.path / "model"
    code, err = run_cli("init", "--index", world["kb"], "--generator",
                        world["root"] / "g.json", "--generator-tokenizer", TOKENIZER,
                        "--out", out)
    line = _one_line(code, err)
    assert "no space left on device" in line and str(out) in line, line
    assert sorted(p.name for p in real_disk.path.iterdir()) == [], list(real_disk.path.iterdir())


def test_train_onto_a_full_disk_is_one_line_and_leaves_no_temporaries(world, real_disk):
    """Probe 9: ENOSPC while `train` wrote its checkpoint gave a traceback (torch.save's
    RuntimeError)."""
    out = real_disk.path / "run"
    code, err = run_cli("train", "--config", world["config"], "--model", world["model"],
                        "--output-dir", out)
    line = _one_line(code, err)
    assert "no space left on device" in line and str(out) in line, line
    assert not [p for p in out.rglob("*") if ".tmp-" in p.name], list(out.rglob("*"))


@pytest.mark.parametrize("argv, words", [
    (["index", "build", "--batch-size", "-3"], ["--batch-size must be >= 1"]),
    (["index", "build", "--batch-size", "0"], ["--batch-size must be >= 1"]),
    (["index", "build", "--max-length", "1000000000"], ["--max-length 1000000000", "positions"]),
    (["eval", "--batch-size", "-1"], ["--batch-size must be >= 1"]),
    (["eval", "--max-new-tokens", "1000000000000"], ["--max-new-tokens", "positions"]),
    (["generate", "--max-new-tokens", "1000000000000"], ["--max-new-tokens", "positions"]),
    (["eval", "--data", "/dev/zero"], ["/dev/zero", "not a regular file"]),
    (["train", "--config", "FOLDER"], ["is a folder, not a file"]),
    (["generate", "--questions", "FOLDER"], ["is a folder, not a file"]),
], ids=["build-batch-negative", "build-batch-zero", "build-max-length", "eval-batch",
        "eval-new-tokens", "generate-new-tokens", "eval-dev-zero", "train-config-folder",
        "generate-questions-folder"])
def test_sizes_and_paths_out_of_range_are_one_error(world, tmp_path, argv, words):
    """Second hostile pass: `--batch-size -3` built an index of zero vectors (exit 0);
    `--max-length 1e9` and `--max-new-tokens 1e12` ended in tracebacks; a device, a pipe or a
    folder given as a file was reported as missing."""
    folder = str(world["root"])
    argv = [folder if a == "FOLDER" else a for a in argv]
    command = argv[0]
    if command == "index":
        argv += ["--passages", world["passages"], "--encoder", world["encoder"], "--out",
                 tmp_path / "kb", "--no-progress"]
    elif command == "eval":
        argv += ["--model", world["model"], "--out", tmp_path / "e", "--no-progress"]
        if "--data" not in argv:
            argv += ["--data", world["dev"]]
    elif command == "generate":
        argv += ["--model", world["model"], "--no-progress"]
        if "--questions" not in argv:
            argv += ["--question", "which river is rome on"]
    elif command == "train":
        argv += ["--model", world["model"], "--output-dir", tmp_path / "run"]
    line = _one_line(*run_cli(*argv))
    for word in words:
        assert word in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_generate_onto_a_full_disk_names_the_file(world, real_disk):
    out = real_disk.path / "answers.jsonl"
    fd = os.open(real_disk.path / "filler", os.O_WRONLY | os.O_CREAT)
    try:  # every block taken
        with pytest.raises(OSError):
            while True:
                os.write(fd, b"\0" * 4096)
    finally:
        os.close(fd)
    code, err = run_cli("generate", "--model", world["model"], "--question", "q", "--out", out,
                        "--num-beams", "1", "--max-new-tokens", "1", "--no-progress")
    line = _one_line(code, err)
    assert "no space left on device" in line and str(out) in line, line
    assert sorted(p.name for p in real_disk.path.iterdir()) == ["filler"]


def test_vectors_without_dimensions_are_not_called_an_empty_corpus():
    """Second hostile pass: ten rows of no dimensions were reported as an empty corpus."""
    import numpy as np

    from rag_fast.retrieval import DenseIndex

    with pytest.raises(ValueError, match=r"shape \[10, 0\] has no dimensions"):
        DenseIndex.build(np.ones((10, 0), np.float32), "exact", progress=False)


def test_only_a_reasonless_runtime_error_on_a_nearly_full_disk_is_taken_for_a_full_disk(
        tmp_path, monkeypatch):
    """A library's write failing on a nearly full disk: torch.save's RuntimeError gives no
    reason and is said as a full disk; any other error keeps its own words."""
    from rag_fast import storage
    from rag_fast.retrieval import NoSpaceError

    path = tmp_path / "f.pt"
    monkeypatch.setattr(storage.disk, "disk_free", lambda p: 1024)
    with pytest.raises(NoSpaceError, match="no space left on device writing"):
        with storage.disk_errors(path):
            raise RuntimeError("unexpected pos 119232 vs 119184")
    with pytest.raises(ValueError, match="a bug"):
        with storage.disk_errors(path):
            raise ValueError("a bug")
    monkeypatch.setattr(storage.disk, "disk_free", lambda p: 1 << 40)
    with pytest.raises(RuntimeError, match="unexpected pos"):
        with storage.disk_errors(path):
            raise RuntimeError("unexpected pos 1 vs 2")
    with pytest.raises(NoSpaceError):  # the message says so, whatever the free space
        with storage.disk_errors(path):
            raise RuntimeError("I/O error: No space left on device (os error 28)")


def test_a_command_is_quiet_without_importing_transformers_first(world):
    """The command silences transformers' and the hub's logs and bars without importing them
    at start-up (0.8 s of every command): through their environment variables, read when they
    are imported. Without --verbose a search prints nothing on stderr; with it, the library's
    "Loading weights" bar is back."""
    from conftest import start_command

    quiet = start_command("index", "search", world["kb"], "which river is paris on")
    out, err = quiet.communicate(timeout=120)
    assert quiet.returncode == 0 and err == "" and "seine" in out, err
    loud = start_command("--verbose", "index", "search", world["kb"], "which river is paris on")
    _, err = loud.communicate(timeout=120)
    assert loud.returncode == 0 and "Loading weights" in err, err


def test_a_command_run_in_process_leaves_the_environment_as_it_was(world, monkeypatch):
    """main() called in a process that goes on (a test's, a notebook's): the variables that
    quiet third-party libraries for the command are put back after it, so a later --verbose
    command started from that process still shows their bars."""
    import os

    import types

    from rag_fast import _quiet
    from rag_fast._quiet import QUIET_VARIABLES

    # as in a command's process: transformers and the hub not imported yet
    monkeypatch.setattr(_quiet, "sys", types.SimpleNamespace(modules={}))
    for name in QUIET_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "true")
    code, err = run_cli("index", "info", world["kb"])
    assert code == 0, err
    assert os.environ.get("TOKENIZERS_PARALLELISM") == "true"
    assert [n for n in QUIET_VARIABLES[1:] if n in os.environ] == []
