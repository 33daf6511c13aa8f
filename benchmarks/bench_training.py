"""One RAG training step (forward + backward + AdamW step): rag_fast's RagModel vs transformers,
eager and compiled.

Every provider drives the very same generator (identical weights), the same B*K contexts,
the same passage scores (a leaf with gradient, as the question encoder's output would be) and
the same labels, with the same optimizer (fused AdamW, the default of transformers' Trainer and
of rag_fast's); only the loss path differs. Providers:

- ``transformers``: ``RagTokenForGeneration`` / ``RagSequenceForGeneration``'s forward, eager;
- ``transformers compiled``: the same forward and loss under ``torch.compile`` (default mode;
  the function compiled is the step's loss, so the backward is compiled too); its compile time
  (the first steps until steady, beyond a steady step) is reported in ``compile s`` and not in
  its step time (inductor's on-disk cache left as a user would have it: a repeated run
  compiles faster). ``--quick`` leaves it out (compiling takes minutes on 2 cores), and the fresh-process memory
  measurement too;
- ``rag_fast``: ``RagModel(lm_head_loss="fused")`` over the same generator (with its default
  ``lean_activations=True``, see ``rag_fast/models/_lean.py``): the LM head and the RAG loss
  as one op that computes the logits a vocabulary tile at a time and never holds
  them (``rag_fast.linear_rag_nll``);
- ``rag_fast materialized``: ``RagModel(lm_head_loss="materialized")``: the logits of the
  positions that have a target, once, into a buffer it reuses from step to step (in L2-sized
  vocabulary chunks), the fused loss writing their gradient in place.
  Both add the gradients of tied input embeddings into the LM head's ``[V, d]`` gradient in
  place, at the end of the backward pass.
- ``rag_fast compiled``: ``RagModel.compile()`` over the same generator, its default path
  (``"auto"``): the generator and the loss under ``torch.compile`` (default mode), rag_fast's
  LM-head and loss ops inside the graph as custom ops (the materialized path as
  ``linear_rag_nll(keep_logits=True)``); compile time measured as the baseline's, in its own
  ``compile s``. :func:`render` shows, per case, the path
  ``RagModel``'s default (``"auto"``) takes there (:func:`default_path`) and the other one;
  in the rows (the table ``run.py`` prints) their ``LM-head path`` column names the path each
  ran and marks the default's. ``--quick`` times only the default's path
  (:func:`quick_providers`: materialized at every ``--quick`` shape).

Time (:func:`time_case`): each provider alone in fresh processes (:func:`time_provider`), so
that no provider's allocations shape another's (glibc's heap, the CPU buffer pool, inductor's
buffers), with glibc's allocator as it is by default, as in a user's training process and as
every bench times (``RAG_FAST_BENCH_TIME_ALLOCATOR=fixed`` times them with the memory
measurement's fixed 1 MiB mmap threshold instead, under which every large temporary is fresh
pages the kernel zeroes); each row records the setting of its timing processes
(``extra["allocator"]``, as ``run.py`` records the harness's for the other benches).
``ROUNDS`` rounds in which the providers take turns, each process ``WARMUP_STEPS`` warm-up
steps then ``STEPS_PER_PROCESS`` timed ones (6 timed steps per provider), so that a machine
whose speed drifts slows every provider alike (``--quick``: ``QUICK_ROUNDS`` round of
``QUICK_STEPS`` timed steps, one process per provider; each row records its rounds, steps and
warm-up steps). Three warm-up steps, because a fresh process's allocations take that long to
settle: measured on the BART-base-sized case, `transformers`
eager's steps 2 and 3 still took 5.8 and 4.9 s (656K and 412K minor page faults) against
3.8 s (450K) from step 5 on, and in one process rag_fast's second step paid 1.4 s of system
time against 0.3-0.9 s in its later steps; with one warm-up step, a process's first timed step
was its slowest. Ratios ``speedup vs eager`` / ``speedup vs compiled`` are
flagged noisy as :func:`harness.add_ratio` flags them. Each row also has the median minor page
faults and system CPU seconds of its timed steps (``page faults/step``, ``system s/step``).
Denormal floats are flushed to zero in the timing processes (``torch.set_flush_denormal``): the
random decoder-only model's training reaches them after a few steps, and each of its steps then
took 4x to 40x longer, for every provider.

Memory (``benchmarks/memory.py``): each provider in its own fresh process (glibc's mmap
threshold fixed at 1 MiB there, for memory only) builds its model and optimizer, runs one warm
step whose gradients it keeps (``zero_grad(set_to_none=False)``), then one measured step.
``peak MB`` is the whole-step peak: the step's peak resident set above the bare process's before
the model existed (parameters + gradients + optimizer state + the step's temporaries and buffers);
``step extra MB`` is the peak above the resident set after the warm step; ``memory vs eager`` is
the whole-step peak's ratio to transformers eager's.

Cases: a small generator (d_model 256, 2+2 layers, V=50265) and a BART-base-sized one
(d_model 768, 6+6 layers); B=4, K=5, 64 context tokens, 32 target tokens. ``--quick``: only the
small generator, 16 target tokens, no compiled baseline.

:func:`render` turns a results file of this bench into the full training section of docs/benchmarks.md.
"""
from __future__ import annotations

import dataclasses
import resource
import statistics

import torch

from harness import (ALLOCATOR_ENV, ALLOCATOR_WORDS, Context, Measurement, Row, add_ratio,
                     allocator_setting, machine_words, run_command, runs_counted, source_path,
                     spread_cell)

NAME = "training"
EAGER, COMPILED, OURS = "transformers", "transformers compiled", "rag_fast"
OURS_MATERIALIZED = "rag_fast materialized"
OURS_COMPILED = "rag_fast compiled"
PROVIDERS = (EAGER, COMPILED, OURS, OURS_MATERIALIZED, OURS_COMPILED)
COMPILED_PROVIDERS = (COMPILED, OURS_COMPILED)  # compile time measured, no FLOP count
# timed steps per provider: ROUNDS fresh processes each, STEPS_PER_PROCESS after WARMUP_STEPS
ROUNDS, STEPS_PER_PROCESS, WARMUP_STEPS = 2, 3, 3
QUICK_ROUNDS, QUICK_STEPS = 1, 5  # --quick: one process per provider (each pays the imports)
GEMM_N, GEMM_CALLS = 4096, 5  # the square fp32 matmul whose best rate sets the GEMM floor

B, K, CONTEXT, TARGET, VOCAB = 4, 5, 64, 32, 50265

SIZES = {
    "small": dict(d_model=256, layers=2, heads=4, ffn=1024),
    "bart-base": dict(d_model=768, layers=6, heads=12, ffn=3072),
    # decoder-only: Qwen2-0.5B's width, heads, FFN and vocabulary, with 2 of its 24 layers
    "qwen2-0.5b-2l": dict(d_model=896, layers=2, heads=14, kv_heads=2, ffn=4864, vocab=151936,
                          causal=True),
    "causal-small": dict(d_model=128, layers=1, heads=4, kv_heads=2, ffn=512, vocab=32000,
                         causal=True),
}
CAUSAL_B, CAUSAL_TARGET = 2, 32  # decoder-only case: questions, answer tokens (16 in --quick)
# the allocator the timing processes run with: "default" (as a user's process) unless this
# variable says "fixed" (the memory measurement's setting, to see what it costs in time)
TIME_ALLOCATOR_ENV = "RAG_FAST_BENCH_TIME_ALLOCATOR"
QUICK_SIZES, FULL_SIZES = ("small", "causal-small"), ("small", "bart-base", "qwen2-0.5b-2l")
SIZE_WORDS = {"small": "small (d 256, 2+2 layers)", "bart-base": "BART-base-sized (d 768, 6+6 layers)",
              "qwen2-0.5b-2l": "decoder-only, Qwen2-0.5B-shaped (d 896, V 151936, 2 of 24 layers)",
              "causal-small": "decoder-only, small (d 128, V 32000, 1 layer)"}
# what the memory processes import before reading the bare resident set: the libraries, no model
IMPORTS = ("transformers", "transformers.models.rag.modeling_rag", "rag_fast.models")


def _hf_model(mode: str, size: dict):
    from transformers import (BartConfig, DPRConfig, RagConfig, RagSequenceForGeneration,
                              RagTokenForGeneration)

    question = DPRConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1,
                         num_attention_heads=2, intermediate_size=64)
    generator = BartConfig(
        vocab_size=VOCAB, d_model=size["d_model"], encoder_layers=size["layers"],
        decoder_layers=size["layers"], encoder_attention_heads=size["heads"],
        decoder_attention_heads=size["heads"], encoder_ffn_dim=size["ffn"],
        decoder_ffn_dim=size["ffn"], max_position_embeddings=128, pad_token_id=1,
        bos_token_id=0, eos_token_id=2, decoder_start_token_id=2, forced_bos_token_id=None,
        forced_eos_token_id=None)
    config = RagConfig.from_question_encoder_generator_configs(question, generator, n_docs=K)
    cls = RagTokenForGeneration if mode == "token" else RagSequenceForGeneration
    torch.manual_seed(0)
    return cls(config).train()


def _inputs(target: int):
    g = torch.Generator().manual_seed(0)
    contexts = torch.randint(3, VOCAB, (B * K, CONTEXT), generator=g)
    labels = torch.randint(3, VOCAB, (B, target), generator=g)
    labels[:, 0] = 0  # BOS
    scores = torch.randn(B, K, generator=g)
    return contexts, torch.ones_like(contexts), labels, scores


def _losses(hf, providers, target: int, device: str) -> dict:
    """provider -> ``loss(scores_leaf)`` over ``hf``'s generator."""
    contexts, mask, labels, _ = (t.to(device) for t in _inputs(target))

    def eager(s):
        return hf(context_input_ids=contexts, context_attention_mask=mask, doc_scores=s,
                  labels=labels).loss.mean()

    def ours(lm_head_loss: str, compiled: bool = False):
        from rag_fast.models import RagModel

        # the same generator module: identical weights
        m = RagModel.from_transformers(hf, lm_head_loss=lm_head_loss)
        if compiled:
            m.compile()
        return lambda s: m(labels, context_input_ids=contexts, context_attention_mask=mask,
                           doc_scores=s).loss

    return _provider_losses(providers, eager, ours)


def _provider_losses(providers, eager, ours) -> dict:
    """provider -> loss function: ``eager`` (the baseline), ``torch.compile(eager)``, or
    ``ours(lm_head_loss, compiled)`` for rag_fast's fused and materialized LM-head paths and
    for ``RagModel.compile()`` (its default path, ``"auto"``)."""
    out = {}
    for p in providers:
        if p == EAGER:
            out[p] = eager
        elif p == COMPILED:
            out[p] = torch.compile(eager)
        elif p in (OURS, OURS_MATERIALIZED):
            out[p] = ours("fused" if p == OURS else "materialized")
        elif p == OURS_COMPILED:
            out[p] = ours("auto", compiled=True)
        else:
            raise ValueError(f"provider must be one of {PROVIDERS}, got {p!r}")
    return out


def _causal_model(size: dict):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=size["vocab"], hidden_size=size["d_model"], num_hidden_layers=size["layers"],
        num_attention_heads=size["heads"], num_key_value_heads=size["kv_heads"],
        intermediate_size=size["ffn"], max_position_embeddings=256, tie_word_embeddings=True,
        pad_token_id=1, bos_token_id=0, eos_token_id=2)
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config).train()


def _causal_inputs(vocab: int, target: int):
    """Left-padded prompts ``[B*K, CONTEXT]`` of different lengths, answers ``[B, target]``."""
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, vocab, (CAUSAL_B * K, CONTEXT), generator=g)
    mask = torch.ones_like(prompts)
    for row in range(CAUSAL_B * K):  # prompts of 48 to 64 tokens
        pad = int(torch.randint(0, 17, (1,), generator=g))
        prompts[row, :pad], mask[row, :pad] = 1, 0
    answers = torch.randint(3, vocab, (CAUSAL_B, target), generator=g)
    answers[:, -2:] = 1  # padding
    return prompts, mask, answers


def materialized_rag_loss(logits, scores, answers, mode: str, pad: int):
    """The RAG loss the way ``transformers``' RAG models compute it (``get_nll`` of
    ``RagTokenForGeneration`` / ``RagSequenceForGeneration``, no smoothing), over answer logits
    ``[B*K, T, V]`` of a decoder-only generator: ``log_softmax`` over the vocabulary, the
    passage log-prior added, ``logsumexp`` over the passages per token (RAG-Token) or of the
    summed sequence log-likelihood (RAG-Sequence)."""
    Bq, Kq = scores.shape
    lp = torch.log_softmax(logits.float(), dim=-1).view(Bq, Kq, logits.shape[1], -1)
    prior = torch.log_softmax(scores.float(), dim=1)[:, :, None]  # [B, K, 1]
    target = answers[:, None, :, None].expand(Bq, Kq, answers.shape[1], 1)
    tok = lp.gather(-1, target).squeeze(-1)  # [B, K, T]
    keep = (answers != pad)[:, None, :]
    if mode == "token":
        marginal = torch.logsumexp(prior + tok, dim=1)  # [B, T]
        return -(marginal * keep[:, 0]).sum(1).mean()
    return -torch.logsumexp(prior[..., 0] + (tok * keep).sum(-1), dim=1).mean()


def _causal_losses(gen, mode: str, providers, target: int, device: str) -> dict:
    """provider -> ``loss(scores_leaf)`` over the decoder-only ``gen``. The baseline runs the
    generator's own forward (``logits_to_keep``: the LM head on the answer positions only, the
    cheapest way ``transformers`` offers) and :func:`materialized_rag_loss`."""
    from rag_fast.generation.causal import position_ids

    prompts, mask, answers = (t.to(device) for t in _causal_inputs(gen.config.vocab_size,
                                                                    target))
    T = answers.shape[1]
    ids = torch.cat([prompts, answers.repeat_interleave(K, 0)[:, :-1]], 1)
    full_mask = torch.cat([mask, mask.new_ones(mask.shape[0], T - 1)], 1)
    positions = position_ids(full_mask)

    def eager(s):
        logits = gen(input_ids=ids, attention_mask=full_mask, position_ids=positions,
                     use_cache=False, logits_to_keep=T).logits
        return materialized_rag_loss(logits, s, answers, mode, pad=1)

    def ours(lm_head_loss: str, compiled: bool = False):
        from rag_fast.models import RagModel

        m = RagModel(gen, mode=mode, n_docs=K, lm_head_loss=lm_head_loss)
        if compiled:
            m.compile()
        return lambda s: m(answers, context_input_ids=prompts, context_attention_mask=mask,
                           doc_scores=s).loss

    return _provider_losses(providers, eager, ours)


def _check_same_loss(losses: dict, params, size_name: str, mode: str, device: str) -> None:
    """Every provider's loss equals the baseline's (one forward each, dropout off)."""
    scores = _inputs(1)[3][:CAUSAL_B].to(device)
    with torch.no_grad():
        values = {p: float(f(scores)) for p, f in losses.items()
                  if p not in COMPILED_PROVIDERS}
    want = values[EAGER]
    for p, v in values.items():
        if abs(v - want) > 1e-3 * max(1.0, abs(want)):
            raise AssertionError(f"{size_name} {mode}: {p} loss {v} differs from the "
                                 f"baseline's {want}")


def gemm_rate(device: str, n: int = GEMM_N, calls: int = GEMM_CALLS) -> float:
    """GFLOP/s of the fastest of ``calls`` ``n x n`` fp32 matmuls after a warm-up one: the best
    rate torch's BLAS reaches on this machine (a step's smaller products run no faster)."""
    import time

    g = torch.Generator().manual_seed(0)
    a, b = (torch.randn(n, n, generator=g).to(device) for _ in range(2))
    out = torch.empty(n, n, device=device)
    best = float("inf")
    for i in range(calls + 1):
        _sync(device)
        start = time.perf_counter()
        torch.mm(a, b, out=out)
        _sync(device)
        if i:
            best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best / 1e9


def step_gflop(step) -> float:
    """Matrix-product GFLOP of one call of ``step`` (``torch.utils.flop_counter``: matmuls and
    attention, plus the in-place ``addmm_`` / ``baddbmm_`` it leaves out, which rag_fast's LM
    head accumulates with), the call itself run once more."""
    from torch.utils import flop_counter

    def addmm_(self_shape, a, b, *args, out_shape=None, **kwargs):  # [m, k] x [k, n]
        return 2 * a[0] * a[1] * b[1]

    def baddbmm_(self_shape, a, b, *args, out_shape=None, **kwargs):  # [B, m, k] x [B, k, n]
        return 2 * a[0] * a[1] * a[2] * b[2]

    inplace = {torch.ops.aten.addmm_: addmm_, torch.ops.aten.baddbmm_: baddbmm_}
    with flop_counter.FlopCounterMode(display=False, custom_mapping=inplace) as counter:
        step()
    return counter.get_total_flops() / 1e9


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _step(loss, params, device: str, keep_grads: bool, batch: int = B):
    scores_leaf = _inputs(1)[3][:batch].to(device).requires_grad_()
    # fused AdamW on every side: transformers' Trainer default (torch >= 2.8), and rag_fast's
    opt = torch.optim.AdamW(list(params) + [scores_leaf], lr=1e-5, fused=True)

    def step():
        opt.zero_grad(set_to_none=not keep_grads)
        value = loss(scores_leaf)
        value.backward()
        opt.step()
        return float(value.detach())

    return step


def _provider_step(mode: str, size_name: str, target: int, provider: str, device: str,
                   keep_grads: bool):
    """``step()`` of one provider over a model built in this process (only this provider's)."""
    if SIZES[size_name].get("causal"):
        gen = _causal_model(SIZES[size_name]).to(device)
        loss = _causal_losses(gen, mode, [provider], target, device)[provider]
        return _step(loss, gen.parameters(), device, keep_grads=keep_grads, batch=CAUSAL_B)
    hf = _hf_model(mode, SIZES[size_name]).to(device)
    loss = _losses(hf, [provider], target, device)[provider]
    return _step(loss, hf.rag.generator.parameters(), device, keep_grads=keep_grads)


def memory_step(mode: str, size_name: str, target: int, provider: str, device: str = "cpu"):
    """The step whose memory ``benchmarks/memory.py`` measures in a fresh process: only this
    provider's model and optimizer exist, and its gradients stay between steps."""
    return _provider_step(mode, size_name, target, provider, device, keep_grads=True)


def time_provider(mode: str, size_name: str, target: int, provider: str, device: str,
                  steps: int, warmup: int, count_flops: bool) -> dict:
    """One provider's steps, timed in a fresh process (:func:`run` calls it through
    ``memory.call_fresh``, with glibc's allocator as it is by default): its matmul work (one
    untimed step, when ``count_flops``; never for compiled code), the compiled baseline's compile
    time, then ``warmup`` and ``steps`` timed steps. Returns JSON values: ``{"times_ms": [...],
    "gflop": GFLOP or None, "compile_s": s or None, "allocator": the harness's setting in this
    process, "faults": [minor page faults of each timed step], "system_s": [system CPU s of
    each]}``."""
    import harness

    # a randomly initialised decoder-only model's training reaches denormal floats after about
    # 5 steps, and arithmetic on them is slow (its step went 2.1 s -> 88 s by the 8th); flushed
    # to zero in every timing process alike
    torch.set_flush_denormal(True)
    step = _provider_step(mode, size_name, target, provider, device, keep_grads=False)
    gflop = step_gflop(step) if count_flops and provider not in COMPILED_PROVIDERS else None
    compile_s = None
    if provider in COMPILED_PROVIDERS:
        from bench_losses import compile_seconds

        torch._dynamo.reset()
        compile_s = compile_seconds(step, device)  # until its calls are steady
    usage = []  # (minor page faults, system CPU s) of each call
    m = harness.measure(_counted(step, usage),
                        Context(device=device, quick=False, repeats=steps, warmup=warmup),
                        memory=False)
    timed = usage[warmup:]
    return {"times_ms": m.times_ms, "gflop": gflop, "compile_s": compile_s,
            "allocator": harness.ALLOCATOR, "faults": [f for f, _ in timed],
            "system_s": [s for _, s in timed]}


def check_case(mode: str, size_name: str, target: int, providers: list[str], device: str) -> bool:
    """Every (uncompiled) provider's loss of a decoder-only case equals the baseline's
    (:func:`_check_same_loss`, raising if not); run in a fresh process of its own."""
    gen = _causal_model(SIZES[size_name]).to(device)
    eager = [p for p in providers if p not in COMPILED_PROVIDERS]
    losses = _causal_losses(gen, mode, eager, target, device)
    _check_same_loss(losses, list(gen.parameters()), size_name, mode, device)
    return True


def _counted(fn, into: list):
    """``fn`` that appends each call's minor page faults and system CPU seconds to ``into``."""
    def call():
        before = resource.getrusage(resource.RUSAGE_SELF)
        out = fn()
        after = resource.getrusage(resource.RUSAGE_SELF)
        into.append((after.ru_minflt - before.ru_minflt, after.ru_stime - before.ru_stime))
        return out
    return call


def time_case(mode: str, size_name: str, target: int, providers: list[str], device: str,
              allocator: str = "default", rounds: int = ROUNDS,
              steps: int = STEPS_PER_PROCESS, warmup: int = WARMUP_STEPS) -> dict:
    """Each provider timed in fresh processes (:func:`time_provider`), ``rounds`` rounds in
    which the providers take turns, ``steps`` timed steps after ``warmup`` untimed ones per
    process.
    Returns ``{"times_ms": {provider: [...]}, "gflop": {provider: GFLOP}, "compile_s":
    {compiled provider: its first round's}, "allocator": the processes' setting, "faults":
    {provider: median per timed step}, "system_s": {provider: median}}``."""
    import memory

    times = {p: [] for p in providers}
    faults = {p: [] for p in providers}
    system = {p: [] for p in providers}
    gflop, compile_s, seen = {}, {}, set()
    for r in range(rounds):
        for p in providers:
            got = memory.call_fresh(
                f"{__name__}:time_provider", mode, size_name, target, p, device, steps, warmup,
                r == 0,
                env={ALLOCATOR_ENV: allocator}, timeout=3600,
                label=f"training {size_name} {mode} {p} (round {r + 1})")
            times[p] += got["times_ms"]
            faults[p] += got["faults"]
            system[p] += got["system_s"]
            seen.add(got["allocator"])
            if got["gflop"] is not None:
                gflop[p] = got["gflop"]
            if r == 0 and got["compile_s"] is not None:
                compile_s[p] = got["compile_s"]
    if len(seen) != 1:
        raise RuntimeError(f"the timing processes ran with different allocators: {sorted(seen)}")
    return {"times_ms": times, "gflop": gflop, "compile_s": compile_s, "allocator": seen.pop(),
            "faults": {p: statistics.median(v) for p, v in faults.items()},
            "system_s": {p: statistics.median(v) for p, v in system.items()}}


def run(ctx: Context) -> list[Row]:
    import memory

    time_allocator = allocator_setting(TIME_ALLOCATOR_ENV, "default")
    sizes = QUICK_SIZES if ctx.quick else FULL_SIZES
    rows = []
    rate = gemm_rate(ctx.device)  # GFLOP/s, for every case's GEMM floor
    for size_name in sizes:
        causal = SIZES[size_name].get("causal", False)
        for mode in ("token", "sequence"):
            if causal:
                target = CAUSAL_TARGET // 2 if ctx.quick else CAUSAL_TARGET
            else:
                target = TARGET // 2 if ctx.quick else TARGET
            case = f"{size_name} {mode} B={CAUSAL_B if causal else B} K={K} L={CONTEXT} T={target}"
            providers = quick_providers(case) if ctx.quick else list(PROVIDERS)
            if causal:
                memory.call_fresh(f"{__name__}:check_case", mode, size_name, target, providers,
                                  ctx.device, label=f"training {size_name} {mode} loss check")
            rounds, steps = (QUICK_ROUNDS, QUICK_STEPS) if ctx.quick else (ROUNDS, STEPS_PER_PROCESS)
            timed = time_case(mode, size_name, target, providers, ctx.device, time_allocator,
                              rounds=rounds, steps=steps)
            measured = {p: Measurement.of(t) for p, t in timed["times_ms"].items()}
            mem = {p: memory.step_memory(f"{__name__}:memory_step", mode, size_name, target, p,
                                         ctx.device, imports=IMPORTS)
                   for p in providers} if ctx.device == "cpu" and not ctx.quick else {}
            case_rows = _rows(case, measured, mem, timed["compile_s"], CAUSAL_B if causal else B,
                              GemmFloor(timed["gflop"], rate))
            for row in case_rows:
                row.extra["allocator"] = ALLOCATOR_WORDS[timed["allocator"]]
                row.extra["page faults/step"] = round(timed["faults"][row.provider])
                row.extra["system s/step"] = round(timed["system_s"][row.provider], 3)
                row.extra["warm-up steps"] = WARMUP_STEPS
                row.extra["rounds"] = rounds
                row.extra["timed steps/process"] = steps
            rows += case_rows
    return rows


# the LM-head path each rag_fast provider runs (its ``lm_head_loss``)
PATHS = {OURS: "fused", OURS_MATERIALIZED: "materialized"}
# rag_fast's compiled provider runs RagModel's default ("auto") path


def quick_providers(case: str) -> list[str]:
    """What ``--quick`` times at ``case``: `transformers` eager and the rag_fast provider of the
    LM-head path ``RagModel``'s default takes there (``--full`` times both paths and the
    compiled baseline)."""
    ours = next(p for p, path in PATHS.items() if path == default_path(case))
    return [EAGER, ours]


def path_label(case: str, provider: str) -> str | None:
    """The ``LM-head path`` cell of a rag_fast row: the ``lm_head_loss`` it ran, marked when
    it is the one ``RagModel``'s default (``"auto"``) takes at ``case``; None for a baseline."""
    if provider == OURS_COMPILED:
        return default_path(case) + " (RagModel default, compiled)"
    path = PATHS.get(provider)
    if path is None:
        return None
    return path + (" (RagModel default)" if path == default_path(case) else "")


@dataclasses.dataclass(frozen=True)
class GemmFloor:
    """A case's matmul work per provider (GFLOP per step) and the machine's best matmul rate
    (GFLOP/s): the least work over the rate is a time no implementation of the step beats."""

    gflop: dict[str, float]
    rate: float

    @property
    def ms(self) -> float:
        return min(self.gflop.values()) / self.rate * 1e3


def _rows(case: str, measured: dict[str, Measurement], mem: dict, compile_s: dict | None,
          batch: int = B, floor: GemmFloor | None = None) -> list[Row]:
    rows, compile_s = [], compile_s or {}
    base = measured[EAGER]
    for provider, m in measured.items():
        row = Row.of(NAME, case, provider, m, {"examples/s": batch / (m.median_ms / 1e3)})
        label = path_label(case, provider)
        if label is not None:
            row.extra["LM-head path"] = label
        add_ratio(row, "speedup vs eager", base, m)
        if COMPILED in measured:
            add_ratio(row, "speedup vs compiled", measured[COMPILED], m)
        if provider in mem:
            row.peak_mb = mem[provider].whole_step_peak_mb
            row.extra["step extra MB"] = round(mem[provider].step_extra_mb, 1)
            row.extra["memory vs eager"] = row.peak_mb / mem[EAGER].whole_step_peak_mb
            if COMPILED in mem:
                row.extra["memory vs compiled"] = row.peak_mb / mem[COMPILED].whole_step_peak_mb
        if compile_s.get(provider) is not None:
            row.extra["compile s"] = round(compile_s[provider], 1)
        if floor is not None and floor.gflop:
            if provider in floor.gflop:
                row.extra["GFLOP"] = round(floor.gflop[provider], 2)
            row.extra["GEMM GFLOP/s"] = round(floor.rate, 1)
            row.extra["GEMM floor ms"] = round(floor.ms, 1)
            row.extra["x GEMM floor"] = m.median_ms / floor.ms
        rows.append(row)
    return rows


# ---------------------------------------------------------- docs/benchmarks.md section

def _ratio(row: dict | None, key: str) -> str:
    if row is None or row["extra"].get(key) is None:
        return "-"
    return f"{row['extra'][key]:.2f}x" + (" (noisy)" if key in row.get("noisy", []) else "")



def _mb(row: dict | None) -> str:
    return "-" if row is None or row.get("peak_mb") is None else f"{row['peak_mb']:,.0f}"


def default_path(case: str) -> str:
    """``"fused"`` or ``"materialized"``: what ``RagModel(lm_head_loss="auto")`` runs for the
    training step of ``case`` (fp32 logits of its B*K rows, target positions and vocabulary)."""
    from rag_fast.models.options import lm_head_path

    size_name, _, *rest = case.split()
    words = dict(w.split("=") for w in rest)
    size = SIZES.get(size_name, {})
    rows = int(words["B"]) * int(words["K"]) * (
        int(words["T"]) if size.get("causal") else int(words["T"]) - 1)  # seq2seq: labels shift
    return lm_head_path("auto", rows * size.get("vocab", VOCAB) * 4)


def _floor_cell(r: dict, *others: dict | None) -> str:
    """``r``'s time over the GEMM floor, then each of ``others``' (``-`` where not run)."""
    def one(x):
        v = None if x is None else x["extra"].get("x GEMM floor")
        return "-" if v is None else f"{v:.2f}x"

    if r["extra"].get("x GEMM floor") is None:
        return "-"
    return " / ".join(one(x) for x in (r, *others))


def _compiled_cell(row: dict | None) -> str:
    """The ``RagModel.compile()`` column: step ms, its ratios to both baselines, peak MB."""
    if row is None:
        return "not run"
    compiled = row["extra"].get("speedup vs compiled")
    return (f"{row['median_ms']:,.0f} ms: {_ratio(row, 'speedup vs eager')} eager, "
            + (f"{_ratio(row, 'speedup vs compiled')} compiled" if compiled is not None
               else "compiled not run") + f", {_mb(row)} MB")


def _floor_words(rows: list[dict]) -> str:
    """The caption's sentence on the GEMM floor; nothing for a file that predates it."""
    measured = [r for r in rows if r["extra"].get("GEMM floor ms") is not None]
    if not measured:
        return ""
    rate = measured[0]["extra"]["GEMM GFLOP/s"]
    bart = [r for r in measured if r["case"].startswith("bart-base")
            and r["extra"].get("GFLOP") is not None]
    work = (f" (BART-base-sized: {min(r['extra']['GFLOP'] for r in bart):,.0f} GFLOP per step)"
            if bart else "")
    return (" GEMM floor: the least matrix-product work of the providers' steps "
            f"(`torch.utils.flop_counter` with in-place `addmm_` counted, one untimed step "
            f"each){work} at the best rate of "
            f"a {GEMM_N}x{GEMM_N} fp32 matmul in the same run ({rate:,.0f} GFLOP/s, the fastest "
            f"of {GEMM_CALLS}): no implementation of the step runs faster, so a speed-up over "
            "eager cannot exceed eager's time over the floor.")


def _one(rows: list[dict], key: str, default: int) -> int | str:
    """The value every row records under ``key`` (``default`` where none does), or a range."""
    values = sorted({r["extra"].get(key, default) for r in rows})
    return values[0] if len(values) == 1 else f"{values[0]}-{values[-1]}"


def _time_process_words(rows: list[dict]) -> str:
    """How the steps were timed: the caption's clause (files that predate the timing processes:
    the providers alternating in the benchmark's own process). Rows of files from before the
    field ``allocator`` name it ``time allocator``."""
    allocators = {r["extra"].get("allocator", r["extra"].get("time allocator")) for r in rows}
    where = {ALLOCATOR_WORDS["default"]: "glibc's allocator as it is by default, as in a "
                                         "user's training process",
             ALLOCATOR_WORDS["fixed"]: "glibc made to unmap freed blocks of 1 MiB or more"}
    if len(allocators) == 1 and next(iter(allocators)) in where:
        # files that predate these fields ran one warm-up step and ROUNDS x STEPS_PER_PROCESS
        n = _one(rows, "warm-up steps", 1)
        warm = "one warm-up step" if n == 1 else f"{n} warm-up steps"
        rounds = _one(rows, "rounds", ROUNDS)
        steps = _one(rows, "timed steps/process", STEPS_PER_PROCESS)
        turns = (f"{rounds} rounds in which the providers take turns" if rounds != 1 else
                 "one process per provider, the providers taking turns")
        return (f", each provider alone in fresh processes ({turns}, {warm} then {steps} timed "
                f"ones per process) with {where[next(iter(allocators))]}, and denormal floats "
                "flushed to zero (docs/benchmarks.md, \"Time and glibc's allocator\")")
    return " after a warm-up step, the providers' steps alternating in one process"


def render(results: dict, source: str) -> str:
    """The full training section of docs/benchmarks.md from a results file (``source``: its name under
    ``benchmarks/results/``): a caption saying what, how and where, then one line per
    generator and mode with rag_fast's step against both baselines."""
    rows = [r for r in results["rows"] if r["bench"] == NAME]
    by = {(r["case"], r["provider"]): r for r in rows}
    lines = [
        "| generator | mode | `RagModel` default path | step ms | spread "
        "| vs `transformers` eager | vs `torch.compile`d `transformers` "
        "| whole-step peak MB (rag_fast / eager / compiled) | memory vs eager "
        "| memory vs compiled | the other path: vs eager, peak MB "
        "| `RagModel.compile()`: step, vs `transformers` eager and compiled, peak "
        "| time over the GEMM floor (rag_fast / rag_fast compiled / `transformers` compiled / "
        "eager) | compile s (`transformers` / rag_fast) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    case_words = ""
    any_compiled = False
    # a case per rag_fast row of either path (--quick times only the default's)
    for case in dict.fromkeys(r["case"] for r in rows if r["provider"] in PATHS):
        size_name, mode, *rest = case.split()
        if not SIZES.get(size_name, {}).get("causal"):
            case_words = " ".join(rest)  # the encoder-decoder cases' shape, for the caption
        fused, materialized = by.get((case, OURS)), by.get((case, OURS_MATERIALIZED))
        path = default_path(case)
        r = (fused if path == "fused" else materialized) or fused or materialized
        other = materialized if r is fused else fused
        other_name = "materialized" if r is fused else "fused"
        other_cell = ("-" if other is None or other is r else
                      f"{other_name}: {_ratio(other, 'speedup vs eager')}, {_mb(other)}")
        eager, comp = by.get((case, EAGER)), by.get((case, COMPILED))
        ours_compiled = by.get((case, OURS_COMPILED))
        any_compiled |= comp is not None
        compile_s = " / ".join(
            "-" if x is None or x["extra"].get("compile s") is None
            else f"{x['extra']['compile s']:.0f}" for x in (comp, ours_compiled))
        peaks = " / ".join(_mb(x) for x in (r, eager, comp))
        path_word = "fused LM head" if r is fused else "materialized logits"
        lines.append(
            f"| {SIZE_WORDS.get(size_name, size_name)} | RAG-{mode.capitalize()} | {path_word} "
            f"| {r['median_ms']:,.0f} | {spread_cell(r)} | {_ratio(r, 'speedup vs eager')} "
            f"| {_ratio(r, 'speedup vs compiled') if comp else 'not run'} | {peaks} "
            f"| {_ratio(r, 'memory vs eager')} | {_ratio(r, 'memory vs compiled')} "
            f"| {other_cell} | {_compiled_cell(ours_compiled)} "
            f"| {_floor_cell(r, ours_compiled, comp, eager)} | {compile_s} |")
    counted = runs_counted(rows)
    args = results.get("args", {})
    command = run_command(args)
    skipped = "" if any_compiled else (
        " The compiled baseline was not run (quick mode: compiling takes minutes on 2 cores)."
        if args.get("quick") else " The compiled baseline was not run.")
    caption = (
        f"Measured by `{command}` on {machine_words(results['machine'])} "
        f"(`{source_path(source)}`). One training step (forward, backward, fused AdamW "
        f"step), {case_words.replace(' ', ', ')}, V={VOCAB} (encoder-decoder generators): `transformers`' RAG model "
        "(eager, and its loss step under `torch.compile`, default mode, whose compile time is "
        "in the last column and is not in its step time; inductor's on-disk cache as a user's "
        "machine keeps it) vs `RagModel` driving the same generator, "
        "contexts, passage scores and labels (with its default `lean_activations=True`: "
        "activation outputs, gated products, norm outputs and cross-attention keys and values "
        "kept for the backward by recipe, dropout masks as one bit per element, "
        "the same gradients bit for bit), both with the fused LM-head + RAG loss that "
        "never holds the logits (`lm_head_loss=\"fused\"`) and with the logits in a reused "
        "buffer (`\"materialized\"`); the row shows the path `RagModel`'s default "
        "(`\"auto\"`) takes at that shape (fused once the logits would reach 1 GiB), the "
        "column after the memory ratios the other one. `RagModel.compile()`: the same model "
        "(its default path) with the generator and the loss under `torch.compile` (default "
        "mode; rag_fast's ops inside the graph as custom ops), its compile time measured as "
        "the baseline's and not in its step time. Decoder-only "
        "generator (Qwen2 architecture, tied embeddings; B=2, prompts of 48 to 64 tokens, "
        "left-padded): `transformers` has no RAG model for one, so its baseline is the "
        "generator's own forward with `logits_to_keep` (the LM head on the answer positions "
        "only) and the RAG loss over those logits as `transformers`' RAG models compute it "
        "(`log_softmax`, passage prior, `logsumexp` over the passages); every provider's loss "
        "is checked equal to it. "
        f"Times: medians of {counted} timed steps{_time_process_words(rows)}; "
        "spread = (max - min) / median of rag_fast's steps; a ratio marked (noisy) has a side "
        "whose spread exceeds 20% or runs that overlap the other side's. "
        "Memory: each provider alone in a fresh process builds its model and optimizer and runs "
        "one warm step keeping its gradients; the whole-step peak is the peak resident set of "
        "the next step above the bare process's before the model existed (parameters, "
        "gradients, optimizer state and the step's temporaries; glibc made to unmap freed "
        "blocks of 1 MiB or more)." + _floor_words(rows) + skipped
    )
    return caption + "\n\n" + "\n".join(lines)
