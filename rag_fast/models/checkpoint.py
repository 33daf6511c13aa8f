"""RagModel checkpoints: our own format, and loading ``transformers`` RAG checkpoints.

Our format is a directory:

    rag_fast_model.json    format version, RagModel options, each module's class and config,
                           and the SHA-256 of every other file (the manifest)
    weights.pt             state dict {"generator.*", "question_encoder.*"} (torch.save)
    generator_tokenizer/   question_tokenizer/    when the model has them (save_pretrained)

It is written into a temporary sibling directory and renamed into place, so a crash never
leaves a half-written checkpoint under ``path``; loading checks every file against the manifest.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from typing import Any

import torch

from rag_fast.models.rag_model import RagModel

FORMAT = 1
MANIFEST = "rag_fast_model.json"
WEIGHTS = "weights.pt"


class CheckpointError(ValueError):
    """A checkpoint that is missing, incomplete, corrupt or of an unknown format."""


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


def atomic_replace_dir(tmp: str, path: str) -> None:
    """Move the finished directory ``tmp`` to ``path``, replacing an existing one."""
    _fsync_tree(tmp)
    old = None
    if os.path.exists(path):
        old = f"{path}.old-{os.getpid()}"
        os.replace(path, old)
    os.replace(tmp, path)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _module_spec(module: torch.nn.Module | None) -> dict | None:
    if module is None:
        return None
    config = getattr(module, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        return {"class": None, "config": None}  # a plain module: the caller passes it at load
    return {"class": type(module).__name__, "config": config.to_dict()}


def save_rag_model(model: RagModel, path: str) -> None:
    """Write ``model`` to the directory ``path`` atomically (see the module docstring)."""
    path = os.path.abspath(path)
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=os.path.basename(path) + ".tmp-", dir=parent)
    try:
        state = {f"generator.{k}": v for k, v in model.generator.state_dict().items()}
        if model.question_encoder is not None:
            state.update({f"question_encoder.{k}": v
                          for k, v in model.question_encoder.state_dict().items()})
        torch.save(state, os.path.join(tmp, WEIGHTS))
        for name in ("generator_tokenizer", "question_tokenizer"):
            tokenizer = getattr(model, name)
            if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
                tokenizer.save_pretrained(os.path.join(tmp, name))
        files = {}
        for folder, _, names in os.walk(tmp):
            for name in names:
                full = os.path.join(folder, name)
                files[os.path.relpath(full, tmp)] = sha256_file(full)
        manifest = {
            "format": FORMAT,
            "options": model.options(),
            "generator": _module_spec(model.generator),
            "question_encoder": _module_spec(model.question_encoder),
            "files": files,
        }
        with open(os.path.join(tmp, MANIFEST), "w") as f:
            json.dump(manifest, f, indent=1)
        atomic_replace_dir(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _read_manifest(path: str) -> dict:
    manifest_path = os.path.join(path, MANIFEST)
    if not os.path.isfile(manifest_path):
        raise CheckpointError(f"{path} is not a rag_fast model checkpoint (no {MANIFEST}); "
                              "for a transformers RAG checkpoint use RagModel.from_transformers")
    with open(manifest_path) as f:
        try:
            manifest = json.load(f)
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{manifest_path} is not valid JSON: {e}") from None
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{manifest_path}: unknown checkpoint format "
                              f"{manifest.get('format')!r} (this rag_fast reads {FORMAT})")
    for rel, digest in manifest["files"].items():
        full = os.path.join(path, rel)
        if not os.path.isfile(full):
            raise CheckpointError(f"checkpoint {path} is incomplete: {rel} is missing")
        if sha256_file(full) != digest:
            raise CheckpointError(f"checkpoint {path} is corrupt: {rel} does not match its "
                                  "SHA-256 in the manifest")
    return manifest


def _build(spec: dict | None, given: torch.nn.Module | None, what: str):
    if given is not None or spec is None:
        return given
    if spec["class"] is None:
        raise CheckpointError(f"the checkpoint's {what} is not a transformers model: pass "
                              f"{what}= to load its weights into")
    import transformers

    cls = getattr(transformers, spec["class"], None)
    if cls is None:
        raise CheckpointError(f"transformers has no class {spec['class']} (the {what})")
    config_cls = cls.config_class
    config = config_cls.from_dict(spec["config"])
    return cls(config)


def load_rag_model(
    path: str,
    *,
    retriever: Any = None,
    generator: torch.nn.Module | None = None,
    question_encoder: torch.nn.Module | None = None,
    map_location: str | torch.device = "cpu",
    **overrides,
) -> RagModel:
    """Load a checkpoint written by :func:`save_rag_model`.

    Modules are rebuilt from their saved configs unless given (their weights are loaded into
    the given ones); ``overrides`` change RagModel options (e.g. ``n_docs``).

    Raises:
        CheckpointError: missing, incomplete or corrupt checkpoint; weights that do not fit.
    """
    manifest = _read_manifest(path)
    generator = _build(manifest["generator"], generator, "generator")
    question_encoder = _build(manifest["question_encoder"], question_encoder, "question_encoder")
    state = torch.load(os.path.join(path, WEIGHTS), map_location=map_location, weights_only=True)
    for prefix, module in (("generator.", generator), ("question_encoder.", question_encoder)):
        if module is None:
            continue
        part = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
        try:
            module.load_state_dict(part, strict=True)
        except RuntimeError as e:
            raise CheckpointError(f"{path}: the {prefix[:-1]} weights do not fit: {e}") from None
    tokenizers = {}
    for name in ("generator_tokenizer", "question_tokenizer"):
        folder = os.path.join(path, name)
        if os.path.isdir(folder):
            from transformers import AutoTokenizer

            tokenizers[name] = AutoTokenizer.from_pretrained(folder)
    options = {**manifest["options"], **overrides}
    return RagModel(generator, question_encoder, retriever, **tokenizers, **options).eval()


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
    from transformers import RagConfig, RagSequenceForGeneration, RagTokenForGeneration

    classes = {"RagTokenForGeneration": RagTokenForGeneration,
               "RagSequenceForGeneration": RagSequenceForGeneration}
    tokenizers = {}
    if isinstance(path_or_model, (str, os.PathLike)):
        path = str(path_or_model)
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise CheckpointError(f"{path} has no config.json: not a transformers checkpoint")
        config = RagConfig.from_pretrained(path)
        arch = (config.architectures or [None])[0]
        if arch not in classes:
            raise CheckpointError(f"{path}: architecture {arch!r} is not one of {sorted(classes)}")
        hf = classes[arch].from_pretrained(path)
        from transformers import AutoTokenizer

        for sub, name in (("generator_tokenizer", "generator_tokenizer"),
                          ("question_encoder_tokenizer", "question_tokenizer")):
            if os.path.isdir(os.path.join(path, sub)):
                tokenizers[name] = AutoTokenizer.from_pretrained(os.path.join(path, sub))
    else:
        hf = path_or_model
        if not isinstance(hf, tuple(classes.values())):
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
    return RagModel(hf.rag.generator, hf.rag.question_encoder, retriever, **tokenizers, **options)
