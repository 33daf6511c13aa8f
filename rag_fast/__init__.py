"""rag_fast: fast Retrieval-Augmented Generation (Lewis et al., 2020).

Public API (the heavier parts are imported on first use):
    rag_token_nll, rag_sequence_nll, rag_token_marginal   fused losses / marginal (rag_fast.ops)
    linear_rag_nll                                        LM head + RAG loss, logits never held
    rag_token_beam_step                                   fused RAG-Token beam step
    reference                                             the paper's math in plain PyTorch
    empty_cache, pool_info                                the ops' CPU buffer pool (rag_fast._pool)
    set_threads, get_threads                              CPU threads of torch's ops and rag_fast's
                                                          kernels (RAG_FAST_THREADS at import; the
                                                          rag-fast command applies it itself)
    use_fused_losses                                      switch transformers' RAG models to them
    PassageStore, Encoder, DenseIndex, Retriever          retrieval (rag_fast.retrieval)
    RagModel, build_rag_model, load_retriever             model directories, retrieval, answers
    rag_token_generate, rag_sequence_generate             decoding (rag_fast.generation)
    Trainer, TrainConfig, evaluate                        training and evaluation
"""
from __future__ import annotations

import _signal  # the builtin C module: signal.py would import enum first (milliseconds)
import os as _os
import sys as _sys


def _early_interrupt(signum, frame) -> None:  # pragma: no cover  (the first milliseconds)
    _os.write(2, b"rag-fast: interrupted while starting; nothing was written\n")
    _os._exit(130)


# the rag-fast script: a Ctrl-C from here on is one line, even while the modules that set the
# command's own handler (_interrupt, below) import; only Python's own start-up comes before
if (_sys.argv and _os.path.basename(_sys.argv[0] or "") == "rag-fast"
        and _signal.getsignal(_signal.SIGINT) is _signal.default_int_handler):
    _signal.signal(_signal.SIGINT, _early_interrupt)

from rag_fast import _interrupt, _threads  # noqa: E402
from rag_fast._lazy import lazy_attributes

# the rag-fast command: Ctrl-C while it starts (the seconds of importing torch) is one line and
# exit 130, not a traceback of whichever module was loading
if _threads.is_command():
    _interrupt.exit_on_interrupt("while starting; nothing was written")
# the rag-fast command on a machine other processes keep busy: OpenMP threads sleep at barriers
# (set before torch loads OpenMP; a library user's process is left alone)
_threads.command_wait_policy()

from rag_fast._threads import get_threads, set_threads  # noqa: E402  (torch on first call)

__version__ = "0.1.0"

_LAZY = {
    "empty_cache": "rag_fast._pool",
    "pool_info": "rag_fast._pool",
    "use_fused_losses": "rag_fast.integrations",
    "linear_rag_nll": "rag_fast.ops",
    "rag_sequence_nll": "rag_fast.ops",
    "rag_token_beam_step": "rag_fast.ops",
    "rag_token_marginal": "rag_fast.ops",
    "rag_token_nll": "rag_fast.ops",
    "PassageStore": "rag_fast.retrieval",
    "Encoder": "rag_fast.retrieval",
    "DenseIndex": "rag_fast.retrieval",
    "Retriever": "rag_fast.retrieval",
    "RagModel": "rag_fast.models",
    "build_rag_model": "rag_fast.models",
    "load_retriever": "rag_fast.models",
    "rag_token_generate": "rag_fast.generation",
    "rag_sequence_generate": "rag_fast.generation",
    "causal_generate": "rag_fast.generation.causal",
    "Trainer": "rag_fast.training",
    "TrainConfig": "rag_fast.training",
    "evaluate": "rag_fast.evaluation",
}


__getattr__, __dir__ = lazy_attributes(__name__, _LAZY, globals())

# A library user's `import rag_fast` loads torch, the kernels and the ops now, as their code
# will use them; the rag-fast command loads them once its arguments are parsed
# (rag_fast.cli.runner), so that `rag-fast --help` or a mistyped flag answers without the
# seconds torch takes (the names of _LAZY are then imported on first use, and the submodule
# rag_fast.reference by `import rag_fast.reference`)
if not _threads.is_command():
    from rag_fast import _ext, reference  # noqa: E402,F401  (loads torch)
    from rag_fast._pool import empty_cache, pool_info  # noqa: E402,F401
    from rag_fast.integrations import use_fused_losses  # noqa: E402,F401
    from rag_fast.ops import (  # noqa: E402,F401
        linear_rag_nll,
        rag_sequence_nll,
        rag_token_beam_step,
        rag_token_marginal,
        rag_token_nll,
    )

    if _ext._source_checkout() is not None:  # imported from a checkout: say now (once) when
        _ext.available()                       # its extension is missing, not at the first op

    try:  # RAG_FAST_THREADS: the thread count for this process (the command applies it itself)
        _threads.apply_env()
    except ValueError:  # not an import error: RagModel reports it, as it does a bad
        pass            # RAG_FAST_POOL_MB, before any work

__all__ = ["__version__", "get_threads", "reference", "set_threads", *_LAZY]
