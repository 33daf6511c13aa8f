# Triton kernels for the fused RAG losses (the GPU backend of rag_fast.ops; its contract is the
# docstring of rag_fast/ops/rag_losses.py; docs/design.md, "Gradients", derives the math).
#
# What they compute, for logits x [B, K, T, V] (stride 1 along V), passage log-prior a [B, K]:
#   row_stats            L = logsumexp_v x, x[y], sum_v x            programs: rows x splits
#   row_grad             c_p * P + c_y * onehot(y) + c_1             programs: rows x splits
#   token_smooth_forward row_stats, then token_smooth_stats            (launcher only)
#   token_smooth_stats   sum_v M and rho = sum_v R                   programs: (b, t) x splits
#   token_smooth_grad    row_grad's terms + c_r[b, t] * R            programs: (b, t) x splits
#   token_marginal       M = logsumexp_k (a + x - L)                 programs: (b, t) x splits
#   token_marginal_grad  c = sum_v R g, then R g - P c               programs: (b, t) x splits
# with P = exp(x - L) and R = exp(a + x - L - M) (token_marginal_grad: M from the forward).
# L is float64 between the kernels (the row max plus the log of a sum, never rounded at the
# logits' size); a kernel gets it as two float32 per row, L = hi + lo (split_lse), and forms
# x - L as (x - hi) - lo and a + x - L as (x - hi) + (a - lo), whose first step is exact near
# the row's top: P keeps float32's relative precision (1 - P near P = 1 then carries only the
# rounding of P itself, as in plain PyTorch).
#
# Trade-off: a program streams one vocabulary chunk of its row (or of the K rows of its (b, t))
# through BLOCK_V-wide tiles with an online max/sum-of-exp, so the forward statistics cost one
# read of the logits and the gradient one read and one write. The vocabulary is split into as
# many chunks as it takes to give the GPU about _PROGRAMS_PER_SM programs per multiprocessor
# (T = 1 in generation, small batches); per-chunk partial results (a logsumexp, sums) are then
# combined by a small reduction over the chunks, the second pass of a two-pass max/sum-of-exp.
# The (b, t) programs loop over the K passages (an online logsumexp over k per tile, then a
# second sweep over k, from cache, for R and the gradient): no row is padded, whatever K is.
# Tile sizes and warps are autotuned on a GPU (keyed on the chunk length); the interpreter
# uses a fixed tile for the chunk length. Everything accumulates in float32; nothing allocates a
# [B, K, T, V] temporary; no launcher reads a tensor value on the host; offsets are int64.
#
# Edge cases: a missing passage (a = -inf) gets R = 0 and no NaN; a position where every
# a + x - L is -inf has M = -inf and R = 0; NaN logits propagate as NaN.
from __future__ import annotations

import contextlib
import functools

import torch
import triton
import triton.language as tl

from rag_fast.kernels import interpreter_enabled

# GPU: programs per multiprocessor the vocabulary split aims for, and the shortest chunk worth
# a program of its own. Interpreter: a small tile, and few programs, so that the tests' tiny
# shapes still cover several tiles, ragged tails and split rows (V = 70: two chunks of 35);
# long chunks get a wider tile (interpreter_block).
_PROGRAMS_PER_SM = 4
_MIN_CHUNK_GPU = 256
_GPU_CONFIGS = [
    triton.Config({"BLOCK_V": block_v}, num_warps=warps)
    for block_v, warps in ((512, 4), (1024, 4), (1024, 8), (2048, 4), (2048, 8), (4096, 8))
]
_INTERPRETER_BLOCK_V, _INTERPRETER_BLOCK_V_MAX = 32, 1024
_INTERPRETER_PROGRAMS = 8
_MIN_CHUNK_INTERPRETER = 16


def with_tuned_restore(*restore: str):
    """Autotune a kernel's BLOCK_V and warps on a GPU (keyed on CHUNK); under the interpreter
    the kernel is left as is and :func:`launch_chunked` gives it the interpreter's tile.
    ``restore`` names outputs the tuning runs must put back (a gradient written over the
    logits)."""

    def wrap(kernel):
        if interpreter_enabled():
            return kernel
        return triton.autotune(configs=_GPU_CONFIGS, key=["CHUNK"],
                               restore_value=list(restore) or None)(kernel)

    return wrap


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
def tile_marginal(x_row0, sx_k, hi_row0, shift_row0, shift_sk, K, v_off, in_row,
                  BLOCK_V: tl.constexpr):
    """M [BLOCK_V] = logsumexp_k ((x_k - hi_k) + shift_k) at the tile's columns, an online
    logsumexp over the K passages. x_row0: the passage-0 row of the tile's (b, t); row k is at
    + k * sx_k, its hi and shift (a - lo, -inf for a missing passage: _hi_shift) at
    hi_row0 / shift_row0 + k * shift_sk; v_off: the columns' element offsets. M = -inf where
    every term is -inf; NaN in gives NaN out."""
    run_max = tl.full([BLOCK_V], float("-inf"), tl.float32)
    run_sum = tl.zeros([BLOCK_V], tl.float32)
    x_row = x_row0  # advanced by a pointer increment, never by an int32 product k * sx_k
    for k in range(0, K):
        shift = tl.load(shift_row0 + k * shift_sk)
        hi = tl.load(hi_row0 + k * shift_sk)
        x = tl.load(x_row + v_off, mask=in_row, other=float("-inf")).to(tl.float32)
        x_row += sx_k
        z = (x - hi) + shift
        new_max = tl.maximum(run_max, z)
        # All -inf so far: shift by 0 instead of -inf so that exp gives 0, not NaN.
        safe = tl.where(new_max == float("-inf"), 0.0, new_max)
        run_sum = run_sum * tl.exp(run_max - safe) + tl.exp(z - safe)
        run_max = new_max
    empty = run_sum == 0.0
    safe = tl.where(run_max == float("-inf"), 0.0, run_max)
    return tl.where(empty, float("-inf"), safe + tl.log(tl.where(empty, 1.0, run_sum)))


@triton.jit
def _posterior(z, m):
    """R = exp(z - M); where M = -inf every z is -inf too, and R = exp(-inf - 0) = 0."""
    return tl.exp(z - tl.where(m == float("-inf"), 0.0, m))


@triton.jit
def _chunk(split, CHUNK, V):
    """[lo, hi): the vocabulary chunk of program column ``split``."""
    lo = split * CHUNK
    return lo, tl.minimum(lo + CHUNK, V)


@with_tuned_restore()
@triton.jit
def _row_stats_kernel(
    x_ptr, y_ptr, lse_ptr, tgt_ptr, sum_ptr,
    K, T, V, CHUNK, sx_b, sx_k, sx_t, sx_v, ignore_index,
    HAS_Y: tl.constexpr, BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # (b * K + k) * T + t
    split = tl.program_id(1).to(tl.int64)
    n_split = tl.num_programs(1)
    t = row % T
    b = row // T // K
    k = row // T % K
    x_row = x_ptr + b * sx_b + k * sx_k + t * sx_t
    lo, hi = _chunk(split, CHUNK, V)
    cols = tl.arange(0, BLOCK_V)

    run_max = float("-inf")
    run_sum = 0.0
    x_acc = tl.zeros([BLOCK_V], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_V):
        v = start + cols
        in_row = v < hi
        x = tl.load(x_row + v * sx_v, mask=in_row, other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(run_max, tl.max(x, axis=0))
        # All -inf so far: shift by 0 instead of -inf so that exp gives 0, not NaN.
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        run_sum = run_sum * tl.exp(run_max - shift) + tl.sum(tl.exp(x - shift), axis=0)
        run_max = new_max
        x_acc += tl.where(in_row, x, 0.0)
    shift = tl.where(run_max == float("-inf"), 0.0, run_max)
    # Partial results of this chunk, [rows, n_split]; the launcher combines the chunks. The
    # lse in float64: the max plus the log of the sum, not rounded at the logits' size.
    tl.store(lse_ptr + row * n_split + split,
             shift.to(tl.float64) + tl.log(run_sum.to(tl.float64)))
    tl.store(sum_ptr + row * n_split + split, tl.sum(x_acc, axis=0))
    if split == 0:
        x_tgt = 0.0
        if HAS_Y:
            y = _load_target(y_ptr, b, t, T, V, ignore_index)
            x_tgt = tl.load(x_row + tl.maximum(y, 0) * sx_v, mask=y >= 0, other=0.0)
            x_tgt = x_tgt.to(tl.float32)
        tl.store(tgt_ptr + row, x_tgt)


@with_tuned_restore("out_ptr")
@triton.jit
def _row_grad_kernel(
    x_ptr, y_ptr, hi_ptr, lo_ptr, cp_ptr, cy_ptr, c1_ptr, out_ptr,
    K, T, V, CHUNK, sx_b, sx_k, sx_t, sx_v, so_b, so_k, so_t, so_v, ignore_index,
    HAS_Y: tl.constexpr, BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # (b * K + k) * T + t
    split = tl.program_id(1).to(tl.int64)
    t = row % T
    b = row // T // K
    k = row // T % K
    x_row = x_ptr + b * sx_b + k * sx_k + t * sx_t
    out_row = out_ptr + b * so_b + k * so_k + t * so_t
    l_hi = tl.load(hi_ptr + row)
    l_lo = tl.load(lo_ptr + row)
    c_p = tl.load(cp_ptr + row)
    c_y = tl.load(cy_ptr + row)
    c_1 = tl.load(c1_ptr + row)
    y = -1
    if HAS_Y:
        y = _load_target(y_ptr, b, t, T, V, ignore_index)
    lo, hi = _chunk(split, CHUNK, V)
    cols = tl.arange(0, BLOCK_V)
    for start in range(lo, hi, BLOCK_V):
        v = start + cols
        in_row = v < hi
        # Read before write, tile by tile: `out` may be the logits' own storage.
        x = tl.load(x_row + v * sx_v, mask=in_row, other=0.0).to(tl.float32)
        g = c_p * tl.exp((x - l_hi) - l_lo) + c_1
        g = tl.where(v == y, g + c_y, g)
        tl.store(out_row + v * so_v, g.to(out_ptr.dtype.element_ty), mask=in_row)


@with_tuned_restore()
@triton.jit
def _token_smooth_stats_kernel(
    x_ptr, hi_ptr, shift_ptr, sum_m_ptr, rho_ptr,
    K, T, V, CHUNK, sx_b, sx_k, sx_t, sx_v,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)  # b * T + t
    split = tl.program_id(1).to(tl.int64)
    n_split = tl.num_programs(1)
    t = pid % T
    b = pid // T
    x_row0 = x_ptr + b * sx_b + t * sx_t
    shift_row0 = shift_ptr + b * K * T + t  # shift [B, K, T]: row k at + k * T
    hi_row0 = hi_ptr + b * K * T + t  # hi likewise
    ks = tl.arange(0, BLOCK_K)  # only indexes the K per-passage sums, never a tile
    lo, hi = _chunk(split, CHUNK, V)
    cols = tl.arange(0, BLOCK_V)
    m_acc = tl.zeros([BLOCK_V], dtype=tl.float32)
    rho = tl.zeros([BLOCK_K], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_V):
        v = start + cols
        in_row = v < hi
        m = tile_marginal(x_row0, sx_k, hi_row0, shift_row0, T, K, v * sx_v, in_row, BLOCK_V)
        m_acc += tl.where(in_row, m, 0.0)
        x_row = x_row0
        for k in range(0, K):  # the tile's K rows again, from cache
            x = tl.load(x_row + v * sx_v, mask=in_row, other=float("-inf")).to(tl.float32)
            z = (x - tl.load(hi_row0 + k * T)) + tl.load(shift_row0 + k * T)
            r = _posterior(z, m)
            rho = tl.where(ks == k, rho + tl.sum(r, axis=0), rho)
            x_row += sx_k
    # Partial results of this chunk: sum_m [B*T, n_split], rho [B*K*T, n_split].
    tl.store(sum_m_ptr + pid * n_split + split, tl.sum(m_acc, axis=0))
    rows = (b * K + ks) * T + t
    tl.store(rho_ptr + rows * n_split + split, rho, mask=ks < K)


@with_tuned_restore("out_ptr")
@triton.jit
def _token_smooth_grad_kernel(
    x_ptr, y_ptr, hi_ptr, lo_ptr, shift_ptr, cp_ptr, cy_ptr, c1_ptr, cr_ptr, out_ptr,
    K, T, V, CHUNK, sx_b, sx_k, sx_t, sx_v, so_b, so_k, so_t, so_v, ignore_index,
    BLOCK_V: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)  # b * T + t
    split = tl.program_id(1).to(tl.int64)
    t = pid % T
    b = pid // T
    x_row0 = x_ptr + b * sx_b + t * sx_t
    out_row0 = out_ptr + b * so_b + t * so_t
    shift_row0 = shift_ptr + b * K * T + t
    hi_row0 = hi_ptr + b * K * T + t
    c_r = tl.load(cr_ptr + pid)
    y = _load_target(y_ptr, b, t, T, V, ignore_index)
    lo, hi = _chunk(split, CHUNK, V)
    cols = tl.arange(0, BLOCK_V)
    for start in range(lo, hi, BLOCK_V):
        v = start + cols
        in_row = v < hi
        # The tile's K rows are all read (for M) before any of them is written: `out` may be
        # the logits' own storage.
        m = tile_marginal(x_row0, sx_k, hi_row0, shift_row0, T, K, v * sx_v, in_row, BLOCK_V)
        x_row, out_row = x_row0, out_row0
        for k in range(0, K):
            row = (b * K + k) * T + t
            x = tl.load(x_row + v * sx_v, mask=in_row, other=0.0).to(tl.float32)
            xh = x - tl.load(hi_ptr + row)
            r = _posterior(xh + tl.load(shift_ptr + row), m)
            g = (tl.load(cp_ptr + row) * tl.exp(xh - tl.load(lo_ptr + row))
                 + tl.load(c1_ptr + row) + c_r * r)
            g = tl.where(v == y, g + tl.load(cy_ptr + row), g)
            tl.store(out_row + v * so_v, g.to(out_ptr.dtype.element_ty), mask=in_row)
            x_row += sx_k
            out_row += so_k


@with_tuned_restore()
@triton.jit
def _token_marginal_kernel(
    x_ptr, hi_ptr, shift_ptr, m_ptr,
    K, T, V, CHUNK, sx_b, sx_k, sx_t, sx_v,
    BLOCK_V: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)  # b * T + t
    split = tl.program_id(1).to(tl.int64)
    t = pid % T
    b = pid // T
    x_row0 = x_ptr + b * sx_b + t * sx_t
    shift_row0 = shift_ptr + b * K * T + t
    hi_row0 = hi_ptr + b * K * T + t
    m_row = m_ptr + pid * V  # M is a fresh contiguous [B, T, V]
    lo, hi = _chunk(split, CHUNK, V)
    cols = tl.arange(0, BLOCK_V)
    for start in range(lo, hi, BLOCK_V):
        v = start + cols
        in_row = v < hi
        m = tile_marginal(x_row0, sx_k, hi_row0, shift_row0, T, K, v * sx_v, in_row, BLOCK_V)
        tl.store(m_row + v, m, mask=in_row)


@with_tuned_restore("out_ptr")
@triton.jit
def _token_marginal_grad_kernel(
    x_ptr, hi_ptr, lo_ptr, shift_ptr, m_ptr, g_ptr, c_ptr, out_ptr,
    K, T, V, CHUNK, sx_b, sx_k, sx_t, sx_v, sm_b, sm_t, sg_b, sg_t, so_b, so_k, so_t, so_v,
    WRITE_GRAD: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """Pass 1 (WRITE_GRAD off): partial c[k] = sum_v R[k, v] g[v] of this chunk into
    c [B*K*T, n_split]. Pass 2 (on): out = R g - P c with the combined c [B*K*T]. R comes from
    the forward's M (one read of M instead of a logsumexp over the K rows)."""
    pid = tl.program_id(0).to(tl.int64)  # b * T + t
    split = tl.program_id(1).to(tl.int64)
    n_split = tl.num_programs(1)
    t = pid % T
    b = pid // T
    x_row0 = x_ptr + b * sx_b + t * sx_t
    out_row0 = out_ptr + b * so_b + t * so_t
    m_row = m_ptr + b * sm_b + t * sm_t
    g_row = g_ptr + b * sg_b + t * sg_t
    ks = tl.arange(0, BLOCK_K)  # only indexes the K per-passage sums, never a tile
    c_acc = tl.zeros([BLOCK_K], dtype=tl.float32)
    lo, hi = _chunk(split, CHUNK, V)
    cols = tl.arange(0, BLOCK_V)
    for start in range(lo, hi, BLOCK_V):
        v = start + cols
        in_row = v < hi
        m = tl.load(m_row + v, mask=in_row, other=float("-inf"))
        g = tl.load(g_row + v, mask=in_row, other=0.0)
        x_row, out_row = x_row0, out_row0
        for k in range(0, K):
            row = (b * K + k) * T + t
            x = tl.load(x_row + v * sx_v, mask=in_row, other=float("-inf")).to(tl.float32)
            xh = x - tl.load(hi_ptr + row)
            rg = _posterior(xh + tl.load(shift_ptr + row), m) * g
            if WRITE_GRAD:
                grad = rg - tl.exp(xh - tl.load(lo_ptr + row)) * tl.load(c_ptr + row)
                tl.store(out_row + v * so_v, grad.to(out_ptr.dtype.element_ty), mask=in_row)
            else:
                c_acc = tl.where(ks == k, c_acc + tl.sum(rg, axis=0), c_acc)
            x_row += sx_k
            out_row += so_k
    if not WRITE_GRAD:
        rows = (b * K + ks) * T + t
        tl.store(c_ptr + rows * n_split + split, c_acc, mask=ks < K)


# ----------------------------------------------------------------------------------------------
# Launchers (the contract of rag_fast/ops/rag_losses.py)
# ----------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _target_programs(device: torch.device) -> int:
    if device.type != "cuda":
        return _INTERPRETER_PROGRAMS
    return _PROGRAMS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count


def split_vocabulary(groups: int, V: int, device: torch.device) -> int:
    """How many chunks to split each of ``groups`` rows (or (b, t) positions) of length ``V``
    into: the power of two that gives the device enough programs (so that the autotuner, keyed
    on the chunk length, sees few distinct lengths), unless chunks would get shorter than the
    minimum."""
    min_chunk = _MIN_CHUNK_INTERPRETER if interpreter_enabled() else _MIN_CHUNK_GPU
    wanted = triton.next_power_of_2(triton.cdiv(_target_programs(device), max(groups, 1)))
    return max(1, min(wanted, V // min_chunk))


def _grid(groups: int, V: int, device: torch.device, num_splits: int | None):
    """``(grid, CHUNK)`` for ``groups`` programs' rows of V entries split into chunks."""
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"num_splits must be None or >= 1, got {num_splits}")
    n_split = min(num_splits or split_vocabulary(groups, V, device), max(V, 1))
    chunk = triton.cdiv(V, n_split)
    return (groups, triton.cdiv(V, chunk)), chunk


def interpreter_block(chunk: int) -> int:
    """The interpreter's tile for rows (chunks) of ``chunk`` entries: :data:`_INTERPRETER_BLOCK_V`
    up to chunks of 8 such tiles, so that small test shapes cover several tiles and ragged
    tails; then about an eighth of the chunk (a power of two, at most 1024), so that a chunk of
    a real vocabulary is still several tiles with a ragged tail but the interpreter, whose cost
    is per tile, does not run thousands of them (BART's 50265 split in 8: 7 tiles of 1024)."""
    eighth = triton.next_power_of_2(triton.cdiv(max(chunk, 1), 8))
    return max(_INTERPRETER_BLOCK_V, min(_INTERPRETER_BLOCK_V_MAX, eighth))


def launch_chunked(kernel, grid, *args, chunk: int, **meta) -> None:
    """Launch on the first tensor argument's GPU (Triton launches on the current device); the
    interpreter gets its tile for ``chunk`` (:func:`interpreter_block`), a GPU the autotuned
    one."""
    device = args[0].device
    if interpreter_enabled():
        meta["BLOCK_V"] = interpreter_block(chunk)
    guard = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
    with guard:
        kernel[grid](*args, **meta)


def _stats(x: torch.Tensor, *extra: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    B, K, T, _ = x.shape
    return torch.empty((B, K, T, *extra), dtype=dtype, device=x.device)


def _f32(t: torch.Tensor) -> torch.Tensor:
    """A small per-row tensor as contiguous float32 (autograd may hand over expanded ones)."""
    return t.to(torch.float32).contiguous()


def split_lse(lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``lse`` (float64) as ``hi + lo``, two float32 tensors of its shape, contiguous. A row
    whose lse is not finite gets ``hi = 0, lo = lse``: the kernels' formulas then give what
    they give with ``x - lse`` itself."""
    lse = lse.to(torch.float64)
    hi = lse.to(torch.float32)
    finite = torch.isfinite(hi)
    lo = torch.where(finite, lse - hi.to(torch.float64), lse).to(torch.float32)
    return torch.where(finite, hi, 0.0).contiguous(), lo.contiguous()


def _hi_shift(a: torch.Tensor, lse: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``hi, lo`` of ``lse [B, K, T]`` and ``shift = a - lo`` ``[B, K, T]`` (float32,
    contiguous): passage k's log-weight ``a + x - lse`` is ``(x - hi) + shift``; -inf for a
    missing passage (a = -inf)."""
    hi, lo = split_lse(lse)
    shift = (a.to(torch.float64)[:, :, None] - lo.to(torch.float64)).to(torch.float32)
    return hi, lo, shift.contiguous()


def _x_strides(x: torch.Tensor) -> tuple[int, int, int, int]:
    return x.stride(0), x.stride(1), x.stride(2), x.stride(3)


def row_stats(
    x: torch.Tensor, y: torch.Tensor | None, ignore_index: int, *, num_splits: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row ``lse`` (float64), ``x_tgt``, ``x_sum`` (float32), each ``[B, K, T]``.

    x: ``[B, K, T, V]`` logits; y: ``[B, T]`` integer targets or None (then x_tgt = 0).
    num_splits: vocabulary chunks per row (default: enough to fill the device).
    """
    B, K, T, V = x.shape
    x_tgt = _stats(x)
    if x_tgt.numel() == 0 or V == 0:
        lse = _stats(x, dtype=torch.float64).fill_(float("-inf"))
        return lse, x_tgt.zero_(), _stats(x).zero_()
    grid, chunk = _grid(B * K * T, V, x.device, num_splits)
    lse_part, sum_part = _stats(x, grid[1], dtype=torch.float64), _stats(x, grid[1])
    y_arg = x if y is None else y.contiguous()  # x: an unread placeholder when HAS_Y is off
    launch_chunked(_row_stats_kernel, grid, x, y_arg, lse_part, x_tgt, sum_part,
            K, T, V, chunk, *_x_strides(x), ignore_index, HAS_Y=y is not None, chunk=chunk)
    if grid[1] == 1:
        return lse_part[..., 0], x_tgt, sum_part[..., 0]
    return torch.logsumexp(lse_part, -1), x_tgt, sum_part.sum(-1)


def row_grad(
    x: torch.Tensor,
    y: torch.Tensor | None,
    ignore_index: int,
    lse: torch.Tensor,
    c_p: torch.Tensor,
    c_y: torch.Tensor,
    c_1: torch.Tensor,
    out: torch.Tensor,
    *,
    num_splits: int | None = None,
) -> torch.Tensor:
    """``out = c_p * exp(x - lse) + c_y * onehot(y) + c_1``; returns ``out``.

    x, out: ``[B, K, T, V]`` (out may be x); lse, c_*: ``[B, K, T]``; y: ``[B, T]`` or None.
    """
    B, K, T, V = x.shape
    if lse.numel() == 0 or V == 0:
        return out
    grid, chunk = _grid(B * K * T, V, x.device, num_splits)
    y_arg = x if y is None else y.contiguous()
    hi, lo = split_lse(lse)
    launch_chunked(_row_grad_kernel, grid, x, y_arg, hi, lo, _f32(c_p), _f32(c_y), _f32(c_1), out,
            K, T, V, chunk, *_x_strides(x), *_x_strides(out), ignore_index,
            HAS_Y=y is not None, chunk=chunk)
    return out


def token_smooth_forward(
    x: torch.Tensor,
    y: torch.Tensor | None,
    ignore_index: int,
    a: torch.Tensor,
    need_rho: bool = True,
    *,
    num_splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``row_stats`` then ``token_smooth_stats``: ``lse, x_tgt, x_sum, sum_m, rho``.

    x: ``[B, K, T, V]``; y: ``[B, T]`` or None; a: ``[B, K]`` passage log-prior. Two passes
    (rows, then (b, t) positions); the C++ backend fuses them into one read. ``rho`` (only
    the backward needs it) comes back None unless ``need_rho``; the (b, t) program computes it
    with the marginal either way, at no extra read.
    """
    lse, x_tgt, x_sum = row_stats(x, y, ignore_index, num_splits=num_splits)
    sum_m, rho = token_smooth_stats(x, a, lse, num_splits=num_splits)
    return lse, x_tgt, x_sum, sum_m, rho if need_rho else None


def token_smooth_stats(
    x: torch.Tensor, a: torch.Tensor, lse: torch.Tensor, *, num_splits: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``sum_m = sum_v M`` ``[B, T]`` and ``rho = sum_v R`` ``[B, K, T]``, float32.

    x: ``[B, K, T, V]``; a: ``[B, K]`` passage log-prior; lse: ``[B, K, T]``.
    """
    B, K, T, V = x.shape
    if B * T == 0 or V == 0:
        return torch.zeros((B, T), dtype=torch.float32, device=x.device), _stats(x).zero_()
    grid, chunk = _grid(B * T, V, x.device, num_splits)
    sum_m = torch.empty((B, T, grid[1]), dtype=torch.float32, device=x.device)
    rho = _stats(x, grid[1])
    hi, _, shift = _hi_shift(a, lse)
    launch_chunked(_token_smooth_stats_kernel, grid, x, hi, shift, sum_m, rho,
            K, T, V, chunk, *_x_strides(x), BLOCK_K=triton.next_power_of_2(K), chunk=chunk)
    return sum_m.sum(-1), rho.sum(-1)


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
    *,
    num_splits: int | None = None,
) -> torch.Tensor:
    """``out = c_p * P + c_y * onehot(y) + c_1 + c_r[b, t] * R``; returns ``out``.

    x, out: ``[B, K, T, V]`` (out may be x); y: ``[B, T]``; a: ``[B, K]``;
    lse, c_p, c_y, c_1: ``[B, K, T]``; c_r: ``[B, T]``.
    """
    B, K, T, V = x.shape
    if B * T == 0 or V == 0:
        return out
    grid, chunk = _grid(B * T, V, x.device, num_splits)
    hi, lo, shift = _hi_shift(a, lse)
    launch_chunked(_token_smooth_grad_kernel, grid, x, y.contiguous(), hi, lo, shift, _f32(c_p), _f32(c_y), _f32(c_1), _f32(c_r), out,
            K, T, V, chunk, *_x_strides(x), *_x_strides(out), ignore_index, chunk=chunk)
    return out


def token_marginal(
    x: torch.Tensor, a: torch.Tensor, lse: torch.Tensor, *, num_splits: int | None = None
) -> torch.Tensor:
    """``M = logsumexp_k (a + x - lse)``, ``[B, T, V]`` float32 (contiguous).

    x: ``[B, K, T, V]``; a: ``[B, K]``; lse: ``[B, K, T]``.
    """
    B, K, T, V = x.shape
    marginal = torch.empty((B, T, V), dtype=torch.float32, device=x.device)
    if marginal.numel() == 0:
        return marginal
    grid, chunk = _grid(B * T, V, x.device, num_splits)
    hi, _, shift = _hi_shift(a, lse)
    launch_chunked(_token_marginal_kernel, grid, x, hi, shift, marginal,
            K, T, V, chunk, *_x_strides(x), chunk=chunk)
    return marginal


def token_marginal_grad(
    x: torch.Tensor,
    a: torch.Tensor,
    lse: torch.Tensor,
    m: torch.Tensor,
    g_m: torch.Tensor,
    out: torch.Tensor,
    *,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Backward of :func:`token_marginal`: writes ``out = R * g_m - P * c``, returns
    ``c = sum_v R * g_m`` ``[B, K, T]`` float32.

    x, out: ``[B, K, T, V]`` (out may be x); a: ``[B, K]``; lse: ``[B, K, T]``;
    m (the forward's M), g_m: ``[B, T, V]``. Two passes over the vocabulary: c needs every
    entry before the first gradient entry can be written.
    """
    B, K, T, V = x.shape
    if B * T == 0 or V == 0:
        return _stats(x).zero_()
    m, g = (t.float() if t.stride(-1) == 1 else t.float().contiguous() for t in (m, g_m))
    grid, chunk = _grid(B * T, V, x.device, num_splits)
    hi, lo, shift = _hi_shift(a, lse)
    c_part = _stats(x, grid[1])
    args = (K, T, V, chunk, *_x_strides(x), m.stride(0), m.stride(1), g.stride(0), g.stride(1))
    block_k = triton.next_power_of_2(K)
    launch_chunked(_token_marginal_grad_kernel, grid, x, hi, lo, shift, m, g, c_part, out, *args,
            *_x_strides(out), WRITE_GRAD=False, BLOCK_K=block_k, chunk=chunk)
    c = c_part.sum(-1)
    launch_chunked(_token_marginal_grad_kernel, grid, x, hi, lo, shift, m, g, c, out, *args,
            *_x_strides(out), WRITE_GRAD=True, BLOCK_K=block_k, chunk=chunk)
    return c
