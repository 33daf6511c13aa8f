"""Ctrl-C in the ``rag-fast`` command: one line and exit status 130, at any moment.

While a command works (``args.func``), Ctrl-C raises KeyboardInterrupt, which
:func:`rag_fast.cli.runner.run` reports in one line saying what was kept. Outside that work, in
the second of importing torch before it (once the command line is parsed) and in the
interpreter's exit after it, a KeyboardInterrupt would surface as a traceback of whatever
module was running. In
the command's process (and only there: a library user's process keeps Python's handler),
:func:`exit_on_interrupt` makes SIGINT write one line and end the process with 130 from the
signal handler itself: before the work nothing has been written, after it everything has.
"""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from typing import Iterator

_said = b""  # the line the handler writes, set by exit_on_interrupt
_exiting = False  # whether the handler below is this process's SIGINT handler
_ended = False  # whether say_last said the command's last line (a Ctrl-C after it says none)


def _exit_130(signum, frame) -> None:
    """SIGINT handler: write the line, flush what the command printed, exit 130."""
    try:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        if _said:
            os.write(2, _said)
    finally:
        os._exit(130)


def exit_now(code: int) -> None:
    """Flush the standard streams and end the process with ``code`` at once (no atexit
    handlers, no interpreter shutdown)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def exit_on_interrupt(said: str) -> None:
    """From now on, SIGINT writes ``rag-fast: interrupted SAID`` and exits 130 (main thread
    only: signal handlers are the main thread's). A process that ignores SIGINT (started in
    the background by a shell) keeps ignoring it."""
    global _said, _exiting
    if not _main_thread() or (not _exiting and signal.getsignal(signal.SIGINT) is signal.SIG_IGN):
        return
    _said = b"" if _ended else f"rag-fast: interrupted {said}\n".encode("utf-8", "replace")
    signal.signal(signal.SIGINT, _exit_130)
    _exiting = True


def say_last(line: str) -> None:
    """Print the command's last line on stderr; when :func:`exit_on_interrupt` is active, a
    Ctrl-C from then on exits 130 without a line of its own (a second Ctrl-C after the first's
    line adds none). SIGINT is held while the line is written, so the line is whole and said
    once."""
    global _said, _ended
    if not _exiting or not _main_thread() or not hasattr(signal, "pthread_sigmask"):
        print(line, file=sys.stderr)
        return
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        print(line, file=sys.stderr, flush=True)
        _said, _ended = b"", True
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def active() -> bool:
    """Whether :func:`exit_on_interrupt` handles SIGINT in this process now."""
    return _exiting


@contextlib.contextmanager
def unraisable_interrupts() -> Iterator[None]:
    """Within the block, a KeyboardInterrupt raised where Python cannot pass it on (in a
    finalizer such as a progress bar's ``__del__``) is kept rather than printed as "Exception
    ignored in ..." and lost; it is raised when the block ends without another exception."""
    seen = []
    previous = sys.unraisablehook

    def hook(unraisable) -> None:
        if isinstance(unraisable.exc_value, KeyboardInterrupt):
            seen.append(True)
            return
        previous(unraisable)

    sys.unraisablehook = hook
    try:
        yield
    finally:
        sys.unraisablehook = previous
    if seen:
        raise KeyboardInterrupt


@contextlib.contextmanager
def interrupts_raise(after: str) -> Iterator[None]:
    """Within the block, SIGINT raises KeyboardInterrupt (Python's default), so that the
    command can say what it kept. When :func:`exit_on_interrupt` was active before, it is again
    afterwards, its line saying ``after``."""
    if not _exiting or not _main_thread():
        yield
        return
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        exit_on_interrupt(after)
