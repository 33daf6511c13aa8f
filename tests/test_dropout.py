"""CPU dropout with torch's masks (rag_fast/models/_dropout.py, csrc/dropout.cpp): the same
outputs, gradients and generator state as torch's dropout, bit for bit."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from rag_fast.models import RagModel, _dropout
from rag_fast.ops import masks
from rag_fast.testing import tiny_hf_rag
from utils import SIMD_VARIANTS, run_in_simd_variant

pytestmark = pytest.mark.requires_ext

ONE_BITS = int(torch.tensor(1.0).view(torch.int32))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.int32)


def _generator(seed: int, skip: int) -> torch.Generator:
    """A CPU generator seeded with ``seed`` that has given ``skip`` 32-bit words already."""
    g = torch.Generator().manual_seed(seed)
    if skip:
        torch.empty(skip, dtype=torch.float32).uniform_(generator=g)  # one word each
    return g


# element counts around a byte, a 624-word state block (312 elements) and a 512-element batch
SIZES = [0, 1, 7, 8, 9, 311, 312, 313, 511, 512, 513, 623, 624, 625, 1249, 100_003]


SKIPS = [0, 1, 311, 623, 624, 1000]
KEEPS = (0.9, 1 - 0.1, 0.5, 0.3, 1e-3, 0.999)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("skip", SKIPS)
def test_keep_bits_are_torch_bernoulli(n, skip):
    """The bits are ``bernoulli_(keep)`` of a float tensor drawn from the same generator, and
    the generator ends where that draw leaves it, wherever in its 624-word block it starts."""
    check_keep_bits(n, skip)


def check_keep_bits(n: int, skip: int) -> None:
    for keep in KEEPS:
        theirs, ours = _generator(7, skip), _generator(7, skip)
        want = torch.empty(n).bernoulli_(keep, generator=theirs)
        state = ours.get_state()
        bits = masks.dropout_keep_bits(state, n, keep)
        assert bits is not None and bits.numel() == (n + 7) // 8
        ours.set_state(state)
        got = masks.bits_unmask(bits, want, ONE_BITS)
        assert torch.equal(got, want), (n, skip, keep)
        assert torch.equal(ours.get_state(), theirs.get_state()), (n, skip, keep)
        # the next numbers either generator gives are the same too
        assert torch.equal(torch.rand(5, generator=ours), torch.rand(5, generator=theirs))


@pytest.mark.parametrize("variant", SIMD_VARIANTS)
def test_every_variant(variant):
    """Each SIMD variant this CPU can run draws torch's masks (forced with RAG_FAST_SIMD in a
    subprocess)."""
    run_in_simd_variant(variant, "import test_dropout as t\n"
                                 "for n in t.SIZES:\n"
                                 "    for skip in t.SKIPS:\n"
                                 "        t.check_keep_bits(n, skip)\n"
                                 "print('ok')\n", timeout=300)


def test_keep_bits_threshold_is_exact():
    """A keep probability between two adjacent doubles of the draw's grid: the comparison
    ``u < keep`` is made exactly (an integer threshold of ceil(keep * 2^53))."""
    for keep in (0.5 + 2**-53, 0.5 - 2**-54, math.nextafter(0.75, 1.0), 2**-50):
        for seed in range(3):
            theirs, ours = _generator(seed, 0), _generator(seed, 0)
            n = 4096
            want = torch.empty(n).bernoulli_(keep, generator=theirs)
            state = ours.get_state()
            bits = masks.dropout_keep_bits(state, n, keep)
            assert torch.equal(masks.bits_unmask(bits, want, ONE_BITS), want)


def test_keep_bits_refuse_bad_arguments():
    state = torch.Generator().get_state()
    with pytest.raises(ValueError, match="state must be a CPU generator's get_state"):
        masks.dropout_keep_bits(state.float(), 8, 0.9)
    with pytest.raises(ValueError, match="n must be an int >= 0, got -1"):
        masks.dropout_keep_bits(state, -1, 0.9)
    with pytest.raises(ValueError, match=r"keep must be a float in \(0, 1\], got 1.5"):
        masks.dropout_keep_bits(state, 8, 1.5)
    with pytest.raises(ValueError, match=r"keep must be a float in \(0, 1\], got 0.0"):
        masks.dropout_keep_bits(state, 8, 0.0)
    # a state whose position is impossible (left = 0) is not read, and left unchanged
    broken = state.clone()
    broken[8:12] = 0
    before = broken.clone()
    assert masks.dropout_keep_bits(broken, 8, 0.9) is None
    assert torch.equal(broken, before)
    # too short to hold the Mersenne Twister's words
    assert masks.dropout_keep_bits(state[:1000].clone(), 8, 0.9) is None


def test_masked_scale_is_the_float_product():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1003, generator=g)
    x[:6] = torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan, 1e-40])
    bits = torch.randint(0, 256, ((x.numel() + 7) // 8,), dtype=torch.uint8, generator=g)
    mask = masks.bits_unmask(bits, x, ONE_BITS)
    scale = _dropout._scale(0.1)
    want = x * (mask * scale)
    got = masks.masked_scale(x, bits, scale)
    assert torch.equal(_bits(got), _bits(want))
    into = torch.empty_like(x)
    assert masks.masked_scale(x, bits, scale, out=into) is into
    assert torch.equal(_bits(into), _bits(want))
    with pytest.raises(ValueError, match="t must be a contiguous float32 CPU tensor"):
        masks.masked_scale(x.double(), bits, scale)
    with pytest.raises(ValueError, match="bits must be a contiguous CPU uint8 tensor of 126"):
        masks.masked_scale(x, bits[:-1], scale)
    with pytest.raises(ValueError, match=r"out must be a contiguous float32 CPU tensor of "
                                          r"shape \(1003,\)"):
        masks.masked_scale(x, bits, scale, out=torch.empty(1002))


def test_the_check_passes_here():
    """torch (as pinned for this project) draws its CPU masks the way csrc/dropout.cpp does:
    if it did not, every other test here would only see torch's own dropout."""
    assert _dropout.exact() is True


def _dropouts(x, calls):
    """Apply each ``(kind, p)`` of ``calls`` to ``x`` in turn; the outputs."""
    outs = []
    for kind, p in calls:
        if kind == "functional":
            outs.append(nn.functional.dropout(x, p, training=True))
        elif kind == "keyword":
            outs.append(nn.functional.dropout(x, p=p, training=True))
        else:
            outs.append(nn.Dropout(p)(x))
    return outs


CALLS = [("functional", 0.1), ("keyword", 0.25), ("module", 0.5), ("functional", 0.9)]


@pytest.mark.parametrize("shape", [(8192,), (3, 40, 97), (20, 64, 768)])
def test_route_equals_torch_dropout(shape):
    """Outputs, gradients and the default generator's state after several dropouts (functional,
    keyword arguments, nn.Dropout; p from 0.1 to 0.9) are those of torch's dropout."""
    g = torch.Generator().manual_seed(1)
    x0 = torch.randn(shape, generator=g)
    x0.view(-1)[:3] = torch.tensor([-0.0, math.inf, math.nan])
    grads = [torch.randn(shape, generator=g) for _ in CALLS]

    def run(route: bool):
        x = x0.clone().requires_grad_()
        torch.manual_seed(99)
        with _dropout.cpu_dropout(enabled=route) as active:
            outs = _dropouts(x, CALLS)
        assert active is route
        if route:
            assert all(type(o.grad_fn).__name__ == "_CpuDropoutBackward" for o in outs)
        else:
            assert all(type(o.grad_fn).__name__ == "MulBackward0" for o in outs)
        torch.autograd.backward(outs, grads)
        return outs, x.grad, torch.get_rng_state()

    want, got = run(False), run(True)
    for a, b in zip(want[0], got[0]):
        assert torch.equal(_bits(a), _bits(b))
    assert torch.equal(_bits(want[1]), _bits(got[1]))
    assert torch.equal(want[2], got[2])


def test_torch_dropout_runs_where_the_route_does_not_apply():
    """Small, non-contiguous, bf16, eval-mode and in-place dropout run torch's own (same
    results); the route never changes what they compute."""
    base = torch.randn(64, 256)
    cases = [
        (lambda: torch.randn(100), lambda x: nn.functional.dropout(x, 0.1)),  # small
        (lambda: base.t(), lambda x: nn.functional.dropout(x, 0.1)),  # not contiguous
        (lambda: base.bfloat16(), lambda x: nn.functional.dropout(x, 0.1)),
        (lambda: base.clone(), lambda x: nn.functional.dropout(x, 0.1, training=False)),
        (lambda: base.clone(), lambda x: nn.functional.dropout(x, 0.1, inplace=True)),
        (lambda: base.clone(), lambda x: nn.functional.dropout(x, 0.0)),
        (lambda: base.clone(), lambda x: nn.functional.dropout(x, 1.0)),
    ]
    for make, apply in cases:
        torch.manual_seed(5)
        want = apply(make())
        torch.manual_seed(5)
        with _dropout.cpu_dropout() as active:
            assert active
            got = apply(make())
        assert torch.equal(_bits(want.float()), _bits(got.float()))
        assert got.grad_fn is None or type(got.grad_fn).__name__ != "_CpuDropoutBackward"


@pytest.mark.parametrize("default_dtype", [torch.float32, torch.float64])
def test_double_backward_matches_torch(default_dtype):
    """A double backward multiplies by the float mask as torch does, whatever the default
    dtype when the backward runs."""
    x0 = torch.randn(100, 100)

    def second(route: bool):
        x = x0.clone().requires_grad_()
        torch.manual_seed(3)
        with _dropout.cpu_dropout(enabled=route):
            y = nn.functional.dropout(x, 0.2)
        previous = torch.get_default_dtype()
        torch.set_default_dtype(default_dtype)
        try:
            (g,) = torch.autograd.grad((y * y).sum(), x, create_graph=True)
            (gg,) = torch.autograd.grad(g.sum(), x)
        finally:
            torch.set_default_dtype(previous)
        return g.detach(), gg

    want, got = second(False), second(True)
    assert torch.equal(_bits(want[0]), _bits(got[0]))
    assert torch.equal(_bits(want[1]), _bits(got[1]))


def test_falls_back_when_the_state_is_not_read(monkeypatch):
    """A generator state the kernel does not read (another torch's layout) leaves torch's
    dropout in charge, with the generator untouched by the attempt."""
    monkeypatch.setattr(masks, "dropout_keep_bits", lambda state, n, keep: None)
    x = torch.randn(10_000)
    torch.manual_seed(8)
    want = nn.functional.dropout(x, 0.1)
    torch.manual_seed(8)
    with _dropout.cpu_dropout():
        got = nn.functional.dropout(x, 0.1)
    assert torch.equal(want, got)


def test_falls_back_when_torch_draws_differently(monkeypatch):
    """If the once-per-process check finds other masks than torch's, nothing is routed."""
    monkeypatch.setattr(_dropout, "_scale", lambda p: 1.0 / (1 - p) + 1e-3)  # a wrong scale
    _dropout.exact.cache_clear()
    try:
        assert _dropout.exact() is False
        with _dropout.cpu_dropout() as active:
            assert active is False
    finally:
        monkeypatch.undo()
        _dropout.exact.cache_clear()
    assert _dropout.exact() is True


@pytest.mark.parametrize("context", ["no_grad", "inference_mode"])
def test_first_use_without_gradients(context):
    """The once-per-process check runs with gradients whatever the caller's mode (a loss
    computed under no_grad, as an evaluation does, may be the first use), and the route then
    gives torch's values there too."""
    mode = torch.no_grad if context == "no_grad" else torch.inference_mode
    _dropout.exact.cache_clear()
    x = torch.randn(10_000)
    torch.manual_seed(4)
    want = nn.functional.dropout(x, 0.1)
    with mode():
        torch.manual_seed(4)
        with _dropout.cpu_dropout() as active:
            assert active is True
            got = nn.functional.dropout(x, 0.1)
    assert torch.equal(want, got)


def test_a_failing_check_warns_and_falls_back(monkeypatch):
    def broken():
        raise RuntimeError("boom")

    monkeypatch.setattr(_dropout, "_matches_torch", broken)
    _dropout.exact.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="CPU dropout runs torch's own kernel .*boom"):
            assert _dropout.exact() is False
    finally:
        monkeypatch.undo()
        _dropout.exact.cache_clear()


def test_exact_leaves_the_generator_alone():
    _dropout.exact.cache_clear()
    torch.manual_seed(11)
    before = torch.get_rng_state()
    assert _dropout.exact() is True
    assert torch.equal(torch.get_rng_state(), before)


@pytest.mark.parametrize("mode", ["token", "sequence"])
def test_rag_model_training_step_is_unchanged(mode, monkeypatch):
    """A BART RagModel's training step (dropout 0.1, lean activations) gives the same loss,
    gradients and generator state with the route as with torch's dropout, and the route ran."""
    monkeypatch.setattr(_dropout, "MIN_ELEMENTS", 256)  # the tiny model's tensors
    hf = tiny_hf_rag(mode, n_docs=3, vocab_size=60, layers=2)
    assert hf.rag.generator.config.dropout > 0
    model = RagModel.from_transformers(hf, lm_head_loss="materialized").train()
    g = torch.Generator().manual_seed(0)
    contexts = torch.randint(3, 60, (6, 20), generator=g)
    labels = torch.randint(3, 60, (2, 6), generator=g)
    scores = torch.randn(2, 3, generator=g)
    calls = []
    apply = _dropout._CpuDropout.apply
    monkeypatch.setattr(_dropout._CpuDropout, "apply",
                        lambda *a: calls.append(1) or apply(*a))

    def step(route: bool):
        model.zero_grad(set_to_none=True)
        s = scores.clone().requires_grad_()
        torch.manual_seed(42)
        monkeypatch.setattr(_dropout, "exact", lambda: route)
        loss = model.loss_from_contexts(contexts, torch.ones_like(contexts), s, labels)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return loss.detach(), s.grad, grads, torch.get_rng_state()

    want = step(False)
    assert not calls
    got = step(True)
    assert len(calls) >= 2 * 2 + 1  # the encoder's and decoder's layers, and embeddings
    assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])
    assert want[2].keys() == got[2].keys() and want[2]
    for name in want[2]:
        assert torch.equal(want[2][name], got[2][name]), name
    assert torch.equal(want[3], got[3])


def test_torch_func_transforms_run_torch_dropout():
    """Under vmap and grad (entered inside or outside the route) torch's own dropout runs:
    the same values as without the route."""
    x = torch.randn(4, 10_000)

    def both(fn):
        torch.manual_seed(6)
        want = fn()
        torch.manual_seed(6)
        with _dropout.cpu_dropout():
            got = fn()
        assert torch.equal(want, got)

    both(lambda: torch.func.vmap(lambda r: nn.functional.dropout(r, 0.1),
                                 randomness="different")(x))
    both(lambda: torch.func.grad(lambda r: (nn.functional.dropout(r, 0.1) ** 2).sum())(x[0]))

    def inner(r):
        with _dropout.cpu_dropout() as active:
            assert active is False
            return nn.functional.dropout(r, 0.1)

    torch.manual_seed(6)
    want = torch.func.vmap(lambda r: nn.functional.dropout(r, 0.1), randomness="different")(x)
    torch.manual_seed(6)
    assert torch.equal(torch.func.vmap(inner, randomness="different")(x), want)


def test_tiny_drop_probabilities_keep_everything_as_torch_does():
    """A drop probability below 2^-53 makes the keep probability 1.0: every element kept,
    and still two words drawn for each, as torch's draw does."""
    x = torch.randn(10_000, requires_grad=True)
    for p in (1e-17, 5e-324):
        torch.manual_seed(2)
        want = nn.functional.dropout(x, p)
        after = torch.get_rng_state()
        torch.manual_seed(2)
        with _dropout.cpu_dropout():
            got = nn.functional.dropout(x, p)
        assert type(got.grad_fn).__name__ == "_CpuDropoutBackward"
        assert torch.equal(want, got) and torch.equal(torch.get_rng_state(), after)


def test_the_check_seeds_only_the_cpu_generator(monkeypatch):
    """exact() reseeds the default CPU generator (and restores it), never another device's:
    a GPU run's dropout masks must not all start from the check's seed."""
    seeded = []
    monkeypatch.setattr(torch.cuda, "manual_seed_all", lambda s: seeded.append(s))
    monkeypatch.setattr(torch.cuda, "manual_seed", lambda s: seeded.append(s))
    _dropout.exact.cache_clear()
    try:
        assert _dropout.exact() is True
    finally:
        _dropout.exact.cache_clear()
    assert seeded == []


def test_forward_mode_ad_and_negated_views_run_torch_dropout():
    import torch.autograd.forward_ad as fwAD

    x, t = torch.randn(10_000), torch.randn(10_000)

    def dual():
        with fwAD.dual_level():
            out = nn.functional.dropout(fwAD.make_dual(x, t), 0.1)
            primal, tangent = fwAD.unpack_dual(out)
            return primal.clone(), tangent.clone()

    def negated():
        return nn.functional.dropout(torch._neg_view(x), 0.1)

    for fn in (dual, negated):
        torch.manual_seed(9)
        want = fn()
        torch.manual_seed(9)
        with _dropout.cpu_dropout():
            got = fn()
        for a, b in zip(want if isinstance(want, tuple) else (want,),
                        got if isinstance(got, tuple) else (got,)):
            assert torch.equal(a, b)


def test_the_environment_switch(monkeypatch):
    monkeypatch.setenv("RAG_FAST_CPU_DROPOUT", "0")
    with _dropout.cpu_dropout() as active:
        assert active is False
    monkeypatch.setenv("RAG_FAST_CPU_DROPOUT", "1")
    with _dropout.cpu_dropout() as active:
        assert active is True
    monkeypatch.setenv("RAG_FAST_CPU_DROPOUT", "yes")
    with pytest.raises(ValueError, match="RAG_FAST_CPU_DROPOUT must be 0 .* or 1 .*, got 'yes'"):
        with _dropout.cpu_dropout():
            pass
    # a bad value is named when the model is made, before any training step
    from rag_fast.models.rag_model import RagModel

    with pytest.raises(ValueError, match="RAG_FAST_CPU_DROPOUT must be 0 .* or 1 .*, got 'yes'"):
        RagModel(None, None, None)  # before anything looks at the models
    # loading a saved model names the variable itself, not the saved options, before any file
    from rag_fast.models.checkpoint import load_rag_model

    with pytest.raises(ValueError, match="^RAG_FAST_CPU_DROPOUT must be 0 .* or 1 .*, got 'yes'$"):
        load_rag_model("no-such-model-directory")


def test_rag_model_off_the_cpu_does_not_enter_the_route(monkeypatch):
    """A generator whose parameters are not on the CPU never enters the mode (no check, no
    Python call per op)."""
    from rag_fast.models import rag_model

    hf = tiny_hf_rag("token", n_docs=3, vocab_size=60, layers=2)
    assert rag_model._on_cpu(hf.rag.generator) is True
    assert rag_model._on_cpu(hf.rag.generator.to("meta")) is False
    assert rag_model._on_cpu(nn.Module()) is False
