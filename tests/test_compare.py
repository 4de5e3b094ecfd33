"""The precision comparison: one command, runs per precision and seed, a report whose numbers are the runs'."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from PIL import Image

from cifar_accel.checkpoint import complete_checkpoints
from cifar_accel.compare import (
    TrainingProcesses,
    add_ratios,
    build_parser,
    check_loss_scale_logged,
    markdown,
    results_table,
)
from cifar_accel.compare import main as compare_cli
from cifar_accel.errors import InputError
from cifar_accel.errors import run_cli as run_in_process

from conftest import read_results, run_cli, tiny_args, wait_until

PRECISIONS = ["no", "bf16"]
SEEDS = [42, 7]


def compare_args(dataset: Path, out: Path, *extra: str) -> list[str]:
    """The module's comparison; --precisions or --seeds in ``extra`` replace its own (given twice, they add up)."""
    lists = [] if "--precisions" in extra else ["--precisions", "no", "fp16", "bf16"]
    lists += [] if "--seeds" in extra else ["--seeds", *map(str, SEEDS)]
    return tiny_args(
        dataset, out, "--num_train_epochs", "2", "--max_train_samples", "150", *lists, "--logging_steps", "2",
        "--jobs", "2", *extra,
    )  # fmt: skip


@pytest.fixture(scope="module")
def compared(tiny_dataset, cli_env, tmp_path_factory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("compare") / "report"
    proc = run_cli(compare_args(tiny_dataset, out), cli_env, module="cifar_accel.compare", timeout=600)
    assert proc.returncode == 0, proc.stderr
    return out, proc.stdout


def test_fp16_is_skipped_on_a_cpu_with_the_reason(compared):
    out, stdout = compared
    report = json.loads((out / "report.json").read_text())
    assert [s["precision"] for s in report["precisions"]] == PRECISIONS
    assert "needs a CUDA GPU" in report["skipped"]["fp16"]
    assert "skipping fp16: needs a CUDA GPU" in stdout
    assert not (out / "fp16_seed42").exists()


def test_the_report_holds_the_runs_own_numbers(compared):
    out, _ = compared
    report = json.loads((out / "report.json").read_text())
    markdown = (out / "report.md").read_text()
    for summary in report["precisions"]:
        runs = [read_results(out / f"{summary['precision']}_seed{seed}") for seed in SEEDS]
        for key in ("test_accuracy", "best_val_accuracy", "seconds_per_epoch", "peak_memory_mib"):
            values = [r[key] for r in runs]
            assert summary[key]["mean"] == pytest.approx(statistics.fmean(values))
            assert summary[key]["std"] == pytest.approx(statistics.pstdev(values))
        assert summary["val_accuracy_per_epoch"] == pytest.approx(
            [statistics.fmean(r["history"][i]["val_accuracy"] for r in runs) for i in range(2)]
        )
        assert summary["epochs_trained"] == 2
        assert summary["dtypes"]["conv_output"] == {"no": "float32", "bf16": "bfloat16"}[summary["precision"]]
        row = next(line for line in markdown.splitlines() if line.startswith(f"| {summary['precision']} |"))
        assert f"{summary['test_accuracy']['mean']:.4f} ± {summary['test_accuracy']['std']:.4f}" in row
        assert f"{summary['seconds_per_epoch']['mean']:.1f}" in row
    no, bf16 = report["precisions"]
    assert bf16["vs_no"]["speedup"] == pytest.approx(
        no["seconds_per_epoch"]["mean"] / bf16["seconds_per_epoch"]["mean"]
    )
    assert report["versions"]["torch"] and report["hardware"]["cpu_cores"] == os.cpu_count()
    assert report["jobs"] == 2 and report["threads_per_run"] == max(1, os.cpu_count() // 2)
    assert isinstance(report["hardware"]["cpu_flags"], list)


def test_each_seed_has_a_row_and_the_seeds_their_statistics(compared):
    """Per precision: each seed's accuracy with and without TTA and its training time, as its results.json
    says, then their mean, std, min and max; each run trained on its own threads, its output in its log."""
    out, _ = compared
    report = json.loads((out / "report.json").read_text())
    markdown = (out / "report.md").read_text()
    for summary in report["precisions"]:
        precision = summary["precision"]
        runs = {seed: read_results(out / f"{precision}_seed{seed}") for seed in SEEDS}
        seconds = {seed: sum(e["epoch_seconds"] for e in r["history"]) for seed, r in runs.items()}
        assert [row["seed"] for row in summary["per_seed"]] == sorted(SEEDS)
        for row in summary["per_seed"]:
            assert row["test_accuracy_no_tta"] == runs[row["seed"]]["test_accuracy_no_tta"]
            assert row["train_seconds"] == pytest.approx(seconds[row["seed"]])
        no_tta = [r["test_accuracy_no_tta"] for r in runs.values()]
        assert summary["test_accuracy_no_tta"] == pytest.approx(
            {"mean": statistics.fmean(no_tta), "std": statistics.pstdev(no_tta), "min": min(no_tta), "max": max(no_tta)}
        )
        table = markdown[markdown.index(f"`{precision}`, each seed") :].split("\n\n")[1].splitlines()
        assert table[2] == (f"| 7 | {100 * runs[7]['test_accuracy']:.2f} | {100 * runs[7]['test_accuracy_no_tta']:.2f} "
                            f"| {seconds[7]:.0f} |")  # fmt: skip
        assert [line.split(" | ")[0] for line in table[4:]] == ["| mean", "| std", "| min", "| max"]
        assert table[7] == (f"| max | {100 * max(r['test_accuracy'] for r in runs.values()):.2f} | "
                            f"{100 * max(no_tta):.2f} | {max(seconds.values()):.0f} |")  # fmt: skip
        log = (out / f"{precision}_seed42.log").read_text()
        assert "test accuracy" in log.lower()
    assert "Skipped `fp16`" in markdown and "![curves.png](curves.png)" in markdown


def test_a_report_of_one_seed_has_its_row_and_no_statistics_rows(compared):
    """The mean, min and max of one seed are its own figures and its std 0: the seed table stops at its row."""
    out, _ = compared
    report = json.loads((out / "report.json").read_text())
    for summary in report["precisions"]:
        summary["per_seed"] = summary["per_seed"][:1]
    text = markdown(report)
    table = text[text.index("`no`, each seed") :].split("\n\n")[1].splitlines()
    assert len(table) == 3 and table[2].startswith(f"| {report['precisions'][0]['per_seed'][0]['seed']} | ")
    assert "| std |" not in text


def test_without_a_no_run_the_ratios_against_no_are_dashes(compared):
    """A report of bf16 alone (the same runs, 'no' left out) has nothing to divide by: its ratio cells say so."""
    out, _ = compared
    report = json.loads((out / "report.json").read_text())
    row = next(line for line in markdown(report).splitlines() if line.startswith("| bf16 |"))
    assert f"| {report['precisions'][1]['vs_no']['speedup']:.2f}x |" in row
    report["precisions"] = report["precisions"][1:]
    add_ratios(report["precisions"])
    cells = next(line for line in markdown(report).splitlines() if line.startswith("| bf16 |")).split(" | ")
    assert [cells[2], cells[5], cells[8]] == ["-", "-", "-"] and "nan" not in " ".join(cells)


@pytest.mark.parametrize("name", ["curves.png", "cost.png"])
def test_the_plots_are_images_of_sensible_size(compared, name):
    out, _ = compared
    with Image.open(out / name) as png:
        assert png.format == "PNG" and png.width >= 800 and png.height >= 300
    assert not (out / "loss_scale.png").exists()  # no fp16 run, no loss-scale trace


def test_finished_runs_are_reused_and_an_unfinished_one_is_resumed(compared, tiny_dataset, cli_env):
    """Reused runs keep their results, and the report gives the threads and machine each run recorded, not the
    comparison's own: here it runs on more threads than the first one gave each run, and one run's record names
    another CPU."""
    out, _ = compared
    finished = out / "bf16_seed42" / "results.json"
    before = finished.stat().st_mtime_ns
    unfinished = out / "no_seed7" / "results.json"
    test_accuracy = json.loads(unfinished.read_text())["test_accuracy"]
    unfinished.unlink()  # as if the run had been stopped after its last checkpoint
    first_threads = max(1, os.cpu_count() // 2)  # each run's in the first comparison, 2 at a time
    threads = first_threads + 1  # this comparison's, and the resumed run's

    args = [*compare_args(tiny_dataset, out), "--jobs", "1"]
    proc = run_cli(args, {**cli_env, "OMP_NUM_THREADS": str(threads)}, module="cifar_accel.compare")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("reusing the finished run") == 3
    assert "--resume_from_checkpoint latest" in proc.stdout
    assert finished.stat().st_mtime_ns == before
    assert json.loads(unfinished.read_text())["test_accuracy"] == test_accuracy
    assert read_results(out / "no_seed7")["hardware"]["torch_threads"] == threads
    assert read_results(out / "bf16_seed42")["hardware"]["torch_threads"] == first_threads
    expected = f"{first_threads} (no seed 42, bf16 seed 42, bf16 seed 7); {threads} (no seed 7)"
    assert json.loads((out / "report.json").read_text())["threads_per_run"] == expected
    assert (
        f"- Threads per run, as the runs recorded: {expected}; this comparison trained 1 of its 4 runs, 1 at a time, "
        "and reused the others" in (out / "report.md").read_text()
    )

    results = json.loads(finished.read_text())
    results["hardware"]["cpu"] = "Another CPU"
    finished.write_text(json.dumps(results))
    proc = run_cli(args, cli_env, module="cifar_accel.compare")
    assert proc.returncode == 0, proc.stderr
    report = json.loads((out / "report.json").read_text())
    assert report["hardware"]["cpu"] == read_results(out / "no_seed42")["hardware"]["cpu"] != "Another CPU"
    assert list(report["other_machines"].values()) == ["bf16 seed 42"]
    text = (out / "report.md").read_text()
    assert "- Some runs trained on other machines, so their times do not compare with the rest: Another CPU (" in text
    # Every run reused: the comparison does not claim how many trained at a time.
    assert report["trained"] == 0 and "this comparison trained none of its runs: it reused runs" in text
    rows = results_table({"reused": report}).splitlines()[2:]
    assert len(rows) == 2 and all(" min, trained before the comparison | " in row for row in rows)


def test_a_length_in_optimizer_steps_is_reported_and_keeps_its_runs_apart(tiny_dataset, cli_env, tmp_path, capsys):
    out = tmp_path / "report"
    args = tiny_args(tiny_dataset, out, "--max_train_samples", "150", "--precisions", "no", "--seeds", "0",
                     "--max_train_steps", "5", "--early_crop_size", "24", "--early_crop_epochs", "3")  # fmt: skip
    proc = run_cli(args, cli_env, module="cifar_accel.compare")
    assert proc.returncode == 0, proc.stderr
    report = json.loads((out / "report.json").read_text())
    # Windows in every epoch but the last, of the 2 the 5 steps span
    assert ", 5 optimizer steps (the first epoch on 24x24 windows), batch 32, " in report["config_summary"]
    assert report["precisions"][0]["per_seed"][0]["epochs"] == 2  # 135 training images: 4 steps of 32, then 1
    assert read_results(out / "no_seed0")["history"][1]["train_images"] == 32
    assert report["precisions"][0]["epochs_trained"] == 1.25  # (128 + 32) / 128
    assert "| [steps](docs/results/steps/report.md) | no | 1.25 | 1 | " in results_table({"steps": report})
    proc = run_cli(args, cli_env, module="cifar_accel.compare")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("reusing the finished run") == 1
    assert run_in_process(compare_cli, [*args, "--max_train_steps", "6"]) == 2
    assert "was made with other settings (max_train_steps 5 (not 6))" in capsys.readouterr().err


def test_runs_that_log_to_no_tracker_are_reported(tiny_dataset, cli_env, tmp_path):
    """--report_to none: the runs write no TensorBoard events, and a run without a GradScaler has no loss scale to
    read from them."""
    out = tmp_path / "report"
    args = tiny_args(tiny_dataset, out, "--max_train_samples", "150", "--precisions", "no", "--seeds", "0",
                     "--num_train_epochs", "1", "--report_to", "none")  # fmt: skip
    proc = run_cli(args, cli_env, module="cifar_accel.compare")
    assert proc.returncode == 0, proc.stderr
    assert not list((out / "no_seed0").rglob("events.out.tfevents*"))
    report = json.loads((out / "report.json").read_text())
    assert report["precisions"][0]["loss_scale_trace"] == {"0": []}
    assert ", 1 epoch, batch 32, " in report["config_summary"]  # a count of one in the singular, and no windows
    assert "this comparison trains 1 run at a time" in (out / "report.md").read_text()


@pytest.mark.parametrize(
    ("precisions", "report_to", "refused"),
    [(["no", "fp16"], "none", True), (["fp16"], "mlflow", True), (["fp16"], "mlflow,tensorboard", False),
     (["fp16"], "all", False), (["no", "bf16"], "none", False)],
)  # fmt: skip
def test_fp16_runs_without_tensorboard_are_refused_before_they_start(precisions, report_to, refused):
    if not refused:
        check_loss_scale_logged(precisions, report_to)
        return
    with pytest.raises(InputError, match=f"--report_to {report_to} leaves out TensorBoard, whose events give"):
        check_loss_scale_logged(precisions, report_to)


def test_runs_made_with_other_settings_are_refused_with_the_fix_for_compare(compared, tiny_dataset, tmp_path, capsys):
    """A resume of them would be refused, with advice for train's command line (--config <run>/config.yaml) that
    does not fit compare's: the comparison names them and its own fix before anything runs."""
    out = Path(shutil.copytree(compared[0], tmp_path / "report"))
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert (
        run_in_process(compare_cli, [*compare_args(tiny_dataset, out), "--learning_rate", "0.01", "--jobs", "1"]) == 2
    )
    line = capsys.readouterr().err.strip()
    assert line == (
        f"error: the no run (seed 42) in {out / 'no_seed42'} was made with other settings (learning_rate 0.001 (not "
        "0.01)); compare these settings in another --output_dir, or give the ones it was made with"
    )
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


def test_a_finished_run_with_another_setting_is_refused_not_tested_again_and_one_older_than_a_setting_reused(
    compared, tiny_dataset, tmp_path, capsys
):
    """Resuming a finished run for a setting other than more epochs would only test its weights again and record
    the setting as if they had trained with it. A run saved before a setting existed had that setting's default."""
    out = Path(shutil.copytree(compared[0], tmp_path / "report"))
    args = [*compare_args(tiny_dataset, out), "--jobs", "1"]
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert run_in_process(compare_cli, [*args, "--no-channels_last"]) == 2
    line = capsys.readouterr().err.strip()
    assert line == (
        f"error: the no run (seed 42) in {out / 'no_seed42'} was made with other settings (channels_last True (not "
        "False)); compare these settings in another --output_dir, or give the ones it was made with"
    )
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before

    for config in out.glob("*_seed*/config.yaml"):  # as written before --conv_weight_grads existed
        config.write_text(
            "".join(line for line in config.read_text().splitlines(True) if "conv_weight_grads" not in line)
        )
    assert run_in_process(compare_cli, args) == 0
    assert json.loads((out / "report.json").read_text())["trained"] == 0
    results = [p for p in before if p.name == "results.json"]
    assert len(results) == 4 and all(p.read_bytes() == before[p] for p in results)


def test_a_signal_stops_the_run_in_training_at_a_checkpoint_and_starts_no_other(tiny_dataset, cli_env, tmp_path):
    """Ctrl-C in a terminal signals the comparison only (its runs train in process groups of their own): it passes
    the request on to the run in training once, which stops with a checkpoint, and starts no other run. (Starting
    the same command again resumes it, as test_finished_runs_are_reused_and_an_unfinished_one_is_resumed shows.)"""
    out = tmp_path / "report"
    args = tiny_args(tiny_dataset, out, "--num_train_epochs", "8", "--max_train_samples", "150",
                     "--precisions", "no", "bf16", "--seeds", "42", "--jobs", "1")  # fmt: skip
    command = [sys.executable, "-m", "cifar_accel.compare", *args]
    proc = subprocess.Popen(command, env=cli_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_until(lambda: complete_checkpoints(out / "no_seed42"), proc)  # the first run in its second epoch
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=120)

    assert proc.returncode == 130, stderr
    assert stderr == (
        "stopped by SIGINT; the runs not finished, 2 of 2: no_seed42, bf16_seed42; run the same command again to "
        "go on\n"
    )
    assert re.search(r"no_seed42: stopped by SIGINT after \d+ epochs? and ", stdout)  # its line: one SIGINT came
    assert complete_checkpoints(out / "no_seed42") and not (out / "no_seed42" / "results.json").exists()
    assert not (out / "bf16_seed42").exists() and not (out / "report.json").exists()


def test_a_closed_terminal_reaches_the_runs_too(tmp_path, hangup_as_a_terminal_sends_it):
    """The runs are in sessions of their own, so a hangup reaches the comparison only: it passes SIGHUP on (each
    run stops at a checkpoint as for SIGTERM) and starts no other run."""
    with TrainingProcesses() as processes, ThreadPoolExecutor(1) as pool:
        running = pool.submit(processes.run, ["sh", "-c", f"touch {tmp_path}/started; exec sleep 60"])
        wait_until((tmp_path / "started").exists, seconds=30)
        os.kill(os.getpid(), signal.SIGHUP)
        assert running.result(timeout=30).returncode == -signal.SIGHUP
        assert processes.signal_number == signal.SIGHUP and processes.run(["true"]) is None


def test_a_comparison_killed_by_sigkill_takes_its_run_down_at_a_checkpoint(tiny_dataset, cli_env, tmp_path):
    """SIGKILL leaves the comparison no handler to pass a stop on with: the run asked the kernel for SIGTERM when
    its parent ends, so it stops at a checkpoint instead of training its 1000 epochs unseen."""
    out = tmp_path / "report"
    args = tiny_args(tiny_dataset, out, "--num_train_epochs", "1000", "--early_stopping_patience", "0",
                     "--max_train_samples", "150", "--precisions", "no", "--seeds", "42")  # fmt: skip
    comparison = subprocess.Popen([sys.executable, "-m", "cifar_accel.compare", *args], env=cli_env,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    run = out / "no_seed42"
    wait_until(lambda: complete_checkpoints(run) and (run / ".lock").exists(), comparison)
    comparison.kill()
    comparison.wait()
    deadline = time.monotonic() + 60
    try:
        while (run / ".lock").exists():  # the run holds its folder until it ends
            assert time.monotonic() < deadline, "the run trains on after its comparison was killed"
            time.sleep(0.1)
    finally:
        with contextlib.suppress(OSError, ValueError):  # a run left training would slow the rest of the suite
            os.kill(json.loads((run / ".lock").read_text())["pid"], signal.SIGKILL)
    assert complete_checkpoints(run) and not (run / "results.json").exists()


def test_a_run_that_fails_stops_the_run_in_training_and_the_comparison_at_once(tiny_dataset, cli_env, tmp_path):
    """Seed 7's folder holds a config.yaml of the user's, so its run is refused; seed 42's, with a long run ahead of
    it, is stopped then (as a signal stops it), not trained to its end before the failure is reported."""
    out = tmp_path / "report"
    (out / "no_seed7").mkdir(parents=True)
    (out / "no_seed7" / "config.yaml").write_text("mine\n")
    args = tiny_args(tiny_dataset, out, "--num_train_epochs", "1000", "--early_stopping_patience", "0",
                     "--max_train_samples", "150", "--precisions", "no", "--seeds", "42", "7",
                     "--jobs", "2")  # fmt: skip
    proc = run_cli(args, cli_env, module="cifar_accel.compare", timeout=120)
    assert proc.returncode == 2
    last_line = proc.stderr.strip().splitlines()[-1]
    assert last_line.startswith(
        f"error: the no run (seed 7) in {out / 'no_seed7'} failed: '{out / 'no_seed7' / 'config.yaml'}' is not a "
        "config a run wrote"
    )
    assert "a run failed: stopping the others at a checkpoint; the same command resumes them" in proc.stdout
    assert not (out / "no_seed42" / "results.json").exists() and not (out / "report.json").exists()
    assert (out / "no_seed7" / "config.yaml").read_text() == "mine\n"


def test_a_bad_training_flag_stops_before_any_run(tiny_dataset, cli_env, tmp_path):
    proc = run_cli(compare_args(tiny_dataset, tmp_path / "out", "--learning_rate", "-1"), cli_env,
                   module="cifar_accel.compare")  # fmt: skip
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("error: ") and "learning_rate" in line
    assert not any((tmp_path / "out").glob("*_seed*"))


PUSH = (
    "push_to_hub is not for compare: every run would push to the one Hub repository of --hub_model_id, or to one "
    "named after its folder, such as no_seed42, over the others; leave it out, and upload the run you pick "
    "afterwards with hf upload"
)
TOKEN = (
    "hub_token is not for compare: it serves only push_to_hub, which compare refuses, and the report would show it in "
    "the command it records; leave it out"
)


@pytest.mark.parametrize(
    "flags, fix",
    [
        (["--seed", "3"], "--seed 3 is not for compare; compare gives each run its --seed from --seeds: give "
         "--seeds 3"),
        (["--mixed_precision", "bf16"], "--mixed_precision bf16 is not for compare; compare gives each run its "
         "--mixed_precision from --precisions: give --precisions bf16"),
        (["--resume", "latest"], "--resume_from_checkpoint latest is not for compare; compare resumes its unfinished "
         "runs and reuses its finished ones itself: run the same command again without it"),
        (["--seeds", "1", "-4"], "--seeds: 'seed' must be >= 0, got -4"),
        (["--seeds", "0", "2", "0"], "--seeds lists 0 more than once; give each once"),
        (["--precisions", "bf16", "no", "bf16"], "--precisions lists bf16 more than once; give each once"),
        (["--seeds", "0", "2", "--seeds", "2"], "--seeds lists 2 more than once; give each once"),  # they add up
        (["--precisions", "no", "--precisions", "no"], "--precisions lists no more than once; give each once"),
        (["--push_to_hub", "--hub_model_id", "me/cifar"], PUSH),
        (["--config", "{tmp}/push.yaml"], PUSH),
        (["--hub_token", "hf_secret4"], TOKEN),
    ],
)  # fmt: skip
def test_training_flags_that_compare_sets_per_run_are_refused_with_its_own(tiny_dataset, tmp_path, capsys, flags, fix):
    """Each run's own --seed, --mixed_precision and --resume_from_checkpoint come last and would win unseen; every
    run would push to the Hub over the others (from a flag or a config file); the report and the log showed a Hub
    token in the command they record."""
    (tmp_path / "push.yaml").write_text("push_to_hub: true\n")
    flags = [flag.format(tmp=tmp_path) for flag in flags]
    assert run_in_process(compare_cli, compare_args(tiny_dataset, tmp_path / "out", *flags)) == 2
    assert capsys.readouterr().err == f"error: {fix}\n"
    assert not (tmp_path / "out").exists()


def test_seeds_and_precisions_given_again_add_up():
    """argparse kept the last list: --precisions no --precisions bf16 compared bf16 alone, without a word."""
    args, _ = build_parser().parse_known_args(["--precisions", "no", "--seeds", "1", "--precisions", "bf16",
                                               "--seeds", "2", "3"])  # fmt: skip
    assert (args.precisions, args.seeds) == (["no", "bf16"], [1, 2, 3])
    args, _ = build_parser().parse_known_args([])
    assert (args.precisions, args.seeds) == (["no", "fp16", "bf16"], [42])


@pytest.mark.skipif(torch.cuda.is_available(), reason="fp16 runs on this machine's GPU")
def test_nothing_to_run_is_refused_and_leaves_no_folder(tiny_dataset, cli_env, tmp_path):
    proc = run_cli(compare_args(tiny_dataset, tmp_path / "new" / "out", "--precisions", "fp16"), cli_env,
                   module="cifar_accel.compare")  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr == "error: none of the requested precisions can run here; add --precisions no\n"
    assert not (tmp_path / "new").exists()  # the folders the command made for its report go again


def test_a_signal_as_the_last_run_finishes_lets_it_and_the_report_finish(tiny_dataset, cli_env, tmp_path):
    """A run stopped during its final test and export finishes them first (its results.json is written): the
    comparison counts it as finished, not as a run to resume, and with every run finished writes the report before
    it exits with the signal's code, as a run does."""
    out = tmp_path / "report"
    args = tiny_args(tiny_dataset, out, "--num_train_epochs", "1", "--precisions", "no", "--seeds", "42")
    command = [sys.executable, "-m", "cifar_accel.compare", *args]
    proc = subprocess.Popen(command, env=cli_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_until(lambda: complete_checkpoints(out / "no_seed42"), proc)  # the last epoch's: the final test is next
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=120)

    assert proc.returncode == 130, stderr
    assert (
        stderr
        == f"stopped by SIGINT as the runs were finishing; they finished first, and the report is in {out}/report.md\n"
    )
    report = json.loads((out / "report.json").read_text())
    assert report["trained"] == 1 and report["precisions"][0]["seeds"] == [42]
    assert read_results(out / "no_seed42")["epochs_completed"] == 1
