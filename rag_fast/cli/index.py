"""``rag-fast index build | search | info``: build, query and describe index directories.

``build`` calls :func:`rag_fast.retrieval.bundle.build_index_bundle` (which writes the
directory atomically and stages sharded builds); ``search`` and ``info`` open one with
:func:`~rag_fast.retrieval.bundle.load_index_bundle`.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from rag_fast.cli.common import check_positive
from rag_fast.retrieval.bundle import build_index_bundle, describe_quality, load_index_bundle
from rag_fast.retrieval.encoders import Encoder
from rag_fast.retrieval.index import PRESETS


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``index`` and its sub-commands to the ``rag-fast`` command's subparsers."""
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
                       help="Only encode shard i of n (0-based) into DIR.staging/, where DIR is "
                            "--out. Once all n shards exist, training under torchrun with n "
                            "processes reads them there when the training config's index is "
                            "{\"path\": \"DIR.staging\", \"sharded\": true}, and the same "
                            "command without --shard merges them into the index directory DIR.")
    build.add_argument("--remove-staging", action="store_true",
                       help="After merging the staged shards into --out, remove DIR.staging/ "
                            "with them. Without it the staging folder is kept, since training "
                            "on a sharded index reads it.")
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
    build.set_defaults(func=run_build)

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
    search.set_defaults(func=run_search)

    info = sub.add_parser(
        "info", help="describe an index directory",
        description="Describe an index directory: its passages, encoder, preset and search "
                    "settings, what a search of it runs here (on the CPU, as loaded) and what "
                    "DenseIndex.to('cuda') would run for CUDA queries with this faiss build.")
    info.add_argument("dir", metavar="DIR")
    info.add_argument("--verify", action="store_true", help="check every file's SHA-256")
    info.set_defaults(func=run_info)


def run_build(args: argparse.Namespace) -> int:
    try:
        build_index_bundle(
            args.passages, args.encoder, args.out, query_encoder=args.query_encoder,
            preset=args.preset, on_disk=args.on_disk, target_recall=args.target_recall,
            queries=args.queries, shard=args.shard, split=args.split, pooling=args.pooling,
            max_length=args.max_length, batch_size=args.batch_size, device=args.device,
            overwrite=args.overwrite, dedupe=args.dedupe, progress=not args.no_progress,
            remove_staging=args.remove_staging)
    except FileNotFoundError as e:  # the passage reader names its argument: say the flag
        if str(e).startswith("passages: "):
            raise FileNotFoundError("--passages: " + str(e).removeprefix("passages: ")) from None
        raise
    return 0


def run_search(args: argparse.Namespace) -> int:
    check_positive(("-k", args.k))
    manifest, store, index = load_index_bundle(args.dir, verify=not args.no_verify)
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


def run_info(args: argparse.Namespace) -> int:
    manifest, store, index = load_index_bundle(args.dir, verify=args.verify)
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
        "measured": describe_quality(d.get("search_quality"), d["factory"]),
        "searched by": d["search"],
        "search on CUDA": f"after .to('cuda'): {index.cuda_search()}",
        "bytes/vector": f"{index.index_bytes() / len(index):.1f} (+{2 * d['dim']} fp16 vectors)",
        "faiss": f"{d['faiss_version']} (built with "
                 f"{json.loads((Path(args.dir) / 'index' / 'manifest.json').read_text())['faiss_version']})",
        "checksums": "verified" if args.verify else "sizes checked (--verify for SHA-256)",
    }
    width = max(len(k) for k in lines)
    for key, value in lines.items():
        print(f"{key:<{width}}  {value}")
    return 0
