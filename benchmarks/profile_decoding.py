"""Where a decoding's time goes: the decoding bench's generation cases (``bench_decoding.py``),
rag_fast's ``generate`` and transformers' (rag_fast's alone over the decoder-only generator) split
by operator into what the GEMM floor counts and what it does not.

    python benchmarks/profile_decoding.py --out benchmarks/results/cpu-decoding-profile.json

Each case builds the bench's models and inputs (same weights, sizes and settings), counts each
provider's matrix-product work (one untimed call, ``torch.utils.flop_counter``, as the bench
does), runs ``WARMUP`` untimed calls, then ``CALLS`` calls under ``torch.profiler`` (CPU
activity, shapes recorded). Each operator's self CPU time goes to one group (:func:`group`):

- ``LM-head GEMMs``: matrix products with the vocabulary as a dimension (the logits of every
  step);
- ``other GEMMs``: the generator's other matrix products (projections, FFN, the
  cross-attention keys and values, the encoder);
- ``attention``: the attention kernels (``scaled_dot_product_*``) and the batched products
  (``bmm``) of an attention written out;
- ``log-softmax``: the normalisations over the vocabulary (``log_softmax``, ``logsumexp``);
- ``beam step``: rag_fast's fused beam step (``rag_fast::beam_step``) and the top-k and sorts
  of a search (``topk``, ``sort``);
- ``cache reorders``: the gathers that move cache rows to the surviving beams
  (``index_select``, ``gather``, ``index``, ``take_along_dim``);
- ``copies``: ``copy_``, ``cat``, ``clone``, ``contiguous`` and ``stack``;
- ``other ops``: every other operator (layer norms, activations, masks, elementwise
  arithmetic);
- ``Python and dispatch``: the call's wall time less the operators' self time: the search's
  Python per step, argument checks, and the dispatcher between operators.

``GEMM floor``: the case's least matrix-product work over the providers at the best rate of a
square fp32 matmul measured in the same run (``bench_training.gemm_rate``). The profiler's own
cost is in the profiled calls (``call ms`` here is a little above the bench's).
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

import bench_decoding as bd  # noqa: E402
import bench_training as bt  # noqa: E402

WARMUP, CALLS = 1, 2
TOP_OPS = 30  # the operators kept per provider in the results (by self time)
GROUPS = ("LM-head GEMMs", "other GEMMs", "attention", "log-softmax", "beam step",
          "cache reorders", "copies", "other ops", "Python and dispatch")
GEMM_OPS = {"aten::mm", "aten::addmm", "aten::addmm_", "aten::baddbmm_"}
ATTENTION_OPS = {"aten::bmm", "aten::baddbmm"}
SOFTMAX_OPS = {"aten::_log_softmax", "aten::log_softmax", "aten::logsumexp",
               "aten::_softmax", "aten::softmax"}
SEARCH_OPS = {"aten::topk", "aten::sort", "aten::argsort"}
REORDER_OPS = {"aten::index_select", "aten::gather", "aten::index", "aten::take_along_dim",
               "aten::index_copy_"}
COPY_OPS = {"aten::copy_", "aten::cat", "aten::clone", "aten::contiguous", "aten::stack",
            "aten::_to_copy"}
PROVIDERS = ("rag_fast", "transformers")


def group(name: str, shapes, vocab: int) -> str:
    """The group of one operator (see the module docstring); ``vocab``: the LM head's rows."""
    if name in GEMM_OPS:
        dims = {d for shape in (shapes or []) for d in (shape or [])}
        return "LM-head GEMMs" if vocab in dims else "other GEMMs"
    if name in ATTENTION_OPS or "scaled_dot_product" in name:
        return "attention"
    if name in SOFTMAX_OPS:
        return "log-softmax"
    if name.startswith("rag_fast::") or name in SEARCH_OPS:
        return "beam step"
    if name in REORDER_OPS:
        return "cache reorders"
    if name in COPY_OPS:
        return "copies"
    return "other ops"


def profile_call(fn, vocab: int, calls: int = CALLS, warmup: int = WARMUP) -> dict:
    """``fn`` (one decoding, under no_grad) profiled: ``{"call_ms": [...], "groups": {group: ms
    per call}, "top_ops": [[name, shapes, ms per call], ...]}``."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad():
        for _ in range(warmup):
            fn()
        times = []
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            for _ in range(calls):
                start = time.perf_counter()
                fn()
                times.append((time.perf_counter() - start) * 1e3)
    groups = dict.fromkeys(GROUPS, 0.0)
    ops = []
    for event in prof.key_averages(group_by_input_shape=True):
        ms = event.self_cpu_time_total / 1e3 / calls
        groups[group(event.key, event.input_shapes, vocab)] += ms
        ops.append((event.key, event.input_shapes, ms))
    wall = statistics.median(times)
    # the profiler's self times sum over the calling thread's operators; the rest of the wall
    # time is Python and dispatch between them
    groups["Python and dispatch"] = max(0.0, sum(times) / calls - sum(groups.values()))
    ops.sort(key=lambda op: -op[2])
    return {"call_ms": times, "median_ms": wall, "groups": groups,
            "top_ops": [list(op) for op in ops[:TOP_OPS]]}


def case_providers(label: str, what: str, B: int, new: int) -> tuple[str, int, dict]:
    """The bench's case ``what`` on generator ``label``: its name, the vocabulary size and
    ``{provider: call}`` (rag_fast alone for a decoder-only generator)."""
    from rag_fast.generation import rag_sequence_generate, rag_token_generate
    from rag_fast.generation.causal import causal_generate

    case = f"{what}, {label} generator, B={B} K={bd.K_DOCS} beams={bd.BEAMS} new={new}"
    if label in bd.CAUSAL_GENERATORS:
        generator = bd._causal_generator(label, bd.INIT_STD)
        vocab = bd._causal_vocab(label)
        ids, mask, scores = bd._inputs(B, bd.K_DOCS, bd.CONTEXT_LEN, vocab)
        mode = "token" if what == bd.TOKEN else "sequence"
        return case, vocab, {"rag_fast": lambda: causal_generate(
            generator, ids, mask, scores, mode=mode, num_beams=bd.BEAMS, max_new_tokens=new,
            min_new_tokens=new)}
    token, sequence = bd._models(*bd.GENERATORS[label], n_docs=bd.K_DOCS, init_std=bd.INIT_STD)
    ids, mask, scores = bd._inputs(B, bd.K_DOCS, bd.CONTEXT_LEN)
    model = token if what == bd.TOKEN else sequence
    ours = rag_token_generate if what == bd.TOKEN else rag_sequence_generate
    settings = dict(num_beams=bd.BEAMS, max_length=new + 1, min_length=new + 1)
    return case, bd.VOCAB, {
        "rag_fast": lambda: ours(model, ids, mask, scores, **settings),
        "transformers": lambda: model.generate(context_input_ids=ids,
                                               context_attention_mask=mask, doc_scores=scores,
                                               **settings)}


def run(sizes: dict, device: str = "cpu") -> dict:
    import torch

    from harness import machine_description

    if device != "cpu":
        raise ValueError("the decoding profile runs on the CPU (as the decoding bench)")
    rate = bt.gemm_rate(device)
    rows = []
    for label, cases in sizes.items():
        for what, (B, new) in cases.items():
            case, vocab, calls = case_providers(label, what, B, new)
            with torch.no_grad():
                gflop = {p: bt.step_gflop(fn) for p, fn in calls.items()}
            floor_ms = min(gflop.values()) / rate * 1e3
            for provider in (p for p in PROVIDERS if p in calls):
                got = profile_call(calls[provider], vocab)
                print(f"{case}: {provider} {got['median_ms']:,.0f} ms", flush=True)
                rows.append({"case": case, "provider": provider, "call_ms": got["median_ms"],
                             "runs_ms": got["call_ms"], "groups": got["groups"],
                             "gflop": gflop[provider], "gemm_floor_ms": floor_ms,
                             "gemm_gflops": rate, "top_ops": got["top_ops"]})
    return {"machine": machine_description(device), "warmup": WARMUP, "calls": CALLS,
            "rows": rows}


def render(results: dict, source: str) -> str:
    """One table per case: each provider's profiled decoding split into the groups, in ms."""
    from harness import machine_words, profile_tables, source_path

    out = [f"Measured by `python benchmarks/profile_decoding.py --out {source_path(source)}` on "
           f"{machine_words(results['machine'])}: the decoding bench's cases and weights, "
           f"{results['warmup']} warm-up call, then {results['calls']} profiled calls per "
           "provider; self CPU time per call in ms by group (module docstring of "
           "`benchmarks/profile_decoding.py`; \"Python and dispatch\" is the wall time the "
           "operators do not account for). GEMM floor: the case's least matrix-product work "
           "(GFLOP, `torch.utils.flop_counter`) at the best fp32 matmul rate of the same run."]
    return "\n".join(out + profile_tables(results["rows"], GROUPS, "call_ms", "call ms",
                                          (("GFLOP", lambda r: f"{r['gflop']:,.1f}"),)))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="the bench's --quick sizes (the small generator, B=1, 6 tokens)")
    parser.add_argument("--out", required=True, help="results JSON to write")
    args = parser.parse_args(argv)
    results = run(bd.QUICK_SIZES if args.quick else bd.FULL_SIZES)
    from harness import write_json_file

    write_json_file(args.out, results, indent=1)
    print(render(results, os.path.basename(args.out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
