"""What the training step's optional mechanisms cost or buy, each measured against the default
in the same process: the lean activations' recipes one at a time, and gradient clipping with
and without its scaling pass.

    python benchmarks/step_variants.py --out benchmarks/results/cpu-step-variants.json

**Lean activations** (``rag_fast/models/_lean.py``): eager ``RagModel`` with materialized logits
(the default at these shapes) over the training bench's case (``bench_training``), one model,
its fused AdamW step; variants of the one step, interleaved round by round (forward order, then
reverse), so that they see the same machine:

- ``all recipes``: the default, every recipe on;
- ``off``: ``lean_activations`` off (every saved tensor kept as autograd saves it);
- ``no key/value recompute``: the cross-attention keys and values kept (no projection again
  in the backward), the other recipes on;
- ``no activation recipe``: activation outputs kept; ``no norm recipe``: norm outputs kept.

**Clipping** (the Trainer's ``max_grad_norm``, ``torch.nn.utils.clip_grad_norm_``): one pass
reads every gradient for the total norm, a second scales every gradient; then the fused AdamW
step reads them again. Fused AdamW can divide the gradients by a scale as it reads them (its
``grad_scale``, which ``torch.amp.GradScaler`` sets), which saves the scaling pass. Timed on
the case's generator parameters with random gradients: the norm, the scaling, the optimizer
step, and clip + step both ways (the second also checked to give the same parameters).

**Freed memory kept** (``rag_fast.training.heap.keep_freed_memory``, which the Trainer applies
on the CPU): the same step in fresh processes, glibc as it is by default and with the
thresholds set, alternating, :data:`HEAP_PROCESSES` of each: step times, minor page faults per
step, and the timed steps' own peak resident set (the kernel's high-water mark reset after the
warm-up steps, ``/proc/self/clear_refs``). Refused when this process's environment sets glibc's
thresholds or the harness's fixed allocator: the fresh processes inherit it.

``render(results, source)`` makes the docs/benchmarks.md section.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import torch  # noqa: E402

import bench_training as bt  # noqa: E402

LEAN_VARIANTS = ("all recipes", "off", "no key/value recompute", "no activation recipe",
                 "no norm recipe")
CLIP_VARIANTS = ("norm pass", "scaling pass", "fused AdamW step", "clip + step",
                 "clip + step, scaling in AdamW")
WARMUP, ROUNDS, CLIP_CALLS = 2, 6, 9
HEAP_PROCESSES, HEAP_WARMUP, HEAP_STEPS = 2, 3, 4
HEAP_VARIANTS = ("glibc default", "freed memory kept")


class _LeanSwitch:
    """Turns the lean activations' recipes on and off by variant (patches, undone by close)."""

    def __init__(self):
        from rag_fast.models import _lean, rag_model

        self._lean, self._rag_model = _lean, rag_model
        self._record, self._share = _lean._Registry.record, _lean.share_input
        self._context = _lean.lean_activations
        acts = _lean._activation_classes()
        switch, record = self, self._record
        self.skip = None

        def filtered(registry, module, x, output, projection=False):
            if switch.skip == "activation" and isinstance(module, acts):
                return None
            if switch.skip == "norm" and not projection and not isinstance(module, acts):
                return None
            return record(registry, module, x, output, projection)

        _lean._Registry.record = filtered

    def set(self, variant: str) -> None:
        self.skip = {"no activation recipe": "activation", "no norm recipe": "norm"}.get(variant)
        self._rag_model._lean.share_input = ((lambda t: None)
                                             if variant == "no key/value recompute"
                                             else self._share)
        context = self._context
        self._lean.lean_activations = ((lambda enabled=True: context(False))
                                       if variant == "off" else context)

    def close(self) -> None:
        self._lean._Registry.record = self._record
        self._lean.share_input = self._share
        self._lean.lean_activations = self._context


def lean_variants(size_name: str, mode: str, rounds: int = ROUNDS) -> dict:
    """Step times (ms) of each lean variant, interleaved (the module docstring)."""
    step = bt._provider_step(mode, size_name, bt.TARGET, bt.OURS_MATERIALIZED, "cpu",
                             keep_grads=False)
    switch = _LeanSwitch()
    times = {v: [] for v in LEAN_VARIANTS}
    try:
        for variant in LEAN_VARIANTS:  # each variant's first steps (page cache, allocator)
            switch.set(variant)
            for _ in range(WARMUP):
                step()
        for r in range(rounds):
            for variant in (LEAN_VARIANTS if r % 2 == 0 else LEAN_VARIANTS[::-1]):
                switch.set(variant)
                start = time.perf_counter()
                step()
                times[variant].append((time.perf_counter() - start) * 1e3)
    finally:
        switch.close()
    return times


def _clip_coefficient(grads, max_norm: float) -> torch.Tensor:
    norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2.0)), 2.0)
    return torch.clamp(max_norm / (norm + 1e-6), max=1.0)


def _step_with_grad_scale(opt, grads, max_norm: float) -> None:
    """Clipping with the scaling pass moved into fused AdamW's read of the gradients."""
    opt.grad_scale = torch.reciprocal(_clip_coefficient(grads, max_norm))
    opt.found_inf = torch.zeros((), dtype=torch.float32)
    try:
        opt.step()
    finally:
        del opt.grad_scale, opt.found_inf


def clip_variants(size_name: str, mode: str, calls: int = CLIP_CALLS) -> dict:
    """Times (ms) of the clipping passes and of clip + step both ways; and the largest
    parameter difference between the two ways after one step from the same state."""
    hf = bt._hf_model(mode, bt.SIZES[size_name])
    params = [p for p in hf.rag.generator.parameters() if p.requires_grad]
    twin = [torch.nn.Parameter(p.detach().clone()) for p in params]
    g = torch.Generator().manual_seed(0)
    for p, q in zip(params, twin):
        p.grad = torch.randn(p.shape, generator=g) * 1e-2
        q.grad = p.grad.clone()
    opt = torch.optim.AdamW(params, lr=1e-3, fused=True)
    opt_twin = torch.optim.AdamW(twin, lr=1e-3, fused=True)
    grads = [p.grad for p in params]
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    _step_with_grad_scale(opt_twin, [q.grad for q in twin], 1.0)
    differs = max(float((p - q).detach().abs().max()) for p, q in zip(params, twin))
    fns = {
        "norm pass": lambda: torch._foreach_norm(grads, 2.0),
        "scaling pass": lambda: torch._foreach_mul_(grads, 1.0),
        "fused AdamW step": opt.step,
        "clip + step": lambda: (torch.nn.utils.clip_grad_norm_(params, 1.0), opt.step()),
        "clip + step, scaling in AdamW": lambda: _step_with_grad_scale(opt, grads, 1.0),
    }
    times = {v: [] for v in CLIP_VARIANTS}
    for r in range(calls + 1):
        for variant in (CLIP_VARIANTS if r % 2 == 0 else CLIP_VARIANTS[::-1]):
            start = time.perf_counter()
            fns[variant]()
            if r:  # the first round warms up
                times[variant].append((time.perf_counter() - start) * 1e3)
    n = sum(p.numel() for p in params)
    return {"times_ms": times, "parameters": n, "tensors": len(params),
            "max_parameter_difference": differs}


def heap_steps(size_name: str, mode: str, keep: bool) -> dict:
    """In a fresh process (``memory.call_fresh``): :data:`HEAP_STEPS` timed steps after
    :data:`HEAP_WARMUP`, with glibc's default thresholds or ``keep_freed_memory``'s."""
    import resource

    from rag_fast.training import heap

    torch.set_flush_denormal(True)
    outcome = heap.keep_freed_memory() if keep else None
    step = bt._provider_step(mode, size_name, bt.TARGET, bt.OURS_MATERIALIZED, "cpu",
                             keep_grads=False)
    for _ in range(HEAP_WARMUP):
        step()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the resident set's high-water mark (VmHWM) to the current size
    times, faults = [], []
    for _ in range(HEAP_STEPS):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        start = time.perf_counter()
        step()
        times.append((time.perf_counter() - start) * 1e3)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    return {"times_ms": times, "faults": faults, "outcome": outcome,
            "peak_rss_mb": _status_kb("VmHWM") / 1024}


def _status_kb(field: str) -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def heap_variants(size_name: str, mode: str, processes: int = HEAP_PROCESSES) -> dict:
    """:func:`heap_steps` both ways, alternating fresh processes; per variant the steps'
    times and faults pooled, and each process's peak resident set."""
    import harness
    import memory

    from rag_fast.training import heap

    said = heap.user_setting(os.environ) or (
        harness.ALLOCATOR_ENV if os.environ.get(harness.ALLOCATOR_ENV, "default") != "default"
        else None)
    if said is not None:
        raise RuntimeError(f"{said} is set here, and the fresh processes would inherit it: unset "
                           "it to compare glibc's defaults with keep_freed_memory")
    got = {v: {"times_ms": [], "faults": [], "peak_rss_mb": []} for v in HEAP_VARIANTS}
    for _ in range(processes):
        for variant in HEAP_VARIANTS:
            keep = variant == "freed memory kept"
            r = memory.call_fresh("step_variants:heap_steps", size_name, mode, keep,
                                  path=(HERE,), timeout=1800, label=f"heap {variant}")
            if keep and r["outcome"] != "set":
                raise RuntimeError(f"keep_freed_memory did not apply here: {r['outcome']}")
            got[variant]["times_ms"] += r["times_ms"]
            got[variant]["faults"] += r["faults"]
            got[variant]["peak_rss_mb"].append(r["peak_rss_mb"])
    return got


def run(size_name: str, mode: str) -> dict:
    from harness import machine_description

    torch.set_flush_denormal(True)  # as the training bench's timing processes
    case = f"{size_name} {mode} B={bt.B} K={bt.K} L={bt.CONTEXT} T={bt.TARGET}"
    lean = lean_variants(size_name, mode)
    print(f"{case}: lean variants measured", flush=True)
    clip = clip_variants(size_name, mode)
    heap = heap_variants(size_name, mode)
    print(f"{case}: freed memory kept measured", flush=True)
    return {"machine": machine_description("cpu"), "case": case, "rounds": ROUNDS,
            "warmup": WARMUP, "lean_ms": lean, "clip": clip, "heap": heap,
            "heap_processes": HEAP_PROCESSES, "heap_warmup": HEAP_WARMUP}


def _cells(runs: list[float], base: float) -> str:
    m = statistics.median(runs)
    return f"{m:,.1f} | {min(runs):,.1f} - {max(runs):,.1f} | {m / base:.3f}"


def render(results: dict, source: str) -> str:
    from harness import machine_words

    lean, clip = results["lean_ms"], results["clip"]
    base = statistics.median(lean["all recipes"])
    out = [f"Measured by `python benchmarks/step_variants.py --out benchmarks/results/{source}` "
           f"on {machine_words(results['machine'])}; {results['case']}, eager `RagModel`, "
           f"materialized logits: {results['rounds']} rounds of one step per variant, "
           "interleaved, after "
           f"{results['warmup']} untimed steps each (ms: median, range, ratio to the default).",
           "", "| lean activations | step ms | range | vs default |", "|---|---|---|---|"]
    out += [f"| {v} | {_cells(lean[v], base)} |" for v in LEAN_VARIANTS]
    t = clip["times_ms"]
    step = statistics.median(t["clip + step"])
    out += ["", f"Clipping over the generator's {clip['parameters'] / 1e6:.0f}M parameters "
            f"({clip['tensors']} tensors), {len(t['clip + step'])} calls each, interleaved "
            "(ms: median, range, ratio to clip + step); the two ways' parameters after one step "
            f"differ by at most {clip['max_parameter_difference']:.1e}:",
            "", "| clipping | ms | range | vs clip + step |", "|---|---|---|---|"]
    out += [f"| {v} | {_cells(t[v], step)} |" for v in CLIP_VARIANTS]
    heap = results.get("heap")
    if heap:
        base = statistics.median(heap["glibc default"]["times_ms"])
        n, p = len(heap["glibc default"]["times_ms"]), results["heap_processes"]
        out += ["", f"Freed memory kept, in fresh processes ({p} of each, alternating; "
                f"{n // p} timed steps per process after {results['heap_warmup']} untimed ones, "
                f"{n} of each in all; ms: median, range, ratio to glibc's default; the timed "
                "steps' peak resident set, per process):", "",
                "| glibc's thresholds | step ms | range | vs default | page faults per step "
                "(median) | steps' peak resident MB |", "|---|---|---|---|---|---|"]
        for v in HEAP_VARIANTS:
            h = heap[v]
            peaks = ", ".join(f"{p:,.0f}" for p in h["peak_rss_mb"])
            out.append(f"| {v} | {_cells(h['times_ms'], base)} | "
                       f"{statistics.median(h['faults']):,.0f} | {peaks} |")
    return "\n".join(out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="bart-base", choices=[
        s for s, v in bt.SIZES.items() if not v.get("causal")],
        help="an encoder-decoder size of the training bench (default bart-base)")
    parser.add_argument("--mode", default="token", choices=["token", "sequence"])
    parser.add_argument("--out", required=True, help="results JSON to write")
    args = parser.parse_args(argv)
    results = run(args.size, args.mode)
    from harness import write_json_file

    write_json_file(args.out, results, indent=1)
    print(render(results, os.path.basename(args.out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
