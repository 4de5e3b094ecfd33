"""After training: evaluate a saved model and predict on image files, through the real CLIs."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch
import yaml
from PIL import Image

from cifar_accel import compare, export, predict
from cifar_accel import evaluate as evaluate_command
from cifar_accel.data import load_split, split_indices
from cifar_accel.errors import InputError
from cifar_accel.errors import run_cli as run_main
from cifar_accel.images import image_to_rgb32, to_rgb32
from cifar_accel.inference import load_model
from cifar_accel.transforms import BatchTransform

import summarize_runs
from conftest import CLASS_NAMES, GIT_LFS_POINTER, REPO, make_images, read_results, run_cli, tiny_args, train_in_process


@pytest.fixture(scope="module")
def trained_run(tiny_dataset, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("trained") / "run"
    assert train_in_process(tiny_args(tiny_dataset, out, "--num_train_epochs", "2")) == 0
    return out


def evaluate(model: Path, env: dict, *extra: str):
    return run_cli(["--model", str(model), *extra], env, module="cifar_accel.evaluate")


def test_evaluating_the_final_model_reproduces_the_runs_test_accuracy(trained_run, cli_env):
    proc = evaluate(trained_run, cli_env)
    assert proc.returncode == 0, proc.stderr
    metrics = json.loads((trained_run / "eval_test" / "metrics.json").read_text())
    assert metrics["accuracy"] == read_results(trained_run)["test_accuracy"]
    assert metrics["accuracy"] > 0.5  # the classes are learnable in two epochs; chance is 0.1
    assert metrics["samples"] == 83
    assert sum(row["total"] for row in metrics["per_class"]) == 83
    assert sum(map(sum, metrics["confusion_matrix"])) == 83
    assert sum(row["correct"] for row in metrics["per_class"]) == round(metrics["accuracy"] * 83)
    assert [row["class"] for row in metrics["per_class"]] == CLASS_NAMES
    assert 0.0 <= metrics["macro_f1"] <= 1.0
    assert "overall accuracy" in proc.stdout and "confusion matrix" in proc.stdout
    with Image.open(trained_run / "eval_test" / "confusion_matrix.png") as png:
        assert png.format == "PNG" and png.width >= 600 and png.height >= 500


def test_the_validation_images_a_run_held_out_are_evaluated_to_its_best_validation_accuracy(
    trained_run, tiny_dataset, cli_env, tmp_path, capsys
):
    """A run on a dataset without a validation split validates on a seeded part of train and reports its best
    accuracy there, which `--split validation` could not check: "has no 'validation' split". It now evaluates those
    same images, in the same order: from the final weights (the best ones), the same accuracy and the same classes."""
    train_labels = datasets.load_dataset(str(tiny_dataset))["train"]["label"]
    _, held_out = split_indices(len(train_labels), 0.1, 42)  # the run's --val_ratio and --seed, its defaults
    assert (tiny_dataset / "data").is_dir() and len(held_out) == 33
    for first, expected in ((None, read_results(trained_run)["best_val_accuracy"]), (10, None)):
        out = tmp_path / f"first_{first}"
        extra = ["--max_eval_samples", str(first)] if first else []
        proc = evaluate(trained_run, cli_env, "--split", "validation", "--output_dir", str(out), *extra)
        assert proc.returncode == 0, proc.stderr
        metrics = json.loads((out / "metrics.json").read_text())
        labels = [train_labels[i] for i in held_out[:first].tolist()]
        assert metrics["split"] == "validation" and metrics["samples"] == len(labels)
        assert [row["total"] for row in metrics["per_class"]] == [labels.count(c) for c in range(10)]
        if expected is not None:
            assert metrics["accuracy"] == expected
    # The rest in this process, as the command's main: the same code from its flags to its one line and exit code.
    capsys.readouterr()
    shutil.copytree(tiny_dataset, tmp_path / "other")  # another dataset's train: the run held out nothing of it
    argv = ["--model", str(trained_run), "--split", "validation", "--dataset_name", str(tmp_path / "other")]
    assert run_main(evaluate_command.main, argv) == 2
    assert capsys.readouterr().err == (f"error: dataset '{tmp_path / 'other'}' has no 'validation' split (splits: "
                                       "train, test); pick one of them with --split\n")  # fmt: skip
    assert run_main(evaluate_command.main, ["--model", str(trained_run), "--split", "val"]) == 2
    assert capsys.readouterr().err == (
        f"error: dataset '{tiny_dataset}' has no 'val' split (splits: train, test, validation (the run's, held out of "
        "train)); pick one of them with --split\n"
    )
    assert train_in_process(tiny_args(tiny_dataset, tmp_path / "ten", "--max_eval_samples", "10")) == 0
    assert run_main(evaluate_command.main, ["--model", str(tmp_path / "ten"), "--split", "validation"]) == 0
    metrics = json.loads((tmp_path / "ten" / "eval_validation" / "metrics.json").read_text())  # as many as it validated
    assert (metrics["samples"], metrics["accuracy"]) == (10, read_results(tmp_path / "ten")["best_val_accuracy"])
    assert train_in_process(tiny_args(tiny_dataset, tmp_path / "all", "--val_ratio", "0")) == 0
    capsys.readouterr()
    assert run_main(evaluate_command.main, ["--model", str(tmp_path / "all"), "--split", "validation"]) == 2
    assert capsys.readouterr().err == (f"error: dataset '{tiny_dataset}' has no 'validation' split, and the run held "
                                       "none out of train (--val_ratio 0); pick one of its splits (train, test) with "
                                       "--split\n")  # fmt: skip


def test_evaluate_takes_a_checkpoint_or_the_weights_file_and_bf16(trained_run, cli_env, tmp_path):
    expected = read_results(trained_run)["test_accuracy"]
    best = trained_run / "checkpoints" / f"step_{9 * read_results(trained_run)['best_epoch']:08d}"
    for model in (best, trained_run / "model.safetensors"):
        proc = evaluate(model, cli_env, "--output_dir", str(tmp_path / model.name))
        assert proc.returncode == 0, proc.stderr
        assert json.loads((tmp_path / model.name / "metrics.json").read_text())["accuracy"] == expected
    proc = evaluate(trained_run, cli_env, "--mixed_precision", "bf16", "--output_dir", str(tmp_path / "bf16"))
    assert proc.returncode == 0, proc.stderr
    metrics = json.loads((tmp_path / "bf16" / "metrics.json").read_text())
    assert metrics["mixed_precision"] == "bf16" and abs(metrics["accuracy"] - expected) <= 0.05


def test_mismatched_weights_are_one_line(trained_run, cli_env, tmp_path):
    run = shutil.copytree(trained_run, tmp_path / "run", ignore=shutil.ignore_patterns("checkpoints", "logs"))
    labels = json.loads((run / "labels.json").read_text())
    (run / "labels.json").write_text(json.dumps({"class_names": labels["class_names"][:5]}))
    proc = evaluate(run, cli_env)
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert "do not fit model 'simple_cnn' with 5 classes" in line and "classifier" in line
    proc = evaluate(tmp_path / "nowhere", cli_env)
    assert proc.returncode == 2 and "no model weights" in proc.stderr


def test_a_runs_dataset_moved_away_is_named_with_the_flag_for_its_new_place(tiny_dataset, tmp_path, capsys):
    """evaluate and export read the run's own dataset by default; once moved, they said "dataset path '...' does not
    exist; pass --dataset_name with a local copy in Hub layout, e.g. ../shared/data/cifar10-jpeg", as if the path
    had been given. The flag then reads it from its new place."""
    copy = shutil.copytree(tiny_dataset, tmp_path / "data")
    run = tmp_path / "run"
    assert train_in_process(tiny_args(copy, run)) == 0
    moved = copy.rename(tmp_path / "moved")
    for module, flag in ((evaluate_command, "--dataset_name"), (export, "--check_dataset")):
        assert run_main(module.main, ["--model", str(run)]) == 2
        assert capsys.readouterr().err == (
            f"error: the run's dataset, '{copy}' (in its config.yaml), is not there any more; pass {flag} with where "
            "it is now\n"
        )
        assert run_main(module.main, ["--model", str(run), flag, str(moved)]) == 0
    assert json.loads((run / "eval_test" / "metrics.json").read_text())["samples"] == 83
    assert (run / "model.onnx").is_file()


def test_a_file_of_a_run_given_as_the_model_points_to_the_run_folder(trained_run, capsys):
    """--model RUN/config.yaml (the file beside the weights) was refused without the fix: the folder it is in."""
    assert run_main(predict.main, ["--model", str(trained_run / "config.yaml"), str(trained_run / "curves.png")]) == 2
    assert capsys.readouterr().err == (
        f"error: '{trained_run / 'config.yaml'}' is not a .safetensors file; only safetensors weights are loaded; pass "
        f"the run folder it is in, {trained_run}\n"
    )


def test_cut_short_weights_are_one_line_that_says_so(trained_run, cli_env, tmp_path):
    run = shutil.copytree(trained_run, tmp_path / "run", ignore=shutil.ignore_patterns("checkpoints", "logs", "eval_*"))
    weights = run / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    proc = evaluate(run, cli_env)
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(f"error: '{weights}' cannot be read as safetensors weights, damaged or cut short (")
    assert not (run / "eval_test").exists()

    # A model repository cloned without git-lfs holds a pointer in place of the weights, which it names.
    weights.write_text(GIT_LFS_POINTER)
    proc = evaluate(run, cli_env)
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert line == (
        f"error: '{weights}' is a Git LFS pointer, not the weights; a clone without git-lfs leaves these; run `git lfs "
        "install` and `git lfs pull` in the repository"
    )


def test_predict_matches_the_model_on_the_datasets_own_copies(trained_run, cli_env, tmp_path):
    """Files of several kinds (PNG, JPEG, grayscale, not 32x32) are written first; a dataset built from those same
    files gives the model's answer on the dataset's copies, which predict must reproduce."""
    images, _ = make_images(6, seed=5)
    files = []
    for i, image in enumerate(images):
        kind = ["png", "jpg", "gray", "large", "png", "jpg"][i]
        if kind == "gray":
            image = image.convert("L")
        if kind == "large":
            image = image.resize((57, 41))
        path = tmp_path / "images" / f"{i}_{kind}.{'jpg' if kind in ('jpg', 'large') else 'png'}"
        path.parent.mkdir(exist_ok=True)
        image.save(path)
        files.append(path)
    features = datasets.Features({"img": datasets.Image(), "label": datasets.ClassLabel(names=CLASS_NAMES)})
    dataset = datasets.Dataset.from_dict({"img": [str(f) for f in files], "label": [0] * 6}, features=features)
    (tmp_path / "ds" / "data").mkdir(parents=True)
    for split in ("train", "test"):
        dataset.to_parquet(tmp_path / "ds" / "data" / f"{split}-00000-of-00001.parquet")

    split, _ = load_split(str(tmp_path / "ds"), "test", None, None, None)
    trained = load_model(trained_run)
    with torch.no_grad():
        preprocess = BatchTransform(trained.preprocess.normalization, False, trained.config.channels_last)
        expected = trained.model(preprocess(split.images)).argmax(1)

    proc = run_cli(["--model", str(trained_run), "--format", "jsonl", "--top_k", "2", str(tmp_path / "images")],
                   cli_env, module="cifar_accel.predict")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [Path(r["file"]).name for r in rows] == sorted(f.name for f in files)
    by_name = {Path(r["file"]).name: r for r in rows}
    for file, label in zip(files, expected.tolist(), strict=True):
        row = by_name[file.name]
        assert row["top_k"][0]["class"] == CLASS_NAMES[label]
        assert len(row["top_k"]) == 2 and row["top_k"][0]["probability"] >= row["top_k"][1]["probability"]
    assert by_name["2_gray.png"]["converted_from"] == "L 32x32"
    assert by_name["3_large.jpg"]["converted_from"] == "RGB 57x41"
    assert "converted_from" not in by_name["0_png.png"]

    table = run_cli(["--model", str(trained_run), str(files[3])], cli_env, module="cifar_accel.predict")
    assert table.returncode == 0 and "(converted from RGB 57x41 to RGB 32x32)" in table.stdout


def test_evaluate_counts_each_image_for_its_own_class_whatever_the_splits_class_order(
    trained_run, tiny_dataset, tmp_path, capsys
):
    """The run's test images with the class order reversed, as an image folder of two of the classes, and with
    plain numbers for labels: each image counts for the model's class of the same name (of the same number, also for
    a model trained on numbers). A class the model does not know is refused in one line, and nothing is written."""

    def metrics(dataset: Path, *extra: str, model: Path = trained_run) -> dict:
        out = tmp_path / f"eval_{model.name}_{dataset.name}{len(extra)}"
        argv = ["--model", str(model), "--dataset_name", str(dataset), "--output_dir", str(out), *extra]
        assert run_main(evaluate_command.main, argv) == 0, capsys.readouterr().err
        return json.loads((out / "metrics.json").read_text())

    test = datasets.load_dataset(str(tiny_dataset), split="test")
    own = metrics(tiny_dataset)
    assert own["accuracy"] == read_results(trained_run)["test_accuracy"]

    reversed_names = datasets.ClassLabel(names=CLASS_NAMES[::-1])
    flipped = test.map(lambda row: {"label": 9 - row["label"]}).cast_column("label", reversed_names)
    flipped.to_parquet(tmp_path / "reversed" / "data" / "test-00000-of-00001.parquet")
    assert metrics(tmp_path / "reversed")["confusion_matrix"] == own["confusion_matrix"]

    for row in test:  # the images of classes 1 and 3 only, in an image folder: the imagefolder loader names them
        if row["label"] in (1, 3):
            folder = tmp_path / "two" / "test" / CLASS_NAMES[row["label"]]
            folder.mkdir(parents=True, exist_ok=True)
            row["img"].save(folder / f"{len(list(folder.iterdir()))}.png")
    two = metrics(tmp_path / "two")
    assert two["confusion_matrix"] == [
        row if i in (1, 3) else [0] * 10 for i, row in enumerate(own["confusion_matrix"])
    ]
    assert two["samples"] == sum(own["per_class"][i]["total"] for i in (1, 3)) > 0

    test.cast_column("label", datasets.Value("int64")).to_parquet(tmp_path / "numbers" / "data" / "test.parquet")
    few = metrics(tmp_path / "numbers", "--max_eval_samples", "5")  # 5 images: classes 0 to 4 only
    assert few["confusion_matrix"] == metrics(tiny_dataset, "--max_eval_samples", "5")["confusion_matrix"]

    numbered_run = tmp_path / "numbered_run"  # trained on numbers, so its classes are '0' to '9'
    shutil.copy(tmp_path / "numbers" / "data" / "test.parquet", tmp_path / "numbers" / "data" / "train.parquet")
    assert train_in_process(tiny_args(tmp_path / "numbers", numbered_run, "--num_train_epochs", "1")) == 0
    by_number = metrics(tiny_dataset, model=numbered_run)  # named classes: taken by number
    assert by_number["accuracy"] == read_results(numbered_run)["test_accuracy_no_tta"]

    (tmp_path / "two" / "test" / CLASS_NAMES[3]).rename(tmp_path / "two" / "test" / "lorry")
    out = tmp_path / "unknown"
    argv = ["--model", str(trained_run), "--dataset_name", str(tmp_path / "two"), "--output_dir", str(out)]
    capsys.readouterr()
    assert run_main(evaluate_command.main, argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: the 'test' split has images of classes the model does not know ('lorry'); its 10 ")
    assert err.count("\n") == 1 and not out.exists()


def test_many_images_go_through_the_network_in_evaluation_batches(trained_run):
    """120 images at once are three batches of the run's --per_device_eval_batch_size (50), so a folder of any
    size takes the memory of one batch; the probabilities are those of the whole batch at once."""
    trained = load_model(trained_run)
    images = torch.stack([torch.tensor(np.asarray(image)).permute(2, 0, 1) for image in make_images(120, seed=6)[0]])
    seen = []
    hook = trained.model.register_forward_pre_hook(lambda module, inputs: seen.append(len(inputs[0])))
    probabilities = trained.probabilities(images)
    hook.remove()
    assert seen == [50, 50, 20]
    with torch.no_grad():
        whole = trained.model(trained.preprocess(images)).softmax(1)
    assert torch.equal(probabilities.argmax(1), whole.argmax(1))
    assert torch.allclose(probabilities, whole, rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    ("name", "line"),
    [
        ("nothere.png", "'nothere.png' does not exist; pass image files or folders of images"),
        ("https://example.com/cat.jpg", "'https://example.com/cat.jpg' is a web address, and predict reads files: "
                                        "download the image (curl -O URL), then pass it"),
        ("-", "'-' is not a file: predict reads image files, not standard input; pass the files or their folder"),
        ("photos/*.png", "no file is named 'photos/*.png': the shell expands such a pattern before predict starts, "
                         "unless it is quoted or matches no file; leave it unquoted, or pass its folder (photos)"),
    ],
    ids=["missing", "web-address", "standard-input", "quoted-pattern"],
)  # fmt: skip
def test_an_image_that_does_not_exist_is_one_line_that_names_the_likely_mistake(trained_run, name, line, capsys):
    """A web address, '-' and a quoted pattern were each 'does not exist; pass image files or folders of images'."""
    assert run_main(predict.main, ["--model", str(trained_run), name]) == 2
    assert capsys.readouterr() == ("", f"error: {line}\n")


@pytest.mark.parametrize(
    ("model", "line"),
    [
        ("you/cifar10-fast",
         "no model at 'you/cifar10-fast': no such folder here; if it names a model on the Hugging Face Hub, download "
         "it first with `hf download you/cifar10-fast --local-dir cifar10-fast`, then pass that folder"),
        ("https://huggingface.co/you/cifar10-fast/tree/main",
         "no model at 'https://huggingface.co/you/cifar10-fast/tree/main': a model on the Hugging Face Hub is read "
         "from a local copy: download it with `hf download you/cifar10-fast --local-dir cifar10-fast`, then pass that "
         "folder"),
        ("runs/first", "no model weights at 'runs/first'; pass a run folder, a checkpoint folder or a .safetensors"),
        ("run.safetensors", "no model weights at 'run.safetensors'; pass a run folder, a checkpoint folder or a "
                            ".safetensors"),
    ],
    ids=["hub-id", "hub-address", "local-folder", "local-file"],
)  # fmt: skip
def test_a_model_that_is_not_here_says_whether_it_may_be_on_the_hub(model, line, tmp_path, monkeypatch, capsys):
    """A run pushed with --push_to_hub, named by its Hub id or address, was 'no model weights at ...'; a path whose
    first folder exists here (runs/) is a local path whatever it looks like."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    (tmp_path / "cat.png").write_bytes(b"")
    assert run_main(predict.main, ["--model", model, "cat.png"]) == 2
    assert capsys.readouterr() == ("", f"error: {line}\n")
    with pytest.raises(InputError, match=re.escape(line)):
        load_model(model)


def test_predicts_table_gives_each_image_one_line_whatever_its_name(trained_run, tmp_path, capsys):
    """Linux allows a newline in a file's name, and the table printed it as it was: one image's row on two lines.
    A control character is printed as its escape (the JSON lines escape it themselves)."""
    folder = tmp_path / "photos"
    folder.mkdir()
    for name, image in zip(["new\nline.png", "tab\there.png", "plain.png"], make_images(3, seed=8)[0], strict=True):
        image.save(folder / name)
    (folder / "broken\n.png").write_bytes(b"")
    assert run_main(predict.main, ["--model", str(trained_run), str(folder)]) == 0
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert err == "" and len(lines) == 4, out
    assert [line.split(": ")[0] for line in lines] == [
        f"{folder}/new\\nline.png",
        f"{folder}/plain.png",
        f"{folder}/tab\\there.png",
        f"{folder}/broken\\n.png",
    ]
    assert lines[-1].endswith("skipped, cannot be read (UnidentifiedImageError: cannot identify image file "
                              f"'{folder}/broken\\n.png')")  # fmt: skip
    assert run_main(predict.main, ["--model", str(trained_run), str(folder), "--format", "jsonl"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [Path(row["file"]).name for row in rows] == ["new\nline.png", "plain.png", "tab\there.png", "broken\n.png"]


def test_predict_takes_flags_between_its_images(trained_run, tmp_path, capsys):
    """`predict --model RUN cat.png --top_k 1 dog.png` was refused: "unknown argument 'dog.png'"."""
    names = ["cat.png", "dog.png", "frog.png"]
    for name, image in zip(names, make_images(3, seed=9)[0], strict=True):
        image.save(tmp_path / name)
    cat, dog, frog = (str(tmp_path / name) for name in names)
    argv = ["--model", str(trained_run), cat, "--top_k", "1", dog, "--format", "jsonl", frog]
    assert run_main(predict.main, argv) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [row["file"] for row in rows] == [cat, dog, frog] and [len(row["top_k"]) for row in rows] == [1, 1, 1]
    assert run_main(predict.main, ["--model", str(trained_run), cat, "--topk", "1", dog]) == 2
    assert capsys.readouterr().err == "error: unknown argument '--topk'; did you mean '--top_k'?\n"


def test_predict_skips_a_folders_unreadable_images_and_refuses_a_named_one(trained_run, cli_env, tmp_path, capsys):
    folder = tmp_path / "photos"
    folder.mkdir()
    for i, image in enumerate(make_images(3, seed=7)[0]):
        image.save(folder / f"{i}.png")
    (folder / "empty.jpg").write_bytes(b"")
    (folder / "cut.png").write_bytes((folder / "0.png").read_bytes()[:60])  # a download that stopped early
    (folder / "pointer.png").write_text(GIT_LFS_POINTER)  # a clone without git-lfs
    proc = run_cli(["--model", str(trained_run), str(folder), "--format", "jsonl"], cli_env,
                   module="cifar_accel.predict")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [Path(row["file"]).name for row in rows if "top_k" in row] == ["0.png", "1.png", "2.png"]
    skipped = {Path(row["file"]).name: row["skipped"] for row in rows if "skipped" in row}
    assert sorted(skipped) == ["cut.png", "empty.jpg", "pointer.png"]
    assert all(reason.startswith("cannot be read (") for reason in skipped.values())
    assert "a Git LFS pointer, not the image;" in skipped["pointer.png"] and "git lfs pull" in skipped["pointer.png"]
    (folder / "pointer.png").unlink()

    # The refusals, in process: the same main as the command line's.
    assert run_main(predict.main, ["--model", str(trained_run), str(folder / "0.png"), str(folder / "cut.png")]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1
    assert err.startswith(f"error: cannot read image '{folder / 'cut.png'}' (")

    (folder / "0.png").write_bytes(b"")
    for name in ("1.png", "2.png"):
        (folder / name).unlink()
    assert run_main(predict.main, ["--model", str(trained_run), str(folder)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("error: no image could be read (3 image files found): ")
    for name in ("0.png", "cut.png"):
        (folder / name).unlink()
    assert run_main(predict.main, ["--model", str(trained_run), str(folder)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("error: no image could be read (1 image file found): ")


def test_predict_on_a_folder_of_class_folders_names_them(trained_run, tmp_path, capsys):
    """An image folder dataset's split (test/cat/1.png, ...): its subfolders are not searched, and the line says so
    where there is nothing else to classify."""
    for name in ("cat", "dog"):
        (tmp_path / "test" / name).mkdir(parents=True)
        make_images(1, seed=7)[0][0].save(tmp_path / "test" / name / "1.png")
    assert run_main(predict.main, ["--model", str(trained_run), str(tmp_path / "test")]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == (
        f"error: no image files found in {tmp_path / 'test'}; a folder's subfolders are not searched, so name them "
        f"({tmp_path / 'test' / 'cat'}, {tmp_path / 'test' / 'dog'})\n"
    )
    assert run_main(predict.main, ["--model", str(trained_run), *(str(p) for p in (tmp_path / "test").iterdir())]) == 0


def test_evaluation_with_two_ranks_counts_every_sample_once(trained_run, cli_env, torchrun, tmp_path):
    """torchrun with CPU forced gives two real gloo ranks; 83 test images in batches of 50 split unevenly."""
    env = {**cli_env, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1"}
    proc = run_cli(["--model", str(trained_run), "--cpu", "--output_dir", str(tmp_path / "two")], env,
                   module="cifar_accel.evaluate", launcher=torchrun)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert evaluate(trained_run, cli_env, "--output_dir", str(tmp_path / "one")).returncode == 0
    one, two = (json.loads((tmp_path / n / "metrics.json").read_text()) for n in ("one", "two"))
    assert two["num_processes"] == 2 and one["num_processes"] == 1
    assert two["samples"] == one["samples"] == 83
    assert two["accuracy"] == one["accuracy"] and two["confusion_matrix"] == one["confusion_matrix"]


def test_unconnected_ranks_of_evaluate_are_refused(trained_run, cli_env, torchrun, tmp_path):
    """torchrun without --cpu on a machine without a GPU (as a multi-GPU profile would start them) gives two
    unconnected ranks, each of which would evaluate everything and write the same report."""
    env = {**cli_env, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = run_cli(["--model", str(trained_run), "--output_dir", str(tmp_path / "out")], env,
                   module="cifar_accel.evaluate", launcher=torchrun)  # fmt: skip
    assert proc.returncode != 0
    errors = [error for error in proc.stderr.splitlines() if error.startswith("error: ")]
    line = (
        "error: 2 processes were started but they are not connected into one process group; this machine has no "
        "GPU for a multi-GPU launch to join them with; launch with 'torchrun --nproc_per_node N -m "
        "cifar_accel.evaluate --cpu'"
    )
    assert 1 <= len(errors) <= 2 and set(errors) == {line}  # one per rank, unless torchrun stops the other first
    assert "accuracy" not in proc.stdout and not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("command", "argv"),
    [
        (predict, ["--model", "{run}", "{image}"]),
        (export, ["--model", "{run}", "--format", "pt2", "--output", "{out}.pt2"]),
        (compare, ["--output_dir", "{out}", "--dataset_name", "{data}"]),
    ],
)
def test_commands_of_one_process_refuse_a_launch_of_two(
    trained_run, tiny_dataset, tmp_path, monkeypatch, capsys, command, argv
):
    """predict and export work in one process, and compare starts its runs' processes itself: each copy that a
    launcher starts (it sets WORLD_SIZE, here 2) would print and write everything again."""
    image = tmp_path / "cat.png"
    make_images(1, seed=5)[0][0].save(image)
    argv = [arg.format(run=trained_run, image=image, out=tmp_path / "out", data=tiny_dataset) for arg in argv]
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert run_main(command.main, argv) == 2
    out, err = capsys.readouterr()
    name = command.__name__
    assert err == f"error: {name} runs in one process, and 2 were started; run it with 'python -m {name}'\n"
    assert out == "" and not list(tmp_path.glob("out*"))


def test_the_documented_python_example_runs_and_agrees_with_the_model(trained_run, tmp_path, monkeypatch, capsys):
    readme = (REPO / "docs" / "evaluation.md").read_text()
    example = next(block for block in readme.split("```python\n")[1:] if "from cifar_accel import load_model" in block)
    example = example.split("```")[0]
    (tmp_path / "outputs").mkdir()
    shutil.copytree(trained_run, tmp_path / "outputs" / "cifar10")
    cat = make_images(1, seed=5)[0][0].resize((48, 40))  # converted to 32x32 as a training image would be
    cat.save(tmp_path / "cat.png")
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(example, "evaluation.md", "exec"), namespace)  # noqa: S102 - the documentation's own example

    class_names, top3, rotated = capsys.readouterr().out.strip().splitlines()
    assert class_names == str(CLASS_NAMES)
    classifier = namespace["classifier"]
    # The file as predict reads it, and the PIL image turned a quarter, each a batch of one as in the example.
    arrays = (to_rgb32(tmp_path / "cat.png")[0], image_to_rgb32(Image.open(tmp_path / "cat.png").rotate(90))[0])
    for line, array, k in zip((top3, rotated), arrays, (3, 1), strict=True):
        with torch.no_grad():
            best = classifier.model(classifier.preprocess(torch.tensor(array)[None])).softmax(1)[0].topk(k)
        assert line == str([[(CLASS_NAMES[i], float(p)) for p, i in zip(best.values, best.indices, strict=True)]])
    assert namespace["probabilities"].shape == (4, 10)
    assert torch.allclose(namespace["probabilities"].sum(1), torch.ones(4))
    assert namespace["logits"].shape == (4, 10) and not classifier.model.training
    with pytest.raises(ValueError, match=r"uint8 tensor of shape \(N, 3, 32, 32\) or \(3, 32, 32\), got torch.float32"):
        classifier.predict(torch.zeros(2, 3, 32, 32))


def test_a_run_on_a_relative_dataset_path_is_evaluated_from_any_folder(tiny_dataset, cli_env, tmp_path, monkeypatch):
    """The run records the dataset's absolute path, which evaluate and export read when not given another."""
    monkeypatch.chdir(tiny_dataset.parent)
    out = tmp_path / "run"
    assert train_in_process(tiny_args(f"./{tiny_dataset.name}", out)) == 0
    assert f"dataset_name: {tiny_dataset.resolve()}\n" in (out / "config.yaml").read_text()
    monkeypatch.chdir(tmp_path)  # the subprocess starts here, where ./tiny... does not exist
    proc = evaluate(out, cli_env)
    assert proc.returncode == 0, proc.stderr
    metrics = json.loads((out / "eval_test" / "metrics.json").read_text())
    assert metrics["accuracy"] == read_results(out)["test_accuracy"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="fp16 runs on this machine's GPU")
@pytest.mark.parametrize("module", ["evaluate", "predict"])
def test_fp16_on_a_cpu_says_it_runs_in_fp32(trained_run, cli_env, tmp_path, module):
    """Accelerate replaces fp16 by fp32 on a CPU without a word; evaluate and predict say so, as training does."""
    make_images(1, seed=3)[0][0].save(tmp_path / "a.png")
    inputs = ["--output_dir", str(tmp_path / "eval")] if module == "evaluate" else [str(tmp_path / "a.png")]
    proc = run_cli(["--model", str(trained_run), "--mixed_precision", "fp16", *inputs], cli_env,
                   module=f"cifar_accel.{module}")  # fmt: skip
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    warnings = [line for line in proc.stdout.splitlines() if "mixed precision 'fp16' is not available on cpu" in line]
    work = "evaluation" if module == "evaluate" else "prediction"
    assert len(warnings) == 1 and f"{work} runs in fp32" in warnings[0]
    if module == "evaluate":
        assert json.loads((tmp_path / "eval" / "metrics.json").read_text())["mixed_precision"] == "no"


def test_summarize_runs_tables_finished_runs_and_refuses_a_folder_without_results(trained_run, tmp_path, capsys):
    copy = shutil.copytree(trained_run, tmp_path / "copy")
    assert run_main(summarize_runs.main, [str(trained_run), str(copy)]) == 0
    out = capsys.readouterr().out
    results = read_results(trained_run)
    assert f"| {trained_run.name} | {results['mixed_precision']} | {results['epochs_completed']} | " in out
    assert f"2 runs: test accuracy mean {results['test_accuracy']:.4f}, min {results['test_accuracy']:.4f}" in out
    assert run_main(summarize_runs.main, [str(tmp_path)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith(f"error: {tmp_path / 'results.json'} is not the results.json of a finished run")
    # The same run twice, through a link to it too, would count twice in the mean.
    (tmp_path / "link").symlink_to(copy)
    assert run_main(summarize_runs.main, [str(copy), str(tmp_path / "link")]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == f"error: '{tmp_path / 'link'}' is the run '{copy}' again; give each run once\n"
    loop = tmp_path / "loop"
    loop.symlink_to(loop)  # stopped with pathlib's RuntimeError, exit 1
    assert run_main(summarize_runs.main, [str(copy), str(loop)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith(f"error: argument run_dirs: the path goes through the symbolic link '{loop}'")


def with_changes(run: Path, folder: Path, config: dict | None = None, results: dict | None = None) -> Path:
    """A copy of ``run`` whose config.yaml and results.json say it was trained with other values."""
    copy = shutil.copytree(run, folder)
    for name, changes in (("config.yaml", config), ("results.json", results)):
        text = (copy / name).read_text()
        values = yaml.safe_load(text) if name.endswith(".yaml") else json.loads(text)
        values.update(changes or {})
        (copy / name).write_text(yaml.safe_dump(values) if name.endswith(".yaml") else json.dumps(values))
    return copy


def test_summarize_runs_averages_seeds_of_one_recipe_only(trained_run, tmp_path, capsys):
    """A mean over runs of other settings or precisions (fp32 beside bf16, say) is no recipe's result: those get
    the table, and what keeps them apart instead."""
    seed = with_changes(trained_run, tmp_path / "seed", config={"seed": 7}, results={"test_accuracy": 0.25})
    rate = with_changes(trained_run, tmp_path / "rate", config={"learning_rate": 0.5})
    bf16 = with_changes(trained_run, tmp_path / "bf16", results={"mixed_precision": "bf16"})
    accuracy = read_results(trained_run)["test_accuracy"]
    assert run_main(summarize_runs.main, [str(trained_run), str(seed)]) == 0
    out = capsys.readouterr().out
    assert f"2 runs: test accuracy mean {(accuracy + 0.25) / 2:.4f}, min 0.2500" in out
    assert run_main(summarize_runs.main, [str(trained_run), str(seed), str(rate), str(bf16)]) == 0
    out = capsys.readouterr().out
    assert len([line for line in out.splitlines() if line.startswith("| ")]) == 5 and "runs: test accuracy" not in out
    assert out.endswith(
        f"no mean: the runs are not seeds of one recipe ({rate} has learning_rate 0.5 (not 0.001); {bf16} has "
        "precision 'bf16' (not 'no'))\n"
    )
