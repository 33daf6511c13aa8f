"""The ``rag-fast`` command.

    rag-fast index build --passages FILE --encoder NAME [--preset ivfpq] [--on-disk] --out DIR [--shard i/n]
    rag-fast index search DIR "question" [-k 5]
    rag-fast index info DIR
    rag-fast init --index DIR --generator NAME|DIR|CONFIG.json --out MODEL_DIR
    rag-fast train --config FILE [--model MODEL_DIR] [--output-dir RUN_DIR]
    rag-fast eval --data dev.jsonl --model RUN_DIR [--out EVAL_DIR]
    rag-fast generate --model RUN_DIR --question "..."
    rag-fast reseal DIR                  accept a hand edit of a model's or an index's manifest

Each top-level command is a registrar in :data:`COMMANDS` that adds its sub-parser and sets
``func``. Errors the user can fix (bad arguments, missing or corrupt files) print one line and
exit 2. Third-party logs and progress bars are off unless ``--verbose``.

An index directory holds ``manifest.json`` (the encoder and the checksums of the parts),
``passages/`` (a PassageStore) and ``index/`` (a DenseIndex). It is assembled under a
temporary name and renamed at the end, so an interrupted build leaves nothing at ``--out``.
With ``--shard i/n`` a process only encodes its shard into ``DIR.staging/``; a final run
without ``--shard`` finds the complete set of shards there and builds the index from them.
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from pathlib import Path
from typing import Callable

BUNDLE_KIND = "rag_fast.index_bundle"
COMMANDS: dict[str, Callable[[argparse._SubParsersAction], None]] = {}


def command(name: str):
    """Register ``fn(subparsers)`` as the registrar of top-level command ``name``."""
    def register(fn: Callable[[argparse._SubParsersAction], None]):
        COMMANDS[name] = fn
        return fn
    return register


# ---- index ---------------------------------------------------------------------------------
@command("index")
def _register_index(subparsers: argparse._SubParsersAction) -> None:
    from rag_fast.retrieval.index import PRESETS

    index = subparsers.add_parser("index", help="build, query and describe passage indexes")
    sub = index.add_subparsers(dest="index_command", required=True, metavar="{build,search,info}")

    build = sub.add_parser("build", help="encode passages and build an index directory")
    build.add_argument("--passages", required=True, metavar="FILE",
                       help="DPR .tsv (id, text, title; or id, text; header row optional), .jsonl, "
                            ".txt or a directory of .txt documents")
    build.add_argument("--encoder", required=True, metavar="NAME",
                       help="Hugging Face passage encoder (name or local folder)")
    build.add_argument("--query-encoder", metavar="NAME", default=None,
                       help="question encoder for `index search` (default: --encoder)")
    build.add_argument("--preset", default="ivfpq", metavar="PRESET",
                       help=f"one of {', '.join(PRESETS)} or a faiss factory string (default ivfpq)")
    build.add_argument("--on-disk", action="store_true",
                       help="keep the inverted lists on disk, memory-mapped when the index is opened "
                            "(for corpora larger than RAM): with ivfpq the lists hold 8-bit PQ codes "
                            "instead of fast-scan ones; a factory string must be an IVF without "
                            "fast-scan, e.g. 'IVF4096,SQ8'")
    build.add_argument("--out", required=True, metavar="DIR", help="output index directory")
    build.add_argument("--target-recall", type=float, default=0.95, metavar="R",
                       help="quality the stored search settings must reach against exact search: "
                            "recall@10, and the fraction of queries with exact search's top 5 "
                            "(default 0.95); measured on --queries, else on one sentence from each "
                            "of 1000 sampled passages encoded as a question (an exact index, which "
                            "small corpora get, is checked on its own stored vectors instead)")
    build.add_argument("--queries", default=None, metavar="FILE",
                       help="real questions to measure and tune the index on: .txt (one per line) "
                            "or .jsonl (objects with 'question')")
    build.add_argument("--shard", default=None, metavar="i/n",
                       help="only encode shard i of n (0-based) into DIR.staging/")
    build.add_argument("--split", type=int, default=None, metavar="WORDS",
                       help="split passages into WORDS-word chunks (raw .txt documents: 100)")
    build.add_argument("--pooling", default="auto", choices=["auto", "cls", "mean", "pooler"],
                       help="how token states become one vector (default auto: the "
                            "sentence-transformers setting of the encoder folder, DPR's pooler, "
                            "else the first token's state)")
    build.add_argument("--max-length", type=int, default=256,
                       help="encoder tokens per passage (default 256; longer ones are truncated)")
    build.add_argument("--batch-size", type=int, default=64,
                       help="passages per encoder batch (default 64)")
    build.add_argument("--device", default=None, help="encoder device (default: cuda if available)")
    build.add_argument("--overwrite", action="store_true",
                       help="replace an index directory at --out (never a folder of another "
                            "kind or one holding other files)")
    build.add_argument("--dedupe", action="store_true",
                       help="keep the first passage of each repeated id (default: an error)")
    build.add_argument("--no-progress", action="store_true", help="no progress bars")
    build.set_defaults(func=_index_build)

    search = sub.add_parser("search", help="retrieve passages for a question")
    search.add_argument("dir", metavar="DIR")
    search.add_argument("question")
    search.add_argument("-k", type=int, default=5, help="passages to return (default 5)")
    search.add_argument("--nprobe", type=int, default=None)
    search.add_argument("--ef-search", type=int, default=None)
    search.add_argument("--json", action="store_true", help="print JSON lines")
    search.add_argument("--device", default=None)
    search.add_argument("--no-verify", action="store_true",
                        help="skip the SHA-256 check of the index files (sizes are still checked)")
    search.set_defaults(func=_index_search)

    info = sub.add_parser("info", help="describe an index directory")
    info.add_argument("dir", metavar="DIR")
    info.add_argument("--verify", action="store_true", help="check every file's SHA-256")
    info.set_defaults(func=_index_info)


STAGING_KEY = "key.json"


def _staging(out: Path) -> Path:
    return out.with_name(out.name + ".staging")


def _encoder_fingerprint(name: str) -> str | None:
    """SHA-256 over a local encoder folder: small files (configs, vocabularies) by content,
    large ones (weights) by name, size and mtime; None for a hub name."""
    import hashlib

    root = Path(name)
    if not root.is_dir():
        return None
    h = hashlib.sha256()
    for f in sorted(p for p in root.rglob("*") if p.is_file()):
        stat = f.stat()
        h.update(f"{f.relative_to(root).as_posix()}\0{stat.st_size}\0".encode())
        h.update(f.read_bytes() if stat.st_size <= 1 << 20 else str(stat.st_mtime_ns).encode())
    return h.hexdigest()


def _staging_key(args) -> dict:
    """What the staged passages and embeddings are made from: the passages' content, the
    encoder and every setting that changes a vector."""
    from rag_fast.retrieval.passages import passages_digest

    return {"passages_sha256": passages_digest(args.passages), "split": args.split,
            "dedupe": bool(getattr(args, "dedupe", False)), "encoder": str(args.encoder),
            "encoder_fingerprint": _encoder_fingerprint(args.encoder), "pooling": args.pooling,
            "normalize": getattr(args, "normalize", None), "max_length": args.max_length}


def _staging_leftovers_only(staging: Path) -> bool:
    """Whether ``staging`` holds only what a staging of rag_fast holds (passages, shard
    embeddings and their temporaries): one whose key file was lost may be discarded."""
    names = re.compile(r"(passages|\.passages\.tmp-.*|\.?embeddings-\d+-of-\d+\.npy(\.tmp-.*)?|"
                       rf"\.?{re.escape(STAGING_KEY)}(\.tmp-.*)?)")
    try:
        return all(names.fullmatch(p.name) for p in staging.iterdir())
    except OSError:
        return False


def _claim_staging(staging: Path, key: dict, sharded: bool) -> None:
    """Make ``staging`` hold data made with ``key``: reuse it if its key matches; else discard
    it (one line says so) and start afresh. The key is published atomically (a hard link of a
    complete file), so concurrent shard processes agree on one staging.

    Raises:
        ValueError: ``sharded`` and ``staging`` holds another key (another build with other
            settings is in progress there): shards never mix.
    """
    import os
    import tempfile

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
        print(f"discarding stale staging {staging} (made with other {', '.join(differ)})")
        trash = Path(tempfile.mkdtemp(prefix=f".{staging.name}.old-", dir=staging.parent))
        try:
            os.replace(staging, trash / "old")
        except FileNotFoundError:
            pass
        shutil.rmtree(trash, ignore_errors=True)
    raise ValueError(f"could not claim the staging folder {staging}: other builds keep changing it")


def _staged_store(args, staging: Path, progress: bool):
    """The passages staged under ``staging/passages`` (created once; concurrent shard
    processes build their own copy and the first rename wins)."""
    import os
    import tempfile

    from rag_fast.retrieval.passages import PassageStore

    path = staging / "passages"
    if not (path / "manifest.json").exists():
        tmp = Path(tempfile.mkdtemp(prefix=".passages.tmp-", dir=staging))
        try:
            PassageStore.from_file(args.passages, tmp / "store", split=args.split,
                                   dedupe=bool(getattr(args, "dedupe", False)), progress=progress)
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
    from rag_fast.retrieval.encoders import shard_rows

    found = {}
    for f in staging.glob("embeddings-*-of-*.npy"):
        i, n = (int(v) for v in f.stem.removeprefix("embeddings-").split("-of-"))
        found.setdefault(n, {})[i] = f
    for n in sorted(found, reverse=True):
        if len(found[n]) == n:
            files = [found[n][i] for i in range(n)]
            import numpy as np

            for i, f in enumerate(files):
                lo, hi = shard_rows(count, (i, n))
                if np.load(f, mmap_mode="r").shape[0] != hi - lo:
                    raise ValueError(f"--shard: staged {f} has the wrong number of rows for "
                                     f"{count} passages; delete {staging} and encode again")
            return files
    return None


def _encoder(flag: str, name: str, **kwargs):
    """``Encoder(name, **kwargs)``, its errors prefixed with the option that named it."""
    from rag_fast.retrieval.encoders import Encoder

    try:
        return Encoder(name, **kwargs)
    except ValueError as e:
        if str(e).startswith("max_length "):
            raise ValueError(f"--max-length{str(e).removeprefix('max_length')}") from None
        raise ValueError(f"{flag}: {e}") from None


def _index_build(args) -> int:
    import numpy as np

    from rag_fast.storage import (atomic_directory, check_apart, check_output_folder,
                                           describe_files, part_digests, write_manifest)
    from rag_fast.retrieval.encoders import encode_passages, parse_shard
    from rag_fast.retrieval.index import (PRESETS, SMALL_CORPUS, DenseIndex, _factory_index,
                                          plan_factory)
    from rag_fast.retrieval.passages import stand_in_questions

    out = Path(args.out)
    progress = not args.no_progress
    on_disk = bool(getattr(args, "on_disk", False))
    if not 0.0 < args.target_recall <= 1.0:
        raise ValueError(f"--target-recall must be in (0, 1], got {args.target_recall}")
    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {args.batch_size}")
    # before anything is read: the output (and its staging folder) apart from every input, and
    # only ever an empty folder or an index directory (replaced with --overwrite)
    inputs = {"--passages": args.passages, "--encoder": args.encoder,
              "--query-encoder": args.query_encoder, "--queries": args.queries}
    check_apart(out, "--out", inputs)
    check_apart(_staging(out), "--out's staging folder", inputs)
    check_output_folder(out, BUNDLE_KIND, overwrite=args.overwrite, flag="--out")
    shard = parse_shard(args.shard) if args.shard is not None else None
    questions = _tuning_questions(args.queries) if args.queries is not None else None
    # the encoders first: a wrong name fails before the passages are read
    encoder = _encoder("--encoder", args.encoder, pooling=args.pooling,
                       max_length=args.max_length, device=args.device)
    query_encoder = _encoder("--query-encoder", args.query_encoder, pooling=args.pooling,
                             max_length=args.max_length,
                             device="cpu") if args.query_encoder else encoder
    if args.preset not in PRESETS:  # a factory string faiss cannot parse fails here too
        _factory_index(args.preset, args.preset, encoder.dim)
    staging = _staging(out)
    key = _staging_key(args)
    _claim_staging(staging, key, sharded=shard is not None)
    store = _staged_store(args, staging, progress)
    # every check on sizes and settings before the (long) encoding
    factory = plan_factory(args.preset, len(store), encoder.dim, on_disk=on_disk)
    if args.preset in ("ivfpq", "hnsw") and factory == "Flat":
        print(f"preset {args.preset}: {len(store)} passages are fewer than {SMALL_CORPUS}, where "
              "exact search takes well under a millisecond and a quantiser has too little to "
              "train on, so the index is exact search (Flat)")
    if query_encoder.dim != encoder.dim:
        raise ValueError(f"--query-encoder has dimension {query_encoder.dim}, --encoder {encoder.dim}")
    if shard is not None:
        i, n = shard
        path = encode_passages(encoder, store, staging / f"embeddings-{i}-of-{n}.npy", shard,
                               args.batch_size, progress)
        print(f"encoded shard {i}/{n} -> {path}; run without --shard once all {n} shards exist")
        return 0
    shards = _complete_shards(staging, len(store))
    if shards is None:
        shards = [encode_passages(encoder, store, staging / "embeddings-0-of-1.npy", None,
                                  args.batch_size, progress)]
    embeddings = [np.load(f, mmap_mode="r") for f in shards]
    queries, source = None, None
    if factory != "Flat":  # exact search needs no measuring
        if questions is None:
            questions = stand_in_questions(store, TUNING_QUESTIONS)
            source = f"one sentence from each of {len(questions)} sampled passages"
        else:
            source = f"{len(questions)} questions from {args.queries}"
        if progress:
            print(f"encoding {len(questions)} questions to measure the index on ({source})")
        queries = query_encoder.encode_queries(questions).numpy()
    index = DenseIndex.build(embeddings, args.preset, progress=progress, on_disk=on_disk,
                             target_recall=args.target_recall, queries=queries, query_source=source)
    with atomic_directory(out, overwrite=args.overwrite, kind=BUNDLE_KIND) as tmp:
        shutil.copytree(store.root, tmp / "passages", ignore=shutil.ignore_patterns("tokens"))
        index.save(tmp / "index")
        files = ["passages/manifest.json", "index/manifest.json"]
        write_manifest(tmp / "manifest.json", {
            "parts": part_digests(tmp, files),
            "kind": BUNDLE_KIND, "format": 1, "passages_source": str(args.passages),
            "passages_sha256": key["passages_sha256"],
            "encoder": encoder.describe(), "query_encoder": query_encoder.describe(),
            "files": describe_files(tmp, files),
        })
    shutil.rmtree(staging, ignore_errors=True)
    quality = index.describe()["search_quality"]
    settings = ", ".join(f"{k}={v}" for k, v in index.params.items() if k != "rerank" or
                         index.factory != "Flat")
    where = " (inverted lists memory-mapped when opened)" if index.on_disk else ""
    print(f"built {factory}{where} over {len(index)} passages ({index.dim}-d) -> {out}; "
          + _quality_line(quality, index.factory)
          + (f"; search defaults {settings}" if settings else ""))
    return 0


TUNING_QUESTIONS = 1000  # stand-in questions drawn from the passages when --queries is not given


def _tuning_questions(path: str) -> list[str]:
    """The questions of ``--queries``: a .txt file (one per non-empty line) or JSONL objects
    with a non-empty string ``question``.

    Raises:
        FileNotFoundError, ValueError: naming ``--queries``, the file and line.
    """
    from rag_fast._jsonl import decoded_lines, read_objects

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


def _load_bundle(directory: str, verify: bool = False):
    from rag_fast.storage import read_manifest
    from rag_fast.retrieval.index import DenseIndex
    from rag_fast.retrieval.passages import PassageStore

    root = Path(directory)
    manifest = read_manifest(root, BUNDLE_KIND, verify=True)
    store = PassageStore.load(root / "passages", verify=verify)
    index = DenseIndex.load(root / "index", verify=verify, expected_dim=manifest["encoder"]["dim"])
    return manifest, store, index


def _index_search(args) -> int:
    from rag_fast.retrieval.encoders import Encoder

    manifest, store, index = _load_bundle(args.dir, verify=not args.no_verify)
    spec = manifest["query_encoder"]
    encoder = Encoder(spec["name"], pooling=spec["pooling"], normalize=spec["normalize"],
                      max_length=spec["max_length"], device=args.device)
    if not args.question.strip():
        raise ValueError("question must not be empty")
    q = encoder.encode_queries([args.question])
    kwargs = {"nprobe": args.nprobe, "ef_search": args.ef_search}
    scores, ids = index.search(q, args.k, **{key: v for key, v in kwargs.items() if v is not None})
    for rank, (score, row) in enumerate(zip(scores[0].tolist(), ids[0].tolist()), 1):
        if row < 0:
            continue
        p = store[row]
        if args.json:
            print(json.dumps({"rank": rank, "score": score, "row": row, "id": p.id,
                              "title": p.title, "text": p.text}))
        else:
            text = p.text if len(p.text) <= 200 else p.text[:197] + "..."
            print(f"{rank:>3}  {score:8.4f}  [{p.id}] {p.title}\n     {text}")
    return 0


def _quality_line(quality: dict | None, factory: str | None = None) -> str:
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


def _index_info(args) -> int:
    manifest, store, index = _load_bundle(args.dir, verify=args.verify)
    d = index.describe()
    lines = {
        "directory": str(Path(args.dir).resolve()),
        "passages": f"{len(store)} (from {manifest.get('passages_source')})",
        "encoder": f"{manifest['encoder']['name']} ({manifest['encoder']['pooling']} pooling, "
                   f"normalize={manifest['encoder']['normalize']})",
        "dimension": d["dim"],
        "metric": d["metric"],
        "preset": (f"{d['preset']} ({d['factory']})" if d["factory"] != "Flat" else
                   f"{d['preset']} (Flat: exact search)"),
        "search defaults": ", ".join(f"{k}={v}" for k, v in d["params"].items()
                                     if k != "rerank" or d["factory"] != "Flat") or "none",
        "measured": _quality_line(d.get("search_quality"), d["factory"]),
        "bytes/vector": f"{index.index_bytes() / len(index):.1f} (+{2 * d['dim']} fp16 vectors)",
        "faiss": f"{d['faiss_version']} (built with {json.loads((Path(args.dir) / 'index' / 'manifest.json').read_text())['faiss_version']})",
        "checksums": "verified" if args.verify else "sizes checked (--verify for SHA-256)",
    }
    width = max(len(k) for k in lines)
    for key, value in lines.items():
        print(f"{key:<{width}}  {value}")
    return 0


# ---- reseal ----------------------------------------------------------------------------------
@command("reseal")
def _register_reseal(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "reseal", help="accept hand edits of a model's rag_fast.json or an index's manifests",
        description="Every manifest rag_fast writes (an index directory's manifest.json and those "
        "of its passages/ and index/, a model directory's rag_fast.json) is sealed: an edit is "
        "refused on load. After editing one on purpose, reseal the folder to accept the edit. "
        "The other files must still match their recorded size and SHA-256: a corrupt data file "
        "is never sealed over.")
    p.add_argument("dir", metavar="DIR", help="an index directory, one of its parts, or a model "
                   "directory")
    p.set_defaults(func=_reseal)


def _reseal(args) -> int:
    from rag_fast.storage import reseal

    if not Path(args.dir).is_dir():
        what = "is not a directory" if Path(args.dir).exists() else "no such directory"
        raise FileNotFoundError(f"reseal: {args.dir}: {what}")
    written = reseal(args.dir)
    if written:
        print("resealed " + ", ".join(str(p) for p in written))
    else:
        print(f"{args.dir}: every seal already matches; nothing to do")
    return 0


# ---- init, train, eval, generate: registrars live beside their code ------------------------
@command("init")
def _register_init(subparsers: argparse._SubParsersAction) -> None:
    from rag_fast.models.build import register

    register(subparsers)


@command("train")
def _register_train(subparsers: argparse._SubParsersAction) -> None:
    from rag_fast.training.cli import register

    register(subparsers)


@command("eval")
def _register_eval(subparsers: argparse._SubParsersAction) -> None:
    from rag_fast.evaluation.cli import register

    register(subparsers)


@command("generate")
def _register_generate(subparsers: argparse._SubParsersAction) -> None:
    from rag_fast.generation.cli import register

    register(subparsers)


# ---- entry point ---------------------------------------------------------------------------
class _Parser(argparse.ArgumentParser):
    """argparse's parser, except that a command given an option it does not know reports that
    option first: in ``index build --encoderr x`` the mistake is the typo, not the ``--encoder``
    argparse then finds missing. :func:`main` hands every command's parser the arguments
    (``argv``) before parsing."""

    argv: list[str] | None = None
    top_options: frozenset[str] = frozenset()

    def error(self, message: str):
        if message.startswith("the following arguments are required") and self.argv:
            known = self.top_options | {s for a in self._actions for s in a.option_strings}
            unknown = [a for a in self.argv
                       if a.startswith("--") and a.split("=", 1)[0] not in known]
            if unknown:
                _unknown_options(self, unknown)
        super().error(message)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="rag-fast", description="Fast Retrieval-Augmented Generation. The workflow: "
        "index build -> init -> train -> eval -> generate, each reading what the one before wrote.")
    parser.add_argument("--verbose", action="store_true",
                        help="show third-party logs and progress bars (transformers, hub)")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="{" + ",".join(COMMANDS) + "}")
    for register in COMMANDS.values():
        register(subparsers)
    _mark_commands(parser)
    return parser


def _mark_commands(parser: argparse.ArgumentParser) -> None:
    """Give every command's own parser (``index build``, ``train``, ...) a default naming
    itself, so that an option it does not know is reported with its usage, not the top level's."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                sub.set_defaults(_command_parser=sub)
                _mark_commands(sub)


def _give_argv(parser: argparse.ArgumentParser, argv: list[str], top: frozenset[str]) -> None:
    """Hand every command's parser the command line (see :class:`_Parser`)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                if isinstance(sub, _Parser):
                    sub.argv, sub.top_options = argv, top
                _give_argv(sub, argv, top)


def _unknown_options(parser: argparse.ArgumentParser, extra: list[str]) -> None:
    """Exit as argparse does (status 2, the command's usage), naming the unknown arguments and
    the command's closest option."""
    import difflib

    known = [s for a in parser._actions for s in a.option_strings if s.startswith("--")]
    hints = []
    for arg in extra:
        if arg.startswith("-"):
            close = difflib.get_close_matches(arg.split("=", 1)[0], known, n=1)
            if close:
                hints.append(f"{arg.split('=', 1)[0]}: did you mean {close[0]}?")
    parser.error(f"unrecognized arguments: {' '.join(extra)}"
                 + (f" ({'; '.join(hints)})" if hints else ""))


def _end_progress_bars() -> None:
    """Close the progress bars a failed command left open, so that its error starts a line."""
    try:
        from tqdm import tqdm
    except ImportError:
        return
    for bar in list(getattr(tqdm, "_instances", ())):
        try:
            bar.close()
        except Exception:  # noqa: BLE001  (a bar that cannot close is no reason to fail)
            pass


def one_line(exc: BaseException) -> str:
    """An exception as one line: an OSError as its reason and the file it names, anything
    else as its message with line breaks folded."""
    if isinstance(exc, OSError) and exc.strerror:
        text = exc.strerror + (f": {exc.filename}" if exc.filename else "")
    else:
        text = str(exc) or type(exc).__name__
    if isinstance(exc, KeyError):  # str(KeyError) is the key's repr
        text = f"missing key {text}"
    return " ".join(part.strip() for part in text.splitlines() if part.strip())


def _report_unexpected(exc: BaseException, verbose: bool) -> int:
    """An exception rag_fast did not expect: one line, and the traceback in a file (or on
    stderr with --verbose). Exit status 1."""
    import tempfile
    import traceback

    text = "".join(traceback.format_exception(exc))
    where = None
    if verbose:
        print(text, file=sys.stderr, end="")
    else:
        try:
            fd, where = tempfile.mkstemp(prefix="rag-fast-error-", suffix=".txt")
            with open(fd, "w", encoding="utf-8") as f:
                f.write(text)
        except OSError:
            where = None
    tail = (f"; the full traceback is in {where}" if where else
            "" if verbose else "; run with `rag-fast --verbose ...` for the traceback")
    print(f"rag-fast: unexpected error: {type(exc).__name__}: {one_line(exc)}{tail} (please "
          "report it)", file=sys.stderr)
    return 1


def main(argv: list[str] | None = None) -> int:
    """Run a command. Exit status: 0 done; 2 an expected failure (bad argument, input, file or
    artefact, no space left), said in one line naming the file, line or key; 1 an unexpected
    error (one line, the traceback in a file); 130 interrupted."""
    from rag_fast import _pool
    from rag_fast.storage import StorageError

    from rag_fast._quiet import set_verbose

    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    _give_argv(parser, argv, frozenset(s for a in parser._actions for s in a.option_strings))
    args, extra = parser.parse_known_args(argv)
    if extra:
        _unknown_options(getattr(args, "_command_parser", parser), extra)
    set_verbose(args.verbose)
    try:
        _pool.limit_bytes()  # RAG_FAST_POOL_MB, named in one line before any work
        return int(args.func(args) or 0)
    except (ValueError, OSError, StorageError) as exc:
        _end_progress_bars()
        print(f"rag-fast: error: {one_line(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        _end_progress_bars()
        said = ("the run's last checkpoint (if one was written) is kept: the same command "
                "resumes from it" if args.command == "train" else
                "nothing was written at the output path")
        print(f"rag-fast: interrupted; {said}", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001  (a bug: said in one line, traceback kept)
        _end_progress_bars()
        return _report_unexpected(exc, args.verbose)


if __name__ == "__main__":
    sys.exit(main())
