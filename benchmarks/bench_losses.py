"""RAG losses: rag_fast (fused kernels and reference) vs the transformers composite, eager and
compiled.

Cases: RAG-Token (epsilon 0 and 0.1) and RAG-Sequence (epsilon 0.1), fp32 and bf16, forward
(no grad) and forward+backward; ``--quick``: epsilon 0.1 only, fp32, 8 target tokens, no compiled
baseline (compiling each row would double the quick run).
Baselines, on the same input: ``transformers``' ``get_nll`` as it runs (eager), and the same
bound ``get_nll`` under ``torch.compile`` (default mode), the first thing a user who wants it
faster would try. The compiled function is compiled afresh for each row; its compile time (the
first calls until steady, minus a steady call) is reported in ``compile s`` and excluded from
its step time. Inductor's on-disk cache is left as a user would have it: a second run on the
same machine reuses its kernels and compiles faster. "read" is one plain read of the logits
(``x.sum()``), the memory-bandwidth floor of any loss.

Each row: the median of ``ctx.repeats`` (>= 5) timed calls after warm-up, the four providers'
calls alternating (:func:`harness.measure_interleaved`), with glibc's allocator as it is by
default, as in a user's process (``run.py`` records it in each row, ``allocator``). Columns:
``speedup vs eager`` and ``speedup vs compiled`` (flagged noisy by :func:`harness.add_ratio`);
time relative to the read; peak extra memory of one call (the harness's per-call resident-set
peak, after glibc returned its free memory to the kernel, so that every page the call touches
counts) as % of the logits (for fwd+bwd: beyond the logits' gradient, which every method must
allocate). rag_fast's gradient comes from its CPU buffer pool (``rag_fast/_pool.py``), reused
from call to call, and the baselines' from torch's allocator (a logits-sized gradient, beyond 32
MiB, is fresh pages each call even with glibc's default allocator, in which the harness times
every provider); the harness empties the pool before each peak-memory call, so the memory column
counts the gradient.

:func:`render` turns a results file of this bench into the full losses section of docs/benchmarks.md.
"""
from __future__ import annotations

import time

import torch

from harness import (ALLOCATOR_WORDS, Context, Measurement, Row, add_ratio, allocator_caption,
                     machine_words, measure, measure_interleaved, run_command, runs_counted,
                     source_path, spread_cell)

NAME = "losses"
PAD = 1
EAGER, COMPILED = "transformers", "transformers compiled"
STEADY_CALLS = 3  # calls after the first that tell the compiled function's steady time
MAX_COMPILE_CALLS = 12  # compile_seconds gives up waiting for steady calls after this many


def _shape(ctx: Context) -> tuple[int, int, int, int]:
    if ctx.device == "cuda":
        return 8, 5, 128, 50265
    return (4, 5, 8, 50265) if ctx.quick else (4, 5, 32, 50265)


def _dtypes(ctx: Context) -> list[torch.dtype]:
    if ctx.device == "cuda":
        return [torch.bfloat16]
    return [torch.float32] if ctx.quick else [torch.float32, torch.bfloat16]


def compile_seconds(fn, device: str, clock=None) -> float:
    """Compile ``fn`` (a compiled function's first call) and return the time its first calls
    took beyond a steady call: calls until the last ``STEADY_CALLS`` are steady (the slowest
    of them within 2x the fastest; at most ``MAX_COMPILE_CALLS`` calls), then the sum, over
    the calls before those, of each call's time minus their median. Compiling may take more
    than one call (the backward compiled at the first backward, a recompilation for a changed
    guard), in any order; never negative. ``clock``: a stand-in for the timed call (tests)."""
    def timed() -> float:
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    clock = clock or timed
    times = [clock()]
    while len(times) < MAX_COMPILE_CALLS:
        times.append(clock())
        window = times[-STEADY_CALLS:]
        if len(times) > STEADY_CALLS and max(window) <= 2 * min(window):
            break
    window = sorted(times[-STEADY_CALLS:])
    base = window[len(window) // 2]
    return max(0.0, sum(t - base for t in times[:-STEADY_CALLS]))


def run(ctx: Context) -> list[Row]:
    import rag_fast
    from rag_fast.testing import shift_targets_left, tiny_hf_rag

    B, K, T, V = _shape(ctx)
    hf = {mode: tiny_hf_rag(mode, n_docs=K, pad_token_id=PAD) for mode in ("token", "sequence")}
    cases = [("token", 0.1), ("sequence", 0.1)] if ctx.quick else [
        ("token", 0.0), ("token", 0.1), ("sequence", 0.1)]
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

            def eager(x, s, m=mode, e=eps):
                return hf[m].get_nll(x, s, hf_target, epsilon=e)

            case = f"{mode} eps={eps} {dname} B{B} K{K} T{T} V{V}"
            for direction in ("fwd", "fwd+bwd"):
                # a fresh compilation per row: its own graphs, none of an earlier row's guards
                # (the recompilation limit counts per code object, shared by every row)
                torch._dynamo.reset()
                providers = {EAGER: eager}
                if not ctx.quick:  # compiling every row would double the quick run
                    providers[COMPILED] = torch.compile(eager)
                providers.update({
                    "rag_fast torch": lambda x, s, f=ours, e=eps: f(
                        x, s, target, epsilon=e, ignore_index=PAD, impl="torch"),
                    "rag_fast fused": lambda x, s, f=ours, e=eps: f(
                        x, s, target, epsilon=e, ignore_index=PAD, impl="auto"),
                })
                calls = {p: call_with_tied(fn, logits, scores, direction) for p, fn in providers.items()}
                compile_s = (compile_seconds(calls[COMPILED], ctx.device)
                             if COMPILED in calls else None)
                measured = measure_interleaved(calls, ctx)
                if direction == "fwd":
                    rows.append(Row.of(NAME, f"{case} fwd", "read (floor)", read,
                                       {"vs read": 1.0}))
                rows += _rows(f"{case} {direction}", measured, read, logits_mb, direction,
                              compile_s)
            del providers, calls
        torch._dynamo.reset()
    return rows


def _rows(case: str, measured: dict[str, Measurement], read: Measurement, logits_mb: float,
          direction: str, compile_s: float) -> list[Row]:
    rows = []
    for provider, m in measured.items():
        row = Row.of(NAME, case, provider, m)
        add_ratio(row, "speedup vs eager", measured[EAGER], m)
        if COMPILED in measured:
            add_ratio(row, "speedup vs compiled", measured[COMPILED], m)
        row.extra["vs read"] = m.median_ms / read.median_ms
        if m.peak_mb is not None:
            beyond = m.peak_mb - (logits_mb if direction == "fwd+bwd" else 0.0)
            row.extra["extra mem % logits"] = max(beyond, 0.0) / logits_mb * 100
        if provider == COMPILED:
            row.extra["compile s"] = round(compile_s, 2)
        rows.append(row)
    return rows


def call_with_tied(fn, logits, scores, direction):
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


# ---------------------------------------------------------- docs/benchmarks.md section
_LABELS = {"token eps=0.0": "RAG-Token, eps 0", "token eps=0.1": "RAG-Token, eps 0.1",
           "sequence eps=0.1": "RAG-Sequence, eps 0.1"}



def _ratio(row: dict, key: str) -> str:
    v = row["extra"].get(key)
    if v is None:
        return "-"
    return f"{v:.1f}x" + (" (noisy)" if key in row.get("noisy", []) else "")



def _mem(row: dict) -> str:
    v = row["extra"].get("extra mem % logits")
    return "-" if v is None else f"{v:.0f}%" if v >= 10 else f"{v:.1f}%"


def _pool_words(machine: dict, rows: list[dict]) -> str:
    """What the caption says of rag_fast's CPU buffer pool: nothing for a run that predates it
    (its machine description has no ``rag_fast_pool_mb``)."""
    mb = machine.get("rag_fast_pool_mb")
    if mb is None or machine.get("device") != "cpu":
        return ""
    if mb == 0:
        return " rag_fast's CPU buffer pool was off (`RAG_FAST_POOL_MB=0`)."
    fixed = {r["extra"].get("allocator", ALLOCATOR_WORDS["fixed"]) for r in rows} == {
        ALLOCATOR_WORDS["fixed"]}
    fresh = ("get fresh pages from torch's allocator every call" if fixed else
             "come from torch's allocator, which glibc maps afresh at every call even by default "
             "(blocks beyond 32 MiB)")
    return (" rag_fast's gradient comes from its CPU buffer pool (`RAG_FAST_POOL_MB` "
            f"{mb}): the memory of the previous call's freed gradient, already resident, where "
            f"the baselines' gradients {fresh}; the "
            "pool is emptied before the memory call, so the memory column counts the gradient "
            "(between calls the pool keeps the freed gradient's memory, which is not in it).")


def render(results: dict, source: str) -> str:
    """The full losses section of docs/benchmarks.md from a results file (``source``: its name under
    ``benchmarks/results/``): a caption saying what, how and where, then one line per case,
    dtype and direction with rag_fast's fused loss against both baselines."""
    rows = [r for r in results["rows"] if r["bench"] == NAME]
    by = {(r["case"], r["provider"]): r for r in rows}
    lines = [
        "| case | dtype | pass | rag_fast ms | spread | vs `transformers` eager | "
        "vs `torch.compile`d `transformers` | vs one read of the logits | extra memory "
        "(rag_fast / eager / compiled) | compile s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    shape = ""
    for r in rows:
        if r["provider"] != "rag_fast fused":
            continue
        words = r["case"].split()
        label = _LABELS.get(" ".join(words[:2]), " ".join(words[:2]))
        dtype, direction = words[2], words[-1]
        shape = " ".join(words[3:-1])
        eager, comp = by.get((r["case"], EAGER)), by.get((r["case"], COMPILED))
        mems = " / ".join(_mem(x) if x else "-" for x in (r, eager, comp))
        compile_s = comp["extra"].get("compile s") if comp else None
        lines.append(
            f"| {label} | {dtype} | {direction} | {r['median_ms']:.1f} | {spread_cell(r)} "
            f"| {_ratio(r, 'speedup vs eager')} | {_ratio(r, 'speedup vs compiled')} "
            f"| {r['extra']['vs read']:.1f}x | {mems} "
            f"| {'-' if compile_s is None else f'{compile_s:.0f}'} |")
    counted = runs_counted(rows)
    args = results.get("args", {})
    command = run_command(args)
    caption = (
        f"Measured by `{command}` on {machine_words(results['machine'])} "
        f"(`{source_path(source)}`), {shape.replace(' ', ', ')}, random logits. "
        "rag_fast: the fused loss (`impl=\"auto\"`). Baselines on the same input: "
        "`transformers`' `get_nll` (eager) and the same `get_nll` under `torch.compile` "
        "(default mode, compiled afresh per row; its compile time, the first calls beyond a "
        "steady call, is the last column and is not in its step time; inductor's on-disk cache as "
        "a user's machine keeps it, so a repeated run compiles faster). "
        f"Times: medians of {counted} timed calls after warm-up, the providers' calls "
        f"alternating, with {allocator_caption(rows)}; spread = (max - min) / median of "
        "rag_fast's calls; a ratio marked (noisy) "
        "has a side whose spread exceeds 20% or runs that overlap the other side's. "
        "One read of the logits is `x.sum()`, the memory-bandwidth floor of any loss. Extra "
        "memory: the peak resident set of one call above the resident set before it "
        f"({allocator_caption(rows, memory=True)}), as % of the logits; for fwd+bwd, beyond "
        "the logits' gradient, which every method allocates."
        + _pool_words(results["machine"], rows)
    )
    return caption + "\n\n" + "\n".join(lines)
