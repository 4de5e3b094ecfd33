"""Load a trained model for evaluation or prediction: safetensors weights plus the run's own config."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import safetensors.torch
import torch
from safetensors import SafetensorError
from torch import nn

from cifar_accel.config import TrainConfig, read_config_file
from cifar_accel.data import LABELS_FILE
from cifar_accel.errors import InputError, one_line
from cifar_accel.models import build_model
from cifar_accel.outputs import WEIGHTS_FILE


@dataclass
class TrainedModel:
    model: nn.Module
    config: TrainConfig
    class_names: list[str]
    weights: Path


def find_run_dir(weights: Path) -> Path:
    """The run folder that holds ``config.yaml``: the weights' folder, or the run above a checkpoint."""
    for folder in (weights.parent, weights.parent.parent, weights.parent.parent.parent):
        if (folder / "config.yaml").is_file() and (folder / LABELS_FILE).is_file():
            return folder
    raise InputError(
        f"no config.yaml and {LABELS_FILE} found for {weights}; pass a run's output folder, its model.safetensors, "
        "or one of its checkpoints"
    )


def read_class_names(path: Path) -> list[str]:
    """The class names a run wrote to labels.json; a damaged file is refused in one line."""
    try:
        names = json.loads(path.read_text())["class_names"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise InputError(
            f"{path} cannot be read ({type(err).__name__}: {one_line(err)[:200]}); it must hold "
            '{"class_names": [...]} as the training run wrote it'
        ) from None
    if not isinstance(names, list) or not names or not all(isinstance(name, str) for name in names):
        raise InputError(f"{path}: 'class_names' must be a non-empty list of strings")
    return names


def load_trained_model(path: str | Path) -> TrainedModel:
    """Build the run's architecture and load its weights (safetensors only) from a run, checkpoint or file."""
    path = Path(path)
    weights = path / WEIGHTS_FILE if path.is_dir() else path
    if not weights.is_file():
        raise InputError(f"no model weights at '{weights}'; pass a run folder, a checkpoint folder or a .safetensors")
    if weights.suffix != ".safetensors":
        raise InputError(f"'{weights}' is not a .safetensors file; only safetensors weights are loaded")
    run_dir = find_run_dir(weights)
    config = TrainConfig(**read_config_file(run_dir / "config.yaml"))
    class_names = read_class_names(run_dir / LABELS_FILE)
    model = build_model(config.model_name, num_classes=len(class_names))
    if config.channels_last:  # the layout the run evaluated with, so results match it exactly
        model = model.to(memory_format=torch.channels_last)
    try:
        model.load_state_dict(safetensors.torch.load_file(weights))
    except (SafetensorError, RuntimeError, OSError) as err:
        raise InputError(
            f"weights in '{weights}' do not fit model '{config.model_name}' with {len(class_names)} classes "
            f"({one_line(err)[:300]})"
        ) from None
    return TrainedModel(model=model.eval(), config=config, class_names=class_names, weights=weights)
