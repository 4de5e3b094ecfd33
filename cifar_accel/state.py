"""Where a run stands and what it measured: one ``EpochRecord`` per finished epoch, the ``TrainerState`` that every
checkpoint saves as JSON, and the ``RunResults`` of a finished run (results.json). Each is read back through
``schema.from_json``, so its definition here is also its check."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cifar_accel.errors import InputError, counted, one_line
from cifar_accel.schema import bounds, from_json

MAX_COUNT = 10**9  # no real run takes this many epochs, steps or processes
COUNT = bounds(ge=0, le=MAX_COUNT)


def checkpoint_name(global_step: int) -> str:
    return f"step_{global_step:08d}"


def _metric(tag: str, log: str, **limits: float) -> Any:
    """An epoch metric that is also a tracker scalar named ``tag`` and a part ``log`` of the epoch's log line."""
    return field(metadata={"tag": tag, "log": log, **bounds(**limits)})


@dataclass
class EpochRecord:
    """One epoch's numbers. The same record is an entry of ``history`` (results.json, trainer_state.json), the
    tracker scalars of the epoch (x axis: epochs) and the epoch's log line, so a metric is added here once."""

    epoch: int = field(metadata=bounds(ge=1, le=MAX_COUNT))
    train_loss: float = _metric("train/loss", "train loss {:.4f}", ge=0)
    train_accuracy: float = _metric("train/accuracy", "acc {:.4f}", ge=0, le=1)
    val_loss: float | None = _metric("val/loss", "| val loss {:.4f}", ge=0)  # None: no validation (--val_ratio 0)
    val_accuracy: float | None = _metric("val/accuracy", "acc {:.4f}", ge=0, le=1)
    val_samples: int = field(metadata=COUNT)
    learning_rate: float = _metric("learning_rate", "| lr {:.2e}", ge=0)
    train_images: int = field(metadata=COUNT)
    train_seconds: float = field(metadata=bounds(ge=0))
    train_images_per_second: float = _metric("train/images_per_second", "| {:.0f} img/s", ge=0)
    epoch_seconds: float = _metric("epoch_seconds", "| {:.1f} s", ge=0)
    skipped_steps: int = field(metadata=COUNT)
    loss_scale: float | None = field(metadata=bounds(gt=0))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def _metrics(self) -> list[tuple[dataclasses.Field, float]]:
        """The tracked metrics with their values, leaving out those the epoch has none of (no validation)."""
        values = [(f, getattr(self, f.name)) for f in dataclasses.fields(self) if "tag" in f.metadata]
        return [(f, value) for f, value in values if value is not None]

    def tracker_values(self) -> dict[str, float]:
        return {f.metadata["tag"]: value for f, value in self._metrics()}

    def log_line(self) -> str:
        return f"epoch {self.epoch}: " + " ".join(f.metadata["log"].format(value) for f, value in self._metrics())


@dataclass
class TrainerState:
    """Progress of a run, saved as JSON in every checkpoint."""

    epoch: int = field(default=0, metadata=COUNT)  # epochs completed
    step_in_epoch: int = field(default=0, metadata=COUNT)  # batches of the current epoch already trained on
    global_step: int = field(default=0, metadata=COUNT)  # optimizer steps taken
    # Per process, the epoch so far: [loss sum, correct, images]; each process resumes its own, so the sums go on
    # in the same order as in an uninterrupted run. Empty at an epoch's end.
    epoch_totals: list[list[float]] = field(default_factory=list, metadata=bounds(ge=0))
    epoch_train_seconds: float = field(default=0.0, metadata=bounds(ge=0))  # training time of the epoch so far
    epoch_learning_rate: float | None = field(default=None, metadata=bounds(ge=0))  # the rate the epoch started with
    best_val_accuracy: float | None = field(default=None, metadata=bounds(ge=0, le=1))
    best_epoch: int | None = field(default=None, metadata=bounds(ge=1, le=MAX_COUNT))
    best_checkpoint: str | None = None
    epochs_without_improvement: int = field(default=0, metadata=COUNT)
    history: list[EpochRecord] = field(default_factory=list)
    config_fingerprint: dict[str, Any] = field(default_factory=dict)
    data_signature: str | None = None  # data.data_signature of the run's data; None in older checkpoints
    num_processes: int = field(default=1, metadata=bounds(ge=1, le=MAX_COUNT))  # of the run that wrote it
    skipped_steps: int = field(default=0, metadata=COUNT)  # optimizer steps the GradScaler skipped (fp16)
    skipped_steps_in_a_row: int = field(default=0, metadata=COUNT)

    def record_epoch(self, record: EpochRecord) -> bool:
        """Close one epoch with its metrics; returns whether its validation accuracy is the best so far (never,
        without validation)."""
        self.epoch = record.epoch
        self.step_in_epoch, self.epoch_totals, self.epoch_train_seconds = 0, [], 0.0
        self.epoch_learning_rate = None
        self.history.append(record)
        if record.val_accuracy is None:
            return False
        improved = self.best_val_accuracy is None or record.val_accuracy > self.best_val_accuracy
        if improved:
            self.best_val_accuracy, self.best_epoch = record.val_accuracy, record.epoch
            self.best_checkpoint = checkpoint_name(self.global_step)
            self.epochs_without_improvement = 0
        else:
            self.epochs_without_improvement += 1
        return improved

    def should_stop_early(self, patience: int) -> bool:
        return patience > 0 and self.epochs_without_improvement >= patience

    def consistency_problem(self, folder_step: int | None, checkpoint_exists: Any) -> str | None:
        """What contradicts itself in a state read from a checkpoint (each field is checked already), or None:
        the optimizer step against the folder's name, the totals against the processes, the history against the
        epochs, and the best checkpoint against the folders that exist (``checkpoint_exists(name)``)."""
        if folder_step is not None and folder_step != self.global_step:
            return f"'global_step' is {self.global_step} but the folder is named for step {folder_step}"
        if len(self.epoch_totals) not in (0, self.num_processes) or any(len(t) != 3 for t in self.epoch_totals):
            processes = counted(self.num_processes, "process", "processes")
            return f"'epoch_totals' must hold [loss sum, correct, images] for each of {processes}"
        if [record.epoch for record in self.history] != list(range(1, self.epoch + 1)):
            records = counted(self.epoch, "epoch record")
            return f"'history' must be a list of {records}, of epochs 1 to {self.epoch} in order"
        best = (self.best_checkpoint, self.best_epoch, self.best_val_accuracy)
        if all(record.val_accuracy is None for record in self.history):  # also before the first epoch's end
            unvalidated_best = best != (None, None, None)
            return "a checkpoint without a validated epoch cannot name a best epoch" if unvalidated_best else None
        if self.best_checkpoint is None or not checkpoint_exists(self.best_checkpoint):
            return f"its best checkpoint {self.best_checkpoint!r} does not exist next to it"
        if self.best_epoch is None or self.best_epoch > self.epoch or self.best_val_accuracy is None:
            return f"'best_epoch' must be an epoch from 1 to {self.epoch}, with its 'best_val_accuracy'"
        return None


RESULTS_SCHEMA_VERSION = 3


@dataclass
class RunResults:
    """What a finished run measured: ``results.json``. ``telemetry.run_results`` builds it; the model card,
    ``compare`` and the scripts read it back through ``read_results``, so a key is defined here once. A field
    added later gets a default, so that the files of older runs still load."""

    validation: bool  # without it (--val_ratio 0) there is no best epoch
    best_val_accuracy: float | None = field(metadata=bounds(ge=0, le=1))
    best_epoch: int | None = field(metadata=bounds(ge=1, le=MAX_COUNT))
    tested_epoch: int = field(metadata=bounds(ge=1, le=MAX_COUNT))  # the epoch whose weights were tested
    test_accuracy: float = field(metadata=bounds(ge=0, le=1))
    tta: str  # the test-time augmentation test_accuracy used
    test_accuracy_no_tta: float = field(metadata=bounds(ge=0, le=1))
    test_loss: float
    test_samples: int = field(metadata=COUNT)
    epochs_completed: int = field(metadata=COUNT)
    stopped_early: bool
    mixed_precision: str  # in effect
    requested_mixed_precision: str
    mixed_precision_source: str
    precision_advice: dict[str, str] | None  # what the hardware suggests, as logged at the start
    train_images_per_second: float
    seconds_per_epoch: float
    skipped_steps: int = field(metadata=COUNT)
    peak_memory_mib: float
    peak_memory_measure: str
    precision_report: dict[str, Any]
    num_processes: int = field(metadata=bounds(ge=1, le=MAX_COUNT))
    global_batch_size: int
    learning_rate: float
    device: str
    hardware: dict[str, Any]
    train_samples: int = field(metadata=COUNT)
    val_samples: int = field(metadata=COUNT)
    history: list[EpochRecord]
    versions: dict[str, str]
    schema_version: int = 1  # a file without it is version 1; run_results writes RESULTS_SCHEMA_VERSION
    image_column: str | None = None  # the dataset's columns the run read (recorded from schema version 2 on)
    label_column: str | None = None
    normalization: dict[str, Any] | None = None  # the input statistics, as preprocessing.json holds them
    # The dataset's own split the run validated on (from schema version 3 on); None where it held out a part of
    # its train split, or had no validation.
    val_split: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def epochs_trained(self) -> float:
        """The epochs trained, a last one cut short by --max_train_steps counted as its share of a whole one."""
        most = max(record.train_images for record in self.history)
        return sum(record.train_images for record in self.history) / most


def epochs_text(epochs: float) -> str:
    """Epochs as the card and the tables show them: whole ones as a whole number, a fraction to two decimals."""
    return f"{round(epochs, 2):g}"


def read_results(path: Path) -> RunResults:
    """The results.json at ``path``, checked against ``RunResults``; a missing, damaged or foreign file is an
    InputError that says so."""

    def invalid(problem: str) -> InputError:
        return InputError(f"{path} is not the results.json of a finished run ({problem})")

    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise invalid(one_line(err)[:200]) from None
    return from_json(RunResults, data, invalid)
