"""The one rule that decides which backend runs an op: the PyTorch reference ("torch"), the C++
CPU kernels ("cpp") or the Triton kernels ("triton").

Every op asks :func:`choose` twice with the same answer: the public function (``impl`` one of
``"auto" | "cpp" | "triton" | "torch"``), and then, for "cpp" and "triton", the custom op
``torch.ops.rag_fast.<name>`` it calls (``impl`` one of ``"auto" | "cpp" | "triton"``), which
decides again from the tensors it is given so that a direct call of the custom op (or a
compiled graph) follows the same rule:

- ``impl="auto"`` in a public op: Triton for CUDA tensors, the C++ extension for CPU tensors
  of float32 or bfloat16, the reference otherwise (also where the extension or Triton is
  missing: ``rag_fast._ext`` has said so once, at its first use).
- ``impl="auto"`` in a custom op: the kernels of the tensors' device (C++ on the CPU, Triton
  on CUDA; meta and fake tensors, which only the fake implementation sees, take Triton's
  dtypes).
- an explicit impl that cannot run here raises ValueError naming the reason (a missing
  extension: ExtensionUnavailableError with the fix).

This module also holds what the C++ launchers of every op share: the dtype codes and the
logits view of ``csrc/kernels.h``.
"""
from __future__ import annotations

import torch

from rag_fast import _ext
from rag_fast._validation import check_impl
from rag_fast.kernels import triton_usable_for

CPP_DTYPES = (torch.float32, torch.bfloat16)
TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
DTYPES = {"cpp": CPP_DTYPES, "triton": TRITON_DTYPES}
OP_IMPLS = ("auto", "cpp", "triton")
DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1}  # csrc/kernels.h, enum class DType


def _constant_result(fn):
    """``torch.compiler.assume_constant_result`` without importing ``torch._dynamo`` (1.2 s of
    every command's start-up): the decorator only marks the function, with the attribute
    dynamo reads when it traces (tests/test_compile.py checks the two agree)."""
    fn._dynamo_marked_constant = True
    return fn


# What is installed cannot change while a program runs: torch.compile evaluates these once,
# when it traces, instead of tracing the import machinery they use (a graph break).
@_constant_result
def _ext_available() -> bool:
    return _ext.available()


@_constant_result
def _triton_usable(device_type: str) -> bool:
    return triton_usable_for(device_type)


def _triton_unusable(device) -> str:
    return (f"impl='triton' cannot run on {device}: needs CUDA, or Triton installed and "
            "TRITON_INTERPRET=1 set before import for the CPU interpreter")


def choose(impl: str, device: torch.device, dtype: torch.dtype, op: str | None = None) -> str:
    """The backend ("torch", "cpp" or "triton") that runs an op on tensors of this device and
    dtype (the logits'), by the rule of the module docstring.

    ``op=None``: a public op's choice (any of the four impls; "torch" where "auto" finds no
    kernel; an explicit kernel impl is checked against the device, the dtype and what is
    installed). ``op="<name>"``: the choice of custom op ``rag_fast::<name>`` (never "torch";
    the dtype and what is installed are checked by the op's own argument checks, once it has
    checked the logits' rank, and at the kernel boundary).

    Raises:
        ValueError: an unknown impl, or one that cannot run on this device (or dtype).
        ExtensionUnavailableError: ``impl="cpp"`` in a public op without the extension.
    """
    kind = device.type
    if op is not None:
        if impl not in OP_IMPLS:
            raise ValueError(f"rag_fast::{op}: impl must be one of {OP_IMPLS}, got {impl!r}")
        if kind == "cpu":
            return "triton" if impl == "triton" else "cpp"
        if kind == "cuda" and impl == "cpp":
            raise ValueError(
                f"rag_fast::{op}: impl='cpp' runs the C++ CPU kernels, but logits are on "
                f"{device}: use impl='triton' or 'auto' (or move the tensors to the CPU)"
            )
        # CUDA; meta (only the fake implementation runs there): Triton unless "cpp" is asked
        return "cpp" if impl == "cpp" else "triton"
    check_impl(impl)
    if impl == "auto":
        if kind == "cuda" and dtype in TRITON_DTYPES and _triton_usable("cuda"):
            return "triton"
        if kind == "cpu" and dtype in CPP_DTYPES and _ext_available():
            return "cpp"
        return "torch"
    if impl == "cpp":
        if kind != "cpu":
            raise ValueError(f"impl='cpp' needs CPU tensors, got logits on {device}")
        if dtype not in CPP_DTYPES:
            raise ValueError(f"impl='cpp' supports logits of dtype {CPP_DTYPES}, got {dtype}")
        if not _ext_available():
            _ext.get()  # raises ExtensionUnavailableError with the fix
    if impl == "triton":
        if not _triton_usable(kind):
            raise ValueError(_triton_unusable(device))
        if dtype not in TRITON_DTYPES:
            raise ValueError(f"impl='triton' supports logits of dtype {TRITON_DTYPES}, got {dtype}")
    return impl


def resolve_impl(impl: str, logits: torch.Tensor) -> str:
    """:func:`choose` for a public op's call on these logits: "cpp", "triton" or "torch"."""
    return choose(impl, logits.device, logits.dtype)


def require(op: str, backend: str, device: torch.device) -> None:
    """Before a custom op's kernel runs: what ``backend`` needs is installed (raises
    ExtensionUnavailableError, with the fix, without the extension; ValueError where Triton
    cannot run on ``device``)."""
    if backend == "cpp":
        _ext.get()
    elif not triton_usable_for(device.type):
        raise ValueError(f"rag_fast::{op}: {_triton_unusable(device)}")


def logits_view(x: torch.Tensor) -> tuple[int, ...]:
    """The ``LogitsView`` fields of ``csrc/kernels.h`` for ``x`` ``[B, K, T, V]`` (or the beam
    step's ``[B, W, K, V]``), stride 1 along the last dimension."""
    B, K, T, V = x.shape
    return (x.data_ptr(), DTYPE_CODE[x.dtype], B, K, T, V, x.stride(0), x.stride(1), x.stride(2))
