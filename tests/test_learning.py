"""The model learns: a few epochs on a 2,000-image slice of the real CIFAR-10 copy."""

from __future__ import annotations

import pytest

from conftest import CIFAR10_JPEG, read_results, run_cli

pytestmark = pytest.mark.skipif(not CIFAR10_JPEG.is_dir(), reason=f"needs the CIFAR-10 copy at {CIFAR10_JPEG}")


def test_2000_image_slice_reaches_35_percent_validation_accuracy(cli_env, tmp_path):
    out = tmp_path / "run"
    args = [
        "--dataset_name", str(CIFAR10_JPEG), "--output_dir", str(out), "--max_train_samples", "2000",
        "--max_eval_samples", "1000", "--num_train_epochs", "6", "--mixed_precision", "no",
    ]  # fmt: skip
    proc = run_cli(args, cli_env, timeout=600)
    assert proc.returncode == 0, proc.stderr
    results = read_results(out)
    assert (results["train_samples"], results["val_samples"], results["test_samples"]) == (1800, 200, 1000)
    assert results["best_val_accuracy"] >= 0.35
    assert results["test_accuracy"] >= 0.30  # chance is 0.10
    losses = [epoch["train_loss"] for epoch in results["history"]]
    assert losses[-1] < losses[0]
