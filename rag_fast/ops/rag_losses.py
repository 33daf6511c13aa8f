"""The RAG losses, one op family: its public functions, its custom ops and its C++ launchers.

Public functions (the formulas: docs/design.md; the reference: ``rag_fast.reference``):

- :func:`rag_token_nll`, RAG-Token (paper eq. 2): the passage is marginalised per target token,
  ``M[b,t,v] = logsumexp_k (a[b,k] + x[b,k,t,v] - L[b,k,t])``,
  ``loss[b] = -(1 - eps) sum_t m' M[b,t,y] - (eps / V) sum_t m sum_v M[b,t,v]``.
  With eps == 0 only per-row statistics are needed (one read of the logits forward, one read
  and one write backward); with eps > 0 the sum over v of M needs the K rows of each (b, t)
  together, so the forward reads the logits twice. Memory stays O(B*K*T) either way.
- :func:`rag_sequence_nll`, RAG-Sequence (paper eq. 1): one passage for the whole sequence,
  ``S[b,k] = sum_t m' (x[b,k,t,y] - L[b,k,t])``, ``nll[b] = -logsumexp_k (a[b,k] + S[b,k])``,
  ``smooth[b] = -logsumexp_k (V a[b,k] + sum_t m (sum_v x[b,k,t,v] - V L[b,k,t]))``,
  ``loss[b] = (1 - eps) nll + (eps / V) smooth``. Everything follows from per-row statistics,
  at the cost of re-running the O(B*K*T) small graph in the backward.
- :func:`rag_token_marginal`: ``M`` itself, ``[B, T, V]`` float32, for decoding and inspection
  (the losses never materialize it). The forward reads the logits twice (row normalisers,
  then the marginal); the backward twice more (``c = sum_v R * g``, then ``R * g - P * c``)
  and writes once.

The fused path: a loss depends on the logits only through per-row statistics (lse, target
logit, sum of logits: one read, ``row_stats``), plus, for RAG-Token with label smoothing, the
per-(b,t) sums of M (``token_smooth_forward`` computes both in one read). A custom op computes
those; the loss follows from them by ordinary PyTorch ops on ``O(B*K*T)`` scalars ("the small
graph"), which autograd differentiates. The statistics ops carry their own registered
backward: one kernel writes the logits' gradient once,

    d loss / d x = g_lse * P + g_tgt * onehot(y) + g_sum + g_sum_m[b,t] * (R - rho * P)

where P = softmax_v(x), R is the passage posterior per vocabulary entry and rho = sum_v R.
Everything is traceable by ``torch.compile`` without a graph break.

The custom ops, ``torch.ops.rag_fast.<name>`` (CPU and CUDA implementations, fake
implementations, autograd; which kernels run is :func:`rag_fast.ops.backend.choose`'s rule):

    row_stats(Tensor logits, Tensor? targets, int ignore_index, str impl="auto",
              bool inplace_grad=False) -> (Tensor lse, Tensor x_tgt, Tensor x_sum)
    row_grad(Tensor logits, Tensor? targets, int ignore_index, Tensor lse, Tensor c_p,
             Tensor c_y, Tensor c_1, Tensor(a!) out, str impl="auto") -> ()
    token_smooth_forward(Tensor logits, Tensor targets, int ignore_index, Tensor log_prior,
                         bool need_rho, str impl="auto", bool inplace_grad=False)
        -> (Tensor lse, Tensor x_tgt, Tensor x_sum, Tensor sum_m, Tensor rho)
    token_smooth_stats(Tensor logits, Tensor log_prior, Tensor lse, str impl="auto")
        -> (Tensor sum_m, Tensor rho)
    token_smooth_grad(Tensor logits, Tensor targets, int ignore_index, Tensor log_prior,
                      Tensor lse, Tensor c_p, Tensor c_y, Tensor c_1, Tensor c_r,
                      Tensor(a!) out, str impl="auto") -> ()
    token_marginal(Tensor logits, Tensor log_prior, str impl="auto")
        -> (Tensor marginal, Tensor lse)
    token_marginal_grad(Tensor logits, Tensor log_prior, Tensor lse, Tensor marginal,
                        Tensor grad_marginal, str impl="auto") -> (Tensor grad_logits, Tensor c)

What each computes is the launcher contract below. Statistics are float32 except the rows'
log-sum-exp ``lse``, float64 wherever it goes in or out (the row max plus the log of the sum of
exps, so that ``x - lse`` keeps float32's relative precision where a softmax entry is near 1:
docs/design.md, "Precision"); gradients are written once, in the logits' dtype, into ``out``
(which may be ``x`` itself for ``inplace_grad``); nothing allocates a ``[B, K, T, V]``
temporary. With logits ``x`` ``[B, K, T, V]`` (stride 1 along V) and the passage log-prior
``a`` ``[B, K]`` float32 (``-inf`` for a missing passage):

    row_stats(x, y, ignore_index)        -> lse, x_tgt, x_sum       each [B, K, T]
        lse = logsumexp_v x, x_tgt = x[..., y] (0 where y is ignored or None), x_sum = sum_v x
    row_grad(x, y, ignore_index, lse, c_p, c_y, c_1, out)
        out = c_p * exp(x - lse) + c_y * onehot(y) + c_1                (c_*: [B, K, T])
    token_smooth_forward(x, y, ignore_index, a, need_rho=True) -> lse, x_tgt, x_sum, sum_m, rho
        row_stats and token_smooth_stats together, in one read of the logits; rho is None
        unless need_rho (only the backward uses it)
    token_smooth_stats(x, a, lse)        -> sum_m [B, T], rho [B, K, T]
        M[b,t,v] = logsumexp_k (a + x - lse); sum_m = sum_v M;
        rho = sum_v R with R = exp(a + x - lse - M)
    token_smooth_grad(x, y, ignore_index, a, lse, c_p, c_y, c_1, c_r, out)
        out = c_p * P + c_y * onehot(y) + c_1 + c_r[b, t] * R           (c_r: [B, T])
    token_marginal(x, a, lse)            -> M [B, T, V] float32
    token_marginal_grad(x, a, lse, m, g_m, out) -> c [B, K, T]
        c = sum_v R * g_m; out = R * g_m - P * c

Both backends follow it: :class:`cpp` (the C++ kernels of ``csrc/rag_losses.cpp``) and the
Triton module ``rag_fast.kernels.rag_losses`` (kernels and launchers; imported only where
Triton runs). The launchers trust their arguments: only the custom ops below, which check them
first (``rag_fast/ops/_boundary.py``), call them.

``inplace_grad=True`` makes the one gradient write go into the logits' own storage and bumps
their version counter, so any later use of the overwritten logits by autograd (a second loss
on the same logits, ``retain_graph``, another op that saved them) raises autograd's "modified
by an inplace operation" error instead of computing a wrong gradient. It is refused
(ValueError) for logits whose elements overlap in memory (expanded), and, when the logits
require grad, for logits that are a leaf, a view (any chain of views) of a leaf that requires
grad, or share their storage with a leaf that requires grad in their autograd graph
(:func:`rag_fast.ops.inplace_grad.inplace_grad_refusal`): that leaf's values would become its
own gradient.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Callable

import torch
from torch import Tensor

from rag_fast import _ext, _pool, reference
from rag_fast._validation import (
    check_epsilon,
    check_loss_inputs,
    check_reduction,
    reduce,
)
from rag_fast.ops import _boundary, backend
from rag_fast.ops.inplace_grad import check_inplace_grad, check_inplace_grad_target
from rag_fast.ops.backend import resolve_impl

# ---- the public losses ---------------------------------------------------------------------


@dataclass(frozen=True)
class PreparedLoss:
    impl: str
    logits: torch.Tensor  # [B, K, T, V], stride 1 along V for kernel impls
    doc_scores: torch.Tensor  # [B, K]
    targets: torch.Tensor  # [B, T] int64
    mask: torch.Tensor  # [B, T] bool: real target positions
    nll_mask: torch.Tensor  # [B, T] bool: positions counted in the NLL term
    ignore_index: int


def prepare_loss(
    logits: torch.Tensor,
    doc_scores: torch.Tensor,
    targets: torch.Tensor,
    n_docs: int | None,
    epsilon: float,
    ignore_index: int,
    exclude_bos: bool | Tensor,
    reduction: str,
    impl: str,
) -> PreparedLoss:
    """Validate the arguments of a RAG loss and pick its impl (raises ValueError)."""
    check_epsilon(epsilon)
    check_reduction(reduction)
    # Target values are read on the host for CPU tensors; on a GPU that would synchronise, and
    # under torch.compile it would break the graph, so there an out-of-range target is an
    # asynchronous assertion instead (the CPU kernels' op boundary checks them again).
    host_check = logits.device.type == "cpu" and not torch.compiler.is_compiling()
    inp = check_loss_inputs(logits, doc_scores, targets, n_docs, ignore_index, host_check)
    targets = inp.targets.contiguous()
    if not host_check and not logits.is_meta:  # meta tensors have no values to check
        V = inp.logits.shape[-1]
        torch._assert_async(
            ((targets == ignore_index) | ((targets >= 0) & (targets < V))).all(),
            "targets must lie in [0, V) or equal ignore_index",
        )
    resolved = resolve_impl(impl, inp.logits)
    x = inp.logits
    if resolved != "torch" and x.stride(-1) != 1:
        x = x.contiguous()  # the kernels need a contiguous vocabulary axis
    mask, nll_mask = reference.target_masks(targets, ignore_index, exclude_bos)
    return PreparedLoss(resolved, x, inp.doc_scores, targets, mask, nll_mask, ignore_index)


# small_graph(lse, x_tgt, x_sum, sum_m, log_prior) -> loss (reduced)
#   lse, x_tgt, x_sum: [B, K, T]; sum_m: [B, T] or None; log_prior: [B, K] float32
SmallGraph = Callable[..., torch.Tensor]


def fused_rag_loss(
    p: PreparedLoss, small_graph: SmallGraph, needs_sum_m: bool, inplace_grad: bool
) -> torch.Tensor:
    """The loss of the prepared inputs ``p`` (impl "cpp" or "triton") through the statistics
    ops. Statistics only the backward uses (``rho``) are computed only when a gradient will be
    asked for. Under ``torch.compile`` ``inplace_grad`` is ignored: the compiler plans the
    gradient's memory itself, and a compiled backward cannot write into its saved inputs.
    Elsewhere the statistics ops refuse it for logits whose memory is a leaf's
    (:func:`rag_fast.ops.inplace_grad.inplace_grad_refusal`)."""
    x, y, ignore = p.logits, p.targets, p.ignore_index
    inplace_grad = inplace_grad and not torch.compiler.is_compiling()
    a = torch.log_softmax(p.doc_scores.float(), dim=1)  # [B, K] passage log-prior
    if needs_sum_m:
        will_backward = torch.is_grad_enabled() and (x.requires_grad or a.requires_grad)
        lse, x_tgt, x_sum, sum_m, _ = torch.ops.rag_fast.token_smooth_forward(
            x, y, ignore, a, will_backward, p.impl, inplace_grad)
    else:
        lse, x_tgt, x_sum = torch.ops.rag_fast.row_stats(x, y, ignore, p.impl, inplace_grad)
        sum_m = None
    # lse is float64 (the row max plus the log of a sum, never rounded at the logits' size):
    # the small graph runs in float64 on its O(B*K*T) scalars; the loss is float32.
    return small_graph(lse, x_tgt, x_sum, sum_m, a).to(torch.float32)


def token_small_graph(mask, nll_mask, epsilon: float, V: int, reduction: str):
    def small_graph(lse, x_tgt, x_sum, sum_m, a):
        target_lp = torch.logsumexp(a[:, :, None] + (x_tgt - lse), dim=1)  # [B, T] = M[.., y]
        zero = target_lp.new_zeros(())
        loss = -(1.0 - epsilon) * torch.where(nll_mask, target_lp, zero).sum(1)
        if sum_m is not None:
            loss = loss - (epsilon / V) * torch.where(mask, sum_m, zero).sum(1)
        return reduce(loss, reduction)

    return small_graph


def rag_token_nll(
    logits: torch.Tensor,
    doc_scores: torch.Tensor,
    targets: torch.Tensor,
    *,
    n_docs: int | None = None,
    epsilon: float = 0.0,
    ignore_index: int = -100,
    exclude_bos: bool | Tensor = False,
    reduction: str = "none",
    impl: str = "auto",
    inplace_grad: bool = False,
) -> torch.Tensor:
    """RAG-Token negative log-likelihood with optional label smoothing, fused.

    Args:
        logits: ``[B, K, T, V]`` or ``[B*K, T, V]`` generator logits (fp32, bf16, fp16, fp64).
        doc_scores: ``[B, K]`` passage scores ``q . d`` (``-inf``: missing passage).
        targets: ``[B, T]`` integer targets aligned with the logits (the caller shifts);
            positions equal to ``ignore_index`` are masked.
        n_docs: K, optional; checked against ``doc_scores.shape[1]``.
        epsilon: label smoothing in ``[0, 1]``.
        ignore_index: masked target value.
        exclude_bos: leave target position 0 out of the NLL term; a bool, or a 0-dim bool
            tensor (on the targets' device or the CPU) that decides without a host read.
        reduction: ``"none"`` -> ``[B]``; ``"sum"`` / ``"mean"`` (over B) -> scalar.
        impl: ``"auto"`` | ``"cpp"`` | ``"triton"`` | ``"torch"`` (the reference).
        inplace_grad: write the logits' gradient into the logits' storage (saves one
            logits-sized buffer; the logits hold the gradient after backward). For logits an
            op computed (``logits = lm_head(h)``), never for a leaf: refused when the logits
            require grad and are a leaf, a view of a leaf that requires grad (e.g. a
            ``[B*K, T, V]`` leaf, which is split into ``[B, K, T, V]``; any reshape, slice,
            transpose or other chain of views), or (impl "cpp" / "triton") share their storage
            with a leaf that requires grad in their autograd graph. Any later use of the
            overwritten logits by autograd (a second loss on them, ``retain_graph``) raises;
            ignored under ``torch.compile``.

    Returns:
        float32 loss (float64 for float64 logits under impl="torch").

    Raises:
        ValueError: bad shapes, dtypes, devices, options, or targets outside ``[0, V)``;
            ``inplace_grad`` on logits that overlap in memory (expanded), or whose memory is
            a leaf's (see ``inplace_grad``).
        RuntimeError: a backward that needs logits an ``inplace_grad`` backward overwrote.
    """
    p = prepare_loss(logits, doc_scores, targets, n_docs, epsilon, ignore_index, exclude_bos,
                     reduction, impl)
    check_inplace_grad("rag_token_nll", logits, inplace_grad)
    if p.impl == "torch":
        return reference.rag_token_nll(p.logits, p.doc_scores, p.targets, epsilon=epsilon,
                                       ignore_index=ignore_index, exclude_bos=exclude_bos,
                                       reduction=reduction)
    graph = token_small_graph(p.mask, p.nll_mask, float(epsilon), p.logits.shape[-1], reduction)
    return fused_rag_loss(p, graph, epsilon > 0, inplace_grad)


def sequence_small_graph(mask, nll_mask, epsilon: float, V: int, reduction: str):
    def small_graph(lse, x_tgt, x_sum, sum_m, a):
        zero = lse.new_zeros(())
        S = torch.where(nll_mask[:, None, :], x_tgt - lse, zero).sum(-1)  # [B, K]
        loss = -(1.0 - epsilon) * torch.logsumexp(a + S, dim=1)
        if epsilon > 0:
            Q = torch.where(mask[:, None, :], x_sum - V * lse, zero).sum(-1)  # [B, K]
            loss = loss - (epsilon / V) * torch.logsumexp(V * a + Q, dim=1)
        return reduce(loss, reduction)

    return small_graph


def rag_sequence_nll(
    logits: torch.Tensor,
    doc_scores: torch.Tensor,
    targets: torch.Tensor,
    *,
    n_docs: int | None = None,
    epsilon: float = 0.0,
    ignore_index: int = -100,
    exclude_bos: bool | Tensor = False,
    reduction: str = "none",
    impl: str = "auto",
    inplace_grad: bool = False,
) -> torch.Tensor:
    """RAG-Sequence negative log-likelihood with optional label smoothing, fused.

    Same arguments, shapes, return value and errors as :func:`rag_fast.rag_token_nll`;
    ``inplace_grad=True`` is likewise refused (ValueError) for logits that are a leaf, a view
    of a leaf that requires grad (a ``[B*K, T, V]`` leaf included), or (impl "cpp" /
    "triton") share their storage with one.
    """
    p = prepare_loss(logits, doc_scores, targets, n_docs, epsilon, ignore_index, exclude_bos,
                     reduction, impl)
    check_inplace_grad("rag_sequence_nll", logits, inplace_grad)
    if p.impl == "torch":
        return reference.rag_sequence_nll(p.logits, p.doc_scores, p.targets, epsilon=epsilon,
                                          ignore_index=ignore_index, exclude_bos=exclude_bos,
                                          reduction=reduction)
    graph = sequence_small_graph(p.mask, p.nll_mask, float(epsilon), p.logits.shape[-1],
                                 reduction)
    return fused_rag_loss(p, graph, False, inplace_grad)


def rag_token_marginal(
    logits: torch.Tensor,
    doc_scores: torch.Tensor,
    n_docs: int | None = None,
    *,
    impl: str = "auto",
) -> torch.Tensor:
    """RAG-Token marginal log-probabilities over passages.

    Args:
        logits: ``[B, K, T, V]`` or ``[B*K, T, V]`` generator logits.
        doc_scores: ``[B, K]`` passage scores (``-inf``: missing passage).
        n_docs: K, optional; checked against ``doc_scores.shape[1]``.
        impl: ``"auto"`` | ``"cpp"`` | ``"triton"`` | ``"torch"`` (the reference).

    Returns:
        ``[B, T, V]`` float32 log-probabilities (float64 for float64 logits under "torch");
        equals ``transformers``' ``RagTokenForGeneration.marginalize``.

    Raises:
        ValueError: bad ranks or shapes, non-floating inputs, tensors on different devices.
    """
    inp = check_loss_inputs(logits, doc_scores, None, n_docs)
    resolved = resolve_impl(impl, inp.logits)
    if resolved == "torch":
        return reference.rag_token_marginal(inp.logits, inp.doc_scores)
    x = inp.logits if inp.logits.stride(-1) == 1 else inp.logits.contiguous()
    a = torch.log_softmax(inp.doc_scores.float(), dim=1)  # [B, K] passage log-prior
    marginal, _ = torch.ops.rag_fast.token_marginal(x, a, resolved)
    return marginal


# ---- the custom ops (torch.ops.rag_fast.*): CPU, CUDA, fake, autograd --------------------


def _launchers(op: str, chosen: str, raw: dict[str, Tensor], targets: Tensor | None = None,
               ignore_index: int = -100, V: int = 0) -> ModuleType | type:
    """The launchers of ``chosen`` ("cpp": :class:`cpp`; "triton": the Triton module), after
    the checks that need real memory (``_boundary.check_memory``). Small tensors reach the
    launchers as float32 copies."""
    _boundary.check_memory(op, chosen, raw, targets, ignore_index, V)
    if chosen == "cpp":
        return cpp
    # deferred: Triton is an optional dependency
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
    return _boundary.check("row_stats", impl, logits,
                  lambda B, K, T, V: {"targets": (targets, (B, T), _boundary.INT64)},
                  inplace_grad=inplace_grad)


@torch.library.custom_op(
    "rag_fast::row_stats", mutates_args=(), device_types=("cpu", "cuda"),
    schema="(Tensor logits, Tensor? targets, int ignore_index, str impl=\"auto\", "
           "bool inplace_grad=False) -> (Tensor, Tensor, Tensor)",
)
def row_stats(logits: Tensor, targets: Tensor | None, ignore_index: int, impl: str = "auto",
              inplace_grad: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    chosen = _check_row_stats(logits, targets, impl, inplace_grad)
    kernels = _launchers("row_stats", chosen, {"logits": logits}, targets, ignore_index,
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
    chosen = _boundary.check("row_grad", impl, logits, lambda B, K, T, V: {
        "targets": (targets, (B, T), _boundary.INT64), "lse": (lse, (B, K, T), _boundary.FLOAT),
        "c_p": (c_p, (B, K, T), _boundary.FLOAT), "c_y": (c_y, (B, K, T), _boundary.FLOAT),
        "c_1": (c_1, (B, K, T), _boundary.FLOAT),
    })
    _boundary.check_out("row_grad", logits, out)
    return chosen


@torch.library.custom_op(
    "rag_fast::row_grad", mutates_args=("out",), device_types=("cpu", "cuda"),
    schema="(Tensor logits, Tensor? targets, int ignore_index, Tensor lse, Tensor c_p, "
           "Tensor c_y, Tensor c_1, Tensor(a!) out, str impl=\"auto\") -> ()",
)
def row_grad(logits: Tensor, targets: Tensor | None, ignore_index: int, lse: Tensor, c_p: Tensor,
             c_y: Tensor, c_1: Tensor, out: Tensor, impl: str = "auto") -> None:
    chosen = _check_row_grad(logits, targets, lse, c_p, c_y, c_1, out, impl)
    kernels = _launchers("row_grad", chosen, {"logits": logits, "out": out}, targets, ignore_index,
                       logits.shape[-1])
    kernels.row_grad(logits, targets, ignore_index, lse, c_p, c_y, c_1, out)


@row_grad.register_fake
def _(logits, targets, ignore_index, lse, c_p, c_y, c_1, out, impl="auto"):
    _check_row_grad(logits, targets, lse, c_p, c_y, c_1, out, impl)


# ---- token_smooth_forward / token_smooth_grad ------------------------------------------------


def _check_token_smooth_forward(logits, targets, log_prior, impl, inplace_grad=False) -> str:
    return _boundary.check("token_smooth_forward", impl, logits, lambda B, K, T, V: {
        "targets": (targets, (B, T), _boundary.INT64), "log_prior": (log_prior, (B, K), _boundary.FLOAT),
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
    chosen = _check_token_smooth_forward(logits, targets, log_prior, impl, inplace_grad)
    kernels = _launchers("token_smooth_forward", chosen, {"logits": logits}, targets, ignore_index,
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
    return _boundary.check("token_smooth_stats", impl, logits, lambda B, K, T, V: {
        "log_prior": (log_prior, (B, K), _boundary.FLOAT), "lse": (lse, (B, K, T), _boundary.FLOAT),
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
    chosen = _check_token_smooth_stats(logits, log_prior, lse, impl)
    kernels = _launchers("token_smooth_stats", chosen, {"logits": logits})
    return kernels.token_smooth_stats(logits, log_prior, lse)


@token_smooth_stats.register_fake
def _(logits, log_prior, lse, impl="auto"):
    _check_token_smooth_stats(logits, log_prior, lse, impl)
    return _pair(logits), _stats(logits)


def _check_token_smooth_grad(logits, targets, log_prior, lse, c_p, c_y, c_1, c_r, out,
                             impl) -> str:
    chosen = _boundary.check("token_smooth_grad", impl, logits, lambda B, K, T, V: {
        "targets": (targets, (B, T), _boundary.INT64), "log_prior": (log_prior, (B, K), _boundary.FLOAT),
        "lse": (lse, (B, K, T), _boundary.FLOAT), "c_p": (c_p, (B, K, T), _boundary.FLOAT),
        "c_y": (c_y, (B, K, T), _boundary.FLOAT), "c_1": (c_1, (B, K, T), _boundary.FLOAT),
        "c_r": (c_r, (B, T), _boundary.FLOAT),
    })
    _boundary.check_out("token_smooth_grad", logits, out)
    return chosen


@torch.library.custom_op(
    "rag_fast::token_smooth_grad", mutates_args=("out",), device_types=("cpu", "cuda"),
    schema="(Tensor logits, Tensor targets, int ignore_index, Tensor log_prior, Tensor lse, "
           "Tensor c_p, Tensor c_y, Tensor c_1, Tensor c_r, Tensor(a!) out, "
           "str impl=\"auto\") -> ()",
)
def token_smooth_grad(logits: Tensor, targets: Tensor, ignore_index: int, log_prior: Tensor,
                      lse: Tensor, c_p: Tensor, c_y: Tensor, c_1: Tensor, c_r: Tensor,
                      out: Tensor, impl: str = "auto") -> None:
    chosen = _check_token_smooth_grad(logits, targets, log_prior, lse, c_p, c_y, c_1, c_r, out,
                                       impl)
    kernels = _launchers("token_smooth_grad", chosen, {"logits": logits, "out": out}, targets,
                       ignore_index, logits.shape[-1])
    kernels.token_smooth_grad(logits, targets, ignore_index, log_prior, lse, c_p, c_y, c_1, c_r,
                              out)


@token_smooth_grad.register_fake
def _(logits, targets, ignore_index, log_prior, lse, c_p, c_y, c_1, c_r, out, impl="auto"):
    _check_token_smooth_grad(logits, targets, log_prior, lse, c_p, c_y, c_1, c_r, out, impl)


# ---- token_marginal / token_marginal_grad ----------------------------------------------------


def _check_token_marginal(logits, log_prior, impl) -> str:
    return _boundary.check("token_marginal", impl, logits,
                  lambda B, K, T, V: {"log_prior": (log_prior, (B, K), _boundary.FLOAT)})


@torch.library.custom_op(
    "rag_fast::token_marginal", mutates_args=(), device_types=("cpu", "cuda"),
    schema="(Tensor logits, Tensor log_prior, str impl=\"auto\") -> (Tensor, Tensor)",
)
def token_marginal(logits: Tensor, log_prior: Tensor, impl: str = "auto") -> tuple[Tensor, Tensor]:
    kernels = _launchers("token_marginal", _check_token_marginal(logits, log_prior, impl),
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
    return _boundary.check("token_marginal_grad", impl, logits, lambda B, K, T, V: {
        "log_prior": (log_prior, (B, K), _boundary.FLOAT), "lse": (lse, (B, K, T), _boundary.FLOAT),
        "marginal": (marginal, (B, T, V), _boundary.FLOAT),
        "grad_marginal": (grad_marginal, (B, T, V), _boundary.FLOAT),
    })


@torch.library.custom_op(
    "rag_fast::token_marginal_grad", mutates_args=(), device_types=("cpu", "cuda"),
    schema="(Tensor logits, Tensor log_prior, Tensor lse, Tensor marginal, "
           "Tensor grad_marginal, str impl=\"auto\") -> (Tensor, Tensor)",
)
def token_marginal_grad(logits: Tensor, log_prior: Tensor, lse: Tensor, marginal: Tensor,
                        grad_marginal: Tensor, impl: str = "auto") -> tuple[Tensor, Tensor]:
    chosen = _check_token_marginal_grad(logits, log_prior, lse, marginal, grad_marginal, impl)
    g_logits = _pool.empty(logits.shape, logits.dtype, like=logits)
    kernels = _launchers("token_marginal_grad", chosen, {"logits": logits, "out": g_logits})
    c = kernels.token_marginal_grad(logits, log_prior, lse, marginal, grad_marginal, g_logits)
    return g_logits, c


@token_marginal_grad.register_fake
def _(logits, log_prior, lse, marginal, grad_marginal, impl="auto"):
    _check_token_marginal_grad(logits, log_prior, lse, marginal, grad_marginal, impl)
    return torch.empty_like(logits, memory_format=torch.contiguous_format), _stats(logits)


# ---- the C++ launchers ---------------------------------------------------------------------


def _f32(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float32).contiguous()


def _f64(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float64).contiguous()


class cpp:  # a namespace: the launchers, named as the Triton module's
    """The C++ launchers of the family, one per kernel of ``csrc/rag_losses.cpp``: the
    contract of the module docstring, on CPU tensors the custom op has checked."""

    @staticmethod
    def row_stats(
        x: torch.Tensor, y: torch.Tensor | None, ignore_index: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        lse, x_tgt, x_sum = _lse(x), _stats(x), _stats(x)
        y_keep = None if y is None else y.contiguous()  # alive for the whole call
        y_ptr = 0 if y_keep is None else y_keep.data_ptr()
        _ext.get().row_stats(
            *backend.logits_view(x), y_ptr, ignore_index, lse.data_ptr(), x_tgt.data_ptr(), x_sum.data_ptr()
        )
        return lse, x_tgt, x_sum

    @staticmethod
    def row_grad(
        x: torch.Tensor,
        y: torch.Tensor | None,
        ignore_index: int,
        lse: torch.Tensor,
        c_p: torch.Tensor,
        c_y: torch.Tensor,
        c_1: torch.Tensor,
        out: torch.Tensor,
    ) -> torch.Tensor:
        y_keep = None if y is None else y.contiguous()
        lse, c_p, c_y, c_1 = _f64(lse), _f32(c_p), _f32(c_y), _f32(c_1)
        _ext.get().row_grad(
            *backend.logits_view(x),
            0 if y_keep is None else y_keep.data_ptr(),
            ignore_index,
            lse.data_ptr(),
            c_p.data_ptr(),
            c_y.data_ptr(),
            c_1.data_ptr(),
            out.data_ptr(),
            out.stride(0),
            out.stride(1),
            out.stride(2),
        )
        return out

    @staticmethod
    def token_smooth_forward(
        x: torch.Tensor,
        y: torch.Tensor | None,
        ignore_index: int,
        a: torch.Tensor,
        need_rho: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        lse, x_tgt, x_sum = _lse(x), _stats(x), _stats(x)
        rho = _stats(x) if need_rho else None
        sum_m = _pair(x)
        y_keep = None if y is None else y.contiguous()
        a = _f32(a)
        _ext.get().token_smooth_forward(
            *backend.logits_view(x),
            0 if y_keep is None else y_keep.data_ptr(),
            ignore_index,
            a.data_ptr(),
            lse.data_ptr(),
            x_tgt.data_ptr(),
            x_sum.data_ptr(),
            sum_m.data_ptr(),
            0 if rho is None else rho.data_ptr(),
        )
        return lse, x_tgt, x_sum, sum_m, rho

    @staticmethod
    def token_smooth_stats(
        x: torch.Tensor, a: torch.Tensor, lse: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        a, lse = _f32(a), _f64(lse)
        sum_m, rho = _pair(x), _stats(x)
        _ext.get().token_smooth_stats(
            *backend.logits_view(x), a.data_ptr(), lse.data_ptr(), sum_m.data_ptr(), rho.data_ptr()
        )
        return sum_m, rho

    @staticmethod
    def token_smooth_grad(
        x: torch.Tensor,
        y: torch.Tensor | None,
        ignore_index: int,
        a: torch.Tensor,
        lse: torch.Tensor,
        c_p: torch.Tensor,
        c_y: torch.Tensor,
        c_1: torch.Tensor,
        c_r: torch.Tensor,
        out: torch.Tensor,
    ) -> torch.Tensor:
        y_keep = None if y is None else y.contiguous()
        a, lse, c_p, c_y, c_1, c_r = _f32(a), _f64(lse), _f32(c_p), _f32(c_y), _f32(c_1), _f32(c_r)
        _ext.get().token_smooth_grad(
            *backend.logits_view(x),
            0 if y_keep is None else y_keep.data_ptr(),
            ignore_index,
            a.data_ptr(),
            lse.data_ptr(),
            c_p.data_ptr(),
            c_y.data_ptr(),
            c_1.data_ptr(),
            c_r.data_ptr(),
            out.data_ptr(),
            out.stride(0),
            out.stride(1),
            out.stride(2),
        )
        return out

    @staticmethod
    def token_marginal(x: torch.Tensor, a: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
        B, _, T, V = x.shape
        a, lse = _f32(a), _f64(lse)
        marginal = _pool.empty((B, T, V), torch.float32, like=x)  # CPU only: reused memory
        _ext.get().token_marginal(*backend.logits_view(x), a.data_ptr(), lse.data_ptr(), marginal.data_ptr())
        return marginal

    @staticmethod
    def token_marginal_grad(
        x: torch.Tensor,
        a: torch.Tensor,
        lse: torch.Tensor,
        m: torch.Tensor,
        g_m: torch.Tensor,
        out: torch.Tensor,
    ) -> torch.Tensor:
        a, lse, m, g_m = _f32(a), _f64(lse), _f32(m), _f32(g_m)
        c = _stats(x)
        _ext.get().token_marginal_grad(
            *backend.logits_view(x),
            a.data_ptr(),
            lse.data_ptr(),
            m.data_ptr(),
            g_m.data_ptr(),
            c.data_ptr(),
            out.data_ptr(),
            out.stride(0),
            out.stride(1),
            out.stride(2),
        )
        return c
