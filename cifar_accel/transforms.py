"""Batch transforms on uint8 image tensors: the chapter's augmentation, done on whole batches.

Each image in a batch gets its own random crop offset, flip and colour-jitter
factors, drawn from the global torch RNG (seeded by ``set_seed`` and saved in
checkpoints), with the same distributions as torchvision's
``RandomCrop(32, padding=4)``, ``RandomHorizontalFlip()`` and
``ColorJitter(0.2, 0.2, 0.2, 0.1)``. No per-image Python runs in the hot path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Per-channel mean and standard deviation of the CIFAR-10 training images.
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)
# ColorJitter's four colour ops, numbered as the columns of its random factors.
BRIGHTNESS, CONTRAST, SATURATION, HUE = range(4)


def random_crop_and_flip(images: torch.Tensor, padding: int = 4, p: float = 0.5) -> torch.Tensor:
    """Pad with zeros, cut a randomly placed window of the original size out of each image, and mirror it
    left-right with probability ``p``."""
    n, c, h, w = images.shape
    padded = F.pad(images, (padding,) * 4).flatten(2)
    dy = torch.randint(0, 2 * padding + 1, (n, 1, 1), device=images.device)
    dx = torch.randint(0, 2 * padding + 1, (n, 1, 1), device=images.device)
    flip = torch.rand(n, 1, 1, device=images.device) < p
    rows = dy + torch.arange(h, device=images.device).view(1, h, 1)
    ramp = torch.arange(w, device=images.device)
    cols = dx + torch.where(flip, ramp.flip(0), ramp)  # a mirrored window reads its columns right to left
    # One gather over the flattened padded images picks each window's pixels, every channel alike.
    index = (rows * (w + 2 * padding) + cols).view(n, 1, h * w).expand(n, c, h * w)
    return padded.gather(2, index).view(n, c, h, w)


def _grayscale(images: torch.Tensor) -> torch.Tensor:
    r, g, b = images.unbind(1)
    return (0.2989 * r + 0.587 * g + 0.114 * b).unsqueeze(1)


def _shift_hue(images: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """torchvision's adjust_hue: to HSV, turn the hue by ``shift`` (a fraction of the circle), back to RGB."""
    r, g, b = images[:, 0:1], images[:, 1:2], images[:, 2:3]
    value = torch.maximum(torch.maximum(r, g), b)
    delta = value - torch.minimum(torch.minimum(r, g), b)
    # Hue in sixths of the circle, from the channel that holds the maximum (red, then green, on ties); 0 for greys.
    hue = torch.where(value == r, g - b, torch.where(value == g, 2 * delta + b - r, 4 * delta + r - g))
    hue = (hue / delta).nan_to_num_(0.0) + 6 * shift  # 0 / 0 for greys
    # Back to RGB: each channel is v - v * s * clamp(min(k, 4 - k), 0, 1) with k = (5, 3, 1) + hue, modulo 6,
    # and v * s is delta.
    k = (images.new_tensor([5.0, 3.0, 1.0]).view(1, 3, 1, 1) + hue) % 6
    return value - delta * torch.minimum(k, 4 - k).clamp_(0, 1)


def _adjust(images: torch.Tensor, ops: torch.Tensor, factors: torch.Tensor) -> torch.Tensor:
    """Each image's colour op (BRIGHTNESS, CONTRAST, SATURATION or HUE) with its own factor, as torchvision's
    ``adjust_*`` functions do it; ``ops`` and ``factors`` hold one value per image."""
    n = images.shape[0]
    ops, factors = ops.view(n, 1, 1, 1), factors.view(n, 1, 1, 1)
    # Brightness, contrast and saturation blend the image with a base (black, its mean grey, its greyscale), all
    # in one pass; the images whose op is hue get weight 1 there, so they pass through unchanged.
    gray = _grayscale(images)
    base = torch.addcmul((ops == CONTRAST) * gray.mean(dim=(1, 2, 3), keepdim=True), gray, ops == SATURATION)
    images = torch.lerp(base, images, torch.where(ops == HUE, 1.0, factors)).clamp_(0, 1)
    hue = (ops.view(n) == HUE).nonzero().squeeze(1)
    if hue.numel():
        images[hue] = _shift_hue(images[hue], factors[hue])
    return images


def color_jitter(
    images: torch.Tensor, brightness: float, contrast: float, saturation: float, hue: float
) -> torch.Tensor:
    """torchvision's ColorJitter per image: random factors, applied in a random order per image."""
    n = images.shape[0]
    low_high = [
        (1 - brightness, 1 + brightness),
        (1 - contrast, 1 + contrast),
        (1 - saturation, 1 + saturation),
        (-hue, hue),
    ]
    factors = torch.stack([torch.empty(n, device=images.device).uniform_(lo, hi) for lo, hi in low_high], 1)
    order = torch.rand(n, 4, device=images.device).argsort(1)
    for position in range(4):
        ops = order[:, position]
        images = _adjust(images, ops, factors.gather(1, ops.view(n, 1)))
    return images


class BatchTransform:
    """uint8 (N, 3, H, W) batch -> normalised float batch, optionally with the training augmentation."""

    def __init__(self, augment: bool, channels_last: bool = False) -> None:
        self.augment = augment
        self.memory_format = torch.channels_last if channels_last else torch.contiguous_format

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        if self.augment:
            images = random_crop_and_flip(images)
        images = images.float().div_(255)
        if self.augment:
            images = color_jitter(images, brightness=0.2, contrast=0.2, saturation=0.2, hue=0.1)
        mean = images.new_tensor(CIFAR10_MEAN).view(1, 3, 1, 1)
        std = images.new_tensor(CIFAR10_STD).view(1, 3, 1, 1)
        return ((images - mean) / std).contiguous(memory_format=self.memory_format)
