"""Passage store: the text side of RAG's non-parametric memory, on disk and memory-mapped.

A store is a directory holding every passage's id, title and text as ragged UTF-8 byte arrays
(one flat file plus int64 offsets each), so millions of passages cost no RAM until read. Row
``i`` of the store is the passage whose embedding is row ``i`` of the index: index ids are
row numbers. Per-tokenizer pre-tokenised copies (ragged int32 token ids) live under
``tokens/<tokenizer key>/`` and are built once, so training and decoding never re-tokenise.

Inputs: DPR-style TSV (``id, text, title``, as ``psgs_w100.tsv``), JSONL passages
(``{"id", "title", "text"}``, id and title optional), or raw documents (``.txt`` files, or
JSONL/TSV with ``split_words``) split into disjoint ``split_words``-word passages (the
paper's 100-word split). Inputs are regular files (a device or a named pipe is refused before
it is opened), read a line at a time: a line longer than ``MAX_LINE_BYTES`` (64 MiB) is
refused, and a passage's title or text longer than ``MAX_TEXT_CHARS`` (1 Mi characters, more
than any model keeps) is cut to it, said once per file (``rag_fast._jsonl``).
"""
from __future__ import annotations

import contextlib
import csv
import hashlib
import itertools
import json
import os
import re
import secrets
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
from tqdm.auto import tqdm

from rag_fast._jsonl import (
    MAX_LINE_BYTES,
    MAX_TEXT_CHARS,
    check_regular_file,
    decoded_lines,
    json_type,
    line_too_long,
    lone_surrogate,
    read_objects,
    warn_cut,
)
from rag_fast.storage import (
    MANIFEST,
    RaggedArray,
    RaggedWriter,
    StorageError,
    atomic_directory,
    describe_files,
    disk_errors,
    private_folder,
    read_manifest,
    write_manifest,
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
    return list(_runs(_word_lists(text), _check_words(words)))


_WORD = re.compile(r"\S+")  # a word as str.split() finds them (the same whitespace)
_WORDS_AT_ONCE = 1 << 16


def _words(text: str) -> Iterator[str]:
    """The words of ``text`` as ``text.split()`` finds them, one at a time."""
    return (m.group() for m in _WORD.finditer(text))


def _word_lists(text: str) -> Iterator[list[str]]:
    """The words of ``text`` (``text.split()``) in lists: one for a text of at most
    ``MAX_TEXT_CHARS`` characters, else lists of ``_WORDS_AT_ONCE`` words, so that a long
    text is never held as a list of all its words (a word costs about 50 bytes)."""
    if len(text) <= MAX_TEXT_CHARS:
        yield text.split()
        return
    words = _words(text)
    while batch := list(itertools.islice(words, _WORDS_AT_ONCE)):
        yield batch


def _check_words(words: object) -> int:
    if not isinstance(words, int) or words < 1:
        raise ValueError(f"words must be a positive int, got {words!r}")
    return words


def _runs(word_lists: Iterable[list[str]], n: int) -> Iterator[str]:
    """Disjoint runs of ``n`` of the words of ``word_lists``, in order, each joined by one
    space (the last may be shorter)."""
    run: list[str] = []
    for words in word_lists:
        run += words
        whole = len(run) - len(run) % n
        for start in range(0, whole, n):
            yield " ".join(run[start : start + n])
        del run[:whole]
    if run:
        yield " ".join(run)


_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[\"'(\[]?[A-Z0-9])")


def sentences(text: str, min_words: int = 8, max_words: int = 40) -> list[str]:
    """The sentences of ``text`` with ``min_words`` to ``max_words`` words, in order (a
    sentence ends at ``.``, ``!`` or ``?`` before a capital or a digit)."""
    return [s for s in _SENTENCE_END.split(text) if min_words <= len(s.split()) <= max_words]


def stand_in_rows(store: "PassageStore", n: int, seed: int = 0) -> np.ndarray:
    """The rows (sorted) of the ``n`` passages :func:`stand_in_questions` samples."""
    return np.sort(np.random.default_rng(seed).choice(len(store), min(n, len(store)),
                                                      replace=False))


def stand_in_questions(store: "PassageStore", n: int, seed: int = 0) -> list[str]:
    """One sentence from each of ``n`` passages sampled with ``seed`` (their first 30 words
    where none has 8 to 40 words; :func:`stand_in_rows`, in that order): short texts about
    the corpus, encoded as questions to measure an index when no real questions are given."""
    rows = stand_in_rows(store, n, seed)
    out = []
    for row in rows.tolist():
        text = store.text(row)
        found = sentences(text)
        out.append(found[0] if found else " ".join(text.split()[:30]))
    return out


def _clean(s: object) -> tuple[str, bool]:
    """``s`` with its whitespace runs made one space and cut to its first ``MAX_TEXT_CHARS``
    characters (None: empty), and whether the cut left anything out. A longer text is read a
    word at a time up to the bound, never split whole."""
    if s is None:
        return "", False
    s = str(s)
    if len(s) <= MAX_TEXT_CHARS:
        return " ".join(s.split()), False
    kept, length = [], -1  # the words so far, and their length joined by one space
    for word in _words(s):
        kept.append(word)
        length += 1 + len(word)
        if length > MAX_TEXT_CHARS:
            break
    return " ".join(kept)[:MAX_TEXT_CHARS], length > MAX_TEXT_CHARS


class PassageFormatError(ValueError):
    """A passages file is malformed (naming the file and line): the readers never guess."""


_EXPECTED = "a passages file (.tsv, .jsonl or .txt) or a folder of .txt documents"


def passage_files(path: str | Path) -> list[Path]:
    """The files :func:`read_passages` reads at ``path``: the file itself, or a folder's
    ``*.txt`` files (sorted), each checked to be a regular file (or a symbolic link to one)
    before any is opened.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: ``path``, or a ``*.txt`` of the folder, is a device, a named pipe, a socket
            or (in a folder) a folder; the message starts with ``passages:`` and names it.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"passages: {str(path)!r} does not exist")
    files = sorted(path.glob("*.txt")) if path.is_dir() else [path]
    for f in files:
        check_regular_file(f, "passages", _EXPECTED)
    return files


def _decoded_lines(path: str | Path) -> Iterator[tuple[int, str]]:
    """Line-numbered UTF-8 lines, BOM dropped (see ``rag_fast._jsonl.decoded_lines``).

    Raises:
        PassageFormatError: bytes that are not UTF-8, naming the file, line and column; a line
            longer than ``MAX_LINE_BYTES``, naming the file and the line.
    """
    return decoded_lines(path, PassageFormatError)


def _bounded_lines(path: Path, chunks: Iterable[bytes]) -> Iterator[bytes]:
    """``chunks`` (the bytes of ``path`` in order, each shorter than ``MAX_LINE_BYTES``),
    refusing a line longer than ``MAX_LINE_BYTES`` as soon as its length shows: what
    :func:`_decoded_lines` refuses, found without decoding anything.

    Raises:
        PassageFormatError: naming the file and the line.
    """
    ended, run = 0, 0  # lines ended before this chunk; bytes of the line read so far
    for chunk in chunks:
        first = chunk.find(b"\n")
        if first < 0 or run + first > MAX_LINE_BYTES:
            run += len(chunk) if first < 0 else first
        else:  # the other lines ending in the chunk are shorter than it
            ended += chunk.count(b"\n")
            run = len(chunk) - chunk.rfind(b"\n") - 1
        if run > MAX_LINE_BYTES:
            raise PassageFormatError(line_too_long(path, ended + 1))
        yield chunk


def _pieces(path: Path) -> Iterator[str]:
    """The text of ``path`` in pieces of whole lines, each of at most ``MAX_TEXT_CHARS``
    characters unless it is one longer line: split word by word, they give the words of the
    whole text (a line ends in whitespace)."""
    piece: list[str] = []
    size = 0
    for _, line in _decoded_lines(path):
        if piece and size + len(line) > MAX_TEXT_CHARS:
            yield "".join(piece)
            piece, size = [], 0
        piece.append(line)
        size += len(line)
    if piece:
        yield "".join(piece)


def _document(path: Path, words: int) -> Iterator[Passage]:
    """The passages of the raw document ``path``: its words in disjoint runs of ``words``
    (:func:`split_words` of its whole text), read a piece at a time, with ids ``<stem>-<j>``
    and the stem as their title."""
    name, title = _document_name(path), path.stem.replace("_", " ")
    document = (batch for piece in _pieces(path) for batch in _word_lists(piece))
    for j, run in enumerate(_runs(document, words)):
        yield Passage(f"{name}-{j}", title, run)


def _bounded(path: str | Path, passages: Iterable[Passage]) -> Iterator[Passage]:
    """``passages`` as a store keeps them (see :func:`_as_passage`: whitespace runs made one
    space, titles and texts cut to ``MAX_TEXT_CHARS`` characters); once they are all read,
    how many were cut is said in one ``TextCutWarning`` naming ``path``."""
    cut = 0
    for row, item in enumerate(passages):
        passage, was_cut = _as_passage(item, row)
        cut += was_cut
        yield passage
    warn_cut(path, cut, "passage")


def _document_name(path: Path) -> str:
    """The stem of a raw document's file, its passages' id and title.

    Raises:
        PassageFormatError: a file name that is not UTF-8 (Python holds its bytes as lone
            surrogates, which the store cannot write).
    """
    if lone_surrogate(path.name) is not None:
        raise PassageFormatError(f"{ascii(str(path))}: the file name is not valid UTF-8 (it "
                                 "becomes the passages' id and title); rename the file")
    return path.stem


def _unique(path: str | Path, rows: Iterable[tuple[int, Passage]], dedupe: bool) -> Iterator[Passage]:
    """The passages of ``rows`` (``(line, passage)``), checking that ids are unique.

    Raises:
        PassageFormatError: a repeated id (unless ``dedupe``, which keeps the first), naming
            both lines.
    """
    seen: dict[str, int] = {}
    for line, p in rows:
        first = seen.setdefault(p.id, line)
        if first != line:
            if dedupe:
                continue
            raise PassageFormatError(
                f"{path}:{line}: duplicate passage id {p.id!r} (line {line} repeats the id of "
                f"line {first}); expected unique ids (pass dedupe=True / --dedupe to keep the first)"
            )
        yield p


def _tsv_rows(path: str | Path) -> Iterator[tuple[int, Passage]]:
    csv.field_size_limit(sys.maxsize)
    lines = _decoded_lines(path)
    reader = csv.reader((line for _, line in lines), delimiter="\t", strict=True)
    names = ("id", "text", "title")
    columns: dict[str, int] | None = None
    expected = 0
    unnamed_pairs = False  # 2 columns and no header: (id, text), ids checked row by row
    end = 0  # the last line of the previous record
    while True:
        start = end + 1
        try:
            row = next(reader)
        except StopIteration:
            return
        except csv.Error as e:
            if reader.line_num > start:
                _spans(path, start, reader.line_num)
            raise PassageFormatError(f"{path}:{start}: malformed TSV record ({e}); "
                                     "expected csv quoting (a quoted field ends with a quote, "
                                     'inner quotes doubled as "")') from None
        end = reader.line_num
        if end > start:
            _spans(path, start, end)
        if not row:  # a blank line
            continue
        if columns is None:
            header = [c.strip().lower() for c in row]
            if {"id", "text"} <= set(header):
                columns, expected = {c: j for j, c in enumerate(header)}, len(row)
                names = tuple(row)
                continue
            if set(header) <= set(names) and len(set(header)) == len(header):
                # a header of the known names that lacks id or text (e.g. text, title)
                raise PassageFormatError(
                    f"{path}:{start}: the header row names {', '.join(row)}; a passage TSV "
                    "needs an id and a text column (id<TAB>text<TAB>title)")
            if len(row) not in (2, 3):
                raise PassageFormatError(f"{path}:{start}: expected 3 tab-separated columns (id, "
                                         f"text, title) or 2 (id, text), got {len(row)}")
            names = names[: len(row)]
            columns, expected = {c: j for j, c in enumerate(names)}, len(row)
            unnamed_pairs = len(row) == 2
        if len(row) != expected:
            raise PassageFormatError(
                f"{path}:{start}: expected {expected} tab-separated columns ({', '.join(names)}), "
                f"got {len(row)}"
            )
        if unnamed_pairs and any(c.isspace() for c in row[0].strip()):
            # rows of (text, title) would be read as (id, text) without a word: refuse them
            raise PassageFormatError(
                f"{path}:{start}: 2 tab-separated columns without a header are read as (id, "
                f"text), but the first column holds {_preview(row[0])}, which looks like text, "
                "not an id; if it is the id, start the file with the header row id<TAB>text, "
                "else give every passage an id (id<TAB>text<TAB>title)")
        title = row[columns["title"]] if "title" in columns else ""
        yield start, Passage(row[columns["id"]].strip(), title, row[columns["text"]])


def _preview(value: str, limit: int = 40) -> str:
    value = value.strip()
    return repr(value if len(value) <= limit else value[:limit] + "...")


def _spans(path: str | Path, start: int, end: int) -> None:
    raise PassageFormatError(
        f"{path}:{start}: a quoted field spans lines {start}-{end} (an unbalanced '\"'?); "
        "expected one passage per line"
    )


def read_dpr_tsv(path: str | Path, dedupe: bool = False) -> Iterator[Passage]:
    """Passages of a DPR-style TSV (``id<TAB>text<TAB>title``, header optional, csv quoting).

    Without a header the first row fixes the columns: ``id, text, title`` or ``id, text`` (an
    id with spaces is refused there, most likely a ``text, title`` row: a header row
    ``id<TAB>text`` allows it). A header of known names needs ``id`` and ``text``.
    Blank lines are skipped; a UTF-8 BOM is dropped. Titles and texts longer than
    ``MAX_TEXT_CHARS`` are cut (one ``TextCutWarning`` for the file).

    Raises:
        PassageFormatError: (a ValueError) naming the file and line: a row with another number
            of columns, a quoted field spanning lines or otherwise malformed quoting, bytes that
            are not UTF-8, a line longer than ``MAX_LINE_BYTES``, a duplicate id (unless
            ``dedupe``: keep the first).
        FileNotFoundError, ValueError: ``path`` is missing or not a regular file (a folder,
            a device, a named pipe), naming ``passages``.
    """
    check_regular_file(path, "passages", _EXPECTED)
    return _bounded(path, _unique(path, _tsv_rows(path), dedupe))


def _jsonl_rows(path: str | Path) -> Iterator[tuple[int, Passage]]:
    for number, where, obj in read_objects(path, PassageFormatError):
        if "text" not in obj:
            raise PassageFormatError(f'{where}: expected an object with a "text" field (and '
                                     'optional "title", "id")')
        text, title, pid = obj["text"], obj.get("title"), obj.get("id", number - 1)
        if not isinstance(text, str):
            raise PassageFormatError(f'{where}: "text" must be a string, got {json_type(text)}')
        if title is not None and not isinstance(title, str):
            raise PassageFormatError(f'{where}: "title" must be a string or null, got {json_type(title)}')
        if isinstance(pid, bool) or not isinstance(pid, (str, int)):
            raise PassageFormatError(f'{where}: "id" must be a string or an integer, got {json_type(pid)}')
        yield number, Passage(str(pid), title or "", text)


def read_jsonl(path: str | Path, dedupe: bool = False) -> Iterator[Passage]:
    """Passages of a JSONL file: one object per line with ``text`` and optional ``title``,
    ``id`` (default: the line number, from 0). ``text`` and ``title`` are strings (a null
    ``title`` is empty), ``id`` a string or an integer. Blank lines are skipped; a UTF-8 BOM
    is dropped. Titles and texts longer than ``MAX_TEXT_CHARS`` are cut (one
    ``TextCutWarning`` for the file).

    Raises:
        PassageFormatError: (a ValueError) naming the file and line: a line that is not a JSON
            object with a string ``text``, a field of another type, bytes that are not UTF-8,
            a string that is not valid Unicode (a lone surrogate from a JSON escape such as
            ``"\\ud800"``, naming the field), a line longer than ``MAX_LINE_BYTES``, a
            duplicate id (unless ``dedupe``: keep the first).
        FileNotFoundError, ValueError: ``path`` is missing or not a regular file (a folder,
            a device, a named pipe), naming ``passages``.
    """
    check_regular_file(path, "passages", _EXPECTED)
    return _bounded(path, _unique(path, _jsonl_rows(path), dedupe))


def _split_all(passages: Iterable[Passage], words: int) -> Iterator[Passage]:
    for p in passages:
        for j, run in enumerate(_runs(_word_lists(p.text), words)):
            yield Passage(f"{p.id}-{j}", p.title, run)


def read_passages(path: str | Path, split: int | None = None, dedupe: bool = False) -> Iterator[Passage]:
    """Passages from a file or directory, chosen by extension.

    ``.tsv``: DPR TSV; ``.jsonl``/``.json``: JSONL; ``.txt``: one raw document titled by the
    file's stem; a directory: every ``*.txt`` in it (sorted), as raw documents. Raw documents
    are split into ``split`` words (default 100); TSV and JSONL rows are split only when
    ``split`` is given. Ids must be unique; ``dedupe`` keeps the first passage of each id.
    Every input is a regular file, read a line at a time (a line holds at most
    ``MAX_LINE_BYTES``); titles and texts longer than ``MAX_TEXT_CHARS`` characters are cut
    after splitting, said once per file (a ``TextCutWarning``), so no passage costs more.

    Raises:
        ValueError: an unknown extension, a path that is not a regular file (see
            :func:`passage_files`) or a malformed file (:class:`PassageFormatError`, naming the
            file and line), naming ``passages``.
        FileNotFoundError: ``path`` does not exist.
    """
    files = passage_files(path)
    path = Path(path)
    if path.is_dir() or path.suffix == ".txt":
        words = _check_words(PAPER_PASSAGE_WORDS if split is None else split)
        return itertools.chain.from_iterable(_bounded(f, _document(f, words)) for f in files)
    readers = {".tsv": _tsv_rows, ".jsonl": _jsonl_rows, ".json": _jsonl_rows}
    if path.suffix not in readers:
        raise ValueError(
            f"passages: cannot tell the format of {str(path)!r}; expected .tsv (DPR: id, text, "
            "title), .jsonl, .txt or a directory of .txt documents"
        )
    rows = _unique(path, readers[path.suffix](path), dedupe)
    return _bounded(path, _split_all(rows, _check_words(split)) if split is not None else rows)


_DIGEST_CHUNK = 1 << 23


def passages_digest(path: str | Path) -> str:
    """SHA-256 of what :func:`read_passages` reads at ``path``: the file's bytes, or for a
    directory each ``*.txt`` file's name and bytes (sorted). Reading every byte anyway, it
    refuses a line longer than ``MAX_LINE_BYTES`` as the readers would, so that ``index
    build`` refuses one before it stages anything.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: a path that is not a regular file (see :func:`passage_files`); a line
            longer than ``MAX_LINE_BYTES`` (:class:`PassageFormatError`, naming the file and
            the line).
    """
    h = hashlib.sha256()
    for f in passage_files(path):
        h.update(f"{f.name}\0{f.stat().st_size}\0".encode())
        with open(f, "rb") as fh:
            for chunk in _bounded_lines(f, iter(lambda: fh.read(_DIGEST_CHUNK), b"")):
                h.update(chunk)
    return h.hexdigest()


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
        with atomic_directory(out, overwrite, kind=STORE_KIND) as tmp, disk_errors(out):
            writers = {name: RaggedWriter(tmp, name, np.uint8) for name in _FIELDS}
            count = cut = 0
            try:
                for item in tqdm(passages, desc="passages", unit=" psg", disable=not progress):
                    p, was_cut = _as_passage(item, count)
                    cut += was_cut
                    writers["ids"].append(p.id.encode())
                    writers["titles"].append(p.title.encode())
                    writers["texts"].append(p.text.encode())
                    count += 1
                for w in writers.values():
                    w.close()
            except BaseException:  # also a reader's error: no open file is left behind
                for w in writers.values():
                    w.abandon()
                raise
            warn_cut(source or "passages", cut, "passage")
            if count == 0:
                raise ValueError(
                    f"passages: the corpus is empty{f' ({source})' if source else ''}; "
                    "expected at least one passage"
                )
            names = [f for name in _FIELDS for f in RaggedArray.files(name)]
            manifest = {"kind": STORE_KIND, "format": FORMAT, "count": count, "source": source,
                        "files": describe_files(tmp, names)}
            write_manifest(tmp / MANIFEST, manifest)
        return cls.load(out, verify=False)

    @classmethod
    def from_file(
        cls, path: str | Path, out: str | Path, split: int | None = None, dedupe: bool = False,
        **kwargs,
    ) -> "PassageStore":
        """:meth:`create` from a TSV, JSONL, ``.txt`` or directory (see :func:`read_passages`)."""
        return cls.create(read_passages(path, split, dedupe), out, source=str(path), **kwargs)

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
        """Row ``i`` of ``field``, its offsets checked against the data first: a store loaded
        without verification may hold offsets that slicing would quietly clamp.

        Raises:
            IndexError: ``i`` out of range.
            StorageError: offsets outside the data or a row that is not UTF-8, naming the
                file and the row.
        """
        array, i = self._arrays[field], self._check_row(i)
        start, end, size = int(array.offsets[i]), int(array.offsets[i + 1]), len(array.values)
        if not 0 <= start <= end <= size:
            raise StorageError(
                f"{self.root / f'{field}.offsets.npy'}: row {i} gives bytes {start}..{end} of "
                f"{field}.values.bin, which holds {size}; the passage store is corrupt (loaded "
                "without verification: its checksums refuse it)")
        try:
            return bytes(array.values[start:end]).decode()
        except UnicodeDecodeError:
            raise StorageError(f"{self.root / f'{field}.values.bin'}: row {i} is not valid UTF-8; "
                               "the passage store is corrupt (loaded without verification: its "
                               "checksums refuse it)") from None

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
        ``key`` defaults to :func:`tokenizer_key` (pass it to skip hashing the vocabulary).
        Safe when several threads or processes ask for the same new key at once.

        Raises:
            StorageError: the stored copy is corrupt or does not match the store.
        """
        key = key or tokenizer_key(tokenizer)
        if key in self._tokenized:
            return self._tokenized[key]
        root = self.root / "tokens" / key
        if not (root / MANIFEST).exists():
            self._build_tokenized(root, key, tokenizer, progress, batch_size)
        manifest = read_manifest(root, TOKENS_KIND, verify=False)
        tok = TokenizedPassages(root, RaggedArray.load(root, "titles", np.int32),
                                RaggedArray.load(root, "texts", np.int32), manifest)
        if len(tok) != len(self):
            raise StorageError(f"tokenized passages {str(root)!r} have {len(tok)} rows, the store {len(self)}")
        self._tokenized[key] = tok
        return tok

    def _build_tokenized(self, root: Path, key: str, tokenizer, progress: bool, batch_size: int) -> None:
        """Tokenise into a private temporary directory, then publish it at ``root`` with one
        rename. Safe between threads and processes: if another writer published ``root``
        first, ours is discarded and theirs is used, so no reader ever sees a partial one.

        Raises:
            OSError: ``root`` cannot be written.
        """
        root.parent.mkdir(parents=True, exist_ok=True)
        with private_folder(root.parent, key) as tmp:
            titles = RaggedWriter(tmp, "titles", np.int32)
            texts = RaggedWriter(tmp, "texts", np.int32)
            try:
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
            finally:
                titles.close()
                texts.close()
            files = RaggedArray.files("titles") + RaggedArray.files("texts")
            write_manifest(tmp / MANIFEST, {
                "kind": TOKENS_KIND, "format": FORMAT, "count": len(self), "tokenizer": key,
                "name_or_path": str(tokenizer.name_or_path), "files": describe_files(tmp, files),
            })
            for attempt in range(2):
                try:
                    os.rename(tmp, root)  # atomic; fails if root exists and is not empty
                    return
                except OSError:
                    if (root / MANIFEST).exists():
                        return  # another thread or process published first: use theirs
                    if attempt or not root.exists():
                        raise
                    # a directory without a manifest is nobody's finished work: move it aside
                    trash = root.parent / f".{key}.trash-{os.getpid()}-{secrets.token_hex(4)}"
                    with contextlib.suppress(OSError):
                        os.rename(root, trash)
                    shutil.rmtree(trash, ignore_errors=True)


def _as_passage(item: Passage | dict | tuple, row: int) -> tuple[Passage, bool]:
    """``item`` (passage ``row``) as a store keeps it: whitespace runs made one space, title
    and text cut to ``MAX_TEXT_CHARS`` characters; and whether either was cut."""
    if isinstance(item, Passage):
        pid, title, text = item.id, item.title, item.text
    elif isinstance(item, dict) and "text" in item:
        pid, title, text = str(item.get("id", row)), item.get("title"), item["text"]
    elif isinstance(item, tuple) and len(item) == 3:
        pid, title, text = str(item[0]), item[1], item[2]
    else:
        raise ValueError(
            f"passages[{row}] must be a Passage, a dict with 'text' (and 'id', 'title') or an "
            f"(id, title, text) tuple, got {type(item).__name__}"
        )
    (title, title_cut), (text, text_cut) = _clean(title), _clean(text)
    return Passage(pid, title, text), title_cut or text_cut
