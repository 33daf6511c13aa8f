"""``inplace_grad=True`` never writes a gradient into a leaf's memory: logits that are a leaf, a
view of a leaf (any layout, any chain of views) or share a leaf's storage are refused (or, for
the reference, at least left untouched); logits an op computed still take their gradient in
place, and that gradient equals the one of ``inplace_grad=False``."""
from __future__ import annotations

import pytest
import torch

import rag_fast
from rag_fast.models._seq2seq import LMHead, LogitsWorkspace, lm_logits
from utils import requires_ext, requires_triton

B, K, T, V = 2, 3, 4, 7
IMPLS = [
    pytest.param("torch", id="torch"),
    pytest.param("cpp", id="cpp", marks=requires_ext),
    pytest.param("triton", id="triton", marks=requires_triton),
]
KERNEL_IMPLS = IMPLS[1:]
# (loss, epsilon): RAG-Token through row_stats and through token_smooth_forward, RAG-Sequence
LOSSES = [
    pytest.param(rag_fast.rag_token_nll, 0.0, id="token"),
    pytest.param(rag_fast.rag_token_nll, 0.1, id="token_smooth"),
    pytest.param(rag_fast.rag_sequence_nll, 0.1, id="sequence"),
]
REFUSED = "inplace_grad=True would overwrite the leaf tensor"


def _inputs():
    """Passage scores [B, K] and targets [B, T] (one ignored)."""
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(B, K, generator=g)
    targets = torch.randint(0, V, (B, T), generator=g)
    targets[0, -1] = -100
    return scores, targets


def _leaf(*shape: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * 2).requires_grad_()


def _refused_or_untouched(fn, eps, impl, leaf, logits, match=REFUSED):
    """The loss with ``inplace_grad=True`` on ``logits`` (memory of ``leaf``) raises, or runs and
    leaves the leaf's values as they were. Returns "refused" or "untouched"."""
    scores, targets = _inputs()
    before = leaf.detach().clone()
    try:
        loss = fn(logits, scores, targets, n_docs=K, epsilon=eps, impl=impl, inplace_grad=True)
        loss.sum().backward()
    except ValueError as exc:
        assert "inplace_grad" in str(exc) and "inplace_grad=False" in str(exc), str(exc)
        if match is not None:
            assert match in str(exc), str(exc)
        outcome = "refused"
    else:
        outcome = "untouched"
    assert torch.equal(leaf.detach(), before), "the leaf's values were overwritten"
    return outcome


# ---- leaves and views of leaves: refused by every impl ------------------------------------


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("fn,eps", LOSSES)
def test_flat_leaf_and_its_4d_view_are_refused(fn, eps, impl):
    leaf = _leaf(B * K, T, V)  # [B*K, T, V], the layout of a generator's output
    assert _refused_or_untouched(fn, eps, impl, leaf, leaf) == "refused"
    # reshaped to [B, K, T, V] by the caller (README): not a leaf itself, a view of one
    assert _refused_or_untouched(fn, eps, impl, leaf, leaf.reshape(B, K, T, V)) == "refused"
    assert _refused_or_untouched(fn, eps, impl, leaf, leaf.view(B, K, T, V)) == "refused"
    # and a second loss on the same leaf still reads its values
    scores, targets = _inputs()
    want = fn(leaf.detach().clone().view(B, K, T, V), scores, targets, epsilon=eps, impl=impl)
    got = fn(leaf.view(B, K, T, V), scores, targets, epsilon=eps, impl=impl)
    torch.testing.assert_close(got.detach(), want)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("fn,eps", LOSSES)
def test_4d_leaf_is_refused(fn, eps, impl):
    leaf = _leaf(B, K, T, V)
    assert _refused_or_untouched(fn, eps, impl, leaf, leaf) == "refused"


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("fn,eps", LOSSES)
def test_view_chains_of_a_leaf_are_refused(fn, eps, impl):
    leaf = _leaf(K, B, T, V + 3)
    chains = {
        # slice along V then transpose: stride 1 along V kept, not contiguous
        "slice_transpose": lambda x: x[..., :V].transpose(0, 1),
        # views of views: flatten, slice, split again, transpose, a no-op transpose pair
        "view_of_view": lambda x: x.reshape(K * B, T, V + 3)[..., 1:V + 1].view(K, B, T, V)
        .transpose(0, 1).transpose(2, 3).transpose(2, 3),
        "as_strided": lambda x: torch.as_strided(x, (B, K, T, V), (T * (V + 3), B * T * (V + 3),
                                                                   V + 3, 1)),
        "expand_same_size": lambda x: x[..., :V].transpose(0, 1).expand(B, K, T, V),
    }
    for name, chain in chains.items():
        logits = chain(leaf)
        assert not logits.is_leaf and logits.shape == (B, K, T, V), name
        assert _refused_or_untouched(fn, eps, impl, leaf, logits) == "refused", name
    # a reshape that has to copy is no view: the copy takes the gradient, the leaf keeps its
    # values
    copy = leaf[..., :V].transpose(0, 1).reshape(B * K, T, V)
    assert copy._base is None
    assert _refused_or_untouched(fn, eps, impl, leaf, copy) == "untouched"
    # vocabulary axes not of stride 1 (the loss would copy them for the kernels): a stride of
    # 2, and a transposed leaf [B, K, V, T]
    wide = _leaf(B, K, T, 2 * V)
    assert _refused_or_untouched(fn, eps, impl, wide, wide[..., ::2]) == "refused"
    tall = _leaf(B, K, V, T)
    assert _refused_or_untouched(fn, eps, impl, tall, tall.transpose(2, 3)) == "refused"
    # broadcast over K: refused too (for the kernels also because the elements overlap)
    one = _leaf(B, 1, T, V)
    assert _refused_or_untouched(fn, eps, impl, one, one.expand(B, K, T, V),
                                 match=None) == "refused"


# ---- aliases that are not views ----------------------------------------------------------


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("fn,eps", LOSSES)
def test_detached_alias_that_requires_grad_is_refused(fn, eps, impl):
    leaf = _leaf(B * K, T, V)
    alias = leaf.detach().requires_grad_()  # the leaf's storage, a leaf of its own
    assert _refused_or_untouched(fn, eps, impl, leaf, alias) == "refused"
    alias4 = leaf.detach().view(B, K, T, V).requires_grad_()
    assert _refused_or_untouched(fn, eps, impl, leaf, alias4) == "refused"
    base = leaf.detach().requires_grad_()
    assert _refused_or_untouched(fn, eps, impl, leaf, base.view(B, K, T, V)) == "refused"


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("fn,eps", LOSSES)
def test_storage_alias_outside_autograd_views(fn, eps, impl):
    """``aten._unsafe_view`` shares the leaf's storage without being a view: the kernels (which
    write) compare storages and refuse; the reference writes nothing."""
    leaf = _leaf(B * K, T, V)
    alias = torch.ops.aten._unsafe_view(leaf, (B, K, T, V))
    assert alias._base is None and not alias.is_leaf
    outcome = _refused_or_untouched(fn, eps, impl, leaf, alias)
    assert outcome == ("untouched" if impl == "torch" else "refused")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("fn,eps", LOSSES[1:])  # each statistics op once
def test_nothing_is_written_where_no_backward_runs(fn, eps, impl):
    """A detached alias of a leaf, or a leaf under no_grad: no gradient for the logits, so
    nothing to refuse and nothing written."""
    scores, targets = _inputs()
    leaf = _leaf(B * K, T, V)
    s = scores.clone().requires_grad_()
    before = leaf.detach().clone()
    fn(leaf.detach(), s, targets, n_docs=K, epsilon=eps, impl=impl,
       inplace_grad=True).sum().backward()
    assert s.grad is not None and torch.equal(leaf.detach(), before)
    with torch.no_grad():
        fn(leaf.view(B, K, T, V), scores, targets, epsilon=eps, impl=impl, inplace_grad=True)
    assert torch.equal(leaf.detach(), before)


@pytest.mark.parametrize("impl", KERNEL_IMPLS)
@pytest.mark.parametrize("op", ["row_stats", "token_smooth_forward"])
def test_the_custom_ops_refuse_a_view_of_a_leaf(op, impl):
    """Called directly, the statistics ops (which do the write) refuse the same logits."""
    scores, targets = _inputs()
    leaf = _leaf(B * K, T, V)
    a = torch.log_softmax(scores, dim=1)
    for logits in (leaf.view(B, K, T, V), torch.ops.aten._unsafe_view(leaf, (B, K, T, V))):
        args = ((logits, targets, -100, impl, True) if op == "row_stats"
                else (logits, targets, -100, a, True, impl, True))
        with pytest.raises(ValueError, match=f"rag_fast::{op}: {REFUSED}"):
            getattr(torch.ops.rag_fast, op)(*args)


# ---- logits an op computed: still written in place, same gradient -------------------------


def _grads(fn, eps, impl, h, weight, inplace_grad, view):
    """Gradients of h, weight and the scores, d loss / d logits (None under inplace_grad: no
    buffer of its own to keep) and the logits' buffer after the backward."""
    scores, targets = _inputs()
    h, weight, s = (t.clone().requires_grad_() for t in (h, weight, scores))
    logits = h @ weight.t()  # [B*K, T, V], an LM head's output
    if not inplace_grad:
        logits.retain_grad()
    x = logits.view(B, K, T, V) if view else logits
    loss = fn(x, s, targets, n_docs=K, epsilon=eps, impl=impl, inplace_grad=inplace_grad)
    loss.sum().backward()
    return (h.grad, weight.grad, s.grad), None if inplace_grad else logits.grad, logits.detach()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("fn,eps,view", [
    pytest.param(rag_fast.rag_token_nll, 0.0, False, id="token-flat"),
    pytest.param(rag_fast.rag_token_nll, 0.1, True, id="token_smooth-view4"),
    pytest.param(rag_fast.rag_sequence_nll, 0.1, True, id="sequence-view4"),
])
def test_computed_logits_still_take_their_gradient_in_place(fn, eps, view, impl):
    g = torch.Generator().manual_seed(1)
    h, weight = torch.randn(B * K, T, 5, generator=g), torch.randn(V, 5, generator=g)
    plain, d_logits, after_plain = _grads(fn, eps, impl, h, weight, False, view)
    inplace, _, after_inplace = _grads(fn, eps, impl, h, weight, True, view)
    for name, got, want in zip(("d h", "d weight", "d scores"), inplace, plain):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6,
                                   msg=lambda m, n=name: f"{n}: {m}")
    torch.testing.assert_close(after_plain, h @ weight.t())  # untouched without inplace_grad
    if impl != "torch":  # the kernels wrote d loss / d logits over the logits
        torch.testing.assert_close(after_inplace, d_logits, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("impl", KERNEL_IMPLS)
@pytest.mark.parametrize("fn,eps", LOSSES[1:])
def test_workspace_logits_are_written_in_place(fn, eps, impl):
    """RagModel's logits: a view of a workspace buffer that does not require grad (not a
    leaf's memory); the gradient goes into the buffer and equals the plain one."""
    g = torch.Generator().manual_seed(2)
    h0, w0 = torch.randn(B * K, T, 5, generator=g), torch.randn(V, 5, generator=g)
    scores, targets = _inputs()
    workspace = LogitsWorkspace()
    results = []
    for inplace_grad in (True, False):
        h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
        logits = lm_logits(LMHead(w, None, 1.0), h, workspace)  # [B*K, T, V]
        assert logits._base is not None and not logits._base.requires_grad
        if not inplace_grad:
            logits.retain_grad()
        fn(logits, scores, targets, n_docs=K, epsilon=eps, impl=impl,
           inplace_grad=inplace_grad).sum().backward()
        results.append((h.grad, w.grad, None if inplace_grad else logits.grad,
                        logits.detach().clone()))
    (gh, gw, _, written), (ph, pw, d_logits, _) = results
    torch.testing.assert_close(gh, ph, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(gw, pw, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(written, d_logits, rtol=1e-6, atol=1e-6)  # the buffer holds it


@pytest.mark.parametrize("fn,eps", LOSSES[1:])
def test_compiled_loss_ignores_inplace_grad(fn, eps):
    """Under torch.compile inplace_grad is ignored: a leaf is neither refused nor written."""
    scores, targets = _inputs()
    leaf = _leaf(B, K, T, V)
    before = leaf.detach().clone()

    def loss_fn(x):
        return fn(x, scores, targets, epsilon=eps, inplace_grad=True).sum()

    torch._dynamo.reset()
    torch.compile(loss_fn, backend="eager")(leaf).backward()
    assert torch.equal(leaf.detach(), before)
    want = leaf.detach().clone().requires_grad_()
    fn(want, scores, targets, epsilon=eps).sum().backward()
    torch.testing.assert_close(leaf.grad, want.grad)
