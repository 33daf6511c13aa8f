"""Loads the compiled extension ``rag_fast._C``.

If the extension is missing or broken (a source checkout that was never built, an ABI
mismatch), one warning says so and how to fix it; every op keeps working through the
reference path.
"""
from __future__ import annotations

import importlib
import warnings
from types import ModuleType

_module: ModuleType | None = None
_error: str | None = None
_loaded = False

FIX = (
    "Reinstall rag_fast from source so the extension is compiled: "
    "`pip install .` (or `pip install -e .` in a checkout); build logs show compiler errors. "
    "Until then rag_fast falls back to its PyTorch reference path (slower, more memory)."
)


class ExtensionUnavailableError(RuntimeError):
    """Raised when impl='cpp' is requested but rag_fast._C could not be loaded."""


def _load() -> None:
    global _module, _error, _loaded
    if _loaded:
        return
    _loaded = True
    try:
        _module = importlib.import_module("rag_fast._C")
    except Exception as exc:  # ImportError, or an OSError from a broken shared object
        _error = f"{type(exc).__name__}: {exc}"
        warnings.warn(
            f"rag_fast C++ extension unavailable ({_error}). {FIX}", RuntimeWarning, stacklevel=3
        )


def available() -> bool:
    """True when the compiled extension loaded."""
    _load()
    return _module is not None


def error() -> str | None:
    """Why the extension did not load, or None."""
    _load()
    return _error


def get() -> ModuleType:
    """The extension module; raises ExtensionUnavailableError (with the fix) if missing."""
    _load()
    if _module is None:
        raise ExtensionUnavailableError(f"rag_fast._C is not available ({_error}). {FIX}")
    return _module
