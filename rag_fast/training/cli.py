"""``rag-fast train --config FILE``: train a RagModel from a JSON configuration.

    {
      "model": {"checkpoint": "DIR"} | {"transformers": "DIR"},   plus RagModel option overrides
      "retriever": {"path": "DIR"},          an index directory (`rag-fast index build --out DIR`)
      "data": {"train": "train.jsonl", "eval": "dev.jsonl"},
      "train": {TrainConfig fields; output_dir is where checkpoints and the final model go},
      "resume": true
    }

Under ``torchrun`` each process joins the group (gloo on CPU, nccl on GPU) and trains its slice
of every global batch. The final model is saved to ``<output_dir>/model`` (RagModel.save).
"""
from __future__ import annotations

import argparse
import json
import os


def load_config(path: str) -> dict:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"config file not found: {path}")
    with open(path) as f:
        try:
            config = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e.msg}, line {e.lineno})") from None
    for key in ("model", "data", "train"):
        if key not in config:
            raise ValueError(f"{path}: missing section {key!r}")
    if "train" not in config["data"]:
        raise ValueError(f"{path}: data.train (the training file) is missing")
    return config


def load_retriever(spec: dict | None):
    """The Retriever of ``{"path": DIR, ...}`` (see ``rag_fast.models.retriever_io``), or None."""
    if not spec:
        return None
    from rag_fast.models.retriever_io import load_retriever as load

    if "path" not in spec:
        raise ValueError(f"retriever needs 'path' (an index directory), got {spec}")
    options = {k: v for k, v in spec.items() if k != "path"}
    return load(spec["path"], **options)


def build_model(spec: dict, retriever):
    from rag_fast.models import RagModel

    spec = dict(spec)
    if "checkpoint" in spec:
        return RagModel.load(spec.pop("checkpoint"), retriever=retriever, **spec)
    if "transformers" in spec:
        return RagModel.from_transformers(spec.pop("transformers"), retriever=retriever, **spec)
    raise ValueError("model needs 'checkpoint' (rag_fast) or 'transformers' (save_pretrained dir)")


def run(args: argparse.Namespace) -> int:
    from rag_fast.evaluation import evaluate, load_qa
    from rag_fast.training import TrainConfig, Trainer, rag_collate, rag_loss
    from rag_fast.training.distributed import init_from_env

    config = load_config(args.config)
    init_from_env()
    train_config = TrainConfig.from_dict(config["train"])
    model = build_model(config["model"], load_retriever(config.get("retriever")))
    train_data = load_qa(config["data"]["train"])
    eval_fn = None
    if config["data"].get("eval"):
        eval_data = load_qa(config["data"]["eval"])
        eval_fn = lambda m: evaluate(m, eval_data).metrics  # noqa: E731
    trainer = Trainer(model, train_data, rag_collate(model), rag_loss, train_config, eval_fn)
    if config.get("resume", True) and train_config.output_dir and trainer.resume():
        print(f"resumed from step {trainer.state.step}")
    trainer.train()
    if train_config.output_dir and trainer.rank == 0:
        model.save(os.path.join(train_config.output_dir, "model"))
    return 0


def register(subparsers) -> None:
    """Add ``train`` to the ``rag-fast`` command's subparsers."""
    p = subparsers.add_parser("train", help="train a RagModel (JSON config)",
                              description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, metavar="FILE", help="JSON training configuration")
    p.set_defaults(func=run)
