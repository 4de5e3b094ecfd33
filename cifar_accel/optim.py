"""What the training minimises and how: the loss, the optimizer and the learning-rate schedule."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from cifar_accel.config import PER_STEP_SCHEDULES, TrainConfig
from cifar_accel.engine import LossFn
from cifar_accel.errors import InputError, counted


def build_loss(config: TrainConfig) -> LossFn:
    """The training loss, used by every training step and by the precision report."""
    if config.label_smoothing:
        return functools.partial(F.cross_entropy, label_smoothing=config.label_smoothing)
    return F.cross_entropy


def build_optimizer(config: TrainConfig, model: nn.Module, learning_rate: float) -> torch.optim.Optimizer:
    """Adam, AdamW, SGD or Muon over the model's parameter groups (its ``parameter_groups`` hook, else one group),
    each group with the learning rate and weight decay scaled as the hook says. Muon takes the conv filter banks
    (the trained 4-D weights) out of those groups into one of its own."""
    if hasattr(model, "parameter_groups"):
        groups = [
            {
                "params": g["params"],
                "lr": learning_rate * g["lr_scale"],
                "weight_decay": config.weight_decay * g["weight_decay_scale"],
                "whitening_bias": g.get("whitening_bias", False),
            }
            for g in model.parameter_groups(config.bias_lr_scale)
        ]
    else:
        groups = [{"params": list(model.parameters())}]
    if config.optimizer == "muon":
        filters = [p for g in groups for p in g["params"] if p.ndim == 4]
        for group in groups:
            group["params"] = [p for p in group["params"] if p.ndim != 4]
        groups = [g for g in groups if g["params"]]
        groups.append(
            {
                "params": filters,
                "lr": config.muon_learning_rate,
                "momentum": config.muon_momentum,
                "weight_decay": 0.0,
                "muon": True,
                "ns_steps": config.muon_ns_steps,
                "ns_dtype": config.muon_ns_dtype,
            }
        )
        return MuonSGD(
            groups,
            lr=learning_rate,
            momentum=config.momentum,
            nesterov=config.nesterov,
            weight_decay=config.weight_decay,
        )
    if config.optimizer == "sgd":
        return torch.optim.SGD(
            groups,
            lr=learning_rate,
            momentum=config.momentum,
            nesterov=config.nesterov,
            weight_decay=config.weight_decay,
        )
    adam = torch.optim.AdamW if config.optimizer == "adamw" else torch.optim.Adam
    return adam(groups, lr=learning_rate, weight_decay=config.weight_decay)


def newton_schulz(
    matrix: torch.Tensor, steps: int = 5, dtype: torch.dtype = torch.float32, eps: float = 1e-7
) -> torch.Tensor:
    """An approximate orthogonalisation of ``matrix`` (rows x columns), computed in ``dtype``: U S' V^T for its
    SVD U S V^T, with every S' near 1 (0.7-1.2 after 5 steps). Muon's quintic Newton-Schulz iteration, with its
    coefficients (Keller Jordan, 2024)."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = matrix.to(dtype)
    x = x / (x.norm() + eps)
    wide = x.size(0) <= x.size(1)
    if not wide:
        x = x.T
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x if wide else x.T


class MuonSGD(torch.optim.Optimizer):
    """Muon on the parameter groups marked ``muon``, SGD on the others, in one optimizer, so that one state dict,
    one schedule and one GradScaler step cover both.

    SGD: ``d = g + weight_decay * p``, ``buf = momentum * buf + d``, a step of ``lr`` along ``d + momentum * buf``
    (Nesterov) or ``buf``, as ``torch.optim.SGD`` without dampening. Muon (airbench94_muon's): the same momentum
    without weight decay, then each filter bank is renormalised to norm sqrt(output channels) and steps by ``lr``
    along the Newton-Schulz orthogonalisation of its update (``ns_steps`` iterations in ``ns_dtype``), seen as an
    (output channels x rest) matrix."""

    def __init__(self, params, lr: float, momentum: float, nesterov: bool, weight_decay: float) -> None:
        defaults = {
            "lr": lr,
            "momentum": momentum,
            "nesterov": nesterov,
            "weight_decay": weight_decay,
            "muon": False,
            "ns_steps": 5,
            "ns_dtype": "float32",
        }
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                update = p.grad.add(p, alpha=group["weight_decay"]) if group["weight_decay"] else p.grad
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                buf = state["momentum_buffer"].mul_(group["momentum"]).add_(update)
                update = update.add(buf, alpha=group["momentum"]) if group["nesterov"] else buf
                if group["muon"]:
                    p.mul_(len(p) ** 0.5 / p.norm())
                    matrix = update.reshape(len(p), -1)
                    dtype = getattr(torch, group["ns_dtype"])
                    update = newton_schulz(matrix, group["ns_steps"], dtype).to(p.dtype).view_as(p)
                p.add_(update, alpha=-group["lr"])
        return loss


@dataclass
class StepSchedule:
    """The learning-rate factor as a pure function of the optimizer step: a linear warm-up from ``start_factor``
    to 1 over ``warmup_steps``, then a linear or cosine decay to ``end_factor`` at ``total_steps``. Its fields
    are saved with the scheduler's state, so a resumed run knows the schedule it was on."""

    kind: str
    total_steps: int
    warmup_steps: int
    start_factor: float
    end_factor: float

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return self.start_factor + (1 - self.start_factor) * step / self.warmup_steps
        progress = min(1.0, (step - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps))
        decay = 0.5 * (1 + math.cos(math.pi * progress)) if self.kind == "cosine_steps" else 1 - progress
        return self.end_factor + (1 - self.end_factor) * decay


def total_steps(config: TrainConfig, steps_per_epoch: int) -> int:
    """The optimizer steps a run takes in all: --max_train_steps, else --num_train_epochs whole epochs."""
    return config.max_train_steps or config.num_train_epochs * steps_per_epoch


def total_epochs(config: TrainConfig, steps_per_epoch: int) -> int:
    """The epochs a run trains in: --num_train_epochs, or those --max_train_steps reaches into (the last one
    stopping part way where the steps end there)."""
    return math.ceil(total_steps(config, steps_per_epoch) / steps_per_epoch)


def build_scheduler(
    config: TrainConfig, optimizer: torch.optim.Optimizer, steps_per_epoch: int
) -> torch.optim.lr_scheduler.LRScheduler:
    """The learning-rate schedule: epoch-wise (``step``, ``cosine``; stepped at each epoch's end) or per
    optimizer step (``linear``, ``cosine_steps``; stepped after each optimizer step, see ``Run.schedule_per_step``).
    With --whiten_bias_epochs, the whitening bias's group decays linearly to 0 over those epochs instead."""
    if config.lr_scheduler_type in PER_STEP_SCHEDULES:
        total = total_steps(config, steps_per_epoch)
        schedule = StepSchedule(
            config.lr_scheduler_type,
            total,
            round(total * config.warmup_ratio),
            config.lr_start_factor,
            config.lr_end_factor,
        )
        whitening_steps = max(1, round(config.whiten_bias_epochs * steps_per_epoch))
        whitening = StepSchedule("linear", whitening_steps, 0, 1.0, 0.0)
        schedules = [
            whitening if config.whiten_bias_epochs and group.get("whitening_bias") else schedule
            for group in optimizer.param_groups
        ]
        return torch.optim.lr_scheduler.LambdaLR(optimizer, schedules)
    if config.lr_scheduler_type == "cosine":
        return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total_epochs(config, steps_per_epoch))
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=config.lr_step_size, gamma=config.lr_gamma)


def freeze_decayed_whitening_bias(optimizer: torch.optim.Optimizer) -> None:
    """Stop computing the whitening bias's gradient once --whiten_bias_epochs has brought its learning rate to 0,
    where its schedule keeps it: its steps leave it as it is, with or without a gradient, and without one the
    backward pass skips the first convolution's input gradient (about 5% of fast_net's training step). Only for a
    model that is not wrapped in DDP, which expects a gradient for every parameter it was given."""
    for group in optimizer.param_groups:
        if group.get("whitening_bias") and group["lr"] == 0:
            for param in group["params"]:
                param.requires_grad_(False)


def check_resumed_schedule(
    scheduler: torch.optim.lr_scheduler.LRScheduler, config: TrainConfig, steps_per_epoch: int, checkpoint: Path
) -> None:
    """Refuse to change the length of a schedule that has one. The cosine's period (epochs) and a per-step
    schedule's total steps, restored from the checkpoint, come from the run's first length: a longer run would
    run the learning rate back up the cosine, or past the end of the decay. StepLR has no length and extends
    as it is (one drop every ``lr_step_size`` epochs)."""
    epochs = total_epochs(config, steps_per_epoch)
    if isinstance(scheduler, torch.optim.lr_scheduler.CosineAnnealingLR):
        if scheduler.T_max != epochs:
            asked, fix = f"--num_train_epochs {epochs}", f"--num_train_epochs {scheduler.T_max}"
            if config.max_train_steps:  # the same steps, in epochs of another number of processes
                asked = f"--max_train_steps {config.max_train_steps} in epochs of {counted(steps_per_epoch, 'step')}"
                fix = "the number of processes it started with"
            raise InputError(
                f"checkpoint '{checkpoint}' anneals the learning rate to zero over "
                f"{counted(scheduler.T_max, 'epoch')} (the cosine schedule's period), so {asked} cannot change it: the "
                f"learning rate would run back up the cosine; resume with {fix}, or start a new run with the longer "
                "schedule"
            )
    elif isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR):
        total, wanted = scheduler.lr_lambdas[0].total_steps, total_steps(config, steps_per_epoch)
        if total != wanted:
            raise InputError(
                f"checkpoint '{checkpoint}' follows a '{config.lr_scheduler_type}' schedule over "
                f"{counted(total, 'optimizer step')}, and this run would take {wanted} ({counted(epochs, 'epoch')} "
                f"of {steps_per_epoch}); resume with the number of epochs and processes it started with, or start a "
                "new run"
            )
