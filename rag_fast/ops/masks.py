"""One-bit masks: plain functions (no autograd, no compiled graphs) over the C++ extension.

:func:`bits_mask` / :func:`bits_unmask`: a tensor whose elements all have the bits of 0 or of
one value, as one bit per element and back (the lean activations store the dropout masks torch
saves for the backward this way: ``rag_fast/models/_lean.py``).

Each function checks its arguments (ValueError naming the argument) before its launcher, in
:class:`cpp`, hands raw pointers to the kernels of ``csrc/masks.cpp``; without the extension
they raise ExtensionUnavailableError with the fix.
"""
from __future__ import annotations

import torch
from torch import Tensor

from rag_fast import _ext


def bits_mask(t: Tensor, one: int) -> Tensor | None:
    """The bit mask of a CPU tensor whose elements all have the bits of 0 or of ``one`` (an
    unsigned integer of the element's width): a uint8 tensor of ``ceil(numel / 8)`` bytes,
    element ``i`` of ``t`` (flattened) in bit ``i % 8`` of byte ``i // 8``; or None if some
    element has other bits. One pass in the C++ extension. Raises ValueError for a tensor the
    kernel cannot read, and ExtensionUnavailableError without the extension."""
    _check_bits_operand(t, one, "t")
    return cpp.bits_mask(t, one)


def bits_unmask(bits: Tensor, like: Tensor, one: int) -> Tensor:
    """The inverse of :func:`bits_mask`: a new contiguous tensor of ``like``'s shape and dtype
    whose elements have the bits of ``one`` where ``bits`` has a set bit and are 0 elsewhere.
    ``like`` is only read for its shape and dtype. Raises ValueError for ``bits`` that is not
    a contiguous CPU uint8 tensor of ``ceil(like.numel() / 8)`` bytes."""
    _check_bits_operand(like, one, "like", contiguous=False)
    n = (like.numel() + 7) // 8
    if (bits.device.type != "cpu" or bits.dtype != torch.uint8 or not bits.is_contiguous()
            or bits.numel() != n):
        raise ValueError(f"rag_fast bits_unmask: bits must be a contiguous CPU uint8 tensor of "
                         f"{n} bytes, got {bits.dtype} of {bits.numel()} on {bits.device}")
    return cpp.bits_unmask(bits, like, one)


def _describe(t) -> str:
    if not isinstance(t, Tensor):
        return type(t).__name__
    return (f"{t.dtype} {tuple(t.shape)} on {t.device}"
            + ("" if t.is_contiguous() else ", not contiguous"))


def _check_bits_operand(t: Tensor, one: int, name: str, contiguous: bool = True) -> None:
    if (t.device.type != "cpu" or (contiguous and not t.is_contiguous())
            or t.element_size() not in (2, 4, 8)):
        need = "a contiguous CPU tensor" if contiguous else "a CPU tensor"
        raise ValueError(f"rag_fast bits mask: {name} must be {need} of 2, 4 or 8-byte "
                         f"elements, got {t.dtype} on {t.device}, contiguous={t.is_contiguous()}")
    if not 0 <= one < 1 << (8 * t.element_size()):
        raise ValueError(f"rag_fast bits mask: one={one} does not fit {t.element_size()} bytes")
    _ext.get()  # ExtensionUnavailableError, with the fix, if the extension is missing


# ---- the C++ launchers ---------------------------------------------------------------------


class cpp:  # a namespace: the launchers of csrc/masks.cpp
    """The C++ launchers, on arguments the functions above have checked."""

    @staticmethod
    def bits_mask(t: torch.Tensor, one: int) -> torch.Tensor | None:
        """The bits of ``t == one`` (elements compared as bits), eight elements per byte (element
        ``i`` in bit ``i % 8`` of byte ``i // 8``), if every element of ``t`` is 0 or ``one``, else
        None. ``t``: contiguous, on the CPU, 2, 4 or 8 bytes per element; ``one``: the unsigned
        bits."""
        out = torch.empty((t.numel() + 7) // 8, dtype=torch.uint8)
        if not _ext.get().bits_mask(t.data_ptr(), t.element_size(), t.numel(), one, out.data_ptr()):
            return None
        return out

    @staticmethod
    def bits_unmask(bits: torch.Tensor, like: torch.Tensor, one: int) -> torch.Tensor:
        """The inverse of :func:`bits_mask`: a tensor of ``like``'s shape and dtype (contiguous)
        holding ``one`` (as bits) where the bit is set and 0 elsewhere."""
        out = torch.empty(like.shape, dtype=like.dtype)
        _ext.get().bits_unmask(bits.data_ptr(), out.element_size(), out.numel(), one, out.data_ptr())
        return out
