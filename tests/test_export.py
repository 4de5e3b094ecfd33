"""cifar_accel.export: ONNX (checked with ONNX Runtime) and torch.export programs of a trained model, taking uint8
or float images with a dynamic batch axis and normalising them as the run did."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import onnxruntime
import pytest
import torch
from PIL import Image

from cifar_accel.checkpoint import complete_checkpoints
from cifar_accel.data import load_split
from cifar_accel.errors import run_cli as run_main
from cifar_accel.export import check_export
from cifar_accel.export import main as export_main
from cifar_accel.inference import load_model

from conftest import run_cli, run_on_a_small_disk, snapshot, tiny_args


def export(model: Path, env: dict, *extra: str):
    return run_cli(["--model", str(model), *extra], env, module="cifar_accel.export")


def test_onnx_export_of_a_cifar100_run_agrees_with_load_model_in_onnx_runtime(cifar100_run, cifar100_dataset, cli_env):
    proc = export(cifar100_run, cli_env, "--format", "onnx")
    assert proc.returncode == 0, proc.stderr
    description = json.loads((cifar100_run / "model.onnx.json").read_text())
    check = description["check"]
    assert check["images"] == check["same_predictions"] == 200 and check["max_probability_difference"] <= 1e-4
    assert f"checked on 200 images of {cifar100_dataset} (test): 200 predictions the same" in proc.stdout
    saved = json.loads((cifar100_run / "preprocessing.json").read_text())
    assert (description["preprocessing"]["mean"], description["preprocessing"]["std"]) == (saved["mean"], saved["std"])
    assert description["input"]["dtype"] == "uint8" and description["input"]["shape"] == ["batch", 3, 32, 32]
    assert len(description["class_names"]) == 100

    # The file itself, in ONNX Runtime, at batch sizes other than the one traced: the same as load_model.
    session = onnxruntime.InferenceSession(str(cifar100_run / "model.onnx"), providers=["CPUExecutionProvider"])
    assert [i.type for i in session.get_inputs()] == ["tensor(uint8)"]
    test, _ = load_split(str(cifar100_dataset), "test", None, "fine_label", None)
    trained = load_model(cifar100_run)
    for batch in (test.images[:1], test.images[1:8], test.images):
        logits, probabilities = session.run(None, {"images": batch.numpy()})
        expected = trained.probabilities(batch).numpy()
        assert logits.shape == probabilities.shape == (len(batch), 100)
        assert np.array_equal(probabilities.argmax(1), expected.argmax(1))
        assert np.abs(probabilities - expected).max() <= 1e-4
    card = (cifar100_run / "README.md").read_text()
    assert "## Exported" in card and "| `model.onnx` | onnx | uint8 0..255 | 200/200 predictions as load_model" in card


def test_pt2_export_takes_float_images_in_the_unit_range(cifar100_run, cifar100_dataset, tmp_path):
    out = tmp_path / "exports" / "new" / "classifier.pt2"  # folders made as needed
    argv = ["--model", str(cifar100_run), "--format", "pt2", "--input", "float32", "--output", str(out)]
    assert run_main(export_main, argv) == 0
    assert json.loads(out.with_name("classifier.pt2.json").read_text())["check"]["same_predictions"] == 200
    program = torch.export.load(out).module()
    test, _ = load_split(str(cifar100_dataset), "test", None, "fine_label", 5)
    logits, probabilities = program(test.images.float() / 255)
    expected = load_model(cifar100_run).probabilities(test.images)
    assert torch.equal(probabilities.argmax(1), expected.argmax(1)) and (probabilities - expected).abs().max() < 1e-4
    assert not (cifar100_run / "model.pt2").exists()  # written where --output says only


def test_an_export_beside_a_readme_of_the_users_keeps_it_checks_on_unlabelled_photos_and_leaves_stderr_empty(
    cifar100_run, cifar100_dataset, cli_env, tmp_path
):
    """The check needs images, not labels: a folder of photos will do. stderr is kept for the error line: loading
    a check dataset that is not in the datasets cache yet writes none of datasets' progress bars there."""
    run = tmp_path / "run"
    shutil.copytree(cifar100_run, run)
    (run / "README.md").write_text("# my notes\n")
    photos = tmp_path / "photos" / "test"  # no class subfolders: the image folder has no label column
    photos.mkdir(parents=True)
    test, _ = load_split(str(cifar100_dataset), "test", None, "fine_label", 7)
    for i, image in enumerate(test.images):
        Image.fromarray(image.permute(1, 2, 0).numpy()).save(photos / f"{i}.png")
    with_bars = {k: v for k, v in cli_env.items() if k != "TQDM_DISABLE"}  # as a user's shell has it
    proc = export(run, with_bars, "--format", "pt2", "--check_dataset", str(photos.parent))
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert f"checked on 7 images of {photos.parent} (test): 7 predictions the same" in proc.stdout
    assert (run / "model.pt2").is_file() and (run / "model.pt2.json").is_file()
    assert (run / "README.md").read_text() == "# my notes\n"
    assert "README.md is not a model card of this package, so it is left as it is" in proc.stdout


def test_a_checkpoints_export_goes_beside_the_checkpoint_not_into_it(cifar100_run, tmp_path):
    """A checkpoint folder is deleted when newer checkpoints replace it, and an export inside would go with it."""
    run = shutil.copytree(cifar100_run, tmp_path / "run")
    checkpoint = complete_checkpoints(run)[-1]
    inside, card = sorted(p.name for p in checkpoint.iterdir()), (run / "README.md").read_text()
    assert run_main(export_main, ["--model", str(checkpoint), "--format", "pt2", "--skip_check"]) == 0
    exported = run / f"model_{checkpoint.name}.pt2"
    assert json.loads(exported.with_name(exported.name + ".json").read_text())["weights"]["file"] == str(
        checkpoint / "model.safetensors"
    )
    assert sorted(p.name for p in checkpoint.iterdir()) == inside and (run / "README.md").read_text() == card


def test_a_file_of_the_users_at_the_output_is_kept_and_an_earlier_export_replaced(cifar100_run, tmp_path, capsys):
    """A model.pt2 (or its .json) that export did not write, a deployed model say, is refused and left as it is;
    one whose description export wrote is an earlier export, and a new one replaces both."""
    output = tmp_path / "served.pt2"
    argv = ["--model", str(cifar100_run), "--format", "pt2", "--skip_check", "--output", str(output)]
    for name in ("served.pt2", "served.pt2.json"):
        (tmp_path / name).write_text("mine")
        assert run_main(export_main, argv) == 2
        assert capsys.readouterr().err.strip() == (
            f"error: '{tmp_path}' already holds {name}, which export writes but did not write there; move it, or "
            "pick another --output"
        )
        assert (tmp_path / name).read_text() == "mine"
        (tmp_path / name).unlink()
    assert run_main(export_main, argv) == 0
    first = output.read_bytes()
    output.write_bytes(b"an earlier export")
    assert run_main(export_main, argv) == 0
    assert output.read_bytes() == first


def test_outputs_of_a_run_trained_further_are_named_as_made_from_earlier_weights(cifar100_dataset, cli_env, tmp_path):
    """Extending a run writes new final weights (without validation, the last epoch's). Its earlier export and
    evaluation stay (files of the user's now), but the run says which were made from the earlier weights and how to
    make them again, and the model card no longer vouches for the export until it is exported again. A
    checkpoint's evaluation is of its own weights."""
    run = tmp_path / "run"
    flags = tiny_args(cifar100_dataset, run, "--label_column_name", "fine_label", "--val_ratio", "0")
    assert run_cli(flags, cli_env).returncode == 0
    assert export(run, cli_env, "--format", "pt2", "--skip_check").returncode == 0
    (checkpoint,) = complete_checkpoints(run)
    for model in (run, checkpoint):
        assert run_cli(["--model", str(model)], cli_env, module="cifar_accel.evaluate").returncode == 0
    assert {p.name for p in run.glob("eval_*")} == {"eval_test", f"eval_test_{checkpoint.name}"}
    row = "| `model.pt2` | pt2 | uint8 0..255 | not checked |"
    assert row in (run / "README.md").read_text()
    exported = (run / "model.pt2").read_bytes()
    proc = run_cli([*flags, "--num_train_epochs", "2", "--resume_from_checkpoint", "latest"], cli_env)
    assert proc.returncode == 0, proc.stderr
    earlier = [line.split(": ", 1)[1] for line in proc.stdout.splitlines() if "WARNING" in line]
    assert earlier == [
        f"{run / 'model.pt2'} was exported from earlier weights than {run / 'model.safetensors'}; export again: "
        f"python -m cifar_accel.export --model {run} --format pt2 --input uint8",
        f"{run / 'eval_test'} evaluated earlier weights than {run / 'model.safetensors'}; evaluate again: "
        f"python -m cifar_accel.evaluate --model {run} --split test",
    ]
    card = (run / "README.md").read_text()
    assert row not in card
    assert "| `model.pt2` | pt2 | uint8 0..255 | made from earlier weights, not these: export again |" in card
    assert (run / "model.pt2").read_bytes() == exported
    assert export(run, cli_env, "--format", "pt2", "--skip_check").returncode == 0
    assert row in (run / "README.md").read_text()


def test_a_missing_extra_is_one_line_and_exit_2(cifar100_run, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # what `import onnxruntime` meets without the extra
    assert run_main(export_main, ["--model", str(cifar100_run), "--output", str(tmp_path / "m.onnx")]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: --format onnx needs the 'export' extra: pip install onnx onnxscript onnxruntime")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "flags, problem",
    [
        (["--output", "{tmp}/m.pt2"], "must end in .onnx for --format onnx"),
        (["--check_dataset", "{tmp}/nowhere", "--output", "{tmp}/new/folders/x.onnx"],
         "path '{tmp}/nowhere' does not exist; pass --check_dataset with a local copy"),
        (["--image_column_name", "nope", "--output", "{tmp}/x.onnx"],
         "image column 'nope' not found (columns: img, fine_label, coarse_label); fix --image_column_name"),
        (["--check_samples", "0"], "--check_samples must be at least 1"),
        (["--check_split", "validation", "--output", "{tmp}/x.onnx"],
         "no 'validation' split (splits: train, test); pick one of them with --check_split"),
        (["--check_split", "test[:10]", "--output", "{tmp}/x.onnx"],
         "give --check_split test, and --check_samples N for its first N images"),
        (["--skip_check", "--tolerance", "0.01", "--output", "{tmp}/x.onnx"],
         "error: --tolerance has no effect with --skip_check, which writes the export without checking it; leave one "
         "of them out\n"),
        (["--check_samples", "5", "--skip_check", "--output", "{tmp}/x.onnx"],
         "error: --check_samples has no effect with --skip_check"),
    ],
)  # fmt: skip
def test_bad_export_flags_are_refused_before_anything_is_written(cifar100_run, tmp_path, capsys, flags, problem):
    argv = ["--model", str(cifar100_run), *(flag.format(tmp=tmp_path) for flag in flags)]
    assert run_main(export_main, argv) == 2
    assert problem.format(tmp=tmp_path) in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("export_format", ["onnx", "pt2"])
def test_an_export_stopped_during_its_check_leaves_the_earlier_one_with_its_description(
    cifar100_run, cifar100_dataset, tmp_path, capsys, monkeypatch, export_format
):
    """The export was written in its place before its check ran, so Ctrl-C during the check (which reads the
    whole test split by default) left an unchecked export beside the earlier export's description, which now
    described another file; with none before it, an export without a description, which the next export refused
    as not its own. It takes its place only once checked."""
    output = tmp_path / f"m.{export_format}"
    argv = ["--model", str(cifar100_run), "--format", export_format, "--output", str(output),
            "--check_dataset", str(cifar100_dataset), "--check_samples", "20"]  # fmt: skip
    assert run_main(export_main, [*argv, "--input", "float32"]) == 0
    earlier = snapshot(tmp_path)

    def interrupted(*args: object) -> None:
        check_export(*args)  # on the new file, as written
        raise KeyboardInterrupt

    monkeypatch.setattr("cifar_accel.export.check_export", interrupted)
    assert run_main(export_main, argv) == 130
    assert capsys.readouterr().err == "error: interrupted\n"
    assert snapshot(tmp_path) == earlier  # the float32 export and its description, nothing beside them
    monkeypatch.undo()
    assert run_main(export_main, argv) == 0
    assert json.loads(output.with_name(output.name + ".json").read_text())["input"]["dtype"] == "uint8"


def test_the_check_counts_disagreements(cifar100_run, cifar100_dataset):
    trained = load_model(cifar100_run)
    test, _ = load_split(str(cifar100_dataset), "test", None, "fine_label", 20)

    def shifted(images: torch.Tensor) -> np.ndarray:  # every prediction moved to the next class
        return trained.probabilities(images).roll(1, dims=1).numpy()

    check = check_export(trained, shifted, test.images, "uint8")
    assert check["images"] == 20 and check["same_predictions"] == 0 and check["max_probability_difference"] > 0
    exact = check_export(trained, lambda images: trained.probabilities(images).numpy(), test.images, "uint8")
    assert exact == {"images": 20, "same_predictions": 20, "max_probability_difference": 0.0}


def test_a_read_only_folder_is_refused_before_the_check_and_the_export(cifar100_run, cli_env, tmp_path):
    """Beside weights on a read-only disk (a shared copy of a run), export refuses at once; --output elsewhere."""
    disk = tmp_path / "disk"
    disk.mkdir()
    args = ["--model", str(disk / "run"), "--format", "pt2"]
    before = f"cp -r {cifar100_run} {disk}/run && mount -o remount,ro {disk}"
    error, status, _ = run_on_a_small_disk(disk, "64m", args, cli_env, before=before, module="cifar_accel.export")
    assert [error, status] == [
        f"error: --output's folder '{disk / 'run'}' is not writable (Read-only file system); choose another --output",
        "exit=2",
    ]


@pytest.mark.parametrize("export_format", ["onnx", "pt2"])
def test_a_full_disk_is_one_line_and_leaves_no_half_file(cifar100_run, cli_env, tmp_path, export_format):
    """torch.export.save to a file aborts the process when the disk fills; ONNX raises. Either way: exit code 1,
    one line, and nothing left on the disk."""
    disk = tmp_path / "disk"
    disk.mkdir()
    args = ["--model", str(cifar100_run), "--format", export_format, "--output", f"{disk}/m.{export_format}"]
    error, status, stdout = run_on_a_small_disk(disk, "64k", args, cli_env, then=f"ls -A {disk}",
                                                module="cifar_accel.export")  # fmt: skip
    assert [error, status] == [
        f"error: writing {disk}/m.{export_format} failed (No space left on device); free space on that disk",
        "exit=1",
    ]
    assert stdout == ""  # ls: the disk holds nothing
