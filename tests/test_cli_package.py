"""The command line is one package over the library: no library module imports it, and the
index build it runs is a library call (``rag_fast.retrieval.bundle``) that works without it."""
from __future__ import annotations

import ast
import csv
from pathlib import Path

import rag_fast
from rag_fast.retrieval.bundle import BUNDLE_KIND, build_index_bundle, load_index_bundle
from utils import save_tiny_bert

ROOT = Path(rag_fast.__file__).parent
WORDS = "paris france tower iron river water mountain nepal chess board game planet gas red".split()
PASSAGES = [("d0", "Paris", "paris france tower iron"), ("d1", "River", "river water gas planet"),
            ("d2", "Chess", "chess board game red"), ("d3", "Nepal", "nepal mountain water river")]


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


def test_no_library_module_imports_the_command_line():
    offenders = [str(f.relative_to(ROOT.parent)) for f in ROOT.rglob("*.py")
                 if "cli" not in f.relative_to(ROOT).parts[:1]
                 and any(n == "rag_fast.cli" or n.startswith("rag_fast.cli.") for n in _imports(f))]
    assert offenders == []


def test_build_index_bundle_is_a_library_call(tmp_path):
    corpus = tmp_path / "psgs.tsv"
    with open(corpus, "w", newline="") as f:
        w = csv.writer(f, delimiter="\t")
        w.writerow(["id", "text", "title"])
        for pid, title, text in PASSAGES:
            w.writerow([pid, text, title])
    (tmp_path / "enc").mkdir()
    encoder = save_tiny_bert(tmp_path / "enc", WORDS)
    lines: list[str] = []
    shard = build_index_bundle(str(corpus), encoder, tmp_path / "kb", preset="exact",
                               shard="0/2", device="cpu", progress=False, log=lines.append)
    assert shard.name == "embeddings-0-of-2.npy" and shard.parent.name == "kb.staging"
    assert not (tmp_path / "kb").exists()
    build_index_bundle(str(corpus), encoder, tmp_path / "kb", preset="exact", shard=(1, 2),
                       device="cpu", progress=False, log=lines.append)
    out = build_index_bundle(str(corpus), encoder, tmp_path / "kb", preset="exact",
                             device="cpu", progress=False, remove_staging=True, log=lines.append)
    assert out == tmp_path / "kb" and not (tmp_path / "kb.staging").exists()
    assert lines[-1].startswith("built Flat over 4 passages") and str(out) in lines[-1], lines
    manifest, store, index = load_index_bundle(out, verify=True)
    assert manifest["kind"] == BUNDLE_KIND and manifest["encoder"]["name"] == encoder
    assert len(store) == len(index) == 4 and store[2].title == "Chess"
