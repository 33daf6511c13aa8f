"""Joint training of RagModel: AdamW, autocast, accumulation, checkpoints, torch.distributed."""
from rag_fast.training.rag_data import encode_targets, rag_collate, rag_loss
from rag_fast.training.trainer import (CheckpointError, TrainConfig, Trainer, TrainState,
                                       atomic_torch_save, enable_gradient_checkpointing,
                                       load_checkpoint, lr_lambda, make_optimizer, plot_training,
                                       resolve_device)

__all__ = [
    "CheckpointError", "TrainConfig", "TrainState", "Trainer", "atomic_torch_save",
    "enable_gradient_checkpointing", "encode_targets", "load_checkpoint", "lr_lambda",
    "make_optimizer", "plot_training", "rag_collate", "rag_loss", "resolve_device",
]
