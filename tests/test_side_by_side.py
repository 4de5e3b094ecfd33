"""scripts/side_by_side.py goes on where it stopped only with the same anchor command and preset config, and names
the machine each preset run recorded. A real preset run, scaled down to the tiny dataset, stands for a finished
pair's; its pair.json is what the script writes after a pair."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import side_by_side as side_by_side_script

from cifar_accel.errors import run_cli as run_main

from conftest import REPO, read_results, run_cli, wait_until

SCRIPT = REPO / "scripts" / "side_by_side.py"
ANCHOR = "absent_anchor.py"  # never started: every pair here is reused or refused


SCALED_DOWN = ["--num_train_epochs", "1", "--per_device_train_batch_size", "32", "--gradient_accumulation_steps", "4",
               "--per_device_eval_batch_size", "50"]  # fmt: skip


def side_by_side(
    dataset: Path, out: Path, env: dict[str, str], precision: str, *train_args: str, anchor=ANCHOR, own=()
):
    command = [sys.executable, str(SCRIPT), "--anchor", str(anchor), "--dataset_name", str(dataset),
               "--precision", precision, "--seeds", "0", "--output_dir", str(out), *own, "--", *train_args]  # fmt: skip
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def anchor_dataset(tiny_dataset, tmp_path_factory) -> Path:
    """The tiny dataset with its parquet files where the anchor reads CIFAR-10's: plain_text/<split>-00000-of-00001,
    as in the Hub's copy (``datasets`` reads both layouts)."""
    root = tmp_path_factory.mktemp("anchor_layout")
    (root / "plain_text").mkdir()
    for split in ("train", "test"):
        name = f"{split}-00000-of-00001.parquet"
        shutil.copyfile(tiny_dataset / "data" / name, root / "plain_text" / name)
    return root


@pytest.fixture(scope="module")
def finished_pair(anchor_dataset, cli_env, tmp_path_factory) -> tuple[Path, dict]:
    """A folder as side_by_side leaves it after seed 0's pair in fp32 (``-- SCALED_DOWN``), moved since; the
    preset's flags, then equal to the preset's values, name its brightness and contrast jitter. Its pair.json is one
    from before --one_after_other, without "together": both scripts ran at the same time."""
    root = tmp_path_factory.mktemp("side_by_side")
    earlier, out = root / "earlier", root / "moved"
    train = ["--config", "fast", "--dataset_name", str(anchor_dataset), "--mixed_precision", "no", "--seed", "0",
             "--output_dir", str(earlier / "no_seed0"), *SCALED_DOWN, "--brightness_shift", "0.14"]  # fmt: skip
    proc = run_cli(train, cli_env)
    assert proc.returncode == 0, proc.stderr
    results = read_results(earlier / "no_seed0")
    results["hardware"]["cpu"] = "The CPU the run recorded"
    (earlier / "no_seed0" / "results.json").write_text(json.dumps(results))
    launch = ["python", "-m", "accelerate.commands.launch", "--cpu", "--num_processes", "1", "--num_machines", "1",
              "--dynamo_backend", "no", "-m", "cifar_accel.train"]  # fmt: skip
    pair = {
        "seed": 0,
        "anchor": {"tta": 0.5, "plain": 0.4, "own_s": 90.0, "wall_s": 100.0, "cpu_s": 95.0,
                   "command": ["python", ANCHOR, str(anchor_dataset), "--precision", "no", "--seed", "0"]},
        "preset": {"tta": results["test_accuracy"], "plain": results["test_accuracy_no_tta"], "own_s": 60.0,
                   "epochs": 1, "wall_s": 80.0, "cpu_s": 76.0, "command": [*launch, *train]},
    }  # fmt: skip
    (earlier / "seed0").mkdir()
    (earlier / "seed0" / "pair.json").write_text(json.dumps(pair))
    earlier.rename(out)
    return out, pair


def files(folder: Path) -> dict[Path, int]:
    return {path: path.stat().st_mtime_ns for path in folder.rglob("*")}


@pytest.mark.parametrize(
    ("precision", "epochs", "refused"),
    [
        (
            "bf16",
            "1",
            "ran the anchor as '{anchor} {data} --precision no --seed 0', not '{anchor} {data} "
            "--precision bf16 --seed 0'",
        ),  # fmt: skip
        ("no", "2", "no_seed0 trained the preset with num_train_epochs 1 (not 2)"),
    ],
)
def test_a_pair_of_another_command_or_config_stops_the_script_and_nothing_is_written(
    finished_pair, anchor_dataset, cli_env, precision, epochs, refused
):
    out, _ = finished_pair
    before = files(out)
    proc = side_by_side(anchor_dataset, out, cli_env, precision, *SCALED_DOWN, "--num_train_epochs", epochs)
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(f"error: {out}") and refused.format(anchor=ANCHOR, data=anchor_dataset) in line
    assert line.endswith("; give the same flags again, or another --output_dir")
    assert files(out) == before


@pytest.mark.parametrize("damage", [lambda text: text[:40], lambda text: "[]", lambda text: '{"seed": 0}'],
                         ids=["cut-short", "not-an-object", "without-the-anchor"])  # fmt: skip
def test_a_damaged_pair_record_is_named_with_the_fix(finished_pair, anchor_dataset, tmp_path, capsys, damage):
    """A pair.json cut short (by a full disk, before it was written atomically) or edited stopped the script with
    JSON's traceback or a KeyError; the line names the file and what to do."""
    out = tmp_path / "pair"
    shutil.copytree(finished_pair[0], out)
    done = out / "seed0" / "pair.json"
    done.write_text(damage(done.read_text()))
    before = files(out)
    argv = ["--anchor", ANCHOR, "--dataset_name", str(anchor_dataset), "--precision", "no", "--seeds", "0",
            "--output_dir", str(out), "--", *SCALED_DOWN]  # fmt: skip
    assert run_main(side_by_side_script.main, argv) == 2
    error = capsys.readouterr().err
    assert error.startswith(f"error: {done} is not the record of a finished pair (") and error.count("\n") == 1
    assert error.endswith("); delete it, and the same command runs the pair again\n")
    assert files(out) == before


def test_a_pair_of_the_same_anchor_command_and_preset_config_is_reused_and_named_by_its_recorded_machine(
    finished_pair, anchor_dataset, cli_env
):
    """Reused from its new folder, with the preset's flags as this invocation gives them (the jitter left to the
    preset)."""
    out, pair = finished_pair
    proc = side_by_side(anchor_dataset, out, cli_env, "no", *SCALED_DOWN)
    assert proc.returncode == 0, proc.stderr
    table = (out / "side_by_side.md").read_text()
    assert "- CPU: The CPU the run recorded (" in table
    assert f"| 0 | preset | {100 * pair['preset']['tta']:.2f} | {100 * pair['preset']['plain']:.2f} | 60 | 80 | 76 " \
           "| 0.80x | 0.80x |" in table  # fmt: skip
    assert f"- preset: TTA {100 * pair['preset']['tta']:.2f}%, plain {100 * pair['preset']['plain']:.2f}% at seed 0; " \
           "wall 0.80x, CPU 0.80x the anchor's" in table  # fmt: skip
    summary = json.loads((out / "side_by_side.json").read_text())
    assert summary["pairs"] == [{**pair, "together": True}] and list(summary["machines"].values()) == [[0]]
    assert not (out / "seed0" / "anchor.log").exists()


def test_a_pair_that_did_not_finish_runs_again_and_replaces_its_preset_run(
    finished_pair, anchor_dataset, cli_env, tmp_path
):
    """A pair stopped before its pair.json was written left a preset run in its folder; the pair is timed as a
    whole, so both scripts run again, the preset over its earlier run. A stand-in prints the anchor's result line."""
    out = tmp_path / "stopped"
    shutil.copytree(finished_pair[0], out)
    (out / "seed0" / "pair.json").unlink()
    earlier = (out / "no_seed0" / "results.json").stat().st_mtime_ns
    anchor = tmp_path / "anchor.py"
    anchor.write_text('print("tta_acc 0.9100 plain_acc 0.9000 time 12.5 s")\n')

    proc = side_by_side(anchor_dataset, out, cli_env, "no", *SCALED_DOWN, anchor=anchor)
    assert proc.returncode == 0, proc.stderr
    pair = json.loads((out / "seed0" / "pair.json").read_text())
    assert (pair["anchor"]["tta"], pair["anchor"]["plain"], pair["anchor"]["own_s"]) == (0.91, 0.9, 12.5)
    assert pair["preset"]["command"][-1] == "--overwrite_output_dir"
    assert (out / "no_seed0" / "results.json").stat().st_mtime_ns != earlier
    assert pair["preset"]["tta"] == read_results(out / "no_seed0")["test_accuracy"]


PRESET_RUNNING = """
import time
from pathlib import Path

time.sleep(1)  # time for a preset started beside it to show
preset_run = str(Path(__file__).with_name("alone") / "no_seed0").encode()  # this pair's, not another test's
running = []
for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
    try:
        running += [cmdline] if preset_run in cmdline.read_bytes() else []
    except OSError:  # the process ended meanwhile
        pass
print("tta_acc 0.9100 plain_acc 0.9000 time 1.0 s")
Path(__file__).with_suffix(".seen").write_text(str(len(running)))
"""


def test_one_after_other_starts_the_preset_once_the_anchor_has_exited(finished_pair, anchor_dataset, cli_env, tmp_path):
    """With --one_after_other no preset runs while the anchor does (a stand-in anchor looks for one), and the table
    says how the pair ran; a pair run at the same time is not reused by it, nor is its pair by a run without it."""
    out = finished_pair[0]
    before = files(out)
    proc = side_by_side(anchor_dataset, out, cli_env, "no", *SCALED_DOWN, own=["--one_after_other"])
    assert proc.returncode == 2
    assert proc.stderr.strip() == (f"error: {out / 'seed0' / 'pair.json'} ran its scripts at the same time; give the "
                                   "same flags again, or another --output_dir")  # fmt: skip
    assert files(out) == before

    anchor = tmp_path / "anchor.py"
    anchor.write_text(PRESET_RUNNING)
    alone = tmp_path / "alone"
    proc = side_by_side(anchor_dataset, alone, cli_env, "no", *SCALED_DOWN, anchor=anchor, own=["--one_after_other"])
    assert proc.returncode == 0, proc.stderr
    assert anchor.with_suffix(".seen").read_text() == "0"
    pair = json.loads((alone / "seed0" / "pair.json").read_text())
    assert pair["together"] is False and pair["anchor"]["wall_s"] >= 1
    assert pair["preset"]["tta"] == read_results(alone / "no_seed0")["test_accuracy"]
    table = (alone / "side_by_side.md").read_text()
    assert "- One thread per process; the anchor, then the preset, each alone" in table
    assert json.loads((alone / "side_by_side.json").read_text())["together"] is False

    proc = side_by_side(anchor_dataset, alone, cli_env, "no", *SCALED_DOWN, anchor=anchor)
    assert proc.returncode == 2
    assert f"{alone / 'seed0' / 'pair.json'} ran its scripts one after the other;" in proc.stderr


def running_commands_naming(folder: Path) -> list[str]:
    """The command lines of this machine's processes that name ``folder``."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            command = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # the process ended meanwhile
            continue
        if str(folder) in command:
            found.append(command)
    return found


def test_an_anchor_that_fails_stops_the_preset_and_the_script(anchor_dataset, cli_env, tmp_path):
    """The pair is timed as a whole: the preset, with a long run ahead of it, is stopped when the anchor fails,
    not left to run on after the script has exited."""
    anchor = tmp_path / "anchor.py"
    anchor.write_text("raise SystemExit(3)\n")
    out = tmp_path / "pair"
    proc = side_by_side(anchor_dataset, out, cli_env, "no", *SCALED_DOWN, "--num_train_epochs", "200", anchor=anchor)
    assert proc.returncode == 1
    assert proc.stderr.strip() == f"error: the anchor failed (exit code 3); see {out / 'seed0' / 'anchor.log'}"
    assert running_commands_naming(out) == []
    assert not (out / "no_seed0" / "results.json").exists() and not (out / "seed0" / "pair.json").exists()


def test_a_preset_that_refuses_its_input_says_why_in_the_scripts_line(anchor_dataset, cli_env, tmp_path):
    """The preset refused a batch larger than the data: the script said only 'the preset failed (exit code 1)',
    and its log held the launcher's traceback around the run's line. Now the script's line carries the run's, the
    log has no traceback, and the anchor is stopped."""
    anchor = tmp_path / "anchor.py"
    anchor.write_text("import time\ntime.sleep(600)\n")
    out = tmp_path / "pair"
    proc = side_by_side(anchor_dataset, out, cli_env, "no", *SCALED_DOWN, "--per_device_train_batch_size", "5000",
                        anchor=anchor)  # fmt: skip
    log = out / "seed0" / "preset.log"
    assert (proc.returncode, proc.stderr) == (
        1,
        "error: the preset failed (exit code 1): 327 training images are fewer than one batch of 5000; lower "
        f"--per_device_train_batch_size; see {log}\n",
    )
    assert "Traceback" not in log.read_text()
    assert running_commands_naming(out) == []


def test_the_script_killed_by_sigkill_takes_both_scripts_down(anchor_dataset, cli_env, tmp_path):
    """Nothing of the script runs after SIGKILL to stop the pair: the anchor and the launcher asked the kernel for
    SIGTERM when the script ends, and the preset's run for SIGTERM when the launcher ends, so neither trains on."""
    anchor = tmp_path / "anchor.py"
    anchor.write_text("import time\ntime.sleep(600)\n")
    out = tmp_path / "pair"
    command = [sys.executable, str(SCRIPT), "--anchor", str(anchor), "--dataset_name", str(anchor_dataset),
               "--precision", "no", "--seeds", "0", "--output_dir", str(out), "--", *SCALED_DOWN,
               "--num_train_epochs", "1000"]  # fmt: skip
    script = subprocess.Popen(command, env=cli_env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_until((out / "no_seed0" / ".lock").exists, script, poll=0.05)  # the preset's run has started
    script.kill()
    script.wait()
    deadline = time.monotonic() + 60
    try:
        while running := running_commands_naming(tmp_path):
            assert time.monotonic() < deadline, running
            time.sleep(0.1)
    finally:
        for cmdline in Path("/proc").glob("[0-9]*/cmdline"):  # none, unless the test failed: leave nothing running
            with contextlib.suppress(OSError):
                if str(tmp_path) in cmdline.read_bytes().decode(errors="replace"):
                    os.kill(int(cmdline.parent.name), signal.SIGKILL)
    assert not (out / "no_seed0" / "results.json").exists()


def test_a_second_comparison_in_the_same_folder_is_refused_and_leaves_the_first_alone(anchor_dataset, cli_env,
                                                                                      tmp_path):  # fmt: skip
    """Both would have run seed 0's anchor into the same log, the second truncating the first's, and trained its
    preset into the same run folder."""
    anchor = tmp_path / "anchor.py"
    anchor.write_text("import time\nprint('started', flush=True)\ntime.sleep(600)\n")
    out = tmp_path / "pair"
    command = [sys.executable, str(SCRIPT), "--anchor", str(anchor), "--dataset_name", str(anchor_dataset),
               "--precision", "no", "--seeds", "0", "--output_dir", str(out), "--one_after_other", "--",
               *SCALED_DOWN]  # fmt: skip
    first = subprocess.Popen(command, env=cli_env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    log = out / "seed0" / "anchor.log"
    try:
        wait_until(lambda: log.exists() and log.read_text() == "started\n", first, poll=0.05)
        second = subprocess.run(command, env=cli_env, capture_output=True, text=True, timeout=300)
        assert second.returncode == 2
        assert second.stderr.startswith(f"error: '{out}' is in use by another run (pid {first.pid} on ")
        assert second.stderr.endswith("; wait for it to finish, or pick another --output_dir\n")
        assert log.read_text() == "started\n" and first.poll() is None
    finally:
        first.terminate()
        first.wait()
    wait_until(lambda: running_commands_naming(tmp_path) == [])


def test_an_anchor_path_that_is_not_a_file_is_refused_before_anything_runs(anchor_dataset, cli_env, tmp_path):
    out = tmp_path / "pair"
    proc = side_by_side(anchor_dataset, out, cli_env, "no", *SCALED_DOWN, anchor=tmp_path / "absent.py")
    assert proc.returncode == 2
    assert proc.stderr.strip().endswith(f"--anchor {tmp_path / 'absent.py'} is not a file; give the path of "
                                        "airbench94_muon_cpu.py")  # fmt: skip
    assert not out.exists()


NEVER_STARTED = "from pathlib import Path\nPath(__file__).with_suffix('.started').touch()\n"


@pytest.mark.parametrize(
    "given, problem",
    [
        (["--", "--seed", "5"], "--seed after -- would part the preset from its anchor; give --seeds before --"),
        (["--", "--mixed_precision=bf16"], "--mixed_precision after -- would part the preset from its anchor; give "
         "--precision before --"),
        (["--", "--resume", "latest"], "--resume_from_checkpoint after -- is not needed: the same command skips the "
         "pairs done and runs an unfinished one again from its start, as a pair is timed whole"),
        (["--", "--config", "mine.yaml"], "--config after -- would train another recipe than the fast preset that "
         "the pair compares with its anchor; give the preset's values to change as flags after --"),
        (["--seeds", "0", "1", "0"], "--seeds lists 0 more than once; give each once"),
        (["--seeds", "1", "0", "--seeds", "0"], "--seeds lists 0 more than once; give each once"),
        (["--seeds", "1", "-1"], "--seeds: 'seed' must be >= 0, got -1"),
        (["--", "--num_train_epochs", "0"], "--num_train_epochs: 'num_train_epochs' must be >= 1, got 0"),
        (["--", "--num_train_epoch", "3"], "unknown argument '--num_train_epoch'; did you mean "
         "'--num_train_epochs'?"),
        (["--output_dir", "{tmp}/file"], "output directory '{tmp}/file' is a file; choose another --output_dir"),
        (["--dataset_name", "{tmp}/nowhere"], "dataset path '{tmp}/nowhere' does not exist; pass --dataset_name "
         "with a local copy in Hub layout"),
        (["--dataset_name", "{tiny}"], "the anchor reads CIFAR-10 from plain_text/train-00000-of-00001.parquet and "
         "plain_text/test-00000-of-00001.parquet of --dataset_name, and '{tiny}' has no "
         "plain_text/train-00000-of-00001.parquet; pass a local copy of the Hub's parquet CIFAR-10, such as "
         "../shared/data/cifar10-jpeg"),
    ],
    ids=["seed", "precision", "resume", "config", "seed-twice", "seed-twice-in-two-lists", "negative-seed",
         "preset-refuses", "mistyped-preset-flag", "output-dir-a-file", "no-dataset", "dataset-the-anchor-cannot-read"],
)  # fmt: skip
def test_bad_input_is_one_line_and_exit_2_before_anything_runs(anchor_dataset, tiny_dataset, tmp_path, capsys,
                                                               given, problem):  # fmt: skip
    """Flags after -- come last in the preset's command, so those the pair sets for both scripts would win there and
    not in the anchor's; --seeds given twice adds up (argparse kept only the last list). The preset's own refusals,
    a file as the output folder and data that the anchor cannot read were found only once the anchor had started
    (or by a traceback); the anchor here would leave a mark had it started."""
    anchor = tmp_path / "anchor.py"
    anchor.write_text(NEVER_STARTED)
    (tmp_path / "file").write_text("mine")
    out, fill = tmp_path / "pair", {"tmp": tmp_path, "tiny": tiny_dataset}
    argv = ["--anchor", str(anchor), "--dataset_name", str(anchor_dataset), "--output_dir", str(out)]
    argv += [word.format(**fill) for word in given]
    assert run_main(side_by_side_script.main, argv) == 2
    error = capsys.readouterr().err
    assert error.startswith(f"error: {problem.format(**fill)}") and error.count("\n") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["anchor.py", "file"]
    assert (tmp_path / "file").read_text() == "mine"
