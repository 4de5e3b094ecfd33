"""The batch augmentation matches torchvision's per-image transforms, op by op and in distribution."""

from __future__ import annotations

import pytest
import torch
import torchvision.transforms.functional as TF

from cifar_accel import transforms as T


@pytest.fixture
def images() -> torch.Tensor:
    return torch.randint(0, 256, (16, 3, 32, 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize(
    ("op", "reference", "factor"),
    [
        (0, TF.adjust_brightness, 1.15),
        (1, TF.adjust_contrast, 0.85),
        (2, TF.adjust_saturation, 1.2),
        (3, TF.adjust_hue, 0.07),
        (3, TF.adjust_hue, -0.09),
    ],
)
def test_each_colour_op_matches_torchvision(images, op, reference, factor):
    x = images.float() / 255
    ours = T._adjust(x, op, torch.full((16, 1, 1, 1), factor))
    theirs = torch.stack([reference(img, factor) for img in x])
    assert torch.allclose(ours, theirs, atol=2e-5)


def test_random_crop_is_a_shifted_window_of_the_zero_padded_image(images):
    torch.manual_seed(0)
    cropped = T.random_crop(images)
    padded = torch.nn.functional.pad(images, (4, 4, 4, 4))
    for img, out in zip(padded, cropped, strict=True):
        windows = [
            (dy, dx) for dy in range(9) for dx in range(9) if torch.equal(img[:, dy : dy + 32, dx : dx + 32], out)
        ]
        assert windows


def test_crop_offsets_and_flips_have_torchvisions_distribution():
    """A marker in the top-left pixel shows each image's crop offset and flip.

    RandomCrop(32, padding=4) draws both offsets uniformly from 0..8, so the marker stays visible when both are
    <= 4, with probability (5/9)^2, landing uniformly on rows 0..4; RandomHorizontalFlip mirrors half of them.
    """
    torch.manual_seed(0)
    marker = torch.zeros(4000, 1, 32, 32, dtype=torch.uint8)
    marker[:, :, 0, 0] = 255
    out = T.random_horizontal_flip(T.random_crop(marker))[:, 0]
    assert out.flatten(1).gt(0).any(1).float().mean().item() == pytest.approx((5 / 9) ** 2, abs=0.03)
    _, rows, cols = (out > 0).nonzero().unbind(1)
    assert set(cols.tolist()) <= set(range(5)) | set(range(27, 32))
    assert (cols >= 16).float().mean().item() == pytest.approx(0.5, abs=0.05)
    assert torch.allclose(torch.bincount(rows, minlength=5) / len(rows), torch.full((5,), 0.2), atol=0.04)


def test_eval_transform_is_deterministic_and_normalised(images):
    transform = T.BatchTransform(augment=False)
    a, b = transform(images), transform(images)
    assert torch.equal(a, b)
    expected = (images.float() / 255 - torch.tensor(T.CIFAR10_MEAN).view(1, 3, 1, 1)) / torch.tensor(
        T.CIFAR10_STD
    ).view(1, 3, 1, 1)
    assert torch.allclose(a, expected)


def test_train_transform_is_seeded_and_varies(images):
    transform = T.BatchTransform(augment=True, channels_last=True)
    torch.manual_seed(1)
    a = transform(images)
    torch.manual_seed(1)
    b = transform(images)
    c = transform(images)
    assert torch.equal(a, b) and not torch.equal(b, c)
    assert a.is_contiguous(memory_format=torch.channels_last)
