"""Checkpoints on top of ``accelerator.save_state`` / ``load_state``, with the trainer state as JSON.

A checkpoint is ``<output_dir>/checkpoints/epoch_NNNN/``: Accelerate's files
(model weights as safetensors, optimizer, scheduler, GradScaler, RNG states,
sampler) plus ``trainer_state.json``. It is written under a temporary name and
renamed when complete, so a folder with the final name is always whole.
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

from cifar_accel.config import TrainConfig
from cifar_accel.errors import InputError

STATE_FILE = "trainer_state.json"
_NAME = re.compile(r"^epoch_(\d{4,})$")

# Config fields a resumed run must share with the checkpoint: they change shapes,
# the data split or the precision, or the restored optimizer/scheduler would ignore them.
FINGERPRINT_FIELDS = (
    "dataset_name",
    "image_column_name",
    "label_column_name",
    "val_ratio",
    "max_train_samples",
    "seed",
    "model_name",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "learning_rate",
    "weight_decay",
    "lr_scheduler_type",
    "lr_step_size",
    "lr_gamma",
)


@dataclass
class TrainerState:
    """Progress of a run, saved as JSON in every checkpoint."""

    epoch: int = 0  # epochs completed
    global_step: int = 0  # optimizer steps taken
    best_val_accuracy: float | None = None
    best_epoch: int | None = None
    epochs_without_improvement: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)
    config_fingerprint: dict[str, Any] = field(default_factory=dict)


def config_fingerprint(config: TrainConfig, mixed_precision: str) -> dict[str, Any]:
    values = {name: getattr(config, name) for name in FINGERPRINT_FIELDS}
    return {**values, "mixed_precision": mixed_precision}


def checkpoint_dir(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def complete_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints in ``output_dir``, oldest first."""
    root = checkpoint_dir(output_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _NAME.match(p.name) and (p / STATE_FILE).is_file()]
    return sorted(found, key=lambda p: int(_NAME.match(p.name).group(1)))


def save_checkpoint(accelerator: Accelerator, output_dir: str | Path, state: TrainerState) -> Path:
    """Save the full training state for the end of ``state.epoch``; keep only the newest and the best."""
    root = checkpoint_dir(output_dir)
    final = root / f"epoch_{state.epoch:04d}"
    partial = root / f".partial-{final.name}"
    if accelerator.is_main_process and partial.exists():
        shutil.rmtree(partial)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(partial))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        (partial / STATE_FILE).write_text(json.dumps(dataclasses.asdict(state), indent=2))
        if final.exists():
            shutil.rmtree(final)
        partial.rename(final)
        keep = {final.name, f"epoch_{state.best_epoch:04d}"}
        for old in complete_checkpoints(output_dir):
            if old.name not in keep:
                shutil.rmtree(old)
    accelerator.wait_for_everyone()
    return final


def best_checkpoint(output_dir: str | Path, state: TrainerState) -> Path:
    return checkpoint_dir(output_dir) / f"epoch_{state.best_epoch:04d}"


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
        data = json.loads((path / STATE_FILE).read_text())
        return TrainerState(**data)
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
    try:
        accelerator.load_state(str(path))
    except Exception as err:  # noqa: BLE001 - any failure here means the files are damaged
        raise InputError(f"checkpoint '{path}' cannot be loaded ({type(err).__name__}: {err})") from None
    return state
