"""rag_fast's exact inner-product kernel (csrc/inner_products.cpp, the exact index preset's
scores): against a float64 oracle under the tolerance rule of tests/utils.py, on odd shapes and
strided inputs, in every SIMD variant this CPU can run; and its defining property, that the
score of a (query, vector) pair is the same bit for bit whatever the other queries and vectors
(the batch, the shard, the place in a register tile) and the thread count."""
from __future__ import annotations

import pytest
import torch

from utils import SIMD_VARIANTS, assert_close_rule, requires_ext, run_in_simd_variant

pytestmark = requires_ext

# (B queries, N vectors, d): one of each; partial register tiles on both sides and a d tail
# shorter than a vector; a d of whole vectors; many queries; the real encoders' widths.
SHAPES = [(1, 1, 1), (3, 7, 13), (5, 97, 17), (45, 300, 64), (130, 50, 384), (2, 1000, 768)]


def _inner_products(q, x, out=None):
    from rag_fast.ops.inner_products import inner_products

    return inner_products(q, x, out=out)


def check_shapes() -> None:
    gen = torch.Generator().manual_seed(0)
    for B, N, d in SHAPES:
        q = torch.randn(B, d, generator=gen)
        x = torch.randn(N, d, generator=gen)
        got = _inner_products(q, x)
        assert_close_rule(got, q @ x.T, q.double() @ x.double().T, torch.float32, f"{(B, N, d)}")


def check_invariance() -> None:
    """Every score equals the whole product's, bit for bit, for any sub-batch of queries, any
    range of vectors (a lone vector, tile tails) and one thread or two."""
    import rag_fast._C as C

    gen = torch.Generator().manual_seed(1)
    for d in (13, 64, 384):
        q = torch.randn(23, d, generator=gen)
        x = torch.randn(211, d, generator=gen)
        whole = _inner_products(q, x)
        for b0, b1 in ((0, 1), (7, 8), (0, 5), (3, 23), (0, 22)):
            assert torch.equal(_inner_products(q[b0:b1], x), whole[b0:b1]), (d, b0, b1)
        for n0, n1 in ((0, 1), (210, 211), (5, 6), (0, 7), (13, 200), (1, 211)):
            assert torch.equal(_inner_products(q, x[n0:n1]), whole[:, n0:n1]), (d, n0, n1)
    # one thread or two: a product large enough that the kernel starts its thread team
    q = torch.randn(23, 384, generator=gen)
    x = torch.randn(C.INNER_PRODUCTS_PARALLEL_WORK // (23 * 384) + 1000, 384, generator=gen)
    assert q.shape[0] * x.shape[0] * 384 >= C.INNER_PRODUCTS_PARALLEL_WORK
    before = C.num_threads()
    try:
        C.set_num_threads(2)
        two = _inner_products(q, x)
        C.set_num_threads(1)
        assert torch.equal(_inner_products(q, x), two)
    finally:
        C.set_num_threads(before)


def test_against_the_float64_oracle():
    check_shapes()


def test_a_pairs_score_does_not_depend_on_the_others():
    check_invariance()


def test_strided_inputs_and_output():
    gen = torch.Generator().manual_seed(2)
    wide_q = torch.randn(6, 40, generator=gen)
    wide_x = torch.randn(33, 50, generator=gen)
    q, x = wide_q[:, 3:24], wide_x[:, 10:31]  # rows of 21 at strides 40 and 50
    out_buf = torch.full((6, 70), float("nan"))
    out = out_buf[:, 5:38]
    got = _inner_products(q, x, out=out)
    assert got.data_ptr() == out.data_ptr()
    assert torch.equal(got, _inner_products(q.contiguous(), x.contiguous()))
    assert out_buf[:, :5].isnan().all() and out_buf[:, 38:].isnan().all()  # nothing else written
    assert_close_rule(got, q @ x.T, q.double() @ x.double().T, torch.float32, "strided")


def test_every_thread_runs_in_the_callers_floating_point_mode():
    """With flush-to-zero set on the calling thread (torch.set_flush_denormal), products below
    float32's normal range are zero in every thread's share of the work, not only the caller's
    (the scores would otherwise depend on which thread computed them)."""
    import rag_fast._C as C

    q = torch.full((3, 16), 1e-20)
    # products 1e-40: subnormal; enough of them for the kernel to start its thread team
    x = torch.full((C.INNER_PRODUCTS_PARALLEL_WORK // 48 + 1000, 16), 1e-20)
    before = C.num_threads()
    assert torch.set_flush_denormal(True), "this CPU has no flush-to-zero mode"
    try:
        C.set_num_threads(2)
        two = _inner_products(q, x)
        C.set_num_threads(1)
        one = _inner_products(q, x)
    finally:
        torch.set_flush_denormal(False)
        C.set_num_threads(before)
    assert torch.equal(one, torch.zeros_like(one)) and torch.equal(two, one)
    assert bool((_inner_products(q, x) > 0).all())  # the same inputs without flush-to-zero


def test_bad_arguments_name_what_is_wrong():
    q, x = torch.randn(3, 8), torch.randn(5, 8)
    with pytest.raises(ValueError, match="queries must be a .*float32"):
        _inner_products(q.double(), x)
    with pytest.raises(ValueError, match="vectors must be a .*contiguous rows"):
        _inner_products(q, torch.randn(8, 5).T)
    with pytest.raises(ValueError, match="vectors must have d=8 columns"):
        _inner_products(q, torch.randn(5, 9))
    with pytest.raises(ValueError, match=r"out must be a \[3, 5\] float32"):
        _inner_products(q, x, out=torch.empty(3, 6))
    with pytest.raises(ValueError, match="non-overlapping rows"):
        _inner_products(q, x, out=torch.empty(20).as_strided((3, 5), (2, 1)))
    with pytest.raises(ValueError, match="must not share memory with queries or vectors"):
        both = torch.randn(3, 8)
        _inner_products(both, x, out=both[:, :5])
    assert _inner_products(q[:0], x).shape == (0, 5)


@pytest.mark.parametrize("variant", SIMD_VARIANTS)
def test_every_variant(variant):
    """Each SIMD variant this CPU can run, forced with RAG_FAST_SIMD in a subprocess."""
    run_in_simd_variant(variant, "import test_inner_products as t\n"
                                 "t.check_shapes()\n"
                                 "t.check_invariance()\n"
                                 "print('ok')\n", timeout=300)
