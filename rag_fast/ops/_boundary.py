"""The argument checks every custom op ``torch.ops.rag_fast.<name>`` runs at its boundary.

Devices, shapes, dtypes, the logits' layout (stride 1 along the last dimension) and alignment
are checked here, once, for every implementation (C++, Triton, fake), so no kernel is ever
handed memory of another device or of the wrong size. Each check raises ValueError naming the
op, the argument and what was expected.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from rag_fast.ops import backend

FLOAT, INT64 = "floating", "int64"

# expected(*logits.shape) -> {name: (tensor or None, shape, kind)}
Expected = Callable[..., dict[str, tuple[Tensor | None, tuple[int, ...], str]]]


def check_logits(op: str, impl: str, logits: Tensor, dims: str, inplace_grad: bool) -> str:
    chosen = backend.choose(impl, logits.device, logits.dtype, op)
    dtypes = backend.DTYPES[chosen]
    if logits.dim() != 4:
        raise ValueError(f"rag_fast::{op}: logits must have shape {dims}, "
                         f"got {tuple(logits.shape)}")
    if logits.dtype not in dtypes:
        raise ValueError(
            f"rag_fast::{op}: impl={chosen!r} needs logits of dtype {dtypes}, got {logits.dtype}"
        )
    if logits.stride(-1) != 1:
        raise ValueError(
            f"rag_fast::{op}: logits must have stride 1 along the vocabulary (last) dimension, "
            f"got strides {logits.stride()}; pass logits.contiguous()"
        )
    if inplace_grad and torch._debug_has_internal_overlap(logits) != 0:
        raise ValueError(
            f"rag_fast::{op}: inplace_grad=True writes the gradient into the logits, but their "
            f"elements overlap in memory (strides {logits.stride()}: expanded or broadcast); "
            "pass inplace_grad=False or logits with their own memory (e.g. .contiguous())"
        )
    return chosen


def check_tensor(
    op: str, name: str, t: Tensor, shape: tuple[int, ...], kind: str, device: torch.device
) -> None:
    if t.device != device:
        raise ValueError(f"rag_fast::{op}: {name} must be on the logits' device {device}, "
                         f"got {t.device}")
    if tuple(t.shape) != shape:
        raise ValueError(f"rag_fast::{op}: {name} must have shape {list(shape)}, "
                         f"got {list(t.shape)}")
    if kind == INT64 and t.dtype != torch.int64:
        raise ValueError(f"rag_fast::{op}: {name} must be int64, got {t.dtype}")
    if kind == FLOAT and not t.is_floating_point():
        raise ValueError(f"rag_fast::{op}: {name} must be a floating tensor, got {t.dtype}")


def check(
    op: str,
    impl: str,
    logits: Tensor,
    expected: Expected,
    *,
    dims: str = "[B, K, T, V]",
    inplace_grad: bool = False,
) -> str:
    """Check ``logits`` (shape ``dims``), then every ``name: (tensor or None, shape, kind)`` of
    ``expected(*logits.shape)``; returns the backend ("cpp" or "triton")."""
    chosen = check_logits(op, impl, logits, dims, inplace_grad)
    for name, (t, shape, kind) in expected(*logits.shape).items():
        if t is not None:
            check_tensor(op, name, t, shape, kind, logits.device)
    return chosen


def check_out(op: str, logits: Tensor, out: Tensor) -> None:
    """A gradient buffer: the logits' shape, dtype and device, stride 1 along V, no overlap."""
    check_tensor(op, "out", out, tuple(logits.shape), FLOAT, logits.device)
    if out.dtype != logits.dtype:
        raise ValueError(f"rag_fast::{op}: out must have the logits' dtype {logits.dtype}, "
                         f"got {out.dtype}")
    if out.stride(-1) != 1 or torch._debug_has_internal_overlap(out) != 0:
        raise ValueError(f"rag_fast::{op}: out must have stride 1 along V and no overlapping "
                         f"elements, got strides {out.stride()}")


def check_memory(op: str, chosen: str, raw: dict[str, Tensor], targets: Tensor | None = None,
                 ignore_index: int = -100, V: int = 0) -> None:
    """The checks that need real memory, before a kernel runs: every tensor handed over as it
    is (``raw``: the logits, a gradient buffer) is aligned to its element size, (CPU) every
    target lies in ``[0, V)`` or equals ``ignore_index`` (a kernel indexes the row with it),
    and what the backend needs is installed."""
    for name, t in raw.items():
        if t.numel() and t.data_ptr() % t.element_size() != 0:
            raise ValueError(f"rag_fast::{op}: {name} ({t.dtype}) is not aligned to its element "
                             f"size (data_ptr {t.data_ptr():#x}); pass a fresh .contiguous() copy")
    if targets is not None and targets.device.type == "cpu" and targets.numel():
        bad = (targets != ignore_index) & ((targets < 0) | (targets >= V))
        if bool(bad.any()):
            raise ValueError(f"rag_fast::{op}: targets must lie in [0, V={V}) or equal "
                             f"ignore_index={ignore_index}, found {int(targets[bad][0])}")
    backend.require(op, chosen, raw["logits"].device)
