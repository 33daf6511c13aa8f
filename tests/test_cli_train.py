"""`rag-fast train` and `rag-fast eval --model` end to end on a tiny setup: a saved RagModel
(tiny BART generator, tiny BERT question encoder, word-level tokenizers), an index directory
opened with load_retriever, JSONL data. Random weights and embeddings: this checks the plumbing,
not the quality (see tests/test_examples.py for that)."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from rag_fast import cli
from rag_fast.models import RagModel, load_retriever
from rag_fast.retrieval import DenseIndex, Passage, PassageStore, Retriever

PASSAGES = [("p0", "vorin", "vorin lives in kelta ."), ("p1", "suma", "suma lives in brodo ."),
            ("p2", "tarek", "tarek lives in miru ."), ("p3", "olun", "olun lives in kelta ."),
            ("p4", "ruzan", "ruzan lives in zafe ."), ("p5", "peli", "peli lives in brodo .")]
QA = [("where does vorin live ?", "kelta"), ("where does suma live ?", "brodo"),
      ("where does tarek live ?", "miru"), ("where does olun live ?", "kelta")]
DIM = 16


def word_tokenizer(texts):
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    split = pre_tokenizers.Whitespace()
    vocab = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3}
    for text in texts:
        for word, _ in split.pre_tokenize_str(text):
            vocab.setdefault(word, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = split
    tok.post_processor = processors.TemplateProcessing(single="<s> $A </s>",
                                                       special_tokens=[("<s>", 0), ("</s>", 2)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>", unk_token="<unk>")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import BartConfig, BartForConditionalGeneration, BertConfig, BertModel

    root = tmp_path_factory.mktemp("cli_train")
    tok = word_tokenizer([t for p in PASSAGES for t in p[1:]] + [q for q, _ in QA] + ["/ //"])
    torch.manual_seed(0)
    generator = BartForConditionalGeneration(BartConfig(
        vocab_size=len(tok), d_model=16, encoder_layers=1, decoder_layers=1,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
        decoder_ffn_dim=32, max_position_embeddings=64, pad_token_id=1, bos_token_id=0,
        eos_token_id=2, decoder_start_token_id=2, forced_bos_token_id=None,
        forced_eos_token_id=None))
    question_encoder = BertModel(BertConfig(vocab_size=len(tok), hidden_size=DIM,
                                            num_hidden_layers=1, num_attention_heads=2,
                                            intermediate_size=32, pad_token_id=1))
    RagModel(generator, question_encoder, None, mode="token", n_docs=2, generator_tokenizer=tok,
             question_tokenizer=tok, question_pooling="mean").save(str(root / "model0"))
    # an index directory as `rag-fast index build` lays it out (random passage vectors)
    index_dir = root / "index_dir"
    PassageStore.create([Passage(*p) for p in PASSAGES], index_dir / "passages", progress=False)
    vectors = np.random.default_rng(0).standard_normal((len(PASSAGES), DIM)).astype(np.float32)
    DenseIndex.build(vectors, "exact", progress=False).save(index_dir / "index")
    data = root / "qa.jsonl"
    data.write_text("".join(json.dumps({"question": q, "answers": [a]}) + "\n" for q, a in QA))
    return root, index_dir, data


def test_load_retriever_opens_an_index_directory(setup):
    _, index_dir, _ = setup
    retriever = load_retriever(index_dir, n_docs=2)
    assert isinstance(retriever, Retriever) and len(retriever.store) == len(PASSAGES)
    found = retriever.retrieve(torch.randn(3, DIM))
    assert found.ids.shape == (3, 2) and found.doc_embeddings.shape == (3, 2, DIM)


def test_load_retriever_errors(setup, tmp_path):
    _, index_dir, _ = setup
    with pytest.raises(FileNotFoundError, match="is not a directory"):
        load_retriever(tmp_path / "missing")
    (tmp_path / "passages").mkdir()
    with pytest.raises(FileNotFoundError, match="has no index/"):
        load_retriever(tmp_path)
    (tmp_path / "index").mkdir()
    (tmp_path / "manifest.json").write_text('{"kind": "something else"}')
    with pytest.raises(ValueError, match="expected an index directory"):
        load_retriever(tmp_path)


def test_train_then_eval_commands(setup, capsys):
    root, index_dir, data = setup
    out = root / "run"
    config = {
        "model": str(root / "model0"),
        "index": str(index_dir),
        "data": {"train": str(data), "eval": str(data)},
        "train": {"max_steps": 3, "micro_batch_size": 2, "lr": 1e-3, "output_dir": str(out),
                  "checkpoint_every": 2, "eval_every": 3, "progress": False, "log_every": 1},
    }
    config_path = root / "train.json"
    config_path.write_text(json.dumps(config))
    before = RagModel.load(str(root / "model0")).state_dict()
    assert cli.main(["train", "--config", str(config_path)]) == 0
    trained = RagModel.load(str(out / "model"), retriever=load_retriever(index_dir))
    changed = [k for k, v in trained.state_dict().items() if not torch.equal(v, before[k])]
    assert any(k.startswith("generator.") for k in changed)
    assert any(k.startswith("question_encoder.") for k in changed)  # trained jointly
    capsys.readouterr()
    assert cli.main(["eval", "--data", str(data), "--model", str(out), "--out",
                     str(root / "eval"), "--max-new-tokens", "3", "--no-progress"]) == 0
    printed = capsys.readouterr().out
    metrics = json.loads((root / "eval" / "metrics.json").read_text())["metrics"]
    assert f"{metrics['em']:.4f}" in printed
    assert "(recall@2: the share of questions with an answer string among their 2 passages" \
        in printed  # not to be taken for recall against gold passage ids
    assert {"em", "f1", "bleu1", "rougeL", "recall@2"} <= set(metrics)
    assert all(0.0 <= metrics[k] <= 1.0 for k in ("em", "recall@2"))


@pytest.mark.slow
def test_train_under_torchrun_with_two_gloo_processes(setup, tmp_path):
    """`rag-fast train` under torchrun: one process per CPU rank (gloo), rank 0 writes."""
    import subprocess
    import sys
    from pathlib import Path

    root, index_dir, data = setup
    config = tmp_path / "train.json"
    config.write_text(json.dumps({
        "model": str(root / "model0"), "index": str(index_dir), "data": {"train": str(data)},
        "train": {"max_steps": 2, "micro_batch_size": 1, "lr": 1e-3, "progress": False,
                  "log_every": 1},
    }))
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "rag_fast.cli", "train", "--config", str(config), "--output-dir", str(out),
           "--device", "cpu"]
    env = {**__import__("os").environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=Path(__file__).parent, capture_output=True, text=True,
                          timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("trained 2 steps") == 1  # rank 0 reports and saves
    # find_unused_parameters decided by the first step (the question encoder's pooler is
    # unused under mean pooling): DDP does not warn that it searched for nothing
    assert "find_unused_parameters" not in proc.stderr, proc.stderr[-3000:]
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]
    trained = RagModel.load(str(out))  # the output directory resolves to its model/
    before = RagModel.load(str(root / "model0"))
    assert not torch.equal(trained.generator.lm_head.weight, before.generator.lm_head.weight)


def test_model_options_of_the_file_apply_when_model_comes_from_the_command_line(setup, tmp_path):
    """A "model" section without "path" is valid with --model DIR: its options still apply
    (the trained model records them); likewise an "index" section without "path" and --index."""
    root, index_dir, data = setup
    config = tmp_path / "train.json"
    config.write_text(json.dumps({
        "model": {"n_docs": 1, "lean_activations": False}, "index": {"verify": False},
        "data": {"train": str(data)},
        "train": {"max_steps": 1, "micro_batch_size": 2, "progress": False, "plot_file": None},
    }))
    out = tmp_path / "run"
    assert cli.main(["train", "--config", str(config), "--model", str(root / "model0"),
                     "--index", str(index_dir), "--output-dir", str(out), "--device", "cpu"]) == 0
    options = RagModel.load(str(out / "model")).options()
    assert options["n_docs"] == 1 and options["lean_activations"] is False


def test_train_resumes_only_the_run_its_model_started(setup, capsys):
    """A checkpoint remembers the model directory its run started from (path and the SHA-256 of
    its rag_fast.json): the same model resumes; another one, or the same folder holding other
    weights, is refused with a one-line error instead of mixing the two; "resume": false starts
    over."""
    root, index_dir, data = setup
    out = root / "resume_run"
    other = root / "model_other"
    m = RagModel.load(str(root / "model0"))
    with torch.no_grad():
        next(m.generator.parameters()).add_(0.5)
    m.save(str(other))

    def train(model, steps, **top):
        config = {"model": str(model), "index": str(index_dir), "data": {"train": str(data)},
                  "train": {"max_steps": steps, "micro_batch_size": 2, "output_dir": str(out),
                            "checkpoint_every": 1, "progress": False}, **top}
        path = root / "resume.json"
        path.write_text(json.dumps(config))
        capsys.readouterr()
        code = cli.main(["train", "--config", str(path)])
        return code, capsys.readouterr()

    code, printed = train(root / "model0", 2)
    assert code == 0 and "resumed" not in printed.out
    code, printed = train(root / "model0", 3)
    assert code == 0 and "resumed from step 2" in printed.out
    import shutil

    moved = shutil.copytree(root / "model0", root / "model0_moved")  # the same files elsewhere
    code, printed = train(moved, 3)
    assert code == 0 and "resumed from step 3" in printed.out
    code, printed = train(other, 4)
    assert code == 2 and "resumed" not in printed.out
    err = printed.err.strip()
    assert "\n" not in err and "continues a run that started from" in err
    assert str(root / "model0") in err and str(other) in err and '"resume": false' in err
    assert err.count("rag_fast.json sha256") == 2
    code, printed = train(other, 1, resume=False)
    assert code == 0 and "resumed" not in printed.out
    code, printed = train(other, 2)  # its own run now
    assert code == 0 and "resumed from step 1" in printed.out


def test_a_model_with_more_passages_per_question_than_the_index_is_refused(setup, tmp_path,
                                                                           capsys):
    """train and eval open the index and refuse a model whose n_docs exceeds its passages,
    naming the model, before any step (search would otherwise fail mid-run)."""
    root, index_dir, data = setup
    too_many = len(PASSAGES) + 1
    with pytest.raises(ValueError, match=rf"^n_docs={too_many} \(from the model 'm'\) is more "
                                         rf"passages per question than the index .* holds \(6\)"):
        load_retriever(index_dir, n_docs=too_many, n_docs_from="the model 'm'")
    config = tmp_path / "train.json"
    config.write_text(json.dumps({
        "model": {"path": str(root / "model0"), "n_docs": too_many}, "index": str(index_dir),
        "data": {"train": str(data)}, "train": {"max_steps": 1, "progress": False}}))
    assert cli.main(["train", "--config", str(config), "--output-dir",
                     str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"rag-fast: error: n_docs={too_many} (from {config}: model.n_docs, the "
                   "config's) is more passages per question than the index "
                   f"{str(index_dir)!r} holds (6): use a model with fewer passages per question "
                   "(`rag-fast init --n-docs`) or a larger index")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    big = tmp_path / "big"
    RagModel.load(str(root / "model0"), n_docs=too_many).save(str(big))
    assert cli.main(["eval", "--data", str(data), "--model", str(big), "--index", str(index_dir),
                     "--out", str(tmp_path / "eval"), "--no-progress"]) == 2
    assert f"n_docs={too_many} (from the model {str(big)!r})" in capsys.readouterr().err


def test_eval_and_generate_show_each_passage_id_title_score_and_text(setup, tmp_path, capsys):
    """Titles repeat in real corpora: eval's predictions.jsonl and generate's lines give each
    retrieved passage's id, title, score and the first 160 characters of its text."""
    from rag_fast.evaluation.report import passage_record

    root, index_dir, data = setup
    out = tmp_path / "eval"
    assert cli.main(["eval", "--data", str(data), "--model", str(root / "model0"), "--index",
                     str(index_dir), "--out", str(out), "--max-new-tokens", "2", "--device",
                     "cpu", "--no-progress"]) == 0
    rows = [json.loads(x) for x in (out / "predictions.jsonl").read_text().splitlines()]
    by_id = {pid: (title, text) for pid, title, text in PASSAGES}
    assert all(len(r["passages"]) == 2 for r in rows)
    for p in (p for r in rows for p in r["passages"]):
        assert list(p) == ["title", "id", "score", "text"] and isinstance(p["score"], float)
        assert (p["title"], p["text"]) == by_id[p["id"]]
    capsys.readouterr()
    assert cli.main(["generate", "--model", str(root / "model0"), "--index", str(index_dir),
                     "--question", QA[0][0], "--max-new-tokens", "2", "--device", "cpu"]) == 0
    line = json.loads(capsys.readouterr().out)
    assert list(line) == ["question", "answer", "passages", "decoding"]
    assert [(p["id"], p["title"], p["text"]) for p in line["passages"]] == \
        [(p["id"], p["title"], p["text"]) for p in rows[0]["passages"]]
    assert [p["score"] for p in line["passages"]] == pytest.approx(
        [p["score"] for p in rows[0]["passages"]], abs=2e-4)
    # the text is cut at its first 160 characters; a passage without an id has id None
    long = Passage("p9", "t", "word " * 100)
    assert passage_record(long, 0.123456) == {"title": "t", "id": "p9", "score": 0.1235,
                                              "text": ("word " * 32)[:160]}
    assert passage_record({"title": "t", "text": "x"}, 1)["id"] is None


def test_eval_and_generate_take_n_docs(setup, tmp_path, capsys, monkeypatch):
    """--n-docs replaces the model's passages per question (retrieved and marginalised over),
    checked as `init --n-docs` is: an integer >= 1 and at most the index's passage count,
    named as the flag, before the model loads where the index is given."""
    root, index_dir, data = setup
    model = root / "model0"  # n_docs 2
    out = tmp_path / "eval"
    assert cli.main(["eval", "--data", str(data), "--model", str(model), "--index", str(index_dir),
                     "--n-docs", "3", "--out", str(out), "--max-new-tokens", "2", "--device", "cpu",
                     "--no-progress"]) == 0
    rows = [json.loads(x) for x in (out / "predictions.jsonl").read_text().splitlines()]
    assert all(len(r["passages"]) == 3 for r in rows)
    assert "recall@3" in json.loads((out / "metrics.json").read_text())["metrics"]
    # generate: the same search, n passages (the first ones those of eval's top 3)
    capsys.readouterr()
    for n in (1, 4):
        assert cli.main(["generate", "--model", str(model), "--index", str(index_dir), "--question",
                         QA[0][0], "--n-docs", str(n), "--max-new-tokens", "2", "--device",
                         "cpu"]) == 0
        ids = [p["id"] for p in json.loads(capsys.readouterr().out)["passages"]]
        assert len(ids) == n and ids[:3] == [p["id"] for p in rows[0]["passages"]][:n]
    # without an index, the passages a question brings: --n-docs of them
    questions = tmp_path / "q.jsonl"
    questions.write_text(json.dumps({"question": QA[0][0], "passages": [
        {"title": t, "text": x} for _, t, x in PASSAGES[:3]]}) + "\n")
    for n, expect in ((None, 2), ("3", 3)):
        assert cli.main(["generate", "--model", str(model), "--questions", str(questions),
                         "--max-new-tokens", "2", "--device", "cpu",
                         *(["--n-docs", n] if n else [])]) == 0
        assert len(json.loads(capsys.readouterr().out)["passages"]) == expect

    # errors, one line each; with --index given, before the model loads
    def never(*args, **kwargs):
        raise AssertionError("the model loaded before --n-docs was checked")

    with monkeypatch.context() as m:
        m.setattr(RagModel, "load", never)
        for command in (["eval", "--data", str(data), "--out", str(tmp_path / "e2")],
                        ["generate", "--question", "q"]):
            assert cli.main([*command, "--model", str(model), "--index", str(index_dir),
                             "--n-docs", "7", "--device", "cpu"]) == 2
            assert capsys.readouterr().err.strip() == (
                f"rag-fast: error: --n-docs=7 is more passages per question than the index "
                f"{str(index_dir)!r} holds (6)")
            assert cli.main([*command, "--model", str(model), "--index", str(index_dir),
                             "--n-docs", "0", "--device", "cpu"]) == 2
            assert capsys.readouterr().err.strip() == "rag-fast: error: --n-docs must be >= 1, got 0"
    # the index the model records is checked the same way
    recorded = tmp_path / "recorded"
    RagModel.load(str(model)).save(str(recorded), index=str(index_dir))
    assert cli.main(["generate", "--model", str(recorded), "--question", "q", "--n-docs", "7",
                     "--device", "cpu"]) == 2
    assert "--n-docs=7 is more passages per question than the index" in capsys.readouterr().err
    assert cli.main(["eval", "--data", str(data), "--predictions", str(data), "--n-docs",
                     "3"]) == 2
    assert "--n-docs needs --model" in capsys.readouterr().err


def test_set_and_the_short_flags_override_the_config(setup, tmp_path, monkeypatch):
    """--set KEY=VALUE and --max-steps / --lr / --micro-batch-size / --seed replace the file's
    values before the run: the checkpoint's config, the metrics and the trained model show
    them; a later option wins; a path --set gives is relative to the current folder."""
    from rag_fast.training.checkpoint import load_checkpoint

    root, index_dir, data = setup
    config = tmp_path / "conf" / "train.json"
    config.parent.mkdir()
    config.write_text(json.dumps({
        "model": str(root / "model0"), "index": str(index_dir), "data": {"train": "missing.jsonl"},
        "train": {"max_steps": 50, "micro_batch_size": 4, "lr": 1e-3, "seed": 0,
                  "progress": False, "log_every": 1, "plot_file": None}}))
    (tmp_path / "here").mkdir()
    (tmp_path / "here" / "qa.jsonl").write_text(data.read_text())
    monkeypatch.chdir(tmp_path / "here")
    out = tmp_path / "run"
    assert cli.main(["train", "--config", str(config), "--output-dir", str(out), "--device", "cpu",
                     "--set", "train.max_steps=9", "--max-steps", "2", "--lr", "0.002",
                     "--set", "train.schedule=constant", "--micro-batch-size", "2",
                     "--seed", "5", "--set", "model.n_docs=1", "--set", "data.train=qa.jsonl",
                     "--set", "train.extra={\"note\": [1, 2]}"]) == 0
    saved = load_checkpoint(str(out / "checkpoint-last.pt"))["config"]
    assert {k: saved[k] for k in ("max_steps", "lr", "schedule", "micro_batch_size", "seed",
                                  "extra")} == {
        "max_steps": 2, "lr": 0.002, "schedule": "constant", "micro_batch_size": 2, "seed": 5,
        "extra": {"note": [1, 2]}}
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["lr"]) for r in metrics] == [(1, 0.002), (2, 0.002)]
    assert RagModel.load(str(out / "model")).options()["n_docs"] == 1


def test_set_values_are_json_when_they_parse():
    from rag_fast.cli.parsers import parse_value

    assert [parse_value(t) for t in ("20", "1e-4", "true", "null", "[0.9, 0.99]", '"20"', "cpu",
                                     "", "{bad")] == [
        20, 1e-4, True, None, [0.9, 0.99], "20", "cpu", "", "{bad"]


def test_ctrl_c_names_the_last_checkpoint_and_the_command_that_resumes(setup, tmp_path,
                                                                       monkeypatch, capsys):
    """Ctrl-C during `rag-fast train` (exit 130) names the run's last checkpoint and its step,
    and the command line that resumes from it, which does; before any checkpoint it says that
    none exists and the command starts over; with "resume": false it adds --set resume=true."""
    import shlex

    from rag_fast.training import Trainer

    root, index_dir, data = setup
    config = tmp_path / "train.json"
    config.write_text(json.dumps({
        "model": str(root / "model0"), "index": str(index_dir), "data": {"train": str(data)},
        "train": {"max_steps": 3, "micro_batch_size": 2, "checkpoint_every": 1,
                  "progress": False, "plot_file": None}}))
    out = tmp_path / "run dir"  # a path the shell must quote
    argv = ["train", "--config", str(config), "--output-dir", str(out), "--device", "cpu",
            "--lr", "0.002", "--set", "train.log_every=1"]
    shown = shlex.join(["rag-fast", *argv])

    def interrupt_at(step):
        def train_step(self):
            if self.state.step == step:
                raise KeyboardInterrupt
            return train_step.original(self)

        train_step.original = Trainer.train_step
        return train_step

    with monkeypatch.context() as m:
        m.setattr(Trainer, "train_step", interrupt_at(0))
        assert cli.main(argv) == 130
    assert capsys.readouterr().err.strip() == (
        f"rag-fast: interrupted; no checkpoint was written yet in {out}, so the same command "
        f"starts over: {shown}")
    with monkeypatch.context() as m:
        m.setattr(Trainer, "train_step", interrupt_at(2))
        assert cli.main(argv) == 130
    assert capsys.readouterr().err.strip() == (
        f"rag-fast: interrupted; the last checkpoint is {out / 'checkpoint-last.pt'} (step 2); "
        f"the same command resumes from it: {shown}")
    assert cli.main(shlex.split(shown)[1:]) == 0  # the command it names
    assert "resumed from step 2" in capsys.readouterr().out
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]

    config.write_text(json.dumps({**json.loads(config.read_text()), "resume": False}))
    with monkeypatch.context() as m:
        m.setattr(Trainer, "train_step", interrupt_at(0))
        assert cli.main(argv) == 130
    assert capsys.readouterr().err.strip() == (
        f"rag-fast: interrupted; the last checkpoint is {out / 'checkpoint-last.pt'} (step 3); "
        f"the config says \"resume\": false, so to resume from it run the same command with "
        f"--set resume=true: {shown} --set resume=true")
