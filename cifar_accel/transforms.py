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


def random_crop(images: torch.Tensor, padding: int = 4) -> torch.Tensor:
    """Pad with zeros, then cut a randomly placed window of the original size out of each image."""
    n, c, h, w = images.shape
    padded = F.pad(images, (padding,) * 4).flatten(2)
    dy = torch.randint(0, 2 * padding + 1, (n, 1, 1), device=images.device)
    dx = torch.randint(0, 2 * padding + 1, (n, 1, 1), device=images.device)
    rows = dy + torch.arange(h, device=images.device).view(1, h, 1)
    cols = dx + torch.arange(w, device=images.device).view(1, 1, w)
    # One gather over the flattened padded images picks each window's pixels, every channel alike.
    index = (rows * (w + 2 * padding) + cols).view(n, 1, h * w).expand(n, c, h * w)
    return padded.gather(2, index).view(n, c, h, w)


def random_horizontal_flip(images: torch.Tensor, p: float = 0.5) -> torch.Tensor:
    flip = torch.rand(images.shape[0], 1, 1, 1, device=images.device) < p
    return torch.where(flip, images.flip(-1), images)


def _grayscale(images: torch.Tensor) -> torch.Tensor:
    r, g, b = images.unbind(1)
    return (0.2989 * r + 0.587 * g + 0.114 * b).unsqueeze(1)


def _blend(images: torch.Tensor, other: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    return (factor * images + (1 - factor) * other).clamp(0, 1)


def _rgb_to_hsv(images: torch.Tensor) -> torch.Tensor:
    maxc, argmax = images.max(1, keepdim=True)  # ties go to the first channel, as in torchvision
    delta = maxc - images.amin(1, keepdim=True)
    saturation = delta / maxc.clamp(min=torch.finfo(images.dtype).tiny)
    # Hue from the channel that holds the maximum: (g - b), 2 + (b - r) or 4 + (r - g), over delta; 0 for greys.
    differences = images.roll(-1, 1) - images.roll(-2, 1)
    hue = differences.gather(1, argmax) / torch.where(delta == 0, 1.0, delta) + 2 * argmax
    return torch.cat(((hue / 6.0) % 1.0, saturation, maxc), 1)


def _hsv_to_rgb(images: torch.Tensor) -> torch.Tensor:
    hue, saturation, value = images.split(1, 1)
    # Each of r, g, b as v - v * s * clamp(min(k, 4 - k), 0, 1), with k = (5, 3, 1) + 6 * hue, modulo 6.
    k = (images.new_tensor([5.0, 3.0, 1.0]).view(1, 3, 1, 1) + 6.0 * hue) % 6.0
    return value - value * saturation * torch.minimum(k, 4.0 - k).clamp(0, 1)


def _adjust(images: torch.Tensor, op: int, factor: torch.Tensor) -> torch.Tensor:
    if op == 0:  # brightness
        return _blend(images, torch.zeros_like(images), factor)
    if op == 1:  # contrast
        return _blend(images, _grayscale(images).mean(dim=(1, 2, 3), keepdim=True), factor)
    if op == 2:  # saturation
        return _blend(images, _grayscale(images), factor)
    hsv = _rgb_to_hsv(images)  # hue
    hue = (hsv[:, 0:1] + factor) % 1.0
    return _hsv_to_rgb(torch.cat((hue, hsv[:, 1:]), 1))


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
    factors = torch.stack([torch.empty(n, device=images.device).uniform_(lo, hi) for lo, hi in low_high], 1).view(
        n, 4, 1, 1, 1
    )
    order = torch.rand(n, 4, device=images.device).argsort(1)
    for position in range(4):
        for op in range(4):
            idx = (order[:, position] == op).nonzero().squeeze(1)
            if idx.numel():
                images[idx] = _adjust(images[idx], op, factors[idx, op])
    return images


class BatchTransform:
    """uint8 (N, 3, H, W) batch -> normalised float batch, optionally with the training augmentation."""

    def __init__(self, augment: bool, channels_last: bool = False) -> None:
        self.augment = augment
        self.memory_format = torch.channels_last if channels_last else torch.contiguous_format

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        if self.augment:
            images = random_horizontal_flip(random_crop(images))
        images = images.float().div_(255)
        if self.augment:
            images = color_jitter(images, brightness=0.2, contrast=0.2, saturation=0.2, hue=0.1)
        mean = images.new_tensor(CIFAR10_MEAN).view(1, 3, 1, 1)
        std = images.new_tensor(CIFAR10_STD).view(1, 3, 1, 1)
        return ((images - mean) / std).contiguous(memory_format=self.memory_format)
