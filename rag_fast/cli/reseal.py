"""``rag-fast reseal DIR``: accept hand edits of a model's or an index's manifests."""
from __future__ import annotations

import argparse
from pathlib import Path

from rag_fast.storage import reseal


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
