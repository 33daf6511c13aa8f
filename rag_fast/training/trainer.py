"""The training loop: AdamW with warm-up and decay, autocast, accumulation, clipping, gradient
checkpointing, progress, periodic evaluation, resumable checkpoints and data parallelism.

Determinism is the design rule, so that a resumed run and a data-parallel run reach the same
parameters as a single uninterrupted one:

* the data order of epoch e is ``randperm(n, seed + e)``; a step takes the next
  ``global_batch = micro_batch * grad_accum * world_size`` examples, rank r getting its own
  contiguous slice of each micro-batch (so the union over ranks is the single-process batch);
* each micro-batch loss is a mean over its examples, scaled by ``1 / grad_accum``; DDP averages
  the gradients over ranks, which is the mean over the global batch;
* a checkpoint (written atomically after a step) holds the model, optimizer, scheduler, grad
  scaler, step, data position and every RNG state, restored exactly on resume.

Checkpoints are safe to load and verified. ``checkpoint-last.pt`` holds only tensors and plain
containers and is read with ``torch.load(weights_only=True)``: everything else (TrainState, the
config, the Python and NumPy RNG states) is a JSON string inside it. ``checkpoint-last.json``,
its manifest, records the payload's size and SHA-256, checked before loading. Both are written
to temporaries in the same folder, fsynced and renamed, the manifest last; a save killed between
the two renames is completed on resume from the fsynced temporary manifest.

Rank 0 also appends logged steps and evaluations to ``metrics.jsonl`` and draws ``training.png``
at the end (both in ``output_dir``; see TrainConfig). When the model's retriever keeps its time
(``retrieval_seconds``), each logged line also has ``step_s`` and ``retrieval_s`` (mean seconds
per step since the previous line, and the retrieval part of it).

A collective retriever (``model.retriever.collective``: a sharded index over the process group,
see ``rag_fast.retrieval.sharded.ShardedRetriever``) is searched by every rank in each forward
pass, on the default group DDP uses too (every rank issues the same collectives in the same
order), and evaluation then runs on every rank (docs/distributed.md).

With ``refresh_index_every`` the passages are re-embedded by the current encoder and the
rebuilt index swapped in on every rank after every N-th step and the last one; the step of the index in use
(``TrainState.refreshed_at``) is checkpointed and its index reopened on resume (see
``rag_fast.training.refresh``).
"""
from __future__ import annotations

import contextlib
import difflib
import glob
import json
import math
import os
import random
import re
import time
import warnings
from dataclasses import MISSING, asdict, dataclass, field, fields
from numbers import Integral, Real
from typing import IO, Any, Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from rag_fast.storage import atomic_write, disk_errors, fsync_dir, sha256_file
from rag_fast.training.refresh import REFRESH_ENCODERS, IndexRefresher, question_encoder_embedder

PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
SCHEDULES = ("linear", "cosine", "constant")
CHECKPOINT = "checkpoint-last.pt"
CHECKPOINT_MANIFEST = "checkpoint-last.json"
CHECKPOINT_FORMAT = "rag_fast.training-checkpoint/1"
_PAYLOAD_KEYS = {"format", "model", "optimizer", "scheduler", "scaler", "rng_torch", "rng_cuda",
                 "meta"}
_META_KEYS = {"state", "config", "world_size", "rng_python", "rng_numpy"}
_OPTIONAL_META = {"origin"}  # what the run started from (Trainer's origin=), when given


class CheckpointError(ValueError):
    """A training checkpoint that cannot be resumed from: corrupt, truncated, without its
    manifest, holding objects other than tensors and plain data, or not fitting the model."""


def _option(default: Any, help: str) -> Any:
    """A TrainConfig field: its default and one-line help (see TrainConfig.schema)."""
    if isinstance(default, dict):
        return field(default_factory=lambda: dict(default), metadata={"help": help})
    return field(default=default, metadata={"help": help})


@dataclass
class TrainConfig:
    """Training options (all JSON-serialisable; ``rag-fast train --config`` reads them).

    Each field's help is in its metadata; :meth:`schema` lists them.

    Raises:
        ValueError: a value of the wrong type or out of range, naming the field and what was
            expected.
    """

    max_steps: int = _option(1000, "optimizer steps to train for")
    micro_batch_size: int = _option(8, "examples per process per forward pass")
    grad_accum: int = _option(1, "micro-batches per optimizer step")
    lr: float = _option(3e-5, "peak learning rate")
    weight_decay: float = _option(0.0, "AdamW weight decay of matrices (not biases or norms)")
    betas: tuple[float, float] = _option((0.9, 0.999), "AdamW betas")
    adam_eps: float = _option(1e-8, "AdamW epsilon")
    warmup_steps: int = _option(0, "steps of linear warm-up to lr (at most max_steps)")
    schedule: str = _option("linear", "decay after warm-up: linear | cosine | constant")
    max_grad_norm: float | None = _option(1.0, "gradient clipping norm; None: no clipping")
    precision: str = _option("fp32", "fp32 | bf16 | fp16 (autocast; fp16 with a grad scaler)")
    gradient_checkpointing: bool = _option(
        False, "recompute the generator's activations in the backward pass (less memory)")
    seed: int = _option(0, "seed of the data order and of the Python, NumPy and torch RNGs")
    output_dir: str | None = _option(
        None, "checkpoints, metrics and plot go here; None: nothing is written")
    checkpoint_every: int = _option(0, "steps between checkpoints; 0: only at the end")
    eval_every: int = _option(0, "steps between evaluations; 0: never")
    log_every: int = _option(10, "steps between loss records (history, metrics); 0: every step")
    progress: bool = _option(True, "show a progress bar (rank 0)")
    find_unused_parameters: bool = _option(True, "DDP's find_unused_parameters")
    freeze_question_encoder: bool = _option(
        False, "do not train the model's question_encoder (requires_grad off, not optimized)")
    question_encoder_lr: float | None = _option(
        None, "learning rate of the question_encoder's parameters; None: lr")
    metrics_file: str | None = _option(
        "metrics.jsonl", "JSON line per logged step and per eval, in output_dir; None: none")
    plot_file: str | None = _option(
        "training.png", "PNG of loss and eval metrics vs step, in output_dir; None: none")
    device: str | None = _option(
        None, "where the model trains: cpu, cuda, cuda:N; None = cuda:LOCAL_RANK if CUDA is "
              "available else cpu")
    refresh_index_every: int = _option(
        0, "steps between index refreshes (and one after the last step): re-embed the passages "
           "with refresh_encoder and swap the rebuilt index in (docs/distributed.md); 0: never")
    refresh_encoder: str = _option(
        "question_encoder", "what re-embeds the passages at a refresh: question_encoder (the "
                            "model's, as trained so far)")
    extra: dict = _option({}, "free-form JSON for your own code (the Trainer ignores it)")

    def __post_init__(self) -> None:
        for f in fields(self):
            setattr(self, f.name, _coerce(f.name, getattr(self, f.name), str(f.type)))
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {tuple(PRECISIONS)}, got {self.precision!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        for name in ("max_steps", "micro_batch_size", "grad_accum"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        for name in ("checkpoint_every", "eval_every", "log_every", "lr", "weight_decay",
                     "refresh_index_every"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        if not 0 <= self.seed <= 2**32 - 1:  # np.random.seed takes no other value
            raise ValueError(f"seed must be an int in [0, 2**32 - 1] (NumPy's seed range), "
                             f"got {self.seed!r}")
        if self.refresh_encoder not in REFRESH_ENCODERS:
            raise ValueError(f"refresh_encoder must be one of {REFRESH_ENCODERS}, got "
                             f"{self.refresh_encoder!r}")
        if self.warmup_steps < 0 or self.warmup_steps > self.max_steps:
            raise ValueError(f"warmup_steps must be in [0, max_steps], got {self.warmup_steps}")
        if self.adam_eps <= 0:
            raise ValueError(f"adam_eps must be > 0, got {self.adam_eps!r}")
        if not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"betas must both be in [0, 1), got {list(self.betas)}")
        if self.max_grad_norm is not None and self.max_grad_norm <= 0:
            raise ValueError(f"max_grad_norm must be > 0 or None, got {self.max_grad_norm!r}")
        if self.question_encoder_lr is not None and self.question_encoder_lr < 0:
            raise ValueError(f"question_encoder_lr must be >= 0 or None, got "
                             f"{self.question_encoder_lr!r}")
        if self.freeze_question_encoder and self.question_encoder_lr is not None:
            raise ValueError("question_encoder_lr must be None when freeze_question_encoder is "
                             "true (a frozen question encoder is not optimized)")
        for name in ("output_dir", "metrics_file", "plot_file"):
            value = getattr(self, name)
            if value is None:
                continue
            if not value.strip():  # "" is not the current folder: say where, or None
                raise ValueError(f"{name} must be a non-empty path or None, got {value!r}")
            if "\0" in value:
                raise ValueError(f"{name} must be a path without NUL characters, got {value!r}")
            try:
                os.fsencode(value)
            except UnicodeEncodeError:
                raise ValueError(f"{name} is not a valid path (not valid Unicode: a lone "
                                 f"surrogate), got {value!r}") from None
        if self.plot_file is not None and not self.plot_file.lower().endswith(".png"):
            raise ValueError(f"plot_file must end in .png (a PNG is written), got "
                             f"{self.plot_file!r}")
        if self.device is not None:
            try:
                torch.device(self.device)
            except (RuntimeError, ValueError):
                raise ValueError(f"device must be cpu, cuda, cuda:N or None, got "
                                 f"{self.device!r}") from None
        try:
            json.dumps(self.extra, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise ValueError(f"extra must be JSON-serialisable, got {self.extra!r} ({e})") from None

    @classmethod
    def from_dict(cls, values: dict) -> "TrainConfig":
        """The config of a JSON object (``rag-fast train``'s ``"train"`` section).

        Raises:
            ValueError: not a dict; unknown keys (named, with the known ones); a value of the
                wrong type or out of range (naming the key and what was expected).
        """
        if not isinstance(values, dict):
            raise ValueError(f"training options must be a JSON object, got "
                             f"{type(values).__name__}")
        known = [f.name for f in fields(cls)]
        unknown = sorted(str(k) for k in set(values) - set(known))
        if unknown:
            close = {k: difflib.get_close_matches(k, known, n=1) for k in unknown}
            named = ", ".join(f"{k!r} (did you mean {m[0]!r}?)" if m else repr(k)
                              for k, m in close.items())
            listed = "" if all(close.values()) else f"; known: {', '.join(sorted(known))}"
            raise ValueError(f"unknown training option{'s' if len(unknown) > 1 else ''} "
                             f"{named}{listed}")
        return cls(**values)

    @classmethod
    def schema(cls) -> list[tuple[str, str, Any, str]]:
        """``(name, type, default, help)`` of every option in declaration order, e.g.
        ``("max_grad_norm", "float | None", 1.0, "gradient clipping norm; None: no clipping")``
        (for ``rag-fast train --help`` and the README)."""
        return [(f.name, str(f.type), f.default_factory() if f.default is MISSING else f.default,
                 f.metadata["help"]) for f in fields(cls)]


_TYPE_WORDS = {"int": "an int", "float": "a float", "bool": "a bool (true or false)",
               "str": "a str", "dict": "a dict (a JSON object)",
               "tuple[float, float]": "a pair of floats"}


def _coerce(name: str, value: Any, annotation: str) -> Any:
    """``value`` as the plain type of TrainConfig's ``annotation`` (``"float | None"``...).

    Ints pass as floats; bools never pass as numbers; paths become str.

    Raises:
        ValueError: naming ``name``, the expected type and the value.
    """
    kind, *rest = [k.strip() for k in annotation.split("|")]
    if value is None and "None" in rest:
        return None
    is_bool = isinstance(value, (bool, np.bool_))
    if kind == "bool" and is_bool:
        return bool(value)
    if kind == "int" and isinstance(value, Integral) and not is_bool:
        return int(value)
    if kind == "float" and isinstance(value, Real) and not is_bool and math.isfinite(value):
        return float(value)
    if kind == "str" and isinstance(value, (str, os.PathLike)):
        return str(os.fspath(value))
    if kind == "dict" and isinstance(value, dict):
        return value
    if (kind == "tuple[float, float]" and isinstance(value, (list, tuple)) and len(value) == 2
            and all(isinstance(v, Real) and not isinstance(v, bool) for v in value)):
        return tuple(float(v) for v in value)
    expected = _TYPE_WORDS[kind] + (" or None" if "None" in rest else "")
    if kind == "float":
        expected = expected.replace("a float", "a finite float")
    raise ValueError(f"{name} must be {expected}, got {value!r}")


@dataclass
class TrainState:
    step: int = 0
    epoch: int = 0
    offset: int = 0          # examples of this epoch already consumed (global)
    last_loss: float = float("nan")
    history: list = field(default_factory=list)  # (step, loss) every log_every steps
    evals: list = field(default_factory=list)    # (step, metrics)
    refreshed_at: int = 0    # step of the last index refresh (0: the index the run began with)


def resolve_device(config_device: str | None, name: str = "device") -> torch.device:
    """The device a process trains on, from ``TrainConfig.device`` (the Trainer itself does
    not move the model; its caller does).

    None is ``cuda:LOCAL_RANK`` when CUDA is available (LOCAL_RANK: torchrun's variable, 0
    without it), else ``cpu``; a plain ``cuda`` is ``cuda:LOCAL_RANK`` too. ``name``: what the
    messages call the value (a command-line flag such as ``"--device"``, which cannot be None).

    Raises:
        ValueError: naming ``name``: not a device, or CUDA (or that CUDA index) unavailable;
            naming LOCAL_RANK when it is not an int.
    """
    try:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    except ValueError:
        raise ValueError(f"LOCAL_RANK must be an int, got {os.environ['LOCAL_RANK']!r}") from None
    if config_device is None:
        if torch.cuda.is_available():
            return torch.device("cuda", local_rank)
        return torch.device("cpu")
    flag = name.startswith("-")
    try:
        device = torch.device(config_device)
    except (RuntimeError, ValueError, TypeError):
        choices = "cpu, cuda or cuda:N" if flag else "cpu, cuda, cuda:N or None"
        raise ValueError(f"{name} must be {choices}, got {config_device!r}") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            fix = (f"use {name} cpu (or leave it out to choose)" if flag else
                   f"use {name} 'cpu' (or None to choose)")
            raise ValueError(f"{name} is {config_device!r} but CUDA is not available here; "
                             f"{fix}")
        if device.index is None:
            device = torch.device("cuda", local_rank)
        if device.index >= torch.cuda.device_count():
            raise ValueError(f"{name} is {config_device!r} (cuda:{device.index}) but only "
                             f"{torch.cuda.device_count()} CUDA device(s) are visible")
    return device


def lr_lambda(config: TrainConfig) -> Callable[[int], float]:
    """Multiplier of the base learning rate at step s: linear warm-up, then the schedule."""
    warm, total = config.warmup_steps, config.max_steps

    def factor(step: int) -> float:
        if warm and step < warm:
            return (step + 1) / warm
        if config.schedule == "constant" or total <= warm:
            return 1.0
        progress = min(1.0, (step - warm) / max(1, total - warm))
        if config.schedule == "linear":
            return max(0.0, 1.0 - progress)
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


_FUSED_ADAM_DEVICES = ("cpu", "cuda")
_FUSED_ADAM_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _question_encoder(model: nn.Module, config: TrainConfig) -> nn.Module | None:
    """The module the question-encoder options apply to; None when both are off.

    Raises:
        ValueError: an option is set but the model has no (non-None) ``question_encoder``.
    """
    if not config.freeze_question_encoder and config.question_encoder_lr is None:
        return None
    encoder = getattr(model, "question_encoder", None)
    if not isinstance(encoder, nn.Module):
        option = ("freeze_question_encoder" if config.freeze_question_encoder
                  else "question_encoder_lr")
        raise ValueError(f"{option} is set but the model ({type(model).__name__}) has no "
                         "question_encoder")
    return encoder


def make_optimizer(model: nn.Module, config: TrainConfig) -> torch.optim.Optimizer:
    """AdamW without weight decay on biases and norms; torch's fused implementation (one pass
    per tensor, no temporaries) where every parameter allows it, as transformers' Trainer
    defaults to.

    ``model.question_encoder``'s parameters are left out with ``freeze_question_encoder``, and
    get their own decay / no-decay groups at ``question_encoder_lr`` when that is set (after
    the other groups).

    Raises:
        ValueError: a question-encoder option on a model without a question_encoder.
    """
    encoder = _question_encoder(model, config)
    in_encoder = {id(p) for p in encoder.parameters()} if encoder is not None else set()
    split = config.question_encoder_lr is not None
    decay, no_decay, enc_decay, enc_no_decay = [], [], [], []
    for name, p in model.named_parameters():
        if not p.requires_grad or (config.freeze_question_encoder and id(p) in in_encoder):
            continue
        if split and id(p) in in_encoder:
            (enc_no_decay if p.dim() < 2 else enc_decay).append(p)
        else:
            (no_decay if p.dim() < 2 else decay).append(p)
    groups = [{"params": decay, "weight_decay": config.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    if split:
        groups += [{"params": enc_decay, "weight_decay": config.weight_decay,
                    "lr": config.question_encoder_lr},
                   {"params": enc_no_decay, "weight_decay": 0.0, "lr": config.question_encoder_lr}]
    params = [p for g in groups for p in g["params"]]
    fused = all(p.device.type in _FUSED_ADAM_DEVICES and p.dtype in _FUSED_ADAM_DTYPES
                for p in params)
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=config.lr, betas=config.betas,
                             eps=config.adam_eps, fused=fused or None)


# ---------------------------------------------------------------------- RNG and files
def _rng_state() -> dict:
    """Every RNG state: torch's (and CUDA's) as tensors, Python's and NumPy's as JSON lists."""
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {"torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
            "python": [version, list(internal), gauss],
            "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)]}


def _set_rng_state(state: dict) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _json_default(obj: Any) -> Any:
    """NumPy and torch values as plain ones (``tolist``); anything else as its str."""
    return obj.tolist() if hasattr(obj, "tolist") else str(obj)


def _number(value: Any) -> float | None:
    """A metric as a float, or None when it is not a number."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, Real) and not isinstance(value, (bool, np.bool_)):
        return float(value)
    return None


def _write_synced(path: str, write: Callable[[IO[bytes]], None]) -> None:
    with open(path, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def atomic_torch_save(obj: Any, path: str) -> None:
    """``torch.save`` to a temporary file in the same folder, fsync, then rename over ``path``."""
    atomic_write(path, lambda f: torch.save(obj, f))


def _manifest_path(path: str) -> str:
    """``checkpoint-last.pt`` -> ``checkpoint-last.json``."""
    manifest = os.path.splitext(path)[0] + ".json"
    if manifest == path:
        raise ValueError(f"a checkpoint path must not end in .json (its manifest does): {path}")
    return manifest


def _digest(path: str) -> tuple[int, str]:
    """Size and SHA-256 hex digest of a file."""
    return os.path.getsize(path), sha256_file(path)


def _write_checkpoint(payload: dict, path: str, step: int) -> None:
    """Payload, then manifest (size, SHA-256, step): each to an fsynced temporary, then renamed;
    then the temporaries of earlier, killed saves (``<stem>*.tmp-*``) are removed."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    manifest = _manifest_path(path)
    tmp_payload, tmp_manifest = f"{path}.tmp-{os.getpid()}", f"{manifest}.tmp-{os.getpid()}"
    renamed = False
    try:
        with disk_errors(path):  # a full disk: one error naming the checkpoint
            _write_synced(tmp_payload, lambda f: torch.save(payload, f))
        size, sha256 = _digest(tmp_payload)
        record = {"format": CHECKPOINT_FORMAT, "payload": os.path.basename(path), "size": size,
                  "sha256": sha256, "step": step}
        with disk_errors(manifest):
            _write_synced(tmp_manifest, lambda f: f.write(json.dumps(record, indent=1).encode()))
        os.replace(tmp_payload, path)
        renamed = True
        fsync_dir(folder)
        # killed here: the new payload has the old manifest; _verify finds tmp_manifest
        os.replace(tmp_manifest, manifest)
        fsync_dir(folder)
    finally:
        if os.path.exists(tmp_payload):
            os.remove(tmp_payload)
        if not renamed and os.path.exists(tmp_manifest):
            os.remove(tmp_manifest)
    stem = os.path.splitext(os.path.basename(path))[0]
    for stale in glob.glob(os.path.join(glob.escape(folder), glob.escape(stem) + "*.tmp-*")):
        with contextlib.suppress(OSError):
            os.remove(stale)


def _read_manifest(manifest: str) -> dict:
    try:
        with open(manifest, "rb") as f:
            record = json.loads(f.read().decode("utf-8"))
    except (OSError, ValueError) as e:  # ValueError: JSON and UTF-8 errors
        raise CheckpointError(f"checkpoint manifest {manifest} is corrupt: {e}") from None
    if not (isinstance(record, dict) and record.get("format") == CHECKPOINT_FORMAT
            and all(isinstance(record.get(k), int) for k in ("size", "step"))
            and isinstance(record.get("sha256"), str)):
        raise CheckpointError(f"checkpoint manifest {manifest} is corrupt (not a "
                              f"{CHECKPOINT_FORMAT} manifest)")
    return record


def _mismatch(path: str, manifest: str, record: dict, size: int, sha256: str) -> str | None:
    """Why the payload (``size``, ``sha256``) does not match ``record``; None when it does."""
    if size != record["size"]:
        how = "truncated" if size < record["size"] else "longer than written"
        return f"{path} is corrupt ({how}): {size} bytes, {manifest} records {record['size']}"
    if sha256 != record["sha256"]:
        return (f"{path} is corrupt: its SHA-256 {sha256[:16]}... differs from "
                f"{record['sha256'][:16]}... recorded in {manifest}")
    return None


def _verify(path: str) -> dict:
    """The manifest record that the payload at ``path`` matches (see _write_checkpoint)."""
    manifest = _manifest_path(path)
    restart = (f"; to start from scratch instead, delete {path} and {manifest} (or do not "
               "resume)")
    if not os.path.isfile(path):
        if not os.path.isfile(manifest):
            raise FileNotFoundError(f"no checkpoint at {path}")
        raise CheckpointError(f"checkpoint {path} is missing but its manifest {manifest} "
                              f"exists{restart}")
    size, sha256 = _digest(path)
    if os.path.isfile(manifest):
        try:
            record = _read_manifest(manifest)
            problem = _mismatch(path, manifest, record, size, sha256)
        except CheckpointError as e:
            problem = str(e)
        if problem is None:
            return record
    else:
        problem = (f"checkpoint {path} has no manifest {os.path.basename(manifest)}, so it "
                   "cannot be verified (a save that was interrupted, or an older rag_fast "
                   "wrote it)")
    # a save killed between its two renames left the new payload's (fsynced) manifest here
    for pending in sorted(glob.glob(glob.escape(manifest) + ".tmp-*")):
        try:
            record = _read_manifest(pending)
        except CheckpointError:
            continue
        if _mismatch(path, pending, record, size, sha256) is None:
            return record
    raise CheckpointError(problem + restart)


def load_checkpoint(path: str) -> dict:
    """A Trainer checkpoint, verified against its manifest and loaded with
    ``torch.load(weights_only=True)``: nothing in it but tensors and plain data is unpickled.

    Args:
        path: the payload (``<output_dir>/checkpoint-last.pt``); its manifest is beside it
            (``checkpoint-last.json``).

    Returns:
        ``{"model", "optimizer", "scheduler", "scaler"}`` state dicts, ``"rng"`` (``torch``,
        ``cuda``, ``python``, ``numpy`` states), ``"state"`` (TrainState fields), ``"config"``
        (TrainConfig fields as saved), ``"world_size"`` and ``"origin"`` (the Trainer's
        ``origin``, None if it had none).

    Raises:
        FileNotFoundError: neither the checkpoint nor its manifest exists.
        CheckpointError: naming the file: missing manifest or payload, corrupt or truncated
            (size or SHA-256 differ from the manifest), holding other objects (refused
            without running them), or not a Trainer checkpoint.
    """
    record = _verify(path)
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # pickle.UnpicklingError for a refused object; zip errors...
        found = re.search(r"GLOBAL ([\w.]+)", str(e))
        detail = f"it references {found.group(1)}" if found else type(e).__name__
        raise CheckpointError(
            f"checkpoint {path} was refused: it holds something other than tensors and plain "
            f"data, and nothing in it was run ({detail})") from None
    try:
        if not isinstance(payload, dict) or set(payload) != _PAYLOAD_KEYS \
                or payload["format"] != CHECKPOINT_FORMAT:
            raise ValueError(f"not a {CHECKPOINT_FORMAT} payload")
        meta = json.loads(payload["meta"])
        if not isinstance(meta, dict) or not _META_KEYS <= set(meta) <= _META_KEYS | _OPTIONAL_META:
            found = sorted(meta) if isinstance(meta, dict) else type(meta).__name__
            raise ValueError(f"its metadata has keys {found}, expected {sorted(_META_KEYS)} "
                             f"(and optionally {sorted(_OPTIONAL_META)})")
        if meta["state"]["step"] != record["step"]:
            raise ValueError(f"step {meta['state']['step']} but the manifest says "
                             f"{record['step']}")
    except (ValueError, TypeError, KeyError) as e:
        raise CheckpointError(f"checkpoint {path} is not a valid rag_fast training checkpoint "
                              f"({e})") from None
    return {"model": payload["model"], "optimizer": payload["optimizer"],
            "scheduler": payload["scheduler"], "scaler": payload["scaler"],
            "rng": {"torch": payload["rng_torch"], "cuda": payload["rng_cuda"],
                    "python": meta["rng_python"], "numpy": meta["rng_numpy"]},
            "state": meta["state"], "config": meta["config"], "world_size": meta["world_size"],
            "origin": meta.get("origin")}


_warned_no_matplotlib = False


def plot_training(state: TrainState, path: str) -> bool:
    """A PNG (written atomically) of the logged loss vs step, and of each eval metric vs step
    in a second panel when there are evals; matplotlib's Agg canvas, no pyplot.

    Returns:
        Whether it was written: False, with one warning per process, without matplotlib.
    """
    global _warned_no_matplotlib
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        if not _warned_no_matplotlib:
            _warned_no_matplotlib = True
            warnings.warn(f"matplotlib is not installed: no training plot {path} "
                          "(pip install matplotlib)", stacklevel=2)
        return False
    series: dict[str, list] = {}
    for step, metrics in state.evals:
        for name, value in metrics.items():
            if (value := _number(value)) is not None:
                series.setdefault(name, []).append((step, value))
    fig = Figure(figsize=(7, 6 if series else 3.5), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(2 if series else 1, 1, sharex=True, squeeze=False)[:, 0]
    if state.history:
        steps, losses = zip(*state.history)
        axes[0].plot(steps, [math.nan if v is None else v for v in losses], marker=".")
    axes[0].set_ylabel("training loss")
    for name, points in series.items():
        axes[1].plot(*zip(*points), marker="o", label=name)
    if series:
        axes[1].set_ylabel("eval")
        axes[1].legend()
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("step")
    atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=100))
    return True


def world() -> tuple[int, int]:
    """``(rank, world_size)`` of the initialised process group, or ``(0, 1)``."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class Trainer:
    """Trains ``model`` on ``dataset``.

    Args:
        model: the module to train (a RagModel, or any module ``loss_fn`` understands), on its
            device already (see :func:`resolve_device`).
        dataset: a sequence of examples.
        collate: list of examples -> batch (whatever ``loss_fn`` takes).
        loss_fn: ``(model, batch) -> scalar loss``, a mean over the batch's examples.
        config: TrainConfig.
        eval_fn: ``(model) -> dict`` of metrics, run every ``eval_every`` steps on rank 0, or
            on every rank when the model's retriever is collective (``model.retriever.collective``,
            e.g. a :class:`~rag_fast.retrieval.sharded.ShardedRetriever`: every rank must join
            each search, so every rank evaluates; rank 0 records the metrics).
        on_step_end: ``(state) -> None`` after each step (and its checkpoint).
        passage_embedder: with ``refresh_index_every``, ``fn(store, lo, hi) -> [hi - lo, d]``
            vectors of store rows ``[lo, hi)`` used instead of ``refresh_encoder`` (see
            ``rag_fast.training.refresh``).
        origin: what the run starts from, a JSON-able dict saved in each checkpoint: its
            ``"id"`` identifies it (``rag-fast train`` passes the SHA-256 of the model
            directory's ``rag_fast.json``, which lists every file's own), the other keys
            describe it in messages. :meth:`resume` refuses a checkpoint whose origin has
            another ``"id"``.

    Raises:
        ValueError: an empty dataset, a global batch larger than it, or a question-encoder
            option on a model without a question_encoder.
    """

    def __init__(
        self,
        model: nn.Module,
        dataset: Sequence,
        collate: Callable[[list], Any],
        loss_fn: Callable[[nn.Module, Any], torch.Tensor],
        config: TrainConfig,
        eval_fn: Callable[[nn.Module], dict] | None = None,
        on_step_end: Callable[[TrainState], None] | None = None,
        passage_embedder: Callable[[Any, int, int], Any] | None = None,
        origin: dict | None = None,
    ) -> None:
        if len(dataset) == 0:
            raise ValueError("the training dataset is empty")
        self.rank, self.world_size = world()
        self.config, self.origin = config, origin
        self.global_batch = config.micro_batch_size * config.grad_accum * self.world_size
        if self.global_batch > len(dataset):
            raise ValueError(f"global batch {self.global_batch} (micro_batch_size x grad_accum x "
                             f"world_size) is larger than the dataset ({len(dataset)} examples)")
        self.model, self.dataset, self.collate, self.loss_fn = model, dataset, collate, loss_fn
        self.eval_fn, self.on_step_end = eval_fn, on_step_end
        encoder = _question_encoder(model, config)
        if config.freeze_question_encoder:
            encoder.requires_grad_(False)
        if config.gradient_checkpointing:
            enable_gradient_checkpointing(model)
        self.optimizer = make_optimizer(model, config)
        self._lr_factor = lr_lambda(config)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_factor)
        self._step_lr = config.lr * self._lr_factor(0)  # lr of the last step (base groups)
        device = next(model.parameters()).device
        self.device_type = device.type
        self.scaler = torch.amp.GradScaler(self.device_type, enabled=config.precision == "fp16")
        self.ddp = None
        if self.world_size > 1:
            self.ddp = nn.parallel.DistributedDataParallel(
                model, device_ids=[device.index] if device.type == "cuda" else None,
                find_unused_parameters=config.find_unused_parameters)
        self.state = TrainState()
        if config.output_dir:
            claim_run_folder(config.output_dir, self.rank, self.world_size)
        self.refresher = None
        if config.refresh_index_every:
            embed = passage_embedder or question_encoder_embedder(model)
            self.refresher = IndexRefresher(getattr(model, "retriever", None), embed,
                                            config.output_dir, self.rank, self.world_size)
        random.seed(config.seed)
        np.random.seed(config.seed)
        torch.manual_seed(config.seed)

    # ------------------------------------------------------------------ data
    def _order(self, epoch: int) -> list[int]:
        g = torch.Generator().manual_seed(self.config.seed + epoch)
        return torch.randperm(len(self.dataset), generator=g).tolist()

    def _next_global_batch(self) -> list[int]:
        """Indices of the next step's examples; drops an epoch's incomplete tail."""
        s = self.state
        if s.offset + self.global_batch > len(self.dataset):
            s.epoch, s.offset = s.epoch + 1, 0
        order = self._order(s.epoch)
        indices = order[s.offset:s.offset + self.global_batch]
        s.offset += self.global_batch
        return indices

    def _micro_batches(self, indices: list[int]) -> list[list[int]]:
        """This rank's micro-batches: micro-batch j of the step, slice ``rank`` of it."""
        per = self.config.micro_batch_size
        chunk = per * self.world_size
        out = []
        for j in range(self.config.grad_accum):
            micro = indices[j * chunk:(j + 1) * chunk]
            out.append(micro[self.rank * per:(self.rank + 1) * per])
        return out

    # ------------------------------------------------------------------ steps
    def _autocast(self):
        dtype = PRECISIONS[self.config.precision]
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=dtype)

    # ------------------------------------------------------------------ retrieval
    def _retriever(self):
        return getattr(self.model, "retriever", None)

    def collective_retrieval(self) -> bool:
        """Whether the model's retriever is collective (a sharded index over the process
        group): then every rank must retrieve the same number of times, so evaluation runs on
        every rank."""
        return bool(getattr(self._retriever(), "collective", False))

    def _retrieval_seconds(self) -> float | None:
        """The retriever's running total of retrieval wall time, None when it keeps none."""
        value = getattr(self._retriever(), "retrieval_seconds", None)
        return float(value) if isinstance(value, (int, float)) else None

    def train_step(self) -> float:
        """One optimizer step over the next global batch; returns the mean loss (this rank)."""
        config = self.config
        module = self.ddp if self.ddp is not None else self.model
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        micro = self._micro_batches(self._next_global_batch())
        total = 0.0
        for j, indices in enumerate(micro):
            batch = self.collate([self.dataset[i] for i in indices])
            last = j == len(micro) - 1
            sync = contextlib.nullcontext() if last or self.ddp is None else self.ddp.no_sync()
            with sync:
                with self._autocast():
                    loss = self.loss_fn(module, batch)
                self.scaler.scale(loss / config.grad_accum).backward()
            total += float(loss.detach()) / config.grad_accum
        if config.max_grad_norm is not None:
            self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), config.max_grad_norm)
        self._step_lr = config.lr * self._lr_factor(self.state.step)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.scheduler.step()
        self.state.step += 1
        self.state.last_loss = total
        return total

    def train(self) -> TrainState:
        """Run (or continue) until ``max_steps``; returns the final state.

        Rank 0 first drops the metrics file's lines after the current step (a resumed or
        restarted run writes them again), and at the end writes the plot.
        """
        config = self.config
        if self.rank == 0:
            self._trim_metrics()
        if self.refresher is not None:
            if self.state.refreshed_at != self.refresher.current:
                self.refresher.restore(self.state.refreshed_at)  # a resumed run's index
            self.refresher.prune(self.state.refreshed_at, after=True)
        bar = None
        if config.progress and self.rank == 0:
            from tqdm.auto import tqdm

            bar = tqdm(total=config.max_steps, initial=self.state.step, desc="train",
                       dynamic_ncols=True)
        start, seen = time.perf_counter(), 0
        # retrieval time inside the training steps (not evaluation), per logged interval
        interval = {"steps": 0, "step_s": 0.0, "retrieval_s": 0.0}
        while self.state.step < config.max_steps:
            before, step_start = self._retrieval_seconds(), time.perf_counter()
            loss = self.train_step()
            after = self._retrieval_seconds()
            interval["steps"] += 1
            interval["step_s"] += time.perf_counter() - step_start
            if before is not None and after is not None:
                interval["retrieval_s"] += after - before
            seen += self.global_batch
            step = self.state.step
            elapsed = max(time.perf_counter() - start, 1e-9)
            if step % max(1, config.log_every) == 0 or step == config.max_steps:
                self.state.history.append((step, loss))
                record = {"step": step, "loss": loss if math.isfinite(loss) else None,
                          "lr": self._step_lr, "examples_per_s": round(seen / elapsed, 3),
                          "elapsed_s": round(elapsed, 3)}
                if after is not None:  # a timed retriever: mean seconds per step since the last record
                    n = max(1, interval["steps"])
                    record["step_s"] = round(interval["step_s"] / n, 6)
                    record["retrieval_s"] = round(interval["retrieval_s"] / n, 6)
                interval = {"steps": 0, "step_s": 0.0, "retrieval_s": 0.0}
                self._log_metrics(record)
            if bar is not None:
                bar.set_postfix(loss=f"{loss:.4f}", ex_per_s=f"{seen / elapsed:.1f}")
                bar.update(1)
            if self.refresher is not None and (step % config.refresh_index_every == 0
                                               or step == config.max_steps):
                self.refresh_index()  # before the evaluation and the checkpoint of this step
            if self.eval_fn is not None and config.eval_every and step % config.eval_every == 0:
                self.evaluate()
            if config.output_dir and (
                (config.checkpoint_every and step % config.checkpoint_every == 0)
                or step == config.max_steps
            ):
                self.save_checkpoint()
            if self.on_step_end is not None:
                self.on_step_end(self.state)
        if bar is not None:
            bar.close()
        plot = self._output_file(config.plot_file)
        if plot is not None and self.rank == 0:
            try:
                plot_training(self.state, plot)
            except Exception as e:  # the run is done and checkpointed: a plot is not worth it
                warnings.warn(f"could not write the training plot {plot}: {e!r}", stacklevel=2)
        return self.state

    def refresh_index(self) -> dict:
        """Re-embed the passages and swap the rebuilt index in on every rank (collective), as
        ``refresh_index_every`` does after its steps; records ``state.refreshed_at`` and (rank
        0) a ``{"step", "refresh": {...}}`` line in the metrics file.

        Raises:
            ValueError: ``refresh_index_every`` is 0 (no refresher was set up).
        """
        if self.refresher is None:
            raise ValueError("refresh_index_every is 0: this Trainer does not refresh its index")
        record = self.refresher.refresh(self.state.step)
        self.state.refreshed_at = self.state.step
        self._log_metrics({"step": self.state.step, "refresh": record})
        return record

    def evaluate(self) -> dict | None:
        """Run ``eval_fn`` on rank 0 (on every rank when retrieval is collective, see
        :meth:`collective_retrieval`), record the metrics in ``state.evals`` and (rank 0) the
        metrics file.

        Returns:
            The metrics on the ranks that evaluated, None on the others.
        """
        metrics = None
        if self.eval_fn is not None and (self.rank == 0 or self.collective_retrieval()):
            metrics = self.eval_fn(self.model)
            self.state.evals.append((self.state.step, metrics))
        if self.rank == 0 and metrics is not None:
            rounded = {}
            for name, value in metrics.items():
                number = _number(value)
                rounded[name] = (value if number is None
                                 else round(number, 4) if math.isfinite(number) else None)
            self._log_metrics({"step": self.state.step, "eval": rounded})
            if self.config.progress:
                from tqdm.auto import tqdm

                tqdm.write(f"step {self.state.step}: " +
                           ", ".join(f"{k}={v:.4f}" if _number(v) is not None else f"{k}={v}"
                                     for k, v in metrics.items()))
        if self.world_size > 1:
            dist.barrier()
        return metrics

    # ------------------------------------------------------------------ metrics
    def _output_file(self, name: str | None) -> str | None:
        """``output_dir/name``, or None when either is unset."""
        if not name or not self.config.output_dir:
            return None
        return os.path.join(self.config.output_dir, name)

    def _log_metrics(self, record: dict) -> None:
        """Append one JSON line to the metrics file (rank 0; non-finite numbers as null)."""
        path = self._output_file(self.config.metrics_file)
        if path is None or self.rank != 0:
            return
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record, default=_json_default) + "\n")

    def _trim_metrics(self) -> None:
        """Drop the metrics file's records after ``state.step`` (and a last record cut short
        by a kill), rewriting it atomically, so that the log matches the run. Lines that are
        not this trainer's records are kept as they are."""
        path = self._output_file(self.config.metrics_file)
        if path is None or not os.path.isfile(path):
            return
        with open(path, encoding="utf-8") as f:
            lines = f.readlines()
        keep = []
        for line in lines:
            if not line.endswith("\n"):  # the last line, cut short by a kill if it is ours
                if line.lstrip().startswith('{"'):
                    continue
                line += "\n"
            try:
                step = json.loads(line)["step"]
            except (ValueError, KeyError, TypeError):
                step = None
            if isinstance(step, int) and not isinstance(step, bool) and step > self.state.step:
                continue
            keep.append(line)
        if keep != lines:
            atomic_write(path, lambda f: f.write("".join(keep).encode("utf-8")))

    # ------------------------------------------------------------------ checkpoints
    def checkpoint_path(self) -> str:
        """``<output_dir>/checkpoint-last.pt`` (its manifest: ``checkpoint-last.json``)."""
        if not self.config.output_dir:
            raise ValueError("config.output_dir is not set")
        return os.path.join(self.config.output_dir, CHECKPOINT)

    def save_checkpoint(self) -> None:
        """Write the resumable state (rank 0; RNG state of rank 0): the tensors and a JSON
        string of the rest, then the manifest, each atomically; then remove the temporaries
        of earlier, killed saves."""
        if self.rank == 0:
            rng = _rng_state()
            meta = {"state": asdict(self.state), "config": asdict(self.config),
                    "world_size": self.world_size, "rng_python": rng["python"],
                    "rng_numpy": rng["numpy"]}
            if self.origin is not None:
                meta["origin"] = self.origin
            _write_checkpoint({
                "format": CHECKPOINT_FORMAT,
                "model": self.model.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(),
                "scaler": self.scaler.state_dict(),
                "rng_torch": rng["torch"],
                "rng_cuda": rng["cuda"],
                "meta": json.dumps(meta, default=_json_default),
            }, self.checkpoint_path(), self.state.step)
        if self.world_size > 1:
            dist.barrier()
        if self.refresher is not None:  # the checkpoint needs only its own refreshed index now
            self.refresher.prune(self.state.refreshed_at, after=False)

    def resume(self, path: str | None = None) -> bool:
        """Load the last checkpoint, verified (see :func:`load_checkpoint`); returns whether
        there was one. Only when neither the checkpoint nor its manifest exists does it return
        False: a bad one raises rather than training from scratch.

        Args:
            path: the checkpoint; default ``<output_dir>/checkpoint-last.pt``.

        Raises:
            CheckpointError: naming the file: corrupt, truncated, without its manifest (or the
                manifest without it), holding objects other than tensors and plain data, or not
                fitting this model and optimizer.
            ValueError: a checkpoint from a different global batch size (its data position
                would not match), or from a run with another ``origin`` (both given).
        """
        path = path or self.checkpoint_path()
        if not os.path.isfile(path) and not os.path.isfile(_manifest_path(path)):
            return False
        ckpt = load_checkpoint(path)
        saved = ckpt["config"]
        global_batch = saved["micro_batch_size"] * saved["grad_accum"] * ckpt["world_size"]
        if global_batch != self.global_batch:
            raise ValueError(f"{path} was written with global batch {global_batch}, this run "
                             f"has {self.global_batch}: its data position would not match")
        if self.origin is not None and ckpt["origin"] is not None \
                and ckpt["origin"].get("id") != self.origin.get("id"):
            raise ValueError(
                f"{path} continues a run that started from {_describe(ckpt['origin'])}, not from "
                f"{_describe(self.origin)}: resuming would mix the two. Train into another "
                "output directory, or set \"resume\": false to start over here (the checkpoint "
                "is replaced)")
        try:
            self.model.load_state_dict(ckpt["model"])
            self.optimizer.load_state_dict(ckpt["optimizer"])
            self.scheduler.load_state_dict(ckpt["scheduler"])
            self.scaler.load_state_dict(ckpt["scaler"])
        except (RuntimeError, ValueError, KeyError) as e:
            raise CheckpointError(
                f"checkpoint {path} does not fit this model and optimizer (written with other "
                f"model or question-encoder options?): {e}") from None
        try:
            state = dict(ckpt["state"])
            state["history"] = [tuple(h) for h in state["history"]]
            state["evals"] = [tuple(e) for e in state["evals"]]
            self.state = TrainState(**state)
        except (TypeError, ValueError, KeyError) as e:
            raise CheckpointError(f"checkpoint {path} is not a valid rag_fast training "
                                  f"checkpoint (its state: {e})") from None
        _set_rng_state(ckpt["rng"])
        return True


def check_run_folder(output_dir: str, flag: str = "output_dir") -> None:
    """Refuse ``output_dir`` unless it is missing, empty or already a training run's folder
    (which is resumed): a folder holding anything else is never written into.

    Raises:
        FileExistsError: naming ``flag`` and the folder.
    """
    from rag_fast.storage import RUN_KIND, check_output_folder

    if not _earlier_run(output_dir):
        check_output_folder(output_dir, RUN_KIND, reuse=True, flag=flag)
    # the trained model is saved to model/ at the end: a folder there must be a model's
    check_output_folder(os.path.join(output_dir, "model"), "rag_fast.model", overwrite=True,
                        flag=f"{flag}'s model/")


_RUN_FILES = re.compile(r"(checkpoint-last\.(pt|json)(\.tmp-\d+)?|metrics\.jsonl|training\.png|"
                        r"model|index|index-refresh|\..*\.(tmp|new|old|trash)-.*)")


def _earlier_run(output_dir: str) -> bool:
    """Whether ``output_dir`` is the run folder of an earlier rag_fast (no marker): a verified
    checkpoint manifest and its payload, and nothing but what a run writes."""
    from rag_fast.storage import folder_kind

    manifest = os.path.join(output_dir, CHECKPOINT_MANIFEST)
    if folder_kind(output_dir) is not None or not os.path.isfile(manifest) \
            or not os.path.isfile(os.path.join(output_dir, CHECKPOINT)):
        return False
    try:
        _read_manifest(manifest)
    except CheckpointError:
        return False
    return all(_RUN_FILES.fullmatch(name) for name in os.listdir(output_dir))


def claim_run_folder(output_dir: str, rank: int = 0, world_size: int = 1,
                     flag: str = "output_dir") -> None:
    """Make ``output_dir`` a training run's folder (see :func:`check_run_folder`), marked by
    ``rag_fast-output.json``. Every rank checks before rank 0 marks it, so all agree.

    Raises:
        FileExistsError: naming ``flag`` and the folder.
    """
    from rag_fast.storage import RUN_KIND, folder_kind, write_marker

    check_run_folder(output_dir, flag)
    if world_size > 1:
        dist.barrier()
    if rank == 0 and folder_kind(output_dir) != RUN_KIND:
        write_marker(output_dir, RUN_KIND)


def _describe(origin: dict) -> str:
    return ", ".join(str(v) for k, v in sorted(origin.items()) if k != "id") + \
        f" ({origin.get('id')})"


def enable_gradient_checkpointing(model: nn.Module) -> None:
    """Turn on gradient checkpointing of a RagModel's generator (or of a HF model itself)."""
    target = getattr(model, "generator", model)
    if not hasattr(target, "gradient_checkpointing_enable"):
        raise ValueError(f"{type(target).__name__} does not support gradient checkpointing")
    target.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
