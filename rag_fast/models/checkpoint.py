"""The model directory: one format for ``RagModel.save/load``, every ``rag-fast`` command and
``transformers``.

A model directory is a ``transformers`` RAG folder plus one side file:

    config.json                  RagConfig (architectures: RagTokenForGeneration or
                                 RagSequenceForGeneration; question encoder and generator configs)
    generation_config.json       the RAG model's generation defaults
    model.safetensors            weights, ``rag.question_encoder.*`` and ``rag.generator.*``
    question_encoder_tokenizer/  generator_tokenizer/     as ``RagTokenizer.save_pretrained``
    rag_fast.json                rag_fast's settings (pooling, normalisation, lengths, ...), the
                                 index the model was trained with, and the size and SHA-256 of
                                 every other file

So ``RagTokenForGeneration.from_pretrained(DIR)`` (or ``RagSequenceForGeneration``) opens a
model rag_fast saved, and ``RagModel.load`` opens any ``transformers`` RAG folder (without
``rag_fast.json`` the settings come from its RagConfig). Weights are safetensors: loading never
runs code. A directory is written and replaced as index directories are
(``rag_fast.retrieval._files.atomic_directory``: after a kill the path holds the old or the
new model, leftovers of dead writers are cleaned); loading checks every file against
``rag_fast.json`` and names the file that does not match.
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import torch

from rag_fast._quiet import quiet_transformers
from rag_fast.models.rag_model import RagModel

FORMAT = 2
KIND = "rag_fast.model"
SIDE_FILE = "rag_fast.json"
QUESTION_TOKENIZER_DIR = "question_encoder_tokenizer"
GENERATOR_TOKENIZER_DIR = "generator_tokenizer"
ARCHITECTURES = {"token": "RagTokenForGeneration", "sequence": "RagSequenceForGeneration"}


class CheckpointError(ValueError):
    """A model directory that is missing, incomplete, corrupt or of an unknown format."""


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _fsync_tree(root: str) -> None:
    for folder, _, files in os.walk(root):
        for name in files:
            with open(os.path.join(folder, name), "rb") as f:
                os.fsync(f.fileno())


def rag_config(model: RagModel):
    """The ``transformers`` RagConfig describing ``model`` (what ``config.json`` holds)."""
    from transformers import RagConfig

    for name, module in (("generator", model.generator), ("question_encoder", model.question_encoder)):
        if module is None or not hasattr(getattr(module, "config", None), "to_dict"):
            what = "None" if module is None else type(module).__name__
            raise CheckpointError(
                f"a model directory needs a transformers {name} (a model with a .config); this "
                f"RagModel's {name} is {what}")
    config = RagConfig.from_question_encoder_generator_configs(
        model.question_encoder.config, model.generator.config,
        n_docs=model.n_docs, label_smoothing=model.epsilon, exclude_bos_score=model.exclude_bos,
        max_combined_length=model.max_context_length,
    )
    config.architectures = [ARCHITECTURES[model.mode]]
    return config


def _hf_wrapper(model: RagModel, config):
    """A transformers RAG model sharing ``model``'s modules (nothing is copied)."""
    import transformers

    cls = getattr(transformers, ARCHITECTURES[model.mode])
    return cls(config, question_encoder=model.question_encoder, generator=model.generator)


def _describe(root: str) -> dict:
    files = {}
    for folder, _, names in os.walk(root):
        for name in sorted(names):
            full = os.path.join(folder, name)
            rel = os.path.relpath(full, root).replace(os.sep, "/")
            if rel != SIDE_FILE:
                files[rel] = {"bytes": os.path.getsize(full), "sha256": sha256_file(full)}
    return files


def save_rag_model(model: RagModel, path: str, *, index: str | None = None) -> None:
    """Write ``model`` to the directory ``path`` atomically (see the module docstring).

    Args:
        index: the index directory the model retrieves from, recorded so that ``rag-fast eval``
            and ``generate`` find it without ``--index`` (default: the one recorded when the
            model was loaded, if any).
    Raises:
        CheckpointError: a model without a transformers generator and question encoder.
    """
    from rag_fast.retrieval._files import atomic_directory

    config = rag_config(model)
    index = index if index is not None else model.index_path
    with atomic_directory(os.path.abspath(path), overwrite=True) as tmp:
        tmp = str(tmp)
        with quiet_transformers():
            _hf_wrapper(model, config).save_pretrained(tmp, safe_serialization=True)
            for sub, tokenizer in ((GENERATOR_TOKENIZER_DIR, model.generator_tokenizer),
                                   (QUESTION_TOKENIZER_DIR, model.question_tokenizer)):
                if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
                    tokenizer.save_pretrained(os.path.join(tmp, sub))
        side = {
            "kind": KIND,
            "format": FORMAT,
            "options": model.options(),
            "index": os.path.abspath(index) if index else None,
            "files": _describe(tmp),
        }
        with open(os.path.join(tmp, SIDE_FILE), "w", encoding="utf-8") as f:
            json.dump(side, f, indent=1)
        _fsync_tree(tmp)


def read_side_file(path: str) -> dict | None:
    """``rag_fast.json`` of a model directory, checked against the files (None if absent).

    Raises:
        CheckpointError: invalid JSON, an unknown kind or format, a missing file, or a file
            whose size or SHA-256 differs from the record (named in the message).
    """
    side_path = os.path.join(path, SIDE_FILE)
    if not os.path.isfile(side_path):
        return None
    try:
        with open(side_path, encoding="utf-8") as f:
            side = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{side_path} is not valid JSON: {e}") from None
    if not isinstance(side, dict) or side.get("kind") != KIND:
        raise CheckpointError(f"{side_path}: not a rag_fast model side file (kind "
                              f"{side.get('kind') if isinstance(side, dict) else None!r})")
    if side.get("format") != FORMAT:
        raise CheckpointError(f"{side_path}: unknown format {side.get('format')!r} (this rag_fast "
                              f"reads format {FORMAT}; save the model again with it)")
    for key, kind in (("options", dict), ("files", dict)):
        if not isinstance(side.get(key), kind):
            raise CheckpointError(f"{side_path}: {key!r} is missing or not a {kind.__name__}")
    for rel, record in side["files"].items():
        full = os.path.join(path, rel)
        if not os.path.isfile(full):
            raise CheckpointError(f"model directory {path} is incomplete: {rel} is missing")
        if os.path.getsize(full) != record.get("bytes"):
            raise CheckpointError(f"model directory {path} is corrupt: {rel} has "
                                  f"{os.path.getsize(full)} bytes, {record.get('bytes')} expected "
                                  "(truncated or replaced)")
        if sha256_file(full) != record.get("sha256"):
            raise CheckpointError(f"model directory {path} is corrupt: {rel} does not match its "
                                  f"SHA-256 in {SIDE_FILE}")
    return side


def resolve_model_dir(path: str) -> str:
    """``path`` if it is a model directory, else its ``model/`` when ``path`` is the output
    directory of ``rag-fast train`` (which saves the trained model there)."""
    path = os.fspath(path)
    if not os.path.isfile(os.path.join(path, "config.json")) and os.path.isfile(
            os.path.join(path, "model", "config.json")):
        return os.path.join(path, "model")
    return path


def _rag_architecture(path: str) -> str:
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        hint = (" (a format-1 directory of an older rag_fast: load it with that version and save "
                "it again)" if os.path.isfile(os.path.join(path, "rag_fast_model.json")) else "")
        raise CheckpointError(f"{path} is not a model directory: no config.json (expected "
                              f"`rag-fast init`/`train` output or a transformers RAG folder){hint}")
    try:
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{config_path} is not valid JSON: {e}") from None
    arch = (config.get("architectures") or [None])[0]
    if config.get("model_type") != "rag" or arch not in ARCHITECTURES.values():
        raise CheckpointError(
            f"{config_path}: model_type {config.get('model_type')!r} / architecture {arch!r} is "
            f"not a RAG model (expected one of {sorted(ARCHITECTURES.values())})")
    return arch


def _load_tokenizers(path: str) -> dict:
    from transformers import AutoTokenizer

    tokenizers = {}
    if not os.path.isdir(os.path.join(path, GENERATOR_TOKENIZER_DIR)) and os.path.isfile(
            os.path.join(path, "tokenizer_config.json")):  # a generator tokenizer saved beside
        tokenizers["generator_tokenizer"] = AutoTokenizer.from_pretrained(path)
    for sub, name in ((GENERATOR_TOKENIZER_DIR, "generator_tokenizer"),
                      (QUESTION_TOKENIZER_DIR, "question_tokenizer")):
        folder = os.path.join(path, sub)
        if os.path.isdir(folder):
            tokenizers[name] = AutoTokenizer.from_pretrained(folder)
    return tokenizers


def _generation_config(path: str):
    from transformers import GenerationConfig

    if os.path.isfile(os.path.join(path, "generation_config.json")):
        return GenerationConfig.from_pretrained(path)
    return None


def load_rag_model(
    path: str,
    *,
    retriever: Any = None,
    device: str | torch.device | None = None,
    **overrides,
) -> RagModel:
    """Load a model directory: one ``rag_fast`` saved, or any ``transformers`` RAG folder.

    Args:
        retriever: what the model retrieves with (see RagModel); ``model.index_path`` names the
            index recorded at save time, if any.
        device: where to put the model (default: the CPU).
        overrides: RagModel options to change (e.g. ``n_docs``, ``mode``).
    Raises:
        CheckpointError: not a model directory, a missing or corrupt file (named), weights that
            do not fit the config.
    """
    import transformers

    from rag_fast.retrieval._files import recover_directory

    path = resolve_model_dir(path)
    recover_directory(path)  # a save killed between its renames left it aside
    if not os.path.isdir(path):
        raise CheckpointError(f"model directory {path!r} does not exist")
    arch = _rag_architecture(path)
    side = read_side_file(path)
    with quiet_transformers():
        try:
            hf = getattr(transformers, arch).from_pretrained(path)
        except (OSError, RuntimeError, ValueError) as e:
            raise CheckpointError(f"{path}: the weights do not load: {e}") from None
        tokenizers = _load_tokenizers(path)
        generation_config = _generation_config(path)
    if side is None:  # a transformers folder: settings from its RagConfig
        model = from_transformers(hf, retriever=retriever, **tokenizers, **overrides)
    else:
        options = {**side["options"], **overrides}
        model = RagModel(hf.rag.generator, hf.rag.question_encoder, retriever, **tokenizers,
                         **options)
        model.index_path = side.get("index")
    model.generation_config = generation_config
    if device is not None:
        model.to(device)
    return model.eval()


def from_transformers(path_or_model: Any, *, retriever: Any = None, **overrides) -> RagModel:
    """A RagModel from a ``transformers`` ``RagTokenForGeneration`` /
    ``RagSequenceForGeneration`` (an instance, or a ``save_pretrained`` directory).

    Takes the generator, the question encoder, n_docs, label smoothing and
    ``exclude_bos_score`` from it, and the tokenizers when the directory holds them
    (``generator_tokenizer/``, ``question_encoder_tokenizer/`` as ``RagTokenizer`` saves them).
    With the same contexts and doc_scores, the loss equals the original model's.

    Raises:
        CheckpointError: a path without a RAG config, or a model that is not a RAG model.
    """
    from transformers import RagSequenceForGeneration, RagTokenForGeneration

    if isinstance(path_or_model, (str, os.PathLike)):
        return load_rag_model(os.fspath(path_or_model), retriever=retriever, **overrides)
    hf = path_or_model
    if not isinstance(hf, (RagTokenForGeneration, RagSequenceForGeneration)):
        raise CheckpointError(f"expected a RagTokenForGeneration or RagSequenceForGeneration, "
                              f"got {type(hf).__name__}")
    config = hf.config
    mode = "token" if isinstance(hf, RagTokenForGeneration) else "sequence"
    options = {
        "mode": mode,
        "n_docs": int(config.n_docs),
        "epsilon": float(config.label_smoothing or 0.0),
        "exclude_bos": bool(config.exclude_bos_score) if mode == "sequence" else False,
        "bos_token_id": config.bos_token_id or config.generator.bos_token_id,
        "max_context_length": int(getattr(config, "max_combined_length", 300) or 300),
    }
    options.update(overrides)
    model = RagModel(hf.rag.generator, hf.rag.question_encoder, retriever, **options)
    model.generation_config = getattr(hf, "generation_config", None)
    return model
