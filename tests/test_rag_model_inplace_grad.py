"""RagModel writes the logits' gradient into the logits (inplace_grad, the memory saving of a
training step) and can never get a wrong gradient from it: a second backward through the same
graph raises instead of reading the overwritten logits."""
from __future__ import annotations

import pytest
import torch

from rag_fast.models import RagModel, rag_model
from rag_fast.ops.rag_losses import cpp as _cpp
from rag_fast.testing import tiny_hf_rag
from utils import requires_ext

pytestmark = requires_ext  # impl="auto" on the CPU: the C++ kernels

B, K, L, T = 2, 3, 7, 6


def _batch():
    g = torch.Generator().manual_seed(0)
    contexts = torch.randint(3, 50, (B * K, L), generator=g)
    scores = torch.randn(B, K, generator=g)
    labels = torch.randint(3, 50, (B, T), generator=g)
    labels[:, 0] = 0
    labels[1, -2:] = 1  # padding
    return contexts, torch.ones_like(contexts), scores, labels


def _grads(model: RagModel, batch) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    contexts, mask, scores, labels = batch
    s = scores.clone().requires_grad_()
    model.loss_from_contexts(contexts, mask, s, labels).backward()
    grads = {n: p.grad.to_dense() for n, p in model.named_parameters() if p.grad is not None}
    return {**grads, "doc_scores": s.grad}


@pytest.mark.parametrize("mode,epsilon,launcher", [("token", 0.0, "row_grad"),
                                                   ("token", 0.1, "token_smooth_grad"),
                                                   ("sequence", 0.1, "row_grad")])
def test_gradient_is_written_into_the_logits_and_is_right(mode, epsilon, launcher, monkeypatch):
    model = RagModel.from_transformers(tiny_hf_rag(mode, n_docs=K), lm_head_loss="materialized")
    model.epsilon = epsilon
    batch = _batch()
    in_place = []
    kernel = getattr(_cpp, launcher)

    def spy(x, *args):
        in_place.append(args[-1].data_ptr() == x.data_ptr())
        return kernel(x, *args)

    monkeypatch.setattr(_cpp, launcher, spy)
    grads = _grads(model, batch)
    assert in_place == [True], "the logits' gradient must be written into the logits"

    loss_fn = {"token": rag_model.rag_token_nll, "sequence": rag_model.rag_sequence_nll}[mode]
    monkeypatch.setattr(rag_model, f"rag_{mode}_nll",
                        lambda *a, **kw: loss_fn(*a, **{**kw, "inplace_grad": False}))
    expected = _grads(model, batch)
    assert in_place == [True, False]
    assert grads.keys() == expected.keys()
    for name, g in grads.items():
        torch.testing.assert_close(g, expected[name], rtol=0, atol=0, msg=name)


def test_second_backward_through_the_same_graph_raises():
    model = RagModel.from_transformers(tiny_hf_rag("token", n_docs=K), lm_head_loss="materialized")
    contexts, mask, scores, labels = _batch()
    loss = model.loss_from_contexts(contexts, mask, scores.clone().requires_grad_(), labels)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="inplace_grad=True"):
        loss.backward()
