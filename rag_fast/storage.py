"""On-disk helpers shared by the passage store and the index: atomic directories, manifests
with checksums, ragged arrays.

Every directory we write is assembled under a temporary sibling name and swapped into place
in one step (``renameat2(RENAME_EXCHANGE)`` on Linux), so a crash, a kill or an interrupt
leaves either the old directory or the new one at the output path, never a half-written one
and never nothing. Where the exchange is unavailable the swap takes two renames; a writer
killed between them leaves the path empty for a moment, and the next open or save of that
path (:func:`recover_directory`) puts the complete directory back. Leftovers of killed writers
(siblings named ``.NAME.{tmp,new,old,trash}-PID-*`` whose PID is no longer alive) are removed
by the next save.

Every manifest lists each file's size and SHA-256; loading checks the sizes always and the
checksums unless told not to. The checksum is SHA-256 streamed in 8 MiB reads (OpenSSL via
hashlib, one core, constant memory); its measured rate, and why not BLAKE2b, are in
``docs/tuning.md`` ("Verifying files on load"). A cold cache adds the disk's read time.
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import json
import os
import re
import secrets
import shutil
import stat
from pathlib import Path, PurePosixPath
from typing import IO, Iterable, Iterator

import numpy as np

MANIFEST = "manifest.json"
_CHUNK = 1 << 23  # 8 MiB per read while hashing
_SHA256 = re.compile(r"[0-9a-f]{64}")


class StorageError(ValueError):
    """A stored directory is missing, corrupt, truncated or does not match what was asked."""


def sha256_file(path: Path) -> str:
    """Streamed SHA-256 of a file (constant memory; its rate: the module doc)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def describe_files(root: Path, names: list[str]) -> dict[str, dict]:
    """{name: {"bytes": size, "sha256": digest}} for files under ``root``."""
    return {n: {"bytes": (root / n).stat().st_size, "sha256": sha256_file(root / n)} for n in names}


def write_json(path: Path, payload: dict) -> None:
    """Write ``payload`` as JSON, fsynced (callers write into a directory that is renamed into
    place afterwards, so the file itself need not be atomic)."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(payload, f, indent=2, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


# ---- seals: a manifest covers its own content ------------------------------------------------
SEAL = "seal"
RESEAL_HINT = "rag-fast reseal"


def content_digest(payload: dict) -> str:
    """SHA-256 of ``payload`` (without its ``seal`` key) as canonical JSON: sorted keys, no
    whitespace, UTF-8. Formatting, key order and the seal itself do not change it."""
    body = {k: v for k, v in payload.items() if k != SEAL}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      allow_nan=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def sealed(payload: dict) -> dict:
    """``payload`` with its ``seal``: ``{"sha256": content_digest(payload)}``."""
    return {**{k: v for k, v in payload.items() if k != SEAL},
            SEAL: {"sha256": content_digest(payload)}}


def write_manifest(path: Path, payload: dict) -> None:
    """Write a sealed manifest (see :func:`check_seal`)."""
    write_json(path, sealed(payload))


def reseal_command(folder: str | os.PathLike) -> str:
    return f"{RESEAL_HINT} {os.fspath(folder)}"


def check_seal(path: str | os.PathLike, payload: dict, folder: str | os.PathLike | None = None
               ) -> dict:
    """``payload`` (read from ``path``) without its seal, after checking that the seal matches
    its content: a manifest edited by hand, or one whose seal was removed, is refused.

    Raises:
        StorageError: naming ``path``, and ``rag-fast reseal FOLDER`` as the way to accept an
            edit made on purpose.
    """
    folder = folder if folder is not None else os.path.dirname(os.fspath(path)) or "."
    seal = payload.get(SEAL)
    accept = (f"if the edit was on purpose, accept it with `{reseal_command(folder)}`; "
              "otherwise rebuild or restore it")
    if seal is None:
        raise StorageError(f"{path} has no seal (written by an earlier rag_fast, or the seal "
                           f"was removed), so an edit could not be told from the original: "
                           f"{accept}")
    try:
        digest = content_digest(payload)
    except ValueError as e:  # NaN or infinity: never written by rag_fast
        raise StorageError(f"{path}: not a manifest rag_fast wrote ({e})") from None
    if not isinstance(seal, dict) or seal.get("sha256") != digest:
        raise StorageError(f"{path} was changed after rag_fast wrote it (its seal does not match "
                           f"its content): {accept}")
    return {k: v for k, v in payload.items() if k != SEAL}


def listed_path(root: Path, name: object, where: str | os.PathLike) -> Path:
    """``root / name`` for a path a manifest lists, after checking that it is relative,
    normalised and inside ``root`` (symbolic links included), before anything is opened.

    Raises:
        StorageError: naming the manifest ``where`` and the entry.
    """
    ok = isinstance(name, str) and name and "\\" not in name and "\0" not in name
    if ok:
        pure = PurePosixPath(name)
        ok = (not pure.is_absolute() and ".." not in pure.parts and "." not in name.split("/")
              and str(pure) == name)
    if not ok:
        raise StorageError(f"{where}: key 'files' lists {name!r:.120}, expected a relative, "
                           "normalised path inside the directory (no '..', no leading '/')")
    path = Path(root) / name
    real_root = os.path.realpath(root)
    real = os.path.realpath(path)
    if os.path.commonpath([real_root, real]) != real_root:
        raise StorageError(f"{where}: key 'files' lists {name!r}, which leads outside "
                           f"{os.fspath(root)!r} (a symbolic link); refused")
    return path


def check_files_entry(manifest_path: str | os.PathLike, files: object,
                      root: Path | None = None) -> dict[str, dict]:
    """The ``files`` entry of a manifest, validated: a non-empty {relative path: {"bytes": int
    >= 0, "sha256": 64 lowercase hex digits}}, every path inside ``root`` (default: the
    manifest's folder)."""
    root = Path(root) if root is not None else Path(manifest_path).parent
    if not isinstance(files, dict) or not files:
        raise StorageError(f"{manifest_path}: key 'files' must be a non-empty object "
                           f"{{name: {{'bytes', 'sha256'}}}}, got {files!r:.80}")
    for name, meta in files.items():
        listed_path(root, name, manifest_path)
        if not isinstance(meta, dict):
            raise StorageError(f"{manifest_path}: key 'files.{name}' must be an object with 'bytes' "
                               f"and 'sha256', got {meta!r:.80}")
        size = meta.get("bytes")
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise StorageError(f"{manifest_path}: key 'files.{name}.bytes' must be an int >= 0, "
                               f"got {size!r:.80}")
        digest = meta.get("sha256")
        if not isinstance(digest, str) or not _SHA256.fullmatch(digest):
            raise StorageError(f"{manifest_path}: key 'files.{name}.sha256' must be 64 lowercase hex "
                               f"digits, got {digest!r:.80}")
    return files


# How errors name a kind of directory (the manifest's "kind" key) to a user.
KIND_WORDS = {"rag_fast.index_bundle": "an index directory from `rag-fast index build`",
              "rag_fast.passage_store": "a passage store (an index directory's passages/)",
              "rag_fast.dense_index": "a saved index (an index directory's index/)",
              "rag_fast.model": "a model directory (`rag-fast init`, RagModel.save)",
              "rag_fast.train_run": "a training run's folder (`rag-fast train`)",
              "rag_fast.eval": "an evaluation's folder (`rag-fast eval`)",
              "rag_fast.retrieval_eval": "a retrieval evaluation's folder (`rag-fast index eval`)",
              "rag_fast.refreshed_index": "a training run's refreshed index directory",
              "rag_fast.tokenized_passages": "a passage store's token cache",
              "rag_fast.tokenizer": "a tokenizer folder (`rag-fast tokenizer fit`)"}


# a manifest, marker or side file larger than this is not one of rag_fast's (they list a few
# files each: kilobytes); read whole, it could take all the memory (a link to /dev/zero)
MAX_JSON_FILE_BYTES = 16 << 20


def read_json_file(path: str | os.PathLike) -> object:
    """The JSON value of a manifest-like file, read only when it is a regular file of at most
    :data:`MAX_JSON_FILE_BYTES`.

    Raises:
        FileNotFoundError: nothing at ``path`` (a dangling link included).
        ValueError: naming ``path``: not a regular file (a folder, a device, a pipe), too
            large, not UTF-8 or not JSON.
    """
    st = os.stat(path)
    if not stat.S_ISREG(st.st_mode):
        what = ("a folder" if stat.S_ISDIR(st.st_mode) else "a named pipe"
                if stat.S_ISFIFO(st.st_mode) else "a device or a socket")
        link = f" (a symbolic link to {os.path.realpath(path)})" if os.path.islink(path) else ""
        raise ValueError(f"{os.fspath(path)} is {what}{link}, not a regular file")
    size = st.st_size
    if size > MAX_JSON_FILE_BYTES:
        raise ValueError(f"{os.fspath(path)} has {size:,} bytes, more than a rag_fast manifest "
                         f"ever holds ({MAX_JSON_FILE_BYTES:,} at most): not one")
    with open(path, "rb") as f:
        data = f.read(MAX_JSON_FILE_BYTES + 1)
    if len(data) > MAX_JSON_FILE_BYTES:
        raise ValueError(f"{os.fspath(path)} grew past {MAX_JSON_FILE_BYTES:,} bytes while read")
    try:
        return json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{os.fspath(path)} is not valid JSON ({exc})") from None


MANIFEST_FORMATS = (1,)  # the "format" every manifest.json of this version writes and reads


def read_manifest(root: Path, kind: str, verify: bool = True,
                  formats: tuple[int, ...] | None = MANIFEST_FORMATS) -> dict:
    """Read ``root/manifest.json`` of the given ``kind`` and check the files it lists.

    First recovers ``root`` if a killed save left it missing (see :func:`recover_directory`).

    Raises:
        StorageError: the directory or manifest is missing or unreadable, the kind differs,
            the ``files`` entry is missing or malformed, a file is missing, has the wrong size
            (truncated) or the wrong checksum (corrupt).
    """
    root = Path(root)
    recover_directory(root)
    if not root.is_dir():
        raise StorageError(f"path {str(root)!r} is not a directory (expected "
                           f"{KIND_WORDS.get(kind, f'a saved {kind}')})")
    try:
        manifest = read_json_file(root / MANIFEST)
    except FileNotFoundError:
        raise StorageError(
            f"{str(root)!r} has no {MANIFEST}: not {KIND_WORDS.get(kind, f'a saved {kind}')}, or "
            "its build was interrupted"
        ) from None
    except ValueError as exc:
        raise StorageError(str(exc)) from None
    except OSError as exc:
        raise StorageError(f"{root / MANIFEST} cannot be read: {exc.strerror or exc}") from None
    if not isinstance(manifest, dict) or manifest.get("kind") != kind:
        found = manifest.get("kind") if isinstance(manifest, dict) else None
        raise StorageError(f"{root / MANIFEST} describes a {found!r}, expected a {kind!r}")
    if formats is not None and "format" in manifest and (
            type(manifest["format"]) is not int or manifest["format"] not in formats):
        raise StorageError(f"{root / MANIFEST}: key 'format' is {manifest['format']!r}: this "
                           f"rag_fast reads format {', '.join(map(str, formats))} only (written "
                           "by another version, or edited; rebuild it)")
    if "files" not in manifest:
        raise StorageError(f"{root / MANIFEST}: missing key 'files' (each file's bytes and sha256); "
                           "nothing could be checked")
    manifest = check_seal(root / MANIFEST, manifest)
    for name, meta in check_files_entry(root / MANIFEST, manifest["files"], root).items():
        path = root / name
        if not path.is_file():
            raise StorageError(f"{kind} file {str(path)!r} listed in the manifest is missing")
        edited = (f" (a manifest edited by hand? `{reseal_command(root)}` accepts the edit)"
                  if name.endswith(".json") else "")
        size = path.stat().st_size
        if size != meta["bytes"]:
            raise StorageError(
                f"{kind} file {str(path)!r} has {size} bytes, the manifest says {meta['bytes']} "
                f"(truncated or overwritten){edited}"
            )
        if verify and sha256_file(path) != meta["sha256"]:
            raise StorageError(
                f"{kind} file {str(path)!r} fails its SHA-256 checksum (corrupt); rebuild it{edited}"
            )
    return manifest


def _load_json(path: Path) -> dict:
    try:
        payload = read_json_file(path)
    except (OSError, ValueError) as e:
        raise StorageError(f"{path}: cannot be read as JSON ({e})") from None
    if not isinstance(payload, dict) or not isinstance(payload.get("kind"), str):
        raise StorageError(f"{path}: not a rag_fast manifest (no 'kind')")
    return payload


def part_digests(root: Path, names: list[str]) -> dict[str, str]:
    """{part manifest: SHA-256 of the ``files`` it lists} for a bundle's parts: what the parts'
    data were when the bundle was built, so that ``reseal`` tells an edit of a part's manifest
    (same data) from a part of another build (other data)."""
    out = {}
    for name in names:
        files = _load_json(Path(root) / name).get("files")
        out[name] = content_digest({"files": files})
    return out


def _seal_matches(payload: dict) -> bool:
    seal = payload.get(SEAL)
    try:
        return isinstance(seal, dict) and seal.get("sha256") == content_digest(payload)
    except ValueError:
        return False


def reseal(folder: str | os.PathLike) -> list[Path]:
    """Accept hand edits of a rag_fast folder's manifest: seal it again (``rag-fast reseal``).

    ``folder`` is an index directory (its ``manifest.json`` and those of ``passages/`` and
    ``index/``), one of those parts (its bundle is resealed with it), or a model directory
    (``rag_fast.json``). Only the manifests are accepted as they are: every other file they
    list must still have its recorded size and SHA-256, so a corrupt data file is never sealed
    over; a ``passages/`` or ``index/`` part whose record differs while its own seal holds (a
    part of another build) is refused. In a model directory, files it does not list yet (added
    on purpose) are listed. Loading still checks every key of the resealed manifest.

    Returns:
        The manifests rewritten (empty when every seal already matched).
    Raises:
        StorageError: ``folder`` is no rag_fast folder, a listed file is missing or differs
            from its record, or a part comes from another build (named).
    """
    folder = Path(folder)
    parent = folder.resolve().parent
    if (parent / MANIFEST).is_file() and folder.name in ("passages", "index"):
        try:
            outer = _load_json(parent / MANIFEST)
        except StorageError:
            outer = {}
        if f"{folder.name}/{MANIFEST}" in (outer.get("files") or {}):
            return reseal(parent)
    for name in (MANIFEST, "rag_fast.json"):
        if (folder / name).is_file():
            return _reseal_file(folder, folder / name)
    raise StorageError(f"{os.fspath(folder)!r} holds no rag_fast manifest (manifest.json or "
                       "rag_fast.json): nothing to reseal")


def _reseal_file(root: Path, path: Path) -> list[Path]:
    payload = _load_json(path)
    files = check_files_entry(path, payload.get("files"), root)
    written: list[Path] = []
    updated = dict(files)
    for name, meta in files.items():
        listed = root / name
        if not listed.is_file():
            raise StorageError(f"{listed}: listed in {path} but missing; not resealed")
        if name.endswith("/" + MANIFEST) and listed.parent != root:  # a part of a bundle
            part = _load_json(listed)
            unchanged = describe_files(root, [name])[name] == meta
            recorded = (payload.get("parts") or {}).get(name)
            # the data the part listed at build time; without that record (an index directory
            # of an earlier rag_fast) an edit cannot be told from a part of another build
            other = (recorded is None
                     or content_digest({"files": part.get("files")}) != recorded)
            if not unchanged and other:
                raise StorageError(f"{listed} is not the part this index directory was built "
                                   f"with (it lists other data than {path} recorded: a part of "
                                   "another build); not resealed: rebuild the index directory")
            written += _reseal_file(listed.parent, listed)
            updated[name] = describe_files(root, [name])[name]
            continue
        size = listed.stat().st_size
        if size != meta["bytes"] or sha256_file(listed) != meta["sha256"]:
            raise StorageError(f"{listed} differs from its record in {path} (a corrupt or "
                               "replaced file, not a manifest edit): not resealed; rebuild it")
    if path.name == "rag_fast.json":  # a model directory: files added on purpose are listed
        for file in sorted(p for p in root.rglob("*") if p.is_file() or p.is_symlink()):
            name = file.relative_to(root).as_posix()
            if name != path.name and name not in updated:
                listed_path(root, name, path)
                updated[name] = describe_files(root, [name])[name]
    new = {**payload, "files": updated}
    if payload.get("kind") == "rag_fast.index_bundle" and "parts" not in payload:
        new["parts"] = part_digests(root, [n for n in updated if n.endswith("/" + MANIFEST)])
    if updated == files and _seal_matches(payload):
        return written
    try:
        text = json.dumps(sealed(new), indent=2, sort_keys=True, ensure_ascii=False,
                          allow_nan=False)
    except ValueError as e:  # NaN or infinity: not JSON, never written by rag_fast
        raise StorageError(f"{path}: cannot be sealed: {e} (NaN or an infinite number in a "
                           "value; give a finite number)") from None
    atomic_write_bytes(path, text.encode("utf-8"))
    return written + [path]


# ---- atomic directories ---------------------------------------------------------------------
_TAGS = ("tmp", "new", "old", "trash")
_AT_FDCWD, _RENAME_EXCHANGE = -100, 2
_renameat2 = None
try:
    _renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    _renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    _renameat2.restype = ctypes.c_int
except (AttributeError, OSError):  # not glibc >= 2.28 / not Linux
    _renameat2 = None


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two existing paths; False where the OS or file system cannot."""
    if _renameat2 is None:
        return False
    if _renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EPERM):
        return False
    raise OSError(err, f"cannot swap {str(a)!r} and {str(b)!r}: {os.strerror(err)}")


def pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return True
    return True


def _sibling(out: Path, tag: str) -> Path:
    return out.parent / f".{out.name}.{tag}-{os.getpid()}-{secrets.token_hex(4)}"


def _leftovers(out: Path) -> list[tuple[str, Path]]:
    """(tag, path) of the siblings of ``out`` left by writers that are no longer alive."""
    pattern = re.compile(rf"\.{re.escape(out.name)}\.({'|'.join(_TAGS)})-(\d+)-[0-9a-f]+")
    found = []
    try:
        entries = list(out.parent.iterdir())
    except OSError:
        return []
    for entry in entries:
        m = pattern.fullmatch(entry.name)
        if m and not pid_alive(int(m.group(2))):
            found.append((m.group(1), entry))
    return found


def recover_directory(out: str | os.PathLike) -> bool:
    """Put back a directory that a save killed between its two renames left missing.

    When ``out`` does not exist: the newest complete new directory of a dead writer
    (``.NAME.new-PID-*``) is renamed into place, else the newest old directory one moved aside
    (``.NAME.old-PID-*``, or the ``.NAME.old-*/old`` of earlier versions of this library).
    Best effort: returns whether ``out`` was restored and never raises (a read-only parent is
    left alone).
    """
    out = Path(out)
    try:
        if out.exists() or out.is_symlink() or not out.parent.is_dir():
            return False
        dead = _leftovers(out)

        def by_age(paths) -> list[Path]:
            return sorted(paths, key=lambda p: p.stat().st_mtime, reverse=True)

        legacy = re.compile(rf"\.{re.escape(out.name)}\.old-[A-Za-z0-9_]+")
        candidates = (by_age(p for tag, p in dead if tag == "new")
                      + by_age(p for tag, p in dead if tag == "old")
                      + by_age(p / "old" for p in out.parent.iterdir()
                               if legacy.fullmatch(p.name) and (p / "old").is_dir()))
        if not candidates:
            return False
        os.rename(candidates[0], out)
        if candidates[0].name == "old":  # legacy: drop the now empty holder
            with contextlib.suppress(OSError):
                candidates[0].parent.rmdir()
        return True
    except OSError:
        return False


def remove_leftovers(out: Path) -> None:
    """Remove the temporary siblings of ``out`` whose writers are no longer alive."""
    for _, path in _leftovers(out):
        shutil.rmtree(path, ignore_errors=True)


# ---- what an output folder is, and whether a command may write it ---------------------------
# The file that says what a folder rag_fast wrote is, by kind: its manifest (index bundle,
# passage store, saved index, token cache), a model's side file, or the marker of a training
# run, an evaluation or a fitted tokenizer.
OUTPUT_MARKER = "rag_fast-output.json"
RUN_KIND, EVAL_KIND = "rag_fast.train_run", "rag_fast.eval"
RETRIEVAL_EVAL_KIND = "rag_fast.retrieval_eval"  # `rag-fast index eval --out`
TOKENIZER_KIND = "rag_fast.tokenizer"  # `rag-fast tokenizer fit`'s folder (rag_fast.tokenization)
REFRESHED_KIND = "rag_fast.refreshed_index"  # a training run's index/ after refreshes
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
    ...), read from its marker file; None when it has none (or is not a folder)."""
    path = Path(path)
    for name in _MARKER_FILES:
        marker = path / name
        if not marker.is_file():
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
    return sorted(str(p.relative_to(root)) for p in found if p not in owned)


def _is_empty_dir(path: Path) -> bool:
    try:
        with os.scandir(path) as entries:
            return next(entries, None) is None
    except OSError:
        return False


def check_output_folder(out: str | os.PathLike, kind: str, *, overwrite: bool = False,
                        flag: str = "output", reuse: bool = False) -> None:
    """Refuse to write the folder ``out`` where that could destroy what rag_fast did not write.

    ``out`` may be missing or an empty folder. An existing folder of the same ``kind`` (its
    marker says so) is replaced only with ``overwrite``, or written into with ``reuse`` (a
    training run resuming, an evaluation written again). Anything else is refused, whatever
    ``overwrite`` says: a file, a folder of another kind, one that holds files rag_fast did not
    write, or (unless ``reuse``) a symbolic link, which a replacement would swap out.

    Raises:
        FileExistsError: naming ``flag`` and ``out``, and what to do instead.
    """
    out = Path(out)
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
    if _is_empty_dir(out):
        return
    found = folder_kind(out)
    if found == kind:
        if reuse:
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
    what = (f"is {KIND_WORDS.get(found, found)}, not {words}" if found is not None else
            "holds files rag_fast did not write")
    # a command that writes into its own folder again (reuse: train, eval) has no --overwrite
    rule = ("rag_fast writes only into a folder of its own kind" if reuse else
            "even with --overwrite, rag_fast replaces only a folder of its own kind")
    raise FileExistsError(f"{flag} {str(out)!r} {what}; refused ({rule}): choose another path "
                          "or an empty folder")


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


def write_marker(folder: str | os.PathLike, kind: str, **extra) -> None:
    """Mark ``folder`` (created if missing) as a rag_fast output of ``kind`` (atomically)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(folder / OUTPUT_MARKER, json.dumps(
        {"kind": kind, "format": 1, **extra}, indent=1, sort_keys=True).encode("utf-8"))


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


def fsync_dir(folder: str | os.PathLike) -> None:
    """Make renames in ``folder`` durable (where the OS allows opening a folder)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(path: str | os.PathLike, write) -> None:
    """``write(f)`` to a temporary file beside ``path`` (binary), fsync, then rename over
    ``path``; the temporary is removed on any failure (a full disk included). The folder of
    ``path`` is created when missing."""
    os.makedirs(os.path.dirname(os.path.abspath(os.fspath(path))), exist_ok=True)
    with atomic_file(path, "wb") as f:
        write(f)


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike, mode: str = "w") -> Iterator[IO]:
    """A file opened (``mode``: ``"w"`` text in UTF-8, or ``"wb"``) on a temporary beside
    ``path`` that becomes ``path`` when the block ends normally: flushed, fsynced, renamed
    over ``path``, the rename made durable. On any failure (a full disk: a
    :class:`NoSpaceError` naming ``path``; an interruption) the temporary is removed and
    ``path`` is as it was. The folder of ``path`` must exist."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    tmp = f"{path}.tmp-{os.getpid()}"
    encoding = None if "b" in mode else "utf-8"
    try:
        with disk_errors(path):
            with open(tmp, mode, encoding=encoding) as f:
                yield f
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        fsync_dir(folder)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)


# ---- one writer at a time ------------------------------------------------------------------
# An output is locked while a command writes it: a second command given the same output (the
# same folder by any path: the lock is keyed by its real path) is refused at once, naming the
# holder, instead of racing the first for the temporary files. The lock is filelock's (flock on
# Unix), on a file in a folder of this user's under the system's temporary folder, so that
# nothing is written beside or inside the output; the kernel drops it when the holder exits,
# however it ends. It is one machine's lock: two machines writing one network folder are not
# kept apart.
_LOCKS = "rag_fast-locks"


class OutputLockedError(FileExistsError):
    """Another process writes the same output now."""


def _lock_folder() -> Path:
    """This user's lock folder (created 0700), refused unless it is a folder the user owns."""
    import tempfile

    folder = Path(tempfile.gettempdir()) / f"{_LOCKS}-{os.getuid()}"
    with contextlib.suppress(FileExistsError):
        folder.mkdir(mode=0o700)
    info = folder.lstat()
    if not folder.is_dir() or folder.is_symlink() or info.st_uid != os.getuid():
        raise OSError(errno.EPERM, f"the lock folder {folder} is not a folder of this user's "
                      "(a symbolic link, or another user's); remove it or set TMPDIR")
    return folder


def _lock_holder(lock_file: Path) -> int | None:
    """The process id holding a flock on ``lock_file`` (/proc/locks, Linux), else None."""
    try:
        inode = lock_file.stat().st_ino
        with open("/proc/locks") as f:
            for line in f:  # "1: FLOCK  ADVISORY  WRITE 1234 00:2f:5678 0 EOF"
                fields = line.split()
                if len(fields) > 5 and fields[1] == "FLOCK" and \
                        fields[5].rsplit(":", 1)[-1] == str(inode):
                    return int(fields[4])
    except (OSError, ValueError):
        return None
    return None


@contextlib.contextmanager
def output_lock(out: str | os.PathLike, flag: str = "output") -> Iterator[None]:
    """Hold the lock of the output ``out`` (a folder or a file, existing or not) for the block.

    Raises:
        OutputLockedError: another process holds it; the message names ``flag``, ``out`` as
            given and the holder's process id where the system tells it.
    """
    from filelock import FileLock, Timeout

    real = os.path.realpath(os.path.abspath(os.fspath(out)))
    key = hashlib.sha256(os.fsencode(real)).hexdigest()[:32]
    lock_file = _lock_folder() / f"{key}.lock"
    lock = FileLock(str(lock_file), timeout=0)
    try:
        lock.acquire()
    except Timeout:
        holder = _lock_holder(lock_file)
        who = f"process {holder}" if holder is not None else "another process"
        raise OutputLockedError(
            f"{flag} {os.fspath(out)!r} is being written by {who} (another rag-fast command "
            "with the same output); refused: wait for it to end, or choose another "
            "path") from None
    try:
        yield
    finally:
        lock.release()


@contextlib.contextmanager
def shared_lock(path: str | os.PathLike, shared: bool, flag: str, who: str) -> Iterator[None]:
    """Hold a lock on ``path`` (a folder, existing or not; keyed like :func:`output_lock`)
    for the block: ``shared`` with the other holders of a shared lock, or exclusive. The
    ``--shard`` builds of one index hold it shared on its staging folder and a full build
    exclusive, so a full build never discards or removes a staging folder that a shard build
    is writing, and a shard build never writes one a full build is working in.

    Raises:
        OutputLockedError: the other kind is held; the message names ``flag``, ``path`` as
            given, ``who`` holds it and its process id where the system tells it.
    """
    import fcntl

    real = os.path.realpath(os.path.abspath(os.fspath(path)))
    key = hashlib.sha256(b"shared:" + os.fsencode(real)).hexdigest()[:32]
    lock_file = _lock_folder() / f"{key}.lock"
    fd = os.open(lock_file, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _lock_holder(lock_file)
            pid = f" (process {holder})" if holder is not None else ""
            raise OutputLockedError(
                f"{flag} {os.fspath(path)!r} is in use by {who}{pid}; refused: wait for it to "
                "end") from None
        yield
    finally:
        os.close(fd)  # (the lock goes with it)


# ---- a full disk ---------------------------------------------------------------------------
class NoSpaceError(OSError):
    """The disk (or the user's quota) has no room for a file being written: one line naming
    the file, the bytes it needs and the bytes free (``errno`` is ``ENOSPC`` or ``EDQUOT``)."""

    def __init__(self, path: str | os.PathLike, needed: int | None, free: int | None,
                 code: int = errno.ENOSPC):
        what = "disk quota exceeded" if code == errno.EDQUOT else "no space left on device"
        message = f"{what} writing {os.fspath(path)}"
        if needed is not None:
            message += f": needs {needed} bytes ({_mib(needed)})"
        if free is not None:
            message += f"{',' if needed is not None else ':'} {free} free ({_mib(free)})"
        super().__init__(code, message)
        self.path, self.needed, self.free = os.fspath(path), needed, free

    def __str__(self) -> str:
        return self.strerror

    def __reduce__(self):
        return type(self), (self.path, self.needed, self.free, self.errno)


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def disk_free(path: str | os.PathLike) -> int | None:
    """Bytes free for an unprivileged writer on the filesystem of ``path`` (or of its nearest
    existing parent), or None where the system cannot say."""
    path = Path(path)
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return int(shutil.disk_usage(path).free)
    except OSError:
        return None


def is_no_space(exc: BaseException) -> bool:
    """Whether ``exc`` says the disk (or the quota) is full."""
    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)


def no_space(exc: OSError, path: str | os.PathLike, needed: int | None = None) -> OSError:
    """``exc`` as a :class:`NoSpaceError` naming ``path`` when it says the disk is full, else
    ``exc`` itself. The free space is read now (after the caller removed its temporary
    files); a :class:`NoSpaceError` keeps the file and the bytes it names."""
    if isinstance(exc, NoSpaceError):
        return NoSpaceError(exc.path, exc.needed, disk_free(exc.path), exc.errno)
    if not is_no_space(exc):
        return exc
    return NoSpaceError(path, needed, disk_free(path), exc.errno)


def reserve_space(fd: int, path: str | os.PathLike, nbytes: int) -> None:
    """Allocate ``nbytes`` on disk for the open file ``fd`` (written as ``path``) before any
    of it is written, so that a full disk is reported now, as one :class:`NoSpaceError`,
    rather than part-way through (or, for a file written through a memory map, as a SIGBUS
    that kills the process). On a filesystem that cannot allocate ahead, the free space is
    checked instead and the file extended, and the writes themselves report a full disk.

    Raises:
        NoSpaceError: the filesystem has fewer than ``nbytes`` free.
        OSError: another error of the filesystem.
    """
    try:
        os.posix_fallocate(fd, 0, nbytes)
        return
    except AttributeError:  # no posix_fallocate on this platform
        pass
    except OSError as exc:
        if is_no_space(exc):
            raise NoSpaceError(path, nbytes, disk_free(path), exc.errno) from None
        if exc.errno not in (errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL, errno.ENOSYS):
            raise
    free = disk_free(path)
    if free is not None and free < nbytes:
        raise NoSpaceError(path, nbytes, free)
    os.ftruncate(fd, nbytes)


_NEARLY_FULL = 64 << 20  # free bytes below which a failed write is taken for a full disk


@contextlib.contextmanager
def disk_errors(path: str | os.PathLike) -> Iterator[None]:
    """Say a full disk as a :class:`NoSpaceError` naming ``path`` when a library writing
    ``path`` fails its own way: its message names the full disk (safetensors, faiss), or it is
    a RuntimeError while the disk holding ``path`` is nearly full (``torch.save``, whose error
    gives no reason). Other failures pass unchanged."""
    try:
        yield
    except NoSpaceError:
        raise
    except OSError as e:
        if is_no_space(e) or _copies_found_no_space(e):
            raise NoSpaceError(path, None, disk_free(path), e.errno or errno.ENOSPC) from None
        if e.errno == errno.EFBIG:
            raise _too_large(path) from None
        raise
    except Exception as e:
        if _interrupted(e):  # Ctrl-C inside the library's write, hidden by its own error
            raise KeyboardInterrupt from None
        if isinstance(e, RuntimeError) and _file_size_limit() is not None:
            # torch.save's writer met the process's file size limit (EFBIG, no reason given)
            raise _too_large(path) from None
        text = str(e)
        free = disk_free(path)
        says_so = "No space left" in text or "os error 28" in text or "ENOSPC" in text
        # torch.save's RuntimeError on a full disk names no reason ("unexpected pos ...")
        guess = isinstance(e, RuntimeError) and free is not None and free < _NEARLY_FULL
        if says_so or guess:
            raise NoSpaceError(path, None, free) from None
        raise


def _copies_found_no_space(exc: OSError) -> bool:
    """Whether ``exc`` is ``shutil.copytree``'s list of failed copies (a ``shutil.Error``,
    whose errno is None) holding one that found the disk full."""
    if not isinstance(exc, shutil.Error) or not exc.args or not isinstance(exc.args[0], list):
        return False
    return any(isinstance(failed, tuple) and any(
        f"[Errno {code}]" in str(part) for part in failed for code in (errno.ENOSPC, errno.EDQUOT))
        for failed in exc.args[0])


def _interrupted(exc: BaseException) -> bool:
    """Whether ``exc`` was raised while a KeyboardInterrupt was being handled (torch.save's
    zip writer, interrupted mid-write, raises "unexpected pos" on its way out)."""
    seen: set[int] = set()
    cause = exc.__context__ or exc.__cause__
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, KeyboardInterrupt):
            return True
        seen.add(id(cause))
        cause = cause.__context__ or cause.__cause__
    return False


def _file_size_limit() -> int | None:
    """The most bytes this process may write to one file (``ulimit -f``), None: no limit."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    return None if soft == resource.RLIM_INFINITY else int(soft)


def _too_large(path: str | os.PathLike) -> OSError:
    """The one-line error of a write stopped by the file size limit (``ulimit -f``)."""
    limit = _file_size_limit()
    most = f" of {limit} bytes ({_mib(limit)})" if limit is not None else ""
    return OSError(errno.EFBIG, f"file too large writing {os.fspath(path)}: this process may "
                   f"write files{most} at most (ulimit -f); raise the limit")


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    atomic_write(path, lambda f: f.write(data))


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
    tmp = _sibling(out, "tmp")
    tmp.mkdir()
    mine = [tmp]  # what to remove at the end
    moved_aside: Path | None = None
    try:
        yield tmp
        if not out.exists():
            os.replace(tmp, out)
        elif not _exchange(tmp, out):  # (exchanged: out is the new directory, tmp the old one)
            new, old, trash = _sibling(out, "new"), _sibling(out, "old"), _sibling(out, "trash")
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


class RaggedArray:
    """Rows of different lengths as one flat array plus offsets: row i is
    ``values[offsets[i]:offsets[i+1]]``.

    Stored as ``<name>.values.bin`` (raw, the dtype is the caller's) and ``<name>.offsets.npy``
    (int64, N+1 entries), both memory-mapped on load, so millions of rows need no RAM until
    they are read.
    """

    def __init__(self, values: np.ndarray, offsets: np.ndarray):
        self.values = values
        self.offsets = offsets

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> np.ndarray:
        return self.values[self.offsets[i] : self.offsets[i + 1]]

    @staticmethod
    def files(name: str) -> list[str]:
        return [f"{name}.values.bin", f"{name}.offsets.npy"]

    @classmethod
    def load(cls, root: Path, name: str, dtype: np.dtype) -> "RaggedArray":
        offsets = np.load(root / f"{name}.offsets.npy", mmap_mode="r")
        path = root / f"{name}.values.bin"
        count = path.stat().st_size // np.dtype(dtype).itemsize
        if offsets.ndim != 1 or len(offsets) < 1 or int(offsets[-1]) != count:
            raise StorageError(f"ragged array {name!r} under {str(root)!r}: offsets do not match values")
        # np.memmap cannot map an empty file.
        values = np.memmap(path, dtype=dtype, mode="r") if count else np.zeros(0, dtype)
        return cls(values, offsets)


class RaggedWriter:
    """Append rows to a ragged array on disk without holding the values in memory."""

    def __init__(self, root: Path, name: str, dtype: np.dtype):
        self.root, self.name, self.dtype = root, name, np.dtype(dtype)
        self._values = open(root / f"{name}.values.bin", "wb")
        self._offsets = [0]

    def append(self, row: bytes | np.ndarray) -> None:
        data = row if isinstance(row, bytes) else np.ascontiguousarray(row, self.dtype).tobytes()
        self._values.write(data)
        self._offsets.append(self._offsets[-1] + len(data) // self.dtype.itemsize)

    def abandon(self) -> None:
        """Close the values file after a failure, dropping what it buffered (the folder it
        lies in is discarded): a full disk is said once, by the write that found it."""
        with contextlib.suppress(OSError):
            self._values.close()  # (once closed, a second close does nothing)

    def close(self) -> int:
        """Flush the values and write the offsets; returns the number of rows."""
        self._values.flush()
        os.fsync(self._values.fileno())
        self._values.close()
        np.save(self.root / f"{self.name}.offsets.npy", np.asarray(self._offsets, dtype=np.int64))
        return len(self._offsets) - 1
