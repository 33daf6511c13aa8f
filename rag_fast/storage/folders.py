"""What an output folder is (its marker), whether a command may write it, and directories
written whole: assembled under a temporary sibling and swapped into place."""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Callable, Iterable, Iterator


from .disk import atomic_write_bytes
from .manifests import KIND_WORDS, MANIFEST, read_json_file, sealed
from . import disk, swap
from .swap import recover_directory, remove_leftovers, sibling

# ---- what an output folder is, and whether a command may write it ---------------------------
# The file that says what a folder rag_fast wrote is, by kind: its manifest (index bundle,
# passage store, saved index, token cache), a model's side file, or the marker of a training
# run, an evaluation or a fitted tokenizer.
OUTPUT_MARKER = "rag_fast-output.json"
RUN_KIND, EVAL_KIND = "rag_fast.train_run", "rag_fast.eval"
RETRIEVAL_EVAL_KIND = "rag_fast.retrieval_eval"  # `rag-fast index eval --out`
TOKENIZER_KIND = "rag_fast.tokenizer"  # `rag-fast tokenizer fit`'s folder (rag_fast.tokenization)
REFRESHED_KIND = "rag_fast.refreshed_index"  # a training run's index/ after refreshes
# the parts its marker always binds (bm25/manifest.json too, where it has one)
REFRESHED_PARTS = ("passages/manifest.json", "index/manifest.json")
_MARKER_FILES = (MANIFEST, "rag_fast.json", OUTPUT_MARKER)
# the kinds each marker file may name (a model's kind in rag_fast-output.json is not a model);
# a manifest.json names a stored directory's kind: any other of rag_fast's
_MARKER_KINDS = {"rag_fast.json": ("rag_fast.model",),
                 OUTPUT_MARKER: (RUN_KIND, EVAL_KIND, RETRIEVAL_EVAL_KIND, REFRESHED_KIND, TOKENIZER_KIND)}


def _names_its_kind(marker: str, kind: object) -> bool:
    if marker in _MARKER_KINDS:
        return kind in _MARKER_KINDS[marker]
    return (isinstance(kind, str) and kind.startswith("rag_fast.")
            and not any(kind in kinds for kinds in _MARKER_KINDS.values()))


def folder_kind(path: str | os.PathLike) -> str | None:
    """The kind of rag_fast folder ``path`` is (``"rag_fast.model"``, ``"rag_fast.index_bundle"``,
    ...), read from its marker file; None when it has none (or is not a folder). A marker that
    is a symbolic link vouches for nothing (rag_fast writes its markers as files): it may lead
    to another folder's."""
    path = Path(path)
    for name in _MARKER_FILES:
        marker = path / name
        if marker.is_symlink() or not marker.is_file():
            continue
        try:
            payload = read_json_file(marker)
        except (OSError, ValueError):
            continue
        kind = payload.get("kind") if isinstance(payload, dict) else None
        if _names_its_kind(name, kind):
            return kind
    return None


# the temporaries of rag_fast's folder writers, named ".NAME.TAG-PID[-THREAD]-HEX8"
_OURS_TEMPORARY = re.compile(r"\..+\.(tmp|new|old|trash)-\d+(-\d+)?-[0-9a-f]{8}")


def unlisted_files(root: str | os.PathLike) -> list[str]:
    """Files under ``root`` that no manifest or marker of rag_fast accounts for: a marker file
    naming a kind of rag_fast's counts (see :func:`folder_kind`), with every path its ``files``
    lists (relative to its folder); the temporary folders of rag_fast's writers count too.
    Symbolic links are not followed."""
    root = Path(root)
    found, owned = [], set()
    for folder, dirs, names in os.walk(root):
        here = Path(folder)
        dirs[:] = [d for d in dirs if not _OURS_TEMPORARY.fullmatch(d)]
        found.extend(here / d for d in dirs if (here / d).is_symlink())  # a link is a file too
        for name in names:
            found.append(here / name)
            if name not in _MARKER_FILES:
                continue
            try:
                payload = read_json_file(here / name)
            except (OSError, ValueError):
                continue
            if not isinstance(payload, dict) or not _names_its_kind(name, payload.get("kind")):
                continue  # a file of that name that is not rag_fast's
            owned.add(here / name)
            if isinstance(payload.get("files"), dict):
                owned.update(here / str(n) for n in payload["files"])
    # what a killed atomic write of a file of rag_fast's left (NAME.tmp-PID-HEX) is rag_fast's
    writes = owned | {p.parent / name for p in found for name in _MARKER_FILES}
    # a symbolic link is never rag_fast's, even at a name its marker lists (it writes files)
    return sorted(str(p.relative_to(root)) for p in found
                  if (p not in owned or p.is_symlink()) and not _dead_writers_file(p, writes))


def _is_empty_dir(path: Path) -> bool:
    try:
        with os.scandir(path) as entries:
            return next(entries, None) is None
    except OSError:
        return False


def _dead_writers_file(path: Path, ours: set[Path]) -> bool:
    """Whether ``path`` is a regular file ``NAME.tmp-PID-HEX`` that an atomic write of one of
    ``ours`` left, killed before its rename by a process that is gone."""
    found = disk.TEMPORARY.fullmatch(path.name)
    return (found is not None and not found["hidden"] and path.with_name(found["name"]) in ours
            and not path.is_symlink() and path.is_file()
            and not swap.pid_alive(int(found["pid"])))


def _only_dead_writers_files(path: Path) -> bool:
    """Whether the folder ``path`` holds nothing but the temporaries of its marker that dead
    writers left (at least one): a command killed while it wrote its marker, its first file
    there; they are removed."""
    try:
        entries = list(path.iterdir())
    except OSError:
        return False
    markers = {path / name for name in _MARKER_FILES}
    if not entries or not all(_dead_writers_file(e, markers) for e in entries):
        return False
    for entry in entries:
        with contextlib.suppress(FileNotFoundError):
            entry.unlink()
    return True


def check_output_folder(out: str | os.PathLike, kind: str, *, overwrite: bool = False,
                        flag: str = "output", reuse: bool = False,
                        links_checked: bool = False, files: Iterable[str] = ()) -> None:
    """Refuse to write the folder ``out`` where that could destroy what rag_fast did not write.

    ``out`` may be missing or an empty folder. An existing folder of the same ``kind`` (its
    marker says so) is replaced only with ``overwrite``, or written into with ``reuse`` (a
    training run resuming, an evaluation written again). Anything else is refused, whatever
    ``overwrite`` says: a file, a folder of another kind, one that holds files rag_fast did not
    write, or (unless ``reuse``) a symbolic link, which a replacement would swap out. A folder
    written into again (``reuse``) may hold no symbolic link, which writing would replace,
    unless the caller checks the links itself (``links_checked``: a training run refuses those
    that lead out of it). ``files``: the names the command writes in the folder; each one
    there must be a regular file (a folder or a device in its place is refused now, before the
    work, not when the file is written).

    Raises:
        FileExistsError: naming ``flag`` and ``out``, and what to do instead.
    """
    out = Path(out)
    for parent in out.parents:  # the nearest entry of the path that exists must be a folder
        if parent.exists() or parent.is_symlink():
            if not parent.is_dir():
                raise FileExistsError(f"{flag} {str(out)!r}: {str(parent)!r} before it is a "
                                      "file, not a folder; refused: choose another path")
            break
    for name in files:
        path = out / name
        if out.is_dir() and (path.exists() or path.is_symlink()) and not path.is_file():
            raise FileExistsError(f"{flag} {str(out)!r} holds {name} as something other than "
                                  "a file (a folder, a device, a dangling link); refused: "
                                  "move it away or choose another path")
    words = KIND_WORDS.get(kind, kind)
    recover_directory(out)
    if out.is_symlink() and not reuse:  # replacing it would replace the link, not its target
        raise FileExistsError(f"{flag} {str(out)!r} is a symbolic link (to "
                              f"{os.readlink(out)!r}); refused: give the folder's own path")
    if not out.exists() and not out.is_symlink():
        return
    if not out.is_dir():
        raise FileExistsError(f"{flag} {str(out)!r} exists and is not a folder (expected "
                              f"{words}); refused: choose another path")
    if _is_empty_dir(out) or _only_dead_writers_files(out):
        return
    found = folder_kind(out)
    if found == kind:
        if reuse:  # written into again: a link in it would be replaced (or written through)
            link = None if links_checked else next(
                (p for p in sorted(out.rglob("*")) if p.is_symlink()), None)
            if link is not None:
                raise FileExistsError(
                    f"{flag} {str(out)!r} is {words} but holds the symbolic link "
                    f"{str(link.relative_to(out))!r} (to {os.readlink(link)!r}) that rag_fast "
                    "did not write; refused (writing again would replace it): move it away or "
                    "choose another path")
            return
        if not overwrite:
            raise FileExistsError(f"{flag} {str(out)!r} already exists (pass --overwrite to "
                                  "replace it)")
        foreign = unlisted_files(out)
        if not foreign:
            return
        raise FileExistsError(
            f"{flag} {str(out)!r} is {words} but also holds {foreign[0]!r}"
            + (f" and {len(foreign) - 1} more file(s)" if len(foreign) > 1 else "")
            + " that rag_fast did not write; refused (--overwrite would delete them): move them "
            "away or choose another path")
    what = f"is {KIND_WORDS.get(found, found)}, not {words}"
    if found is None:
        linked = [name for name in _MARKER_FILES if (out / name).is_symlink()]
        what = (f"holds its marker {linked[0]} as a symbolic link (to "
                f"{os.readlink(out / linked[0])!r}), which vouches for nothing" if linked
                else "holds files rag_fast did not write")
    # a command that writes into its own folder again (reuse: train, eval) has no --overwrite
    rule = ("rag_fast writes only into a folder of its own kind" if reuse else
            "even with --overwrite, rag_fast replaces only a folder of its own kind")
    raise FileExistsError(f"{flag} {str(out)!r} {what}; refused ({rule}): choose another path "
                          "or an empty folder")


# the longest line check_output_file reads of an existing file (the readers' bound,
# rag_fast._jsonl.MAX_LINE_BYTES: no output of ours holds a longer one)
_OUTPUT_LINE_BYTES = 64 << 20


def check_output_file(out: str, flag: str, ours: Callable[[object], bool], what: str) -> None:
    """Refuse to write the file ``out`` where that could destroy what rag_fast did not write:
    it may be missing (in an existing folder), or a file every line of which is a JSON value
    ``ours`` accepts (an earlier output of the same command, ``what``). Anything else is
    refused, and never replaced: a path ending in a separator, a missing folder, a symbolic
    link (writing would replace the link), a folder, an empty file, any other file.

    Raises:
        FileNotFoundError, FileExistsError: naming ``flag`` and ``out`` as given.
    """
    path = Path(out)
    folder = os.path.dirname(out.rstrip(os.sep)) or "."
    if out.endswith(os.sep):
        raise FileNotFoundError(f"{flag} {out!r} ends with a path separator: give a file name; "
                                "refused (nothing was written)")
    if not os.path.isdir(folder):
        where = ("does not exist" if not os.path.lexists(folder) else "is a file, not a folder"
                 if os.path.isfile(folder) else "is not a folder")
        raise FileNotFoundError(f"{flag} {out!r}: its folder {folder!r} {where}; refused "
                                "(nothing was written)")
    if path.is_symlink():
        raise FileExistsError(f"{flag} {out!r} is a symbolic link (to {os.readlink(path)!r}); "
                              "refused: give the file's own path")
    if not path.exists():
        return
    if not path.is_file():
        raise FileExistsError(f"{flag} {out!r} exists and is not a file; refused")
    if path.stat().st_size == 0:  # never an output (those hold a line per question)
        raise FileExistsError(f"{flag} {out!r} exists (an empty file rag_fast did not write); "
                              "refused: choose another path")
    mine = True
    try:  # a line at a time, never more than the readers' bound: a file's size sets no memory
        with open(path, "rb") as f:
            while mine and (raw := f.readline(_OUTPUT_LINE_BYTES + 1)):
                if len(raw) > _OUTPUT_LINE_BYTES:
                    mine = False  # no output of ours holds a line this long
                elif raw.strip():
                    mine = bool(ours(json.loads(raw.decode("utf-8"))))
    except (OSError, ValueError, RecursionError, MemoryError):
        mine = False
    if not mine:
        raise FileExistsError(f"{flag} {out!r} exists and is not {what}; refused (it is never "
                              "replaced): choose another path")


def _real(path: str | os.PathLike) -> str:
    return os.path.realpath(os.path.abspath(os.fspath(path)))


def check_apart(out: str | os.PathLike, flag: str, inputs: dict[str, object]) -> None:
    """Refuse an output that is, contains or lies inside one of the command's inputs, before
    anything is read or written. ``inputs`` maps a flag (or config key) to a path (or None, or
    a name that is not a local path: skipped).

    Raises:
        ValueError: naming both flags and paths.
    """
    target = _real(out)
    for name, value in inputs.items():
        if value is None or not isinstance(value, (str, os.PathLike)) or not os.fspath(value):
            continue
        if not os.path.exists(value):  # a model or encoder name, not a path
            continue
        source = _real(value)
        if target == source:
            how = "is"
        elif os.path.commonpath([target, source]) == target:
            how = "contains"
        elif os.path.commonpath([target, source]) == source and os.path.isdir(source):
            how = "lies inside"
        else:
            continue
        raise ValueError(f"{flag} {os.fspath(out)!r} {how} {name} {os.fspath(value)!r}: writing "
                         f"it could destroy the input; choose an output path apart from the "
                         "inputs")


def write_marker(folder: str | os.PathLike, kind: str, *, seal: bool = False, **extra) -> None:
    """Mark ``folder`` (created if missing) as a rag_fast output of ``kind`` (atomically);
    with ``seal``, sealed as a manifest is (:func:`~rag_fast.storage.check_seal` checks it)."""
    folder = Path(folder)
    with disk.disk_errors(folder):  # no inode left for the folder: a full disk, naming it
        folder.mkdir(parents=True, exist_ok=True)
    payload = {"kind": kind, "format": 1, **extra}
    atomic_write_bytes(folder / OUTPUT_MARKER, json.dumps(
        sealed(payload) if seal else payload, indent=1, sort_keys=True).encode("utf-8"))


@contextlib.contextmanager
def new_folder_removed_on_failure(folder: str | os.PathLike, names: Iterable[str]) -> Iterator[None]:
    """When ``folder`` does not exist yet and the block fails (a full disk, Ctrl-C), remove
    what the block may have written there (``names``, and the marker) and then the folder if
    it is empty: a failed command leaves no folder it made. A folder that existed is left."""
    folder = Path(folder)
    existed = os.path.lexists(folder)
    try:
        yield
    except BaseException:
        if not existed and folder.is_dir() and not folder.is_symlink():
            for name in (*names, OUTPUT_MARKER):
                with contextlib.suppress(OSError):
                    (folder / name).unlink()
            with contextlib.suppress(OSError):
                folder.rmdir()
        raise


@contextlib.contextmanager
def atomic_directory(out: str | os.PathLike, overwrite: bool = False,
                     kind: str | None = None) -> Iterator[Path]:
    """Yield a temporary directory that becomes ``out`` when the block exits normally.

    On any exception (KeyboardInterrupt included) the temporary directory is removed and
    ``out`` is left untouched. With ``overwrite`` an existing ``out`` is replaced atomically:
    after a kill at any point ``out`` holds the old or the new directory, or (only where the
    OS cannot exchange two directories) is restored by the next open or save, see
    :func:`recover_directory`. Before any work, a missing ``out`` is recovered and the
    leftovers of dead writers (``.NAME.{tmp,new,old,trash}-PID-*``) are removed.

    ``kind`` is what the new directory is (its manifest's kind): an existing ``out`` is replaced
    only when it is empty or of that kind (see :func:`check_output_folder`); without ``kind``,
    only an empty one.

    Raises:
        FileExistsError: ``out`` exists and ``overwrite`` is False, or it is not a folder of
            ``kind`` (before any work starts).
    """
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    recover_directory(out)
    remove_leftovers(out)
    if out.exists() and not overwrite and not (out.is_dir() and _is_empty_dir(out)):
        raise FileExistsError(f"output path {str(out)!r} already exists (pass overwrite=True)")
    if out.exists() or out.is_symlink():
        check_output_folder(out, kind or "an empty folder", overwrite=True, flag="output path")
    tmp = sibling(out, "tmp")
    tmp.mkdir()
    mine = [tmp]  # what to remove at the end
    moved_aside: Path | None = None
    try:
        yield tmp
        if not out.exists():
            os.replace(tmp, out)
        elif not swap.exchange(tmp, out):  # (exchanged: out is the new directory, tmp the old one)
            new, old, trash = sibling(out, "new"), sibling(out, "old"), sibling(out, "trash")
            mine += [new, trash]
            os.replace(tmp, new)  # complete: recover_directory may install a dead writer's .new-*
            os.replace(out, old)
            moved_aside = old
            os.replace(new, out)
            moved_aside = None
            mine.append(old)
            os.replace(old, trash)  # so that an .old-* is always a complete directory
    finally:
        if moved_aside is not None and not out.exists():
            with contextlib.suppress(OSError):  # failed between the renames: put the old one back
                os.replace(moved_aside, out)
        for path in mine:
            if path.exists():
                shutil.rmtree(path, ignore_errors=True)
