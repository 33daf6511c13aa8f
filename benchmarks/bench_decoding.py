"""Decoding throughput: rag_fast vs transformers' RAG generate, and the beam step alone.

Identical weights, passages and settings on both sides (context_input_ids, masks and doc
scores given directly, so no retriever runs); every run generates exactly the same number of
new tokens (min = max), and the rows check that both return the same ids (from the timed runs).
The small generator's weights are re-initialised larger (std 0.3) so that answers depend on
the passage and the K*W hypotheses of a question are distinct, as with a trained model: with
the default initialisation every passage yields the same beams and RAG-Sequence's rescoring
has almost nothing to do. The BART-base-sized one keeps the default initialisation: with
distinct hypotheses, transformers' rescoring (which re-encodes every passage for every
candidate) alone would take most of an hour on 2 cores.
Full sizes (the issue's): B=8 questions, K=5 passages, 4 beams, 20 new tokens, V=50265, a small
generator (d_model 256, 2+2 layers) and a BART-base-sized one (768, 6+6, 12 heads). --quick:
one question, 6 new tokens, the small generator only, one timed run each (indicative ratios
only), within about 45 s on 2 idle CPU cores.
"""
from __future__ import annotations

import dataclasses

import torch

from harness import Context, Row, measure

NAME = "decoding"
VOCAB = 50265


def _models(d_model: int, layers: int, heads: int, ffn: int, n_docs: int, init_std: float | None):
    from transformers import BartConfig, DPRConfig, RagConfig, RagSequenceForGeneration
    from transformers import RagTokenForGeneration

    q = DPRConfig(vocab_size=99, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                  intermediate_size=64)
    g = BartConfig(vocab_size=VOCAB, d_model=d_model, encoder_layers=layers,
                   decoder_layers=layers, encoder_attention_heads=heads,
                   decoder_attention_heads=heads, encoder_ffn_dim=ffn, decoder_ffn_dim=ffn,
                   max_position_embeddings=256, pad_token_id=1, bos_token_id=0, eos_token_id=2,
                   decoder_start_token_id=2, forced_bos_token_id=None, forced_eos_token_id=None)
    config = RagConfig.from_question_encoder_generator_configs(q, g, n_docs=n_docs)
    torch.manual_seed(0)
    token = RagTokenForGeneration(config).eval()
    if init_std is not None:
        with torch.no_grad():
            for p in token.rag.generator.parameters():
                if p.dim() >= 2:
                    p.normal_(0.0, init_std)
    sequence = RagSequenceForGeneration(config).eval()
    sequence.rag.generator.load_state_dict(token.rag.generator.state_dict())
    return token, sequence


def _inputs(B: int, K: int, S: int):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, VOCAB, (B * K, S), generator=g)
    mask = torch.ones_like(ids)
    return ids, mask, torch.randn(B, K, generator=g)


def _beam_step_rows(ctx: Context, B: int, W: int, K: int, reference: bool) -> list[Row]:
    from rag_fast.ops import rag_token_beam_step

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(B * W * K, 1, VOCAB, generator=g) * 3  # the generator's [rows, 1, V]
    doc_scores = torch.randn(B * W, K, generator=g)
    beam = torch.randn(B, W, generator=g)

    def hf_step():  # transformers: marginalize, then beam search's log_softmax, add, topk
        lp = torch.log_softmax(logits, dim=-1).view(B * W, K, 1, VOCAB)
        marginal = torch.logsumexp(lp + torch.log_softmax(doc_scores, 1)[:, :, None, None], 1)
        scores = torch.log_softmax(marginal[:, -1], dim=-1).view(B, W, VOCAB) + beam[:, :, None]
        return torch.topk(scores.view(B, -1), 2 * W)

    prior = torch.log_softmax(doc_scores.view(B, W, K)[:, 0], 1)
    x = logits.view(B, W, K, VOCAB)
    rows = []
    base = measure(hf_step, ctx, memory=False)
    gb = x.numel() * 4 / 1e9
    case = f"beam step B={B} W={W} K={K} V={VOCAB}"
    rows.append(Row(NAME, case, "transformers", base.median_ms, None, {"speedup": 1.0}))
    for impl in ("cpp", "torch") if reference else ("cpp",):
        m = measure(lambda: rag_token_beam_step(x, prior, beam, impl=impl), ctx, memory=False)
        rows.append(Row(NAME, case, f"rag_fast ({impl})", m.median_ms, None,
                        {"speedup": base.median_ms / m.median_ms,
                         "GB/s": gb / (m.median_ms / 1e3)}))
    return rows


def _timed(fn, ctx: Context):
    """``(measurement, ids of the last timed run)``."""
    out = {}

    def call():
        out["ids"] = fn()

    with torch.no_grad():
        m = measure(call, ctx, memory=False)
    return m, out["ids"]


def _generation_rows(ctx: Context, label: str, dims: tuple, init_std: float | None, B: int,
                     K: int, W: int, new: int) -> list[Row]:
    from rag_fast.generation import rag_sequence_generate, rag_token_generate

    token, sequence = _models(*dims, n_docs=K, init_std=init_std)
    ids, mask, scores = _inputs(B, K, 64)
    settings = dict(num_beams=W, max_length=new + 1, min_length=new + 1)
    runs = {
        "RAG-Token beam": (
            lambda: token.generate(context_input_ids=ids, context_attention_mask=mask,
                                   doc_scores=scores, **settings),
            lambda: rag_token_generate(token, ids, mask, scores, **settings),
        ),
        "RAG-Sequence thorough": (
            lambda: sequence.generate(context_input_ids=ids, context_attention_mask=mask,
                                      doc_scores=scores, **settings),
            lambda: rag_sequence_generate(sequence, ids, mask, scores, **settings),
        ),
    }
    rows = []
    tokens = B * new
    for what, (hf, ours) in runs.items():
        base, hf_ids = _timed(hf, ctx)
        mine, our_ids = _timed(ours, ctx)
        same = torch.equal(hf_ids, our_ids)
        case = f"{what} {label} B={B} K={K} beams={W} new={new}"
        rows.append(Row(NAME, case, "transformers", base.median_ms, None,
                        {"tokens/s": tokens / (base.median_ms / 1e3), "speedup": 1.0,
                         "same ids": same}))
        rows.append(Row(NAME, case, "rag_fast", mine.median_ms, None,
                        {"tokens/s": tokens / (mine.median_ms / 1e3),
                         "speedup": base.median_ms / mine.median_ms, "same ids": same}))
    return rows


def run(ctx: Context) -> list[Row]:
    # Whole generations take seconds to minutes (transformers' RAG-Sequence on the full sizes:
    # minutes), so one timed run each, no warm-up; the ids are checked on the timed runs.
    gen_ctx = dataclasses.replace(ctx, warmup=0, repeats=1)
    rows = _beam_step_rows(ctx, 8, 4, 5, reference=not ctx.quick)
    small = (256, 2, 4, 1024)
    if ctx.quick:
        rows += _generation_rows(gen_ctx, "small", small, 0.3, B=1, K=5, W=4, new=6)
        return rows
    rows += _generation_rows(gen_ctx, "small", small, 0.3, B=8, K=5, W=4, new=20)
    rows += _generation_rows(gen_ctx, "BART-base", (768, 6, 12, 3072), None, B=8, K=5, W=4,
                             new=20)
    return rows
