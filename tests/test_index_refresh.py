"""Index refresh during training (issue #14, deliverable 3): ``refresh_index_every``.

* after a refresh, the index in use is what a fresh exact build from the passage vectors of
  the encoder as trained at that step returns (identical ids and scores), and not what the
  encoder of the start gives (the encoder did change);
* training continues across the refresh without losing steps: the step count, the metrics
  lines, the data position and bitwise the parameters equal a reference run that does the same
  rebuild and ``Retriever.swap`` by hand after that step;
* a kill (``os._exit`` in a subprocess) in the middle of writing the refreshed index leaves the
  previous index in use; the next start resumes from the checkpoint with that index, removes
  the half-written one and reaches bitwise the parameters of an uninterrupted run;
* 2 gloo processes with the index sharded over them refresh each their shard, swap at the same
  step, and train to the parameters of the same run on a whole (single) index.
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
from test_training_sharded import make_model, passage_vectors, passages, qa, stage

from rag_fast.retrieval import DenseIndex, PassageStore, Retriever

HERE = Path(__file__).resolve().parent


def by_hand_vectors(model, store) -> np.ndarray:
    """The passage vectors of the model's question encoder, written out independently of
    rag_fast.training.refresh: ``title. text``, mean pooling, fp16."""
    texts = [f"{store.title(i)}. {store.text(i)}" for i in range(len(store))]
    model.question_encoder.eval()
    with torch.no_grad():
        enc = model.question_tokenizer(texts, padding=True, truncation=True, max_length=256,
                                       return_tensors="pt")
        out = model.encode_questions(enc["input_ids"], enc["attention_mask"])
    model.question_encoder.train()
    return out.numpy().astype(np.float16)


def retriever_over(store_dir: Path) -> Retriever:
    return Retriever(DenseIndex.build(passage_vectors(), "exact", progress=False),
                     PassageStore.load(store_dir), n_docs=3, progress=False)


def config(out: Path, **kw):
    from rag_fast.training import TrainConfig

    values = dict(max_steps=6, micro_batch_size=2, grad_accum=1, lr=1e-2, seed=3, progress=False,
                  log_every=1, device="cpu", output_dir=str(out), plot_file=None)
    values.update(kw)
    return TrainConfig(**values)


def losses(out: Path) -> list[tuple[int, float]]:
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in lines if "loss" in r]


def test_refresh_equals_fresh_build_and_training_continues(tmp_path):
    from rag_fast.models.retriever_io import TimedRetriever
    from rag_fast.training import Trainer, rag_collate, rag_loss

    PassageStore.create(passages(), tmp_path / "passages", progress=False)
    store_dir = tmp_path / "passages"
    queries = torch.randn(7, 16, generator=torch.Generator().manual_seed(1))

    # the run that refreshes after step 3 and after the last one, 4
    model = make_model(TimedRetriever(retriever_over(store_dir)))
    start_vectors = by_hand_vectors(model, model.retriever.store)
    seen = {}

    def at_step(state):
        if state.step == 3:
            seen["index"] = model.retriever.index
            seen["fresh"] = DenseIndex.build(by_hand_vectors(model, model.retriever.store), "exact",
                                             progress=False)
            seen["version"] = model.retriever.version

    trainer = Trainer(model, qa(), rag_collate(model), rag_loss,
                      config(tmp_path / "a", max_steps=4, refresh_index_every=3), on_step_end=at_step)
    state = trainer.train()
    assert state.step == 4 and state.refreshed_at == 4 and seen["version"] == 1
    assert model.retriever.version == 2  # steps 3 and 4
    got, fresh = seen["index"], seen["fresh"]
    assert got.meta["refreshed_at"] == 3 and got.preset == "exact"
    s1, i1 = got.search(queries, 5)
    s2, i2 = fresh.search(queries, 5)
    assert torch.equal(i1, i2) and torch.equal(s1, s2)
    assert np.array_equal(got.embeddings, fresh.embeddings)
    # the encoder changed in 3 steps: its vectors differ from those of the start
    assert not np.array_equal(got.embeddings, start_vectors)
    assert (tmp_path / "a" / "index-refresh" / "step-00000004").is_dir()

    # the reference: no refresh option, the same rebuild and swap by hand after step 3
    ref = make_model(TimedRetriever(retriever_over(store_dir)))

    def swap_by_hand(state):
        if state.step == 3:
            ref.retriever.swap(DenseIndex.build(by_hand_vectors(ref, ref.retriever.store), "exact",
                                                progress=False), ref.retriever.store)

    ref_trainer = Trainer(ref, qa(), rag_collate(ref), rag_loss, config(tmp_path / "b", max_steps=4),
                          on_step_end=swap_by_hand)
    ref_state = ref_trainer.train()
    assert (ref_state.step, ref_state.epoch, ref_state.offset) == (state.step, state.epoch, state.offset)
    params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        assert torch.equal(p, params[name]), name
    assert losses(tmp_path / "a") == losses(tmp_path / "b")
    assert [s for s, _ in losses(tmp_path / "a")] == [1, 2, 3, 4]
    refresh_lines = [json.loads(x) for x in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()
                     if "refresh" in x]
    assert [r["step"] for r in refresh_lines] == [3, 4]
    assert refresh_lines[0]["refresh"]["passages"] == len(passages())
    assert refresh_lines[0]["refresh"]["version"] == 1


KILLED = 17
_RUN = """
import json, os, sys
from pathlib import Path
import faiss, torch
torch.set_num_threads(1)
from test_index_refresh import config, retriever_over
from test_training_sharded import make_model, qa
from rag_fast.models.retriever_io import TimedRetriever
from rag_fast.training import Trainer, rag_collate, rag_loss

root, kill = Path(sys.argv[1]), sys.argv[2] == "kill"
model = make_model(TimedRetriever(retriever_over(root / "passages")))
if kill:  # die after the first file of the step-4 refresh is written, before its manifest
    import rag_fast.retrieval.index as index_module
    write = index_module.write_faiss  # how every index file is written
    def dying_write(index, path, shown):
        write(index, path, shown)
        if "step-00000004" in str(path):
            r = model.retriever
            (root / "at-kill.json").write_text(json.dumps(
                {"version": r.version, "refreshed_at": r.index.meta.get("refreshed_at")}))
            os._exit(%d)
    index_module.write_faiss = dying_write
trainer = Trainer(model, qa(), rag_collate(model), rag_loss,
                  config(root / "out", refresh_index_every=2, checkpoint_every=2))
resumed = trainer.resume()
state = trainer.train()
print(json.dumps({"resumed": resumed, "step": state.step, "refreshed_at": state.refreshed_at,
                  "version": model.retriever.version}))
""" % KILLED


def _run(root: Path, mode: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-c", _RUN, str(root), mode], cwd=HERE, env=env,
                          capture_output=True, text=True, timeout=180)


@pytest.mark.slow
def test_kill_during_refresh_keeps_previous_index_and_resumes(tmp_path):
    from rag_fast.training import load_checkpoint

    PassageStore.create(passages(), tmp_path / "passages", progress=False)
    killed = _run(tmp_path, "kill")
    assert killed.returncode == KILLED, killed.stderr[-3000:]
    # when it died, the retriever still searched the index of the refresh at step 2
    assert json.loads((tmp_path / "at-kill.json").read_text()) == {"version": 1, "refreshed_at": 2}
    refresh = tmp_path / "out" / "index-refresh"
    left = sorted(p.name for p in refresh.iterdir())
    assert "step-00000002" in left and "step-00000004" not in left
    assert any(name.startswith(".step-00000004.tmp-") for name in left), left
    assert load_checkpoint(str(tmp_path / "out" / "checkpoint-last.pt"))["state"]["refreshed_at"] == 2

    again = _run(tmp_path, "resume")
    assert again.returncode == 0, again.stderr[-3000:]
    result = json.loads(again.stdout.strip().splitlines()[-1])
    # resumed at step 2 with the step-2 index (version 1), refreshed at 4 and 6 (version 3)
    assert result == {"resumed": True, "step": 6, "refreshed_at": 6, "version": 3}
    assert sorted(p.name for p in refresh.iterdir()) == ["step-00000006"]  # no leftovers
    assert [s for s, _ in losses(tmp_path / "out")] == [1, 2, 3, 4, 5, 6]

    # an uninterrupted run reaches bitwise the same parameters
    from rag_fast.models.retriever_io import TimedRetriever
    from rag_fast.training import Trainer, rag_collate, rag_loss

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in the subprocesses: the same float sums
    try:
        model = make_model(TimedRetriever(retriever_over(tmp_path / "passages")))
        Trainer(model, qa(), rag_collate(model), rag_loss,
                config(tmp_path / "whole", refresh_index_every=2, checkpoint_every=2)).train()
    finally:
        torch.set_num_threads(threads)
    resumed = load_checkpoint(str(tmp_path / "out" / "checkpoint-last.pt"))["model"]
    for name, p in model.state_dict().items():
        assert torch.equal(p, resumed[name]), name
    assert losses(tmp_path / "out") == losses(tmp_path / "whole")


# ---- sharded: each rank refreshes its shard ---------------------------------------------------
def _sharded_worker(rank, world, staging, out):
    from rag_fast.models.retriever_io import TimedRetriever, load_sharded_retriever
    from rag_fast.training import Trainer, rag_collate, rag_loss

    def train(retriever, name):
        model = make_model(retriever)
        cfg = config(out / f"{name}-{rank}", max_steps=4, refresh_index_every=2)
        state = Trainer(model, qa(), rag_collate(model), rag_loss, cfg).train()
        assert state.step == 4 and state.refreshed_at == 4 and retriever.version == 2
        return model

    whole = TimedRetriever(retriever_over(staging / "passages"))
    single = train(whole, "single")
    sharded = load_sharded_retriever(staging, n_docs=3)
    model = train(sharded, "sharded")
    params = dict(single.named_parameters())
    for name, p in model.named_parameters():
        assert torch.equal(p, params[name]), name
    # this rank's refreshed shard is its rows of the refreshed whole index
    lo, hi = sharded.sharded.offset, sharded.sharded.offset + len(sharded.index)
    assert np.array_equal(sharded.index.embeddings, whole.index.embeddings[lo:hi])
    assert sharded.sharded.meta["refreshed_at"] == 4
    left = sorted(p.name for p in (out / f"sharded-{rank}" / "index-refresh").iterdir())
    assert left == [f"step-00000004-shard-{rank}-of-{world}"]  # step 2's removed after the checkpoint
    q = torch.randn(3 + rank, 16, generator=torch.Generator().manual_seed(rank))
    got, want = sharded.retrieve(q), whole.retrieve(q, n_docs=3)
    assert got.version == 2
    assert torch.equal(got.ids, want.ids) and torch.equal(got.scores, want.scores)


def test_sharded_refresh_two_processes(tmp_path):
    staging = stage(tmp_path / "kb.staging", 2)
    run_ranks(2, _sharded_worker, staging, tmp_path)


# ---- `rag-fast train`: the trained model records the index of its own encoder ----------------
def test_train_command_writes_the_refreshed_index(tmp_path, capsys):
    from rag_fast.cli import main
    from rag_fast.models import RagModel
    from rag_fast.models.retriever_io import load_retriever

    make_model(None).save(str(tmp_path / "model0"))
    PassageStore.create(passages(), tmp_path / "kb" / "passages", progress=False)
    DenseIndex.build(passage_vectors(), "exact", progress=False).save(tmp_path / "kb" / "index")
    (tmp_path / "qa.jsonl").write_text("".join(
        json.dumps({"question": e.question, "answers": list(e.answers)}) + "\n" for e in qa()[:6]))
    (tmp_path / "train.json").write_text(json.dumps({
        "model": "model0", "index": "kb", "data": {"train": "qa.jsonl"},
        "train": {"max_steps": 3, "micro_batch_size": 2, "lr": 1e-2, "progress": False,
                  "refresh_index_every": 2, "plot_file": None}}))
    assert main(["train", "--config", str(tmp_path / "train.json"), "--output-dir",
                 str(tmp_path / "run"), "--device", "cpu"]) == 0
    assert "trained 3 steps" in capsys.readouterr().out
    trained = RagModel.load(str(tmp_path / "run" / "model"))
    assert os.path.samefile(trained.index_path, tmp_path / "run" / "index")
    index = load_retriever(trained.index_path).index
    assert index.meta["refreshed_at"] == 3  # the last step, not only the multiples of 2
    assert np.array_equal(index.embeddings, by_hand_vectors(trained, PassageStore.load(
        tmp_path / "kb" / "passages")))
    steps = [json.loads(x)["step"] for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
             if "refresh" in x]
    assert steps == [2, 3]
