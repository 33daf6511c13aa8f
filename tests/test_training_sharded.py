"""Training on a sharded index (issue #14, deliverable 2), 2 gloo processes on the CPU.

* 20 DDP steps (dropout off, gradient accumulation, an evaluation every 10 steps) with the
  index sharded over the ranks reach bitwise the same parameters as the same run where every
  rank holds the whole index: the sharded search returns the same passages in the same order
  and their exact fp16 vectors, so every rank computes the same losses and gradients;
* ``retrieval_s`` / ``step_s`` land in metrics.jsonl, evaluation during training runs on every
  rank (no rank left waiting in a search);
* `rag-fast train` under torchrun with ``"index": {"path": X.staging, "sharded": true}``;
* bad configs (a world size other than the number of shards, a missing shard, a bad preset,
  no process group, bad config values) raise clear errors on every rank, none hangs.

Ranks run in the forkserver launcher of tests/test_retrieval_sharded.py.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from test_retrieval_sharded import run_ranks

from rag_fast.evaluation.data import QAExample
from rag_fast.retrieval import Passage, PassageStore

DIM = 16
NAMES = ["vorin", "suma", "tarek", "olun", "ruzan", "peli", "kaso", "mirel", "duna", "febo",
         "gast", "hiro", "jalo", "lemi"]
CITIES = ["kelta", "brodo", "miru", "zafe"]
N = len(NAMES)


def passages() -> list[Passage]:
    return [Passage(f"p{i}", name, f"{name} lives in {CITIES[i % 4]} .") for i, name in enumerate(NAMES)]


def qa() -> list[QAExample]:
    return [QAExample(f"where does {name} live ?", (CITIES[i % 4],)) for i, name in enumerate(NAMES)]


def word_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    split = pre_tokenizers.Whitespace()
    vocab = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3}
    texts = [f"{p.title} {p.text}" for p in passages()] + [e.question for e in qa()] + ["/ //"]
    for text in texts:
        for word, _ in split.pre_tokenize_str(text):
            vocab.setdefault(word, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = split
    tok.post_processor = processors.TemplateProcessing(single="<s> $A </s>",
                                                       special_tokens=[("<s>", 0), ("</s>", 2)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>", unk_token="<unk>")


def make_model(retriever):
    """A tiny RAG-Token model, the same weights in every process; dropout off."""
    from transformers import BartConfig, BartForConditionalGeneration, BertConfig, BertModel

    from rag_fast.models import RagModel

    tok = word_tokenizer()
    torch.manual_seed(0)
    generator = BartForConditionalGeneration(BartConfig(
        vocab_size=len(tok), d_model=16, encoder_layers=1, decoder_layers=1,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
        decoder_ffn_dim=32, max_position_embeddings=64, pad_token_id=1, bos_token_id=0,
        eos_token_id=2, decoder_start_token_id=2, forced_bos_token_id=None,
        forced_eos_token_id=None, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0))
    question_encoder = BertModel(BertConfig(
        vocab_size=len(tok), hidden_size=DIM, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, pad_token_id=1, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0))
    return RagModel(generator, question_encoder, retriever, mode="token", n_docs=3,
                    generator_tokenizer=tok, question_tokenizer=tok, question_pooling="mean")


def passage_vectors() -> np.ndarray:
    """Random passage vectors, exactly representable in fp16 (what the staging stores)."""
    return np.random.default_rng(0).standard_normal((N, DIM)).astype(np.float16)


def stage(root: Path, world: int, vectors: np.ndarray | None = None) -> Path:
    """The staging directory `rag-fast index build --out X --shard i/world` leaves."""
    from rag_fast.retrieval.encoders import shard_rows

    vectors = passage_vectors() if vectors is None else vectors
    root.mkdir(parents=True)
    (root / "key.json").write_text(json.dumps({"encoder": "random-16"}))
    PassageStore.create(passages(), root / "passages", progress=False)
    for i in range(world):
        lo, hi = shard_rows(len(vectors), (i, world))
        np.save(root / f"embeddings-{i}-of-{world}.npy", vectors[lo:hi])
    return root


# ---- sharded training == whole index on every rank --------------------------------------------
def _train(rank, retriever, out_dir):
    from rag_fast.evaluation import evaluate
    from rag_fast.training import TrainConfig, Trainer, rag_collate, rag_loss

    model = make_model(retriever)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    config = TrainConfig(max_steps=20, micro_batch_size=2, grad_accum=2, lr=1e-2, warmup_steps=2,
                         seed=5, progress=False, log_every=5, eval_every=10, device="cpu",
                         output_dir=str(out_dir), plot_file=None, checkpoint_every=0)
    eval_data = qa()[:5]  # 3 batches of 2, 2, 1 questions: 3 collective searches per eval
    evals = []

    def eval_fn(m):
        metrics = evaluate(m, eval_data, batch_size=2, max_new_tokens=3).metrics
        evals.append(metrics)
        return metrics

    trainer = Trainer(model, qa(), rag_collate(model), rag_loss, config, eval_fn)
    state = trainer.train()
    # steps 10 and 20: on every rank with a collective (sharded) retriever, else on rank 0
    assert state.step == 20
    assert len(evals) == (2 if rank == 0 or trainer.collective_retrieval() else 0)
    return model, before, evals


def _equal_training_worker(rank, world, staging, out):
    from rag_fast.models.retriever_io import TimedRetriever, load_sharded_retriever
    from rag_fast.retrieval import DenseIndex, Retriever

    vectors = np.load(out / "vectors.npy")
    whole = Retriever(DenseIndex.build(vectors, "exact", progress=False),
                      PassageStore.load(staging / "passages"), n_docs=3, progress=False)
    single, single_before, single_evals = _train(rank, TimedRetriever(whole), out / f"single-{rank}")

    sharded = load_sharded_retriever(staging, n_docs=3)
    assert sharded.sharded.shard == (rank, world) and len(sharded.index) == N // world
    model, before, evals = _train(rank, sharded, out / f"sharded-{rank}")

    # the same start, and training moved both the generator and the question encoder
    for name, p in model.named_parameters():
        assert torch.equal(before[name], single_before[name]), name
    moved = [n for n, p in model.named_parameters() if not torch.equal(p.detach(), before[n])]
    assert any(n.startswith("question_encoder.") for n in moved)
    assert any(n.startswith("generator.") for n in moved)
    # bitwise the same parameters after 20 steps: the same passages, vectors and gradients
    single_params = dict(single.named_parameters())
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), single_params[name].detach()), name
    if rank == 0:
        assert evals == single_evals

    # not vacuous: this rank's questions retrieve passages held by the other rank's shard
    with torch.no_grad():
        enc = model.tokenize_questions([e.question for e in qa()])
        q = model.encode_questions(enc["input_ids"], enc["attention_mask"])
    mine = q[rank::world]
    got = sharded.retrieve(mine)
    want = whole.retrieve(mine, n_docs=3)
    assert torch.equal(got.ids, want.ids) and torch.equal(got.doc_embeddings, want.doc_embeddings)
    lo, hi = sharded.sharded.offset, sharded.sharded.offset + len(sharded.index)
    assert bool(((got.ids < lo) | (got.ids >= hi)).any())
    assert sharded.calls > 0 and sharded.retrieval_seconds > 0


@pytest.mark.slow
def test_sharded_training_equals_whole_index(tmp_path):
    staging = stage(tmp_path / "kb.staging", 2)
    np.save(tmp_path / "vectors.npy", passage_vectors())
    run_ranks(2, _equal_training_worker, staging, tmp_path)
    for kind in ("single", "sharded"):
        records = [json.loads(x) for x in (tmp_path / f"{kind}-0" / "metrics.jsonl").read_text().splitlines()]
        steps = [r for r in records if "loss" in r]
        assert [r["step"] for r in steps] == [5, 10, 15, 20]
        assert all(0 < r["retrieval_s"] <= r["step_s"] for r in steps), steps
        assert [r["step"] for r in records if "eval" in r] == [10, 20]
        assert not (tmp_path / f"{kind}-1" / "metrics.jsonl").exists()  # rank 0 writes


# ---- bad configurations: clear errors on every rank -------------------------------------------
def _errors_worker(rank, world, tmp):
    from rag_fast.models.retriever_io import load_sharded_retriever
    from rag_fast.retrieval.sharded import ShardedIndex, ShardedRetriever

    with pytest.raises(ValueError, match=r"index.path: .*three.staging' holds 3 shards "
                       r"\(embeddings-i-of-3.npy\) but this run has 2 processes.*"
                       r"torchrun --nproc-per-node 3"):
        load_sharded_retriever(tmp / "three.staging")
    with pytest.raises(ValueError, match=r"shard 1/2 is missing" if rank == 1
                       else r"rank\(s\) \[1\] could not be opened.*shard 1/2 is missing"):
        load_sharded_retriever(tmp / "holed.staging")
    with pytest.raises(ValueError, match=r"index.path: .*has no key.json: not a staging directory"):
        load_sharded_retriever(tmp / "three.staging" / "passages")
    with pytest.raises(ValueError, match=r"index.path: .*is not a directory"):
        load_sharded_retriever(tmp / "nowhere")
    with pytest.raises(ValueError, match=r"index.preset: .*preset 'no-such-preset'"):
        load_sharded_retriever(tmp / "good.staging", preset="no-such-preset")
    # a store holding only this rank's shard cannot give RagModel its texts
    good = load_sharded_retriever(tmp / "good.staging", n_docs=2)
    local = PassageStore.load(tmp / f"local-{rank}")
    with pytest.raises(ValueError, match=r"store: a ShardedRetriever needs the whole corpus"):
        ShardedRetriever(ShardedIndex(good.index, good.sharded.offset, store=local))
    # n_docs differing between ranks: both raise, the group still works after
    q = torch.randn(2, DIM)
    with pytest.raises(ValueError, match=r"k must be the same on every rank"):
        good.retrieve(q, n_docs=2 + rank)
    assert good.retrieve(q).ids.shape == (2, 2)
    # retrieval on a group of its own (gloo) gives what the default group gives
    import torch.distributed as dist

    own = load_sharded_retriever(tmp / "good.staging", n_docs=2, group=dist.new_group(backend="gloo"))
    assert torch.equal(own.retrieve(q).ids, good.retrieve(q).ids)


def test_bad_sharded_configs_raise_on_every_rank(tmp_path):
    from rag_fast.retrieval.encoders import shard_rows

    stage(tmp_path / "three.staging", 3)
    stage(tmp_path / "holed.staging", 2)
    (tmp_path / "holed.staging" / "embeddings-1-of-2.npy").unlink()
    stage(tmp_path / "good.staging", 2)
    for i in range(2):
        lo, hi = shard_rows(N, (i, 2))
        PassageStore.create(passages()[lo:hi], tmp_path / f"local-{i}", progress=False)
    run_ranks(2, _errors_worker, tmp_path)


# ---- a shard's built index saved and reused (cache) -------------------------------------------
def _cache_worker(rank, world, staging):
    import torch.distributed as dist

    from rag_fast.models.retriever_io import load_sharded_retriever
    from rag_fast.retrieval.encoders import shard_rows

    q = torch.from_numpy(np.random.default_rng(11 + rank).standard_normal((4, DIM)).astype(np.float32))
    first = load_sharded_retriever(staging, preset="hnsw", cache=True, n_docs=3)
    saved = list(staging.glob(f"index-{rank}-of-2-*"))
    assert len(saved) == 1 and (saved[0] / "manifest.json").is_file()
    stamp = (saved[0] / "manifest.json").stat().st_mtime_ns
    got = first.retrieve(q)
    again = load_sharded_retriever(staging, preset="hnsw", cache=True, n_docs=3)  # reused
    assert (saved[0] / "manifest.json").stat().st_mtime_ns == stamp
    assert again.index.meta["shard_cache"]["preset"] == "hnsw"
    reused = again.retrieve(q)
    assert torch.equal(reused.ids, got.ids) and torch.equal(reused.scores, got.scores)
    load_sharded_retriever(staging, preset="exact", cache=True)  # other settings: its own entry
    assert len(list(staging.glob(f"index-{rank}-of-2-*"))) == 2
    # new embeddings for the shard (re-encoded): the saved index is rebuilt, not reused
    dist.barrier()
    lo, hi = shard_rows(N, (rank, 2))
    np.save(staging / f"embeddings-{rank}-of-2.npy", -passage_vectors()[lo:hi])
    dist.barrier()
    rebuilt = load_sharded_retriever(staging, preset="hnsw", cache=True, n_docs=3)
    assert (saved[0] / "manifest.json").stat().st_mtime_ns != stamp
    fresh = load_sharded_retriever(staging, preset="hnsw", n_docs=3)
    a, b = rebuilt.retrieve(q), fresh.retrieve(q)
    assert torch.equal(a.ids, b.ids) and not torch.equal(a.ids, got.ids)


def test_shard_index_saved_and_reused(tmp_path):
    run_ranks(2, _cache_worker, stage(tmp_path / "kb.staging", 2))


def test_sharded_needs_a_process_group_and_valid_config(tmp_path):
    from rag_fast.models.retriever_io import load_sharded_retriever
    from rag_fast.training.run import load_config

    stage(tmp_path / "kb.staging", 2)
    with pytest.raises(ValueError, match=r"index.sharded: a sharded index needs torch.distributed: "
                       r"run under torchrun with 2 processes"):
        load_sharded_retriever(tmp_path / "kb.staging")
    config = tmp_path / "train.json"
    for index, error in [
        ({"path": "kb.staging", "sharded": "yes"}, r"index.sharded: expected true or false"),
        ({"path": "kb.staging", "preset": "hnsw"}, r"index.preset: only for a sharded index"),
        ({"path": "kb.staging", "sharded": True, "preset": 3}, r"index.preset: expected a preset"),
        ({"path": "kb.staging", "shards": 2}, r"index.shards: unknown option"),
        ({"path": "kb.staging", "cache": True}, r"index.cache: only for a sharded index"),
        ({"path": "kb.staging", "sharded": True, "cache": 1}, r"index.cache: expected true or false"),
    ]:
        config.write_text(json.dumps({"model": "m", "index": index, "data": {"train": "t.jsonl"}}))
        with pytest.raises(ValueError, match=error):
            load_config(str(config))
    config.write_text(json.dumps({"model": "m", "index": {"path": "kb.staging", "sharded": True,
                                                          "preset": "hnsw"},
                                  "data": {"train": "t.jsonl"}}))
    assert load_config(str(config))["index"] == {"path": str(tmp_path / "kb.staging"),
                                                 "sharded": True, "preset": "hnsw"}


# ---- `rag-fast train` under torchrun ----------------------------------------------------------
def _torchrun(config: Path, out: Path, nproc: int = 2) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           str(nproc), "-m", "rag_fast.cli", "train", "--config", str(config), "--output-dir",
           str(out), "--device", "cpu"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, cwd=Path(__file__).parent, capture_output=True, text=True,
                          timeout=300, env=env)


@pytest.mark.slow
def test_train_command_under_torchrun_with_sharded_index(tmp_path):
    from rag_fast.models import RagModel

    make_model(None).save(str(tmp_path / "model0"))
    stage(tmp_path / "kb.staging", 2)
    data = tmp_path / "qa.jsonl"
    data.write_text("".join(json.dumps({"question": e.question, "answers": list(e.answers)}) + "\n"
                            for e in qa()[:6]))
    config = tmp_path / "train.json"
    config.write_text(json.dumps({
        "model": "model0", "index": {"path": "kb.staging", "sharded": True},
        "data": {"train": "qa.jsonl", "eval": "qa.jsonl"},
        "train": {"max_steps": 2, "micro_batch_size": 1, "lr": 1e-3, "progress": False,
                  "log_every": 1, "eval_every": 1},
    }))
    proc = _torchrun(config, tmp_path / "run")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("trained 2 steps") == 1
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2]
    assert [r["step"] for r in records if "eval" in r] == [1, 2]  # evaluated on both ranks, no hang
    assert all(r["retrieval_s"] > 0 for r in records if "loss" in r)
    trained = RagModel.load(str(tmp_path / "run"))
    assert not torch.equal(trained.generator.lm_head.weight,
                           RagModel.load(str(tmp_path / "model0")).generator.lm_head.weight)
    # (2 processes on 3 shards: test_bad_sharded_configs_raise_on_every_rank, in-process)
