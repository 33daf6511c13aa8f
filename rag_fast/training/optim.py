"""The optimizer and its schedule: AdamW with parameter groups (no decay on biases and norms,
the question encoder frozen or at its own learning rate) and the learning-rate multiplier of
each step (linear warm-up, then linear, cosine or constant)."""
from __future__ import annotations

import math
from typing import Callable

import torch
from torch import nn

from rag_fast.training.config import TrainConfig


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


def trainable_question_encoder(model: nn.Module, config: TrainConfig) -> nn.Module | None:
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
    encoder = trainable_question_encoder(model, config)
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
