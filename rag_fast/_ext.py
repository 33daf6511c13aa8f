"""Loads the compiled extension ``rag_fast._C``.

If the extension is missing or broken (a source checkout that was never built, an ABI
mismatch), one warning says so and how to fix it; every op keeps working through the
reference path. The warning comes at first use of the extension; when rag_fast is imported
from a source checkout (Python started in the repository root after a non-editable ``pip
install .``, say), at ``import rag_fast`` already.
"""
from __future__ import annotations

import importlib
import importlib.machinery
import sys
import warnings
from pathlib import Path
from types import ModuleType

_module: ModuleType | None = None
_error: str | None = None
_diagnosis: str | None = None
_loaded = False

PACKAGE_DIR = Path(__file__).resolve().parent

FIX = (
    "Reinstall rag_fast from source so the extension is compiled: "
    "`pip install .` (or `pip install -e .` in a checkout); build logs show compiler errors. "
    "Until then rag_fast falls back to its PyTorch reference path (slower, more memory)."
)


class ExtensionUnavailableError(RuntimeError):
    """Raised when impl='cpp' is requested but rag_fast._C could not be loaded."""


class SourceTreeWarning(RuntimeWarning):
    """rag_fast was imported from a source checkout whose extension is not built (typically:
    Python started in the repository root after a non-editable `pip install .`)."""


def _source_checkout() -> Path | None:
    """The checkout rag_fast was imported from, or None for an installed package."""
    root = PACKAGE_DIR.parent
    if (root / "setup.py").is_file() and (root / "CMakeLists.txt").is_file():
        return root
    return None


def _installed_elsewhere() -> Path | None:
    """Another rag_fast package on the import path (site-packages, another checkout's editable
    install), i.e. the one Python would import if the checkout were not in the way."""
    here = PACKAGE_DIR.parent
    paths = [p for p in sys.path if Path(p or ".").resolve() != here]
    for finder in sys.meta_path:
        try:
            is_path_finder = finder is importlib.machinery.PathFinder
            spec = finder.find_spec("rag_fast", paths if is_path_finder else None)
        except Exception:  # a third-party finder that cannot answer
            continue
        if spec is not None and spec.origin and Path(spec.origin).resolve().parent != PACKAGE_DIR:
            return Path(spec.origin).resolve().parent
    return None


def _explain(error: str) -> tuple[str, type[RuntimeWarning]]:
    """The warning text (what happened, the fix) and its category."""
    root = _source_checkout()
    if root is None:
        return f"rag_fast C++ extension unavailable ({error}). {FIX}", RuntimeWarning
    built = any(
        (PACKAGE_DIR / f"_C{suffix}").is_file() for suffix in importlib.machinery.EXTENSION_SUFFIXES
    )
    state = (
        "whose in-place build of the extension does not load"
        if built
        else "and this checkout has no compiled extension (rag_fast/_C*.so) for this Python"
    )
    installed = _installed_elsewhere()
    outside = "run Python from outside this checkout to use the installed rag_fast"
    if installed is not None:
        outside += f" (at {installed})"
    message = (
        f"rag_fast C++ extension unavailable ({error}): rag_fast was imported from the source "
        f"checkout {PACKAGE_DIR} {state}, so every op runs on the slow PyTorch reference "
        f"kernels. Fix: build the extension in place with `pip install -e .` in {root}, or "
        f"{outside}."
    )
    return message, SourceTreeWarning


def _load() -> None:
    global _module, _error, _diagnosis, _loaded
    if _loaded:
        return
    _loaded = True
    try:
        _module = importlib.import_module("rag_fast._C")
    except Exception as exc:  # ImportError, or an OSError from a broken shared object
        _error = f"{type(exc).__name__}: {exc}"
        _diagnosis, category = _explain(_error)
        warnings.warn(_diagnosis, category, stacklevel=3)


def available() -> bool:
    """True when the compiled extension loaded."""
    _load()
    return _module is not None


def error() -> str | None:
    """Why the extension did not load, or None."""
    _load()
    return _error


def diagnosis() -> str | None:
    """The warning's full text (what happened and how to fix it), or None if it loaded."""
    _load()
    return _diagnosis


def get() -> ModuleType:
    """The extension module; raises ExtensionUnavailableError (with the fix) if missing."""
    _load()
    if _module is None:
        raise ExtensionUnavailableError(_diagnosis)
    return _module
