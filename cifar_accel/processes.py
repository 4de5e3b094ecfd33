"""How many processes a command was started as, checked before it does any work."""

from __future__ import annotations

import os

import torch
from accelerate import Accelerator

from cifar_accel.errors import InputError


def launched_processes() -> int:
    """The processes a launcher (accelerate launch, torchrun, srun through them) started: its WORLD_SIZE."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def check_joined(accelerator: Accelerator, command: str) -> None:
    """Refuse processes that a launcher started but Accelerate did not join into one group (a multi-GPU launch on a
    machine without a GPU, or torchrun without --cpu there): each would do all the work and write the same files."""
    processes = launched_processes()
    if processes == 1 or accelerator.num_processes == processes:
        return
    fix = f"launch with 'torchrun --nproc_per_node N -m cifar_accel.{command} --cpu'"
    if torch.cuda.is_available():
        fix += " on CPUs, or with 'accelerate launch --config_file accelerate_configs/multi_gpu_fp16.yaml' on GPUs"
    else:
        fix = f"this machine has no GPU for a multi-GPU launch to join them with; {fix}"
    raise InputError(f"{processes} processes were started but they are not connected into one process group; {fix}")


def require_one_process(command: str) -> None:
    """Commands that work in one process (compare starts its runs' processes itself) refuse a multi-process
    launch, whose copies would each write the same output."""
    processes = launched_processes()
    if processes > 1:
        raise InputError(
            f"cifar_accel.{command} runs in one process, and {processes} were started; "
            f"run it with 'python -m cifar_accel.{command}'"
        )
