"""Manifests: files listed with their size and SHA-256, sealed by a digest of their own
content, read back verified; JSON files read as small regular files only; ``reseal``."""
from __future__ import annotations

import hashlib
import json
import os
import re
import stat
from pathlib import Path, PurePosixPath


from .disk import atomic_write_bytes
from .swap import recover_directory

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
              "rag_fast.tokenizer": "a tokenizer folder (`rag-fast tokenizer fit`)",
              "rag_fast.bm25": "a BM25 part (an index directory's bm25/)"}


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
    except RecursionError:  # (Python's decoder recurses once per level)
        raise ValueError(f"{os.fspath(path)} is JSON nested too deeply to be read: not a file "
                         "rag_fast writes") from None


MANIFEST_FORMATS = (1,)  # the "format" every manifest.json of this version writes and reads


def _linked_manifest(path: Path) -> str:
    return (f"{path} is a symbolic link (to {os.readlink(path)!r}); refused: rag_fast writes "
            "its manifests as regular files, and a link may stand for another folder's")


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
    if (root / MANIFEST).is_symlink():  # it may stand for another folder's manifest
        raise StorageError(_linked_manifest(root / MANIFEST))
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
        if (folder / name).is_symlink():  # never sealed over: loading refuses it anyway
            raise StorageError(f"{_linked_manifest(folder / name)}; not resealed")
        if (folder / name).is_file():
            return _reseal_file(folder, folder / name)
    raise StorageError(f"{os.fspath(folder)!r} holds no rag_fast manifest (manifest.json or "
                       "rag_fast.json): nothing to reseal")


_SAVED_CONFIGS = ("config.json", "generation_config.json")
_WEIGHTS = (".safetensors", ".bin", ".pt", ".pth", ".ckpt")


# the tokenizer folders of a model directory and the files every save writes in them (a fast
# tokenizer's, as rag_fast saves both tokenizers)
_TOKENIZER_FOLDERS = ("generator_tokenizer", "question_encoder_tokenizer")
_SAVED_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def _written_by_every_save(name: str) -> bool:
    """Whether ``name`` (relative to a model directory) is a file its save writes for every
    model: weights anywhere, the configs at the top or of either model side by side, and the
    two files of each tokenizer folder."""
    parts = name.split("/")
    return name.endswith(_WEIGHTS) or (parts[-1] in _SAVED_CONFIGS and (
        len(parts) == 1 or (len(parts) == 2 and parts[0] in ("generator", "question_encoder")))
    ) or (len(parts) == 2 and parts[0] in _TOKENIZER_FOLDERS
          and parts[1] in _SAVED_TOKENIZER_FILES)


def _reseal_file(root: Path, path: Path) -> list[Path]:
    payload = _load_json(path)
    files = check_files_entry(path, payload.get("files"), root)
    written: list[Path] = []
    updated = dict(files)
    for name, meta in files.items():
        listed = root / name
        if not listed.is_file():
            raise StorageError(f"{listed}: listed in {path} but missing; not resealed")
        if listed.is_symlink() and name.endswith("/" + MANIFEST):
            raise StorageError(f"{_linked_manifest(listed)}; not resealed")
        if name.endswith("/" + MANIFEST) and listed.parent != root:  # a part of a bundle
            part = _load_json(listed)
            unchanged = describe_files(root, [name])[name] == meta
            parts = payload.get("parts") or {}
            if not isinstance(parts, dict):
                raise StorageError(f"{path}: its 'parts' is not an object of part digests (an "
                                   "edited manifest); not resealed: rebuild the index directory")
            recorded = parts.get(name)
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
        odd = next((p for p in sorted(root.rglob("*")) if not p.is_symlink()
                    and not p.is_file() and not p.is_dir()), None)
        if odd is not None:  # a pipe, a device or a socket is never a model's file
            raise StorageError(f"{odd} is not a regular file (a named pipe, a device or a "
                               "socket): not listed; remove it")
        for file in sorted(p for p in root.rglob("*") if p.is_file() or p.is_symlink()):
            name = file.relative_to(root).as_posix()
            if name != path.name and name not in updated:
                if _written_by_every_save(name):  # its record was removed, not a file added
                    raise StorageError(
                        f"{file} is not listed in {path}, but a model's save always writes it "
                        "(weights, a config or a tokenizer's file): a record removed by hand is not a file added "
                        "on purpose; not resealed: restore the record, or save the model again")
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
