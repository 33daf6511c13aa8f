"""Training options: :class:`TrainConfig`, its schema (name, type, default, help of each option)
and its validation, and reading it from a JSON object (``rag-fast train``'s ``"train"`` section).
"""
from __future__ import annotations

import difflib
import json
import math
import os
import re
import warnings
from dataclasses import MISSING, dataclass, field, fields
from numbers import Integral, Real
from typing import Any

import numpy as np
import torch

from rag_fast._threads import check_threads
from rag_fast.storage.disk import NAME_ROOM
from rag_fast.training.refresh import REFRESH_ENCODERS

PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
SCHEDULES = ("linear", "cosine", "constant")


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
    warmup_steps: int = _option(0, "steps of linear warm-up to lr (more than max_steps: clamped, with a warning)")
    schedule: str = _option("linear", "decay after warm-up: linear | cosine | constant")
    max_grad_norm: float | None = _option(1.0, "gradient clipping norm; None: no clipping")
    precision: str = _option("fp32", "fp32 | bf16 | fp16 (autocast; fp16 with a grad scaler)")
    gradient_checkpointing: bool = _option(
        False, "recompute the generator's activations in the backward pass (less memory)")
    compile: bool = _option(
        False, "run the question encoder and the generator with the RAG loss under "
               "torch.compile (RagModel.compile; docs/tuning.md, \"Compiled training\"): the "
               "first steps compile (minutes on a few CPU cores); measure before choosing it")
    seed: int = _option(0, "seed of the data order and of the Python, NumPy and torch RNGs")
    output_dir: str | None = _option(
        None, "checkpoints, metrics and plot go here; None: nothing is written")
    checkpoint_every: int = _option(0, "steps between checkpoints; 0: only at the end")
    eval_every: int = _option(0, "steps between evaluations; 0: never")
    log_every: int = _option(10, "steps between loss records (history, metrics); 0: every step")
    progress: bool = _option(True, "show a progress bar (rank 0)")
    find_unused_parameters: bool | None = _option(
        None, "DDP's find_unused_parameters; None: decided by the first step, on only when a "
              "trainable parameter gets no gradient there (docs/distributed.md)")
    freeze_question_encoder: bool = _option(
        False, "do not train the model's question_encoder (requires_grad off, not optimized)")
    question_encoder_lr: float | None = _option(
        None, "learning rate of the question_encoder's parameters; None: lr")
    metrics_file: str | None = _option(
        "metrics.jsonl", "JSON line per logged step and per eval: a path inside output_dir "
                         "(relative, no '..'); None: none")
    plot_file: str | None = _option(
        "training.png", "PNG of loss and eval metrics vs step: a path inside output_dir "
                        "(relative, no '..'); None: none")
    device: str | None = _option(
        None, "where the model trains: cpu, cuda, cuda:N; None = cuda:LOCAL_RANK if CUDA is "
              "available else cpu")
    refresh_index_every: int = _option(
        0, "steps between index refreshes (and one after the last step): re-embed the passages "
           "with refresh_encoder and swap the rebuilt index in (docs/distributed.md); 0: never")
    refresh_encoder: str = _option(
        "question_encoder", "what re-embeds the passages at a refresh: question_encoder (the "
                            "model's, as trained so far)")
    threads: int | None = _option(
        None, "CPU threads of torch's ops and rag_fast's kernels during training; None: "
              "RAG_FAST_THREADS if set, else adaptive on the CPU: one per core, fewer while "
              "other processes keep cores busy (docs/tuning.md)")
    keep_freed_memory: bool = _option(
        True, "on the CPU: keep the memory a step frees in the process for the next step "
              "instead of returning it to the kernel (glibc's malloc thresholds, for the rest "
              "of the process; left alone where GLIBC_TUNABLES or MALLOC_*_ variables set "
              "those thresholds; docs/tuning.md)")
    extra: dict = _option({}, "free-form JSON for your own code (the Trainer ignores it)")

    def __post_init__(self) -> None:
        for f in fields(self):
            setattr(self, f.name, _coerce(f.name, getattr(self, f.name), str(f.type)))
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {tuple(PRECISIONS)}, got {self.precision!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        for f in fields(self):  # a step or count a checkpoint can record (its manifest's bound)
            value = getattr(self, f.name)
            if isinstance(value, int) and not isinstance(value, bool) and value >= 2**63:
                raise ValueError(f"{f.name} must be below 2**63, got {value!r}")
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
        if self.threads is not None:  # at least 1, at most what the machine allows
            check_threads(self.threads, "threads")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be in [0, max_steps], got {self.warmup_steps}")
        if self.warmup_steps > self.max_steps:  # a shortened run keeps its other settings
            warnings.warn(f"warmup_steps {self.warmup_steps} is more than max_steps "
                          f"{self.max_steps}: the warm-up is clamped to {self.max_steps} steps",
                          UserWarning, stacklevel=3)
            self.warmup_steps = self.max_steps
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
        _check_run_files(self.metrics_file, self.plot_file)
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


# what a run writes in output_dir besides the files named by options: the checkpoint and its
# manifest (and their temporaries), the run's marker, the trained model, the exported and the
# refreshed indexes (rag_fast.training.checkpoint, storage, run and refresh name them)
CHECKPOINT = "checkpoint-last.pt"
CHECKPOINT_MANIFEST = "checkpoint-last.json"
RUN_ENTRIES = ("checkpoint-last.", "rag_fast-output.json", "model", "index", "index-refresh")


MAX_NAME_BYTES = 255  # a file name's bytes on Linux's filesystems (NAME_MAX)
MAX_RUN_FILE_DEPTH = 16  # folders a metrics or plot file may lie in, inside the run


# a name of the form of a writer's temporary (NAME.tmp-PID[-HEX], .NAME.new-..., ...)
_TEMPORARY_LIKE = re.compile(r"\.(tmp|new|old|trash)-\d", re.IGNORECASE)


def _check_run_files(*files: tuple[str, str | None]) -> None:
    """``metrics_file`` and ``plot_file``: each a relative path that stays inside output_dir,
    names nothing else the run writes, and is not the other one.

    Raises:
        ValueError: naming the option and the value.
    """
    seen: dict[str, str] = {}
    for name, value in zip(("metrics_file", "plot_file"), files):
        if value is None:
            continue
        parts = [p for p in value.replace("\\", "/").split("/") if p not in ("", ".")]
        if os.path.isabs(value) or value.startswith(("/", "\\", "~")) or ".." in parts \
                or not parts:
            raise ValueError(f"{name} must be a path inside output_dir (relative, without "
                             f"'..', '~' or a leading '/'), got {value!r}")
        if value.endswith(("/", "\\")):
            raise ValueError(f"{name} must name a file, not a folder (no trailing '/'), got "
                             f"{value!r}")
        longest = max(parts, key=lambda p: len(p.encode("utf-8", "surrogatepass")))
        # (the file is rewritten through a temporary beside it, NAME.tmp-PID-HEX: room kept)
        most = MAX_NAME_BYTES - NAME_ROOM
        if len(longest.encode("utf-8", "surrogatepass")) > most:
            raise ValueError(f"{name}: the name {longest[:40]!r}... is "
                             f"{len(longest.encode('utf-8', 'surrogatepass'))} bytes, more than "
                             f"the {most} a run file's name may have (the {MAX_NAME_BYTES} of "
                             f"a file name, less {NAME_ROOM} for the temporaries beside it)")
        if len(parts) > MAX_RUN_FILE_DEPTH:
            raise ValueError(f"{name}: {len(parts)} folders deep, more than "
                             f"{MAX_RUN_FILE_DEPTH} (got {value[:60]!r}...)")
        first = parts[0].casefold()
        clash = next((e for e in RUN_ENTRIES if first == e.casefold() or
                      (e.endswith(".") and first.startswith(e.casefold()))), None)
        if clash is not None:
            raise ValueError(f"{name} {value!r} would overwrite what the run itself writes in "
                             f"output_dir ({clash.rstrip('.') + ('*' if clash.endswith('.') else '')}"
                             f"); choose another name")
        if any(_TEMPORARY_LIKE.search(p) for p in parts):
            raise ValueError(f"{name} {value!r} is named like a temporary file (NAME.tmp-...): "
                             "writes in the run remove such files once their writer is gone; "
                             "choose another name")
        key = "/".join(parts).casefold()
        for other, other_name in seen.items():  # the same file, or one inside the other
            if key == other or key.startswith(other + "/") or other.startswith(key + "/"):
                how = "the same file as" if key == other else "a folder path crossing"
                raise ValueError(f"{name} {value!r} is {how} {other_name}; give each its own "
                                 "name")
        seen[key] = name


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
