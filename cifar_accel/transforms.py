"""Batch transforms on uint8 image tensors: the training augmentation, done on whole batches.

Each image in a batch gets its own random crop offset, flip, colour-jitter
factors and brightness and contrast, drawn from the global torch RNG (seeded by ``set_seed`` and saved in
checkpoints). The chapter's recipe has the same distributions as torchvision's
``RandomCrop(32, padding=4)``, ``RandomHorizontalFlip()`` and
``ColorJitter(0.2, 0.2, 0.2, 0.1)``. No per-image Python runs in the hot path.
MixUp and CutMix come from ``torchvision.transforms.v2``, which draws from the
same RNG.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from cifar_accel.config import TrainConfig

# Per-channel mean and standard deviation of the CIFAR-10 training images.
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)
# ColorJitter's four colour ops, numbered as the columns of its random factors.
BRIGHTNESS, CONTRAST, SATURATION, HUE = range(4)
GRAY_WEIGHTS = (0.2989, 0.587, 0.114)  # of red, green and blue in torchvision's rgb_to_grayscale


@dataclass(frozen=True)
class Normalization:
    """The per-channel mean and standard deviation (of pixel values scaled to [0, 1]) that model inputs are
    normalised with, and where they come from; a run saves them (preprocessing.json) and every use of its model
    applies the same."""

    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    source: str

    def to_dict(self) -> dict:
        """As preprocessing.json states it, with the model's input and the formula."""
        return {
            "input": "RGB images as uint8, shape (N, 3, 32, 32)",
            "formula": "(pixels / 255 - mean) / std, per channel",
            "mean": list(self.mean),
            "std": list(self.std),
            "source": self.source,
        }

    @classmethod
    def from_dict(cls, values: dict) -> Normalization:
        """The statistics of a ``to_dict`` dict; a KeyError, TypeError or ValueError where it does not hold them."""
        mean, std = (tuple(float(x) for x in values[key]) for key in ("mean", "std"))
        if len(mean) != 3 or len(std) != 3 or not all(math.isfinite(x) and x > 0 for x in std):
            raise ValueError("'mean' and 'std' must be 3 numbers each, every std finite and above 0")
        return cls(mean, std, str(values["source"]))


CIFAR10_NORMALIZATION = Normalization(CIFAR10_MEAN, CIFAR10_STD, "CIFAR-10's published constants")
CIFAR10_CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]


def normalized_by_cifar10_constants(normalization: str, class_names: list[str]) -> bool:
    """Whether ``--normalization`` takes CIFAR-10's constants for a dataset of these classes (``auto``: for
    CIFAR-10's own), rather than statistics computed from its training split."""
    return normalization == "cifar10" or (normalization == "auto" and class_names == CIFAR10_CLASSES)


def random_crop_and_flip(
    images: torch.Tensor, padding: int = 4, flip: bool = True, padding_mode: str = "zeros", size: int = 0
) -> torch.Tensor:
    """Pad by ``padding`` pixels (zeros, or the image's reflection), cut a randomly placed window of the original
    size (or ``size`` x ``size``) out of each image, and, with ``flip``, mirror it left-right with probability 1/2."""
    n, c, h, w = images.shape
    out_h, out_w = (size, size) if size else (h, w)
    dy = torch.randint(0, h + 2 * padding - out_h + 1, (n, 1, 1), device=images.device)
    dx = torch.randint(0, w + 2 * padding - out_w + 1, (n, 1, 1), device=images.device)
    rows = dy + torch.arange(out_h, device=images.device).view(1, out_h, 1)
    cols = dx + torch.arange(out_w, device=images.device)
    if flip:  # a mirrored window reads its columns right to left
        mirrored = torch.rand(n, 1, 1, device=images.device) < 0.5
        cols = torch.where(mirrored, cols.flip(-1), cols)
    if padding_mode == "reflect":  # no padded copy: the window's coordinates are reflected into the image
        source, width = images.flatten(2), w
        rows, cols = _reflect(rows - padding, h), _reflect(cols - padding, w)
    else:
        source, width = F.pad(images, (padding,) * 4).flatten(2), w + 2 * padding
    # One gather over the flattened images picks each window's pixels, every channel alike.
    index = (rows * width + cols).view(n, 1, out_h * out_w).expand(n, c, out_h * out_w)
    return source.gather(2, index).view(n, c, out_h, out_w)


def _reflect(coordinates: torch.Tensor, size: int) -> torch.Tensor:
    """Coordinates up to ``size - 1`` outside 0..size-1 mirrored back inside, as reflect padding does it (the edge
    pixel itself is not repeated)."""
    return (size - 1) - ((size - 1) - coordinates.abs()).abs()


def _grayscale(images: torch.Tensor) -> torch.Tensor:
    """torchvision's rgb_to_grayscale: 0.2989 r + 0.587 g + 0.114 b, the products made in one pass."""
    r, g, b = (images * images.new_tensor(GRAY_WEIGHTS).view(1, 3, 1, 1)).unbind(1)
    return (r + g + b).unsqueeze(1)


def _shift_hue(images: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """torchvision's adjust_hue: to HSV, turn the hue by ``shift`` (a fraction of the circle), back to RGB.

    Only branch-free arithmetic kernels: torch.where's CPU kernel branches on every element and % runs fmod, which
    made them the slowest part of the default recipe's input pipeline. Both replacements are exact: a lerp whose
    weight is 0 or 1 returns one of its ends, and the remainder's range is known (see below).
    """
    r, g, b = images[:, 0:1], images[:, 1:2], images[:, 2:3]
    value = torch.maximum(torch.maximum(r, g), b)
    delta = value - torch.minimum(torch.minimum(r, g), b)
    # Hue in sixths of the circle, from the channel that holds the maximum (red, then green, on ties); 0 for greys.
    # sign(x - value) + 1 is 1 where x is the maximum and 0 elsewhere.
    is_red, is_green = (r - value).sign_().add_(1), (g - value).sign_().add_(1)
    hue = torch.lerp(torch.lerp(4 * delta + r - g, 2 * delta + b - r, is_green), g - b, is_red)
    hue = (hue / delta).nan_to_num_(0.0) + 6 * shift  # 0 / 0 for greys
    # Back to RGB: each channel is v - v * s * clamp(min(k, 4 - k), 0, 1) with k = (5, 3, 1) + hue, modulo 6,
    # and v * s is delta. k lies in [-0.6, 10.6], where k - 6 * floor(k / 6) is k % 6 bit for bit.
    k = images.new_tensor([5.0, 3.0, 1.0]).view(1, 3, 1, 1) + hue
    k -= 6 * (k / 6).floor_()
    return value - delta * torch.minimum(k, 4 - k).clamp_(0, 1)


def _blend_(images: torch.Tensor, ops: torch.Tensor, factors: torch.Tensor) -> None:
    """Each image's BRIGHTNESS, CONTRAST or SATURATION (``ops``, one per image) with its factor in its row of
    ``factors`` (one column per op), as torchvision's ``adjust_*`` functions do it: a blend of the image with a base
    (black, its mean grey, its greyscale), all in one pass, written over ``images``."""
    n = images.shape[0]
    factor = factors.gather(1, ops.view(n, 1)).view(n, 1, 1, 1)
    ops = ops.view(n, 1, 1, 1)
    gray = _grayscale(images)
    base = torch.addcmul((ops == CONTRAST) * gray.mean(dim=(1, 2, 3), keepdim=True), gray, ops == SATURATION)
    torch.lerp(base, images, factor, out=images).clamp_(0, 1)


def color_jitter(
    images: torch.Tensor, brightness: float, contrast: float, saturation: float, hue: float
) -> torch.Tensor:
    """torchvision's ColorJitter per image: random factors, applied in a random order per image.

    Every image gets one hue turn, somewhere in its order, and three blends. With the images sorted by the position
    of their hue turn, the blends before it fall on a tail of the batch at each position, the turn is one call for
    the whole batch, and the blends after it fall on a head of the batch; no image is touched by an op it does not
    get.
    """
    n = images.shape[0]
    low_high = [
        (1 - brightness, 1 + brightness),
        (1 - contrast, 1 + contrast),
        (1 - saturation, 1 + saturation),
        (-hue, hue),
    ]
    factors = torch.stack([torch.empty(n, device=images.device).uniform_(lo, hi) for lo, hi in low_high], 1)
    order = torch.rand(n, 4, device=images.device).argsort(1)
    hue_at, by_hue_at = (order == HUE).int().argmax(1).sort(stable=True)
    images = images.index_select(0, by_hue_at)
    order, factors = order[by_hue_at], factors[by_hue_at]
    # Images starts[p] to starts[p + 1] - 1 have their hue turn at position p.
    starts = [0, *hue_at.bincount(minlength=4).cumsum(0).tolist()]
    for position in range(3):  # the blends of the images whose hue turn comes later
        later = slice(starts[position + 1], n)
        _blend_(images[later], order[later, position], factors[later])
    images = _shift_hue(images, factors[:, HUE].view(n, 1, 1, 1))
    for step in range(1, 4):  # the blends `step` places after the turn, of the images that have them
        earlier = slice(0, starts[4 - step])
        ops = order[earlier].gather(1, (hue_at[earlier] + step).view(-1, 1)).view(-1)
        _blend_(images[earlier], ops, factors[earlier])
    return images.index_select(0, by_hue_at.argsort())


def brightness_and_contrast(images: torch.Tensor, shift: float, scale: float) -> torch.Tensor:
    """hiverge/cifar10-speedrun's jitter of normalised images: each image plus b, times c, with b uniform in
    [-shift, shift] and c uniform in [1 - scale, 1 + scale], drawn per image."""
    n = images.shape[0]
    brightness = torch.empty(n, 1, 1, 1, device=images.device).uniform_(-shift, shift)
    contrast = torch.empty(n, 1, 1, 1, device=images.device).uniform_(1 - scale, 1 + scale)
    return (images + brightness) * contrast


class BatchTransform:
    """uint8 (N, 3, H, W) batch -> float batch normalised by ``normalization``, optionally with the training
    augmentation: a random translation by up to ``padding`` pixels (or a random window of ``size`` x ``size``
    pixels of the padded images), a random flip, colour jitter (the chapter's recipe by default), and a brightness
    shift and contrast scale of the normalised images."""

    def __init__(
        self,
        normalization: Normalization,
        augment: bool = False,
        channels_last: bool = False,
        padding: int = 4,
        padding_mode: str = "zeros",
        flip: bool = True,
        color_jitter: bool = True,
        brightness_shift: float = 0.0,
        contrast_scale: float = 0.0,
    ) -> None:
        self.normalization, self.augment = normalization, augment
        self.memory_format = torch.channels_last if channels_last else torch.contiguous_format
        self.padding, self.padding_mode, self.flip, self.color_jitter = padding, padding_mode, flip, color_jitter
        self.brightness_shift, self.contrast_scale = brightness_shift, contrast_scale

    def __call__(self, images: torch.Tensor, size: int = 0) -> torch.Tensor:
        if self.augment and (self.padding or self.flip or size):
            images = random_crop_and_flip(images, self.padding, self.flip, self.padding_mode, size)
        images = images.float().div_(255)
        if self.augment and self.color_jitter:
            images = color_jitter(images, brightness=0.2, contrast=0.2, saturation=0.2, hue=0.1)
        mean = images.new_tensor(self.normalization.mean).view(1, 3, 1, 1)
        std = images.new_tensor(self.normalization.std).view(1, 3, 1, 1)
        images = (images - mean) / std
        if self.augment and (self.brightness_shift or self.contrast_scale):
            images = brightness_and_contrast(images, self.brightness_shift, self.contrast_scale)
        return images.contiguous(memory_format=self.memory_format)


def windowed_epochs(early_crop_epochs: int, num_epochs: int) -> int:
    """How many of a run's first epochs train on --early_crop_size windows: --early_crop_epochs, but never the last
    epoch, which trains on whole images, the size the model is tested at (a preset's count also fits shorter runs)."""
    return min(early_crop_epochs, num_epochs - 1)


class TrainingTransform:
    """A training batch of uint8 images and class labels -> (model inputs, loss targets): the augmentation of
    ``config`` and, with --mixup_alpha or --cutmix_alpha, MixUp or CutMix, whose targets are mixed class
    probabilities; in the first --early_crop_epochs epochs (never the run's last), windows of --early_crop_size
    pixels. Alternating flips are the training data's (see ``data.TrainImages``), not drawn here."""

    def __init__(self, config: TrainConfig, num_classes: int, normalization: Normalization) -> None:
        self.augment = BatchTransform(
            normalization,
            config.augment,
            config.channels_last,
            config.crop_padding,
            config.padding_mode,
            flip=config.flip == "random",
            color_jitter=config.color_jitter,
            brightness_shift=config.brightness_shift,
            contrast_scale=config.contrast_scale,
        )
        self.early_crop_size, self.early_crop_epochs = config.early_crop_size, config.early_crop_epochs
        self.mix = None
        if config.augment and (config.mixup_alpha or config.cutmix_alpha):
            from torchvision.transforms import v2  # here, not at the top: it takes a second to import

            mixes = [
                mix(alpha=alpha, num_classes=num_classes)
                for mix, alpha in ((v2.MixUp, config.mixup_alpha), (v2.CutMix, config.cutmix_alpha))
                if alpha > 0
            ]
            self.mix = v2.RandomChoice(mixes) if len(mixes) > 1 else mixes[0]

    def __call__(
        self, images: torch.Tensor, labels: torch.Tensor, epoch: int, num_epochs: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        windowed = epoch < windowed_epochs(self.early_crop_epochs, num_epochs)
        inputs = self.augment(images, self.early_crop_size if windowed else 0)
        if self.mix is None:
            return inputs, labels
        return self.mix(inputs, labels)
