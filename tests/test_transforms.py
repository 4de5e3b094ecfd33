"""The batch augmentation matches torchvision's per-image transforms, op by op and in distribution."""

from __future__ import annotations

import datasets
import numpy as np
import pytest
import torch
import torchvision.transforms.functional as TF

from cifar_accel import transforms as T

from chapter_pipeline import CHAPTER_TRANSFORM
from conftest import CIFAR10_JPEG


@pytest.fixture
def images() -> torch.Tensor:
    images = torch.randint(0, 256, (16, 3, 32, 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    images[0] = 128  # grey: no hue, no saturation
    images[1, 1] = images[1, 0]  # red and green tie for the maximum
    return images


def test_each_image_gets_its_own_colour_op_as_torchvision_does_it(images):
    """One call applies each image's op with its factor; the grey and the tie images get every op in turn."""
    reference = {T.BRIGHTNESS: TF.adjust_brightness, T.CONTRAST: TF.adjust_contrast,
                 T.SATURATION: TF.adjust_saturation, T.HUE: TF.adjust_hue}  # fmt: skip
    factors = {T.BRIGHTNESS: 1.15, T.CONTRAST: 0.85, T.SATURATION: 1.2, T.HUE: -0.09}
    x = images.float() / 255
    for shift in range(4):
        ops = (torch.arange(16) + shift) % 4
        op_factors = torch.tensor([factors[op] for op in ops.tolist()])
        op_factors[ops == T.HUE] *= torch.tensor([1.0, -0.8, 0.5, -1.1])  # both directions of the hue shift
        ours = T._adjust(x, ops, op_factors)
        theirs = torch.stack(
            [reference[op](img, f) for img, op, f in zip(x, ops.tolist(), op_factors.tolist(), strict=True)]
        )
        assert torch.allclose(ours, theirs, atol=2e-5)


def test_each_crop_is_a_window_of_the_zero_padded_image_mirrored_or_not(images):
    torch.manual_seed(0)
    cropped = T.random_crop_and_flip(images)
    padded = torch.nn.functional.pad(images, (4, 4, 4, 4))
    mirrored = 0
    for img, out in zip(padded, cropped, strict=True):
        windows = [img[:, dy : dy + 32, dx : dx + 32] for dy in range(9) for dx in range(9)]
        straight = any(torch.equal(window, out) for window in windows)
        flipped = any(torch.equal(window.flip(-1), out) for window in windows)
        assert straight or flipped
        mirrored += flipped and not straight
    assert 0 < mirrored < len(images)


def test_crop_offsets_and_flips_have_torchvisions_distribution():
    """A marker in the top-left pixel shows each image's crop offset and flip.

    RandomCrop(32, padding=4) draws both offsets uniformly from 0..8, so the marker stays visible when both are
    <= 4, with probability (5/9)^2, landing uniformly on rows 0..4; RandomHorizontalFlip mirrors half of them.
    """
    torch.manual_seed(0)
    marker = torch.zeros(4000, 1, 32, 32, dtype=torch.uint8)
    marker[:, :, 0, 0] = 255
    out = T.random_crop_and_flip(marker)[:, 0]
    assert out.flatten(1).gt(0).any(1).float().mean().item() == pytest.approx((5 / 9) ** 2, abs=0.03)
    _, rows, cols = (out > 0).nonzero().unbind(1)
    assert set(cols.tolist()) <= set(range(5)) | set(range(27, 32))
    assert (cols >= 16).float().mean().item() == pytest.approx(0.5, abs=0.05)
    assert torch.allclose(torch.bincount(rows, minlength=5) / len(rows), torch.full((5,), 0.2), atol=0.04)


def test_eval_transform_is_deterministic_and_normalised(images):
    transform = T.BatchTransform(T.CIFAR10_NORMALIZATION)
    a, b = transform(images), transform(images)
    assert torch.equal(a, b)
    expected = (images.float() / 255 - torch.tensor(T.CIFAR10_MEAN).view(1, 3, 1, 1)) / torch.tensor(
        T.CIFAR10_STD
    ).view(1, 3, 1, 1)
    assert torch.allclose(a, expected)


def test_train_transform_is_seeded_and_varies(images):
    transform = T.BatchTransform(T.CIFAR10_NORMALIZATION, augment=True, channels_last=True)
    torch.manual_seed(1)
    a = transform(images)
    torch.manual_seed(1)
    b = transform(images)
    c = transform(images)
    assert torch.equal(a, b) and not torch.equal(b, c)
    assert a.is_contiguous(memory_format=torch.channels_last)


def test_brightness_and_contrast_shift_then_scale_each_normalised_image_within_their_ranges(images):
    """hiverge's jitter: each image's normalised pixels p become (p + b) * c, with one b in [-0.2, 0.2] and one c in
    [0.9, 1.1] per image, shared by its channels; with both ranges 0 nothing is drawn and nothing changes."""
    plain = T.BatchTransform(T.CIFAR10_NORMALIZATION)(images).double()
    jitter = T.BatchTransform(T.CIFAR10_NORMALIZATION, augment=True, padding=0, flip=False, color_jitter=False,
                              brightness_shift=0.2, contrast_scale=0.1)  # fmt: skip
    torch.manual_seed(0)
    out = jitter(images).double()
    # Per image, out = c * p + c * b: a straight line through its pixels, whose slope is c.
    x, y = plain.flatten(1), out.flatten(1)
    x_centred = x - x.mean(1, keepdim=True)
    scale = (x_centred * (y - y.mean(1, keepdim=True))).sum(1) / x_centred.pow(2).sum(1)
    shift = (y.mean(1) - scale * x.mean(1)) / scale
    residual = y - scale.unsqueeze(1) * (x + shift.unsqueeze(1))
    assert residual.abs().max() < 1e-5  # one b and one c for every pixel and channel of an image
    assert ((scale >= 0.9 - 1e-6) & (scale <= 1.1 + 1e-6)).all() and scale.std() > 0.02
    assert (shift.abs() <= 0.2 + 1e-5).all() and shift.std() > 0.04
    off = T.BatchTransform(T.CIFAR10_NORMALIZATION, augment=True, padding=0, flip=False, color_jitter=False)
    state = torch.get_rng_state()
    assert torch.equal(off(images), plain.float()) and torch.equal(torch.get_rng_state(), state)


def image_statistics(batch: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-image statistics of normalised images that each augmentation moves: brightness, contrast, saturation,
    colour balance (hue) and where the content sits (crop offsets, flips)."""
    pixels = batch * torch.tensor(T.CIFAR10_STD).view(1, 3, 1, 1) + torch.tensor(T.CIFAR10_MEAN).view(1, 3, 1, 1)
    return {
        "brightness": pixels.mean((1, 2, 3)),
        "contrast": pixels.std((1, 2, 3)),
        "saturation": (pixels.amax(1) - pixels.amin(1)).mean((1, 2)),
        "red - green": (pixels[:, 0] - pixels[:, 1]).mean((1, 2)),
        "green - blue": (pixels[:, 1] - pixels[:, 2]).mean((1, 2)),
        "left - right": pixels[..., :16].mean((1, 2, 3)) - pixels[..., 16:].mean((1, 2, 3)),
        "top - bottom": pixels[:, :, :16].mean((1, 2, 3)) - pixels[:, :, 16:].mean((1, 2, 3)),
        "dark top and bottom rows": (pixels[:, :, [0, -1]].amax(1) < 0.05).float().mean((1, 2)),
    }


@pytest.mark.skipif(not CIFAR10_JPEG.is_dir(), reason=f"needs the CIFAR-10 copy at {CIFAR10_JPEG}")
def test_batch_augmentation_has_the_chapter_pipelines_statistics():
    """The same 200 real images, each augmented 20 times by the chapter's per-image PIL pipeline and by ours:
    every per-image statistic has the same mean and spread, within sampling noise."""
    rows = datasets.load_dataset(str(CIFAR10_JPEG), split="test[:200]")
    pil_images = [row["img"].convert("RGB") for row in rows]
    uint8 = torch.from_numpy(np.stack([np.asarray(image) for image in pil_images])).permute(0, 3, 1, 2).contiguous()
    repeats = 20
    torch.manual_seed(0)
    theirs = image_statistics(torch.stack([CHAPTER_TRANSFORM(image) for _ in range(repeats) for image in pil_images]))
    augment = T.BatchTransform(T.CIFAR10_NORMALIZATION, augment=True)
    ours = image_statistics(torch.cat([augment(uint8.clone()) for _ in range(repeats)]))
    unaugmented = image_statistics(T.BatchTransform(T.CIFAR10_NORMALIZATION)(uint8))
    for name in theirs:
        # Paired by image, so the content's own variety cancels and what is left is the augmentations' randomness.
        their_shift = theirs[name].view(repeats, -1) - unaugmented[name]
        our_shift = ours[name].view(repeats, -1) - unaugmented[name]
        noise = (their_shift.var() / their_shift.numel() + our_shift.var() / our_shift.numel()).sqrt().item()
        assert abs(our_shift.mean() - their_shift.mean()).item() < 4 * noise + 2e-3, name
        assert our_shift.std().item() == pytest.approx(their_shift.std().item(), rel=0.1, abs=2e-3), name
