"""Joint training of RagModel: AdamW, autocast, accumulation, checkpoints, torch.distributed.

Modules: ``config`` (TrainConfig), ``optim`` (optimizer and schedule), ``checkpoint`` (resumable
state, checkpoint files, the run's folder), ``plot`` (the training plot), ``trainer`` (the loop),
``distributed`` (process groups), ``refresh`` (index refresh), ``rag_data`` (batches and loss).
"""
from rag_fast.training.checkpoint import (CheckpointError, TrainState, atomic_torch_save,
                                          check_run_folder, load_checkpoint)
from rag_fast.training.config import TrainConfig
from rag_fast.training.optim import lr_lambda, make_optimizer
from rag_fast.training.plot import plot_training
from rag_fast.training.rag_data import encode_targets, rag_collate, rag_loss
from rag_fast.training.trainer import Trainer, enable_gradient_checkpointing, resolve_device

__all__ = [
    "CheckpointError", "TrainConfig", "TrainState", "Trainer", "atomic_torch_save",
    "check_run_folder", "enable_gradient_checkpointing", "encode_targets", "load_checkpoint",
    "lr_lambda", "make_optimizer", "plot_training", "rag_collate", "rag_loss", "resolve_device",
]
