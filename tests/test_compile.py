"""torch.compile of a RagModel training step with the fused losses (the custom ops of
rag_fast/ops/rag_losses.py): no graph break inside rag_fast, and the same loss and gradients
as eager (which writes the logits' gradient in place and reuses its logits buffer)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch._dynamo

import rag_fast
from rag_fast.models import RagModel
from rag_fast.testing import tiny_hf_rag
from utils import requires_ext

pytestmark = requires_ext  # impl="auto" on the CPU: the C++ kernels

B, K, L, T = 2, 3, 7, 6
PACKAGE = str(Path(rag_fast.__file__).resolve().parent)


def _model(mode: str, epsilon: float) -> RagModel:
    model = RagModel.from_transformers(tiny_hf_rag(mode, n_docs=K))
    model.epsilon = epsilon
    return model


def _inputs():
    g = torch.Generator().manual_seed(0)
    contexts = torch.randint(3, 50, (B * K, L), generator=g)
    mask = torch.ones_like(contexts)
    mask[1, -2:] = 0  # a padded context
    scores = torch.randn(B, K, generator=g) * 2
    labels = torch.randint(3, 50, (B, T), generator=g)
    labels[:, 0] = 0  # BOS
    labels[1, -2:] = 1  # padding
    return contexts, mask, scores, labels


def _step(model: RagModel, step_fn, contexts, mask, scores, labels):
    """One training step: loss and the gradients of every parameter and of the scores."""
    model.zero_grad(set_to_none=True)
    s = scores.clone().requires_grad_()
    loss = step_fn(contexts, mask, s, labels)
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    grads["doc_scores"] = s.grad
    return loss.detach(), grads


def _in_rag_fast(frame) -> bool:
    return str(Path(frame.filename).resolve()).startswith(PACKAGE)


@pytest.mark.parametrize("mode,epsilon", [("token", 0.1), ("sequence", 0.1)])
def test_training_step_has_no_graph_break_in_rag_fast(mode, epsilon):
    model = _model(mode, epsilon)
    contexts, mask, scores, labels = _inputs()
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model.loss_from_contexts)(
        contexts, mask, scores.clone().requires_grad_(), labels)
    ours = [r for r in explained.break_reasons if r.user_stack and _in_rag_fast(r.user_stack[-1])]
    assert not ours, "graph breaks in rag_fast:\n" + "\n".join(
        f"{r.reason.splitlines()[0]} at {r.user_stack[-1].filename}:{r.user_stack[-1].lineno}"
        for r in ours)
    # Observed with transformers 5.x: the whole step (generator included) is one graph.
    assert explained.graph_count >= 1
    ops = {str(node.target) for g in explained.graphs for node in g.graph.nodes
           if node.op == "call_function"}
    stats_op = str(torch.ops.rag_fast.token_smooth_forward if epsilon > 0 and mode == "token"
                   else torch.ops.rag_fast.row_stats)
    assert stats_op in ops, f"the fused loss must appear in the graph as {stats_op}: {ops}"


@pytest.mark.parametrize("mode,epsilon", [
    ("token", 0.1),  # token_smooth_forward and its backward (token_smooth_grad)
    ("sequence", 0.1),  # row_stats and its backward (row_grad)
])
def test_compiled_training_step_equals_eager(mode, epsilon):
    model = _model(mode, epsilon)
    batch = _inputs()
    eager_loss, eager_grads = _step(model, model.loss_from_contexts, *batch)
    torch._dynamo.reset()
    compiled = torch.compile(model.loss_from_contexts, backend="aot_eager")
    loss, grads = _step(model, compiled, *batch)
    torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=1e-6)
    assert grads.keys() == eager_grads.keys()
    for name, g in grads.items():
        torch.testing.assert_close(g, eager_grads[name].to_dense(), rtol=1e-4, atol=1e-6,
                                   msg=lambda m, n=name: f"{n}: {m}")


def test_inductor_lm_head_and_loss_equal_eager():
    """Inductor generates code around the custom ops (a mutating one in the backward); the
    whole generator would take a minute to compile on two cores, the LM head and loss do not."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(B * K, T, 8, generator=g)
    weight = torch.randn(37, 8, generator=g)
    scores = torch.randn(B, K, generator=g)
    targets = torch.randint(0, 37, (B, T), generator=g)
    targets[1, -2:] = -100

    def loss_fn(h, weight, scores, targets):
        logits = h @ weight.t()  # [B*K, T, V]
        token = rag_fast.rag_token_nll(logits, scores, targets, n_docs=K, epsilon=0.1,
                                       reduction="sum")
        return token + rag_fast.rag_sequence_nll(logits, scores, targets, n_docs=K,
                                                 reduction="sum")

    def run(fn):
        leaves = [t.clone().requires_grad_() for t in (h, weight, scores)]
        loss = fn(*leaves, targets)
        loss.backward()
        return [loss.detach()] + [t.grad for t in leaves]

    torch._dynamo.reset()
    compiled = torch.compile(loss_fn, backend="inductor", fullgraph=True)
    for name, got, want in zip(("loss", "d h", "d weight", "d scores"), run(compiled),
                               run(loss_fn)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")


def test_marginal_and_beam_step_compile_in_one_graph():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(B, K, T, 11, generator=g)
    scores = torch.randn(B, K, generator=g)
    beam_logits = torch.randn(B, 2, K, 11, generator=g)
    beam_scores = torch.randn(B, 2, generator=g)

    def fn(logits, scores):
        marginal = rag_fast.rag_token_marginal(logits, scores)
        prior = torch.log_softmax(scores, dim=1)
        return marginal, rag_fast.rag_token_beam_step(beam_logits, prior, beam_scores)

    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    x = logits.clone().requires_grad_()
    (marginal, step), (want_marginal, want_step) = compiled(x, scores), fn(logits, scores)
    torch.testing.assert_close(marginal, want_marginal, rtol=0, atol=0)
    for got, want in zip(step, want_step):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    upstream = torch.randn(marginal.shape, generator=g)
    marginal.backward(upstream)
    want_x = logits.clone().requires_grad_()
    rag_fast.rag_token_marginal(want_x, scores).backward(upstream)
    torch.testing.assert_close(x.grad, want_x.grad, rtol=1e-6, atol=1e-6)
