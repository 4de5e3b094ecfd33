"""Checkpoints on top of ``accelerator.save_state`` / ``load_state``, with the trainer state as JSON.

A checkpoint is ``<output_dir>/checkpoints/step_NNNNNNNN/`` (named by optimizer
step): Accelerate's files (model weights as safetensors, optimizer, scheduler,
GradScaler, RNG states, sampler) plus ``trainer_state.json``, which holds the
progress as plain data; nothing of ours is pickled. A checkpoint is written
under a temporary name and renamed once complete, so a folder with the final
name is always whole.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import safetensors.torch
from accelerate import Accelerator
from accelerate.utils import load as load_pickled

from cifar_accel.averaging import EMA_FILE, WeightAverage, load_ema, save_ema
from cifar_accel.config import FIELDS, TrainConfig
from cifar_accel.errors import InputError, RunFault, one_line

STATE_FILE = "trainer_state.json"
PARTIAL_PREFIX = ".partial-"
_NAME = re.compile(r"^step_(\d{8,})$")


class CheckpointSaveError(RunFault):
    """A checkpoint could not be written (for example, the disk is full); earlier ones are untouched."""


@dataclass
class TrainerState:
    """Progress of a run, saved as JSON in every checkpoint."""

    epoch: int = 0  # epochs completed
    step_in_epoch: int = 0  # batches of the current epoch already trained on
    global_step: int = 0  # optimizer steps taken
    # Per process, the epoch so far: [loss sum, correct, images]; each process resumes its own, so the sums go on
    # in the same order as in an uninterrupted run. Empty at an epoch's end.
    epoch_totals: list[list[float]] = field(default_factory=list)
    epoch_train_seconds: float = 0.0  # training time of the current epoch so far
    epoch_learning_rate: float | None = None  # the learning rate the current epoch started with
    best_val_accuracy: float | None = None
    best_epoch: int | None = None
    best_checkpoint: str | None = None
    epochs_without_improvement: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)
    config_fingerprint: dict[str, Any] = field(default_factory=dict)
    num_processes: int = 1  # of the run that wrote the checkpoint
    skipped_steps: int = 0  # optimizer steps the GradScaler skipped (fp16)
    skipped_steps_in_a_row: int = 0

    def record_epoch(self, record: dict[str, Any]) -> bool:
        """Close one epoch with its metrics; returns whether its validation accuracy is the best so far (never,
        without validation)."""
        self.epoch = record["epoch"]
        self.step_in_epoch, self.epoch_totals, self.epoch_train_seconds = 0, [], 0.0
        self.epoch_learning_rate = None
        self.history.append(record)
        if record["val_accuracy"] is None:
            return False
        improved = self.best_val_accuracy is None or record["val_accuracy"] > self.best_val_accuracy
        if improved:
            self.best_val_accuracy, self.best_epoch = record["val_accuracy"], record["epoch"]
            self.best_checkpoint = checkpoint_name(self.global_step)
            self.epochs_without_improvement = 0
        else:
            self.epochs_without_improvement += 1
        return improved

    def should_stop_early(self, patience: int) -> bool:
        return patience > 0 and self.epochs_without_improvement >= patience


def config_fingerprint(config: TrainConfig, mixed_precision: str) -> dict[str, Any]:
    """The config values a resume must share with the checkpoint: the fields whose metadata says
    ``resume="match"``, with the precision that was in effect rather than the one requested."""
    values = {name: getattr(config, name) for name, f in FIELDS.items() if f.metadata["resume"] == "match"}
    return {**values, "mixed_precision": mixed_precision}


def checkpoint_name(global_step: int) -> str:
    return f"step_{global_step:08d}"


def checkpoint_dir(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def complete_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints in ``output_dir``, oldest first."""
    root = checkpoint_dir(output_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _NAME.match(p.name) and (p / STATE_FILE).is_file()]
    return sorted(found, key=lambda p: int(_NAME.match(p.name).group(1)))


def remove_partial_checkpoints(output_dir: str | Path) -> None:
    """Delete checkpoints whose writing was cut off (by a crash or a kill)."""
    root = checkpoint_dir(output_dir)
    for partial in root.glob(f"{PARTIAL_PREFIX}*") if root.is_dir() else []:
        shutil.rmtree(partial)


def save_checkpoint(
    accelerator: Accelerator, output_dir: str | Path, state: TrainerState, keep: int, ema: WeightAverage | None = None
) -> Path:
    """Save the full training state (with the weight average, if any); keep the newest ``keep`` checkpoints and
    the best one."""
    final = checkpoint_dir(output_dir) / checkpoint_name(state.global_step)
    partial = final.with_name(PARTIAL_PREFIX + final.name)  # leftovers of killed runs go at start-up
    try:
        accelerator.save_state(str(partial))
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            if ema is not None:
                save_ema(ema, partial)
            (partial / STATE_FILE).write_text(json.dumps(dataclasses.asdict(state), indent=2))
    except Exception as err:  # torch.save, safetensors and json each report a full disk in their own way
        shutil.rmtree(partial, ignore_errors=True)
        previous = complete_checkpoints(output_dir)
        kept = f"the previous checkpoint {previous[-1]} is intact" if previous else "no earlier checkpoint exists"
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CheckpointSaveError(
            f"saving checkpoint {final.name} failed ({reason}); {kept}; free space and resume with "
            "--resume_from_checkpoint latest"
        ) from err
    if accelerator.is_main_process:
        if final.exists():  # a run stopped on an epoch's last batch, resumed: that step is saved again at its end
            shutil.rmtree(final)
        partial.rename(final)
        for old in complete_checkpoints(output_dir)[:-keep]:
            if old.name != state.best_checkpoint:
                shutil.rmtree(old)
    accelerator.wait_for_everyone()
    return final


def resolve_checkpoint(spec: str, output_dir: str | Path) -> tuple[Path, TrainerState]:
    """The checkpoint folder named by ``--resume_from_checkpoint`` (a path, or 'latest'), with its checked
    trainer state."""
    if spec == "latest":
        found = complete_checkpoints(output_dir)
        if not found:
            raise InputError(
                f"no complete checkpoint in {checkpoint_dir(output_dir)}; start without --resume_from_checkpoint"
            )
        path = found[-1]
    else:
        path = Path(spec)
        if not path.is_dir():
            raise InputError(f"checkpoint '{spec}' does not exist; pass a checkpoint folder or 'latest'")
        if not (path / STATE_FILE).is_file():
            raise InputError(
                f"checkpoint '{spec}' is incomplete (no {STATE_FILE}); resume from another one or 'latest'"
            )
    return path, read_trainer_state(path)


MAX_COUNT = 10**9  # no real run takes this many epochs, steps or processes
STATE_KEYS_ADDED_LATER = {"epoch_learning_rate"}  # may be missing from older checkpoints


def read_trainer_state(path: Path) -> TrainerState:
    """The trainer state of checkpoint ``path``, checked as a schema before it is used: types and ranges, the
    optimizer step against the folder's name, and the best checkpoint against the folders that exist."""

    def invalid(problem: str) -> InputError:
        return InputError(
            f"checkpoint '{path}' has an invalid {STATE_FILE} ({problem}); resume from another checkpoint"
        )

    try:
        data = json.loads((path / STATE_FILE).read_text())
    except (OSError, ValueError) as err:
        raise InputError(
            f"checkpoint '{path}' has an unreadable {STATE_FILE} ({one_line(err)[:200]}); resume from another "
            "checkpoint"
        ) from None
    fields = {f.name for f in dataclasses.fields(TrainerState)}
    if not isinstance(data, dict):
        raise invalid("not a JSON object")
    if wrong_keys := (set(data) ^ fields) - STATE_KEYS_ADDED_LATER:
        raise invalid(f"unexpected or missing keys: {', '.join(sorted(map(str, wrong_keys)))[:200]}")

    def count(name: str, low: int = 0) -> int:
        value = data[name]
        if type(value) is not int or not low <= value <= MAX_COUNT:
            raise invalid(f"'{name}' must be a whole number from {low} to {MAX_COUNT}, not {str(value)[:50]!r}")
        return value

    def number(value: object, name: str, high: float = float("inf")) -> float:
        if type(value) not in (int, float) or not 0 <= value <= high:
            raise invalid(f"'{name}' must be a number from 0 to {high}, not {str(value)[:50]!r}")
        return value

    epoch = count("epoch")
    for name in ("step_in_epoch", "epochs_without_improvement", "skipped_steps", "skipped_steps_in_a_row"):
        count(name)
    processes = count("num_processes", low=1)
    step = count("global_step")
    if match := _NAME.match(path.name):
        if int(match.group(1)) != step:
            raise invalid(f"'global_step' is {step} but the folder is named for step {int(match.group(1))}")
    totals = data["epoch_totals"]
    if isinstance(totals, list) and len(totals) == 3 and not any(isinstance(t, list) for t in totals):
        totals = data["epoch_totals"] = [totals] + [[0.0] * 3] * (processes - 1)  # the sum of all, as once written
    if not isinstance(totals, list) or len(totals) not in (0, processes):
        raise invalid(f"'epoch_totals' must hold [loss sum, correct, images] for each of the {processes} processes")
    for process_totals in totals:
        if not isinstance(process_totals, list) or len(process_totals) != 3:
            raise invalid("'epoch_totals' must hold a list of 3 numbers for each process")
        for value in process_totals:
            number(value, "epoch_totals")
    number(data["epoch_train_seconds"], "epoch_train_seconds")
    if data.get("epoch_learning_rate") is not None:
        number(data["epoch_learning_rate"], "epoch_learning_rate")
    history = data["history"]
    if not isinstance(history, list) or len(history) != epoch:
        raise invalid(f"'history' must be a list of {epoch} epoch records")
    for index, record in enumerate(history, start=1):
        if not isinstance(record, dict) or record.get("epoch") != index:
            raise invalid(f"'history' entry {index} must be the record of epoch {index}")
        val_accuracy = record.get("val_accuracy", "missing")
        if val_accuracy is not None:  # None: a run without validation
            number(val_accuracy, f"history[{index}].val_accuracy", high=1)
    if not isinstance(data["config_fingerprint"], dict):
        raise invalid("'config_fingerprint' must be a mapping")
    best = data["best_checkpoint"]
    if all(record["val_accuracy"] is None for record in history):  # also before the first epoch's end
        if (best, data["best_epoch"], data["best_val_accuracy"]) != (None, None, None):
            raise invalid("a checkpoint without a validated epoch cannot name a best epoch")
    else:
        if not isinstance(best, str) or not _NAME.match(best):
            raise invalid(f"'best_checkpoint' must name a checkpoint folder, not {str(best)[:50]!r}")
        if not (path.parent / best / STATE_FILE).is_file():
            raise invalid(f"its best checkpoint '{best}' does not exist next to it")
        best_epoch = data["best_epoch"]
        if type(best_epoch) is not int or not 1 <= best_epoch <= epoch:
            raise invalid(f"'best_epoch' must be an epoch from 1 to {epoch}, not {str(best_epoch)[:50]!r}")
        number(data["best_val_accuracy"], "best_val_accuracy", high=1)
    return TrainerState(**data)


def check_checkpoint_files(
    accelerator: Accelerator, path: Path, state: TrainerState, ema: WeightAverage | None = None
) -> None:
    """Every file a resume reads must be there and load as plain data: the weights (safetensors), optimizer,
    scheduler, the RNG state of each process that saved it, and the GradScaler when this run has one. Pickled
    files are read with ``weights_only=True``, so a file whose unpickling would run code is refused."""

    def numbered(stem: str, count: int, suffix: str) -> list[str]:  # Accelerate's names: x, x_1, x_2, ...
        return [f"{stem}{f'_{i}' if i else ''}{suffix}" for i in range(count)]

    names = [
        *numbered("model", len(accelerator._models), ".safetensors"),
        *numbered("optimizer", len(accelerator._optimizers), ".bin"),
        *numbered("scheduler", len(accelerator._schedulers), ".bin"),
        *(f"random_states_{rank}.pkl" for rank in range(state.num_processes)),
    ]
    if accelerator.scaler is not None:
        names.append("scaler.pt")
    if ema is not None:
        names.append(EMA_FILE)
    for name in names:
        file = path / name
        if not file.is_file():
            raise InputError(f"checkpoint '{path}' is incomplete: {name} is missing; resume from another checkpoint")
        try:
            if name.endswith(".safetensors"):
                safetensors.torch.load_file(file)
            else:
                load_pickled(file, weights_only=True)
        except Exception as err:  # noqa: BLE001 - torch and safetensors raise many kinds for a bad file
            raise InputError(
                f"checkpoint '{path}': {name} cannot be read as plain tensors and numbers ({type(err).__name__}: "
                f"{one_line(err)[:200]}); it is damaged or unsafe, resume from another checkpoint"
            ) from None


def check_resume(path: Path, state: TrainerState, fingerprint: dict[str, Any], num_processes: int) -> None:
    """Refuse a checkpoint made with another config (see ``config_fingerprint``), or saved mid-epoch by another
    number of processes."""
    # A field added after the checkpoint was written ran with its default there.
    saved = {
        key: state.config_fingerprint.get(key, FIELDS[key].default if key in FIELDS else None) for key in fingerprint
    }
    differences = [
        f"{key}: checkpoint {saved[key]!r}, now {value!r}" for key, value in fingerprint.items() if saved[key] != value
    ]
    if differences:
        raise InputError(
            f"checkpoint '{path}' was made with a different config ({'; '.join(differences)}); "
            "resume with the original settings or start a new --output_dir"
        )
    if state.num_processes != num_processes and state.step_in_epoch:
        raise InputError(
            f"checkpoint '{path}' was saved mid-epoch by {state.num_processes} processes and cannot continue that "
            f"epoch with {num_processes}; resume it with {state.num_processes} processes, or resume an "
            "epoch-end checkpoint"
        )


def load_checkpoint(
    accelerator: Accelerator, path: Path, state: TrainerState, ema: WeightAverage | None = None
) -> None:
    """Restore everything ``save_checkpoint`` wrote into the prepared objects, after checking every file."""
    check_checkpoint_files(accelerator, path, state, ema)
    try:
        accelerator.load_state(str(path), load_kwargs={"weights_only": True})
        if ema is not None:
            load_ema(ema, path)
    except Exception as err:  # noqa: BLE001 - any failure here means the files are damaged
        raise InputError(
            f"checkpoint '{path}' cannot be loaded ({type(err).__name__}: {one_line(err)[:200]})"
        ) from None
