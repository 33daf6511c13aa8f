"""The LM head + RAG loss: rag_fast's fused op (logits a vocabulary tile at a time) against
rag_fast's materialized path and the ``transformers`` composite.

Case (``--full``): decoder states ``[B*K, T, d]`` = B 4, K 5, T 64, d 896 and an LM head of
V = 151 936 entries (Qwen2's vocabulary and width), fp32, forward + backward (gradients for
the states, the LM head weight and the passage scores): RAG-Token with label smoothing 0.1 and
0, RAG-Sequence with 0. ``--quick``: V 32 000, d 256, B 2, K 5, T 16, the first two cases.

Providers, on the same input:

- ``rag_fast fused LM head``: ``rag_fast.linear_rag_nll`` (the ``RagModel`` default);
- ``rag_fast materialized``: the LM head's ``[B*K, T, V]`` logits into a reused buffer, then
  ``rag_token_nll`` / ``rag_sequence_nll`` writing their gradient over them in place (the path
  ``RagModel(lm_head_loss="materialized")`` takes; three LM-head-sized GEMMs per step);
- ``transformers``: ``F.linear`` then ``transformers``' RAG ``get_nll`` (``log_softmax`` of the
  whole logits and the marginalisation over them), as a ``transformers`` RAG model computes it.

Times: the providers' calls alternating (:func:`harness.measure_interleaved`), with glibc's
allocator as it is by default, as in a user's process (``run.py`` records it in each row,
``allocator``). Columns: time relative to the materialized path (the fused op runs one more GEMM
of the LM head's size, two more for RAG-Token with label smoothing, and never writes a
logits-sized buffer); speedup against ``transformers``; the peak resident set of one step (the
harness's, after glibc returned its free memory to the kernel) beyond the weights and the
gradients the step returns (``dW``, ``dh``, the scores' gradient), in MiB and as % of the
logits' size (for the materialized path this includes its reused logits buffer, released before
its measured call so that the peak counts it).

:func:`render` turns a results file of this bench into the full section of docs/benchmarks.md.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from harness import (Context, Row, add_ratio, allocator_caption, machine_words,
                     measure_interleaved, run_command, runs_counted, source_path, spread_cell)

NAME = "lm_head"
PAD = 1
FUSED, MATERIALIZED, EAGER = "rag_fast fused LM head", "rag_fast materialized", "transformers"


def _shape(ctx: Context) -> tuple[int, int, int, int, int]:
    """B, K, T, d, V."""
    if ctx.device == "cuda":
        return 8, 5, 128, 896, 151936
    return (2, 5, 16, 256, 32000) if ctx.quick else (4, 5, 64, 896, 151936)


def _cases(ctx: Context) -> list[tuple[str, float]]:
    if ctx.quick:
        return [("token", 0.1), ("sequence", 0.0)]
    return [("token", 0.1), ("token", 0.0), ("sequence", 0.0)]


def run(ctx: Context) -> list[Row]:
    import rag_fast
    from rag_fast.generation.heads import LMHead
    from rag_fast.models import _seq2seq
    from rag_fast.testing import shift_targets_left, tiny_hf_rag

    B, K, T, d, V = _shape(ctx)
    dtype = torch.bfloat16 if ctx.device == "cuda" else torch.float32
    g = torch.Generator().manual_seed(0)
    h = (torch.randn(B * K, T, d, generator=g)).to(ctx.device, dtype).requires_grad_()
    W = (torch.randn(V, d, generator=g) * d ** -0.5).to(ctx.device, dtype).requires_grad_()
    s = torch.randn(B, K, generator=g).to(ctx.device).requires_grad_()
    hf_target = torch.randint(3, V, (B, T), generator=g).to(ctx.device)
    hf_target[:, -2:] = PAD
    target = shift_targets_left(hf_target, PAD)
    elem = h.element_size()
    logits_mb = B * K * T * V * elem / 2**20
    grads_mb = (W.numel() * elem + h.numel() * elem + s.numel() * 4) / 2**20
    hf = {mode: tiny_hf_rag(mode, n_docs=K, pad_token_id=PAD) for mode in ("token", "sequence")}
    workspace = _seq2seq.LogitsWorkspace()
    head = LMHead(W, None, 1.0)
    dname = str(dtype).replace("torch.", "")
    rows: list[Row] = []
    for mode, eps in _cases(ctx):
        ours = rag_fast.rag_token_nll if mode == "token" else rag_fast.rag_sequence_nll

        def fused(m=mode, e=eps):
            return rag_fast.linear_rag_nll(h, W, s, target, mode=m, epsilon=e, ignore_index=PAD,
                                           reduction="sum")

        def materialized(f=ours, e=eps):
            logits = _seq2seq.lm_logits(head, h, workspace)
            return f(logits, s, target, epsilon=e, ignore_index=PAD, reduction="sum",
                     inplace_grad=True)

        def eager(m=mode, e=eps):
            return hf[m].get_nll(F.linear(h, W), s, hf_target, epsilon=e).sum()

        with torch.no_grad():
            losses = {p: float(fn()) for p, fn in
                      ((FUSED, fused), (MATERIALIZED, materialized), (EAGER, eager))}
        for p, value in losses.items():  # the same loss, or the comparison means nothing
            if abs(value - losses[EAGER]) > 1e-3 * max(1.0, abs(losses[EAGER])):
                raise AssertionError(f"{p} loss {value} differs from transformers' "
                                     f"{losses[EAGER]} ({mode}, eps {eps})")
        calls = {p: _step(fn, h, W, s) for p, fn in
                 ((FUSED, fused), (MATERIALIZED, materialized), (EAGER, eager))}
        measured = measure_interleaved(calls, ctx, before_memory={MATERIALIZED: workspace.release})
        case = f"{mode} eps={eps} {dname} B{B} K{K} T{T} d{d} V{V} fwd+bwd"
        rows += _rows(case, measured, grads_mb, logits_mb)
        workspace.release()
    return rows


def _rows(case: str, measured: dict, grads_mb: float, logits_mb: float) -> list[Row]:
    """One row per provider: its time against the materialized path and against
    ``transformers``, and its peak memory beyond the gradients the step returns."""
    rows = []
    for provider, m in measured.items():
        row = Row.of(NAME, case, provider, m)
        add_ratio(row, "speedup vs materialized", measured[MATERIALIZED], m)
        add_ratio(row, "speedup vs transformers", measured[EAGER], m)
        if m.peak_mb is not None:
            extra = max(m.peak_mb - grads_mb, 0.0)
            row.extra["extra MiB"] = round(extra, 1)
            row.extra["extra % logits"] = extra / logits_mb * 100
        rows.append(row)
    return rows


def _step(fn, h, W, s):
    def forward_backward():
        fn().backward()
        h.grad = W.grad = s.grad = None  # each call makes (and counts) its own gradients

    return forward_backward


# ---------------------------------------------------------- docs/benchmarks.md section
_LABELS = {"token eps=0.0": "RAG-Token, eps 0", "token eps=0.1": "RAG-Token, eps 0.1",
           "sequence eps=0.0": "RAG-Sequence, eps 0", "sequence eps=0.1": "RAG-Sequence, eps 0.1"}


def _cell(row: dict | None, key: str, fmt: str) -> str:
    if row is None or row["extra"].get(key) is None:
        return "-"
    return fmt.format(row["extra"][key]) + (" (noisy)" if key in row.get("noisy", []) else "")


def render(results: dict, source: str) -> str:
    """The full LM-head loss section of docs/benchmarks.md from a results file (``source``: its name under
    ``benchmarks/results/``)."""
    rows = [r for r in results["rows"] if r["bench"] == NAME]
    by = {(r["case"], r["provider"]): r for r in rows}
    lines = [
        "| case | fused ms | spread | time vs materialized | speedup vs `transformers` | "
        "extra memory, fused / materialized / `transformers` (% of the logits) |",
        "|---|---|---|---|---|---|",
    ]
    shape = ""
    for r in rows:
        if r["provider"] != FUSED:
            continue
        words = r["case"].split()
        label = _LABELS.get(" ".join(words[:2]), " ".join(words[:2]))
        shape = " ".join(words[2:-1])
        others = [by.get((r["case"], p)) for p in (MATERIALIZED, EAGER)]
        time_ratio = r["extra"].get("speedup vs materialized")
        ratio = "-" if time_ratio is None else f"{1 / time_ratio:.2f}x" + (
            " (noisy)" if "speedup vs materialized" in r.get("noisy", []) else "")
        mems = " / ".join(
            "-" if x is None or x["extra"].get("extra MiB") is None
            else f"{x['extra']['extra MiB']:.0f} MiB ({x['extra']['extra % logits']:.1f}%)"
            for x in (r, *others))
        lines.append(f"| {label} | {r['median_ms']:.0f} | {spread_cell(r)} | {ratio} "
                     f"| {_cell(r, 'speedup vs transformers', '{:.1f}x')} | {mems} |")
    command = run_command(results.get("args", {}))
    caption = (
        f"Measured by `{command}` on {machine_words(results['machine'])} "
        f"(`{source_path(source)}`): one forward + backward of the LM head and the RAG "
        f"loss ({shape.replace(' ', ', ')}; gradients for the states, the LM head and the "
        "passage scores), random weights. Fused: `rag_fast.linear_rag_nll`, the logits a "
        "vocabulary tile at a time. Materialized: the `[B*K, T, V]` logits in a reused buffer, "
        "then rag_fast's fused loss writing their gradient in place. `transformers`: `F.linear`, "
        "then `transformers`' RAG `get_nll` (`log_softmax` over the whole logits). Time vs "
        "materialized: fused time / materialized time (below 1: the fused op is faster). "
        f"Medians of {runs_counted(rows)} timed calls after warm-up, the providers' calls "
        f"alternating, with {allocator_caption(rows)}; a ratio marked (noisy) has a side whose "
        "spread exceeds 20% or runs that overlap the other side's. Extra memory: the peak "
        "resident set of one step above the "
        f"resident set before it ({allocator_caption(rows, memory=True)}), less the gradients "
        "the step returns; % of the logits' size."
    )
    return caption + "\n\n" + "\n".join(lines)
