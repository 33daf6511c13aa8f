"""The C++ kernels are reached only with CPU tensors.

Without a GPU, CUDA tensors are mocked: ``CudaLike`` says it lives on ``cuda:0`` (so the
dispatcher sends custom ops to their CUDA implementation, and every device check sees CUDA)
and keeps its values in a CPU tensor (so aten ops and the Triton interpreter can compute).
With the C++ extension replaced by a tripwire, every caller of the kernels (the losses and
their backward, the marginal, the beam step, RAG-Sequence rescoring) must take the Triton
route on CUDA tensors and give the CPU results, or raise a clear error for impl="cpp".
Meta tensors reach only the fake implementations or the PyTorch reference.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from torch.utils._pytree import tree_map

import rag_fast
from rag_fast import _ext
from rag_fast.generation import encoder_decoder
from test_custom_ops import OPS, _args
from utils import requires_ext, requires_triton

PACKAGE = Path(rag_fast.__file__).resolve().parent
CUDA = torch.device("cuda", 0)


class CudaLike(torch.Tensor):
    """A mocked CUDA tensor: device ``cuda:0``, values in the CPU tensor ``inner``."""

    @staticmethod
    def __new__(cls, inner: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(
            cls, inner.shape, strides=inner.stride(), storage_offset=inner.storage_offset(),
            dtype=inner.dtype, device=CUDA, requires_grad=inner.requires_grad)

    def __init__(self, inner: torch.Tensor):
        self.inner = inner.detach()

    def data_ptr(self) -> int:  # what the op boundary's alignment check reads
        return self.inner.data_ptr()

    def __repr__(self) -> str:
        return f"CudaLike({self.inner!r})"

    # Indexing opens a device guard before it dispatches, which a CPU build has not for CUDA.
    def __getitem__(self, index):
        return _wrap(self.inner[tree_map(_unwrap, index)])

    def __setitem__(self, index, value) -> None:
        self.inner[tree_map(_unwrap, index)] = _unwrap(value)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "rag_fast":  # the dispatcher's choice for a real CUDA tensor
            return func.redispatch(torch._C.DispatchKeySet(torch._C.DispatchKey.CUDA),
                                   *args, **kwargs)
        out = func(*tree_map(_unwrap, args), **tree_map(_on_cpu, tree_map(_unwrap, kwargs)))
        return tree_map(_wrap, out)


def _unwrap(v):
    return v.inner if isinstance(v, CudaLike) else v


def _wrap(v):
    return CudaLike(v) if isinstance(v, torch.Tensor) and not isinstance(v, CudaLike) else v


def _on_cpu(v):
    return torch.device("cpu") if isinstance(v, torch.device) and v.type == "cuda" else v


def cuda_like(t: torch.Tensor, requires_grad: bool = False) -> CudaLike:
    return CudaLike(t.detach().clone().requires_grad_(requires_grad))


class _Tripwire:
    def __getattr__(self, name: str):
        raise AssertionError(f"the C++ kernel {name} was reached with CUDA tensors")


@pytest.fixture
def triton_route(monkeypatch):
    """The C++ extension as a tripwire; every Triton launcher records the devices it is given
    and computes on the CPU values (through the Triton interpreter). Yields the record."""
    from rag_fast.kernels import beam_step, rag_losses

    monkeypatch.setattr(_ext, "_module", _Tripwire())
    calls: list[tuple[str, set[torch.device]]] = []

    def spy(name, launcher):
        def run(*args, **kwargs):
            devices = {v.device for v in (*args, *kwargs.values()) if isinstance(v, CudaLike)}
            if not devices:  # a launcher calling another one, on the CPU values
                return launcher(*args, **kwargs)
            calls.append((name, devices))
            return tree_map(_wrap, launcher(*tree_map(_unwrap, args), **tree_map(_unwrap, kwargs)))
        return run

    for name in ("row_stats", "row_grad", "token_smooth_forward", "token_smooth_stats",
                 "token_smooth_grad", "token_marginal", "token_marginal_grad"):
        monkeypatch.setattr(rag_losses, name, spy(name, getattr(rag_losses, name)))
    monkeypatch.setattr(beam_step, "beam_step", spy("beam_step", beam_step.beam_step))
    return calls


def _case(V=9):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 4, V, generator=g)
    scores = torch.randn(2, 3, generator=g)
    targets = torch.randint(0, V, (2, 4), generator=g)
    targets[1, 2] = -100
    return logits, scores, targets


def _values(t: torch.Tensor) -> torch.Tensor:
    return t.inner if isinstance(t, CudaLike) else t


@requires_triton
@requires_ext
@pytest.mark.parametrize("kind,eps,launcher", [
    ("token", 0.0, "row_stats"),
    ("token", 0.1, "token_smooth_forward"),
    ("sequence", 0.1, "row_stats"),
])
def test_losses_on_cuda_tensors_run_triton(kind, eps, launcher, triton_route):
    """Forward only: autograd cannot record a graph on mocked CUDA tensors without CUDA; the
    backward's kernels (row_grad, token_smooth_grad) are ops, routed like every op below."""
    fn = {"token": rag_fast.rag_token_nll, "sequence": rag_fast.rag_sequence_nll}[kind]
    logits, scores, targets = _case()
    with pytest.raises(AssertionError, match="C\\+\\+ kernel"):
        fn(logits, scores, targets, epsilon=eps, impl="cpp")  # the tripwire is armed
    got = fn(cuda_like(logits), cuda_like(scores), cuda_like(targets), epsilon=eps)
    assert got.device == CUDA
    assert triton_route == [(launcher, {CUDA})]
    want = fn(logits, scores, targets, epsilon=eps, impl="torch")
    torch.testing.assert_close(_values(got), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="impl='cpp' needs CPU tensors, got logits on cuda:0"):
        fn(cuda_like(logits), cuda_like(scores), cuda_like(targets), epsilon=eps, impl="cpp")


@requires_triton
@requires_ext
def test_marginal_and_beam_step_on_cuda_tensors_run_triton(triton_route):
    logits, scores, _ = _case()
    marginal = rag_fast.rag_token_marginal(cuda_like(logits), cuda_like(scores))
    torch.testing.assert_close(_values(marginal), rag_fast.reference.rag_token_marginal(
        logits, scores), rtol=1e-5, atol=1e-5)
    beam_logits = logits.permute(0, 2, 1, 3)[:, :2]  # [B, W=2, K, V]
    prior, beams = torch.log_softmax(scores, 1), torch.zeros(2, 2)
    got = rag_fast.rag_token_beam_step(cuda_like(beam_logits), cuda_like(prior), cuda_like(beams))
    want = rag_fast.rag_token_beam_step(beam_logits, prior, beams, impl="torch")
    for g, w in zip(got, want):
        torch.testing.assert_close(_values(g), w, rtol=1e-5, atol=1e-5)
    assert [name for name, _ in triton_route] == ["row_stats", "token_marginal", "beam_step"]
    with pytest.raises(ValueError, match="impl='cpp' needs CPU tensors, got logits on cuda:0"):
        rag_fast.rag_token_beam_step(cuda_like(beam_logits), cuda_like(prior), cuda_like(beams),
                                     impl="cpp")


class _Decoder:
    """What ``_lm_row_stats`` uses of a decoder: its LM head."""

    def __init__(self, logits: torch.Tensor) -> None:
        self._logits = logits

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._logits


@requires_triton
@requires_ext
def test_rag_sequence_rescoring_on_cuda_tensors_runs_triton(triton_route):
    """The rescoring of RAG-Sequence thorough decoding (the default) sent CUDA logits to the
    C++ row statistics; now they go to Triton, or impl="cpp" raises."""
    logits = torch.randn(5, 3, 17, generator=torch.Generator().manual_seed(2))  # [U, K, V]
    dec = _Decoder(cuda_like(logits))
    _, lse, xsum = encoder_decoder._lm_row_stats(dec, None, "auto")
    assert [name for name, _ in triton_route] == ["row_stats"]
    assert _values(lse).dtype == torch.float64  # the fused row statistics' lse
    torch.testing.assert_close(_values(lse), torch.logsumexp(logits.double(), -1), rtol=1e-6,
                               atol=1e-6)
    torch.testing.assert_close(_values(xsum), logits.sum(-1), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="impl='cpp' needs CPU tensors, got logits on cuda:0"):
        encoder_decoder._lm_row_stats(dec, None, "cpp")


LAUNCHERS = {"token_marginal": ["row_stats", "token_marginal"]}  # else: the op's name


@requires_triton
@pytest.mark.parametrize("op", OPS)
def test_ops_on_cuda_tensors_run_triton_or_refuse_cpp(op, triton_route):
    """At the op boundary itself: the dispatcher sends CUDA tensors to the CUDA
    implementation, which runs the Triton launcher (the same values as the interpreter on the
    CPU tensors) and refuses impl="cpp"."""
    cpu_args = _args(op)
    cuda_args = tree_map(lambda v: cuda_like(v) if isinstance(v, torch.Tensor) else v, cpu_args)
    got = getattr(torch.ops.rag_fast, op)(*cuda_args)
    assert [name for name, _ in triton_route] == LAUNCHERS.get(op, [op])
    assert all(devices == {CUDA} for _, devices in triton_route)
    want = getattr(torch.ops.rag_fast, op)(*cpu_args, impl="triton")
    if got is None:  # row_grad, token_smooth_grad: the gradient is written into ``out``
        got, want = cuda_args[-1], cpu_args[-1]
    for g, w in zip(tree_map(_values, got), want) if isinstance(want, tuple) else [(got, want)]:
        assert torch.equal(_values(g), w)
    with pytest.raises(ValueError, match=f"rag_fast::{op}: impl='cpp' runs the C\\+\\+ CPU "
                                         "kernels, but logits are on cuda:0"):
        getattr(torch.ops.rag_fast, op)(*cuda_args, impl="cpp")


def test_meta_tensors_never_reach_a_kernel(monkeypatch):
    monkeypatch.setattr(_ext, "_module", _Tripwire())
    logits, scores, targets = (t.to("meta") for t in _case())
    marginal = rag_fast.rag_token_marginal(logits, scores)  # "auto": the reference path
    assert marginal.is_meta and marginal.shape == (2, 4, 9)
    with pytest.raises(ValueError, match="impl='cpp' needs CPU tensors, got logits on meta"):
        rag_fast.rag_sequence_nll(logits, scores, targets, impl="cpp")
    _, lse, xsum = encoder_decoder._lm_row_stats(_Decoder(logits[:, :, 0]), None, "auto")
    assert lse.is_meta and lse.shape == (2, 3) and xsum.shape == (2, 3)
    with pytest.raises(ValueError, match="impl='cpp' needs CPU tensors, got logits on meta"):
        encoder_decoder._lm_row_stats(_Decoder(logits[:, :, 0]), None, "cpp")


def test_cpp_kernels_are_called_only_from_the_cpu_implementations():
    """Statically: the extension's kernels are called only by the C++ launchers of the op
    homes (a ``cpp`` namespace class in rag_fast/ops/rag_losses.py, rag_token_beam_step.py,
    masks.py and inner_products.py, whose launchers trust their arguments), and those
    launchers are used only inside their own module, by the functions that check the
    arguments first (the custom ops' CPU implementations, the mask and inner-product
    functions)."""
    homes = {"ops/rag_losses.py", "ops/rag_token_beam_step.py", "ops/masks.py",
             "ops/inner_products.py"}
    ext_callers, launcher_users = {}, set()
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        rel = path.relative_to(PACKAGE).as_posix()
        classes = [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]
        for node in ast.walk(tree):
            # _ext.get().<kernel>(...)
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Call)
                    and isinstance(node.value.func, ast.Attribute)
                    and node.value.func.attr == "get"
                    and isinstance(node.value.func.value, ast.Name)
                    and node.value.func.value.id == "_ext"):
                owner = next((c.name for c in classes
                              if c.lineno <= node.lineno <= c.end_lineno), None)
                ext_callers.setdefault(rel, set()).add(owner)
            if isinstance(node, ast.ImportFrom) and any(a.name == "cpp" for a in node.names):
                launcher_users.add(rel)
    assert set(ext_callers) == homes
    assert all(owners == {"cpp"} for owners in ext_callers.values()), ext_callers
    assert launcher_users == set()  # nothing imports a home's launchers
