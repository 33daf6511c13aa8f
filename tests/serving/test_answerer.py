"""rag_fast.serving without HTTP: an Answerer's batched answers are the answers of each question
asked alone (token for token, both RAG modes, both generator families), every record names the
index it came from, a swap is verified before it replaces the index, and the batcher groups,
bounds and drops jobs as documented."""
from __future__ import annotations

import threading
import time

import pytest
import torch
from serving_fixtures import QUESTIONS

from rag_fast.generation import rag_sequence_generate
from rag_fast.serving import Answerer, Batcher, Limits, Overloaded
from rag_fast.serving.answerer import index_checksum

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def answerers(serving_world):
    return {name: Answerer.load(str(serving_world[name]), device="cpu", max_batch=4)
            for name in ("bart", "qwen2")}


@pytest.mark.parametrize("family", ["bart", "qwen2"])
@pytest.mark.parametrize("mode", ["token", "sequence"])
@pytest.mark.parametrize("beams", [1, 3])
def test_batched_answers_are_the_answers_asked_alone(answerers, family, mode, beams):
    answerer = answerers[family]
    settings = answerer.settings(num_beams=beams, max_new_tokens=6, mode=mode)
    batched = answerer.answer(QUESTIONS, settings)  # batches of 4 and 2
    alone = [answerer.answer([q], settings)[0] for q in QUESTIONS]
    assert [r["answer"] for r in batched] == [r["answer"] for r in alone]
    assert ([[p["id"] for p in r["passages"]] for r in batched]
            == [[p["id"] for p in r["passages"]] for r in alone])
    # the check means something: the answers differ between questions
    assert len({r["answer"] for r in batched}) > 1
    assert {r["index"] for r in batched} == {answerer.index.checksum}
    assert all(r["decoding"]["rag_mode"] == mode for r in batched)


def test_masked_sequence_searches_do_not_depend_on_the_batch(answerers):
    """rag_sequence_generate(mask_searches=True): a question's answer is the same whatever
    the other contexts of its batch pad it to; the default (transformers' unmasked searches)
    is what changes with the padding."""
    model = answerers["bart"].model
    short, long = "cairo", "cairo " * 12
    found = [{"title": "rome", "text": "rome tiber 10"},
             {"title": "paris", "text": "paris seine 11"}]
    ctx_alone = model.build_contexts([short], [found])
    ctx_batch = model.build_contexts([short, long], [found, found])
    assert ctx_batch["input_ids"].shape[1] > ctx_alone["input_ids"].shape[1]  # padded
    scores = torch.tensor([[0.3, 0.1]])
    gen = model.transformers_view()
    for beams in (1, 2):
        one = rag_sequence_generate(gen, ctx_alone["input_ids"], ctx_alone["attention_mask"],
                                    scores, num_beams=beams, max_new_tokens=5,
                                    mask_searches=True)
        two = rag_sequence_generate(gen, ctx_batch["input_ids"], ctx_batch["attention_mask"],
                                    scores.repeat(2, 1), num_beams=beams, max_new_tokens=5,
                                    mask_searches=True)
        width = min(one.shape[1], two.shape[1])
        assert torch.equal(one[0, :width], two[0, :width]), beams
        assert bool((two[0, width:] == model.generator.config.pad_token_id).all())


def test_settings_are_checked_against_the_limits(answerers):
    answerer = answerers["bart"]
    for kwargs, word in [({"n_docs": 0}, "n_docs"), ({"n_docs": 17}, "n_docs"),
                         ({"num_beams": 9}, "num_beams"), ({"max_new_tokens": 129}, "max_new"),
                         ({"num_beams": True}, "num_beams"), ({"mode": "both"}, "mode"),
                         ({"max_new_tokens": 1.5}, "max_new_tokens")]:
        with pytest.raises(ValueError, match=word):
            answerer.settings(**kwargs)
    with pytest.raises(ValueError, match="at most 64 questions"):
        answerer.check_questions(["q"] * 65)
    with pytest.raises(ValueError, match=r"question\[1\]"):
        answerer.check_questions(["q", " "])
    with pytest.raises(ValueError, match="2000"):
        answerer.check_questions(["q" * 2001])


def test_swap_is_verified_and_records_name_their_index(serving_world, tmp_path):
    answerer = Answerer.load(str(serving_world["bart"]), device="cpu")
    a, b = serving_world["kb_a"], serving_world["kb_b"]
    assert answerer.index.checksum == index_checksum(a) != index_checksum(b)
    before = answerer.retrieve(QUESTIONS[:2])
    assert all(p["id"].startswith("a") for r in before for p in r["passages"])
    new = answerer.swap_index(b)
    assert new.checksum == index_checksum(b) and answerer.swaps == 1
    after = answerer.answer(QUESTIONS[:2], answerer.settings(num_beams=1, max_new_tokens=3))
    assert all(r["index"] == new.checksum for r in after)
    assert all(p["id"].startswith("b") for r in after for p in r["passages"])
    # a corrupt index is refused and the one serving stays
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(a, bad)
    vectors = bad / "index" / "index.faiss"
    data = bytearray(vectors.read_bytes())
    data[-5] ^= 0xFF
    vectors.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="index.faiss"):
        answerer.swap_index(bad)
    assert answerer.index.checksum == new.checksum and answerer.swaps == 1
    with pytest.raises(FileNotFoundError):
        answerer.swap_index(tmp_path / "missing")


def test_swap_refuses_another_encoder(serving_world, tmp_path):
    from serving_fixtures import run_cli
    from utils import save_tiny_bert

    (tmp_path / "enc").mkdir()
    other = save_tiny_bert(tmp_path / "enc", ["paris", "rome", "seine"])
    code, err = run_cli("index", "build", "--passages", serving_world["root"] / "a.jsonl",
                        "--encoder", other, "--out", tmp_path / "kb", "--no-progress")
    assert code == 0, err
    answerer = Answerer.load(str(serving_world["bart"]), device="cpu")
    with pytest.raises(ValueError, match="another encoder"):
        answerer.swap_index(tmp_path / "kb")
    assert answerer.index.checksum == index_checksum(serving_world["kb_a"])


# ---------------------------------------------------------------------------- batcher
class _Gate:
    """An answerer stand-in whose batches wait for ``release`` and are recorded."""

    max_batch = 4

    def __init__(self) -> None:
        self.release = threading.Event()
        self.batches: list[list[str]] = []

    def run_batch(self, questions, settings, decode, on_stage=None):
        self.release.wait(10)
        self.batches.append(list(questions))
        return [{"question": q, "answer": q.upper()} for q in questions]


def test_batcher_groups_equal_settings_and_splits_at_max_batch(answerers):
    gate = _Gate()
    gate.release.set()
    batcher = Batcher(gate, max_batch=4, max_wait_ms=300, max_queue=100)
    s1 = answerers["bart"].settings(num_beams=1)
    s2 = answerers["bart"].settings(num_beams=2)
    jobs = [batcher.submit([f"q{i}"], s1 if i % 2 == 0 else s2) for i in range(6)]
    batcher.start()
    results = [j.future.result(10) for j in jobs]
    batcher.stop()
    assert [r[0]["answer"] for r in results] == [f"Q{i}" for i in range(6)]
    # equal settings together, at most 4 questions a batch
    assert sorted(map(sorted, gate.batches)) == [["q0", "q2", "q4"], ["q1", "q3", "q5"]]


def test_batcher_refuses_past_its_queue_and_drops_cancelled_jobs(answerers):
    gate = _Gate()
    batcher = Batcher(gate, max_batch=4, max_wait_ms=0, max_queue=3)
    s = answerers["bart"].settings(num_beams=1)
    batcher.start()
    first = batcher.submit(["running"], s)
    deadline = time.monotonic() + 10
    while batcher.queued and time.monotonic() < deadline:  # the worker took it and waits
        time.sleep(0.01)
    kept = batcher.submit(["kept"], s)
    dropped = batcher.submit(["dropped", "too"], s)
    with pytest.raises(Overloaded):
        batcher.submit(["one more"], s)
    assert dropped.future.cancel()  # its client went away before its batch started
    assert not first.future.cancel()  # started: it is answered
    gate.release.set()
    assert kept.future.result(10)[0]["answer"] == "KEPT"
    assert first.future.result(10)[0]["answer"] == "RUNNING"
    batcher.stop()
    assert ["dropped", "too"] not in gate.batches
    assert [q for b in gate.batches for q in b] == ["running", "kept"]


def test_a_batch_error_reaches_each_of_its_jobs_and_the_worker_goes_on(answerers):
    class Failing(_Gate):
        def run_batch(self, questions, settings, decode, on_stage=None):
            if "bad" in questions:
                raise ValueError("n_docs must be at most 2")
            return super().run_batch(questions, settings, decode)

    gate = Failing()
    gate.release.set()
    batcher = Batcher(gate, max_batch=4, max_wait_ms=200)
    s = answerers["bart"].settings(num_beams=1)
    jobs = [batcher.submit(["bad"], s), batcher.submit(["other"], s)]
    batcher.start()
    for job in jobs:
        with pytest.raises(ValueError, match="at most 2"):
            job.future.result(10)
    assert batcher.submit(["fine"], s).future.result(10)[0]["answer"] == "FINE"
    batcher.stop()


def test_limits_are_the_owners(serving_world):
    answerer = Answerer.load(str(serving_world["bart"]), device="cpu",
                             limits=Limits(max_beams=2, max_questions=2))
    with pytest.raises(ValueError, match=r"num_beams must be in \[1, 2\]"):
        answerer.settings(num_beams=3)
    with pytest.raises(ValueError, match="at most 2 questions"):
        answerer.answer(QUESTIONS[:3])


def test_swap_refuses_an_index_smaller_than_the_models_n_docs(serving_world, tmp_path):
    """S46 (eighth hostile pass): a swap took a 1-passage index under a model of n_docs=2,
    which start-up refuses; every request naming no n_docs then got 422 for a value it never
    sent."""
    from serving_fixtures import run_cli

    one = tmp_path / "one.jsonl"
    one.write_text((serving_world["root"] / "a.jsonl").read_text().splitlines()[0] + "\n")
    code, err = run_cli("index", "build", "--passages", one, "--encoder",
                        serving_world["encoder"], "--out", tmp_path / "kb1", "--no-progress",
                        "--max-length", "32")
    assert code == 0, err
    answerer = Answerer.load(str(serving_world["bart"]), device="cpu")
    with pytest.raises(ValueError, match=r"n_docs=2 \(from the served model\) is more passages "
                                         r"per question than the index .*kb1.* holds \(1\)"):
        answerer.swap_index(tmp_path / "kb1")
    assert answerer.index.checksum == index_checksum(serving_world["kb_a"])
    assert answerer.swaps == 0 and answerer.settings().n_docs == 2


def test_a_requests_defaults_are_the_models_while_a_batch_runs_with_others(serving_world):
    """A batch sets the model's n_docs and mode to its own settings while it runs; a request
    checked meanwhile took those for its defaults."""
    answerer = Answerer.load(str(serving_world["bart"]), device="cpu")
    seen = []
    real = answerer._answer_batch

    def during(*args, **kwargs):  # what a request checked during this batch gets
        seen.append(answerer.settings())
        return real(*args, **kwargs)

    answerer._answer_batch = during
    answerer.answer(QUESTIONS[:1], answerer.settings(n_docs=1, mode="sequence", num_beams=1,
                                                      max_new_tokens=2))
    assert (seen[0].n_docs, seen[0].mode) == (2, answerer.model.mode) == (2, "token")
    assert answerer.describe()["n_docs"] == 2
