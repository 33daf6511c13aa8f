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
"""
from __future__ import annotations

import contextlib
import math
import os
import random
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
SCHEDULES = ("linear", "cosine", "constant")
CHECKPOINT = "checkpoint-last.pt"


@dataclass
class TrainConfig:
    """Training options (all JSON-serialisable; ``rag-fast train --config`` reads them)."""

    max_steps: int = 1000
    micro_batch_size: int = 8          # examples per process per forward
    grad_accum: int = 1                # micro-batches per optimizer step
    lr: float = 3e-5
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    adam_eps: float = 1e-8
    warmup_steps: int = 0
    schedule: str = "linear"           # decay after warm-up: linear | cosine | constant
    max_grad_norm: float | None = 1.0  # None: no clipping
    precision: str = "fp32"            # fp32 | bf16 | fp16 (autocast)
    gradient_checkpointing: bool = False
    seed: int = 0
    output_dir: str | None = None      # checkpoints; None: none written
    checkpoint_every: int = 0          # steps; 0: only at the end (if output_dir)
    eval_every: int = 0                # steps; 0: never
    log_every: int = 10
    progress: bool = True
    find_unused_parameters: bool = True
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {tuple(PRECISIONS)}, got {self.precision!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        for name in ("max_steps", "micro_batch_size", "grad_accum"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if self.warmup_steps < 0 or self.warmup_steps > self.max_steps:
            raise ValueError(f"warmup_steps must be in [0, max_steps], got {self.warmup_steps}")
        self.betas = tuple(self.betas)

    @classmethod
    def from_dict(cls, values: dict) -> "TrainConfig":
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown training options {unknown}; known: {sorted(known)}")
        return cls(**values)


@dataclass
class TrainState:
    step: int = 0
    epoch: int = 0
    offset: int = 0          # examples of this epoch already consumed (global)
    last_loss: float = float("nan")
    history: list = field(default_factory=list)  # (step, loss) every log_every steps
    evals: list = field(default_factory=list)    # (step, metrics)


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


def make_optimizer(model: nn.Module, config: TrainConfig) -> torch.optim.Optimizer:
    """AdamW without weight decay on biases and norms; torch's fused implementation (one pass
    per tensor, no temporaries) where every parameter allows it, as transformers' Trainer
    defaults to."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if p.dim() < 2 else decay).append(p)
    groups = [{"params": decay, "weight_decay": config.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    fused = all(p.device.type in _FUSED_ADAM_DEVICES and p.dtype in _FUSED_ADAM_DTYPES
                for p in decay + no_decay)
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=config.lr, betas=config.betas,
                             eps=config.adam_eps, fused=fused or None)


def _rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(),
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def atomic_torch_save(obj: Any, path: str) -> None:
    """``torch.save`` to a temporary file in the same folder, fsync, then rename over ``path``."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def world() -> tuple[int, int]:
    """``(rank, world_size)`` of the initialised process group, or ``(0, 1)``."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class Trainer:
    """Trains ``model`` on ``dataset``.

    Args:
        model: the module to train (a RagModel, or any module ``loss_fn`` understands).
        dataset: a sequence of examples.
        collate: list of examples -> batch (whatever ``loss_fn`` takes).
        loss_fn: ``(model, batch) -> scalar loss``, a mean over the batch's examples.
        config: TrainConfig.
        eval_fn: ``(model) -> dict`` of metrics, run every ``eval_every`` steps on rank 0.
        on_step_end: ``(state) -> None`` after each step (and its checkpoint).
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
    ) -> None:
        if len(dataset) == 0:
            raise ValueError("the training dataset is empty")
        self.rank, self.world_size = world()
        self.config = config
        self.global_batch = config.micro_batch_size * config.grad_accum * self.world_size
        if self.global_batch > len(dataset):
            raise ValueError(f"global batch {self.global_batch} (micro_batch_size x grad_accum x "
                             f"world_size) is larger than the dataset ({len(dataset)} examples)")
        self.model, self.dataset, self.collate, self.loss_fn = model, dataset, collate, loss_fn
        self.eval_fn, self.on_step_end = eval_fn, on_step_end
        if config.gradient_checkpointing:
            enable_gradient_checkpointing(model)
        self.optimizer = make_optimizer(model, config)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(config))
        device = next(model.parameters()).device
        self.device_type = device.type
        self.scaler = torch.amp.GradScaler(self.device_type, enabled=config.precision == "fp16")
        self.ddp = None
        if self.world_size > 1:
            self.ddp = nn.parallel.DistributedDataParallel(
                model, device_ids=[device.index] if device.type == "cuda" else None,
                find_unused_parameters=config.find_unused_parameters)
        self.state = TrainState()
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
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.scheduler.step()
        self.state.step += 1
        self.state.last_loss = total
        return total

    def train(self) -> TrainState:
        """Run (or continue) until ``max_steps``; returns the final state."""
        config = self.config
        bar = None
        if config.progress and self.rank == 0:
            from tqdm.auto import tqdm

            bar = tqdm(total=config.max_steps, initial=self.state.step, desc="train",
                       dynamic_ncols=True)
        start, seen = time.perf_counter(), 0
        while self.state.step < config.max_steps:
            loss = self.train_step()
            seen += self.global_batch
            step = self.state.step
            if step % max(1, config.log_every) == 0 or step == config.max_steps:
                self.state.history.append((step, loss))
            if bar is not None:
                rate = seen / max(time.perf_counter() - start, 1e-9)
                bar.set_postfix(loss=f"{loss:.4f}", ex_per_s=f"{rate:.1f}")
                bar.update(1)
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
        return self.state

    def evaluate(self) -> dict | None:
        metrics = None
        if self.rank == 0 and self.eval_fn is not None:
            metrics = self.eval_fn(self.model)
            self.state.evals.append((self.state.step, metrics))
            if self.config.progress:
                from tqdm.auto import tqdm

                tqdm.write(f"step {self.state.step}: " +
                           ", ".join(f"{k}={v:.4f}" for k, v in metrics.items()))
        if self.world_size > 1:
            dist.barrier()
        return metrics

    # ------------------------------------------------------------------ checkpoints
    def checkpoint_path(self) -> str:
        if not self.config.output_dir:
            raise ValueError("config.output_dir is not set")
        return os.path.join(self.config.output_dir, CHECKPOINT)

    def save_checkpoint(self) -> None:
        """Write the resumable state atomically (rank 0; RNG state of rank 0)."""
        if self.rank == 0:
            atomic_torch_save({
                "model": self.model.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(),
                "scaler": self.scaler.state_dict(),
                "state": asdict(self.state),
                "rng": _rng_state(),
                "config": asdict(self.config),
                "world_size": self.world_size,
            }, self.checkpoint_path())
        if self.world_size > 1:
            dist.barrier()

    def resume(self, path: str | None = None) -> bool:
        """Load the last checkpoint if there is one; returns whether it did.

        Raises:
            ValueError: a checkpoint from a different global batch size (its data position
                would not match).
        """
        path = path or self.checkpoint_path()
        if not os.path.isfile(path):
            return False
        ckpt = torch.load(path, map_location="cpu", weights_only=False)
        saved = ckpt["config"]
        global_batch = saved["micro_batch_size"] * saved["grad_accum"] * ckpt["world_size"]
        if global_batch != self.global_batch:
            raise ValueError(f"{path} was written with global batch {global_batch}, this run "
                             f"has {self.global_batch}: its data position would not match")
        self.model.load_state_dict(ckpt["model"])
        self.optimizer.load_state_dict(ckpt["optimizer"])
        self.scheduler.load_state_dict(ckpt["scheduler"])
        self.scaler.load_state_dict(ckpt["scaler"])
        self.state = TrainState(**ckpt["state"])
        _set_rng_state(ckpt["rng"])
        return True


def enable_gradient_checkpointing(model: nn.Module) -> None:
    """Turn on gradient checkpointing of a RagModel's generator (or of a HF model itself)."""
    target = getattr(model, "generator", model)
    if not hasattr(target, "gradient_checkpointing_enable"):
        raise ValueError(f"{type(target).__name__} does not support gradient checkpointing")
    target.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
