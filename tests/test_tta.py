"""Test-time augmentation: the views averaged as stated, and reported by training and by evaluate."""

from __future__ import annotations

import json

import pytest
import torch
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from cifar_accel import evaluate
from cifar_accel.engine import predict, tta_logits
from cifar_accel.errors import run_cli

from conftest import read_results, tiny_args


def shifted(images: torch.Tensor, rows: list[int], cols: list[int]) -> torch.Tensor:
    return images[:, :, rows][:, :, :, cols]


def test_tta_is_the_mean_of_the_views_computed_by_hand():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 5)).eval()
    images = torch.randn(2, 3, 8, 8)
    mirror = images[:, :, :, list(range(7, -1, -1))]
    # One pixel down-right and one pixel up-left, the border reflected (row -1 is row 1, row 8 is row 6).
    down_right = shifted(images, [1, *range(7)], [1, *range(7)])
    up_left = shifted(images, [*range(1, 8), 6], [*range(1, 8), 6])
    views = {name: model(view) for name, view in
             [("image", images), ("mirror", mirror), ("down_right", down_right), ("up_left", up_left)]}  # fmt: skip
    by_hand_flip = (views["image"] + views["mirror"]) / 2
    mirrored = {name: model(view.flip(3)) for name, view in (("down_right", down_right), ("up_left", up_left))}
    by_hand_translate = 0.5 * by_hand_flip + 0.125 * (
        views["down_right"] + mirrored["down_right"] + views["up_left"] + mirrored["up_left"]
    )
    with torch.no_grad():
        assert torch.equal(tta_logits(model, images, "none"), views["image"])
        torch.testing.assert_close(tta_logits(model, images, "flip"), by_hand_flip)
        torch.testing.assert_close(tta_logits(model, images, "flip_translate"), by_hand_translate)
        for unknown in ("flips", None, ""):  # never quietly one of the others
            with pytest.raises(ValueError, match="unknown test-time augmentation"):
                tta_logits(model, images, unknown)


def test_selective_tta_augments_only_the_images_whose_plain_prediction_is_unsure():
    """hiverge's selective TTA: images with a plain top probability at or above the threshold keep their plain
    logits exactly, the others get the full TTA logits exactly; a threshold of 1 is TTA for every image."""
    torch.manual_seed(1)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 5)).double().eval()
    images = torch.randn(64, 3, 8, 8, dtype=torch.float64) * torch.logspace(-2, 1, 64, dtype=torch.float64).view(
        64, 1, 1, 1
    )  # from near-uniform predictions to confident ones
    with torch.no_grad():
        plain, full = model(images), tta_logits(model, images, "flip_translate")
        threshold = plain.softmax(1).amax(1).median().item()
        unsure = plain.softmax(1).amax(1) < threshold
        selective = tta_logits(model, images, "flip_translate", below_confidence=threshold)
        assert 0 < unsure.sum() < len(images)
        assert torch.equal(selective[~unsure], plain[~unsure])
        torch.testing.assert_close(selective[unsure], full[unsure], rtol=0, atol=1e-12)
        assert torch.equal(tta_logits(model, images, "flip_translate", below_confidence=1.0), full)


def test_one_pass_predicts_with_and_without_tta():
    """predict's plain classes are the model's own on each image, its classes those of the (selective) TTA
    logits: the plain logits are reused as the first view, not changed by the views."""
    torch.manual_seed(2)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 5)).double().eval()
    images = torch.randn(40, 3, 8, 8, dtype=torch.float64) * torch.logspace(-2, 1, 40, dtype=torch.float64).view(
        40, 1, 1, 1
    )
    loader = DataLoader(TensorDataset(images, torch.randint(0, 5, (40,))), batch_size=16)
    with torch.no_grad():
        plain = model(images).argmax(1)
        full = tta_logits(model, images, "flip_translate").argmax(1)
        selective = tta_logits(model, images, "flip_translate", below_confidence=0.5).argmax(1)
    assert not torch.equal(plain, full)  # the views change some predictions, so the check below can fail
    accelerator = Accelerator(cpu=True)
    for below_confidence, expected in ((1.0, full), (0.5, selective)):
        found = predict(accelerator, model, loader, lambda batch: batch, "flip_translate", below_confidence)
        assert torch.equal(found.plain_classes, plain)
        assert torch.equal(found.classes, expected)


def test_results_and_evaluate_say_which_tta_was_used(tiny_dataset, train_here, tmp_path, capsys):
    out = tmp_path / "run"
    proc = train_here(tiny_args(tiny_dataset, out, "--tta", "flip_translate"))
    assert proc.returncode == 0, proc.stderr
    results = read_results(out)
    assert results["tta"] == "flip_translate"
    assert 0 < results["test_accuracy_no_tta"] <= 1
    for tta, expected in (("flip_translate", results["test_accuracy"]), ("none", results["test_accuracy_no_tta"])):
        assert run_cli(evaluate.main, ["--model", str(out), "--tta", tta, "--output_dir", str(tmp_path / tta)]) == 0
        metrics = json.loads((tmp_path / tta / "metrics.json").read_text())
        assert (metrics["tta"], metrics["accuracy"]) == (tta, pytest.approx(expected, abs=0))
    assert "test-time augmentation: flip_translate" in capsys.readouterr().out
