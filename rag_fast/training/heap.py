"""Keeping the memory a CPU training step frees, for the next step (glibc's malloc thresholds).

A training step frees and re-allocates its activation-sized temporaries every step (a
BART-base-sized step's feed-forward activations and their gradients, 8-16 MB each). By default
glibc returns freed memory at the top of its heap to the kernel once it exceeds an adaptive
trim threshold, and maps blocks above an adaptive mmap threshold afresh; the next step then
touches that memory again, one minor page fault per 4 KiB page, each a trip into the kernel
that zeroes the page. :func:`keep_freed_memory` sets both thresholds (``mallopt``) so that
freed blocks below 32 MiB stay in the process for reuse: its peak memory barely changes (the
heap holds what the step already used at its peak), but memory freed after training is not
returned to the kernel until the process ends. Measured figures: docs/tuning.md, "Training on
the CPU: glibc's heap".

The :class:`~rag_fast.training.Trainer` calls it when it trains on the CPU (``TrainConfig``'s
``keep_freed_memory``, default on). It changes nothing when the environment already sets one of
these thresholds (:func:`user_setting`: the user's choice stands), or when the C library is not
glibc. glibc's settings are per process and cannot be read back, so they stay for the rest of
the process, and a setting the process made itself with ``mallopt`` cannot be seen: such a
program turns ``keep_freed_memory`` off.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
import threading
from collections.abc import Callable, Mapping

TRIM_THRESHOLD = 1 << 30  # freed memory at the top of the heap kept, up to this much
MMAP_THRESHOLD = 32 << 20  # blocks of this size or more are still mapped and unmapped
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # <malloc.h>
# glibc's tunables and environment variables for the thresholds this module sets and the two
# that decide with them what returns to the kernel
_TUNABLES = ("glibc.malloc.trim_threshold", "glibc.malloc.mmap_threshold",
             "glibc.malloc.top_pad", "glibc.malloc.mmap_max")
_MALLOC_VARIABLES = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_",
                     "MALLOC_MMAP_MAX_")

_lock = threading.Lock()
_outcome: str | None = None


def user_setting(environ: Mapping[str, str]) -> str | None:
    """The environment variable through which the user set one of glibc's trim, mmap or top-pad
    thresholds (or its mmap count), if any: ``GLIBC_TUNABLES`` naming one of them, or one of
    the ``MALLOC_TRIM_THRESHOLD_``, ``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TOP_PAD_``,
    ``MALLOC_MMAP_MAX_`` variables. Other malloc settings (arenas, caches) do not count."""
    tunables = {item.split("=", 1)[0].strip()
                for item in environ.get("GLIBC_TUNABLES", "").split(":")}
    if tunables & set(_TUNABLES):
        return "GLIBC_TUNABLES"
    return next((name for name in _MALLOC_VARIABLES if name in environ), None)


def _glibc() -> ctypes.CDLL | None:
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    for name in (None, ctypes.util.find_library("c")):  # the process's own symbols first
        try:
            libc = ctypes.CDLL(name)
        except OSError:
            continue
        if hasattr(libc, "mallopt"):
            return libc
    return None


def keep_freed_memory(environ: Mapping[str, str] | None = None,
                      libc: Callable[[], object | None] = _glibc) -> str:
    """Set glibc's trim threshold to 1 GiB and its mmap threshold to 32 MiB for this process
    (the module docstring), once; later calls return the first call's outcome.

    Returns:
        ``"set"``; ``"environment"`` when the environment already sets malloc thresholds (left
        as they are); ``"unavailable"`` when the C library is not glibc or refused a setting.
    """
    global _outcome
    with _lock:
        if _outcome is None:
            if user_setting(os.environ if environ is None else environ) is not None:
                _outcome = "environment"
            else:
                c = libc()
                # both: setting either one turns glibc's adaptive thresholds off, leaving the
                # other where it happens to be
                ok = c is not None and bool(c.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) \
                    and bool(c.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
                _outcome = "set" if ok else "unavailable"
        return _outcome
