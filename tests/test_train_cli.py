"""End-to-end runs of `python -m cifar_accel.train` in real subprocesses on a tiny Hub-layout dataset."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch
import yaml
from huggingface_hub import ModelCard
from PIL import Image
from safetensors.torch import load_file
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from cifar_accel import evaluate, export
from cifar_accel.errors import run_cli as run_in_process
from cifar_accel.outputs import complete_checkpoints
from cifar_accel.precision import hardware_advice, native_bf16

from conftest import REPO, read_results, run_cli, snapshot, tiny_args, train_in_process

RESULT_KEYS = {"best_val_accuracy", "test_accuracy", "epochs_completed", "mixed_precision", "train_images_per_second"}


@pytest.mark.parametrize("precision", [pytest.param("no", marks=pytest.mark.end_to_end), "bf16"])
def test_one_epoch_run_leaves_weights_results_checkpoint_and_events(tiny_dataset, cli_env, tmp_path, precision):
    out = tmp_path / "run"
    proc = run_cli(tiny_args(tiny_dataset, out, "--mixed_precision", precision, "--max_grad_norm", "1.0"), cli_env)
    assert proc.returncode == 0, proc.stderr

    results = read_results(out)
    assert RESULT_KEYS <= results.keys()
    assert results["mixed_precision"] == precision
    assert results["mixed_precision_source"] == "--mixed_precision flag"
    assert results["epochs_completed"] == 1
    assert results["train_samples"] == 294 and results["val_samples"] == 33 and results["test_samples"] == 83
    assert results["train_images_per_second"] > 0
    assert 0.0 <= results["test_accuracy"] <= 1.0
    assert results["best_val_accuracy"] == results["history"][0]["val_accuracy"]
    assert f"in effect '{precision}' on cpu" in proc.stdout and "dtypes of one batch: conv_output " in proc.stdout
    advice = hardware_advice(precision, torch.device("cpu"), native_bf16())  # this CPU's: bf16 emulated or not
    assert results["precision_advice"] == advice
    assert advice is None or f"{advice['level']} cifar_accel.precision: [RANK 0] {advice['message']}" in proc.stdout

    # The model card: the Hub's format, its metadata parsed as YAML and by huggingface_hub, against results.json.
    assert (
        f"results.json, the model card (README.md), config.yaml, checkpoints/ and logs/ are in {out.resolve()}"
        in proc.stdout
    )
    _, metadata, body = (out / "README.md").read_text().split("---\n", 2)
    meta = yaml.safe_load(metadata)
    assert (meta["library_name"], meta["pipeline_tag"], meta["metrics"]) == (
        "cifar-accel",
        "image-classification",
        ["accuracy"],
    )
    assert {"simple_cnn", f"precision-{precision}", "cifar10"} <= set(meta["tags"])
    (entry,) = meta["model-index"]
    (result,) = entry["results"]
    assert entry["name"] == "run" and result["task"]["type"] == "image-classification"
    assert result["dataset"] == {"name": f"CIFAR-10 ({tiny_dataset.name})", "type": "cifar10", "split": "test"}
    assert result["metrics"] == [
        {"type": "accuracy", "value": results["test_accuracy"], "name": "Test accuracy (TTA: none)"}
    ]
    card = ModelCard.load(out / "README.md")
    assert card.data.eval_results[0].metric_value == results["test_accuracy"]
    assert f"| test accuracy | {results['test_accuracy']:.4f} (test-time augmentation: none) |" in body
    assert f"| precision in effect | {precision} (requested `{precision}` by --mixed_precision flag) |" in body
    assert "| training images | 294 (validated on 33 images held out of the train split) |" in body
    assert re.search(r"\| hardware \| .* \(\d cores?\), 1 process, device `cpu` \|", body)
    assert "![training curves](curves.png)" in body and "from cifar_accel import load_model" in body
    assert (out / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    weights = load_file(out / "model.safetensors")
    assert weights["classifier.weight"].shape == (10, 128)
    state = json.loads((out / "checkpoints" / "step_00000009" / "trainer_state.json").read_text())
    assert state["epoch"] == 1 and state["best_epoch"] == 1
    assert state["global_step"] == 294 // 32
    checkpoint_weights = load_file(out / "checkpoints" / "step_00000009" / "model.safetensors")
    assert torch.equal(checkpoint_weights["classifier.weight"], weights["classifier.weight"])
    assert yaml.safe_load((out / "config.yaml").read_text())["mixed_precision"] == precision

    events = EventAccumulator(str(out / "logs" / "cifar_accel"))
    events.Reload()
    scalars = events.Tags()["scalars"]
    for tag in (
        "train/loss",
        "train/accuracy",
        "val/loss",
        "val/accuracy",
        "learning_rate",
        "train/images_per_second",
        "epoch_seconds",
        "test/accuracy",
    ):
        assert tag in scalars
    # The pictures: an augmented batch at step 0; the test's confusion matrix, per-class accuracy and confident
    # mistakes at the last epoch; the HParams panel with the test accuracy.
    images = {tag: events.Images(tag) for tag in events.Tags()["images"]}
    assert images.keys() == {"train/augmentation", "test/confusion_matrix", "test/per_class_accuracy",
                             "test/confident_mistakes"}  # fmt: skip
    assert [e.step for e in images["train/augmentation"]] == [0] and images["test/confusion_matrix"][0].step == 9
    for (event,) in images.values():
        assert event.encoded_image_string.startswith(b"\x89PNG") and event.width >= 200
    assert images["train/augmentation"][0].width == 8 * (3 * 32 + 4) + 4  # 8 images of 32 pixels, drawn 3x
    assert {"_hparams_/experiment", "_hparams_/session_start_info"} <= events.PluginTagToContent("hparams").keys()
    (tested,) = events.Scalars("hparam/test_accuracy")
    assert tested.value == pytest.approx(results["test_accuracy"])
    (val_accuracy,) = events.Scalars("val/accuracy")
    assert val_accuracy.step == 9  # x axis: the optimizer step the epoch ended on (294 // 32 steps)
    assert [(e.step, e.value) for e in events.Scalars("epoch")] == [(9, 1.0)]
    assert val_accuracy.value == pytest.approx(results["history"][0]["val_accuracy"])
    (test_accuracy,) = events.Scalars("test/accuracy")
    assert test_accuracy.value == pytest.approx(results["test_accuracy"])


def test_the_card_of_a_run_on_part_of_the_data_says_which_part(tiny_dataset, tmp_path):
    """With --max_eval_samples 40 the card's metadata named the whole test split, so that the Hub would show the
    accuracy on 40 images as the split's, and its rows gave the counts without saying they were the first ones."""
    out = tmp_path / "run"
    assert train_in_process(tiny_args(tiny_dataset, out, "--max_train_samples", "200", "--max_eval_samples", "40")) == 0
    results = read_results(out)
    assert (results["train_samples"], results["val_samples"], results["test_samples"]) == (180, 20, 40)
    card = ModelCard.load(out / "README.md")
    assert card.data.eval_results[0].dataset_split == "test[:40]"
    assert card.data.eval_results[0].metric_value == results["test_accuracy"]
    body = card.text
    assert "| test images | 40 (the first 40 of the test split: --max_eval_samples) |" in body
    assert (
        "| training images | 180 (from the train split's first 200 images, --max_train_samples; validated on 20 "
        "images held out of the train split) |" in body
    )


def test_fp16_on_cpu_warns_once_and_records_fp32(tiny_dataset, cli_env, tmp_path):
    """Also: the log holds the package's own INFO lines, not other libraries' (matplotlib notes that it builds its
    font cache, which a fresh MPLCONFIGDIR makes it do)."""
    out = tmp_path / "run"
    env = {**cli_env, "MPLCONFIGDIR": str(tmp_path / "matplotlib")}
    proc = run_cli(tiny_args(tiny_dataset, out, "--mixed_precision", "fp16", "--max_train_samples", "100"), env)
    assert proc.returncode == 0, proc.stderr
    warnings = [line for line in proc.stdout.splitlines() if "is not available on cpu" in line]
    assert len(warnings) == 1 and "WARNING" in warnings[0]
    info = {found[1] for found in re.finditer(r"^\d\d:\d\d:\d\d INFO (\S+): ", proc.stdout, re.MULTILINE)}
    assert info and {name.split(".")[0] for name in info} == {"__main__", "cifar_accel"}, info
    results = read_results(out)
    assert results["mixed_precision"] == "no"
    assert results["requested_mixed_precision"] == "fp16"


def test_resume_with_a_different_config_or_a_missing_checkpoint_is_refused(tiny_dataset, cli_env, tmp_path):
    out = tmp_path / "run"
    assert run_cli(tiny_args(tiny_dataset, out, "--max_train_samples", "100"), cli_env).returncode == 0
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}

    args = tiny_args(tiny_dataset, out, "--max_train_samples", "100", "--num_train_epochs", "2")
    proc = run_cli([*args, "--resume_from_checkpoint", "latest", "--seed", "7", "--lr", "0.01"], cli_env)
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert "different config" in line and "seed: checkpoint 42, now 7" in line
    assert "learning_rate: checkpoint 0.001, now 0.01" in line
    settings = out / "config.yaml"
    assert line.endswith(f"resume with its settings (--learning_rate 0.001 --seed 42; all of the run's are in "
                         f"{settings}, for --config), or start a new --output_dir")  # fmt: skip

    proc = run_cli([*args, "--resume_from_checkpoint", str(tmp_path / "nope")], cli_env)
    assert proc.returncode == 2 and "does not exist" in proc.stderr
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before

    # The fixes the line names: the flags it names, and the run's own config with only the fields a resume may
    # change given again.
    proc = run_cli([*args, "--resume_from_checkpoint", "latest", "--learning_rate", "0.001", "--seed", "42"], cli_env)
    assert proc.returncode == 0, proc.stderr
    assert read_results(out)["epochs_completed"] == 2
    resumed = ["--config", str(settings), "--num_train_epochs", "3", "--resume_from_checkpoint", "latest"]
    proc = run_cli(resumed, cli_env)
    assert proc.returncode == 0, proc.stderr
    assert read_results(out)["epochs_completed"] == 3


def test_resuming_from_what_is_no_checkpoint_names_what_it_is(tiny_dataset, train_here, tmp_path):
    """A run's own folder or its checkpoints/ given as the checkpoint was refused as 'another folder's checkpoint'
    that would write a second history over the run, and its weights file as a checkpoint that 'does not exist'.
    Each is refused for what it is, in one line, exit 2, every file unchanged; the checkpoint named then resumes."""
    out = tmp_path / "run"
    args = tiny_args(tiny_dataset, out, "--max_train_samples", "100")
    assert train_here(args).returncode == 0
    (newest,) = complete_checkpoints(out)
    before = snapshot(tmp_path)
    resume = [*args, "--num_train_epochs", "2", "--resume_from_checkpoint"]
    for given in (out, out / "checkpoints"):
        proc = train_here([*resume, str(given)])
        assert (proc.returncode, proc.stderr) == (
            2, f"error: '{given}' holds checkpoints but is not one; pass one, such as the newest: {newest}\n"
        )  # fmt: skip
    proc = train_here([*resume, str(out / "model.safetensors")])
    assert (proc.returncode, proc.stderr) == (
        2,
        f"error: '{out / 'model.safetensors'}' is a file, where a resume needs a checkpoint folder (a run's "
        "checkpoints/step_N, with the optimizer's state); pass one, 'latest' or 'auto'\n",
    )
    proc = train_here([*resume, str(out / "logs")])
    assert proc.returncode == 2 and proc.stderr.startswith(f"error: '{out / 'logs'}' is not a complete checkpoint")
    assert snapshot(tmp_path) == before
    assert train_here([*resume, str(newest)]).returncode == 0
    assert read_results(out)["epochs_completed"] == 2


def test_a_resumed_runs_config_yaml_starts_a_new_run_elsewhere(tiny_dataset, train_here, tmp_path):
    """--config RUN/config.yaml --output_dir new, to start a run set as RUN, failed once RUN had been resumed: its
    config.yaml said 'resume_from_checkpoint: latest' ('no complete checkpoint in new/checkpoints')."""
    out = tmp_path / "run"
    args = tiny_args(tiny_dataset, out, "--max_train_samples", "100")
    assert train_here(args).returncode == 0
    assert train_here([*args, "--num_train_epochs", "2", "--resume_from_checkpoint", "latest"]).returncode == 0
    proc = train_here(["--config", str(out / "config.yaml"), "--output_dir", str(tmp_path / "new")])
    assert proc.returncode == 0, proc.stderr
    assert read_results(tmp_path / "new")["epochs_completed"] == 2
    assert (tmp_path / "new" / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()


def test_a_run_inside_the_folders_another_run_manages_is_refused(tiny_dataset, train_here, cli_env, tmp_path,
                                                                 capsys):  # fmt: skip
    """A run in another run's checkpoints/ or logs/ trained there, and an --overwrite_output_dir of the other run
    then set those folders aside and deleted them, the finished run inside with them. Now that is refused in one
    line, exit 2, before anything is written, by compare too (its runs go below its folder), and by evaluate and
    export; a folder of the run's own name beside its files is not one of them."""
    outer = tmp_path / "outer"
    assert train_here(tiny_args(tiny_dataset, outer)).returncode == 0
    before = snapshot(tmp_path)
    for inside, folder in ((outer / "checkpoints", "checkpoints"), (outer / "logs" / "a" / "b", "logs")):
        proc = train_here(tiny_args(tiny_dataset, inside))
        compared = run_cli(["--dataset_name", str(tiny_dataset), "--output_dir", str(inside), "--precisions", "no"],
                           cli_env, module="cifar_accel.compare")  # fmt: skip
        for refused in (proc, compared):
            assert (refused.returncode, refused.stderr) == (
                2,
                f"error: '{inside}' is part of {folder}/, a folder that the run in '{outer}' manages (an "
                "--overwrite_output_dir there deletes all of it); pick an --output_dir outside it\n",
            )
        # An evaluation or an export there went the same way, and the checkpoints' rotation could take it too.
        assert run_in_process(evaluate.main, ["--model", str(outer), "--output_dir", str(inside)]) == 2
        assert run_in_process(export.main, ["--model", str(outer), "--output", str(inside / "m.onnx")]) == 2
        refusals = capsys.readouterr().err.splitlines()
        assert refusals == [f"error: '{inside}' is part of {folder}/, a folder that the run in '{outer}' manages (an "
                            f"--overwrite_output_dir there deletes all of it); pick an {flag} outside it"
                            for flag in ("--output_dir", "--output")]  # fmt: skip
        assert snapshot(tmp_path) == before and not (outer / "logs" / "a").exists()
    assert train_here(tiny_args(tiny_dataset, outer / "beside")).returncode == 0


def test_refuses_an_output_dir_that_holds_another_run(tiny_dataset, cli_env, tmp_path):
    out = tmp_path / "run"
    assert run_cli(tiny_args(tiny_dataset, out, "--max_train_samples", "100"), cli_env).returncode == 0
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}

    proc = run_cli(tiny_args(tiny_dataset, out, "--max_train_samples", "100"), cli_env)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0
    assert "already holds a run" in proc.stderr and "--overwrite_output_dir" in proc.stderr
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before

    # --overwrite_output_dir replaces the earlier run but leaves files it did not create alone
    (out / "notes.txt").write_text("mine")
    proc = run_cli(tiny_args(tiny_dataset, out, "--max_train_samples", "100", "--overwrite_output_dir"), cli_env)
    assert proc.returncode == 0, proc.stderr
    assert (out / "notes.txt").read_text() == "mine"
    assert str(out.resolve()) in proc.stdout.strip().splitlines()[-1]


def test_missing_dataset_path_is_one_line_and_exit_2(cli_env, tmp_path):
    proc = run_cli(["--dataset_name", str(tmp_path / "nowhere"), "--output_dir", str(tmp_path / "out")], cli_env)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]
    assert "does not exist" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_hub_dataset_offline_points_to_a_local_copy(cli_env, tmp_path):
    proc = run_cli(["--output_dir", str(tmp_path / "out")], cli_env)
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1
    assert proc.stderr.startswith("error: cannot load dataset 'uoft-cs/cifar10'") and "--dataset_name" in proc.stderr


def test_the_chapter_pipeline_script_trains_a_run_as_the_package_does(tiny_dataset, cli_env, tmp_path):
    """scripts/chapter_pipeline.py, the benchmarks' reference input pipeline, trains with the package's loop: the
    same outputs, epochs and splits as the package's own run, only the training batches made otherwise."""
    ours, chapter = tmp_path / "ours", tmp_path / "chapter"
    assert train_in_process(tiny_args(tiny_dataset, ours)) == 0
    script = REPO / "scripts" / "chapter_pipeline.py"
    proc = subprocess.run(
        [sys.executable, str(script), *tiny_args(tiny_dataset, chapter)],
        env=cli_env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in chapter.iterdir()) == sorted(p.name for p in ours.iterdir())
    for key in ("epochs_completed", "train_samples", "val_samples", "test_samples"):
        assert read_results(chapter)[key] == read_results(ours)[key], key


def test_a_leading_tilde_is_the_home_folder_in_every_path_flag_and_config_value(tiny_dataset, cli_env, tmp_path):
    """The shell leaves ~ as it is in --flag=~/x (and in quotes), and a config file is not read by a shell. Every
    path of every command expands it as the shell would, rather than making a folder called ~ in the working
    folder or refusing a path that exists."""
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    env = {**cli_env, "HOME": str(home)}

    def command(module: str, *args: str) -> subprocess.CompletedProcess:
        proc = subprocess.run(
            [sys.executable, "-m", module, *args], env=env, cwd=work, capture_output=True, text=True, timeout=300
        )
        assert proc.returncode == 0, proc.stderr
        return proc

    (home / "run.yaml").write_text(
        f"output_dir: ~/a\ndataset_name: {tiny_dataset}\nnum_train_epochs: 1\nper_device_train_batch_size: 32\n"
    )
    command("cifar_accel.train", "--config=~/run.yaml")
    (checkpoint,) = sorted(p.name for p in (home / "a" / "checkpoints").iterdir())
    resume = f"--resume_from_checkpoint=~/a/checkpoints/{checkpoint}"
    command("cifar_accel.train", "--config=~/run.yaml", "--output_dir=~/b", resume, "--num_train_epochs", "2")
    assert read_results(home / "b")["epochs_completed"] == 2
    command("cifar_accel.evaluate", "--model=~/b", "--output_dir=~/eval", f"--dataset_name={tiny_dataset}")
    command("cifar_accel.export", "--model=~/b", "--format", "pt2", "--skip_check", "--output=~/b.pt2")
    Image.new("RGB", (32, 32)).save(home / "image.png")
    assert command("cifar_accel.predict", "--model=~/b", "~/image.png").stdout.startswith(f"{home / 'image.png'}: ")
    command("cifar_accel.compare", "--precisions", "no", "--output_dir=~/compare", "--config=~/run.yaml")
    assert (home / "eval" / "metrics.json").is_file() and (home / "b.pt2").is_file()
    assert (home / "compare" / "report.md").is_file()
    assert list(work.iterdir()) == []
