"""The ``rag-fast`` command.

    rag-fast index build --passages FILE --encoder NAME [--preset ivfpq] [--on-disk] --out DIR [--shard i/n]
    rag-fast index search DIR "question" [-k 5]        (or --queries FILE [--out FILE])
    rag-fast index eval --data QA.jsonl --index DIR [-k 1,5,20] [--out DIR]
    rag-fast index info DIR
    rag-fast tokenizer fit --passages FILE [--data QA.jsonl] --vocab-size N --out DIR
    rag-fast init --index DIR --generator NAME|DIR|CONFIG.json --out MODEL_DIR
    rag-fast train --config FILE [--model MODEL_DIR] [--output-dir RUN_DIR]
    rag-fast eval --data dev.jsonl --model RUN_DIR [--out EVAL_DIR]
    rag-fast generate --model RUN_DIR --question "..."
    rag-fast reseal DIR                  accept a hand edit of a model's or an index's manifest

One module per top-level command (``index``, ``tokenizer``, ``reseal``, ``init``, ``train``,
``eval``, ``generate``, ``serve``) holds what it runs, which parses nothing more and calls the
library; :mod:`rag_fast.cli.parsers` holds every command's options (``COMMANDS``) and imports
nothing heavy, so that ``rag-fast --help`` and a usage error answer without loading torch;
:mod:`rag_fast.cli.common` holds what several commands share. The error contract
(:mod:`rag_fast.cli.runner`, loaded with torch once the command line is parsed): errors the user
can fix (bad arguments, missing or corrupt files) print one line and exit 2; an unexpected
error prints one line and exits 1 with the traceback in a file; Ctrl-C exits 130, saying what
was kept (a command that knows more sets ``args.on_interrupt``, as ``train`` does to name its
last checkpoint and the command that resumes from it). Third-party logs and progress bars are
off unless ``--verbose``.
"""
from __future__ import annotations

import argparse
import atexit
import importlib
import sys
import threading
import warnings

from rag_fast import _interrupt, _threads
from rag_fast._quiet import restore_environment, set_verbose
from rag_fast.cli.parsers import COMMANDS

class _Parser(argparse.ArgumentParser):
    """argparse's parser, except that a command given an option it does not know reports that
    option first: in ``index build --encoderr x`` the mistake is the typo, not the ``--encoder``
    argparse then finds missing. :func:`main` hands every command's parser the arguments
    (``argv``) before parsing."""

    argv: list[str] | None = None
    top_options: frozenset[str] = frozenset()

    def __init__(self, *args, **kwargs) -> None:
        # no prefix matching: `--n-doc` is a typo to name, not a silent `--n-docs`
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        if message.startswith("the following arguments are required") and self.argv:
            known = self.top_options | {s for a in self._actions for s in a.option_strings}
            unknown = [a for a in self.argv
                       if a.startswith("--") and a.split("=", 1)[0] not in known]
            if unknown:
                _unknown_options(self, unknown)
        # one line, as every other error of the command (not argparse's usage block)
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())} (see `{self.prog} "
                     "--help`)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="rag-fast", description="Fast Retrieval-Augmented Generation. The workflow: "
        "index build -> init -> train -> eval -> generate (or serve), each reading what the one "
        "before wrote; tokenizer fit makes a generator tokenizer for a generator trained from "
        "scratch.")
    parser.add_argument("--verbose", action="store_true",
                        help="show third-party logs and progress bars (transformers, hub)")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="{" + ",".join(COMMANDS) + "}")
    for register in COMMANDS.values():
        register(subparsers)
    _mark_commands(parser)
    _add_threads_option(parser)
    return parser


# commands that compute nothing worth threads: no --threads
NO_THREADS = frozenset({"rag-fast reseal", "rag-fast index info"})


def _add_threads_option(parser: argparse.ArgumentParser) -> None:
    """``--threads N`` on every command that computes (the leaf parsers, less
    :data:`NO_THREADS`; ``train`` has its own, a short form of ``--set train.threads=N``)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                if any(isinstance(a, argparse._SubParsersAction) for a in sub._actions):
                    _add_threads_option(sub)
                elif sub.prog not in NO_THREADS and "--threads" not in sub._option_string_actions:
                    sub.add_argument(
                        "--threads", type=int, default=None, metavar="N",
                        help="CPU threads for torch's ops and rag_fast's kernels (default: "
                             "RAG_FAST_THREADS if set, else one per core; on a machine "
                             "another process keeps busy, 1 runs steadier: docs/tuning.md)")


def apply_threads(args: argparse.Namespace) -> int | None:
    """The command's thread count: ``--threads``, else ``RAG_FAST_THREADS``, else torch's
    default (one per core) left as it is. Returns the count set (None: unchanged).

    Raises:
        ValueError: a count below 1, naming the flag or the variable.
    """
    n = getattr(args, "threads", None)
    if n is not None:
        _threads.set_threads(_threads.check_threads(n, "--threads"))
        return n
    return _threads.apply_env()


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
    """Exit as a usage error does (status 2, one line), naming the unknown arguments and the
    command's closest option."""
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


def one_line(exc: BaseException) -> str:
    """An exception as one line: an OSError as its reason and the file it names, anything
    else as its message with line breaks folded."""
    if isinstance(exc, OSError) and exc.strerror:
        text = exc.strerror + (f": {exc.filename}" if exc.filename else "")
    else:
        text = str(exc) or type(exc).__name__
    if isinstance(exc, KeyError):  # str(KeyError) is the key's repr
        text = f"missing key {text}"
    return " ".join(_shortened(word) for word in text.split())


_LONGEST_WORD = 200  # characters of one word of an error line kept whole


def _shortened(word: str) -> str:
    """``word`` whole, or its start and end around how much was left out: a crafted value
    (a 400-digit number, a megabyte-long name) echoed in an error stays one readable line."""
    if len(word) <= _LONGEST_WORD:
        return word
    return f"{word[:120]}...({len(word) - 160:,} characters)...{word[-40:]}"


def _one_line_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """``warnings.showwarning`` for a command: ``rag-fast: warning: MESSAGE`` on one line,
    without the source line Python adds (``--verbose`` keeps Python's format)."""
    print(f"rag-fast: warning: {' '.join(str(message).split())}", file=file or sys.stderr)


def main(argv: list[str] | None = None) -> int:
    """Run a command. Exit status: 0 done; 2 an expected failure (bad argument, input, file or
    artefact, no space left), said in one line naming the file, line or key; 1 an unexpected
    error (one line, the traceback in a file); 130 interrupted."""
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    top = frozenset(s for a in parser._actions for s in a.option_strings)
    parser.argv, parser.top_options = argv, top  # `rag-fast --typo`: the typo, not the command
    _give_argv(parser, argv, top)
    args, extra = parser.parse_known_args(argv)
    if extra:
        _unknown_options(getattr(args, "_command_parser", parser), extra)
    shown, stdout = warnings.showwarning, sys.stdout
    if stdout is sys.__stdout__ and stdout is not None:  # the process's own, not a capture
        sys.stdout = _NamedStdout(stdout)
    if not args.verbose:  # a warning is one line, as the command's own are
        warnings.showwarning = _one_line_warning
    try:
        with restore_environment():  # main() called in a process that goes on keeps its own
            set_verbose(args.verbose)
            # the command's module, torch and the kernels load only now (the parsers import
            # nothing heavy: `rag-fast --help` and a mistyped flag do not wait for them)
            code = importlib.import_module("rag_fast.cli.runner").run(args)
    finally:
        warnings.showwarning, sys.stdout = shown, stdout  # main() in a process that goes on
        if _interrupt.active():  # the command's process: Ctrl-C while it exits is one line
            _interrupt.exit_on_interrupt("while exiting; the command had ended")
    if code == 130 and _threads.is_command():
        # interrupted, its last line said: the command's process ends here, without Python's
        # shutdown, where a library's thread (torch's) writing to a stream already closed
        # aborted the process (SIGABRT) after a Ctrl-C of `train`
        _interrupt.exit_now(130)
    return code


def command() -> None:
    """The ``rag-fast`` script (and ``python -m rag_fast.cli``): :func:`main`, then the end
    of the process without Python's shutdown, which sets SIGINT back to its default action
    before it ends: a Ctrl-C in its last few tenths of a second killed a finished command
    without a line. The exit functions run first, with the command's handler still saying
    one line; then the process ends with main's status."""
    code = main()
    if _threads.is_command():
        getattr(threading, "_shutdown", lambda: None)()  # (non-daemon threads, as Python does)
        atexit._run_exitfuncs()
        _interrupt.exit_now(code)
    sys.exit(code)


class _NamedStdout:
    """The process's standard output, whose write errors name it: ``> /dev/full`` or a full
    disk under a redirection says "standard output", not a bare "No space left on device"."""

    def __init__(self, stream):
        self._stream = stream

    def _named(self, call, *args):
        try:
            return call(*args)
        except OSError as e:
            if e.errno is None or e.filename is not None:
                raise
            raise OSError(e.errno, f"writing standard output: {e.strerror} (the command's "
                          "output is lost)") from None

    def write(self, text):
        return self._named(self._stream.write, text)

    def flush(self):
        return self._named(self._stream.flush)

    def __getattr__(self, name):
        return getattr(self._stream, name)
