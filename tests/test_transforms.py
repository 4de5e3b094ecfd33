"""The batch augmentation matches torchvision's per-image transforms, op by op and in distribution."""

from __future__ import annotations

import datasets
import numpy as np
import pytest
import torch
import torchvision.transforms.functional as TF

from cifar_accel import transforms as T
from cifar_accel.config import TrainConfig
from cifar_accel.pictures import augmentation_grid

from chapter_pipeline import CHAPTER_TRANSFORM
from conftest import CIFAR10_JPEG


@pytest.fixture
def images() -> torch.Tensor:
    images = torch.randint(0, 256, (16, 3, 32, 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    images[0] = 128  # grey: no hue, no saturation
    images[1, 1] = images[1, 0]  # red and green tie for the maximum
    return images


def test_each_image_gets_torchvisions_colour_ops_in_its_own_order(images):
    """The random factors and orders, drawn again from the same seed, applied image by image with torchvision's
    functions, give the batch's result; the grey and the tie images are among them, and the hue turn comes at
    every position of the order in some image."""
    reference = {T.BRIGHTNESS: TF.adjust_brightness, T.CONTRAST: TF.adjust_contrast,
                 T.SATURATION: TF.adjust_saturation, T.HUE: TF.adjust_hue}  # fmt: skip
    x = torch.cat([images, images.flip(0)]).float() / 255
    torch.manual_seed(3)
    ours = T.color_jitter(x, brightness=0.2, contrast=0.2, saturation=0.2, hue=0.1)
    torch.manual_seed(3)
    ranges = [(0.8, 1.2), (0.8, 1.2), (0.8, 1.2), (-0.1, 0.1)]
    factors = torch.stack([torch.empty(len(x)).uniform_(low, high) for low, high in ranges], 1)
    orders = torch.rand(len(x), 4).argsort(1)
    assert set((orders == T.HUE).int().argmax(1).tolist()) == {0, 1, 2, 3}
    for image, out, order, image_factors in zip(x, ours, orders.tolist(), factors.tolist(), strict=True):
        for op in order:
            image = reference[op](image, image_factors[op])
        assert torch.allclose(out, image, atol=5e-5)


def test_hue_turn_picks_and_wraps_exactly():
    """_shift_hue's branch-free arithmetic gives the same bits as the plain formula with torch.where and %, on
    greys, ties for the maximum and every hue, for the largest turns both ways."""
    x = torch.randint(0, 256, (64, 3, 32, 32), generator=torch.Generator().manual_seed(1)).float() / 255
    x[:, :, :4] = x[:, :1, :4]  # greys
    x[:, 1, 4:8] = x[:, 0, 4:8]  # red and green tie
    x[:, 2, 8:12] = x[:, 1, 8:12]  # green and blue tie
    shift = torch.linspace(-0.1, 0.1, 64).view(64, 1, 1, 1)
    r, g, b = x[:, 0:1], x[:, 1:2], x[:, 2:3]
    value = torch.maximum(torch.maximum(r, g), b)
    delta = value - torch.minimum(torch.minimum(r, g), b)
    hue = torch.where(value == r, g - b, torch.where(value == g, 2 * delta + b - r, 4 * delta + r - g))
    hue = (hue / delta).nan_to_num(0.0) + 6 * shift
    k = (torch.tensor([5.0, 3.0, 1.0]).view(1, 3, 1, 1) + hue) % 6
    assert torch.equal(T._shift_hue(x, shift), value - delta * torch.minimum(k, 4 - k).clamp(0, 1))


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


def test_a_smaller_window_is_any_window_of_the_reflect_padded_image_each_place_drawn():
    """--early_crop_size 24 with --crop_padding 2 and reflect padding: each 24x24 input is one of the 13 x 13 windows
    of the 36x36 image that reflect padding makes, mirrored or not; over many draws every place is taken."""
    torch.manual_seed(0)
    images = torch.randint(0, 256, (4000, 3, 32, 32), dtype=torch.uint8)
    cropped = T.random_crop_and_flip(images, padding=2, padding_mode="reflect", size=24)
    assert cropped.shape == (4000, 3, 24, 24)
    padded = torch.nn.functional.pad(images.float(), (2, 2, 2, 2), mode="reflect").to(torch.uint8)
    places = []
    for chunk, out in zip(padded.split(100), cropped.split(100), strict=True):
        windows = chunk.unfold(2, 24, 1).unfold(3, 24, 1)  # N, 3, 13, 13, 24, 24
        for flip in (False, True):
            seen = out.flip(-1) if flip else out
            same = (windows == seen[:, :, None, None]).flatten(-2).all(-1).all(1)  # N, 13, 13
            places += [(int(dy), int(dx), flip) for _, dy, dx in same.nonzero()]
    assert len(places) == len(images)  # one window each
    assert len(set(places)) == 13 * 13 * 2


@pytest.mark.parametrize(
    ("early_crop_epochs", "num_epochs", "sizes"),
    [(2, 3, [24, 24, 32]), (2, 4, [24, 24, 32, 32]), (6, 3, [24, 24, 32]), (3, 3, [24, 24, 32]), (6, 1, [32])],
)
def test_the_training_transform_cuts_smaller_windows_in_the_early_epochs_but_never_the_last(
    images, early_crop_epochs, num_epochs, sizes
):
    """--early_crop_epochs 6 (the fast preset's) in a shorter run: every epoch but the last on windows."""
    config = TrainConfig(early_crop_size=24, early_crop_epochs=early_crop_epochs)
    transform = T.TrainingTransform(config, 10, T.CIFAR10_NORMALIZATION)
    labels = torch.zeros(len(images), dtype=torch.long)
    shapes = [transform(images, labels, epoch, num_epochs)[0].shape[-2:] for epoch in range(num_epochs)]
    assert shapes == [(size, size) for size in sizes]


def test_the_augmentation_picture_frames_smaller_windows_in_white_at_the_originals_size(images):
    """TensorBoard's train/augmentation shows the originals above what the first step trains on: with
    --early_crop_size 24 each 24x24 window sits in the middle of a white 32x32 frame, its pixels as the window's."""
    originals = images[:8]
    windows = T.random_crop_and_flip(originals, padding=2, padding_mode="reflect", size=24)
    normalised = T.BatchTransform(T.CIFAR10_NORMALIZATION)(windows)
    grid = augmentation_grid(originals, normalised, T.CIFAR10_NORMALIZATION, zoom=1)
    assert grid.shape == (3, 2 * 32 + 3 * 4, 8 * 32 + 9 * 4)  # two rows of eight, 4-pixel gaps
    second_row = grid[:, 4 + 32 + 4 :, 4 : 4 + 32][:, :32]  # the first window's frame
    assert (second_row[:, :4] == 1).all() and (second_row[:, 28:] == 1).all()
    assert (second_row[:, :, :4] == 1).all() and (second_row[:, :, 28:] == 1).all()
    assert torch.allclose(second_row[:, 4:28, 4:28], windows[0].float() / 255, atol=1e-6)


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
