"""Third-party chatter (``transformers``' "Loading weights" bars and info logs, Hugging Face
hub bars) off by default in rag_fast's own loads and commands.

:func:`quiet_transformers` silences them for the duration of a block and restores what was
there before, so a library user who turned them on keeps them everywhere else.
:func:`set_verbose` is what the ``rag-fast`` command calls (``--verbose``: everything
third-party speaks; otherwise it is silenced for the whole process).
"""
from __future__ import annotations

import contextlib
import logging
import os
import sys

_VERBOSE = os.environ.get("RAG_FAST_VERBOSE", "0") not in ("", "0")


# the variables set_verbose(False) may set for libraries imported later (restore_environment
# puts them back when a command run inside a longer process ends)
QUIET_VARIABLES = ("TOKENIZERS_PARALLELISM", "TRANSFORMERS_VERBOSITY",
                   "HF_HUB_DISABLE_PROGRESS_BARS")


@contextlib.contextmanager
def restore_environment():
    """Within the block :func:`set_verbose` may set :data:`QUIET_VARIABLES`; afterwards they
    are as before (``rag_fast.cli.main`` called in a process that goes on, a test's)."""
    before = {name: os.environ.get(name) for name in QUIET_VARIABLES}
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def set_verbose(verbose: bool) -> None:
    """Process-wide, for a command line: let third-party libraries print their logs, warnings
    and progress bars (True), or silence them for the whole process (False)."""
    global _VERBOSE
    _VERBOSE = bool(verbose)
    if verbose:
        return
    import warnings

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    else:  # read when it is imported (importing it here would cost a command 0.8 s)
        os.environ["TRANSFORMERS_VERBOSITY"] = "error"
    if "huggingface_hub" in sys.modules:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    else:  # likewise; transformers' own bars follow the hub's setting at its import
        os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    warnings.filterwarnings("ignore", module="transformers")
    warnings.filterwarnings("ignore", module="huggingface_hub")
    # the hub's HTTP retries ("Retrying in 1s [Retry 1/5]") log as warnings; the error that
    # follows, if any, is what the command says
    logging.getLogger("huggingface_hub").setLevel(logging.ERROR)


@contextlib.contextmanager
def quiet_transformers():
    """Inside the block ``transformers`` logs errors only and shows no progress bars."""
    if _VERBOSE:
        yield
        return
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:  # pragma: no cover - transformers is a dependency
        yield
        return
    level = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()
