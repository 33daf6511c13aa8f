"""Line-numbered reading of the JSONL files users hand us (datasets, questions, passages)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator


def read_objects(path: str | Path, error: type[Exception] = ValueError) -> Iterator[tuple[int, str, dict]]:
    """``(line number from 1, "path:line", object)`` for each non-blank line of ``path``.

    Raises:
        error: a line that is not JSON, or not a JSON object, naming the file and the line.
    """
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise error(f"{where}: malformed JSON line ({e.msg} at column {e.colno})") from None
            if not isinstance(obj, dict):
                raise error(f"{where}: expected a JSON object, got {type(obj).__name__}")
            yield number, where, obj
