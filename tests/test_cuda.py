"""The GPU lane's end-to-end tests (benchmarks/gpu_check.sh selects every ``requires_cuda`` test
with ``-m requires_cuda``): the beam step at BART's vocabulary, RAG-Token and RAG-Sequence
decoding, training steps, and the retrieval's exact torch search, on a CUDA device.

Without a GPU they are skipped, except under ``RAG_FAST_GPU_LANE_DRY_RUN=1`` (the lane's
``--dry-run``), where they run on the CPU through Triton's interpreter at small shapes, so that
the lane itself is tested in CI. No module-level import of faiss: the GPU machine has none.
"""
from __future__ import annotations

import os

import pytest
import torch

from rag_fast.ops import rag_token_beam_step
from rag_fast.reference_decoding import rag_token_beam_candidates
from rag_fast.reference_decoding import rag_token_beam_step as reference_step
from rag_fast.testing import tiny_hf_rag
from utils import assert_close_rule, requires_cuda

pytestmark = pytest.mark.requires_cuda
DRY_RUN = os.environ.get("RAG_FAST_GPU_LANE_DRY_RUN") == "1"


@pytest.fixture
def device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda")
    if DRY_RUN:
        return torch.device("cpu")
    pytest.skip("needs a CUDA device (or RAG_FAST_GPU_LANE_DRY_RUN=1: the CPU interpreter)")


def vocabulary(device: torch.device) -> int:
    """BART's V on a GPU; a small odd V (three interpreter tiles and a tail) on the CPU."""
    return 50265 if device.type == "cuda" else 67


# ---- the beam step ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_beam_step_full_vocabulary(device, dtype):
    if device.type == "cpu" and dtype != torch.float32:
        pytest.skip("the interpreter runs float32 only")
    B, W, K, V = 4, 4, 5, vocabulary(device)
    g = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(B, W, K, V, generator=g)).to(dtype)
    scores = torch.randn(B, K, generator=g)
    scores[0, -1] = float("-inf")  # a missing passage
    a = torch.log_softmax(scores, 1)
    beam = torch.randn(B, W, generator=g)
    bias = torch.zeros(B * W, V)
    bias[:, 2] = float("-inf")  # EOS below the minimum length
    got = rag_token_beam_step(x.to(device), a.to(device), beam.to(device), bias.to(device),
                              impl="triton")
    got_scores, beams, tokens = (t.cpu() for t in got)
    oracle, _, _ = reference_step(x.double(), a.double(), beam.double(), bias.double())
    plain, _, _ = reference_step(x.float(), a, beam, bias)
    assert_close_rule(got_scores, plain, oracle, torch.float32, "beam step scores")
    # Every returned (beam, token) scores what the step says it does.
    cand = rag_token_beam_candidates(x.double(), a.double(), beam.double(), bias.double())
    picked = cand[torch.arange(B)[:, None], beams, tokens]
    assert_close_rule(picked.float(), plain, oracle, torch.float32, "beam step pairs")


@requires_cuda
def test_offsets_beyond_2_to_the_31():
    # B*W*K*V > 2^31 bf16 logits (4.3 GB): int32 offsets would wrap and read the wrong rows.
    # The last question (and the last row) is checked against the reference on its own slice.
    B, W, K, V = 2137, 4, 5, 50265
    assert B * W * K * V > 2**31
    x = torch.empty(B, W, K, V, dtype=torch.bfloat16, device="cuda").normal_(0, 3)
    a = torch.log_softmax(torch.randn(B, K, device="cuda"), 1)
    beam = torch.randn(B, W, device="cuda")
    got, beams, tokens = rag_token_beam_step(x, a, beam, impl="triton")
    last = slice(B - 1, B)
    want, want_beams, want_tokens = reference_step(x[last].double(), a[last].double(),
                                                   beam[last].double())
    plain, _, _ = reference_step(x[last].float(), a[last], beam[last])
    assert_close_rule(got[last].cpu(), plain.cpu(), want.cpu(), torch.float32, "last question")
    from rag_fast.kernels import rag_losses

    lse, _, x_sum = rag_losses.row_stats(x, None, 0)  # x read as [B, W, K, V] rows
    row = x[-1, -1, -1]
    assert_close_rule(lse[-1, -1, -1:].cpu(), row.float().logsumexp(-1, keepdim=True).cpu(),
                      row.double().logsumexp(-1, keepdim=True).cpu(), torch.float32, "last lse")
    assert_close_rule(x_sum[-1, -1, -1:].cpu(), row.float().sum(-1, keepdim=True).cpu(),
                      row.double().sum(-1, keepdim=True).cpu(), torch.float32, "last sum")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
@requires_cuda
def test_kernels_launch_on_the_tensors_device():
    # Tensors on cuda:1 while cuda:0 is current: every launch must follow the tensors.
    x = torch.randn(2, 2, 3, 1000, device="cuda:1")
    a = torch.log_softmax(torch.randn(2, 3, device="cuda:1"), 1)
    beam = torch.zeros(2, 2, device="cuda:1")
    with torch.cuda.device(0):
        got, _, _ = rag_token_beam_step(x, a, beam, impl="triton")
    want, _, _ = reference_step(x.double(), a.double(), beam.double())
    assert_close_rule(got.cpu(), reference_step(x, a, beam)[0].cpu(), want.cpu(),
                      torch.float32, "beam step on cuda:1")


# ---- decoding and training on the device --------------------------------------------------


def _generation_model(mode: str, device: torch.device):
    """A tiny RAG model whose answers depend on the passages (larger random weights)."""
    model = tiny_hf_rag(mode, seed=0, n_docs=3, vocab_size=60, d_model=32, layers=2)
    torch.manual_seed(100)
    with torch.no_grad():
        for p in model.rag.generator.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.3)
    return model.to(device)


def _generation_inputs(device: torch.device):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 60, (3 * 3, 9), generator=g)
    mask = torch.ones_like(ids)
    ids[0, 4:], mask[0, 4:] = 1, 0  # one padded question
    return ids.to(device), mask.to(device), torch.randn(3, 3, generator=g).to(device)


@pytest.mark.parametrize("mode,kw", [
    ("token", dict(num_beams=3)),
    ("token", dict(num_beams=1)),
    ("sequence", dict(num_beams=3)),
    ("sequence", dict(num_beams=3, decoding="fast")),
], ids=["token-beam3", "token-greedy", "sequence-thorough", "sequence-fast"])
def test_generation_on_device(device, mode, kw):
    from rag_fast.generation import rag_sequence_generate, rag_token_generate

    model = _generation_model(mode, device)
    ids, mask, scores = _generation_inputs(device)
    generate = rag_token_generate if mode == "token" else rag_sequence_generate
    got = generate(model, ids, mask, scores, max_length=8, **kw)
    assert got.device.type == device.type
    if kw.get("decoding") == "fast":  # transformers has no fast RAG-Sequence decoding
        on_cpu = generate(model.cpu(), ids.cpu(), mask.cpu(), scores.cpu(), max_length=8, **kw)
        assert torch.equal(got.cpu(), on_cpu)
        return
    expected = model.generate(context_input_ids=ids, context_attention_mask=mask,
                              doc_scores=scores, max_length=8, **kw)
    assert torch.equal(got, expected), f"\n{got}\n!=\n{expected}"


def test_training_steps_on_device(device):
    # Three optimizer steps of RagModel with the fused loss on the device follow the same
    # trajectory as on the CPU (losses within float32 rounding of a few steps).
    from rag_fast.models import RagModel

    def run(dev: torch.device) -> list[float]:
        model = RagModel.from_transformers(tiny_hf_rag("token", seed=0, n_docs=3)).to(dev)
        model.eval()  # no dropout: the two devices draw different masks
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        g = torch.Generator().manual_seed(1)
        labels = torch.randint(3, 50, (2, 6), generator=g).to(dev)
        q = torch.randint(3, 99, (2, 4), generator=g).to(dev)
        emb = torch.randn(2, 3, 16, generator=g).to(dev)
        ctx = torch.randint(3, 50, (6, 10), generator=g).to(dev)
        losses = []
        for _ in range(3):
            loss = model(labels, question_input_ids=q, passage_embeddings=emb,
                         context_input_ids=ctx, context_attention_mask=torch.ones_like(ctx)).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
        return losses

    on_device, on_cpu = run(device), run(torch.device("cpu"))
    assert on_device == pytest.approx(on_cpu, rel=1e-4), (on_device, on_cpu)
    assert on_device[-1] < on_device[0]  # the steps trained something


def test_exact_search_on_device(device):
    # The retrieval's torch exact search (the GPU fallback when faiss has no GPU support) finds
    # the same ids on the device as on the CPU.
    from rag_fast.retrieval._exact import exact_search  # no faiss needed (none on the lane)

    g = torch.Generator().manual_seed(0)
    vectors = torch.randn(5000, 64, generator=g).half()
    queries = torch.randn(32, 64, generator=g)
    scores, ids = exact_search(vectors.to(device), queries.to(device), 10, chunk=1024)
    want_scores, want_ids = exact_search(vectors, queries, 10, chunk=1024)
    assert ids.device.type == device.type
    assert torch.equal(ids.cpu(), want_ids)
    torch.testing.assert_close(scores.cpu(), want_scores, rtol=1e-4, atol=1e-4)
