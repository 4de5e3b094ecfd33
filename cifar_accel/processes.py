"""How many processes a command was started as, checked before it does any work."""

from __future__ import annotations

import os

import torch
from accelerate import Accelerator
from accelerate.logging import get_logger

from cifar_accel.errors import InputError

logger = get_logger(__name__)
# Where mpirun (Intel MPI, Open MPI, MVAPICH) puts the number of processes it started: Accelerate's CPU ranks.
MPI_SIZES = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")


def launched_processes() -> int:
    """The processes a launcher (accelerate launch, torchrun, srun through them) started: its WORLD_SIZE."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def launched_rank() -> int:
    """This process's rank among them (0 for the one process of a plain start), before the Accelerator exists."""
    return int(os.environ.get("RANK", "0"))


def check_joined(accelerator: Accelerator, command: str) -> None:
    """Refuse processes that a launcher started but Accelerate did not join into one group (a multi-GPU launch on a
    machine without a GPU, or torchrun without --cpu there): each would do all the work and write the same files."""
    processes = launched_processes()
    if processes == 1 and accelerator.device.type == "cpu" and several_asked_of_one_launch():
        logger.warning(
            f"accelerate launch starts several CPU processes only through mpirun, so this run is 1 process; for N, "
            f"launch with 'torchrun --nproc_per_node N -m cifar_accel.{command} --cpu'"
        )
    if processes == 1 or accelerator.num_processes == processes:
        return
    fix = f"launch with 'torchrun --nproc_per_node N -m cifar_accel.{command} --cpu'"
    if torch.cuda.is_available():
        fix += " on CPUs, or with 'accelerate launch --config_file accelerate_configs/multi_gpu_fp16.yaml' on GPUs"
    else:
        fix = f"this machine has no GPU for a multi-GPU launch to join them with; {fix}"
    raise InputError(f"{processes} processes were started but they are not connected into one process group; {fix}")


def several_asked_of_one_launch() -> bool:
    """Whether ``accelerate launch`` was asked for several processes (``--num_processes 2``, with ``--cpu`` or on a
    machine without GPUs, or a MULTI_CPU config) and started one, as it does without mpirun: its single-process
    launcher (which sets ACCELERATE_USE_CPU, true or false) then sets the rendezvous address that several would
    need, and no launcher's process count is there."""
    counted = any(name in os.environ for name in ("WORLD_SIZE", *MPI_SIZES))
    return "ACCELERATE_USE_CPU" in os.environ and "MASTER_ADDR" in os.environ and not counted


def require_one_process(command: str) -> None:
    """Commands that work in one process (compare starts its runs' processes itself) refuse a multi-process
    launch, whose copies would each write the same output."""
    processes = launched_processes()
    if processes > 1:
        raise InputError(
            f"cifar_accel.{command} runs in one process, and {processes} were started; "
            f"run it with 'python -m cifar_accel.{command}'"
        )
