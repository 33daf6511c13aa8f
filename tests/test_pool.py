"""The CPU buffer pool of the ops' large outputs (rag_fast/_pool.py): a freed buffer is reused,
a held one never is, idle memory stays within its limit, and the ops' results do not change."""
import pytest
import torch

import rag_fast
from rag_fast import _pool

MIN_FLOATS = _pool.MIN_BYTES // 4


@pytest.fixture(autouse=True)
def _clean_pool(monkeypatch):
    monkeypatch.delenv(_pool.ENV, raising=False)
    rag_fast.empty_cache()
    yield
    rag_fast.empty_cache()


def test_a_freed_buffer_is_reused_and_a_held_one_is_not():
    a = _pool.empty((MIN_FLOATS + 3,), torch.float32)
    a_ptr = a.data_ptr()
    b = _pool.empty((MIN_FLOATS + 3,), torch.float32)
    assert b.data_ptr() != a_ptr  # a is still held
    del a
    c = _pool.empty((MIN_FLOATS + 3,), torch.float32)
    assert c.data_ptr() == a_ptr  # a's memory, idle since a died
    view = c[10:]
    del c
    d = _pool.empty((MIN_FLOATS + 3,), torch.float32)
    assert d.data_ptr() != a_ptr  # a view keeps the buffer held
    assert view.data_ptr() == a_ptr + 40
    info = rag_fast.pool_info()
    assert info["blocks"] == 3 and info["idle_bytes"] == 0
    del b, d, view
    assert rag_fast.pool_info()["in_use_bytes"] == 0


def test_a_pooled_tensor_is_aligned_writable_and_shaped():
    t = _pool.empty((3, MIN_FLOATS // 2), torch.float64)
    assert t.shape == (3, MIN_FLOATS // 2) and t.dtype == torch.float64 and t.is_contiguous()
    assert t.data_ptr() % (1 << 21) == 0
    t.fill_(2.5)
    assert float(t.sum()) == 2.5 * t.numel()


def test_a_much_larger_idle_buffer_is_not_leased_for_a_small_request():
    big = _pool.empty((4 * MIN_FLOATS,), torch.float32)
    big_ptr = big.data_ptr()
    del big
    small = _pool.empty((MIN_FLOATS,), torch.float32)
    assert small.data_ptr() != big_ptr
    assert rag_fast.pool_info()["idle_bytes"] >= 4 * _pool.MIN_BYTES


def test_small_requests_skip_the_pool():
    t = _pool.empty((1000,), torch.float32)
    assert t.shape == (1000,)
    assert rag_fast.pool_info()["blocks"] == 0


def test_idle_memory_beyond_the_limit_is_released(monkeypatch):
    monkeypatch.setenv(_pool.ENV, "10")  # MiB: room for one 8 MiB block, not two
    a = _pool.empty((2 * MIN_FLOATS,), torch.float32)  # 8 MiB
    b = _pool.empty((2 * MIN_FLOATS,), torch.float32)
    del a, b
    assert rag_fast.pool_info()["idle_bytes"] == 16 << 20  # released only at the next request
    c = _pool.empty((6 * MIN_FLOATS,), torch.float32)  # 24 MiB: neither idle block fits
    info = rag_fast.pool_info()
    assert info["idle_bytes"] <= 10 << 20 and info["in_use_bytes"] == 24 << 20
    del c


def test_the_pool_off_releases_what_it_kept(monkeypatch):
    a = _pool.empty((MIN_FLOATS,), torch.float32)
    del a
    assert rag_fast.pool_info()["idle_bytes"] > 0
    monkeypatch.setenv(_pool.ENV, "0")
    t = _pool.empty((MIN_FLOATS,), torch.float32)
    assert t.shape == (MIN_FLOATS,)
    assert rag_fast.pool_info() == {"blocks": 0, "idle_bytes": 0, "in_use_bytes": 0}


@pytest.mark.parametrize("value", ["lots", "-1", "1.5"])
def test_a_bad_limit_names_the_variable(monkeypatch, value):
    monkeypatch.setenv(_pool.ENV, value)
    with pytest.raises(ValueError, match=rf"RAG_FAST_POOL_MB must be a whole number .*{value}"):
        _pool.empty((MIN_FLOATS,), torch.float32)


def test_empty_cache_keeps_held_buffers():
    held = _pool.empty((MIN_FLOATS,), torch.float32)
    freed = _pool.empty((MIN_FLOATS,), torch.float32)
    del freed
    assert rag_fast.empty_cache() == _pool.MIN_BYTES
    held.fill_(1.0)
    assert float(held.sum()) == MIN_FLOATS
    assert rag_fast.pool_info() == {"blocks": 1, "idle_bytes": 0,
                                    "in_use_bytes": _pool.MIN_BYTES}


def test_meta_and_non_cpu_like_tensors_get_plain_buffers():
    t = _pool.empty((MIN_FLOATS,), torch.float32, like=torch.empty(0, device="meta"))
    assert t.device.type == "meta"
    assert rag_fast.pool_info()["blocks"] == 0


def _loss_grads(op, x, s, y, **kw):
    x.grad = s.grad = None
    op(x, s, y, **kw).sum().backward()
    return x.grad, s.grad


@pytest.mark.parametrize("mode,eps", [("token", 0.1), ("token", 0.0), ("sequence", 0.1)])
def test_the_loss_gradient_comes_from_the_pool_and_is_unchanged(monkeypatch, mode, eps):
    """The logits' gradient (>= MIN_BYTES here) lands in pooled memory, which the next backward
    reuses once the first gradient is dropped, and is bit-identical to a gradient in torch's
    own memory (the pool off) and close to the reference."""
    g = torch.Generator().manual_seed(0)
    B, K, T, V = 2, 3, 7, 30011  # 5.0 MiB of fp32 logits
    x = torch.randn(B, K, T, V, generator=g).requires_grad_()
    s = torch.randn(B, K, generator=g).requires_grad_()
    y = torch.randint(0, V, (B, T), generator=g)
    y[1, -2:] = -100
    op = rag_fast.rag_token_nll if mode == "token" else rag_fast.rag_sequence_nll
    gx, gs = _loss_grads(op, x, s, y, epsilon=eps, impl="cpp")
    first_ptr, first = gx.data_ptr(), gx.clone()
    assert rag_fast.pool_info()["in_use_bytes"] >= x.numel() * 4
    del gx
    gx, _ = _loss_grads(op, x, s, y, epsilon=eps, impl="cpp")
    assert gx.data_ptr() == first_ptr
    assert torch.equal(gx, first)
    del gx
    monkeypatch.setenv(_pool.ENV, "0")
    plain, plain_s = _loss_grads(op, x, s, y, epsilon=eps, impl="cpp")
    assert rag_fast.pool_info()["blocks"] == 0
    assert torch.equal(plain, first) and torch.equal(plain_s, gs)
    ref, ref_s = _loss_grads(op, x.double().detach().requires_grad_(),
                             s.double().detach().requires_grad_(), y, epsilon=eps,
                             impl="torch")
    torch.testing.assert_close(first.double(), ref, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(gs.double(), ref_s, rtol=1e-4, atol=1e-5)


def test_the_token_marginal_and_its_gradient_come_from_the_pool():
    g = torch.Generator().manual_seed(1)
    B, K, T, V = 2, 3, 5, 50021  # marginal 1.9 MiB, logits and their gradient 5.7 MiB
    x = torch.randn(B, K, T, V, generator=g, requires_grad=True)
    a = torch.randn(B, K, generator=g, requires_grad=True)
    m = rag_fast.rag_token_marginal(x, a, impl="cpp")
    w = torch.randn(m.shape, generator=g)
    (m * w).sum().backward()
    assert rag_fast.pool_info()["in_use_bytes"] >= x.numel() * 4  # x.grad
    xr = x.detach().double().requires_grad_()
    ar = a.detach().double().requires_grad_()
    mr = rag_fast.rag_token_marginal(xr, ar, impl="torch")
    (mr * w.double()).sum().backward()
    torch.testing.assert_close(m.double(), mr, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad.double(), xr.grad, rtol=1e-4, atol=1e-6)
