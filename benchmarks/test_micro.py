"""Micro-benchmarks of rag_fast's kernels against the plain PyTorch reference (pytest-benchmark).

Every case is a group of two benchmarks on the same seeded input: ``cpp`` (rag_fast's C++
kernel, which fails without the compiled extension instead of falling back) and ``torch`` (the
reference, ``impl="torch"``), so a regression shows in the group's ratio as well as in the
absolute time against a saved run. Each benchmark then checks what it returned against a
float64 oracle: a kernel that is fast because it is wrong fails. Usage: benchmarks/conftest.py.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import rag_fast
from rag_fast import reference_decoding

IMPLS = ("cpp", "torch")
IGNORE = -100

# (B, K, T, V) of the losses and the marginal; (B, W, K, V) of the beam step; (N, d, queries,
# k) of the index. "full" are the README's loss and decoding shapes.
LOSS_SHAPES = {"small": (2, 5, 8, 50265), "full": (4, 5, 32, 50265)}
BEAM_SHAPES = {"small": (2, 4, 5, 50265), "full": (8, 4, 5, 50265)}
INDEX_SHAPES = {"small": (20_000, 64, 64, 10), "full": (200_000, 128, 256, 10)}

# Per-element bound against the float64 oracle: |got - want| <= RTOL (|want| + mean |want|).
# float32 kernels and the float32 reference land within about 1e-6 of it; 1e-4 leaves room for
# another summation order and still fails a kernel that drops or perturbs entries.
RTOL = 1e-4


def assert_close(got: torch.Tensor, want: torch.Tensor, what: str, rtol: float = RTOL) -> None:
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    got, want = got.detach().double(), want.detach().double()
    scale = float(want.abs().mean()) if want.numel() else 1.0
    bound = rtol * (want.abs() + (scale if scale > 0 else 1.0))
    err = (got - want).abs().nan_to_num(nan=math.inf)
    bad = ~(err <= bound)
    if bool(bad.any()):
        i = int(torch.where(bad.flatten(), err.flatten(), -1.0).argmax())
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {bad.numel()} elements off the float64 oracle; worst: "
            f"got {got.flatten()[i].item():.9g}, want {want.flatten()[i].item():.9g}"
        )


# ---- the RAG losses and the RAG-Token marginal ---------------------------------------------
LOSSES = {
    "token": rag_fast.rag_token_nll,
    "sequence": rag_fast.rag_sequence_nll,
}
LOSS_CASES = [("token", 0.0), ("token", 0.1), ("sequence", 0.1)]
LOSS_IDS = [f"{mode}-eps{eps}" for mode, eps in LOSS_CASES]


class LossInputs:
    """Seeded logits ``[B*K, T, V]`` fp32, scores ``[B, K]``, targets ``[B, T]`` (the last two
    positions ignored), and the float64 oracle of each case, computed once."""

    def __init__(self, shape: tuple[int, int, int, int]):
        B, K, T, V = shape
        self.shape = shape
        g = torch.Generator().manual_seed(0)
        self.logits = torch.randn(B * K, T, V, generator=g) * 2
        self.scores = torch.randn(B, K, generator=g)
        self.targets = torch.randint(0, V, (B, T), generator=g)
        self.targets[:, -2:] = IGNORE
        self.grad_out = torch.randn(B, T, V, generator=g)  # the marginal's upstream gradient
        self._oracles: dict[tuple, tuple[torch.Tensor, ...]] = {}

    @property
    def label(self) -> str:
        B, K, T, V = self.shape
        return f"B{B} K{K} T{T} V{V} fp32"

    def oracle(self, key: tuple, fn) -> tuple[torch.Tensor, ...]:
        """``fn(logits64, scores64)`` (leaves requiring grad), computed once per key."""
        if key not in self._oracles:
            x = self.logits.double().requires_grad_()
            s = self.scores.double().requires_grad_()
            self._oracles[key] = tuple(t.detach() for t in fn(x, s))
        return self._oracles[key]


@pytest.fixture(scope="module")
def loss_inputs(micro_size) -> LossInputs:
    return LossInputs(LOSS_SHAPES[micro_size])


def _loss(mode: str, eps: float, impl: str, inputs: LossInputs, reduction: str = "none"):
    fn = LOSSES[mode]
    return lambda x, s: fn(x, s, inputs.targets, epsilon=eps, ignore_index=IGNORE,
                           reduction=reduction, impl=impl)


def _with_grads(loss_fn):
    """``(loss, d loss / d logits, d loss / d scores)`` of a summed loss."""
    def run(x, s):
        loss = loss_fn(x, s)
        return (loss, *torch.autograd.grad(loss, (x, s)))

    return run


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(("mode", "eps"), LOSS_CASES, ids=LOSS_IDS)
def test_loss_forward(benchmark, loss_inputs, mode, eps, impl):
    benchmark.group = f"{mode} loss eps={eps} fwd {loss_inputs.label}"
    fn = _loss(mode, eps, impl, loss_inputs)
    x, s = loss_inputs.logits, loss_inputs.scores
    with torch.no_grad():
        loss = benchmark(fn, x, s)
    reference = _loss(mode, eps, "torch", loss_inputs)
    (want,) = loss_inputs.oracle(("loss", mode, eps), lambda x, s: (reference(x, s),))
    assert_close(loss, want, f"{mode} eps={eps} loss ({impl})")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(("mode", "eps"), LOSS_CASES, ids=LOSS_IDS)
def test_loss_forward_backward(benchmark, loss_inputs, mode, eps, impl):
    benchmark.group = f"{mode} loss eps={eps} fwd+bwd {loss_inputs.label}"
    fn = _with_grads(_loss(mode, eps, impl, loss_inputs, reduction="sum"))
    x = loss_inputs.logits.clone().requires_grad_()
    s = loss_inputs.scores.clone().requires_grad_()
    got = benchmark(fn, x, s)
    want = loss_inputs.oracle(("loss+grad", mode, eps),
                              _with_grads(_loss(mode, eps, "torch", loss_inputs, reduction="sum")))
    for name, g, w in zip(("loss", "logits' gradient", "scores' gradient"), got, want):
        assert_close(g, w, f"{mode} eps={eps} {name} ({impl})")


def _marginal(impl: str):
    return lambda x, s: rag_fast.rag_token_marginal(x, s, impl=impl)


def _marginal_with_grads(impl: str, grad_out: torch.Tensor):
    def run(x, s):
        m = rag_fast.rag_token_marginal(x, s, impl=impl)
        return (m, *torch.autograd.grad(m, (x, s), grad_out.to(m.dtype)))

    return run


@pytest.mark.parametrize("impl", IMPLS)
def test_token_marginal_forward(benchmark, loss_inputs, impl):
    benchmark.group = f"token marginal fwd {loss_inputs.label}"
    with torch.no_grad():
        got = benchmark(_marginal(impl), loss_inputs.logits, loss_inputs.scores)
    (want,) = loss_inputs.oracle(("marginal",), lambda x, s: (_marginal("torch")(x, s),))
    assert_close(got, want, f"token marginal ({impl})")


@pytest.mark.parametrize("impl", IMPLS)
def test_token_marginal_forward_backward(benchmark, loss_inputs, impl):
    benchmark.group = f"token marginal fwd+bwd {loss_inputs.label}"
    x = loss_inputs.logits.clone().requires_grad_()
    s = loss_inputs.scores.clone().requires_grad_()
    got = benchmark(_marginal_with_grads(impl, loss_inputs.grad_out), x, s)
    want = loss_inputs.oracle(("marginal+grad",), _marginal_with_grads("torch", loss_inputs.grad_out))
    for name, g, w in zip(("marginal", "logits' gradient", "scores' gradient"), got, want):
        assert_close(g, w, f"token marginal {name} ({impl})")


# ---- the RAG-Token beam step ---------------------------------------------------------------
@pytest.fixture(scope="module")
def beam_inputs(micro_size):
    B, W, K, V = BEAM_SHAPES[micro_size]
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(B, W, K, V, generator=g) * 2
    log_prior = torch.log_softmax(torch.randn(B, K, generator=g), dim=1)
    beam_scores = -torch.rand(B, W, generator=g) * 3
    bias = torch.zeros(B * W, V)
    bias[:, 2] = -math.inf  # an end-of-sequence token held back (a minimum length)
    oracle = reference_decoding.rag_token_beam_step(logits.double(), log_prior.double(),
                                                    beam_scores.double(), bias.double())
    return (logits, log_prior, beam_scores, bias), oracle, f"B{B} W{W} K{K} V{V} fp32"


@pytest.mark.parametrize("impl", IMPLS)
def test_beam_step(benchmark, beam_inputs, impl):
    args, (want_scores, want_beams, want_tokens), label = beam_inputs
    benchmark.group = f"token beam step {label}"
    scores, beams, tokens = benchmark(rag_fast.rag_token_beam_step, *args, impl=impl)
    assert_close(scores, want_scores, f"beam step scores ({impl})")
    assert torch.equal(beams, want_beams), f"beam step ({impl}): beams differ from the oracle's"
    assert torch.equal(tokens, want_tokens), f"beam step ({impl}): tokens differ from the oracle's"


# ---- index search --------------------------------------------------------------------------
class IndexInputs:
    """Seeded unit vectors near an 8-dimensional subspace (embeddings have far fewer degrees of
    freedom than dimensions; isotropic noise would make every top 10 a near-tie no quantiser
    resolves), queries close to stored vectors, the two indexes built once with fixed search
    settings (so that saved runs compare the same work), and the float64 exact scores."""

    LATENT = 8
    IVFPQ_SETTINGS = {"nprobe": 16, "rerank": 16}
    MIN_RECALL = 0.85  # measured 0.94 on the small shape (recall@10 against exact search)

    def __init__(self, shape: tuple[int, int, int, int]):
        from rag_fast.retrieval import DenseIndex

        n, d, q, self.k = shape
        rng = np.random.default_rng(0)
        vectors = (rng.standard_normal((n, self.LATENT)) @ rng.standard_normal((self.LATENT, d))
                   + 0.1 * rng.standard_normal((n, d))).astype(np.float32)
        vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
        queries = (vectors[rng.choice(n, q, replace=False)]
                   + 0.05 / math.sqrt(d) * rng.standard_normal((q, d)).astype(np.float32))
        self.vectors, self.queries = vectors, np.ascontiguousarray(queries, dtype=np.float32)
        self.indexes = {"exact": DenseIndex.build(vectors, "exact", progress=False),
                        "ivfpq": DenseIndex.build(vectors, "ivfpq", progress=False,
                                                  **self.IVFPQ_SETTINGS)}
        self.label = f"N{n} d{d} queries{q} k{self.k}"
        self.matrix = torch.from_numpy(vectors)  # the torch baseline's float32 matrix
        exact = self.queries.astype(np.float64) @ vectors.astype(np.float64).T
        top = np.argpartition(-exact, self.k - 1, axis=1)[:, : self.k]
        order = np.argsort(-np.take_along_axis(exact, top, axis=1), axis=1, kind="stable")
        self.truth_ids = np.take_along_axis(top, order, axis=1)
        self.truth_scores = np.take_along_axis(exact, self.truth_ids, axis=1)
        self.exact64 = exact

    def true_scores(self, ids: np.ndarray) -> np.ndarray:
        """float64 inner products of the returned ids (a tie-proof check of an exact search)."""
        return np.take_along_axis(self.exact64, ids, axis=1)


@pytest.fixture(scope="module")
def index_inputs(micro_size) -> IndexInputs:
    return IndexInputs(INDEX_SHAPES[micro_size])


def _torch_exact(matrix: torch.Tensor, queries: np.ndarray, k: int):
    scores, ids = torch.topk(torch.from_numpy(queries) @ matrix.T, k, dim=1)
    return scores.numpy(), ids.numpy()


@pytest.mark.parametrize("provider", ["rag_fast exact", "rag_fast ivfpq", "torch exact"])
def test_index_search(benchmark, index_inputs, provider):
    inp = index_inputs
    benchmark.group = f"index search {inp.label}"
    if provider == "torch exact":
        scores, ids = benchmark(_torch_exact, inp.matrix, inp.queries, inp.k)
    else:
        index = inp.indexes[provider.split()[1]]
        scores, ids = benchmark(index.search, inp.queries, inp.k)
    assert scores.shape == ids.shape == (len(inp.queries), inp.k)
    found = inp.true_scores(np.maximum(ids, 0))
    if provider.endswith("exact"):
        # the k best inner products, whichever of equal ones was taken
        assert_close(torch.from_numpy(found), torch.from_numpy(inp.truth_scores), f"{provider} ids")
        assert_close(torch.from_numpy(scores), torch.from_numpy(found), f"{provider} scores")
    else:
        hits = sum(len(set(a) & set(b)) for a, b in zip(ids.tolist(), inp.truth_ids.tolist()))
        recall = hits / inp.truth_ids.size
        assert recall >= inp.MIN_RECALL, (f"{provider}: recall@{inp.k} {recall:.3f} against exact "
                                          f"search < {inp.MIN_RECALL}")
        # re-ranked from the fp16 copy: each score is its id's inner product to fp16 precision
        ok = ids >= 0
        assert np.allclose(scores[ok], found[ok], rtol=0, atol=2e-3), f"{provider}: scores"
