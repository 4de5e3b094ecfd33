"""The policies around the training loop, per step and per epoch, in one object.

After every batch the monitor counts it; after every optimizer step it notes whether the run is still finite
(checked on the host before anything is saved, not at every step), logs step telemetry, steps a per-step
schedule, updates the weight average, saves step checkpoints and honours a stop request (SIGINT, SIGTERM). At an
epoch's end it steps an epoch-wise schedule, records and logs the epoch, saves a checkpoint and again honours a
stop request.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.logging import get_logger
from torch import nn
from torch.utils.data import DataLoader

from cifar_accel.averaging import WeightAverage
from cifar_accel.checkpoint import save_checkpoint
from cifar_accel.config import TrainConfig
from cifar_accel.errors import RunFault, Stopped
from cifar_accel.optim import steps_per_update
from cifar_accel.outputs import discard_replaced_run
from cifar_accel.state import EpochRecord, TrainerState
from cifar_accel.stopping import StopRequest
from cifar_accel.telemetry import log_epoch, log_step, loss_scale

logger = get_logger(__name__)


def count_skipped_step(
    accelerator: Accelerator, state: TrainerState, max_consecutive_skipped_steps: int, last_checkpoint: Path | None
) -> None:
    """fp16, after an optimizer step: count the steps the GradScaler skipped, and stop a run that diverged.

    A non-finite gradient is an overflow there: the scaler skips the step and halves the scale, which is expected
    now and then; too many in a row means the run diverged. (The scaler reads its overflow flag on the host at
    every step anyway, so asking whether it skipped costs no extra wait.)
    """
    if not accelerator.optimizer_step_was_skipped:
        state.skipped_steps_in_a_row = 0
        return
    state.skipped_steps += 1
    state.skipped_steps_in_a_row += 1
    if state.skipped_steps_in_a_row > max_consecutive_skipped_steps:
        raise RunFault(
            f"the GradScaler skipped {state.skipped_steps_in_a_row} optimizer steps in a row (loss scale now "
            f"{accelerator.scaler.get_scale():g}) at epoch {state.epoch + 1}, optimizer step {state.global_step}: "
            "the gradients overflow at any scale, so training diverged; "
            + _what_to_do(last_checkpoint, "a lower --learning_rate or --mixed_precision bf16")
        )


class NonFiniteGuard:
    """Stops a run without a GradScaler (no, bf16) once its loss or gradient norm is no longer finite: nothing
    skips a bad step there, so the weights would turn to NaN.

    ``record`` notes each optimizer step on the device, without waiting for it; ``check`` waits for the device
    and raises, naming the first bad step. The monitor checks before every checkpoint, at logged steps and at
    each epoch's end, so nothing non-finite is ever saved. The gradients were averaged over processes, so every
    process stops at the same check.
    """

    def __init__(self, device: torch.device, global_step: int) -> None:
        self.step = torch.tensor(float(global_step), device=device)
        self.first_bad = torch.zeros(
            3, device=device
        )  # (step, loss, gradient norm) of the first bad step; step 0: none

    def record(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        self.step += 1
        values = torch.stack((self.step, loss.float(), grad_norm.float()))
        first = ~values[1:].isfinite().all() & (self.first_bad[0] == 0)
        self.first_bad = torch.where(first, values, self.first_bad)

    def check(self, state: TrainerState, last_checkpoint: Path | None) -> None:
        step, loss, grad_norm = self.first_bad.tolist()
        if step:
            raise RunFault(
                f"non-finite training loss ({loss}) or gradient norm ({grad_norm}) at epoch {state.epoch + 1}, "
                f"optimizer step {int(step)}; the run stops here rather than train on NaN weights; "
                + _what_to_do(last_checkpoint, "a lower --learning_rate or --max_grad_norm 1")
            )


def _what_to_do(last_checkpoint: Path | None, new_run: str) -> str:
    if last_checkpoint is None:
        return f"no checkpoint was saved yet; start a new run with {new_run}"
    return (
        f"resume from the newest checkpoint, {last_checkpoint} (--resume_from_checkpoint latest, perhaps with "
        f"--max_grad_norm 1), or start a new run with {new_run}"
    )


class TrainingMonitor:
    """Per-step and per-epoch policies of one run: ``begin_epoch``, ``after_step`` after every batch, and
    ``end_epoch``. A SIGINT or SIGTERM recorded by ``stop`` ends the run after the current optimizer step, with
    a checkpoint. An earlier run set aside by --overwrite_output_dir (``replaced_run``) is deleted once this
    run's first checkpoint is written."""

    def __init__(
        self,
        accelerator: Accelerator,
        config: TrainConfig,
        state: TrainerState,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        output_dir: Path,
        stop: StopRequest,
        last_checkpoint: Path | None = None,
        replaced_run: Path | None = None,
        ema: WeightAverage | None = None,
        model: nn.Module | None = None,
    ) -> None:
        self.accelerator, self.config, self.state = accelerator, config, state
        self.optimizer, self.scheduler = optimizer, scheduler
        self.output_dir = output_dir
        self.last_checkpoint = last_checkpoint  # the one saved last, or resumed from: what a failure points to
        self.steps_between_saves = 0 if config.checkpointing_steps == "epoch" else int(config.checkpointing_steps)
        self.schedule_per_step = steps_per_update(config)
        self.stop = stop
        self.replaced_run = replaced_run
        self.ema, self.model = ema, model  # the weight average follows the (unwrapped) model after each step
        self.guard = None if accelerator.scaler is not None else NonFiniteGuard(accelerator.device, state.global_step)
        # The epoch under way: this process's (loss sum, correct, images), its start, and the training seconds
        # carried over from before a resume.
        self.totals = torch.zeros(3, device=accelerator.device)
        self.epoch_start = 0.0
        self.seconds_before = 0.0

    def stops_early(self) -> bool:
        """Whether the validation accuracy has not improved for ``early_stopping_patience`` epochs."""
        if not self.state.should_stop_early(self.config.early_stopping_patience):
            return False
        logger.info(f"early stopping: no better validation accuracy for {self.config.early_stopping_patience} epochs")
        return True

    def begin_epoch(self, epoch: int, train_loader: DataLoader) -> Iterable:
        """Start the clock and the totals of ``epoch`` (counted from 0); the batches still to train on. A run
        resumed mid-epoch skips the batches it already trained on and carries on their totals and time."""
        self.epoch_start = time.perf_counter()
        if self.state.epoch_learning_rate is None:  # an epoch starting now (or resumed from an older checkpoint)
            self.state.epoch_learning_rate = self.scheduler.get_last_lr()[0]
        train_loader.set_epoch(epoch)
        self.totals = torch.zeros(3, device=self.accelerator.device)
        if self.state.epoch_totals:  # a resumed epoch's first part: each process carries on its own sums
            self.totals += torch.tensor(
                self.state.epoch_totals[self.accelerator.process_index], device=self.totals.device
            )
        self.seconds_before = self.state.epoch_train_seconds
        if self.state.step_in_epoch:
            return self.accelerator.skip_first_batches(train_loader, self.state.step_in_epoch)
        return train_loader

    def after_step(self, loss: torch.Tensor, grad_norm: torch.Tensor | None) -> None:
        """After every batch. On optimizer steps (not on accumulation-only batches): the non-finite guard, step
        telemetry every ``logging_steps``, a checkpoint every ``checkpointing_steps``, and a stop request."""
        state = self.state
        state.step_in_epoch += 1
        if not self.accelerator.sync_gradients:
            return
        state.global_step += 1
        if self.guard is None:
            count_skipped_step(self.accelerator, state, self.config.max_consecutive_skipped_steps, self.last_checkpoint)
        else:
            self.guard.record(loss, grad_norm)
        if state.global_step % self.config.logging_steps == 0:
            self.check_finite()  # logging reads the loss on the host anyway
            log_step(self.accelerator, state, loss, grad_norm, self.optimizer.param_groups[0]["lr"])
        if self.schedule_per_step:  # also after a step the GradScaler skipped: the schedule counts steps taken
            self.scheduler.step()
        if self.ema is not None:
            self.ema.update(self.model)
        stopping = self.stop.requested(self.accelerator)
        due = self.steps_between_saves and state.global_step % self.steps_between_saves == 0
        # An epoch's last step is saved at the epoch's end, after the epoch is logged: a checkpoint taken before
        # would make its resume log the epoch a second time.
        if stopping or (due and not self.accelerator.gradient_state.end_of_dataloader):
            state.epoch_totals = self.accelerator.gather(self.totals.unsqueeze(0)).tolist()
            state.epoch_train_seconds = self.seconds_before + time.perf_counter() - self.epoch_start
            self.save()
            if stopping:
                raise self.stopped()

    def end_epoch(self, train: dict[str, float], val: dict[str, float] | None) -> EpochRecord:
        """Step an epoch-wise schedule, record and log the epoch (``val`` is None without validation), save a
        checkpoint, honour a stop request."""
        self.check_finite()
        if not self.schedule_per_step:
            self.scheduler.step()
        train_seconds = self.seconds_before + train["seconds"]
        record = EpochRecord(
            epoch=self.state.epoch + 1,
            train_loss=train["loss"],
            train_accuracy=train["accuracy"],
            val_loss=val and val["loss"],
            val_accuracy=val and val["accuracy"],
            val_samples=val["samples"] if val else 0,
            learning_rate=self.state.epoch_learning_rate,
            train_images=train["images"],
            train_seconds=train_seconds,
            train_images_per_second=train["images"] / train_seconds,
            epoch_seconds=time.perf_counter() - self.epoch_start,
            skipped_steps=self.state.skipped_steps,
            loss_scale=loss_scale(self.accelerator),
        )
        self.state.record_epoch(record)
        log_epoch(self.accelerator, record, self.state.global_step)
        self.save()
        if self.stop.requested(self.accelerator):
            raise self.stopped()
        return record

    def check_finite(self) -> None:
        if self.guard is not None:
            self.guard.check(self.state, self.last_checkpoint)

    def save(self) -> Path:
        self.check_finite()
        self.last_checkpoint = save_checkpoint(
            self.accelerator, self.output_dir, self.state, keep=self.config.checkpoints_total_limit, ema=self.ema
        )
        if self.replaced_run is not None and self.accelerator.is_main_process:
            discard_replaced_run(self.output_dir)
            self.replaced_run = None
        return self.last_checkpoint

    def stopped(self) -> Stopped:
        state = self.state
        return Stopped(
            f"stopped by {self.stop.name} after {state.epoch} epochs and {state.step_in_epoch} batches "
            f"(optimizer step {state.global_step}); saved {self.last_checkpoint}; resume with "
            "--resume_from_checkpoint latest",
            exit_code=self.stop.exit_code,
        )
