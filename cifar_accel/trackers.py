"""Experiment trackers by flag, as in the Hugging Face example scripts: ``--report_to``, ``--project_name`` and
``--run_name``, through Accelerate's tracker API."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from accelerate.tracking import get_available_trackers
from accelerate.utils import LoggerType

from cifar_accel.config import TrainConfig
from cifar_accel.errors import InputError

TRACKERS = [tracker.value for tracker in LoggerType if tracker is not LoggerType.ALL]
# The keyword each tracker takes for the run's name (Accelerate gives them the project name as its own argument).
RUN_NAME_KEYWORDS = {"wandb": "name", "mlflow": "run_name", "clearml": "task_name", "swanlab": "experiment_name",
                     "trackio": "name"}  # fmt: skip


def requested_trackers(report_to: str) -> list[str] | str | None:
    """What ``--report_to`` asks Accelerate for: None for 'none', 'all' for every installed tracker, else the
    names. A name that is not one of Accelerate's trackers, or whose package is not installed, is refused (Accelerate
    would leave it out without a word)."""
    if report_to.strip() in ("none", "all"):
        return None if report_to.strip() == "none" else "all"
    names = [name.strip() for name in report_to.split(",") if name.strip()]
    installed = {tracker.value for tracker in get_available_trackers()}
    for name in names:
        if name not in TRACKERS:
            raise InputError(
                f"--report_to: '{name[:40]}' is not a tracker; use tensorboard, all, none, or names from "
                f"{', '.join(TRACKERS)}, separated by commas"
            )
        if name not in installed:
            raise InputError(f"--report_to {name}: its package is not installed; pip install {name}, or pick another "
                             "tracker")  # fmt: skip
    return names or None


def tracker_config(config: TrainConfig) -> dict[str, Any]:
    """The config as tracker hyperparameters (TensorBoard's cannot hold None)."""
    return {k: ("none" if v is None else v) for k, v in config.to_dict().items()}


def run_name(config: TrainConfig, output_dir: Path) -> str:
    """The run's name in trackers and its model card: ``--run_name``, else the output folder's name."""
    return config.run_name or output_dir.resolve().name


def tracker_init_kwargs(config: TrainConfig, output_dir: Path, resumed_step: int) -> dict[str, dict[str, Any]]:
    """Each tracker's keyword arguments: the run's name; for TensorBoard, in a run resumed from the checkpoint of
    optimizer step ``resumed_step``, a purge of every point logged after it (by the interrupted run, and logged
    again now), so each step is drawn once."""
    kwargs = {tracker: {keyword: run_name(config, output_dir)} for tracker, keyword in RUN_NAME_KEYWORDS.items()}
    if resumed_step:
        kwargs["tensorboard"] = {"purge_step": resumed_step + 1}
    return kwargs


def tensorboard_dir(output_dir: Path, project_name: str) -> Path:
    """Where TensorBoard's event files go: Accelerate names the folder after the project."""
    return output_dir / "logs" / project_name
