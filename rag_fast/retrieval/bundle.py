"""Index directories: build one from a passage file and an encoder, and open one.

An index directory holds ``manifest.json`` (kind :data:`BUNDLE_KIND`: the encoders and the
checksums of the parts), ``passages/`` (a PassageStore), ``index/`` (a DenseIndex) and, built
with ``bm25``, ``bm25/`` (a BM25Index). It is assembled under a temporary name and renamed at
the end, so an interrupted build leaves nothing at ``out``. With ``shard=(i, n)`` a process only encodes its shard into
``OUT.staging/``; a final build without a shard finds the complete set of shards there and
builds the index from them. That staging folder is also what training on a sharded index reads
(``"index": {"path": "OUT.staging", "sharded": true}``), so the build that merges staged shards
keeps it unless asked to remove it (``remove_staging``); a build that encoded the whole corpus
itself removes its own staging, and removes the staging folder it created when it fails.

The staging folder holds ``key.json`` (what the staged data are made from), ``passages/`` and,
for each shard, ``embeddings-i-of-n.npy`` with its record ``shard-i-of-n.json`` (the file's
size and SHA-256, sealed; published before the file, so a staged file never lacks one). It is
only ever removed entry by entry, and only what a build staged there (:func:`_staging_entries`):
a staging folder holding anything else is refused before any work where the build would remove
it, and a staging folder that is a symbolic link is refused always.

This is the library behind ``rag-fast index build``: its errors name the options as that
command spells them (``--out``, ``--shard``, ...), so that the command reports them unchanged.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import stat
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Callable, NamedTuple

import numpy as np

from rag_fast._jsonl import check_regular_file, cut_texts, decoded_lines, read_objects
from rag_fast.retrieval.encoders import Encoder, encode_passages, parse_shard, shard_rows
from rag_fast.retrieval.factory import PRESETS, SMALL_CORPUS, factory_index, plan_factory
from rag_fast.retrieval.index import INDEX_KIND, DenseIndex
from rag_fast.retrieval.inputs import NonFiniteError
from rag_fast.retrieval.lexical import BM25_MANIFEST, BM25_PART, build_part, check_memory
from rag_fast.retrieval.tuning import SmallSampleWarning, small_sample_message
from rag_fast.retrieval.weights import read_gold_questions, tune_part
from rag_fast.retrieval.passages import (STORE_KIND, PassageStore, passages_digest,
                                         stand_in_questions)
from rag_fast.storage import (NoSpaceError, StorageError, atomic_directory, check_apart,
                              check_output_folder, check_seal, describe_files, disk_errors,
                              fsync_dir, part_digests, pid_alive, private_folder, read_json_file,
                              read_manifest, sha256_file, unlisted_files, write_json,
                              write_manifest)

BUNDLE_KIND = "rag_fast.index_bundle"
STAGING_KEY = "key.json"
SHARD_RECORD_KIND = "rag_fast.staged_shard"  # shard-i-of-n.json: what a build encoded
TUNING_QUESTIONS = 1000  # stand-in questions drawn from the passages when no queries are given

_SHARD_FILE = re.compile(r"embeddings-(\d+)-of-(\d+)\.npy")
_SHARD_RECORD = re.compile(r"shard-(\d+)-of-(\d+)\.json")
# the shard indexes sharded training caches in the staging folder (ShardedIndex.from_shards)
_CACHED_INDEX = re.compile(r"index-\d+-of-\d+-[0-9a-f]{12}")
# a build's temporary folder: .NAME.tmp-PID-HEX (see _temporary)
_TEMPORARY = re.compile(r"\.(?P<name>.+)\.tmp-(?P<pid>\d+)-[0-9a-f]{8}")


def staging_folder(out: str | Path) -> Path:
    """Where the passages and shard embeddings of a build of ``out`` are staged."""
    out = Path(out)
    return out.with_name(out.name + ".staging")


def _no_name_of_its_own(out: str) -> str | None:
    """Why the path ``out`` names no folder of its own (``.``, ``..``, ``/``, empty, ending
    in ``..``), or None when it does."""
    name = Path(out).name
    if out and name not in ("", ".."):
        return None
    plain = os.path.normpath(out) if out else ""
    if not out:
        return "it is empty"
    if not plain.strip("/"):
        return "it is the root folder"
    return {".": "it is the current folder", "..": "it is the parent folder"}.get(
        plain, "it ends in '..'")


def _check_out(out: str | os.PathLike) -> None:
    """Refuse an ``--out`` that names no folder of its own: the index directory and its
    staging folder (``OUT.staging``, beside it) are named after it.

    Raises:
        ValueError: naming ``--out`` and the value as given.
    """
    why = _no_name_of_its_own(os.fspath(out))
    parent = Path(os.fspath(out)).parent
    if why is None and parent.exists() and not parent.is_dir():
        why = f"{str(parent)!r} before it is a file, not a folder"
    if why is not None:
        raise ValueError(f"--out {os.fspath(out)!r} names no folder of its own ({why}); give a "
                         "new folder's path such as work/kb")


def _check_staging_path(staging: Path) -> None:
    """Refuse a staging folder that is a symbolic link or no folder: the build writes into it
    and removes it, which must never reach what a link points to.

    Raises:
        FileExistsError: naming the staging folder of ``--out``.
    """
    if staging.is_symlink():
        raise FileExistsError(f"--out's staging folder {str(staging)!r} is a symbolic link (to "
                              f"{os.readlink(staging)!r}); refused (the build writes and removes "
                              "that folder itself): remove the link or choose another --out")
    if staging.exists() and not staging.is_dir():
        raise FileExistsError(f"--out's staging folder {str(staging)!r} exists and is not a "
                              "folder; refused: move it away or choose another --out")


def _temporary(staging: Path, name: str) -> contextlib.AbstractContextManager[Path]:
    """A private folder ``staging/.NAME.tmp-PID-HEX`` in which ``name`` is written before it is
    moved into place, removed on every way out (:func:`rag_fast.storage.private_folder`). A
    build's temporaries are folders holding only ``name`` and its writers' own temporaries,
    so that a file of the user's named like one is never taken for one (:func:`_is_leftover`)."""
    return private_folder(staging, name)


def _encoder_fingerprint(name: str) -> str | None:
    """SHA-256 over a local encoder folder: small files (configs, vocabularies) by content,
    large ones (weights) by name, size and mtime; None for a hub name."""
    root = Path(name)
    if not root.is_dir():
        return None
    h = hashlib.sha256()
    for f in sorted(p for p in root.rglob("*") if p.is_file()):
        stat = f.stat()
        h.update(f"{f.relative_to(root).as_posix()}\0{stat.st_size}\0".encode())
        h.update(f.read_bytes() if stat.st_size <= 1 << 20 else str(stat.st_mtime_ns).encode())
    return h.hexdigest()


def _staging_key(passages: str, split: int | None, dedupe: bool, encoder: str, pooling: str,
                 max_length: int) -> dict:
    """What the staged passages and embeddings are made from: the passages' content, the
    encoder and every setting that changes a vector."""
    # "normalize" is always None: kept so that stagings of earlier versions keep their key
    return {"passages_sha256": passages_digest(passages), "split": split,
            "dedupe": bool(dedupe), "encoder": str(encoder),
            "encoder_fingerprint": _encoder_fingerprint(encoder), "pooling": pooling,
            "normalize": None, "max_length": max_length}


def _shard_name(i: int | str, n: int | str) -> str:
    return f"embeddings-{i}-of-{n}.npy"


def _record_name(i: int | str, n: int | str) -> str:
    return f"shard-{i}-of-{n}.json"


def _read_key(path: Path) -> dict | None:
    """The staging key in ``path``; None when it is missing, no regular file, or no key."""
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            return None
        key = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return None
    return key if isinstance(key, dict) and "passages_sha256" in key else None


def _read_record(path: Path) -> dict | None:
    """``{"bytes", "sha256"}`` of the embeddings file the shard record ``path`` lists; None
    when ``path`` is no such record (no regular file, no sealed JSON of
    :data:`SHARD_RECORD_KIND`, or listing anything but its own shard's file)."""
    m = _SHARD_RECORD.fullmatch(path.name)
    try:
        if m is None or not stat.S_ISREG(os.lstat(path).st_mode):
            return None
        payload = read_json_file(path)  # at most a manifest's bound
        if not isinstance(payload, dict) or payload.get("kind") != SHARD_RECORD_KIND:
            return None
        files = check_seal(path, payload).get("files")
    except (OSError, ValueError, RecursionError, StorageError):
        return None
    name = _shard_name(*m.groups())
    meta = files.get(name) if isinstance(files, dict) and list(files) == [name] else None
    valid = (isinstance(meta, dict) and type(meta.get("bytes")) is int
             and isinstance(meta.get("sha256"), str))
    return meta if valid else None


def _matches_record(path: Path, verify: bool) -> bool:
    """Whether the staged embeddings file ``path`` is the one its record lists: a regular file
    of the recorded size and, with ``verify``, SHA-256."""
    i, n = _SHARD_FILE.fullmatch(path.name).groups()
    meta = _read_record(path.with_name(_record_name(i, n)))
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return (meta is not None and stat.S_ISREG(st.st_mode) and st.st_size == meta["bytes"]
            and (not verify or sha256_file(path) == meta["sha256"]))


def _staged_name(name: str) -> bool:
    """Whether ``name`` is one of a staging folder's own: the key, the passages, a shard's
    embeddings file or its record, a shard index sharded training cached."""
    return (name in (STAGING_KEY, "passages") or any(
        pattern.fullmatch(name) for pattern in (_SHARD_FILE, _SHARD_RECORD, _CACHED_INDEX)))


def _is_leftover(entry: Path, name: str) -> bool:
    """Whether ``entry``, named like a temporary of a build whose process is gone, is one: a
    folder (not a link) made for one of the staging folder's own names
    (:func:`_staged_name`), holding only ``name`` and the temporaries of its writers
    (``.NAME.*``), none of them a link."""
    if not _staged_name(name) or entry.is_symlink() or not entry.is_dir():
        return False
    try:
        return all((e.name == name or e.name.startswith(f".{name}.")) and not e.is_symlink()
                   for e in entry.iterdir())
    except OSError:
        return False


def _unlisted(folder: Path, kind: str) -> list[str]:
    """What in ``folder``, a rag_fast folder of ``kind``, its manifests do not list (as
    ``'FOLDER/FILE'``); the folder itself when it is none (its manifest missing, broken or
    sized otherwise than its files)."""
    try:
        read_manifest(folder, kind, verify=False)
    except (StorageError, OSError):
        return [repr(folder.name)]
    return [repr(f"{folder.name}/{name}") for name in unlisted_files(folder)]


def _unstaged(entry: Path, verify: bool) -> list[str]:
    """The names (quoted, relative to the staging folder) of what in ``entry``, one entry of a
    staging folder, no build staged; empty when all of it is a build's."""
    name = entry.name
    if entry.is_symlink():
        return [repr(name)]
    if name == "passages":
        return _unlisted(entry, STORE_KIND)
    if _CACHED_INDEX.fullmatch(name):
        return _unlisted(entry, INDEX_KIND)
    if name == STAGING_KEY:
        ours = _read_key(entry) is not None
    elif _SHARD_FILE.fullmatch(name):
        ours = _matches_record(entry, verify)
    elif _SHARD_RECORD.fullmatch(name):
        ours = _read_record(entry) is not None
    else:
        temporary = _TEMPORARY.fullmatch(name)
        ours = temporary is not None and _is_leftover(entry, temporary["name"])
    return [] if ours else [repr(name)]


class _Staged(NamedTuple):
    """What a staging folder holds (:func:`_staging_entries`)."""

    ours: list[Path]  # what builds staged there: what may be removed
    others: list[str]  # what they did not (quoted names): never removed
    writers: list[str]  # temporaries of builds still running ("'NAME', process PID")


def _staging_entries(staging: Path, verify: bool) -> _Staged:
    """Sort what ``staging`` holds into what builds staged there and what they did not.

    A build's: ``key.json`` (a staging key); ``passages/`` holding only what its manifests
    list (sharded training adds token caches there); each ``embeddings-i-of-n.npy`` that is
    the file its record ``shard-i-of-n.json`` lists (its size and, with ``verify``, SHA-256),
    and each such record; the shard indexes sharded training caches (``index-i-of-n-TAG/``,
    holding only what their manifests list); the temporary folders of builds whose process is
    gone (:func:`_is_leftover`). Anything else is named in ``others``: files, folders and
    symbolic links of the user's (a link is never a build's, whatever its name), a shard file
    its record does not vouch for, a file named like a temporary. A temporary folder of a
    process still alive is named in ``writers``. Nothing is read through a link.
    """
    ours, others, writers = [], [], []
    for entry in sorted(staging.iterdir()):
        temporary = _TEMPORARY.fullmatch(entry.name)
        if (temporary and _staged_name(temporary["name"]) and not entry.is_symlink()
                and entry.is_dir() and pid_alive(int(temporary["pid"]))):
            writers.append(f"{entry.name!r}, process {temporary['pid']}")
            continue
        unstaged = _unstaged(entry, verify)
        others += unstaged
        if not unstaged:
            ours.append(entry)
    return _Staged(ours, others, writers)


def _refuse_unless_ours(staging: Path, staged: _Staged, subject: str, advice: str) -> None:
    """Raise when ``staging`` holds what no build staged there (the first named, and how many
    more) or a build is still writing it. ``subject`` names the folder's role (with the
    flag), ``advice`` the way out (its ``{them}``: "it" or "them", as many as are named).

    Raises:
        ValueError: one line naming ``staging``.
    """
    if staged.writers:
        raise ValueError(f"{subject} {staging} is refused: another build is still writing it "
                         f"({staged.writers[0]}); wait for it to finish, then run again")
    if staged.others:
        more = f" and {len(staged.others) - 1} more" if len(staged.others) > 1 else ""
        them = "them" if more else "it"
        raise ValueError(f"{subject} {staging} holds {staged.others[0]}{more} that rag_fast did "
                         f"not write; {advice.format(them=them)}")


def _publish_key(staging: Path, key: dict) -> bool:
    """Publish ``key`` as ``staging/key.json`` atomically (a hard link of a complete file);
    False when another process published one first."""
    with _temporary(staging, STAGING_KEY) as tmp:
        write_json(tmp / STAGING_KEY, key)
        try:
            os.link(tmp / STAGING_KEY, staging / STAGING_KEY)
        except FileExistsError:
            return False
    return True


def _await_key(staging: Path, seconds: float = 60.0) -> None:
    """Wait (at most ``seconds``) while another process publishes the staging key: its
    temporary folder of ``key.json`` is there, the key not yet (shard processes started
    together race for the first key)."""
    deadline = time.monotonic() + seconds
    while not os.path.lexists(staging / STAGING_KEY) and time.monotonic() < deadline:
        publishing = (_TEMPORARY.fullmatch(e.name) for e in staging.iterdir())
        if not any(m and m["name"] == STAGING_KEY and pid_alive(int(m["pid"]))
                   for m in publishing):
            return
        time.sleep(0.05)


def _claim_staging(staging: Path, key: dict, sharded: bool, log: Callable[[str], None]) -> bool:
    """Make ``staging`` hold data made with ``key``: reuse it if its key matches; else discard
    it (one line says so) and start afresh, only while everything in it is what builds
    staged (:func:`_staging_entries`). The key is published atomically, so concurrent shard
    processes agree on one staging.

    Returns:
        Whether a stale staging was discarded (the folder is then this build's own).
    Raises:
        ValueError: ``sharded`` and ``staging`` holds another key (another build with other
            settings is in progress there): shards never mix; or ``staging`` is to be
            discarded but holds what no build staged there, or a build is still writing it.
    """
    fresh = False
    for _ in range(3):
        staging.mkdir(parents=True, exist_ok=True)
        path = staging / STAGING_KEY
        if not os.path.lexists(path) and not any(staging.iterdir()) and _publish_key(staging, key):
            return fresh
        _await_key(staging)
        staged = _read_key(path)
        if staged == key:
            return fresh
        differ = _settings_differ(staged, key)  # each setting, with both values
        other_settings = ValueError(
            f"--shard: {staging} holds passages or embeddings made with other settings "
            f"({differ}): another build with other settings is in progress, "
            f"or a stale one failed; finish it or delete {staging}")
        if sharded and staged is not None:
            raise other_settings
        _refuse_unless_ours(staging, _staging_entries(staging, verify=False),
                            "--out's staging folder",
                            f"refused (a staging made with other settings, or without a readable "
                            f"{STAGING_KEY}, is discarded only while it holds nothing else): "
                            "move {them} away or choose another --out")
        if sharded:
            raise other_settings
        # sets of 2 or more (embeddings-0-of-1.npy is a build without --shard's own)
        staged_shards = sorted(e.name for e in staging.iterdir() if any(
            (m := pattern.fullmatch(e.name)) and int(m[2]) >= 2
            for pattern in (_SHARD_FILE, _SHARD_RECORD)))
        if staged_shards:  # --shard builds' work: never discarded for a setting that differs
            raise ValueError(
                f"--out's staging folder {staging} holds shards staged by --shard builds with "
                f"other settings ({differ}; first: {staged_shards[0]}): "
                "run this build with the settings the shards were built with to merge them, or "
                "remove the staging folder to start over")
        log(f"discarding stale staging {staging} (made with other settings: {differ})")
        trash = Path(tempfile.mkdtemp(prefix=f".{staging.name}.old-", dir=staging.parent))
        try:
            os.replace(staging, trash / "old")
        except FileNotFoundError:
            pass
        shutil.rmtree(trash, ignore_errors=True)
        fresh = True
    raise ValueError(f"could not claim the staging folder {staging}: other builds keep changing it")


def _settings_differ(staged: dict | None, key: dict) -> str:
    """The settings in which a staging's key differs from this build's, with both values
    (``max_length 128 there, 256 here``); the passages by their file's contents."""
    if staged is None:
        return f"no readable {STAGING_KEY}: an older version's staging"
    said = []
    for name in sorted(k for k in set(key) | set(staged) if staged.get(k) != key.get(k)):
        if name == "passages_sha256":
            said.append("--passages (another file, or the file changed)")
        elif name == "encoder_fingerprint":
            said.append("--encoder's weights or configuration")
        else:
            flag = "--" + name.replace("_", "-")
            said.append(f"{flag} {staged.get(name)!r} there, {key.get(name)!r} here")
    return "; ".join(said)


def _staged_store(passages: str, split: int | None, dedupe: bool, staging: Path,
                  progress: bool) -> PassageStore:
    """The passages staged under ``staging/passages`` (created once; concurrent shard
    processes build their own copy and the first rename wins)."""
    path = staging / "passages"
    if path.is_symlink() or (path.exists() and not path.is_dir()):  # not a build's
        raise ValueError(f"--out's staging folder {staging}: its passages is a symbolic link "
                         "or not a folder; refused (builds stage passages there): remove it")
    if not (path / "manifest.json").exists():
        with _temporary(staging, "passages") as tmp:
            try:
                PassageStore.from_file(passages, tmp / "passages", split=split,
                                       dedupe=bool(dedupe), progress=progress)
            except NoSpaceError as e:  # named as the staged store, not its temporary
                raise NoSpaceError(path, e.needed, e.free, e.errno) from None
            try:
                os.rename(tmp / "passages", path)
            except OSError:
                if not (path / "manifest.json").exists():  # not another shard process's store
                    raise
    return PassageStore.load(path)


def _stage_embeddings(encoder: Encoder, store: PassageStore, staging: Path,
                      shard: tuple[int, int], batch_size: int, progress: bool) -> Path:
    """Encode shard ``(i, n)`` of ``store`` into ``staging/embeddings-i-of-n.npy`` with its
    record ``shard-i-of-n.json`` (the file's size and SHA-256, sealed): encoded in a
    temporary folder, the record published first and the file moved beside it after, so
    that a staged file never lacks its record (a kill between leaves a record alone).

    Raises:
        NoSpaceError: naming the staged file, as :func:`encode_passages` does.
    """
    name = _shard_name(*shard)
    path = staging / name
    with _temporary(staging, name) as tmp:
        try:
            encode_passages(encoder, store, tmp / name, shard, batch_size, progress)
        except NoSpaceError as e:
            raise NoSpaceError(path, e.needed, e.free, e.errno) from None
        record = _record_name(*shard)
        with _temporary(staging, record) as held, disk_errors(staging / record):
            write_manifest(held / record, {"kind": SHARD_RECORD_KIND, "format": 1,
                                           "files": describe_files(tmp, [name])})
            os.replace(held / record, staging / record)
        fsync_dir(staging)
        os.replace(tmp / name, path)
    return path


def _check_staging_removable(staging: Path, remove: bool) -> None:
    """Before a build without shards does any work: when it will remove ``staging`` at the end
    (``remove``, or no ``--shard`` set is staged there), refuse a staging holding what no
    build staged (checked against the records' SHA-256), naming it, so that nothing is
    encoded or merged in vain and nothing of the user's is removed.

    Raises:
        ValueError: naming ``--remove-staging`` or ``--out`` and the staging folder.
    """
    if _shard_sets(staging) and not remove:
        return  # kept: at most the build's own embeddings-0-of-1.npy goes
    staged = _staging_entries(staging, verify=True)
    if remove:
        _refuse_unless_ours(staging, staged, "--remove-staging: the staging folder",
                            "refused before the merge, nothing was removed: move {them} away, or "
                            "run without --remove-staging to keep the folder")
    _refuse_unless_ours(staging, staged, "--out's staging folder",
                        "refused before any work (a build without --shard removes its staging "
                        "folder when done): move {them} away or choose another --out")


def _complete_shards(staging: Path, count: int) -> list[Path] | None:
    """The shard files of the largest n for which all n are staged, else None."""
    found: dict[int, dict[int, Path]] = {}
    for f in staging.iterdir():
        if (m := _SHARD_FILE.fullmatch(f.name)):
            found.setdefault(int(m[2]), {})[int(m[1])] = f
    for n in sorted(found, reverse=True):
        if len(found[n]) == n:
            files = [found[n][i] for i in range(n)]
            for i, f in enumerate(files):
                # the file its sealed record lists (a regular file, its size and SHA-256):
                # never a shard edited, swapped, truncated or replaced by a device or a pipe
                if not _matches_record(f, verify=True):
                    raise ValueError(
                        f"--out's staging folder: {f} is not the file its record "
                        f"{_record_name(i, n)} lists (size and SHA-256, sealed when it was "
                        f"encoded): edited, damaged or replaced; encode shard {i}/{n} again "
                        f"(delete the file and its record first) or remove {staging}")
                lo, hi = shard_rows(count, (i, n))
                if _open_staged(f).shape[0] != hi - lo:
                    raise ValueError(f"--shard: staged {f} has the wrong number of rows for "
                                     f"{count} passages; delete {staging} and encode again")
            return files
    return None


def _open_staged(path: Path, dim: int | None = None) -> np.ndarray:
    """A staged shard's embeddings, memory-mapped: ``[rows, dim]`` float16 or float32 (``dim``:
    the encoder's, when given). (The build checks every value is finite; a merge names the
    shard of a row that is not: :func:`_shard_of_row`.)

    Raises:
        ValueError: naming the file: not such an array (a crafted shard whose record was forged
            to match it).
    """
    where = f"--out's staging folder: {path}"
    try:
        array = np.load(path, mmap_mode="r")
    except (ValueError, OSError, EOFError) as e:  # object arrays cannot be mapped, a bad header
        raise ValueError(f"{where} is not a shard of embeddings ({e}); encode it again") from None
    if array.ndim != 2 or array.dtype not in (np.float16, np.float32) or (
            dim is not None and array.shape[1] != dim):
        raise ValueError(f"{where} holds a {array.dtype} array of shape {array.shape}, not "
                         f"[rows, {dim or 'dim'}] float16 embeddings; encode it again")
    return array


def _shard_of_row(shards: list[Path], embeddings: list[np.ndarray], row: int) -> tuple[Path, int]:
    """The staged shard holding global ``row`` of the merged embeddings, and its row there."""
    for path, array in zip(shards, embeddings):
        if row < array.shape[0]:
            return path, row
        row -= array.shape[0]
    return shards[-1], row


def _encoder(flag: str, name: str, **kwargs) -> Encoder:
    """``Encoder(name, **kwargs)``, its errors prefixed with the option that named it."""
    try:
        return Encoder(name, **kwargs)
    except ValueError as e:
        if str(e).startswith("max_length "):
            raise ValueError(f"--max-length{str(e).removeprefix('max_length')}") from None
        raise ValueError(f"{flag}: {e}") from None


def _warn_stderr(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr)


def read_tuning_questions(path: str) -> list[str]:
    """The questions of a ``--queries`` file: a .txt file (one per non-empty line) or JSONL
    objects with a non-empty string ``question``.

    Raises:
        FileNotFoundError, ValueError: naming ``--queries``, the file and line.
    """
    check_regular_file(path, "--queries", "a .txt or JSONL file of questions")
    if Path(path).suffix.lower() == ".txt":
        questions = [line.strip() for _, line in decoded_lines(path) if line.strip()]
    else:
        questions = []
        for _, where, row in read_objects(path):
            if not isinstance(row.get("question"), str) or not row["question"].strip():
                raise ValueError(f"--queries {where}: expected an object with a non-empty string "
                                 "'question'")
            questions.append(row["question"])
    if not questions:
        raise ValueError(f"--queries {path}: no questions")
    return cut_texts(questions, path, "question")  # no model keeps more of one (said once)


def describe_quality(quality: dict | None, factory: str | None = None) -> str:
    """One line on what an index's build measured (``DenseIndex.describe()["search_quality"]``)."""
    if factory == "Flat":  # exact search: the true top k of every query by construction
        return "exact search, nothing approximate to measure"
    if not quality:
        return "not measured (built before rag_fast measured indexes, or by DenseIndex.build)"
    speed = (f", {quality['ms_per_query']:.3f} ms/query (batch)"
             if quality.get("ms_per_query") is not None else "")
    reached = "" if quality.get("reached", True) else " (target NOT reached)"
    same = f", same top 5 for {quality['same_top5']:.1%} of queries" if "same_top5" in quality else ""
    source = quality.get("query_source", "the corpus's vectors")
    return (f"recall@{quality['k']} {quality['recall']:.3f}{same} vs exact search on "
            f"{quality['queries']} queries ({source}; target {quality['target_recall']})"
            f"{reached}{speed}")


def build_index_bundle(
    passages: str,
    encoder: str,
    out: str | Path,
    *,
    query_encoder: str | None = None,
    preset: str = "ivfpq",
    on_disk: bool = False,
    target_recall: float = 0.95,
    queries: str | None = None,
    shard: str | tuple[int, int] | None = None,
    split: int | None = None,
    pooling: str = "auto",
    max_length: int = 256,
    batch_size: int = 64,
    device: str | None = None,
    overwrite: bool = False,
    dedupe: bool = False,
    bm25: bool = False,
    progress: bool = True,
    remove_staging: bool = False,
    log: Callable[[str], None] = print,
    warn: Callable[[str], None] | None = None,
    alone: Callable[[], bool] | None = None,
) -> Path:
    """Encode ``passages`` and write the index directory ``out`` (see the module docstring).

    Args:
        passages: DPR .tsv, .jsonl, .txt or a directory of .txt documents.
        encoder: Hugging Face passage encoder (name or local folder).
        out: the index directory to write: only ever an empty or missing folder, or (with
            ``overwrite``) an index directory, is replaced. It must name a folder of its own
            (not ``.``, ``..``, ``/``): its staging folder ``OUT.staging`` lies beside it.
        query_encoder: question encoder recorded for search (default: ``encoder``); it must
            give vectors of the same dimension.
        preset: one of ``PRESETS`` or a faiss factory string; small corpora get exact search.
        on_disk: inverted lists kept on disk, memory-mapped when the index is opened.
        target_recall: quality (recall@10, and the fraction of queries with exact search's
            top 5) the stored search settings must reach against exact search, in (0, 1].
        queries: a file of real questions (.txt or .jsonl, see :func:`read_tuning_questions`)
            to tune on; default: :data:`TUNING_QUESTIONS` stand-in questions drawn from the
            passages.
        shard: ``"i/n"`` or ``(i, n)``: only encode shard i of n into ``OUT.staging/`` and
            return the shard's embeddings file; the build without a shard then uses the
            complete set of staged shards (and keeps them, see ``remove_staging``).
        split: split passages into chunks of this many words (None: as read).
        pooling, max_length, device: the encoders' settings (device: the passage encoder's;
            the query encoder, when given, runs on the CPU).
        batch_size: passages per encoder batch.
        dedupe: keep the first passage of each repeated id instead of refusing.
        bm25: a BM25 part beside the dense index (:mod:`~rag_fast.retrieval.lexical`).
        progress: progress bars and a line on the tuning questions.
        remove_staging: after a build that used shards staged by ``shard`` builds (sets of
            2 or more), remove ``OUT.staging/`` with them; by default it is kept, as training
            on a sharded index reads it. The staging of a build without shards is removed
            either way, and a set of shards it did not use is kept either way. Only what
            builds staged there is ever removed: a staging folder the build would remove that
            holds anything else is refused before any work (:func:`_staging_entries`). A
            build that fails removes the staging folder it created (a ``shard`` build only
            when ``alone()``, and never a staged shard).
        alone: whether a ``shard`` build is now its staging folder's only user (its lock's;
            None: a failed ``shard`` build keeps the folder).
        log: where the lines on progress and the result go (default ``print``).
        warn: where warnings go (default: stderr, after ``warning: ``): ``--queries`` fewer
            than the target needs to be shown with the tuner's confidence
            (:func:`~rag_fast.retrieval.tuning.min_tuning_queries`).
    Returns:
        ``out`` as a Path; with ``shard``, the shard's embeddings file.
    Raises:
        ValueError: a bad setting, an unknown encoder, a factory string faiss cannot parse,
            encoders of different dimensions, a staging folder another build holds, or one
            the build would remove that holds what no build staged there.
        OSError, rag_fast.storage.StorageError: unreadable inputs, a full disk, an output
            folder that is not ours to replace.
    """
    _check_out(out)
    shown, out = os.fspath(out), Path(out)  # paths in messages as given
    if not 0.0 < target_recall <= 1.0:
        raise ValueError(f"--target-recall must be in (0, 1], got {target_recall}")
    if batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {batch_size}")
    if split is not None and (isinstance(split, bool) or not isinstance(split, int) or split < 1):
        raise ValueError(f"--split must be a number of words >= 1, got {split!r}")
    # before anything is read: the output (and its staging folder) apart from every input, and
    # only ever an empty folder or an index directory (replaced with overwrite)
    inputs = {"--passages": passages, "--encoder": encoder, "--query-encoder": query_encoder,
              "--queries": queries}
    staging = staging_folder(out)
    check_apart(shown, "--out", inputs)
    check_apart(staging, "--out's staging folder", inputs)
    check_output_folder(shown, BUNDLE_KIND, overwrite=overwrite, flag="--out")
    _check_staging_path(staging)
    shard = parse_shard(shard) if shard is not None else None
    if shard is not None and remove_staging:
        raise ValueError("--remove-staging: only for the build without --shard (the one that "
                         "merges the staged shards into --out); a --shard build adds its shard "
                         "to the staging folder")
    questions = read_tuning_questions(queries) if queries is not None else None
    # the encoders first: a wrong name fails before the passages are read
    passage_encoder = _encoder("--encoder", encoder, pooling=pooling, max_length=max_length,
                               device=device)
    question_encoder = _encoder("--query-encoder", query_encoder, pooling=pooling,
                                max_length=max_length,
                                device="cpu") if query_encoder else passage_encoder
    if preset not in PRESETS:  # a factory string faiss cannot parse fails here too
        factory_index(preset, preset, passage_encoder.dim)
    key = _staging_key(passages, split, dedupe, encoder, pooling, max_length)
    created = not os.path.lexists(staging)
    try:
        with disk_errors(staging):  # its key, a few hundred bytes, may not fit either
            created = _claim_staging(staging, key, sharded=shard is not None, log=log) or created
        if shard is None:  # before any work: a staging it would remove holds only what builds staged
            _check_staging_removable(staging, remove_staging)
        store = _staged_store(passages, split, dedupe, staging, progress)
        # every check on sizes and settings before the (long) encoding
        gold = None  # --queries' gold questions, read (and checked) before the encoding
        if bm25:  # and a corpus whose BM25 index would not fit in memory refused
            check_memory(store)
            gold = read_gold_questions(queries, store) if queries is not None else ([], [])
        factory = plan_factory(preset, len(store), passage_encoder.dim, on_disk=on_disk)
        if preset in ("ivfpq", "hnsw") and factory == "Flat":
            log(f"preset {preset}: {len(store)} passages are fewer than {SMALL_CORPUS}, where "
                "exact search takes well under a millisecond and a quantiser has too little to "
                "train on, so the index is exact search (Flat)")
        if question_encoder.dim != passage_encoder.dim:
            raise ValueError(f"--query-encoder has dimension {question_encoder.dim}, --encoder "
                             f"{passage_encoder.dim}")
        if shard is not None:
            i, n = shard
            path = _stage_embeddings(passage_encoder, store, staging, shard, batch_size, progress)
            log(f"encoded shard {i}/{n} -> {path}. Once all {n} shards exist, either train on "
                f"them: under torchrun with {n} processes, with the training config's index set "
                f"to {{\"path\": {json.dumps(os.path.abspath(staging))}, \"sharded\": true}} "
                "(docs/distributed.md); "
                f"or merge them into one index directory {shown}: run this command without "
                f"--shard (it keeps {staging} unless given --remove-staging)")
            return path
        shards = _complete_shards(staging, len(store))
        if shards is None:
            shards = [_stage_embeddings(passage_encoder, store, staging, (0, 1), batch_size,
                                        progress)]
        embeddings = [_open_staged(f, passage_encoder.dim) for f in shards]
        vectors, source = None, None
        if factory != "Flat":  # exact search needs no measuring
            if questions is None:
                questions = stand_in_questions(store, TUNING_QUESTIONS)
                source = f"one sentence from each of {len(questions)} sampled passages"
            else:
                source = f"{len(questions)} questions from {queries}"
                if (message := small_sample_message(len(questions), target_recall, "--queries")):
                    (warn or _warn_stderr)(message)
            if progress:
                log(f"encoding {len(questions)} questions to measure the index on ({source})")
            vectors = question_encoder.encode_queries(questions).numpy()
        with warnings.catch_warnings():  # a small --queries is said above, naming the flag
            warnings.simplefilter("ignore", SmallSampleWarning)
            try:
                index = DenseIndex.build(embeddings, preset, progress=progress,
                                         on_disk=on_disk, target_recall=target_recall,
                                         queries=vectors, query_source=source)
            except NonFiniteError as e:  # a staged shard's values: named with its file
                path, row = _shard_of_row(shards, embeddings, e.row)
                raise ValueError(f"--out's staging folder: {path} has NaN or inf (row {row}); "
                                 "encode it again") from None
        with atomic_directory(out, overwrite=overwrite, kind=BUNDLE_KIND) as tmp, \
                disk_errors(shown):
            shutil.copytree(store.root, tmp / "passages", ignore=shutil.ignore_patterns("tokens"))
            try:
                index.save(tmp / "index")
            except NoSpaceError as e:  # named in --out, not in its temporary
                raise NoSpaceError(os.path.join(shown, "index"), e.needed, e.free,
                                   e.errno) from None
            files = ["passages/manifest.json", "index/manifest.json"]
            if bm25:  # with the weighted fusion's weight tuned on the tuning questions
                said = []
                build_part(store, tmp / BM25_PART, tune=lambda part: said.append(tune_part(
                    part, store, lambda q: question_encoder.encode_queries(q).numpy(),
                    index.search, queries, gold=gold)))
                log(said[0])
                files.append(BM25_MANIFEST)
            write_manifest(tmp / "manifest.json", {
                "parts": part_digests(tmp, files),
                "kind": BUNDLE_KIND, "format": 1, "passages_source": str(passages),
                "passages_sha256": key["passages_sha256"],
                "encoder": passage_encoder.describe(),
                "query_encoder": question_encoder.describe(),
                "files": describe_files(tmp, files),
            })
    except BaseException:  # KeyboardInterrupt too: the staging this build made goes with it
        # a --shard build's only while no other build uses it (staged shards are kept anyway)
        if created and (shard is None or (alone is not None and alone())):
            with contextlib.suppress(OSError):
                _discard_staging(staging, remove=False)
        raise
    kept = _discard_staging(staging, remove_staging)
    quality = index.describe()["search_quality"]
    settings = ", ".join(f"{k}={v}" for k, v in index.params.items() if k != "rerank" or
                         index.factory != "Flat")
    where = " (inverted lists memory-mapped when opened)" if index.on_disk else ""
    log(f"built {factory}{where} over {len(index)} passages ({index.dim}-d) -> {shown}; "
        + describe_quality(quality, index.factory)
        + (f"; search defaults {settings}" if settings else ""))
    if kept:
        log(kept)
    return out


def _shard_sets(staging: Path) -> dict[int, int]:
    """{n: shards staged} of the ``--shard`` sets (n >= 2) in ``staging``
    (``embeddings-0-of-1.npy`` is the build without shards' own)."""
    sets: dict[int, int] = {}
    for entry in staging.iterdir():
        m = _SHARD_FILE.fullmatch(entry.name)
        if m and int(m[2]) >= 2:
            sets[int(m[2])] = sets.get(int(m[2]), 0) + 1
    return sets


def _remove_entry(staging: Path, entry: Path) -> None:
    """Remove ``entry``, one of what builds staged in ``staging``. A folder is first moved
    into a temporary folder (:func:`_temporary`), so that a kill part-way leaves a leftover
    the next build removes, never a broken folder it would have to refuse."""
    if entry.is_symlink() or not entry.is_dir():
        entry.unlink(missing_ok=True)
    elif _TEMPORARY.fullmatch(entry.name):
        shutil.rmtree(entry, ignore_errors=True)
    else:
        with _temporary(staging, entry.name) as tmp:
            os.rename(entry, tmp / entry.name)


def _discard_staging(staging: Path, remove: bool) -> str | None:
    """After a build, or a failed one that created ``staging``: remove what builds staged there
    (:func:`_staging_entries`), entry by entry and ``key.json`` last, then the folder. One that
    holds shards of a ``--shard`` set is kept unless ``remove``: only the single build's own
    ``embeddings-0-of-1.npy`` (and its record) goes. What no build staged stays, and with it
    the folder; so does everything while a build is still writing there.

    Returns:
        A line on what was kept and why; None when the folder is gone.
    """
    if staging.is_symlink() or not staging.is_dir():
        return None
    sets = _shard_sets(staging)
    if sets and not remove:
        own = staging / _shard_name(0, 1)
        if own.exists() and _matches_record(own, verify=False):
            own.unlink()
        record = staging / _record_name(0, 1)
        if not os.path.lexists(own) and _read_record(record) is not None:
            record.unlink()
        kept = ", ".join(f"{count} of {n} shards (embeddings-i-of-{n}.npy)"
                         for n, count in sorted(sets.items()))
        return (f"kept the staging folder {staging} with its {kept}, which training on a "
                "sharded index reads (\"sharded\": true); run with --remove-staging to remove it")
    staged = _staging_entries(staging, verify=False)
    if staged.writers:
        return (f"kept the staging folder {staging}: another build is still writing it "
                f"({staged.writers[0]})")
    for entry in sorted(staged.ours, key=lambda e: e.name == STAGING_KEY):
        _remove_entry(staging, entry)
    if staged.others:
        more = f" and {len(staged.others) - 1} more" if len(staged.others) > 1 else ""
        return (f"kept the staging folder {staging}: it holds {staged.others[0]}{more} that "
                "rag_fast did not write (what the builds staged there is removed)")
    with contextlib.suppress(OSError):  # something new there: kept
        staging.rmdir()
    return None


def load_index_bundle(directory: str | Path, verify: bool = False):
    """``(manifest, store, index)`` of an index directory: the bundle manifest (its seal and
    its parts' checksums checked), the PassageStore and the DenseIndex (``verify``: every
    file's SHA-256, else the sizes)."""
    root = Path(directory)
    manifest = read_manifest(root, BUNDLE_KIND, verify=True)
    store = PassageStore.load(root / "passages", verify=verify)
    index = DenseIndex.load(root / "index", verify=verify, expected_dim=manifest["encoder"]["dim"])
    return manifest, store, index


__all__ = ["BUNDLE_KIND", "STAGING_KEY", "TUNING_QUESTIONS", "build_index_bundle",
           "describe_quality", "load_index_bundle", "read_tuning_questions", "staging_folder"]
