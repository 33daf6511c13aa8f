"""Line-numbered reading of the text files users hand us (datasets, questions, passages):
UTF-8 with a leading BOM dropped, errors naming the file and the line; and the bounds on what
one line may cost (:data:`MAX_LINE_BYTES`, :data:`MAX_TEXT_CHARS`)."""
from __future__ import annotations

import json
import os
import re
import stat
import warnings
from pathlib import Path
from typing import Iterator

# A line longer than this (its bytes before the "\n") is refused, naming the file and the line,
# after reading no more than this much of it: whatever a file holds, one line costs at most its
# bytes, its decoded text and what JSON makes of it, a few hundred MiB. 64 MiB is far more than
# a passage, a question or a line of a document needs (their texts are cut to MAX_TEXT_CHARS).
MAX_LINE_BYTES = 64 << 20

# Tokenizers tokenise a whole text before truncating it, at about 150 bytes of memory per
# character: a 20 MB passage took about 3 GB and 30 s to keep its first 256 tokens, and a
# 200 MB one asks for allocations of several GiB at once, which abort the process. So every
# text read (a passage's title and text, a question, an answer, a label) is cut to its first
# MAX_TEXT_CHARS characters before a tokenizer sees it. The bound is generous enough never to
# change the tokens a model keeps:
#   MAX_TEXT_TOKENS: more tokens than a model keeps of one text (an encoder's --max-length is
#     at most its positions: 512 for BERT-family encoders, 8192 for the longest; BART has 1024
#     positions, and a decoder-only generator shares its own among a prompt's passages);
#   MAX_CHARS_PER_TOKEN: more characters than a token covers in text whose whitespace runs are
#     one space (vocabulary entries are words and pieces of words: the longest of MiniLM's
#     WordPiece has 18 characters, of the example's byte-level BPE 16; English averages 4 to 5
#     characters a token, so the first 1 Mi characters hold over 200,000 tokens).
# At `index build`'s default of 256 tokens, the cut changes the tokens kept only for a text
# averaging more than 4,096 characters a token.
MAX_TEXT_TOKENS = 32768
MAX_CHARS_PER_TOKEN = 32
MAX_TEXT_CHARS = MAX_TEXT_TOKENS * MAX_CHARS_PER_TOKEN  # 1 Mi characters

_BOM = b"\xef\xbb\xbf"
_UTF16_BOMS = (b"\xff\xfe", b"\xfe\xff")
# after json.loads a surrogate pair is one character: what is left in this range is alone
_SURROGATE = re.compile("[\ud800-\udfff]")


def line_too_long(path: str | Path, number: int) -> str:
    """The message refusing line ``number`` of ``path``, longer than :data:`MAX_LINE_BYTES`."""
    return (f"{path}:{number}: a line longer than {MAX_LINE_BYTES:,} bytes (64 MiB), the most one "
            "line may hold; refused without reading the rest of it (expected one passage, "
            "question or example per line; rag_fast._jsonl.MAX_LINE_BYTES)")


def _raw_lines(f, path: str | Path, error: type[Exception]) -> Iterator[bytes]:
    """The lines of the binary file ``f`` (with their ``\\n``), each read in one bounded call.

    Raises:
        error: a line longer than :data:`MAX_LINE_BYTES` (not counting its ``\\n``), as soon as
            its first ``MAX_LINE_BYTES + 1`` bytes are read.
    """
    number = 0
    while raw := f.readline(MAX_LINE_BYTES + 1):
        number += 1
        if len(raw) > MAX_LINE_BYTES and not raw.endswith(b"\n"):
            raise error(line_too_long(path, number))
        yield raw


def decoded_lines(path: str | Path, error: type[Exception] = ValueError) -> Iterator[tuple[int, str]]:
    """``(line number from 1, line with its ending)`` of a UTF-8 file; a BOM at the start is
    dropped. Lines end at ``\\n`` only, and hold at most :data:`MAX_LINE_BYTES` bytes before it.

    Raises:
        error: bytes that are not UTF-8 (naming the file, line, column and byte offset, and a
            UTF-16 byte order mark if the file starts with one), or a NUL byte (text saved as
            UTF-16 without a byte order mark reads as UTF-8 with a NUL after each letter), or
            a line longer than :data:`MAX_LINE_BYTES` (read no further than that).
    """
    offset = 0  # bytes of the file before this line
    with open(path, "rb") as f:
        for number, raw in enumerate(_raw_lines(f, path, error), start=1):
            start = offset
            offset += len(raw)
            if number == 1 and raw.startswith(_BOM):
                raw, start = raw[len(_BOM):], start + len(_BOM)
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                hint = ("; the file starts with a UTF-16 byte order mark: save it as UTF-8"
                        if number == 1 and raw.startswith(_UTF16_BOMS) else "")
                raise error(
                    f"{path}:{number}: not valid UTF-8 (byte 0x{raw[e.start]:02x} at column "
                    f"{e.start + 1}, byte offset {start + e.start} of the file); expected a UTF-8 "
                    f"text file{hint}"
                ) from None
            nul = text.find("\0")
            if nul >= 0:
                raise error(
                    f"{path}:{number}: a NUL character at column {nul + 1}; expected a UTF-8 text "
                    "file (a file saved as UTF-16 has a NUL beside each ASCII letter)"
                )
            yield number, text


_NOT_FILES = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a named pipe"),
              (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
              (stat.S_ISSOCK, "a socket"))


def check_regular_file(path: str | os.PathLike, name: str,
                       expected: str = "a file to read") -> None:
    """Refuse ``path`` unless it is a regular file or a symbolic link to one, before anything
    opens it: a device is read forever (/dev/zero) or as empty (/dev/null), and opening a named
    pipe waits for a writer.

    Raises:
        FileNotFoundError: ``"{name}: '{path}' does not exist (expected ...)"``.
        ValueError: ``"{name}: '{path}' is a named pipe, not a regular file; expected ..."``
            (a device, a folder or a socket likewise; a symbolic link names its target).
    """
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise FileNotFoundError(f"{name}: {os.fspath(path)!r} does not exist (expected "
                                f"{expected})") from None
    if stat.S_ISREG(mode):
        return
    what = next((kind for test, kind in _NOT_FILES if test(mode)), "not a file")
    link = f" (a symbolic link to {os.path.realpath(path)})" if os.path.islink(path) else ""
    raise ValueError(f"{name}: {os.fspath(path)!r} is {what}{link}, not a regular file; "
                     f"expected {expected}")


class TextCutWarning(UserWarning):
    """Texts of a file longer than :data:`MAX_TEXT_CHARS` were cut (said once per file)."""


def cut_text(text: str) -> tuple[str, bool]:
    """``text``'s first :data:`MAX_TEXT_CHARS` characters, and whether that left any out."""
    return (text, False) if len(text) <= MAX_TEXT_CHARS else (text[:MAX_TEXT_CHARS], True)


def warn_cut(where: str | os.PathLike, count: int, noun: str) -> None:
    """Say once for the file ``where`` how many of its passages or examples (``noun``) held a
    text cut to :data:`MAX_TEXT_CHARS` characters: ``count``, nothing when it is 0."""
    if count:
        warnings.warn(
            f"{os.fspath(where)}: cut {count:,} {noun}{'' if count == 1 else 's'} longer than "
            f"{MAX_TEXT_CHARS:,} characters to their first {MAX_TEXT_CHARS:,} (no model keeps "
            "more of one text; rag_fast._jsonl.MAX_TEXT_CHARS)", TextCutWarning, stacklevel=2)


def cut_texts(texts: list[str], where: str | os.PathLike, noun: str) -> list[str]:
    """``texts`` each cut to :data:`MAX_TEXT_CHARS` characters, the cut ones said once for the
    file ``where`` (:func:`warn_cut`, ``noun`` naming them: ``"question"``)."""
    out = [cut_text(t) for t in texts]
    warn_cut(where, sum(cut for _, cut in out), noun)
    return [t for t, _ in out]


def json_type(value: object) -> str:
    """The JSON-ish name of a value's type for messages (``null`` for None)."""
    return "null" if value is None else type(value).__name__


# the fields naming a question's gold passages, the first present read (``index eval``'s data,
# ``index build --queries``): a passage id or a list of them; DPR's list of passage objects
GOLD_FIELDS = ("positive_ids", "gold", "passage_id", "positive_ctxs")


def gold_ids(obj: dict, where: str, error: type[ValueError] = ValueError) -> tuple[str, ...] | None:
    """The gold passage ids of a JSON line (its first field of :data:`GOLD_FIELDS`), as
    strings; None when it has none (or an empty list).

    Raises:
        ``error``: naming ``where`` and the field, for a value that is not a passage id (a
            string or an integer), a list of them, or DPR's list of passage objects.
    """
    name = next((f for f in GOLD_FIELDS if f in obj), None)
    if name is None:
        return None
    value = obj[name]
    if name == "positive_ctxs":
        expected = "a list of objects with a 'passage_id' (or 'id'), a string or an integer"
        if not isinstance(value, list):
            raise error(f"{where}: 'positive_ctxs' must be {expected}, got {json_type(value)}")
        ids = []
        for i, ctx in enumerate(value):
            pid = ctx.get("passage_id", ctx.get("id")) if isinstance(ctx, dict) else None
            if isinstance(pid, bool) or not isinstance(pid, (str, int)):
                raise error(f"{where}: 'positive_ctxs'[{i}] must be an object with a "
                            "'passage_id' (or 'id'), a string or an integer")
            ids.append(pid)
    else:
        ids = value if isinstance(value, list) else [value]
        if any(isinstance(i, bool) or not isinstance(i, (str, int)) for i in ids):
            raise error(f"{where}: {name!r} must be a passage id (a string or an integer) or a "
                        f"list of them, got {json.dumps(value)[:60]}")
    return tuple(dict.fromkeys(str(i).strip() for i in ids)) or None


def lone_surrogate(value: object, field: str = "") -> tuple[str, int, str] | None:
    """``(field, character index, the surrogate)`` of the first string in ``value`` (a parsed
    JSON value: str, list, dict, number...) holding a lone surrogate, else None.

    ``json.loads`` accepts an escape such as ``"\\ud800"`` that is not half of a pair; the
    string it gives cannot be written as UTF-8 (nor tokenised). ``field`` names ``value`` in
    the result: ``"answers"[1]``, ``"passages"[0]["text"]``, or ``a key of ...`` for a key.
    """
    stack = [(field, value)]
    while stack:
        name, item = stack.pop()
        if isinstance(item, str):
            found = _SURROGATE.search(item)
            if found:
                return name, found.start(), found.group()
        elif isinstance(item, dict):
            for key, v in reversed(list(item.items())):
                stack.append((f"{name}[{json.dumps(key)}]" if name else json.dumps(key), v))
                stack.append((f"a key of {name or 'the object'}", key))
        elif isinstance(item, list):
            stack.extend((f"{name}[{i}]", v) for i, v in reversed(list(enumerate(item))))
    return None


def check_unicode(value: object, where: str, field: str,
                  error: type[Exception] = ValueError) -> None:
    """Refuse a lone surrogate anywhere in ``value`` (see :func:`lone_surrogate`).

    Raises:
        error: ``"{where}: {field} is not valid Unicode ..."``, naming the character.
    """
    found = lone_surrogate(value, field)
    if found is not None:
        name, index, char = found
        raise error(
            f"{where}: {name} is not valid Unicode: a lone surrogate \\u{ord(char):04x} at "
            f"character {index + 1} (a JSON escape \\ud800-\\udbff must be followed by one "
            "of \\udc00-\\udfff, the pair making one character)"
        )


def read_objects(path: str | Path, error: type[Exception] = ValueError) -> Iterator[tuple[int, str, dict]]:
    """``(line number from 1, "path:line", object)`` for each non-blank line of ``path``.

    Raises:
        error: bytes that are not UTF-8, a line that is not JSON, or not a JSON object, or a
            string in it that is not valid Unicode (a lone surrogate), naming the file and the
            line (and the field).
    """
    for number, line in decoded_lines(path, error):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            # without its terminator: an error at the line's end is just past its last character
            obj = json.loads(line.rstrip("\r\n"))
        except json.JSONDecodeError as e:
            msg = e.msg[:-3] if e.msg.endswith(" at") else e.msg  # json's own "... at" messages
            raise error(f"{where}: malformed JSON line ({msg} at column {e.colno})") from None
        except RecursionError:
            raise error(f"{where}: malformed JSON line (nested too deeply to read)") from None
        except ValueError as e:  # a number too long for Python's int conversion
            raise error(f"{where}: malformed JSON line ({str(e).split(';')[0]})") from None
        if not isinstance(obj, dict):
            raise error(f"{where}: expected a JSON object, got {json_type(obj)}")
        if "\\u" in line:  # a lone surrogate comes only from an escape
            check_unicode(obj, where, "", error)
        yield number, where, obj
