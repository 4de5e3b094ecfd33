"""Misuse and flaky infrastructure: whatever happens, one line and the right exit code, and nothing lost.

One test group per class of failure: refusals before anything is removed, one run per folder, complete
checkpoints, atomic outputs, config files as bounded data, data errors that name the row, predict and evaluate
inputs, stderr for the error line only, signals at any moment, and a global batch that really happens.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

from cifar_accel import compare, evaluate, export, predict
from cifar_accel.bookkeeping import RunBookkeeper
from cifar_accel.checkpoint import STATE_FILE, check_checkpoint_files, complete_checkpoints
from cifar_accel.config import read_config_file
from cifar_accel.errors import MAX_ERROR_CHARACTERS, InputError, RunFault, run_cli
from cifar_accel.images import to_rgb32
from cifar_accel.inference import load_model
from cifar_accel.outputs import REPLACED_RUN, OutputDirLock, writable_output_dir
from cifar_accel.state import TrainerState

from conftest import (
    CLASS_NAMES,
    FEATURES,
    REPO,
    corrupt_dataset,
    fp16_accelerator,
    good_split,
    make_images,
    read_results,
    snapshot,
    tiny_args,
    train_in_process,
    wait_until,
    write_image_folder,
    write_split_files,
)
from conftest import run_cli as run_subprocess


def one_error_line(proc: subprocess.CompletedProcess) -> str:
    (line,) = proc.stderr.strip().splitlines()
    assert "Traceback" not in proc.stderr
    return line


def run_args(dataset: Path, out: Path, *extra: str) -> list[str]:
    """Two epochs of 9 optimizer steps on the tiny dataset, a checkpoint every 4 steps, all kept."""
    return tiny_args(dataset, out, "--num_train_epochs", "2", "--checkpointing_steps", "4",
                     "--checkpoints_total_limit", "100", "--max_eval_samples", "40", *extra)  # fmt: skip


@pytest.fixture(scope="module")
def finished_run(tiny_dataset, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("finished") / "run"
    assert train_in_process(run_args(tiny_dataset, out)) == 0
    return out


@pytest.fixture
def earlier_run(finished_run, tmp_path) -> Path:
    """A copy of a finished run, with a file of the user's beside it."""
    out = shutil.copytree(finished_run, tmp_path / "run")
    (out / "notes.txt").write_text("mine")
    return out


# 1. Validate everything before deleting anything.


@pytest.mark.parametrize("problem", ["batch larger than the data", "corrupt image"])
def test_a_refused_overwrite_leaves_the_earlier_run_whole(earlier_run, tiny_dataset, train_here, tmp_path, problem):
    before = snapshot(earlier_run)
    if problem == "corrupt image":
        args = run_args(corrupt_dataset(tmp_path / "corrupt"), earlier_run, "--overwrite_output_dir")
    else:
        args = run_args(tiny_dataset, earlier_run, "--overwrite_output_dir", "--per_device_train_batch_size", "1000")
    proc = train_here(args)
    assert proc.returncode == 2
    assert one_error_line(proc).startswith("error: ")
    assert snapshot(earlier_run) == before


class FaultAtFirstStep(RunBookkeeper):
    def count_step(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        raise RunFault("injected fault before the first checkpoint")


def test_overwrite_replaces_the_earlier_run_only_once_the_new_one_has_a_checkpoint(earlier_run, tiny_dataset,
                                                                                  train_here):  # fmt: skip
    earlier = snapshot(earlier_run)
    args = run_args(tiny_dataset, earlier_run, "--overwrite_output_dir", "--seed", "7")
    proc = train_here(args, bookkeeper_type=FaultAtFirstStep)
    assert proc.returncode == 1 and "injected fault" in one_error_line(proc)
    kept = {name: digest for name, digest in earlier.items() if name != "notes.txt"}
    assert snapshot(earlier_run / REPLACED_RUN) == kept  # the whole earlier run, set aside
    assert (earlier_run / "notes.txt").read_text() == "mine"

    proc = train_here(args)
    assert proc.returncode == 0, proc.stderr
    assert not (earlier_run / REPLACED_RUN).exists()
    assert read_results(earlier_run)["epochs_completed"] == 2
    assert json.loads((complete_checkpoints(earlier_run)[-1] / STATE_FILE).read_text())["config_fingerprint"][
        "seed"
    ] == 7  # fmt: skip
    assert (earlier_run / "notes.txt").read_text() == "mine"


def test_overwrite_sets_aside_the_earlier_runs_evaluations_and_checkpoint_exports(earlier_run, tiny_dataset,
                                                                                  train_here):  # fmt: skip
    """They stayed beside the new run: the earlier run's eval_test/, and its model_step_00000004.onnx and
    eval_test_step_00000004/, taken for those of the new run's checkpoint of that name. Folders and files of the
    user's stay, a report-like one too."""
    step = earlier_run / "checkpoints" / "step_00000004"
    assert run_cli(evaluate.main, ["--model", str(earlier_run)]) == 0
    assert run_cli(evaluate.main, ["--model", str(step)]) == 0
    assert run_cli(export.main, ["--model", str(step), "--skip_check"]) == 0
    made = ["eval_test", "eval_test_step_00000004", "model_step_00000004.onnx", "model_step_00000004.onnx.json"]
    assert all((earlier_run / name).exists() for name in made)
    (earlier_run / "eval_mine").mkdir()
    (earlier_run / "eval_mine" / "metrics.json").write_text('{"accuracy": 1}')
    assert train_here(run_args(tiny_dataset, earlier_run, "--overwrite_output_dir", "--seed", "7")).returncode == 0
    assert [name for name in made if (earlier_run / name).exists()] == []
    assert (earlier_run / "eval_mine" / "metrics.json").read_text() == '{"accuracy": 1}'
    assert (earlier_run / "notes.txt").read_text() == "mine"


def test_a_chain_of_overwrites_never_deletes_a_finished_run(earlier_run, tiny_dataset, train_here, capsys):
    """A finished; B (--overwrite_output_dir) stops before its first checkpoint, so A waits in .replaced-run/.
    A plain run C is then refused, saying where A went, and so are a resume and evaluate; the folder stays as B
    left it. D (--overwrite_output_dir) replaces A at its first checkpoint and finishes."""
    a_run = snapshot(earlier_run)
    overwrite = run_args(tiny_dataset, earlier_run, "--overwrite_output_dir", "--seed", "7")
    assert train_here(overwrite, bookkeeper_type=FaultAtFirstStep).returncode == 1
    left_by_b = snapshot(earlier_run)
    assert snapshot(earlier_run / REPLACED_RUN) == {k: v for k, v in a_run.items() if k != "notes.txt"}

    aside = f"its earlier run waits in {earlier_run / REPLACED_RUN}, set aside by an --overwrite_output_dir run"
    for args in (run_args(tiny_dataset, earlier_run), [*run_args(tiny_dataset, earlier_run), "--resume", "latest"]):
        proc = train_here(args)
        assert proc.returncode == 2
        line = one_error_line(proc)
        assert aside in line and f"&& mv {earlier_run / REPLACED_RUN}/* {earlier_run}/ && rmdir" in line
        assert snapshot(earlier_run) == left_by_b
    capsys.readouterr()
    assert run_cli(evaluate.main, ["--model", str(earlier_run)]) == 2
    assert aside in capsys.readouterr().err

    proc = train_here(overwrite)
    assert proc.returncode == 0, proc.stderr
    assert not (earlier_run / REPLACED_RUN).exists()
    assert read_results(earlier_run)["epochs_completed"] == 2 and (earlier_run / "notes.txt").read_text() == "mine"


def test_the_command_a_refusal_gives_restores_the_set_aside_run_whole(earlier_run, tiny_dataset, train_here):
    """B (--overwrite_output_dir) stopped before its first checkpoint, leaving its config, labels and TensorBoard
    events beside the set-aside run A. The restore command of the refusal, run by a shell, brings A back as it was."""
    a_run = snapshot(earlier_run)
    overwrite = run_args(tiny_dataset, earlier_run, "--overwrite_output_dir", "--seed", "7")
    assert train_here(overwrite, bookkeeper_type=FaultAtFirstStep).returncode == 1
    assert list((earlier_run / "logs").rglob("events.out.tfevents.*"))  # B's, where A's were
    proc = train_here(run_args(tiny_dataset, earlier_run))
    assert proc.returncode == 2
    command = one_error_line(proc).split("restore it with '", 1)[1].split("', replace it with", 1)[0]
    restored = subprocess.run(["bash", "-c", command], capture_output=True, text=True)
    assert restored.returncode == 0, restored.stderr
    assert snapshot(earlier_run) == a_run
    assert not (earlier_run / REPLACED_RUN).exists()


def test_a_run_beside_a_set_aside_run_is_never_deleted(earlier_run, finished_run, tiny_dataset, train_here):
    """A folder that holds a run and, in .replaced-run/, another (as a kill between a checkpoint and the deletion
    of the set-aside run once left it) is refused even with --overwrite_output_dir: both runs stay whole."""
    shutil.copytree(finished_run, earlier_run / REPLACED_RUN)
    before = snapshot(earlier_run)
    proc = train_here(run_args(tiny_dataset, earlier_run, "--overwrite_output_dir"))
    assert proc.returncode == 2
    assert "holds a run, and its earlier run waits in" in one_error_line(proc) and "neither is deleted" in proc.stderr
    assert snapshot(earlier_run) == before


@pytest.mark.parametrize("overwrite", [[], ["--overwrite_output_dir"]])
def test_files_of_the_users_with_the_names_a_run_writes_are_refused_and_kept(
    overwrite, tiny_dataset, train_here, tmp_path
):
    """A run would write over a labels.json or curves.png of the user's, and add its logs to theirs (which a later
    --overwrite_output_dir run would then set aside and delete with its own)."""
    out = tmp_path / "project"
    (out / "logs").mkdir(parents=True)
    (out / "logs" / "mine.log").write_text("a log of the user's")
    (out / "labels.json").write_text("my labels")
    (out / "curves.png").write_bytes(b"my plot")
    before = snapshot(out)
    proc = train_here(tiny_args(tiny_dataset, out, *overwrite))
    assert proc.returncode == 2
    assert one_error_line(proc) == (
        f"error: '{out}' already holds logs/, labels.json and curves.png, which a training run writes but did not "
        "write there; move them, or pick another --output_dir"
    )
    assert snapshot(out) == before


@pytest.mark.parametrize("root", ["/", "//", "/tmp/.."])
def test_the_file_systems_root_is_refused_as_an_output_folder(root):
    """Run as root (in a container), ``train --output_dir "$RUNS/"`` with RUNS not set wrote its files into /, beside
    the system's folders; ``compare`` goes through the same check."""
    with pytest.raises(InputError) as refused, writable_output_dir(Path(root)):
        pass
    assert str(refused.value) == (
        f"output directory '{root}' is the file system's root, as '$RUNS/' gives where RUNS is not set; choose "
        "another --output_dir"
    )


def test_a_folder_with_other_files_of_the_users_takes_a_run_beside_them(tiny_dataset, train_here, tmp_path):
    out = tmp_path / "project"
    out.mkdir()
    (out / ".env").write_text("SECRET=1")
    (out / "README.md").write_text("# my project\n")
    proc = train_here(tiny_args(tiny_dataset, out, "--overwrite_output_dir"))
    assert proc.returncode == 0, proc.stderr
    assert (out / ".env").read_text() == "SECRET=1" and (out / "README.md").read_text() == "# my project\n"
    assert (out / "model.safetensors").is_file() and not (out / REPLACED_RUN).exists()


def test_a_config_yaml_of_the_users_in_the_output_folder_is_refused_and_kept(tiny_dataset, train_here, tmp_path):
    """`--config config.yaml --output_dir .` would have replaced the user's own config with the effective one."""
    out = tmp_path / "project"
    out.mkdir()
    (out / "config.yaml").write_text("learning_rate: 0.01\n")
    proc = train_here(tiny_args(tiny_dataset, out, "--config", str(out / "config.yaml")))
    assert proc.returncode == 2
    assert one_error_line(proc) == (
        f"error: '{out / 'config.yaml'}' is not a config a run wrote, and a run writes its effective config there; "
        "move it, or pick another --output_dir"
    )
    assert sorted(p.name for p in out.iterdir()) == ["config.yaml"]
    assert (out / "config.yaml").read_text() == "learning_rate: 0.01\n"


# 2. One run per output folder.


def test_a_second_run_into_a_locked_folder_is_refused_naming_the_holder(tiny_dataset, train_here, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    with OutputDirLock(out):
        before = snapshot(out)
        proc = train_here(tiny_args(tiny_dataset, out))
        assert proc.returncode == 2
        line = one_error_line(proc)
        assert f"is in use by another run (pid {os.getpid()} on {socket.gethostname()}, started 20" in line
        assert snapshot(out) == before
        assert run_cli(compare.main, ["--output_dir", str(out), "--dataset_name", str(tiny_dataset)]) == 2
    assert not (out / ".lock").exists()  # released with the lock
    assert train_here(tiny_args(tiny_dataset, out)).returncode == 0


def test_two_processes_one_folder_and_sigkill_leaves_no_stale_lock(tiny_dataset, cli_env, tmp_path):
    out = tmp_path / "run"
    args = tiny_args(tiny_dataset, out, "--num_train_epochs", "50", "--early_stopping_patience", "0")
    first = subprocess.Popen([sys.executable, "-m", "cifar_accel.train", *args], env=cli_env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip
    wait_until(lambda: complete_checkpoints(out), first, poll=0.05)
    second = run_subprocess([*args, "--resume_from_checkpoint", "latest"], cli_env)  # a requeued copy
    assert second.returncode == 2
    assert f"is in use by another run (pid {first.pid} on " in one_error_line(second)
    assert first.poll() is None  # the first run goes on

    first.kill()  # SIGKILL: the kernel drops the lock with the process
    first.wait()
    resumed = run_subprocess([*args, "--num_train_epochs", "50", "--resume_from_checkpoint", "latest",
                              "--early_stopping_patience", "1"], cli_env)  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr


def test_auto_resume_is_one_command_for_a_jobs_first_start_and_its_requeue(tiny_dataset, cli_env, tmp_path):
    """A preemptible job runs one command each time it starts: the first start trains from scratch, the requeue
    after a SIGKILL resumes the newest checkpoint, and the weights are those of a run never interrupted."""
    args = [*run_args(tiny_dataset, tmp_path / "job"), "--resume_from_checkpoint", "auto"]
    unbuffered = {**cli_env, "PYTHONUNBUFFERED": "1"}  # its lines are read after a SIGKILL
    first = subprocess.Popen([sys.executable, "-m", "cifar_accel.train", *args], env=unbuffered,
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)  # fmt: skip
    wait_until(lambda: complete_checkpoints(tmp_path / "job"), first, poll=0.05)
    first.kill()
    assert (
        f"--resume_from_checkpoint auto: a new run starts, as there is no checkpoint in {tmp_path / 'job'}"
        in (first.communicate()[0])
    )
    requeued = run_subprocess(args, cli_env)
    assert requeued.returncode == 0, requeued.stderr
    assert f"--resume_from_checkpoint auto: resuming from the newest checkpoint in {tmp_path / 'job'}" in (
        requeued.stdout
    )
    assert train_in_process(run_args(tiny_dataset, tmp_path / "plain")) == 0
    assert snapshot(tmp_path / "job")["model.safetensors"] == snapshot(tmp_path / "plain")["model.safetensors"]


def test_a_job_killed_while_writing_its_first_checkpoint_starts_again_when_requeued(tiny_dataset, cli_env, tmp_path):
    """The kill leaves a partial checkpoint, which nothing can resume: 'auto' starts the run from scratch, where it
    was refused as 'already holds a run' and 'latest' found no checkpoint."""
    for attempt in range(5):  # the stop must land before the checkpoint is renamed complete
        job = tmp_path / f"job{attempt}"
        args = [*run_args(tiny_dataset, job), "--resume_from_checkpoint", "auto"]
        first = subprocess.Popen([sys.executable, "-m", "cifar_accel.train", *args], env=cli_env,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        wait_until(lambda job=job: list((job / "checkpoints").glob(".partial-*")), first, poll=0.0005)
        first.send_signal(signal.SIGSTOP)
        cut_off = not complete_checkpoints(job)
        first.kill()
        first.wait()
        if cut_off:
            break
    assert cut_off and list((job / "checkpoints").glob(".partial-*"))
    requeued = run_subprocess(args, cli_env)
    assert requeued.returncode == 0, requeued.stderr
    assert f"--resume_from_checkpoint auto: a new run starts, as there is no checkpoint in {job}" in requeued.stdout
    assert [r["epoch"] for r in read_results(job)["history"]] == [1, 2]
    assert not list((job / "checkpoints").glob(".partial-*"))


def test_a_finished_run_without_checkpoints_is_not_offered_a_resume(earlier_run, tiny_dataset, train_here):
    shutil.rmtree(earlier_run / "checkpoints")  # removed to save space once the run was done
    before = snapshot(earlier_run)
    proc = train_here(run_args(tiny_dataset, earlier_run))
    assert proc.returncode == 2
    assert one_error_line(proc) == (
        f"error: '{earlier_run}' already holds a run (results.json); replace it with --overwrite_output_dir, or pick "
        "another --output_dir"
    )
    assert snapshot(earlier_run) == before


NO_FLOCK = r"""
/* flock() fails with ENOSYS, as on Lustre mounted without -o flock, for files under $NOFLOCK_PREFIX. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

int flock(int fd, int operation) {
    static int (*real_flock)(int, int);
    const char *prefix = getenv("NOFLOCK_PREFIX");
    char link[64], path[4096];
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    ssize_t n = readlink(link, path, sizeof path - 1);
    if (prefix && n > 0) {
        path[n] = '\0';
        if (strncmp(path, prefix, strlen(prefix)) == 0) {
            errno = ENOSYS;
            return -1;
        }
    }
    if (!real_flock) real_flock = (int (*)(int, int))dlsym(RTLD_NEXT, "flock");
    return real_flock(fd, operation);
}
"""


def test_a_folder_on_a_filesystem_without_locks_trains_with_a_warning(tiny_dataset, cli_env, tmp_path):
    """Lustre mounted without -o flock answers flock with ENOSYS; the C library's flock is replaced (LD_PRELOAD) to
    answer so for the output folder only. The run warns once and finishes (compare takes the same lock); the old
    code stopped with "OSError: [Errno 38] Function not implemented"."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("needs a C compiler")
    (tmp_path / "noflock.c").write_text(NO_FLOCK)
    subprocess.run([compiler, "-shared", "-fPIC", "-o", tmp_path / "noflock.so", tmp_path / "noflock.c", "-ldl"],
                   check=True)  # fmt: skip
    lustre = tmp_path / "lustre"
    lustre.mkdir()
    env = {**cli_env, "LD_PRELOAD": str(tmp_path / "noflock.so"), "NOFLOCK_PREFIX": str(lustre.resolve())}
    warning = "cannot lock files (Function not implemented), so a second run started in this folder meanwhile"
    proc = run_subprocess(tiny_args(tiny_dataset, lustre / "run"), env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count(warning) == 1 and proc.stderr == ""
    assert read_results(lustre / "run")["epochs_completed"] == 1


# 3. A checkpoint is complete or refused.


def edit_state(checkpoint: Path, **changes: object) -> None:
    state = json.loads((checkpoint / STATE_FILE).read_text())
    state.update(changes)
    (checkpoint / STATE_FILE).write_text(json.dumps(state))


RECORD = {"epoch": 1, "train_loss": 1.5, "train_accuracy": 0.4, "val_loss": 1.4, "val_accuracy": 0.5, "val_samples": 33,
          "learning_rate": 0.001, "train_images": 288, "train_seconds": 2.0, "train_images_per_second": 144.0,
          "epoch_seconds": 2.5, "skipped_steps": 0, "loss_scale": None}  # fmt: skip
STATE_CASES = [
    ({"global_step": -5}, "'global_step' must be >= 0, got -5"),
    ({"global_step": "18"}, "'global_step' must be int, not str ('18')"),
    ({"global_step": 17}, "'global_step' is 17 but the folder is named for step 18"),
    ({"epoch": 10**12}, "'epoch' must be <= 1000000000, got 1000000000000"),
    ({"num_processes": 0}, "'num_processes' must be >= 1, got 0"),
    ({"best_checkpoint": None}, "its best checkpoint None does not exist next to it"),
    ({"best_checkpoint": "step_00000099"}, "its best checkpoint 'step_00000099' does not exist"),
    ({"best_checkpoint": "../../x"}, "its best checkpoint '../../x' does not exist"),
    ({"best_epoch": 3}, "'best_epoch' must be an epoch from 1 to 2"),
    ({"epoch_totals": [1, 2]}, "'epoch_totals[0]' must be a list, not int (1)"),
    ({"epoch_totals": [[1, 2]]}, "'epoch_totals' must hold [loss sum, correct, images] for each of 1 process)"),
    ({"epoch_totals": [[1, 2, -3]]}, "'epoch_totals[0][2]' must be >= 0, got -3.0"),
    ({"history": []}, "'history' must be a list of 2 epoch records"),
    ({"history": [{"epoch": 1}, {"epoch": 2}]}, "missing keys in history[0]: epoch_seconds, learning_rate"),
    ({"history": [RECORD, {**RECORD, "epoch": 2, "val_accuracy": 1.5}]}, "'history[1].val_accuracy' must be <= 1"),
    ({"history": [RECORD, {**RECORD, "epoch": 2, "train_images": 2.5}]}, "'history[1].train_images' must be int"),
    ({"history": [RECORD, {**RECORD, "epoch": 2, "surprise": 1}]}, "unexpected keys in history[1]: surprise"),
    ({"history": [RECORD, {**RECORD, "epoch": 3}]}, "'history' must be a list of 2 epoch records, of epochs 1 to 2"),
    ({"history": [RECORD, {**RECORD, "epoch": 2, "train_loss": float("nan")}]}, "'history[1].train_loss' must be a"),
    ({"surprise": 1}, "unexpected keys in the file: surprise"),
]


@pytest.mark.parametrize(("changes", "message"), STATE_CASES, ids=[next(iter(c)) + str(i) for i, (c, _) in
                                                                   enumerate(STATE_CASES)])  # fmt: skip
def test_an_invalid_trainer_state_is_refused_before_anything_is_written(earlier_run, tiny_dataset, train_here,
                                                                        changes, message):  # fmt: skip
    edit_state(earlier_run / "checkpoints" / "step_00000018", **changes)
    before = snapshot(earlier_run)  # config.yaml and labels.json included
    proc = train_here([*run_args(tiny_dataset, earlier_run, "--num_train_epochs", "3"), "--resume", "latest"])
    assert proc.returncode == 2
    line = one_error_line(proc)
    assert "step_00000018' has an invalid trainer_state.json (" in line and message in line
    assert snapshot(earlier_run) == before


def test_a_copied_runs_config_yaml_trains_the_copy_on_and_leaves_the_original_alone(
    finished_run, earlier_run, tiny_dataset, train_here, tmp_path, monkeypatch
):
    """A run copied (or moved) to train it longer: its config.yaml records the original's output_dir, where the
    resume once went on, replacing the original's weights and results; from another folder too."""
    original = snapshot(finished_run)
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    proc = train_here(
        ["--config", "../run/config.yaml", "--num_train_epochs", "3", "--resume_from_checkpoint", "latest"]
    )
    assert proc.returncode == 0, proc.stderr
    assert "resumed from ../run/checkpoints/step_00000018: 2 epochs and 0 batches done" in proc.stdout
    assert json.loads((earlier_run / "results.json").read_text())["epochs_completed"] == 3
    assert snapshot(finished_run) == original
    assert not list((tmp_path / "elsewhere").iterdir())


def test_a_checkpoint_with_the_epoch_totals_of_all_processes_in_one_list_still_resumes(
    earlier_run, tiny_dataset, train_here
):
    """Checkpoints once kept one [loss sum, correct, images] for all processes; they are read as process 0's."""
    edit_state(earlier_run / "checkpoints" / "step_00000018", epoch_totals=[0.0, 0.0, 0.0])
    proc = train_here([*run_args(tiny_dataset, earlier_run, "--num_train_epochs", "3"), "--resume", "latest"])
    assert proc.returncode == 0, proc.stderr
    assert json.loads((earlier_run / "results.json").read_text())["epochs_completed"] == 3


def test_an_older_checkpoint_of_the_folder_itself_is_refused_as_a_second_history(earlier_run, tiny_dataset,
                                                                                   train_here):  # fmt: skip
    """Resumed in place, step 12 would save steps 16 and 18 again over the run's own (other weights where a flag a
    resume may change differs, as --max_grad_norm here), and 'latest' would mix the two histories."""
    before = snapshot(earlier_run)
    older = earlier_run / "checkpoints" / "step_00000012"
    proc = train_here([*run_args(tiny_dataset, earlier_run, "--max_grad_norm", "0.5"), "--resume", str(older)])
    assert proc.returncode == 2
    later = [str(earlier_run / "checkpoints" / name) for name in ("step_00000016", "step_00000018")]
    assert one_error_line(proc) == (
        f"error: checkpoint '{older}' is not the newest of {earlier_run} (step_00000018 is), and resuming it there "
        "would save a second history over the later ones; resume it with another --output_dir (a fork of the run), "
        f"or remove the later checkpoints first: rm -r {' '.join(later)}"
    )
    assert snapshot(earlier_run) == before


def test_a_fork_into_a_folder_that_holds_a_run_is_refused_and_leaves_that_run_whole(
    finished_run, earlier_run, tiny_dataset, train_here
):
    """Another folder's checkpoint resumed into a folder that holds a run (another one, or the fork itself started
    again from its config.yaml, which records the source) once wrote over its weights, results and checkpoints;
    --overwrite_output_dir sets that run aside, as for a new run."""
    before = snapshot(earlier_run)
    source = finished_run / "checkpoints" / "step_00000012"
    fork = run_args(tiny_dataset, earlier_run, "--resume_from_checkpoint", str(source), "--max_grad_norm", "0.5")
    proc = train_here(fork)
    assert proc.returncode == 2
    assert one_error_line(proc) == (
        f"error: '{earlier_run}' already holds a run (results.json, checkpoints), and resuming {source}, another "
        "folder's checkpoint, there would write a second history over it; continue it with --resume_from_checkpoint "
        "latest, replace it with --overwrite_output_dir, or pick another --output_dir"
    )
    assert snapshot(earlier_run) == before

    proc = train_here([*fork, "--overwrite_output_dir"])
    assert proc.returncode == 0, proc.stderr
    assert f"resumed from {source}: 1 epoch and 3 batches done" in proc.stdout
    assert f"the earlier run waits in {earlier_run / '.replaced-run'} until the first checkpoint" in proc.stdout
    assert not (earlier_run / ".replaced-run").exists() and (earlier_run / "notes.txt").read_text() == "mine"
    assert [p.name for p in complete_checkpoints(earlier_run)] == ["step_00000009", "step_00000016", "step_00000018"]
    last = Path("checkpoints", "step_00000018", "model.safetensors")  # trained on with --max_grad_norm 0.5
    assert (earlier_run / last).read_bytes() != (finished_run / last).read_bytes()


@pytest.mark.parametrize("name", ["model.safetensors", "optimizer.bin", "scheduler.bin", "random_states_0.pkl"])
def test_a_checkpoint_missing_a_file_is_refused_naming_it(earlier_run, tiny_dataset, train_here, name):
    (earlier_run / "checkpoints" / "step_00000018" / name).unlink()
    before = snapshot(earlier_run)
    proc = train_here([*run_args(tiny_dataset, earlier_run), "--resume", str(earlier_run / "checkpoints" /
                                                                              "step_00000018")])  # fmt: skip
    assert proc.returncode == 2
    assert f"step_00000018' is incomplete: {name} is missing" in one_error_line(proc)
    assert snapshot(earlier_run) == before


class RunsCode:
    """A pickle whose loading would run a shell command (creating a file)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("name", ["optimizer.bin", "scheduler.bin", "random_states_0.pkl"])
def test_a_checkpoint_file_whose_unpickling_would_run_code_is_refused(earlier_run, tiny_dataset, train_here,
                                                                      tmp_path, name):  # fmt: skip
    marker = tmp_path / "code_ran"
    torch.save(RunsCode(marker), earlier_run / "checkpoints" / "step_00000018" / name)
    proc = train_here([*run_args(tiny_dataset, earlier_run), "--resume", str(earlier_run / "checkpoints" /
                                                                              "step_00000018")])  # fmt: skip
    assert proc.returncode == 2
    assert f"{name} cannot be read as plain tensors and numbers (UnpicklingError" in one_error_line(proc)
    assert not marker.exists()


@pytest.fixture(scope="module")
def ema_run(tiny_dataset, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ema") / "run"
    assert train_in_process(run_args(tiny_dataset, out, "--ema_decay", "0.9")) == 0
    return out


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ("nan", "ema.safetensors holds non-finite values (NaN or infinity); it is damaged"),
        ("negative_count", "ema.safetensors counts -3 updates of the weight average, but the checkpoint is of "
                           "optimizer step 18"),
        ("nan_weights", "model.safetensors holds non-finite values"),
    ],
)  # fmt: skip
def test_damaged_values_in_a_checkpoint_are_refused_by_resume_and_load_model(ema_run, tiny_dataset, train_here,
                                                                            tmp_path, damage, message):  # fmt: skip
    run = shutil.copytree(ema_run, tmp_path / "run")
    checkpoint = run / "checkpoints" / "step_00000018"
    name = "model.safetensors" if damage == "nan_weights" else "ema.safetensors"
    tensors = load_file(checkpoint / name)
    if damage == "negative_count":
        tensors["n_averaged"] = torch.tensor(-3)
    else:
        tensors = {k: v.fill_(float("nan")) if v.is_floating_point() else v for k, v in tensors.items()}
    save_file(tensors, checkpoint / name)
    before = snapshot(run)
    proc = train_here([*run_args(tiny_dataset, run, "--ema_decay", "0.9", "--num_train_epochs", "3"), "--resume",
                       str(checkpoint)])  # fmt: skip
    assert proc.returncode == 2
    assert message in one_error_line(proc)
    assert snapshot(run) == before
    if damage != "nan_weights":  # load_model takes the average of a checkpoint, so that is what it checks
        with pytest.raises(InputError, match=message.split(";")[0].replace("(", r"\(").replace(")", r"\)")):
            load_model(checkpoint)


def test_the_grad_scaler_file_is_required_and_read_safely(finished_run, tmp_path):
    """Only fp16 runs (on a GPU) have a GradScaler; its file is checked like the others."""
    checkpoint = shutil.copytree(finished_run / "checkpoints" / "step_00000018", tmp_path / "step_00000018")
    accelerator = fp16_accelerator("cpu", init_scale=1024.0)
    state = TrainerState(num_processes=1)
    with pytest.raises(InputError, match="is incomplete: scaler.pt is missing"):
        check_checkpoint_files(accelerator, checkpoint, state)
    marker = tmp_path / "code_ran"
    torch.save(RunsCode(marker), checkpoint / "scaler.pt")
    with pytest.raises(InputError, match="scaler.pt cannot be read as plain tensors"):
        check_checkpoint_files(accelerator, checkpoint, state)
    assert not marker.exists()
    torch.save(torch.amp.GradScaler("cpu").state_dict(), checkpoint / "scaler.pt")
    check_checkpoint_files(accelerator, checkpoint, state)


# 4. Every output is written atomically.


@pytest.mark.parametrize(
    "between, problem",
    [(":", "No space left on device); free space on that disk"),
     ("mount -o remount,ro {disk}", "Read-only file system); make that folder writable")],
    ids=["full", "read-only"],
)  # fmt: skip
def test_a_full_or_read_only_disk_while_writing_an_output_is_one_line_and_keeps_the_old_file(
    tmp_path, between, problem
):
    """A 128 KiB disk, full or remounted read-only after the earlier file was written (as a filesystem with errors
    is); removing the temporary file that was never made must not fail there either."""
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare (util-linux) for a private tmpfs")
    disk = tmp_path / "small_disk"
    disk.mkdir()
    start = (
        "import sys; from pathlib import Path; from cifar_accel.outputs import write_atomic; "
        f"from cifar_accel.errors import run_cli; path = Path('{disk}') / 'results.json'; "
    )
    earlier = start + "write_atomic(path, 'the earlier results')"
    program = start + "sys.exit(run_cli(lambda argv: write_atomic(path, 'x' * 300_000)))"
    script = f"mount -t tmpfs -o size=128k tmpfs {disk} || exit 99; {sys.executable} -c \"{earlier}\"; " \
             f"{between.format(disk=disk)} || exit 98; {sys.executable} -c \"{program}\"; " \
             f'echo "exit=$?" >&2; ls -A {disk}; cat {disk}/results.json'  # fmt: skip
    proc = subprocess.run(["unshare", "-rm", "sh", "-c", script], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO)})  # fmt: skip
    if "exit=" not in proc.stderr:
        pytest.skip(f"cannot mount a private tmpfs here: {proc.stderr.strip()[-200:]}")
    error, status = proc.stderr.strip().splitlines()
    assert status == "exit=1"
    assert error == f"error: writing {disk / 'results.json'} failed ({problem}"
    assert proc.stdout.split() == ["results.json", "the", "earlier", "results"]  # no temporary file left


def test_readers_treat_a_damaged_file_as_unfinished_or_refuse_it(finished_run, tmp_path, capsys):
    run = shutil.copytree(finished_run, tmp_path / "run")
    (run / "results.json").write_text('{"test_accuracy": 0.5')  # cut off
    assert compare.finished_results(run) is None
    (run / "labels.json").write_text("{not json")
    assert run_cli(evaluate.main, ["--model", str(run)]) == 2
    assert "labels.json cannot be read (JSONDecodeError" in capsys.readouterr().err
    shutil.copy(finished_run / "labels.json", run / "labels.json")
    (run / "config.yaml").write_text("learning_rate: [0.1\n")
    assert run_cli(evaluate.main, ["--model", str(run)]) == 2
    assert "config.yaml is not valid YAML" in capsys.readouterr().err
    shutil.copy(finished_run / "config.yaml", run / "config.yaml")
    (tmp_path / "a_file").write_text("")
    assert run_cli(evaluate.main, ["--model", str(run), "--output_dir", str(tmp_path / "a_file")]) == 2
    assert f"output directory '{tmp_path / 'a_file'}' is a file; choose another --output_dir" in capsys.readouterr().err
    # A split the dataset lacks is refused with the flag to fix, and the folders made for the report go again.
    assert run_cli(evaluate.main, ["--model", str(run), "--output_dir", str(tmp_path / "new" / "eval"), "--split",
                                   "valid"]) == 2  # fmt: skip
    assert ("no 'valid' split (splits: train, test, validation (the run's, held out of train)); pick one of them "
            "with --split") in capsys.readouterr().err  # fmt: skip
    assert not (tmp_path / "new").exists()


def test_evaluating_a_checkpoint_writes_beside_it_not_into_it(finished_run, tmp_path):
    """A checkpoint folder goes when newer checkpoints replace it, and its evaluation would go with it."""
    run = shutil.copytree(finished_run, tmp_path / "run")
    checkpoint = complete_checkpoints(run)[-1]
    before = snapshot(checkpoint)
    assert run_cli(evaluate.main, ["--model", str(checkpoint), "--max_eval_samples", "20"]) == 0
    assert snapshot(checkpoint) == before
    assert json.loads((run / f"eval_test_{checkpoint.name}" / "metrics.json").read_text())["model"] == str(
        checkpoint / "model.safetensors"
    )


def test_evaluate_and_compare_keep_the_users_files_of_their_names_and_replace_their_own(
    finished_run, tiny_dataset, tmp_path, capsys
):
    """A metrics.json of the user's (a DVC project's, say) or their report.md is refused; an earlier evaluation's
    metrics.json is replaced."""
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "metrics.json").write_text('{"accuracy": 0.99}')
    evaluation = ["--model", str(finished_run), "--output_dir", str(folder), "--max_eval_samples", "20"]
    assert run_cli(evaluate.main, evaluation) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: '{folder}' already holds metrics.json, which evaluate writes but did not write there; move it, or "
        "pick another --output_dir"
    )
    assert (folder / "metrics.json").read_text() == '{"accuracy": 0.99}'
    (folder / "metrics.json").unlink()
    assert run_cli(evaluate.main, evaluation) == 0
    assert run_cli(evaluate.main, evaluation) == 0  # its own earlier report is replaced
    assert json.loads((folder / "metrics.json").read_text())["split"] == "test"

    (folder / "report.md").write_text("# my notes\n")
    assert run_cli(compare.main, ["--output_dir", str(folder), "--dataset_name", str(tiny_dataset)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: '{folder}' already holds report.md, which compare writes but did not write there; move it, or pick "
        "another --output_dir"
    )
    assert (folder / "report.md").read_text() == "# my notes\n"


# 5. Config files are data, within limits.


def test_config_files_that_are_not_regular_files_are_refused_without_reading(cli_env, tmp_path):
    fifo = tmp_path / "config.fifo"
    os.mkfifo(fifo)
    for path in (fifo, Path("/dev/zero"), tmp_path):
        proc = run_subprocess(["--config", str(path), "--output_dir", str(tmp_path / "out")], cli_env, timeout=60)
        assert proc.returncode == 2
        assert f"config file {path} is not a regular file" in one_error_line(proc)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("learning_rate: 0.1\n" + "# padding\n" * 200_000, "more than the 1048576 a config may have"),
        ("seed: " + "[" * 50_000 + "]" * 50_000 + "\n", "nests deeper than 8 levels"),
        ("a0: &a0 x\n" + "".join(f"a{i}: *a0\n" for i in range(1, 120)), "uses more than 100 YAML aliases"),
        (
            "a0: &a0 [x, x]\n" + "".join(f"a{i}: &a{i} [*a{i - 1}, *a{i - 1}]\n" for i in range(1, 60)),
            "holds more than 10000 values once its YAML aliases are expanded",
        ),  # fmt: skip
        (  # 80 aliases, 3 levels deep, under 300 bytes: 10^8 elements, whose repr() alone would exhaust memory
            "seed: [&a [x, x, x, x, x, x, x, x, x, x], "
            + ", ".join(f"&{b} [{', '.join([f'*{a}'] * 10)}]" for a, b in zip("abcdefg", "bcdefgh", strict=True))
            + "]\n",
            "holds more than 10000 values once its YAML aliases are expanded",
        ),  # fmt: skip
        ("learning_rate: " + "9" * 300_000 + "x\n", "'learning_rate' must be float, not str ('99999"),
        ("seed: " + "[" * 7 + "1, " * 2000 + "]" * 7 + "\n", "'seed' must be int, not list ([[[...]]])"),
    ],
    ids=["too-large", "too-deep", "too-many-aliases", "alias-bomb", "small-alias-bomb", "huge-value", "big-list"],
)
def test_config_files_have_size_depth_and_alias_limits_and_errors_stay_short(tmp_path, text, message):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    started = time.perf_counter()
    with pytest.raises(InputError) as err:
        read_config_file(path)
    assert message in str(err.value) and len(str(err.value)) < 400
    assert time.perf_counter() - started < 30  # bounded work: the bombs took minutes and gigabytes before


# 6. Data errors name the row.


def dataset_with(root: Path, column: list, features: datasets.Features, column_name: str) -> Path:
    images, labels = make_images(40, 0)
    values = {"img": images, "label": labels, column_name: column}
    train = datasets.Dataset.from_dict(values, features=features)
    return write_split_files(root, train, good_split(20, 1))


def null_image(root: Path) -> Path:
    images, _ = make_images(40, 0)
    return dataset_with(root, images[:3] + [None] + images[4:], FEATURES, "img")


def huge_image(root: Path) -> Path:
    images, _ = make_images(40, 0)
    return dataset_with(root, images[:2] + [Image.new("1", (9000, 8000))] + images[3:], FEATURES, "img")


def null_label(root: Path) -> Path:
    features = datasets.Features({"img": datasets.Image(), "label": datasets.ClassLabel(names=CLASS_NAMES)})
    return dataset_with(root, [i % 10 for i in range(5)] + [None] + [1] * 34, features, "label")


def fractional_labels(root: Path) -> Path:
    features = datasets.Features({"img": datasets.Image(), "label": datasets.Value("float64")})
    return dataset_with(root, [float(i % 10) for i in range(5)] + [3.7] + [1.0] * 34, features, "label")


def number_labels(labels: list, dtype: str = "int64") -> Callable[[Path], Path]:
    """A dataset whose train labels are these plain numbers (no ClassLabel: its classes are numbered 0..max)."""

    def make(root: Path) -> Path:
        features = datasets.Features({"img": datasets.Image(), "label": datasets.Value(dtype)})
        return dataset_with(root, labels, features, "label")

    return make


def class_named(name: str) -> Callable[[Path], Path]:
    """A dataset whose class 3 has the name ``name``."""

    def make(root: Path) -> Path:
        features = datasets.Features(
            {"img": datasets.Image(), "label": datasets.ClassLabel(names=[*CLASS_NAMES[:3], name, *CLASS_NAMES[4:]])}
        )
        return dataset_with(root, [i % 10 for i in range(40)], features, "label")

    return make


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (null_image, "train image 3 (column 'img') is empty; fix or drop that row"),
        (huge_image, "train image 2 (column 'img') cannot be decoded (ImageTooLarge: 9000x8000 pixels, more than"),
        (null_label, "train label 5 (column 'label') is empty; fix that row or the column"),
        (fractional_labels, "train label 5 (column 'label') is 3.7, not a whole class number"),
        (number_labels([i % 10 for i in range(39)] + [2**40]), "train label 1099511627776 at index 39 (column "
         "'label') is above 99,999, the largest class number taken (an id, not a class?); fix that row, or name the "
         "column of class numbers with --label_column_name"),
        (number_labels([i % 10 for i in range(39)] + [1e300], "float64"), "train label 1e+300 at index 39 "),
        (number_labels([-1] * 40), "error: the 'train' split has no labels (-1 in every row, datasets' mark for a "
         "missing label); training needs them"),
        (number_labels([3, 1, -5] + [1] * 37), "train label -5 at index 2 is below 0, where class numbers start; "
         "fix the labels or --label_column_name"),
        (number_labels([-5] * 40), "train label -5 at index 0 is below 0"),
        (class_named("big\ncat"), "the name of class 3 (label column 'label') holds a line break or another control "
                                   "character ('big\\ncat'); the tables, predictions and model card show each class on "
                                   "one line: rename it in the dataset"),
        (class_named(" "), "the name of class 3 (label column 'label') is empty (' ')"),
    ],
    ids=["null-image", "decompression-bomb-size", "null-label", "fractional-labels", "an-id-as-label",
         "a-huge-float-label", "every-label-missing", "a-negative-label", "every-label-negative",
         "class-name-with-a-line-break", "blank-class-name"],
)  # fmt: skip
def test_bad_rows_and_class_names_are_refused_naming_them(train_here, tmp_path, make, words):
    """A label of plain numbers far above the others (an id) made a list of that many class names, which took
    all the memory until the kernel killed the run; labels all below 0 made none, and an IndexError of exit code 1."""
    proc = train_here(tiny_args(make(tmp_path / "data"), tmp_path / "out"))
    assert proc.returncode == 2
    assert words in one_error_line(proc)
    assert not (tmp_path / "out" / "config.yaml").exists()


def test_a_broken_file_of_an_image_folder_is_named_by_its_path(train_here, tmp_path):
    root = write_image_folder(tmp_path / "folder", ["cat", "dog"], {"train": 20, "test": 5})
    broken = root / "train" / "dog" / "7.png"
    broken.write_bytes(broken.read_bytes()[:100])
    proc = train_here(tiny_args(root, tmp_path / "out"))
    assert proc.returncode == 2
    line = one_error_line(proc)
    assert f"(column 'image', file {broken}) cannot be decoded (OSError: " in line, line
    assert line.endswith("; fix or remove that file")


@pytest.mark.parametrize(
    ("old", "new", "shown"),
    [
        ("train/dog/7.png", b"chien_\xe9.png", "train/dog/chien_\\xe9.png"),
        ("train/dog", b"chien_\xe9", "train/chien_\\xe9"),
    ],
    ids=["file", "class"],
)
def test_an_image_folder_name_that_is_not_utf8_is_named_by_its_path(train_here, tmp_path, old, new, shown):
    """`datasets` failed on it with a bare DatasetGenerationError (exit 1)."""
    root = write_image_folder(tmp_path / "folder", ["cat", "dog"], {"train": 20, "test": 5})
    (root / old).rename((root / old).with_name(os.fsdecode(new)))
    proc = train_here(tiny_args(root, tmp_path / "out"))
    line = f"error: dataset '{root}' holds '{shown}', a name that is not UTF-8 text, which datasets cannot read; "
    assert (proc.returncode, os.fsencode(one_error_line(proc))) == (2, f"{line}rename it".encode())
    assert not (tmp_path / "out").exists()


# 7. predict and evaluate.


def test_predict_reads_only_regular_image_files_and_says_what_it_skipped(finished_run, cli_env, tmp_path):
    folder = tmp_path / "photos"
    folder.mkdir()
    make_images(1, 0)[0][0].save(folder / "a.png")
    os.mkfifo(folder / "b.png")  # opening it would block
    (folder / "c.png").mkdir()
    (folder / "notes.txt").write_text("not an image")
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(folder / "d.png"))
    try:
        proc = run_subprocess(["--model", str(finished_run), str(folder), "--format", "jsonl"], cli_env,
                              module="cifar_accel.predict", timeout=120)  # fmt: skip
    finally:
        server.close()
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [row["file"] for row in rows if "top_k" in row] == [str(folder / "a.png")]
    assert {Path(row["file"]).name: row["skipped"] for row in rows if "skipped" in row} == {
        "b.png": "not a regular file", "c.png": "not a regular file", "d.png": "not a regular file",
        "notes.txt": "not an image file name",
    }  # fmt: skip


def test_predict_into_a_reader_that_goes_away_finishes_quietly(finished_run, cli_env, tmp_path):
    """``predict photos/ | head -1``, with more lines than a pipe holds: exit code 0 and nothing on stderr, where
    every later line raised BrokenPipeError."""
    folder = tmp_path / "photos"
    folder.mkdir()
    make_images(1, 0)[0][0].save(folder / "0000.png")
    for i in range(1, 800):  # about 140 kB of JSON lines; a pipe holds 64 kB
        shutil.copyfile(folder / "0000.png", folder / f"{i:04d}.png")
    proc = subprocess.Popen([sys.executable, "-m", "cifar_accel.predict", "--model", str(finished_run), str(folder),
                             "--format", "jsonl"], env=cli_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)  # fmt: skip
    assert json.loads(proc.stdout.readline())["file"] == str(folder / "0000.png")
    proc.stdout.close()
    stderr = proc.stderr.read()
    assert proc.wait(timeout=120) == 0
    assert stderr == ""


@pytest.mark.parametrize(
    ("module", "argv"),
    [
        (evaluate, ["--model", ""]),
        (evaluate, ["--model", "{run}", "--dataset_name", ""]),
        (evaluate, ["--model", "{run}", "--output_dir", " "]),
        (predict, ["--model", "{run}", ""]),
        (compare, ["--output_dir", ""]),
    ],
    ids=["evaluate-model", "evaluate-dataset", "evaluate-output", "predict-image", "compare-output"],
)
def test_an_empty_name_is_refused_not_read_as_the_default_or_the_current_folder(finished_run, capsys, module,
                                                                                argv):  # fmt: skip
    """An unset shell variable (``--model "$RUN"``) would otherwise evaluate the current folder or the run's own
    dataset, or write a comparison into the current folder."""
    capsys.readouterr()
    assert run_cli(module.main, [a.format(run=finished_run) for a in argv]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: argument ") and "must not be empty" in line


def test_a_run_without_final_weights_names_its_newest_checkpoint(earlier_run):
    """A run still training (or stopped before its end) has checkpoints but no model.safetensors yet."""
    (earlier_run / "model.safetensors").unlink()
    newest = complete_checkpoints(earlier_run)[-1]
    for folder in (earlier_run, earlier_run / "checkpoints"):
        with pytest.raises(InputError, match=f"no model weights at .*; its newest checkpoint is {newest}; pass"):
            load_model(folder)
    assert load_model(newest).predict(torch.zeros(1, 3, 32, 32, dtype=torch.uint8))


def test_exif_orientation_is_applied_and_reported(tmp_path):
    """A phone stores a portrait photo as landscape pixels plus 'rotate 90 degrees' (orientation 6)."""
    image = Image.new("RGB", (64, 32), (0, 0, 255))
    image.paste((255, 0, 0), (0, 0, 32, 32))  # left half red, as stored
    exif = Image.Exif()
    exif[0x0112] = 6
    image.save(tmp_path / "photo.jpg", exif=exif, quality=95)
    pixels, original = to_rgb32(tmp_path / "photo.jpg")
    assert original == "RGB 64x32, EXIF-rotated"
    top, bottom = pixels[:, :8].reshape(3, -1).mean(1), pixels[:, -8:].reshape(3, -1).mean(1)
    assert top[0] > 200 and top[2] < 60 and bottom[2] > 200  # rotated clockwise: the stored left is now on top


def test_16_bit_float_and_transparent_images_keep_what_they_show(tmp_path):
    """PIL's convert("RGB") clips 16-bit greyscale to white above 255, rounds floating-point greyscale from 0 to 1
    down to black, and shows the colour stored under transparent pixels; a 16-bit scan, a float TIFF or a cut-out PNG
    would be predicted, and trained on, as something else. Each file below
    is written by PIL, read back through the decoder of training data and predict, and every pixel checked."""
    ramp = np.arange(32 * 32, dtype=np.uint16).reshape(32, 32) * 64  # 0 to 65472
    Image.fromarray(ramp).save(tmp_path / "scan16.png")
    Image.fromarray(ramp).save(tmp_path / "scan16.tif")
    cut_out = np.zeros((32, 32, 4), dtype=np.uint8)  # black where transparent, as editors store it
    cut_out[8:24, 8:24] = (200, 40, 10, 255)
    cut_out[0, :, 3] = 128  # a half-transparent black row
    Image.fromarray(cut_out, "RGBA").save(tmp_path / "cut_out.png")
    Image.new("RGB", (32, 32), (7, 8, 9)).save(tmp_path / "keyed.png", transparency=(7, 8, 9))  # PNG's tRNS colour
    for name in ("scan16.png", "scan16.tif"):
        pixels, original = to_rgb32(tmp_path / name)
        assert original == "I;16 32x32"
        assert all((channel == ramp >> 8).all() for channel in pixels)  # 0 to 255, one step every 4 pixels
    pixels, original = to_rgb32(tmp_path / "cut_out.png")
    assert original == "RGBA 32x32"
    assert (pixels[:, 8:24, 8:24] == np.array([200, 40, 10]).reshape(3, 1, 1)).all()
    assert (pixels[:, 1:8] == 255).all() and (pixels[:, 0] == 127).all()  # white behind, half of it through
    pixels, original = to_rgb32(tmp_path / "keyed.png")
    assert original == "RGB 32x32" and (pixels == 255).all()
    Image.fromarray(ramp.astype(np.float32) / 65472).save(tmp_path / "float.tif")  # 0 to 1, as float images hold it
    pixels, original = to_rgb32(tmp_path / "float.tif")
    assert original == "F 32x32"
    assert all((np.abs(channel.astype(int) - ramp / 65472 * 255) <= 0.5 + 1e-9).all() for channel in pixels)
    for values in (ramp.astype(np.float32), np.full((32, 32), np.nan, np.float32)):  # 0 to 65472; not a number
        Image.fromarray(values).save(tmp_path / "float.tif")
        with pytest.raises(ValueError, match="floating-point image with values from (0 to 65472|nan to nan), where"):
            to_rgb32(tmp_path / "float.tif")
    for low, high in ((0, 70000), (-1, 255)):  # a 32-bit integer TIFF (mode I): not 16-bit intensities
        Image.fromarray(np.linspace(low, high, 32 * 32).astype(np.int32).reshape(32, 32)).save(tmp_path / "int.tif")
        with pytest.raises(ValueError, match=f"integer image with values from {low} to {high}, where 16-bit"):
            to_rgb32(tmp_path / "int.tif")
    Image.fromarray(ramp.astype(np.int32)).save(tmp_path / "int.tif")
    pixels, original = to_rgb32(tmp_path / "int.tif")
    assert original == "I 32x32" and all((channel == ramp >> 8).all() for channel in pixels)


# 8. One line means one line.


def test_warnings_go_to_stdout_and_stderr_gets_the_error_line_in_one_write(cli_env):
    """stderr keeps the one error line; a library's warning goes to stdout, and so does a log line of torch's,
    which torch's own handler would write on stderr (torch.compile's "No CUDA runtime is found"). The line is one
    write: ranks that fail at once share the launcher's stderr, and print, which wrote the newline in a write of its
    own, let two ranks' lines run together ("...--cpu'error: 2 processes..."). A write under the pipe's atomic 4096
    bytes cannot be split by another process's. Every write to stderr is recorded and passed on."""
    program = (
        "import json, logging, sys, warnings; import torch; from cifar_accel.errors import InputError, run_cli\n"
        "writes, stderr = [], sys.stderr\n"
        "class Recorder:\n"
        "    def write(self, text): writes.append(text); return stderr.write(text)\n"
        "    def flush(self): stderr.flush()\n"
        "def main(argv):\n"
        "    warnings.warn('a library says something', UserWarning)\n"
        "    logging.getLogger('torch.utils.cpp_extension').warning('torch says something')\n"
        "    raise InputError('the one line ' + 'x' * 5000)\n"
        "sys.stderr = Recorder()\n"
        "code = run_cli(main)\n"
        "print(json.dumps(writes)); sys.exit(code)\n"
    )
    proc = subprocess.run([sys.executable, "-c", program], env=cli_env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    line = "error: " + ("the one line " + "x" * 5000)[:MAX_ERROR_CHARACTERS] + "...\n"
    assert proc.stderr == line and len(line.encode()) < 4096
    assert json.loads(proc.stdout.splitlines()[-1]) == [line]
    assert "UserWarning: a library says something" in proc.stdout
    assert "<string>:8] torch says something" in proc.stdout  # in torch's own format


# 9. Signals at any moment.


def test_a_signal_while_loading_data_stops_at_once_and_writes_nothing(tiny_dataset, cli_env, tmp_path):
    out = tmp_path / "run"
    env = {**cli_env, "HF_DATASETS_CACHE": str(tmp_path / "fresh_cache")}  # decode again
    proc = subprocess.Popen([sys.executable, "-m", "cifar_accel.train", *tiny_args(tiny_dataset, out)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    for line in proc.stdout:
        if "cifar_accel.data: train: decoded" in line:  # the train split is decoded, the test split not yet
            proc.send_signal(signal.SIGTERM)
            break
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 143
    assert stderr.strip().splitlines() == ["stopped by SIGTERM before training started; nothing of the run was written"]
    assert not out.exists()  # the folder the run made for itself goes too


@pytest.mark.parametrize(
    ("last_line_read", "stop_line"),
    [
        ("effective config:", "stopped by SIGPIPE before training started; nothing of the run was written"),
        ("epoch 1:", "stopped by SIGPIPE after "),  # at the next step that logs
    ],
    ids=["during-set-up", "during-training"],
)
def test_a_reader_of_stdout_that_goes_away_stops_the_run_as_sigpipe_would(tiny_dataset, cli_env, tmp_path,
                                                                           last_line_read, stop_line):  # fmt: skip
    """``train | head``: once head has its lines and exits, the next log line finds no reader. The run stops as a
    signal stops it, in one line and with exit code 141 (128 + SIGPIPE), instead of a log-error traceback per
    line; in training, after the step, with a checkpoint that the resume finishes from."""
    out = tmp_path / "run"
    args = tiny_args(tiny_dataset, out, "--num_train_epochs", "3")
    proc = subprocess.Popen([sys.executable, "-m", "cifar_accel.train", *args], env=cli_env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    for line in proc.stdout:
        if last_line_read in line:
            break
    proc.stdout.close()  # as head does when it has its lines
    stderr = proc.stderr.read()
    assert proc.wait(timeout=120) == 141
    (line,) = stderr.strip().splitlines()
    assert line.startswith(stop_line)
    if last_line_read == "effective config:":
        assert not out.exists()
        return
    assert "resume with --resume_from_checkpoint latest" in line and not (out / "results.json").exists()
    resumed = run_subprocess([*args, "--resume_from_checkpoint", "latest"], cli_env)
    assert resumed.returncode == 0, resumed.stderr
    assert read_results(out)["epochs_completed"] == 3


@pytest.mark.parametrize("module", ["cifar_accel.train", "cifar_accel.predict"])
def test_stdout_on_a_full_disk_is_one_line_and_exit_code_1(finished_run, tiny_dataset, cli_env, tmp_path, module):
    """``train > log`` where the disk is full (/dev/full): one line naming the failed write, where every log call
    printed a traceback and the end blamed the tracker files."""
    if module == "cifar_accel.train":
        args = tiny_args(tiny_dataset, tmp_path / "run")
    else:
        make_images(1, 0)[0][0].save(tmp_path / "one.png")
        args = ["--model", str(finished_run), str(tmp_path / "one.png")]
    with open("/dev/full", "w") as full:
        proc = subprocess.run([sys.executable, "-m", module, *args], env=cli_env, stdout=full, stderr=subprocess.PIPE,
                              text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 1
    assert proc.stderr == (
        "error: writing to standard output failed (No space left on device); free space where it goes, or send it "
        "elsewhere\n"
    )


@pytest.mark.parametrize("fd", [1, 2], ids=["stdout", "stderr"])
def test_a_command_started_with_stdout_or_stderr_closed_runs_as_with_dev_null(finished_run, tiny_dataset, cli_env,
                                                                              tmp_path, fd):  # fmt: skip
    """``train >&-`` (or ``2>&-``): Python leaves ``sys.stdout`` None, where every log line printed a traceback on
    stderr, and a refusal with stderr closed gave exit code 1, not 2."""
    make_images(1, 0)[0][0].save(tmp_path / "one.png")

    def run(*argv: str) -> subprocess.CompletedProcess:
        closed = ["sh", "-c", f'exec "$@" {fd}>&-', "sh", sys.executable, "-m", *argv]  # the shell closes it
        return subprocess.run(closed, env=cli_env, capture_output=True, text=True, timeout=300)

    trained = run("cifar_accel.train", *tiny_args(tiny_dataset, tmp_path / "run"))
    refused = run("cifar_accel.train", *tiny_args(tiny_dataset, tmp_path / "refused"), "--bogus")
    predicted = run("cifar_accel.predict", "--model", str(finished_run), str(tmp_path / "one.png"))
    assert (trained.returncode, refused.returncode, predicted.returncode) == (0, 2, 0)
    assert read_results(tmp_path / "run")["epochs_completed"] == 1 and not (tmp_path / "refused").exists()
    if fd == 1:
        assert (trained.stderr, predicted.stderr) == ("", "")
        assert refused.stderr == "error: unknown argument '--bogus' (see --help)\n"


def test_names_a_stream_or_the_locale_cannot_encode(finished_run, tiny_dataset, cli_env, tmp_path):
    """An image whose name is not UTF-8 (Linux allows any bytes) is classified under a strict UTF-8 stdout (as
    en_US.UTF-8 gives), where its line failed with 'surrogates not allowed', exit 1; a run into a folder named
    outside ASCII with PYTHONIOENCODING=ascii logs its last line, where the logging module printed a traceback; and
    in an ASCII locale without Python's UTF-8 mode, where Python cannot read such a name as text, the run is
    refused in one line that says how to run it, where it failed after writing its first files."""
    image = tmp_path / os.fsdecode(b"cat_\xe9.png")
    make_images(1, 0)[0][0].save(image)

    def run(env: dict[str, str], *argv: str | Path) -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", *map(str, argv)]
        return subprocess.run(command, env={**cli_env, **env}, capture_output=True, timeout=300)

    predicted = run({"PYTHONIOENCODING": "utf-8:strict"}, "cifar_accel.predict", "--model", finished_run, image)
    assert (predicted.returncode, predicted.stderr) == (0, b"")
    assert predicted.stdout.startswith(f"{tmp_path}/cat_\\udce9.png: ".encode())
    trained = run({"PYTHONIOENCODING": "ascii"}, "cifar_accel.train", *tiny_args(tiny_dataset, tmp_path / "runs_é"))
    assert (trained.returncode, trained.stderr) == (0, b"")
    assert f"are in {tmp_path}/runs_\\xe9\n".encode() in trained.stdout
    ascii_locale = {"LC_ALL": "C", "PYTHONUTF8": "0"}
    refused = run(ascii_locale, "cifar_accel.train", *tiny_args(tiny_dataset, tmp_path / "runs_ë"))
    assert (refused.returncode, refused.stdout) == (2, b"") and not (tmp_path / "runs_ë").exists()
    assert refused.stderr == (
        b"error: --output_dir: 'output_dir' holds a name ('runs_\\xeb') that Python reads as ascii here; set "
        b"PYTHONUTF8=1 or a UTF-8 locale (LANG=C.UTF-8)\n"
    )


class DeleteAtStep(RunBookkeeper):
    """Deletes the run's folder, or its logs/, after optimizer step 11, once checkpoint step_00000010 is saved."""

    what = "."

    def count_step(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        super().count_step(loss, grad_norm)
        if self.state.global_step == 11:
            shutil.rmtree(self.run.output_dir / self.what)


@pytest.mark.parametrize(
    ("what", "then"), [(".", "run again"), ("logs", "resume with --resume_from_checkpoint latest")]
)
def test_a_run_whose_folder_is_deleted_under_it_names_the_file_and_what_is_left(tiny_dataset, train_here, tmp_path,
                                                                                monkeypatch, what, then):  # fmt: skip
    """TensorBoard's writer names its file in bytes (b'...'), and the line advised a resume from a checkpoint that
    went with the folder."""
    monkeypatch.setattr(DeleteAtStep, "what", what)
    out = tmp_path / "run"
    args = tiny_args(tiny_dataset, out, "--num_train_epochs", "3", "--checkpointing_steps", "5", "--logging_steps", "1")
    proc = train_here(args, bookkeeper_type=DeleteAtStep)
    assert proc.returncode == 1
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(f"error: writing {out / 'logs' / 'cifar_accel' / 'events.out.tfevents.'}")
    assert line.endswith(f" failed (No such file or directory); check that folder, then {then}")
    if what == "logs":
        assert train_here([*args, "--resume_from_checkpoint", "latest"]).returncode == 0


class SignalAsTheLastEpochEnds(RunBookkeeper):
    """SIGTERM at the end of the run's last epoch: after its checkpoint (as the final test starts) or before it
    (after the last validation); or before the checkpoint of an epoch that early stopping makes the last (its
    validation accuracy reported as 0, no better than the first epoch's, with --early_stopping_patience 1)."""

    when = "after its checkpoint"

    def end_epoch(self, train: dict, val: dict):
        if self.when == "at an early stop" and self.state.epoch == 1:
            val = {**val, "accuracy": 0.0}
        last = self.state.epoch + 1 == (2 if self.when == "at an early stop" else self.run.num_epochs)
        if last and self.when != "after its checkpoint":
            os.kill(os.getpid(), signal.SIGTERM)
        record = super().end_epoch(train, val)
        if last and self.when == "after its checkpoint":
            os.kill(os.getpid(), signal.SIGTERM)
        return record


@pytest.mark.parametrize("when", ["after its checkpoint", "before its checkpoint", "at an early stop"])
def test_a_signal_after_the_last_optimizer_step_lets_the_run_finish_then_exits_with_the_signals_code(
    tiny_dataset, train_here, tmp_path, monkeypatch, when
):
    """All that a resume from the last epoch's checkpoint would do is the final test and export, so a stop
    requested after the last optimizer step waits for them, wherever it comes: a test that signalled a run once its
    last checkpoint was complete found it stopped there now and then, when the signal came before its stop check."""
    monkeypatch.setattr(SignalAsTheLastEpochEnds, "when", when)
    out = tmp_path / "run"
    early_stop = when == "at an early stop"
    args = tiny_args(tiny_dataset, out, *(["--num_train_epochs", "4", "--early_stopping_patience", "1"] if early_stop
                                          else ["--num_train_epochs", "2"]))  # fmt: skip
    proc = train_here(args, bookkeeper_type=SignalAsTheLastEpochEnds)
    assert proc.returncode == 143
    assert one_error_line(proc) == (
        f"stopped by SIGTERM as the run was finishing, which it did first: results.json and model.safetensors are in "
        f"{out}"
    )
    results = read_results(out)
    assert results["epochs_completed"] == 2 and results["stopped_early"] == early_stop
    assert (out / "model.safetensors").is_file()


# 10. The global batch is what really happens.


def test_more_accumulation_steps_than_batches_in_an_epoch_is_refused(tiny_dataset, train_here, tmp_path):
    proc = train_here(tiny_args(tiny_dataset, tmp_path / "run", "--gradient_accumulation_steps", "10"))
    assert proc.returncode == 2
    line = one_error_line(proc)
    assert "--gradient_accumulation_steps 10 is more than the 9 batches an epoch has" in line
    assert "global batch of 320" in line


def test_a_readme_of_the_users_in_the_output_folder_is_left_as_it_is(tiny_dataset, train_here, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "README.md").write_text("# my notes\n")
    proc = train_here(tiny_args(tiny_dataset, out))
    assert proc.returncode == 0, proc.stderr
    assert (out / "README.md").read_text() == "# my notes\n"
    assert "README.md is not a model card of this package, so it is left as it is" in proc.stdout
    assert "model.safetensors, results.json, config.yaml, checkpoints/ and logs/ are in" in proc.stdout  # no card
    proc = train_here([*tiny_args(tiny_dataset, out), "--overwrite_output_dir"])
    assert proc.returncode == 0, proc.stderr
    assert (out / "README.md").read_text() == "# my notes\n"  # not set aside with the earlier run's files
