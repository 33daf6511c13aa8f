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
  scaler, step, data position and every RNG state, restored exactly on resume (its files and
  their verification: ``rag_fast.training.checkpoint``).

Under DDP, ``find_unused_parameters`` (``TrainConfig``) makes every backward pass search the
autograd graph for parameters that got no gradient, and DDP warns when it finds none; without
it, such a parameter makes DDP fail at the next step. Which parameters go unused depends on the
model and its options (a frozen question encoder is not trainable at all, but an encoder's
pooler is unused under mean pooling), so by default (None) the first step decides: it runs
without DDP, after the parameters and buffers were broadcast from rank 0 as DDP would; after
its backward pass the gradients are averaged over the ranks by hand, the same arithmetic as
DDP's, and the model is then wrapped in DDP with ``find_unused_parameters`` on exactly when a
trainable parameter got no gradient on some rank (their names: ``Trainer.unused_parameters``).
``true`` or ``false`` in the config are used as they are. Whenever DDP runs without the
search (decided or set so), each step checks that every trainable parameter got a gradient: one
that goes unused stops the run before the optimizer step, with an error naming it and saying to
set the option to true.

The rest of a run lives beside this loop: its options in ``rag_fast.training.config``, the
optimizer and schedule in ``rag_fast.training.optim``, the plot in ``rag_fast.training.plot``.

Rank 0 also appends logged steps and evaluations to ``metrics.jsonl`` and draws ``training.png``
at the end (both in ``output_dir``; see TrainConfig). A logged step's ``loss`` is what
``loss_fn`` returns, averaged over the step's micro-batches: for ``rag_loss``, the mean over the
step's questions of each answer's negative log-likelihood summed over its tokens (the paper's
objective, so it grows with the answers' length); ``loss_per_token`` divides the loss summed
over the questions by their target tokens (``RagModel.count_targets``), comparable across
answer lengths and vocabularies (null for a model without ``count_targets``, or a batch
without ``labels``). A logged step's ``elapsed_s`` is the run's
training time up to it, continued across resumes (``TrainState.elapsed_s``, checkpointed; the
time of steps after the last checkpoint of a killed session is not counted, as they are trained
again), ``examples_per_s`` the rate of the current session, and ``threads`` the CPU threads
the step ran on. When the model's retriever
keeps its time (``retrieval_seconds``), each logged line also has ``step_s`` and
``retrieval_s`` (mean seconds per step since the previous line, and the retrieval part of it).

Rank 0 says once, in one line, when the steps become far slower than the first ones (the median
of the last 5 steps over 3x that of steps 3 to 7: ``rag_fast._threads.SlowStepWatch``), which
on a CPU usually means another process is using the cores (docs/tuning.md, "Threads on a shared
machine"); above the progress bar when there is one, else as a ``SlowStepsWarning``.

A collective retriever (``model.retriever.collective``: a sharded index over the process group,
see ``rag_fast.retrieval.sharded.ShardedRetriever``) is searched by every rank in each forward
pass, on the default group DDP uses too (every rank issues the same collectives in the same
order), and evaluation then runs on every rank (docs/distributed.md).

With ``refresh_index_every`` the passages are re-embedded by the current encoder and the
rebuilt index swapped in on every rank after every N-th step and the last one; the step of the
index in use (``TrainState.refreshed_at``) is checkpointed and its index reopened on resume
(see ``rag_fast.training.refresh``).
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import random
import sys
import time
import warnings
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from rag_fast import _threads
from rag_fast._jsonl import check_regular_file
from rag_fast._threads import SlowStepWatch
from rag_fast.storage import append_line, atomic_write
from rag_fast.training.checkpoint import (CHECKPOINT, TrainState, json_default, claim_run_folder,
                                          restore_checkpoint, save_checkpoint,
                                          settle_killed_saves)
from rag_fast.training.config import CHECKPOINT_MANIFEST, PRECISIONS, TrainConfig
from rag_fast.training import heap
from rag_fast.training.distributed import average_gradients, broadcast_module, world
from rag_fast.training.optim import trainable_question_encoder, lr_lambda, make_optimizer
from rag_fast.training.plot import plotted_number, plot_training
from rag_fast.training.refresh import IndexRefresher, question_encoder_embedder

# The most a metrics file may hold when a run resumes (it is read whole to drop the records past
# the checkpoint): a step's record is about 200 bytes, so millions of steps fit.
MAX_METRICS_BYTES = 1 << 30


class SlowStepsWarning(UserWarning):
    """Training steps became far slower than the first ones (``rag_fast._threads``'
    ``SlowStepWatch``): usually another process using the CPU."""


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


def enable_gradient_checkpointing(model: nn.Module) -> None:
    """Turn on gradient checkpointing of a RagModel's generator (or of a HF model itself)."""
    target = getattr(model, "generator", model)
    if not hasattr(target, "gradient_checkpointing_enable"):
        raise ValueError(f"{type(target).__name__} does not support gradient checkpointing")
    target.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


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
        encoder = trainable_question_encoder(model, config)
        if config.freeze_question_encoder:
            encoder.requires_grad_(False)
        if config.gradient_checkpointing:
            enable_gradient_checkpointing(model)
        if config.compile:
            if not hasattr(model, "compiled"):  # every nn.Module has compile(); RagModel's differs
                raise ValueError("compile: true needs a rag_fast RagModel (its compile() "
                                 f"compiles the training regions), got {type(model).__name__}")
            model.compile()
        self.optimizer = make_optimizer(model, config)
        self._lr_factor = lr_lambda(config)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_factor)
        self._step_lr = config.lr * self._lr_factor(0)  # lr of the last step (base groups)
        device = next(model.parameters()).device
        self.device_type = device.type
        self.scaler = torch.amp.GradScaler(self.device_type, enabled=config.precision == "fp16")
        self.ddp = None
        # DDP's find_unused_parameters: the config's, or (None) decided by the first step
        self.find_unused_parameters = config.find_unused_parameters
        self.unused_parameters: list[str] = []  # trainable, no gradient in the first step
        if self.world_size > 1:
            if self.find_unused_parameters is None:
                broadcast_module(model)  # what wrapping does; the first step wraps it
            else:
                self._wrap(self.find_unused_parameters)
        self.state = TrainState()
        self.last_token_loss: float | None = None  # the last step's loss per target token
        if config.output_dir:
            claim_run_folder(config.output_dir, self.rank, self.world_size)
            # what the run writes and resumes from, inside it (a link planted there that leads
            # out is refused), before any step
            for name in (config.metrics_file, config.plot_file, CHECKPOINT, CHECKPOINT_MANIFEST):
                self._output_file(name)
        self.refresher = None
        if config.refresh_index_every:
            embed = passage_embedder or question_encoder_embedder(model)
            self.refresher = IndexRefresher(getattr(model, "retriever", None), embed,
                                            config.output_dir, self.rank, self.world_size)
        random.seed(config.seed)
        np.random.seed(config.seed)
        torch.manual_seed(config.seed)

    # ------------------------------------------------------------------ data parallelism
    def _wrap(self, find_unused_parameters: bool) -> None:
        device = next(self.model.parameters()).device
        self.ddp = nn.parallel.DistributedDataParallel(
            self.model, device_ids=[device.index] if device.type == "cuda" else None,
            find_unused_parameters=find_unused_parameters)

    def _first_step_decides(self) -> None:
        """After the first step's backward pass, run without DDP: average its gradients over
        the ranks by hand (as DDP would have), and wrap the model in DDP with
        ``find_unused_parameters`` on exactly when a trainable parameter got no gradient on
        some rank."""
        named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        unused = average_gradients([p for _, p in named])
        self.find_unused_parameters = bool(unused)
        self.unused_parameters = [named[i][0] for i in unused]
        self._wrap(self.find_unused_parameters)

    def _check_every_gradient(self) -> None:
        """Under DDP without find_unused_parameters: every trainable parameter got a gradient
        in this step, else a ValueError naming them and the option (raised before the
        optimizer step: DDP has not averaged this step's gradients, and would fail at the next
        one)."""
        missing = [n for n, p in self.model.named_parameters()
                   if p.requires_grad and p.grad is None]
        if not missing:
            return
        how = ("every trainable parameter got one in the first step, which decided it"
               if self.config.find_unused_parameters is None else
               "the config sets find_unused_parameters false")
        named = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5
                                          else "")
        raise ValueError(
            f"step {self.state.step + 1}: no gradient for the trainable parameter"
            f"{'s' if len(missing) > 1 else ''} {named}, and DDP runs without "
            f"find_unused_parameters ({how}): set train.find_unused_parameters to true "
            "(rag-fast train --set train.find_unused_parameters=true)")

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
        summed, tokens = 0.0, 0  # the loss summed over questions, and their target tokens
        count = getattr(self.model, "count_targets", None)
        for j, indices in enumerate(micro):
            batch = self.collate([self.dataset[i] for i in indices])
            last = j == len(micro) - 1
            sync = contextlib.nullcontext() if last or self.ddp is None else self.ddp.no_sync()
            with sync:
                with self._autocast():
                    loss = self.loss_fn(module, batch)
                self.scaler.scale(loss / config.grad_accum).backward()
            value = float(loss.detach())  # (one read of the loss from the device)
            total += value / config.grad_accum
            if count is not None and isinstance(batch, dict) and "labels" in batch:
                summed += value * len(indices)
                tokens += count(batch["labels"])
        self.last_token_loss = summed / tokens if tokens else None
        if self.world_size > 1 and self.ddp is None:
            self._first_step_decides()
        elif self.ddp is not None and not self.find_unused_parameters:
            self._check_every_gradient()
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
        # elapsed_s continues the run's time across resumes (the checkpoint's elapsed_s), while
        # examples_per_s is this session's rate
        start, seen, before_session = time.perf_counter(), 0, self.state.elapsed_s
        watch = SlowStepWatch()  # says once when steps become far slower than the first ones
        if config.keep_freed_memory and self.device_type == "cpu":
            heap.keep_freed_memory()  # no page faults for what the last step freed
        threads_before = _threads.get_threads()
        fixed = config.threads if config.threads is not None else _threads.threads_from_env()
        auto = None
        if fixed is not None:
            _threads.set_threads(fixed)
        elif self.device_type == "cpu":
            auto = _threads.AutoThreads()
        if _threads.COMMAND_POLICY and self.device_type == "cpu" and self.rank == 0:
            # on stdout with the run's log: a run that then fails says so in one line on stderr
            notice = ("rag_fast: other processes were keeping the cores busy as this command "
                      "started: OpenMP threads sleep at barriers instead of spinning in this run "
                      "(OMP_WAIT_POLICY=PASSIVE; set OMP_WAIT_POLICY to choose)")
            if bar is not None:
                bar.write(notice, file=sys.stdout)
            else:
                print(notice)
        self._threads_fixed = fixed is not None  # what the slow-step warning suggests
        try:
            return self._train_loop(bar, watch, auto, start, seen, before_session)
        finally:
            _threads.set_threads(threads_before)  # a library user's process keeps its setting

    def _train_loop(self, bar, watch, auto, start, seen, before_session) -> TrainState:
        config = self.config
        # retrieval time inside the training steps (not evaluation), per logged interval
        interval = {"steps": 0, "step_s": 0.0, "retrieval_s": 0.0}
        while self.state.step < config.max_steps:
            before, step_start = self._retrieval_seconds(), time.perf_counter()
            loss = self.train_step()
            after = self._retrieval_seconds()
            step_s = time.perf_counter() - step_start
            interval["steps"] += 1
            interval["step_s"] += step_s
            if auto is not None:
                changed = auto.after_step(self.state.step)
                if changed is not None and len(auto.changes) == 1 and self.rank == 0:
                    self._say(f"other processes are using {auto.other_cores():.1f} of the "
                              f"cores: training on {changed} thread(s) instead of {auto.most} "
                              "while they do (threads: null adapts; --threads N or "
                              "RAG_FAST_THREADS fix the count)", bar, None)
            slow = watch.observe(step_s)
            if slow is not None and self.rank == 0:
                if self._threads_fixed:
                    slow += "; the count is fixed (--threads, RAG_FAST_THREADS or threads in " \
                            "the config): unset it to adapt"
                self._say(slow, bar, SlowStepsWarning)
            if before is not None and after is not None:
                interval["retrieval_s"] += after - before
            seen += self.global_batch
            step = self.state.step
            elapsed = max(time.perf_counter() - start, 1e-9)
            self.state.elapsed_s = before_session + elapsed
            if step % max(1, config.log_every) == 0 or step == config.max_steps:
                self.state.history.append((step, loss))
                token_loss = self.last_token_loss
                record = {"step": step, "loss": loss if math.isfinite(loss) else None,
                          "loss_per_token": (round(token_loss, 6) if token_loss is not None
                                             and math.isfinite(token_loss) else None),
                          "lr": self._step_lr, "examples_per_s": round(seen / elapsed, 3),
                          "elapsed_s": round(self.state.elapsed_s, 3),
                          "threads": _threads.get_threads()}
                if after is not None:  # a timed retriever: mean seconds per step since the last record
                    n = max(1, interval["steps"])
                    record["step_s"] = round(interval["step_s"] / n, 6)
                    record["retrieval_s"] = round(interval["retrieval_s"] / n, 6)
                interval = {"steps": 0, "step_s": 0.0, "retrieval_s": 0.0}
                self._log_metrics(record)
            if bar is not None:
                shown = {"loss": f"{loss:.4f}"}  # per question: summed over its answer tokens
                if self.last_token_loss is not None:
                    shown["per_token"] = f"{self.last_token_loss:.4f}"
                bar.set_postfix(**shown, ex_per_s=f"{seen / elapsed:.1f}")
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

    @staticmethod
    def _say(message: str, bar, category) -> None:
        """One line for the user: a warning of ``category`` on stderr (above the progress bar
        when there is one), or (None) a notice on stdout with the run's log, so that a run
        that then fails still prints one line on stderr."""
        if category is None:
            if bar is not None:  # the bar stays intact below the line
                bar.write(f"rag_fast: {message}", file=sys.stdout)
            else:
                print(f"rag_fast: {message}", flush=True)
        elif bar is not None:
            bar.write(f"rag_fast: warning: {message}", file=sys.stderr)
        else:
            warnings.warn(message, category, stacklevel=3)

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
                number = plotted_number(value)
                rounded[name] = (value if number is None
                                 else round(number, 4) if math.isfinite(number) else None)
            self._log_metrics({"step": self.state.step, "eval": rounded})
            if self.config.progress:
                from tqdm.auto import tqdm

                tqdm.write(f"step {self.state.step}: " +
                           ", ".join(f"{k}={v:.4f}" if plotted_number(v) is not None else f"{k}={v}"
                                     for k, v in metrics.items()))
        if self.world_size > 1:
            dist.barrier()
        return metrics

    # ------------------------------------------------------------------ metrics
    def _output_file(self, name: str | None) -> str | None:
        """``output_dir/name``, or None when either is unset.

        Raises:
            ValueError: the path leads out of ``output_dir`` through a symbolic link (a
                config's own path cannot: TrainConfig refuses it).
        """
        if not name or not self.config.output_dir:
            return None
        path = os.path.join(self.config.output_dir, name)
        root = os.path.realpath(self.config.output_dir)
        if os.path.commonpath([root, os.path.realpath(path)]) != root:
            raise ValueError(f"{name!r} in output_dir {self.config.output_dir!r} leads out of "
                             "it (a symbolic link): refused, nothing is written outside the run")
        return path

    def _log_metrics(self, record: dict) -> None:
        """Append one JSON line to the metrics file (rank 0; non-finite numbers as null). The
        file is opened without following a symbolic link in its place."""
        path = self._output_file(self.config.metrics_file)
        if path is None or self.rank != 0:
            return
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        append_line(path, json.dumps(record, default=json_default))

    def _trim_metrics(self) -> None:
        """Drop the metrics file's records after ``state.step`` (and a last record cut short
        by a kill), rewriting it atomically, so that the log matches the run. Lines that are
        not this trainer's records are kept as they are."""
        path = self._output_file(self.config.metrics_file)
        if path is None or not os.path.lexists(path):
            return
        # before anything opens it: a named pipe would wait for a writer, a device never end
        check_regular_file(path, "train.metrics_file", "the run's metrics (JSON lines)")
        size = os.path.getsize(path)
        if size > MAX_METRICS_BYTES:
            raise ValueError(f"train.metrics_file: {path!r} holds {size / 2**30:.1f} GiB, more "
                             f"than a run's metrics take ({MAX_METRICS_BYTES / 2**30:g} GiB at "
                             "most): not this run's metrics? Move it aside")
        # bytes that are not UTF-8 (not ours) are kept as they are, through surrogateescape
        with open(path, encoding="utf-8", errors="surrogateescape") as f:
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
            atomic_write(path, lambda f: f.write("".join(keep).encode("utf-8",
                                                                       "surrogateescape")))

    # ------------------------------------------------------------------ checkpoints
    def checkpoint_path(self) -> str:
        """``<output_dir>/checkpoint-last.pt`` (its manifest: ``checkpoint-last.json``)."""
        if not self.config.output_dir:
            raise ValueError("config.output_dir is not set")
        return os.path.join(self.config.output_dir, CHECKPOINT)

    def save_checkpoint(self) -> None:
        """Write the resumable state (rank 0; RNG state of rank 0) to :meth:`checkpoint_path`,
        atomically with its manifest (see :func:`~rag_fast.training.checkpoint.save_checkpoint`)."""
        if self.rank == 0:
            save_checkpoint(self.checkpoint_path(), model=self.model, optimizer=self.optimizer,
                            scheduler=self.scheduler, scaler=self.scaler, state=self.state,
                            config=self.config, world_size=self.world_size, origin=self.origin)
        if self.world_size > 1:
            dist.barrier()
        if self.refresher is not None:  # the checkpoint needs only its own refreshed index now
            self.refresher.prune(self.state.refreshed_at, after=False)

    def resume(self, path: str | None = None) -> bool:
        """Load the last checkpoint, verified (see
        :func:`~rag_fast.training.checkpoint.load_checkpoint`); returns whether
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
        state = restore_checkpoint(
            path or self.checkpoint_path(), model=self.model, optimizer=self.optimizer,
            scheduler=self.scheduler, scaler=self.scaler, global_batch=self.global_batch,
            origin=self.origin)
        if state is None:
            return False
        if self.rank == 0:  # the writer of checkpoints: what a killed save left is settled
            settle_killed_saves(path or self.checkpoint_path())
        self.state = state
        return True
