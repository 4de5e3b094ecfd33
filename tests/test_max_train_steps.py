"""--max_train_steps: a run of a given number of optimizer steps, which may end part way through an epoch, its
schedule over those steps, its resume and its refusals."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from cifar_accel.bookkeeping import RunBookkeeper
from cifar_accel.checkpoint import complete_checkpoints
from cifar_accel.errors import run_cli as run_main
from cifar_accel.optim import StepSchedule

import summarize_runs
from conftest import assert_same_run, crashed_copy, read_results, tiny_args, train_in_process

LR = 1e-3  # the default --learning_rate


def run_args(dataset: Path, out: Path, *extra: str, length: tuple[str, ...] = ("--max_train_steps", "20")) -> list[str]:
    """20 optimizer steps of a linear decay: two epochs of 9 batches of 32, then 2 batches of a third; a checkpoint
    every 4 steps, all kept."""
    return tiny_args(dataset, out, *length, "--lr_scheduler_type", "linear", "--logging_steps", "1",
                     "--checkpointing_steps", "4", "--checkpoints_total_limit", "100", "--max_eval_samples", "40",
                     *extra)  # fmt: skip


def snapshot(folder: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def straight(tiny_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("max_train_steps") / "run"
    assert train_in_process(run_args(tiny_dataset, out)) == 0
    return out


def test_the_run_stops_at_the_step_part_way_through_an_epoch(straight, capsys):
    results = read_results(straight)
    assert results["epochs_completed"] == 3  # --num_train_epochs 1 is overridden
    assert [r["train_images"] for r in results["history"]] == [288, 288, 64]
    whole = [r["epoch_seconds"] for r in results["history"][:2]]
    assert results["seconds_per_epoch"] == sum(whole) / 2  # the cut-short epoch is no epoch's measure
    # Every step once, the last one the 20th; its checkpoint is saved once, at the epoch's end.
    assert [p.name for p in complete_checkpoints(straight)] == [
        f"step_{step:08d}" for step in (4, 8, 9, 12, 16, 18, 20)
    ]
    state = json.loads((straight / "checkpoints" / "step_00000020" / "trainer_state.json").read_text())
    assert (state["epoch"], state["step_in_epoch"], state["global_step"]) == (3, 0, 20)
    events = EventAccumulator(str(straight / "logs" / "cifar_accel"))
    events.Reload()
    logged = events.Scalars("step/learning_rate")
    assert [e.step for e in logged] == list(range(1, 21))
    # The linear decay spans the 20 steps: the 20th trains at 1/20 of the rate, and the schedule ends at 0.
    schedule = StepSchedule("linear", total_steps=20, warmup_steps=0, start_factor=0.0, end_factor=0.0)
    assert [e.value for e in logged] == pytest.approx([LR * schedule(step - 1) for step in range(1, 21)], rel=1e-6)
    assert [(e.step, e.value) for e in events.Scalars("epoch")] == [(9, 1.0), (18, 2.0), (20, 3.0)]
    card = (straight / "README.md").read_text()  # 640 images in epochs of 288
    assert "| epochs | 2.22 (20 optimizer steps: --max_train_steps; epoch 3 cut short) |" in card
    assert run_main(summarize_runs.main, [str(straight)]) == 0
    assert "| run | no | 2.22 | " in capsys.readouterr().out
    config = (straight / "config.yaml").read_text()
    assert "num_train_epochs: 1\n" in config and "max_train_steps: 20\n" in config  # as given


def test_the_log_and_the_card_say_where_the_steps_end(tiny_dataset, train_here, tmp_path):
    for steps, where, epochs, row in (
        ("9", "1 epoch of 9 optimizer steps\n", 1, "| epochs | 1 (9 optimizer steps: --max_train_steps) |"),
        ("11", "1 epoch of 9 optimizer steps, then 2 of epoch 2\n", 2,
         "| epochs | 1.22 (11 optimizer steps: --max_train_steps; epoch 2 cut short) |"),  # 288 + 64 images
    ):  # fmt: skip
        out = tmp_path / f"run{steps}"
        proc = train_here(run_args(tiny_dataset, out, "--report_to", "none", length=("--max_train_steps", steps)))
        assert proc.returncode == 0, proc.stderr
        assert f"--max_train_steps {steps}: {where}" in proc.stdout
        assert read_results(out)["epochs_completed"] == epochs
        assert row in (out / "README.md").read_text()
    proc = train_here(
        run_args(tiny_dataset, tmp_path / "run2", "--profile_steps", "2", length=("--max_train_steps", "3"))
    )
    assert proc.returncode == 2
    assert (
        "--profile_steps 2 needs 4 optimizer steps (2 before the recorded ones) but the run has 3 left" in proc.stderr
    )
    assert not (tmp_path / "run2").exists()


def test_the_epoch_the_steps_end_in_trains_on_whole_images_whatever_early_crop_epochs_says(
    tiny_dataset, train_here, tmp_path
):
    """25 steps reach into a third epoch, which is the run's last: --early_crop_epochs 5 trains its first 2 epochs
    on windows, bit for bit as --early_crop_epochs 2 does, and says so; 1 epoch of windows trains other weights."""
    runs = {}
    for epochs in ("5", "2", "1"):
        runs[epochs] = tmp_path / f"windows{epochs}"
        args = run_args(  # no validation: the last weights are the run's; 10 steps an epoch
            tiny_dataset, runs[epochs], "--report_to", "none", "--val_ratio", "0", length=("--max_train_steps", "25")
        )
        proc = train_here([*args, "--early_crop_size", "24", "--early_crop_epochs", epochs])
        assert proc.returncode == 0, proc.stderr
        said = "early_crop_epochs is 5, but the run trains 3 epochs: the first 2 train on 24x24 windows, and the last"
        assert (said in proc.stdout) == (epochs == "5")
    assert_same_run(runs["2"], runs["5"])
    one, two = (load_file(runs[epochs] / "model.safetensors") for epochs in ("1", "2"))
    assert any(not torch.equal(one[name], two[name]) for name in one)


def test_a_config_files_windows_are_not_announced_in_a_run_without_augmentation(tiny_dataset, train_here, tmp_path):
    """A preset's or file's windows act only with augmentation: --no-augment trains every epoch on whole images,
    and the log does not say otherwise."""
    config = tmp_path / "windows.yaml"
    config.write_text("early_crop_size: 24\nearly_crop_epochs: 5\n")
    for augment in ("--augment", "--no-augment"):
        args = run_args(tiny_dataset, tmp_path / augment, "--report_to", "none", length=("--max_train_steps", "25"))
        proc = train_here([*args, "--config", str(config), augment])
        assert proc.returncode == 0, proc.stderr
        assert ("train on 24x24 windows" in proc.stdout) == (augment == "--augment")


@pytest.mark.parametrize(("cut", "done"), [(16, "1 epoch and 7 batches"), (18, "2 epochs and 0 batches")])
def test_a_resume_ends_where_the_uninterrupted_run_did(straight, tiny_dataset, train_here, tmp_path, cut, done):
    resumed = crashed_copy(straight, tmp_path / "resumed", last_step=cut)
    proc = train_here([*run_args(tiny_dataset, resumed), "--resume_from_checkpoint", "latest"])
    assert proc.returncode == 0, proc.stderr
    assert f"{done} done" in proc.stdout
    assert_same_run(straight, resumed)


class StopAtStep20(RunBookkeeper):
    def count_step(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        super().count_step(loss, grad_norm)
        if self.state.global_step == 20:
            os.kill(os.getpid(), signal.SIGTERM)  # recorded: the run stops after this step, with a checkpoint


def test_a_stop_at_the_last_step_resumes_to_close_the_epoch_it_stopped_in(straight, tiny_dataset, train_here, tmp_path):
    """A stop request at the run's last step, 2 batches into epoch 3, saves that step mid-epoch; the resume trains
    no further and closes the epoch: the same run as the uninterrupted one."""
    out = tmp_path / "run"
    proc = train_here(run_args(tiny_dataset, out), bookkeeper_type=StopAtStep20)
    assert proc.returncode == 143
    assert proc.stderr.startswith("stopped by SIGTERM after 2 epochs and 2 batches (optimizer step 20); saved ")
    assert not (out / "results.json").exists()
    proc = train_here([*run_args(tiny_dataset, out), "--resume_from_checkpoint", "latest"])
    assert proc.returncode == 0, proc.stderr
    assert "2 epochs and 2 batches done" in proc.stdout
    assert_same_run(straight, out)


@pytest.mark.parametrize(
    ("length", "now"),
    [(("--max_train_steps", "16"), "16"), (("--max_train_steps", "24"), "24"), (("--num_train_epochs", "3"), "None")],
)
def test_a_resume_to_another_length_is_refused_and_leaves_the_run_as_it_was(
    straight, tiny_dataset, train_here, tmp_path, length, now
):
    """The length of a run of --max_train_steps is part of it, as its schedule is: a resume keeps it."""
    run = crashed_copy(straight, tmp_path / "run", last_step=16)
    before = snapshot(run)
    proc = train_here([*run_args(tiny_dataset, run, length=length), "--resume_from_checkpoint", "latest"])
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert f"was made with a different config (max_train_steps: checkpoint 20, now {now}); resume with" in line
    assert snapshot(run) == before
