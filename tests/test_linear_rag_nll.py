"""The fused LM-head + RAG loss equals the loss over materialized logits: forward and every
gradient (hidden states, LM head weight and bias, passage scores), per element, against a
float64 oracle (``F.linear`` then ``rag_fast.reference``), at vocabularies of 7, 1003 and
151 936 entries, K of 1 and 5, label smoothing 0 and 0.1, ignored positions and missing
passages."""
from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F

from rag_fast import linear_rag_nll, rag_sequence_nll, rag_token_nll
from rag_fast import reference as ref
from rag_fast.models import _seq2seq
from utils import RTOL, assert_close_rule, requires_cuda, requires_ext, requires_triton

lin = sys.modules["rag_fast.ops.linear_rag_nll"]  # the module (the package exports the function)

IGNORE = -100


def _case(B, K, T, d, V, *, seed=0, missing=False, bias=True, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(B * K, T, d, generator=g, dtype=torch.float64)
    W = torch.randn(V, d, generator=g, dtype=torch.float64) / d ** 0.5 * 2
    b = torch.randn(V, generator=g, dtype=torch.float64) * 0.3 if bias else None
    s = torch.randn(B, K, generator=g, dtype=torch.float64) * 2
    if missing:
        s[0, K - 1] = float("-inf")  # a question with a missing passage
    y = torch.randint(0, V, (B, T), generator=g)
    y[B - 1, T - 1] = IGNORE  # an ignored (padding) position
    if T > 2:
        y[0, 1] = IGNORE
    return h, W, b, s, y


def _grads(fn, tensors, upstream=None):
    leaves = [None if t is None else t.detach().clone().requires_grad_() for t in tensors]
    loss = fn(*leaves)
    loss.backward(upstream if upstream is not None else None)
    return loss.detach(), [None if t is None else t.grad for t in leaves]


def _materialized(mode, eps, red, exclude_bos=False):
    def fn(h, W, b, s, y):
        x = F.linear(h, W, b)
        B, K = s.shape
        x = x.view(B, K, *x.shape[1:])
        f = ref.rag_token_nll if mode == "token" else ref.rag_sequence_nll
        return f(x, s, y, epsilon=eps, ignore_index=IGNORE, exclude_bos=exclude_bos,
                 reduction=red)
    return fn


def _fused(mode, eps, red, exclude_bos=False, **kw):
    def fn(h, W, b, s, y):
        return linear_rag_nll(h, W, s, y, bias=b, mode=mode, epsilon=eps, ignore_index=IGNORE,
                              exclude_bos=exclude_bos, reduction=red, **kw)
    return fn


def _check_against_oracle(mode, eps, B, K, T, d, V, *, red="mean", missing=False, bias=True,
                          tile=None, upstream=None, exclude_bos=False, impl="auto",
                          dtype=torch.float32, deferred=False):
    h, W, b, s, y = _case(B, K, T, d, V, missing=missing, bias=bias)
    names = ["loss", "hidden", "weight", "bias", "doc_scores"]

    def with_y(fn):
        return lambda h_, W_, b_, s_: fn(h_, W_, b_, s_, y)

    up64 = None if upstream is None else upstream.double()
    want, want_g = _grads(with_y(_materialized(mode, eps, red, exclude_bos)), [h, W, b, s], up64)
    low = [None if t is None else t.to(dtype) for t in (h, W, b)] + [s.float()]
    up = None if upstream is None else upstream.float()
    plain, plain_g = _grads(with_y(_materialized(mode, eps, red, exclude_bos)), low, up)
    if deferred:  # a tied head's deferred weight gradient, taken when the backward has run
        heads = _seq2seq.DeferredHeadGrad()
        got, got_g = _grads(with_y(_fused(mode, eps, red, exclude_bos, tile=tile, impl=impl,
                                          deferred_weight_grad=heads)), low, up)
        assert got_g[1] is None
        got_g[1] = heads.take()
    else:
        got, got_g = _grads(with_y(_fused(mode, eps, red, exclude_bos, tile=tile, impl=impl)),
                            low, up)
    assert got.dtype == torch.float32
    # The hidden, weight and bias gradients are sums over the vocabulary or the rows of
    # products with the logits' gradient G, whose terms can cancel: each element's floor is the
    # dtype's relative tolerance times the size of its terms (|G| |W|, |G|^T |h|, sum |G|).
    G = _logits_grad(mode, eps, red, exclude_bos, h, W, b, s, y, up64).flatten(0, -2).abs()
    h2 = h.reshape(-1, d).abs()
    floors = {"hidden": (G @ W.abs()).view_as(h), "weight": G.t() @ h2, "bias": G.sum(0),
              "doc_scores": 1e-6}  # doc_scores: sums over K that cancel to about 0
    for name, a, p, o in zip(names, [got, *got_g], [plain, *plain_g], [want, *want_g]):
        if o is None:
            assert a is None, name
            continue
        atol = floors.get(name, 0.0)
        if isinstance(atol, torch.Tensor):
            atol = RTOL[dtype] * atol
        assert_close_rule(a.float(), p.float(), o, dtype, f"{mode} eps={eps} V={V} K={K} {name}",
                          atol=atol)


def _logits_grad(mode, eps, red, exclude_bos, h, W, b, s, y, upstream):
    """The float64 gradient of the loss with respect to the logits ``[B*K, T, V]``."""
    x = F.linear(h, W, b).requires_grad_()
    B, K = s.shape
    f = ref.rag_token_nll if mode == "token" else ref.rag_sequence_nll
    loss = f(x.view(B, K, *x.shape[1:]), s, y, epsilon=eps, ignore_index=IGNORE,
             exclude_bos=exclude_bos, reduction=red)
    (g,) = torch.autograd.grad(loss, x, upstream)
    return g


@requires_ext
@pytest.mark.parametrize("deferred", [False, True], ids=["immediate", "deferred"])
@pytest.mark.parametrize("mode", ["token", "sequence"])
@pytest.mark.parametrize("eps", [0.0, 0.1])
@pytest.mark.parametrize("K", [1, 5])
@pytest.mark.parametrize("V", [7, 1003])
def test_equals_materialized_loss(mode, eps, K, V, deferred):
    # tiles that do not divide V, and a question with a missing passage when K > 1; deferred:
    # a tied head's weight gradient computed late, the hidden states' in the forward pass
    # (RAG-Token eps 0 and RAG-Sequence without a bias gradient; the others as immediate)
    _check_against_oracle(mode, eps, B=3, K=K, T=5, d=12, V=V, missing=K > 1,
                          tile=3 if V == 7 else 256, deferred=deferred,
                          bias=not deferred or V == 7)


@requires_ext
@pytest.mark.parametrize("deferred", [False, True], ids=["immediate", "deferred"])
@pytest.mark.parametrize("mode", ["token", "sequence"])
@pytest.mark.parametrize("eps", [0.0, 0.1])
@pytest.mark.parametrize("K", [1, 5])
def test_equals_materialized_loss_at_qwen2_vocabulary(mode, eps, K, deferred):
    # V = 151 936 (Qwen2), the default tile width
    _check_against_oracle(mode, eps, B=2, K=K, T=3, d=16, V=151936, missing=K > 1,
                          deferred=deferred, bias=not deferred)


@requires_ext
@pytest.mark.parametrize("deferred", [False, True], ids=["immediate", "deferred"])
@pytest.mark.parametrize("mode,eps", [("token", 0.1), ("token", 0.0), ("sequence", 0.1)])
def test_per_question_upstream_gradient_and_options(mode, eps, deferred):
    # reduction="none" with a different upstream weight per question; no bias; exclude_bos
    up = torch.tensor([0.5, -2.0, 1.5])
    _check_against_oracle(mode, eps, B=3, K=4, T=6, d=8, V=300, red="none", bias=False,
                          upstream=up, exclude_bos=mode == "sequence", missing=True, tile=128,
                          deferred=deferred)
    _check_against_oracle(mode, 0.0, B=3, K=2, T=4, d=8, V=50, red="sum", tile=50)


@requires_ext
@pytest.mark.parametrize("mode", ["token", "sequence"])
def test_bfloat16_matches_the_materialized_fused_loss(mode):
    h, W, b, s, y = _case(2, 3, 4, 16, 517, missing=True)
    low = [t.to(torch.bfloat16) for t in (h, W, b)] + [s.float()]

    def materialized(h_, W_, b_, s_):
        f = rag_token_nll if mode == "token" else rag_sequence_nll
        return f(F.linear(h_, W_, b_), s_, y, epsilon=0.1, ignore_index=IGNORE, reduction="sum")

    want, want_g = _grads(materialized, low)
    got, got_g = _grads(lambda h_, W_, b_, s_: linear_rag_nll(
        h_, W_, s_, y, bias=b_, mode=mode, epsilon=0.1, ignore_index=IGNORE, reduction="sum",
        tile=128), low)
    torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)
    for name, a, w in zip(["hidden", "weight", "bias", "doc_scores"], got_g, want_g):
        assert a.dtype == w.dtype, name
        # same bf16 logits; the gradient GEMMs sum in a different order
        torch.testing.assert_close(a.float(), w.float(), rtol=3e-2, atol=3e-2, msg=name)


@requires_ext
def test_hidden_may_be_4d_and_tile_width_never_changes_the_result():
    h, W, b, s, y = [None if t is None else t.float() if t.is_floating_point() else t
                     for t in _case(2, 3, 5, 8, 333)]
    base = linear_rag_nll(h, W, s, y, bias=b, epsilon=0.1, ignore_index=IGNORE, tile=333)
    four = linear_rag_nll(h.view(2, 3, 5, 8), W, s, y, bias=b, epsilon=0.1,
                          ignore_index=IGNORE, tile=333)
    torch.testing.assert_close(four, base, rtol=0, atol=0)
    for tile in (1, 64, 100, 10_000):
        got = linear_rag_nll(h, W, s, y, bias=b, epsilon=0.1, ignore_index=IGNORE, tile=tile)
        torch.testing.assert_close(got, base, rtol=2e-6, atol=2e-6)


def test_tile_width_rule():
    assert lin.tile_width(1280, 151936, 4) == (lin.TILE_BYTES // (1280 * 4)) // 64 * 64
    assert lin.tile_width(10, 151936, 4) == 151936  # few rows: the whole vocabulary at once
    assert lin.tile_width(10**7, 151936, 4) == lin.MIN_TILE
    assert lin.tile_width(10**7, 7, 4) == 7
    # a tile of the shape (B4 K5 T64 fp32) is at most 2% of the logits
    rows, V = 4 * 5 * 64, 151936
    assert rows * lin.tile_width(rows, V, 4) <= 0.02 * rows * V
    # on a GPU the tiles are TILE_BYTES_CUDA wide: the GPU benchmark's shape (B8 K5 T128, bf16)
    # in a dozen tiles, each under 10% of the logits
    rows = 8 * 5 * 128
    width = lin.tile_width(rows, V, 2, device_type="cuda")
    assert width == (lin.TILE_BYTES_CUDA // (rows * 2)) // 64 * 64
    assert 10 <= -(-V // width) <= 16 and width <= 0.1 * V
    assert lin.tile_width(rows, V, 2, 4 << 20, device_type="cuda") == (4 << 20) // (rows * 2) // 64 * 64


@requires_ext
@pytest.mark.parametrize("mode", ["token", "sequence"])
def test_deferred_weight_gradient_equals_the_immediate_one(mode):
    h, W, b, s, y = [None if t is None else t.float() if t.is_floating_point() else t
                     for t in _case(2, 3, 4, 8, 200, missing=True)]
    leaves = [t.clone().requires_grad_() for t in (h, W, b, s)]
    linear_rag_nll(leaves[0], leaves[1], leaves[3], y, bias=leaves[2], mode=mode, epsilon=0.1,
                   ignore_index=IGNORE, reduction="mean", tile=64).backward()
    now = [t.grad for t in leaves]
    deferred = _seq2seq.DeferredHeadGrad()
    late = [t.clone().requires_grad_() for t in (h, W, b, s)]
    linear_rag_nll(late[0], late[1], late[3], y, bias=late[2], mode=mode, epsilon=0.1,
                   ignore_index=IGNORE, reduction="mean", tile=64,
                   deferred_weight_grad=deferred).backward()
    assert late[1].grad is None  # left to the deferred object
    dW = deferred.take()
    assert deferred.take() is None  # taken once
    torch.testing.assert_close(dW, now[1], rtol=0, atol=0)
    # with a bias that needs a gradient, the hidden states' comes from the backward's tiles as
    # in the immediate path, bit for bit (without one: the oracle tests, deferred=True)
    for a, w in zip([late[0].grad, late[2].grad, late[3].grad], [now[0], now[2], now[3]]):
        torch.testing.assert_close(a, w, rtol=0, atol=0)


@requires_ext
@pytest.mark.parametrize("mode,eps", [("token", 0.0), ("sequence", 0.0), ("sequence", 0.1)])
def test_deferred_head_takes_the_hidden_gradient_from_the_forward(mode, eps, monkeypatch):
    """A tied head without a bias gradient (RagModel's case): the backward runs no vocabulary
    pass of its own for the hidden states (their gradient comes from the forward's online
    softmax product), only the late weight gradient's; RAG-Token with smoothing keeps it."""
    h, W, _, s, y = [None if t is None else t.float() if t.is_floating_point() else t
                     for t in _case(2, 3, 4, 8, 200, missing=True, bias=False)]
    passes = []
    real = lin._GradTiles.__iter__

    def counting(self):
        passes.append(1)
        return real(self)

    monkeypatch.setattr(lin._GradTiles, "__iter__", counting)
    for e, want in ((eps, 1), (0.1, 2)) if mode == "token" else ((eps, 1),):
        passes.clear()
        deferred = _seq2seq.DeferredHeadGrad()
        hh = h.clone().requires_grad_()
        linear_rag_nll(hh, W.clone().requires_grad_(), s, y, mode=mode, epsilon=e,
                       ignore_index=IGNORE, reduction="mean", tile=64,
                       deferred_weight_grad=deferred).backward()
        assert deferred.take() is not None
        assert len(passes) == want, (mode, e, passes)


@requires_ext
def test_no_grad_forward_and_frozen_head():
    h, W, b, s, y = [None if t is None else t.float() if t.is_floating_point() else t
                     for t in _case(2, 2, 3, 8, 90)]
    with torch.no_grad():
        a = linear_rag_nll(h, W, s, y, bias=b, ignore_index=IGNORE, reduction="none")
    assert a.shape == (2,) and not a.requires_grad
    # a head that needs no gradient: only hidden gets one, and it equals the trained head's
    hh = h.clone().requires_grad_()
    Wt = W.clone().requires_grad_()
    frozen = torch.autograd.grad(
        linear_rag_nll(hh, W, s, y, bias=b, ignore_index=IGNORE, reduction="sum"), [hh])[0]
    g_h, g_w = torch.autograd.grad(
        linear_rag_nll(hh, Wt, s, y, bias=b, ignore_index=IGNORE, reduction="sum"), [hh, Wt])
    torch.testing.assert_close(frozen, g_h, rtol=0, atol=0)
    assert g_w.abs().sum() > 0


@requires_ext
def test_autocast_runs_the_tiles_in_bfloat16_and_returns_float32_gradients():
    h, W, b, s, y = [None if t is None else t.float() if t.is_floating_point() else t
                     for t in _case(2, 3, 4, 16, 300, missing=True)]
    leaves = [t.clone().requires_grad_() for t in (h, W, s)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = linear_rag_nll(leaves[0], leaves[1], leaves[2], y, ignore_index=IGNORE,
                             epsilon=0.1, reduction="sum", tile=128)
    got.backward()
    # the same bf16 logits through the materialized path
    ref_leaves = [t.clone().requires_grad_() for t in (h, W, s)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = F.linear(ref_leaves[0], ref_leaves[1])
    want = rag_token_nll(logits, ref_leaves[2], y, epsilon=0.1, ignore_index=IGNORE,
                         reduction="sum")
    want.backward()
    torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)
    for name, a, w in zip(["hidden", "weight", "doc_scores"], leaves, ref_leaves):
        assert a.grad.dtype == torch.float32, name
        torch.testing.assert_close(a.grad, w.grad, rtol=3e-2, atol=3e-2, msg=name)
    # the late weight gradient of a tied head is float32 too
    deferred = _seq2seq.DeferredHeadGrad()
    late = W.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        linear_rag_nll(h, late, s, y, ignore_index=IGNORE, epsilon=0.1, reduction="sum",
                       tile=128, deferred_weight_grad=deferred).backward()
    dW = deferred.take()
    assert dW.dtype == torch.float32
    torch.testing.assert_close(dW, leaves[1].grad, rtol=3e-2, atol=3e-2)


@requires_triton
@pytest.mark.parametrize("mode", ["token", "sequence"])
@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_triton_tiles_equal_the_oracle(mode, eps):
    # Triton's interpreter on the CPU (conftest.py); on a GPU the same launchers run compiled
    _check_against_oracle(mode, eps, B=2, K=3, T=3, d=8, V=37, missing=True, tile=16,
                          impl="triton")


@requires_cuda
@pytest.mark.parametrize("mode", ["token", "sequence"])
def test_cuda_bfloat16_at_qwen2_vocabulary(mode):
    h, W, b, s, y = _case(2, 5, 8, 64, 151936, missing=True)
    dev = [t.to("cuda", torch.bfloat16) for t in (h, W, b)] + [s.float().cuda()]
    y = y.cuda()

    def materialized(h_, W_, b_, s_):
        f = rag_token_nll if mode == "token" else rag_sequence_nll
        return f(F.linear(h_, W_, b_), s_, y, epsilon=0.1, ignore_index=IGNORE, reduction="sum")

    want, want_g = _grads(materialized, dev)
    got, got_g = _grads(lambda h_, W_, b_, s_: linear_rag_nll(
        h_, W_, s_, y, bias=b_, mode=mode, epsilon=0.1, ignore_index=IGNORE,
        reduction="sum"), dev)
    torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)
    for name, a, w in zip(["hidden", "weight", "bias", "doc_scores"], got_g, want_g):
        torch.testing.assert_close(a.float(), w.float(), rtol=3e-2, atol=3e-2, msg=name)


def test_bad_arguments_name_what_is_wrong():
    h, W, s = torch.randn(6, 3, 8), torch.randn(20, 8), torch.randn(2, 3)
    y = torch.randint(0, 20, (2, 3))
    with pytest.raises(ValueError, match="mode must be one of"):
        linear_rag_nll(h, W, s, y, mode="tokens")
    with pytest.raises(ValueError, match=r"hidden must be \[B\*K=6, T, d=8\]"):
        linear_rag_nll(torch.randn(5, 3, 8), W, s, y)
    with pytest.raises(ValueError, match="weight must be the LM head's"):
        linear_rag_nll(h, torch.randn(20), s, y)
    # transposed [d, V]: the weight is named, with the d that hidden gives
    with pytest.raises(ValueError, match=r"weight must be the LM head's \[V, d=8\].*\(8, 20\)"):
        linear_rag_nll(h, W.T.contiguous(), s, y)
    with pytest.raises(ValueError, match=r"bias must be None or a \[V=20\]"):
        linear_rag_nll(h, W, s, y, bias=torch.randn(19))
    with pytest.raises(ValueError, match="tile must be a positive int"):
        linear_rag_nll(h, W, s, y, tile=0)
    with pytest.raises(ValueError, match="tile must be a positive int"):
        linear_rag_nll(h, W, s, y, tile=True)
    with pytest.raises(ValueError, match="hidden must be a floating tensor"):
        linear_rag_nll(torch.ones(6, 3, 8, dtype=torch.long), W, s, y)
    with pytest.raises(ValueError, match="share one dtype"):
        linear_rag_nll(h, W.double(), s, y)
    with pytest.raises(ValueError, match=r"targets must lie in \[0, V=20\)"):
        linear_rag_nll(h, W, s, torch.full((2, 3), 25))
    with pytest.raises(ValueError, match="n_docs"):
        linear_rag_nll(h, W, s, y, n_docs=4)


def test_float64_runs_the_materialized_reference():
    h, W, b, s, y = _case(2, 2, 3, 8, 40)
    got = linear_rag_nll(h, W, s, y, bias=b, epsilon=0.1, ignore_index=IGNORE, reduction="none")
    want = _materialized("token", 0.1, "none")(h, W, b, s, y)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@requires_ext
@pytest.mark.parametrize("mode", ["token", "sequence"])
def test_autocast_deferred_head_gathers_the_hidden_gradient_in_bfloat16_tiles(mode):
    """Under autocast the forward's online softmax product runs on bf16 tiles into a float32
    accumulator; the hidden states' gradient matches the immediate path's (bf16 tolerance)."""
    h, W, _, s, y = [None if t is None else t.float() if t.is_floating_point() else t
                     for t in _case(2, 3, 4, 16, 300, missing=True, bias=False)]
    grads = []
    for deferred in (None, _seq2seq.DeferredHeadGrad()):
        hh, ww = h.clone().requires_grad_(), W.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = linear_rag_nll(hh, ww, s, y, mode=mode, ignore_index=IGNORE,
                                  reduction="sum", tile=128, deferred_weight_grad=deferred)
        loss.backward()
        assert hh.grad.dtype == torch.float32
        grads.append((hh.grad, ww.grad if deferred is None else deferred.take()))
    (h_now, w_now), (h_late, w_late) = grads
    torch.testing.assert_close(h_late, h_now, rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(w_late, w_now, rtol=0, atol=0)


def _row_errors(got, want):
    """Per-row relative error of ``got`` against the float64 ``want`` ([rows, d])."""
    got, want = got.reshape(-1, got.shape[-1]).double(), want.reshape(-1, want.shape[-1])
    return ((got - want).norm(dim=1) / want.norm(dim=1).clamp_min(1e-30))


@requires_ext
@pytest.mark.parametrize("mode,eps,dtype", [("token", 0.0, torch.bfloat16),
                                            ("sequence", 0.1, torch.bfloat16),
                                            ("token", 0.0, torch.float32)])
def test_deferred_hidden_gradient_is_as_accurate_on_a_peaked_softmax(mode, eps, dtype):
    """Rows whose target takes nearly all the probability (P_y ~ 0.98): the target's terms of
    the hidden gradient, c_p P_y W[y] and c_y W[y], nearly cancel. The deferred path adds them
    up in float64 apart from the rest of P W, so its per-row error against float64 is no worse
    than the immediate path's (which forms c_p P_y + c_y in float32 inside the kernel)."""
    B, K, T, d, V = 2, 3, 8, 64, 4000
    h, W, _, s, y = _case(B, K, T, d, V, seed=3, bias=False)
    yy = y.clamp_min(0)[:, None, :].expand(B, K, T).reshape(B * K, T)
    h = 0.2 * h + 6.0 * W[yy] / W[yy].norm(dim=-1, keepdim=True)  # peaked at the target
    h, W = h.to(dtype).double(), W.to(dtype).double()  # the oracle sees the rounded inputs
    oracle = torch.autograd.grad(_materialized(mode, eps, "sum")(
        h.requires_grad_(), W, None, s, y), h)[0]
    p_y = torch.softmax(F.linear(h, W), -1).gather(-1, yy[..., None])
    assert p_y.median() > 0.9
    errors = []
    for deferred in (None, _seq2seq.DeferredHeadGrad()):
        hh, ww = h.detach().to(dtype).requires_grad_(), W.to(dtype).requires_grad_()
        linear_rag_nll(hh, ww, s.float(), y, mode=mode, epsilon=eps, ignore_index=IGNORE,
                       reduction="sum", tile=512, deferred_weight_grad=deferred).backward()
        errors.append(_row_errors(hh.grad, oracle).max().item())
    immediate, late = errors
    assert late <= 2 * immediate + 1e-5, errors


@requires_ext
@pytest.mark.parametrize("mode", ["token", "sequence"])
def test_deferred_path_with_a_frozen_bias_of_minus_inf_on_whole_tiles(mode):
    """A frozen bias (BART's final_logits_bias) of -inf over the first tiles: those rows'
    running log-sum-exp is -inf until a finite tile comes; the hidden gradient stays finite
    and equals the immediate path's."""
    h, W, b, s, y = [None if t is None else t.float() if t.is_floating_point() else t
                     for t in _case(2, 3, 4, 8, 600, missing=True)]
    b[:300] = float("-inf")
    y = torch.where((y >= 0) & (y < 300), y + 300, y)  # targets where the bias is finite
    grads = []
    for deferred in (None, _seq2seq.DeferredHeadGrad()):
        hh = h.clone().requires_grad_()
        linear_rag_nll(hh, W.clone().requires_grad_(), s, y, bias=b, mode=mode,
                       ignore_index=IGNORE, reduction="mean", tile=128,
                       deferred_weight_grad=deferred).backward()
        grads.append(hh.grad)
    assert torch.isfinite(grads[1]).all()
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-5, atol=1e-6)
