"""Trackers by flag: a missing package is refused before any work; MLflow, offline, gets the same scalars and
config as TensorBoard."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import mlflow
import pytest
import torch
from accelerate import Accelerator
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from cifar_accel.bookkeeping import RunBookkeeper
from cifar_accel.checkpoint import complete_checkpoints, read_trainer_state
from cifar_accel.config import load_config
from cifar_accel.errors import RunFault
from cifar_accel.trackers import requested_trackers, start_trackers, tensorboard_dir, tracker_config

from conftest import read_results, reset_accelerate_state, run_cli, snapshot, tiny_args


@pytest.mark.parametrize(
    ("report_to", "message"),
    [
        ("wandb", "--report_to wandb: its package is not installed; pip install wandb, or pick another tracker"),
        ("tensorboard,comet_ml", "--report_to comet_ml: its package is not installed; pip install comet_ml"),
        ("tensorbored", "--report_to: 'tensorbored' is not a tracker; use tensorboard, all, none, or names from"),
        ("none,tensorboard", "--report_to: 'none' stands alone; pass --report_to none, or tracker names only"),
    ],
)
def test_a_tracker_that_cannot_run_is_refused_before_any_work(tiny_dataset, train_here, tmp_path, report_to, message):
    out = tmp_path / "run"
    proc = train_here(tiny_args(tiny_dataset, out, "--report_to", report_to))
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(f"error: {message}")
    assert not out.exists()


def test_mlflow_offline_holds_the_scalars_and_config_that_tensorboard_holds(
    tiny_dataset, train_here, tmp_path, monkeypatch
):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())  # a local file store, no server
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    out = tmp_path / "run"
    args = tiny_args(tiny_dataset, out, "--num_train_epochs", "2", "--report_to", "tensorboard,mlflow",
                     "--project_name", "cifar_test", "--run_name", "tiny-2-epochs", "--logging_steps", "4")  # fmt: skip
    proc = train_here(args)
    assert proc.returncode == 0, proc.stderr
    results = read_results(out)

    client = MlflowClient()
    experiment = client.get_experiment_by_name("cifar_test")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == "tiny-2-epochs" and run.info.status == "FINISHED"
    config, _ = load_config(args)
    assert run.data.params == {key: str(value) for key, value in tracker_config(config).items()}  # all of it
    assert run.data.params["model_name"] == "simple_cnn" and run.data.params["max_grad_norm"] == "none"
    val_accuracy = client.get_metric_history(run.info.run_id, "val/accuracy")
    assert [(m.step, m.value) for m in val_accuracy] == [
        (9 * r["epoch"], pytest.approx(r["val_accuracy"]))
        for r in results["history"]  # 9 optimizer steps an epoch
    ]
    (test_accuracy,) = client.get_metric_history(run.info.run_id, "test/accuracy")
    assert test_accuracy.value == pytest.approx(results["test_accuracy"])
    step_loss = client.get_metric_history(run.info.run_id, "step/loss")
    assert [m.step for m in step_loss] == [4, 8, 12, 16]  # 9 optimizer steps an epoch

    events = EventAccumulator(str(tensorboard_dir(out, "cifar_test")))
    events.Reload()
    scalars = {tag for tag in events.Tags()["scalars"] if not tag.startswith("hparam/")}  # TensorBoard's HParams
    assert scalars == set(run.data.metrics)  # the same scalars in both
    for tag in run.data.metrics:
        tensorboard = [(e.step, e.value) for e in events.Scalars(tag)]
        mlflow = [(m.step, pytest.approx(m.value)) for m in client.get_metric_history(run.info.run_id, tag)]
        assert tensorboard == mlflow, tag


def test_a_tracker_named_twice_starts_once():
    """Accelerate would start two TensorBoard writers, each with its own event file of the same scalars."""
    assert requested_trackers(" tensorboard,mlflow,tensorboard ") == ["tensorboard", "mlflow"]
    assert requested_trackers("all") == "all" and requested_trackers("none") is None


def test_report_to_none_writes_no_event_files(tiny_dataset, train_here, tmp_path):
    out = tmp_path / "run"
    proc = train_here(tiny_args(tiny_dataset, out, "--report_to", "none"))
    assert proc.returncode == 0, proc.stderr
    assert read_results(out)["epochs_completed"] == 1
    assert not list((out / "logs").rglob("events.out.tfevents.*"))


def test_a_new_run_where_a_run_stopped_before_its_first_checkpoint_draws_each_step_once(
    tiny_dataset, train_here, tmp_path
):
    """Such a run leaves its config, labels and TensorBoard events, which a new run in the folder keeps (here a
    finished run's, its checkpoints and results removed). TensorBoard purges their points, so the curves are the new
    run's alone, not both runs' drawn over each other."""
    out = tmp_path / "run"
    assert train_here(tiny_args(tiny_dataset, out, "--num_train_epochs", "2", "--logging_steps", "1")).returncode == 0
    for name in ("checkpoints", "results.json", "model.safetensors", "README.md", "curves.png"):
        shutil.rmtree(out / name) if name == "checkpoints" else (out / name).unlink()
    earlier_events = list((out / "logs").rglob("events.out.tfevents.*"))
    proc = train_here(tiny_args(tiny_dataset, out, "--logging_steps", "1"))
    assert proc.returncode == 0, proc.stderr
    steps = read_trainer_state(complete_checkpoints(out)[-1]).global_step  # one epoch
    events = EventAccumulator(str(tensorboard_dir(out, "cifar_accel")))
    events.Reload()
    assert [e.step for e in events.Scalars("step/loss")] == list(range(1, steps + 1))
    assert [(e.step, e.value) for e in events.Scalars("epoch")] == [(steps, 1.0)]
    assert all(path.exists() for path in earlier_events)  # kept on disk, left out of the curves


def test_a_run_killed_and_resumed_continues_its_mlflow_run_holding_each_step_once(
    tiny_dataset, cli_env, tmp_path, monkeypatch
):
    """SIGKILL two or more optimizer steps after a checkpoint: MLflow and TensorBoard already hold those steps. The
    resumed run continues the same MLflow run without logging them again, and TensorBoard purges them."""
    env = {**cli_env, "MLFLOW_TRACKING_URI": (tmp_path / "mlruns").as_uri(), "MLFLOW_ALLOW_FILE_STORE": "true"}
    out = tmp_path / "run"
    args = tiny_args(tiny_dataset, out, "--num_train_epochs", "3", "--report_to", "tensorboard,mlflow",
                     "--logging_steps", "1", "--checkpointing_steps", "6", "--max_eval_samples", "40")  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-m", "cifar_accel.train", *args], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)  # fmt: skip
    monkeypatch.setenv("MLFLOW_TRACKING_URI", env["MLFLOW_TRACKING_URI"])  # this process reads the same store
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient()
    deadline = time.monotonic() + 120
    while True:  # until the step after checkpoint step_00000006 and the one after it are logged
        assert proc.poll() is None and time.monotonic() < deadline
        try:
            runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
            if runs and len(client.get_metric_history(runs[0].info.run_id, "step/loss")) >= 8:
                break
        except MlflowException:  # the store read while the run writes it, for example a run folder half made
            pass
        time.sleep(0.01)
    proc.kill()
    proc.wait()
    (killed,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    logged = max(m.step for m in client.get_metric_history(killed.info.run_id, "step/loss"))
    checkpoint = read_trainer_state(complete_checkpoints(out)[-1]).global_step  # step 6 unless the kill came late
    assert checkpoint < logged  # the store holds steps after the checkpoint

    resumed = run_cli([*args, "--resume_from_checkpoint", "latest"], env)
    assert resumed.returncode == 0, resumed.stderr
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert run.info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "step/loss")] == list(range(1, 28))
    epochs = client.get_metric_history(run.info.run_id, "epoch")
    assert [(m.step, m.value) for m in epochs] == [(9, 1.0), (18, 2.0), (27, 3.0)]
    events = EventAccumulator(str(tensorboard_dir(out, "cifar_accel")))
    events.Reload()
    assert [e.step for e in events.Scalars("step/loss")] == list(range(1, 28))
    tensorboard = {e.step: e.value for e in events.Scalars("step/loss")}
    assert {m.step: pytest.approx(m.value) for m in client.get_metric_history(run.info.run_id, "step/loss")} == (
        tensorboard
    )


def test_a_run_killed_between_two_metrics_of_one_step_logs_the_second_when_resumed(tmp_path, monkeypatch):
    """The step's loss and the epoch's figures go to MLflow in two calls at the same step; a run killed between
    them holds the first only. The resumed run continues it with the second, and does not log the first twice."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    out = tmp_path / "run"
    config, _ = load_config(["--output_dir", str(out), "--report_to", "mlflow"])
    (out / "logs").mkdir(parents=True)  # as the run makes it

    killed = Accelerator(log_with="mlflow", cpu=True)
    start_trackers(killed, config, out, resumed_step=0)
    killed.log({"step/loss": 2.0}, step=8)
    killed.log({"step/loss": 1.5}, step=9)  # killed here, before the epoch's figures at step 9
    run_id = killed.get_tracker("mlflow").tracker.info.run_id
    mlflow.end_run(status="KILLED")
    reset_accelerate_state()

    resumed = Accelerator(log_with="mlflow", cpu=True)
    start_trackers(resumed, config, out, resumed_step=6)  # from the checkpoint of step 6: steps 7-9 again
    for step, loss in [(7, 2.5), (8, 2.0), (9, 1.5)]:
        resumed.log({"step/loss": loss}, step=step)
    resumed.log({"val/accuracy": 0.25, "epoch": 1}, step=9)
    resumed.log({"step/loss": 1.25}, step=10)
    resumed.end_training()

    client = MlflowClient()
    (run,) = client.search_runs([client.get_experiment_by_name("cifar_accel").experiment_id])
    assert run.info.run_id == run_id and run.info.status == "FINISHED"
    history = {key: [(m.step, m.value) for m in client.get_metric_history(run_id, key)] for key in run.data.metrics}
    assert history == {"step/loss": [(8, 2.0), (9, 1.5), (10, 1.25)], "val/accuracy": [(9, 0.25)], "epoch": [(9, 1)]}


@pytest.mark.parametrize("report_to", ["mlflow", "all"])
def test_mlflow_without_a_tracking_uri_uses_a_file_store_in_the_run_folder(tiny_dataset, train_here, tmp_path,
                                                                           monkeypatch, report_to):  # fmt: skip
    """MLflow 3 on its own would pick a sqlite file in the working folder, which mlflow-skinny (the package's
    extra) cannot open, and refuse a file store without MLFLOW_ALLOW_FILE_STORE."""
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_ALLOW_FILE_STORE"):  # unset here, and as they were afterwards
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "run"
    proc = train_here(tiny_args(tiny_dataset, out, "--report_to", report_to))
    assert proc.returncode == 0, proc.stderr
    store = out / "logs" / "mlruns"
    assert f"MLFLOW_TRACKING_URI is not set, so the run uses the file store {store.resolve().as_uri()}" in proc.stdout
    assert not (tmp_path / "mlflow.db").exists()
    client = MlflowClient(tracking_uri=store.as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("cifar_accel").experiment_id])
    (accuracy,) = client.get_metric_history(run.info.run_id, "test/accuracy")
    assert accuracy.value == pytest.approx(read_results(out)["test_accuracy"])
    assert bool(list((out / "logs").rglob("events.out.tfevents.*"))) == (report_to == "all")


@pytest.mark.parametrize(
    ("uri", "allow", "message"),
    [
        ("foo://somewhere", True, "MLFLOW_TRACKING_URI='foo://somewhere' needs a scheme MLflow knows"),
        ("sqlite:///{tmp}/mlflow.db", True, "needs the full mlflow package (pip install mlflow)"),
        ("{tmp}/mlruns", False, "is a file store, which MLflow 3 opens only with MLFLOW_ALLOW_FILE_STORE=true"),
        ("file://{tmp}/a_file/mlruns", True, "a_file is a file; point it at a folder"),
        ("http://127.0.0.1:9", True, "the MLflow server does not answer (MlflowException: "),  # a closed port
        ("postgresql://me:pw-secret5@db.example/mlflow", True,
         "MLFLOW_TRACKING_URI='postgresql://me:***@db.example/mlflow' needs the full mlflow package"),
        ("http://me:pw-secret5@127.0.0.1:9", True, "MLFLOW_TRACKING_URI='http://me:***@127.0.0.1:9': the MLflow server "
         "does not answer (MlflowException: API request to http://me:***@127.0.0.1:9/api/"),
    ],
    ids=["unknown-scheme", "sqlite-without-mlflow", "file-store-not-allowed", "under-a-file", "server-down",
         "password-of-a-database", "password-of-a-server"],
)  # fmt: skip
def test_an_mlflow_store_that_cannot_open_is_refused_before_any_work(tiny_dataset, train_here, tmp_path, monkeypatch,
                                                                     uri, allow, message):  # fmt: skip
    (tmp_path / "a_file").write_text("not a folder")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri.format(tmp=tmp_path))
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true" if allow else "")
    out = tmp_path / "run"
    proc = train_here(tiny_args(tiny_dataset, out, "--report_to", "tensorboard,mlflow"))
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("error: MLFLOW_TRACKING_URI=") and message in line
    assert "secret5" not in proc.stdout + proc.stderr  # a URI's password is shown as ***
    assert not out.exists() and not (tmp_path / "mlflow.db").exists()


class StopOrFailAtStep5(RunBookkeeper):
    """SIGTERM at optimizer step 5 (the run stops after it with a checkpoint), or a fault there."""

    fault = False

    def count_step(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        super().count_step(loss, grad_norm)
        if self.state.global_step == 5:
            if self.fault:
                raise RunFault("injected fault at step 5")
            os.kill(os.getpid(), signal.SIGTERM)  # recorded, not fatal: the step in progress completes


@pytest.mark.parametrize(("fault", "exit_code", "status"), [(False, 143, "KILLED"), (True, 1, "FAILED")])
def test_a_run_that_does_not_finish_says_so_in_mlflow_and_its_resume_finishes_the_same_run(
    tiny_dataset, train_here, tmp_path, monkeypatch, fault, exit_code, status
):
    """MLflow's exit hook would end the run as FINISHED; a stopped one is KILLED, a failed one FAILED, and the
    TensorBoard writer is closed in either case."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.setattr(StopOrFailAtStep5, "fault", fault)
    out = tmp_path / "run"
    args = tiny_args(tiny_dataset, out, "--report_to", "tensorboard,mlflow", "--checkpointing_steps", "3")
    writers = {thread for thread in threading.enumerate() if type(thread).__name__ == "_AsyncWriterThread"}
    assert train_here(args, bookkeeper_type=StopOrFailAtStep5).returncode == exit_code
    assert mlflow.active_run() is None
    assert {t for t in threading.enumerate() if type(t).__name__ == "_AsyncWriterThread"} == writers
    client = MlflowClient()
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert run.info.status == status

    assert train_here([*args, "--resume_from_checkpoint", "latest"]).returncode == 0
    (resumed,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert (resumed.info.run_id, resumed.info.status) == (run.info.run_id, "FINISHED")


def test_a_resume_whose_mlflow_run_is_not_in_the_store_is_refused_before_any_work(
    tiny_dataset, train_here, tmp_path, monkeypatch
):
    """MLflow would fail to start the run it continues once the data were loaded: the store changed since the run
    began, or the MLflow run was deleted."""
    store, other = (tmp_path / "mlruns").as_uri(), (tmp_path / "other").as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    out = tmp_path / "run"
    args = tiny_args(tiny_dataset, out, "--report_to", "mlflow", "--checkpointing_steps", "3")
    assert train_here(args, bookkeeper_type=StopOrFailAtStep5).returncode == 143
    run_id = json.loads((out / "logs" / "tracker_runs.json").read_text())["mlflow"]
    before = snapshot(out)
    resume = [*args, "--resume_from_checkpoint", "latest"]

    monkeypatch.setenv("MLFLOW_TRACKING_URI", other)
    proc = train_here(resume)
    assert proc.returncode == 2 and proc.stderr == (
        f"error: the run continues MLflow run {run_id}, which the store MLFLOW_TRACKING_URI='{other}' holds nowhere; "
        f"set MLFLOW_TRACKING_URI to the store the run began in, or delete {out / 'logs' / 'tracker_runs.json'} to "
        "log the rest of the run to a new MLflow run\n"
    )
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    MlflowClient().delete_run(run_id)
    proc = train_here(resume)
    assert proc.returncode == 2 and f"MLFLOW_TRACKING_URI='{store}' holds as deleted; set" in proc.stderr
    assert snapshot(out) == before

    MlflowClient().restore_run(run_id)
    assert train_here(resume).returncode == 0
    assert MlflowClient().get_run(run_id).info.status == "FINISHED"
