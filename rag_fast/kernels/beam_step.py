"""Triton kernels of the fused RAG-Token beam step (see rag_fast/ops/rag_token_beam_step.py).

Trade-off: the GPU version reads the logits twice (row normalisers, then the marginal over the
K passages of each (b, j) tile by tile) and writes one float32 candidate score per (b, j, v),
K times smaller than the logits; the top-n selection is a stable sort of those scores, which
gives the documented tie order (lower flat index first) without a custom in-kernel top-k.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from rag_fast.reference_decoding import select_top


@triton.jit
def _row_lse_kernel(x_ptr, lse_ptr, W, K, V, sb, sw, sk, BLOCK_V: tl.constexpr):
    row = tl.program_id(0)  # (b*W + j)*K + k
    k = row % K
    bj = row // K
    j = bj % W
    b = bj // W
    base = x_ptr + b * sb + j * sw + k * sk
    offs = tl.arange(0, BLOCK_V)
    m = tl.full([BLOCK_V], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK_V], tl.float32)
    for start in range(0, V, BLOCK_V):
        x = tl.load(base + start + offs, mask=start + offs < V, other=float("-inf")).to(tl.float32)
        nm = tl.maximum(m, x)
        safe = tl.where(nm == float("-inf"), 0.0, nm)
        s = s * tl.exp(m - safe) + tl.exp(x - safe)
        m = nm
    gm = tl.max(m, axis=0)
    gsafe = tl.where(gm == float("-inf"), 0.0, gm)
    total = tl.sum(s * tl.exp(m - gsafe), axis=0)
    total = tl.where(gm == float("-inf"), 1.0, total)  # keeps log() away from 0
    tl.store(lse_ptr + row, tl.where(gm == float("-inf"), gm, gm + tl.log(total)))


@triton.jit
def _candidates_kernel(
    x_ptr, lse_ptr, a_ptr, beam_ptr, bias_ptr, out_ptr, W, K, V, sb, sw, sk,
    HAS_BIAS: tl.constexpr, BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0)  # b*W + j
    tile = tl.program_id(1)
    j = row % W
    b = row // W
    offs = tile * BLOCK_V + tl.arange(0, BLOCK_V)
    valid = offs < V
    m = tl.full([BLOCK_V], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK_V], tl.float32)
    for k in range(0, K):
        shift = tl.load(a_ptr + b * K + k) - tl.load(lse_ptr + row * K + k)
        x = tl.load(x_ptr + b * sb + j * sw + k * sk + offs, mask=valid, other=0.0).to(tl.float32)
        # A missing passage (prior -inf) or an all -inf row gives t = -inf or NaN: skip it.
        t = tl.where(shift == shift, x + shift, float("-inf"))
        t = tl.where(shift == float("-inf"), float("-inf"), t)
        nm = tl.maximum(m, t)
        safe = tl.where(nm == float("-inf"), 0.0, nm)
        s = s * tl.exp(m - safe) + tl.exp(t - safe)
        m = nm
    marginal = tl.where(m == float("-inf"), m, m + tl.log(tl.where(m == float("-inf"), 1.0, s)))
    if HAS_BIAS:
        marginal = marginal + tl.load(bias_ptr + row * V + offs, mask=valid, other=0.0)
    score = marginal + tl.load(beam_ptr + row)
    tl.store(out_ptr + row * V + offs, score, mask=valid)


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
    lse = torch.empty(B * W * K, dtype=torch.float32, device=x.device)
    block = min(1024, triton.next_power_of_2(V))
    _row_lse_kernel[(B * W * K,)](x, lse, W, K, V, x.stride(0), x.stride(1), x.stride(2),
                                  BLOCK_V=block)
    cand = torch.empty((B * W, V), dtype=torch.float32, device=x.device)
    grid = (B * W, triton.cdiv(V, block))
    _candidates_kernel[grid](
        x, lse, a, beam_scores, bias if bias is not None else cand, cand, W, K, V,
        x.stride(0), x.stride(1), x.stride(2), HAS_BIAS=bias is not None, BLOCK_V=block,
    )
    scores, flat = select_top(cand.view(B, W * V), n)
    return scores, flat // V, flat % V
