"""A trained model for evaluation, prediction and notebooks: safetensors weights plus the run's own config.

from cifar_accel import load_model
classifier = load_model("outputs/cifar10")         # a run folder, a checkpoint or a .safetensors file
classifier.predict([Image.open("cat.png")])        # [[('cat', 0.91)]]
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import safetensors.torch
import torch
from PIL import Image
from safetensors import SafetensorError
from torch import nn

from cifar_accel.config import TrainConfig, read_config_file
from cifar_accel.data import IMAGE_SIZE, LABELS_FILE, image_to_rgb32
from cifar_accel.engine import tta_logits
from cifar_accel.errors import InputError, one_line
from cifar_accel.models import build_model
from cifar_accel.outputs import WEIGHTS_FILE
from cifar_accel.transforms import BatchTransform


@dataclass
class TrainedModel:
    """The network in eval mode, its preprocessing (uint8 batch -> normalised float batch, as the run evaluated)
    and the class names, with the run's config and where the weights came from."""

    model: nn.Module
    preprocess: BatchTransform
    class_names: list[str]
    config: TrainConfig
    weights: Path

    def as_batch(self, images: Sequence[Image.Image] | torch.Tensor) -> torch.Tensor:
        """PIL images (any mode and size, converted as training images are) or a uint8 tensor of shape
        (N, 3, 32, 32) or (3, 32, 32), as one uint8 batch on the model's device."""
        if isinstance(images, torch.Tensor):
            batch = images.unsqueeze(0) if images.dim() == 3 else images
            if batch.dtype != torch.uint8 or batch.dim() != 4 or tuple(batch.shape[1:]) != (3, IMAGE_SIZE, IMAGE_SIZE):
                raise ValueError(
                    f"expected uint8 images of shape (N, 3, 32, 32), got {batch.dtype} {tuple(images.shape)}"
                )
        else:
            batch = torch.stack([torch.tensor(image_to_rgb32(image)[0]) for image in images])
        return batch.to(next(self.model.parameters()).device)

    @torch.no_grad()
    def probabilities(self, images: Sequence[Image.Image] | torch.Tensor, tta: str = "none") -> torch.Tensor:
        """Class probabilities, (N, classes) float32 on the CPU, with test-time augmentation ``tta`` if asked."""
        logits = tta_logits(self.model, self.preprocess(self.as_batch(images)), tta)
        return logits.float().softmax(1).cpu()

    def predict(
        self, images: Sequence[Image.Image] | torch.Tensor, top_k: int = 1, tta: str = "none"
    ) -> list[list[tuple[str, float]]]:
        """For each image, its ``top_k`` classes with their probabilities, most likely first."""
        top = self.probabilities(images, tta).topk(min(top_k, len(self.class_names)), dim=1)
        return [[(self.class_names[i], float(p)) for p, i in zip(scores, indices, strict=True)]
                for scores, indices in zip(top.values, top.indices, strict=True)]  # fmt: skip


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


def load_model(path: str | Path) -> TrainedModel:
    """The trained model of a run folder, a checkpoint folder or a .safetensors file inside either: the run's
    architecture with its weights (safetensors only), in eval mode, with its preprocessing and class names."""
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
    preprocess = BatchTransform(augment=False, channels_last=config.channels_last)
    return TrainedModel(model.eval(), preprocess, class_names, config, weights)
