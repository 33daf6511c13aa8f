"""Joint training of RagModel: AdamW, autocast, accumulation, checkpoints, torch.distributed."""
from rag_fast.training.rag_data import encode_targets, rag_collate, rag_loss
from rag_fast.training.trainer import (TrainConfig, Trainer, TrainState, atomic_torch_save,
                                       enable_gradient_checkpointing, lr_lambda, make_optimizer)

__all__ = [
    "TrainConfig", "TrainState", "Trainer", "atomic_torch_save", "enable_gradient_checkpointing",
    "encode_targets", "lr_lambda", "make_optimizer", "rag_collate", "rag_loss",
]
