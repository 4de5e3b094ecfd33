"""`--torch_compile`: the compiled model trains as the eager one does, and its checkpoints are the plain model's."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from conftest import read_results, run_cli, tiny_args


def test_compiled_run_matches_eager_and_resumes_uncompiled(tiny_dataset, cli_env, tmp_path):
    eager, compiled = tmp_path / "eager", tmp_path / "compiled"
    for out, extra in ((eager, []), (compiled, ["--torch_compile"])):
        proc = run_cli(tiny_args(tiny_dataset, out, "--max_eval_samples", "40", *extra), cli_env)
        assert proc.returncode == 0, proc.stderr

    eager_weights, compiled_weights = load_file(eager / "model.safetensors"), load_file(compiled / "model.safetensors")
    assert compiled_weights.keys() == eager_weights.keys()  # no torch.compile wrapper prefix in saved names
    diffs = torch.cat([(compiled_weights[k].float() - eager_weights[k].float()).abs().flatten() for k in eager_weights])
    # Fused kernels round differently, and Adam can turn that into up to about lr (1e-3) a step for a weight whose
    # gradient is near zero; on average the 9 steps leave the weights within about 1e-5 of each other.
    assert diffs.max().item() < 1e-2
    assert diffs.mean().item() < 1e-4
    (eager_epoch,), (compiled_epoch,) = read_results(eager)["history"], read_results(compiled)["history"]
    for key in ("train_loss", "val_loss"):
        assert compiled_epoch[key] == pytest.approx(eager_epoch[key], rel=1e-3), key

    # The compiled run's checkpoint continues in an uncompiled run.
    args = tiny_args(tiny_dataset, compiled, "--max_eval_samples", "40", "--num_train_epochs", "2")
    proc = run_cli([*args, "--resume_from_checkpoint", "latest"], cli_env)
    assert proc.returncode == 0, proc.stderr
    assert "1 epoch and 0 batches done" in proc.stdout
    results = read_results(compiled)
    assert results["epochs_completed"] == 2 and results["history"][0] == compiled_epoch


def test_compiling_on_a_cpu_without_a_working_cxx_compiler_is_refused_before_any_work(tiny_dataset, cli_env, tmp_path):
    """A machine whose compilers do not run (a slim container has none): each name inductor looks for is a program
    that fails, first on the PATH."""
    broken = tmp_path / "bin"
    broken.mkdir()
    for name in ("g++", "gcc", "c++", "cc", "clang++", "clang"):
        (broken / name).write_text("#!/bin/sh\nexit 1\n")
        (broken / name).chmod(0o755)
    env = {**cli_env, "PATH": f"{broken}:{cli_env['PATH']}"}
    env.pop("CXX", None)
    out = tmp_path / "run"
    proc = run_cli(tiny_args(tiny_dataset, out, "--torch_compile"), env)
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: --torch_compile on a CPU needs a C++ compiler, which inductor builds its ")
    assert proc.stderr.endswith("; install one (g++, or set CXX), or leave --torch_compile out\n")
    assert len(proc.stderr.splitlines()) == 1 and not out.exists()
