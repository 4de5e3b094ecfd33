"""Two real ranks on CPU (torchrun, gloo): identical weights, every sample counted once, resume across counts."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from cifar_accel.optim import StepSchedule

from conftest import REPO, assert_same_run, crashed_copy, read_results, run_cli, tiny_args


def two_rank_env(cli_env: dict[str, str], **extra: str) -> dict[str, str]:
    return {**cli_env, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", **extra}


def run_args(dataset: Path, out: Path, *extra: str) -> list[str]:
    """Two epochs; 294 training images make 4 steps per epoch with 2 ranks of 32; a checkpoint every 2 steps."""
    return tiny_args(
        dataset, out, "--num_train_epochs", "2", "--checkpointing_steps", "2", "--checkpoints_total_limit", "100",
        *extra,
    )  # fmt: skip


@pytest.fixture(scope="module")
def two_ranks(tiny_dataset, cli_env, torchrun, tmp_path_factory) -> Path:
    """A 2-rank run in which each rank saves its weights after the first epoch's validation (rank<N>.safetensors)."""
    root = tmp_path_factory.mktemp("two_ranks")
    command = [*torchrun, str(REPO / "tests" / "rank_weights.py"), "--cpu", *run_args(tiny_dataset, root / "run")]
    env = two_rank_env(cli_env, RANK_WEIGHTS_DIR=str(root))
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "batch 32 per process x 2 processes x 1 accumulation step = 64 global" in proc.stdout
    return root


def test_both_ranks_hold_bitwise_identical_weights_after_an_epoch(two_ranks):
    rank0, rank1 = (load_file(two_ranks / f"rank{i}.safetensors") for i in range(2))
    assert rank0.keys() == rank1.keys() and len(rank0) == 20
    for name in rank0:
        assert torch.equal(rank0[name], rank1[name]), name
    saved = load_file(two_ranks / "run" / "checkpoints" / "step_00000004" / "model.safetensors")  # epoch 1's end
    assert all(torch.equal(rank0[name], saved[name]) for name in rank0)


def test_every_evaluation_sample_counts_once_and_only_rank_0_writes(two_ranks):
    results = read_results(two_ranks / "run")
    assert results["num_processes"] == 2 and results["global_batch_size"] == 64
    assert [r["val_samples"] for r in results["history"]] == [33, 33]  # 33 = 2 x 17 - 1: the last batch is uneven
    assert results["test_samples"] == 83
    assert [r["train_images"] for r in results["history"]] == [256, 256]  # 4 steps x 64
    event_files = list((two_ranks / "run" / "logs").rglob("events.out.tfevents.*"))
    assert event_files and len({f.name.split(".")[-2] for f in event_files}) == 1  # ...<host>.<pid>.<n>


def test_a_two_rank_checkpoint_resumes_exactly_with_two_ranks(two_ranks, tiny_dataset, cli_env, torchrun, tmp_path):
    resumed = crashed_copy(two_ranks / "run", tmp_path / "resumed", last_step=6)  # 2 batches into epoch 2
    args = ["--cpu", *run_args(tiny_dataset, resumed), "--resume_from_checkpoint", "latest"]
    proc = run_cli(args, two_rank_env(cli_env), launcher=torchrun)
    assert proc.returncode == 0, proc.stderr
    assert "1 epoch and 2 batches done" in proc.stdout
    tensors, max_diff = assert_same_run(two_ranks / "run", resumed)
    print(f"2-rank run resumed with 2 ranks mid-epoch: {tensors} tensors bitwise equal (max abs diff {max_diff})")


def test_a_two_rank_checkpoint_resumes_with_one_process_at_an_epoch_end(two_ranks, tiny_dataset, cli_env, tmp_path):
    resumed = crashed_copy(two_ranks / "run", tmp_path / "resumed", last_step=4)  # the end of epoch 1
    proc = run_cli([*run_args(tiny_dataset, resumed), "--resume_from_checkpoint", "latest"], cli_env)
    assert proc.returncode == 0, proc.stderr
    assert "written by 2 processes and this run has 1: the global batch becomes 32" in proc.stdout
    results, before = read_results(resumed), read_results(two_ranks / "run")
    assert results["num_processes"] == 1 and results["epochs_completed"] == 2
    assert results["history"][0] == before["history"][0]  # epoch 1 as the two ranks trained it
    assert results["history"][1]["train_images"] == 288  # 9 steps of 32 on one process


def test_a_mid_epoch_checkpoint_refuses_another_process_count(two_ranks, tiny_dataset, cli_env, tmp_path):
    resumed = crashed_copy(two_ranks / "run", tmp_path / "resumed", last_step=6)
    proc = run_cli([*run_args(tiny_dataset, resumed), "--resume_from_checkpoint", "latest"], cli_env)
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert "was saved mid-epoch by 2 processes and cannot continue that epoch with 1" in line
    assert not (resumed / "results.json").exists()


def test_processes_without_a_process_group_are_refused(tiny_dataset, cli_env, torchrun, tmp_path):
    """torchrun without --cpu on a machine without GPUs starts two ranks that Accelerate does not join."""
    proc = run_cli(tiny_args(tiny_dataset, tmp_path / "run"), two_rank_env(cli_env), launcher=torchrun)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    # One line from each rank, unless torchrun stops the second rank before it writes, once the first has failed.
    assert 1 <= len(errors) <= 2
    assert all("2 processes were started but they are not connected" in line for line in errors)
    assert "torchrun --nproc_per_node N -m cifar_accel.train --cpu" in errors[0]
    # CUDA_VISIBLE_DEVICES="" hides any GPU: the line does not send the user back to a multi-GPU profile.
    assert "this machine has no GPU for a multi-GPU launch to join them with; launch with 'torchrun" in errors[0]
    assert "multi_gpu_fp16.yaml" not in errors[0]
    assert not (tmp_path / "run" / "results.json").exists()


@pytest.mark.parametrize(("max_train_steps", "precision"), [(None, "bf16"), (7, "no")])
def test_the_fast_recipe_on_two_ranks_steps_its_schedule_once_per_step_and_resumes_exactly(
    tiny_dataset, cli_env, torchrun, tmp_path, max_train_steps, precision
):
    """The fast preset (Muon and SGD in one optimizer, a per-step schedule, alternating flips and translations,
    steps of 4 accumulated batches, 24x24 windows in the first epoch) on all 327 training images with 2 ranks of 8:
    20 batches and 5 optimizer steps an epoch, each step stepping the schedule once; two epochs in bf16 with the
    convolutions' weight gradients as matrix products, or with --max_train_steps 7 one and 2 steps in fp32."""
    total = max_train_steps or 10
    length = ["--max_train_steps", str(max_train_steps)] if max_train_steps else []

    def fast_args(out: Path) -> list[str]:
        return ["--cpu", *run_args(tiny_dataset, out, "--config", "fast", "--per_device_train_batch_size", "8",
                                   "--gradient_accumulation_steps", "4", "--max_eval_samples", "40",
                                   "--logging_steps", "1", "--whiten_bias_epochs", "1", "--early_crop_size", "24",
                                   "--early_crop_epochs", "1", "--mixed_precision",
                                   precision, "--conv_weight_grads", "matmul", *length)]  # fmt: skip

    straight = tmp_path / "straight"
    proc = run_cli(fast_args(straight), two_rank_env(cli_env), launcher=torchrun)
    assert proc.returncode == 0, proc.stderr
    results = read_results(straight)
    assert results["num_processes"] == 2 and results["train_samples"] == 327 and results["validation"] is False
    assert [r["train_images"] for r in results["history"]] == [320, 2 * 4 * 8 * 2 if max_train_steps else 320]
    events = EventAccumulator(str(straight / "logs" / "cifar_accel"))
    events.Reload()
    logged = events.Scalars("step/learning_rate")
    schedule = StepSchedule("linear", total_steps=total, warmup_steps=0, start_factor=1.0, end_factor=0.0)
    assert [e.step for e in logged] == list(range(1, total + 1))
    assert [e.value for e in logged] == pytest.approx([1.656 * schedule(step - 1) for step in range(1, total + 1)],
                                                      rel=1e-6)  # fmt: skip

    resumed = crashed_copy(straight, tmp_path / "resumed", last_step=6)  # 1 batch into epoch 2
    proc = run_cli([*fast_args(resumed), "--resume_from_checkpoint", "latest"], two_rank_env(cli_env),
                   launcher=torchrun)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "1 epoch and 4 batches done" in proc.stdout
    assert_same_run(straight, resumed)


FAKE_SRUN = """#!/bin/bash
# srun as the test simulates it: its options skipped, the command started once per "node" with SLURM_NODEID set.
while [[ $1 == --* ]]; do shift; done
for ((node = 0; node < SLURM_NNODES; node++)); do SLURM_NODEID=$node "$@" > "$NODE_LOGS/node$node.log" 2>&1 & done
status=0
for job in $(jobs -p); do wait "$job" || status=$?; done
exit $status
"""


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_the_slurm_script_on_two_simulated_nodes_matches_the_two_process_run(
    two_ranks, tiny_dataset, cli_env, tmp_path
):
    """scripts/slurm/train.sbatch as sbatch would run it, with srun and scontrol simulated on this machine: two
    "nodes" (node ranks 0 and 1, one CPU process each, gloo) meet at a rendezvous on 127.0.0.1 and train exactly
    what torchrun --nproc_per_node 2 trained."""
    bin_dir, logs = tmp_path / "bin", tmp_path / "logs"
    bin_dir.mkdir()
    logs.mkdir()
    (bin_dir / "srun").write_text(FAKE_SRUN)
    # The allocation's nodes, the second written after a pause, as a long node list arrives: the script must read
    # them all, not stop at the first and leave scontrol to die of SIGPIPE.
    (bin_dir / "scontrol").write_text("#!/bin/bash\necho 127.0.0.1\nsleep 0.5\necho node-b\n")
    for tool in ("srun", "scontrol"):
        (bin_dir / tool).chmod(0o755)
    env = two_rank_env(
        cli_env,
        PATH=f"{bin_dir}:{cli_env['PATH']}",
        SLURM_JOB_NODELIST="node-[a-b]",
        SLURM_NNODES="2",
        SLURM_SUBMIT_DIR=str(REPO),
        MASTER_PORT=str(free_port()),
        PYTHON=sys.executable,
        NODE_LOGS=str(logs),
        TMPDIR=str(tmp_path),  # each node's torchrun writes its torchelastic_* logs here, not in /tmp
    )
    command = [
        "bash",
        str(REPO / "scripts" / "slurm" / "train.sbatch"),
        "--cpu",
        *run_args(tiny_dataset, tmp_path / "run"),
    ]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, cwd=REPO)
    node_logs = {path.name: path.read_text() for path in sorted(logs.iterdir())}
    assert proc.returncode == 0, (proc.stderr, node_logs)
    assert "cifar_accel on 2 nodes x 1 processes, rendezvous on 127.0.0.1:" in proc.stdout
    assert "batch 32 per process x 2 processes x 1 accumulation step = 64 global" in node_logs["node0.log"]
    results = read_results(tmp_path / "run")
    assert results["num_processes"] == 2 and results["device"].startswith("cpu")
    tensors, max_diff = assert_same_run(two_ranks / "run", tmp_path / "run")
    print(f"2 simulated SLURM nodes against torchrun's 2 processes: {tensors} tensors bitwise equal ({max_diff})")
