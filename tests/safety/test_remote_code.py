"""Nothing rag_fast loads runs code: every ``from_pretrained`` of a model, tokenizer, config or
encoder passes ``trust_remote_code=False``, so a folder whose ``auto_map`` points at a ``.py``
file in it is refused with one line, and ``transformers`` never asks "run the custom code?",
even on a terminal where someone would answer "y"."""
from __future__ import annotations

import ast
import json
import os
import pty
import select
import subprocess
import sys
import time
from pathlib import Path

from conftest import REPO

PAYLOAD = """
from pathlib import Path
Path({marker!r}).write_text("ran")
from transformers import PreTrainedTokenizerFast, BertModel
class EvilTokenizer(PreTrainedTokenizerFast):
    pass
class EvilModel(BertModel):
    pass
"""


def _plant(folder: Path, marker: Path, config_file: str, auto_map: dict) -> None:
    (folder / "evil.py").write_text(PAYLOAD.format(marker=str(marker)))
    path = folder / config_file
    config = json.loads(path.read_text())
    config["auto_map"] = auto_map
    path.write_text(json.dumps(config))


def _hostile_model(world, tmp_path, marker) -> Path:
    """A model directory whose generator tokenizer maps to code in the folder, with both files
    listed in rag_fast.json (hashes and seal made again, as an attacker would)."""
    import shutil

    from rag_fast.storage import describe_files, sealed

    model = tmp_path / "model"
    shutil.copytree(world["model"], model)
    tok = model / "generator_tokenizer"
    _plant(tok, marker, "tokenizer_config.json",
           {"AutoTokenizer": ["evil.EvilTokenizer", "evil.EvilTokenizer"]})
    config = json.loads((tok / "tokenizer_config.json").read_text())
    config["tokenizer_class"] = "EvilTokenizer"
    (tok / "tokenizer_config.json").write_text(json.dumps(config))
    side = json.loads((model / "rag_fast.json").read_text())
    names = ["generator_tokenizer/tokenizer_config.json", "generator_tokenizer/evil.py"]
    side["files"].update(describe_files(model, names))
    (model / "rag_fast.json").write_text(json.dumps(sealed(side)))
    return model


def _hostile_encoder(world, tmp_path, marker) -> Path:
    import shutil

    encoder = tmp_path / "encoder"
    shutil.copytree(world["encoder"], encoder)
    _plant(encoder, marker, "config.json", {"AutoModel": "evil.EvilModel",
                                            "AutoConfig": "evil.EvilModel"})
    config = json.loads((encoder / "config.json").read_text())
    config["model_type"] = "evil-bert"  # no class in transformers: only its code could load it
    (encoder / "config.json").write_text(json.dumps(config))
    return encoder


DRIVER = """
import sys
from rag_fast import cli
runs = [["generate", "--model", sys.argv[1], "--question", "which river is rome on",
         "--num-beams", "1", "--max-new-tokens", "1"],
        ["index", "build", "--passages", sys.argv[3], "--encoder", sys.argv[2], "--out",
         sys.argv[4], "--no-progress"]]
codes = [cli.main(run) for run in runs]
print("EXIT CODES", codes, flush=True)
"""


def test_code_in_a_model_or_encoder_folder_never_runs_even_answering_y_on_a_terminal(
        world, tmp_path):
    """Probe 3: on a terminal transformers asked "run the custom code? [y/N]"; answering y ran
    a .py file from the model folder. Here a pseudo-terminal answers "y" to anything."""
    marker = tmp_path / "RAN"
    model = _hostile_model(world, tmp_path, marker)
    encoder = _hostile_encoder(world, tmp_path, marker)
    master, slave = pty.openpty()
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(REPO / "tests"))
    proc = subprocess.Popen([sys.executable, "-c", DRIVER, str(model), str(encoder),
                             str(world["passages"]), str(tmp_path / "kb")],
                            stdin=slave, stdout=slave, stderr=slave, env=env, cwd=tmp_path)
    os.close(slave)
    output = b""
    deadline = time.monotonic() + 300
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.5)
            if ready:
                try:
                    chunk = os.read(master, 4096)
                except OSError:  # the child closed the terminal
                    break
                if not chunk:
                    break
                output += chunk
            os.write(master, b"y\n")  # whoever asks gets a yes
            if proc.poll() is not None and not ready:
                break
    finally:
        proc.kill() if proc.poll() is None else None
        proc.wait()
        os.close(master)
    text = "\n".join(line for line in output.decode("utf-8", "replace").splitlines()
                     if line.strip() != "y")  # (the terminal echoes the answers)
    assert not marker.exists(), text
    assert "EXIT CODES [2, 2]" in text, text
    assert "custom code" not in text.lower().split("rag-fast: error:")[0], text
    errors = ["rag-fast: error:" + line.split("rag-fast: error:", 1)[1]
              for line in text.splitlines() if "rag-fast: error:" in line]
    assert len(errors) == 2, text
    assert "generator_tokenizer" in errors[0] and "--encoder" in errors[1], errors
    assert all("never runs code" in e for e in errors), errors
    assert not (tmp_path / "kb").exists()


def test_every_from_pretrained_call_passes_trust_remote_code_false():
    """Read from the source: a new ``from_pretrained`` call without the argument fails here."""
    missing = []
    for path in sorted((REPO / "rag_fast").rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "from_pretrained"):
                given = {k.arg: k.value for k in node.keywords}
                value = given.get("trust_remote_code")
                named = getattr(node.func.value, "id", None) or getattr(
                    node.func.value, "attr", "")
                if named == "GenerationConfig":  # a config of numbers, never code
                    continue
                if not (isinstance(value, ast.Constant) and value.value is False):
                    missing.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not missing, missing
