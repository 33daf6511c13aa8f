"""Triton kernels. Imported lazily: rag_fast works without Triton.

Triton runs on a CUDA GPU, or on the CPU when ``TRITON_INTERPRET=1`` is set before Triton is
imported (fp32 only, small shapes: that is how CI tests these kernels).
"""
from __future__ import annotations

import importlib
import importlib.metadata
import os


def interpreter_enabled() -> bool:
    """True when Triton runs kernels on the CPU through its interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_status() -> tuple[str, str]:
    """``(version, usable)``: Triton's version and whether its kernels can run here."""
    try:
        version = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        return "not installed", ("no (the GPU kernels: a CUDA build of torch brings Triton, or "
                                 "pip install 'rag_fast[gpu]'; the CPU runs the C++ kernels)")
    try:
        importlib.import_module("triton")
    except Exception as exc:
        return version, f"no (import failed: {type(exc).__name__}: {exc})"
    import torch

    if torch.cuda.is_available():
        return version, "yes (CUDA)"
    if interpreter_enabled():
        return version, "yes (CPU interpreter, TRITON_INTERPRET=1)"
    return version, "no (no CUDA device; set TRITON_INTERPRET=1 to run on the CPU)"


def triton_usable_for(device_type: str) -> bool:
    """Whether Triton kernels can run on tensors of this device type."""
    if device_type == "cuda":
        ok = True
    elif device_type == "cpu":
        ok = interpreter_enabled()
    else:
        return False
    if not ok:
        return False
    try:
        importlib.import_module("triton")
    except Exception:
        return False
    return True
