"""The ``rag-fast`` command's error contract around a parsed command (see
:mod:`rag_fast.cli`): torch, the kernels and the command's module load here, after the
arguments are parsed, and every exception the command raises becomes its one line and exit
status. :func:`rag_fast.cli.main` imports this module once it has parsed the command line."""
from __future__ import annotations

import argparse
import contextlib
import sys

from rag_fast import _ext, _interrupt, _pool
from rag_fast import ops  # noqa: F401  (torch.ops.rag_fast.*, as `import rag_fast` registers them)
from rag_fast._validation import out_of_memory
from rag_fast.cli import apply_threads, one_line
from rag_fast.storage import StorageError, check_name_length, output_lock


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


# what each command writes: (its argument's attribute, the flag messages name), locked while
# the command runs so that a second command given the same output is refused at once (`train`
# locks the run folder its config names, in rag_fast.training.run; `index build --shard`
# builds share OUT.staging/ by design and lock nothing)
OUTPUTS = {
    "rag-fast index build": ("out", "--out"),
    "rag-fast index search": ("out", "--out"),
    "rag-fast index eval": ("out", "--out"),
    "rag-fast tokenizer fit": ("out", "--out"),
    "rag-fast init": ("out", "--out"),
    "rag-fast eval": ("out", "--out"),
    "rag-fast generate": ("out", "--out"),
    "rag-fast reseal": ("dir", "DIR"),
}


def _output_lock(args: argparse.Namespace) -> contextlib.AbstractContextManager:
    """The lock of the output the command writes (see :data:`OUTPUTS`), or a no-op."""
    parser = getattr(args, "_command_parser", None)
    attr, flag = OUTPUTS.get(getattr(parser, "prog", None), (None, None))
    value = getattr(args, attr, None) if attr else None
    if value:  # (a name too long for the temporaries beside it: refused before any work)
        check_name_length(value, flag)
    if not value or getattr(args, "shard", None):
        return contextlib.nullcontext()
    return output_lock(value, flag)


def run(args: argparse.Namespace) -> int:
    """The command, under :func:`rag_fast.cli.main`'s error contract."""
    if _ext._source_checkout() is not None:  # run from a checkout: say (once) when its
        _ext.available()                       # extension is missing, as `import rag_fast` does
    try:
        # the command's module and what it loads (transformers, faiss, ...), imported before
        # its output is locked: a full `index build` takes its staging folder's lock at once
        # after its --out lock, leaving no window for a --shard build of the same --out
        func = args.func.load() if hasattr(args.func, "load") else args.func
        _pool.limit_bytes()  # RAG_FAST_POOL_MB, named in one line before any work
        apply_threads(args)  # --threads / RAG_FAST_THREADS, likewise
        with _output_lock(args), \
                _interrupt.interrupts_raise(after="while reporting the command's end"), \
                _interrupt.unraisable_interrupts():
            return int(func(args) or 0)
    except (ValueError, OSError, StorageError) as exc:
        _end_progress_bars()
        print(f"rag-fast: error: {one_line(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        _end_progress_bars()
        said = ("the run's last checkpoint (if one was written) is kept: the same command "
                "resumes from it" if args.command == "train" else
                "nothing was written at the output path")
        on_interrupt = getattr(args, "on_interrupt", None)  # what the command knows by now
        if on_interrupt is not None:
            try:
                said = on_interrupt()
            except Exception:  # noqa: BLE001  (the general line is still true)
                pass
        _interrupt.say_last(f"rag-fast: interrupted; {said}")  # a second Ctrl-C adds nothing
        return 130
    except RecursionError as exc:  # a JSON input nested deeper than any reader here checks
        _end_progress_bars()
        print("rag-fast: error: an input is nested too deeply to be read (a JSON file given, or "
              f"one in a folder given; {one_line(exc)}): rag_fast writes none like it",
              file=sys.stderr)
        return 2
    except Exception as exc:  # noqa: BLE001  (a bug: said in one line, traceback kept)
        _end_progress_bars()
        if out_of_memory(exc):  # a request too large for the machine: the user's to change
            print(f"rag-fast: error: out of memory ({_allocation(exc)}): ask for less (a "
                  "smaller --batch-size, --num-beams, --max-new-tokens, --n-docs or model), "
                  "or use a machine with more memory", file=sys.stderr)
            return 2
        return _report_unexpected(exc, args.verbose)


def _allocation(exc: BaseException) -> str:
    """The bytes the failed allocation asked for, as the allocator said, or its first line."""
    import re

    found = re.search(r"tried to allocate (\d+) bytes", str(exc))
    if found:
        return f"an allocation of {int(found.group(1)):,} bytes failed"
    return one_line(exc)[:200] or type(exc).__name__
