"""Question-answer datasets from JSONL or TSV files.

JSONL: one object per line with ``question`` (str) and ``answers`` (list of str, or one str;
``answer`` is accepted too), optionally ``label``; blank lines are skipped.
TSV: ``question<TAB>answers`` where answers is a JSON list (as DPR's NQ files) or the remaining
columns, one answer each; a first non-blank line ``question<TAB>answers...`` is a header and
skipped.

Both are UTF-8 (a BOM at the start is dropped). Errors name the file and the line: bytes that
are not UTF-8, a malformed line, a line longer than ``MAX_LINE_BYTES`` (64 MiB), a missing
field, a string that is not valid Unicode (a lone surrogate from a JSON escape), an empty
dataset. A question, answer or label longer than ``MAX_TEXT_CHARS`` (1 Mi characters, more
than any model keeps) is cut to it as its line is read, said once per file
(``rag_fast._jsonl``).
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Iterator

from rag_fast._jsonl import check_unicode, cut_text, decoded_lines, read_objects, warn_cut


@dataclass(frozen=True)
class QAExample:
    question: str
    answers: tuple[str, ...]
    label: str | None = None
    extra: dict = field(default_factory=dict, compare=False)
    source: str | None = field(default=None, compare=False)  # the field the answers came from

    @property
    def target(self) -> str:
        """The text a model is trained to produce: the label if any, else the first answer."""
        return self.label if self.label is not None else self.answers[0]


class DatasetError(ValueError):
    """A dataset file that cannot be read as questions and answers."""


def read_answers(value, where: str) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value or not all(isinstance(a, str) for a in value):
        raise DatasetError(f"{where}: 'answers' must be a string or a non-empty list of strings")
    return tuple(value)


def _cut(example: QAExample) -> tuple[QAExample, bool]:
    """``example`` with its question, answers and label cut to ``MAX_TEXT_CHARS`` characters,
    and whether any was cut."""
    (question, cut), answers = cut_text(example.question), []
    for answer in example.answers:
        answer, answer_cut = cut_text(answer)
        answers.append(answer)
        cut |= answer_cut
    label = example.label
    if label is not None:
        label, label_cut = cut_text(label)
        cut |= label_cut
    if not cut:
        return example, False
    return dataclasses.replace(example, question=question, answers=tuple(answers),
                               label=label), True


QUESTION_FIELDS = ("question",)
ANSWER_FIELDS = ("answers", "answer", "label")  # the first present is the answers' source
# keys that hold a question or answers under another name, and the field each was meant to be
_MEANT = {"query": "question", "q": "question", "questions": "question", "prompt": "question",
          "input": "question", "answer_text": "answers", "answers_text": "answers",
          "gold_answers": "answers", "target": "answers", "targets": "answers",
          "output": "answers", "ans": "answers", "labels": "label"}


def _did_you_mean(obj: dict, wanted: tuple[str, ...]) -> str:
    """`` ('query': did you mean 'question'?)`` for the keys of ``obj`` that look like one of
    ``wanted``, else ""."""
    import difflib

    hints = []
    for key in obj:
        meant = _MEANT.get(key.lower()) or next(
            iter(difflib.get_close_matches(key.lower(), wanted, n=1, cutoff=0.75)), None)
        if meant in wanted and key not in wanted:
            hints.append(f"{key!r}: did you mean {meant!r}?")
    return f" ({'; '.join(hints)})" if hints else ""


def _from_jsonl(path: str) -> Iterator[QAExample]:
    for _, where, obj in read_objects(path, DatasetError):
        question = obj.get("question")
        if not isinstance(question, str) or not question.strip():
            found = "an empty 'question'" if "question" in obj else "no 'question' field"
            raise DatasetError(f"{where}: {found} (the field read for the question; this line "
                               f"has {sorted(obj)}){_did_you_mean(obj, QUESTION_FIELDS)}")
        source = next((f for f in ANSWER_FIELDS if obj.get(f) is not None), None)
        if source is None:
            raise DatasetError(f"{where}: no answers: looked for "
                               f"{', '.join(repr(f) for f in ANSWER_FIELDS)} (this line has "
                               f"{sorted(obj)}){_did_you_mean(obj, ANSWER_FIELDS)}")
        raw = obj.get("answers", obj.get("answer"))
        label = obj.get("label")
        answers = read_answers(raw if raw is not None else str(label), where)
        extra = {k: v for k, v in obj.items() if k not in ("question", "answers", "answer", "label")}
        yield QAExample(question, answers, None if label is None else str(label), extra, source)


def fields_read(path: str, examples: list[QAExample]) -> str:
    """One line saying what ``load_qa`` read: ``PATH: 60 examples (answers from 'answers')``
    (a TSV file: its two columns)."""
    counts: dict[str, int] = {}
    for e in examples:
        counts[e.source or "the answers column"] = counts.get(e.source or "the answers column",
                                                              0) + 1
    sources = ", ".join(name if name.startswith("the ") else f"{name!r}" +
                        (f" ({n})" if len(counts) > 1 else "") for name, n in counts.items())
    return f"{path}: {len(examples)} examples (answers from {sources})"


def _from_tsv(path: str) -> Iterator[QAExample]:
    header_checked = False
    for number, line in decoded_lines(path, DatasetError):
        line = line.rstrip("\n\r")
        if not line.strip():
            continue
        where = f"{path}:{number}"
        if "\r" in line:
            raise DatasetError(f"{where}: a carriage return inside the line (a file with old Mac "
                               "line endings?); expected lines ending in \\n or \\r\\n")
        cols = line.split("\t")
        if not header_checked:
            header_checked = True
            if cols[0].strip().lower() == "question":
                continue
        if len(cols) < 2 or not cols[0].strip():
            raise DatasetError(f"{where}: expected 'question<TAB>answers', got {len(cols)} column(s)")
        if cols[1].lstrip().startswith("["):
            try:
                raw = json.loads(cols[1])
            except json.JSONDecodeError as e:
                raise DatasetError(f"{where}: malformed JSON answer list ({e.msg})") from None
            except RecursionError:
                raise DatasetError(f"{where}: malformed JSON answer list (nested too deeply to "
                                   "read)") from None
            except ValueError as e:  # a number too long for Python's int conversion
                raise DatasetError(f"{where}: malformed JSON answer list "
                                   f"({str(e).split(';')[0]})") from None
            check_unicode(raw, where, '"answers"', DatasetError)
        else:
            raw = [c for c in cols[1:] if c.strip()]
        yield QAExample(cols[0], read_answers(raw, where))


def load_qa(path: str, fmt: str | None = None) -> list[QAExample]:
    """Questions and answers from ``path`` (format from ``fmt`` or the extension: .jsonl/.json
    -> JSONL, .tsv/.txt -> TSV).

    Questions, answers and labels longer than ``MAX_TEXT_CHARS`` characters are cut as each
    line is read (one ``TextCutWarning`` for the file), so no example costs more.

    Raises:
        DatasetError: unreadable format, a malformed line (with its line number), a line
            longer than ``MAX_LINE_BYTES``, bytes that are not UTF-8 or a string that is not
            valid Unicode (file, line and field), no examples, or a directory.
        FileNotFoundError: no such file.
    """
    if os.path.isdir(path):
        raise DatasetError(f"{path}: is a directory; expected a dataset file (.jsonl or .tsv)")
    if not os.path.exists(path):
        raise FileNotFoundError(f"dataset file not found: {path}")
    if not os.path.isfile(path):  # a device or a pipe: /dev/zero would be read forever
        raise DatasetError(f"{path}: is not a regular file (a device or a pipe?); expected a "
                           "dataset file (.jsonl or .tsv)")
    if fmt is None:
        ext = os.path.splitext(path)[1].lower()
        fmt = {".jsonl": "jsonl", ".json": "jsonl", ".tsv": "tsv", ".txt": "tsv"}.get(ext)
        if fmt is None:
            raise DatasetError(f"{path}: cannot tell the format from '{ext}'; use .jsonl or .tsv")
    if fmt not in ("jsonl", "tsv"):
        raise DatasetError(f"unknown dataset format {fmt!r} (jsonl or tsv)")
    examples, cut = [], 0
    for example in _from_jsonl(path) if fmt == "jsonl" else _from_tsv(path):
        example, was_cut = _cut(example)
        examples.append(example)
        cut += was_cut
    warn_cut(path, cut, "example")
    if not examples:
        raise DatasetError(f"{path}: empty dataset (no examples)")
    return examples
