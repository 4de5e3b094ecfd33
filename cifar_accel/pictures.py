"""Pictures where they say more than numbers, in TensorBoard and in evaluate's output folder.

- ``train/augmentation``: at the start of a run, a batch of training images as stored (top half) and as the
  training step receives them, augmented (bottom half);
- ``test/confusion_matrix`` and ``test/per_class_accuracy`` at the end, as figures;
- ``test/confident_mistakes``: the test images misclassified with the highest confidence, with their true and
  predicted classes;
- the HParams panel: the config with the final test accuracy.

Figures need matplotlib (the ``plots`` extra); without it they are left out, and said so once.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.logging import get_logger
from torch.utils.tensorboard import SummaryWriter

from cifar_accel.errors import counted
from cifar_accel.plots import MISSING, class_labels, figure_text, pyplot
from cifar_accel.transforms import Normalization

logger = get_logger(__name__)

AUGMENTED_IMAGES = 32  # the batch shown at the start
MISTAKES = 24  # the confident mistakes shown at the end
LABELLED_CLASSES = 20  # up to this many classes, the figures write each count and accuracy in


def tensorboard_writer(accelerator: Accelerator) -> SummaryWriter | None:
    """The run's TensorBoard writer on the main process, or None (other processes, or TensorBoard not asked for)."""
    if not accelerator.is_main_process:
        return None
    return next((t.tracker for t in accelerator.trackers if t.name == "tensorboard"), None)


def to_unit_range(inputs: torch.Tensor, normalization: Normalization) -> torch.Tensor:
    """Normalised model inputs back to images in [0, 1], for display."""
    mean = inputs.new_tensor(normalization.mean).view(1, 3, 1, 1)
    std = inputs.new_tensor(normalization.std).view(1, 3, 1, 1)
    return (inputs.float() * std + mean).clamp(0, 1)


def augmentation_grid(
    originals: torch.Tensor, augmented: torch.Tensor, normalization: Normalization, zoom: int = 3
) -> torch.Tensor:
    """One (3, H, W) image: the originals (uint8) in the top rows, the augmented inputs (normalised) below, each
    pixel drawn ``zoom`` x ``zoom`` so that 32x32 images can be seen; smaller inputs (--early_crop_size) framed
    in white to the originals' size."""
    from torchvision.utils import make_grid  # here, not at the top: torchvision takes a second to import

    inputs = to_unit_range(augmented, normalization).cpu()
    rows, cols = (originals.shape[i] - inputs.shape[i] for i in (-2, -1))
    inputs = F.pad(inputs, (cols // 2, cols - cols // 2, rows // 2, rows - rows // 2), value=1.0)
    both = torch.cat((originals.float().cpu() / 255, inputs))
    return make_grid(F.interpolate(both, scale_factor=zoom, mode="nearest"), nrow=8, padding=4, pad_value=1.0)


def confusion_figure(confusion: list[list[int]], class_names: list[str], title: str) -> Any:
    """The confusion matrix, coloured by the fraction of each true class, with the counts written in (up to
    ``LABELLED_CLASSES`` classes; the figure grows with more)."""
    plt = pyplot()
    matrix = torch.tensor(confusion, dtype=torch.float64)
    fractions = matrix / matrix.sum(1, keepdim=True).clamp(min=1)
    classes = len(class_names)
    labelled = classes <= LABELLED_CLASSES
    size = 8 if labelled else min(24, 4 + classes * 0.16)
    fig, ax = plt.subplots(figsize=(size, size - 1), dpi=100)
    image = ax.imshow(fractions.numpy(), cmap="Blues", vmin=0, vmax=1)
    tick_size = 10 if labelled else 6
    labels = class_labels(class_names)
    ax.set_xticks(range(classes), labels, rotation=45 if labelled else 90, ha="right", fontsize=tick_size)
    ax.set_yticks(range(classes), labels, fontsize=tick_size)
    ax.set_xlabel("predicted class")
    ax.set_ylabel("true class")
    ax.set_title(figure_text(title))
    for i in range(classes if labelled else 0):
        for j in range(classes):
            ax.text(
                j,
                i,
                int(matrix[i, j]),
                ha="center",
                va="center",
                fontsize=7,
                color="white" if fractions[i, j] > 0.5 else "black",
            )
    fig.colorbar(image, ax=ax, label="fraction of the true class")
    fig.tight_layout()
    return fig


def per_class_figure(per_class: list[dict[str, Any]], title: str) -> Any:
    """Each class's accuracy as a bar, with the overall accuracy as a line."""
    plt = pyplot()
    names = class_labels([row["class"] for row in per_class])
    accuracies = [row["accuracy"] or 0.0 for row in per_class]
    overall = sum(row["correct"] for row in per_class) / max(1, sum(row["total"] for row in per_class))
    labelled = len(names) <= LABELLED_CLASSES
    fig, ax = plt.subplots(figsize=(8 if labelled else min(24, 2 + len(names) * 0.16), 4), dpi=100)
    ax.bar(range(len(names)), accuracies, tick_label=names, color="tab:blue")  # by position: names may repeat
    ax.axhline(overall, color="tab:red", linestyle="--", label=f"overall {overall:.4f}")
    for x, accuracy in enumerate(accuracies if labelled else []):
        ax.text(x, accuracy + 0.01, f"{accuracy:.2f}", ha="center", fontsize=8)
    ax.set_ylim(0, 1.08)
    ax.set_ylabel("accuracy")
    ax.set_title(title)
    ax.tick_params(axis="x", rotation=45 if labelled else 90, labelsize=10 if labelled else 6)
    ax.legend(loc="lower right")
    fig.tight_layout()
    return fig


def mistakes_figure(
    images: torch.Tensor, true: list[str], predicted: list[str], confidences: list[float], title: str
) -> Any:
    """A grid of misclassified images (uint8), each captioned with its true class and the predicted one: the images
    pasted into one picture, drawn on one set of axes (an axes per image took most of a second to lay out)."""
    plt = pyplot()
    columns, pad = 8, 2  # images in a row, and white pixels on either side of each
    n, _, height, width = images.shape
    rows = max(1, -(-n // columns))
    cell_width = width + 2 * pad
    caption = cell_width // 4  # white pixels above each image, for its two lines of caption
    cell_height = caption + height + pad
    grid = torch.full((rows * cell_height, columns * cell_width, 3), 255, dtype=torch.uint8)
    fig, ax = plt.subplots(figsize=(columns * 1.6, rows * 1.6 * cell_height / cell_width + 0.4), dpi=100)
    for index in range(n):
        top, left = index // columns * cell_height + caption, index % columns * cell_width + pad
        grid[top : top + height, left : left + width] = images[index].permute(1, 2, 0)
        label = f"{true[index]}\n-> {predicted[index]} {confidences[index]:.2f}"
        ax.text(left + width / 2, top - 1, label, ha="center", va="bottom", fontsize=7)
    ax.imshow(grid.numpy(), interpolation="nearest")
    ax.axis("off")
    ax.set_title(title)
    fig.tight_layout()
    return fig


def log_augmentation(
    writer: SummaryWriter, originals: torch.Tensor, augmented: torch.Tensor, normalization: Normalization
) -> None:
    writer.add_image("train/augmentation", augmentation_grid(originals, augmented, normalization), global_step=0)


def log_test_pictures(
    writer: SummaryWriter,
    report: dict[str, Any],
    test: dict[str, Any],
    images: torch.Tensor,
    class_names: list[str],
    step: int,
) -> bool:
    """The confusion matrix, per-class accuracy and confident mistakes of the final test; False without
    matplotlib."""
    plt = pyplot()
    if plt is None:
        logger.info(f"TensorBoard gets no test figures: {MISSING}")
        return False
    accuracy = report["accuracy"]
    figures = {
        "test/confusion_matrix": confusion_figure(report["confusion_matrix"], class_names, f"test: {accuracy:.4f}"),
        "test/per_class_accuracy": per_class_figure(report["per_class"], "test accuracy per class"),
    }
    predictions, references, confidences = (test[k].cpu() for k in ("predictions", "references", "confidences"))
    wrong = (predictions != references).nonzero().squeeze(1)
    worst = wrong[confidences[wrong].argsort(descending=True)[:MISTAKES]]
    labels = class_labels(class_names)
    figures["test/confident_mistakes"] = mistakes_figure(
        images[worst],
        [labels[i] for i in references[worst]],
        [labels[i] for i in predictions[worst]],
        confidences[worst].tolist(),
        f"the {len(worst)} most confident of {counted(len(wrong), 'mistake')}: true -> predicted",
    )
    for tag, figure in figures.items():
        writer.add_figure(tag, figure, global_step=step)  # closes the figure
    return True


def log_hparams(writer: SummaryWriter, hparams: dict[str, Any], metrics: dict[str, float]) -> None:
    """The config and the final metrics in TensorBoard's HParams panel, in the run's own folder."""
    values = {k: v if isinstance(v, bool | int | float | str) else str(v) for k, v in hparams.items()}
    writer.add_hparams(values, {f"hparam/{k}": v for k, v in metrics.items()}, run_name=".")
