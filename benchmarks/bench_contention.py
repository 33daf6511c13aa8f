"""A training step alone and beside one busy process: how much each provider slows down when
another process keeps the machine's cores busy.

The step is the training bench's (``bench_training``: forward, backward and fused AdamW step of
the small generator, RAG-Token, B=4, K=5, 64 context tokens), timed in fresh processes, each
alone and then beside one busy process: a torch process running a 1024 x 1024 fp32 matmul in a
loop on 2 threads (what another training job or notebook does to a shared machine). Providers:

- ``transformers``: ``RagTokenForGeneration``'s forward, eager, torch's default threads (one
  per core), as a user's training loop runs it;
- ``rag_fast``: ``RagModel`` (the LM-head path its default takes at this shape) under the
  thread policy ``rag-fast train`` runs with by default (``rag_fast._threads``): the process
  starts with ``wait_policy_for_load()``'s OpenMP settings, decided by the parent just before
  it starts as the command decides them for itself before torch loads
  (``OMP_WAIT_POLICY=PASSIVE`` when other processes keep cores busy), and
  ``AutoThreads.after_step`` runs after every step as ``Trainer.train`` runs it;
- ``rag_fast, no thread policy``: the same step with neither, one thread per core throughout
  and OpenMP's default spinning: what the policy buys.

Why they slow down by more than their share of the CPU: every OpenMP parallel region ends at
a barrier that waits for all of the team's threads, and beside a busy process one of them is
often descheduled for a time slice while the others spin (docs/tuning.md, "Threads on a shared
machine"). ``slowdown`` is a provider's median step beside the busy process over its median
alone; ``speedup vs eager`` compares with ``transformers`` in the same condition.

Rounds: in each, every provider is timed alone, then every provider beside the busy process
(started before the provider's process and stopped after it), so that a machine whose speed
drifts slows every provider alike. ``--quick``: one round, fewer steps.
"""
from __future__ import annotations

import subprocess
import sys
import time

import torch

from harness import (ALLOCATOR_WORDS, Context, Measurement, Row, add_ratio, allocator_setting,
                     machine_words, run_command, source_path, spread_cell)

NAME = "contention"
EAGER, OURS, OURS_FIXED = "transformers", "rag_fast", "rag_fast, no thread policy"
PROVIDERS = (EAGER, OURS, OURS_FIXED)
ALONE, BUSY = "alone", "beside one busy process"
SIZE, MODE, TARGET = "small", "token", 32
ROUNDS, STEPS, WARMUP = 2, 6, 3
QUICK_ROUNDS, QUICK_STEPS = 1, 4
BUSY_THREADS, BUSY_N = 2, 1024
BUSY_CODE = (f"import torch\ntorch.set_num_threads({BUSY_THREADS})\n"
             f"a = torch.randn({BUSY_N}, {BUSY_N})\nwhile True:\n    a @ a\n")
BUSY_START_S = 2.0  # the busy process's import and first products, before the timing starts


def timed_steps(provider: str, target: int, steps: int, warmup: int) -> dict:
    """One provider's steps in this (fresh) process: ``warmup`` untimed then ``steps`` timed,
    with rag_fast's thread policy after every step for ``rag_fast``. Returns JSON values:
    ``{"times_ms": [...], "threads": [thread count of each timed step]}``."""
    import bench_training as bt
    from rag_fast import _threads

    torch.set_flush_denormal(True)  # as the training bench's timing processes
    case = f"{SIZE} {MODE} B={bt.B} K={bt.K} L={bt.CONTEXT} T={target}"
    inner = bt.EAGER if provider == EAGER else next(
        p for p, path in bt.PATHS.items() if path == bt.default_path(case))
    step = bt._provider_step(MODE, SIZE, target, inner, "cpu", keep_grads=False)
    auto = _threads.AutoThreads() if provider == OURS else None
    times, threads = [], []
    for i in range(warmup + steps):
        start = time.perf_counter()
        step()
        seconds = time.perf_counter() - start
        if i >= warmup:
            times.append(seconds * 1e3)
            threads.append(torch.get_num_threads())
        if auto is not None:  # as Trainer.train does after each step
            auto.after_step(i)
    return {"times_ms": times, "threads": threads}


def _time(provider: str, busy: bool, target: int, steps: int, allocator: str) -> dict:
    """:func:`timed_steps` in a fresh process, beside the busy process when ``busy``; the
    result also has ``"wait policy"``, the OpenMP setting the process started with."""
    import memory
    from harness import ALLOCATOR_ENV

    from rag_fast import _threads

    other = subprocess.Popen([sys.executable, "-c", BUSY_CODE]) if busy else None
    try:
        if other is not None:
            time.sleep(BUSY_START_S)
        env = {ALLOCATOR_ENV: allocator}
        if provider == OURS:  # as the command decides for itself before torch loads
            env.update(_threads.wait_policy_for_load({}))
        got = memory.call_fresh(f"{__name__}:timed_steps", provider, target, steps, WARMUP,
                                env=env, timeout=3600,
                                label=f"contention {provider} ({BUSY if busy else ALONE})")
        got["wait policy"] = env.get("OMP_WAIT_POLICY", "default (spin)")
        return got
    finally:
        if other is not None:
            other.kill()
            other.wait()


def run(ctx: Context) -> list[Row]:
    if ctx.device != "cpu":
        return []  # a CPU matter: another process competing for the cores
    allocator = allocator_setting("RAG_FAST_BENCH_TIME_ALLOCATOR", "default")
    rounds, steps = (QUICK_ROUNDS, QUICK_STEPS) if ctx.quick else (ROUNDS, STEPS)
    target = TARGET // 2 if ctx.quick else TARGET
    times = {(p, c): [] for p in PROVIDERS for c in (ALONE, BUSY)}
    threads = {key: [] for key in times}
    policies = {key: set() for key in times}
    for _ in range(rounds):
        for condition in (ALONE, BUSY):
            for p in PROVIDERS:
                got = _time(p, condition == BUSY, target, steps, allocator)
                times[p, condition] += got["times_ms"]
                threads[p, condition] += got["threads"]
                policies[p, condition].add(got["wait policy"])
    measured = {key: Measurement.of(t) for key, t in times.items()}
    rows = []
    for condition in (ALONE, BUSY):
        case = f"small generator, RAG-Token, B=4 K=5 L=64 T={target}, {condition}"
        for p in PROVIDERS:
            m = measured[p, condition]
            row = Row.of(NAME, case, p, m, {
                "threads": sorted(set(threads[p, condition])),
                "OpenMP wait": ", ".join(sorted(policies[p, condition])),
                "allocator": ALLOCATOR_WORDS[allocator], "rounds": rounds,
                "timed steps/process": steps, "busy process": f"torch {BUSY_N}x{BUSY_N} matmul "
                                                              f"loop, {BUSY_THREADS} threads"})
            add_ratio(row, "speedup vs eager", measured[EAGER, condition], m)
            if condition == BUSY:
                alone = measured[p, ALONE]
                row.extra["slowdown"] = m.median_ms / alone.median_ms
            rows.append(row)
    return rows


def render(results: dict, source: str) -> str:
    """The full contention table of docs/benchmarks.md from a results file of this bench."""
    rows = [r for r in results["rows"] if r["bench"] == NAME]
    if not rows:
        raise ValueError(f"{source}: no rows of the {NAME!r} bench")
    by = {(r["provider"], r["case"].rsplit(", ", 1)[1]): r for r in rows}
    m = results["machine"]
    first = rows[0]["extra"]
    lines = [
        f"Measured by `{run_command(results.get('args', {}))}` on {machine_words(m)} "
        f"(`{source_path(source)}`). One training step of the small generator (d 256, 2+2 "
        f"layers, V 50265; RAG-Token, {rows[0]['case'].split(', ')[2]}), alone and beside one busy "
        f"process ({first['busy process']}). `transformers`: its RAG model, eager, torch's "
        "default threads (one per core). `rag_fast`: `RagModel` under the thread policy "
        "`rag-fast train` runs with by default: OpenMP threads that sleep at barriers when "
        "other processes keep the cores busy as the process starts, and fewer threads while "
        "they do during training unless threads sleep; `rag_fast, no thread policy`: one "
        "thread per core throughout, spinning at barriers as OpenMP does by default. Medians of "
        f"{first['rounds'] * first['timed steps/process']} timed steps per provider and "
        f"condition ({first['rounds']} round(s) of fresh processes, every provider alone and "
        f"then beside the busy process; {first['allocator']} allocator); slowdown = median beside "
        "the busy process / median alone; spread = (max - min) / median.",
        "",
        "| provider | alone ms (spread) | beside a busy process ms (spread) | slowdown | threads, "
        "OpenMP wait beside it | speedup vs `transformers`, alone / beside |",
        "|---|---|---|---|---|---|",
    ]
    for p in PROVIDERS:
        alone, busy = by.get((p, ALONE)), by.get((p, BUSY))
        if alone is None or busy is None:
            continue
        ratio = "/".join(f"{r['extra']['speedup vs eager']:.2f}x" for r in (alone, busy))
        lines.append(
            f"| {p} | {alone['median_ms']:,.0f} ({spread_cell(alone)}) | "
            f"{busy['median_ms']:,.0f} ({spread_cell(busy)}) | "
            f"**{busy['extra']['slowdown']:.2f}x** | "
            f"{', '.join(map(str, busy['extra']['threads']))}, "
            f"{busy['extra'].get('OpenMP wait', 'default (spin)')} | {ratio.replace('/', ' / ')} |")
    return "\n".join(lines)


def slowdowns(results: dict) -> dict[str, float]:
    """provider -> its slowdown beside the busy process, from a results file."""
    return {r["provider"]: r["extra"]["slowdown"] for r in results["rows"]
            if r["bench"] == NAME and "slowdown" in r["extra"]}
