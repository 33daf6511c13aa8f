"""Re-tune rag_fast's machine-dependent settings on this machine (docs/tuning.md).

    python benchmarks/tune.py lm-head-chunk    # LM_HEAD_CHUNK (CPU training's LM head)
    python benchmarks/tune.py lm-head-tile     # TILE_BYTES(_CUDA) of the fused LM-head + RAG loss
    python benchmarks/tune.py cpp-threads      # threads of the C++ kernels
    python benchmarks/tune.py cpp-simd         # instruction-set variant of the C++ kernels

Each command times every candidate value on the same seeded input, candidates taking turns
round after round (so that a slow spell of a shared machine hits them all alike), and prints
a table (median and min-max of the rounds, time relative to the best), the value in use now
and the best one, and how to apply it. Spreads above 20% mark a noisy row: rerun on an idle
machine before changing anything. Constants compiled into the C++ kernels are swept with a
rebuild (docs/tuning.md, "C++ kernels"), and the micro-benchmarks compare the two builds.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Callable

import torch

NOISY = 0.20  # (max - min) / median above this marks a row as noisy
SIMD_VARIANTS = ("generic", "avx2", "avx512")


# ---- timing ----------------------------------------------------------------------------------
def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"must be positive integers, got {text!r}")
    return values


def time_rounds(candidates: dict[str, Callable[[], object]], rounds: int, warmup: int = 1
                ) -> dict[str, list[float]]:
    """Milliseconds of each candidate per round; the candidates take turns within a round."""
    for fn in candidates.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(rounds):
        for name, fn in candidates.items():
            start = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - start) * 1e3)
    return times


def summarise(times: dict[str, list[float]]) -> list[dict]:
    rows = [{"value": name, "median_ms": statistics.median(t), "min_ms": min(t), "max_ms": max(t)}
            for name, t in times.items()]
    best = min(r["median_ms"] for r in rows)
    for r in rows:
        r["vs_best"] = r["median_ms"] / best
        r["noisy"] = (r["max_ms"] - r["min_ms"]) / r["median_ms"] > NOISY
    return rows


def print_table(title: str, rows: list[dict], current: str | None, unit: str = "value") -> dict:
    """Print the table; return the best row."""
    print(title)
    print(f"  {unit:>14}  {'median ms':>10}  {'min-max ms':>17}  {'vs best':>7}")
    best = min(rows, key=lambda r: r["median_ms"])
    for r in rows:
        marks = [m for m, on in (("best", r is best), ("in use", r["value"] == current),
                                 ("noisy", r["noisy"])) if on]
        span = f"{r['min_ms']:.2f}-{r['max_ms']:.2f}"
        print(f"  {r['value']:>14}  {r['median_ms']:>10.2f}  {span:>17}  {r['vs_best']:>6.2f}x"
              f"  {', '.join(marks)}")
    if any(r["noisy"] for r in rows):
        print(f"  note: rows marked noisy varied by more than {NOISY:.0%} between rounds; rerun on an "
              "idle machine (or with more --rounds) before acting on this table")
    return best


# ---- LM_HEAD_CHUNK -------------------------------------------------------------------------
def cmd_lm_head_chunk(args) -> int:
    from rag_fast.generation.heads import LMHead
    from rag_fast.models import _seq2seq

    current = _seq2seq.LM_HEAD_CHUNK
    g = torch.Generator().manual_seed(0)
    N, d, V = args.rows, args.dim, args.vocab
    states = torch.randn(N, d, generator=g).requires_grad_()
    head = LMHead(weight=torch.randn(V, d, generator=g) * 0.02,
                           bias=torch.randn(V, generator=g) * 0.02, scale=1.0)
    workspace = _seq2seq.LogitsWorkspace()
    want = torch.nn.functional.linear(states.detach(), head.weight, head.bias)
    chunks = sorted(set(args.candidates + [current]))

    def run(chunk: int):
        def call():
            _seq2seq.LM_HEAD_CHUNK = chunk
            with torch.enable_grad():
                out = _seq2seq.lm_logits(head, states, workspace)
            return out

        return call

    try:
        for chunk in chunks:  # every candidate computes the same logits
            got = run(chunk)()
            if not torch.allclose(got, want, rtol=1e-4, atol=1e-5):
                raise SystemExit(f"LM_HEAD_CHUNK={chunk}: logits differ from one matmul's")
            del got
        times = time_rounds({str(c): run(c) for c in chunks}, args.rounds)
    finally:
        _seq2seq.LM_HEAD_CHUNK = current
    rows = summarise(times)
    best = print_table(
        f"LM_HEAD_CHUNK: LM head forward of CPU fp32 training, [{N}, {d}] x [{d}, {V}], "
        f"{torch.get_num_threads()} torch threads, {args.rounds} rounds (a chunk >= {V} is one matmul)",
        rows, str(current), unit="LM_HEAD_CHUNK")
    print(f"in use: {current}; best here: {best['value']}")
    if best["value"] != str(current):
        print(f"to use it: set LM_HEAD_CHUNK = {best['value']} in rag_fast/models/_seq2seq.py "
              "(or assign rag_fast.models._seq2seq.LM_HEAD_CHUNK at run time)")
    _dump(args, {"setting": "LM_HEAD_CHUNK", "current": current, "rows": rows})
    return 0


# ---- TILE_BYTES of the fused LM-head loss ----------------------------------------------------
def cmd_lm_head_tile(args) -> int:
    import importlib

    lin = importlib.import_module("rag_fast.ops.linear_rag_nll")
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print("tune.py lm-head-tile: --device cuda but torch sees no CUDA device", file=sys.stderr)
        return 2
    name = "TILE_BYTES_CUDA" if cuda else "TILE_BYTES"
    current = getattr(lin, name)
    dtype = torch.bfloat16 if cuda else torch.float32
    g = torch.Generator().manual_seed(0)
    B, K, T, d, V = args.batch, args.docs, args.tokens, args.dim, args.vocab
    h = torch.randn(B * K, T, d, generator=g).to(args.device, dtype).requires_grad_()
    W = (torch.randn(V, d, generator=g) * d ** -0.5).to(args.device, dtype).requires_grad_()
    s = torch.randn(B, K, generator=g).to(args.device).requires_grad_()
    y = torch.randint(0, V, (B, T), generator=g).to(args.device)
    candidates = args.candidates or ([16, 32, 64, 128, 256, 512] if cuda else [2, 4, 8, 16, 32])
    sizes = sorted(set(candidates + [current >> 20]))

    def run(mib: int):
        def call():
            tile = lin.tile_width(h.shape[0] * T, V, h.element_size(), mib << 20)
            lin.linear_rag_nll(h, W, s, y, mode=args.mode, epsilon=args.epsilon,
                               reduction="sum", tile=tile).backward()
            h.grad = W.grad = s.grad = None
            if cuda:
                torch.cuda.synchronize()

        return call

    times = time_rounds({str(m): run(m) for m in sizes}, args.rounds)
    rows = summarise(times)
    best = print_table(
        f"{name} (MiB of logits per tile): fused LM-head + RAG-{args.mode} loss, fwd+bwd, "
        f"B{B} K{K} T{T} d{d} V{V} {str(dtype).replace('torch.', '')} on {args.device}, "
        f"eps {args.epsilon}, {args.rounds} rounds", rows, str(current >> 20),
        unit="MiB per tile")
    print(f"in use: {current >> 20} MiB; best here: {best['value']} MiB")
    if best["value"] != str(current >> 20):
        print(f"to use it: set {name} = {best['value']} << 20 in "
              "rag_fast/ops/linear_rag_nll.py (or pass tile= to linear_rag_nll)")
    _dump(args, {"setting": name, "current": current, "rows": rows})
    return 0


# ---- C++ kernels: one workload, timed by kernel ------------------------------------------------
def kernel_workload(shape: tuple[int, int, int, int], beam: tuple[int, int, int, int]
                    ) -> dict[str, Callable[[], object]]:
    """The C++ kernels' main calls on seeded inputs: the losses forward and backward, the
    marginal, the beam step (impl="cpp": fails without the compiled extension)."""
    import rag_fast

    B, K, T, V = shape
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(B * K, T, V, generator=g) * 2).requires_grad_()
    scores = torch.randn(B, K, generator=g).requires_grad_()
    targets = torch.randint(0, V, (B, T), generator=g)
    bB, bW, bK, bV = beam
    beam_logits = torch.randn(bB, bW, bK, bV, generator=g) * 2
    prior = torch.log_softmax(torch.randn(bB, bK, generator=g), dim=1)
    beam_scores = -torch.rand(bB, bW, generator=g)

    def loss_step(fn, eps):
        def call():
            loss = fn(logits, scores, targets, epsilon=eps, reduction="sum", impl="cpp")
            return torch.autograd.grad(loss, (logits, scores))

        return call

    def marginal():
        with torch.no_grad():
            return rag_fast.rag_token_marginal(logits, scores, impl="cpp")

    return {
        "token eps=0.1 fwd+bwd": loss_step(rag_fast.rag_token_nll, 0.1),
        "token eps=0 fwd+bwd": loss_step(rag_fast.rag_token_nll, 0.0),
        "sequence eps=0.1 fwd+bwd": loss_step(rag_fast.rag_sequence_nll, 0.1),
        "token marginal fwd": marginal,
        "beam step": lambda: rag_fast.rag_token_beam_step(beam_logits, prior, beam_scores, impl="cpp"),
    }


def _ext():
    from rag_fast import _ext as ext

    return ext.get()  # raises with the fix when the extension is missing


def _workload_args(args):
    return (args.batch, args.docs, args.tokens, args.vocab), (args.beam_batch, args.beams, args.docs, args.vocab)


def cmd_cpp_threads(args) -> int:
    C = _ext()
    before = C.num_threads()
    counts = sorted(set(args.candidates or range(1, (os.cpu_count() or 1) + 1)))
    work = kernel_workload(*_workload_args(args))
    per_kernel: dict[str, dict[str, list[float]]] = {k: {} for k in work}
    try:
        for name, fn in work.items():
            def with_threads(n, fn=fn):
                def call():
                    C.set_num_threads(n)
                    return fn()

                return call

            per_kernel[name] = time_rounds({str(n): with_threads(n) for n in counts}, args.rounds)
    finally:
        C.set_num_threads(before)
    return _report_kernels(args, per_kernel, "threads", str(before),
                           f"C++ kernel threads ({C.simd_level()}), {_shape_text(args)}",
                           apply="to use N threads: OMP_NUM_THREADS=N (set before the process starts) or "
                                 "rag_fast._C.set_num_threads(N); see docs/tuning.md on torch's threads")


def cmd_cpp_simd(args) -> int:
    """Each variant in a child process (the variant is chosen once, at the first kernel call)."""
    in_use = _ext().simd_level()
    per_kernel: dict[str, dict[str, list[float]]] = {}
    seen: set[str] = set()
    for variant in args.candidates or SIMD_VARIANTS:
        env = {**os.environ, "RAG_FAST_SIMD": variant}
        cmd = [sys.executable, os.path.abspath(__file__), "_kernel-times", "--rounds", str(args.rounds),
               *_shape_flags(args)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"RAG_FAST_SIMD={variant}: the timing run failed:\n{proc.stderr[-3000:]}")
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        got = result["simd_level"]
        if got in seen:  # this CPU cannot run the variant asked for: the dispatcher fell back
            print(f"RAG_FAST_SIMD={variant}: this CPU runs {got} instead (already timed)")
            continue
        seen.add(got)
        for name, t in result["times"].items():
            per_kernel.setdefault(name, {})[got] = t
    return _report_kernels(args, per_kernel, "variant", in_use,
                           f"C++ kernel variants ({_ext().num_threads()} threads), {_shape_text(args)}",
                           apply="to use a variant: RAG_FAST_SIMD=generic|avx2|avx512 caps the choice "
                                 "(the default takes the widest this CPU runs)")


def cmd_kernel_times(args) -> int:
    """Internal (cpp-simd's child): times of the workload in this process, one JSON line."""
    work = kernel_workload(*_workload_args(args))
    times = {name: time_rounds({"x": fn}, args.rounds)["x"] for name, fn in work.items()}
    print(json.dumps({"simd_level": _ext().simd_level(), "times": times}))
    return 0


def _report_kernels(args, per_kernel, unit, current, title, apply) -> int:
    totals: dict[str, float] = {}
    dumped = {}
    for name, times in per_kernel.items():
        rows = summarise(times)
        print_table(f"{title}: {name}", rows, current, unit=unit)
        for r in rows:
            totals[r["value"]] = totals.get(r["value"], 0.0) + r["median_ms"]
        dumped[name] = rows
        print()
    best = min(totals, key=totals.get)
    print("sum of the medians: " + ", ".join(f"{v}: {t:.1f} ms" for v, t in totals.items()))
    print(f"in use: {current}; best here (sum over the kernels): {best}")
    if best != current:
        print(apply)
    _dump(args, {"setting": unit, "current": current, "kernels": dumped, "totals_ms": totals})
    return 0


def _shape_text(args) -> str:
    return (f"losses B{args.batch} K{args.docs} T{args.tokens} V{args.vocab}, beam step "
            f"B{args.beam_batch} W{args.beams} K{args.docs}, {args.rounds} rounds")


def _shape_flags(args) -> list[str]:
    return ["--batch", str(args.batch), "--docs", str(args.docs), "--tokens", str(args.tokens),
            "--vocab", str(args.vocab), "--beam-batch", str(args.beam_batch), "--beams", str(args.beams)]


def _dump(args, result: dict) -> None:
    """``--json PATH``: the table as JSON, written atomically (a temporary file renamed)."""
    if not getattr(args, "json", None):
        return
    tmp = f"{args.json}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, args.json)
    print(f"wrote {args.json}")


# ---- command line ------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="docs/tuning.md lists every tuned constant and how it was chosen.")
    # the metavar lists the public commands only (the internal _kernel-times stays unlisted)
    sub = parser.add_subparsers(dest="command", required=True,
                                metavar="{lm-head-chunk,lm-head-tile,cpp-threads,cpp-simd}")

    def common(p, rounds: int):
        p.add_argument("--rounds", type=_positive_int, default=rounds, help=f"timed rounds (default {rounds})")
        p.add_argument("--json", metavar="PATH", help="also write the results as JSON")

    p = sub.add_parser("lm-head-chunk", help="LM_HEAD_CHUNK: vocabulary columns per LM-head matmul")
    p.add_argument("--rows", type=_positive_int, default=640,
                   help="decoder states B*K*T (default 640: B4 K5 T32, the training benchmark)")
    p.add_argument("--dim", type=_positive_int, default=768, help="d_model (default 768: BART-base)")
    p.add_argument("--vocab", type=_positive_int, default=50265, help="vocabulary (default 50265)")
    p.add_argument("--candidates", type=_int_list, default=[128, 256, 512, 1024, 2048, 4096, 50265],
                   help="comma-separated chunk sizes (the one in use is always added)")
    common(p, 7)
    p.set_defaults(func=cmd_lm_head_chunk)

    p = sub.add_parser("lm-head-tile",
                       help="TILE_BYTES (TILE_BYTES_CUDA): logits per tile of the fused LM-head + RAG loss")
    p.add_argument("--batch", type=_positive_int, default=4, help="questions B (default 4)")
    p.add_argument("--docs", type=_positive_int, default=5, help="passages K (default 5)")
    p.add_argument("--tokens", type=_positive_int, default=64, help="target tokens T (default 64)")
    p.add_argument("--dim", type=_positive_int, default=896, help="d_model (default 896)")
    p.add_argument("--vocab", type=_positive_int, default=151936, help="vocabulary (default 151936)")
    p.add_argument("--mode", choices=["token", "sequence"], default="token")
    p.add_argument("--epsilon", type=float, default=0.0, help="label smoothing (default 0)")
    p.add_argument("--candidates", type=_int_list, default=None,
                   help="comma-separated MiB per tile (default 2,4,8,16,32 on the CPU, "
                        "16,32,64,128,256,512 on a GPU; the one in use is always added)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cpu (fp32, tunes TILE_BYTES) or cuda (bf16, tunes TILE_BYTES_CUDA)")
    common(p, 3)
    p.set_defaults(func=cmd_lm_head_tile)

    def kernel_shape(p):
        p.add_argument("--batch", type=_positive_int, default=4, help="losses: questions B (default 4)")
        p.add_argument("--docs", type=_positive_int, default=5, help="passages K (default 5)")
        p.add_argument("--tokens", type=_positive_int, default=32, help="losses: target tokens T (default 32)")
        p.add_argument("--vocab", type=_positive_int, default=50265, help="vocabulary V (default 50265)")
        p.add_argument("--beam-batch", type=_positive_int, default=8, help="beam step: questions (default 8)")
        p.add_argument("--beams", type=_positive_int, default=4, help="beam step: beams W (default 4)")

    p = sub.add_parser("cpp-threads", help="OpenMP threads of the C++ kernels")
    p.add_argument("--candidates", type=_int_list, default=None,
                   help="comma-separated thread counts (default 1 .. the CPU count)")
    kernel_shape(p)
    common(p, 5)
    p.set_defaults(func=cmd_cpp_threads)

    p = sub.add_parser("cpp-simd", help="instruction-set variant of the C++ kernels (RAG_FAST_SIMD)")
    p.add_argument("--candidates", type=lambda s: [v for v in s.split(",") if v], default=None,
                   help=f"comma-separated variants among {', '.join(SIMD_VARIANTS)} (default all)")
    kernel_shape(p)
    common(p, 5)
    p.set_defaults(func=cmd_cpp_simd)

    p = sub.add_parser("_kernel-times")  # internal: cpp-simd's child process; no help line
    kernel_shape(p)
    common(p, 5)
    p.set_defaults(func=cmd_kernel_times)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "cpp-simd" and args.candidates:
        bad = [v for v in args.candidates if v not in SIMD_VARIANTS]
        if bad:
            build_parser().error(f"--candidates: unknown variant(s) {bad}; choose among {SIMD_VARIANTS}")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
