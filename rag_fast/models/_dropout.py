"""Dropout on the CPU with torch's own masks, drawn faster and kept as bits.

A BART- or T5-style generator applies dropout to every layer's output (BART-base: 13 tensors
``[B*K, L, d]`` in the encoder, 19 ``[B*K, T, d]`` in the decoder). On the CPU, torch draws
each mask with ``bernoulli_`` on a float tensor, a serial loop that takes two 32-bit words of
the generator's Mersenne Twister per element (about 6 ns each on the benchmark machines), then
divides the mask by the keep probability, multiplies, and saves the float mask for the
backward: for a BART-base-sized step about 6% of its time.

While :func:`cpu_dropout` is active, ``torch.nn.functional.dropout`` (and so ``nn.Dropout``)
on a contiguous float32 CPU tensor in training mode runs :class:`_CpuDropout` instead:

- the mask is drawn by the C++ extension (``csrc/dropout.cpp``) from the same generator state,
  word for word as torch's kernel draws it (the Mersenne Twister's state update and output in
  blocks, the comparison in integers), one bit per element, and the generator is advanced
  exactly as torch's draw advances it, so every later random number is unchanged too;
- the output is ``x * (1 / (1 - p))`` where kept and ``x * 0`` elsewhere, the very float
  products torch computes (the same scale, computed by the same torch division);
- the backward multiplies the gradient the same way, from the bits.

Values, gradients and the generator's state are bit-identical to torch's dropout
(``tests/test_dropout.py``). Because this depends on how torch draws the mask, the first use in
a process checks it (:func:`exact`, on 4,099 elements with ``-0``, ``inf`` and ``nan``, both
outputs and gradients compared as bits, the generator restored afterwards); if torch draws
differently (another version, another kernel), torch's own dropout runs as before. Anything
else (another dtype or device, a non-contiguous or small tensor, ``inplace=True``, under
``torch.compile``, a ``torch.func`` transform, forward-mode AD) also runs torch's own
dropout.

The generator is read and written back (``get_state`` / ``set_state``) around the draw,
without the lock torch's own draw holds: a thread that draws from the default CPU generator
at the same moment as a routed dropout would see some of its numbers again. Training loops
(and data-loader worker processes, which have generators of their own) do not do that; where
something does, ``RAG_FAST_CPU_DROPOUT=0`` in the environment keeps torch's own dropout
everywhere.
"""
from __future__ import annotations

import contextlib
import functools
import math
import os
import threading
import warnings

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from rag_fast import _ext
from rag_fast.ops import masks

# Tensors with fewer elements keep torch's dropout: reading and writing the generator's state
# (5 KB each way) costs about as much as torch's draw of this many elements.
MIN_ELEMENTS = 8192


@functools.lru_cache(maxsize=64)
def _scale(p: float) -> float:
    """``1 / (1 - p)`` as torch's dropout computes it (a float32 one divided by ``1 - p``)."""
    return float(torch.ones(1, dtype=torch.float32).div_(1 - p))


def _draw(x: torch.Tensor, p: float) -> tuple[torch.Tensor, float] | None:
    """The bits of the mask torch's dropout would draw for ``x`` now, and its scale; the
    default generator advanced as that draw advances it. None (generator untouched) if the
    generator's state is not one the kernel reads."""
    generator = torch.default_generator
    state = generator.get_state()
    bits = masks.dropout_keep_bits(state, x.numel(), 1.0 - p)
    if bits is None:
        return None
    generator.set_state(state)
    return bits, _scale(p)


class _CpuDropout(torch.autograd.Function):
    """``torch.nn.functional.dropout(x, p, training=True)`` for a contiguous float32 CPU ``x``,
    the mask drawn by the C++ extension and saved as bits."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, bits: torch.Tensor, scale: float):
        ctx.bits, ctx.scale = bits, scale  # not saved tensors: nothing for autograd to track
        return masks.masked_scale(x, bits, scale)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        if torch.is_grad_enabled() or g.dtype != torch.float32:
            # a double backward (or another dtype): g times the float mask, as torch does
            ones = torch.ones(g.shape, dtype=torch.float32, device="cpu")
            mask = masks.masked_scale(ones, ctx.bits, ctx.scale)
            return g * mask, None, None
        return masks.masked_scale(g.contiguous(), ctx.bits, ctx.scale), None, None


def dropout(x: torch.Tensor, p: float) -> torch.Tensor | None:
    """Training-mode dropout of ``x`` through :class:`_CpuDropout`, or None where torch's own
    dropout must run (see the module docstring): the caller then calls it."""
    if (type(x) is not torch.Tensor or x.device.type != "cpu" or x.dtype != torch.float32
            or x.layout != torch.strided or not x.is_contiguous() or x.is_neg()
            or x.numel() < MIN_ELEMENTS
            or not isinstance(p, (int, float)) or not 0.0 < p < 1.0
            or torch.compiler.is_compiling() or _transformed(x)
            or torch.autograd.forward_ad.unpack_dual(x).tangent is not None  # forward-mode AD
            or not exact()):
        return None
    drawn = _draw(x, float(p))
    if drawn is None:
        return None
    return _CpuDropout.apply(x, *drawn)


def _transformed(x: torch.Tensor | None = None) -> bool:
    """Whether a ``torch.func`` transform (vmap, grad, ...) is running or wraps ``x``."""
    functorch = torch._C._functorch
    return (functorch.peek_interpreter_stack() is not None
            or (x is not None and functorch.is_functorch_wrapped_tensor(x)))


_ARG_NAMES = ("input", "p", "training", "inplace")
_DEFAULTS = {"p": 0.5, "training": True, "inplace": False}


class _DropoutMode(TorchFunctionMode):
    """Routes ``torch.nn.functional.dropout`` calls to :func:`dropout` where it applies."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is nn.functional.dropout and len(args) <= len(_ARG_NAMES):
            bound = {**_DEFAULTS, **dict(zip(_ARG_NAMES, args)), **kwargs}
            if (set(bound) == set(_ARG_NAMES) and bound["training"] is True
                    and bound["inplace"] is False and isinstance(bound["input"], torch.Tensor)):
                out = dropout(bound["input"], bound["p"])
                if out is not None:
                    return out
        return func(*args, **kwargs)


@contextlib.contextmanager
def cpu_dropout(enabled: bool = True):
    """While active, training-mode dropout of contiguous float32 CPU tensors runs
    :class:`_CpuDropout` (same values, gradients and generator state as torch's). Yields
    whether it is active: not when ``enabled`` is False, under ``torch.compile`` or a
    ``torch.func`` transform, without the
    C++ extension, or where :func:`exact` finds that torch draws its masks differently."""
    if (not enabled or not switched_on() or torch.compiler.is_compiling() or _transformed()
            or not exact()):
        yield False
        return
    with _DropoutMode():
        yield True


SWITCH_ENV = "RAG_FAST_CPU_DROPOUT"


def switched_on() -> bool:
    """False where the environment variable ``RAG_FAST_CPU_DROPOUT`` is ``0`` (torch's own
    dropout everywhere); ``1`` or unset: on. Raises ValueError naming the variable for any
    other value."""
    value = os.environ.get(SWITCH_ENV, "1").strip()
    if value not in ("0", "1"):
        raise ValueError(f"{SWITCH_ENV} must be 0 (torch's own CPU dropout) or 1 (rag_fast's, "
                         f"the default), got {value!r}")
    return value == "1"


_exact_lock = threading.Lock()


def exact() -> bool:
    """Whether :class:`_CpuDropout` gives torch's dropout bit for bit here (see
    :func:`_exact`); checked once per process, one thread at a time."""
    with _exact_lock:
        return _exact()


@functools.lru_cache(maxsize=None)
def _exact() -> bool:
    """:func:`exact`'s check: outputs and gradients compared as bits on 4,099 elements (with
    ``-0``, ``inf`` and ``nan`` among them), and the generator's state after the draw. Only
    the default CPU generator is seeded (other devices' generators are not touched), and its
    state is restored afterwards."""
    if not _ext.available():
        return False
    saved = torch.get_rng_state()
    try:
        # the check needs gradients whatever the caller's mode (no_grad, inference_mode)
        with torch.inference_mode(False), torch.enable_grad():
            return _matches_torch()
    except Exception as exc:  # noqa: BLE001 - a failed check means: run torch's dropout
        warnings.warn(f"rag_fast: CPU dropout runs torch's own kernel (the check of rag_fast's "
                      f"failed: {type(exc).__name__}: {exc})", RuntimeWarning, stacklevel=2)
        return False
    finally:
        torch.set_rng_state(saved)


def _matches_torch() -> bool:
    """:func:`exact`'s comparison (the default generator is reseeded; the caller restores it)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4099, generator=g)
    x[:4] = torch.tensor([0.0, -0.0, math.inf, math.nan])
    grad = torch.randn(4099, generator=g)
    p = 0.1
    want_x = x.clone().requires_grad_()
    torch.default_generator.manual_seed(20261203)
    want = torch.ops.aten.dropout(want_x, p, True)  # torch's own, not this module's route
    want.backward(grad)
    want_state = torch.get_rng_state()
    torch.default_generator.manual_seed(20261203)
    drawn = _draw(x, p)
    if drawn is None:
        return False
    got_x = x.clone().requires_grad_()
    got = _CpuDropout.apply(got_x, *drawn)
    got.backward(grad)
    return (torch.equal(got.detach().view(torch.int32), want.detach().view(torch.int32))
            and torch.equal(got_x.grad.view(torch.int32), want_x.grad.view(torch.int32))
            and torch.equal(torch.get_rng_state(), want_state))


exact.cache_clear = _exact.cache_clear  # type: ignore[attr-defined]
