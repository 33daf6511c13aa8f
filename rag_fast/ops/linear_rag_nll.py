"""The LM head and the RAG loss in one op, without the ``[B, K, T, V]`` logits.

A RAG loss reads the logits ``x = h W^T + b`` only through a few per-row statistics (see
``rag_fast/ops/rag_losses.py``): the row's log-sum-exp ``L``, its target logit, its sum, and for
RAG-Token with label smoothing the per-(b, t) sum over v of the passage marginal ``M`` (with
``rho``, the posterior mass per row, for the backward). Each of them is a sum over the
vocabulary, so the vocabulary is walked in tiles of ``tile`` columns and only one
``[B*K*T, tile]`` tile of logits exists at a time:

- forward, pass 1: per tile, ``x = h W_tile^T (+ b)``; ``L`` merges the tiles' log-sum-exps, the
  target logit is read from the tile that holds it, the row sums add up;
- forward, pass 2 (RAG-Token with ``epsilon > 0`` only): per tile, with ``L`` now final,
  the tile's share of ``sum_v M`` and of ``rho`` (the K rows of each (b, t) together);
- the loss follows from those ``O(B*K*T)`` statistics by the same small graph as the fused
  losses over materialized logits;
- backward: the small graph's gradients give per-row coefficients; per tile the logits are
  recomputed, their gradient is written over them in place (the cross-entropy-shaped formula
  of docs/design.md), and ``dh += G W_tile``, ``dW_tile = G^T h``, ``db_tile = sum_rows G``.

With ``deferred_weight_grad`` (a tied head: ``dW`` is computed late, by one more pass that
recomputes the logits) and no smoothed RAG-Token term or bias gradient, pass 1 also accumulates
``P W`` without the target entries (softmax times the LM head, rescaled as the running ``L``
grows, as a flash-attention output is: one more ``[N, d]`` float32 buffer, held until the
backward), so that the backward gets ``dh = c_p (P W)' + (c_p P_y + c_y) W[y] + c_1 colsum(W)``
without a pass of its own.

Cost: the materialized path runs three ``[N, d] x [d, V]``-sized GEMMs (logits, ``dh``, ``dW``);
this op runs four (the logits twice), five for RAG-Token with label smoothing (six with a
deferred weight gradient); in exchange it never writes, reads back or page-faults a
logits-sized buffer. Memory beyond the weights and
their gradients: one tile, ``dh`` and ``O(B*K*T)`` statistics.

Backends: the per-tile statistics and gradients are the fused losses' own kernels (C++ on the
CPU, Triton on a GPU), called on tile views through their custom ops (``torch.ops.rag_fast.*``,
which check every argument before a kernel runs); the GEMMs are torch's (BLAS on the CPU, cuBLAS on
a GPU). ``impl="torch"`` is the materialized reference (``F.linear`` then
``rag_fast.reference``), which also serves float64.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from rag_fast import _pool, reference
from rag_fast.ops.rag_losses import (
    sequence_small_graph,
    token_small_graph,
    prepare_loss,
)

MODES = ("token", "sequence")

# Bytes of one logits tile (rows x tile columns). Small enough to stay a small fraction of the
# logits (1 280 rows x V 151 936 fp32 are 742 MiB; a tile is 1%), large enough that each GEMM
# still runs near full speed (the measurement: docs/tuning.md, "Training: TILE_BYTES of the
# fused LM-head loss"). Re-measure with ``python benchmarks/tune.py lm-head-tile``.
TILE_BYTES = 8 << 20
# The same on a GPU. There a tile's GEMM takes about as long as launching the handful of
# kernels and small ops that follow it, so tiles must be far wider than a CPU's
# cache-sized ones for the launches not to dominate: 128 MiB is 8.6% of the bf16 logits of
# 5 120 rows x V 151 936 (the GPU benchmark's shape: 12 tiles of 13 056 columns), and 2.6% of
# those of 8 questions x 10 passages x 256 tokens x V 128 256 (4.9 GiB). Not yet measured on a
# GPU: re-measure with ``python benchmarks/tune.py lm-head-tile --device cuda``.
TILE_BYTES_CUDA = 128 << 20
MIN_TILE = 256


def tile_width(rows: int, V: int, element_size: int, tile_bytes: int | None = None,
               device_type: str = "cpu") -> int:
    """Vocabulary columns per tile: ``tile_bytes`` of logits (default, read at each call:
    :data:`TILE_BYTES`, or :data:`TILE_BYTES_CUDA` for ``device_type="cuda"``), a multiple of
    64, at least ``MIN_TILE`` and at most V."""
    if tile_bytes is None:
        tile_bytes = TILE_BYTES_CUDA if device_type == "cuda" else TILE_BYTES
    width = tile_bytes // max(1, rows * element_size)
    width = max(MIN_TILE, width - width % 64)
    return max(1, min(V, width))


class _Tiles:
    """The vocabulary tiles of ``h W^T + b`` into one reused buffer; with ``logits`` (the whole
    ``[N, V]`` logits, computed once by :func:`_kept_logits`), one tile: those logits, not
    recomputed."""

    def __init__(self, h2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 width: int, logits: torch.Tensor | None = None) -> None:
        self.h2, self.weight, self.bias = h2, weight, bias
        self.V = weight.shape[0]
        self.logits = logits
        self.width = self.V if logits is not None else width
        self._buf = None if logits is not None else torch.empty(
            h2.shape[0] * min(width, self.V), dtype=h2.dtype, device=h2.device)

    def __iter__(self):
        if self.logits is not None:
            yield 0, self.V, self.logits
            return
        N = self.h2.shape[0]
        for v0 in range(0, self.V, self.width):
            v1 = min(v0 + self.width, self.V)
            x = self._buf[: N * (v1 - v0)].view(N, v1 - v0)
            torch.mm(self.h2, self.weight[v0:v1].t(), out=x)
            if self.bias is not None:
                x += self.bias[v0:v1]
            yield v0, v1, x


# Vocabulary columns per GEMM of the kept logits on the CPU: a slice of the LM head that stays in
# L2 while it meets every row (as rag_fast/models/_seq2seq.py's LM_HEAD_CHUNK, measured in
# docs/tuning.md, "Training: LM_HEAD_CHUNK").
KEPT_CHUNK = 512


def _kept_logits(h2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """The whole ``[N, V]`` logits, once, in memory from rag_fast's CPU buffer pool (reused
    from step to step, see rag_fast/_pool.py), ``KEPT_CHUNK`` columns per GEMM on the CPU."""
    N, V = h2.shape[0], weight.shape[0]
    out = _pool.empty((N, V), h2.dtype, like=h2)
    chunk = KEPT_CHUNK if h2.device.type == "cpu" else V
    for v0 in range(0, V, chunk):
        v1 = min(v0 + chunk, V)
        torch.mm(h2, weight[v0:v1].t(), out=out[:, v0:v1])
    if bias is not None:
        out += bias
    return out


def _local_targets(targets: torch.Tensor, ignore_index: int, v0: int, v1: int) -> torch.Tensor:
    """Targets as column indices of the tile ``[v0, v1)``; -1 (the tiles' ignore value) where
    the target lies elsewhere or is ignored."""
    inside = (targets >= v0) & (targets < v1) & (targets != ignore_index)
    return torch.where(inside, targets - v0, torch.full_like(targets, -1))


class _GradTiles(_Tiles):
    """The tiles of the logits' gradient ``G``: each tile's logits recomputed, then overwritten
    with their gradient from the per-row coefficients (see the module docstring)."""

    def __init__(self, h2, weight, bias, width, shape, targets, ignore_index, a, lse, c_p, c_y,
                 c_1, c_r, smooth_token: bool, impl: str, logits=None) -> None:
        super().__init__(h2, weight, bias, width, logits)
        self.shape, self.targets, self.ignore_index, self.a = shape, targets, ignore_index, a
        self.lse, self.c_p, self.c_y, self.c_1, self.c_r = lse, c_p, c_y, c_1, c_r
        self.smooth_token, self.impl = smooth_token, impl

    def __iter__(self):
        B, K, T = self.shape
        for v0, v1, x in super().__iter__():
            x4 = x.view(B, K, T, v1 - v0)
            local = _local_targets(self.targets, self.ignore_index, v0, v1)
            if self.smooth_token:
                torch.ops.rag_fast.token_smooth_grad(x4, local, -1, self.a, self.lse, self.c_p,
                                                     self.c_y, self.c_1, self.c_r, x4, self.impl)
            else:
                torch.ops.rag_fast.row_grad(x4, local, -1, self.lse, self.c_p, self.c_y,
                                            self.c_1, x4, self.impl)
            yield v0, v1, x

    @torch.no_grad()
    def weight_grad(self) -> torch.Tensor:
        """``G^T h`` ``[V, d]``, tile by tile (the logits recomputed once more). float32 when
        the tiles are bf16/fp16 (autocast): the tied weight it belongs to, and the embedding
        rows added into it later, are float32."""
        low = self.weight.dtype in (torch.bfloat16, torch.float16)
        dtype = torch.float32 if low else self.weight.dtype
        dW = _pool.empty(self.weight.shape, dtype, like=self.h2)  # reused memory on the CPU
        for v0, v1, G in self:
            if low:
                dW[v0:v1] = G.t() @ self.h2
            else:
                torch.mm(G.t(), self.h2, out=dW[v0:v1])
        return dW


def _statistics(h2, weight, bias, a, targets, shape, ignore_index, impl, width, smooth_token,
                need_sum, fold=None, logits=None):
    """The per-row statistics of the logits ``h2 W^T + b``, a vocabulary tile at a time (pass 1,
    and pass 2 for RAG-Token with label smoothing): ``(lse [B, K, T] float64, x_tgt [B, K, T],
    x_sum [B, K, T] or None, sum_m [B, T] or None, rho [B, K, T] or None)``. ``fold(x, w_tile,
    lse_before, lse_after, local)`` is called on each pass-1 tile (the online ``P W``).
    ``logits``: see :class:`_Tiles`."""
    B, K, T = shape
    N = h2.shape[0]
    y_rows = targets[:, None, :].expand(B, K, T).reshape(N)
    # float64, as row_stats gives each tile's (see rag_fast/ops/rag_losses.py)
    lse = torch.full((N,), float("-inf"), dtype=torch.float64, device=h2.device)
    x_tgt = torch.zeros(N, dtype=torch.float32, device=h2.device)
    x_sum = torch.zeros(N, dtype=torch.float32, device=h2.device) if need_sum else None
    tiles = _Tiles(h2, weight, bias, width, logits)
    for v0, v1, x in tiles:
        part, _, part_sum = torch.ops.rag_fast.row_stats(x.view(B, K, T, v1 - v0), None,
                                                         ignore_index, impl)
        new_lse = torch.logaddexp(lse, part.view(N))
        if need_sum:
            x_sum += part_sum.view(N)
        local = _local_targets(y_rows, ignore_index, v0, v1)
        picked = x.gather(1, local.clamp_min(0)[:, None]).squeeze(1).float()
        x_tgt = torch.where(local >= 0, picked, x_tgt)
        if fold is not None:
            fold(x, weight[v0:v1], lse, new_lse, local)
        lse = new_lse
    lse3 = lse.view(B, K, T)
    sum_m = rho = None
    if smooth_token:
        sum_m = torch.zeros((B, T), dtype=torch.float32, device=h2.device)
        rho = torch.zeros((B, K, T), dtype=torch.float32, device=h2.device)
        for v0, v1, x in tiles:
            part_m, part_rho = torch.ops.rag_fast.token_smooth_stats(
                x.view(B, K, T, v1 - v0), a, lse3, impl)
            sum_m += part_m
            rho += part_rho
    return lse3, x_tgt.view(B, K, T), None if x_sum is None else x_sum.view(B, K, T), sum_m, rho


def _tile_grads(grad_tiles: "_GradTiles", h2, weight, need_h: bool, need_w: bool,
                need_b: bool):
    """``(dh float32 [N, d], dW [V, d], db [V])`` (None where not needed) from the logits'
    gradient, a tile at a time."""
    N = h2.shape[0]
    dh = torch.zeros((N, h2.shape[1]), dtype=torch.float32, device=h2.device) if need_h \
        else None
    dW = torch.empty_like(weight) if need_w else None
    db = torch.empty_like(grad_tiles.bias) if need_b else None
    if need_h or need_w or need_b:
        for v0, v1, G in grad_tiles:
            if need_h:
                if dh.dtype == G.dtype:
                    dh.addmm_(G, weight[v0:v1])
                else:
                    dh += G @ weight[v0:v1]
            if need_w:
                torch.mm(G.t(), h2, out=dW[v0:v1])
            if need_b:
                db[v0:v1] = G.sum(0)
    return dh, dW, db


def _smooth_coefficients(g_lse, g_sum_m, rho, smooth_token: bool):
    """``(c_p, extra g_a)``: RAG-Token with label smoothing moves part of ``sum_m``'s gradient
    onto the logits' softmax term and the log-prior (``d sum_m / d a = rho``)."""
    if not smooth_token:
        return g_lse, None
    weighted = g_sum_m[:, None, :] * rho
    return g_lse - weighted, weighted.sum(-1)


class _LinearRagLoss(torch.autograd.Function):
    """The op with a deferred weight gradient (a tied head in eager ``RagModel``): the hidden
    states' gradient may be gathered in the forward pass (the online ``P W``), and the weight's
    is left to ``deferred``. Every other call runs the custom ops of :func:`_custom_op_loss`."""

    @staticmethod
    def forward(ctx, h2, weight, bias, a, targets, mask, nll_mask, shape, mode, epsilon,
                ignore_index, reduction, impl, width, deferred):
        B, K, T = shape
        N, V = h2.shape[0], weight.shape[0]
        smooth_token = mode == "token" and epsilon > 0
        need_sum = mode == "sequence" and epsilon > 0
        needs_grad = any(ctx.needs_input_grad[:4])
        # With the weight's gradient deferred (a tied head in RagModel), the hidden states'
        # gradient is gathered here, in this one pass, instead of by a pass of its own in the
        # backward (see _online_softmax_product); not for RAG-Token with label smoothing, whose
        # gradient needs statistics of a second pass, nor with a bias that needs a gradient.
        online = (deferred is not None and ctx.needs_input_grad[0] and not smooth_token
                  and not (bias is not None and ctx.needs_input_grad[2]))
        pw = colsum = fold = None
        if online:
            pw = torch.zeros((N, h2.shape[1]), dtype=torch.float32, device=h2.device)
            colsum = torch.zeros(h2.shape[1], dtype=torch.float32, device=h2.device) \
                if need_sum else None
            unit = (torch.ones((B, K, T), dtype=torch.float32, device=h2.device),
                    torch.zeros((B, K, T), dtype=torch.float32, device=h2.device))

            def fold(x, w_tile, lse_before, lse_after, local):
                _online_softmax_product(pw, x, w_tile, lse_before, lse_after, shape, local,
                                        unit, impl)
                if colsum is not None:
                    colsum.add_(w_tile.sum(0, dtype=torch.float32))

        lse3, x_tgt, x_sum, sum_m, rho = _statistics(
            h2, weight, bias, a, targets, shape, ignore_index, impl, width, smooth_token,
            need_sum, fold)
        graph = _small_graph(mode, mask, nll_mask, epsilon, V, reduction)
        loss = graph(lse3, x_tgt, x_sum, sum_m, a).to(torch.float32)
        if needs_grad:
            ctx.save_for_backward(h2, weight, bias, a, targets, mask, nll_mask, lse3, x_tgt,
                                  x_sum, sum_m, rho, pw, colsum)
        ctx.meta = (shape, mode, epsilon, ignore_index, reduction, impl, width)
        ctx.deferred = deferred
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_loss):
        (h2, weight, bias, a, targets, mask, nll_mask, lse, x_tgt, x_sum, sum_m, rho, pw,
         colsum) = ctx.saved_tensors
        shape, mode, epsilon, ignore_index, reduction, impl, width = ctx.meta
        V = weight.shape[0]
        smooth_token = mode == "token" and epsilon > 0
        # the small graph's gradients with respect to the statistics and the log-prior
        stats = [t.detach().requires_grad_() if t is not None else None
                 for t in (lse, x_tgt, x_sum, sum_m, a)]
        with torch.enable_grad():
            loss = _small_graph(mode, mask, nll_mask, epsilon, V, reduction)(*stats)
            loss = loss.to(torch.float32)
            wanted = [t for t in stats if t is not None]
            grads = torch.autograd.grad(loss, wanted, g_loss, allow_unused=True,
                                        materialize_grads=True)
        found = iter(grads)
        g_lse, g_tgt, g_sum, g_sum_m, g_a = (None if t is None else next(found) for t in stats)
        if g_sum is None:  # no row sums in this loss
            g_sum = torch.zeros_like(lse)
        c_p, g_a_smooth = _smooth_coefficients(g_lse, g_sum_m, rho, smooth_token)
        if g_a_smooth is not None:
            g_a = g_a + g_a_smooth
        need_h, need_w, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1], (
            bias is not None and ctx.needs_input_grad[2])
        deferred = ctx.deferred if need_w else None
        if deferred is not None:  # the weight's gradient is computed later (see below)
            need_w = False
        grad_tiles = _GradTiles(h2, weight, bias, width, shape, targets, ignore_index, a,
                                lse, c_p, g_tgt, g_sum, g_sum_m, smooth_token, impl)
        dh = None
        if pw is not None and need_h and not need_w and not need_b:
            dh = _hidden_grad_from_pw(pw, weight, targets, ignore_index, shape, lse, x_tgt,
                                      c_p, g_tgt, g_sum, colsum)
            need_h = False
        dh_tiles, dW, db = _tile_grads(grad_tiles, h2, weight, need_h, need_w, need_b)
        dh = dh if dh is not None else dh_tiles
        if deferred is not None:
            deferred.add_late(grad_tiles.weight_grad)
        g_h = None if dh is None else dh.to(h2.dtype)
        return (g_h, dW, db, g_a if ctx.needs_input_grad[3] else None,
                None, None, None, None, None, None, None, None, None, None, None)


# ---- the op as custom ops: what torch.compile traces (and every call without a deferred
# weight gradient). The statistics pass and the gradient pass are opaque to the compiler; the
# small graph between them is ordinary torch code it fuses.

def _width(h2: torch.Tensor, V: int, tile: int) -> int:
    """Vocabulary columns per tile: ``tile`` (at most V), or the default for ``tile <= 0``."""
    return min(V, tile) if tile > 0 else tile_width(h2.shape[0], V, h2.element_size(),
                                                     device_type=h2.device.type)


def _none_empty(t: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """Custom ops return tensors only: an absent one is an empty float32 tensor."""
    return like.new_empty(0, dtype=torch.float32) if t is None else t


def _present(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None or t.numel() == 0 else t


@torch.library.custom_op(
    "rag_fast::linear_rag_stats", mutates_args=(), device_types=("cpu", "cuda"),
    schema="(Tensor hidden, Tensor weight, Tensor? bias, Tensor log_prior, Tensor targets, "
           "int ignore_index, bool smooth_token, bool need_sum, int tile, bool keep_logits, "
           "str impl) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
)
def linear_rag_stats(hidden, weight, bias, log_prior, targets, ignore_index, smooth_token,
                     need_sum, tile, keep_logits, impl):
    """The per-row statistics of ``hidden [B*K*T, d] @ weight^T (+ bias)`` (see
    :func:`_statistics`): ``lse [B, K, T]`` float64, ``x_tgt``, ``x_sum`` (empty unless
    ``need_sum``), ``sum_m [B, T]`` and ``rho [B, K, T]`` (empty unless ``smooth_token``),
    and with ``keep_logits`` the ``[B*K*T, V]`` logits, computed once and kept for the
    backward (which writes their gradient over them), else an empty tensor and the logits
    a tile at a time. ``tile`` <= 0: the default tile width."""
    B, K = log_prior.shape
    shape = (B, K, targets.shape[1])
    logits = _kept_logits(hidden, weight, bias) if keep_logits else None
    stats = _statistics(hidden, weight, bias, log_prior, targets, shape, ignore_index, impl,
                        _width(hidden, weight.shape[0], tile), smooth_token, need_sum,
                        logits=logits)
    return tuple(_none_empty(t, hidden) for t in stats) + (_none_empty(logits, hidden),)


@linear_rag_stats.register_fake
def _(hidden, weight, bias, log_prior, targets, ignore_index, smooth_token, need_sum, tile,
      keep_logits, impl):
    B, K = log_prior.shape
    T = targets.shape[1]
    f32 = dict(dtype=torch.float32)
    return (hidden.new_empty((B, K, T), dtype=torch.float64), hidden.new_empty((B, K, T), **f32),
            hidden.new_empty((B, K, T) if need_sum else (0,), **f32),
            hidden.new_empty((B, T) if smooth_token else (0,), **f32),
            hidden.new_empty((B, K, T) if smooth_token else (0,), **f32),
            hidden.new_empty((hidden.shape[0], weight.shape[0])) if keep_logits
            else hidden.new_empty(0, **f32))


def _linear_rag_stats_setup(ctx, inputs, output) -> None:
    (hidden, weight, bias, log_prior, targets, ignore_index, smooth_token, _, tile, _,
     impl) = inputs
    ctx.save_for_backward(hidden, weight, bias, log_prior, targets, output[0], output[4],
                          output[5])
    ctx.meta = (ignore_index, smooth_token, tile, impl)


def _linear_rag_stats_backward(ctx, g_lse, g_tgt, g_sum, g_sum_m, _g_rho, _g_logits):
    hidden, weight, bias, log_prior, targets, lse, rho, logits = ctx.saved_tensors
    ignore_index, smooth_token, tile, impl = ctx.meta
    g_lse = torch.zeros_like(lse) if g_lse is None else g_lse
    g_tgt = torch.zeros_like(lse, dtype=torch.float32) if g_tgt is None else g_tgt
    g_sum = torch.zeros_like(lse) if g_sum is None or g_sum.numel() == 0 else g_sum
    if smooth_token and g_sum_m is None:
        g_sum_m = lse.new_zeros(lse.shape[0], lse.shape[2], dtype=torch.float32)
    c_p, g_a = _smooth_coefficients(g_lse, g_sum_m, rho, smooth_token)
    need = ctx.needs_input_grad
    kept = logits.numel() > 0
    dh, dW, db = torch.ops.rag_fast.linear_rag_grad(
        hidden, weight, bias, log_prior, targets, lse, c_p, g_tgt, g_sum,
        g_sum_m if smooth_token else None, logits if kept else None, ignore_index,
        smooth_token, tile, impl, need[0], need[1], bias is not None and need[2])
    if kept and not torch.compiler.is_compiling():
        # the kept logits now hold their gradient: a second backward through this call
        # raises (autograd's version check) instead of reading it
        torch.autograd.graph.increment_version(logits)
    return (_present(dh) if need[0] else None, _present(dW) if need[1] else None,
            _present(db) if bias is not None and need[2] else None,
            g_a if need[3] else None, None, None, None, None, None, None, None)


torch.library.register_autograd("rag_fast::linear_rag_stats", _linear_rag_stats_backward,
                                setup_context=_linear_rag_stats_setup)


@torch.library.custom_op(
    "rag_fast::linear_rag_grad", mutates_args=(), device_types=("cpu", "cuda"),
    schema="(Tensor hidden, Tensor weight, Tensor? bias, Tensor log_prior, Tensor targets, "
           "Tensor lse, Tensor c_p, Tensor c_y, Tensor c_1, Tensor? c_r, Tensor? logits, "
           "int ignore_index, bool smooth_token, int tile, str impl, bool need_hidden, "
           "bool need_weight, bool need_bias) -> (Tensor, Tensor, Tensor)",
)
def linear_rag_grad(hidden, weight, bias, log_prior, targets, lse, c_p, c_y, c_1, c_r, logits,
                    ignore_index, smooth_token, tile, impl, need_hidden, need_weight, need_bias):
    """``(d hidden, d weight, d bias)`` of :func:`linear_rag_stats` given the per-row
    coefficients of the logits' gradient (each empty where not asked for). ``logits``: the
    logits :func:`linear_rag_stats` kept, whose only reader this op is: their gradient is
    written over them (the schema does not declare it: nothing reads them after this call;
    eager autograd's version check refuses a second backward)."""
    B, K, T = lse.shape
    grad_tiles = _GradTiles(hidden, weight, bias, _width(hidden, weight.shape[0], tile),
                            (B, K, T), targets, ignore_index, log_prior, lse, c_p, c_y, c_1,
                            c_r, smooth_token, impl, logits)
    dh, dW, db = _tile_grads(grad_tiles, hidden, weight, need_hidden, need_weight, need_bias)
    return (_none_empty(None if dh is None else dh.to(hidden.dtype), hidden),
            _none_empty(dW, hidden), _none_empty(db, hidden))


@linear_rag_grad.register_fake
def _(hidden, weight, bias, log_prior, targets, lse, c_p, c_y, c_1, c_r, logits, ignore_index,
      smooth_token, tile, impl, need_hidden, need_weight, need_bias):
    empty = hidden.new_empty(0, dtype=torch.float32)
    return (torch.empty_like(hidden) if need_hidden else empty,
            torch.empty_like(weight) if need_weight else empty,
            torch.empty_like(bias) if need_bias else empty)


def _custom_op_loss(h2, weight, bias, a, targets, mask, nll_mask, mode, epsilon,
                    ignore_index, reduction, impl, tile, keep_logits):
    """The loss through :func:`linear_rag_stats` (whose backward is :func:`linear_rag_grad`)
    and the small graph as plain torch code."""
    smooth_token = mode == "token" and epsilon > 0
    need_sum = mode == "sequence" and epsilon > 0
    lse, x_tgt, x_sum, sum_m, _, _ = torch.ops.rag_fast.linear_rag_stats(
        h2, weight, bias, a, targets, ignore_index, smooth_token, need_sum, tile, keep_logits,
        impl)
    graph = _small_graph(mode, mask, nll_mask, epsilon, weight.shape[0], reduction)
    return graph(lse, x_tgt, x_sum if need_sum else None, sum_m if smooth_token else None,
                 a).to(torch.float32)


def _online_softmax_product(pw, x, w_tile, lse_before, lse_after, shape, local, unit, impl):
    """Fold one vocabulary tile into ``pw``, the running ``P W`` over the entries other than
    each row's target (softmax of the logits seen so far times their LM-head rows):
    ``pw <- pw * exp(L_before - L_after) + exp(x - L_after) W_tile``, where L is the running
    log-sum-exp of each row (float64). After the last tile, ``pw = P W - P_y W[y]`` with P the
    rows' softmax over the whole vocabulary, as a flash-attention output accumulates.
    exp(x - L) is written over the tile ``x`` by the losses' own gradient kernel (its float64
    row normaliser, c_p = 1 and no other term); the target's entry is then zeroed: its term is
    added back exactly in the backward (:func:`_hidden_grad_from_pw`), where it nearly cancels
    the target term when P_y is near 1. A row whose logits so far are all -inf (a -inf bias)
    adds nothing and is not rescaled."""
    B, K, T = shape
    ones, zeros = unit
    seen = torch.isfinite(lse_after)
    after = torch.where(seen, lse_after, 0.0)  # exp(-inf - 0) = 0 for an unseen row
    x4 = x.view(B, K, T, x.shape[1])
    torch.ops.rag_fast.row_grad(x4, None, -1, after.view(shape), ones, zeros, zeros, x4, impl)
    rows = (local >= 0).nonzero().squeeze(1)
    x[rows, local[rows]] = 0
    scale = torch.where(torch.isfinite(lse_before), torch.exp(lse_before - after), 0.0)
    pw.mul_(scale.to(pw.dtype)[:, None])  # 0 before a row's first finite tile
    if x.dtype == pw.dtype:
        pw.addmm_(x, w_tile)
    else:
        pw += (x @ w_tile).float()


ROW_CHUNK = 4096  # rows of dh formed at once from P W (caps the gathered W[y] rows)


def _hidden_grad_from_pw(pw, weight, targets, ignore_index, shape, lse, x_tgt, c_p, c_y, c_1,
                         colsum):
    """``dh = G W`` for ``G = c_p P + c_y onehot(y) + c_1``, from the forward's ``pw`` (P W
    without the target entry) in place: ``c_p pw + (c_p P_y + c_y) W[y] + c_1 colsum(W)``,
    the target's coefficient formed in float64 (for P_y near 1 its two terms cancel)."""
    B, K, T = shape
    N = pw.shape[0]
    y_rows = targets[:, None, :].expand(B, K, T).reshape(N)
    has_y = y_rows != ignore_index
    p_y = torch.exp(x_tgt.reshape(N).double() - lse.reshape(N))
    coef_y = torch.where(has_y, c_p.reshape(N).double() * p_y + c_y.reshape(N).double(), 0.0)
    dh = pw.mul_(c_p.reshape(N, 1).to(pw.dtype))
    for r0 in range(0, N, ROW_CHUNK):
        r1 = min(N, r0 + ROW_CHUNK)
        w_y = weight[y_rows[r0:r1].clamp_min(0)]
        dh[r0:r1].addcmul_(coef_y[r0:r1, None].to(dh.dtype), w_y.to(dh.dtype))
    if colsum is not None:
        dh.addcmul_(c_1.reshape(N, 1).to(dh.dtype), colsum[None, :])
    return dh


def _small_graph(mode, mask, nll_mask, epsilon, V, reduction):
    if mode == "token":
        return token_small_graph(mask, nll_mask, epsilon, V, reduction)
    return sequence_small_graph(mask, nll_mask, epsilon, V, reduction)


def _check(hidden, weight, bias, doc_scores, targets, mode, n_docs, tile):
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    for name, t in (("hidden", hidden), ("weight", weight), ("doc_scores", doc_scores)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise ValueError(f"{name} must be a floating tensor, got dtype {t.dtype}")
    if weight.dim() != 2:
        raise ValueError(f"weight must be the LM head's [V, d] matrix, got {tuple(weight.shape)}")
    if doc_scores.dim() != 2:
        raise ValueError(f"doc_scores must be [B, K], got {tuple(doc_scores.shape)}")
    B, K = doc_scores.shape
    if n_docs is not None and n_docs != K:
        raise ValueError(f"n_docs={n_docs} but doc_scores has K={K} passages per question")
    d = weight.shape[1]
    if hidden.dim() in (3, 4) and hidden.shape[-1] != d:
        # the model width is hidden's last dimension: a weight that does not end in it is the
        # argument at fault (e.g. given as [d, V])
        raise ValueError(f"weight must be the LM head's [V, d={hidden.shape[-1]}] matrix (d from "
                         f"hidden's last dimension), got {tuple(weight.shape)}")
    if hidden.dim() == 4:
        if hidden.shape[:2] != (B, K):
            raise ValueError(f"hidden must be [B={B}, K={K}, T, d={d}] or [B*K, T, d], got "
                             f"{tuple(hidden.shape)}")
    elif hidden.dim() == 3:
        if hidden.shape[0] != B * K:
            raise ValueError(f"hidden must be [B*K={B * K}, T, d={d}] or [B, K, T, d], got "
                             f"{tuple(hidden.shape)}")
    else:
        raise ValueError(f"hidden must be [B*K, T, d] or [B, K, T, d], got {tuple(hidden.shape)}")
    if bias is not None and (not isinstance(bias, torch.Tensor)
                             or tuple(bias.shape) != (weight.shape[0],)):
        raise ValueError(f"bias must be None or a [V={weight.shape[0]}] tensor, got "
                         f"{getattr(bias, 'shape', type(bias).__name__)}")
    for name, t in (("weight", weight), ("bias", bias), ("doc_scores", doc_scores),
                    ("targets", targets)):
        if isinstance(t, torch.Tensor) and t.device != hidden.device:
            raise ValueError(f"{name} is on {t.device} but hidden on {hidden.device}")
    if tile is not None and (isinstance(tile, bool) or not isinstance(tile, int) or tile < 1):
        raise ValueError(f"tile must be a positive int (vocabulary columns), got {tile!r}")


def linear_rag_nll(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    doc_scores: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    mode: str = "token",
    n_docs: int | None = None,
    epsilon: float = 0.0,
    ignore_index: int = -100,
    exclude_bos: bool | torch.Tensor = False,
    reduction: str = "none",
    impl: str = "auto",
    tile: int | None = None,
    deferred_weight_grad=None,
    keep_logits: bool = False,
) -> torch.Tensor:
    """RAG-Token or RAG-Sequence loss of the logits ``hidden @ weight^T + bias``, computed a
    vocabulary tile at a time: the ``[B, K, T, V]`` logits never exist.

    Equal (forward and every gradient) to ``rag_token_nll`` / ``rag_sequence_nll`` of
    ``F.linear(hidden, weight, bias)``.

    Args:
        hidden: ``[B*K, T, d]`` or ``[B, K, T, d]`` decoder states (after any output scaling),
            float32 / bfloat16 (float16 on CUDA; float64 runs the materialized reference).
        weight: ``[V, d]`` LM head; bias: ``[V]`` or None.
        doc_scores: ``[B, K]`` passage scores (``-inf``: missing passage).
        targets: ``[B, T]`` integer targets aligned with ``hidden`` (``ignore_index``: masked).
        mode: ``"token"`` (RAG-Token) or ``"sequence"`` (RAG-Sequence).
        n_docs, epsilon, ignore_index, exclude_bos, reduction: as in ``rag_token_nll``.
        impl: ``"auto"`` | ``"cpp"`` | ``"triton"`` for the per-tile kernels, ``"torch"`` for
            the materialized reference.
        tile: vocabulary columns per tile (default: ``TILE_BYTES`` of logits per tile on the
            CPU, ``TILE_BYTES_CUDA`` on a GPU).
        deferred_weight_grad: a ``rag_fast.models._seq2seq.DeferredHeadGrad`` of a tied LM
            head (what ``RagModel`` passes): the weight's gradient is then computed when that
            object's ``take()`` is called, at the end of the backward pass (once the
            activations are freed), at the cost of recomputing the logits once more; until
            then ``weight`` gets no gradient from this op. None (default): in this op's
            backward.
        keep_logits: compute the ``[B*K*T, V]`` logits once (``KEPT_CHUNK`` vocabulary columns
            per GEMM, into reused memory on the CPU) and keep them for the backward, which
            writes their gradient over them: three LM-head GEMMs instead of four, for the
            logits' memory (what ``RagModel``'s materialized path runs under
            ``torch.compile``). Not with ``deferred_weight_grad``; a second backward through
            the call raises.

    Returns:
        float32 loss: ``[B]`` for ``reduction="none"``, else a scalar.

    Raises:
        ValueError: shapes, dtypes or devices that do not match, a bad option, targets outside
            ``[0, V)``, ``keep_logits`` with ``deferred_weight_grad``.

    Under autocast the GEMMs run in the autocast dtype (as ``F.linear`` would).
    """
    _check(hidden, weight, bias, doc_scores, targets, mode, n_docs, tile)
    if not isinstance(keep_logits, bool):
        raise ValueError(f"keep_logits must be True or False, got {keep_logits!r}")
    if keep_logits and deferred_weight_grad is not None:
        raise ValueError("keep_logits=True computes the weight's gradient in the op's backward; "
                         "it cannot also be deferred (deferred_weight_grad must be None)")
    B, K = doc_scores.shape
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type) and hidden.dtype != torch.float64:
        dt = torch.get_autocast_dtype(device_type)
        hidden, weight = hidden.to(dt), weight.to(dt)
        bias = None if bias is None else bias.to(dt)
    if weight.dtype != hidden.dtype or (bias is not None and bias.dtype != hidden.dtype):
        raise ValueError(f"hidden ({hidden.dtype}), weight ({weight.dtype}) and bias must share "
                         "one dtype")
    T, d, V = hidden.shape[-2], hidden.shape[-1], weight.shape[0]
    # validation and impl choice as for the losses over logits, on a [B, K, T, V] stand-in
    stand_in = hidden.new_empty(V).expand(B, K, T, V)  # V elements, stride 1 along V
    p = prepare_loss(stand_in, doc_scores, targets, n_docs, epsilon, ignore_index, exclude_bos,
                     reduction, impl)
    if p.impl == "torch":
        logits = F.linear(hidden, weight, bias).reshape(B, K, T, V)
        fn = reference.rag_token_nll if mode == "token" else reference.rag_sequence_nll
        return fn(logits, p.doc_scores, p.targets, epsilon=epsilon, ignore_index=ignore_index,
                  exclude_bos=exclude_bos, reduction=reduction)
    h2 = hidden.reshape(B * K * T, d)
    if not h2.is_contiguous():
        h2 = h2.contiguous()
    w = weight if weight.stride(-1) == 1 else weight.contiguous()
    a = torch.log_softmax(p.doc_scores.float(), dim=1)
    deferred = deferred_weight_grad if torch.is_grad_enabled() else None
    with torch.autocast(device_type, enabled=False):
        if deferred is None or keep_logits or torch.compiler.is_compiling():
            return _custom_op_loss(h2, w, bias, a, p.targets, p.mask, p.nll_mask, mode,
                                   float(epsilon), ignore_index, reduction, p.impl,
                                   0 if tile is None else tile, keep_logits)
        return _LinearRagLoss.apply(h2, w, bias, a, p.targets, p.mask, p.nll_mask, (B, K, T),
                                    mode, float(epsilon), ignore_index, reduction, p.impl,
                                    _width(h2, V, 0 if tile is None else tile), deferred)
