"""What the training minimises and how: the loss, the optimizer and the learning-rate schedule."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from cifar_accel.config import TrainConfig
from cifar_accel.engine import LossFn
from cifar_accel.errors import InputError


def build_loss(config: TrainConfig) -> LossFn:
    """The training loss, used by every training step and by the precision report."""
    return F.cross_entropy


def build_optimizer(config: TrainConfig, model: nn.Module, learning_rate: float) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=learning_rate, weight_decay=config.weight_decay)


def build_scheduler(config: TrainConfig, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    """The epoch-wise learning-rate schedule."""
    if config.lr_scheduler_type == "cosine":
        return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=config.num_train_epochs)
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=config.lr_step_size, gamma=config.lr_gamma)


def check_resumed_schedule(
    scheduler: torch.optim.lr_scheduler.LRScheduler, config: TrainConfig, checkpoint: Path
) -> None:
    """Refuse to extend a cosine schedule: its period, restored from the checkpoint, is the run's first
    ``num_train_epochs``, so the epochs after it would run the learning rate back up the cosine's second half.
    StepLR has no period and extends as it is (one drop every ``lr_step_size`` epochs)."""
    if isinstance(scheduler, torch.optim.lr_scheduler.CosineAnnealingLR) and scheduler.T_max != config.num_train_epochs:
        raise InputError(
            f"checkpoint '{checkpoint}' anneals the learning rate to zero over {scheduler.T_max} epochs (the cosine "
            f"schedule's period), so --num_train_epochs {config.num_train_epochs} cannot change it: the learning "
            f"rate would run back up the cosine; resume with --num_train_epochs {scheduler.T_max}, or start a new "
            "run with the longer schedule"
        )
