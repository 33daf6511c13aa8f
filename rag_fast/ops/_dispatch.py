"""Picks the impl (cpp | triton | torch) of a public op call.

``impl="auto"``: Triton for CUDA tensors, the C++ extension for CPU tensors (fp32/bf16), the
PyTorch reference otherwise. An explicit impl that cannot run here raises ValueError naming
the reason; a missing extension or Triton under "auto" was already reported once by
``rag_fast._ext`` and falls back to the reference.

"cpp" and "triton" then run through the custom ops (``rag_fast/ops/_custom_ops.py``), which
check every argument again at the kernel boundary; "torch" runs ``rag_fast.reference``.
"""
from __future__ import annotations

import torch

from rag_fast import _ext
from rag_fast._validation import check_impl
from rag_fast.kernels import triton_usable_for

CPP_DTYPES = (torch.float32, torch.bfloat16)
TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# What is installed cannot change while a program runs: torch.compile evaluates these once,
# when it traces, instead of tracing the import machinery they use (a graph break).
@torch.compiler.assume_constant_result
def _ext_available() -> bool:
    return _ext.available()


@torch.compiler.assume_constant_result
def _triton_usable(device_type: str) -> bool:
    return triton_usable_for(device_type)


def resolve_impl(impl: str, logits: torch.Tensor) -> str:
    """The concrete impl ("cpp", "triton" or "torch") for these logits."""
    check_impl(impl)
    device, dtype = logits.device.type, logits.dtype
    if impl == "auto":
        if device == "cuda" and dtype in TRITON_DTYPES and _triton_usable("cuda"):
            return "triton"
        if device == "cpu" and dtype in CPP_DTYPES and _ext_available():
            return "cpp"
        return "torch"
    if impl == "cpp":
        if device != "cpu":
            raise ValueError(f"impl='cpp' needs CPU tensors, got logits on {logits.device}")
        if dtype not in CPP_DTYPES:
            raise ValueError(f"impl='cpp' supports logits of dtype {CPP_DTYPES}, got {dtype}")
        if not _ext_available():
            _ext.get()  # raises ExtensionUnavailableError with the fix
    if impl == "triton":
        if not _triton_usable(device):
            raise ValueError(
                f"impl='triton' cannot run on {logits.device}: needs CUDA, or Triton installed "
                "and TRITON_INTERPRET=1 set before import for the CPU interpreter"
            )
        if dtype not in TRITON_DTYPES:
            raise ValueError(f"impl='triton' supports logits of dtype {TRITON_DTYPES}, got {dtype}")
    return impl

