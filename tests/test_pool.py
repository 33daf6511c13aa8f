"""The CPU buffer pool of the ops' large outputs (rag_fast/_pool.py): a freed buffer is reused,
a held one never is, idle memory stays within its limit, a fork does not share it, and the
ops' results do not change."""
import gc
import os

import pytest
import torch

import rag_fast
from rag_fast import _pool

MIN_FLOATS = _pool.MIN_BYTES // 4
MiB = 1 << 20


@pytest.fixture(autouse=True)
def _clean_pool(monkeypatch):
    monkeypatch.delenv(_pool.ENV, raising=False)
    gc.collect()
    rag_fast.empty_cache()
    yield
    gc.collect()
    rag_fast.empty_cache()


def _info():
    return rag_fast.pool_info()


def test_a_freed_buffer_is_reused_and_a_held_one_is_not():
    before = _info()["blocks"]
    a = _pool.empty((MIN_FLOATS + 3,), torch.float32)
    a_ptr = a.data_ptr()
    b = _pool.empty((MIN_FLOATS + 3,), torch.float32)
    assert b.data_ptr() != a_ptr  # a is still held
    del a
    c = _pool.empty((MIN_FLOATS + 3,), torch.float32)
    assert c.data_ptr() == a_ptr  # a's memory, idle since a died
    view = c[10:].t()
    del c
    d = _pool.empty((MIN_FLOATS + 3,), torch.float32)
    assert d.data_ptr() != a_ptr  # a view keeps the buffer held
    assert view.data_ptr() == a_ptr + 40
    assert _info()["blocks"] - before == 3
    del b, d, view
    assert _info()["in_use_bytes"] == 0


def test_a_held_buffer_cannot_be_released():
    held = _pool.empty((MIN_FLOATS,), torch.float32)
    freed = _pool.empty((MIN_FLOATS,), torch.float32)
    del freed
    assert rag_fast.empty_cache() == _pool.MIN_BYTES  # only the freed one
    held.fill_(1.0)
    assert float(held.sum()) == MIN_FLOATS
    info = _info()
    assert info["idle_bytes"] == 0 and info["in_use_bytes"] == _pool.MIN_BYTES


def test_a_pooled_tensor_is_aligned_writable_and_shaped():
    t = _pool.empty((3, MIN_FLOATS // 2), torch.float64)
    assert t.shape == (3, MIN_FLOATS // 2) and t.dtype == torch.float64 and t.is_contiguous()
    assert t.data_ptr() % (1 << 21) == 0
    t.fill_(2.5)
    assert float(t.sum()) == 2.5 * t.numel()
    with pytest.raises(RuntimeError, match="not resizable"):
        t.resize_(4, MIN_FLOATS)


def test_a_much_larger_idle_buffer_is_not_leased_for_a_small_request():
    big = _pool.empty((4 * MIN_FLOATS,), torch.float32)
    big_ptr = big.data_ptr()
    del big
    small = _pool.empty((MIN_FLOATS,), torch.float32)
    assert small.data_ptr() != big_ptr
    assert _info()["idle_bytes"] == 4 * _pool.MIN_BYTES


def test_small_requests_and_requests_above_the_limit_skip_the_pool(monkeypatch):
    before = _info()["blocks"]
    t = _pool.empty((1000,), torch.float32)
    assert t.shape == (1000,) and _info()["blocks"] == before
    monkeypatch.setenv(_pool.ENV, "6")
    big = _pool.empty((2 * MIN_FLOATS,), torch.float32)  # 8 MiB > 6 MiB: never kept
    assert big.shape == (2 * MIN_FLOATS,) and _info()["blocks"] == before


def test_idle_memory_beyond_the_limit_is_released_when_a_buffer_is_freed(monkeypatch):
    monkeypatch.setenv(_pool.ENV, "10")  # MiB: room for one idle 8 MiB block, not two
    a = _pool.empty((2 * MIN_FLOATS,), torch.float32)
    b = _pool.empty((2 * MIN_FLOATS,), torch.float32)
    b_ptr = b.data_ptr()
    del a
    assert _info()["idle_bytes"] == 8 * MiB
    del b  # 16 MiB idle > 10: the longest idle (a's) goes at once
    info = _info()
    assert info["idle_bytes"] == 8 * MiB and info["in_use_bytes"] == 0
    c = _pool.empty((2 * MIN_FLOATS,), torch.float32)
    assert c.data_ptr() == b_ptr  # the one kept is the one freed last
    assert info["limit_bytes"] == 10 * MiB


def test_the_pool_off_releases_what_it_kept(monkeypatch):
    a = _pool.empty((MIN_FLOATS,), torch.float32)
    del a
    assert _info()["idle_bytes"] > 0
    monkeypatch.setenv(_pool.ENV, "0")
    t = _pool.empty((MIN_FLOATS,), torch.float32)
    assert t.shape == (MIN_FLOATS,)
    info = _info()
    assert info["idle_bytes"] == 0 and info["in_use_bytes"] == 0 and info["limit_bytes"] == 0


@pytest.mark.parametrize("value", ["lots", "-1", "1.5", "+5", "1_000"])
def test_a_bad_limit_names_the_variable(monkeypatch, value):
    monkeypatch.setenv(_pool.ENV, value)
    with pytest.raises(ValueError, match=r"RAG_FAST_POOL_MB must be a whole number of MiB"):
        _pool.empty((MIN_FLOATS,), torch.float32)


def test_meta_and_parameter_like_tensors_skip_the_pool():
    before = _info()["blocks"]
    t = _pool.empty((MIN_FLOATS,), torch.float32, like=torch.empty(0, device="meta"))
    assert t.device.type == "meta"
    p = _pool.empty((MIN_FLOATS,), torch.float32, like=torch.nn.Parameter(torch.empty(1)))
    assert p.device.type == "cpu" and _info()["blocks"] == before


@pytest.mark.skipif(not hasattr(os, "fork"), reason="POSIX fork")
def test_a_forked_child_does_not_write_into_the_parent():
    """The maps are private: a child that takes an idle block and writes into it, or writes
    into an inherited pooled tensor, leaves the parent's memory as it was."""
    held = _pool.empty((MIN_FLOATS,), torch.float32)
    held.fill_(1.0)
    idle = _pool.empty((MIN_FLOATS,), torch.float32)
    del idle
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no torch threads (a forked OpenMP pool may hang), plain writes
        try:
            mine = _pool.empty((MIN_FLOATS,), torch.float32)
            mine.numpy()[:] = 7.0
            held.numpy()[:] = 7.0
            os.write(write, b"ok")
        finally:
            os._exit(0)
    os.close(write)
    assert os.read(read, 2) == b"ok"
    os.waitpid(pid, 0)
    os.close(read)
    assert (held.numpy() == 1.0).all()
    again = _pool.empty((MIN_FLOATS,), torch.float32)
    assert not (again.numpy() == 7.0).any()


def _loss_grads(op, x, s, y, **kw):
    x.grad = s.grad = None
    op(x, s, y, **kw).sum().backward()
    return x.grad, s.grad


@pytest.mark.parametrize("mode,eps", [("token", 0.1), ("token", 0.0), ("sequence", 0.1)])
def test_the_loss_gradient_comes_from_the_pool_and_is_unchanged(monkeypatch, mode, eps):
    """The logits' gradient (>= MIN_BYTES here) lands in pooled memory, which the next backward
    reuses once the first gradient is dropped (filled with NaN in between: every element must
    be written again), bit-identical to a gradient in torch's own memory (the pool off) and
    close to the float64 reference."""
    g = torch.Generator().manual_seed(0)
    B, K, T, V = 2, 3, 7, 30011  # 5.0 MiB of fp32 logits
    x = torch.randn(B, K, T, V, generator=g).requires_grad_()
    s = torch.randn(B, K, generator=g).requires_grad_()
    y = torch.randint(0, V, (B, T), generator=g)
    y[1, -2:] = -100
    op = rag_fast.rag_token_nll if mode == "token" else rag_fast.rag_sequence_nll
    gx, gs = _loss_grads(op, x, s, y, epsilon=eps, impl="cpp")
    first_ptr, first = gx.data_ptr(), gx.clone()
    assert _info()["in_use_bytes"] >= x.numel() * 4
    gx.fill_(float("nan"))
    del gx
    x.grad = None
    gx, _ = _loss_grads(op, x, s, y, epsilon=eps, impl="cpp")
    assert gx.data_ptr() == first_ptr
    assert torch.equal(gx, first)
    del gx
    monkeypatch.setenv(_pool.ENV, "0")
    plain, plain_s = _loss_grads(op, x, s, y, epsilon=eps, impl="cpp")
    assert _info()["in_use_bytes"] == 0
    assert torch.equal(plain, first) and torch.equal(plain_s, gs)
    ref, ref_s = _loss_grads(op, x.double().detach().requires_grad_(),
                             s.double().detach().requires_grad_(), y, epsilon=eps,
                             impl="torch")
    torch.testing.assert_close(first.double(), ref, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(gs.double(), ref_s, rtol=1e-4, atol=1e-5)


def test_non_contiguous_logits_get_a_gradient_in_their_own_strides():
    """A leaf's gradient must have the leaf's strides (else autograd copies it): for logits
    that are not contiguous the gradient comes from torch.empty_like, not the pool."""
    g = torch.Generator().manual_seed(2)
    B, K, T, V = 2, 3, 7, 30011
    base = torch.randn(B, T, K, V, generator=g)
    x = base.transpose(1, 2).detach().requires_grad_()  # [B, K, T, V], stride 1 along V
    s = torch.randn(B, K, generator=g)
    y = torch.randint(0, V, (B, T), generator=g)
    before = _info()["in_use_bytes"]
    rag_fast.rag_token_nll(x, s, y, epsilon=0.1, impl="cpp").sum().backward()
    assert x.grad.stride() == x.stride()
    assert _info()["in_use_bytes"] == before
    xr = x.detach().double().requires_grad_()
    rag_fast.rag_token_nll(xr, s.double(), y, epsilon=0.1, impl="torch").sum().backward()
    torch.testing.assert_close(x.grad.double(), xr.grad, rtol=1e-4, atol=1e-6)


def test_the_token_marginal_and_its_gradient_come_from_the_pool():
    g = torch.Generator().manual_seed(1)
    B, K, T, V = 2, 3, 5, 50021  # marginal 1.9 MiB, logits and their gradient 5.7 MiB
    x = torch.randn(B, K, T, V, generator=g, requires_grad=True)
    a = torch.randn(B, K, generator=g, requires_grad=True)
    m = rag_fast.rag_token_marginal(x, a, impl="cpp")
    w = torch.randn(m.shape, generator=g)
    (m * w).sum().backward()
    assert _info()["in_use_bytes"] >= x.numel() * 4  # x.grad
    xr = x.detach().double().requires_grad_()
    ar = a.detach().double().requires_grad_()
    mr = rag_fast.rag_token_marginal(xr, ar, impl="torch")
    (mr * w.double()).sum().backward()
    torch.testing.assert_close(m.double(), mr, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad.double(), xr.grad, rtol=1e-4, atol=1e-6)


def test_a_bad_limit_is_one_line_from_the_command_and_an_error_before_any_work(monkeypatch):
    """A bad RAG_FAST_POOL_MB does not break ``import rag_fast``; the rag-fast command reports
    it in one line (no traceback), and RagModel's checks and every pool request raise it."""
    import subprocess
    import sys

    env = dict(os.environ, RAG_FAST_POOL_MB="2GB")
    run = subprocess.run([sys.executable, "-c", "import rag_fast; print('imported')"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "imported" in run.stdout, run.stderr
    run = subprocess.run([sys.executable, "-m", "rag_fast.cli", "index", "info", "no-such-index"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, (run.stdout, run.stderr)
    assert "Traceback" not in run.stderr
    assert run.stderr.strip() == ("rag-fast: error: RAG_FAST_POOL_MB must be a whole number of "
                                  "MiB >= 0 (0 turns the pool off), got '2GB'"), run.stderr
    from rag_fast.models.options import check_arguments
    from rag_fast.models.rag_model import RagModel

    monkeypatch.setenv("RAG_FAST_POOL_MB", "-1")
    with pytest.raises(ValueError, match=r"RAG_FAST_POOL_MB must be a whole number of MiB.*'-1'"):
        RagModel(None, None, None)  # before anything looks at the models
    check_arguments(n_docs=3)  # the options' checks name only options
    with pytest.raises(ValueError, match=r"RAG_FAST_POOL_MB must be a whole number of MiB"):
        _pool.empty((MIN_FLOATS,), torch.float32)


def test_a_tensor_subclass_like_gets_its_own_kind():
    class Tagged(torch.Tensor):
        pass

    like = torch.empty(2).as_subclass(Tagged)
    t = _pool.empty((MIN_FLOATS,), torch.float32, like=like)
    assert type(t) is Tagged and t.shape == (MIN_FLOATS,)


@pytest.mark.parametrize("lm_head_loss", ["materialized", "fused"])
def test_the_lm_heads_weight_gradient_comes_from_the_pool(monkeypatch, lm_head_loss):
    """A training step's [V, d] LM-head weight gradient (tied to the input embedding) lands in
    pooled memory, so a step after ``zero_grad(set_to_none=True)`` reuses the last one's instead
    of fresh pages; the gradients are bit-identical to those with the pool off."""
    from rag_fast.models import RagModel
    from rag_fast.testing import tiny_hf_rag

    V, d = 9001, 128  # a 4.4 MiB weight gradient
    model = RagModel.from_transformers(tiny_hf_rag("token", vocab_size=V, d_model=d),
                                       lm_head_loss=lm_head_loss)
    weight = model.generator.get_output_embeddings().weight
    assert weight.numel() * 4 >= _pool.MIN_BYTES
    g = torch.Generator().manual_seed(0)
    contexts = torch.randint(3, V, (2 * 3, 9), generator=g)
    labels = torch.randint(3, V, (2, 5), generator=g)
    scores = torch.randn(2, 3, generator=g)

    def grads():
        model.zero_grad(set_to_none=True)
        model.loss_from_contexts(contexts, torch.ones_like(contexts), scores, labels).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    first = grads()
    assert _info()["in_use_bytes"] >= weight.numel() * 4  # weight.grad, held by the model
    ptr = weight.grad.data_ptr()
    again = grads()
    assert weight.grad.data_ptr() == ptr  # the freed gradient's memory, reused
    monkeypatch.setenv(_pool.ENV, "0")
    rag_fast.empty_cache()
    plain = grads()
    assert _info()["in_use_bytes"] == 0
    assert first.keys() == plain.keys()
    for name in first:
        assert torch.equal(first[name], plain[name]) and torch.equal(again[name], plain[name]), name
