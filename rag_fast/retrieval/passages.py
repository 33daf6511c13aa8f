"""Passage store: the text side of RAG's non-parametric memory, on disk and memory-mapped.

A store is a directory holding every passage's id, title and text as ragged UTF-8 byte arrays
(one flat file plus int64 offsets each), so millions of passages cost no RAM until read. Row
``i`` of the store is the passage whose embedding is row ``i`` of the index: index ids are
row numbers. Per-tokenizer pre-tokenised copies (ragged int32 token ids) live under
``tokens/<tokenizer key>/`` and are built once, so training and decoding never re-tokenise.

Inputs: DPR-style TSV (``id, text, title``, as ``psgs_w100.tsv``), JSONL passages
(``{"id", "title", "text"}``, id and title optional), or raw documents (``.txt`` files, or
JSONL/TSV with ``split_words``) split into disjoint ``split_words``-word passages (the
paper's 100-word split).
"""
from __future__ import annotations

import csv
import hashlib
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
from tqdm.auto import tqdm

from rag_fast._jsonl import read_objects
from rag_fast.retrieval._files import (
    MANIFEST,
    RaggedArray,
    RaggedWriter,
    StorageError,
    atomic_directory,
    describe_files,
    read_manifest,
    write_json,
)

STORE_KIND = "rag_fast.passage_store"
TOKENS_KIND = "rag_fast.tokenized_passages"
FORMAT = 1
PAPER_PASSAGE_WORDS = 100
_FIELDS = ("ids", "titles", "texts")


@dataclass(frozen=True)
class Passage:
    """One passage: its corpus id (a string, as in DPR's TSV), title and text."""

    id: str
    title: str
    text: str


def split_words(text: str, words: int = PAPER_PASSAGE_WORDS) -> list[str]:
    """Split ``text`` into disjoint passages of ``words`` whitespace-separated words (the
    last one may be shorter); an empty text gives no passages."""
    if not isinstance(words, int) or words < 1:
        raise ValueError(f"words must be a positive int, got {words!r}")
    tokens = text.split()
    return [" ".join(tokens[i : i + words]) for i in range(0, len(tokens), words)]


def _clean(s: object) -> str:
    return " ".join(str(s).split()) if s is not None else ""


def read_dpr_tsv(path: str | Path) -> Iterator[Passage]:
    """Passages of a DPR-style TSV (``id<TAB>text<TAB>title``, header optional, csv quoting).

    Raises:
        ValueError: a row without the three columns, naming the file and line.
    """
    csv.field_size_limit(sys.maxsize)
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.reader(f, delimiter="\t")
        columns = {"id": 0, "text": 1, "title": 2}
        for row in reader:
            if reader.line_num == 1 and {"id", "text"} <= {c.strip().lower() for c in row}:
                columns = {c.strip().lower(): j for j, c in enumerate(row)}
                continue
            if len(row) <= max(columns.get("id", 0), columns["text"]):
                raise ValueError(
                    f"passages file {str(path)!r} line {reader.line_num}: expected the columns "
                    f"id, text, title separated by tabs, got {len(row)} column(s)"
                )
            title = row[columns["title"]] if columns.get("title", 99) < len(row) else ""
            yield Passage(row[columns["id"]].strip(), _clean(title), _clean(row[columns["text"]]))


def read_jsonl(path: str | Path) -> Iterator[Passage]:
    """Passages of a JSONL file: one object per line with ``text`` and optional ``title``,
    ``id`` (default: the line number, from 0).

    Raises:
        ValueError: a line that is not a JSON object with a ``text`` field, naming file and line.
    """
    for number, where, obj in read_objects(path):
        if "text" not in obj:
            raise ValueError(f'{where}: expected an object with a "text" field (and optional '
                             '"title", "id")')
        yield Passage(str(obj.get("id", number - 1)), _clean(obj.get("title")), _clean(obj["text"]))


def _split_all(passages: Iterable[Passage], words: int) -> Iterator[Passage]:
    for p in passages:
        for j, chunk in enumerate(split_words(p.text, words)):
            yield Passage(f"{p.id}-{j}", p.title, chunk)


def read_passages(path: str | Path, split: int | None = None) -> Iterator[Passage]:
    """Passages from a file or directory, chosen by extension.

    ``.tsv``: DPR TSV; ``.jsonl``/``.json``: JSONL; ``.txt``: one raw document titled by the
    file's stem; a directory: every ``*.txt`` in it (sorted), as raw documents. Raw documents
    are split into ``split`` words (default 100); TSV and JSONL rows are split only when
    ``split`` is given.

    Raises:
        ValueError: an unknown extension or a malformed file, naming ``passages``.
        FileNotFoundError: ``path`` does not exist.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"passages: {str(path)!r} does not exist")
    if path.is_dir() or path.suffix == ".txt":
        files = sorted(path.glob("*.txt")) if path.is_dir() else [path]
        docs = (Passage(f.stem, f.stem.replace("_", " "), f.read_text(encoding="utf-8")) for f in files)
        return _split_all(docs, split or PAPER_PASSAGE_WORDS)
    readers = {".tsv": read_dpr_tsv, ".jsonl": read_jsonl, ".json": read_jsonl}
    if path.suffix not in readers:
        raise ValueError(
            f"passages: cannot tell the format of {str(path)!r}; expected .tsv (DPR: id, text, "
            "title), .jsonl, .txt or a directory of .txt documents"
        )
    rows = readers[path.suffix](path)
    return _split_all(rows, split) if split else rows


def tokenizer_key(tokenizer) -> str:
    """A directory name that identifies a tokenizer by its name and vocabulary."""
    vocab = json.dumps(sorted(tokenizer.get_vocab().items()), ensure_ascii=False)
    digest = hashlib.sha256(f"{type(tokenizer).__name__}\n{vocab}".encode()).hexdigest()[:16]
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", Path(str(tokenizer.name_or_path)).name or "tokenizer")
    return f"{name}-{digest}"


class TokenizedPassages:
    """Pre-tokenised titles and texts of a store for one tokenizer (no special tokens).

    ``titles[i]`` are the ids of ``title`` and ``texts[i]`` the ids of ``" " + text`` (int32
    arrays), so that ``title + " / " + text + " // " + question`` can be assembled from
    pieces without tokenising again.
    """

    def __init__(self, root: Path, titles: RaggedArray, texts: RaggedArray, manifest: dict):
        self.root, self.titles, self.texts, self.manifest = root, titles, texts, manifest

    def __len__(self) -> int:
        return len(self.texts)


class PassageStore:
    """Memory-mapped passages: ``store[i] -> Passage``, ``len(store)``.

    Create with :meth:`create` (from passages) or :meth:`from_file`; open with :meth:`load`.
    """

    def __init__(self, root: Path, arrays: dict[str, RaggedArray], manifest: dict):
        self.root = Path(root)
        self._arrays = arrays
        self.manifest = manifest
        self._tokenized: dict[str, TokenizedPassages] = {}

    # ---- creation -------------------------------------------------------------------------
    @classmethod
    def create(
        cls,
        passages: Iterable[Passage | dict | tuple],
        out: str | Path,
        overwrite: bool = False,
        progress: bool = True,
        source: str | None = None,
    ) -> "PassageStore":
        """Write ``passages`` (Passage, dicts with id/title/text, or (id, title, text) tuples)
        to a new store directory ``out``, atomically.

        Raises:
            ValueError: ``passages`` is empty, or an item has the wrong form.
            FileExistsError: ``out`` exists and ``overwrite`` is False.
        """
        with atomic_directory(out, overwrite) as tmp:
            writers = {name: RaggedWriter(tmp, name, np.uint8) for name in _FIELDS}
            count = 0
            for item in tqdm(passages, desc="passages", unit=" psg", disable=not progress):
                p = _as_passage(item, count)
                writers["ids"].append(p.id.encode())
                writers["titles"].append(p.title.encode())
                writers["texts"].append(p.text.encode())
                count += 1
            for w in writers.values():
                w.close()
            if count == 0:
                raise ValueError(
                    f"passages: the corpus is empty{f' ({source})' if source else ''}; "
                    "expected at least one passage"
                )
            names = [f for name in _FIELDS for f in RaggedArray.files(name)]
            manifest = {"kind": STORE_KIND, "format": FORMAT, "count": count, "source": source,
                        "files": describe_files(tmp, names)}
            write_json(tmp / MANIFEST, manifest)
        return cls.load(out, verify=False)

    @classmethod
    def from_file(
        cls, path: str | Path, out: str | Path, split: int | None = None, **kwargs
    ) -> "PassageStore":
        """:meth:`create` from a TSV, JSONL, ``.txt`` or directory (see :func:`read_passages`)."""
        return cls.create(read_passages(path, split), out, source=str(path), **kwargs)

    @classmethod
    def load(cls, path: str | Path, verify: bool = True) -> "PassageStore":
        """Open a store directory, memory-mapped. ``verify`` checks every file's SHA-256 (sizes
        are always checked).

        Raises:
            StorageError: missing, truncated, corrupt or not a passage store.
        """
        root = Path(path)
        manifest = read_manifest(root, STORE_KIND, verify)
        arrays = {name: RaggedArray.load(root, name, np.uint8) for name in _FIELDS}
        for name, arr in arrays.items():
            if len(arr) != manifest["count"]:
                raise StorageError(f"passage store {str(root)!r}: {name} has {len(arr)} rows, "
                                   f"the manifest says {manifest['count']}")
        return cls(root, arrays, manifest)

    # ---- access ---------------------------------------------------------------------------
    def __len__(self) -> int:
        return self.manifest["count"]

    def _str(self, field: str, i: int) -> str:
        return bytes(self._arrays[field][self._check_row(i)]).decode()

    def _check_row(self, i: int) -> int:
        i = int(i)
        if not 0 <= i < len(self):
            raise IndexError(f"passage row {i} is out of range [0, {len(self)})")
        return i

    def id(self, i: int) -> str:
        return self._str("ids", i)

    def title(self, i: int) -> str:
        return self._str("titles", i)

    def text(self, i: int) -> str:
        return self._str("texts", i)

    def __getitem__(self, i: int) -> Passage:
        return Passage(self.id(i), self.title(i), self.text(i))

    def __iter__(self) -> Iterator[Passage]:
        return (self[i] for i in range(len(self)))

    def text_lengths(self) -> np.ndarray:
        """``[N]`` int64 byte length of each text (a cheap proxy for its token count)."""
        return np.diff(np.asarray(self._arrays["texts"].offsets))

    # ---- pre-tokenised copies -------------------------------------------------------------
    def tokenized(self, tokenizer, progress: bool = True, batch_size: int = 1024,
                  key: str | None = None) -> TokenizedPassages:
        """The store's titles and texts tokenised by ``tokenizer`` (a Hugging Face tokenizer),
        built on first use under ``tokens/<key>/`` (atomically) and memory-mapped after.
        ``key`` defaults to :func:`tokenizer_key` (pass it to skip hashing the vocabulary)."""
        key = key or tokenizer_key(tokenizer)
        if key in self._tokenized:
            return self._tokenized[key]
        root = self.root / "tokens" / key
        if not (root / MANIFEST).exists():
            with atomic_directory(root, overwrite=True) as tmp:
                titles = RaggedWriter(tmp, "titles", np.int32)
                texts = RaggedWriter(tmp, "texts", np.int32)
                bar = tqdm(total=len(self), desc=f"tokenizing ({key})", unit=" psg", disable=not progress)
                for start in range(0, len(self), batch_size):
                    rows = range(start, min(start + batch_size, len(self)))
                    enc_titles = tokenizer([self.title(i) for i in rows], add_special_tokens=False)
                    enc_texts = tokenizer([" " + self.text(i) for i in rows], add_special_tokens=False)
                    for a, b in zip(enc_titles["input_ids"], enc_texts["input_ids"]):
                        titles.append(np.asarray(a, np.int32))
                        texts.append(np.asarray(b, np.int32))
                    bar.update(len(rows))
                bar.close()
                titles.close()
                texts.close()
                files = RaggedArray.files("titles") + RaggedArray.files("texts")
                write_json(tmp / MANIFEST, {
                    "kind": TOKENS_KIND, "format": FORMAT, "count": len(self), "tokenizer": key,
                    "name_or_path": str(tokenizer.name_or_path), "files": describe_files(tmp, files),
                })
        manifest = read_manifest(root, TOKENS_KIND, verify=False)
        tok = TokenizedPassages(root, RaggedArray.load(root, "titles", np.int32),
                                RaggedArray.load(root, "texts", np.int32), manifest)
        if len(tok) != len(self):
            raise StorageError(f"tokenized passages {str(root)!r} have {len(tok)} rows, the store {len(self)}")
        self._tokenized[key] = tok
        return tok


def _as_passage(item: Passage | dict | tuple, row: int) -> Passage:
    if isinstance(item, Passage):
        return Passage(item.id, _clean(item.title), _clean(item.text))
    if isinstance(item, dict) and "text" in item:
        return Passage(str(item.get("id", row)), _clean(item.get("title")), _clean(item["text"]))
    if isinstance(item, tuple) and len(item) == 3:
        return Passage(str(item[0]), _clean(item[1]), _clean(item[2]))
    raise ValueError(
        f"passages[{row}] must be a Passage, a dict with 'text' (and 'id', 'title') or an "
        f"(id, title, text) tuple, got {type(item).__name__}"
    )
