"""The op boundary: every kernel is a PyTorch custom op, ``torch.ops.rag_fast.<name>``.

    row_stats(Tensor logits, Tensor? targets, int ignore_index, str impl="auto",
              bool inplace_grad=False) -> (Tensor lse, Tensor x_tgt, Tensor x_sum)
    row_grad(Tensor logits, Tensor? targets, int ignore_index, Tensor lse, Tensor c_p,
             Tensor c_y, Tensor c_1, Tensor(a!) out, str impl="auto") -> ()
    token_smooth_forward(Tensor logits, Tensor targets, int ignore_index, Tensor log_prior,
                         bool need_rho, str impl="auto", bool inplace_grad=False)
        -> (Tensor lse, Tensor x_tgt, Tensor x_sum, Tensor sum_m, Tensor rho)
    token_smooth_grad(Tensor logits, Tensor targets, int ignore_index, Tensor log_prior,
                      Tensor lse, Tensor c_p, Tensor c_y, Tensor c_1, Tensor c_r,
                      Tensor(a!) out, str impl="auto") -> ()
    token_marginal(Tensor logits, Tensor log_prior, str impl="auto")
        -> (Tensor marginal, Tensor lse)
    token_marginal_grad(Tensor logits, Tensor log_prior, Tensor lse, Tensor marginal,
                        Tensor grad_marginal, str impl="auto") -> (Tensor grad_logits, Tensor c)
    beam_step(Tensor logits, Tensor log_prior, Tensor beam_scores, Tensor? bias,
              int num_candidates, str impl="auto") -> (Tensor scores, Tensor beams, Tensor tokens)

What each computes is the launcher contract of ``rag_fast/ops/_cpp.py`` (logits
``[B, K, T, V]``; beam_step: ``[B, W, K, V]``, see ``rag_token_beam_step.py``); statistics are
float32 except the rows' log-sum-exp ``lse``, float64 (so that ``x - lse`` keeps float32's
relative precision where a softmax entry is near 1: docs/design.md, "Precision"); gradients
have the logits' dtype.

Which implementation runs is decided by the dispatcher from the tensors' device, then by
``impl``: CPU tensors run the C++ extension (``impl="auto"`` or ``"cpp"``) or the Triton
interpreter (``impl="triton"``, needs ``TRITON_INTERPRET=1``); CUDA tensors run Triton
(``impl="cpp"`` raises); meta and fake tensors (``torch.compile``) run the fake implementation,
which returns outputs of the right shapes and dtypes. Devices, shapes, dtypes, the logits'
layout (stride 1 along V) and alignment are checked here, once, for every implementation, so
no kernel is ever handed memory of another device or of the wrong size: the C++ launchers are
reached from the CPU implementations below and from nowhere else in the package.

Autograd is registered for ``row_stats``, ``token_smooth_forward`` (the backward is one
``row_grad`` / ``token_smooth_grad`` call: the logits' gradient is written once) and
``token_marginal``. ``inplace_grad=True`` makes that one write go into the logits' own storage
and bumps their version counter, so any later use of the overwritten logits by autograd
(a second loss on the same logits, ``retain_graph``, another op that saved them) raises
autograd's "modified by an inplace operation" error instead of computing a wrong gradient. It
is refused (ValueError) for logits whose elements overlap in memory (expanded), and, when the
logits require grad, for logits that are a leaf, a view (any chain of views) of a leaf that
requires grad, or share their storage with a leaf that requires grad in their autograd graph
(``inplace_grad_refusal``): that leaf's values would become its own gradient.
"""
from __future__ import annotations

import math
from types import ModuleType
from typing import Callable

import torch
from torch import Tensor

from rag_fast import _ext, _pool
from rag_fast.kernels import triton_usable_for
from rag_fast.ops._dispatch import CPP_DTYPES, TRITON_DTYPES

OP_IMPLS = ("auto", "cpp", "triton")
_FLOAT, _INT64 = "floating", "int64"


# ---- checks (shared by the device and the fake implementations) ------------------------------


def _backend(op: str, impl: str, device: torch.device) -> str:
    """``"cpp"`` or ``"triton"``: the kernels that run ``op`` for tensors on ``device``."""
    if impl not in OP_IMPLS:
        raise ValueError(f"rag_fast::{op}: impl must be one of {OP_IMPLS}, got {impl!r}")
    if device.type == "cpu":
        return "triton" if impl == "triton" else "cpp"
    if device.type == "cuda":
        if impl == "cpp":
            raise ValueError(
                f"rag_fast::{op}: impl='cpp' runs the C++ CPU kernels, but logits are on "
                f"{device}: use impl='triton' or 'auto' (or move the tensors to the CPU)"
            )
        return "triton"
    # meta: only the fake implementation runs (the dispatcher has no kernel for other devices)
    return "cpp" if impl == "cpp" else "triton"


def _check_logits(op: str, impl: str, logits: Tensor, dims: str, inplace_grad: bool) -> str:
    backend = _backend(op, impl, logits.device)
    dtypes = CPP_DTYPES if backend == "cpp" else TRITON_DTYPES
    if logits.dim() != 4:
        raise ValueError(f"rag_fast::{op}: logits must have shape {dims}, "
                         f"got {tuple(logits.shape)}")
    if logits.dtype not in dtypes:
        raise ValueError(
            f"rag_fast::{op}: impl={backend!r} needs logits of dtype {dtypes}, got {logits.dtype}"
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
    return backend


def _check_tensor(
    op: str, name: str, t: Tensor, shape: tuple[int, ...], kind: str, device: torch.device
) -> None:
    if t.device != device:
        raise ValueError(f"rag_fast::{op}: {name} must be on the logits' device {device}, "
                         f"got {t.device}")
    if tuple(t.shape) != shape:
        raise ValueError(f"rag_fast::{op}: {name} must have shape {list(shape)}, "
                         f"got {list(t.shape)}")
    if kind == _INT64 and t.dtype != torch.int64:
        raise ValueError(f"rag_fast::{op}: {name} must be int64, got {t.dtype}")
    if kind == _FLOAT and not t.is_floating_point():
        raise ValueError(f"rag_fast::{op}: {name} must be a floating tensor, got {t.dtype}")


def _check(
    op: str,
    impl: str,
    logits: Tensor,
    expected: Callable[..., dict[str, tuple[Tensor | None, tuple[int, ...], str]]],
    *,
    dims: str = "[B, K, T, V]",
    inplace_grad: bool = False,
) -> str:
    """Check ``logits`` (shape ``dims``), then every ``name: (tensor or None, shape, kind)`` of
    ``expected(*logits.shape)``; returns the backend ("cpp" or "triton").

    Raises ValueError naming the op, the argument and what was expected."""
    backend = _check_logits(op, impl, logits, dims, inplace_grad)
    for name, (t, shape, kind) in expected(*logits.shape).items():
        if t is not None:
            _check_tensor(op, name, t, shape, kind, logits.device)
    return backend


def _check_out(op: str, logits: Tensor, out: Tensor) -> None:
    """A gradient buffer: the logits' shape, dtype and device, stride 1 along V, no overlap."""
    _check_tensor(op, "out", out, tuple(logits.shape), _FLOAT, logits.device)
    if out.dtype != logits.dtype:
        raise ValueError(f"rag_fast::{op}: out must have the logits' dtype {logits.dtype}, "
                         f"got {out.dtype}")
    if out.stride(-1) != 1 or torch._debug_has_internal_overlap(out) != 0:
        raise ValueError(f"rag_fast::{op}: out must have stride 1 along V and no overlapping "
                         f"elements, got strides {out.stride()}")


def _kernels(op: str, backend: str, raw: dict[str, Tensor], targets: Tensor | None = None,
             ignore_index: int = -100, V: int = 0) -> ModuleType:
    """The launcher module of ``backend``, after the checks that need real memory: every
    tensor handed over as it is (``raw``: the logits, a gradient buffer) is aligned to its
    element size, and (CPU) every target lies in ``[0, V)`` or equals ``ignore_index`` (a
    kernel indexes the row with it). Small tensors reach the launchers as float32 copies."""
    for name, t in raw.items():
        if t.numel() and t.data_ptr() % t.element_size() != 0:
            raise ValueError(f"rag_fast::{op}: {name} ({t.dtype}) is not aligned to its element "
                             f"size (data_ptr {t.data_ptr():#x}); pass a fresh .contiguous() copy")
    if targets is not None and targets.device.type == "cpu" and targets.numel():
        bad = (targets != ignore_index) & ((targets < 0) | (targets >= V))
        if bool(bad.any()):
            raise ValueError(f"rag_fast::{op}: targets must lie in [0, V={V}) or equal "
                             f"ignore_index={ignore_index}, found {int(targets[bad][0])}")
    if backend == "cpp":
        _ext.get()  # ExtensionUnavailableError, with the fix, if the extension is missing
        from rag_fast.ops import _cpp

        return _cpp
    device = raw["logits"].device
    if not triton_usable_for(device.type):
        raise ValueError(
            f"rag_fast::{op}: impl='triton' cannot run on {device}: needs CUDA, or Triton "
            "installed and TRITON_INTERPRET=1 set before import for the CPU interpreter"
        )
    from rag_fast.kernels import rag_losses

    return rag_losses


def _stats(logits: Tensor) -> Tensor:
    B, K, T, _ = logits.shape
    return logits.new_empty((B, K, T), dtype=torch.float32)


def _lse(logits: Tensor) -> Tensor:
    B, K, T, _ = logits.shape
    return logits.new_empty((B, K, T), dtype=torch.float64)


def _pair(logits: Tensor) -> Tensor:
    B, _, T, _ = logits.shape
    return logits.new_empty((B, T), dtype=torch.float32)


def _grads(like: Tensor, *grads: Tensor | None) -> list[Tensor]:
    """Upstream gradients with None (an unused output) as zeros of ``like``'s shape."""
    return [torch.zeros_like(like) if g is None else g for g in grads]


def _storage_ptr(t: Tensor) -> int:
    """The address of ``t``'s storage; 0 where it has none to compare (fake, meta, or a
    tensor subclass without one)."""
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):
        return 0


def _leaf_sharing_storage(logits: Tensor) -> Tensor | None:
    """A leaf that requires grad and whose storage is the logits' storage, found among the
    leaves of the logits' autograd graph (its AccumulateGrad nodes); None if there is none.
    This catches aliases autograd does not record as views (``aten._unsafe_view``, a custom
    ``autograd.Function`` that returns its input's memory under a new tensor). One visit per
    node of the graph: about 1 ms for 1,600 nodes."""
    ptr = _storage_ptr(logits)
    if not ptr or logits.grad_fn is None:
        return None
    seen: set = set()
    stack = [logits.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # AccumulateGrad: the leaf it accumulates
        if variable is not None:
            if variable.requires_grad and _storage_ptr(variable) == ptr:
                return variable
            continue
        stack.extend(fn for fn, _ in node.next_functions)
    return None


def inplace_grad_refusal(logits: Tensor, storage: bool = True) -> str | None:
    """The leaf whose values ``inplace_grad=True`` would overwrite with the logits' gradient
    (a phrase for an error message), or None if the logits' storage may take it.

    Refused, when the logits require grad: logits that are themselves a leaf; a view, through
    any chain of views (reshape, view, slice, transpose, expand, as_strided, the
    ``[B*K, T, V]`` -> ``[B, K, T, V]`` split), of a leaf that requires grad (autograd's
    ``_base``); and (``storage``) logits whose storage is that of a leaf that requires grad
    in their autograd graph. Writing there would replace the leaf's values (a parameter, the
    user's input) by its gradient. Logits that do not require grad are never written (no
    backward computes their gradient), and a view of a buffer that does not require grad
    (RagModel's logits workspace) is not a leaf's memory in this sense."""
    if not logits.requires_grad:
        return None
    if logits.is_leaf:
        return "the leaf tensor logits"
    base = logits
    while base._base is not None:  # torch keeps the root here; followed in case it does not
        base = base._base
    if base is not logits and base.is_leaf and base.requires_grad:
        return f"the leaf tensor (shape {list(base.shape)}) that the logits are a view of"
    if storage and not torch.compiler.is_compiling():
        leaf = _leaf_sharing_storage(logits)
        if leaf is not None:
            return f"the leaf tensor (shape {list(leaf.shape)}) whose storage the logits share"
    return None


def check_inplace_grad_target(where: str, logits: Tensor, inplace_grad: bool,
                              storage: bool = True) -> None:
    """Raise ValueError, naming ``where``, when ``inplace_grad`` would write the logits'
    gradient into a leaf's storage (:func:`inplace_grad_refusal`)."""
    if not inplace_grad:
        return
    why = inplace_grad_refusal(logits, storage)
    if why is None:
        return
    raise ValueError(
        f"{where}: inplace_grad=True would overwrite {why} with its own gradient (the "
        "values an optimizer step or a second loss reads would be lost): pass "
        "inplace_grad=False for a leaf, a view of one or memory shared with one, or use "
        "inplace_grad=True only for logits an op computed (e.g. logits = lm_head(h))"
    )


def _check_inplace_grad_target(op: str, logits: Tensor, inplace_grad: bool) -> None:
    check_inplace_grad_target(f"rag_fast::{op}", logits, inplace_grad)


def _saved(ctx, op: str) -> tuple[Tensor | None, ...]:
    """``ctx.saved_tensors``; autograd's version check fails there when the saved logits were
    overwritten since the forward, e.g. by an ``inplace_grad`` backward: say so."""
    try:
        return ctx.saved_tensors
    except RuntimeError as exc:
        message = str(exc)  # autograd's words: for a plain tensor, and for a view
        if "modified by an inplace operation" not in message and "modified inplace" not in message:
            raise
        raise RuntimeError(
            f"rag_fast::{op}: the logits this backward needs were overwritten after the forward, "
            "most likely by a backward with inplace_grad=True, which writes the gradient into "
            "the logits (a second loss on the same logits, or a second backward through "
            "retain_graph=True); use inplace_grad=False there"
        ) from exc


def _empty_like(logits: Tensor) -> Tensor:
    """A gradient buffer for ``logits``: from rag_fast's CPU buffer pool (``rag_fast/_pool.py``:
    memory a freed gradient leaves is reused instead of faulted in afresh) when ``logits`` are
    contiguous, else ``torch.empty_like`` (the same strides, which autograd's gradient layout
    rule asks of a leaf's gradient)."""
    if logits.is_contiguous():
        return _pool.empty(logits.shape, logits.dtype, like=logits)
    return torch.empty_like(logits)


def _write_grad(ctx, logits: Tensor, grad_op, *args) -> Tensor:
    """``grad_op(*args, out, impl)`` into a new buffer, or under inplace_grad into the logits
    themselves, whose version counter then moves on (recent torch bumps it for the mutating
    op already; done here too so the rule does not depend on it): autograd refuses any later
    use of the overwritten values."""
    out = logits if ctx.inplace_grad else _empty_like(logits)
    grad_op(*args, out, ctx.impl)
    if ctx.inplace_grad:
        torch.autograd.graph.increment_version(logits)
    return out


# ---- row_stats / row_grad --------------------------------------------------------------------


def _check_row_stats(logits, targets, impl, inplace_grad=False) -> str:
    return _check("row_stats", impl, logits,
                  lambda B, K, T, V: {"targets": (targets, (B, T), _INT64)},
                  inplace_grad=inplace_grad)


@torch.library.custom_op(
    "rag_fast::row_stats", mutates_args=(), device_types=("cpu", "cuda"),
    schema="(Tensor logits, Tensor? targets, int ignore_index, str impl=\"auto\", "
           "bool inplace_grad=False) -> (Tensor, Tensor, Tensor)",
)
def row_stats(logits: Tensor, targets: Tensor | None, ignore_index: int, impl: str = "auto",
              inplace_grad: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    backend = _check_row_stats(logits, targets, impl, inplace_grad)
    kernels = _kernels("row_stats", backend, {"logits": logits}, targets, ignore_index,
                       logits.shape[-1])
    return kernels.row_stats(logits, targets, ignore_index)


@row_stats.register_fake
def _(logits, targets, ignore_index, impl="auto", inplace_grad=False):
    _check_row_stats(logits, targets, impl, inplace_grad)
    return _lse(logits), _stats(logits), _stats(logits)


def _row_stats_setup(ctx, inputs, output) -> None:
    logits, targets, ignore_index, impl, inplace_grad = inputs
    _check_inplace_grad_target("row_stats", logits, inplace_grad)
    ctx.save_for_backward(logits, targets, output[0])
    ctx.ignore_index, ctx.impl, ctx.inplace_grad = ignore_index, impl, inplace_grad


def _row_stats_backward(ctx, g_lse, g_tgt, g_sum):
    logits, targets, lse = _saved(ctx, "row_stats")
    if not ctx.needs_input_grad[0]:
        return None, None, None, None, None
    out = _write_grad(ctx, logits, torch.ops.rag_fast.row_grad, logits, targets,
                      ctx.ignore_index, lse, *_grads(lse, g_lse, g_tgt, g_sum))
    return out, None, None, None, None


torch.library.register_autograd("rag_fast::row_stats", _row_stats_backward,
                                setup_context=_row_stats_setup)


def _check_row_grad(logits, targets, lse, c_p, c_y, c_1, out, impl) -> str:
    backend = _check("row_grad", impl, logits, lambda B, K, T, V: {
        "targets": (targets, (B, T), _INT64), "lse": (lse, (B, K, T), _FLOAT),
        "c_p": (c_p, (B, K, T), _FLOAT), "c_y": (c_y, (B, K, T), _FLOAT),
        "c_1": (c_1, (B, K, T), _FLOAT),
    })
    _check_out("row_grad", logits, out)
    return backend


@torch.library.custom_op(
    "rag_fast::row_grad", mutates_args=("out",), device_types=("cpu", "cuda"),
    schema="(Tensor logits, Tensor? targets, int ignore_index, Tensor lse, Tensor c_p, "
           "Tensor c_y, Tensor c_1, Tensor(a!) out, str impl=\"auto\") -> ()",
)
def row_grad(logits: Tensor, targets: Tensor | None, ignore_index: int, lse: Tensor, c_p: Tensor,
             c_y: Tensor, c_1: Tensor, out: Tensor, impl: str = "auto") -> None:
    backend = _check_row_grad(logits, targets, lse, c_p, c_y, c_1, out, impl)
    kernels = _kernels("row_grad", backend, {"logits": logits, "out": out}, targets, ignore_index,
                       logits.shape[-1])
    kernels.row_grad(logits, targets, ignore_index, lse, c_p, c_y, c_1, out)


@row_grad.register_fake
def _(logits, targets, ignore_index, lse, c_p, c_y, c_1, out, impl="auto"):
    _check_row_grad(logits, targets, lse, c_p, c_y, c_1, out, impl)


# ---- token_smooth_forward / token_smooth_grad ------------------------------------------------


def _check_token_smooth_forward(logits, targets, log_prior, impl, inplace_grad=False) -> str:
    return _check("token_smooth_forward", impl, logits, lambda B, K, T, V: {
        "targets": (targets, (B, T), _INT64), "log_prior": (log_prior, (B, K), _FLOAT),
    }, inplace_grad=inplace_grad)


@torch.library.custom_op(
    "rag_fast::token_smooth_forward", mutates_args=(), device_types=("cpu", "cuda"),
    schema="(Tensor logits, Tensor targets, int ignore_index, Tensor log_prior, bool need_rho, "
           "str impl=\"auto\", bool inplace_grad=False) "
           "-> (Tensor, Tensor, Tensor, Tensor, Tensor)",
)
def token_smooth_forward(logits: Tensor, targets: Tensor, ignore_index: int, log_prior: Tensor,
                         need_rho: bool, impl: str = "auto", inplace_grad: bool = False
                         ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    backend = _check_token_smooth_forward(logits, targets, log_prior, impl, inplace_grad)
    kernels = _kernels("token_smooth_forward", backend, {"logits": logits}, targets, ignore_index,
                       logits.shape[-1])
    lse, x_tgt, x_sum, sum_m, rho = kernels.token_smooth_forward(
        logits, targets, ignore_index, log_prior, need_rho=need_rho)
    if rho is None:  # need_rho=False: an empty placeholder (an op returns tensors only)
        rho = logits.new_empty(0, dtype=torch.float32)
    return lse, x_tgt, x_sum, sum_m, rho


@token_smooth_forward.register_fake
def _(logits, targets, ignore_index, log_prior, need_rho, impl="auto", inplace_grad=False):
    _check_token_smooth_forward(logits, targets, log_prior, impl, inplace_grad)
    rho = _stats(logits) if need_rho else logits.new_empty(0, dtype=torch.float32)
    return _lse(logits), _stats(logits), _stats(logits), _pair(logits), rho


def _token_smooth_setup(ctx, inputs, output) -> None:
    logits, targets, ignore_index, log_prior, need_rho, impl, inplace_grad = inputs
    _check_inplace_grad_target("token_smooth_forward", logits, inplace_grad)
    lse, rho = output[0], output[4]
    ctx.save_for_backward(logits, targets, log_prior, lse, rho)
    ctx.ignore_index, ctx.impl, ctx.inplace_grad = ignore_index, impl, inplace_grad
    ctx.need_rho = need_rho


def _token_smooth_backward(ctx, g_lse, g_tgt, g_sum, g_sum_m, _g_rho):
    """d sum_m / d x = R - rho * P and d sum_m / d a = rho (docs/design.md, "Gradients")."""
    logits, targets, log_prior, lse, rho = _saved(ctx, "token_smooth_forward")
    if not ctx.need_rho:
        raise RuntimeError("rag_fast::token_smooth_forward ran with need_rho=False, which "
                           "skips what its backward needs; pass need_rho=True to differentiate")
    g_lse, g_tgt, g_sum = _grads(lse, g_lse, g_tgt, g_sum)
    (g_sum_m,) = _grads(lse[:, 0], g_sum_m)  # [B, T]
    weighted = g_sum_m[:, None, :] * rho  # [B, K, T]
    g_prior = weighted.sum(-1) if ctx.needs_input_grad[3] else None  # [B, K]
    g_logits = None
    if ctx.needs_input_grad[0]:
        g_logits = _write_grad(ctx, logits, torch.ops.rag_fast.token_smooth_grad, logits,
                               targets, ctx.ignore_index, log_prior, lse, g_lse - weighted,
                               g_tgt, g_sum, g_sum_m)
    return g_logits, None, None, g_prior, None, None, None


torch.library.register_autograd("rag_fast::token_smooth_forward", _token_smooth_backward,
                                setup_context=_token_smooth_setup)


def _check_token_smooth_stats(logits, log_prior, lse, impl) -> str:
    return _check("token_smooth_stats", impl, logits, lambda B, K, T, V: {
        "log_prior": (log_prior, (B, K), _FLOAT), "lse": (lse, (B, K, T), _FLOAT),
    })


@torch.library.custom_op(
    "rag_fast::token_smooth_stats", mutates_args=(), device_types=("cpu", "cuda"),
    schema="(Tensor logits, Tensor log_prior, Tensor lse, str impl=\"auto\") -> (Tensor, Tensor)",
)
def token_smooth_stats(logits: Tensor, log_prior: Tensor, lse: Tensor, impl: str = "auto"
                       ) -> tuple[Tensor, Tensor]:
    """``sum_m = sum_v M`` ``[B, T]`` and ``rho = sum_v R`` ``[B, K, T]`` of logits whose row
    normalisers ``lse`` are given (not computed from these logits): the fused LM-head loss
    calls it on one vocabulary tile at a time with the rows' final log-sum-exp. No autograd."""
    backend = _check_token_smooth_stats(logits, log_prior, lse, impl)
    kernels = _kernels("token_smooth_stats", backend, {"logits": logits})
    return kernels.token_smooth_stats(logits, log_prior, lse)


@token_smooth_stats.register_fake
def _(logits, log_prior, lse, impl="auto"):
    _check_token_smooth_stats(logits, log_prior, lse, impl)
    return _pair(logits), _stats(logits)


def _check_token_smooth_grad(logits, targets, log_prior, lse, c_p, c_y, c_1, c_r, out,
                             impl) -> str:
    backend = _check("token_smooth_grad", impl, logits, lambda B, K, T, V: {
        "targets": (targets, (B, T), _INT64), "log_prior": (log_prior, (B, K), _FLOAT),
        "lse": (lse, (B, K, T), _FLOAT), "c_p": (c_p, (B, K, T), _FLOAT),
        "c_y": (c_y, (B, K, T), _FLOAT), "c_1": (c_1, (B, K, T), _FLOAT),
        "c_r": (c_r, (B, T), _FLOAT),
    })
    _check_out("token_smooth_grad", logits, out)
    return backend


@torch.library.custom_op(
    "rag_fast::token_smooth_grad", mutates_args=("out",), device_types=("cpu", "cuda"),
    schema="(Tensor logits, Tensor targets, int ignore_index, Tensor log_prior, Tensor lse, "
           "Tensor c_p, Tensor c_y, Tensor c_1, Tensor c_r, Tensor(a!) out, "
           "str impl=\"auto\") -> ()",
)
def token_smooth_grad(logits: Tensor, targets: Tensor, ignore_index: int, log_prior: Tensor,
                      lse: Tensor, c_p: Tensor, c_y: Tensor, c_1: Tensor, c_r: Tensor,
                      out: Tensor, impl: str = "auto") -> None:
    backend = _check_token_smooth_grad(logits, targets, log_prior, lse, c_p, c_y, c_1, c_r, out,
                                       impl)
    kernels = _kernels("token_smooth_grad", backend, {"logits": logits, "out": out}, targets,
                       ignore_index, logits.shape[-1])
    kernels.token_smooth_grad(logits, targets, ignore_index, log_prior, lse, c_p, c_y, c_1, c_r,
                              out)


@token_smooth_grad.register_fake
def _(logits, targets, ignore_index, log_prior, lse, c_p, c_y, c_1, c_r, out, impl="auto"):
    _check_token_smooth_grad(logits, targets, log_prior, lse, c_p, c_y, c_1, c_r, out, impl)


# ---- token_marginal / token_marginal_grad ----------------------------------------------------


def _check_token_marginal(logits, log_prior, impl) -> str:
    return _check("token_marginal", impl, logits,
                  lambda B, K, T, V: {"log_prior": (log_prior, (B, K), _FLOAT)})


@torch.library.custom_op(
    "rag_fast::token_marginal", mutates_args=(), device_types=("cpu", "cuda"),
    schema="(Tensor logits, Tensor log_prior, str impl=\"auto\") -> (Tensor, Tensor)",
)
def token_marginal(logits: Tensor, log_prior: Tensor, impl: str = "auto") -> tuple[Tensor, Tensor]:
    kernels = _kernels("token_marginal", _check_token_marginal(logits, log_prior, impl),
                       {"logits": logits})
    lse, _, _ = kernels.row_stats(logits, None, -100)
    return kernels.token_marginal(logits, log_prior, lse), lse


@token_marginal.register_fake
def _(logits, log_prior, impl="auto"):
    _check_token_marginal(logits, log_prior, impl)
    B, _, T, V = logits.shape
    return logits.new_empty((B, T, V), dtype=torch.float32), _lse(logits)


def _token_marginal_setup(ctx, inputs, output) -> None:
    logits, log_prior, impl = inputs
    marginal, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(logits, log_prior, lse, marginal)
    ctx.impl = impl


def _token_marginal_backward(ctx, g_marginal, _g_lse):
    logits, log_prior, lse, marginal = _saved(ctx, "token_marginal")
    (g_marginal,) = _grads(marginal, g_marginal)
    g_logits, c = torch.ops.rag_fast.token_marginal_grad(logits, log_prior, lse, marginal,
                                                         g_marginal, ctx.impl)
    g_prior = c.sum(-1) if ctx.needs_input_grad[1] else None  # d M / d a_k = R_k
    return (g_logits if ctx.needs_input_grad[0] else None), g_prior, None


torch.library.register_autograd("rag_fast::token_marginal", _token_marginal_backward,
                                setup_context=_token_marginal_setup)


def _check_token_marginal_grad(logits, log_prior, lse, marginal, grad_marginal, impl) -> str:
    return _check("token_marginal_grad", impl, logits, lambda B, K, T, V: {
        "log_prior": (log_prior, (B, K), _FLOAT), "lse": (lse, (B, K, T), _FLOAT),
        "marginal": (marginal, (B, T, V), _FLOAT),
        "grad_marginal": (grad_marginal, (B, T, V), _FLOAT),
    })


@torch.library.custom_op(
    "rag_fast::token_marginal_grad", mutates_args=(), device_types=("cpu", "cuda"),
    schema="(Tensor logits, Tensor log_prior, Tensor lse, Tensor marginal, "
           "Tensor grad_marginal, str impl=\"auto\") -> (Tensor, Tensor)",
)
def token_marginal_grad(logits: Tensor, log_prior: Tensor, lse: Tensor, marginal: Tensor,
                        grad_marginal: Tensor, impl: str = "auto") -> tuple[Tensor, Tensor]:
    backend = _check_token_marginal_grad(logits, log_prior, lse, marginal, grad_marginal, impl)
    g_logits = _pool.empty(logits.shape, logits.dtype, like=logits)
    kernels = _kernels("token_marginal_grad", backend, {"logits": logits, "out": g_logits})
    c = kernels.token_marginal_grad(logits, log_prior, lse, marginal, grad_marginal, g_logits)
    return g_logits, c


@token_marginal_grad.register_fake
def _(logits, log_prior, lse, marginal, grad_marginal, impl="auto"):
    _check_token_marginal_grad(logits, log_prior, lse, marginal, grad_marginal, impl)
    return torch.empty_like(logits, memory_format=torch.contiguous_format), _stats(logits)


# ---- beam_step -------------------------------------------------------------------------------


def _check_beam_step(logits, log_prior, beam_scores, bias, num_candidates, impl) -> str:
    backend = _check("beam_step", impl, logits, lambda B, W, K, V: {
        "log_prior": (log_prior, (B, K), _FLOAT), "beam_scores": (beam_scores, (B, W), _FLOAT),
        "bias": (bias, (B * W, V), _FLOAT),
    }, dims="[B, W, K, V]")
    _, W, _, V = logits.shape
    if not 1 <= num_candidates <= W * V:
        raise ValueError(f"rag_fast::beam_step: num_candidates must lie in [1, W*V = {W * V}], "
                         f"got {num_candidates}")
    return backend


@torch.library.custom_op(
    "rag_fast::beam_step", mutates_args=(), device_types=("cpu", "cuda"),
    schema="(Tensor logits, Tensor log_prior, Tensor beam_scores, Tensor? bias, "
           "int num_candidates, str impl=\"auto\") -> (Tensor, Tensor, Tensor)",
)
def beam_step(logits: Tensor, log_prior: Tensor, beam_scores: Tensor, bias: Tensor | None,
              num_candidates: int, impl: str = "auto") -> tuple[Tensor, Tensor, Tensor]:
    backend = _check_beam_step(logits, log_prior, beam_scores, bias, num_candidates, impl)
    a, beam = log_prior.float().contiguous(), beam_scores.float().contiguous()
    b = None if bias is None else bias.float().contiguous()
    kernels = _kernels("beam_step", backend, {"logits": logits})
    if backend == "cpp":
        return kernels.beam_step(logits, a, beam, b, num_candidates)
    from rag_fast.kernels import beam_step as triton_beam_step

    return triton_beam_step.beam_step(logits, a, beam, b, num_candidates)


@beam_step.register_fake
def _(logits, log_prior, beam_scores, bias, num_candidates, impl="auto"):
    _check_beam_step(logits, log_prior, beam_scores, bias, num_candidates, impl)
    B, n = logits.shape[0], num_candidates
    return (logits.new_empty((B, n), dtype=torch.float32),
            logits.new_empty((B, n), dtype=torch.int64),
            logits.new_empty((B, n), dtype=torch.int64))


# ---- bits_mask (a plain function: no autograd, no compiled graphs; lean activations) ----------


def bits_mask(t: Tensor, one: int) -> Tensor | None:
    """The bit mask of a CPU tensor whose elements all have the bits of 0 or of ``one`` (an
    unsigned integer of the element's width): a uint8 tensor of ``ceil(numel / 8)`` bytes,
    element ``i`` of ``t`` (flattened) in bit ``i % 8`` of byte ``i // 8``; or None if some
    element has other bits. One pass in the C++ extension. Raises ValueError for a tensor the
    kernel cannot read, and ExtensionUnavailableError without the extension."""
    _check_bits_operand(t, one, "t")
    from rag_fast.ops import _cpp

    return _cpp.bits_mask(t, one)


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
    from rag_fast.ops import _cpp

    return _cpp.bits_unmask(bits, like, one)


# ---- dropout masks (plain functions: no autograd; rag_fast/models/_dropout.py) ----------------


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
    from rag_fast.ops import _cpp

    # u < keep for u = k * 2**-53 (k an integer below 2**53) exactly when k < ceil(keep * 2**53)
    return _cpp.dropout_keep_bits(state, n, math.ceil(math.ldexp(keep, 53)))


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
    from rag_fast.ops import _cpp

    _cpp.masked_scale(t, bits, float(scale), out)
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
