"""Beyond CIFAR-10: a dataset in the Hub's CIFAR-100 layout (fine and coarse labels) and an image folder train,
evaluate, predict and load like CIFAR-10, each normalised by statistics of its own training split, saved with the
run and applied again wherever the model is used."""

from __future__ import annotations

import json
import re
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch
from PIL import Image

from cifar_accel.compare import main as compare_main
from cifar_accel.config import TrainConfig
from cifar_accel.data import Split, choose_normalization, computed_normalization, load_data, load_split
from cifar_accel.errors import InputError
from cifar_accel.errors import run_cli as run_main
from cifar_accel.evaluate import main as evaluate_main
from cifar_accel.export import main as export_main
from cifar_accel.inference import load_model
from cifar_accel.predict import main as predict_main
from cifar_accel.transforms import CIFAR10_MEAN, CIFAR10_NORMALIZATION, BatchTransform

from conftest import (
    CLASS_NAMES,
    COARSE_NAMES,
    FINE_NAMES,
    read_results,
    run_cli,
    snapshot,
    tiny_args,
    write_image_folder,
)


def numpy_statistics(dataset: Path, split: str = "train") -> tuple[np.ndarray, np.ndarray]:
    """Per-channel mean and population std of a split's pixels in [0, 1], in float64, straight from its files."""
    rows = datasets.load_dataset(str(dataset), split=split)
    column = "img" if "img" in rows.features else "image"  # the Hub layout's name, imagefolder's
    images = [image.convert("RGB").resize((32, 32), Image.Resampling.BILINEAR) for image in rows[column]]
    pixels = np.stack([np.asarray(image, dtype=np.float64) for image in images]) / 255
    return pixels.mean((0, 1, 2)), pixels.std((0, 1, 2))


def test_a_cifar100_layout_run_saves_statistics_of_its_own_training_split(cifar100_run, cifar100_dataset):
    saved = json.loads((cifar100_run / "preprocessing.json").read_text())
    mean, std = numpy_statistics(cifar100_dataset)
    assert np.abs(np.array(saved["mean"]) - mean).max() <= 0.5e-4 + 1e-12  # rounded to 4 decimals
    assert np.abs(np.array(saved["std"]) - std).max() <= 0.5e-4 + 1e-12
    assert np.abs(np.array(saved["mean"]) - CIFAR10_MEAN).max() > 0.05  # this dataset is not CIFAR-10
    assert saved["source"] == f"computed from the 400 training images of {cifar100_dataset}"
    results = read_results(cifar100_run)
    assert results["normalization"] == saved
    assert (results["image_column"], results["label_column"]) == ("img", "fine_label")
    assert json.loads((cifar100_run / "labels.json").read_text())["class_names"] == FINE_NAMES
    card = (cifar100_run / "README.md").read_text()
    assert re.search(r"trained on cifar\d+ \(`[^`]+`, label column\s+`fine_label`, 100 classes\)", card), card[:600]
    assert f"mean {saved['mean']}, std {saved['std']}" in card


def test_load_model_evaluate_and_predict_apply_the_saved_statistics(
    cifar100_run, cifar100_dataset, cli_env, tmp_path, capsys
):
    trained = load_model(cifar100_run)
    saved = json.loads((cifar100_run / "preprocessing.json").read_text())
    assert list(trained.preprocess.normalization.mean) == saved["mean"]
    test, class_names = load_split(str(cifar100_dataset), "test", None, "fine_label", None)
    assert class_names == trained.class_names == FINE_NAMES
    # The model sees exactly (pixels / 255 - mean) / std with the saved statistics, and not CIFAR-10's.
    mean, std = (torch.tensor(saved[key]).view(1, 3, 1, 1) for key in ("mean", "std"))
    with torch.no_grad():
        expected = trained.model((test.images.float() / 255 - mean) / std).softmax(1)
        with_cifar10 = trained.model(BatchTransform(CIFAR10_NORMALIZATION)(test.images)).softmax(1)
    probabilities = trained.probabilities(test.images)
    assert torch.allclose(probabilities, expected, atol=1e-6)
    assert (probabilities - with_cifar10).abs().max() > 1e-3
    accuracy = (probabilities.argmax(1) == test.labels).double().mean().item()
    assert accuracy == pytest.approx(read_results(cifar100_run)["test_accuracy"], abs=1e-12)

    evaluate = ["--model", str(cifar100_run), "--output_dir", str(tmp_path / "eval")]
    proc = run_cli(evaluate, cli_env, "cifar_accel.evaluate")
    assert proc.returncode == 0, proc.stderr
    metrics = json.loads((tmp_path / "eval" / "metrics.json").read_text())
    assert metrics["accuracy"] == read_results(cifar100_run)["test_accuracy"] and metrics["samples"] == 200
    assert len(metrics["confusion_matrix"]) == 100 and "confusion matrix" not in proc.stdout  # too wide to print
    images = tmp_path / "images"
    images.mkdir()
    first = datasets.load_dataset(str(cifar100_dataset), split="test[:3]")
    for index, row in enumerate(first):
        row["img"].save(images / f"{index}.png")
    assert run_main(predict_main, ["--model", str(cifar100_run), "--format", "jsonl", str(images)]) == 0
    predicted = [json.loads(line)["top_k"][0]["class"] for line in capsys.readouterr().out.splitlines()]
    assert predicted == [FINE_NAMES[i] for i in probabilities[:3].argmax(1)]


def test_presets_train_coarse_and_fine_labels_and_statistics_are_cached(train_here, cifar100_dataset, tmp_path, caplog):
    """fast and resnet18 with 100 and 20 classes; the next load of the same split takes the decoded images and
    their statistics from the datasets cache."""
    small = [
        "--max_train_samples",
        "200",
        "--max_eval_samples",
        "50",
        "--per_device_eval_batch_size",
        "50",
        "--report_to",
        "none",
    ]
    fast = train_here(
        tiny_args(cifar100_dataset, tmp_path / "fast", "--config", "fast", "--label_column_name", "fine_label")
        + [*small, "--per_device_train_batch_size", "25"]
    )
    assert fast.returncode == 0, fast.stderr
    assert f"test images of 100 classes ({', '.join(FINE_NAMES[:10])}, ...); batch 25" in fast.stdout
    caplog.clear()
    config = TrainConfig(dataset_name=str(cifar100_dataset), label_column_name="fine_label", max_train_samples=200)
    again = load_data(config)
    assert "train: 200 images from the datasets cache" in caplog.text
    assert again.normalization.to_dict() == json.loads((tmp_path / "fast" / "preprocessing.json").read_text())
    coarse = train_here(
        tiny_args(cifar100_dataset, tmp_path / "coarse", "--config", "resnet18", "--label_column_name", "coarse_label")
        + [*small, "--per_device_train_batch_size", "50"]
    )
    assert coarse.returncode == 0, coarse.stderr
    assert json.loads((tmp_path / "coarse" / "labels.json").read_text())["class_names"] == COARSE_NAMES
    assert read_results(tmp_path / "coarse")["normalization"]["source"].startswith("computed from the 200 training")
    for run, classes in ((tmp_path / "fast", 100), (tmp_path / "coarse", 20)):
        assert load_model(run).model(torch.zeros(2, 3, 32, 32)).shape == (2, classes)


def test_an_image_folder_of_greyscale_and_rgb_pngs_trains_with_its_own_statistics(train_here, tmp_path):
    """Its validation/ folder validates, and all of train/ trains (the statistics are train/'s)."""
    per_class = {"train": 20, "validation": 4, "test": 6}
    folder = write_image_folder(tmp_path / "shapes", ["dark", "mid", "light"], per_class)
    proc = train_here(tiny_args(folder, tmp_path / "run", "--per_device_train_batch_size", "8"))
    assert proc.returncode == 0, proc.stderr
    # The log names the classes: an image folder's are the folders that hold the images themselves (one level
    # deeper, train/cat/2019/, and the classes would be the years).
    assert "data: 60 train, 12 validation, 18 test images of 3 classes (dark, light, mid); batch 8" in proc.stdout
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert (results["train_samples"], results["val_samples"], results["val_split"]) == (60, 12, "validation")
    assert (
        "| training images | 60 (12 validation images: the 'validation' split) |"
        in (tmp_path / "run" / "README.md").read_text()
    )
    saved = json.loads((tmp_path / "run" / "preprocessing.json").read_text())
    mean, std = numpy_statistics(folder)
    assert np.abs(np.array(saved["mean"]) - mean).max() <= 0.5e-4 + 1e-12
    assert saved["mean"][0] == saved["mean"][1] == saved["mean"][2]  # grey images: every channel alike
    assert np.abs(np.array(saved["std"]) - std).max() <= 0.5e-4 + 1e-12
    assert load_model(tmp_path / "run").class_names == ["dark", "light", "mid"]  # the folders' names, sorted


def test_no_command_writes_into_the_local_dataset_it_reads(train_here, tmp_path, capsys):
    """A run with its --output_dir in an image folder trained, and its files became part of the dataset: the next
    load found a class named after the run's folder, with curves.png as its image. Now train, compare, evaluate and
    export refuse a folder in (or of) the dataset they read, in one line, exit 2, before anything is written; a
    folder beside it whose name only begins like it is not in it."""
    folder = write_image_folder(tmp_path / "shapes", ["dark", "light"], {"train": 12, "test": 4})
    beside = tmp_path / "shapes-run"
    assert train_here(tiny_args(folder, beside, "--per_device_train_batch_size", "8")).returncode == 0
    before = snapshot(tmp_path)
    for inside in (folder / "train" / "run", folder):
        proc = train_here(tiny_args(folder, inside, "--per_device_train_batch_size", "8"))
        assert (proc.returncode, proc.stderr) == (
            2,
            f"error: output directory '{inside}' is inside the dataset '{folder}' that it reads, and its files would "
            "become part of that dataset; choose another --output_dir, outside it\n",
        )
        compare = ["--dataset_name", str(folder), "--output_dir", str(inside), "--precisions", "no"]
        assert run_main(compare_main, compare) == 2
        assert run_main(evaluate_main, ["--model", str(beside), "--output_dir", str(inside)]) == 2
        assert run_main(export_main, ["--model", str(beside), "--output", str(inside / "m.onnx")]) == 2
        refusals = capsys.readouterr().err.splitlines()
        assert refusals == [
            f"error: {what} '{place}' is inside the dataset '{folder}' that it reads, and its files would become part "
            f"of that dataset; choose another {flag}, outside it"
            for what, place, flag in (
                ("output directory", inside, "--output_dir"),
                ("output directory", inside, "--output_dir"),
                ("--output's folder", inside, "--output"),
            )
        ]
        assert snapshot(tmp_path) == before and not (folder / "train" / "run").exists()
    # Without the check, export reads no dataset, and its file may go anywhere.
    assert run_main(export_main, ["--model", str(beside), "--output", str(folder / "m.pt2"), "--format", "pt2",
                                  "--skip_check"]) == 0  # fmt: skip
    assert datasets.load_dataset(str(folder))["train"].features["label"].names == ["dark", "light"]


def uint8_split(values: list[list[int]]) -> Split:
    """A decoded-looking split whose channels hold the given values, with its integer moments."""
    images = torch.tensor(values, dtype=torch.uint8).view(len(values), 3, 1, 1).expand(-1, -1, 32, 32).contiguous()
    wide = images.flatten(2).long()
    return Split(
        images, torch.zeros(len(values), dtype=torch.long), torch.stack([wide.sum((0, 2)), (wide**2).sum((0, 2))])
    )


def test_computed_statistics_are_exact_and_rounded_to_four_decimals():
    split = uint8_split([[0, 255, 10], [255, 255, 30], [51, 0, 20]])
    stats = computed_normalization(split, "three")
    pixels = split.images.double() / 255
    assert stats.mean == tuple(round(x, 4) for x in pixels.mean((0, 2, 3)).tolist())
    assert stats.std == tuple(round(x, 4) for x in pixels.std((0, 2, 3), correction=0).tolist())
    assert stats.mean[0] == round(306 / 3 / 255, 4) and stats.std[1] == round(255 * 2**0.5 / 3 / 255, 4)


def test_the_normalization_flag_chooses_the_constants_or_the_datasets_own():
    split = uint8_split([[0, 100, 10], [200, 120, 30]])
    for flag, class_names, expected in (
        ("auto", CLASS_NAMES, CIFAR10_NORMALIZATION),
        ("auto", FINE_NAMES, computed_normalization(split, "d")),
        ("cifar10", FINE_NAMES, CIFAR10_NORMALIZATION),
        ("computed", CLASS_NAMES, computed_normalization(split, "d")),
    ):
        assert choose_normalization(TrainConfig(normalization=flag, dataset_name="d"), split, class_names) == expected
    with pytest.raises(InputError, match="same value in every training image of 'd'.*pass --normalization cifar10"):
        computed_normalization(uint8_split([[5, 100, 10], [5, 120, 30]]), "d")


def test_a_damaged_or_missing_preprocessing_file_is_refused_in_one_line(cifar100_run, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    for name in ("model.safetensors", "config.yaml", "labels.json"):
        (run / name).write_bytes((cifar100_run / name).read_bytes())
    for damage in ("{", '{"mean": [0.5, 0.5], "std": [0.2, 0.2, 0.2], "source": "x"}', '{"mean": [0, 0, 0]}'):
        (run / "preprocessing.json").write_text(damage)
        with pytest.raises(InputError, match="preprocessing.json cannot be read .*'mean', 'std' and 'source'"):
            load_model(run)
    # Missing, it was taken for a run written before the file existed, which used CIFAR-10's constants: this run,
    # normalised by its own statistics, predicted with the wrong ones. Only a run of the constants does without it.
    (run / "preprocessing.json").unlink()
    with pytest.raises(InputError, match="preprocessing.json is missing: the run normalised its inputs by statistics "):
        load_model(run)
    config = (run / "config.yaml").read_text()
    assert "\nnormalization: auto\n" in config
    (run / "config.yaml").write_text(config.replace("\nnormalization: auto\n", "\nnormalization: cifar10\n"))
    assert load_model(run).preprocess.normalization == CIFAR10_NORMALIZATION
