"""The C++ launchers of the RAG losses (rag_fast/ops/rag_losses.py, ``cpp``) against plain-torch formulas in float64.

Each launcher is checked directly, below the autograd layer, with the tolerance rule of
tests/utils.py: the "plain" version is the same formula in float32 (bf16 gradients rounded to
bf16 at the end), the oracle the formula in float64. Every SIMD variant this CPU can run
(generic, AVX2, AVX-512) also runs the checks, up to V = 50265, in a subprocess with
RAG_FAST_SIMD set to it.
"""
from __future__ import annotations

import pytest
import torch

from utils import SIMD_VARIANTS, assert_close_rule, requires_ext, run_in_simd_variant

pytestmark = requires_ext
IGNORE = -100

# (B, K, T, V) and the branch each shape is for.
SHAPES = [
    (2, 3, 4, 7),  # V below one vector: only the masked tail path
    (1, 1, 1, 1),  # one passage, one position, one vocabulary entry
    (2, 4, 3, 1003),  # several tiles and a partial vector at the end
    (1, 2, 2, 50265),  # BART's vocabulary: long sums (accumulation error)
]


def _inputs(B, K, T, V, dtype, seed=0, strided=False, missing=True):
    """x [B, K, T, V] (row stride V + 5 when strided), a [B, K], y [B, T], lse [B, K, T]."""
    g = torch.Generator().manual_seed(seed)
    width = V + 5 if strided else V
    x = (3 * torch.randn(B, K, T, width, generator=g)).to(dtype)[..., :V]
    scores = torch.randn(B, K, generator=g)
    if missing and K > 1:
        scores[0, -1] = float("-inf")  # a missing passage: weight 0, never NaN
    a = torch.log_softmax(scores, dim=1)
    y = torch.randint(0, V, (B, T), generator=g)
    y[-1, 0] = IGNORE
    if B > 1:
        y[0, :] = IGNORE  # a question whose every target is ignored
    from rag_fast.ops.rag_losses import cpp as _cpp

    lse, _, _ = _cpp.row_stats(x, y, IGNORE)
    return x, a, y, lse


def _onehot(y, K, V):
    mask = y != IGNORE
    oh = torch.zeros(y.shape[0], K, y.shape[1], V, dtype=torch.float64)
    idx = torch.where(mask, y, 0)[:, None, :, None].expand(-1, K, -1, 1)
    oh.scatter_(-1, idx, 1.0)
    return oh * mask[:, None, :, None]


def _terms(x, a, lse, ftype):
    """P, R, M in ftype (float64: the oracle; float32: the plain version)."""
    z = a.to(ftype)[:, :, None, None] + x.to(ftype) - lse.to(ftype)[..., None]
    M = torch.logsumexp(z, dim=1)  # [B, T, V]
    R = torch.exp(z - M[:, None])
    P = torch.exp(x.to(ftype) - lse.to(ftype)[..., None])
    return P, R, M


def _check(actual, formula, dtype, what):
    """formula(ftype) -> tensor; the plain version is rounded to `dtype` (the output's)."""
    oracle = formula(torch.float64)
    plain = formula(torch.float32).to(dtype)
    assert_close_rule(actual, plain, oracle, dtype, what)


def _coefs(B, K, T, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g) for shape in [(B, K, T)] * 3 + [(B, T)]]


def _lse(x, ft):
    return torch.logsumexp(x.to(ft), -1)


def check_smooth_forward(x, a, y):
    """token_smooth_forward (the fused one-read forward) against the float64 formulas; its own
    lse feeds the plain and oracle versions of sum_m and rho, as in the op."""
    from rag_fast.ops.rag_losses import cpp as _cpp

    B, K, T, V = x.shape
    f32 = torch.float32
    lse, x_tgt, x_sum, sum_m, rho = _cpp.token_smooth_forward(x, y, IGNORE, a)
    _check(lse, lambda ft: _lse(x, ft), f32, "token_smooth_forward lse")
    _check(x_sum, lambda ft: x.to(ft).sum(-1), f32, "token_smooth_forward x_sum")
    assert torch.equal(x_tgt, _cpp.row_stats(x, y, IGNORE)[1]), "token_smooth_forward x_tgt"
    _check(sum_m, lambda ft: _terms(x, a, _lse(x, ft), ft)[2].sum(-1), f32,
           "token_smooth_forward sum_m")
    _check(rho, lambda ft: _terms(x, a, _lse(x, ft), ft)[1].sum(-1), f32,
           "token_smooth_forward rho")
    missing = torch.isinf(a) & (a < 0)  # [B, K]
    assert (rho[missing] == 0).all(), "a missing passage must get rho == 0 exactly"
    # Without targets: x_tgt is 0, everything else unchanged.
    lse2, x_tgt2, _, sum_m2, rho2 = _cpp.token_smooth_forward(x, None, IGNORE, a)
    assert (x_tgt2 == 0).all()
    assert torch.equal(lse2, lse) and torch.equal(sum_m2, sum_m) and torch.equal(rho2, rho)
    # Without rho (a forward that will not be differentiated): the same statistics, no rho.
    lse3, x_tgt3, x_sum3, sum_m3, rho3 = _cpp.token_smooth_forward(x, y, IGNORE, a, need_rho=False)
    assert rho3 is None
    for got, want in ((lse3, lse), (x_tgt3, x_tgt), (x_sum3, x_sum), (sum_m3, sum_m)):
        assert torch.equal(got, want)


def check_launchers(shape, dtype, strided=False):
    """Every launcher on one case; also run by the generic-variant subprocess."""
    from rag_fast.ops.rag_losses import cpp as _cpp

    B, K, T, V = shape
    x, a, y, lse = _inputs(B, K, T, V, dtype, strided=strided)
    f32 = torch.float32

    lse2, x_tgt, x_sum = _cpp.row_stats(x, y, IGNORE)
    _check(lse2, lambda ft: torch.logsumexp(x.to(ft), -1), f32, "row_stats lse")
    _check(x_sum, lambda ft: x.to(ft).sum(-1), f32, "row_stats x_sum")
    safe = torch.where(y == IGNORE, 0, y)[:, None, :, None].expand(-1, K, -1, 1)
    tgt = torch.where((y == IGNORE)[:, None], 0.0, x.gather(-1, safe).squeeze(-1).float())
    assert torch.equal(x_tgt, tgt), "row_stats x_tgt"

    sum_m, rho = _cpp.token_smooth_stats(x, a, lse)
    _check(sum_m, lambda ft: _terms(x, a, lse, ft)[2].sum(-1), f32, "token_smooth_stats sum_m")
    _check(rho, lambda ft: _terms(x, a, lse, ft)[1].sum(-1), f32, "token_smooth_stats rho")
    if K > 1:
        assert (rho[0, -1] == 0).all(), "a missing passage must get rho == 0 exactly"

    check_smooth_forward(x, a, y)

    marginal = _cpp.token_marginal(x, a, lse)
    _check(marginal, lambda ft: _terms(x, a, lse, ft)[2], f32, "token_marginal")

    c_p, c_y, c_1, c_r = _coefs(B, K, T)
    oh = _onehot(y, K, V)

    def coef(c, ft):
        return c.to(ft)[..., None]

    out = torch.empty_like(x)
    _cpp.row_grad(x, y, IGNORE, lse, c_p, c_y, c_1, out)
    _check(out, lambda ft: coef(c_p, ft) * _terms(x, a, lse, ft)[0] + coef(c_y, ft) * oh.to(ft)
           + coef(c_1, ft), dtype, "row_grad")

    def smooth_grad(ft):
        P, R, _ = _terms(x, a, lse, ft)
        return (coef(c_p, ft) * P + coef(c_y, ft) * oh.to(ft) + coef(c_1, ft)
                + c_r.to(ft)[:, None, :, None] * R)

    out = torch.empty_like(x)
    _cpp.token_smooth_grad(x, y, IGNORE, a, lse, c_p, c_y, c_1, c_r, out)
    _check(out, smooth_grad, dtype, "token_smooth_grad")

    g_m = torch.randn(B, T, V, generator=torch.Generator().manual_seed(2))

    def marginal_grad(ft):
        P, R, _ = _terms(x, a, lse, ft)
        c = (R * g_m.to(ft)[:, None]).sum(-1)
        return c, R * g_m.to(ft)[:, None] - P * c[..., None]

    out = torch.empty_like(x)
    c = _cpp.token_marginal_grad(x, a, lse, marginal, g_m, out)
    _check(c, lambda ft: marginal_grad(ft)[0], f32, "token_marginal_grad c")
    _check(out, lambda ft: marginal_grad(ft)[1], dtype, "token_marginal_grad out")


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_launchers_match_float64(shape, dtype):
    check_launchers(shape, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_non_contiguous_rows(dtype):
    # Row stride V + 5: the kernels must use the given strides, not assume V.
    check_launchers((2, 3, 3, 37), dtype, strided=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grad_into_aliased_and_strided_out(dtype):
    from rag_fast.ops.rag_losses import cpp as _cpp

    B, K, T, V = 2, 3, 4, 1003
    x, a, y, lse = _inputs(B, K, T, V, dtype)
    c_p, c_y, c_1, c_r = _coefs(B, K, T)
    expected = _cpp.token_smooth_grad(x, y, IGNORE, a, lse, c_p, c_y, c_1, c_r,
                                      torch.empty_like(x))
    # inplace_grad: out is x itself (the target entries are read before they are overwritten).
    inplace = x.clone()
    _cpp.token_smooth_grad(inplace, y, IGNORE, a, lse, c_p, c_y, c_1, c_r, inplace)
    assert torch.equal(inplace, expected)
    # out with its own strides: [B, T, K, V] storage seen as [B, K, T, V].
    out = torch.empty(B, T, K, V, dtype=dtype).transpose(1, 2)
    _cpp.token_smooth_grad(x, y, IGNORE, a, lse, c_p, c_y, c_1, c_r, out)
    assert torch.equal(out, expected)

    g_m = torch.randn(B, T, V)
    marginal = _cpp.token_marginal(x, a, lse)
    expected = torch.empty_like(x)
    c = _cpp.token_marginal_grad(x, a, lse, marginal, g_m, expected)
    inplace = x.clone()
    c2 = _cpp.token_marginal_grad(inplace, a, lse, marginal, g_m, inplace)
    assert torch.equal(inplace, expected) and torch.equal(c, c2)


def test_very_unlikely_entries_keep_their_log_prob():
    # Every passage gives some entries a log-prob near -100: the marginal there must still be
    # finite and exact (the kernels switch to a max-shifted sum for those vectors).
    from rag_fast.ops.rag_losses import cpp as _cpp

    B, K, T, V = 1, 3, 2, 300
    x, a, _, _ = _inputs(B, K, T, V, torch.float32, missing=False)
    x[..., 40:80] = -120.0
    lse, _, _ = _cpp.row_stats(x, None, IGNORE)
    marginal = _cpp.token_marginal(x, a, lse)
    assert torch.isfinite(marginal).all()
    _check(marginal, lambda ft: _terms(x, a, lse, ft)[2], torch.float32, "token_marginal")
    sum_m, rho = _cpp.token_smooth_stats(x, a, lse)
    _check(sum_m, lambda ft: _terms(x, a, lse, ft)[2].sum(-1), torch.float32, "sum_m")
    _check(rho, lambda ft: _terms(x, a, lse, ft)[1].sum(-1), torch.float32, "rho")
    check_smooth_forward(x, a, None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 5, 2, 50265), (2, 3, 3, 1003), (1, 1, 1, 300)])
def test_peaked_logits(shape, dtype):
    # Logits scaled by 30, as peaked as a trained model's: most entries have log-probs far
    # below -87 under every passage, where exp underflows. The marginal there must still be
    # exact (max-shifted path, relative to max_k (a + x - lse)), never -inf, in every kernel.
    from rag_fast.ops.rag_losses import cpp as _cpp

    B, K, T, V = shape
    g = torch.Generator().manual_seed(3)
    x = (30 * torch.randn(B, K, T, V, generator=g)).to(dtype)
    scores = torch.randn(B, K, generator=g)
    if K > 1:
        scores[0, 0] = float("-inf")
    a = torch.log_softmax(scores, dim=1)
    y = torch.randint(0, V, (B, T), generator=g)
    lse, _, _ = _cpp.row_stats(x, y, IGNORE)
    marginal = _cpp.token_marginal(x, a, lse)
    assert torch.isfinite(marginal).all()
    assert float(marginal.min()) < -120  # far below exp's range: the underflow branch ran
    _check(marginal, lambda ft: _terms(x, a, lse, ft)[2], torch.float32, "token_marginal")
    check_smooth_forward(x, a, y)
    c_p, c_y, c_1, c_r = _coefs(B, K, T)
    oh = _onehot(y, K, V)

    def smooth_grad(ft):
        P, R, _ = _terms(x, a, lse, ft)
        return (c_p.to(ft)[..., None] * P + c_y.to(ft)[..., None] * oh.to(ft)
                + c_1.to(ft)[..., None] + c_r.to(ft)[:, None, :, None] * R)

    out = _cpp.token_smooth_grad(x, y, IGNORE, a, lse, c_p, c_y, c_1, c_r, torch.empty_like(x))
    _check(out, smooth_grad, dtype, "token_smooth_grad")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nan_propagates(dtype):
    from rag_fast.ops.rag_losses import cpp as _cpp

    B, K, T, V = 2, 3, 2, 70
    x, a, y, _ = _inputs(B, K, T, V, dtype)
    x[1, 0, 1, 5] = float("nan")
    lse, _, x_sum = _cpp.row_stats(x, y, IGNORE)
    assert lse[1, 0, 1].isnan() and x_sum[1, 0, 1].isnan()
    assert lse.isnan().sum() == 1
    sum_m, rho = _cpp.token_smooth_stats(x, a, lse)
    assert sum_m[1, 1].isnan() and sum_m.isnan().sum() == 1
    assert rho[1, :, 1].isnan().all() and rho.isnan().sum() == K
    _, _, _, sum_m, rho = _cpp.token_smooth_forward(x, y, IGNORE, a)
    assert sum_m[1, 1].isnan() and sum_m.isnan().sum() == 1
    assert rho[1, :, 1].isnan().all() and rho.isnan().sum() == K
    marginal = _cpp.token_marginal(x, a, lse)
    assert marginal[1, 1].isnan().all() and marginal.isnan().sum() == V
    c_p, c_y, c_1, c_r = _coefs(B, K, T)
    out = _cpp.token_smooth_grad(x, y, IGNORE, a, lse, c_p, c_y, c_1, c_r, torch.empty_like(x))
    assert out[1, :, 1].isnan().all() and out.isnan().sum() == K * V


@pytest.mark.parametrize("variant", SIMD_VARIANTS)
def test_every_variant_on_long_rows(variant):
    # Each variant this CPU can run, forced with RAG_FAST_SIMD in a subprocess, on every shape
    # including V = 50265 (the long-row paths: block rescaling, many tiles, the vector tail)
    # and the peaked logits (the max-shifted path), in fp32 and bf16, under the tolerance rule.
    run_in_simd_variant(variant, (
        "import torch, test_cpp_kernels as t\n"
        "for dtype in (torch.float32, torch.bfloat16):\n"
        "    for shape in t.SHAPES:\n"
        "        t.check_launchers(shape, dtype)\n"
        "    t.test_peaked_logits((1, 5, 2, 50265), dtype)\n"
        "t.check_launchers((2, 3, 3, 37), torch.float32, strided=True)\n"
        "print('ok')\n"
    ))


def _smooth_forward_outputs(x, a, y, threads):
    import rag_fast._C as C
    from rag_fast.ops.rag_losses import cpp as _cpp

    before = C.num_threads()
    C.set_num_threads(threads)
    try:
        return _cpp.token_smooth_forward(x, y, IGNORE, a)
    finally:
        C.set_num_threads(before)


def test_fused_forward_scratch_is_bounded_and_exact():
    # The fused forward keeps a K x V buffer of exps per thread only while all of them fit in
    # 16 MiB (csrc/rag_losses.cpp, kScratchBytes); other threads recompute each block. K * V * 4 =
    # 12 MB here: with two threads one pair in two is computed each way, and every output must
    # equal, bit for bit, the one-thread run (one buffer, never recomputed).
    B, K, T, V = 2, 3, 2, 1_000_003
    x, a, y, _ = _inputs(B, K, T, V, torch.float32)
    one = _smooth_forward_outputs(x, a, y, threads=1)
    two = _smooth_forward_outputs(x, a, y, threads=2)
    for name, got, want in zip(("lse", "x_tgt", "x_sum", "sum_m", "rho"), two, one):
        assert torch.equal(got, want), f"token_smooth_forward {name}: differs between paths"


def test_fused_forward_without_any_buffer():
    # K * V * 4 = 18 MB: larger than the whole budget, so every block is recomputed in pass 2.
    B, K, T, V = 1, 5, 2, 900_001
    x, a, y, _ = _inputs(B, K, T, V, torch.float32)
    check_smooth_forward(x, a, y)


def test_every_registered_kernel_checks_its_argument_count():
    """The bindings come from the kernels' own registrations (csrc/registry.h): each takes
    one int per field of its Args struct, and a call with another count is a TypeError naming
    the kernel, not a read of arguments that were never passed."""
    from rag_fast import _ext

    C = _ext.get()
    fields = {"row_stats": 14, "row_grad": 19, "token_smooth_forward": 17,
              "token_smooth_stats": 13, "token_smooth_grad": 21, "token_marginal": 12,
              "token_marginal_grad": 18, "inner_products": 9, "rag_token_beam_step": 16}
    for name, n in fields.items():
        with pytest.raises(TypeError, match=rf"rag_fast\._C\.{name} takes {n} int arguments, "
                                            rf"got {n - 1}"):
            getattr(C, name)(*([0] * (n - 1)))
