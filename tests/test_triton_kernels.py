"""The Triton launchers of rag_fast.kernels.rag_losses, each against its formula from the
contract (rag_fast/ops/rag_losses.py) written in plain PyTorch and evaluated in float64, under the
tolerance rule of tests/utils.py; then the public ops end to end with impl="triton".

On the CPU these run through Triton's interpreter (conftest.py sets TRITON_INTERPRET=1), whose
tiles hold 32 elements and whose launchers split the vocabulary as if the device had 8
programs to fill: a row of V = 70 becomes two chunks of 35 (a full tile and a ragged one
each), the K = 3 rows of a position with V = 33 two chunks of 17, V = 7 one partial tile,
V = 1 a single entry. Shapes stay tiny because the interpreter is slow.
"""
from __future__ import annotations

import pytest
import torch

import rag_fast
from rag_fast import reference as ref
from utils import assert_close_rule, requires_cuda, requires_triton

pytestmark = requires_triton

IGNORE = -100
NEG_INF = float("-inf")
F32 = torch.float32


@pytest.fixture(autouse=True)
def float32_factories():
    """Tensor factories here make float32 even if another test module changed the default."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(F32)
    yield
    torch.set_default_dtype(previous)


# (B, K, T, V), logits layout, and the branch each case is for.
CASES = {
    "one_passage": ((2, 1, 3, 7), False),  # K = 1: one pass of the loop over k; one tile
    "one_position": ((2, 3, 1, 70), True),  # T = 1; strided rows; rows split in two chunks
    "vocab_one": ((1, 3, 2, 1), True),  # V = 1: P = 1, M = a + 0
    "missing_passage": ((2, 3, 2, 33), False),  # a = -inf for passage 2 of question 0;
    # the K = 3 rows of a position split in two chunks
}


def make_inputs(case: str, seed: int = 0, dtype: torch.dtype = F32):
    """Logits x ``[B, K, T, V]``, targets y ``[B, T]`` (some ignored), log-prior a ``[B, K]``."""
    (B, K, T, V), strided = CASES[case]
    g = torch.Generator().manual_seed(seed)
    if strided:
        # Row strides (K*(V+3), V+3, B*K*(V+3)) with stride 1 along V.
        x = (torch.randn(T, B, K, V + 3, generator=g) * 3).permute(1, 2, 0, 3)[..., :V]
        assert not x.is_contiguous() and x.stride(-1) == 1
    else:
        x = torch.randn(B, K, T, V, generator=g) * 3
    scores = torch.randn(B, K, generator=g)
    if case == "missing_passage":
        scores[0, 2] = NEG_INF
    y = torch.randint(0, V, (B, T), generator=g)
    y[0, 0] = IGNORE
    return x.to(dtype), y, torch.log_softmax(scores, dim=1)


def fresh_like(x: torch.Tensor) -> torch.Tensor:
    """An output buffer with strides of its own (T outermost), stride 1 along V."""
    B, K, T, V = x.shape
    return torch.empty(T, B, K, V, dtype=x.dtype).permute(1, 2, 0, 3)


def rand_coeffs(shape, seed: int, expand_last: bool = False) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if expand_last:  # an expanded (stride 0) tensor, as autograd can hand over
        return torch.randn(*shape[:-1], 1, generator=g).expand(shape)
    return torch.randn(shape, generator=g)


# ---- the contract's formulas, in whatever dtype they are given -------------------------------


def onehot(y: torch.Tensor, V: int, dtype: torch.dtype, ignore: int = IGNORE) -> torch.Tensor:
    """``[B, 1, T, V]``: one at the target, zero on ignored positions."""
    valid = y != ignore
    hot = torch.nn.functional.one_hot(torch.where(valid, y, 0), V).to(dtype)
    return (hot * valid[..., None])[:, None]


def row_stats_formula(x, y, ignore=IGNORE):
    B, K, T, V = x.shape
    valid = (y != ignore)[:, None]
    idx = torch.where(y != ignore, y, 0)[:, None, :, None].expand(B, K, T, 1)
    x_tgt = torch.where(valid, x.gather(-1, idx).squeeze(-1), 0.0)
    return torch.logsumexp(x, -1), x_tgt, x.sum(-1)


def posteriors(x, a, lse):
    """``(P, M, R)``: token distribution, marginal log-probs, passage posterior per entry."""
    z = a[:, :, None, None] + x - lse[..., None]
    M = torch.logsumexp(z, dim=1)  # [B, T, V]
    R = torch.where(M[:, None] == NEG_INF, 0.0, torch.exp(z - M[:, None]))
    return torch.exp(x - lse[..., None]), M, R


def plain_and_oracle(formula, *args):
    """The formula in float32 (the plain version) and in float64 (the oracle)."""
    to = lambda t, dt: t.to(dt) if isinstance(t, torch.Tensor) and t.is_floating_point() else t
    return formula(*(to(t, F32) for t in args)), formula(*(to(t, torch.float64) for t in args))


def check(actual, plain, oracle, what, dtype=F32, atol=0.0):
    for i, (a_, p_, o_) in enumerate(zip(actual, plain, oracle)):
        assert_close_rule(a_, p_, o_, dtype, f"{what}[{i}]", atol=atol)


def cancelling_atol(case: str) -> float:
    """At V = 1, M = logsumexp_k a_k is 0 up to the rounding of the O(1) log-priors: an
    absolute floor of a few float32 units of 1 there (tests/utils.py), none elsewhere."""
    return 1e-6 if CASES[case][0][3] == 1 else 0.0


def kernels():
    from rag_fast.kernels import rag_losses

    return rag_losses


# ---- launchers ---------------------------------------------------------------------------


@pytest.mark.parametrize("case", list(CASES))
def test_row_stats(case):
    x, y, _ = make_inputs(case)
    K = kernels()
    check(K.row_stats(x, y, IGNORE), *plain_and_oracle(row_stats_formula, x, y), "row_stats")
    # Ascending rows: the running max grows with every tile, so the running sum is rescaled.
    x_up = x.sort(-1).values * 4
    check(K.row_stats(x_up, y, IGNORE), *plain_and_oracle(row_stats_formula, x_up, y),
          "row_stats, ascending")
    # Without targets x_tgt is 0 (the marginal's forward).
    lse, x_tgt, _ = K.row_stats(x, None, IGNORE)
    assert (x_tgt == 0).all()
    assert_close_rule(lse, x.logsumexp(-1), x.double().logsumexp(-1), F32, "lse, no targets")


@pytest.mark.parametrize("alias", [False, True], ids=["out", "aliased"])
@pytest.mark.parametrize("case", list(CASES))
def test_row_grad(case, alias):
    x, y, _ = make_inputs(case)
    B, K_, T, V = x.shape
    lse = x.logsumexp(-1)
    c_p, c_y = rand_coeffs((B, K_, T), 1), rand_coeffs((B, K_, T), 2)
    c_1 = rand_coeffs((B, K_, T), 3, expand_last=True)

    def formula(x, lse, c_p, c_y, c_1):
        P = torch.exp(x - lse[..., None])
        return (c_p[..., None] * P + c_y[..., None] * onehot(y, V, x.dtype) + c_1[..., None],)

    plain, oracle = plain_and_oracle(formula, x, lse, c_p, c_y, c_1)
    out = x if alias else fresh_like(x)
    got = kernels().row_grad(x, y, IGNORE, lse, c_p, c_y, c_1, out)
    assert got is out and got.dtype == x.dtype
    check((out,), plain, oracle, "row_grad")

    # Without targets: no one-hot term.
    x2, _, _ = make_inputs(case)
    out2 = kernels().row_grad(x2, None, IGNORE, lse, c_p, c_y, c_1, fresh_like(x2))
    expected = c_p[..., None] * torch.softmax(x2.double(), -1) + c_1[..., None].double()
    assert_close_rule(out2, expected.float(), expected, F32, "row_grad, no targets")


def test_ignore_index_inside_vocabulary():
    # transformers masks with pad_token_id, a real vocabulary entry: no target term there.
    pad = 1
    x, y, a = make_inputs("one_position")
    y[:, 0] = pad
    B, K_, T, V = x.shape
    K = kernels()
    stats = K.row_stats(x, y, pad)
    assert (stats[1][:, :, 0] == 0).all()
    check(stats, *plain_and_oracle(row_stats_formula, x, y, pad), "row_stats, pad")
    lse = stats[0]
    c_p, c_y, c_1 = (rand_coeffs((B, K_, T), s) for s in (1, 2, 3))
    c_r = rand_coeffs((B, T), 4)
    P, _, R = posteriors(x.double(), a.double(), lse.double())
    hot = onehot(y, V, torch.float64, pad)
    expected = c_p[..., None] * P + c_y[..., None] * hot + c_1[..., None]
    out = K.row_grad(x, y, pad, lse, c_p, c_y, c_1, fresh_like(x))
    assert_close_rule(out, expected.float(), expected, F32, "row_grad, pad")
    expected = expected + c_r[:, None, :, None] * R
    out = K.token_smooth_grad(x, y, pad, a, lse, c_p, c_y, c_1, c_r, fresh_like(x))
    assert_close_rule(out, expected.float(), expected, F32, "token_smooth_grad, pad")


@pytest.mark.parametrize("case", list(CASES))
def test_token_smooth_stats(case):
    x, _, a = make_inputs(case)
    lse = x.logsumexp(-1)

    def formula(x, a, lse):
        _, M, R = posteriors(x, a, lse)
        return M.sum(-1), R.sum(-1)

    check(kernels().token_smooth_stats(x, a, lse), *plain_and_oracle(formula, x, a, lse),
          "token_smooth_stats", atol=cancelling_atol(case))


@pytest.mark.parametrize("alias", [False, True], ids=["out", "aliased"])
@pytest.mark.parametrize("case", list(CASES))
def test_token_smooth_grad(case, alias):
    x, y, a = make_inputs(case)
    B, K_, T, V = x.shape
    lse = x.logsumexp(-1)
    c_p, c_y, c_1 = (rand_coeffs((B, K_, T), s) for s in (1, 2, 3))
    c_r = rand_coeffs((B, T), 4, expand_last=True)

    def formula(x, a, lse, c_p, c_y, c_1, c_r):
        P, _, R = posteriors(x, a, lse)
        hot = onehot(y, V, x.dtype)
        return (c_p[..., None] * P + c_y[..., None] * hot + c_1[..., None]
                + c_r[:, None, :, None] * R,)

    plain, oracle = plain_and_oracle(formula, x, a, lse, c_p, c_y, c_1, c_r)
    out = x if alias else fresh_like(x)
    got = kernels().token_smooth_grad(x, y, IGNORE, a, lse, c_p, c_y, c_1, c_r, out)
    assert got is out
    check((out,), plain, oracle, "token_smooth_grad")


@pytest.mark.parametrize("case", list(CASES))
def test_token_marginal(case):
    x, _, a = make_inputs(case)
    lse = x.logsumexp(-1)
    M = kernels().token_marginal(x, a, lse)
    assert M.dtype == F32 and M.is_contiguous()
    check((M,), *plain_and_oracle(lambda *t: (posteriors(*t)[1],), x, a, lse), "token_marginal",
          atol=cancelling_atol(case))


@pytest.mark.parametrize("alias", [False, True], ids=["out", "aliased"])
@pytest.mark.parametrize("case", list(CASES))
def test_token_marginal_grad(case, alias):
    x, _, a = make_inputs(case)
    B, _, T, V = x.shape
    lse = x.logsumexp(-1)
    g_m = rand_coeffs((B, T, V), 5)
    M = posteriors(x, a, lse)[1]

    def formula(x, a, lse, g_m):
        P, _, R = posteriors(x, a, lse)
        c = (R * g_m[:, None]).sum(-1)  # [B, K, T]
        return R * g_m[:, None] - P * c[..., None], c

    plain, oracle = plain_and_oracle(formula, x, a, lse, g_m)
    out = x if alias else fresh_like(x)
    c = kernels().token_marginal_grad(x, a, lse, M, g_m, out)
    check((out, c), plain, oracle, "token_marginal_grad")


@pytest.mark.parametrize("num_splits", [1, 3])
def test_results_do_not_depend_on_the_vocabulary_split(num_splits):
    # On a GPU the launchers split each row (or (b, t) position) into vocabulary chunks when
    # there are few of them (T = 1, small batches) and combine the chunks' partial results.
    # Forced here: one chunk, and three (V = 70: chunks of 24, 24, 22, none a tile multiple).
    x, y, a = make_inputs("one_position")
    B, K_, T, V = x.shape
    K = kernels()
    kw = dict(num_splits=num_splits)
    check(K.row_stats(x, y, IGNORE, **kw), *plain_and_oracle(row_stats_formula, x, y),
          "row_stats")
    lse = x.logsumexp(-1)

    def smooth(x, a, lse):
        _, M, R = posteriors(x, a, lse)
        return M.sum(-1), R.sum(-1)

    check(K.token_smooth_stats(x, a, lse, **kw), *plain_and_oracle(smooth, x, a, lse),
          "token_smooth_stats")
    g_m = rand_coeffs((B, T, V), 5)
    M = K.token_marginal(x, a, lse, **kw)
    check((M,), *plain_and_oracle(lambda *t: (posteriors(*t)[1],), x, a, lse), "token_marginal")

    def marginal_grad(x, a, lse, g_m):
        P, _, R = posteriors(x, a, lse)
        c = (R * g_m[:, None]).sum(-1)
        return R * g_m[:, None] - P * c[..., None], c

    out = fresh_like(x)
    c = K.token_marginal_grad(x, a, lse, M, g_m, out, **kw)
    check((out, c), *plain_and_oracle(marginal_grad, x, a, lse, g_m), "token_marginal_grad")
    with pytest.raises(ValueError, match="num_splits must be None or >= 1, got 0"):
        K.row_stats(x, y, IGNORE, num_splits=0)


def test_vocabulary_split_fills_the_gpu(monkeypatch):
    # An H200 (132 multiprocessors): at T = 1 and small batches the (b, t) and row programs
    # alone are far fewer than the multiprocessors; the split makes up the difference, with
    # chunks of at least 256 entries; a large batch is not split.
    K = kernels()
    monkeypatch.setattr(K, "interpreter_enabled", lambda: False)
    monkeypatch.setattr(K, "_target_programs", lambda device: 4 * 132)
    V = 50265
    for groups in (1, 2, 8, 40, 160):  # (b, t) positions at T = 1, or rows B * W * K
        n = K.split_vocabulary(groups, V, torch.device("cuda"))
        assert groups * n >= 132 and V / n >= 256, (groups, n)
    assert K.split_vocabulary(8 * 128, V, torch.device("cuda")) == 1  # B = 8, T = 128
    assert K.split_vocabulary(1, 300, torch.device("cuda")) == 1  # one chunk's worth


def test_vocabulary_entry_masked_in_every_passage():
    # x = -inf at v = 0 everywhere: M = -inf there, R = P = 0, and no NaN anywhere.
    x, y, a = make_inputs("missing_passage")
    x[..., 0] = NEG_INF
    y[y == 0] = 1
    B, K_, T, V = x.shape
    K = kernels()
    lse = K.row_stats(x, y, IGNORE)[0]
    M = K.token_marginal(x, a, lse)
    assert (M[..., 0] == NEG_INF).all() and torch.isfinite(M[..., 1:]).all()
    sum_m, rho = K.token_smooth_stats(x, a, lse)
    assert (sum_m == NEG_INF).all() and torch.isfinite(rho).all()
    ones = torch.ones(B, K_, T)
    grad = K.token_smooth_grad(x, y, IGNORE, a, lse, ones, ones, ones, torch.ones(B, T),
                               fresh_like(x))
    c = K.token_marginal_grad(x, a, lse, M, torch.ones(B, T, V), fresh_like(x))
    assert torch.isfinite(grad).all() and torch.isfinite(c).all()
    _, _, R = posteriors(x.double(), a.double(), lse.double())
    assert_close_rule(rho, R.sum(-1).float(), R.sum(-1), F32, "rho, masked entry")


def test_nan_logits_propagate_to_their_rows_only():
    x, y, a = make_inputs("missing_passage")
    B, K_, T, V = x.shape
    x[1, 0, 0, 2] = float("nan")
    y[1, 0] = 2
    K = kernels()
    row = torch.zeros(B, K_, T, dtype=torch.bool)
    row[1, 0, 0] = True  # the row holding the NaN
    pos = torch.zeros(B, T, dtype=torch.bool)
    pos[1, 0] = True  # its (b, t): every passage's R and M there

    def assert_nan_exactly(t: torch.Tensor, where: torch.Tensor, what: str):
        where = where.reshape(where.shape + (1,) * (t.dim() - where.dim())).expand_as(t)
        assert torch.isnan(t[where]).all(), f"{what}: NaN lost"
        assert not torch.isnan(t[~where]).any(), f"{what}: NaN leaked"

    lse, x_tgt, x_sum = K.row_stats(x, y, IGNORE)
    for name, t in (("lse", lse), ("x_tgt", x_tgt), ("x_sum", x_sum)):
        assert_nan_exactly(t, row, name)
    ones = torch.ones(B, K_, T)
    assert_nan_exactly(K.row_grad(x, y, IGNORE, lse, ones, ones, ones, fresh_like(x)), row,
                       "row_grad")
    pos_rows = pos[:, None].expand(B, K_, T)
    sum_m, rho = K.token_smooth_stats(x, a, lse)
    assert_nan_exactly(sum_m, pos, "sum_m")
    assert_nan_exactly(rho, pos_rows, "rho")
    M = K.token_marginal(x, a, lse)
    assert_nan_exactly(M, pos, "M")
    grad = K.token_smooth_grad(x, y, IGNORE, a, lse, ones, ones, ones, torch.ones(B, T),
                               fresh_like(x))
    assert_nan_exactly(grad, pos_rows, "token_smooth_grad")
    out = fresh_like(x)
    c = K.token_marginal_grad(x, a, lse, M, torch.ones(B, T, V), out)
    assert_nan_exactly(c, pos_rows, "c")
    assert_nan_exactly(out, pos_rows, "token_marginal_grad")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_logits(dtype):
    # Statistics accumulate in float32 from half-precision loads; gradients come back in the
    # logits' dtype. Plain version: the formula in that dtype.
    x, y, a = make_inputs("one_position", dtype=dtype)
    B, K_, T, V = x.shape
    K = kernels()
    lse, x_tgt, x_sum = K.row_stats(x, y, IGNORE)
    oracle = row_stats_formula(x.double(), y)
    plain = (torch.logsumexp(x, -1), row_stats_formula(x, y)[1], x.sum(-1))
    check((lse, x_tgt, x_sum), plain, oracle, f"row_stats {dtype}", dtype)
    c_p, c_y, c_1 = (rand_coeffs((B, K_, T), s) for s in (1, 2, 3))
    c_r = rand_coeffs((B, T), 4)
    out = K.token_smooth_grad(x, y, IGNORE, a, lse, c_p, c_y, c_1, c_r, fresh_like(x))
    assert out.dtype == dtype
    P, _, R = posteriors(x.double(), a.double(), lse.double())
    expected = (c_p[..., None] * P + c_y[..., None] * onehot(y, V, torch.float64)
                + c_1[..., None] + c_r[:, None, :, None] * R)
    plain = expected.to(dtype)  # the best a result stored in this dtype can do
    assert_close_rule(out, plain, expected, dtype, f"token_smooth_grad {dtype}")


# ---- the public ops with impl="triton" ---------------------------------------------------


def loss_and_grads(fn, logits, scores, targets, upstream, **kw):
    x = logits.clone().requires_grad_()
    s = scores.clone().requires_grad_()
    # inplace_grad writes the gradient over its input: give it an intermediate, not the leaf.
    x_in = x.clone() if kw.get("inplace_grad") else x
    out = fn(x_in, s, targets, **kw) if targets is not None else fn(x_in, s, **kw)
    out.backward(upstream.to(out.dtype))
    return out.detach(), x.grad, s.grad


def op_inputs(B, K, T, V, seed=0, missing=True):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, K, T, V, generator=g) * 3
    scores = torch.randn(B, K, generator=g)
    if missing:
        scores[0, -1] = NEG_INF  # a missing passage
    targets = torch.randint(0, V, (B, T), generator=g)
    targets[0, 0] = IGNORE
    if B > 1:
        targets[-1] = IGNORE  # every target of the last question ignored
    return logits, scores, targets


OPS = {
    "token": (rag_fast.rag_token_nll, ref.rag_token_nll),
    "sequence": (rag_fast.rag_sequence_nll, ref.rag_sequence_nll),
    "marginal": (rag_fast.rag_token_marginal, ref.rag_token_marginal),
}


@pytest.mark.parametrize(
    "kind,kw",
    [
        ("token", dict(epsilon=0.0)),
        ("token", dict(epsilon=0.1, exclude_bos=True)),
        ("token", dict(epsilon=0.1, reduction="sum", inplace_grad=True)),
        ("sequence", dict(epsilon=0.0, reduction="mean")),
        ("sequence", dict(epsilon=0.1, inplace_grad=True)),
        ("marginal", dict()),
    ],
    ids=["token", "token_smooth_bos", "token_smooth_sum_inplace", "sequence_mean",
         "sequence_smooth_inplace", "marginal"],
)
def test_ops_end_to_end(kind, kw):
    logits, scores, targets = op_inputs(B=2, K=3, T=3, V=19)
    fn, ref_fn = OPS[kind]
    targets = None if kind == "marginal" else targets
    ref_kw = {k: v for k, v in kw.items() if k != "inplace_grad"}
    g = torch.Generator().manual_seed(1)
    if kind == "marginal":
        upstream = torch.randn(2, 3, 19, generator=g)
    else:
        upstream = torch.randn(2, generator=g) if "reduction" not in kw else torch.tensor(0.7)
    oracle = loss_and_grads(ref_fn, logits.double(), scores.double(), targets,
                            upstream.double(), **ref_kw)
    plain = loss_and_grads(ref_fn, logits, scores, targets, upstream, **ref_kw)
    actual = loss_and_grads(fn, logits, scores, targets, upstream, impl="triton", **kw)
    for name, a_, p_, o_ in zip(("output", "d logits", "d doc_scores"), actual, plain, oracle):
        assert_close_rule(a_, p_, o_, F32, f"{kind}/{name}")


def test_interpreter_tile_covers_several_tiles_and_a_tail():
    """The interpreter's tile: 32 wide up to chunks of 8 tiles (the tests' small shapes), then
    about an eighth of the chunk, at most 1024 wide; a BART-sized chunk stays several tiles
    with a ragged tail."""
    from rag_fast.kernels.rag_losses import interpreter_block

    assert [interpreter_block(c) for c in (0, 1, 35, 256)] == [32, 32, 32, 32]
    assert [interpreter_block(c) for c in (257, 512, 513, 8192, 10**6)] == [64, 64, 128, 1024, 1024]
    chunk = -(-50265 // 8)
    tiles = -(-chunk // interpreter_block(chunk))
    assert tiles >= 4 and chunk % interpreter_block(chunk) != 0


def test_ops_flat_layout_one_passage_one_position():
    # [B*K, T, V] with n_docs, K = 1, T = 1, V = 1.
    for V in (1, 7):
        logits, scores, targets = op_inputs(B=2, K=1, T=1, V=V, missing=False)
        targets[-1] = 0
        flat = logits.reshape(2, 1, V)
        for fn, ref_fn in (OPS["token"], OPS["sequence"]):
            up = torch.ones(2)
            actual = loss_and_grads(fn, flat, scores, targets, up, n_docs=1, epsilon=0.1,
                                    impl="triton")
            oracle = loss_and_grads(ref_fn, flat.double(), scores.double(), targets,
                                    up.double(), n_docs=1, epsilon=0.1)
            plain = loss_and_grads(ref_fn, flat, scores, targets, up, n_docs=1, epsilon=0.1)
            for a_, p_, o_ in zip(actual, plain, oracle):
                assert_close_rule(a_, p_, o_, F32, f"{fn.__name__} V={V}")


@pytest.mark.parametrize("kind,eps", [("token", 0.1), ("sequence", 0.1), ("marginal", 0.0)])
def test_ops_at_bart_vocabulary_under_the_rule(kind, eps):
    """Every loss and marginal kernel, forward and every gradient, at BART's V=50265 (many
    tiles, a ragged tail, the vocabulary split across programs) under the per-element rule.
    The interpreter is slow (~30 s a case here), so two rows: the GPU test below runs the
    full shapes in fp32/bf16/fp16. RAG-Token with eps 0.1 runs row_stats, the smoothing pass
    and their gradient; RAG-Sequence row_stats and row_grad; the marginal its own two."""
    logits, scores, targets = op_inputs(B=1, K=2, T=1, V=50265, missing=False)
    fn, ref_fn = OPS[kind]
    kw = {} if kind == "marginal" else {"epsilon": eps}
    targets = None if kind == "marginal" else targets
    shape = (1, 1, 50265) if kind == "marginal" else (1,)
    upstream = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    oracle = loss_and_grads(ref_fn, logits.double(), scores.double(), targets, upstream.double(), **kw)
    plain = loss_and_grads(ref_fn, logits, scores, targets, upstream, **kw)
    actual = loss_and_grads(fn, logits, scores, targets, upstream, impl="triton", **kw)
    for name, a_, p_, o_ in zip(("output", "d logits", "d doc_scores"), actual, plain, oracle):
        assert_close_rule(a_, p_, o_, F32, f"{kind} V=50265 {name}")


# ---- on a GPU only -----------------------------------------------------------------------


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind,eps", [("token", 0.0), ("token", 0.1), ("sequence", 0.1),
                                      ("marginal", 0.0)])
def test_ops_on_gpu_full_vocabulary(dtype, kind, eps):
    # BART's V = 50265: many full tiles and a ragged tail at GPU block sizes.
    logits, scores, targets = op_inputs(B=2, K=5, T=4, V=50265)
    logits, scores, targets = logits.cuda().to(dtype), scores.cuda(), targets.cuda()
    fn, ref_fn = OPS[kind]
    kw = {} if kind == "marginal" else {"epsilon": eps}
    targets = None if kind == "marginal" else targets
    shape = (2, 4, 50265) if kind == "marginal" else (2,)
    upstream = torch.randn(shape, generator=torch.Generator().manual_seed(1)).cuda()
    oracle = loss_and_grads(ref_fn, logits.double(), scores.double(), targets,
                            upstream.double(), **kw)
    plain = loss_and_grads(ref_fn, logits, scores, targets, upstream, **kw)
    actual = loss_and_grads(fn, logits, scores, targets, upstream, impl="triton", **kw)
    assert actual[1].dtype == dtype
    for name, a_, p_, o_ in zip(("output", "d logits", "d doc_scores"), actual, plain, oracle):
        assert_close_rule(a_.cpu(), p_.cpu(), o_.cpu(), dtype, f"{kind}/{dtype}/{name}")


@requires_cuda
def test_launchers_never_synchronise():
    x, y, a = (t.cuda() for t in make_inputs("missing_passage"))
    B, K_, T, V = x.shape
    K = kernels()
    ones = torch.ones(B, K_, T, device="cuda")

    def every_launcher():
        lse, _, _ = K.row_stats(x, y, IGNORE)
        K.row_grad(x, y, IGNORE, lse, ones, ones, ones, torch.empty_like(x))
        K.token_smooth_stats(x, a, lse)
        K.token_smooth_grad(x, y, IGNORE, a, lse, ones, ones, ones, ones[:, 0],
                            torch.empty_like(x))
        M = K.token_marginal(x, a, lse)
        K.token_marginal_grad(x, a, lse, M, torch.ones_like(M), torch.empty_like(x))

    every_launcher()  # compile outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        every_launcher()
    finally:
        torch.cuda.set_sync_debug_mode("default")
