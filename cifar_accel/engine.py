"""The training step and evaluation, on objects prepared by an Accelerator; the loop around the step is
``train.train_epoch``."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader

from cifar_accel.progress import progress

if TYPE_CHECKING:
    import evaluate

Transform = Callable[[torch.Tensor], torch.Tensor]
# A training batch of images and class labels, the epoch (from 0) and the run's number of epochs -> (model inputs,
# loss targets), see transforms.TrainingTransform.
TrainTransform = Callable[[torch.Tensor, torch.Tensor, int, int], tuple[torch.Tensor, torch.Tensor]]
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def training_step(
    accelerator: Accelerator,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: LossFn,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    max_grad_norm: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One forward/backward/update; returns the (detached) loss and outputs, and on steps that update the
    weights the total gradient norm before clipping (else None).

    Autocast covers the forward pass and the loss, not the update. Accelerate scales the loss for fp16 in
    ``backward`` and unscales the gradients in ``clip_grad_norm_`` before measuring and clipping them (with no
    ``max_grad_norm`` the norm is only measured); call this inside ``accelerator.accumulate``.
    """
    with accelerator.autocast():
        outputs = model(inputs)
        loss = loss_fn(outputs, targets)
    accelerator.backward(loss)
    grad_norm = None
    if accelerator.sync_gradients:
        grad_norm = accelerator.clip_grad_norm_(
            model.parameters(), math.inf if max_grad_norm is None else max_grad_norm
        )
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach(), outputs.detach(), grad_norm


def progress_bar(batches: Iterable, accelerator: Accelerator, description: str) -> Iterable:
    """``batches`` with their progress on stdout (a live bar on a terminal, ten lines off one), on the main
    process of each machine."""
    return progress(batches, desc=description, show=accelerator.is_local_main_process)


def tta_logits(
    model: nn.Module, images: torch.Tensor, tta: str = "none", below_confidence: float = 1.0
) -> torch.Tensor:
    """The model's logits for ``images``, averaged over test-time augmentation views (as airbench94 does).

    ``flip``: the mean over the image and its mirror image. ``flip_translate``: half that, plus a quarter each
    of the same for the image shifted one pixel up-left and one pixel down-right (reflect padding). With
    ``below_confidence`` under 1, only the images whose plain prediction has a lower probability get the views;
    the others keep their plain logits.
    """
    check_tta(tta)
    return with_tta(model, images, model(images), tta, below_confidence)


def check_tta(tta: str) -> None:
    if tta not in ("none", "flip", "flip_translate"):
        raise ValueError(f"unknown test-time augmentation {tta!r}; use none, flip or flip_translate")


def with_tta(
    model: nn.Module, images: torch.Tensor, plain: torch.Tensor, tta: str, below_confidence: float = 1.0
) -> torch.Tensor:
    """``tta_logits`` of ``images`` given their plain logits ``plain``, which are the first view and are left as
    they are."""
    if tta == "none":
        return plain
    if below_confidence >= 1:
        return augmented_logits(model, images, plain, tta)
    logits = plain.clone()
    unsure = plain.float().softmax(1).amax(1) < below_confidence
    if unsure.any():
        logits[unsure] = augmented_logits(model, images[unsure], plain[unsure], tta).to(plain.dtype)
    return logits


def augmented_logits(model: nn.Module, images: torch.Tensor, plain: torch.Tensor, tta: str) -> torch.Tensor:
    """``tta_logits`` for every image, given their plain logits ``plain`` (the first view)."""
    mirrored = 0.5 * (plain + model(images.flip(3)))
    if tta == "flip":
        return mirrored

    def with_mirror(views: torch.Tensor) -> torch.Tensor:
        return 0.5 * (model(views) + model(views.flip(3)))

    padded = F.pad(images, (1, 1, 1, 1), mode="reflect")
    shifted = (padded[:, :, :-2, :-2], padded[:, :, 2:, 2:])
    return 0.5 * mirrored + 0.25 * (with_mirror(shifted[0]) + with_mirror(shifted[1]))


class Predictions(NamedTuple):
    """Per sample, in the loader's order: the predicted class (with test-time augmentation where asked), the
    class predicted without it, the true label, the loss and the probability of the predicted class."""

    classes: torch.Tensor
    plain_classes: torch.Tensor
    labels: torch.Tensor
    losses: torch.Tensor
    confidences: torch.Tensor


@torch.no_grad()
def predict(
    accelerator: Accelerator,
    model: nn.Module,
    loader: DataLoader,
    transform: Transform,
    tta: str = "none",
    below_confidence: float = 1.0,
) -> Predictions:
    """Predictions of every sample, gathered from all processes in the loader's order, each sample once (``tta``
    and ``below_confidence``: see ``tta_logits``). One forward pass gives both the plain predictions and the
    first view of the augmented ones."""
    check_tta(tta)
    model.eval()
    gathered = []
    for images, labels in loader:
        with accelerator.autocast():
            inputs = transform(images)
            plain = model(inputs)
            logits = with_tta(model, inputs, plain, tta, below_confidence)
        losses = F.cross_entropy(logits.float(), labels, reduction="none")
        classes = logits.argmax(1)
        confidences = logits.float().softmax(1).gather(1, classes.unsqueeze(1)).squeeze(1)
        gathered.append(accelerator.gather_for_metrics((classes, plain.argmax(1), labels, losses, confidences)))
    return Predictions(*(torch.cat(parts) for parts in zip(*gathered, strict=True)))


def evaluate_model(
    accelerator: Accelerator,
    model: nn.Module,
    loader: DataLoader,
    transform: Transform,
    metric: evaluate.EvaluationModule,
    tta: str = "none",
    below_confidence: float = 1.0,
) -> dict[str, Any]:
    """Loss and accuracy over ``loader`` (with ``tta``, and without it as ``accuracy_no_tta``), each sample counted
    exactly once across processes, with the predictions, labels and confidences they come from."""
    found = predict(accelerator, model, loader, transform, tta, below_confidence)
    return {
        "loss": found.losses.mean().item(),
        "accuracy": metric.compute(predictions=found.classes, references=found.labels)["accuracy"],
        "accuracy_no_tta": metric.compute(predictions=found.plain_classes, references=found.labels)["accuracy"],
        "samples": len(found.labels),
        "predictions": found.classes,
        "references": found.labels,
        "confidences": found.confidences,
    }
