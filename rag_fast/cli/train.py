"""``rag-fast train``: train a model directory on question-answer data from a JSON config.

The config file, its checks and the run are :mod:`rag_fast.training.run`'s (its docstring
describes the file); this module reads the options, which replace the file's ``model``,
``index``, ``output_dir`` and ``device`` (relative to the current folder), and calls it.
"""
from __future__ import annotations

import argparse

from rag_fast.cli.common import resolve_device
from rag_fast.training.run import load_config, run_training, schema_help


def run(args: argparse.Namespace) -> int:
    # --model / --index replace the file's paths before the sections are checked: a section
    # may then leave its "path" out, its other options still apply
    config = load_config(args.config, model=args.model, index=args.index)
    if args.output_dir is not None:
        if not args.output_dir:
            raise ValueError("--output-dir: expected a folder path, got ''")
        config["train"]["output_dir"] = args.output_dir
    if args.device is not None:
        resolve_device(args.device, "--device")  # the flag's value, not the file's: named so
        config["train"]["device"] = args.device
    run_training(config, args.config,
                 output_flag="--output-dir" if args.output_dir is not None else None)
    return 0


_DESCRIPTION = __doc__.splitlines()[0].replace("``", "")


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``train`` to the ``rag-fast`` command's subparsers."""
    p = subparsers.add_parser("train", help="train a model directory (JSON config)",
                              description=_DESCRIPTION, epilog=schema_help(),
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, metavar="FILE", help="JSON training configuration")
    p.add_argument("--model", default=None, metavar="DIR", help="model directory to start from")
    p.add_argument("--index", default=None, metavar="DIR", help="index directory to retrieve from")
    p.add_argument("--output-dir", default=None, metavar="DIR",
                   help="where checkpoints, metrics, plot and the trained model/ go")
    p.add_argument("--device", default=None,
                   help="cpu, cuda or cuda:N (default: cuda:LOCAL_RANK when CUDA is available)")
    p.set_defaults(func=run)
