"""Bad input and misuse, each through the CLI (a real subprocess, or its entry point in this process where the
subprocess would add only seconds): exit code, one clear line on stderr, nothing lost."""

from __future__ import annotations

import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import datasets
import numpy as np
import pytest
from PIL import Image

from conftest import (
    CLASS_NAMES,
    FEATURES,
    GIT_LFS_POINTER,
    corrupt_dataset,
    good_split,
    make_images,
    read_results,
    run_cli,
    run_on_a_small_disk,
    snapshot,
    tiny_args,
    write_split_files,
)


@pytest.fixture(scope="module")
def finished_run(tiny_dataset: Path, cli_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished one-epoch run on the tiny dataset, for the tests of what evaluate refuses."""
    run = tmp_path_factory.mktemp("finished") / "run"
    assert run_cli(tiny_args(tiny_dataset, run), cli_env).returncode == 0
    return run


def empty_test_split(root: Path) -> Path:
    return write_split_files(root, good_split(), good_split().select([]))


def labels_out_of_range(root: Path) -> Path:
    features = datasets.Features({"img": datasets.Image(), "label": datasets.Value("int64")})
    images, labels = make_images(40, 0)
    labels[5] = -3
    train = datasets.Dataset.from_dict({"img": images, "label": labels}, features=features)
    test = datasets.Dataset.from_dict({"img": images[:10], "label": list(range(10))}, features=features)
    return write_split_files(root, train, test)


def unlabelled(count: int, seed: int) -> datasets.Dataset:
    """Images whose labels `datasets` marks as missing, as on the Hub where a test split's are kept back."""
    return good_split(count, seed).map(lambda row: {"label": -1})


def a_missing_label(root: Path) -> Path:
    labelled = good_split(20, seed=1)
    return write_split_files(root, good_split(), datasets.concatenate_datasets([labelled, unlabelled(1, seed=3)]))


def unlabelled_test_split(root: Path) -> Path:
    return write_split_files(root, good_split(), unlabelled(20, seed=1))


def unlabelled_validation_split(root: Path) -> Path:
    write_split_files(root, good_split(), good_split(20, seed=2))
    unlabelled(20, seed=1).to_parquet(root / "data" / "validation-00000-of-00001.parquet")
    return root


def no_label_column(root: Path) -> Path:
    features = datasets.Features({"img": datasets.Image(), "category": datasets.Value("int64")})
    images, labels = make_images(40, 0)
    split = datasets.Dataset.from_dict({"img": images, "category": labels}, features=features)
    return write_split_files(root, split, split)


def no_image_column(root: Path) -> Path:
    features = datasets.Features({"pixels": datasets.Value("string"), "label": datasets.ClassLabel(names=CLASS_NAMES)})
    split = datasets.Dataset.from_dict({"pixels": ["a"] * 10, "label": list(range(10))}, features=features)
    return write_split_files(root, split, split)


def git_lfs_pointers(root: Path) -> Path:
    """A dataset repository cloned without git-lfs: each parquet file is the pointer that stands for it."""
    write_split_files(root, good_split(), good_split())
    for path in root.glob("data/*.parquet"):
        path.write_text(GIT_LFS_POINTER)
    return root


def git_lfs_pointer_image(root: Path) -> Path:
    """An image folder cloned without git-lfs: its PNG files are pointers."""
    for split in ("train", "test"):
        for index, class_name in enumerate(CLASS_NAMES[:2] * 40):
            folder = root / split / class_name
            folder.mkdir(parents=True, exist_ok=True)
            (folder / f"{index}.png").write_text(GIT_LFS_POINTER)
    return root


def cifar10_python_version(root: Path) -> Path:
    """CIFAR-10's pickled batches as torchvision downloads them (a few images each)."""
    root.mkdir(parents=True)
    images, labels = make_images(20, 0)
    rows = np.stack([np.asarray(image).transpose(2, 0, 1).reshape(-1) for image in images])
    for name in ("data_batch_1", "data_batch_2", "test_batch"):
        batch = {b"batch_label": name.encode(), b"labels": labels, b"data": rows, b"filenames": [b"x.png"] * 20}
        (root / name).write_bytes(pickle.dumps(batch))
    (root / "batches.meta").write_bytes(pickle.dumps({b"label_names": [n.encode() for n in CLASS_NAMES]}))
    return root


def cifar100_in_torchvisions_folder(root: Path) -> Path:
    """torchvision's root folder (its `root=` argument) holding CIFAR-100's python version, as files named so."""
    (root / "cifar-100-python").mkdir(parents=True)
    for name in ("meta", "train", "test"):
        (root / "cifar-100-python" / name).write_bytes(pickle.dumps({b"fine_labels": [0]}))
    return root


def bad_yaml(root: Path) -> Path:
    root.mkdir()
    (root / "bad.yaml").write_text("learning_rate: [0.1\n")
    return root / "bad.yaml"


def one_parquet_file(root: Path) -> Path:
    """A dataset's file, passed where its folder belongs."""
    write_split_files(root, good_split(), good_split())
    return next(root.glob("data/train-*.parquet"))


def one_class(root: Path) -> Path:
    features = datasets.Features({"img": datasets.Image(), "label": datasets.Value("int64")})
    rows = datasets.Dataset.from_dict({"img": make_images(20, 0)[0], "label": [0] * 20}, features=features)
    return write_split_files(root, rows, rows)


def run_folder(root: Path) -> Path:
    """A run folder with two checkpoints (as far as a lookup sees them), passed where one of them belongs."""
    for step in (4, 8):
        (root / "checkpoints" / f"step_{step:08d}").mkdir(parents=True)
        (root / "checkpoints" / f"step_{step:08d}" / "trainer_state.json").write_text("{}")
    return root


def run_folder_with_its_config(root: Path) -> Path:
    """A run folder, passed to --config where its config.yaml belongs."""
    root.mkdir()
    (root / "config.yaml").write_text("num_train_epochs: 1\n")
    return root


def unknown_key_yaml(root: Path) -> Path:
    root.mkdir()
    (root / "c.yaml").write_text("num_epochs: 3\n")
    return root / "c.yaml"


# (id, flags, expected exit code, words the error line must contain); "{data}" is the tiny dataset,
# "{made}" a file or dataset that the case's maker writes.
CASES = [
    ("unknown-flag", ["--learning_rat", "0.1"], 2, ["--learning_rat", "did you mean '--learning_rate'"]),
    ("unknown-key", ["--config", "{made}"], 2, ["num_epochs", "did you mean 'num_train_epochs'"]),
    ("wrong-type", ["--per_device_train_batch_size", "sixty"], 2, ["per_device_train_batch_size", "invalid int"]),
    ("lr-zero", ["--learning_rate", "0"], 2, ["learning_rate", "> 0"]),
    ("batch-zero", ["--per_device_train_batch_size", "0"], 2, ["per_device_train_batch_size", ">= 1"]),
    ("val-ratio-one", ["--val_ratio", "1"], 2, ["val_ratio", "< 1"]),
    ("val-ratio-negative", ["--val_ratio", "-0.1"], 2, ["val_ratio", ">= 0"]),
    ("epochs-zero", ["--num_train_epochs", "0"], 2, ["num_train_epochs", ">= 1"]),
    ("patience-negative", ["--early_stopping_patience", "-1"], 2, ["early_stopping_patience", ">= 0"]),
    ("clip-zero", ["--max_grad_norm", "0"], 2, ["max_grad_norm", "> 0"]),
    # Beyond float32, which training computes them in: a RuntimeError or ValueError of torch's, exit code 1.
    ("cutmix-alpha-beyond-float32", ["--cutmix_alpha", "1e39"], 2, ["'cutmix_alpha' is 1e+39, outside the "
     "range of the float32 it is computed in (1.175e-38 to 3.403e+38 in size, or 0)"]),
    ("brightness-too-large", ["--brightness_shift", "1e39"], 2, ["'brightness_shift' must be <= 1000000, got 1e+39"]),
    ("weight-decay-beyond-float32", ["--weight_decay", "1e308"], 2, ["'weight_decay' is 1e+308, outside"]),
    ("mixup-alpha-below-float32", ["--mixup_alpha", "5e-324"], 2, ["'mixup_alpha' is 5e-324, outside"]),
    ("lr-that-overflows-adam", ["--learning_rate", "3e38"], 2, ["'learning_rate' must be <= 1000000, got 3e+38"]),
    ("eval-batch-beyond-int64", ["--per_device_eval_batch_size", str(2**64)], 2, [
     f"'per_device_eval_batch_size' is {2**64}, beyond the 64-bit integers it is counted in (up to {2**63 - 1})"]),
    ("unknown-scheduler", ["--lr_scheduler_type", "exponential"], 2, ["lr_scheduler_type", "invalid choice"]),
    ("unknown-model", ["--model_name", "resnet50"], 2, ["model_name", "invalid choice"]),
    ("unknown-precision", ["--mixed_precision", "fp8"], 2, ["mixed_precision", "invalid choice"]),
    ("yaml-does-not-parse", ["--config", "{made}"], 2, ["not valid YAML", "at line 2"]),
    ("config-file-missing", ["--config", "/nonexistent/c.yaml"], 2, ["cannot read config file"]),
    ("config-is-a-run-folder", ["--config", "{made}"], 2,
     ["made is a folder; pass its config.yaml (", "made/config.yaml)"]),
    ("dataset-missing", ["--dataset_name", "/nonexistent/cifar"], 2, ["does not exist", "--dataset_name"]),
    ("dataset-mistyped-local-path", ["--dataset_name", "tests/cifar10"], 2,
     ["cannot load dataset 'tests/cifar10': tests/ holds no 'cifar10', and as a Hub id it failed too (",
      "); check the path"]),
    ("dataset-is-a-file", ["--dataset_name", "{made}"], 2, ["train-", "is a file; pass the dataset's folder"]),
    ("no-label-column", ["--dataset_name", "{made}"], 2, ["label column 'label' not found", "--label_column_name"]),
    ("no-image-column", ["--dataset_name", "{made}"], 2, ["no image column", "--image_column_name"]),
    ("wrong-image-column", ["--dataset_name", "{data}", "--image_column_name", "picture"], 2,
     ["image column 'picture' not found", "img"]),
    ("not-an-image-column", ["--dataset_name", "{data}", "--image_column_name", "label"], 2,
     ["image column 'label' holds ClassLabel, not images (Image columns: img)", "--image_column_name"]),
    ("corrupt-image", ["--dataset_name", "{made}"], 2, ["image 17", "cannot be decoded"]),
    ("cifar10-python-version", ["--dataset_name", "{made}"], 2,
     ["it holds CIFAR-10's python version (the pickled batches that torchvision downloads), which datasets does not "
      "read; pass --dataset_name uoft-cs/cifar10 (downloaded once"]),
    ("cifar100-in-torchvisions-folder", ["--dataset_name", "{made}"], 2,
     ["it holds CIFAR-100's python version", "pass --dataset_name uoft-cs/cifar100 ("]),
    ("git-lfs-pointers", ["--dataset_name", "{made}"], 2,
     ["-00000-of-00001.parquet is a Git LFS pointer, not the data it stands for; a clone without git-lfs leaves these; "
      "run `git lfs install` and `git lfs pull` in the repository"]),
    ("git-lfs-pointer-image", ["--dataset_name", "{made}"], 2,
     ["train image 0 (column 'image', file ", "0.png) is a Git LFS pointer, not the image;", "`git lfs pull`"]),
    ("empty-split", ["--dataset_name", "{made}"], 2, ["has an empty split", "\"test\""]),
    ("label-out-of-range", ["--dataset_name", "{made}"], 2, ["label -3 at index 5"]),
    ("a-missing-label", ["--dataset_name", "{made}"], 2,
     ["test label at index 20 is missing (-1, datasets' mark for a missing label)", "drop the rows without labels"]),
    ("unlabelled-test-split", ["--dataset_name", "{made}"], 2,
     ["the 'test' split has no labels (-1 in every row", "give a dataset whose test split is labelled"]),
    ("unlabelled-validation-split", ["--dataset_name", "{made}"], 2,
     ["the 'validation' split has no labels (-1 in every row", "train without validation with --val_ratio 0"]),
    ("one-class", ["--dataset_name", "{made}"], 2, ["has one class ('0', label column 'label')", "two or more"]),
    ("resume-missing", ["--dataset_name", "{data}", "--resume_from_checkpoint", "/nonexistent/ckpt"], 2,
     ["does not exist"]),
    ("resume-run-folder", ["--dataset_name", "{data}", "--resume_from_checkpoint", "{made}"], 2,
     ["holds checkpoints but is not one; pass one, such as the newest: ", "checkpoints/step_00000008"]),
    ("resume-checkpoints-folder", ["--dataset_name", "{data}", "--resume_from_checkpoint", "{made}/checkpoints"], 2,
     ["/checkpoints' holds checkpoints but is not one", "checkpoints/step_00000008"]),
    ("config-empty", ["--config", ""], 2, ["--config is empty", "leave --config out for the default recipe"]),
    ("nesterov-from-preset", ["--config", "fast", "--optimizer", "adam"], 2,
     ["Nesterov momentum ('nesterov' in the fast preset)", "but --optimizer is adam", "add --no-nesterov"]),
    ("warmup-without-per-step-schedule", ["--warmup_ratio", "0.1"], 2,
     ["a warm-up (--warmup_ratio) needs a per-step schedule", "'lr_scheduler_type' (the default) is 'step'"]),
    ("whitening-bias-without-whitening", ["--whiten_bias_epochs", "3"], 2,
     ["--whiten_bias_epochs sets how long a whitening bias trains", "'simple_cnn', which has none"]),
    ("bias-lr-scale-without-bias-groups", ["--bias_lr_scale", "85"], 2,
     ["--bias_lr_scale scales the biases' learning rate", "'simple_cnn', which trains them at --learning_rate",
      "or --bias_lr_scale 64"]),
    ("conv-weight-grads-without-the-choice", ["--conv_weight_grads", "matmul"], 2,
     ["--conv_weight_grads chooses how fast_net's convolutions compute their weight gradients",
      "'simple_cnn', which has no such choice", "or --conv_weight_grads auto"]),
    ("whitening-bias-epoch-schedule", ["--config", "fast", "--lr_scheduler_type", "cosine"], 2,
     ["'whiten_bias_epochs' in the fast preset needs a per-step schedule", "--lr_scheduler_type is 'cosine'"]),
    ("early-crop-without-its-epochs", ["--early_crop_size", "24"], 2,
     ["--early_crop_size has no effect unless --early_crop_epochs is above 0, but 'early_crop_epochs' (the default) "
      "is 0; add --early_crop_epochs N"]),
    ("early-crop-too-small", ["--early_crop_size", "12", "--early_crop_epochs", "1"], 2,
     ["--early_crop_size is 12, under 16 pixels (half the images' 32)", "use 16 to 31, or 0"]),
    ("early-crop-whole-image", ["--early_crop_size", "32", "--early_crop_epochs", "1"], 2,
     ["'early_crop_size' must be <= 31, got 32"]),
    ("ns-dtype-unknown", ["--muon_ns_dtype", "float16"], 2, ["muon_ns_dtype", "invalid choice"]),
    ("idle-momentum", ["--momentum", "0.5"], 2,
     ["--momentum has no effect unless --optimizer is sgd or muon, but 'optimizer' (the default) is 'adam'; leave "
      "--momentum out, or change that"]),
    ("idle-patience", ["--val_ratio", "0", "--patience", "3"], 2,
     ["--early_stopping_patience has no effect unless --val_ratio is above 0 (it watches validation accuracy), but "
      "--val_ratio is 0;"]),
    ("idle-muon-after-preset", ["--config", "fast", "--optimizer", "sgd", "--muon_ns_steps", "5"], 2,
     ["--muon_ns_steps has no effect unless --optimizer is muon, but --optimizer is 'sgd';"]),
    ("optional-number-as-a-word", ["--max_grad_norm", "off"], 2, ["--max_grad_norm: expected a number or none"]),
    ("validation-leaves-too-few", ["--dataset_name", "{data}", "--val_ratio", "0.95"], 2,
     ["training images are fewer than one batch of 64", "or lower --val_ratio (311 held out for validation)"]),
    ("validation-takes-all", ["--dataset_name", "{data}", "--val_ratio", "0.999"], 2,
     ["--val_ratio 0.999 leaves no training images out of", "; lower it (0 trains on all of them)"]),
    ("max-train-samples-too-few", ["--dataset_name", "{data}", "--max_train_samples", "20", "--val_ratio", "0"], 2,
     ["20 training images are fewer than one batch of 64; lower --per_device_train_batch_size, or raise "
      "--max_train_samples"]),
]  # fmt: skip
MAKERS = {
    "dataset-is-a-file": one_parquet_file,
    "unknown-key": unknown_key_yaml,
    "yaml-does-not-parse": bad_yaml,
    "no-label-column": no_label_column,
    "no-image-column": no_image_column,
    "corrupt-image": corrupt_dataset,
    "cifar10-python-version": cifar10_python_version,
    "cifar100-in-torchvisions-folder": cifar100_in_torchvisions_folder,
    "git-lfs-pointers": git_lfs_pointers,
    "git-lfs-pointer-image": git_lfs_pointer_image,
    "one-class": one_class,
    "resume-run-folder": run_folder,
    "config-is-a-run-folder": run_folder_with_its_config,
    "resume-checkpoints-folder": run_folder,
    "empty-split": empty_test_split,
    "label-out-of-range": labels_out_of_range,
    "a-missing-label": a_missing_label,
    "unlabelled-test-split": unlabelled_test_split,
    "unlabelled-validation-split": unlabelled_validation_split,
}


# These go through a real subprocess, where anything else on stderr (a library's warning at import) would show; the
# other cases run the same entry point in this process (train_here), seconds faster each.
THROUGH_THE_CLI = {"unknown-flag", "yaml-does-not-parse", "dataset-missing", "dataset-mistyped-local-path",
                   "corrupt-image", "git-lfs-pointers", "resume-missing", "nesterov-from-preset",
                   "idle-momentum"}  # fmt: skip


@pytest.fixture
def earlier_output(tmp_path) -> Path:
    """An output folder that already holds a user's file, which no failing run may touch."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("results of an earlier experiment\n")
    return out


@pytest.mark.parametrize(("case", "flags", "code", "words"), CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_and_an_exit_code(tiny_dataset, cli_env, train_here, tmp_path, earlier_output, case,
                                                flags, code, words):  # fmt: skip
    made = MAKERS[case](tmp_path / "made") if case in MAKERS else None
    args = [a.format(data=tiny_dataset, made=made) for a in flags]
    before = snapshot(earlier_output)

    argv = ["--output_dir", str(earlier_output), "--num_train_epochs", "1", *args]
    proc = run_cli(argv, cli_env) if case in THROUGH_THE_CLI else train_here(argv)

    assert proc.returncode == code, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: ") and "Traceback" not in proc.stderr
    for word in words:
        assert word in lines[0]
    assert snapshot(earlier_output) == before


@pytest.mark.parametrize("case", ["corrupt-image", "resume-missing"])
def test_bad_input_found_after_the_output_folder_is_made_leaves_no_folder(tiny_dataset, cli_env, tmp_path, case):
    """The run makes its output folder (and its parents) first, to lock it; input found bad later, while the data
    loads or the checkpoint is looked up, takes the empty folders away again."""
    (_, flags, code, words) = next(c for c in CASES if c[0] == case)
    made = MAKERS[case](tmp_path / "made") if case in MAKERS else None
    args = [a.format(data=tiny_dataset, made=made) for a in flags]
    proc = run_cli(["--output_dir", str(tmp_path / "new" / "run"), *args], cli_env)
    assert proc.returncode == code and words[0] in proc.stderr, proc.stderr
    assert not (tmp_path / "new").exists()


FLAG = "which Accelerate reads as true or false; set it to true or false (1 or 0), or unset it"
NUMBER = "where a launcher (torchrun, accelerate launch) puts a whole number; unset it, or start the command through "


@pytest.mark.parametrize(("module", "variable", "value", "words"), [
    ("cifar_accel.train", "ACCELERATE_USE_CPU", "Maybe", FLAG),
    ("cifar_accel.compare", "ACCELERATE_USE_DEEPSPEED", "Maybe", FLAG),
    ("cifar_accel.train", "LOCAL_RANK", "x", NUMBER),
    ("cifar_accel.train", "WORLD_SIZE", "2x", NUMBER),
])  # fmt: skip
def test_an_environment_variable_of_accelerate_or_a_launcher_with_a_bad_value_is_named(
    tiny_dataset, cli_env, tmp_path, module, variable, value, words
):
    """Accelerate reads flags as true or false and a launcher's numbers as whole numbers (so does the package, the
    process count), and their ValueError named neither the variable nor the fix: a run-time fault (exit code 1) for
    bad input."""
    flags = ["--dataset_name", str(tiny_dataset), "--output_dir", str(tmp_path / "out")]
    proc = run_cli(flags, {**cli_env, variable: value}, module=module)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith(f"error: {variable} is {value!r}, {words}") and len(proc.stderr.splitlines()) == 1
    assert not (tmp_path / "out").exists()


RENDEZVOUS = (
    "which torch.distributed needs to join the processes (a launcher, torchrun or accelerate launch, sets "
    "them all); unset them, or start the command through the launcher"
)
RANKS = (
    "where a launcher (torchrun, accelerate launch) numbers the processes from 0 to {} - 1; unset them, or start "
    "the command through the launcher"
)


@pytest.mark.parametrize(("module", "environment", "line"), [
    ("cifar_accel.train", {"LOCAL_RANK": "0"}, f"LOCAL_RANK is '0' but RANK is not set, {RENDEZVOUS}"),
    ("cifar_accel.train", {"LOCAL_RANK": "0", "RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"},
     f"WORLD_SIZE is '1' and RANK is '0' and LOCAL_RANK is '0' and MASTER_ADDR is '127.0.0.1' but MASTER_PORT is "
     f"not set, {RENDEZVOUS}"),
    ("cifar_accel.train", {"LOCAL_RANK": "0", "RANK": "1", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                           "MASTER_PORT": "29555"}, "RANK is 1 and WORLD_SIZE is 1, " + RANKS.format("WORLD_SIZE")),
    ("cifar_accel.evaluate", {"LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2", "RANK": "0", "WORLD_SIZE": "1",
                              "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29555"},
     "LOCAL_RANK is 2 and LOCAL_WORLD_SIZE is 2, " + RANKS.format("LOCAL_WORLD_SIZE")),
], ids=["local-rank-alone", "no-master-port", "rank-past-world-size", "local-rank-past-local-world-size"])  # fmt: skip
def test_a_launchers_variables_set_by_hand_in_part_or_out_of_range_are_named(
    tiny_dataset, finished_run, cli_env, tmp_path, module, environment, line
):
    """LOCAL_RANK makes Accelerate join the processes through torch's env:// rendezvous. Set without the others it
    needs, the run ended in torch's ValueError, exit code 1; with a RANK not below WORLD_SIZE (or a LOCAL_RANK not
    below LOCAL_WORLD_SIZE), the process waited for processes that never come, and neither SIGTERM nor Ctrl-C
    stopped it. Now one line each, exit code 2, before anything is written."""
    train = module == "cifar_accel.train"
    flags = tiny_args(tiny_dataset, tmp_path / "run") if train else ["--model", str(finished_run)]
    before = snapshot(finished_run)
    proc = run_cli(flags, {**cli_env, **environment}, module=module, timeout=120)
    assert (proc.returncode, proc.stderr) == (2, f"error: {line}\n")
    assert not (tmp_path / "run").exists() and snapshot(finished_run) == before


def test_a_libraries_log_line_is_printed_once(cli_env, tmp_path):
    """`datasets` logs the parquet reader's failure through its own handler, and its logger propagates to the root
    logger, where the command's handler printed it a second time."""
    proc = run_cli(["--dataset_name", str(git_lfs_pointers(tmp_path / "clone")), "--output_dir", str(tmp_path / "out")],
                   cli_env)  # fmt: skip
    assert proc.returncode == 2 and "is a Git LFS pointer" in proc.stderr, proc.stderr
    assert proc.stdout.count("Parquet magic bytes not found") == 1, proc.stdout


def test_odd_images_are_converted_with_a_note(cli_env, tmp_path):
    features = FEATURES
    odd = [Image.new("L", (32, 32), 90), Image.new("RGBA", (32, 32), (1, 2, 3, 4)), Image.new("RGB", (64, 48))]
    images, labels = make_images(60, 0)
    train = datasets.Dataset.from_dict({"img": odd + images[3:], "label": labels}, features=features)
    root = write_split_files(tmp_path / "odd", train, good_split(20, 1))
    out = tmp_path / "out"
    proc = run_cli(tiny_args(root, out, "--max_eval_samples", "10"), cli_env)
    assert proc.returncode == 0, proc.stderr
    assert "train: converted 3 images to 32x32 RGB" in proc.stdout


def test_output_dir_that_cannot_be_created(tiny_dataset, cli_env, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    proc = run_cli(tiny_args(tiny_dataset, blocker / "out"), cli_env)
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert "is not writable" in line and "--output_dir" in line
    proc = run_cli(tiny_args(tiny_dataset, blocker), cli_env)
    assert proc.returncode == 2
    assert proc.stderr == f"error: output directory '{blocker}' is a file; choose another --output_dir\n"
    assert blocker.read_text() == "not a folder"


@pytest.mark.parametrize(
    ("size", "reason"),
    [
        ("1800k", "Error while serializing: I/O error: No space left on device (os error 28)"),  # model.safetensors
        ("2100k", "a write fell short, so the disk is likely full: [enforce fail at"),  # optimizer.bin, by torch.save
    ],
    ids=["safetensors", "torch.save"],
)
def test_full_disk_during_a_save_keeps_the_previous_checkpoint(tiny_dataset, cli_env, tmp_path, size, reason):
    """The run writes into a small tmpfs (private mount namespace): epoch 1's checkpoint (about 1.2 MB) fits,
    epoch 2's does not. The run must stop with one line naming the cause, leave epoch 1's checkpoint whole, and
    resume from it."""
    mounted, kept = tmp_path / "small_disk", tmp_path / "copy"
    mounted.mkdir()
    args = tiny_args(tiny_dataset, mounted / "run", "--num_train_epochs", "2")
    error, status, _ = run_on_a_small_disk(mounted, size, args, cli_env, then=f"cp -r {mounted}/run {kept}")
    assert status == "exit=1"
    assert error.startswith(f"error: saving checkpoint step_00000018 failed ({reason}"), error
    assert "step_00000009 is intact" in error and "--resume_from_checkpoint latest" in error
    assert sorted(p.name for p in (kept / "checkpoints").iterdir()) == ["step_00000009"]

    resumed = run_cli(
        tiny_args(tiny_dataset, kept, "--num_train_epochs", "2", "--resume_from_checkpoint", "latest"), cli_env
    )
    assert resumed.returncode == 0, resumed.stderr
    assert read_results(kept)["epochs_completed"] == 2


def test_a_full_disk_when_the_final_weights_are_written_is_one_line_and_the_resume_finishes(
    tiny_dataset, cli_env, tmp_path
):
    """A finished run's checkpoints on a disk with 200 KiB to spare, too little for model.safetensors: its resume
    tests the model and fails to export it, in one line that says what to do; once there is room, that resume
    finishes the run."""
    src, mounted, kept = tmp_path / "src", tmp_path / "small_disk", tmp_path / "copy"
    mounted.mkdir()
    assert run_cli(tiny_args(tiny_dataset, src), cli_env).returncode == 0
    (src / "model.safetensors").unlink()
    (src / "results.json").unlink()
    run = mounted / "run"
    args = tiny_args(tiny_dataset, run, "--resume_from_checkpoint", "latest")
    room = f"$(( $(df -k --output=used {mounted} | tail -1) + 200 ))k"
    before = f"cp -r {src} {run} && mount -o remount,size={room} {mounted}"
    error, status, _ = run_on_a_small_disk(mounted, "64m", args, cli_env, then=f"cp -r {run} {kept}", before=before)
    assert status == "exit=1"
    assert error == (f"error: writing {run}/model.safetensors failed (No space left on device); free space on that "
                     "disk, then resume with --resume_from_checkpoint latest to test and export again")  # fmt: skip
    assert not (kept / "model.safetensors").exists() and not list(kept.glob(".export-*"))

    resumed = run_cli(tiny_args(tiny_dataset, kept, "--resume_from_checkpoint", "latest"), cli_env)
    assert resumed.returncode == 0, resumed.stderr
    assert (kept / "model.safetensors").is_file() and read_results(kept)["epochs_completed"] == 1


def test_a_full_disk_under_tensorboard_is_one_line_naming_the_folder_and_the_fix(tiny_dataset, cli_env, tmp_path):
    """TensorBoard writes its events from a thread of its own; on a full disk that thread's traceback went to
    stderr, and the error line named neither a file nor a fix. logs/ is a 12 KiB tmpfs here; the rest has room."""
    out = tmp_path / "run"
    (out / "logs").mkdir(parents=True)
    args = tiny_args(tiny_dataset, out, "--num_train_epochs", "2", "--logging_steps", "1")
    error, status, stdout = run_on_a_small_disk(out / "logs", "12k", args, cli_env)
    assert status == "exit=1"
    assert error == (f"error: writing the tracker files in {out / 'logs'} failed (No space left on device); free "
                     "space on that disk, then run again")  # fmt: skip
    assert "background thread" in stdout and "No space left on device" in stdout


@pytest.mark.parametrize(
    ("size", "work"),
    [("200k", "preparing dataset '{data}'"), ("1800k", "caching the decoded train split")],
    ids=["load_dataset", "decoding"],
)
def test_a_full_datasets_cache_is_one_line_naming_it_and_the_fix(tiny_dataset, cli_env, tmp_path, size, work):
    """The datasets cache on a small tmpfs: the tiny dataset's Arrow copy (about 1.2 MB) does not fit in 200 KiB,
    and its decoded splits (1.4 MB more) do not fit beside it in 1800 KiB. No run folder is left either."""
    cache = tmp_path / "cache"
    cache.mkdir()
    args = tiny_args(tiny_dataset, tmp_path / "run")
    error, status, _ = run_on_a_small_disk(cache, size, args, {**cli_env, "HF_DATASETS_CACHE": str(cache)})
    assert status == "exit=1"
    assert error == (f"error: {work.format(data=tiny_dataset)} in the datasets cache {cache} failed (No space left on "
                     "device); free space on that disk, or set HF_DATASETS_CACHE to a folder on another, then run "
                     "again")  # fmt: skip
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("variable", ["HF_DATASETS_CACHE", "HF_HOME", "XDG_CACHE_HOME"])
def test_a_cache_variable_set_but_empty_is_refused_before_the_cache_lands_among_the_users_files(
    tiny_dataset, finished_run, cli_env, tmp_path, variable
):
    """`HF_DATASETS_CACHE=$UNSET_VARIABLE python -m cifar_accel.train ...`: `datasets` takes an empty value as the
    current folder. Run beside a copy of the dataset, the run trained, writing the cache's Arrow files into the
    dataset's own folder (data/default/0.0.0/...) and its lock files into the current one. Now one line, exit 2,
    from `train` and `evaluate`, and nothing written anywhere."""
    shutil.copytree(tiny_dataset, tmp_path / "data")
    env = {**cli_env, "HF_DATASETS_CACHE": str(tmp_path / "cache"), variable: ""}
    before = snapshot(tmp_path), snapshot(finished_run)
    for command in (
        ["-m", "cifar_accel.train", "--dataset_name", "data", "--num_train_epochs", "1", "--output_dir", "run"],
        ["-m", "cifar_accel.evaluate", "--model", str(finished_run), "--dataset_name", "data"],
    ):
        proc = subprocess.run([sys.executable, *command], env=env, cwd=tmp_path, capture_output=True, text=True)
        assert (proc.returncode, proc.stderr) == (
            2,
            f"error: {variable} is set but empty, which datasets and the Hub take as the current folder: their caches "
            f"would be written into {tmp_path} (a local dataset's into its own folder); unset {variable}, or set it "
            "to a folder for the cache\n",
        )
        assert (snapshot(tmp_path), snapshot(finished_run)) == before


@pytest.mark.parametrize(
    ("size", "before", "status", "where", "problem"),
    [
        ("4k", ":", "exit=1", "{disk}/hf/modules", "No space left on device); free space on that disk"),
        ("64k", "mount -o remount,ro {disk}", "exit=2", "{disk}/hf",
         "Read-only file system); make that folder writable"),
    ],
    ids=["full", "read-only"],
)  # fmt: skip
def test_a_hugging_face_cache_that_cannot_take_the_metric_is_one_line_naming_it(tiny_dataset, cli_env, tmp_path,
                                                                                size, before, status, where,
                                                                                problem):  # fmt: skip
    """`evaluate` copies the shipped metric into HF_HOME (by default under the home folder) before a run tests:
    with a read-only home and the datasets cache elsewhere (as the datasets cache's own refusal advises), the run
    failed with 'OSError: [Errno 30] Read-only file system', exit 1. Nothing is written."""
    disk = tmp_path / "home"
    disk.mkdir()
    env = {**cli_env, "HF_HOME": str(disk / "hf")}
    error, exit_status, _ = run_on_a_small_disk(disk, size, tiny_args(tiny_dataset, tmp_path / "run"), env,
                                                before=before.format(disk=disk))  # fmt: skip
    assert exit_status == status
    assert error == (f"error: loading the metric 'accuracy' failed: `evaluate` copies it into the Hugging Face cache "
                     f"({where.format(disk=disk)}), which failed ({problem}, or set HF_HOME to a folder you can write "
                     "to")  # fmt: skip
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("kind", "damage"),
    [
        ("-train.arrow", lambda data: data[:1000]),
        ("cache-", lambda data: data[:1000]),
        ("dataset_info.json", lambda data: data[:100]),
        ("dataset_info.json", lambda data: b"{}"),
    ],
    ids=["prepared-split", "decoded-split", "dataset-info-cut-short", "dataset-info-without-splits"],
)
def test_a_damaged_file_in_the_datasets_cache_is_named_with_the_folder_to_delete(tiny_dataset, cli_env, tmp_path,
                                                                                 kind, damage):  # fmt: skip
    """A run killed while `datasets` wrote its cache, or a disk that filled, leaves a file cut short: the next run
    failed with Arrow's own words ('ArrowInvalid: Expected to read 1328 metadata bytes...'), exit 1, or, for the
    prepared dataset's dataset_info.json, with JSON's ('Unterminated string') as a fault of the user's dataset, or a
    TypeError. Deleting the folder the line names lets the next run read and decode the data again."""
    env = {**cli_env, "HF_DATASETS_CACHE": str(tmp_path / "cache")}
    assert run_cli(tiny_args(tiny_dataset, tmp_path / "first"), env).returncode == 0
    damaged = next(f for f in sorted((tmp_path / "cache").rglob("*")) if kind in f.name)
    damaged.write_bytes(damage(damaged.read_bytes()))
    proc = run_cli(tiny_args(tiny_dataset, tmp_path / "second"), env)
    assert proc.returncode == 1
    assert proc.stderr.startswith(f"error: the datasets cache holds a damaged file, {damaged} (")
    assert proc.stderr.endswith(
        f"), as a run killed while writing it leaves; delete {damaged.parent} and run again, which reads and decodes "
        "the data again\n"
    )
    shutil.rmtree(damaged.parent)
    assert run_cli(tiny_args(tiny_dataset, tmp_path / "second"), env).returncode == 0


def test_an_unlabelled_validation_split_is_left_out_with_val_ratio_0_and_evaluate_points_to_predict(cli_env, tmp_path):
    """The fix that the refusal names works: without validation the run trains; and evaluate, which has nothing to
    count on such a split, names the split to pick or the command that classifies its images."""
    dataset = unlabelled_validation_split(tmp_path / "data")
    run = tmp_path / "run"
    assert run_cli(tiny_args(dataset, run, "--val_ratio", "0"), cli_env).returncode == 0
    proc = run_cli(["--model", str(run), "--split", "validation"], cli_env, module="cifar_accel.evaluate")
    assert proc.returncode == 2 and proc.stderr == (
        "error: the 'validation' split has no labels (-1 in every row, datasets' mark for a missing label); accuracy "
        "needs them: pick a labelled --split, or classify its images with cifar_accel.predict\n"
    )
