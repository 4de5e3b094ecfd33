"""A trained model for evaluation, prediction and notebooks: safetensors weights plus the run's own config.

from cifar_accel import load_model
classifier = load_model("outputs/cifar10")         # a run folder, a checkpoint or a .safetensors file
classifier.predict([Image.open("cat.png")])        # [[('cat', 0.91)]]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import typing
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import safetensors.torch
import torch
from PIL import Image
from safetensors import SafetensorError
from torch import nn

from cifar_accel.averaging import EMA_FILE
from cifar_accel.checkpoint import STATE_FILE, checkpoints_within, validated_weights
from cifar_accel.config import (
    TestTimeAugmentation,
    TrainConfig,
    check_acts,
    check_field,
    check_launcher_environment,
    launcher_precision,
    looks_like_path,
    read_config_file,
    resolve_mixed_precision,
)
from cifar_accel.engine import tta_logits
from cifar_accel.errors import InputError, one_line, path_problem
from cifar_accel.images import GIT_LFS_FIX, IMAGE_SIZE, git_lfs_pointer, image_to_rgb32, to_rgb32
from cifar_accel.models import build_model
from cifar_accel.outputs import (
    CONFIG_FILE,
    LABELS_FILE,
    PREPROCESSING_FILE,
    REPLACED_RUN,
    WEIGHTS_FILE,
    set_aside_note,
)
from cifar_accel.transforms import (
    CIFAR10_NORMALIZATION,
    BatchTransform,
    Normalization,
    normalized_by_cifar10_constants,
)

EXPECTED_IMAGES = (
    "a non-empty list of PIL images or image files, or a uint8 tensor of shape (N, 3, 32, 32) or (3, 32, 32)"
)
# What as_batch, probabilities and predict take: PIL images and image files (paths), or a uint8 tensor.
IMAGE_TYPES = (Image.Image, str, os.PathLike)
Images = Sequence[Image.Image | str | os.PathLike] | torch.Tensor


@dataclass
class TrainedModel:
    """The network in eval mode, its preprocessing (uint8 batch -> normalised float batch, as the run evaluated)
    and the class names, with the run's config and where the weights came from."""

    model: nn.Module
    preprocess: BatchTransform
    class_names: list[str]
    config: TrainConfig
    weights: Path

    def as_batch(self, images: Images) -> torch.Tensor:
        """PIL images and image files (any mode and size, converted as training images are, a file as ``predict``
        reads it) or a uint8 tensor of shape (N, 3, 32, 32) or (3, 32, 32), as one uint8 batch on the model's
        device. Anything else is a ValueError that names what is expected; a file that cannot be read raises as
        opening it would."""
        if isinstance(images, torch.Tensor):
            batch = images.unsqueeze(0) if images.dim() == 3 else images
            if batch.dtype != torch.uint8 or batch.dim() != 4 or tuple(batch.shape[1:]) != (3, IMAGE_SIZE, IMAGE_SIZE):
                raise ValueError(f"expected {EXPECTED_IMAGES}, got {batch.dtype} of shape {tuple(images.shape)}")
            if not len(batch):
                raise ValueError(f"expected {EXPECTED_IMAGES}, got an empty tensor")
        elif isinstance(images, (list, tuple)) and images and all(isinstance(i, IMAGE_TYPES) for i in images):
            arrays = [image_to_rgb32(i)[0] if isinstance(i, Image.Image) else to_rgb32(i)[0] for i in images]
            batch = torch.stack([torch.tensor(array) for array in arrays])
        elif isinstance(images, (list, tuple)):
            kinds = sorted({type(image).__name__ for image in images})
            got = f"a list of {', '.join(kinds)}" if kinds else "an empty list"
            raise ValueError(f"expected {EXPECTED_IMAGES}, got {got}")
        else:
            raise ValueError(f"expected {EXPECTED_IMAGES}, got {type(images).__name__}")
        return batch.to(next(self.model.parameters()).device)

    @torch.no_grad()
    def probabilities(self, images: Images, tta: str = "none", tta_below_confidence: float = 1.0) -> torch.Tensor:
        """Class probabilities, (N, classes) float32 on the CPU, with test-time augmentation ``tta`` if asked (only
        for the images whose plain prediction is less sure than ``tta_below_confidence``, where that is under 1).

        The network sees the images in batches of the run's --per_device_eval_batch_size, so that its activations
        take the memory of one such batch however many images are given."""
        if tta not in typing.get_args(TestTimeAugmentation):
            raise ValueError(f"tta must be one of {', '.join(typing.get_args(TestTimeAugmentation))}, not {tta!r}")
        if not 0 < tta_below_confidence <= 1:
            raise ValueError(f"tta_below_confidence must be above 0 and at most 1, not {tta_below_confidence!r}")
        if tta == "none" and tta_below_confidence != 1:
            raise ValueError("tta_below_confidence has no effect unless tta is 'flip' or 'flip_translate'")
        batches = self.as_batch(images).split(self.config.per_device_eval_batch_size)
        return torch.cat(
            [
                tta_logits(self.model, self.preprocess(batch), tta, tta_below_confidence).float().softmax(1).cpu()
                for batch in batches
            ]
        )

    def predict(
        self,
        images: Images,
        top_k: int = 1,
        tta: str = "none",
        tta_below_confidence: float = 1.0,
    ) -> list[list[tuple[str, float]]]:
        """For each image, its ``top_k`` classes (at least 1) with their probabilities, most likely first."""
        if type(top_k) is not int or top_k < 1:
            raise ValueError(f"top_k must be a whole number of at least 1, not {top_k!r}")
        top = self.probabilities(images, tta, tta_below_confidence).topk(min(top_k, len(self.class_names)), dim=1)
        return [
            [(self.class_names[i], float(p)) for p, i in zip(scores, indices, strict=True)]
            for scores, indices in zip(top.values, top.indices, strict=True)
        ]


def add_tta_flags(parser: argparse.ArgumentParser) -> None:
    """evaluate's and predict's test-time augmentation flags; a run's config.yaml holds those its final test used."""
    parser.add_argument(
        "--tta",
        choices=typing.get_args(TestTimeAugmentation),
        default="none",
        help="Test-time augmentation: none (default), flip, or flip_translate.",
    )
    parser.add_argument(
        "--tta_below_confidence",
        type=float,
        default=1.0,
        help="Apply --tta only to the images whose plain prediction has a probability below this (default: 1, "
        "every image).",
    )


def check_tta_flags(args: argparse.Namespace) -> None:
    """evaluate's and predict's --tta_below_confidence: within training's bounds, and refused without a --tta that
    it would choose the images of, as training refuses it."""
    check_field("tta_below_confidence", args.tta_below_confidence, "--tta_below_confidence")
    if args.tta_below_confidence != 1:
        check_acts("tta_below_confidence", vars(args), {"tta": "--tta"})


def inference_precision(flag: str | None, trained: TrainedModel) -> tuple[str, bool]:
    """The precision evaluate and predict run ``trained`` in: --mixed_precision (``flag``), else accelerate launch's
    (other than its default 'no'), else the run's own, in which its test accuracy was measured; and whether it was
    asked for (by the flag or the launcher), which a device without it is worth a warning for. A GPU run's fp16 is
    not: on a CPU its model runs in fp32, as a run there would. A launcher's DeepSpeed, or a rank outside its
    processes, is refused, as for training."""
    check_launcher_environment()
    precision, source = resolve_mixed_precision(flag, launcher_precision(), trained.config.mixed_precision)
    return precision, source != "config file"


def find_run_dir(weights: Path) -> Path:
    """The run folder that holds ``config.yaml``: the weights' folder, or the run above a checkpoint."""
    for folder in (weights.parent, weights.parent.parent, weights.parent.parent.parent):
        if (folder / CONFIG_FILE).is_file() and (folder / LABELS_FILE).is_file():
            return folder
    raise InputError(
        f"no {CONFIG_FILE} and {LABELS_FILE} found for {weights}; pass a run's output folder, its {WEIGHTS_FILE}, "
        "or one of its checkpoints"
    )


def in_checkpoint(weights: Path) -> bool:
    """Whether ``weights`` is a file in a checkpoint folder."""
    return (weights.parent / STATE_FILE).is_file()


def output_beside(weights: Path, name: str) -> Path:
    """Where an output called ``name`` (a file or folder) of ``weights`` goes by default: beside them, or for a
    checkpoint's, in its run folder with the checkpoint's name added, since a checkpoint folder is deleted when
    newer checkpoints replace it (``eval_test`` -> ``<run>/eval_test_step_00000016``)."""
    if not in_checkpoint(weights):
        return weights.parent / name
    path = Path(name)
    return find_run_dir(weights) / f"{path.stem}_{weights.parent.name}{path.suffix}"


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


def read_normalization(run_dir: Path, config: TrainConfig, class_names: list[str]) -> Normalization:
    """The input normalisation a run of ``config`` and ``class_names`` trained with (preprocessing.json). Without
    the file, CIFAR-10's constants where the run took them, as a run written before the file existed did; statistics
    of its data, which only the file holds, refused in one line, as a damaged file is."""
    path = run_dir / PREPROCESSING_FILE
    if not path.exists():
        if normalized_by_cifar10_constants(config.normalization, class_names):
            return CIFAR10_NORMALIZATION
        raise InputError(
            f"{path} is missing: the run normalised its inputs by statistics of its training images, which it wrote "
            "there and nowhere else; copy it back from another copy of the run, or train again"
        )
    try:
        return Normalization.from_dict(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise InputError(
            f"{path} cannot be read ({type(err).__name__}: {one_line(err)[:200]}); it must hold the 'mean', 'std' "
            "and 'source' the training run wrote"
        ) from None


def dataset_to_read(given: str | None, trained: TrainedModel, flag: str) -> str:
    """The dataset evaluate or export reads: the one ``flag`` names, else the run's own, from its config.yaml; a
    local copy that is not where the run found it any more is refused with the flag that names its new place."""
    if given:
        return given
    name = trained.config.dataset_name
    if looks_like_path(name) and not Path(name).expanduser().exists():
        raise InputError(
            f"the run's dataset, '{name}' (in its config.yaml), is not there any more; pass {flag} with where it is now"
        )
    return name


def hub_model_note(name: str) -> str | None:
    """For a --model that does not exist here but may name a model on the Hugging Face Hub (where --push_to_hub
    uploads a run), by its web address or as 'owner/name' (whose owner is no folder here), how to read it: from a
    local copy. None for anything else."""
    address = re.fullmatch(r"https?://(?:www\.)?huggingface\.co/([\w.-]+/[\w.-]+)(?:/tree/[^/]+)?/?", name)
    repo = address[1] if address else name
    if not re.fullmatch(r"[\w-][\w.-]*/[\w.-]+", repo) or repo.endswith(".safetensors") or Path(repo).parent.exists():
        return None
    download = f"`hf download {repo} --local-dir {repo.split('/')[1]}`, then pass that folder"
    if address:
        return f"a model on the Hugging Face Hub is read from a local copy: download it with {download}"
    return f"no such folder here; if it names a model on the Hugging Face Hub, download it first with {download}"


def load_model(path: str | Path) -> TrainedModel:
    """The trained model of a run folder, a checkpoint folder or a .safetensors file inside either: the run's
    architecture with its weights (safetensors only), in eval mode, with its preprocessing and class names. A
    checkpoint gives the weights its validation measured: their average, in a run with --ema_decay."""
    given, path = str(path), Path(path).expanduser()
    if problem := path_problem(str(path)):
        raise InputError(f"the path {problem}")
    weights = path / WEIGHTS_FILE if path.is_dir() else path
    if not path.exists() and (note := hub_model_note(given)):
        raise InputError(f"no model at '{given}': {note}")
    if not weights.is_file():
        aside = f"; {set_aside_note(path)}" if (path / REPLACED_RUN).is_dir() else ""
        checkpoints = checkpoints_within(path)
        if checkpoints:  # a run still training, or stopped before its end
            aside += f"; its newest checkpoint is {checkpoints[-1]}"
        raise InputError(
            f"no model weights at '{weights}'{aside}; pass a run folder, a checkpoint folder or a .safetensors"
        )
    if weights.suffix != ".safetensors":
        folder = f"; pass the run folder it is in, {weights.parent}" if (weights.parent / CONFIG_FILE).is_file() else ""
        raise InputError(f"'{weights}' is not a .safetensors file; only safetensors weights are loaded{folder}")
    run_dir = find_run_dir(weights)
    config = TrainConfig(**read_config_file(run_dir / CONFIG_FILE))
    class_names = read_class_names(run_dir / LABELS_FILE)
    model = build_model(config.model_name, num_classes=len(class_names))
    if config.channels_last:  # the layout the run evaluated with, so results match it exactly
        model = model.to(memory_format=torch.channels_last)
    in_own_checkpoint = weights.name in (WEIGHTS_FILE, EMA_FILE) and in_checkpoint(weights)
    try:
        state = validated_weights(weights.parent) if in_own_checkpoint else safetensors.torch.load_file(weights)
    except (SafetensorError, OSError) as err:
        if git_lfs_pointer(weights):  # a model repository cloned without git-lfs
            raise InputError(f"'{weights}' is a Git LFS pointer, not the weights; {GIT_LFS_FIX}") from None
        raise InputError(
            f"'{weights}' cannot be read as safetensors weights, damaged or cut short ({one_line(err)[:300]}); "
            "pass an intact copy, or a checkpoint folder of the run"
        ) from None
    try:
        model.load_state_dict(state)
    except RuntimeError as err:
        raise InputError(
            f"weights in '{weights}' do not fit model '{config.model_name}' with {len(class_names)} classes "
            f"({one_line(err)[:300]})"
        ) from None
    preprocess = BatchTransform(read_normalization(run_dir, config, class_names), channels_last=config.channels_last)
    return TrainedModel(model.eval(), preprocess, class_names, config, weights)
