"""Breaks found by the eighteenth hostile pass (at 5085568); each test failed before the fix:

- X969/X970: `serve --log-requests` with standard output a closed pipe (or a full disk)
  printed logging's "--- Logging error ---" traceback for every request;
- W803/W820: a server started with --max-new-tokens below 32 or --max-beams below 4 refused
  every request naming neither (even /v1/retrieve's): the defaults were checked against them;
- X941/X942/X955: `index build --bm25` over passages without a word BM25 indexes failed with
  Python's bare "max() arg is an empty sequence";
- Q108: `index build --out FILE/x` said only "Not a directory: FILE/x.staging";
- X938/X939: with --no-verify, a BM25 part edited at its recorded sizes was an "unexpected
  error" (an IndexError at search, an ImportError at load).

And of the nineteenth (at 7ebcc84): O102-O106b, every other command's output under a file
(the OS's "File exists" or "Not a directory", no flag); S306/S306c, a huge -k in a BM25 mode.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import TESTS, one_error, run_cli


@pytest.fixture(scope="module")
def bm25_kb(world, tmp_path_factory):
    out = tmp_path_factory.mktemp("kb18") / "kb"
    code, err = run_cli("index", "build", "--passages", world["passages"], "--encoder",
                        world["encoder"], "--out", out, "--no-progress", "--max-length", "32",
                        "--bm25")
    assert code == 0, err
    return out


def test_log_lines_to_a_closed_pipe_stop_with_one_warning(world, tmp_path):
    import http.client

    script = Path(sys.executable).parent / "rag-fast"
    read, write = os.pipe()
    proc = subprocess.Popen([str(script), "serve", "--model", str(world["model"]), "--port", "0",
                             "--device", "cpu", "--threads", "1", "--log-requests"],
                            cwd=TESTS, stdout=write, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    os.close(write)
    os.close(read)  # standard output: a pipe nobody reads any more
    try:
        first = proc.stderr.readline()
        port = int(first.split("http://127.0.0.1:")[1].split()[0])
        for _ in range(3):
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
            conn.request("POST", "/v1/retrieve", json.dumps({"question": "paris"}),
                         {"Content-Type": "application/json"})
            assert conn.getresponse().status == 200
            conn.close()
            time.sleep(0.1)
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    lines = err.strip().splitlines()
    assert "Traceback" not in err and "Logging error" not in err, err
    warned = [line for line in lines if "writing log lines to standard output failed" in line]
    assert len(warned) == 1 and len(lines) == 2, err


def test_defaults_above_a_servers_limits_are_its_limits(world):
    from rag_fast.serving import Answerer, Limits

    answerer = Answerer.load(str(world["model"]), device="cpu",
                             limits=Limits(max_beams=2, max_new_tokens=3))
    settings = answerer.settings()
    assert (settings.num_beams, settings.max_new_tokens) == (2, 3)
    [record] = answerer.retrieve(["which river is paris on"])
    assert record["passages"]
    assert answerer.answer(["which river is paris on"])[0]["answer"] is not None
    with pytest.raises(ValueError, match="num_beams must be in \\[1, 2\\]"):
        answerer.settings(num_beams=3)


@pytest.mark.parametrize("texts", [["the and of", "a an the"], ["a b c", "x y"]])
def test_bm25_over_passages_without_a_word_is_one_line(world, tmp_path, texts):
    passages = tmp_path / "p.jsonl"
    passages.write_text("".join(json.dumps({"id": f"p{i}", "title": "", "text": t}) + "\n"
                                for i, t in enumerate(texts)))
    code, err = run_cli("index", "build", "--passages", passages, "--encoder", world["encoder"],
                        "--out", tmp_path / "kb", "--no-progress", "--max-length", "32", "--bm25")
    one_error(code, err, "--bm25", "none of the 2 passages")
    assert not (tmp_path / "kb").exists()


def test_an_out_under_a_file_is_one_line_naming_out(world, tmp_path):
    (tmp_path / "userfile.txt").write_text("mine\n")
    out = tmp_path / "userfile.txt" / "x"
    code, err = run_cli("index", "build", "--passages", world["passages"], "--encoder",
                        world["encoder"], "--out", out, "--no-progress")
    one_error(code, err, "--out", str(out), "is a file, not a folder")
    assert (tmp_path / "userfile.txt").read_text() == "mine\n"


def _same_size_edit(path: Path, edit) -> None:
    data = bytearray(path.read_bytes())
    edit(data)
    path.write_bytes(bytes(data))


def test_a_bm25_part_edited_at_its_sizes_is_one_line_without_verify(bm25_kb, tmp_path):
    import shutil

    kb = tmp_path / "kb"
    shutil.copytree(bm25_kb, kb)
    indices = kb / "bm25" / "indices.csc.index.npy"
    header = len(indices.read_bytes()) - np.load(indices).nbytes

    def out_of_range(data):
        data[header:header + 4] = (10**6).to_bytes(4, "little")

    _same_size_edit(indices, out_of_range)
    code, err = run_cli("index", "search", kb, "paris", "--mode", "bm25", "--no-verify")
    one_error(code, err, "bm25", "out of range or inconsistent")
    shutil.rmtree(kb)
    shutil.copytree(bm25_kb, kb)
    params = kb / "bm25" / "params.index.json"
    text = params.read_text()
    # another backend (numba, which bm25s would import): the part is read with numpy's always
    params.write_text(text.replace('"numpy"', '"numba"'))
    code, err = run_cli("index", "search", kb, "paris", "--mode", "bm25", "--no-verify")
    assert code == 0, err
    params.write_text("[" + text[1:])  # not JSON of settings any more
    code, err = run_cli("index", "search", kb, "paris", "--mode", "bm25", "--no-verify")
    one_error(code, err, "bm25", "do not load")


# ---- the nineteenth pass (at 7ebcc84) -------------------------------------------------------

@pytest.mark.parametrize("command", [
    ["tokenizer", "fit", "--passages", "P", "--vocab-size", "300", "--out"],
    ["index", "eval", "--data", "D", "--index", "KB", "--out"],
    ["eval", "--data", "D", "--model", "M", "--max-new-tokens", "2", "--out"],
    ["train", "--config", "C", "--model", "M", "--output-dir"]])
def test_an_output_under_a_file_is_one_line_naming_its_flag(world, tmp_path, command):
    """O102-O106b: the OS's "File exists" or "Not a directory", naming no flag."""
    (tmp_path / "userfile.txt").write_text("mine\n")
    out = tmp_path / "userfile.txt" / "x"
    values = {"P": world["passages"], "D": world["dev"], "KB": world["kb"], "M": world["model"],
              "C": world["config"]}
    code, err = run_cli(*[values.get(a, a) for a in command], out)
    one_error(code, err, command[-1], str(out), "is a file, not a folder")
    assert (tmp_path / "userfile.txt").read_text() == "mine\n"


@pytest.mark.parametrize("mode", ["bm25", "hybrid"])
def test_a_huge_k_in_a_bm25_mode_is_one_line_naming_k(bm25_kb, mode):
    """S306/S306c: numpy's "array is too big" or "Maximum allowed dimension exceeded"."""
    code, err = run_cli("index", "search", bm25_kb, "paris", "--mode", mode, "-k",
                        str(2**63 - 1))
    one_error(code, err, "-k", "more passages than")
