"""Resumable training runs: the state a checkpoint holds, its files, and the run's folder.

A checkpoint holds the model, optimizer, scheduler, grad scaler, :class:`TrainState` (step,
data position, history) and every RNG state (torch, CUDA, Python, NumPy), restored exactly on
resume.

Checkpoints are safe to load and verified. ``checkpoint-last.pt`` holds only tensors and plain
containers and is read with ``torch.load(weights_only=True)``: everything else (TrainState, the
config, the Python and NumPy RNG states) is a JSON string inside it. ``checkpoint-last.json``,
its manifest, records the payload's size and SHA-256, checked before loading. Both are written
to temporaries in the same folder, fsynced and renamed, the manifest last; a save killed between
the two renames is completed on resume from the fsynced temporary manifest.

The run's folder (``TrainConfig.output_dir``) is written into only when it is missing, empty or
already a training run's folder (marked through ``rag_fast.storage``): see
:func:`check_run_folder`.
"""
from __future__ import annotations

import contextlib
import glob
import json
import os
import random
import re
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from rag_fast._validation import not_a_file
from rag_fast.storage import (RUN_KIND, atomic_write, check_output_folder, disk_errors,
                              folder_kind, fsync_dir, pid_alive, read_json_file, sha256_file,
                              write_marker, write_synced)
from rag_fast.training.config import CHECKPOINT, CHECKPOINT_MANIFEST, TrainConfig

CHECKPOINT_FORMAT = "rag_fast.training-checkpoint/1"
_PAYLOAD_KEYS = {"format", "model", "optimizer", "scheduler", "scaler", "rng_torch", "rng_cuda",
                 "meta"}
_META_KEYS = {"state", "config", "world_size", "rng_python", "rng_numpy"}
_OPTIONAL_META = {"origin"}  # what the run started from (Trainer's origin=), when given


class CheckpointError(ValueError):
    """A training checkpoint that cannot be resumed from: corrupt, truncated, without its
    manifest, holding objects other than tensors and plain data, or not fitting the model."""


@dataclass
class TrainState:
    """A run's progress, saved in each checkpoint and restored on resume."""

    step: int = 0
    epoch: int = 0
    offset: int = 0          # examples of this epoch already consumed (global)
    last_loss: float = float("nan")
    history: list = field(default_factory=list)  # (step, loss) every log_every steps
    evals: list = field(default_factory=list)    # (step, metrics)
    refreshed_at: int = 0    # step of the last index refresh (0: the index the run began with)
    elapsed_s: float = 0.0   # training time up to ``step``, over every session of the run (a
    #                          checkpoint of an older rag_fast has none: its resume counts from 0)


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


def json_default(obj: Any) -> Any:
    """NumPy and torch values as plain ones (``tolist``); anything else as its str."""
    return obj.tolist() if hasattr(obj, "tolist") else str(obj)


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
            write_synced(tmp_payload, lambda f: torch.save(payload, f), shown=path)
        size, sha256 = _digest(tmp_payload)
        record = {"format": CHECKPOINT_FORMAT, "payload": os.path.basename(path), "size": size,
                  "sha256": sha256, "step": step}
        with disk_errors(manifest):
            write_synced(tmp_manifest, lambda f: f.write(json.dumps(record, indent=1).encode()),
                         shown=manifest)
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


def settle_killed_saves(path: str) -> None:
    """After a verified resume from ``path``, finish what a killed save left: a manifest still
    under its temporary name that matches the payload is renamed into place, and the other
    temporaries of saves whose process is gone (``<stem>*.tmp-PID``, a payload can be
    gigabytes) are removed. Only the process that writes the checkpoints may call it."""
    manifest = _manifest_path(path)
    record = _verify(path)
    folder = os.path.dirname(os.path.abspath(path))
    stem = os.path.splitext(os.path.basename(path))[0]
    for stale in sorted(glob.glob(os.path.join(glob.escape(folder), glob.escape(stem)
                                               + "*.tmp-*"))):
        pid = stale.rsplit(".tmp-", 1)[1]
        if not pid.isdigit() or pid_alive(int(pid)):
            continue
        with contextlib.suppress(OSError, CheckpointError):
            if stale.startswith(manifest + ".tmp-") and _read_manifest(stale) == record:
                os.replace(stale, manifest)  # the save's last step, done now
                fsync_dir(folder)
                continue
        with contextlib.suppress(OSError):
            os.remove(stale)


def _read_manifest(manifest: str) -> dict:
    try:  # a regular file of a manifest's size (not a link to /dev/zero, a 20 GB file)
        record = read_json_file(manifest)
    except (OSError, ValueError, RecursionError) as e:  # ValueError: JSON and UTF-8 errors
        raise CheckpointError(f"checkpoint manifest {manifest} is corrupt: {e}") from None
    if not (isinstance(record, dict) and record.get("format") == CHECKPOINT_FORMAT):
        raise CheckpointError(f"checkpoint manifest {manifest} is corrupt (not a "
                              f"{CHECKPOINT_FORMAT} manifest)")
    problem = _manifest_problem(record, manifest)
    if problem is not None:
        raise CheckpointError(f"checkpoint manifest {manifest} is corrupt ({problem})")
    return record


_MANIFEST_KEYS = ("format", "payload", "size", "sha256", "step")
_LARGEST = 2**63  # sizes and steps above are no save's (and would be echoed in full)


def _shown(value: object, limit: int = 60) -> str:
    """``repr(value)``, cut to ``limit`` characters: a crafted value in one line, not a page."""
    try:
        text = repr(value)
    except ValueError:  # an integer past Python's digit limit
        return "a number too long to print"
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text):,} characters)"


def _manifest_problem(record: dict, manifest: str) -> str | None:
    """What is wrong with a manifest's fields, or None: exactly the keys a save writes, sizes
    and steps as whole numbers >= 0, a SHA-256 as 64 hex digits, the payload's file name as a
    string (:func:`_mismatch` checks that it names the payload beside the manifest)."""
    if sorted(record) != sorted(_MANIFEST_KEYS):
        return f"its keys are {sorted(record)}, expected {sorted(_MANIFEST_KEYS)}"
    for key in ("size", "step"):
        value = record[key]
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < _LARGEST:
            return f"{key} must be a whole number in [0, 2**63), got {_shown(value)}"
    if not isinstance(record["sha256"], str) or not re.fullmatch(r"[0-9a-f]{64}",
                                                                  record["sha256"]):
        return f"sha256 must be 64 hex digits, got {_shown(record['sha256'])}"
    if not isinstance(record["payload"], str):
        return f"payload must be a file name, got {_shown(record['payload'])}"
    return None


def _mismatch(path: str, manifest: str, record: dict, size: int, sha256: str) -> str | None:
    """Why the payload (``size``, ``sha256``) does not match ``record``; None when it does."""
    if record["payload"] != os.path.basename(path):
        return (f"{manifest} is the manifest of {_shown(record['payload'])}, not of "
                f"{os.path.basename(path)!r} beside it (edited?)")
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
    for name in (path, manifest):  # a pipe or a device in a checkpoint file's place
        if os.path.lexists(name) and not os.path.isfile(name) and not os.path.isdir(name):
            raise CheckpointError(f"checkpoint file {name} {not_a_file(name)}: refused "
                                  f"unread{restart}")
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


def last_checkpoint(output_dir: str) -> tuple[str, int] | None:
    """``(path, step)`` of the checkpoint in a run's folder that a resume would start from,
    judged by its manifest and the payload's size (no SHA-256: quick enough for a message on
    Ctrl-C); None when there is none, or none whose manifest matches it."""
    path = os.path.join(output_dir, CHECKPOINT)
    manifest = _manifest_path(path)
    try:
        size = os.path.getsize(path)
    except OSError:
        return None
    # a save killed between its two renames left the new payload's manifest as a temporary
    for candidate in [manifest, *sorted(glob.glob(glob.escape(manifest) + ".tmp-*"))]:
        try:
            record = _read_manifest(candidate)
        except CheckpointError:
            continue
        if record["size"] == size:
            return path, record["step"]
    return None


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
    # torch's own warnings on the file (a pickle protocol it does not write, ...) are held back
    # and shown only for a checkpoint that passes every check: a refused one is one line
    with warnings.catch_warnings(record=True) as held:
        warnings.simplefilter("always")
        try:
            payload, refused = torch.load(path, map_location="cpu", weights_only=True), None
        except Exception as e:  # pickle.UnpicklingError for a refused object; zip errors...
            payload, refused = None, e
    if refused is not None:
        found = re.search(r"GLOBAL ([\w.]+)", str(refused))
        detail = f"it references {found.group(1)}" if found else type(refused).__name__
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
    for w in held:
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return {"model": payload["model"], "optimizer": payload["optimizer"],
            "scheduler": payload["scheduler"], "scaler": payload["scaler"],
            "rng": {"torch": payload["rng_torch"], "cuda": payload["rng_cuda"],
                    "python": meta["rng_python"], "numpy": meta["rng_numpy"]},
            "state": meta["state"], "config": meta["config"], "world_size": meta["world_size"],
            "origin": meta.get("origin")}


def save_checkpoint(path: str, *, model: nn.Module, optimizer: torch.optim.Optimizer,
                    scheduler: Any, scaler: torch.amp.GradScaler, state: TrainState,
                    config: TrainConfig, world_size: int, origin: dict | None = None) -> None:
    """Write a run's resumable state to ``path`` with this process's RNG states: the tensors
    and a JSON string of the rest, then the manifest, each atomically; then remove the
    temporaries of earlier, killed saves. ``origin``: what the run started from (see
    :class:`~rag_fast.training.Trainer`), kept when given."""
    rng = _rng_state()
    meta = {"state": asdict(state), "config": asdict(config), "world_size": world_size,
            "rng_python": rng["python"], "rng_numpy": rng["numpy"]}
    if origin is not None:
        meta["origin"] = origin
    _write_checkpoint({
        "format": CHECKPOINT_FORMAT,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "scaler": scaler.state_dict(),
        "rng_torch": rng["torch"],
        "rng_cuda": rng["cuda"],
        "meta": json.dumps(meta, default=json_default),
    }, path, state.step)


def restore_checkpoint(path: str, *, model: nn.Module, optimizer: torch.optim.Optimizer,
                       scheduler: Any, scaler: torch.amp.GradScaler, global_batch: int,
                       origin: dict | None = None) -> TrainState | None:
    """Load the checkpoint at ``path``, verified (see :func:`load_checkpoint`), into the model,
    optimizer, scheduler and scaler, and set every RNG state; returns its TrainState. Only
    when neither the checkpoint nor its manifest exists does it return None: a bad one raises.

    Raises:
        CheckpointError: naming the file: corrupt, truncated, without its manifest (or the
            manifest without it), holding objects other than tensors and plain data, or not
            fitting this model and optimizer.
        ValueError: a checkpoint from another ``global_batch`` (its data position would not
            match), or from a run with another ``origin`` (both given).
    """
    if not os.path.isfile(path) and not os.path.isfile(_manifest_path(path)):
        return None
    ckpt = load_checkpoint(path)
    saved = ckpt["config"]
    saved_batch = saved["micro_batch_size"] * saved["grad_accum"] * ckpt["world_size"]
    if saved_batch != global_batch:
        raise ValueError(f"{path} was written with global batch {saved_batch}, this run "
                         f"has {global_batch}: its data position would not match")
    if origin is not None and ckpt["origin"] is not None \
            and ckpt["origin"].get("id") != origin.get("id"):
        raise ValueError(
            f"{path} continues a run that started from {_describe(ckpt['origin'])}, not from "
            f"{_describe(origin)}: resuming would mix the two. Train into another "
            "output directory, or set \"resume\": false to start over here (the checkpoint "
            "is replaced)")
    try:
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        scaler.load_state_dict(ckpt["scaler"])
    except (RuntimeError, ValueError, KeyError) as e:
        raise CheckpointError(
            f"checkpoint {path} does not fit this model and optimizer (written with other "
            f"model or question-encoder options?): {e}") from None
    try:
        values = dict(ckpt["state"])
        values["history"] = [tuple(h) for h in values["history"]]
        values["evals"] = [tuple(e) for e in values["evals"]]
        state = TrainState(**values)
    except (TypeError, ValueError, KeyError) as e:
        raise CheckpointError(f"checkpoint {path} is not a valid rag_fast training "
                              f"checkpoint (its state: {e})") from None
    _set_rng_state(ckpt["rng"])
    return state


# ---------------------------------------------------------------------- the run folder
def check_run_folder(output_dir: str, flag: str = "output_dir") -> None:
    """Refuse ``output_dir`` unless it is missing, empty or already a training run's folder
    (which is resumed): a folder holding anything else is never written into.

    Raises:
        FileExistsError: naming ``flag`` and the folder.
    """
    if not _earlier_run(output_dir):
        check_output_folder(output_dir, RUN_KIND, reuse=True, flag=flag, links_checked=True)
    # the trained model is saved to model/ at the end: a folder there must be a model's
    check_output_folder(os.path.join(output_dir, "model"), "rag_fast.model", overwrite=True,
                        flag=f"{flag}'s model/")


_RUN_FILES = re.compile(r"(checkpoint-last\.(pt|json)(\.tmp-\d+)?|metrics\.jsonl|training\.png|"
                        r"model|index|index-refresh|\..*\.(tmp|new|old|trash)-.*)")


def _earlier_run(output_dir: str) -> bool:
    """Whether ``output_dir`` is the run folder of an earlier rag_fast (no marker): a verified
    checkpoint manifest and its payload, and nothing but what a run writes."""
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
    check_run_folder(output_dir, flag)
    if world_size > 1:
        dist.barrier()
    if rank == 0 and folder_kind(output_dir) != RUN_KIND:
        write_marker(output_dir, RUN_KIND)


def _describe(origin: dict) -> str:
    return ", ".join(str(v) for k, v in sorted(origin.items()) if k != "id") + \
        f" ({origin.get('id')})"
