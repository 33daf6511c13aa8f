"""``rag-fast train``: train a model directory on question-answer data from a JSON config.

The config file, its checks and the run are :mod:`rag_fast.training.run`'s (its docstring
describes the file); this module applies the options (parsed by
:func:`rag_fast.cli.parsers.add_train`), which replace the file's ``model``, ``index``,
``output_dir`` and ``device`` (relative to the current folder), or set any value of it
(``--set KEY=VALUE`` and its short forms, in command-line order), and calls it.
"""
from __future__ import annotations

import argparse
import os
import shlex

from rag_fast.cli.common import resolve_device
from rag_fast.training.checkpoint import last_checkpoint
from rag_fast.training.run import load_config, run_training


def run(args: argparse.Namespace) -> int:
    # --model / --index replace the file's paths before the sections are checked: a section
    # may then leave its "path" out, its other options still apply; --set and the short flags
    # set values before the checks too, which name them
    overrides = [(key, value, option) for key, value, option, _ in args.overrides or []]
    config = load_config(args.config, model=args.model, index=args.index, overrides=overrides)
    if args.output_dir is not None:
        if not args.output_dir:
            raise ValueError("--output-dir: expected a folder path, got ''")
        config["train"]["output_dir"] = args.output_dir
    if args.device is not None:
        resolve_device(args.device, "--device")  # the flag's value, not the file's: named so
        config["train"]["device"] = args.device
    output_dir = config["train"].get("output_dir")
    if isinstance(output_dir, str) and output_dir:
        # read by rag_fast.cli.runner.run on Ctrl-C
        args.on_interrupt = lambda: interrupted(args, output_dir, config["resume"])
    run_training(config, args.config,
                 output_flag="--output-dir" if args.output_dir is not None else None)
    return 0


def command_line(args: argparse.Namespace, *extra: str) -> str:
    """The ``rag-fast train`` command these arguments come from (options in a fixed order,
    --set and its short forms in the order given), then ``extra``, quoted for a shell."""
    words = ["rag-fast", *(["--verbose"] if args.verbose else []), "train",
             "--config", args.config]
    for flag, value in (("--model", args.model), ("--index", args.index),
                        ("--output-dir", args.output_dir), ("--device", args.device)):
        if value is not None:
            words += [flag, value]
    for *_, tokens in args.overrides or []:
        words += tokens
    return shlex.join([*words, *extra])


def interrupted(args: argparse.Namespace, output_dir: str, resume: bool) -> str:
    """What ``rag-fast train`` says when Ctrl-C stops it: the last checkpoint of the run's
    folder (path and step) and the command that resumes from it (this one, adding
    ``--set resume=true`` where the config says ``"resume": false``), or that there is none
    yet and the command starts over."""
    found = last_checkpoint(output_dir)
    torchrun = int(os.environ.get("WORLD_SIZE", "1") or 1) > 1
    same = "the same torchrun command" if torchrun else "the same command"
    if found is None:
        return (f"no checkpoint was written yet in {output_dir}, so {same} starts over: "
                f"{command_line(args)}")
    path, step = found
    if resume:
        return (f"the last checkpoint is {path} (step {step}); {same} resumes from it: "
                f"{command_line(args)}")
    return (f"the last checkpoint is {path} (step {step}); the config says \"resume\": false, "
            f"so to resume from it run {same} with --set resume=true: "
            f"{command_line(args, '--set', 'resume=true')}")


