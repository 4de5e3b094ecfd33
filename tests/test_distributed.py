"""Several processes: unconnected ones are refused with the launch line that works."""

from __future__ import annotations

import sys
from pathlib import Path

from conftest import run_cli, tiny_args


def test_processes_without_a_process_group_are_refused(tiny_dataset, cli_env, tmp_path):
    """torchrun without --cpu on a machine without GPUs starts two ranks that Accelerate does not join."""
    torchrun = [str(Path(sys.executable).parent / "torchrun"), "--nproc_per_node", "2"]
    env = {**cli_env, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = run_cli(tiny_args(tiny_dataset, tmp_path / "run"), env, launcher=torchrun)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 2  # one line from each rank
    assert all("2 processes were started but they are not connected" in line for line in errors)
    assert "torchrun --nproc_per_node N -m cifar_accel.train --cpu" in errors[0]
    assert not (tmp_path / "run" / "results.json").exists()
