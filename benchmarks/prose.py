"""A real-text corpus that installs with rag_fast itself: the prose of Python's documentation and
of the documented libraries rag_fast depends on.

Sources, all under permissive licenses:
- ``pydoc_data.topics``: the language reference and library topics that ``help()`` shows, and
  the docstrings of the standard library's modules, classes and functions (Python Software
  Foundation License); the index bench's --quick corpus is made of these alone;
- with ``packages`` (:data:`PACKAGES`, the full corpus): the docstrings of numpy, torch,
  matplotlib and networkx, which installing rag_fast brings along (BSD, BSD, PSF-based and
  BSD licenses), each package's version recorded in :attr:`Corpus.sources`. These four keep
  the first embedding of the full corpus within about 10 minutes on 2 cores; transformers'
  docstrings, many of them copied between models with a word changed, are left out.

Test packages and docstrings under 40 words are left out, and a document whose text another
one already has (a docstring copied between models, say) is kept once.

Doctest lines and code-like lines are dropped, whitespace is collapsed, and each document is
cut into passages of :data:`WORDS` words (as DPR cuts Wikipedia), titled by topic or
qualified name. Documents are split into an indexed part and a held-out part (every
:data:`HELD_OUT_EVERY`-th document, by position): queries are sentences of held-out passages,
text the index has never seen. The corpus depends on the Python version (its stdlib); the
embedding cache is keyed by the texts' SHA-256.
"""
from __future__ import annotations

import ast
import hashlib
import os
import re
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from rag_fast.retrieval.passages import sentences

WORDS = 100
MIN_DOC_WORDS = 40
HELD_OUT_EVERY = 10
QUERIES_PER_PASSAGE = 2
# the libraries whose docstrings the full corpus adds: dependencies of rag_fast (networkx
# comes with torch), so every machine that runs the bench has them
PACKAGES = ("numpy", "torch", "matplotlib", "networkx")
_CODE = re.compile(r"^\s*(>>>|\.\.\.|\$ |[{}\[\]()#@]|def |class |import |from \S+ import )")


@dataclass
class Corpus:
    titles: list[str]
    texts: list[str]
    queries: list[str]  # sentences of held-out passages (never indexed)
    sha256: str
    sources: list[str] = field(default_factory=list)  # e.g. "python 3.11.9", "numpy 2.1.0"

    def __len__(self) -> int:
        return len(self.texts)

    def text(self, row: int) -> str:
        return self.texts[row]

    def stand_ins(self) -> list[str]:
        """What ``rag-fast index build`` measures an index on without ``--queries``: one
        sentence from each of up to 1000 sampled indexed passages."""
        from rag_fast.retrieval.bundle import TUNING_QUESTIONS
        from rag_fast.retrieval.passages import stand_in_questions

        return stand_in_questions(self, TUNING_QUESTIONS)


def _clean(text: str) -> str:
    lines = [line for line in text.splitlines() if not _CODE.match(line)]
    return " ".join(" ".join(lines).split())


def _docstrings(root: Path, prefix: str) -> list[tuple[str, str]]:
    """(qualified name, cleaned docstring) of every module, class and function under ``root``
    (``prefix`` names its package; test folders left out), in a fixed order."""
    docs = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        parts = rel.split("/")
        if parts[0] in ("site-packages", "dist-packages") or any(
                p.startswith(("test", "idle_test")) or p == "tests" for p in parts):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        module = prefix + rel[:-3].replace("/", ".").removesuffix(".__init__")
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc:
                    name = module if isinstance(node, ast.Module) else f"{module}.{node.name}"
                    docs.append((name, _clean(doc)))
    return docs


def _documents(packages: tuple[str, ...] = ()) -> tuple[list[tuple[str, str]], list[str]]:
    """(title, text) of every source document, in a fixed order, each text once; and the
    sources with their versions."""
    import importlib.metadata
    import importlib.util
    import platform

    from pydoc_data.topics import topics

    docs = [(name, _clean(text)) for name, text in sorted(topics.items())]
    docs += _docstrings(Path(sysconfig.get_paths()["stdlib"]), "")
    sources = [f"python {platform.python_version()}"]
    for package in packages:
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise RuntimeError(f"prose: the package {package!r} is not installed (pip install {package})")
        docs += _docstrings(Path(next(iter(spec.submodule_search_locations))), package + ".")
        sources.append(f"{package} {importlib.metadata.version(package)}")
    seen: set[str] = set()
    kept = []
    for title, text in docs:
        if len(text.split()) >= MIN_DOC_WORDS and text not in seen:
            seen.add(text)
            kept.append((title, text))
    return kept, sources


def _passages(text: str) -> list[str]:
    words = text.split()
    cuts = range(0, len(words), WORDS)
    out = [" ".join(words[i : i + WORDS]) for i in cuts]
    if len(out) > 1 and len(out[-1].split()) < WORDS // 4:  # a short tail joins the one before
        tail = out.pop()
        out[-1] += " " + tail
    return out


def _queries(passage: str) -> list[str]:
    """Up to :data:`QUERIES_PER_PASSAGE` sentences of 8 to 40 words of a passage, in order."""
    return sentences(passage)[:QUERIES_PER_PASSAGE]


def build(every: int = 1, packages: tuple[str, ...] = ()) -> Corpus:
    """The corpus: the passages of every ``every``-th indexed document (1: all of them; with
    the standard library alone ~2,650 passages, 3: ~900, what the index bench's quick mode
    embeds; with :data:`PACKAGES` too, the full mode's, ~14,700), and the queries of every
    held-out document whatever ``every`` is. A passage whose text an earlier one has is
    left out."""
    if not isinstance(every, int) or every < 1:
        raise ValueError(f"every must be a positive int, got {every!r}")
    titles, texts, queries = [], [], []
    documents, sources = _documents(tuple(packages))
    seen: set[str] = set()
    for i, (title, text) in enumerate(documents):
        held_out = i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1
        if not held_out and (i - i // HELD_OUT_EVERY) % every:
            continue  # an indexed document left out of a smaller corpus
        for passage in _passages(text):
            if passage in seen:
                continue
            seen.add(passage)
            if held_out:
                queries += _queries(passage)
            else:
                titles.append(title)
                texts.append(passage)
    digest = hashlib.sha256()
    for part in (titles, texts, queries):
        digest.update("\x1e".join(part).encode())
        digest.update(b"\x1d")
    return Corpus(titles, texts, queries, digest.hexdigest(), sources)


CACHE = Path(__file__).resolve().parent / "results" / "local" / "cache"  # git-ignored


def embeddings(corpus: Corpus, encoder_path: str, batch_size: int = 64,
               progress: bool = True) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(passage vectors ``[N, d]``, held-out query vectors ``[Q, d]``, stand-in question
    vectors ``[S, d]``), float32, from the encoder at ``encoder_path`` (pooling and
    normalisation as its sentence-transformers config says).

    Cached under ``benchmarks/results/local/cache``, each part keyed by the SHA-256 of its
    texts and the encoder folder's weights (size and mtime): changed text or weights
    re-encode, never a silent reuse.
    """
    from rag_fast.retrieval import Encoder

    weights = "|".join(f"{p.name}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in sorted(
        Path(encoder_path).rglob("*")) if p.suffix in (".safetensors", ".bin"))
    encoder = None
    out = []
    parts = (("passages", corpus.texts, corpus.titles), ("queries", corpus.queries, None),
             ("stand-ins", corpus.stand_ins(), None))
    for part, texts, titles in parts:
        digest = hashlib.sha256(weights.encode())
        for t in (titles or []) + texts:
            digest.update(t.encode() + b"\x1e")
        cached = CACHE / f"prose-{part}-{digest.hexdigest()[:16]}.npy"
        if cached.exists():
            try:
                x = np.load(cached)
                if x.shape[0] == len(texts):
                    out.append(x)
                    continue
            except (OSError, ValueError):
                pass  # unreadable: encode again
        encoder = encoder or Encoder(encoder_path, max_length=256)
        x = encoder.encode(texts, titles=titles, batch_size=batch_size, progress=progress).numpy()
        CACHE.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_name(f".{cached.name}.tmp-{os.getpid()}.npy")
        np.save(tmp, x)
        os.replace(tmp, cached)
        out.append(x)
    return out[0], out[1], out[2]
