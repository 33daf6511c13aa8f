# Triton kernels for the fused RAG losses (the GPU backend of rag_fast.ops; its contract is the
# docstring of rag_fast/ops/_cpp.py; docs/design.md, "Gradients", derives the math).
#
# What they compute, for logits x [B, K, T, V] (stride 1 along V), passage log-prior a [B, K]:
#   row_stats            L = logsumexp_v x, x[y], sum_v x            one program per row
#   row_grad             c_p * P + c_y * onehot(y) + c_1             one program per row
#   token_smooth_forward row_stats, then token_smooth_stats            (launcher only)
#   token_smooth_stats   sum_v M and rho = sum_v R                   one program per (b, t)
#   token_smooth_grad    row_grad's terms + c_r[b, t] * R            one program per (b, t)
#   token_marginal       M = logsumexp_k (a + x - L)                 one program per (b, t)
#   token_marginal_grad  c = sum_v R g, then R g - P c               one program per (b, t)
# with P = exp(x - L) and R = exp(a + x - L - M).
#
# Trade-off: a row program streams its row through BLOCK_V-wide tiles with an online
# max/sum-of-exp, so the forward statistics cost one read of the logits and the gradient one
# read and one write, at the price of one scalar reduction per tile. The (b, t) programs hold
# the K rows of a position together as a [BLOCK_K, BLOCK_V] tile (K is small, padded to a power
# of two), which is what M needs; fewer, wider programs than rows, so the V tile shrinks as K
# grows to keep the tile in registers. Everything accumulates in float32; nothing allocates a
# [B, K, T, V] temporary; no launcher reads a tensor value on the host.
#
# Edge cases: a missing passage (a = -inf) gets R = 0 and no NaN; a position where every
# a + x - L is -inf has M = -inf and R = 0; NaN logits propagate as NaN. Offsets are int64.
from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from rag_fast.kernels import interpreter_enabled

# Elements per tile. On a GPU a tile is a register block per program. The interpreter runs
# programs in NumPy at a fixed cost per operation and per tile, so its tiles are small enough
# for tiny test shapes to cover several tiles and a ragged tail (V = 70 for a row; V = 33 for
# K = 3 rows, 16 columns each) and no smaller, to keep V ~ 1000 quick.
_MAX_TILE_GPU = 4096
_MAX_TILE_INTERPRETER = 64
_MIN_BLOCK_V = 16


# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def _load_target(y_ptr, b, t, T, V, ignore_index):
    """y[b, t] as int64, or -1 where it is ignored (or out of range, for memory safety)."""
    y = tl.load(y_ptr + b * T + t).to(tl.int64)
    valid = (y != ignore_index) & (y >= 0) & (y < V)
    return tl.where(valid, y, -1)


@triton.jit
def _row_stats_kernel(
    x_ptr, y_ptr, lse_ptr, tgt_ptr, sum_ptr,
    K, T, V, sx_b, sx_k, sx_t, sx_v, ignore_index,
    HAS_Y: tl.constexpr, BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # (b * K + k) * T + t
    t = row % T
    b = row // T // K
    k = row // T % K
    x_row = x_ptr + b * sx_b + k * sx_k + t * sx_t
    cols = tl.arange(0, BLOCK_V)

    run_max = float("-inf")
    run_sum = 0.0
    x_acc = tl.zeros([BLOCK_V], dtype=tl.float32)
    for start in range(0, V, BLOCK_V):
        v = start + cols
        in_row = v < V
        x = tl.load(x_row + v * sx_v, mask=in_row, other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(run_max, tl.max(x, axis=0))
        # All -inf so far: shift by 0 instead of -inf so that exp gives 0, not NaN.
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        run_sum = run_sum * tl.exp(run_max - shift) + tl.sum(tl.exp(x - shift), axis=0)
        run_max = new_max
        x_acc += tl.where(in_row, x, 0.0)
    shift = tl.where(run_max == float("-inf"), 0.0, run_max)
    tl.store(lse_ptr + row, shift + tl.log(run_sum))
    tl.store(sum_ptr + row, tl.sum(x_acc, axis=0))

    x_tgt = 0.0
    if HAS_Y:
        y = _load_target(y_ptr, b, t, T, V, ignore_index)
        x_tgt = tl.load(x_row + tl.maximum(y, 0) * sx_v, mask=y >= 0, other=0.0).to(tl.float32)
    tl.store(tgt_ptr + row, x_tgt)


@triton.jit
def _row_grad_kernel(
    x_ptr, y_ptr, lse_ptr, cp_ptr, cy_ptr, c1_ptr, out_ptr,
    K, T, V, sx_b, sx_k, sx_t, sx_v, so_b, so_k, so_t, so_v, ignore_index,
    HAS_Y: tl.constexpr, BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # (b * K + k) * T + t
    t = row % T
    b = row // T // K
    k = row // T % K
    x_row = x_ptr + b * sx_b + k * sx_k + t * sx_t
    out_row = out_ptr + b * so_b + k * so_k + t * so_t
    lse = tl.load(lse_ptr + row)
    c_p = tl.load(cp_ptr + row)
    c_y = tl.load(cy_ptr + row)
    c_1 = tl.load(c1_ptr + row)
    y = -1
    if HAS_Y:
        y = _load_target(y_ptr, b, t, T, V, ignore_index)
    cols = tl.arange(0, BLOCK_V)
    for start in range(0, V, BLOCK_V):
        v = start + cols
        in_row = v < V
        # Read before write, tile by tile: `out` may be the logits' own storage.
        x = tl.load(x_row + v * sx_v, mask=in_row, other=0.0).to(tl.float32)
        g = c_p * tl.exp(x - lse) + c_1
        g = tl.where(v == y, g + c_y, g)
        tl.store(out_row + v * so_v, g.to(out_ptr.dtype.element_ty), mask=in_row)


@triton.jit
def _marginal_tile(x_ptr, rows, shift, v, sx_v, in_k, in_row):
    """The K rows of one (b, t) at columns v: ``(x, M, R)``.

    rows [BLOCK_K] int64 row offsets, shift [BLOCK_K] = a - L (-inf for a missing or padded
    passage), v [BLOCK_V] column indices. x [BLOCK_K, BLOCK_V] float32 (-inf outside),
    M [BLOCK_V] = logsumexp_k (shift + x), R [BLOCK_K, BLOCK_V] = exp(shift + x - M), 0 where
    M = -inf.
    """
    mask = in_k[:, None] & in_row[None, :]
    x = tl.load(x_ptr + rows[:, None] + v[None, :] * sx_v, mask=mask, other=float("-inf"))
    x = x.to(tl.float32)
    z = shift[:, None] + x
    z_max = tl.max(z, axis=0)
    z_max = tl.where(z_max == float("-inf"), 0.0, z_max)
    e = tl.exp(z - z_max[None, :])
    e_sum = tl.sum(e, axis=0)
    # A column with every z = -inf (padding, or a vocabulary entry masked in every passage)
    # has e_sum = 0: M = -inf and R = 0 there, without evaluating log(0) or 0 / 0.
    empty = e_sum == 0.0
    e_sum = tl.where(empty, 1.0, e_sum)
    m = tl.where(empty, float("-inf"), z_max + tl.log(e_sum))
    r = e * (1.0 / e_sum)[None, :]
    return x, m, r


@triton.jit
def _token_rows(x_ptr, a_ptr, lse_ptr, pid, K, T, sx_b, sx_k, sx_t, BLOCK_K: tl.constexpr):
    """For program pid = b * T + t: ``(b, t, ks, in_k, rows, lse, shift, stat_idx)`` with
    rows the K row offsets into x, lse [BLOCK_K] their normalisers, shift = a - lse and
    stat_idx the rows' indices into [B, K, T] statistics."""
    t = pid % T
    b = pid // T
    ks = tl.arange(0, BLOCK_K)
    in_k = ks < K
    rows = b * sx_b + ks.to(tl.int64) * sx_k + t * sx_t
    stat_idx = (b * K + ks) * T + t
    a = tl.load(a_ptr + b * K + ks, mask=in_k, other=float("-inf"))
    lse = tl.load(lse_ptr + stat_idx, mask=in_k, other=0.0)
    return b, t, ks, in_k, rows, lse, a - lse, stat_idx


@triton.jit
def _token_smooth_stats_kernel(
    x_ptr, a_ptr, lse_ptr, sum_m_ptr, rho_ptr,
    K, T, V, sx_b, sx_k, sx_t, sx_v,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)  # b * T + t
    b, t, ks, in_k, rows, lse, shift, stat_idx = _token_rows(
        x_ptr, a_ptr, lse_ptr, pid, K, T, sx_b, sx_k, sx_t, BLOCK_K
    )
    cols = tl.arange(0, BLOCK_V)
    m_acc = tl.zeros([BLOCK_V], dtype=tl.float32)
    rho_acc = tl.zeros([BLOCK_K, BLOCK_V], dtype=tl.float32)
    for start in range(0, V, BLOCK_V):
        v = start + cols
        in_row = v < V
        _, m, r = _marginal_tile(x_ptr, rows, shift, v, sx_v, in_k, in_row)
        m_acc += tl.where(in_row, m, 0.0)
        rho_acc += r  # 0 outside the row: every padded entry has M = -inf
    tl.store(sum_m_ptr + pid, tl.sum(m_acc, axis=0))
    tl.store(rho_ptr + stat_idx, tl.sum(rho_acc, axis=1), mask=in_k)


@triton.jit
def _token_smooth_grad_kernel(
    x_ptr, y_ptr, a_ptr, lse_ptr, cp_ptr, cy_ptr, c1_ptr, cr_ptr, out_ptr,
    K, T, V, sx_b, sx_k, sx_t, sx_v, so_b, so_k, so_t, so_v, ignore_index,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)  # b * T + t
    b, t, ks, in_k, rows, lse, shift, stat_idx = _token_rows(
        x_ptr, a_ptr, lse_ptr, pid, K, T, sx_b, sx_k, sx_t, BLOCK_K
    )
    out_rows = b * so_b + ks.to(tl.int64) * so_k + t * so_t
    c_p = tl.load(cp_ptr + stat_idx, mask=in_k, other=0.0)[:, None]
    c_y = tl.load(cy_ptr + stat_idx, mask=in_k, other=0.0)[:, None]
    c_1 = tl.load(c1_ptr + stat_idx, mask=in_k, other=0.0)[:, None]
    c_r = tl.load(cr_ptr + pid)
    y = _load_target(y_ptr, b, t, T, V, ignore_index)
    cols = tl.arange(0, BLOCK_V)
    for start in range(0, V, BLOCK_V):
        v = start + cols
        in_row = v < V
        # Read before write, tile by tile: `out` may be the logits' own storage.
        x, _, r = _marginal_tile(x_ptr, rows, shift, v, sx_v, in_k, in_row)
        g = c_p * tl.exp(x - lse[:, None]) + c_1 + c_r * r
        g = tl.where(v[None, :] == y, g + c_y, g)
        tl.store(
            out_ptr + out_rows[:, None] + v[None, :] * so_v,
            g.to(out_ptr.dtype.element_ty),
            mask=in_k[:, None] & in_row[None, :],
        )


@triton.jit
def _token_marginal_kernel(
    x_ptr, a_ptr, lse_ptr, m_ptr,
    K, T, V, sx_b, sx_k, sx_t, sx_v,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)  # b * T + t
    b, t, ks, in_k, rows, lse, shift, stat_idx = _token_rows(
        x_ptr, a_ptr, lse_ptr, pid, K, T, sx_b, sx_k, sx_t, BLOCK_K
    )
    m_row = m_ptr + pid * V  # M is a fresh contiguous [B, T, V]
    cols = tl.arange(0, BLOCK_V)
    for start in range(0, V, BLOCK_V):
        v = start + cols
        in_row = v < V
        _, m, _ = _marginal_tile(x_ptr, rows, shift, v, sx_v, in_k, in_row)
        tl.store(m_row + v, m, mask=in_row)


@triton.jit
def _token_marginal_grad_kernel(
    x_ptr, a_ptr, lse_ptr, g_ptr, c_ptr, out_ptr,
    K, T, V, sx_b, sx_k, sx_t, sx_v, sg_b, sg_t, so_b, so_k, so_t, so_v,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)  # b * T + t
    b, t, ks, in_k, rows, lse, shift, stat_idx = _token_rows(
        x_ptr, a_ptr, lse_ptr, pid, K, T, sx_b, sx_k, sx_t, BLOCK_K
    )
    g_row = g_ptr + b * sg_b + t * sg_t
    cols = tl.arange(0, BLOCK_V)

    # Pass 1: c[k] = sum_v R[k, v] g[v].
    c_acc = tl.zeros([BLOCK_K, BLOCK_V], dtype=tl.float32)
    for start in range(0, V, BLOCK_V):
        v = start + cols
        in_row = v < V
        _, _, r = _marginal_tile(x_ptr, rows, shift, v, sx_v, in_k, in_row)
        g = tl.load(g_row + v, mask=in_row, other=0.0)
        c_acc += r * g[None, :]
    c = tl.sum(c_acc, axis=1)
    tl.store(c_ptr + stat_idx, c, mask=in_k)

    # Pass 2: out = R g - P c, read before write tile by tile.
    out_rows = b * so_b + ks.to(tl.int64) * so_k + t * so_t
    for start in range(0, V, BLOCK_V):
        v = start + cols
        in_row = v < V
        x, _, r = _marginal_tile(x_ptr, rows, shift, v, sx_v, in_k, in_row)
        g = tl.load(g_row + v, mask=in_row, other=0.0)
        grad = r * g[None, :] - tl.exp(x - lse[:, None]) * c[:, None]
        tl.store(
            out_ptr + out_rows[:, None] + v[None, :] * so_v,
            grad.to(out_ptr.dtype.element_ty),
            mask=in_k[:, None] & in_row[None, :],
        )


# ----------------------------------------------------------------------------------------------
# Launchers (the contract of rag_fast/ops/_cpp.py)
# ----------------------------------------------------------------------------------------------


def _max_tile() -> int:
    return _MAX_TILE_INTERPRETER if interpreter_enabled() else _MAX_TILE_GPU


def _row_block(V: int) -> tuple[int, int]:
    """``(BLOCK_V, num_warps)`` for a one-row program."""
    block_v = max(_MIN_BLOCK_V, min(triton.next_power_of_2(V), _max_tile()))
    return block_v, 8 if block_v >= 2048 else 4


def _token_block(K: int, V: int) -> tuple[int, int, int]:
    """``(BLOCK_K, BLOCK_V, num_warps)`` for a program holding the K rows of one (b, t)."""
    block_k = triton.next_power_of_2(K)
    block_v = max(_MIN_BLOCK_V, min(triton.next_power_of_2(V), _max_tile() // block_k))
    return block_k, block_v, 8 if block_k * block_v >= 2048 else 4


def _on_device(x: torch.Tensor):
    """Launch on the logits' GPU (Triton launches on the current device)."""
    return torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()


def _stats(x: torch.Tensor) -> torch.Tensor:
    B, K, T, _ = x.shape
    return torch.empty((B, K, T), dtype=torch.float32, device=x.device)


def _f32(t: torch.Tensor) -> torch.Tensor:
    """A small per-row tensor as contiguous float32 (autograd may hand over expanded ones)."""
    return t.to(torch.float32).contiguous()


def _x_strides(x: torch.Tensor) -> tuple[int, int, int, int]:
    return x.stride(0), x.stride(1), x.stride(2), x.stride(3)


def row_stats(
    x: torch.Tensor, y: torch.Tensor | None, ignore_index: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row ``lse``, ``x_tgt``, ``x_sum``, each ``[B, K, T]`` float32.

    x: ``[B, K, T, V]`` logits; y: ``[B, T]`` integer targets or None (then x_tgt = 0).
    """
    B, K, T, V = x.shape
    lse, x_tgt, x_sum = _stats(x), _stats(x), _stats(x)
    if lse.numel() == 0:
        return lse, x_tgt, x_sum
    y_arg = x if y is None else y.contiguous()  # x: an unread placeholder when HAS_Y is off
    block_v, num_warps = _row_block(V)
    with _on_device(x):
        _row_stats_kernel[(B * K * T,)](
            x, y_arg, lse, x_tgt, x_sum, K, T, V, *_x_strides(x), ignore_index,
            HAS_Y=y is not None, BLOCK_V=block_v, num_warps=num_warps,
        )
    return lse, x_tgt, x_sum


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
    """``out = c_p * exp(x - lse) + c_y * onehot(y) + c_1``; returns ``out``.

    x, out: ``[B, K, T, V]`` (out may be x); lse, c_*: ``[B, K, T]``; y: ``[B, T]`` or None.
    """
    B, K, T, V = x.shape
    if lse.numel() == 0:
        return out
    y_arg = x if y is None else y.contiguous()
    block_v, num_warps = _row_block(V)
    with _on_device(x):
        _row_grad_kernel[(B * K * T,)](
            x, y_arg, _f32(lse), _f32(c_p), _f32(c_y), _f32(c_1), out,
            K, T, V, *_x_strides(x), *_x_strides(out), ignore_index,
            HAS_Y=y is not None, BLOCK_V=block_v, num_warps=num_warps,
        )
    return out


def token_smooth_forward(
    x: torch.Tensor,
    y: torch.Tensor | None,
    ignore_index: int,
    a: torch.Tensor,
    need_rho: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``row_stats`` then ``token_smooth_stats``: ``lse, x_tgt, x_sum, sum_m, rho``.

    x: ``[B, K, T, V]``; y: ``[B, T]`` or None; a: ``[B, K]`` passage log-prior. Two programs
    (a row pass, then a (b, t) pass); the C++ backend fuses them into one read. ``rho`` (only
    the backward needs it) comes back None unless ``need_rho``; the (b, t) program computes it
    with the marginal either way, at no extra read.
    """
    lse, x_tgt, x_sum = row_stats(x, y, ignore_index)
    sum_m, rho = token_smooth_stats(x, a, lse)
    return lse, x_tgt, x_sum, sum_m, rho if need_rho else None


def token_smooth_stats(
    x: torch.Tensor, a: torch.Tensor, lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``sum_m = sum_v M`` ``[B, T]`` and ``rho = sum_v R`` ``[B, K, T]``, float32.

    x: ``[B, K, T, V]``; a: ``[B, K]`` passage log-prior; lse: ``[B, K, T]``.
    """
    B, K, T, V = x.shape
    sum_m = torch.empty((B, T), dtype=torch.float32, device=x.device)
    rho = _stats(x)
    if sum_m.numel() == 0:
        return sum_m, rho
    block_k, block_v, num_warps = _token_block(K, V)
    with _on_device(x):
        _token_smooth_stats_kernel[(B * T,)](
            x, _f32(a), _f32(lse), sum_m, rho, K, T, V, *_x_strides(x),
            BLOCK_K=block_k, BLOCK_V=block_v, num_warps=num_warps,
        )
    return sum_m, rho


def token_smooth_grad(
    x: torch.Tensor,
    y: torch.Tensor,
    ignore_index: int,
    a: torch.Tensor,
    lse: torch.Tensor,
    c_p: torch.Tensor,
    c_y: torch.Tensor,
    c_1: torch.Tensor,
    c_r: torch.Tensor,
    out: torch.Tensor,
) -> torch.Tensor:
    """``out = c_p * P + c_y * onehot(y) + c_1 + c_r[b, t] * R``; returns ``out``.

    x, out: ``[B, K, T, V]`` (out may be x); y: ``[B, T]``; a: ``[B, K]``;
    lse, c_p, c_y, c_1: ``[B, K, T]``; c_r: ``[B, T]``.
    """
    B, K, T, V = x.shape
    if B * T == 0:
        return out
    block_k, block_v, num_warps = _token_block(K, V)
    with _on_device(x):
        _token_smooth_grad_kernel[(B * T,)](
            x, y.contiguous(), _f32(a), _f32(lse), _f32(c_p), _f32(c_y), _f32(c_1), _f32(c_r),
            out, K, T, V, *_x_strides(x), *_x_strides(out), ignore_index,
            BLOCK_K=block_k, BLOCK_V=block_v, num_warps=num_warps,
        )
    return out


def token_marginal(x: torch.Tensor, a: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """``M = logsumexp_k (a + x - lse)``, ``[B, T, V]`` float32 (contiguous).

    x: ``[B, K, T, V]``; a: ``[B, K]``; lse: ``[B, K, T]``.
    """
    B, K, T, V = x.shape
    marginal = torch.empty((B, T, V), dtype=torch.float32, device=x.device)
    if B * T == 0:
        return marginal
    block_k, block_v, num_warps = _token_block(K, V)
    with _on_device(x):
        _token_marginal_kernel[(B * T,)](
            x, _f32(a), _f32(lse), marginal, K, T, V, *_x_strides(x),
            BLOCK_K=block_k, BLOCK_V=block_v, num_warps=num_warps,
        )
    return marginal


def token_marginal_grad(
    x: torch.Tensor,
    a: torch.Tensor,
    lse: torch.Tensor,
    m: torch.Tensor,
    g_m: torch.Tensor,
    out: torch.Tensor,
) -> torch.Tensor:
    """Backward of :func:`token_marginal`: writes ``out = R * g_m - P * c``, returns
    ``c = sum_v R * g_m`` ``[B, K, T]`` float32.

    x, out: ``[B, K, T, V]`` (out may be x); a: ``[B, K]``; lse: ``[B, K, T]``;
    m, g_m: ``[B, T, V]``. ``m`` (the forward's M) is not read: R is recomputed from the K
    rows already in the tile, which costs less memory traffic than reading M twice.
    """
    del m
    B, K, T, V = x.shape
    c = _stats(x)
    if B * T == 0:
        return c
    g = g_m.float()
    if g.stride(-1) != 1:
        g = g.contiguous()
    block_k, block_v, num_warps = _token_block(K, V)
    with _on_device(x):
        _token_marginal_grad_kernel[(B * T,)](
            x, _f32(a), _f32(lse), g, c, out, K, T, V, *_x_strides(x),
            g.stride(0), g.stride(1), *_x_strides(out),
            BLOCK_K=block_k, BLOCK_V=block_v, num_warps=num_warps,
        )
    return c
