"""What a run reports: one record per epoch, step telemetry, peak memory, and the results of a finished run."""

from __future__ import annotations

import os
import platform
import resource
import sys
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.logging import get_logger

from cifar_accel.errors import versions
from cifar_accel.precision import cpu_flags, native_bf16
from cifar_accel.run import Run
from cifar_accel.state import RESULTS_SCHEMA_VERSION, EpochRecord, RunResults, TrainerState

logger = get_logger(__name__)


# The CPU flags that decide how fast a recipe runs: the vector and matrix extensions, bf16 among them.
SPEED_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile")


def cpu_name(cpuinfo: str) -> str:
    """The first CPU's model name in ``cpuinfo`` (the text of /proc/cpuinfo), with its x86 family and model where
    they are given: a cloud machine's name can be as bare as "AMD EPYC", the same for a Zen 4 (family 25 model 17)
    and a Zen 5, whose speeds differ."""
    fields = {}
    for line in cpuinfo.split("\n\n", 1)[0].splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    name = fields.get("model name", "?")
    if "cpu family" in fields and "model" in fields:
        name += f" (family {fields['cpu family']} model {fields['model']})"
    return name


def hardware() -> dict[str, Any]:
    """What a run ran on: the CPU (model, cores, its ``SPEED_FLAGS``, native bf16), torch's CPU capability and
    thread count, and the GPU."""
    info: dict[str, Any] = {"cpu": platform.processor() or platform.machine(), "cpu_cores": os.cpu_count()}
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        info["cpu"] = cpu_name(cpuinfo.read_text())
        flags = cpu_flags()
        info["cpu_flags"] = [flag for flag in SPEED_FLAGS if flag in flags]
        info["cpu_native_bf16"] = native_bf16()
    info["torch_cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    info["torch_threads"] = torch.get_num_threads()
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def machine_name(hw: dict[str, Any]) -> str:
    """A ``hardware()`` record in a few words: the GPU, or the CPU with its ``SPEED_FLAGS``."""
    return f"{hw.get('gpu') or hw['cpu']} ({' '.join(hw.get('cpu_flags', []))})"


def loss_scale(accelerator: Accelerator) -> float | None:
    return accelerator.scaler.get_scale() if accelerator.scaler is not None else None


def peak_memory(device: torch.device) -> tuple[float, str]:
    """Peak memory in MiB: allocated by tensors on the GPU, or the process's resident set on a CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20, "torch.cuda.max_memory_allocated"
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1024 if sys.platform == "darwin" else 1)
    return peak_kib / 1024, "peak resident set size of the main process"


def log_step(
    accelerator: Accelerator, state: TrainerState, loss: torch.Tensor, grad_norm: torch.Tensor, learning_rate: float
) -> None:
    """Step telemetry (x axis: optimizer steps): this process's batch loss, the gradient norm before clipping,
    the learning rate, and where they apply, the loss scale, skipped steps and peak GPU memory."""
    values = {
        "step/loss": loss.item(),
        "step/grad_norm": grad_norm.item(),
        "step/learning_rate": learning_rate,
    }
    if accelerator.scaler is not None:
        values["step/loss_scale"] = loss_scale(accelerator)
        values["step/skipped_steps"] = state.skipped_steps
    if accelerator.device.type == "cuda":
        values["step/peak_memory_mib"] = peak_memory(accelerator.device)[0]
    accelerator.log(values, step=state.global_step)
    logger.info(
        f"step {state.global_step}: " + ", ".join(f"{k.removeprefix('step/')} {v:.4g}" for k, v in values.items())
    )


def log_epoch(accelerator: Accelerator, record: EpochRecord, global_step: int) -> None:
    """The epoch's scalars and its number (``epoch``), at the optimizer step it ended on: one x axis for every
    tracker scalar, as in the Hugging Face Trainer, so that a resume can purge what came after its checkpoint."""
    accelerator.log({**record.tracker_values(), "epoch": record.epoch}, step=global_step)
    logger.info(record.log_line())


def run_results(run: Run, test: dict[str, Any]) -> RunResults:
    """The contents of results.json: the outcome (the weights of the best validation epoch, or of the last one
    without validation, tested with the run's test-time augmentation), the precision in effect (with the dtype
    report), speed and memory, the setting, and the per-epoch history."""
    accelerator, state, tta, precision = run.accelerator, run.state, run.config.tta, run.precision
    history, val_samples = state.history, len(run.data.val)
    most = max(record.train_images for record in history)  # a last epoch cut short by --max_train_steps has fewer
    whole = [record for record in history if record.train_images == most]
    memory, memory_measure = peak_memory(accelerator.device)
    return RunResults(
        validation=val_samples > 0,
        best_val_accuracy=state.best_val_accuracy,
        best_epoch=state.best_epoch,
        tested_epoch=state.best_epoch if val_samples else state.epoch,
        test_accuracy=test["accuracy"],
        tta=tta,
        test_accuracy_no_tta=test["accuracy_no_tta"],
        test_loss=test["loss"],
        test_samples=test["samples"],
        epochs_completed=state.epoch,
        stopped_early=state.should_stop_early(run.config.early_stopping_patience),
        mixed_precision=precision["effective"],
        requested_mixed_precision=precision["requested"],
        mixed_precision_source=precision["requested_by"],
        precision_advice=precision["advice"],
        train_images_per_second=sum(r.train_images for r in history) / sum(r.train_seconds for r in history),
        seconds_per_epoch=sum(r.epoch_seconds for r in whole) / len(whole),
        skipped_steps=state.skipped_steps,
        peak_memory_mib=memory,
        peak_memory_measure=memory_measure,
        precision_report=precision,
        num_processes=accelerator.num_processes,
        global_batch_size=run.global_batch_size,
        learning_rate=run.learning_rate,
        device=str(accelerator.device),
        hardware=hardware(),
        train_samples=len(run.data.train),
        val_samples=val_samples,
        history=list(history),
        image_column=run.data.image_column,
        label_column=run.data.label_column,
        normalization=run.data.normalization.to_dict(),
        val_split=run.data.val_split,
        schema_version=RESULTS_SCHEMA_VERSION,
        versions=versions(),
    )
