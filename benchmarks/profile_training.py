"""Where a training step's time goes: the training bench's cases (``bench_training.py``), each
provider's step split by operator into what the GEMM floor counts and what it does not.

    python benchmarks/profile_training.py --out benchmarks/results/cpu-training-profile.json

Each (case, mode, provider) runs alone in a fresh process (``memory.call_fresh``, glibc's
allocator as it is by default, denormals flushed to zero, as the bench times): its model,
``WARMUP`` untimed steps (compiling, for a compiled provider), then ``STEPS`` steps under
``torch.profiler`` (CPU activity; inductor's kernels named, ``cpp.enable_kernel_profile``).
Each operator's self CPU time goes to one group (:func:`group`):

- ``LM-head GEMMs``: matrix products with the vocabulary as a dimension (logits, their
  gradient to the hidden states and to the head's weight), or one of the 512-column slices of
  it that rag_fast's LM head computes its logits in (``LM_HEAD_CHUNK``, ``KEPT_CHUNK``, and the
  last, narrower slice): no other matrix product of these generators has such a dimension;
- ``other GEMMs``: the generator's other matrix products (projections, FFN, embeddings' none);
- ``attention``: the fused attention kernels (``scaled_dot_product_*``), forward and backward;
- ``compiled kernels``: inductor's generated code (fused elementwise, norms, dropout, the
  embedding's gradient ...);
- ``rag_fast kernels``: rag_fast's loss statistics and gradient kernels (the C++ ops);
- ``optimizer``: the fused AdamW step and ``zero_grad``;
- ``other``: everything else (eager elementwise ops, norms, dropout, copies, the autograd
  engine, Python).

``GEMM floor`` is the step's least matrix-product work (the non-compiled providers' FLOP counts,
as the bench counts them) at the best rate of a square fp32 matmul measured in the same run.
The profiler's own cost is in the profiled step (``step ms`` here is a little above the bench's).
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

import bench_training as bt  # noqa: E402

WARMUP, STEPS = 3, 2
TOP_OPS = 40  # the operators kept per provider in the results (by self time)
GROUPS = ("LM-head GEMMs", "other GEMMs", "attention", "compiled kernels", "rag_fast kernels",
          "optimizer", "other")
GEMM_OPS = {"aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm", "aten::baddbmm",
            "aten::baddbmm_"}
PROVIDERS = (bt.EAGER, bt.COMPILED, bt.OURS_MATERIALIZED, bt.OURS_COMPILED)
CASES = ("small", "bart-base", "qwen2-0.5b-2l")
MODES = ("token", "sequence")


def group(name: str, shapes, vocab: int, chunk: int = 512) -> str:
    """The group of one operator (see the module docstring); ``chunk``: the vocabulary columns
    per GEMM of rag_fast's LM head."""
    if name in GEMM_OPS:
        dims = {d for shape in (shapes or []) for d in (shape or [])}
        lm_head = {vocab, chunk, vocab % chunk} - {0}
        return "LM-head GEMMs" if dims & lm_head else "other GEMMs"
    if "scaled_dot_product" in name:
        return "attention"
    if name.startswith("graph_") or "CompiledFxGraph" in name:
        return "compiled kernels"
    if name.startswith("rag_fast::"):
        return "rag_fast kernels"
    if "adamw" in name.lower() or name.startswith("Optimizer."):
        return "optimizer"
    return "other"


def profile_provider(mode: str, size_name: str, target: int, provider: str, device: str,
                     count_flops: bool) -> dict:
    """One provider's steps profiled in this (fresh) process: ``{"step_ms": [...], "groups":
    {group: ms per step}, "gflop": GFLOP or None}``."""
    import torch
    import torch._inductor.config as inductor_config
    from torch.profiler import ProfilerActivity, profile

    inductor_config.cpp.enable_kernel_profile = True  # inductor's kernels by name
    torch.set_flush_denormal(True)
    step = bt._provider_step(mode, size_name, target, provider, device, keep_grads=False)
    gflop = bt.step_gflop(step) if count_flops else None
    for _ in range(WARMUP):
        step()
    times = []
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(STEPS):
            start = time.perf_counter()
            step()
            times.append((time.perf_counter() - start) * 1e3)
    from rag_fast.models._seq2seq import LM_HEAD_CHUNK
    from rag_fast.ops.linear_rag_nll import KEPT_CHUNK

    if LM_HEAD_CHUNK != KEPT_CHUNK:
        raise RuntimeError("the LM head's two chunk widths differ: group() needs both")
    vocab = bt.SIZES[size_name].get("vocab", bt.VOCAB)
    groups = dict.fromkeys(GROUPS, 0.0)
    ops = []  # (name, input shapes, self ms per step): the raw data behind the groups
    for event in prof.key_averages(group_by_input_shape=True):
        ms = event.self_cpu_time_total / 1e3
        groups[group(event.key, event.input_shapes, vocab, LM_HEAD_CHUNK)] += ms
        ops.append((event.key, event.input_shapes, ms / STEPS))
    ops.sort(key=lambda op: -op[2])
    return {"step_ms": times, "groups": {k: v / STEPS for k, v in groups.items()},
            "gflop": gflop, "top_ops": [list(op) for op in ops[:TOP_OPS]]}


def run(cases, modes, device: str) -> dict:
    import memory
    from harness import machine_description

    rate = bt.gemm_rate(device)
    rows = []
    for size_name in cases:
        causal = bt.SIZES[size_name].get("causal", False)
        target = bt.CAUSAL_TARGET if causal else bt.TARGET
        batch = bt.CAUSAL_B if causal else bt.B
        for mode in modes:
            case = f"{size_name} {mode} B={batch} K={bt.K} L={bt.CONTEXT} T={target}"
            got = {}
            for provider in PROVIDERS:
                got[provider] = memory.call_fresh(
                    "profile_training:profile_provider", mode, size_name, target, provider, device,
                    provider not in bt.COMPILED_PROVIDERS, timeout=3600,
                    label=f"profile {size_name} {mode} {provider}")
                print(f"{case}: {provider} {statistics.median(got[provider]['step_ms']):,.0f} ms",
                      flush=True)
            floor_ms = min(g["gflop"] for g in got.values() if g["gflop"]) / rate * 1e3
            for provider, g in got.items():
                rows.append({"case": case, "provider": provider,
                             "step_ms": statistics.median(g["step_ms"]), "groups": g["groups"],
                             "gemm_floor_ms": floor_ms, "gemm_gflops": rate,
                             "top_ops": g["top_ops"]})
    return {"machine": machine_description(device), "warmup": WARMUP, "steps": STEPS,
            "rows": rows}


def render(results: dict, source: str) -> str:
    """One table per case: each provider's profiled step split into the groups, in ms."""
    from harness import machine_words, profile_tables, source_path

    out = [f"Measured by `python benchmarks/profile_training.py --out {source_path(source)}` on "
           f"{machine_words(results['machine'])}: {results['warmup']} warm-up steps, then "
           f"the median of {results['steps']} profiled steps per provider, each provider in a "
           "fresh process; self CPU time per step in ms by group (module docstring of "
           "`benchmarks/profile_training.py`). The GEMM floor: the step's least matrix-product "
           "work at the best fp32 matmul rate of the same run."]
    return "\n".join(out + profile_tables(results["rows"], GROUPS, "step_ms", "step ms"))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES),
                        help=f"comma-separated bench sizes (default {','.join(CASES)})")
    parser.add_argument("--modes", default=",".join(MODES), help="token,sequence (default)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", required=True, help="results JSON to write")
    args = parser.parse_args(argv)
    cases = [c for c in args.cases.split(",") if c]
    unknown = [c for c in cases if c not in bt.SIZES]
    if unknown:
        parser.error(f"--cases: unknown size(s) {unknown}; choose from {sorted(bt.SIZES)}")
    modes = [m for m in args.modes.split(",") if m]
    if not modes or any(m not in MODES for m in modes):
        parser.error(f"--modes must be token and/or sequence, got {args.modes!r}")
    results = run(cases, modes, args.device)
    from harness import write_json_file

    write_json_file(args.out, results, indent=1)
    print(render(results, os.path.basename(args.out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
