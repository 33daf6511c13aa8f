"""Line-numbered reading of the text files users hand us (datasets, questions, passages):
UTF-8 with a leading BOM dropped, errors naming the file and the line."""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Iterator

_BOM = b"\xef\xbb\xbf"
_UTF16_BOMS = (b"\xff\xfe", b"\xfe\xff")
# after json.loads a surrogate pair is one character: what is left in this range is alone
_SURROGATE = re.compile("[\ud800-\udfff]")


def decoded_lines(path: str | Path, error: type[Exception] = ValueError) -> Iterator[tuple[int, str]]:
    """``(line number from 1, line with its ending)`` of a UTF-8 file; a BOM at the start is
    dropped. Lines end at ``\\n`` only.

    Raises:
        error: bytes that are not UTF-8 (naming the file, line, column and byte offset, and a
            UTF-16 byte order mark if the file starts with one), or a NUL byte (text saved as
            UTF-16 without a byte order mark reads as UTF-8 with a NUL after each letter).
    """
    offset = 0  # bytes of the file before this line
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
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


def json_type(value: object) -> str:
    """The JSON-ish name of a value's type for messages (``null`` for None)."""
    return "null" if value is None else type(value).__name__


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
