"""rag_fast.use_fused_losses: transformers' own RAG models give the same losses and gradients."""
from __future__ import annotations

import pytest
import torch

import rag_fast
from rag_fast.testing import tiny_hf_rag


def _forward_and_grads(model, inputs):
    model.zero_grad()
    scores = inputs["doc_scores"].clone().requires_grad_()
    out = model(context_input_ids=inputs["ctx"], context_attention_mask=inputs["mask"],
                doc_scores=scores, labels=inputs["labels"], reduce_loss=False)
    out.loss.sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.loss.detach(), scores.grad, grads, out.logits.detach()


@pytest.mark.parametrize("mode", ["token", "sequence"])
@pytest.mark.parametrize("epsilon", [0.0, 0.1])
def test_patched_model_equals_original(mode, epsilon):
    B, K, L, T = 2, 3, 7, 5
    g = torch.Generator().manual_seed(0)
    inputs = {
        "ctx": torch.randint(3, 50, (B * K, L), generator=g),
        "mask": torch.ones(B * K, L, dtype=torch.long),
        "doc_scores": torch.randn(B, K, generator=g),
        "labels": torch.randint(3, 50, (B, T), generator=g),
    }
    inputs["labels"][1, -2:] = 1  # padding at the end of question 1
    inputs["doc_scores"][0, 2] = -float("inf")  # a missing passage
    original = tiny_hf_rag(mode, n_docs=K)
    original.config.label_smoothing = epsilon
    patched = tiny_hf_rag(mode, n_docs=K)  # same seed: same weights
    patched.config.label_smoothing = epsilon
    assert rag_fast.use_fused_losses(patched) is patched
    want = _forward_and_grads(original, inputs)
    got = _forward_and_grads(patched, inputs)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], want[1], rtol=1e-4, atol=1e-6)
    assert got[2].keys() == want[2].keys()
    for name in want[2]:
        torch.testing.assert_close(got[2][name], want[2][name], rtol=1e-4, atol=1e-6, msg=name)
    torch.testing.assert_close(got[3], want[3], rtol=1e-5, atol=1e-5)  # marginalised logits


@pytest.mark.parametrize("all_bos", [True, False])
def test_patched_sequence_nll_excludes_bos_as_transformers_does(all_bos):
    """exclude_bos_score=True: BOS (position 0 of the shifted targets) leaves the NLL only if
    every target starts with it; the patched get_nll decides it on the device and agrees."""
    B, K, T, V = 2, 3, 5, 50
    g = torch.Generator().manual_seed(1)
    original = tiny_hf_rag("sequence", n_docs=K)
    patched = rag_fast.use_fused_losses(tiny_hf_rag("sequence", n_docs=K))
    bos = original.config.generator.bos_token_id
    target = torch.randint(3, V, (B, T), generator=g)
    target[:, 1] = bos  # the shifted targets start with BOS
    if not all_bos:
        target[1, 1] = 7
    logits = torch.randn(B * K, T, V, generator=g)
    scores = torch.randn(B, K, generator=g)
    results = []
    for model in (original, patched):
        for exclude in (True, False):
            results.append(model.get_nll(logits, scores, target, exclude_bos_score=exclude,
                                         n_docs=K))
    want_excluded, want_kept, got_excluded, got_kept = results
    torch.testing.assert_close(got_excluded, want_excluded, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_kept, want_kept, rtol=1e-5, atol=1e-5)
    assert torch.allclose(got_excluded, got_kept) != all_bos  # the flag acts only then


def test_class_wide_patch_and_bad_model():
    from transformers import RagSequenceForGeneration, RagTokenForGeneration

    saved = (RagTokenForGeneration.get_nll, RagTokenForGeneration.marginalize,
             RagSequenceForGeneration.get_nll)
    try:
        assert rag_fast.use_fused_losses() is None
        model = tiny_hf_rag("token")
        assert model.get_nll.__func__.__module__ == "rag_fast.integrations.transformers"
    finally:
        (RagTokenForGeneration.get_nll, RagTokenForGeneration.marginalize,
         RagSequenceForGeneration.get_nll) = saved
    with pytest.raises(ValueError, match="model must be a transformers RagTokenForGeneration"):
        rag_fast.use_fused_losses(torch.nn.Linear(2, 2))
