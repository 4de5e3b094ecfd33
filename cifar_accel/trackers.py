"""Experiment trackers by flag, as in the Hugging Face example scripts: ``--report_to``, ``--project_name`` and
``--run_name``, through Accelerate's tracker API."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from accelerate import Accelerator
from accelerate.tracking import GeneralTracker, get_available_trackers
from accelerate.utils import LoggerType

from cifar_accel.config import TrainConfig
from cifar_accel.errors import InputError, RunFault, Stopped, one_line
from cifar_accel.outputs import LOGS_DIR, fix_for, write_atomic

logger = logging.getLogger(__name__)  # not Accelerate's: the trackers are checked before the Accelerator exists

TRACKERS = [tracker.value for tracker in LoggerType if tracker is not LoggerType.ALL]
# The keyword each tracker takes for the run's name (Accelerate gives them the project name as its own argument).
RUN_NAME_KEYWORDS = {
    "wandb": "name",
    "mlflow": "run_name",
    "clearml": "task_name",
    "swanlab": "experiment_name",
    "trackio": "name",
}


def requested_trackers(report_to: str) -> list[str] | str | None:
    """What ``--report_to`` asks Accelerate for: None for 'none', 'all' for every installed tracker, else the
    names. A name that is not one of Accelerate's trackers, or whose package is not installed, is refused (Accelerate
    would leave it out without a word)."""
    if report_to.strip() in ("none", "all"):
        return None if report_to.strip() == "none" else "all"
    names = list(dict.fromkeys(name.strip() for name in report_to.split(",") if name.strip()))  # each once
    installed = {tracker.value for tracker in get_available_trackers()}
    for name in names:
        if name in ("none", "all"):
            raise InputError(f"--report_to: '{name}' stands alone; pass --report_to {name}, or tracker names only")
        if name not in TRACKERS:
            raise InputError(
                f"--report_to: '{name[:40]}' is not a tracker; use tensorboard, all, none, or names from "
                f"{', '.join(TRACKERS)}, separated by commas"
            )
        if name not in installed:
            raise InputError(
                f"--report_to {name}: its package is not installed; pip install {name}, or pick another tracker"
            )
    return names or None


MLFLOW_STORE = "mlruns"  # in logs/: MLflow's file store, when MLFLOW_TRACKING_URI names none


def check_trackers(trackers: list[str] | str | None, output_dir: Path) -> None:
    """Before any work: every tracker asked for can start. For MLflow that is its store
    (``check_mlflow_store``); the others need no more than their package."""
    names = [t.value for t in get_available_trackers()] if trackers == "all" else trackers or []
    if "mlflow" in names:
        check_mlflow_store(output_dir)


def without_passwords(text: str) -> str:
    """``text`` with the password of every URI in it (``postgresql://user:secret@host/db``) shown as ***: refusals
    name MLFLOW_TRACKING_URI, and MLflow's own errors quote the URL they requested."""
    return re.sub(r"(\w[\w+.-]*://[^\s/@:]*):[^\s/@]*@", r"\1:***@", text)


def check_mlflow_store(output_dir: Path) -> None:
    """MLflow's store must be one it can open here. Without MLFLOW_TRACKING_URI, MLflow 3 would pick a sqlite
    file in the working folder, which mlflow-skinny cannot open; the run picks a file store in
    ``<output_dir>/logs/mlruns`` instead, beside TensorBoard's events. A URI of another kind is refused with
    one line naming the setting to change: an unknown scheme, a database without the full ``mlflow`` package, a
    file store without ``MLFLOW_ALLOW_FILE_STORE`` (MLflow 3 refuses those), or a folder that cannot be written."""
    from mlflow.tracking._tracking_service.utils import _tracking_store_registry
    from mlflow.utils.file_utils import local_file_uri_to_path
    from mlflow.utils.uri import get_uri_scheme

    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        uri = (output_dir / LOGS_DIR / MLFLOW_STORE).resolve().as_uri()
        os.environ["MLFLOW_TRACKING_URI"] = uri
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        logger.info(f"MLflow: MLFLOW_TRACKING_URI is not set, so the run uses the file store {uri}")
    unset = "or unset it for a file store in <output_dir>/logs/mlruns"
    setting = f"MLFLOW_TRACKING_URI={without_passwords(uri)!r}"
    scheme = get_uri_scheme(uri)
    try:
        _tracking_store_registry.get_store_builder(uri)
    except Exception:  # noqa: BLE001 - MLflow's registry says "unsupported" in several kinds
        need = "the full mlflow package (pip install mlflow)" if scheme in DATABASE_SCHEMES else "a scheme MLflow knows"
        raise InputError(f"{setting} needs {need}; use a file: folder or an http(s) server, {unset}") from None
    if scheme in ("http", "https"):
        check_mlflow_server(uri, unset)
    if scheme not in ("", "file"):
        return
    if os.environ.get("MLFLOW_ALLOW_FILE_STORE", "").lower() not in ("true", "1"):
        raise InputError(
            f"{setting} is a file store, which MLflow 3 opens only with MLFLOW_ALLOW_FILE_STORE=true; set that, or "
            "use an http(s) server"
        )
    store = Path(local_file_uri_to_path(uri))
    existing = next(folder for folder in (store, *store.parents) if folder.exists())
    if not existing.is_dir():
        raise InputError(f"{setting}: {existing} is a file; point it at a folder, {unset}")
    probe = existing / f".write-test-{os.getpid()}"
    try:
        probe.touch()
        probe.unlink()
    except OSError as err:
        raise InputError(
            f"{setting}: {existing} is not writable ({err.strerror}); point it at a writable folder, {unset}"
        ) from None


DATABASE_SCHEMES = ("sqlite", "postgresql", "mysql", "mssql")
# One try, answered within 15 s: MLflow's own requests try 8 times over about four minutes before they fail.
SERVER_PROBE = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "15"}


def check_mlflow_server(uri: str, unset: str) -> None:
    """An MLflow server must answer before any work, with the credentials MLflow would send: the run's first
    request to it (Accelerate's MLflow tracker looks its experiment up by name) is made here once, so that a server
    that is down or refuses the credentials stops the run in seconds, not minutes later and after the run folder
    was written."""
    from mlflow.tracking import MlflowClient

    saved = {name: os.environ.get(name) for name in SERVER_PROBE}
    os.environ.update(SERVER_PROBE)
    try:
        MlflowClient(tracking_uri=uri).get_experiment_by_name("cifar_accel")
    except Exception as err:  # noqa: BLE001 - the network and the server fail in many kinds
        raise InputError(
            f"MLFLOW_TRACKING_URI={without_passwords(uri)!r}: the MLflow server does not answer ({type(err).__name__}: "
            f"{without_passwords(one_line(err))[:200]}); start it or fix its credentials, point the variable at one "
            f"that runs, {unset}"
        ) from None
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name)
            else:
                os.environ[name] = value


def tracker_config(config: TrainConfig) -> dict[str, Any]:
    """The config as tracker hyperparameters (TensorBoard's cannot hold None)."""
    return {k: ("none" if v is None else v) for k, v in config.to_dict().items()}


def run_name(config: TrainConfig, output_dir: Path) -> str:
    """The run's name in trackers and its model card: ``--run_name``, else the output folder's name."""
    return config.run_name or output_dir.resolve().name


def tracker_init_kwargs(
    config: TrainConfig, output_dir: Path, resumed_step: int, continued: dict[str, str]
) -> dict[str, dict[str, Any]]:
    """Each tracker's keyword arguments: the run's name; for TensorBoard, a purge of every point an earlier run in
    the folder logged after the step this run starts from, so each step is drawn once: after the checkpoint of
    optimizer step ``resumed_step`` (the interrupted run's points, logged again now), or all of them in a new run (of
    a run killed before its first checkpoint, which a new run replaces); for MLflow, the run to continue
    (``continued``: tracker -> run id)."""
    kwargs = {tracker: {keyword: run_name(config, output_dir)} for tracker, keyword in RUN_NAME_KEYWORDS.items()}
    kwargs["tensorboard"] = {"purge_step": resumed_step + 1 if resumed_step else 0}
    if "mlflow" in continued:
        kwargs["mlflow"]["run_id"] = continued["mlflow"]
    return kwargs


TRACKER_RUNS_FILE = "tracker_runs.json"  # in logs/: the MLflow run a resumed run continues


def tracker_runs_file(output_dir: Path) -> Path:
    return output_dir / LOGS_DIR / TRACKER_RUNS_FILE


class ContinuedRun(GeneralTracker):
    """A tracker run that a resumed training run continues. It holds the points the interrupted run logged, each
    metric up to its own last step in ``logged_through`` (metric -> step), some of them after the checkpoint: those
    are not logged again (the resume is exact, so they hold the values computed again now). A run killed between
    two metrics of one step holds the first and not the second, so the check is per metric. The config was stored
    when the run began (MLflow cannot change a parameter)."""

    def __init__(self, tracker: GeneralTracker, logged_through: dict[str, int]) -> None:
        super().__init__(_blank=True)
        self.wrapped, self.logged_through = tracker, logged_through
        self.name, self.requires_logging_directory = tracker.name, tracker.requires_logging_directory

    @property
    def tracker(self) -> Any:
        return self.wrapped.tracker

    def log(self, values: dict, step: int | None = None, **kwargs: Any) -> None:
        if step is not None:
            values = {key: value for key, value in values.items() if step > self.logged_through.get(key, 0)}
        if values:
            self.wrapped.log(values, step=step, **kwargs)

    def finish(self) -> None:
        self.wrapped.finish()


def continued_runs(output_dir: Path, resumed_step: int) -> dict[str, str]:
    """The tracker runs (tracker -> run id) that a run resumed at optimizer step ``resumed_step`` continues: those
    the interrupted run in ``output_dir`` recorded; none for a new run."""
    runs_file = tracker_runs_file(output_dir)
    return json.loads(runs_file.read_text()) if resumed_step and runs_file.is_file() else {}


def check_continued_runs(accelerator: Accelerator, output_dir: Path, resumed_step: int) -> None:
    """Before any work: the MLflow run that a resumed run continues is in the store it logs to now, where MLflow
    would fail to start it, once the data were loaded. It is not there where MLFLOW_TRACKING_URI has changed since
    the run began, or the MLflow run was deleted."""
    run_id = continued_runs(output_dir, resumed_step).get("mlflow")
    if not (run_id and LoggerType.MLFLOW in accelerator.log_with and accelerator.is_main_process):
        return
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    try:
        state = MlflowClient().get_run(run_id).info.lifecycle_stage
    except MlflowException:
        state = "missing"
    if state != "active":
        raise InputError(
            f"the run continues MLflow run {run_id}, which the store MLFLOW_TRACKING_URI="
            f"{without_passwords(os.environ['MLFLOW_TRACKING_URI'])!r} holds "
            f"{'as deleted' if state == 'deleted' else 'nowhere'}; set "
            f"MLFLOW_TRACKING_URI to the store the run began in, or delete {tracker_runs_file(output_dir)} "
            "to log the rest of the run to a new MLflow run"
        )


def mlflow_logged_through(run_id: str) -> dict[str, int]:
    """Each metric the MLflow run holds, with the last step it holds."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient()
    keys = client.get_run(run_id).data.metrics
    return {key: max(m.step for m in client.get_metric_history(run_id, key)) for key in keys}


def start_trackers(accelerator: Accelerator, config: TrainConfig, output_dir: Path, resumed_step: int) -> None:
    """Start the trackers with the config. A new run records its MLflow run id; a resumed one continues that run
    (``ContinuedRun``) and TensorBoard purges what came after the checkpoint, so every tracker holds each step
    once. Only the main process has trackers."""
    continued = continued_runs(output_dir, resumed_step)
    accelerator.init_trackers(
        config.project_name, init_kwargs=tracker_init_kwargs(config, output_dir, resumed_step, continued)
    )
    for index, tracker in enumerate(accelerator.trackers):
        if tracker.name == "mlflow" and "mlflow" in continued:
            accelerator.trackers[index] = ContinuedRun(tracker, mlflow_logged_through(continued["mlflow"]))
        else:
            tracker.store_init_configuration(tracker_config(config))
        if tracker.name == "mlflow" and accelerator.is_main_process:
            write_atomic(tracker_runs_file(output_dir), json.dumps({"mlflow": tracker.tracker.info.run_id}))


@contextlib.contextmanager
def trackers_ended_with_the_run(accelerator: Accelerator) -> Iterator[None]:
    """Around a run whose trackers the body starts: a run that raises ends its MLflow run saying how it ended,
    KILLED when a signal stopped it (resumable), FAILED otherwise, as ``mlflow.start_run`` as a context does
    (MLflow's own exit hook would mark it FINISHED), and closes TensorBoard's writer. The other trackers' libraries
    end their runs at exit, where they see the exit code (W&B marks a run failed by it); a ``finish()`` here would
    mark them finished. Ending them cannot hide the run's own error."""
    try:
        yield
    except BaseException as err:
        for tracker in accelerator.trackers:
            with contextlib.suppress(Exception):
                if tracker.name == "mlflow":
                    import mlflow

                    mlflow.end_run(status="KILLED" if isinstance(err, Stopped) else "FAILED")
                elif tracker.name == "tensorboard":
                    tracker.finish()
        raise


def tracker_write_fault(err: OSError, output_dir: Path, last_checkpoint: Path | None) -> RunFault:
    """The line for a write of the trackers that failed: TensorBoard's writer may name no file, or name it in bytes.
    The run resumes from its newest checkpoint, unless that is gone with the folder."""
    written = os.fsdecode(err.filename) if err.filename else f"the tracker files in {output_dir / LOGS_DIR}"
    resumable = last_checkpoint is not None and last_checkpoint.is_dir()
    return RunFault(
        f"writing {written} failed ({err.strerror or err}); {fix_for(err)}, then "
        + ("resume with --resume_from_checkpoint latest" if resumable else "run again")
    )


def tensorboard_dir(output_dir: Path, project_name: str) -> Path:
    """Where TensorBoard's event files go: Accelerate names the folder after the project."""
    return output_dir / LOGS_DIR / project_name
