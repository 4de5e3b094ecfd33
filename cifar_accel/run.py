"""One training run: everything it trains with, prepared by the Accelerator, and where it stands."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import evaluate
import torch
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader

from cifar_accel.averaging import WeightAverage
from cifar_accel.config import PER_STEP_SCHEDULES, TrainConfig
from cifar_accel.data import CifarData
from cifar_accel.engine import LossFn, TrainTransform, Transform
from cifar_accel.state import TrainerState


@dataclass
class Run:
    """Everything a run trains with, prepared by the Accelerator, and where it stands (``state``)."""

    config: TrainConfig
    accelerator: Accelerator
    output_dir: Path
    data: CifarData
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    loss_fn: LossFn
    train_loader: DataLoader
    train_transform: TrainTransform
    val_loader: DataLoader
    test_loader: DataLoader
    eval_transform: Transform
    metric: evaluate.EvaluationModule
    precision: dict[str, Any]  # the dtype report
    state: TrainerState
    last_checkpoint: Path | None  # the checkpoint resumed from
    global_batch_size: int
    learning_rate: float
    num_epochs: int  # the epochs it trains in: --num_train_epochs, or those --max_train_steps reaches into
    ema: WeightAverage | None  # the weight average, when --ema_decay is set
    profiler: torch.profiler.profile | None = None  # while train_epochs runs, with --profile_steps

    @property
    def eval_model(self) -> nn.Module:
        """What validation, test and export use: the weight average, if there is one."""
        return self.model if self.ema is None else self.ema.module

    @property
    def schedule_per_step(self) -> bool:
        """Whether the learning-rate schedule steps after every optimizer step (else once per epoch)."""
        return self.config.lr_scheduler_type in PER_STEP_SCHEDULES
