"""Every entry point on the outputs of every run shape: evaluate, predict, compare and load_model, on a run with
validation, without it (the fast and resnet18 presets: TTA, Muon, EMA), with a weight average, and on a run
forked from another folder's checkpoint. Each must agree with what the run itself measured and exported."""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import accelerate
import datasets
import evaluate as evaluate_library
import numpy as np
import pytest
import torch
import yaml
from PIL import Image
from safetensors.torch import load_file

import cifar_accel
from cifar_accel import __main__ as package_main
from cifar_accel import compare, evaluate, export, load_model, predict, train
from cifar_accel.checkpoint import complete_checkpoints, read_trainer_state
from cifar_accel.data import load_split
from cifar_accel.errors import InputError, run_cli
from cifar_accel.state import read_results as read_run_results

from conftest import make_images, read_results, tiny_args, train_in_process

# Each shape: the flags of a short run on the tiny dataset (two epochs, or one without validation; a checkpoint
# every 4 of its 9 or so optimizer steps). The presets keep what makes them what they are (no validation, TTA,
# Muon or EMA, per-step schedules) at a batch the tiny dataset can fill.
SHAPES = {
    "default": [],
    "default_ema": ["--ema_decay", "0.9"],
    "fast": ["--config", "fast", "--per_device_train_batch_size", "64", "--gradient_accumulation_steps", "4",
             "--per_device_eval_batch_size", "50", "--num_train_epochs", "1"],
    "resnet18": ["--config", "resnet18", "--per_device_train_batch_size", "32", "--per_device_eval_batch_size", "50",
                 "--max_train_samples", "64", "--num_train_epochs", "1"],
}  # fmt: skip


def shape_args(dataset: Path, out: Path, shape: str) -> list[str]:
    """The argv ``compare`` builds for precision 'no' and seed 42, so that it reuses the finished run."""
    return [*tiny_args(dataset, out, "--num_train_epochs", "2", "--checkpointing_steps", "4",
                       "--checkpoints_total_limit", "10"), *SHAPES[shape],
            "--mixed_precision", "no", "--seed", "42"]  # fmt: skip


@pytest.fixture(scope="module")
def runs(tiny_dataset, tmp_path_factory) -> dict[str, Path]:
    """A finished run of each shape, in ``<compare folder>/no_seed42``, and one forked from the EMA run's
    checkpoint of epoch 1 into a new folder, trained to epoch 3."""
    root = tmp_path_factory.mktemp("shapes")
    folders = {}
    for shape in SHAPES:
        out = root / shape / "no_seed42"
        assert train_in_process(shape_args(tiny_dataset, out, shape)) == 0, shape
        folders[shape] = out
    source = folders["default_ema"]
    epoch_one = next(c for c in complete_checkpoints(source) if read_trainer_state(c).epoch == 1)
    assert read_trainer_state(epoch_one).step_in_epoch == 0  # saved at the end of epoch 1
    forked = root / "forked"
    args = tiny_args(tiny_dataset, forked, "--num_train_epochs", "3", "--ema_decay", "0.9", "--resume", str(epoch_one))
    assert train_in_process(args) == 0
    folders["forked"] = forked
    return folders


def run_entry_point(module, argv: list[str], capsys: pytest.CaptureFixture) -> tuple[int, str, str]:
    capsys.readouterr()
    code = run_cli(module.main, argv)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(
    ("module", "argv", "line"),
    [
        (evaluate, ["--model", "run", "--max-eval-samples", "3"],
         "'--max-eval-samples'; did you mean '--max_eval_samples'?"),
        (predict, ["--model", "run", "--topk", "2", "cat.png"], "'--topk'; did you mean '--top_k'?"),
        (export, ["--model", "run", "--formt", "onnx"], "'--formt'; did you mean '--format'?"),
        (compare, ["--seeds", "1", "--learnin_rate", "0.1"], "'--learnin_rate'; did you mean '--learning_rate'?"),
        (evaluate, ["--model", "run", "extra"], "'extra' (see --help)"),
    ],
    ids=["evaluate", "predict", "export", "compare", "a-value-no-flag-took"],
)  # fmt: skip
def test_every_command_names_the_flag_an_unknown_one_was_probably_meant_to_be(module, argv, line, capsys):
    assert run_entry_point(module, argv, capsys) == (2, "", f"error: unknown argument {line}\n")


NAME = "n" * 256  # one byte more than a file or folder name may have
NAME_LINE = (
    "holds a name of 256 bytes ('nnnnnnnnnnnnnnnnnnnnnnnn...'), more than the 255 a file or folder name may have"
)
DEEP = "/".join(["d" * 200] * 21)  # every name short enough, the whole path too long


@pytest.mark.parametrize(
    ("module", "argv", "line"),
    [
        (train, ["--output_dir", NAME], f"--output_dir: 'output_dir' {NAME_LINE}; use a shorter one"),
        (train, ["--output_dir", DEEP], "--output_dir: 'output_dir' is "),
        (train, ["--project_name", NAME], f"--project_name: 'project_name' {NAME_LINE}; use a shorter one"),
        (train, ["--dataset_name", NAME], f"--dataset_name: 'dataset_name' {NAME_LINE}; use a shorter one"),
        (train, ["--resume", NAME], f"--resume_from_checkpoint: 'resume_from_checkpoint' {NAME_LINE}"),
        (train, ["--config", NAME], f"--config: the path {NAME_LINE}; use a shorter one"),
        (train, ["--config", "config.yaml"], f"config file config.yaml: 'output_dir' {NAME_LINE}; use a shorter one"),
        (evaluate, ["--model", NAME], f"argument --model: the path {NAME_LINE}; use a shorter one (see --help)"),
        (predict, ["--model", "run", f"{NAME}.png"], "argument images: the path holds a name of 260 bytes"),
        (export, ["--model", "run", "--output", f"{NAME}.onnx"], "argument --output: the path holds a name of 261"),
        (compare, ["--output_dir", NAME], f"argument --output_dir: the path {NAME_LINE}; use a shorter one"),
    ],
    ids=["output-dir", "output-dir-deep", "project-name", "dataset", "resume", "config", "config-file", "evaluate",
         "predict", "export", "compare"],
)  # fmt: skip
def test_every_path_too_long_for_the_file_system_is_refused_naming_its_flag(module, argv, line, capsys, tmp_path,
                                                                            monkeypatch):  # fmt: skip
    """Every file call on such a path fails with 'File name too long': each command refuses it first, in one line
    naming the flag, where it stopped at the first call with OSError's own words, exit 1."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "config.yaml").write_text(f"output_dir: runs/{NAME}\n")
    code, out, err = run_entry_point(module, argv, capsys)
    assert (code, out) == (2, "") and err.startswith(f"error: {line}") and err.count("\n") == 1, err
    assert sorted(path.name for path in tmp_path.iterdir()) == ["config.yaml"]  # nothing made


def test_load_model_refuses_a_path_too_long_for_the_file_system(tmp_path):
    """As the commands' --model does, where it raised OSError's 'File name too long'."""
    for path, words in ((NAME, NAME_LINE), (DEEP, "is ")):
        with pytest.raises(InputError) as refused:
            load_model(path)
        assert str(refused.value).startswith(f"the path {words}") and str(refused.value).endswith("use a shorter one")


LOOP_LINE = ("goes through the symbolic link 'loop' -> 'loop', which leads to nothing (its target is missing, or the "
             "links loop); fix the link, or use another path")  # fmt: skip
GONE_LINE = LOOP_LINE.replace("'loop' -> 'loop'", "'gone' -> 'missing/target'")


@pytest.mark.parametrize(
    ("module", "argv", "line"),
    [
        (train, ["--output_dir", "loop"], f"--output_dir: 'output_dir' {LOOP_LINE}"),
        (train, ["--output_dir", "loop/run"], f"--output_dir: 'output_dir' {LOOP_LINE}"),
        (train, ["--output_dir", "gone"], f"--output_dir: 'output_dir' {GONE_LINE}"),
        (train, ["--dataset_name", "loop"], f"--dataset_name: 'dataset_name' {LOOP_LINE}"),
        (train, ["--resume", "gone/checkpoints/step_1"], f"--resume_from_checkpoint: 'resume_from_checkpoint' "
                                                          f"{GONE_LINE}"),
        (train, ["--config", "loop"], f"--config: the path {LOOP_LINE}"),
        (evaluate, ["--model", "gone"], f"argument --model: the path {GONE_LINE} (see --help)"),
        (evaluate, ["--model", "run", "--output_dir", "loop/eval"], f"argument --output_dir: the path {LOOP_LINE}"),
        (predict, ["--model", "run", "gone"], f"argument images: the path {GONE_LINE} (see --help)"),
        (export, ["--model", "run", "--output", "loop/m.onnx"], f"argument --output: the path {LOOP_LINE}"),
        (compare, ["--output_dir", "gone"], f"argument --output_dir: the path {GONE_LINE} (see --help)"),
    ],
    ids=["output-dir", "output-dir-below", "output-dir-dangling", "dataset", "resume", "config", "evaluate",
         "evaluate-output", "predict", "export", "compare"],
)  # fmt: skip
def test_every_path_through_a_link_to_nothing_is_refused_naming_the_link(module, argv, line, capsys, tmp_path,
                                                                         monkeypatch):  # fmt: skip
    """A symbolic link in a loop stopped training with pathlib's 'RuntimeError: Symlink loop', exit 1; one to a
    missing target was 'not writable (File exists)' as an --output_dir, a dataset 'not on the Hub', a model with
    'no weights'. Every path is refused in one line naming the link and where it points, before anything is made."""
    monkeypatch.chdir(tmp_path)
    Path("loop").symlink_to("loop")
    Path("gone").symlink_to("missing/target")
    code, out, err = run_entry_point(module, argv, capsys)
    assert (code, out) == (2, "") and err.startswith(f"error: {line}") and err.count("\n") == 1, err
    assert sorted(path.name for path in tmp_path.iterdir()) == ["gone", "loop"]  # nothing made


NOT_UTF8 = os.fsdecode(b"runs_\xe9")  # a Latin-1 name, as Linux allows: 'runs_\udce9' to Python
NOT_UTF8_LINE = "holds a name that is not UTF-8 text ('runs_\\xe9'); rename it"


@pytest.mark.parametrize(
    ("module", "argv", "line"),
    [
        (train, ["--output_dir", NOT_UTF8], f"--output_dir: 'output_dir' {NOT_UTF8_LINE}"),
        (train, ["--dataset_name", f"{NOT_UTF8}/data"], f"--dataset_name: 'dataset_name' {NOT_UTF8_LINE}"),
        (train, ["--resume", f"{NOT_UTF8}/checkpoints/step_1"], f"--resume_from_checkpoint: 'resume_from_checkpoint' "
                                                                 f"{NOT_UTF8_LINE}"),
        (train, ["--config", f"{NOT_UTF8}/config.yaml"], f"--config: the path {NOT_UTF8_LINE}"),
        (train, ["--dataset_name", "data"], f"--dataset_name: the absolute path of 'data' {NOT_UTF8_LINE}"),
        (train, ["--run_name", NOT_UTF8], "--run_name: 'run_name' is not UTF-8 text; give it in UTF-8 characters"),
        (train, ["--hub_token", NOT_UTF8], "--hub_token: 'hub_token' is not UTF-8 text; give it in UTF-8 characters"),
        (evaluate, ["--model", NOT_UTF8], f"argument --model: the path {NOT_UTF8_LINE} (see --help)"),
        (predict, ["--model", NOT_UTF8, "cat.png"], f"argument --model: the path {NOT_UTF8_LINE} (see --help)"),
        (export, ["--model", "run", "--output", f"{NOT_UTF8}.onnx"],
         "argument --output: the path holds a name that is not UTF-8 text ('runs_\\xe9.onnx'); rename it (see --help)"),
        (compare, ["--output_dir", NOT_UTF8], f"argument --output_dir: the path {NOT_UTF8_LINE} (see --help)"),
    ],
    ids=["output-dir", "dataset", "resume", "config", "dataset-through-link", "run-name", "hub-token-not-shown",
         "evaluate", "predict", "export", "compare"],
)  # fmt: skip
def test_every_path_or_text_that_is_not_utf8_is_refused_naming_its_flag(module, argv, line, tiny_dataset, capsys,
                                                                        tmp_path, monkeypatch):  # fmt: skip
    """A run records its paths as text, and safetensors, datasets and onnxruntime take only UTF-8 ones: such a path
    failed after the run had written its first files ('surrogates not allowed', exit 1), as safetensors weights
    'damaged or cut short', or with onnxruntime's TypeError; so did any other text a run records (the secret
    hub_token is not shown). ``data`` links to a dataset inside a folder whose
    name is not UTF-8, which the run would record as its absolute path."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / NOT_UTF8).mkdir()
    shutil.copytree(tiny_dataset, tmp_path / NOT_UTF8 / "data")
    (tmp_path / "data").symlink_to(tmp_path / NOT_UTF8 / "data")
    code, out, err = run_entry_point(module, argv, capsys)
    # compared as bytes: a failure's report must not hold the surrogate, which pytest-xdist cannot send
    assert (code, out, os.fsencode(err)) == (2, "", f"error: {line}\n".encode())
    assert sorted(map(os.fsencode, os.listdir(tmp_path))) == [b"data", b"runs_\xe9"]  # nothing made
    assert os.listdir(tmp_path / NOT_UTF8) == ["data"]
    with pytest.raises(InputError) as refused:
        load_model(NOT_UTF8)
    assert os.fsencode(str(refused.value)) == f"the path {NOT_UTF8_LINE}".encode()


@pytest.mark.parametrize("shape", [*SHAPES, "forked"])
def test_evaluate_reproduces_the_runs_test_accuracy_from_the_folder_and_from_its_best_checkpoint(runs, shape, capsys,
                                                                                                 tmp_path):  # fmt: skip
    run, results = runs[shape], read_results(runs[shape])
    tta = results["tta"]
    models = [run]
    if results["validation"]:  # the checkpoint the run tested: its weights, or their average
        models.append(run / "checkpoints" / read_trainer_state(complete_checkpoints(run)[-1]).best_checkpoint)
    for model in models:
        for flags, expected in ((["--tta", tta], results["test_accuracy"]), ([], results["test_accuracy_no_tta"])):
            out = tmp_path / model.name / f"eval_{tta}_{bool(flags)}"  # not in a checkpoint: it goes with it
            code, _, err = run_entry_point(evaluate, ["--model", str(model), "--output_dir", str(out), *flags], capsys)
            assert code == 0, err
            metrics = json.loads((out / "metrics.json").read_text())
            assert metrics["accuracy"] == expected, (model, flags)
            assert metrics["samples"] == results["test_samples"] == 83


@pytest.mark.parametrize("shape", [*SHAPES, "forked"])
def test_load_model_and_predict_use_the_exported_weights(runs, shape, capsys, tmp_path):
    run = runs[shape]
    exported = load_file(run / "model.safetensors")
    trained = load_model(run)
    assert trained.model.state_dict().keys() == exported.keys()
    assert all(torch.equal(trained.model.state_dict()[k], exported[k]) for k in exported)
    if read_results(run)["validation"]:
        best = read_trainer_state(complete_checkpoints(run)[-1]).best_checkpoint
        from_checkpoint = load_model(run / "checkpoints" / best).model.state_dict()
        assert all(torch.equal(from_checkpoint[k], exported[k]) for k in exported), "the checkpoint's validated weights"

    images, _ = make_images(4, seed=5)
    for index, image in enumerate(images):
        image.save(tmp_path / f"{index}.png")
    code, out, err = run_entry_point(predict, ["--model", str(run), "--format", "jsonl", "--top_k", "1",
                                               str(tmp_path)], capsys)  # fmt: skip
    assert code == 0, err
    rows = [json.loads(line) for line in out.splitlines()]
    expected = trained.predict(images, top_k=1)
    assert [(r["top_k"][0]["class"], r["top_k"][0]["probability"]) for r in rows] == [
        (name, pytest.approx(p, abs=1e-6)) for ((name, p),) in expected
    ]


@pytest.mark.parametrize("shape", list(SHAPES))
def test_load_model_and_predict_with_the_runs_tta_give_its_test_accuracy(runs, shape, tiny_dataset, capsys, tmp_path):
    """The fast preset tests with TTA on its unsure images only (--tta_below_confidence 0.7): load_model and predict
    take the same two settings, and with the run's own they classify its test images as its final test did."""
    run = runs[shape]
    config = yaml.safe_load((run / "config.yaml").read_text())
    tta = ["--tta", config["tta"], "--tta_below_confidence", str(config["tta_below_confidence"])]
    test, _ = load_split(str(tiny_dataset), "test", None, None, None)
    trained = load_model(run)
    classes = trained.probabilities(test.images, config["tta"], config["tta_below_confidence"]).argmax(1)
    assert (classes == test.labels).float().mean().item() == pytest.approx(read_results(run)["test_accuracy"])
    for index in range(6):
        Image.fromarray(test.images[index].permute(1, 2, 0).numpy()).save(tmp_path / f"{index}.png")
    code, out, err = run_entry_point(predict, ["--model", str(run), "--format", "jsonl", "--top_k", "1", *tta,
                                               str(tmp_path)], capsys)  # fmt: skip
    assert code == 0, err
    assert [json.loads(line)["top_k"][0]["class"] for line in out.splitlines()] == [
        trained.class_names[i] for i in classes[:6]
    ]


def test_the_ema_checkpoint_gives_the_average_not_the_raw_weights(runs):
    """The raw weights of a checkpoint differ from its average; every consumer gets the average."""
    run = runs["default_ema"]
    best = run / "checkpoints" / read_trainer_state(complete_checkpoints(run)[-1]).best_checkpoint
    raw = load_file(best / "model.safetensors")
    loaded = load_model(best).model.state_dict()
    assert any(not torch.equal(raw[k], loaded[k]) for k in raw if raw[k].is_floating_point())


def test_a_forked_run_finishes_and_its_own_checkpoints_resume(runs, tiny_dataset, capsys):
    forked = runs["forked"]
    results = read_results(forked)
    assert results["epochs_completed"] == 3
    state = read_trainer_state(complete_checkpoints(forked)[-1])
    assert (forked / "checkpoints" / state.best_checkpoint).is_dir()  # the best one came along
    args = tiny_args(tiny_dataset, forked, "--num_train_epochs", "4", "--ema_decay", "0.9", "--resume", "latest")
    assert train_in_process(args) == 0
    assert read_results(forked)["epochs_completed"] == 4


@pytest.mark.parametrize("shape", list(SHAPES))
def test_compare_reports_every_preset_shape(runs, shape, tiny_dataset, capsys):
    """compare reuses the finished run of its config and writes a report, with or without validation."""
    folder = runs[shape].parent
    finished = (runs[shape] / "results.json").read_bytes()
    train_flags = shape_args(tiny_dataset, runs[shape], shape)[:-4]  # less the precision and seed
    code, out, err = run_entry_point(compare, [*train_flags, "--precisions", "no", "--seeds", "42", "--output_dir",
                                               str(folder)], capsys)  # fmt: skip
    assert code == 0, err
    assert (runs[shape] / "results.json").read_bytes() == finished  # reused, not trained again
    report = json.loads((folder / "report.json").read_text())
    (summary,) = report["precisions"]
    results = read_results(runs[shape])
    assert summary["test_accuracy"]["mean"] == results["test_accuracy"]
    if results["validation"]:
        assert summary["best_val_accuracy"]["mean"] == results["best_val_accuracy"]
    else:
        assert summary["best_val_accuracy"] is None and summary["val_accuracy_per_epoch"] is None
        row = next(line for line in (folder / "report.md").read_text().splitlines() if line.startswith("| no |"))
        assert f"| - | {results['test_accuracy']:.4f} |" in row


@pytest.mark.parametrize(("shape", "row"), [("default", "294 (validated on 33 images held out of the train split)"),
                                            ("fast", "327 (no validation)")])  # fmt: skip
def test_the_model_card_says_what_the_run_validated_on(runs, shape, row):
    """The card said '(0 held out for validation)' without validation, and with --max_eval_samples 10 '(10 held out
    for validation)' where 33 were held out and 10 of them validated on."""
    assert f"| training images | {row} |" in (runs[shape] / "README.md").read_text()


@pytest.mark.parametrize("module", [evaluate, predict])
def test_tta_below_confidence_without_tta_is_refused_as_training_refuses_it(runs, module, capsys, tmp_path):
    """evaluate and predict took --tta_below_confidence 0.7 without --tta and gave plain predictions, as if no
    image were unsure; the flag is refused, and nothing is written."""
    run = runs["default"]
    image = tmp_path / "cat.png"
    Image.new("RGB", (32, 32)).save(image)
    argv = ["--model", str(run), "--tta_below_confidence", "0.7", *([str(image)] if module is predict else [])]
    assert run_entry_point(module, argv, capsys) == (2, "", "error: --tta_below_confidence has no effect unless --tta "
                                                     "is flip or flip_translate, but --tta is 'none'; leave "
                                                     "--tta_below_confidence out, or change that\n")  # fmt: skip
    assert not (run / "eval_test").exists()
    elsewhere = ["--output_dir", str(tmp_path / "eval")] if module is evaluate else []
    code, out, _ = run_entry_point(module, [*argv, "--tta", "flip", *elsewhere], capsys)
    assert code == 0 and out


@pytest.mark.parametrize(
    ("images", "kwargs", "message"),
    [
        ([], {}, "got an empty list"),
        (np.zeros((2, 3, 32, 32), dtype=np.uint8), {}, "got ndarray"),
        ([torch.zeros(3, 32, 32, dtype=torch.uint8)], {}, "got a list of Tensor"),
        (torch.zeros(0, 3, 32, 32, dtype=torch.uint8), {}, "got an empty tensor"),
        (torch.zeros(2, 3, 32, 32), {}, "got torch.float32 of shape (2, 3, 32, 32)"),
        (None, {}, "got NoneType"),
        ("cat.png", {}, "got str"),
        (torch.zeros(1, 3, 32, 32, dtype=torch.uint8), {"top_k": 0}, "top_k must be a whole number of at least 1"),
        (torch.zeros(1, 3, 32, 32, dtype=torch.uint8), {"tta": None}, "tta must be one of none, flip, flip_translate"),
        (torch.zeros(1, 3, 32, 32, dtype=torch.uint8), {"tta": "flips"}, "tta must be one of none, flip"),
        (torch.zeros(1, 3, 32, 32, dtype=torch.uint8), {"tta": "flip", "tta_below_confidence": 0},
         "tta_below_confidence must be above 0 and at most 1, not 0"),
        (torch.zeros(1, 3, 32, 32, dtype=torch.uint8), {"tta_below_confidence": 0.7},
         "tta_below_confidence has no effect unless tta is 'flip' or 'flip_translate'"),
    ],
    ids=["empty-list", "numpy", "list-of-tensors", "empty-tensor", "float", "none", "path", "top-k-0", "tta-none",
         "tta-unknown", "tta-below-0", "tta-below-without-tta"],
)  # fmt: skip
def test_the_python_api_names_the_expected_input_in_one_error(runs, images, kwargs, message):
    trained = load_model(runs["default"])
    expected = "expected a non-empty list of PIL images or image files, or a uint8 tensor"
    with pytest.raises(ValueError, match="^" + re.escape(expected) if message.startswith("got") else re.escape(message)
                       ) as err:  # fmt: skip
        trained.predict(images, **kwargs)
    assert message in str(err.value)


# results.json keeps every key it ever had; RunResults (cifar_accel/state.py) is the one definition of them.
RESULTS_KEYS = {
    "validation", "best_val_accuracy", "best_epoch", "tested_epoch", "test_accuracy", "tta", "test_accuracy_no_tta",
    "test_loss", "test_samples", "epochs_completed", "stopped_early", "mixed_precision", "requested_mixed_precision",
    "mixed_precision_source", "precision_advice", "train_images_per_second", "seconds_per_epoch", "skipped_steps",
    "peak_memory_mib", "peak_memory_measure", "precision_report", "num_processes", "global_batch_size",
    "learning_rate", "device", "hardware", "train_samples", "val_samples", "history", "versions",
}  # fmt: skip
VERSION_2_KEYS = {"image_column", "label_column", "normalization"}
VERSION_3_KEYS = {"val_split"}


@pytest.mark.parametrize("module", [train, evaluate, predict, export, compare])
def test_every_command_prints_its_versions(module, capsys):
    """--version is one line: the package's version (the one source of the installed package's), then Python's and
    the libraries'; exit code 0, as argparse's own version flag exits."""
    with pytest.raises(SystemExit) as stopped:
        module.main(["--version"])
    assert stopped.value.code in (0, None)
    out, err = capsys.readouterr()
    assert err == "" and out == (
        f"cifar_accel {cifar_accel.__version__} (python {platform.python_version()}, torch {torch.__version__}, "
        f"accelerate {accelerate.__version__}, datasets {datasets.__version__}, "
        f"evaluate {evaluate_library.__version__})\n"
    )
    assert importlib.metadata.version("cifar-accel") == cifar_accel.__version__


@pytest.mark.parametrize(
    ("script", "argv", "problem"),
    [
        ("summarize_runs", ["/nowhere"], "/nowhere/results.json is not the results.json of a finished run"),
        ("side_by_side", ["--anchor", "/nowhere.py"], "--anchor /nowhere.py is not a file"),
        ("bench_throughput", ["--config", "nope"], "--config 'nope' is neither a preset"),
    ],
)
def test_the_scripts_refuse_in_one_line_and_show_the_traceback_under_debug(script, argv, problem, capsys):
    """The scripts' refusals are the commands' (one line, exit code 2), where a benchmark's was a traceback; and
    their parsers take --debug, which shows the traceback, where one that lacked it refused --debug itself."""
    main = importlib.import_module(script).main
    assert run_cli(main, argv) == 2
    assert capsys.readouterr().err.startswith(f"error: {problem}")
    with pytest.raises(InputError, match=re.escape(problem)):
        run_cli(main, [*argv, "--debug"])


@pytest.mark.parametrize(
    ("script", "flag", "value", "least"),
    [
        ("bench_throughput", "--steps", "0", 1),
        ("bench_throughput", "--turns", "0", 1),
        ("bench_throughput", "--warmup", "-1", 0),
        ("bench_throughput", "--batch_size", "0", 1),
        ("bench_step", "--steps", "0", 1),
        ("bench_step", "--eval_batch_sizes", "0", 1),
        ("bench_step", "--eval_images", "0", 1),
        ("bench_fast_changes", "--turns", "0", 1),
        ("bench_fast_changes", "--warmup", "-2", 0),
        ("bench_conv_layers", "--repeats", "0", 1),
    ],
)
def test_the_benchmarks_refuse_counts_below_their_least_in_one_line(script, flag, value, least, capsys):
    """A benchmark given no steps, no turns or an empty batch divided by zero (exit 1, "ZeroDivisionError") or
    printed a table of zeros and infinities, exit 0; now the flag is refused as the commands refuse one."""
    assert run_cli(importlib.import_module(script).main, [flag, value]) == 2
    assert capsys.readouterr().err == f"error: argument {flag}: must be at least {least}, not {value} (see --help)\n"


def test_the_package_imports_under_python_m_with_no_argument_after_the_module(cli_env):
    """`python -m pytest` (or a command), with nothing after the module's name, failed to import the package
    (IndexError) while it looked for the module that -m runs."""
    proc = subprocess.run([sys.executable, "-m", "cifar_accel.predict"], env=cli_env, capture_output=True, text=True)
    assert (proc.returncode, proc.stderr) == (2, "error: the following arguments are required: images, --model (see "
                                                 "--help)\n")  # fmt: skip


def test_python_m_the_package_lists_the_commands_and_points_a_command_word_to_its_module(cli_env, tmp_path):
    """`python -m cifar_accel` said only "No module named cifar_accel.__main__; 'cifar_accel' is a package and
    cannot be directly executed". It lists the commands, each with its module's first docstring line; a command
    after it is pointed to its module with the same flags; and, as under the commands, a file of the user's in the
    current folder named as a library does not stand for it."""
    for name in ("datasets.py", "torch.py"):
        (tmp_path / name).write_text("raise SystemExit('the user's own file was imported')\n")

    def package(*argv: str) -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", "cifar_accel", *argv]
        return subprocess.run(command, env=cli_env, cwd=tmp_path, capture_output=True, text=True, timeout=120)

    listed = package()
    assert (listed.returncode, listed.stderr) == (0, "")
    for module in (train, evaluate, predict, compare, export):
        command = module.__name__.split(".")[1]
        assert f"\n  {command:<9} {module.__doc__.splitlines()[0]}\n" in listed.stdout
    assert package("--help").stdout == listed.stdout
    for argv, line in [
        (["train", "--output_dir", "my runs/a"], "each command is a module of its own: run python -m "
                                                 "cifar_accel.train --output_dir 'my runs/a'"),
        (["trian"], "'trian' is not a command; did you mean 'train'? (the commands: train, evaluate, predict, "
                    "compare, export; see --help)"),
        (["--model=x"], "unknown argument '--model': flags follow a command, python -m cifar_accel.COMMAND --model "
                        "... (see --help)"),
    ]:  # fmt: skip
        proc = package(*argv)
        assert (proc.returncode, proc.stdout, proc.stderr) == (2, "", f"error: {line}\n")
    # --debug, which the listing's parser takes too, stays among the flags it points to (and shows the traceback)
    with pytest.raises(InputError, match=re.escape("run python -m cifar_accel.train --debug --lr 3")):
        run_cli(package_main.main, ["--debug", "train", "--lr", "3"])


@pytest.mark.parametrize("command", [[sys.executable, "-m", "cifar_accel.predict"], ["cifar-accel-predict"]],
                         ids=["module", "console-script"])  # fmt: skip
def test_ctrl_c_while_a_command_imports_its_libraries_is_one_line(command, runs, cli_env):
    """Ctrl-C in the seconds a command spends importing torch and the rest, before its own error handling runs,
    printed Python's traceback of the import, or aborted the process where it landed in a C++
    extension's initialisation; now the one line it prints later, and the exit status of SIGINT."""
    run = runs["default"]
    if command[0] == "cifar-accel-predict":
        command = [str(Path(sys.executable).parent / "cifar-accel-predict")]
    # Started as from a terminal, where Ctrl-C reaches it: SIGINT at its default, which a shell's background job
    # (the test run itself started with &) would pass on ignored, and Python would then never raise KeyboardInterrupt.
    proc = subprocess.Popen([*command, "--model", str(run), str(run / "curves.png")], env=cli_env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # fmt: skip
    time.sleep(0.5)  # Python has started, and imports torch for a second or more
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert (out, err) == ("", "error: interrupted\n")
    assert proc.returncode == -signal.SIGINT  # killed by it, as a program without a handler for it is


def test_predict_and_load_model_start_without_datasets_or_evaluate(cli_env):
    """Reading image files needs neither `datasets` nor `evaluate` (nor the pandas and pyarrow they import), which
    took `predict --help` from 2.2 s to 3.4-4.1 s on a 2-core Zen 4; the image decoder is a module of its own."""
    libraries = "{'datasets', 'evaluate', 'pandas', 'pyarrow'}"
    check = f"import sys, cifar_accel.predict; print(sorted({{m.split('.')[0] for m in sys.modules}} & {libraries}))"
    proc = subprocess.run([sys.executable, "-c", check], env=cli_env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_a_command_exits_with_its_code_and_its_objects_frozen_out_of_the_shutdown_collections(cli_env):
    """Python's shutdown ran its garbage collections over every object torch and its compiler had made, a second of
    each command's exit on a 2-core Zen 4 (`train` on the tiny dataset 6.2-6.6 s, 5.0-5.1 s frozen). The command's
    code stands, and an exit handler, which runs before those collections, still runs and finds the objects frozen."""
    program = (
        "import atexit, gc, sys; from cifar_accel.errors import InputError, exit_command\n"
        "atexit.register(lambda: print('frozen:', gc.get_freeze_count() > 10_000))\n"
        "def main(argv):\n"
        "    import torch._dynamo  # the objects a training run leaves\n"
        "    if argv: raise InputError(f'bad {argv[0]}')\n"
        "exit_command(main)\n"
    )
    for argv, code, err in (([], 0, ""), (["x"], 2, "error: bad x\n")):
        proc = subprocess.run([sys.executable, "-c", program, *argv], env=cli_env, capture_output=True, text=True,
                              timeout=120)  # fmt: skip
        assert (proc.returncode, proc.stdout, proc.stderr) == (code, "frozen: True\n", err)


def test_results_json_is_typed_keeps_its_keys_and_older_files_still_load(runs, tmp_path):
    written = json.loads((runs["default"] / "results.json").read_text())
    assert set(written) == RESULTS_KEYS | VERSION_2_KEYS | VERSION_3_KEYS | {"schema_version"}
    assert written["schema_version"] == 3 and written["val_split"] is None  # a part of train held out
    assert (written["image_column"], written["label_column"]) == ("img", "label")
    assert written["normalization"]["mean"] == [0.4914, 0.4822, 0.4465]  # CIFAR-10's classes: its constants
    assert (
        written["versions"]["cifar_accel"] == cifar_accel.__version__
        and written["versions"]["torch"] == torch.__version__
    )
    older = {k: v for k, v in written.items() if k in RESULTS_KEYS}  # as written before the version was
    (tmp_path / "results.json").write_text(json.dumps(older))
    results = read_run_results(tmp_path / "results.json")
    assert results.schema_version == 1 and results.history[0].epoch == 1 and results.label_column is None
    assert results.to_dict() == {**older, "schema_version": 1} | dict.fromkeys(VERSION_2_KEYS | VERSION_3_KEYS)
    (tmp_path / "results.json").write_text(json.dumps(written))
    assert read_run_results(tmp_path / "results.json").to_dict() == written
    for damage in ({**written, "test_accuracy": 1.5}, {**written, "history": [{"epoch": 1}]}, [written]):
        (tmp_path / "results.json").write_text(json.dumps(damage))
        with pytest.raises(InputError, match="is not the results.json of a finished run"):
            read_run_results(tmp_path / "results.json")
        assert compare.finished_results(tmp_path) is None  # compare trains such a run again


def test_the_commands_start_without_torchvision(cli_env):
    """torchvision loads torch._dynamo, a second of every start: the commands import it only where a run uses it
    (docs/design.md), so evaluate, predict and export, and train until it builds a ResNet-18, start without it."""
    commands = ", ".join(f"cifar_accel.{name}" for name in ("train", "evaluate", "predict", "export", "compare"))
    check = f"import sys, {commands}; print(sorted(m for m in sys.modules if m.startswith('torchvision')))"
    proc = subprocess.run([sys.executable, "-c", check], env=cli_env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
