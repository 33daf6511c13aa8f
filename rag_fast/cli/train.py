"""``rag-fast train``: train a model directory on question-answer data from a JSON config.

The config file, its checks and the run are :mod:`rag_fast.training.run`'s (its docstring
describes the file); this module reads the options, which replace the file's ``model``,
``index``, ``output_dir`` and ``device`` (relative to the current folder), or set any value of
it (``--set KEY=VALUE`` and its short forms, in command-line order), and calls it.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex

from rag_fast.cli.common import resolve_device
from rag_fast.training.checkpoint import last_checkpoint
from rag_fast.training.run import load_config, run_training, schema_help

# the short flags: flag -> (the training config's dotted key, the value's type, its metavar)
SHORT_FLAGS = {"--max-steps": ("train.max_steps", int, "N"), "--lr": ("train.lr", float, "X"),
               "--micro-batch-size": ("train.micro_batch_size", int, "N"),
               "--seed": ("train.seed", int, "N"), "--threads": ("train.threads", int, "N")}
# what a short flag's help says beyond "the same as --set KEY=VALUE"
SHORT_HELP = {"--threads": " CPU threads for torch's ops and rag_fast's kernels, fixed (default: "
                           "RAG_FAST_THREADS if set, else adaptive: one per core, fewer while "
                           "other processes keep cores busy; docs/tuning.md)."}


def parse_value(text: str):
    """A --set value: JSON when it parses as JSON (numbers, true, false, null, lists,
    objects, quoted strings), else the text itself as a string."""
    try:
        return json.loads(text)
    except ValueError:
        return text
    except RecursionError:
        raise ValueError(f"value {text[:40]!r}... is JSON nested too deeply") from None


class _Override(argparse.Action):
    """``--set KEY=VALUE`` and the short flags: each appends ``(key, value, option)`` to
    ``args.overrides`` in command-line order (a later one wins), ``option`` being how the
    command line said it (``--set train.lr=1e-4``, ``--lr 1e-4``), named in errors."""

    def __init__(self, option_strings, dest, key=None, kind=None, **kwargs):
        super().__init__(option_strings, dest, **kwargs)
        self.key, self.kind = key, kind

    def __call__(self, parser, namespace, values, option_string=None):
        if self.key is None:
            key, sep, text = values.partition("=")
            if not sep or not all(part.strip() == part and part for part in key.split(".")):
                raise argparse.ArgumentError(
                    self, f"expected KEY=VALUE with KEY a dotted path into the training config "
                          f"(such as train.lr=1e-4 or model.n_docs=3), got {values!r}")
            try:
                value = parse_value(text)
            except ValueError as e:  # JSON nested too deeply
                raise argparse.ArgumentError(self, str(e)) from None
            option = f"{option_string} {_shown(values)}"
        else:
            try:
                value = self.kind(values)
            except ValueError:
                raise argparse.ArgumentError(
                    self, f"invalid {self.kind.__name__} value: {values!r}") from None
            key, option = self.key, f"{option_string} {_shown(values)}"
        setattr(namespace, self.dest, [*(getattr(namespace, self.dest) or []),
                                       (key, value, option, [option_string, values])])


def _shown(value: str, most: int = 80) -> str:
    """An option's value as messages name it: a long one cut, its length said."""
    return value if len(value) <= most else f"{value[:most - 20]}...({len(value)} characters)"


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
        # read by rag_fast.cli.main on Ctrl-C
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
    p.add_argument("--set", action=_Override, dest="overrides", metavar="KEY=VALUE",
                   help="Set a value of the training config by its dotted key path, such as "
                        "train.lr=1e-4, model.n_docs=3, index.verify=false or data.train=FILE, "
                        "after the file is read and before it is checked; repeat it for more "
                        "values (a later one wins). The value is read as JSON when it parses "
                        "(numbers, true, false, null, lists, quoted strings), else taken as a "
                        "string. A path it gives is relative to the current folder, and an "
                        "error about its value names this option.")
    for flag, (key, kind, metavar) in SHORT_FLAGS.items():
        p.add_argument(flag, action=_Override, dest="overrides", key=key, kind=kind,
                       metavar=metavar,
                       help=f"The same as --set {key}={metavar}.{SHORT_HELP.get(flag, '')}")
    p.set_defaults(func=run, overrides=[])
