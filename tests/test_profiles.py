"""The `accelerate config` profiles: each loads with Accelerate's own loader; the CPU ones launch a run."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from accelerate.commands.config.config_args import load_config_from_file
from safetensors.torch import load_file

from conftest import REPO, read_results, run_cli, tiny_args

PROFILES = sorted((REPO / "accelerate_configs").glob("*.yaml"))
EXPECTED = {
    "cpu": ("no", True, "NO"),
    "cpu_bf16": ("bf16", True, "NO"),
    "single_gpu_fp16": ("fp16", False, "NO"),
    "single_gpu_bf16": ("bf16", False, "NO"),
    "multi_gpu_fp16": ("fp16", False, "MULTI_GPU"),
    "multi_node": ("fp16", False, "MULTI_GPU"),
}


def test_the_required_profiles_exist():
    assert EXPECTED.keys() <= {p.stem for p in PROFILES}


@pytest.mark.parametrize("profile", PROFILES, ids=lambda p: p.stem)
def test_profile_loads_with_accelerates_config_loader(profile: Path):
    config = load_config_from_file(str(profile))
    assert profile.read_text().startswith("#"), "each profile starts with a comment saying when to use it"
    if profile.stem in EXPECTED:
        precision, use_cpu, distributed = EXPECTED[profile.stem]
        assert config.mixed_precision == precision
        assert config.use_cpu == use_cpu
        assert str(config.distributed_type).endswith(distributed)


def test_multi_node_template_names_what_each_machine_must_set():
    config = load_config_from_file(str(REPO / "accelerate_configs" / "multi_node.yaml"))
    assert (config.num_machines, config.machine_rank, config.main_process_port) == (2, 0, 29500)
    assert config.main_process_ip and config.rdzv_backend in ("static", "c10d")
    lines = (REPO / "accelerate_configs" / "multi_node.yaml").read_text().splitlines()
    settings = {line.split(":")[0]: line for line in lines if not line.startswith("#")}
    assert "CHANGE" in settings["machine_rank"] and "CHANGE" in settings["main_process_ip"]


def launcher(profile: str | None, *options: str) -> list[str]:
    """``accelerate launch`` of this environment with one of the profiles (None: none, and no default config, as
    the tests' HF_HOME holds none)."""
    accelerate = shutil.which("accelerate", path=str(Path(sys.executable).parent)) or "accelerate"
    config = ["--config_file", str(REPO / "accelerate_configs" / f"{profile}.yaml")] if profile else []
    return [accelerate, "launch", *options, *config]


ONE_OF_SEVERAL = "accelerate launch starts several CPU processes only through mpirun, so this run is 1 process"


@pytest.mark.parametrize(
    "profile, options",
    [("cpu", ()), ("cpu_bf16", ()), ("cpu", ("--num_processes", "2")), (None, ("--num_processes", "2"))],
    ids=["cpu", "bf16", "two", "two-without-a-profile"],
)
def test_cpu_profile_launches_a_short_run(tiny_dataset, cli_env, tmp_path, profile, options):
    """With --num_processes 2 and no mpirun, accelerate launch starts one process, with the CPU profile and, on a
    machine without GPUs, without one: the run says so, and trains."""
    out = tmp_path / "run"
    args = tiny_args(tiny_dataset, out, "--max_train_samples", "150")
    # No GPU: the launch without a profile trains on the CPU. TMPDIR: the launcher's torchelastic_* logs go here.
    env = {**cli_env, "CUDA_VISIBLE_DEVICES": "", "TMPDIR": str(tmp_path)}
    proc = run_cli(args, env, launcher=launcher(profile, *options))
    assert proc.returncode == 0, proc.stderr
    results = read_results(out)
    assert results["mixed_precision"] == (EXPECTED[profile][0] if profile else "no")
    assert results["mixed_precision_source"] == "accelerate launch (flag or config profile)"
    assert results["epochs_completed"] == 1
    assert "x 1 process x" in proc.stdout
    warned = [line for line in (proc.stdout + proc.stderr).splitlines() if ONE_OF_SEVERAL in line]
    assert len(warned) == (1 if options else 0)
    if options:
        assert warned[0].endswith("for N, launch with 'torchrun --nproc_per_node N -m cifar_accel.train --cpu'")


def test_the_commands_run_as_files_as_accelerate_launches_a_script(tiny_dataset, cli_env, tmp_path):
    """`accelerate launch cifar_accel/train.py` (how Accelerate's examples launch a script) put cifar_accel/ first
    on sys.path, where evaluate.py stood for the `evaluate` library: 'ImportError: cannot import name 'Precision'
    from partially initialized module', with a traceback. The commands run as files now, as with -m."""
    out = tmp_path / "run"
    env = {**cli_env, "TMPDIR": str(tmp_path)}
    command = [*launcher("cpu"), str(REPO / "cifar_accel" / "train.py"), *tiny_args(tiny_dataset, out)]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    results = read_results(out)
    evaluate = [sys.executable, str(REPO / "cifar_accel" / "evaluate.py"), "--model", str(out)]
    proc = subprocess.run(evaluate, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    metrics = json.loads((out / "eval_test" / "metrics.json").read_text())
    assert metrics["accuracy"] == results["test_accuracy"]


def test_a_users_file_named_as_a_library_does_not_stand_for_it(tiny_dataset, cli_env, tmp_path):
    """python -m puts the current folder first on sys.path: a script of the user's named datasets.py there stood for
    the library ('ImportError: cannot import name 'Dataset' from 'datasets' (/home/you/datasets.py)', a traceback).
    The commands leave that folder off, as their console scripts do."""
    for name in ("datasets.py", "evaluate.py", "torch.py"):
        (tmp_path / name).write_text("raise SystemExit('the user's own file was imported')\n")
    command = [*launcher("cpu"), "-m", "cifar_accel.train", *tiny_args(tiny_dataset, tmp_path / "run")]
    proc = subprocess.run(command, env={**cli_env, "TMPDIR": str(tmp_path)}, cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert read_results(tmp_path / "run")["epochs_completed"] == 1


def test_a_launchers_torch_dynamo_compiles_as_torch_compile_does_and_other_backends_are_refused(
    tiny_dataset, cli_env, tmp_path
):
    """`accelerate launch --dynamo_backend inductor` (or a profile that `accelerate config` wrote with dynamo on) made
    Accelerate wrap the model in torch.compile: the run trained, then failed at its end, loading the best weights
    ('Missing key(s) in state_dict: "_orig_mod.features..."'), exit 1. Now it turns on --torch_compile, which
    compiles in place: the weights keep their names, and evaluate gives the run's test accuracy. Other backends
    are refused in one line."""
    out = tmp_path / "run"
    env = {**cli_env, "TMPDIR": str(tmp_path)}
    with_dynamo = launcher("cpu", "--dynamo_backend", "inductor")
    proc = run_cli(tiny_args(tiny_dataset, out), env, launcher=with_dynamo)
    assert proc.returncode == 0, proc.stderr
    assert yaml.safe_load((out / "config.yaml").read_text())["torch_compile"] is True
    assert not [name for name in load_file(out / "model.safetensors") if "_orig_mod" in name]
    evaluated = run_cli(["--model", str(out), "--output_dir", str(tmp_path / "eval")], env,
                        module="cifar_accel.evaluate", launcher=with_dynamo)  # fmt: skip
    assert evaluated.returncode == 0, evaluated.stderr
    metrics = json.loads((tmp_path / "eval" / "metrics.json").read_text())
    assert metrics["accuracy"] == read_results(out)["test_accuracy_no_tta"]

    proc = run_cli(tiny_args(tiny_dataset, tmp_path / "eager"), env,
                   launcher=launcher("cpu", "--quiet", "--dynamo_backend", "eager"))  # fmt: skip
    assert proc.returncode == 1
    assert proc.stderr.splitlines()[-1] == (
        "error: accelerate launch asked torch dynamo for its 'eager' backend; this package compiles the model itself, "
        "with inductor (--torch_compile), so that checkpoints load into a model compiled or not: choose no or "
        "inductor for dynamo in the accelerate profile (accelerate config), or launch with --dynamo_backend no"
    )
    assert not (tmp_path / "eager").exists()


@pytest.mark.parametrize("quiet", [True, False])
def test_under_the_launcher_bad_input_is_the_runs_line_and_the_launchers_exit_code_1(cli_env, tmp_path, quiet):
    """What docs/checkpoints.md says of `accelerate launch`: it exits 1 for the run's exit code 2, after the run's
    one line; --quiet leaves that line without a traceback of the launcher's."""
    missing = tmp_path / "missing"
    options = ["--quiet"] if quiet else []
    proc = run_cli(["--dataset_name", str(missing)], cli_env, launcher=launcher("cpu", *options))
    assert proc.returncode == 1
    line = f"error: dataset path '{missing}' does not exist; pass --dataset_name with a local copy in Hub layout"
    assert [x for x in proc.stderr.splitlines() if x.startswith("error:")][0].startswith(line)
    assert ("Traceback" in proc.stderr) is not quiet
    if not quiet:  # the run's own exit code shows only in the launcher's traceback
        assert "returned non-zero exit status 2" in proc.stderr


def test_make_train_reads_the_local_copy_beside_the_checkout_else_the_hub(tmp_path):
    """`make -n` prints the command without running it; a checkout with no ../shared beside it gets the Hub id."""

    def dataset_of(checkout: Path, *args: str) -> str:
        command = subprocess.run(["make", "-n", "-C", str(checkout), "train", *args], capture_output=True, text=True)
        assert command.returncode == 0, command.stderr
        return command.stdout.split("--dataset_name ")[1].split()[0]

    elsewhere = tmp_path / "deep" / "checkout"
    elsewhere.mkdir(parents=True)
    shutil.copy(REPO / "Makefile", elsewhere)
    (elsewhere / "pyproject.toml").touch()
    (elsewhere / ".venv").mkdir()
    (elsewhere / ".venv" / ".installed").touch()  # installed already: make prints only the training command
    assert dataset_of(elsewhere) == "uoft-cs/cifar10"
    local = tmp_path / "deep" / "shared" / "data" / "cifar10-jpeg"
    local.mkdir(parents=True)
    assert dataset_of(elsewhere) == "../shared/data/cifar10-jpeg"
    assert dataset_of(elsewhere, "DATA=my/cifar") == "my/cifar"


@pytest.mark.slow
@pytest.mark.skipif(not (REPO / ".venv" / ".installed").exists(), reason="needs the checkout's .venv (make install)")
def test_make_train_refuses_bad_input_in_one_line_without_a_traceback(tmp_path):
    """The README's training command, through the real launcher, on a dataset path that does not exist."""
    proc = subprocess.run(["make", "-C", str(REPO), "train", f"DATA={tmp_path / 'missing'}",
                           f"ARGS=--output_dir {tmp_path / 'run'}"], capture_output=True, text=True)  # fmt: skip
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: dataset path '{tmp_path / 'missing'}' does not exist; pass --dataset_name with a "
                      "local copy in Hub layout, e.g. ../shared/data/cifar10-jpeg"]  # fmt: skip
    assert "Traceback" not in proc.stderr + proc.stdout
    assert not (tmp_path / "run").exists()
