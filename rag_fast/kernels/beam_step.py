"""Triton kernels of the fused RAG-Token beam step (see rag_fast/ops/rag_token_beam_step.py).

Trade-off: the GPU version reads the logits twice (row normalisers with the loss kernels'
``row_stats``, whose vocabulary split fills the GPU at T = 1; then the marginal over the K
passages of each (b, j), an online logsumexp over k tile by tile) and writes one float32
candidate score per (b, j, v), K times smaller than the logits; the top-n selection is a
stable sort of those scores, which gives the documented tie order (lower flat index first)
without a custom in-kernel top-k. Offsets are int64 (B*W*K*V may exceed 2^31); tiles are
autotuned on a GPU, set by the chunk length under the interpreter.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from rag_fast.kernels.rag_losses import (launch_chunked, row_stats, split_lse, tile_marginal,
                                         with_tuned_restore)
from rag_fast._topk import select_top


@with_tuned_restore()
@triton.jit
def _candidates_kernel(
    x_ptr, hi_ptr, shift_ptr, beam_ptr, bias_ptr, out_ptr, W, K, V, CHUNK, sb, sw, sk,
    HAS_BIAS: tl.constexpr, BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # b * W + j
    tile = tl.program_id(1).to(tl.int64)
    j = row % W
    b = row // W
    lo = tile * CHUNK
    hi = tl.minimum(lo + CHUNK, V)
    cols = tl.arange(0, BLOCK_V)
    beam = tl.load(beam_ptr + row)
    for start in range(lo, hi, BLOCK_V):
        v = start + cols
        valid = v < hi
        # hi, shift [B, W, K]: a + x - L = (x - hi) + shift, shift = -inf for a missing
        # passage (whatever L is).
        marginal = tile_marginal(x_ptr + b * sb + j * sw, sk, hi_ptr + row * K,
                                 shift_ptr + row * K, 1, K, v, valid, BLOCK_V)
        if HAS_BIAS:
            marginal = marginal + tl.load(bias_ptr + row * V + v, mask=valid, other=0.0)
        tl.store(out_ptr + row * V + v, marginal + beam, mask=valid)


def beam_step(
    x: torch.Tensor,
    a: torch.Tensor,
    beam_scores: torch.Tensor,
    bias: torch.Tensor | None,
    n: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launcher: ``x [B, W, K, V]`` (stride 1 along V), ``a [B, K]``, ``beam_scores [B, W]``,
    ``bias [B*W, V]`` or None (all float32 contiguous but x) -> top-n (scores, beams, tokens)."""
    B, W, K, V = x.shape
    # [B, W, K, V] read as the losses' [B, K', T', V] with K' = W, T' = K: lse [B, W, K].
    lse, _, _ = row_stats(x, None, 0)
    hi, lo = split_lse(lse)
    a3 = a[:, None, :]
    # A missing passage (a = -inf) is skipped even where its row is all -inf (L = -inf).
    shift = torch.where(a3 == float("-inf"), a3, (a3.double() - lo.double()).float())
    cand = torch.empty((B * W, V), dtype=torch.float32, device=x.device)
    chunk = min(V, 8192)  # (b, j) x chunks: enough programs at any batch size
    grid = (B * W, triton.cdiv(V, chunk))
    launch_chunked(_candidates_kernel, grid, x, hi, shift.contiguous(), beam_scores,
                   bias if bias is not None else cand, cand, W, K, V, chunk, x.stride(0),
                   x.stride(1), x.stride(2), HAS_BIAS=bias is not None, chunk=chunk)
    scores, flat = select_top(cand.view(B, W * V), n)
    return scores, flat // V, flat % V
