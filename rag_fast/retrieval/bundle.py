"""Index directories: build one from a passage file and an encoder, and open one.

An index directory holds ``manifest.json`` (kind :data:`BUNDLE_KIND`: the encoders and the
checksums of the parts), ``passages/`` (a PassageStore) and ``index/`` (a DenseIndex). It is
assembled under a temporary name and renamed at the end, so an interrupted build leaves
nothing at ``out``. With ``shard=(i, n)`` a process only encodes its shard into
``OUT.staging/``; a final build without a shard finds the complete set of shards there and
builds the index from them. That staging folder is also what training on a sharded index reads
(``"index": {"path": "OUT.staging", "sharded": true}``), so the build that merges staged shards
keeps it unless asked to remove it (``remove_staging``); a build that encoded the whole corpus
itself removes its own staging.

This is the library behind ``rag-fast index build``: its errors name the options as that
command spells them (``--out``, ``--encoder``, ``--shard``, ...), so that the command reports
them unchanged.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Callable

import numpy as np

from rag_fast._jsonl import decoded_lines, read_objects
from rag_fast.retrieval.encoders import Encoder, encode_passages, parse_shard, shard_rows
from rag_fast.retrieval.index import (PRESETS, SMALL_CORPUS, DenseIndex, SmallSampleWarning,
                                      _factory_index, plan_factory, small_sample_message)
from rag_fast.retrieval.passages import PassageStore, passages_digest, stand_in_questions
from rag_fast.storage import (atomic_directory, check_apart, check_output_folder,
                              describe_files, part_digests, read_manifest, write_manifest)

BUNDLE_KIND = "rag_fast.index_bundle"
STAGING_KEY = "key.json"
TUNING_QUESTIONS = 1000  # stand-in questions drawn from the passages when no queries are given


def staging_folder(out: str | Path) -> Path:
    """Where the passages and shard embeddings of a build of ``out`` are staged."""
    out = Path(out)
    return out.with_name(out.name + ".staging")


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


def _staging_leftovers_only(staging: Path) -> bool:
    """Whether ``staging`` holds only what a staging of rag_fast holds (passages, shard
    embeddings and their temporaries): one whose key file was lost may be discarded."""
    names = re.compile(r"(passages|\.passages\.tmp-.*|\.?embeddings-\d+-of-\d+\.npy(\.tmp-.*)?|"
                       rf"\.?{re.escape(STAGING_KEY)}(\.tmp-.*)?)")
    try:
        return all(names.fullmatch(p.name) for p in staging.iterdir())
    except OSError:
        return False


def _claim_staging(staging: Path, key: dict, sharded: bool, log: Callable[[str], None]) -> None:
    """Make ``staging`` hold data made with ``key``: reuse it if its key matches; else discard
    it (one line says so) and start afresh. The key is published atomically (a hard link of a
    complete file), so concurrent shard processes agree on one staging.

    Raises:
        ValueError: ``sharded`` and ``staging`` holds another key (another build with other
            settings is in progress there): shards never mix.
    """
    for _ in range(3):
        staging.mkdir(parents=True, exist_ok=True)
        path = staging / STAGING_KEY
        if not path.exists() and not any(staging.iterdir()):
            fd, tmp = tempfile.mkstemp(prefix=f".{STAGING_KEY}.tmp-", dir=staging)
            try:
                with os.fdopen(fd, "w") as f:
                    json.dump(key, f, indent=2, sort_keys=True)
                    f.flush()
                    os.fsync(f.fileno())
                os.link(tmp, path)  # atomic, fails if another process published first
                return
            except FileExistsError:
                pass
            finally:
                os.unlink(tmp)
        try:
            staged = json.loads(path.read_text())
        except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError):
            staged = None
        if staged is None and not path.exists() and not _staging_leftovers_only(staging):
            raise ValueError(
                f"{staging} (the staging folder of --out) holds files rag_fast did not write (no "
                f"{STAGING_KEY}); refused: move them away or choose another --out")
        if staged == key:
            return
        differ = (sorted(k for k in key if staged.get(k) != key[k]) if isinstance(staged, dict)
                  else ["settings (no key: an older version's staging)"])
        if sharded:
            raise ValueError(
                f"--shard: {staging} holds passages or embeddings made with other settings "
                f"({', '.join(differ)} differ): another build with other settings is in progress, "
                f"or a stale one failed; finish it or delete {staging}"
            )
        log(f"discarding stale staging {staging} (made with other {', '.join(differ)})")
        trash = Path(tempfile.mkdtemp(prefix=f".{staging.name}.old-", dir=staging.parent))
        try:
            os.replace(staging, trash / "old")
        except FileNotFoundError:
            pass
        shutil.rmtree(trash, ignore_errors=True)
    raise ValueError(f"could not claim the staging folder {staging}: other builds keep changing it")


def _staged_store(passages: str, split: int | None, dedupe: bool, staging: Path,
                  progress: bool) -> PassageStore:
    """The passages staged under ``staging/passages`` (created once; concurrent shard
    processes build their own copy and the first rename wins)."""
    path = staging / "passages"
    if not (path / "manifest.json").exists():
        tmp = Path(tempfile.mkdtemp(prefix=".passages.tmp-", dir=staging))
        try:
            PassageStore.from_file(passages, tmp / "store", split=split, dedupe=bool(dedupe),
                                   progress=progress)
            try:
                os.rename(tmp / "store", path)
            except OSError:
                if not (path / "manifest.json").exists():  # not another shard process's store
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return PassageStore.load(path)


def _complete_shards(staging: Path, count: int) -> list[Path] | None:
    """The shard files of the largest n for which all n are staged, else None."""
    found = {}
    for f in staging.glob("embeddings-*-of-*.npy"):
        i, n = (int(v) for v in f.stem.removeprefix("embeddings-").split("-of-"))
        found.setdefault(n, {})[i] = f
    for n in sorted(found, reverse=True):
        if len(found[n]) == n:
            files = [found[n][i] for i in range(n)]
            for i, f in enumerate(files):
                lo, hi = shard_rows(count, (i, n))
                if np.load(f, mmap_mode="r").shape[0] != hi - lo:
                    raise ValueError(f"--shard: staged {f} has the wrong number of rows for "
                                     f"{count} passages; delete {staging} and encode again")
            return files
    return None


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
    if not Path(path).is_file():
        raise FileNotFoundError(f"--queries: no such file {path}")
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
    return questions


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
    progress: bool = True,
    remove_staging: bool = False,
    log: Callable[[str], None] = print,
    warn: Callable[[str], None] | None = None,
) -> Path:
    """Encode ``passages`` and write the index directory ``out`` (see the module docstring).

    Args:
        passages: DPR .tsv, .jsonl, .txt or a directory of .txt documents.
        encoder: Hugging Face passage encoder (name or local folder).
        out: the index directory to write: only ever an empty or missing folder, or (with
            ``overwrite``) an index directory, is replaced.
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
        progress: progress bars and a line on the tuning questions.
        remove_staging: after a build that used shards staged by ``shard`` builds (sets of
            2 or more), remove ``OUT.staging/`` with them; by default it is kept, as training
            on a sharded index reads it. The staging of a build without shards is removed
            either way, and a set of shards it did not use is kept either way.
        log: where the lines on progress and the result go (default ``print``).
        warn: where warnings go (default: stderr, after ``warning: ``): ``--queries`` fewer
            than the target needs to be shown with the tuner's confidence
            (:func:`~rag_fast.retrieval.index.min_tuning_queries`).
    Returns:
        ``out`` as a Path; with ``shard``, the shard's embeddings file.
    Raises:
        ValueError: a bad setting, an unknown encoder, a factory string faiss cannot parse,
            encoders of different dimensions, a staging folder another build holds.
        OSError, rag_fast.storage.StorageError: unreadable inputs, a full disk, an output
            folder that is not ours to replace.
    """
    out = Path(out)
    if not 0.0 < target_recall <= 1.0:
        raise ValueError(f"--target-recall must be in (0, 1], got {target_recall}")
    if batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {batch_size}")
    # before anything is read: the output (and its staging folder) apart from every input, and
    # only ever an empty folder or an index directory (replaced with overwrite)
    inputs = {"--passages": passages, "--encoder": encoder, "--query-encoder": query_encoder,
              "--queries": queries}
    staging = staging_folder(out)
    check_apart(out, "--out", inputs)
    check_apart(staging, "--out's staging folder", inputs)
    check_output_folder(out, BUNDLE_KIND, overwrite=overwrite, flag="--out")
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
        _factory_index(preset, preset, passage_encoder.dim)
    key = _staging_key(passages, split, dedupe, encoder, pooling, max_length)
    _claim_staging(staging, key, sharded=shard is not None, log=log)
    store = _staged_store(passages, split, dedupe, staging, progress)
    # every check on sizes and settings before the (long) encoding
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
        path = encode_passages(passage_encoder, store, staging / f"embeddings-{i}-of-{n}.npy",
                               shard, batch_size, progress)
        log(f"encoded shard {i}/{n} -> {path}. Once all {n} shards exist, either train on "
            f"them: under torchrun with {n} processes, with the training config's index set to "
            f"{{\"path\": {json.dumps(os.path.abspath(staging))}, \"sharded\": true}} "
            "(docs/distributed.md); "
            f"or merge them into one index directory {out}: run this command without --shard "
            f"(it keeps {staging} unless given --remove-staging)")
        return path
    shards = _complete_shards(staging, len(store))
    if shards is None:
        shards = [encode_passages(passage_encoder, store, staging / "embeddings-0-of-1.npy",
                                  None, batch_size, progress)]
    embeddings = [np.load(f, mmap_mode="r") for f in shards]
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
        index = DenseIndex.build(embeddings, preset, progress=progress, on_disk=on_disk,
                                 target_recall=target_recall, queries=vectors, query_source=source)
    with atomic_directory(out, overwrite=overwrite, kind=BUNDLE_KIND) as tmp:
        shutil.copytree(store.root, tmp / "passages", ignore=shutil.ignore_patterns("tokens"))
        index.save(tmp / "index")
        files = ["passages/manifest.json", "index/manifest.json"]
        write_manifest(tmp / "manifest.json", {
            "parts": part_digests(tmp, files),
            "kind": BUNDLE_KIND, "format": 1, "passages_source": str(passages),
            "passages_sha256": key["passages_sha256"],
            "encoder": passage_encoder.describe(), "query_encoder": question_encoder.describe(),
            "files": describe_files(tmp, files),
        })
    kept = _discard_staging(staging, remove_staging)
    quality = index.describe()["search_quality"]
    settings = ", ".join(f"{k}={v}" for k, v in index.params.items() if k != "rerank" or
                         index.factory != "Flat")
    where = " (inverted lists memory-mapped when opened)" if index.on_disk else ""
    log(f"built {factory}{where} over {len(index)} passages ({index.dim}-d) -> {out}; "
        + describe_quality(quality, index.factory)
        + (f"; search defaults {settings}" if settings else ""))
    if kept:
        log(f"kept the staging folder {staging} with its {kept}, which training on a sharded "
            "index reads (\"sharded\": true); run with --remove-staging to remove it")
    return out


def _discard_staging(staging: Path, remove: bool) -> str | None:
    """After a build: remove the staging folder, unless it holds shards of a ``--shard`` set
    (n >= 2; ``embeddings-0-of-1.npy`` is the single-process build's own) and ``remove`` is
    False. Then only the single-process embeddings are removed, and the return value says what
    was kept (e.g. ``"2 shards (embeddings-i-of-2.npy)"``); None when the folder is gone."""
    sets: dict[int, int] = {}
    for f in staging.glob("embeddings-*-of-*.npy"):
        n = int(f.stem.rsplit("-of-", 1)[1])
        if n >= 2:
            sets[n] = sets.get(n, 0) + 1
    if remove or not sets:
        shutil.rmtree(staging, ignore_errors=True)
        return None
    (staging / "embeddings-0-of-1.npy").unlink(missing_ok=True)
    return ", ".join(f"{count} of {n} shards (embeddings-i-of-{n}.npy)"
                     for n, count in sorted(sets.items()))


def load_index_bundle(directory: str | Path, verify: bool = False):
    """``(manifest, store, index)`` of an index directory: the bundle manifest (its seal and
    its parts' checksums checked), the PassageStore and the DenseIndex (``verify``: every
    file's SHA-256, else the sizes)."""
    root = Path(directory)
    manifest = read_manifest(root, BUNDLE_KIND, verify=True)
    store = PassageStore.load(root / "passages", verify=verify)
    index = DenseIndex.load(root / "index", verify=verify, expected_dim=manifest["encoder"]["dim"])
    return manifest, store, index


class BundleSearch:
    """An index directory opened to answer questions: its passages (``store``), its index and
    the question encoder its manifest records (``encoder``), what ``rag-fast index search``
    and ``rag-fast index eval`` search with (:func:`open_bundle_search`)."""

    def __init__(self, manifest: dict, store: PassageStore, index: DenseIndex, encoder: Encoder):
        self.manifest, self.store, self.index, self.encoder = manifest, store, index, encoder

    def search(self, questions: list[str], k: int, *, nprobe: int | None = None,
               ef_search: int | None = None, chunk: int = 1024) -> tuple[np.ndarray, np.ndarray]:
        """``(scores, rows)`` ``[Q, k]`` of ``questions``: encoded in batches (``chunk``
        questions at a time, each a batch search), best first; a row is -1 (its score -inf)
        where fewer than ``k`` were found. ``nprobe``, ``ef_search``: the index's defaults
        when None."""
        settings = {key: v for key, v in (("nprobe", nprobe), ("ef_search", ef_search))
                    if v is not None}
        scores, rows = [], []
        for start in range(0, len(questions), chunk):
            q = self.encoder.encode_queries(list(questions[start:start + chunk])).numpy()
            found = self.index.search(q, k, **settings)
            scores.append(found[0])
            rows.append(found[1])
        if not rows:
            return np.zeros((0, k), np.float32), np.zeros((0, k), np.int64)
        return np.concatenate(scores), np.concatenate(rows)


def open_bundle_search(directory: str | Path, *, device: str | None = None,
                       verify: bool = True) -> BundleSearch:
    """An index directory with the question encoder its manifest records, on ``device``
    (default: CUDA when available), to search questions with (``verify``: every file's
    SHA-256, else the sizes)."""
    manifest, store, index = load_index_bundle(directory, verify=verify)
    spec = manifest["query_encoder"]
    encoder = Encoder(spec["name"], pooling=spec["pooling"], normalize=spec["normalize"],
                      max_length=spec["max_length"], device=device)
    return BundleSearch(manifest, store, index, encoder)


__all__ = ["BUNDLE_KIND", "STAGING_KEY", "TUNING_QUESTIONS", "BundleSearch", "build_index_bundle",
           "describe_quality", "load_index_bundle", "open_bundle_search", "read_tuning_questions",
           "staging_folder"]
