"""The bookkeeping of one run around its training loop (``train.train_epoch`` shows the order): count each batch
and optimizer step, guard against non-finite steps, log step telemetry, save checkpoints, honour stop requests,
and at an epoch's end record, log and save the epoch.

Whether the run is still finite is noted on the device at every optimizer step and read on the host only before
a checkpoint, at logged steps and at an epoch's end, where the model's weights and buffers are checked too. With
several processes a stop request is agreed across them at those same points, so no step waits for the device or
for the other processes for it.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.logging import get_logger

from cifar_accel.checkpoint import save_checkpoint
from cifar_accel.errors import RunFault, Stopped, counted
from cifar_accel.outputs import discard_replaced_run
from cifar_accel.run import Run
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
            f"the GradScaler skipped {counted(state.skipped_steps_in_a_row, 'optimizer step')} in a row (loss "
            f"scale now {accelerator.scaler.get_scale():g}) at epoch {state.epoch + 1}, optimizer step "
            f"{state.global_step}: "
            "the gradients overflow at any scale, so training diverged; "
            + _what_to_do(last_checkpoint, "a lower --learning_rate or --mixed_precision bf16")
        )


class NonFiniteGuard:
    """Stops a run without a GradScaler (no, bf16) once its loss or gradient norm is no longer finite: nothing
    skips a bad step there, so the weights would turn to NaN.

    ``record`` notes each optimizer step on the device, without waiting for it; ``check`` waits for the device
    and raises, naming the first bad step. The bookkeeper checks before every checkpoint, at logged steps and at
    each epoch's end, so nothing non-finite is ever saved. The gradients were averaged over processes, so every
    process stops at the same check.
    """

    def __init__(self, device: torch.device, global_step: int) -> None:
        self.step = torch.tensor(float(global_step), device=device)
        self.first_bad = torch.zeros(3, device=device)  # (step, loss, gradient norm) of the first bad step; 0: none

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


def check_finite_model(
    accelerator: Accelerator, model: torch.nn.Module, state: TrainerState, last_checkpoint: Path | None
) -> None:
    """Stop a run whose model's weights or buffers (BatchNorm's running statistics) hold NaN or infinity on any
    process. Activations can overflow while the loss stays finite (a huge learning rate), and an update can break
    the weights after the last loss was measured: the loss and gradient checks see neither."""
    broken = [
        name
        for name, value in accelerator.unwrap_model(model).state_dict().items()
        if value.is_floating_point() and not value.isfinite().all()
    ]
    if accelerator.reduce(torch.tensor(len(broken), device=accelerator.device), reduction="sum").item():
        named = ", ".join(broken[:3]) + (f" and {len(broken) - 3} more" if len(broken) > 3 else "")
        raise RunFault(
            f"non-finite values in the model's {named or 'state on another process'} at epoch {state.epoch + 1}, "
            f"optimizer step {state.global_step} (activations that overflow, or an update that broke the weights); "
            "the run stops here rather than save them; " + _what_to_do(last_checkpoint, "a lower --learning_rate")
        )


def _what_to_do(last_checkpoint: Path | None, new_run: str) -> str:
    if last_checkpoint is None:
        return f"no checkpoint was saved yet; start a new run with {new_run}"
    return (
        f"resume from the newest checkpoint, {last_checkpoint} (--resume_from_checkpoint latest, perhaps with "
        f"--max_grad_norm 1), or start a new run with {new_run}"
    )


class RunBookkeeper:
    """Counts a run's batches and optimizer steps, guards it against non-finite steps, logs its step telemetry,
    saves its checkpoints, honours stop requests (SIGINT, SIGTERM: the run ends after the current optimizer step,
    with a checkpoint) and records each epoch. An earlier run set aside by --overwrite_output_dir
    (``replaced_run``) is deleted once this run's first checkpoint is written."""

    def __init__(self, run: Run, stop: StopRequest, replaced_run: Path | None = None) -> None:
        self.run, self.state, self.stop, self.replaced_run = run, run.state, stop, replaced_run
        self.last_checkpoint = run.last_checkpoint  # the one saved last, or resumed from: what a failure points to
        steps = run.config.checkpointing_steps
        self.steps_between_saves = 0 if steps == "epoch" else int(steps)
        accelerator = run.accelerator
        self.guard = None if accelerator.scaler else NonFiniteGuard(accelerator.device, run.state.global_step)
        # The epoch under way: this process's (loss sum, correct, images), its start, and the training seconds
        # carried over from before a resume.
        self.totals = torch.zeros(3, device=accelerator.device)
        self.epoch_start = 0.0
        self.seconds_before = 0.0

    def stops_early(self) -> bool:
        """Whether the validation accuracy has not improved for ``early_stopping_patience`` epochs."""
        patience = self.run.config.early_stopping_patience
        if not self.state.should_stop_early(patience):
            return False
        logger.info(f"early stopping: no better validation accuracy for {counted(patience, 'epoch')}")
        return True

    def begin_epoch(self, epoch: int) -> Iterable:
        """Start the clock and the totals of ``epoch`` (counted from 0); the batches still to train on. A run
        resumed mid-epoch skips the batches it already trained on and carries on their totals and time."""
        accelerator, state, loader = self.run.accelerator, self.state, self.run.train_loader
        self.epoch_start = time.perf_counter()
        if state.epoch_learning_rate is None:  # an epoch starting now (or resumed from an older checkpoint)
            state.epoch_learning_rate = self.run.scheduler.get_last_lr()[0]
        loader.set_epoch(epoch)
        self.totals = torch.zeros(3, device=accelerator.device)
        if state.epoch_totals:  # a resumed epoch's first part: each process carries on its own sums
            self.totals += torch.tensor(state.epoch_totals[accelerator.process_index], device=self.totals.device)
        self.seconds_before = state.epoch_train_seconds
        return accelerator.skip_first_batches(loader, state.step_in_epoch) if state.step_in_epoch else loader

    def count_batch(self, loss: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor) -> None:
        """Add a batch to the epoch's totals. The accuracy counts against the class labels, also when MixUp or
        CutMix train on mixed targets."""
        self.totals[0] += loss.float() * len(labels)
        self.totals[1] += (logits.argmax(1) == labels).sum()
        self.totals[2] += len(labels)
        self.state.step_in_epoch += 1

    def count_step(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        """Count an optimizer step, and note whether it stayed finite (or, with a GradScaler, was skipped)."""
        state = self.state
        state.global_step += 1
        if self.guard is None:
            count_skipped_step(
                self.run.accelerator, state, self.run.config.max_consecutive_skipped_steps, self.last_checkpoint
            )
        else:
            self.guard.record(loss, grad_norm)

    def log_step(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        """Step telemetry every ``logging_steps`` optimizer steps, with the learning rate the step used."""
        if self.state.global_step % self.run.config.logging_steps == 0:
            self.check_finite()  # logging reads the loss on the host anyway
            log_step(self.run.accelerator, self.state, loss, grad_norm, self.run.optimizer.param_groups[0]["lr"])

    def save_or_stop(self) -> None:
        """A checkpoint every ``checkpointing_steps`` optimizer steps, or when a stop was requested (then stop).
        An epoch's last step (or the run's last, with --max_train_steps) is saved at the epoch's end, after the epoch
        is logged: a checkpoint taken before would make its resume log the epoch a second time."""
        accelerator, state = self.run.accelerator, self.state
        due = self.steps_between_saves and state.global_step % self.steps_between_saves == 0
        last = accelerator.gradient_state.end_of_dataloader or state.global_step == self.run.config.max_train_steps
        due = due and not last
        logged = state.global_step % self.run.config.logging_steps == 0
        # One process reads its own flag at no cost; several agree on it where they save or log anyway.
        stopping = self.stop.requested(accelerator) if due or logged or accelerator.num_processes == 1 else False
        if stopping or due:
            state.epoch_totals = accelerator.gather(self.totals.unsqueeze(0)).tolist()
            state.epoch_train_seconds = self.seconds_before + time.perf_counter() - self.epoch_start
            self.save()
            if stopping:
                raise self.stopped()

    def epoch_training(self) -> dict[str, float]:
        """The epoch's training loss, accuracy and images, summed over all processes, and its training seconds."""
        loss_sum, correct, seen = self.run.accelerator.reduce(self.totals.clone(), reduction="sum").tolist()
        seconds = self.seconds_before + time.perf_counter() - self.epoch_start
        return {"loss": loss_sum / seen, "accuracy": correct / seen, "images": int(seen), "seconds": seconds}

    def end_epoch(self, train: dict[str, float], val: dict[str, float] | None) -> EpochRecord:
        """Record and log the epoch (``val`` is None without validation), save a checkpoint, and honour a stop
        request where another epoch follows; after the run's last one the request waits until the final test and
        export are done, as one that comes during them does."""
        self.check_finite()
        record = EpochRecord(
            epoch=self.state.epoch + 1,
            train_loss=train["loss"],
            train_accuracy=train["accuracy"],
            val_loss=val and val["loss"],
            val_accuracy=val and val["accuracy"],
            val_samples=val["samples"] if val else 0,
            learning_rate=self.state.epoch_learning_rate,
            train_images=train["images"],
            train_seconds=train["seconds"],
            train_images_per_second=train["images"] / train["seconds"],
            epoch_seconds=time.perf_counter() - self.epoch_start,
            skipped_steps=self.state.skipped_steps,
            loss_scale=loss_scale(self.run.accelerator),
        )
        self.state.record_epoch(record)
        log_epoch(self.run.accelerator, record, self.state.global_step)
        self.save()
        if self.trains_on() and self.stop.requested(self.run.accelerator):
            raise self.stopped()
        return record

    def trains_on(self) -> bool:
        """Whether an epoch follows the one just recorded: the epoch loop's test, without its log line."""
        patience = self.run.config.early_stopping_patience
        return self.state.epoch < self.run.num_epochs and not self.state.should_stop_early(patience)

    def check_finite(self) -> None:
        if self.guard is not None:
            self.guard.check(self.state, self.last_checkpoint)
        check_finite_model(self.run.accelerator, self.run.model, self.state, self.last_checkpoint)

    def save(self) -> Path:
        self.check_finite()
        run = self.run
        self.last_checkpoint = save_checkpoint(
            run.accelerator, run.output_dir, self.state, keep=run.config.checkpoints_total_limit, ema=run.ema
        )
        if self.replaced_run is not None and run.accelerator.is_main_process:
            discard_replaced_run(run.output_dir)
            self.replaced_run = None
        return self.last_checkpoint

    def stopped(self) -> Stopped:
        state = self.state
        return Stopped(
            f"stopped by {self.stop.name} after {counted(state.epoch, 'epoch')} and "
            f"{counted(state.step_in_epoch, 'batch', 'batches')} "
            f"(optimizer step {state.global_step}); saved {self.last_checkpoint}; resume with "
            "--resume_from_checkpoint latest",
            exit_code=self.stop.exit_code,
        )
