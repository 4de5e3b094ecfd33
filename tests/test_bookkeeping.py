"""The bookkeeping per step and per epoch (counting, the non-finite guard, telemetry, step checkpoints, stop
requests, the epoch record), tested in this process on real Accelerate objects and the real epoch loop."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from cifar_accel.bookkeeping import NonFiniteGuard, RunBookkeeper, count_skipped_step
from cifar_accel.checkpoint import STATE_FILE, complete_checkpoints
from cifar_accel.config import TrainConfig
from cifar_accel.engine import training_step
from cifar_accel.errors import RunFault, Stopped
from cifar_accel.run import Run
from cifar_accel.state import EpochRecord, TrainerState
from cifar_accel.stopping import StopRequest
from cifar_accel.train import train_epoch

from conftest import fp16_accelerator, read_results, tiny_args


def small_run(tmp_path: Path, accumulation: int = 1, accelerator: Accelerator | None = None, **config: object) -> Run:
    """A run of a small prepared model, optimizer, epoch-wise schedule and a loader of 12 batches of 4; what the
    bookkeeping does not use (data, evaluation, metric) is left out."""
    torch.manual_seed(0)
    accelerator = accelerator or Accelerator(cpu=True, gradient_accumulation_steps=accumulation)
    model = nn.Sequential(nn.Flatten(), nn.Linear(12, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    generator = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(48, 3, 2, 2, generator=generator), torch.randint(0, 3, (48,), generator=generator))
    loader = DataLoader(data, batch_size=4, shuffle=True, generator=generator)
    model, optimizer, scheduler, loader = accelerator.prepare(model, optimizer, scheduler, loader)
    settings = TrainConfig(output_dir=str(tmp_path), checkpoints_total_limit=100, **config)
    return Run(
        config=settings, accelerator=accelerator, output_dir=tmp_path, data=None, model=model, optimizer=optimizer,
        scheduler=scheduler, loss_fn=F.cross_entropy, train_loader=loader,
        train_transform=lambda x, y, epoch, num_epochs: (x, y), val_loader=None, test_loader=None,
        eval_transform=None, metric=None, precision={}, state=TrainerState(),
        last_checkpoint=None, global_batch_size=4 * accumulation, learning_rate=0.1, num_epochs=2, ema=None,
    )  # fmt: skip


def test_batches_and_optimizer_steps_are_counted_and_saved_every_n_steps(tmp_path):
    run = small_run(tmp_path, accumulation=2, checkpointing_steps="2")
    books = RunBookkeeper(run, StopRequest())
    stats = train_epoch(run, books, epoch=0)
    state = run.state
    assert (state.step_in_epoch, state.global_step) == (12, 6)  # 12 batches, 2 per optimizer step
    # Step 6 ends the epoch: it is saved by the epoch's end, once the epoch is recorded, not before.
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step_00000002", "step_00000004"]
    saved = json.loads((tmp_path / "checkpoints" / "step_00000004" / STATE_FILE).read_text())
    assert (saved["step_in_epoch"], saved["global_step"]) == (8, 4)
    assert saved["epoch_totals"][0][2] == 32  # the images of the epoch so far, kept for a mid-epoch resume
    assert saved["epoch_train_seconds"] > 0
    assert stats["images"] == 48 and books.last_checkpoint == tmp_path / "checkpoints" / "step_00000004"
    books.end_epoch(stats, None)
    assert books.last_checkpoint == tmp_path / "checkpoints" / "step_00000006"
    saved = json.loads((books.last_checkpoint / STATE_FILE).read_text())
    assert (saved["epoch"], saved["step_in_epoch"], len(saved["history"])) == (1, 0, 1)


def test_max_train_steps_ends_the_epoch_part_way_and_counts_the_steps_a_grad_scaler_skipped(tmp_path):
    """--max_train_steps counts optimizer steps as the schedule does, the ones fp16's GradScaler skipped included:
    a loss scale of 2**24 overflows the gradients, so each of the 5 steps is skipped and halves the scale."""
    accelerator = fp16_accelerator("cpu", init_scale=2.0**24)
    run = small_run(tmp_path, accelerator=accelerator, max_train_steps=5, checkpointing_steps="5")
    before = [p.detach().clone() for p in run.model.parameters()]
    books = RunBookkeeper(run, StopRequest())
    stats = train_epoch(run, books, epoch=0)
    assert (run.state.global_step, run.state.step_in_epoch, run.state.skipped_steps) == (5, 5, 5)
    assert stats["images"] == 20 and accelerator.scaler.get_scale() == 2.0**19
    assert all(torch.equal(b, p) for b, p in zip(before, run.model.parameters(), strict=True))
    assert complete_checkpoints(tmp_path) == []  # the run's last step is saved at the epoch's end, not before it
    books.end_epoch(stats, None)
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step_00000005"]
    assert run.state.history[0].train_images == 20


def test_end_epoch_records_and_saves_with_the_rate_the_epoch_trained_with(tmp_path):
    run = small_run(tmp_path)
    books = RunBookkeeper(run, StopRequest())
    for epoch in range(2):
        train = train_epoch(run, books, epoch)
        run.scheduler.step()  # epoch-wise, as train_epochs steps it before the epoch is recorded
        record = books.end_epoch(train, {"loss": 1.5 - epoch, "accuracy": 0.5 + epoch / 10, "samples": 7})
    assert [r.learning_rate for r in run.state.history] == [0.1, 0.05]  # the rate each epoch trained with
    assert run.optimizer.param_groups[0]["lr"] == 0.025
    assert record == run.state.history[-1]
    assert (record.epoch, record.val_accuracy, record.val_samples, record.train_images) == (2, 0.6, 7, 48)
    assert run.state.best_checkpoint == "step_00000024" and run.state.step_in_epoch == 0
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step_00000012", "step_00000024"]


def test_the_epoch_record_is_the_one_source_of_history_tracker_scalars_and_log_line():
    record = EpochRecord(
        epoch=3, train_loss=1.23456, train_accuracy=0.5, val_loss=1.5, val_accuracy=0.625, val_samples=40,
        learning_rate=0.001, train_images=288, train_seconds=2.0, train_images_per_second=144.0, epoch_seconds=2.5,
        skipped_steps=0, loss_scale=None,
    )  # fmt: skip
    assert list(record.to_dict()) == [f.name for f in dataclasses.fields(EpochRecord)]
    assert record.tracker_values() == {
        "train/loss": 1.23456, "train/accuracy": 0.5, "val/loss": 1.5, "val/accuracy": 0.625,
        "learning_rate": 0.001, "train/images_per_second": 144.0, "epoch_seconds": 2.5,
    }  # fmt: skip
    assert record.log_line() == (
        "epoch 3: train loss 1.2346 acc 0.5000 | val loss 1.5000 acc 0.6250 | lr 1.00e-03 | 144 img/s | 2.5 s"
    )


class SignalAtStep5(RunBookkeeper):
    signals = (signal.SIGTERM,)

    def count_step(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        super().count_step(loss, grad_norm)
        if self.state.global_step == 5:
            for number in self.signals:
                os.kill(os.getpid(), number)  # recorded, not fatal: the step in progress completes


class CtrlCUnderTheLauncherAtStep5(SignalAtStep5):
    signals = (signal.SIGINT, signal.SIGTERM)  # the terminal's SIGINT, then the one `accelerate launch` sends on


@pytest.mark.parametrize("number", [signal.SIGTERM, signal.SIGHUP])  # a scheduler's stop, a closed terminal
def test_a_stop_request_saves_a_checkpoint_and_stops_with_the_signals_exit_code(
    tmp_path, monkeypatch, number, hangup_as_a_terminal_sends_it
):
    run = small_run(tmp_path)
    monkeypatch.setattr(SignalAtStep5, "signals", (number,))
    books = SignalAtStep5(run, StopRequest())
    previous = signal.getsignal(number)
    with books.stop, pytest.raises(Stopped) as stop:
        books.stop.defer()  # as once the run writes: record the signal, stop at the next optimizer step
        train_epoch(run, books, epoch=0)
    assert signal.getsignal(number) == previous  # the handler is put back
    assert stop.value.exit_code == 128 + number
    assert str(stop.value).startswith(
        f"stopped by {signal.Signals(number).name} after 0 epochs and 5 batches (optimizer step 5); saved "
    )
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step_00000005"]


def test_under_nohup_a_hangup_is_no_stop_request(tmp_path):
    """nohup starts the run with SIGHUP ignored: closing the terminal must not stop it, so that stays as it is."""
    run = small_run(tmp_path)
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        books = type("HangupAtStep5", (SignalAtStep5,), {"signals": (signal.SIGHUP,)})(run, StopRequest())
        with books.stop:
            books.stop.defer()
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
            train_epoch(run, books, epoch=0)
        assert books.state.global_step > 5 and books.stop.signal_number == 0
    finally:
        signal.signal(signal.SIGHUP, previous)


def test_overflows_are_skipped_and_counted_and_too_many_in_a_row_stop_the_run(tmp_path):
    accelerator = fp16_accelerator("cpu", init_scale=1024.0)
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    state, scales = TrainerState(), []
    checkpoint = tmp_path / "checkpoints" / "step_00000002"

    def step(overflow: bool) -> None:
        inputs = torch.full((8, 4), float("inf") if overflow else 1.0)
        before = model.weight.detach().clone()
        loss, _, grad_norm = training_step(accelerator, model, optimizer, F.mse_loss, inputs, torch.zeros(8, 2))
        state.global_step += 1
        try:
            count_skipped_step(accelerator, state, max_consecutive_skipped_steps=3, last_checkpoint=checkpoint)
        finally:
            scales.append(accelerator.scaler.get_scale())
            assert torch.equal(model.weight, before) == overflow  # a skipped step leaves the weights alone

    for overflow in (True, True, True, False, True, True, True):
        step(overflow)
    assert (state.skipped_steps, state.skipped_steps_in_a_row) == (6, 3)  # the good step reset the streak
    with pytest.raises(
        RunFault, match=r"skipped 4 optimizer steps in a row \(loss scale now 8\).*--learning_rate"
    ) as e:
        step(overflow=True)
    assert f"resume from the newest checkpoint, {checkpoint} (" in str(e.value)
    assert scales == [512, 256, 128, 128, 64, 32, 16, 8]  # halved at each overflow, kept by the good step


def test_without_a_scaler_the_first_non_finite_step_is_named_at_the_next_check(tmp_path):
    state = TrainerState(epoch=2, global_step=7)
    guard = NonFiniteGuard(torch.device("cpu"), global_step=state.global_step)
    finite, nan, inf = torch.tensor(1.0), torch.tensor(float("nan")), torch.tensor(float("inf"))
    guard.record(finite, finite)  # step 8
    guard.check(state, None)
    guard.record(nan, finite)  # step 9: noted on the device, raised at the check
    guard.record(finite, inf)  # step 10: a later bad step does not replace the first
    checkpoint = tmp_path / "checkpoints" / "step_00000006"
    expected = (
        r"loss \(nan\) or gradient norm \(1.0\) at epoch 3, optimizer step 9;.*newest checkpoint, .*step_00000006"
    )
    with pytest.raises(RunFault, match=expected):
        guard.check(state, checkpoint)
    fresh = NonFiniteGuard(torch.device("cpu"), global_step=0)
    fresh.record(finite, inf)
    with pytest.raises(RunFault, match=r"gradient norm \(inf\) at epoch 3, optimizer step 1;.*no checkpoint"):
        fresh.check(state, None)


class NaNWeightsAfterStep12(RunBookkeeper):
    """Turns one weight tensor into NaN after optimizer step 12, so that step 13's loss and gradients are NaN."""

    def save_or_stop(self) -> None:
        super().save_or_stop()
        if self.state.global_step == 12:
            with torch.no_grad():
                self.run.optimizer.param_groups[0]["params"][0].fill_(float("nan"))


def test_a_nan_loss_stops_the_run_naming_the_step_and_the_checkpoint_to_resume(tiny_dataset, train_here, tmp_path):
    """The guard checks before the checkpoint of step 16: step 13 was the first NaN, and nothing after step 12 is
    saved."""
    out = tmp_path / "run"
    args = tiny_args(tiny_dataset, out, "--num_train_epochs", "2", "--checkpointing_steps", "4")
    proc = train_here(args, bookkeeper_type=NaNWeightsAfterStep12)  # 9 steps an epoch: step 13 is epoch 2's 4th
    assert proc.returncode == 1
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("error: non-finite training loss (nan) or gradient norm (nan) at epoch 2, optimizer step 13")
    assert f"resume from the newest checkpoint, {out / 'checkpoints' / 'step_00000012'} (" in line
    assert [p.name for p in complete_checkpoints(out)] == ["step_00000009", "step_00000012"]
    assert not (out / "results.json").exists()

    resumed = train_here([*args, "--resume_from_checkpoint", "latest"])
    assert resumed.returncode == 0, resumed.stderr
    assert "1 epoch and 3 batches done" in resumed.stdout
    assert read_results(out)["epochs_completed"] == 2 and (out / "model.safetensors").is_file()


class InfStatisticsAfterStep5(RunBookkeeper):
    """Sets the first BatchNorm's running variance to infinity after optimizer step 5, as overflowing activations
    do: training normalises with each batch's own statistics, so the loss and gradients stay finite."""

    def save_or_stop(self) -> None:
        super().save_or_stop()
        if self.state.global_step == 5:
            norm = next(m for m in self.run.model.modules() if isinstance(m, nn.BatchNorm2d))
            norm.running_var.fill_(float("inf"))


def test_non_finite_weights_or_statistics_behind_a_finite_loss_stop_the_run_before_a_save(
    tiny_dataset, train_here, tmp_path
):
    out = tmp_path / "run"
    args = tiny_args(tiny_dataset, out, "--checkpointing_steps", "4")
    proc = train_here(args, bookkeeper_type=InfStatisticsAfterStep5)  # 9 steps: saves due at 4 and 8
    assert proc.returncode == 1
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(
        "error: non-finite values in the model's features.0.1.running_var at epoch 1, optimizer step 8 "
        "(activations that overflow, or an update that broke the weights); the run stops here rather than save them; "
        "resume from the newest checkpoint, "
        f"{out / 'checkpoints' / 'step_00000004'} ("
    )
    assert [p.name for p in complete_checkpoints(out)] == ["step_00000004"]
    assert not (out / "results.json").exists()
    resumed = train_here([*args, "--resume_from_checkpoint", "latest"])
    assert resumed.returncode == 0, resumed.stderr


def test_the_first_of_two_stop_requests_names_the_stop(tmp_path):
    run = small_run(tmp_path)
    books = CtrlCUnderTheLauncherAtStep5(run, StopRequest())
    with books.stop, pytest.raises(Stopped) as stop:
        books.stop.defer()
        train_epoch(run, books, epoch=0)
    assert stop.value.exit_code == 130
    assert str(stop.value).startswith("stopped by SIGINT after 0 epochs and 5 batches (optimizer step 5); saved ")
