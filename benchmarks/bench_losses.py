"""RAG losses: rag_fast (fused kernels and reference) vs the transformers composite.

Cases: RAG-Token (epsilon 0 and 0.1) and RAG-Sequence (epsilon 0.1), fp32 and bf16, forward
(no grad) and forward+backward. Baseline: transformers' get_nll on the same input. "read" is
one plain read of the logits (x.sum()), the memory-bandwidth floor of any loss.
Columns: speedup over transformers; time relative to the read; peak extra memory as % of the
logits (for fwd+bwd: beyond the logits' gradient, which every method must allocate).
"""
from __future__ import annotations

import torch

from harness import Context, Row, measure

NAME = "losses"
PAD = 1


def _shape(ctx: Context) -> tuple[int, int, int, int]:
    if ctx.device == "cuda":
        return 8, 5, 128, 50265
    return (4, 5, 8, 50265) if ctx.quick else (4, 5, 32, 50265)


def _dtypes(ctx: Context) -> list[torch.dtype]:
    if ctx.device == "cuda":
        return [torch.bfloat16]
    return [torch.float32] if ctx.quick else [torch.float32, torch.bfloat16]


def run(ctx: Context) -> list[Row]:
    import rag_fast
    from rag_fast.testing import shift_targets_left, tiny_hf_rag

    B, K, T, V = _shape(ctx)
    hf = {mode: tiny_hf_rag(mode, n_docs=K, pad_token_id=PAD) for mode in ("token", "sequence")}
    cases = [("token", 0.0), ("token", 0.1), ("sequence", 0.1)]
    rows: list[Row] = []
    for dtype in _dtypes(ctx):
        g = torch.Generator().manual_seed(0)
        logits = (torch.randn(B * K, T, V, generator=g) * 2).to(ctx.device, dtype)
        scores = torch.randn(B, K, generator=g).to(ctx.device)
        hf_target = torch.randint(3, V, (B, T), generator=g).to(ctx.device)
        hf_target[:, -2:] = PAD
        target = shift_targets_left(hf_target, PAD)
        logits_mb = logits.numel() * logits.element_size() / 2**20
        dname = str(dtype).replace("torch.", "")

        read = measure(lambda: logits.sum(), ctx)
        for mode, eps in cases:
            ours = rag_fast.rag_token_nll if mode == "token" else rag_fast.rag_sequence_nll
            providers = {
                "transformers": lambda x, s, m=mode, e=eps: hf[m].get_nll(x, s, hf_target,
                                                                           epsilon=e),
                "rag_fast torch": lambda x, s, f=ours, e=eps: f(x, s, target, epsilon=e,
                                                                ignore_index=PAD, impl="torch"),
                "rag_fast fused": lambda x, s, f=ours, e=eps: f(x, s, target, epsilon=e,
                                                                ignore_index=PAD, impl="auto"),
            }
            case = f"{mode} eps={eps} {dname} B{B} K{K} T{T} V{V}"
            for direction in ("fwd", "fwd+bwd"):
                base_ms = None
                if direction == "fwd":
                    rows.append(Row(NAME, f"{case} fwd", "read (floor)", read.median_ms,
                                    read.peak_mb, {"vs read": 1.0}))
                for provider, fn in providers.items():
                    m = measure(_call(fn, logits, scores, direction), ctx)
                    base_ms = base_ms or m.median_ms  # transformers is first
                    extra = {"speedup": base_ms / m.median_ms,
                             "vs read": m.median_ms / read.median_ms}
                    if m.peak_mb is not None:
                        beyond = m.peak_mb - (logits_mb if direction == "fwd+bwd" else 0.0)
                        extra["extra mem % logits"] = max(beyond, 0.0) / logits_mb * 100
                    rows.append(Row(NAME, f"{case} {direction}", provider, m.median_ms,
                                    m.peak_mb, extra))
    return rows


def _call(fn, logits, scores, direction):
    if direction == "fwd":
        def forward():
            with torch.no_grad():
                return fn(logits, scores)

        return forward
    x = logits.detach().requires_grad_()
    s = scores.detach().requires_grad_()

    def forward_backward():
        fn(x, s).sum().backward()
        grad = x.grad  # a fresh gradient every call, counted in the call's peak memory
        x.grad = s.grad = None
        return grad

    return forward_backward
