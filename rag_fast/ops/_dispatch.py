"""Picks the backend (cpp | triton | torch) for an op call.

``impl="auto"``: Triton for CUDA tensors, the C++ extension for CPU tensors (fp32/bf16), the
PyTorch reference otherwise. An explicit impl that cannot run here raises ValueError naming
the reason; a missing extension or Triton under "auto" was already reported once by
``rag_fast._ext`` and falls back to the reference.

A backend is a module with the same launchers (``row_stats``, ``row_grad``,
``token_smooth_stats``, ``token_smooth_grad``, ``token_marginal``, ``token_marginal_grad``);
see ``rag_fast/ops/_cpp.py`` for their contract.
"""
from __future__ import annotations

from types import ModuleType

import torch

from rag_fast import _ext
from rag_fast._validation import check_impl
from rag_fast.kernels import triton_usable_for

CPP_DTYPES = (torch.float32, torch.bfloat16)
TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def resolve_impl(impl: str, logits: torch.Tensor) -> str:
    """The concrete impl ("cpp", "triton" or "torch") for these logits."""
    check_impl(impl)
    device, dtype = logits.device.type, logits.dtype
    if impl == "auto":
        if device == "cuda" and dtype in TRITON_DTYPES and triton_usable_for("cuda"):
            return "triton"
        if device == "cpu" and dtype in CPP_DTYPES and _ext.available():
            return "cpp"
        return "torch"
    if impl == "cpp":
        if device != "cpu":
            raise ValueError(f"impl='cpp' needs CPU tensors, got logits on {logits.device}")
        if dtype not in CPP_DTYPES:
            raise ValueError(f"impl='cpp' supports logits of dtype {CPP_DTYPES}, got {dtype}")
        _ext.get()  # raises ExtensionUnavailableError with the fix
    if impl == "triton":
        if not triton_usable_for(device):
            raise ValueError(
                f"impl='triton' cannot run on {logits.device}: needs CUDA, or Triton installed "
                "and TRITON_INTERPRET=1 set before import for the CPU interpreter"
            )
        if dtype not in TRITON_DTYPES:
            raise ValueError(f"impl='triton' supports logits of dtype {TRITON_DTYPES}, got {dtype}")
    return impl


def backend(impl: str) -> ModuleType:
    """The launcher module of a resolved impl ("cpp" or "triton")."""
    if impl == "cpp":
        from rag_fast.ops import _cpp

        return _cpp
    if impl == "triton":
        from rag_fast.kernels import rag_losses

        return rag_losses
    raise ValueError(f"no kernel backend for impl={impl!r}")

