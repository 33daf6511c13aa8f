"""Every impl of the public ops against the float64 reference (forward and gradients), under the
one tolerance rule of tests/utils.py, over shapes that hit every branch."""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import rag_fast
from rag_fast import reference as ref
from utils import assert_close_rule, requires_ext, requires_triton, tolerance_violations

IMPLS = [
    pytest.param("torch", id="torch"),
    pytest.param("cpp", id="cpp", marks=requires_ext),
    pytest.param("triton", id="triton", marks=requires_triton),
]
LOSSES = {
    "token": (rag_fast.rag_token_nll, ref.rag_token_nll),
    "sequence": (rag_fast.rag_sequence_nll, ref.rag_sequence_nll),
}
NEG_INF = float("-inf")


def make_case(B, K, T, V, seed=0, dtype=torch.float32, ignore_frac=0.2, missing=False,
              all_ignored_row=False, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(B, K, T, V, generator=g) * scale).to(dtype)
    scores = torch.randn(B, K, generator=g)
    targets = torch.randint(0, V, (B, T), generator=g)
    targets[torch.rand(B, T, generator=g) < ignore_frac] = -100
    if missing and K > 1:
        scores[0, -1] = NEG_INF  # a missing passage
    if all_ignored_row:
        targets[-1] = -100  # every target of the last question ignored
    return logits, scores, targets


def run(fn, logits, scores, targets, upstream, **kw):
    """Loss and gradients (logits, scores) for the given upstream gradient."""
    x = logits.clone().requires_grad_()
    s = scores.clone().requires_grad_()
    out = fn(x, s, targets, **kw) if targets is not None else fn(x, s, **kw)
    out.backward(upstream.to(out.dtype))
    return out.detach(), x.grad, s.grad


def check_against_reference(kind, impl, logits, scores, targets, **kw):
    """Compare impl with the fp64 oracle, and bound by the plain same-dtype reference."""
    if kind == "marginal":
        fn, ref_fn = rag_fast.rag_token_marginal, ref.rag_token_marginal
        B, _, T, V = logits.shape
        upstream = torch.randn(B, T, V, generator=torch.Generator().manual_seed(1))
    else:
        fn, ref_fn = LOSSES[kind]
        upstream = torch.randn(logits.shape[0], generator=torch.Generator().manual_seed(1))
        if kw.get("reduction", "none") != "none":
            upstream = upstream[0]
    dtype = logits.dtype
    T = logits.shape[2]
    oracle = run(ref_fn, logits.double(), scores.double(), targets, upstream.double(), **kw)
    plain = run(ref_fn, logits, scores, targets, upstream, **kw)
    actual = run(fn, logits, scores, targets, upstream, impl=impl, **kw)
    assert actual[1].dtype == dtype, "the logits' gradient must have the logits' dtype"
    # d doc_scores is a sum of O(1) terms that cancel to about 1e-3: per position, posterior
    # minus prior times the upstream (the losses: T terms per question; the marginal: T*V terms
    # with a random upstream). Float32 rounding of those terms leaves an error of a few units in
    # the last place of their absolute sum, of which the plain version's own error is only one
    # random draw (it may land near 0). Its floor: 4 roundings per term, each term bounded by
    # the upstream's size (|posterior - prior| <= 1).
    unit = torch.finfo(scores.dtype).eps / 2  # the scores' gradient has the scores' dtype
    terms = upstream.abs().sum(dim=(1, 2)) if kind == "marginal" else upstream.abs() * T
    floors = {"d doc_scores": 4 * unit * float(terms.max())}
    if kind != "marginal":
        floors["d logits"] = _target_entry_floor(logits, targets, upstream,
                                                 kw.get("ignore_index", -100))
    for name, a, p, o in zip(("output", "d logits", "d doc_scores"), actual, plain, oracle):
        assert_close_rule(a, p, o, dtype, f"{kind}/{impl}/{name}", atol=floors.get(name, 0.0))


def _target_entry_floor(logits, targets, upstream, ignore_index) -> torch.Tensor:
    """Absolute floor of the logits' gradient, nonzero only at the target entries.

    There the gradient is c_P P_y + c_y (+ the smoothing terms): terms of the size of the
    question's upstream gradient g that cancel to about -c_P (1 - P_y) when a passage is sure of
    its target (P_y near 1, e.g. at V <= 3). Evaluated in the logits' dtype, as torch's own
    cross-entropy (softmax minus one-hot) evaluates it, that leaves an absolute error of a few
    units in the last place of |g| (float32's: the kernels compute in float32 for every logits
    dtype), of which the plain version's own error is only one random draw. Its floor:
    TARGET_ROUNDINGS units of |g|; every other entry keeps the plain rule."""
    B, K, T, V = logits.shape
    unit = torch.finfo(torch.float32).eps / 2
    g = upstream.abs().double().expand(B)  # a reduced loss: one upstream for every question
    floor = torch.zeros(B, K, T, V, dtype=torch.float64)
    valid = (targets != ignore_index) & (targets >= 0) & (targets < V)
    b, t = valid.nonzero(as_tuple=True)
    floor[b, :, t, targets[b, t]] = (TARGET_ROUNDINGS * unit * g[b]).unsqueeze(1)
    return floor.reshape(logits.shape)


# c_P P_y, c_y, the smoothing terms (each at most |g|) and P_y's own rounding: the worst seen
# in 20,000 random draws of test_property_cpp's cases was 3.9 units, each time at a target entry
TARGET_ROUNDINGS = 8


def test_the_target_entry_floor_is_at_the_targets_only():
    logits, _, targets = make_case(B=2, K=3, T=4, V=5, seed=9)
    upstream = torch.tensor([0.5, -2.0])
    floor = _target_entry_floor(logits, targets, upstream, -100)
    unit = torch.finfo(torch.float32).eps / 2
    want = torch.zeros(2, 3, 4, 5, dtype=torch.float64)
    for b in range(2):
        for t in range(4):
            if targets[b, t] != -100:
                want[b, :, t, targets[b, t]] = TARGET_ROUNDINGS * unit * abs(float(upstream[b]))
    assert int((targets != -100).sum()) > 0 and torch.equal(floor, want)
    # an oracle so small that only the floor separates right from wrong
    oracle = torch.full((2, 3, 4, 5), 1e-11, dtype=torch.float64)
    b, t = (targets != -100).nonzero()[0].tolist()
    y = int(targets[b, t])
    for planted, at_target, rejected in ((0.5, True, False), (2.0, True, True),
                                         (0.5, False, True)):
        actual = oracle.clone()
        v = y if at_target else (y + 1) % 5
        actual[b, 1, t, v] += planted * TARGET_ROUNDINGS * unit * abs(float(upstream[b]))
        bad = tolerance_violations(actual, oracle, oracle, torch.float32, floor)
        assert bool(bad.any()) == rejected, (planted, at_target)


# Shapes and the branch each one is for.
CASES = {
    "basic": dict(B=2, K=3, T=5, V=7),
    "vocab_one": dict(B=2, K=2, T=3, V=1),  # lse == x, P == 1
    "one_passage": dict(B=2, K=1, T=4, V=9),  # K = 1: the marginal is the passage itself
    "one_position": dict(B=3, K=3, T=1, V=11),  # T = 1
    "all_ignored": dict(B=2, K=3, T=4, V=5, all_ignored_row=True),  # masked row: zero grads
    "missing_passage": dict(B=2, K=4, T=3, V=13, missing=True),  # -inf score: weight 0
    "vector_tail": dict(B=1, K=2, T=2, V=1000 + 3),  # vector loop plus a scalar tail
}
KINDS = [("token", 0.0), ("token", 0.1), ("sequence", 0.0), ("sequence", 0.1), ("marginal", 0.0)]


def _kw(kind, eps):
    return {} if kind == "marginal" else {"epsilon": eps}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("kind,eps", KINDS)
@pytest.mark.parametrize("case", list(CASES))
def test_matches_reference(impl, kind, eps, case):
    logits, scores, targets = make_case(**CASES[case])
    check_against_reference(kind, impl, logits, scores, None if kind == "marginal" else targets,
                            **_kw(kind, eps))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("kind,eps", [("token", 0.1), ("sequence", 0.1)])
def test_forward_without_grad_equals_forward_with_grad(impl, kind, eps):
    """Under no_grad the op skips statistics only the backward uses: the loss must not change."""
    fn = {"token": rag_fast.rag_token_nll, "sequence": rag_fast.rag_sequence_nll}[kind]
    logits, scores, targets = make_case(B=2, K=3, T=4, V=37, missing=True)
    logits.requires_grad_()
    with_grad = fn(logits, scores, targets, epsilon=eps, impl=impl)
    with torch.no_grad():
        without = fn(logits, scores, targets, epsilon=eps, impl=impl)
    assert torch.equal(with_grad.detach(), without)


@pytest.mark.parametrize("impl", [p for p in IMPLS if p.id != "triton"])  # too slow interpreted
@pytest.mark.parametrize("kind,eps", KINDS)
def test_full_vocabulary(impl, kind, eps):
    # V = 50265 (BART): many vector blocks per row.
    logits, scores, targets = make_case(B=1, K=2, T=2, V=50265)
    check_against_reference(kind, impl, logits, scores, None if kind == "marginal" else targets,
                            **_kw(kind, eps))


@pytest.mark.parametrize("impl", [p for p in IMPLS if p.id != "triton"])  # interpreter: fp32
@pytest.mark.parametrize("kind,eps", KINDS)
def test_bfloat16(impl, kind, eps):
    logits, scores, targets = make_case(B=2, K=3, T=4, V=37, dtype=torch.bfloat16, missing=True)
    check_against_reference(kind, impl, logits, scores, None if kind == "marginal" else targets,
                            **_kw(kind, eps))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("kind,eps", KINDS)
def test_non_contiguous(impl, kind, eps):
    base, scores, targets = make_case(B=2, K=3, T=8, V=10)
    # Row strides that are not (K*T*V, T*V, V): every other position (targets follow).
    logits = base[:, :, ::2]
    assert not logits.is_contiguous()
    check_against_reference(kind, impl, logits, scores,
                            None if kind == "marginal" else targets[:, ::2], **_kw(kind, eps))
    # A vocabulary axis with stride 2: copied to a contiguous layout first.
    wide, _, _ = make_case(B=2, K=3, T=4, V=20)
    check_against_reference(kind, impl, wide[..., ::2], scores,
                            None if kind == "marginal" else targets[:, :4], **_kw(kind, eps))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("kind", ["token", "sequence"])
@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_flat_layout_exclude_bos_and_reductions(impl, kind, reduction):
    logits, scores, targets = make_case(B=3, K=2, T=4, V=6, seed=3)
    fn, ref_fn = LOSSES[kind]
    flat = logits.reshape(6, 4, 6)  # [B*K, T, V] with n_docs
    kw = dict(n_docs=2, epsilon=0.1, exclude_bos=True, reduction=reduction)
    torch.testing.assert_close(fn(flat, scores, targets, impl=impl, **kw),
                               ref_fn(flat.double(), scores.double(), targets, **kw).float(),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("kind", ["token", "sequence"])
def test_exclude_bos_as_a_device_tensor_equals_the_bool(impl, kind):
    """A 0-dim bool tensor (decided on the device, no host read) gives the loss and gradients
    of the Python bool of the same value, for either value."""
    logits, scores, targets = make_case(B=3, K=2, T=4, V=6, seed=5, ignore_frac=0.0)
    fn, _ = LOSSES[kind]
    up = torch.tensor([1.0, -0.5, 2.0])
    for value in (True, False):
        want = run(fn, logits, scores, targets, up, impl=impl, epsilon=0.1, exclude_bos=value)
        got = run(fn, logits, scores, targets, up, impl=impl, epsilon=0.1,
                  exclude_bos=torch.tensor(value))
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=0, atol=0)
    # and the flag matters here, so the comparison above can fail
    assert not torch.equal(fn(logits, scores, targets, impl=impl, exclude_bos=True),
                           fn(logits, scores, targets, impl=impl, exclude_bos=False))


def test_exclude_bos_takes_numpy_bools_and_a_cpu_scalar():
    import numpy as np

    logits, scores, targets = make_case(B=3, K=2, T=4, V=6)
    for fn in (rag_fast.rag_token_nll, rag_fast.rag_sequence_nll, ref.rag_sequence_nll):
        for value in (True, False):
            want = fn(logits, scores, targets, exclude_bos=value)
            torch.testing.assert_close(fn(logits, scores, targets, exclude_bos=np.bool_(value)),
                                       want, rtol=0, atol=0)


_TENSOR_REFUSAL = "0-dim bool tensor on the targets' device \\(cpu\\) or the CPU, got a"


@pytest.mark.parametrize("bad,message", [
    (torch.tensor([True, False, True]), f"{_TENSOR_REFUSAL} torch.bool tensor of shape \\(3,\\)"),
    (torch.tensor(1), f"{_TENSOR_REFUSAL} torch.int64 tensor of shape \\(\\)"),
    (torch.tensor(True, device="meta"), f"{_TENSOR_REFUSAL} torch.bool tensor .* on meta"),
    (1, "0-dim bool tensor, got builtins.int 1"),
    ("yes", "0-dim bool tensor, got builtins.str 'yes'"),
    (None, "0-dim bool tensor, got builtins.NoneType None"),
])
def test_exclude_bos_refuses_what_is_not_a_flag(bad, message):
    logits, scores, targets = make_case(B=3, K=2, T=4, V=6)
    for fn in (rag_fast.rag_token_nll, rag_fast.rag_sequence_nll, ref.rag_sequence_nll):
        with pytest.raises(ValueError, match=f"^exclude_bos must be a bool or a {message}"):
            fn(logits, scores, targets, exclude_bos=bad)
    hidden, weight = torch.randn(6, 4, 5), torch.randn(6, 5)
    with pytest.raises(ValueError, match=f"^exclude_bos must be a bool or a {message}"):
        rag_fast.linear_rag_nll(hidden, weight, scores, targets, mode="sequence",
                                exclude_bos=bad)


@pytest.mark.parametrize("impl", [p for p in IMPLS if p.id != "torch"])
@pytest.mark.parametrize("kind,eps", [("token", 0.0), ("token", 0.1), ("sequence", 0.1)])
def test_inplace_grad_writes_into_the_logits(impl, kind, eps):
    logits, scores, targets = make_case(B=2, K=3, T=4, V=9, seed=4)
    fn, _ = LOSSES[kind]
    expected = run(fn, logits, scores, targets, torch.ones(2), impl=impl, epsilon=eps)[1]
    leaf = logits.clone().requires_grad_()
    x = leaf * 1.0  # non-leaf logits, like a language-model head's output
    fn(x, scores, targets, impl=impl, epsilon=eps, inplace_grad=True).sum().backward()
    torch.testing.assert_close(leaf.grad, expected)
    torch.testing.assert_close(x.detach(), expected)  # the gradient now lives in the logits


# ---- inplace_grad: never a wrong gradient ------------------------------------------------
# The gradient overwrites the logits and bumps their version counter, so autograd refuses any
# later use of the old values; logits that cannot take their own gradient are refused upfront.
KERNEL_IMPLS = [p for p in IMPLS if p.id != "torch"]


def _intermediate_logits(logits):
    leaf = logits.clone().requires_grad_()
    return leaf, leaf * 1.0  # non-leaf logits, like a language-model head's output


@pytest.mark.parametrize("impl", KERNEL_IMPLS)
@pytest.mark.parametrize("first,second", [(("token", 0.0), ("sequence", 0.0)),
                                          (("token", 0.1), ("sequence", 0.1)),
                                          (("token", 0.0), ("token", 0.0))])
def test_inplace_grad_twice_on_the_same_logits_raises(impl, first, second):
    logits, scores, targets = make_case(B=2, K=3, T=4, V=9, seed=5)
    _, x = _intermediate_logits(logits)
    loss = sum(LOSSES[kind][0](x, scores, targets, impl=impl, epsilon=eps,
                               inplace_grad=True).sum() for kind, eps in (first, second))
    with pytest.raises(RuntimeError, match="overwritten after the forward.*inplace_grad=True"):
        loss.backward()


@pytest.mark.parametrize("impl", KERNEL_IMPLS)
@pytest.mark.parametrize("kind,eps", [("token", 0.0), ("token", 0.1), ("sequence", 0.0)])
def test_inplace_grad_second_backward_with_retain_graph_raises(impl, kind, eps):
    logits, scores, targets = make_case(B=2, K=3, T=4, V=9, seed=6)
    _, x = _intermediate_logits(logits)
    loss = LOSSES[kind][0](x, scores, targets, impl=impl, epsilon=eps, inplace_grad=True).sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="overwritten after the forward.*retain_graph=True"):
        loss.backward()


@pytest.mark.parametrize("impl", KERNEL_IMPLS)
@pytest.mark.parametrize("kind,eps", [("token", 0.0), ("token", 0.1), ("sequence", 0.0)])
def test_inplace_grad_on_expanded_or_leaf_logits_is_refused(impl, kind, eps):
    logits, scores, targets = make_case(B=2, K=3, T=4, V=9, seed=7)
    fn = LOSSES[kind][0]
    _, one = _intermediate_logits(logits[:, :1])
    expanded = one.expand(2, 3, 4, 9)  # one passage's logits for all K: shared memory
    with pytest.raises(ValueError, match="inplace_grad=True .* overlap in memory"):
        fn(expanded, scores, targets, impl=impl, epsilon=eps, inplace_grad=True)
    leaf = logits.clone().requires_grad_()
    with pytest.raises(ValueError, match="inplace_grad=True would overwrite the leaf tensor"):
        fn(leaf, scores, targets, impl=impl, epsilon=eps, inplace_grad=True)
    # Without inplace_grad both are fine and agree with the reference.
    expected = run(LOSSES[kind][1], logits[:, :1].expand(2, 3, 4, 9).double(), scores.double(),
                   targets, torch.ones(2, dtype=torch.float64), epsilon=eps)
    leaf, one = _intermediate_logits(logits[:, :1])
    fn(one.expand(2, 3, 4, 9), scores, targets, impl=impl, epsilon=eps).sum().backward()
    torch.testing.assert_close(leaf.grad.double(), expected[1].sum(1, keepdim=True),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("impl", KERNEL_IMPLS)
def test_inplace_grad_after_a_plain_loss_on_the_same_logits_is_right_or_raises(impl):
    """A second loss without inplace_grad on the same logits: whichever backward runs first,
    the gradient is the plain one or autograd refuses; never a wrong one."""
    logits, scores, targets = make_case(B=2, K=3, T=4, V=9, seed=8)
    leaf, x = _intermediate_logits(logits)
    plain = rag_fast.rag_sequence_nll(x, scores, targets, impl=impl).sum()
    (plain + rag_fast.rag_token_nll(x, scores, targets, impl=impl).sum()).backward()
    expected = leaf.grad
    outcomes = set()
    for inplace_first in (True, False):  # autograd runs the later loss's backward first
        leaf, x = _intermediate_logits(logits)
        losses = [lambda: rag_fast.rag_token_nll(x, scores, targets, impl=impl,
                                                 inplace_grad=True).sum(),
                  lambda: rag_fast.rag_sequence_nll(x, scores, targets, impl=impl).sum()]
        a, b = (f() for f in (losses if inplace_first else losses[::-1]))
        try:
            (a + b).backward()
        except RuntimeError as exc:
            assert "inplace_grad=True" in str(exc)
            outcomes.add("raised")
        else:
            torch.testing.assert_close(leaf.grad, expected)
            outcomes.add("right")
    assert outcomes == {"raised", "right"}


@pytest.mark.parametrize("impl", [p for p in IMPLS if p.id != "torch"])
@pytest.mark.parametrize("kind", ["token", "sequence"])
def test_nan_logits_propagate(impl, kind):
    logits, scores, targets = make_case(B=2, K=2, T=3, V=8, ignore_frac=0.0)
    logits[1, 0, 1, 3] = float("nan")
    loss = LOSSES[kind][0](logits, scores, targets, impl=impl, epsilon=0.1)
    assert torch.isnan(loss[1]) and torch.isfinite(loss[0])


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    B=st.integers(1, 3), K=st.integers(1, 4), T=st.integers(1, 4), V=st.integers(1, 70),
    eps=st.sampled_from([0.0, 0.1]), kind=st.sampled_from(["token", "sequence", "marginal"]),
    missing=st.booleans(), seed=st.integers(0, 2**16),
)
def _property(impl, B, K, T, V, eps, kind, missing, seed):
    logits, scores, targets = make_case(B, K, T, V, seed=seed, missing=missing)
    check_against_reference(kind, impl, logits, scores, None if kind == "marginal" else targets,
                            **_kw(kind, eps))


@requires_ext
def test_property_cpp():
    _property("cpp")


@requires_triton
@settings(max_examples=8, deadline=None)
@given(data=st.data())
def test_property_triton(data):
    B, K, T = (data.draw(st.integers(1, 2)) for _ in range(3))
    V = data.draw(st.integers(1, 20))
    kind = data.draw(st.sampled_from(["token", "sequence", "marginal"]))
    eps = data.draw(st.sampled_from([0.0, 0.1]))
    logits, scores, targets = make_case(B, K, T, V, seed=data.draw(st.integers(0, 999)),
                                        missing=data.draw(st.booleans()))
    check_against_reference(kind, "triton", logits, scores,
                            None if kind == "marginal" else targets, **_kw(kind, eps))


# ---- bad input --------------------------------------------------------------------------


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("fn", [rag_fast.rag_token_nll, rag_fast.rag_sequence_nll])
def test_bad_input(impl, fn):
    logits, scores, targets = make_case(B=2, K=3, T=4, V=5)
    with pytest.raises(ValueError, match="logits must be a floating tensor"):
        fn(logits.long(), scores, targets, impl=impl)
    with pytest.raises(ValueError, match=r"targets must have shape \[B, T\]"):
        fn(logits, scores, targets[:, :3], impl=impl)
    with pytest.raises(ValueError, match=r"logits \[B, K, T, V\] must have B, K"):
        fn(logits[:, :2], scores, targets, impl=impl)
    bad = targets.clone()
    bad[1, 2] = 5
    with pytest.raises(ValueError, match=r"targets must lie in \[0, V=5\)"):
        fn(logits, scores, bad, impl=impl)
    with pytest.raises(ValueError, match="doc_scores must be on the logits' device"):
        fn(logits, scores.to("meta"), targets, impl=impl)
    with pytest.raises(ValueError, match="impl must be one of"):
        fn(logits, scores, targets, impl="cuda")


def test_explicit_impl_that_cannot_run_says_why():
    logits, scores, targets = make_case(B=1, K=1, T=1, V=3)
    with pytest.raises(ValueError, match="impl='cpp' supports logits of dtype"):
        rag_fast.rag_token_nll(logits.half(), scores, targets, impl="cpp")
