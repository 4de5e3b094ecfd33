"""Exact, crash-safe resume: interrupted runs end where uninterrupted ones do."""

from __future__ import annotations

import json
import random
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator
from safetensors.torch import load_file
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from cifar_accel.checkpoint import (
    STATE_FILE,
    TrainerState,
    check_resumed_epochs,
    complete_checkpoints,
    load_checkpoint,
    resolve_checkpoint,
    save_checkpoint,
)
from cifar_accel.errors import InputError

from conftest import (
    assert_same_run,
    crashed_copy,
    good_split,
    read_results,
    run_cli,
    tiny_args,
    train_in_process,
    wait_until,
    write_split_files,
)


def run_args(dataset: Path, out: Path, precision: str, *extra: str) -> list[str]:
    """Three epochs of 9 optimizer steps each on the tiny dataset, a checkpoint every 4 steps, all kept."""
    return tiny_args(
        dataset, out, "--num_train_epochs", "3", "--mixed_precision", precision, "--checkpointing_steps", "4",
        "--checkpoints_total_limit", "100", "--max_eval_samples", "40", *extra,
    )  # fmt: skip


@pytest.fixture(scope="module", params=["no", "bf16"])
def uninterrupted(request, tiny_dataset, tmp_path_factory) -> tuple[str, Path]:
    """The uninterrupted run, in this process; the signal test compares a subprocess's resumed run with it."""
    out = tmp_path_factory.mktemp(f"straight_{request.param}") / "run"
    assert train_in_process(run_args(tiny_dataset, out, request.param)) == 0
    return request.param, out


@pytest.mark.parametrize(("cut", "where"), [(18, "end of epoch 2"), (20, "2 batches into epoch 3")])
def test_resume_from_a_checkpoint_is_bitwise_exact(uninterrupted, tiny_dataset, train_here, tmp_path, cut, where):
    precision, straight = uninterrupted
    resumed = crashed_copy(straight, tmp_path / "resumed", last_step=cut)
    assert complete_checkpoints(resumed)[-1].name == f"step_{cut:08d}"

    proc = train_here([*run_args(tiny_dataset, resumed, precision), "--resume_from_checkpoint", "latest"])
    assert proc.returncode == 0, proc.stderr
    assert f"2 epochs and {cut - 18} batches done" in proc.stdout
    tensors, max_diff = assert_same_run(straight, resumed)
    print(f"{precision}, resumed at {where}: {tensors} tensors bitwise equal (max abs diff {max_diff})")


@pytest.mark.parametrize("uninterrupted", ["no"], indirect=True)  # the signal path is the same for every precision
@pytest.mark.parametrize(("signal_number", "exit_code"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_stops_after_the_step_with_a_checkpoint_and_resume_is_exact(
    uninterrupted, tiny_dataset, cli_env, tmp_path, signal_number, exit_code
):
    precision, straight = uninterrupted
    out = tmp_path / "run"
    args = run_args(tiny_dataset, out, precision, "--logging_steps", "1")  # telemetry at every step
    command = [sys.executable, "-m", "cifar_accel.train", *args]
    proc = subprocess.Popen(command, env=cli_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_until((out / "checkpoints" / "step_00000012").exists, proc)  # well into epoch 2
    proc.send_signal(signal_number)
    stdout, stderr = proc.communicate(timeout=120)

    assert proc.returncode == exit_code, stderr
    (line,) = stderr.strip().splitlines()
    assert line.startswith(f"stopped by {signal.Signals(signal_number).name} after 1 epoch and ")
    assert "resume with --resume_from_checkpoint latest" in line
    assert not (out / "results.json").exists()
    latest = complete_checkpoints(out)[-1]
    assert latest.name in line and int(latest.name.split("_")[1]) > 12

    proc = run_cli([*args, "--resume_from_checkpoint", "latest"], cli_env)
    assert proc.returncode == 0, proc.stderr
    assert_same_run(straight, out)
    # The curves read back from the event files: every optimizer step once, the epochs continuing after the stop.
    events = EventAccumulator(str(out / "logs" / "cifar_accel"))
    events.Reload()
    assert [e.step for e in events.Scalars("step/loss")] == list(range(1, 28))
    assert [(e.step, e.value) for e in events.Scalars("epoch")] == [(9, 1.0), (18, 2.0), (27, 3.0)]


def test_sigkill_at_random_moments_and_during_a_save_always_leaves_a_resumable_latest(tiny_dataset, cli_env, tmp_path):
    out = tmp_path / "run"
    args = tiny_args(tiny_dataset, out, "--num_train_epochs", "20", "--checkpointing_steps", "2",
                     "--early_stopping_patience", "0", "--max_eval_samples", "40", "--logging_steps", "1")  # fmt: skip
    resume = ["--resume_from_checkpoint", "latest"]
    rng = random.Random(0)
    kills = 0
    for attempt in range(4):
        command = [sys.executable, "-m", "cifar_accel.train", *args, *(resume if attempt else [])]
        proc = subprocess.Popen(command, env=cli_env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        before = {p.name for p in complete_checkpoints(out)}
        deadline = time.monotonic() + 120
        while not ({p.name for p in complete_checkpoints(out)} - before):  # this run's first save
            assert proc.poll() is None, proc.stderr.read()
            assert time.monotonic() < deadline
            time.sleep(0.005)
        if attempt == 3:  # the last kill lands while a checkpoint is being written
            while not list((out / "checkpoints").glob(".partial-*")):
                assert proc.poll() is None and time.monotonic() < deadline
                time.sleep(0.0005)
        else:
            time.sleep(rng.uniform(0.0, 0.8))
        proc.kill()
        proc.wait()
        kills += 1

        latest, _ = resolve_checkpoint("latest", out)
        assert json.loads((latest / STATE_FILE).read_text())["global_step"] == int(latest.name.split("_")[1])
        assert load_file(latest / "model.safetensors")

    proc = run_cli([*args, *resume], cli_env)
    assert proc.returncode == 0, proc.stderr
    results = read_results(out)
    assert results["epochs_completed"] == 20 and [r["epoch"] for r in results["history"]] == list(range(1, 21))
    assert not list((out / "checkpoints").glob(".partial-*"))
    # The curves survive: each resume purged what the killed run had logged after its checkpoint, so TensorBoard
    # holds every optimizer step and every epoch once, with the values of the history.
    events = EventAccumulator(str(out / "logs" / "cifar_accel"))
    events.Reload()
    assert [e.step for e in events.Scalars("step/loss")] == list(range(1, 181))  # 9 optimizer steps an epoch
    assert [(e.step, e.value) for e in events.Scalars("epoch")] == [(9 * epoch, epoch) for epoch in range(1, 21)]
    assert [e.value for e in events.Scalars("val/accuracy")] == pytest.approx(
        [r["val_accuracy"] for r in results["history"]]
    )
    print(f"{kills} SIGKILLs (one during a save), {kills} resumes from 'latest', run finished")


def test_a_finished_run_can_be_extended_with_more_epochs(tiny_dataset, train_here, tmp_path):
    out = tmp_path / "run"
    assert train_here(tiny_args(tiny_dataset, out, "--max_train_samples", "100")).returncode == 0
    first = read_results(out)
    args = tiny_args(tiny_dataset, out, "--max_train_samples", "100", "--num_train_epochs", "2")
    proc = train_here([*args, "--resume_from_checkpoint", "latest"])
    assert proc.returncode == 0, proc.stderr
    assert "1 epoch and 0 batches done" in proc.stdout
    results = read_results(out)
    assert results["epochs_completed"] == 2 and results["history"][0] == first["history"][0]

    # Fewer epochs than it has trained cannot be resumed: its config.yaml would record fewer than its results.
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    fewer = tiny_args(tiny_dataset, out, "--max_train_samples", "100", "--resume_from_checkpoint", "latest")
    proc = train_here(fewer)
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert line.endswith(
        "has trained 2 epochs, more than --num_train_epochs 1; resume with --num_train_epochs 2 or more, or evaluate "
        "the run as it is with 'python -m cifar_accel.evaluate --model " + str(complete_checkpoints(out)[-1]) + "'"
    )
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


def test_the_evaluate_command_of_that_refusal_holds_a_path_with_spaces_whole(tmp_path):
    checkpoint = tmp_path / "my runs" / "run 1" / "checkpoints" / "step_00000018"
    with pytest.raises(InputError) as refusal:
        check_resumed_epochs(checkpoint, TrainerState(epoch=2, global_step=18), num_train_epochs=1)
    command = str(refusal.value).split("evaluate the run as it is with '", 1)[1].removesuffix("'")
    assert shlex.split(command) == ["python", "-m", "cifar_accel.evaluate", "--model", str(checkpoint)]


def test_a_moved_dataset_resumes_and_other_data_at_its_path_is_refused(tiny_dataset, train_here, tmp_path):
    """A checkpoint knows its data by the images and labels (their SHA-256), not by where the dataset was: a job
    that stages the data to a new folder each time resumes, and data changed in place does not."""
    first, moved = tmp_path / "data_here", tmp_path / "data_there"
    shutil.copytree(tiny_dataset, first)
    out = tmp_path / "run"
    assert train_here(tiny_args(first, out, "--max_train_samples", "100")).returncode == 0
    first.rename(moved)
    args = tiny_args(moved, out, "--max_train_samples", "100", "--num_train_epochs", "2")
    proc = train_here([*args, "--resume_from_checkpoint", "latest"])
    assert proc.returncode == 0, proc.stderr
    assert f"the dataset is at {moved} now, the same images and labels as at {first}" in proc.stdout
    assert (
        read_results(out)["epochs_completed"] == 2 and f"dataset_name: {moved}\n" in (out / "config.yaml").read_text()
    )

    shutil.rmtree(moved)
    write_split_files(moved, good_split(327, seed=5), good_split(83, seed=6))  # the same shape, other images
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    proc = train_here([*args[:-1], "3", "--resume_from_checkpoint", "latest"])
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert line.endswith(
        f"was trained on other data than '{moved}' holds now (its images, labels or classes differ); resume with the "
        "dataset it was trained on, or start a new --output_dir"
    )
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


def test_a_finished_cosine_run_is_not_extended_and_is_left_as_it_was(tiny_dataset, train_here, tmp_path):
    """The cosine's period is the first run's epochs; more epochs would run the learning rate back up."""
    out = tmp_path / "run"
    args = tiny_args(tiny_dataset, out, "--max_train_samples", "100", "--lr_scheduler_type", "cosine")
    assert train_here([*args, "--num_train_epochs", "2"]).returncode == 0
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}

    proc = train_here([*args, "--num_train_epochs", "3", "--resume_from_checkpoint", "latest"])
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert "anneals the learning rate to zero over 2 epochs" in line and "resume with --num_train_epochs 2" in line
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before

    proc = train_here([*args, "--num_train_epochs", "2", "--resume_from_checkpoint", "latest"])
    assert proc.returncode == 0, proc.stderr  # the same length resumes (here: nothing left to train)
    assert read_results(out)["epochs_completed"] == 2


def test_pruning_keeps_the_newest_and_the_best(tiny_dataset, train_here, tmp_path):
    out = tmp_path / "run"
    args = tiny_args(tiny_dataset, out, "--num_train_epochs", "3", "--checkpointing_steps", "2",
                     "--checkpoints_total_limit", "2", "--max_eval_samples", "40")  # fmt: skip
    assert train_here(args).returncode == 0
    results = read_results(out)
    best = f"step_{9 * results['best_epoch']:08d}"
    names = [p.name for p in complete_checkpoints(out)]
    assert names[-2:] == ["step_00000026", "step_00000027"]
    assert best in names and len(names) == (2 if best in names[-2:] else 3)


def test_corrupt_or_incomplete_checkpoints_are_refused_and_left_alone(tiny_dataset, train_here, tmp_path):
    out = tmp_path / "run"
    assert train_here(tiny_args(tiny_dataset, out, "--max_train_samples", "100")).returncode == 0
    (checkpoint,) = complete_checkpoints(out)
    weights = checkpoint / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    args = tiny_args(tiny_dataset, out, "--max_train_samples", "100", "--num_train_epochs", "2")

    proc = train_here([*args, "--resume_from_checkpoint", "latest"])
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert f"checkpoint '{checkpoint}': model.safetensors cannot be read as plain tensors" in line
    assert len(weights.read_bytes()) == 1000

    (checkpoint / STATE_FILE).unlink()
    proc = train_here([*args, "--resume_from_checkpoint", str(checkpoint)])
    assert proc.returncode == 2
    assert f"'{checkpoint}' is not a complete checkpoint (it has no {STATE_FILE}" in proc.stderr


def test_grad_scaler_state_survives_save_and_resume(tmp_path):
    """Accelerate creates no scaler on a CPU, so give it a real torch.amp.GradScaler: after an overflow halves
    the scale, the scale restored by load_checkpoint is the one saved, not a fresh 65536."""
    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    for poison in (True, False, False):
        loss = model(torch.ones(1, 2)).sum()
        accelerator.scaler.scale(loss).backward()
        if poison:
            model.weight.grad.fill_(float("inf"))
        accelerator.scaler.step(optimizer)
        accelerator.scaler.update()
        optimizer.zero_grad()
    assert accelerator.scaler.get_scale() == 512.0  # halved by the overflow, not yet grown back

    state = TrainerState(global_step=3, config_fingerprint={"seed": 1})
    path = save_checkpoint(accelerator, tmp_path, state, keep=1)
    assert (path / "scaler.pt").is_file()
    accelerator.scaler = torch.amp.GradScaler("cpu")
    assert accelerator.scaler.get_scale() == 65536.0
    restored_path, restored = resolve_checkpoint("latest", tmp_path)
    load_checkpoint(accelerator, restored_path, restored)
    assert accelerator.scaler.get_scale() == 512.0
    assert restored.global_step == 3
