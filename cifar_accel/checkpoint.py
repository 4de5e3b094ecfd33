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

from accelerate import Accelerator

from cifar_accel.config import FIELDS, TrainConfig
from cifar_accel.errors import InputError, RunFault

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
    epoch_totals: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])  # loss sum, correct, images so far
    epoch_train_seconds: float = 0.0  # training time of the current epoch so far
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
        """Close one epoch with its metrics; returns whether its validation accuracy is the best so far."""
        self.epoch = record["epoch"]
        self.step_in_epoch, self.epoch_totals, self.epoch_train_seconds = 0, [0.0, 0.0, 0.0], 0.0
        self.history.append(record)
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


def save_checkpoint(accelerator: Accelerator, output_dir: str | Path, state: TrainerState, keep: int) -> Path:
    """Save the full training state; keep the newest ``keep`` checkpoints and the best one."""
    final = checkpoint_dir(output_dir) / checkpoint_name(state.global_step)
    partial = final.with_name(PARTIAL_PREFIX + final.name)  # leftovers of killed runs go at start-up
    try:
        accelerator.save_state(str(partial))
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
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
        if final.exists():  # an epoch's end can fall on a step that was just saved mid-epoch
            shutil.rmtree(final)
        partial.rename(final)
        for old in complete_checkpoints(output_dir)[:-keep]:
            if old.name != state.best_checkpoint:
                shutil.rmtree(old)
    accelerator.wait_for_everyone()
    return final


def resolve_checkpoint(spec: str, output_dir: str | Path) -> Path:
    """The checkpoint folder named by ``--resume_from_checkpoint`` (a path, or 'latest')."""
    if spec == "latest":
        found = complete_checkpoints(output_dir)
        if not found:
            raise InputError(
                f"no complete checkpoint in {checkpoint_dir(output_dir)}; start without --resume_from_checkpoint"
            )
        return found[-1]
    path = Path(spec)
    if not path.is_dir():
        raise InputError(f"checkpoint '{spec}' does not exist; pass a checkpoint folder or 'latest'")
    if not (path / STATE_FILE).is_file():
        raise InputError(f"checkpoint '{spec}' is incomplete (no {STATE_FILE}); resume from another one or 'latest'")
    return path


def read_trainer_state(path: Path) -> TrainerState:
    try:
        return TrainerState(**json.loads((path / STATE_FILE).read_text()))
    except (ValueError, TypeError) as err:
        raise InputError(f"checkpoint '{path}' has an unreadable {STATE_FILE}: {err}") from None


def load_checkpoint(accelerator: Accelerator, path: Path, fingerprint: dict[str, Any]) -> TrainerState:
    """Check that ``path`` fits this run, then restore everything ``save_checkpoint`` wrote."""
    state = read_trainer_state(path)
    differences = [
        f"{key}: checkpoint {state.config_fingerprint.get(key)!r}, now {value!r}"
        for key, value in fingerprint.items()
        if state.config_fingerprint.get(key) != value
    ]
    if differences:
        raise InputError(
            f"checkpoint '{path}' was made with a different config ({'; '.join(differences)}); "
            "resume with the original settings or start a new --output_dir"
        )
    if state.num_processes != accelerator.num_processes and state.step_in_epoch:
        raise InputError(
            f"checkpoint '{path}' was saved mid-epoch by {state.num_processes} processes and cannot continue that "
            f"epoch with {accelerator.num_processes}; resume it with {state.num_processes} processes, or resume an "
            "epoch-end checkpoint"
        )
    try:
        accelerator.load_state(str(path))
    except Exception as err:  # noqa: BLE001 - any failure here means the files are damaged
        raise InputError(f"checkpoint '{path}' cannot be loaded ({type(err).__name__}: {err})") from None
    return state
