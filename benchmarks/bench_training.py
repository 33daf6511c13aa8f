"""One RAG training step (forward + backward + AdamW step): rag_fast's RagModel vs transformers.

Both providers drive the very same generator (identical weights), the same B*K contexts,
the same passage scores (a leaf with gradient, as the question encoder's output would be) and
the same labels, with the same optimizer (fused AdamW, the default of transformers' Trainer and
of rag_fast's); only the loss path differs. transformers'
``RagTokenForGeneration`` / ``RagSequenceForGeneration`` compute the full logits, their fp32
log-softmax and the marginalisation's temporaries; RagModel computes the logits of the positions
that have a target once (into a buffer it reuses from step to step, in L2-sized vocabulary
chunks), the fused loss writes their gradient in place, and the gradients of the tied input
embeddings are added into the LM head's ``[V, d]`` gradient in place (instead of one dense
``[V, d]`` tensor per lookup, summed out of place). The reused buffer is dropped before the
peak-memory step, so that rag_fast's peak counts it.

Cases: a small generator (d_model 256, 2+2 layers, V=50265) and a BART-base-sized one
(d_model 768, 6+6 layers); B=4, K=5, 64 context tokens, 32 target tokens. ``--quick`` keeps
the run near a minute: only the small generator, 16 target tokens, 1 warm-up + 3 timed steps.
"""
from __future__ import annotations

import torch

from harness import Context, Row, measure_interleaved

NAME = "training"

B, K, CONTEXT, TARGET, VOCAB = 4, 5, 64, 32, 50265

SIZES = {
    "small": dict(d_model=256, layers=2, heads=4, ffn=1024),
    "bart-base": dict(d_model=768, layers=6, heads=12, ffn=3072),
}


def _hf_model(mode: str, size: dict):
    from transformers import (BartConfig, DPRConfig, RagConfig, RagSequenceForGeneration,
                              RagTokenForGeneration)

    question = DPRConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1,
                         num_attention_heads=2, intermediate_size=64)
    generator = BartConfig(
        vocab_size=VOCAB, d_model=size["d_model"], encoder_layers=size["layers"],
        decoder_layers=size["layers"], encoder_attention_heads=size["heads"],
        decoder_attention_heads=size["heads"], encoder_ffn_dim=size["ffn"],
        decoder_ffn_dim=size["ffn"], max_position_embeddings=128, pad_token_id=1,
        bos_token_id=0, eos_token_id=2, decoder_start_token_id=2, forced_bos_token_id=None,
        forced_eos_token_id=None)
    config = RagConfig.from_question_encoder_generator_configs(question, generator, n_docs=K)
    cls = RagTokenForGeneration if mode == "token" else RagSequenceForGeneration
    torch.manual_seed(0)
    return cls(config).train()


def _inputs(target: int):
    g = torch.Generator().manual_seed(0)
    contexts = torch.randint(3, VOCAB, (B * K, CONTEXT), generator=g)
    labels = torch.randint(3, VOCAB, (B, target), generator=g)
    labels[:, 0] = 0  # BOS
    scores = torch.randn(B, K, generator=g)
    return contexts, torch.ones_like(contexts), labels, scores


def _step_fns(mode: str, size: dict, target: int = TARGET, device: str = "cpu"):
    from rag_fast.models import RagModel

    hf = _hf_model(mode, size).to(device)
    ours = RagModel.from_transformers(hf)  # the same generator module: identical weights
    contexts, mask, labels, scores = (t.to(device) for t in _inputs(target))
    params = list(hf.rag.generator.parameters())

    def make(forward):
        scores_leaf = scores.clone().requires_grad_()
        # fused AdamW on both sides: transformers' Trainer default (torch >= 2.8), and rag_fast's
        opt = torch.optim.AdamW(params + [scores_leaf], lr=1e-5, fused=True)

        def step():
            opt.zero_grad(set_to_none=True)
            loss = forward(scores_leaf)
            loss.backward()
            opt.step()
            return float(loss.detach())

        return step

    hf_step = make(lambda s: hf(context_input_ids=contexts, context_attention_mask=mask,
                                doc_scores=s, labels=labels).loss.mean())
    ours_step = make(lambda s: ours(labels, context_input_ids=contexts,
                                    context_attention_mask=mask, doc_scores=s).loss)
    # RagModel reuses its logits buffer between steps; the peak-memory step starts without it
    return hf_step, ours_step, ours.release_buffers


def run(ctx: Context) -> list[Row]:
    sizes = ["small"] if ctx.quick else ["small", "bart-base"]
    target = TARGET // 2 if ctx.quick else TARGET
    rows = []
    for size_name in sizes:
        # a step takes about a second (small) or several (bart-base) on 2 cores: one warm-up
        # step, and at most 3 (quick) or 5 timed steps, the providers' steps alternating; the
        # peak-memory run is one more step
        run_ctx = Context(ctx.device, ctx.quick, min(ctx.repeats, 3 if ctx.quick else 5), 1)
        for mode in ("token", "sequence"):
            hf_step, ours_step, drop_buffers = _step_fns(mode, SIZES[size_name], target, ctx.device)
            case = f"{size_name} {mode} B={B} K={K} L={CONTEXT} T={target}"
            m = measure_interleaved({"transformers": hf_step, "rag_fast": ours_step}, run_ctx,
                                    before_memory={"rag_fast": drop_buffers})
            base, fast = m["transformers"], m["rag_fast"]
            for provider, m in (("transformers", base), ("rag_fast", fast)):
                extra = {"examples/s": B / (m.median_ms / 1e3),
                         "speedup": base.median_ms / m.median_ms}
                if m.peak_mb is not None and base.peak_mb:
                    extra["memory ratio"] = m.peak_mb / base.peak_mb
                rows.append(Row(NAME, case, provider, m.median_ms, m.peak_mb, extra))
    return rows
