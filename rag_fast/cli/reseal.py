"""``rag-fast reseal DIR``: accept hand edits of a model's or an index's manifests."""
from __future__ import annotations

import argparse
from pathlib import Path

from rag_fast.storage import reseal


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``reseal`` to the ``rag-fast`` command's subparsers."""
    p = subparsers.add_parser(
        "reseal", help="accept hand edits of a model's rag_fast.json or an index's manifests",
        description="Every manifest rag_fast writes (an index directory's manifest.json and those "
        "of its passages/ and index/, a model directory's rag_fast.json) is sealed: an edit is "
        "refused on load. After editing one on purpose, reseal the folder to accept the edit. "
        "The other files must still match their recorded size and SHA-256: a corrupt data file "
        "is never sealed over.")
    p.add_argument("dir", metavar="DIR", help="an index directory, one of its parts, or a model "
                   "directory")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if not Path(args.dir).is_dir():
        what = "is not a directory" if Path(args.dir).exists() else "no such directory"
        raise FileNotFoundError(f"reseal: {args.dir}: {what}")
    written = reseal(args.dir)
    if written:
        print("resealed " + ", ".join(str(p) for p in written))
    else:
        print(f"{args.dir}: every seal already matches; nothing to do")
    return 0
