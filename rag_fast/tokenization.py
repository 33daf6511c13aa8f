"""A generator tokenizer fitted to a corpus, whose decoding gives back the text it encoded.

    fit_tokenizer(texts, vocab_size=4000)                        a tokenizer, in memory
    fit_tokenizer_folder("passages.jsonl", "tok/", vocab_size=4000, data=["train.jsonl"])

What ``rag-fast tokenizer fit`` runs. The tokenizer is a byte-level BPE (GPT-2's and BART's
kind, fitted with the ``tokenizers`` library): text is cut into words and runs of digits,
punctuation and spaces (a word keeps the space before it), every byte is a symbol, and the
most frequent pairs are merged until ``vocab_size`` tokens. Nothing normalises the text (no
lower-casing, no accent stripping, no space added in front), and any byte sequence is some
sequence of tokens, so ``decode(encode(text)) == text`` for every string: an answer such as
"3.7.15", "Saint-Étienne" or "[a]/b" comes back from the generator as it was written, which
exact match needs. (A WordPiece tokenizer with BERT's normaliser decodes those as
"3. 7. 15" and "saint - etienne" and has no token for "[", "]" or "/".)

The special tokens are BART's, at the ids BART's configuration expects: ``<s>`` 0 (start:
bos, cls), ``<pad>`` 1, ``</s>`` 2 (end: eos, sep), ``<unk>`` 3 (never produced: every byte
has a token), ``<mask>`` 4. A context is encoded as ``<s> text </s>``. ``rag-fast init
--generator CONFIG.json --generator-tokenizer DIR`` takes the vocabulary size and the pad /
bos / eos ids from the tokenizer. Text that spells a special token ("<s>") is encoded as text,
not as that token, so it survives too.

The folder is what ``transformers.AutoTokenizer.from_pretrained`` opens
(``tokenizer.json``, ``tokenizer_config.json``, ``special_tokens_map.json``), written
atomically and marked as rag_fast's (``rag_fast-output.json``, kind ``rag_fast.tokenizer``,
with the size and SHA-256 of each file and what it was fitted on): it is replaced only with
``overwrite`` and only when it is such a folder (:func:`rag_fast.storage.check_output_folder`).
A full disk is one :class:`~rag_fast.storage.NoSpaceError` naming the file and the bytes it
needs, and leaves nothing at the folder's path.

What a fit reads costs bounded memory: every text fitted on (a passage's title and text, a
question, an answer, a label) is at most ``MAX_TEXT_CHARS`` characters (1 Mi,
``rag_fast._jsonl``): the passage and QA readers cut longer ones as they read them, saying so
once per file, and :func:`fit_tokenizer` cuts what it is given likewise (the fit counts
pairs over the whole corpus: the rest of one text longer than that moves few counts). A line
longer than ``MAX_LINE_BYTES`` (64 MiB) is refused, naming the file and the line, and inputs
are regular files: a device or a named pipe is refused before it is opened.
"""
from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

from rag_fast._defaults import MAX_VOCAB_SIZE, MIN_VOCAB_SIZE
from rag_fast._jsonl import MAX_TEXT_CHARS, check_regular_file
from rag_fast.evaluation.data import load_qa
from rag_fast.retrieval.passages import passage_files, read_passages
from rag_fast.storage import (
    OUTPUT_MARKER,
    TOKENIZER_KIND,
    NoSpaceError,
    StorageError,
    atomic_directory,
    atomic_write_bytes,
    check_apart,
    check_files_entry,
    check_output_folder,
    describe_files,
    disk_errors,
    read_json_file,
    reserve_space,
    sha256_file,
)

# (token, role) in id order: BART's ids for start, padding and end
SPECIAL_TOKENS = (("<s>", "bos"), ("<pad>", "pad"), ("</s>", "eos"), ("<unk>", "unk"),
                  ("<mask>", "mask"))
BYTES = 256  # the byte-level alphabet: one token per byte value
# MIN_VOCAB_SIZE (rag_fast._defaults, where the command's parser reads it) is BYTES + the special
# tokens; MAX_VOCAB_SIZE is 4x the largest vocabularies in use (about 256k tokens): the
# tokenizers library sets aside memory for every token asked for before it reads a text (70 GB
# for 10**9, then an abort)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def check_vocab_size(vocab_size: object, name: str = "vocab_size") -> int:
    """``vocab_size`` as an int of at least :data:`MIN_VOCAB_SIZE` (the 256 bytes and the 5
    special tokens) and at most :data:`MAX_VOCAB_SIZE`, else a ValueError naming ``name``."""
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int):
        raise ValueError(f"{name} must be an int, got {vocab_size!r}")
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"{name} must be at least {MIN_VOCAB_SIZE} (one token per byte value "
                         f"and {len(SPECIAL_TOKENS)} special tokens), got {vocab_size}")
    if vocab_size > MAX_VOCAB_SIZE:
        raise ValueError(f"{name} must be at most {MAX_VOCAB_SIZE:,} (four times the largest "
                         f"vocabularies in use; the fit sets memory aside for every token asked "
                         f"for), got {vocab_size:,}")
    return vocab_size


def special_tokens_map() -> dict[str, str]:
    """The special tokens by ``transformers``' names (``bos_token``, ``cls_token``, ...)."""
    roles = {role: token for token, role in SPECIAL_TOKENS}
    return {"bos_token": roles["bos"], "cls_token": roles["bos"], "eos_token": roles["eos"],
            "sep_token": roles["eos"], "pad_token": roles["pad"], "unk_token": roles["unk"],
            "mask_token": roles["mask"]}


def fit_tokenizer(texts: Iterable[str], vocab_size: int, *, progress: bool = False) -> Any:
    """A byte-level BPE tokenizer (``transformers.PreTrainedTokenizerFast``) of at most
    ``vocab_size`` tokens fitted to ``texts`` (see the module docstring); fewer when the texts
    allow no more merges. The same texts in the same order give the same tokenizer. Each text
    is fitted on by its first ``MAX_TEXT_CHARS`` characters (1 Mi): the library tokenises a
    whole text at once, so a longer one would cost memory in proportion to its length.
    ``progress``: the ``tokenizers`` library's progress bars, where stderr is a terminal.

    Raises:
        ValueError: ``vocab_size`` below :data:`MIN_VOCAB_SIZE` or not an int; whatever
            ``texts`` raises while it is read.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    check_vocab_size(vocab_size)
    tok = Tokenizer(models.BPE())  # no unknown token: every byte is in the alphabet
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size,
                                  special_tokens=[t for t, _ in SPECIAL_TOKENS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  # (its bars print blank lines where stderr is no terminal)
                                  show_progress=progress and sys.stderr.isatty())
    tok.train_from_iterator((text[:MAX_TEXT_CHARS] for text in texts), trainer)
    for i, (token, _) in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(token) == i, (token, tok.token_to_id(token))
    bos, eos = SPECIAL_TOKENS[0][0], SPECIAL_TOKENS[2][0]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A {eos}", pair=f"{bos} $A {eos} {eos} $B {eos}",
        special_tokens=[(bos, 0), (eos, 2)])
    tok.encode_special_tokens = True  # "<s>" in a text is that text, not the start token
    return PreTrainedTokenizerFast(tokenizer_object=tok, clean_up_tokenization_spaces=False,
                                   split_special_tokens=True, **special_tokens_map())


@dataclass(frozen=True)
class FitSummary:
    """What :func:`fit_tokenizer_folder` fitted: the folder, its tokens, and its sources."""

    out: Path
    vocab_size: int
    passages: int
    questions: int
    characters: int

    def line(self) -> str:
        """One line for the command line."""
        qa = f" and {self.questions:,} questions with their answers" if self.questions else ""
        return (f"fitted a byte-level BPE tokenizer of {self.vocab_size:,} tokens on "
                f"{self.passages:,} passages{qa} ({self.characters:,} characters) -> {self.out}")


def _read_data(data: Sequence[str | os.PathLike]) -> tuple[list[str], int]:
    """The questions, answers and labels of every example of the QA files ``data`` (read, and
    so checked, before the passages), and the number of examples. Every file is checked to be
    a regular file before any is read."""
    for path in data:
        check_regular_file(path, "data", "a QA file: JSONL lines with 'question' and "
                                         "'answers', or TSV")
    texts, examples = [], 0
    for path in data:
        for e in load_qa(os.fspath(path)):
            texts += [e.question, *e.answers] + ([e.label] if e.label is not None else [])
            examples += 1
    return texts, examples


def save_tokenizer(tokenizer: Any, folder: str | os.PathLike, record: dict | None = None, *,
                   shown: str | os.PathLike | None = None) -> None:
    """Write ``tokenizer`` (from :func:`fit_tokenizer`) into the folder ``folder`` as
    ``transformers`` reads it, and mark the folder as rag_fast's tokenizer (``record``: what
    it was fitted on, kept in the marker). Used inside :func:`fit_tokenizer_folder`'s atomic
    folder; on its own it writes each file atomically.

    ``tokenizer_config.json`` names the class ``PreTrainedTokenizerFast``, which every
    ``transformers`` from 4.40 on opens, and ``special_tokens_map.json`` is written for those
    that read the special tokens from it.

    Raises:
        NoSpaceError: the disk is full, naming the file in ``shown`` (the folder named in
            messages, default ``folder``: the final path of a temporary folder) and, for
            ``tokenizer.json`` (all but a few KiB of the folder, allocated before anything is
            written) and the files written here, the bytes it needs.
    """
    folder = Path(folder)
    shown = Path(shown) if shown is not None else folder
    folder.mkdir(parents=True, exist_ok=True)
    # the tokenizers library's error on a full disk names neither the file nor the size
    _reserve(folder / "tokenizer.json", shown / "tokenizer.json",
             len(tokenizer.backend_tokenizer.to_str(pretty=True).encode("utf-8")))
    with disk_errors(shown):
        tokenizer.save_pretrained(str(folder))
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config["clean_up_tokenization_spaces"] = False
    config["split_special_tokens"] = True
    _write(folder, shown, "tokenizer_config.json", _json_bytes(config))
    _write(folder, shown, "special_tokens_map.json", _json_bytes(special_tokens_map()))
    # every file save_pretrained wrote (a transformers that writes more than TOKENIZER_FILES
    # included) is listed, so that only this folder's own files count as rag_fast's
    names = sorted(p.name for p in folder.iterdir() if p.name != OUTPUT_MARKER)
    marker = {"kind": TOKENIZER_KIND, "format": 1, **(record or {}),
              "files": describe_files(folder, names)}
    _write(folder, shown, OUTPUT_MARKER, _json_bytes(marker))


def verify_tokenizer_folder(folder: str | os.PathLike, what: str) -> bool:
    """When ``folder`` is one ``tokenizer fit`` wrote (its marker names the kind), check every
    file its marker lists against the size and SHA-256 recorded: a hand edit is refused before
    ``transformers`` reads it. Returns whether the folder was such a folder (False: not ours,
    nothing checked).

    Raises:
        StorageError: naming ``what``, the folder and the first file that differs.
    """
    marker = Path(folder) / OUTPUT_MARKER
    if not Path(folder).is_dir() or not os.path.lexists(marker):
        return False
    try:
        record = read_json_file(marker)
    except (OSError, ValueError) as exc:
        raise StorageError(f"{what} {os.fspath(folder)!r}: {exc}") from None
    if not isinstance(record, dict) or record.get("kind") != TOKENIZER_KIND:
        return False
    listed = check_files_entry(marker, record.get("files"), Path(folder))
    unlisted = sorted(p.name for p in Path(folder).iterdir()
                      if p.name != OUTPUT_MARKER and p.name not in listed)
    if unlisted:  # transformers reads some files by name when present (added_tokens.json)
        raise StorageError(
            f"{what} {os.fspath(folder)!r} holds {unlisted[0]!r}"
            f"{f' and {len(unlisted) - 1} more' if len(unlisted) > 1 else ''}, which "
            f"`rag-fast tokenizer fit` did not write ({OUTPUT_MARKER} does not list it): move "
            "it away, or fit the tokenizer again")
    for name, meta in listed.items():
        path = Path(folder) / name
        if not path.is_file() or path.stat().st_size != meta["bytes"] \
                or sha256_file(path) != meta["sha256"]:
            raise StorageError(
                f"{what} {os.fspath(folder)!r}: {name} is missing or differs from what "
                f"`rag-fast tokenizer fit` wrote (size and SHA-256 in {OUTPUT_MARKER}): edited "
                "or damaged; fit it again")
    return True


def _reserve(path: Path, shown: Path, nbytes: int) -> None:
    """Allocate ``nbytes`` for the file ``path`` (``shown`` in messages), which is written in
    full next: a disk without room says so now (:func:`rag_fast.storage.reserve_space`)."""
    with disk_errors(shown):  # no inode left for the file: said as a full disk, naming shown
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
    try:
        reserve_space(fd, shown, nbytes)
    finally:
        os.close(fd)


def _write(folder: Path, shown: Path, name: str, data: bytes) -> None:
    """``data`` written atomically as ``folder/name``; a full disk names ``shown/name`` and
    the bytes it needs."""
    try:
        atomic_write_bytes(folder / name, data)
    except NoSpaceError as e:
        raise NoSpaceError(shown / name, len(data), e.free, e.errno) from None


def _json_bytes(payload: dict) -> bytes:
    return (json.dumps(payload, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode("utf-8")


def fit_tokenizer_folder(passages: str | os.PathLike, out: str | os.PathLike, *,
                         vocab_size: int, data: Sequence[str | os.PathLike] = (),
                         overwrite: bool = False, dedupe: bool = False,
                         progress: bool = False) -> FitSummary:
    """Fit :func:`fit_tokenizer` on the titles and texts of ``passages`` (a file or folder as
    ``rag-fast index build`` reads it: :func:`rag_fast.retrieval.passages.read_passages`) and
    the questions and answers of the QA files ``data``, and save it as the folder ``out``.

    Everything is checked before the fit: ``vocab_size``, ``out`` (missing, empty, or with
    ``overwrite`` a tokenizer folder of this function's holding nothing else; never one of the
    inputs), that ``passages`` and every ``data`` file are regular files, and every ``data``
    file in full.

    Raises:
        ValueError: a bad ``vocab_size``; ``out`` overlapping an input; a ``passages`` or
            ``data`` path that is a device, a named pipe or (``data``) a folder (the message
            starts with ``passages:`` or ``data:``); a malformed passages or QA file (naming
            it and the line); passages and QA files without any text.
        FileNotFoundError: a missing ``passages`` or ``data`` file (the message starts with
            ``passages:`` or ``data:``).
        FileExistsError: ``out`` exists and may not be replaced.
        NoSpaceError: the disk is full (nothing is left at ``out``).
    """
    check_vocab_size(vocab_size)
    data = list(data)
    inputs = {"passages": passages, **{f"data[{i}]": d for i, d in enumerate(data)}}
    check_apart(out, "out", inputs)
    check_output_folder(out, TOKENIZER_KIND, overwrite=overwrite, flag="out")
    passage_files(passages)
    qa_texts, questions = _read_data(data)
    counts = {"passages": 0, "characters": 0}

    def texts() -> Iterator[str]:
        for p in read_passages(passages, dedupe=dedupe):
            counts["passages"] += 1
            for text in (p.title, p.text):
                if text:
                    counts["characters"] += len(text)
                    yield text
        for text in qa_texts:
            if text:
                counts["characters"] += len(text)
                yield text

    tokenizer = fit_tokenizer(texts(), vocab_size, progress=progress)
    if counts["characters"] == 0:
        raise ValueError(f"passages {os.fspath(passages)!r}"
                         + (" and the data files" if data else "")
                         + " hold no text to fit a tokenizer on")
    record = {"vocab_size": len(tokenizer), "requested_vocab_size": vocab_size,
              "passages": os.fspath(passages), "data": [os.fspath(d) for d in data],
              "method": "byte-level BPE (tokenizers), rag_fast.tokenization.fit_tokenizer"}
    with atomic_directory(out, overwrite=overwrite, kind=TOKENIZER_KIND) as tmp:
        save_tokenizer(tokenizer, tmp, record, shown=out)
    return FitSummary(Path(out), len(tokenizer), counts["passages"], questions,
                      counts["characters"])
