"""The kernels as PyTorch custom ops (rag_fast/ops/rag_losses.py, rag_token_beam_step.py): registered per device,
``torch.library.opcheck`` (schema, autograd registration, fake tensors, AOT dispatch), fake
implementations on fake CPU and fake CUDA tensors and on the meta device, and the argument
checks at the op boundary."""
from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import rag_fast  # noqa: F401  (registers torch.ops.rag_fast.*)
from utils import requires_ext, requires_triton

OPS = ("row_stats", "row_grad", "token_smooth_forward", "token_smooth_stats", "token_smooth_grad",
       "token_marginal", "token_marginal_grad", "beam_step")
DIFFERENTIABLE = ("row_stats", "token_smooth_forward", "token_marginal")
B, K, T, V, W, N = 2, 3, 4, 11, 2, 5  # N: beam-step candidates
IMPLS = [pytest.param("cpp", marks=requires_ext), pytest.param("triton", marks=requires_triton)]


def _args(op: str, device: str = "cpu", requires_grad: bool = False) -> tuple:
    """Valid arguments of ``op`` (without impl), float32 logits ``[B, K, T, V]``."""
    g = torch.Generator().manual_seed(0)

    seeded = {"generator": g} if device == "cpu" else {"device": device}  # meta, fake CUDA

    def rand(*shape):
        return torch.randn(*shape, **seeded)

    x = rand(B, K, T, V).requires_grad_(requires_grad)
    y = torch.randint(0, V, (B, T), **seeded)
    if device == "cpu":
        y[0, 1] = -100  # an ignored position
    a = torch.log_softmax(rand(B, K), 1).requires_grad_(requires_grad)
    stats = [rand(B, K, T) for _ in range(4)]  # lse, c_p, c_y, c_1
    return {
        "row_stats": (x, y, -100),
        "row_grad": (x, y, -100, *stats, torch.empty_like(x)),
        "token_smooth_forward": (x, y, -100, a, True),
        "token_smooth_stats": (x, a, stats[0]),
        "token_smooth_grad": (x, y, -100, a, *stats, rand(B, T), torch.empty_like(x)),
        "token_marginal": (x, a),
        "token_marginal_grad": (x, a, stats[0], rand(B, T, V), rand(B, T, V)),
        "beam_step": (rand(B, W, K, V), a, rand(B, W), None, N),
    }[op]


def _expected(op: str) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """Shapes and dtypes of the outputs (the docstrings of rag_fast/ops/rag_losses.py and rag_token_beam_step.py)."""
    f32, i64 = torch.float32, torch.int64
    stats, lse = ((B, K, T), f32), ((B, K, T), torch.float64)
    return {
        "row_stats": [lse, stats, stats],
        "row_grad": [],
        "token_smooth_forward": [lse, stats, stats, ((B, T), f32), stats],
        "token_smooth_stats": [((B, T), f32), stats],
        "token_smooth_grad": [],
        "token_marginal": [((B, T, V), f32), lse],
        "token_marginal_grad": [((B, K, T, V), f32), stats],
        "beam_step": [((B, N), f32), ((B, N), i64), ((B, N), i64)],
    }[op]


def _outputs(result) -> list[torch.Tensor]:
    return [] if result is None else list(result)


def test_every_op_is_registered_per_device():
    listed = set(dir(torch.ops.rag_fast))
    assert set(OPS) <= listed, f"missing from torch.ops.rag_fast: {set(OPS) - listed}"
    for op in OPS:
        name = f"rag_fast::{op}"
        for key in ("CPU", "CUDA", "Meta"):
            assert torch._C._dispatch_has_kernel_for_dispatch_key(name, key), f"{name}: {key}"


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("op", OPS)
def test_opcheck(op, impl):
    """Schema (no undeclared mutation, no aliasing), autograd registration, the fake
    implementation against the real one, and AOT dispatch with dynamic shapes."""
    args = _args(op, requires_grad=op in DIFFERENTIABLE)
    result = torch.library.opcheck(getattr(torch.ops.rag_fast, op).default, args,
                                   {"impl": impl})
    assert set(result.values()) == {"SUCCESS"}, result


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("op", OPS)
def test_fake_tensors_give_shapes_and_dtypes(op, device, monkeypatch):
    """Fake CPU and fake CUDA tensors (what torch.compile traces with) reach only the fake
    implementation: shapes and dtypes, and never a kernel."""
    from rag_fast import _ext

    monkeypatch.setattr(_ext, "get", lambda: pytest.fail("a kernel ran on fake tensors"))
    with FakeTensorMode():
        args = _args(op, device)
        outputs = _outputs(getattr(torch.ops.rag_fast, op)(*args))
        got = [(tuple(t.shape), t.dtype) for t in outputs]
        assert got == _expected(op)
        assert all(t.device.type == device for t in outputs)
        if device == "cuda":  # the fake implementation refuses what the CUDA one would
            with pytest.raises(ValueError, match="impl='cpp' runs the C\\+\\+ CPU kernels"):
                getattr(torch.ops.rag_fast, op)(*args, impl="cpp")


@pytest.mark.parametrize("op", OPS)
def test_meta_device(op):
    outputs = _outputs(getattr(torch.ops.rag_fast, op)(*_args(op, "meta")))
    assert [(tuple(t.shape), t.dtype) for t in outputs] == _expected(op)
    assert all(t.is_meta for t in outputs)


@requires_ext
def test_no_rho_without_gradient():
    """need_rho=False returns an empty rho (fake and real), and differentiating such a call
    raises instead of using it."""
    x, y, ignore, a, _ = _args("token_smooth_forward", requires_grad=True)
    with FakeTensorMode():
        fake = _args("token_smooth_forward")
        assert torch.ops.rag_fast.token_smooth_forward(*fake[:4], False)[4].shape == (0,)
    out = torch.ops.rag_fast.token_smooth_forward(x, y, ignore, a, False)
    assert out[4].shape == (0,)
    with pytest.raises(RuntimeError, match="need_rho=False"):
        out[3].sum().backward()


# ---- checks at the op boundary ---------------------------------------------------------------


def _replace(args: tuple, i: int, value) -> tuple:
    return args[:i] + (value,) + args[i + 1:]


@requires_ext
@pytest.mark.parametrize("op,index,value,message", [
    ("row_stats", 0, torch.zeros(2, 3, 4), r"logits must have shape \[B, K, T, V\]"),
    ("row_stats", 0, torch.zeros(B, K, T, V, dtype=torch.float16),
     r"impl='cpp' needs logits of dtype"),
    ("row_stats", 0, torch.zeros(B, K, T, 2 * V)[..., ::2], "stride 1 along the vocabulary"),
    ("row_stats", 1, torch.zeros(B, T, dtype=torch.int32), "targets must be int64"),
    ("row_stats", 1, torch.zeros(B, T + 1, dtype=torch.int64), r"targets must have shape \[2, 4\]"),
    ("row_stats", 1, torch.full((B, T), V, dtype=torch.int64), r"targets must lie in \[0, V=11\)"),
    ("row_stats", 1, torch.zeros(B, T, dtype=torch.int64, device="meta"),
     "targets must be on the logits' device cpu, got meta"),
    ("row_grad", 3, torch.zeros(B, K), r"lse must have shape \[2, 3, 4\]"),
    ("row_grad", 5, torch.zeros(B, K, T, dtype=torch.int64), "c_y must be a floating tensor"),
    ("row_grad", 7, torch.zeros(B, K, T, V, dtype=torch.bfloat16),
     "out must have the logits' dtype"),
    ("row_grad", 7, torch.zeros(B, 1, T, V).expand(B, K, T, V), "out must .* no overlapping"),
    ("token_smooth_forward", 3, torch.zeros(B, K + 1), r"log_prior must have shape \[2, 3\]"),
    ("token_smooth_grad", 8, torch.zeros(B, K, T), r"c_r must have shape \[2, 4\]"),
    ("token_smooth_stats", 2, torch.zeros(B, K), r"lse must have shape \[2, 3, 4\]"),
    ("token_marginal_grad", 4, torch.zeros(B, T, V - 1),
     r"grad_marginal must have shape \[2, 4, 11\]"),
    ("beam_step", 3, torch.zeros(B * W, V + 1), r"bias must have shape \[4, 11\]"),
    ("beam_step", 4, W * V + 1, r"num_candidates must lie in \[1, W\*V = 22\]"),
])
def test_bad_arguments_are_refused_before_any_kernel(op, index, value, message, monkeypatch):
    import sys

    from rag_fast.ops import rag_losses

    beam = sys.modules["rag_fast.ops.rag_token_beam_step"].cpp  # the package exports the function
    for launchers, name in [(rag_losses.cpp, n) for n in (
            "row_stats", "row_grad", "token_smooth_forward", "token_smooth_stats",
            "token_smooth_grad", "token_marginal", "token_marginal_grad")] + [(beam, "beam_step")]:
        monkeypatch.setattr(launchers, name, lambda *a, **k: pytest.fail("a kernel ran"))
    with pytest.raises(ValueError, match=f"rag_fast::{op}: .*{message}"):
        getattr(torch.ops.rag_fast, op)(*_replace(_args(op), index, value))


def test_unknown_impl_is_refused():
    with pytest.raises(ValueError, match=r"rag_fast::row_stats: impl must be one of \('auto', "
                                         r"'cpp', 'triton'\), got 'torch'"):
        torch.ops.rag_fast.row_stats(*_args("row_stats"), impl="torch")
