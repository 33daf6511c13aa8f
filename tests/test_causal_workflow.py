"""Decoder-only generators through the product: model directories (save / load, verified) and
the command line (init -> train -> eval -> generate) on a tiny Qwen2 config, a tiny BERT
question encoder, word-level tokenizers and an index directory of six passages. Random weights:
this checks the plumbing (same loss and ids after a round trip, every stage's outputs), not the
answers' quality."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from rag_fast import cli
from rag_fast.models import RagModel, load_retriever
from rag_fast.models.checkpoint import ModelDirError
from rag_fast.retrieval import DenseIndex, Passage, PassageStore
from rag_fast.training import encode_targets
from test_cli_train import PASSAGES, QA, word_tokenizer

DIM = 16
GENERATOR_CONFIG = {"model_type": "qwen2", "hidden_size": 16, "intermediate_size": 32,
                    "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
                    "max_position_embeddings": 128, "tie_word_embeddings": True}


def _tokenizer():
    return word_tokenizer([t for p in PASSAGES for t in p[1:]] + [q for q, _ in QA] + ["/ //"])


def _model(mode: str = "token", family: str = "qwen2") -> RagModel:
    from transformers import (BertConfig, BertModel, GPT2Config, GPT2LMHeadModel, Qwen2Config,
                              Qwen2ForCausalLM)

    tok = _tokenizer()
    ids = dict(pad_token_id=1, bos_token_id=0, eos_token_id=2)
    torch.manual_seed(0)
    if family == "qwen2":
        g = Qwen2ForCausalLM(Qwen2Config(vocab_size=len(tok), **{
            k: v for k, v in GENERATOR_CONFIG.items() if k != "model_type"}, **ids))
    else:
        g = GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_embd=16, n_layer=1, n_head=2,
                                       n_positions=128, **ids))
    q = BertModel(BertConfig(vocab_size=len(tok), hidden_size=DIM, num_hidden_layers=1,
                             num_attention_heads=2, intermediate_size=32, pad_token_id=1))
    return RagModel(g, q, None, mode=mode, n_docs=2, generator_tokenizer=tok,
                    question_tokenizer=tok, question_pooling="mean", epsilon=0.1).eval()


QUESTIONS = [q for q, _ in QA[:2]]
FOUND = [[{"title": "vorin", "text": "vorin lives in kelta ."},
          {"title": "suma", "text": "suma lives in brodo ."}],
         [{"title": "tarek", "text": "tarek lives in miru ."}]]  # question 1: one passage


def _inputs():
    gen = torch.Generator().manual_seed(3)
    return dict(questions=QUESTIONS, passages=FOUND,
                passage_embeddings=torch.randn(2, 2, DIM, generator=gen))


# ------------------------------------------------------------------------ encode_targets
def test_encode_targets_causal_has_no_start_token():
    model = _model()
    tok = model.generator_tokenizer
    labels = encode_targets(model, ["kelta", "lives in brodo"])
    words = [tok.convert_tokens_to_ids(w) for w in ("kelta", "lives", "in", "brodo")]
    # padded with -100: a decoder-only model's pad token may be its EOS (a target)
    assert labels.tolist() == [[words[0], 2, -100, -100], [words[1], words[2], words[3], 2]]


# ------------------------------------------------------------------------- save / load
@pytest.mark.parametrize("family,mode", [("qwen2", "token"), ("gpt2", "sequence")])
def test_save_load_round_trip(tmp_path, family, mode):
    model = _model(mode, family)
    labels = encode_targets(model, ["kelta", "miru"])
    settings = dict(num_beams=2, max_new_tokens=4, min_new_tokens=3)
    with torch.no_grad():
        loss = model(labels, **_inputs()).loss
    ids = model.generate(**_inputs(), **settings).sequences
    assert ids.shape[1] >= 3  # min_new_tokens: real answers, not an immediate EOS
    model.index_path = str(tmp_path / "some_index")
    model.save(str(tmp_path / "m"))
    side = json.loads((tmp_path / "m" / "rag_fast.json").read_text())
    assert side["layout"] == "causal" and side["options"]["mode"] == mode
    assert {"generator/model.safetensors", "question_encoder/model.safetensors",
            "generator_tokenizer/tokenizer.json"} <= set(side["files"])
    loaded = RagModel.load(str(tmp_path / "m"))
    assert loaded.is_causal and type(loaded.generator) is type(model.generator)
    assert loaded.index_path == str(tmp_path / "some_index") and loaded.epsilon == 0.1
    with torch.no_grad():
        assert torch.equal(loaded(labels, **_inputs()).loss, loss)
    assert torch.equal(loaded.generate(**_inputs(), **settings).sequences, ids)
    for key, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    # saving again over it replaces it atomically
    loaded.replace(n_docs=3).save(str(tmp_path / "m"))
    assert RagModel.load(str(tmp_path / "m")).n_docs == 3


def test_load_names_a_corrupt_or_missing_file(tmp_path):
    from rag_fast.storage import sealed

    _model().save(str(tmp_path / "m"))
    weights = tmp_path / "m" / "generator" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    with pytest.raises(ModelDirError, match="generator/model.safetensors does not match"):
        RagModel.load(str(tmp_path / "m"))
    weights.unlink()
    with pytest.raises(ModelDirError, match="generator/model.safetensors is missing"):
        RagModel.load(str(tmp_path / "m"))
    side_path = tmp_path / "m" / "rag_fast.json"
    side = json.loads(side_path.read_text())
    side_path.write_text(json.dumps(sealed({**side, "layout": "mystery"})))  # accepted edit
    with pytest.raises(ModelDirError, match="unknown layout 'mystery'"):
        RagModel.load(str(tmp_path / "m"))


def test_save_refuses_a_question_encoder_that_is_not_transformers(tmp_path):
    model = _model()
    model.question_encoder = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="question_encoder .* Linear"):
        model.save(str(tmp_path / "m"))
    assert not (tmp_path / "m").exists()


# ----------------------------------------------------------------------- command line
@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    from transformers import BertConfig, BertModel

    root = tmp_path_factory.mktemp("causal_cli")
    tok = _tokenizer()
    tok.save_pretrained(str(root / "tokenizer"))
    torch.manual_seed(0)
    encoder = BertModel(BertConfig(vocab_size=len(tok), hidden_size=DIM, num_hidden_layers=1,
                                   num_attention_heads=2, intermediate_size=32, pad_token_id=1))
    encoder.save_pretrained(str(root / "encoder"))
    tok.save_pretrained(str(root / "encoder"))
    (root / "generator.json").write_text(json.dumps(GENERATOR_CONFIG))
    index_dir = root / "kb"
    PassageStore.create([Passage(*p) for p in PASSAGES], index_dir / "passages", progress=False)
    vectors = np.random.default_rng(0).standard_normal((len(PASSAGES), DIM)).astype(np.float32)
    DenseIndex.build(vectors, "exact", progress=False).save(index_dir / "index")
    data = root / "qa.jsonl"
    data.write_text("".join(json.dumps({"question": q, "answers": [a]}) + "\n" for q, a in QA))
    return root, index_dir, data


@pytest.mark.parametrize("mode", ["token", "sequence"])
def test_cli_init_train_eval_generate(workspace, capsys, mode):
    root, index_dir, data = workspace
    model0, run = root / f"model0-{mode}", root / f"run-{mode}"
    assert cli.main(["init", "--generator", str(root / "generator.json"),
                     "--generator-tokenizer", str(root / "tokenizer"),
                     "--question-encoder", str(root / "encoder"), "--mode", mode,
                     "--n-docs", "2", "--max-context-length", "40", "--out", str(model0)]) == 0
    assert "decoder-only RAG-" in capsys.readouterr().out
    start = RagModel.load(str(model0))
    assert start.is_causal and type(start.generator).__name__ == "Qwen2ForCausalLM"
    assert start.mode == mode and start.generator.config.vocab_size == len(_tokenizer())
    before = {k: v.clone() for k, v in start.state_dict().items()}

    config = {"data": {"train": str(data), "eval": str(data)},
              "train": {"max_steps": 4, "micro_batch_size": 2, "lr": 3e-3, "log_every": 1,
                        "eval_every": 4, "checkpoint_every": 4, "progress": False}}
    (root / f"train-{mode}.json").write_text(json.dumps(config))
    assert cli.main(["train", "--config", str(root / f"train-{mode}.json"), "--model",
                     str(model0), "--index", str(index_dir), "--output-dir", str(run)]) == 0
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [x["loss"] for x in lines if "loss" in x]
    assert len(losses) == 4 and all(np.isfinite(losses))
    assert any("eval" in x for x in lines)  # evaluation (greedy decoding) ran during training
    trained = RagModel.load(str(run))  # the output directory resolves to run/model
    assert trained.is_causal and trained.index_path == str(index_dir.resolve())
    changed = [k for k, v in trained.state_dict().items() if not torch.equal(v, before[k])]
    assert any(k.startswith("generator.") for k in changed)

    capsys.readouterr()
    assert cli.main(["eval", "--data", str(data), "--model", str(run), "--out",
                     str(root / f"eval-{mode}"), "--max-new-tokens", "3", "--no-progress",
                     "--json"]) == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    saved = json.loads((root / f"eval-{mode}" / "metrics.json").read_text())["metrics"]
    assert printed == saved and {"em", "f1", "recall@2"} <= set(saved)
    rows = [json.loads(x) for x in
            (root / f"eval-{mode}" / "predictions.jsonl").read_text().splitlines()]
    assert len(rows) == len(QA) and all(len(r["passages"]) == 2 for r in rows)

    assert cli.main(["generate", "--model", str(run), "--question", QA[0][0],
                     "--num-beams", "2", "--max-new-tokens", "3"]) == 0
    answer = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert answer["question"] == QA[0][0] and isinstance(answer["answer"], str)
    assert len(answer["passages"]) == 2
    # the same answer as the Python API on the trained model
    trained.retriever = load_retriever(index_dir, n_docs=2)
    want = trained.generate([QA[0][0]], num_beams=2, max_new_tokens=3).texts[0]
    assert answer["answer"] == want

    # sampling and penalties from the command line, seeded: the Python API's answers
    sampled = ["generate", "--model", str(run), "--questions", str(data), "--num-beams", "1",
               "--max-new-tokens", "4", "--do-sample", "--top-k", "5", "--temperature", "1.5",
               "--repetition-penalty", "1.2", "--no-repeat-ngram-size", "2", "--seed", "3"]
    assert cli.main(sampled) == 0
    first = [json.loads(x)["answer"] for x in capsys.readouterr().out.strip().splitlines()]
    want = trained.generate([q for q, _ in QA], num_beams=1, max_new_tokens=4, do_sample=True,
                            top_k=5, temperature=1.5, repetition_penalty=1.2,
                            no_repeat_ngram_size=2, rng=torch.Generator().manual_seed(3)).texts
    assert first == want and any(first)  # answers, the same ones
