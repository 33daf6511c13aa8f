"""A training run from its JSON config file: reading and checking the file, and running it.

This is the library behind ``rag-fast train`` (:mod:`rag_fast.cli.train`); its errors name the
file and key, and the command-line options that can stand in for them.

The config file (paths in it are relative to the file's own folder)::

    {
      "model": "model0",                    a model directory (`rag-fast init`), or
                                            {"path": DIR, <RagModel option>: value, ...}
                                            ("path" may be left out when --model gives it)
      "index": "kb",                        an index directory (default: the model's own), or
                                            {"path": DIR, "verify": bool, "mode": "dense" |
                                            "bm25" | "hybrid" | "weighted"} ("path" may be
                                            left out when --index gives it; "mode": how
                                            passages are picked, all but dense needing an
                                            index built with --bm25, the prior staying the
                                            dense score), or a
                                            sharded index:
                                            {"path": "kb.staging", "sharded": true,
                                             "preset": "exact", "cache": false} (the staging
                                            directory that `rag-fast index build --shard i/n`
                                            leaves; under torchrun with n processes, rank r
                                            loads shard r; cache: save each shard's built
                                            index there and reuse it on later runs)
      "data": {"train": "train.jsonl",      JSONL {"question", "answers"} (or TSV) files;
               "eval": "dev.jsonl"},        eval is optional (needs train.eval_every > 0)
      "train": {<TrainConfig field>: value, ...},
      "resume": true                        continue from output_dir's checkpoint if present
    }

``--model``, ``--index``, ``--output-dir`` and ``--device`` on the command line replace the
config's (relative to the current folder); the other options of the file's ``model`` and
``index`` sections still apply. ``--set KEY=VALUE`` (and the short flags ``--max-steps``,
``--lr``, ``--micro-batch-size``, ``--seed``) set any value by its dotted key path before the
file is checked (:func:`apply_overrides`); an error about such a value names the option
instead of the file. The run writes into ``output_dir``: the resumable
``checkpoint-last.pt`` (verified on resume; refused when its run started from another
model directory or from other weights in this one), ``metrics.jsonl`` (loss, learning rate and speed
per logged step, eval metrics), ``training.png`` (their plot) and, at the end, the trained
model directory ``model/`` (which ``rag-fast eval`` and ``generate`` take). With
``train.refresh_index_every`` (an index directory, not a sharded one) it also writes
``index/``, the passages with the index of the last refresh, and ``model/`` records it.

Under ``torchrun`` each process joins one group (nccl when the model trains on a GPU, gloo on
the CPU) with the model on its own device, and trains its slice of every global batch.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import time
import warnings

import torch.distributed as dist

from rag_fast._defaults import RETRIEVAL_MODES
from rag_fast._validation import IMPLS, not_a_file
from rag_fast.evaluation import evaluate, load_qa
from rag_fast.evaluation.data import fields_read
from rag_fast.models import RagModel
from rag_fast.models.checkpoint import SIDE_FILE, resolve_model_dir
from rag_fast.models.options import LM_HEAD_LOSSES, MODES, POOLINGS, check_arguments
from rag_fast.models.retriever_io import TimedRetriever, load_retriever, load_sharded_retriever
from rag_fast.storage import check_apart, output_lock
from rag_fast.training import Trainer, TrainConfig, rag_collate, rag_loss
from rag_fast.training.distributed import init_from_env
from rag_fast.training.refresh import export_index_directory
from rag_fast.training.checkpoint import check_run_folder
from rag_fast.training.trainer import resolve_device

TOP_LEVEL = {
    "model": "model directory (str) or {'path': DIR, RagModel options...} ('path' optional "
             "with --model)",
    "index": "index directory (str) or {'path': DIR, 'verify': bool, 'mode': str, "
             "'sharded': bool, 'preset': str, 'cache': bool} ('path' optional with --index)",
    "data": "{'train': FILE, 'eval': FILE}",
    "train": "TrainConfig fields (object)",
    "resume": "true / false",
}
MODEL_OPTIONS = ("n_docs", "epsilon", "mode", "exclude_bos", "max_context_length",
                 "max_question_length", "loss_impl", "lm_head_loss", "question_pooling",
                 "normalize_questions", "lean_activations")
# where a section's "path" can come from instead
_FLAGS = {"model": "--model", "index": "--index"}


_NULL = object()  # a key the file gives as JSON null (None also stands for a missing key)
# the keys whose values are paths: relative to the current folder when a --set gives them
_PATH_KEYS = ("model.path", "index.path", "data.train", "data.eval", "train.output_dir")


class _Where:
    """What an error about a config key names as its source: the file, or the command-line
    option that set the key (``overrides``: dotted key -> option, e.g. ``"train.lr"`` ->
    ``"--set train.lr=fast"``)."""

    def __init__(self, path: str, overrides: dict[str, str] | None = None) -> None:
        self.path, self.overrides = path, dict(overrides or {})

    def __call__(self, *keys: str) -> str:
        """The source of ``keys`` (dotted), the first one an option set winning: that option
        (it set the key, or a section holding it); else the file, ``with`` the options that
        set keys inside the first key's section."""
        for key in keys:
            for set_key, option in reversed(self.overrides.items()):
                # it set the key, a section holding it, or (below a section) a key inside it
                # (`--set train.foo.bar=1` made the unknown option `train.foo`)
                if key == set_key or key.startswith(set_key + ".") or (
                        "." in key and set_key.startswith(key + ".")):
                    return option
        inside = [option for set_key, option in self.overrides.items()
                  if keys and set_key.startswith(keys[0] + ".")]
        return f"{self.path} with {', '.join(inside)}" if inside else self.path


def _fail(path: str, key: str, expected: str, got=None) -> ValueError:
    """``FILE: KEY: expected WHAT, got VALUE``; ``got``: None says nothing (a missing key),
    :data:`_NULL` says ``null``."""
    tail = "" if got is None else ", got null" if got is _NULL else f", got {got!r}"
    return ValueError(f"{path}: {key}: expected {expected}{tail}")


def _from_here(key: str, value):
    """A value a --set gives at ``key``, its paths made absolute (relative to the current
    folder, as the command line's other paths are; the file's own are relative to its folder)."""
    def rebased(path):
        return os.path.abspath(path) if isinstance(path, str) and path else path

    if key in _PATH_KEYS:
        return rebased(value)
    if key in ("model", "index"):
        if isinstance(value, str):
            return rebased(value)
        if isinstance(value, dict) and "path" in value:
            return {**value, "path": rebased(value["path"])}
    if key in ("data", "train") and isinstance(value, dict):
        return {k: _from_here(f"{key}.{k}", v) for k, v in value.items()}
    return value


def apply_overrides(config: dict, overrides) -> dict[str, str]:
    """Set each ``(key, value, option)`` of ``overrides`` in the config file's object, in
    order (a later one wins): ``key`` a dotted path (``"train.lr"``, ``"model.n_docs"``,
    ``"data.train"``, ``"resume"``), ``option`` what set it (``"--set train.lr=1e-4"``, named
    in errors). Missing sections are created; a ``model`` or ``index`` given as a directory
    string stands for ``{"path": DIR}``, so ``model.n_docs`` can be set on it. Paths a value
    gives are relative to the current folder. The values are checked afterwards, with the
    file's (:func:`load_config`).

    Returns:
        dotted key -> the option that set it last.

    Raises:
        ValueError: naming the option: an empty key part, or a key under a value that is not
            an object (``train.lr.x``).
    """
    where: dict[str, str] = {}
    for key, value, option in overrides:
        parts = key.split(".")
        if not all(parts):
            raise ValueError(f"{option}: {key!r} is not a key path: expected names joined by "
                             "dots, such as train.lr or model.n_docs")
        node, walked = config, []
        for part in parts[:-1]:
            walked.append(part)
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            elif isinstance(child, str) and walked in (["model"], ["index"]):
                child = node[part] = {"path": child}  # the directory string, as a section
            elif not isinstance(child, dict):
                raise ValueError(
                    f"{option}: {'.'.join(walked)} is {json.dumps(child)}, not an object, so "
                    f"it has no key {'.'.join(parts[len(walked):])!r}")
            node = child
        node[parts[-1]] = _from_here(key, value)
        where = {k: v for k, v in where.items() if not k.startswith(key + ".")}
        where[key] = option
    return where


def _given(value):
    """A value read from a key the file has: JSON null as :data:`_NULL`, for :func:`_fail`."""
    return _NULL if value is None else value


def _relative(base: str, value: str) -> str:
    return value if os.path.isabs(value) else os.path.normpath(os.path.join(base, value))


def _directory_section(value, key: str, allowed: tuple, expected: str, where: _Where,
                       base: str, given: str | None = None):
    """``"DIR"`` or ``{"path": DIR, option: value}`` -> the dict form with ``path`` made relative
    to the config's folder; None stays None.

    ``given``: the directory the command line names (``--model`` / ``--index``, relative to the
    current folder). It replaces the file's ``path``, which the section may then leave out; the
    section's other options still apply.
    """
    if isinstance(value, str):
        value = {"path": value}
    if value is None:
        return None if given is None else {"path": given}
    if not isinstance(value, dict):
        raise _fail(where(key), key, expected, value)
    bad = sorted(set(value) - set(allowed))
    if bad:
        raise ValueError(f"{where(f'{key}.{bad[0]}')}: {key}.{bad[0]}: unknown option "
                         f"(expected one of {', '.join(allowed)})")
    if given is not None:
        return {**value, "path": given}
    if "path" not in value:
        raise ValueError(f"{where(key)}: {key}: no \"path\": set it in the file (the {key} "
                         f"directory) or pass {_FLAGS[key]} DIR")
    if not isinstance(value["path"], str):
        raise _fail(where(f"{key}.path"), f"{key}.path", f"a {key} directory (a string)",
                    value["path"])
    return {**value, "path": _relative(base, value["path"])}


def _model_option_words() -> dict[str, str]:
    """RagModel option -> what the config's ``model`` section must give, in JSON's words."""
    positive, flag = "a positive integer", "true or false"
    return {
        "n_docs": positive, "epsilon": "a number in [0, 1]", "mode": _one_of(MODES),
        "exclude_bos": flag, "max_context_length": positive, "max_question_length": positive,
        "loss_impl": _one_of(IMPLS), "lm_head_loss": _one_of(LM_HEAD_LOSSES),
        "question_pooling": _one_of(POOLINGS), "normalize_questions": flag,
        "lean_activations": flag,
    }


def _one_of(values) -> str:
    return "one of " + ", ".join(values)


def _check_model_options(model: dict | None, where: _Where) -> None:
    """Every RagModel option of the ``model`` section has a value RagModel takes (its own
    checks, ``check_arguments``); else a ValueError names the file (or the option that set it)
    and ``model.KEY`` (before any model is loaded)."""
    words = _model_option_words()
    for key, value in (model or {}).items():
        if key in MODEL_OPTIONS:
            try:
                check_arguments(**{key: value})
            except ValueError:
                raise _fail(where(f"model.{key}"), f"model.{key}", words[key],
                            _given(value)) from None


def load_config(path: str, model: str | None = None, index: str | None = None,
                overrides=()) -> dict:
    """Read and check a training config; paths become relative to the current folder.

    ``model`` / ``index``: the directories ``--model`` / ``--index`` name (relative to the current
    folder); they replace the file's ``path`` of that section, which may then leave it out.
    ``overrides``: ``(dotted key, value, option)`` triples set in the file's object before it
    is checked (:func:`apply_overrides`); the result's ``"overrides"`` maps each key to the
    option that set it, for :func:`run_training`'s messages.

    Raises:
        FileNotFoundError: no such file.
        ValueError: invalid JSON (with its line), an unknown key, a value of the wrong type
            (named as ``FILE: section.key: expected ...``, or ``OPTION: section.key: ...`` for
            a value an override set; RagModel options included), or a ``model`` / ``index``
            section without ``"path"`` that the command line does not give.
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"config file {path}: {not_a_file(path)}")
    with open(path, "rb") as f:
        data = f.read()
    try:  # (a BOM at the start is dropped)
        config = json.loads(data.decode("utf-8-sig"), object_pairs_hook=_no_repeats)
    except _RepeatedKey as e:  # which value was meant is not known: not the last, silently
        raise ValueError(f"{path}: key {e.args[0]!r} appears twice in one object; keep one"
                         ) from None
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        raise ValueError(f"{path}:{line}: not valid UTF-8 (byte offset {e.start}); expected a "
                         "UTF-8 JSON file") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e.msg}, line {e.lineno})") from None
    except (RecursionError, ValueError) as e:  # nested too deeply, a number too long
        raise ValueError(f"{path}: not a config rag_fast can read "
                         f"({type(e).__name__}: {' '.join(str(e).split())[:120]})") from None
    if not isinstance(config, dict):
        raise _fail(path, "(top level)", "a JSON object", type(config).__name__)
    set_by = apply_overrides(config, overrides)
    where = _Where(path, set_by)
    unknown = sorted(set(config) - set(TOP_LEVEL))
    if unknown:
        raise ValueError(f"{where(unknown[0])}: unknown key {unknown[0]!r} (expected: "
                         f"{', '.join(TOP_LEVEL)})")
    base = os.path.dirname(os.path.abspath(path))
    out = {"resume": config.get("resume", True)}
    if not isinstance(out["resume"], bool):
        raise _fail(where("resume"), "resume", "true or false", _given(out["resume"]))

    out["model"] = _directory_section(config.get("model"), "model", ("path", *MODEL_OPTIONS),
                                      "a model directory or {'path': DIR, ...}", where, base,
                                      given=model)
    _check_model_options(out["model"], where)
    out["index"] = _directory_section(config.get("index"), "index",
                                      ("path", "verify", "mode", "sharded", "preset", "cache"),
                                      "an index directory or {'path': DIR, 'verify': bool, "
                                      "'mode': str, 'sharded': bool, 'preset': str, "
                                      "'cache': bool}", where,
                                      base, given=index)
    index = out["index"] or {}
    for key in ("verify", "sharded", "cache"):
        if key in index and not isinstance(index[key], bool):
            raise _fail(where(f"index.{key}"), f"index.{key}", "true or false",
                        _given(index[key]))
    for key in ("preset", "cache"):
        if key in index and not index.get("sharded"):
            raise ValueError(f"{where(f'index.{key}', 'index.sharded')}: index.{key}: only for "
                             "a sharded index (\"sharded\": true); an index directory has its "
                             "index built already")
    if "mode" in index:
        if index["mode"] not in RETRIEVAL_MODES:
            raise _fail(where("index.mode"), "index.mode", " or ".join(RETRIEVAL_MODES),
                        _given(index["mode"]))
        if index.get("sharded") and index["mode"] != "dense":
            raise ValueError(f"{where('index.mode', 'index.sharded')}: index.mode "
                             f"{index['mode']!r}: a sharded index searches dense only")
    if "preset" in index:
        if not isinstance(index["preset"], str) or not index["preset"]:
            raise _fail(where("index.preset"), "index.preset",
                        "a preset name or faiss factory string", index["preset"])

    data = config.get("data")
    if not isinstance(data, dict) or not isinstance(data.get("train"), str):
        raise _fail(where("data", "data.train"), "data",
                    "{'train': FILE, 'eval': FILE (optional)}", data)
    bad = sorted(set(data) - {"train", "eval"})
    if bad:
        raise ValueError(f"{where(f'data.{bad[0]}')}: data.{bad[0]}: unknown key (expected "
                         "train, eval)")
    if data.get("eval") is not None and not isinstance(data["eval"], str):
        raise _fail(where("data.eval"), "data.eval", "a file path", data["eval"])
    out["data"] = {k: _relative(base, v) for k, v in data.items() if v is not None}

    train = config.get("train", {})
    if not isinstance(train, dict):
        raise _fail(where("train"), "train", "an object of TrainConfig fields", train)
    train = dict(train)
    if train.get("output_dir") == "":
        source = where("train.output_dir")
        relative = "the config file's folder" if source == path else "the current folder"
        raise _fail(source, "train.output_dir", f"a folder path (relative to {relative}) or "
                    "null", "")
    if isinstance(train.get("output_dir"), str):
        train["output_dir"] = _relative(base, train["output_dir"])
    out["train"] = train
    out["overrides"] = set_by
    return out


_TRAIN_FIELDS = sorted((name for name, *_ in TrainConfig.schema()), key=len, reverse=True)


def train_config(values: dict, path: str, overrides: dict[str, str] | None = None):
    """TrainConfig of the ``train`` section; errors name the file and ``train.KEY``, or the
    option that set the key (``overrides``: dotted key -> option, as :func:`load_config`
    returns them)."""
    try:
        return TrainConfig.from_dict(values)
    except (TypeError, ValueError) as e:
        text = str(e)
        # the fields the message is about: the one it starts with, unknown ones, those it names
        keys = [name for name in _TRAIN_FIELDS if text.startswith(name + " ")]
        unknown = sorted(str(k) for k in values if k not in _TRAIN_FIELDS)
        keys += unknown
        if not unknown:  # (a message about unknown keys lists every known one: not about them)
            keys += [name for name in _TRAIN_FIELDS if re.search(rf"\b{name}\b", text)]
        where = _Where(path, overrides)(*(f"train.{k}" for k in keys), "train")
        raise ValueError(f"{where}: train: {e}") from None


def run_origin(model_dir: str) -> dict | None:
    """What a run starts from, saved in each checkpoint (Trainer's ``origin``): the SHA-256 of
    the model directory's ``rag_fast.json``, which holds every other file's (the same weights
    under another path, mount or symlink are the same origin), and the path, for messages."""
    path = os.path.join(model_dir, SIDE_FILE)
    if not os.path.isfile(path):  # a bare transformers folder: nothing to compare
        return None
    with open(path, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    return {"id": f"{SIDE_FILE} sha256 {digest}", "model": os.path.abspath(model_dir)}


def section_retriever(spec: dict | None, n_docs: int = 5, n_docs_from: str | None = None):
    """The retriever of the config's ``index`` section, or None.

    ``{"path": DIR, "verify": bool}``: a Retriever over an index directory. With
    ``"sharded": true``, DIR is the staging directory of ``rag-fast index build --shard i/n``
    and the result a ShardedRetriever: collective, call it on every rank of the initialised
    process group (n ranks; rank r loads shard r, its index built with ``preset``).
    """
    if not spec:
        return None
    verify = bool(spec.get("verify", True))
    if spec.get("sharded"):
        return load_sharded_retriever(spec["path"], n_docs=n_docs, verify=verify,
                                      preset=spec.get("preset", "exact"),
                                      cache=bool(spec.get("cache", False)))
    return load_retriever(spec["path"], n_docs=n_docs, verify=verify, n_docs_from=n_docs_from,
                          mode=spec.get("mode", "dense"), mode_flag="index.mode")


def run_training(config: dict, path: str, output_flag: str | None = None):
    """Run the training a checked config (:func:`load_config`) describes and save the trained
    model directory ``OUTPUT_DIR/model``; return the final TrainState.

    ``path``: the config file, named in errors. ``output_flag``: what set ``output_dir``, named
    in errors about it (default ``PATH: train.output_dir``). Before the model, the index or the
    data are read, the output folder is checked to be apart from every input and only ever
    empty or one of ``rag-fast train``'s runs, which the run resumes when ``resume`` is set.
    Under ``torchrun`` each process joins the group; lines on resuming and the result are
    printed by rank 0.
    """
    overrides = config.get("overrides") or {}
    where = _Where(path, overrides)
    with warnings.catch_warnings(record=True) as said:  # said once the output is checked:
        warnings.simplefilter("always")                # a refused output is one line
        tc = train_config(config["train"], path, overrides)
    if config["model"] is None:
        raise ValueError(f"{path}: no model: set \"model\" or pass --model DIR")
    if not tc.output_dir:
        raise ValueError(f"{path}: train.output_dir is not set (or pass --output-dir DIR)")
    # before the model, the index or the data are read: the run's folder apart from every input,
    # and only ever empty or one of rag-fast train's runs (which it resumes)
    flag = output_flag or f"{where('train.output_dir')}: train.output_dir"
    index_path = (config["index"] or {}).get("path")
    check_apart(tc.output_dir, flag, {
        "--config": path, "the model": (config["model"] or {}).get("path"),
        "the index": index_path, "data.train": config["data"].get("train"),
        "data.eval": config["data"].get("eval")})
    # one writer at a time (under torchrun, rank 0 holds the lock for the job)
    lock = (output_lock(tc.output_dir, flag) if os.environ.get("RANK", "0") == "0"
            else contextlib.nullcontext())
    with lock:
        return _run_checked(config, path, tc, flag, said)


def _run_checked(config: dict, path: str, tc: TrainConfig, flag: str, said=()):
    """:func:`run_training` once the output is apart from the inputs and locked; ``said``:
    the config's warnings, given once the run's folder is checked."""
    where = _Where(path, config.get("overrides") or {})
    check_run_folder(tc.output_dir, flag)
    for w in said:
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    for key, file in config["data"].items():  # before the model and the index are loaded
        if not os.path.isfile(file):
            problem = "is not a file" if os.path.exists(file) else "dataset file not found:"
            problem_at = f"{file} {problem}" if os.path.exists(file) else f"{problem} {file}"
            source = where(f"data.{key}")
            read_from = ("the config file's folder" if source == path else
                         "the current folder, as the command line gives it")
            raise ValueError(f"{source}: data.{key}: {problem_at} (a relative path is read "
                             f"from {read_from})")

    device = resolve_device(tc.device)
    init_from_env(device)
    spec = dict(config["model"])
    model_dir = resolve_model_dir(spec.pop("path"))
    model = RagModel.load(model_dir, **spec)
    index = config["index"]
    if index is None and model.index_path:
        index = {"path": model.index_path}
        check_apart(tc.output_dir, flag, {"the index the model records": model.index_path})
    if index is None:
        raise ValueError(f"{path}: no index: the model records none; set \"index\" or "
                         "pass --index DIR (an index directory from `rag-fast index build`)")
    if index.get("sharded") and not dist.is_initialized():
        raise ValueError(f"{where('index.sharded')}: index.sharded: a sharded index needs one "
                         "process per shard: run under torchrun (--nproc-per-node = the number "
                         "of shards)")
    n_docs_from = (f"{where('model.n_docs')}: model.n_docs, the config's" if "n_docs" in spec
                   else f"the model {model_dir!r}")  # (the config's or --set's, or the model's)
    retriever = section_retriever(index, model.n_docs, n_docs_from=n_docs_from)
    if not index.get("sharded"):
        retriever = TimedRetriever(retriever)  # retrieval_s per step in metrics.jsonl
    model.retriever = retriever
    model.to(device).train()

    train_data = load_qa(config["data"]["train"])
    say = os.environ.get("RANK", "0") == "0"  # rank 0 says what it read
    if say:
        print(f"data.train: {fields_read(config['data']['train'], train_data)}")
    eval_fn = None
    if config["data"].get("eval"):
        eval_data = load_qa(config["data"]["eval"])
        if say:
            print(f"data.eval: {fields_read(config['data']['eval'], eval_data)}")
        eval_fn = lambda m: evaluate(m, eval_data, progress=False).metrics  # noqa: E731
    trainer = Trainer(model, train_data, rag_collate(model), rag_loss, tc, eval_fn,
                      origin=run_origin(model_dir))
    if config["resume"] and trainer.resume():
        print(f"resumed from step {trainer.state.step} ({trainer.checkpoint_path()})")
    first_step = trainer.state.step
    start = time.perf_counter()
    state = trainer.train()
    if trainer.rank == 0:
        final = os.path.join(tc.output_dir, "model")
        # a sharded staging directory is not an index directory `rag-fast eval` can open: the
        # model keeps the index it recorded before (if any)
        recorded = None if index.get("sharded") else index["path"]
        if recorded is not None and trainer.refresher is not None and state.refreshed_at:
            # the index of the trained encoder (the last refresh), not the stale starting one
            recorded = str(export_index_directory(  # with the BM25 part trained with
                retriever.store, trainer.refresher._path(state.refreshed_at),
                os.path.join(tc.output_dir, "index"), lexical=getattr(retriever, "lexical",
                                                                       None)))
        model.save(final, index=recorded)
        summary = f"loss {state.last_loss:.4f} per question"
        if trainer.last_token_loss is not None:
            summary += f", {trainer.last_token_loss:.4f} per token"
        if state.evals:
            step, metrics = state.evals[-1]
            summary += f"; eval at step {step}: " + ", ".join(
                f"{k} {v:.3f}" if isinstance(v, (int, float)) else f"{k} {v}"
                for k, v in metrics.items())
        done = (f"trained {state.step} steps" if first_step == 0 else
                f"trained {state.step - first_step} steps (from step {first_step} to {state.step})")
        files = [f"{name}: {os.path.join(tc.output_dir, path)}" for name, path in
                 (("metrics", tc.metrics_file), ("plot", tc.plot_file)) if path]
        print(f"{done} in {time.perf_counter() - start:.0f} s ({summary}); "
              f"model: {final}" + (f"  ({', '.join(files)})" if files else ""))
    return state


class _RepeatedKey(Exception):
    pass


def _no_repeats(pairs: list) -> dict:
    """A JSON object as a dict, refusing a key it holds twice (json keeps the last)."""
    out = {}
    for key, value in pairs:
        if key in out:
            raise _RepeatedKey(key)
        out[key] = value
    return out


def schema_help() -> str:
    """The config file's sections and the ``train`` section's fields, as ``rag-fast train
    --help`` ends with them."""
    lines = ["config file (JSON; paths relative to its folder):"]
    lines += [f"  {k:<8} {v}" for k, v in TOP_LEVEL.items()]
    lines.append("train (TrainConfig) fields:")
    for name, kind, default, text in TrainConfig.schema():
        lines.append(f"  {name:<24} {kind:<14} default {default!r:<16} {text}")
    lines.append("example: examples/workflow/train.json")
    return "\n".join(lines)
