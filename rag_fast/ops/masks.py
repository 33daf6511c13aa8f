"""One-bit masks: plain functions (no autograd, no compiled graphs) over the C++ extension.

- :func:`bits_mask` / :func:`bits_unmask`: a tensor whose elements all have the bits of 0 or of
  one value, as one bit per element and back (the lean activations store saved dropout masks
  this way: ``rag_fast/models/_lean.py``).
- :func:`dropout_keep_bits` / :func:`masked_scale`: torch's CPU dropout mask drawn as bits from
  a generator state, and the product by such a mask (``rag_fast/models/_dropout.py``).

Each function checks its arguments (ValueError naming the argument) before its launcher, in
:class:`cpp`, hands raw pointers to the kernels of ``csrc/masks.cpp``; without the extension
they raise ExtensionUnavailableError with the fix.
"""
from __future__ import annotations

import math

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


def dropout_keep_bits(state: Tensor, n: int, keep: float) -> Tensor | None:
    """The bits of torch's CPU dropout mask over ``n`` elements, as ``bernoulli_(keep)`` on a
    float tensor draws it from a generator whose ``get_state()`` is ``state``: a uint8 tensor of
    ``ceil(n / 8)`` bytes, element ``i`` kept where bit ``i % 8`` of byte ``i // 8`` is set.
    ``state`` is advanced in place as that draw advances the generator (``set_state`` it
    back). None, with ``state`` unchanged, for a state the kernel does not recognise. Raises
    ValueError for a ``state`` that is no contiguous CPU uint8 tensor, an ``n`` below 0 or a
    ``keep`` outside (0, 1] (``keep`` is 1.0 for a drop probability below 2^-53: every
    element kept, two words drawn for each as torch draws them)."""
    if (not isinstance(state, Tensor) or state.device.type != "cpu"
            or state.dtype != torch.uint8 or not state.is_contiguous() or state.dim() != 1):
        raise ValueError("rag_fast dropout_keep_bits: state must be a CPU generator's "
                         "get_state() (a contiguous 1-D uint8 CPU tensor), got "
                         f"{_describe(state)}")
    if not isinstance(n, int) or n < 0:
        raise ValueError(f"rag_fast dropout_keep_bits: n must be an int >= 0, got {n!r}")
    if not (isinstance(keep, float) and 0.0 < keep <= 1.0):
        raise ValueError(f"rag_fast dropout_keep_bits: keep must be a float in (0, 1], "
                         f"got {keep!r}")
    _ext.get()
    # u < keep for u = k * 2**-53 (k an integer below 2**53) exactly when k < ceil(keep * 2**53)
    return cpp.dropout_keep_bits(state, n, math.ceil(math.ldexp(keep, 53)))


def masked_scale(t: Tensor, bits: Tensor, scale: float, out: Tensor | None = None) -> Tensor:
    """``t * (scale where the element's bit is set, else 0)``: a contiguous float32 CPU tensor
    of ``t``'s shape (``out``, if given, which may be ``t``). ``bits`` as
    :func:`dropout_keep_bits` gives them. Raises ValueError for tensors the kernel cannot
    read."""
    if (not isinstance(t, Tensor) or t.device.type != "cpu" or t.dtype != torch.float32
            or not t.is_contiguous()):
        raise ValueError(f"rag_fast masked_scale: t must be a contiguous float32 CPU tensor, "
                         f"got {_describe(t)}")
    n = (t.numel() + 7) // 8
    if (not isinstance(bits, Tensor) or bits.device.type != "cpu" or bits.dtype != torch.uint8
            or not bits.is_contiguous() or bits.numel() != n):
        raise ValueError(f"rag_fast masked_scale: bits must be a contiguous CPU uint8 tensor "
                         f"of {n} bytes, got {_describe(bits)}")
    if out is None:
        out = torch.empty_like(t, memory_format=torch.contiguous_format)
    elif (out.device.type != "cpu" or out.dtype != torch.float32 or not out.is_contiguous()
          or out.shape != t.shape):
        raise ValueError(f"rag_fast masked_scale: out must be a contiguous float32 CPU tensor "
                         f"of shape {tuple(t.shape)}, got {_describe(out)}")
    _ext.get()
    cpp.masked_scale(t, bits, float(scale), out)
    return out


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

    @staticmethod
    def dropout_keep_bits(state: torch.Tensor, n: int, threshold: int) -> torch.Tensor | None:
        """The kept elements of torch's CPU dropout mask over ``n`` elements, eight per byte
        (element ``i`` in bit ``i % 8`` of byte ``i // 8``): those whose double from the generator
        is below ``threshold * 2**-53``. ``state``: a CPU generator's ``get_state()`` bytes
        (contiguous uint8), advanced in place past the ``2 * n`` words drawn; None (``state``
        unchanged) if the kernel does not recognise it."""
        bits = torch.empty((n + 7) // 8, dtype=torch.uint8)
        if not _ext.get().dropout_keep_bits(state.data_ptr(), state.numel(), n, threshold,
                                            bits.data_ptr()):
            return None
        return bits

    @staticmethod
    def masked_scale(src: torch.Tensor, bits: torch.Tensor, scale: float, out: torch.Tensor) -> None:
        """``out = src * (bit set ? scale : 0)`` elementwise (float32, contiguous, ``out`` may be
        ``src``); ``bits`` as :func:`dropout_keep_bits` gives them."""
        _ext.get().masked_scale(src.data_ptr(), bits.data_ptr(), src.numel(), scale, out.data_ptr())
