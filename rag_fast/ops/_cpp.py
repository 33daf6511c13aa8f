"""Launchers for the C++ CPU kernels (csrc/). Also the contract every backend follows.

Every launcher takes logits ``x`` as a ``[B, K, T, V]`` view whose last dimension is contiguous
(the op layer copies otherwise), validated by the op layer. Statistics are float32 except
``lse``, which is float64 wherever it goes in or out (see ``row_stats``); gradients
are written once, in the logits' dtype, into ``out`` (which may be ``x`` itself for
``inplace_grad``). Nothing here allocates a ``[B, K, T, V]`` temporary.

    row_stats(x, y, ignore_index)        -> lse, x_tgt, x_sum       each [B, K, T]
        lse = logsumexp_v x (float64: the row max plus the log of the sum of exps, so that
        x - lse keeps float32's relative precision where softmax(x) is near 1),
        x_tgt = x[..., y] (0 where y is ignored or y is None), x_sum = sum_v x.
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
    beam_step(x, a, beam, bias, n)       -> scores, beams, tokens   each [B, n]
        x is [B, W, K, V] here; see rag_fast/ops/rag_token_beam_step.py
    inner_products(q, v, out)            out[b, n] = q[b] . v[n]   (float32 [B, d], [N, d])
    dropout_keep_bits(state, n, threshold) -> bits or None
        torch's CPU dropout mask of n elements as bits, drawn from the generator state bytes
        ``state`` (advanced in place); None if the kernel cannot read the state
    masked_scale(src, bits, scale, out)  out = src * (bit set ? scale : 0)   (float32)

``a`` is the passage log-prior ``[B, K]`` float32 (``-inf`` for a missing passage).
These launchers trust their arguments: only the CPU implementations of the custom ops
(``rag_fast/ops/_custom_ops.py``) and the exact search's ``inner_products``
(``rag_fast/retrieval/_exact.py``), which check them first, call them.
"""
from __future__ import annotations

import torch

from rag_fast import _ext, _pool

_DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1}


def _stats_like(x: torch.Tensor) -> torch.Tensor:
    B, K, T, _ = x.shape
    return torch.empty((B, K, T), dtype=torch.float32, device=x.device)


def _view_args(x: torch.Tensor) -> tuple[int, ...]:
    B, K, T, V = x.shape
    return (x.data_ptr(), _DTYPE_CODE[x.dtype], B, K, T, V, x.stride(0), x.stride(1), x.stride(2))


def _lse_like(x: torch.Tensor) -> torch.Tensor:
    B, K, T, _ = x.shape
    return torch.empty((B, K, T), dtype=torch.float64, device=x.device)


def _f32(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float32).contiguous()


def _f64(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float64).contiguous()


def row_stats(
    x: torch.Tensor, y: torch.Tensor | None, ignore_index: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    lse, x_tgt, x_sum = _lse_like(x), _stats_like(x), _stats_like(x)
    y_keep = None if y is None else y.contiguous()  # alive for the whole call
    y_ptr = 0 if y_keep is None else y_keep.data_ptr()
    _ext.get().row_stats(
        *_view_args(x), y_ptr, ignore_index, lse.data_ptr(), x_tgt.data_ptr(), x_sum.data_ptr()
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
    y_keep = None if y is None else y.contiguous()
    lse, c_p, c_y, c_1 = _f64(lse), _f32(c_p), _f32(c_y), _f32(c_1)
    _ext.get().row_grad(
        *_view_args(x),
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


def _pair_stats_like(x: torch.Tensor) -> torch.Tensor:
    B, _, T, _ = x.shape
    return torch.empty((B, T), dtype=torch.float32, device=x.device)


def token_smooth_forward(
    x: torch.Tensor,
    y: torch.Tensor | None,
    ignore_index: int,
    a: torch.Tensor,
    need_rho: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    lse, x_tgt, x_sum = _lse_like(x), _stats_like(x), _stats_like(x)
    rho = _stats_like(x) if need_rho else None
    sum_m = _pair_stats_like(x)
    y_keep = None if y is None else y.contiguous()
    a = _f32(a)
    _ext.get().token_smooth_forward(
        *_view_args(x),
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


def token_smooth_stats(
    x: torch.Tensor, a: torch.Tensor, lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    a, lse = _f32(a), _f64(lse)
    sum_m, rho = _pair_stats_like(x), _stats_like(x)
    _ext.get().token_smooth_stats(
        *_view_args(x), a.data_ptr(), lse.data_ptr(), sum_m.data_ptr(), rho.data_ptr()
    )
    return sum_m, rho


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
        *_view_args(x),
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


def token_marginal(x: torch.Tensor, a: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    B, _, T, V = x.shape
    a, lse = _f32(a), _f64(lse)
    marginal = _pool.empty((B, T, V), torch.float32, like=x)  # CPU only: reused memory
    _ext.get().token_marginal(*_view_args(x), a.data_ptr(), lse.data_ptr(), marginal.data_ptr())
    return marginal


def token_marginal_grad(
    x: torch.Tensor,
    a: torch.Tensor,
    lse: torch.Tensor,
    m: torch.Tensor,
    g_m: torch.Tensor,
    out: torch.Tensor,
) -> torch.Tensor:
    a, lse, m, g_m = _f32(a), _f64(lse), _f32(m), _f32(g_m)
    c = _stats_like(x)
    _ext.get().token_marginal_grad(
        *_view_args(x),
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


def beam_step(
    x: torch.Tensor, a: torch.Tensor, beam: torch.Tensor, bias: torch.Tensor | None, n: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x ``[B, W, K, V]``; a ``[B, K]``, beam ``[B, W]``, bias ``[B*W, V]`` or None: float32,
    contiguous -> the top ``n`` (scores float32, beams int64, tokens int64), each ``[B, n]``."""
    B, W, K, V = x.shape
    scores = torch.empty((B, n), dtype=torch.float32)
    beams = torch.empty((B, n), dtype=torch.int64)
    tokens = torch.empty((B, n), dtype=torch.int64)
    _ext.get().rag_token_beam_step(
        x.data_ptr(), _DTYPE_CODE[x.dtype], B, W, K, V, x.stride(0), x.stride(1), x.stride(2),
        a.data_ptr(), beam.data_ptr(), 0 if bias is None else bias.data_ptr(), n,
        scores.data_ptr(), beams.data_ptr(), tokens.data_ptr(),
    )
    return scores, beams, tokens


def bits_mask(t: torch.Tensor, one: int) -> torch.Tensor | None:
    """The bits of ``t == one`` (elements compared as bits), eight elements per byte (element
    ``i`` in bit ``i % 8`` of byte ``i // 8``), if every element of ``t`` is 0 or ``one``, else
    None. ``t``: contiguous, on the CPU, 2, 4 or 8 bytes per element; ``one``: the unsigned
    bits."""
    out = torch.empty((t.numel() + 7) // 8, dtype=torch.uint8)
    if not _ext.get().bits_mask(t.data_ptr(), t.element_size(), t.numel(), one, out.data_ptr()):
        return None
    return out


def bits_unmask(bits: torch.Tensor, like: torch.Tensor, one: int) -> torch.Tensor:
    """The inverse of :func:`bits_mask`: a tensor of ``like``'s shape and dtype (contiguous)
    holding ``one`` (as bits) where the bit is set and 0 elsewhere."""
    out = torch.empty(like.shape, dtype=like.dtype)
    _ext.get().bits_unmask(bits.data_ptr(), out.element_size(), out.numel(), one, out.data_ptr())
    return out


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


def masked_scale(src: torch.Tensor, bits: torch.Tensor, scale: float, out: torch.Tensor) -> None:
    """``out = src * (bit set ? scale : 0)`` elementwise (float32, contiguous, ``out`` may be
    ``src``); ``bits`` as :func:`dropout_keep_bits` gives them."""
    _ext.get().masked_scale(src.data_ptr(), bits.data_ptr(), src.numel(), scale, out.data_ptr())


def inner_products(q: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> None:
    B, d = q.shape
    _ext.get().inner_products(q.data_ptr(), B, q.stride(0), v.data_ptr(), v.shape[0],
                              v.stride(0), d, out.data_ptr(), out.stride(0))
