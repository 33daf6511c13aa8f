"""Decoding throughput: rag_fast vs transformers' RAG ``generate``, and the beam step alone.

Identical weights, passages and settings on both sides (context_input_ids, masks and doc
scores given directly, so no retriever runs); every run generates exactly the same number of
new tokens (min = max). Providers of a case are timed interleaved (one warm-up run each, then
``GEN_REPEATS`` timed runs, a, b, c, a, b, c, ...), and every timed run's ids are compared with
transformers' ids of the first timed run: a row says "same ids" only when all of them match.

Weights: both generators (a small one, d_model 256, 2+2 layers, and a BART-base-sized one,
768, 6+6 layers, 12 heads; V=50265) are re-initialised from a seeded normal with std
``INIT_STD`` (every matrix; layer norms keep their defaults). With the default initialisation
(std 0.02) every passage yields the same beams, which leaves RAG-Sequence's rescoring nothing
to decide and makes the same-ids check weak. Each case asserts that the weights exercise the
algorithm: transformers' own per-passage beam search (the generator's ``generate``, as
RAG-Sequence runs it) must give, for every question, top beams that differ between passages and
more than ``num_beams`` distinct hypotheses to rescore (the row records the smallest counts).

Baselines: transformers' ``generate`` with its default (dynamic) cache, and with
``cache_implementation="static"`` where that gives transformers' own ids: RAG-Sequence passes
it to the generator's per-passage beam search (BART supports it); RAG-Token's ``generate``
accepts it but its ``_reorder_cache`` rebuilds the cache from the static buffers as a dynamic
cache (empty slots included), so the ids change: the bench checks this at run time, records it,
and times the static cache only where its ids are transformers' default ones.

Beam step alone: the baseline is transformers' code for one RAG-Token beam-search step
(``RagTokenForGeneration.marginalize``, then what its ``_beam_search`` does with the step's
logits: ``log_softmax``, the running beam scores added, ``_get_top_k_continuations``).

Decoder-only rows: a Qwen2-0.5B-shaped generator (``bench_training``'s ``qwen2-0.5b-2l``: d 896,
2 layers, V 151,936) continuing the passages' prompts, decoded by rag_fast alone
(``causal_generate``): transformers has no RAG over a decoder-only generator; each row checks
that every timed run repeats the warm-up run's ids. RAG-Token: B=4 questions, 20 new tokens;
RAG-Sequence: B=2, 12.

Sizes (K=5 passages, 4 beams, V=50265 for the encoder-decoders): full: B=8 questions and 20 new
tokens, except RAG-Sequence on the BART-base-sized generator: B=2 questions and 12 new tokens
(transformers' RAG-Sequence re-encodes every passage for every distinct hypothesis, about 20 per
question here, so that case at B=8, 20 tokens would take most of an hour alone). The full
decoding bench is estimated at about 10 minutes on 2 idle cores. --quick: the small generator
only, B=1, 6 new tokens, within about a minute.

GEMM floor: each decoding's matrix-product work (``torch.utils.flop_counter``: matmuls and
attention, one untimed call of each provider's ``generate`` with the same inputs) at the best
rate of a square fp32 matmul measured in the same run (``bench_training.gemm_rate``); the
least work of the providers over that rate is a time no implementation of the decoding beats,
and every row says how far above it it runs (``x GEMM floor``).

Threads: rag_fast's BART decoder steps run on one intra-op thread, its LM head on all
(rag_fast.generation._decoder.STEP_ONE_THREAD, docs/tuning.md).
"""
from __future__ import annotations

import dataclasses

import torch

from bench_training import GEMM_CALLS, GEMM_N, GemmFloor, gemm_rate, step_gflop
from harness import (Context, Row, add_ratio, allocator_caption, machine_words,
                     measure_interleaved, noisy_note, run_command, source_path, spread_cell)

NAME = "decoding"
VOCAB = 50265
K_DOCS = 5
BEAMS = 4
CONTEXT_LEN = 64
INIT_STD = 0.3  # see the module docstring: passages must lead to different beams
GEN_WARMUP = 1  # done by hand in _generation_rows
GEN_REPEATS = 5
GENERATORS = {  # label -> (d_model, layers, heads, ffn)
    "small": (256, 2, 4, 1024),
    "BART-base-sized": (768, 6, 12, 3072),
}
# decoder-only generators: label -> bench_training size (Qwen2's shape, random weights)
CAUSAL_GENERATORS = {"Qwen2-0.5B-shaped (2 layers)": "qwen2-0.5b-2l"}
# generator -> {case: (B questions, new tokens)}; see the module docstring for the reductions
FULL_SIZES = {
    "small": {"RAG-Token beam search": (8, 20), "RAG-Sequence thorough": (8, 20)},
    "BART-base-sized": {"RAG-Token beam search": (8, 20), "RAG-Sequence thorough": (2, 12)},
    "Qwen2-0.5B-shaped (2 layers)": {"RAG-Token beam search": (4, 20),
                                     "RAG-Sequence thorough": (2, 12)},
}
QUICK_SIZES = {"small": {"RAG-Token beam search": (1, 6), "RAG-Sequence thorough": (1, 6)}}


def _models(d_model: int, layers: int, heads: int, ffn: int, n_docs: int, init_std: float | None):
    """(RagTokenForGeneration, RagSequenceForGeneration) sharing one seeded generator."""
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
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in token.rag.generator.parameters():
                if p.dim() >= 2:
                    p.copy_(torch.randn(p.shape, generator=gen) * init_std)
    sequence = RagSequenceForGeneration(config).eval()
    sequence.rag.generator.load_state_dict(token.rag.generator.state_dict())
    return token, sequence


def _causal_generator(label: str, init_std: float | None):
    """The decoder-only generator ``label`` (:data:`CAUSAL_GENERATORS`), its matrices drawn as
    the encoder-decoders' are, in eval mode."""
    import bench_training as bt

    generator = bt._causal_model(bt.SIZES[CAUSAL_GENERATORS[label]]).eval()
    if init_std is not None:
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in generator.parameters():
                if p.dim() >= 2:
                    p.copy_(torch.randn(p.shape, generator=gen) * init_std)
    return generator


def _causal_vocab(label: str) -> int:
    import bench_training as bt

    return bt.SIZES[CAUSAL_GENERATORS[label]]["vocab"]


def _inputs(B: int, K: int, S: int, vocab: int | None = None):
    vocab = VOCAB if vocab is None else vocab
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (B * K, S), generator=g)
    mask = torch.ones_like(ids)
    return ids, mask, torch.randn(B, K, generator=g)


def distinct_beams(generator, ids: torch.Tensor, B: int, K: int, W: int, new: int) -> dict:
    """How different the passages' beams are, by transformers' own per-passage beam search
    (what RAG-Sequence runs first): per question, the number of distinct top beams among its
    K passages and of distinct hypotheses among its K*W; the smallest over the questions."""
    with torch.no_grad():
        if getattr(generator.config, "is_encoder_decoder", True):
            out = generator.generate(input_ids=ids, num_beams=W, num_return_sequences=W,
                                     max_length=new + 1, min_length=new + 1)
        else:  # a decoder-only generator continues each passage's prompt
            out = generator.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                     num_beams=W, num_return_sequences=W, max_new_tokens=new,
                                     min_new_tokens=new)[:, ids.shape[1]:]
    out = out.view(B, K, W, -1)
    tops = [len({tuple(out[b, k, 0].tolist()) for k in range(K)}) for b in range(B)]
    hyps = [len({tuple(out[b, k, j].tolist()) for k in range(K) for j in range(W)})
            for b in range(B)]
    return {"distinct top beams": min(tops), "distinct hypotheses": min(hyps)}


def check_exercised(counts: dict, W: int, what: str) -> None:
    """Raise unless every question's passages lead to different beams (see the docstring)."""
    if counts["distinct top beams"] < 2 or counts["distinct hypotheses"] <= W:
        raise AssertionError(
            f"{what}: the generator's weights do not exercise RAG decoding (some question's "
            f"passages give {counts['distinct top beams']} distinct top beam(s) and "
            f"{counts['distinct hypotheses']} distinct hypotheses for {W} beams); raise INIT_STD"
        )


def _beam_step_rows(ctx: Context, B: int, W: int, K: int, reference: bool) -> list[Row]:
    from transformers import RagTokenForGeneration

    from rag_fast.ops import rag_token_beam_step

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(B * W * K, 1, VOCAB, generator=g) * 3  # the generator's [rows, 1, V]
    # generate repeats each question's scores for its W beams (repeat_interleave)
    doc_scores = torch.randn(B, K, generator=g).repeat_interleave(W, dim=0)
    beam = torch.randn(B, W, generator=g)
    # transformers' beam search keeps these per step; filled as after the decoder's start token.
    running = torch.full((B, W, 2), 2, dtype=torch.long)
    running_idx = torch.full((B, W, 1), -1, dtype=torch.int32)
    holder = RagTokenForGeneration.__new__(RagTokenForGeneration)  # the methods' `self`

    def hf_step():
        # RagTokenForGeneration.forward marginalises the generator's logits; _beam_search then
        # normalises, adds the running beam scores and keeps the 2W best continuations.
        marginal = RagTokenForGeneration.marginalize(holder, logits, doc_scores, n_docs=K)
        log_probs = torch.nn.functional.log_softmax(marginal[:, -1, :], dim=-1)
        log_probs = holder._unflatten_beam_dim(log_probs, B, W) + beam[:, :, None]
        return holder._get_top_k_continuations(
            accumulated_log_probs=log_probs.reshape(B, -1), running_sequences=running,
            running_beam_indices=running_idx, cur_len=1, decoder_prompt_len=1, do_sample=False,
            beams_to_keep=2 * W, num_beams=W, batch_size=B)

    prior = torch.log_softmax(doc_scores.view(B, W, K)[:, 0], 1)
    x = logits.view(B, W, K, VOCAB)
    providers = {"transformers": hf_step}
    impls = ("cpp", "torch") if reference else ("cpp",)
    for impl in impls:
        providers[f"rag_fast ({impl})"] = (lambda impl=impl: rag_token_beam_step(
            x, prior, beam, impl=impl))
    ms = measure_interleaved(providers, ctx, memory=False)
    hf_scores, hf_seqs, _ = hf_step()
    case = f"beam step B={B} W={W} K={K} V={VOCAB}"
    gb = x.numel() * 4 / 1e9
    base = ms["transformers"]
    rows = [Row.of(NAME, case, "transformers", base)]
    add_ratio(rows[0], "speedup", base, base)
    for impl in impls:
        scores, _, tokens = rag_token_beam_step(x, prior, beam, impl=impl)
        same = bool(torch.equal(tokens, hf_seqs[:, :, 1])
                    and torch.allclose(scores.double(), hf_scores.double(), atol=1e-4))
        m = ms[f"rag_fast ({impl})"]
        row = Row.of(NAME, case, f"rag_fast ({impl})", m,
                     {"GB/s": gb / (m.median_ms / 1e3), "same candidates": same})
        add_ratio(row, "speedup", base, m)
        rows.append(row)
    return rows


TOKEN, SEQUENCE = "RAG-Token beam search", "RAG-Sequence thorough"


def _generation_rows(ctx: Context, label: str, dims: tuple, sizes: dict,
                     rate: float | None = None) -> list[Row]:
    """Rows of the cases in ``sizes`` ({case: (B, new tokens)}) on one generator; with
    ``rate`` (the GEMM rate, GFLOP/s), each row's GEMM floor (see the module docstring)."""
    from rag_fast.generation import rag_sequence_generate, rag_token_generate

    K, W = K_DOCS, BEAMS
    if label in CAUSAL_GENERATORS:
        return _causal_rows(ctx, label, sizes, rate)
    token, sequence = _models(*dims, n_docs=K, init_std=INIT_STD)
    # One warm-up run per provider is done below, by hand (it also checks the ids).
    gen_ctx = dataclasses.replace(ctx, warmup=0, repeats=max(GEN_REPEATS, 5))
    rows = []
    for what, (B, new) in sizes.items():
        ids, mask, scores = _inputs(B, K, CONTEXT_LEN)
        counts = distinct_beams(token.rag.generator, ids, B, K, W, new)
        check_exercised(counts, W, f"{label} generator, {what}")
        rows += _case_rows(gen_ctx, f"{what}, {label} generator, B={B} K={K} beams={W} new={new}",
                           token if what == TOKEN else sequence,
                           rag_token_generate if what == TOKEN else rag_sequence_generate,
                           ids, mask, scores, B, new, counts, rate)
    return rows


def _causal_rows(ctx: Context, label: str, sizes: dict, rate: float | None) -> list[Row]:
    """rag_fast's decoding over a decoder-only generator (``causal_generate``), timed alone:
    transformers has no RAG for one. Each row's ids are the same in every run."""
    from rag_fast.generation.causal import causal_generate

    K, W = K_DOCS, BEAMS
    generator = _causal_generator(label, INIT_STD)
    gen_ctx = dataclasses.replace(ctx, warmup=0, repeats=max(GEN_REPEATS, 5))
    rows = []
    for what, (B, new) in sizes.items():
        ids, mask, scores = _inputs(B, K, CONTEXT_LEN, _causal_vocab(label))
        counts = distinct_beams(generator, ids, B, K, W, new)
        check_exercised(counts, W, f"{label} generator, {what}")
        mode = "token" if what == TOKEN else "sequence"

        def ours(mode=mode, ids=ids, mask=mask, scores=scores, new=new):
            return causal_generate(generator, ids, mask, scores, mode=mode, num_beams=W,
                                   max_new_tokens=new, min_new_tokens=new)

        with torch.no_grad():
            reference = ours()  # the warm-up run; every timed run must repeat its ids
        outputs: list[torch.Tensor] = []

        def call(ours=ours, outputs=outputs):
            with torch.no_grad():
                outputs.append(ours())

        m = measure_interleaved({"rag_fast": call}, gen_ctx, memory=False)["rag_fast"]
        same = len(outputs) == m.runs and all(torch.equal(o, reference) for o in outputs)
        row = Row.of(NAME, f"{what}, {label} generator, B={B} K={K} beams={W} new={new}",
                     "rag_fast", m, {"tokens/s": B * new / (m.median_ms / 1e3),
                                     "same ids": same, **counts})
        if rate is not None:
            with torch.no_grad():
                gflop = step_gflop(ours)
            floor = GemmFloor({"rag_fast": gflop}, rate)
            row.extra.update({"GFLOP": round(gflop, 2), "GEMM GFLOP/s": round(rate, 1),
                              "GEMM floor ms": round(floor.ms, 2),
                              "x GEMM floor": m.median_ms / floor.ms})
        rows.append(row)
    return rows


def _case_rows(gen_ctx: Context, case: str, model, ours_generate, ids, mask, scores, B: int,
               new: int, counts: dict, rate: float | None = None) -> list[Row]:
    settings = dict(num_beams=BEAMS, max_length=new + 1, min_length=new + 1)

    def hf(**extra):
        return lambda: model.generate(context_input_ids=ids, context_attention_mask=mask,
                                      doc_scores=scores, **settings, **extra)

    hf_default, hf_static = hf(), hf(cache_implementation="static")

    def ours():
        return ours_generate(model, ids, mask, scores, **settings)

    # The warm-up runs, one per provider: transformers' ids are the reference, and its
    # static cache is timed only when it returns them.
    with torch.no_grad():
        reference = hf_default()
        static_ok = bool(torch.equal(hf_static(), reference))
        ours()
    fns = {"transformers": hf_default}
    if static_ok:
        fns["transformers (static cache)"] = hf_static
    fns["rag_fast"] = ours
    outputs: dict[str, list[torch.Tensor]] = {name: [] for name in fns}

    def recorder(name, fn):
        def call():
            with torch.no_grad():
                outputs[name].append(fn())
        return call

    ms = measure_interleaved({n: recorder(n, f) for n, f in fns.items()}, gen_ctx,
                             memory=False)
    floor = None
    if rate is not None:  # one untimed call each (the static cache runs the default's products)
        with torch.no_grad():
            floor = GemmFloor({"transformers": step_gflop(hf_default),
                               "rag_fast": step_gflop(ours)}, rate)
    tokens = B * new
    common = {**counts, "static cache same ids": static_ok}
    rows = []
    for name, m in ms.items():
        same = len(outputs[name]) == m.runs and all(
            torch.equal(o, reference) for o in outputs[name])
        row = Row.of(NAME, case, name, m,
                     {"tokens/s": tokens / (m.median_ms / 1e3), "same ids": same, **common})
        add_ratio(row, "x transformers", ms["transformers"], m)
        if static_ok:
            add_ratio(row, "x static cache", ms["transformers (static cache)"], m)
        if floor is not None:
            gflop = floor.gflop["transformers" if name.startswith("transformers") else name]
            row.extra.update({"GFLOP": round(gflop, 2), "GEMM GFLOP/s": round(floor.rate, 1),
                              "GEMM floor ms": round(floor.ms, 2),
                              "x GEMM floor": m.median_ms / floor.ms})
        rows.append(row)
    return rows


def run(ctx: Context) -> list[Row]:
    rows = _beam_step_rows(ctx, 8, BEAMS, K_DOCS, reference=not ctx.quick)
    sizes = QUICK_SIZES if ctx.quick else FULL_SIZES
    rate = gemm_rate(ctx.device)  # GFLOP/s, for every case's GEMM floor
    for label, cases in sizes.items():
        rows += _generation_rows(ctx, label, GENERATORS[label], cases, rate)
    return rows


# docs/benchmarks.md -----------------------------------------------------------------------

def _ratio(row: dict, key: str) -> str:
    if key not in row["extra"]:
        return "-"
    mark = " (noisy)" if key in row.get("noisy", []) else ""
    return f"{row['extra'][key]:.2f}x{mark}"


def _floor_cell(ours: dict, base: dict | None) -> str:
    """rag_fast's and transformers' times over the case's GEMM floor (``-`` in a file that
    predates it)."""
    if "x GEMM floor" not in ours["extra"]:
        return "-"
    theirs = "" if base is None else f" / {base['extra']['x GEMM floor']:.2f}x"
    e = ours["extra"]
    return f"{e['x GEMM floor']:.2f}x{theirs} ({e['GEMM floor ms']:,.0f} ms)"


def _causal_words(rows: list[dict]) -> str:
    """The caption's sentence on the decoder-only rows; nothing for a file without them."""
    if not any(label in r["case"] for r in rows for label in CAUSAL_GENERATORS):
        return ""
    return (" Decoder-only rows: a Qwen2-shaped generator (d 896, 14 heads with 2 key/value "
            "heads, FFN 4864, V 151,936, 2 layers) continuing prompts of 64 tokens, decoded by "
            "rag_fast alone (`causal_generate`; transformers has no RAG over a decoder-only "
            "generator), weights drawn as above and checked the same way (by transformers' "
            "beam search continuing each prompt); \"same every run\": every timed run "
            "returned the warm-up run's ids.")


def _floor_words(rows: list[dict]) -> str:
    """The caption's sentence on the GEMM floor; nothing for a file that predates it."""
    measured = [r for r in rows if "GEMM floor ms" in r["extra"]]
    if not measured:
        return ""
    return (" x GEMM floor: each provider's time over the case's least matrix-product work "
            "(`torch.utils.flop_counter`, matmuls and attention, one untimed `generate` per "
            "provider; rag_fast's is the least in every case) at the rate of a "
            f"{GEMM_N}x{GEMM_N} fp32 matmul measured in the same run "
            f"({measured[0]['extra']['GEMM GFLOP/s']:,.0f} GFLOP/s, the fastest of "
            f"{GEMM_CALLS}), rag_fast / transformers, with the floor in ms; where the time "
            "above the floor goes: [the decoding profile](#where-a-decodings-time-goes).")



def render(results: dict, source: str) -> str:
    """The full decoding section of docs/benchmarks.md: a caption (what, how, where) and one table."""
    rows = [r for r in results["rows"] if r["bench"] == NAME]
    if not rows:
        raise ValueError(f"render: {source} has no '{NAME}' rows")
    m = results["machine"]
    machine = machine_words(m)
    lines = [
        "| case | rag_fast ms (spread) | transformers ms (spread) | static cache ms | "
        "vs `generate` | vs static cache | x GEMM floor | same ids "
        "| distinct top beams / hypotheses |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    cases = list(dict.fromkeys(r["case"] for r in rows))
    for case in cases:
        by = {r["provider"]: r for r in rows if r["case"] == case}
        base = by.get("transformers")
        if case.startswith("beam step"):
            for name, r in by.items():
                if name == "transformers":
                    continue
                lines.append(
                    f"| {case}, {name} | {r['median_ms']:.2f} ({spread_cell(r)}) "
                    f"| {base['median_ms']:.2f} ({spread_cell(base)}) | - | {_ratio(r, 'speedup')} "
                    f"| - | - | {'yes' if r['extra'].get('same candidates') else 'NO'} | - |")
            continue
        ours = by["rag_fast"]
        if base is None:  # a decoder-only generator: transformers has no RAG for it
            e = ours["extra"]
            lines.append(
                f"| {case} | {ours['median_ms']:.0f} ({spread_cell(ours)}) | no RAG in "
                f"transformers | - | - | - | {_floor_cell(ours, None)} "
                f"| {'same every run' if e.get('same ids') else 'NO'} "
                f"| {e['distinct top beams']} / {e['distinct hypotheses']} |")
            continue
        static = by.get("transformers (static cache)")
        e = ours["extra"]
        static_ms = (f"{static['median_ms']:.0f} ({spread_cell(static)})" if static
                     else "ids differ: not timed")
        same = all(r["extra"].get("same ids") for r in by.values())
        lines.append(
            f"| {case} | {ours['median_ms']:.0f} ({spread_cell(ours)}) "
            f"| {base['median_ms']:.0f} ({spread_cell(base)}) | {static_ms} "
            f"| {_ratio(ours, 'x transformers')} | {_ratio(ours, 'x static cache')} "
            f"| {_floor_cell(ours, base)} | {'yes, every run' if same else 'NO'} "
            f"| {e['distinct top beams']} / {e['distinct hypotheses']} |")
    noisy = [r for r in rows if r.get("noisy")]
    caption = (
        f"Measured by `{run_command(results.get('args') or {})}` on {machine} "
        f"(`{source_path(source)}`). K={K_DOCS} passages of {CONTEXT_LEN} tokens, "
        f"{BEAMS} beams, V={VOCAB}, min = max new tokens, B questions as each case says: "
        "8 questions and 20 new tokens except RAG-Sequence on the BART-base-sized generator "
        "(2 and 12: transformers' RAG-Sequence re-encodes every passage for every distinct "
        "hypothesis); small generator: d_model 256, 2+2 layers; BART-base-sized: 768, 6+6 "
        "layers, 12 heads. Generator weights drawn with std "
        f"{INIT_STD} so that passages lead to different beams (checked: the last column is the "
        "fewest distinct top beams among a question's 5 passages and distinct hypotheses among "
        "its 20, by transformers' own per-passage beam search). Medians of "
        f"{GEN_REPEATS} timed runs after {GEN_WARMUP} warm-up, providers interleaved, with "
        f"{allocator_caption(rows)}; spread = "
        "(max - min) / median; \"same ids\": every timed run returned transformers' ids. "
        "Baselines: transformers' `generate` (dynamic cache) and with "
        "`cache_implementation=\"static\"` where it keeps transformers' ids (RAG-Sequence; "
        "RAG-Token's `generate` accepts it, but its cache reordering turns the static cache "
        "into a dynamic one that keeps the empty slots, and the ids change). The beam step "
        "alone: logits [B*W*K, V] of B=8, W=4, K=5 against transformers' "
        "`RagTokenForGeneration.marginalize`, `log_softmax` and `_get_top_k_continuations`."
        + _floor_words(rows) + _causal_words(rows)
    )
    if noisy:
        caption += (" A ratio marked (noisy) comes from runs whose spread exceeds 20% or whose "
                    "ranges overlap: " + "; ".join(
                        f"{r['case']} / {r['provider']}: {noisy_note(r['noisy'])}"
                        for r in noisy) + ".")
    return caption + "\n\n" + "\n".join(lines)
