"""Line-numbered reading of the text files users hand us (datasets, questions, passages):
UTF-8 with a leading BOM dropped, errors naming the file and the line."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

_BOM = b"\xef\xbb\xbf"


def decoded_lines(path: str | Path, error: type[Exception] = ValueError) -> Iterator[tuple[int, str]]:
    """``(line number from 1, line with its ending)`` of a UTF-8 file; a BOM at the start is
    dropped.

    Raises:
        error: bytes that are not UTF-8, naming the file, line and column.
    """
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            if number == 1 and raw.startswith(_BOM):
                raw = raw[len(_BOM):]
            try:
                yield number, raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise error(
                    f"{path}:{number}: not valid UTF-8 (byte 0x{raw[e.start]:02x} at column "
                    f"{e.start + 1}); expected a UTF-8 text file"
                ) from None


def json_type(value: object) -> str:
    """The JSON-ish name of a value's type for messages (``null`` for None)."""
    return "null" if value is None else type(value).__name__


def read_objects(path: str | Path, error: type[Exception] = ValueError) -> Iterator[tuple[int, str, dict]]:
    """``(line number from 1, "path:line", object)`` for each non-blank line of ``path``.

    Raises:
        error: bytes that are not UTF-8, a line that is not JSON, or not a JSON object, naming
            the file and the line.
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
        if not isinstance(obj, dict):
            raise error(f"{where}: expected a JSON object, got {json_type(obj)}")
        yield number, where, obj
