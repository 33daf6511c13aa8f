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
(``rag_fast.storage.atomic_directory``: after a kill the path holds the old or the
new model, leftovers of dead writers are cleaned); loading checks every file against
``rag_fast.json`` and names the file that does not match.

A RagModel with a decoder-only generator (``*ForCausalLM``) has no ``transformers`` RAG class,
so its directory holds the two models side by side instead (``"layout": "causal"`` in
``rag_fast.json``; the same atomic write and the same checks on load):

    generator/                   the generator's ``save_pretrained`` (config.json,
                                 generation_config.json, model.safetensors)
    question_encoder/            the question encoder's ``save_pretrained``
    question_encoder_tokenizer/  generator_tokenizer/     as above
    generation_config.json       the RagModel's generation defaults, when it has its own
    rag_fast.json                as above, plus ``"layout": "causal"``

Each model is re-created from its ``config.json`` (the ``transformers`` class its
``architectures`` names) and its safetensors weights: no code runs on load either.
"""
from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

import torch

from rag_fast import _pool
from rag_fast._validation import brief_error, not_a_folder
from rag_fast._quiet import quiet_transformers
from rag_fast.models.family import LAYOUT_CAUSAL, LAYOUT_RAG
from rag_fast.retrieval.encoders import unloadable
from rag_fast.storage import (StorageError, atomic_directory, check_files_entry, check_seal,
                              disk_errors, fsync_tree, read_json_file, recover_directory, sealed,
                              sha256_file)

if TYPE_CHECKING:  # (annotations only: rag_model.py imports this module)
    from rag_fast.models.rag_model import RagModel

FORMAT = 2
KIND = "rag_fast.model"
SIDE_FILE = "rag_fast.json"
QUESTION_TOKENIZER_DIR = "question_encoder_tokenizer"
GENERATOR_TOKENIZER_DIR = "generator_tokenizer"
ARCHITECTURES = {"token": "RagTokenForGeneration", "sequence": "RagSequenceForGeneration"}
# rag_fast.json's "layout" (each generator family names its own: family.py): a transformers
# RAG folder (the default, also when absent), or the generator and question encoder saved side
# by side (decoder-only generators)
LAYOUTS = (LAYOUT_RAG, LAYOUT_CAUSAL)
GENERATOR_DIR = "generator"
QUESTION_ENCODER_DIR = "question_encoder"


class ModelDirError(ValueError):
    """A model directory that is missing, incomplete, corrupt or of an unknown format."""


def rag_config(model: RagModel):
    """The ``transformers`` RagConfig describing ``model`` (what ``config.json`` holds)."""
    from transformers import RagConfig

    for name, module in (("generator", model.generator), ("question_encoder", model.question_encoder)):
        if module is None or not hasattr(getattr(module, "config", None), "to_dict"):
            what = "None" if module is None else type(module).__name__
            raise ModelDirError(
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


def _describe(root: str, names_only: bool = False) -> dict:
    """{relative path: {"bytes", "sha256"}} of every file under ``root`` but the side file
    (``names_only``: {relative path: None}, nothing read)."""
    files = {}
    for folder, _, names in os.walk(root):
        for name in sorted(names):
            full = os.path.join(folder, name)
            rel = os.path.relpath(full, root).replace(os.sep, "/")
            if rel != SIDE_FILE:
                files[rel] = None if names_only else {"bytes": os.path.getsize(full),
                                                       "sha256": sha256_file(full)}
    return files


def save_rag_model(model: RagModel, path: str, *, index: str | None = None) -> None:
    """Write ``model`` to the directory ``path`` atomically (see the module docstring).

    Args:
        index: the index directory the model retrieves from, recorded so that ``rag-fast eval``
            and ``generate`` find it without ``--index`` (default: the one recorded when the
            model was loaded, if any).
    Raises:
        ModelDirError: a model without a transformers generator and question encoder.
    """

    causal = model.family.layout == LAYOUT_CAUSAL
    if causal:
        _check_savable(model)
        config = None
    else:
        config = rag_config(model)
    index = index if index is not None else model.index_path
    with disk_errors(path), atomic_directory(os.path.abspath(path), overwrite=True,
                                             kind=KIND) as tmp:
        tmp = str(tmp)
        with quiet_transformers():
            if causal:
                _save_causal_models(model, tmp)
            else:
                _hf_wrapper(model, config).save_pretrained(tmp, safe_serialization=True)
            for sub, tokenizer in ((GENERATOR_TOKENIZER_DIR, model.generator_tokenizer),
                                   (QUESTION_TOKENIZER_DIR, model.question_tokenizer)):
                if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
                    tokenizer.save_pretrained(os.path.join(tmp, sub))
        side = {
            "kind": KIND,
            "format": FORMAT,
            "layout": model.family.layout,
            "options": model.options(),
            "index": os.path.abspath(index) if index else None,
            "files": _describe(tmp),
        }
        with open(os.path.join(tmp, SIDE_FILE), "w", encoding="utf-8") as f:
            json.dump(sealed(side), f, indent=1)
        fsync_tree(tmp)


def _check_savable(model: RagModel) -> None:
    """A decoder-only RagModel's directory needs both models to be ``transformers`` models
    (``save_pretrained`` and a config naming their class)."""
    for name, module in (("generator", model.generator),
                         ("question_encoder", model.question_encoder)):
        if module is None or not callable(getattr(module, "save_pretrained", None)) \
                or not hasattr(getattr(module, "config", None), "to_dict"):
            what = "None" if module is None else type(module).__name__
            raise ModelDirError(
                f"the model directory of a decoder-only RagModel needs a transformers {name} "
                f"(a PreTrainedModel with save_pretrained and a .config); this RagModel's "
                f"{name} is {what}")


def _save_causal_models(model: RagModel, root: str) -> None:
    """The decoder-only layout's models into ``root`` (see the module docstring)."""
    for sub, module in ((GENERATOR_DIR, model.generator),
                        (QUESTION_ENCODER_DIR, model.question_encoder)):
        folder = os.path.join(root, sub)
        module.save_pretrained(folder, safe_serialization=True)
        config_path = os.path.join(folder, "config.json")
        with open(config_path, encoding="utf-8") as f:
            saved = json.load(f)
        if not saved.get("architectures"):  # loading re-creates the class it names
            saved["architectures"] = [type(module).__name__]
            with open(config_path, "w", encoding="utf-8") as f:
                json.dump(saved, f, indent=2)
    if model.generation_config is not None and hasattr(model.generation_config,
                                                       "save_pretrained"):
        model.generation_config.save_pretrained(root)


def _read_side_json(side_path: str) -> Any:
    """The parsed ``rag_fast.json`` at ``side_path`` (which exists)."""
    try:
        return read_json_file(side_path)
    except FileNotFoundError:  # a dangling link: there, but nothing to check against
        raise ModelDirError(f"{side_path} is a symbolic link to nothing: a model directory's "
                              f"{SIDE_FILE} must be a file") from None
    except ValueError as e:  # not a regular file, too large, not JSON
        raise ModelDirError(str(e)) from None
    except OSError as e:
        raise ModelDirError(f"{side_path} cannot be read: {e.strerror or e}") from None


def read_side_file(path: str) -> dict | None:
    """``rag_fast.json`` of a model directory, checked against the files (None if absent).

    Raises:
        ModelDirError: invalid JSON, an unknown kind or format, a missing file, or a file
            whose size or SHA-256 differs from the record (named in the message).
    """

    side_path = os.path.join(path, SIDE_FILE)
    if not os.path.lexists(side_path):  # anything there (a link, a folder, a device) is read
        return None
    side = _read_side_json(side_path)
    if not isinstance(side, dict) or side.get("kind") != KIND:
        raise ModelDirError(f"{side_path}: not a rag_fast model side file (kind "
                              f"{side.get('kind') if isinstance(side, dict) else None!r})")
    try:
        side = check_seal(side_path, side, path)
        if "files" in side:
            check_files_entry(side_path, side["files"], path)
    except StorageError as e:
        raise ModelDirError(str(e)) from None
    if side.get("format") != FORMAT:
        raise ModelDirError(f"{side_path}: unknown format {side.get('format')!r} (this rag_fast "
                              f"reads format {FORMAT}; save the model again with it)")
    for key, kind in (("options", dict), ("files", dict)):
        if not isinstance(side.get(key), kind):
            raise ModelDirError(f"{side_path}: {key!r} is missing or not a {kind.__name__}")
    if side.get("layout", LAYOUT_RAG) not in LAYOUTS:
        raise ModelDirError(f"{side_path}: unknown layout {side.get('layout')!r} (expected "
                              f"one of {list(LAYOUTS)})")
    if side.get("layout") == LAYOUT_CAUSAL:
        for required in (f"{GENERATOR_DIR}/config.json", f"{QUESTION_ENCODER_DIR}/config.json"):
            if required not in side["files"]:
                raise ModelDirError(f"{side_path}: a decoder-only model directory must list "
                                      f"{required} among its files")
    for rel, record in side["files"].items():
        full = os.path.join(path, rel)
        if not os.path.isfile(full):
            raise ModelDirError(f"model directory {path} is incomplete: {rel} is missing")
        if os.path.getsize(full) != record.get("bytes"):
            raise ModelDirError(f"model directory {path} is corrupt: {rel} has "
                                  f"{os.path.getsize(full)} bytes, {record.get('bytes')} expected "
                                  "(truncated or replaced)")
        if sha256_file(full) != record.get("sha256"):
            raise ModelDirError(f"model directory {path} is corrupt: {rel} does not match its "
                                  f"SHA-256 in {SIDE_FILE}")
    unlisted = sorted(set(_describe(path, names_only=True)) - set(side["files"]))
    if unlisted:  # transformers reads some files by name only if they are there
        raise ModelDirError(
            f"model directory {path} holds {unlisted[0]!r}"
            + (f" (and {len(unlisted) - 1} more)" if len(unlisted) > 1 else "")
            + f", which {SIDE_FILE} does not list: rag_fast did not write it, and a tokenizer or "
            "model would read it. Remove it, or list it with `rag-fast reseal "
            f"{path}` if you added it on purpose")
    return side


def resolve_model_dir(path: str) -> str:
    """``path`` if it is a model directory, else its ``model/`` when ``path`` is the output
    directory of ``rag-fast train`` (which saves the trained model there)."""
    path = os.fspath(path)

    def is_model(folder: str) -> bool:
        return (os.path.isfile(os.path.join(folder, "config.json"))
                or os.path.lexists(os.path.join(folder, SIDE_FILE)))

    if not is_model(path) and is_model(os.path.join(path, "model")):
        return os.path.join(path, "model")
    return path


def _side_layout(path: str) -> str:
    """The ``layout`` ``rag_fast.json`` records (``"rag"`` when absent), read before the full
    check so that the right files are looked for."""
    side_path = os.path.join(path, SIDE_FILE)
    if not os.path.lexists(side_path):
        return LAYOUT_RAG
    side = _read_side_json(side_path)
    layout = side.get("layout", LAYOUT_RAG) if isinstance(side, dict) else LAYOUT_RAG
    return layout if isinstance(layout, str) else repr(layout)


def _pretrained_class(folder: str, what: str, fallback: str):
    """The ``transformers`` class a saved model's ``config.json`` names (``architectures``)."""
    import transformers

    config_path = os.path.join(folder, "config.json")
    try:
        config = read_json_file(config_path)
    except OSError as e:
        raise ModelDirError(f"{config_path}: cannot read the {what}'s config: "
                            f"{e.strerror or e}") from None
    except ValueError as e:  # not a regular file, too large, not JSON, nested too deeply
        raise ModelDirError(f"cannot read the {what}'s config: {e}") from None
    arch = (config.get("architectures") or [None])[0] if isinstance(config, dict) else None
    cls = getattr(transformers, arch, None) if isinstance(arch, str) else None
    if cls is None or not hasattr(cls, "from_pretrained"):
        if arch is not None:
            raise ModelDirError(f"{config_path}: the {what}'s architecture {arch!r} is not a "
                                  "transformers model class")
        cls = getattr(transformers, fallback)
    return cls


def _load_causal(model_class: type[RagModel], path: str, side: dict, retriever: Any,
                 overrides: dict) -> RagModel:
    """A decoder-only RagModel from the causal layout (files already verified)."""
    models = {}
    for sub, what, fallback in ((GENERATOR_DIR, "generator", "AutoModelForCausalLM"),
                                (QUESTION_ENCODER_DIR, "question_encoder", "AutoModel")):
        folder = os.path.join(path, sub)
        cls = _pretrained_class(folder, what, fallback)
        try:
            models[what] = cls.from_pretrained(folder, use_safetensors=True,
                                                 trust_remote_code=False)
        except Exception as e:  # noqa: BLE001  (whatever fails: one line)
            raise ModelDirError(f"{folder}: the {what}'s weights do not load: {e}") from None
    tokenizers = _load_tokenizers(path)
    options = {**side["options"], **overrides}
    try:
        model = model_class(models["generator"], models["question_encoder"], retriever,
                         **tokenizers, **options)
    except (TypeError, ValueError) as e:  # a key RagModel lacks, or a value it refuses
        raise ModelDirError(f"{os.path.join(path, SIDE_FILE)}: options do not fit RagModel: "
                              f"{e}") from None
    model.index_path = side.get("index")
    return model


def _rag_architecture(path: str) -> str:
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        hint = (" (a format-1 directory of an older rag_fast: load it with that version and save "
                "it again)" if os.path.isfile(os.path.join(path, "rag_fast_model.json")) else "")
        raise ModelDirError(f"{path} is not a model directory: no config.json (expected "
                              f"`rag-fast init`/`train` output or a transformers RAG folder){hint}")
    try:
        config = read_json_file(config_path)
    except ValueError as e:  # not a regular file, too large, not JSON, nested too deeply
        raise ModelDirError(str(e)) from None
    if not isinstance(config, dict):
        raise ModelDirError(f"{config_path}: not a JSON object, so not a model's config")
    arch = (config.get("architectures") or [None])[0]
    arch = arch if isinstance(arch, str) else repr(arch)
    if config.get("model_type") != "rag" or arch not in ARCHITECTURES.values():
        raise ModelDirError(
            f"{config_path}: model_type {config.get('model_type')!r} / architecture {arch!r} is "
            f"not a RAG model (expected one of {sorted(ARCHITECTURES.values())})")
    return arch


def _load_tokenizer(folder: str):
    """The tokenizer saved in ``folder``; never runs code from it (a tokenizer that needs its
    own code, an ``auto_map``, is refused)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(folder, trust_remote_code=False)
    except Exception as e:  # noqa: BLE001  (whatever fails: one line naming the folder)
        raise ModelDirError(str(unloadable("tokenizer", folder, e))) from None


def _load_tokenizers(path: str) -> dict:
    tokenizers = {}
    if not os.path.isdir(os.path.join(path, GENERATOR_TOKENIZER_DIR)) and os.path.isfile(
            os.path.join(path, "tokenizer_config.json")):  # a generator tokenizer saved beside
        tokenizers["generator_tokenizer"] = _load_tokenizer(path)
    for sub, name in ((GENERATOR_TOKENIZER_DIR, "generator_tokenizer"),
                      (QUESTION_TOKENIZER_DIR, "question_tokenizer")):
        folder = os.path.join(path, sub)
        if os.path.isdir(folder):
            tokenizers[name] = _load_tokenizer(folder)
    return tokenizers


def _generation_config(path: str):
    from transformers import GenerationConfig

    if os.path.isfile(os.path.join(path, "generation_config.json")):
        return GenerationConfig.from_pretrained(path)
    return None


def load_model_dir(
    model_class: type[RagModel],
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
        ModelDirError: not a model directory, a missing or corrupt file (named), weights that
            do not fit the config.
    """
    import transformers

    # the environment's settings, named as themselves before any file is read (RagModel checks
    # them too, where a failure would read as the saved options')
    _pool.limit_bytes()
    path = resolve_model_dir(path)
    recover_directory(path)  # a save killed between its renames left it aside
    if not os.path.isdir(path):
        raise ModelDirError(f"model directory {path!r} {not_a_folder(path)}")
    if _side_layout(path) != LAYOUT_RAG:  # decoder-only: the models side by side
        side = read_side_file(path)  # checks the layout, every file's size and SHA-256
        with quiet_transformers():
            model = _load_causal(model_class, path, side, retriever, overrides)
            model.generation_config = _generation_config(path)
        if device is not None:
            model.to(device)
        return model.eval()
    arch = _rag_architecture(path)
    side = read_side_file(path)
    with quiet_transformers():
        try:
            hf = getattr(transformers, arch).from_pretrained(path, trust_remote_code=False)
        except Exception as e:  # noqa: BLE001  (whatever fails: one line)
            raise ModelDirError(f"{path}: the weights do not load: {brief_error(e)}") from None
        tokenizers = _load_tokenizers(path)
        generation_config = _generation_config(path)
    if side is None:  # a transformers folder: settings from its RagConfig
        model = model_from_transformers(model_class, hf, retriever=retriever, **tokenizers,
                                        **overrides)
    else:
        options = {**side["options"], **overrides}
        try:
            model = model_class(hf.rag.generator, hf.rag.question_encoder, retriever,
                             **tokenizers, **options)
        except (TypeError, ValueError) as e:  # a key RagModel lacks, or a value it refuses
            raise ModelDirError(f"{os.path.join(path, SIDE_FILE)}: options do not fit "
                                  f"RagModel: {e}") from None
        model.index_path = side.get("index")
    model.generation_config = generation_config
    if device is not None:
        model.to(device)
    return model.eval()


def model_from_transformers(model_class: type[RagModel], path_or_model: Any, *,
                            retriever: Any = None, **overrides) -> RagModel:
    """A RagModel from a ``transformers`` ``RagTokenForGeneration`` /
    ``RagSequenceForGeneration`` (an instance, or a ``save_pretrained`` directory).

    Takes the generator, the question encoder, n_docs, label smoothing and
    ``exclude_bos_score`` from it, and the tokenizers when the directory holds them
    (``generator_tokenizer/``, ``question_encoder_tokenizer/`` as ``RagTokenizer`` saves them).
    With the same contexts and doc_scores, the loss equals the original model's.

    Raises:
        ModelDirError: a path without a RAG config, or a model that is not a RAG model.
    """
    from transformers import RagSequenceForGeneration, RagTokenForGeneration

    if isinstance(path_or_model, (str, os.PathLike)):
        return load_model_dir(model_class, os.fspath(path_or_model), retriever=retriever,
                              **overrides)
    hf = path_or_model
    if not isinstance(hf, (RagTokenForGeneration, RagSequenceForGeneration)):
        raise ModelDirError(f"expected a RagTokenForGeneration or RagSequenceForGeneration, "
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
    model = model_class(hf.rag.generator, hf.rag.question_encoder, retriever, **options)
    model.generation_config = getattr(hf, "generation_config", None)
    return model
