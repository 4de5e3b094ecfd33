"""Mixed precision made visible: what is really in effect, per-step telemetry, and guards against non-finite runs.

AMP fails quietly: fp16 asked for on a CPU runs fp32, a scaler can skip steps for ever, a NaN can sit in the
weights for epochs. The report shows the dtypes one batch actually produces, the telemetry shows the loss scale,
skipped steps and gradient norm as the run goes, and the guards stop a run the moment it has gone wrong.
"""

from __future__ import annotations

import copy
import resource
import sys
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.logging import get_logger
from torch import nn

from cifar_accel.checkpoint import TrainerState, complete_checkpoints
from cifar_accel.engine import LossFn
from cifar_accel.errors import RunFault

logger = get_logger(__name__)

AUTOCAST_DTYPES = {"fp16": "float16", "bf16": "bfloat16"}


def effective_precision(accelerator: Accelerator) -> str:
    """The precision autocast really uses: Accelerate falls back to fp32 (without saying so) for fp16 on a CPU."""
    return accelerator.mixed_precision if accelerator.native_amp else "no"


def precision_report(
    accelerator: Accelerator,
    model: nn.Module,
    loss_fn: LossFn,
    images: torch.Tensor,
    labels: torch.Tensor,
    requested: str,
    source: str,
) -> dict[str, Any]:
    """Requested and effective precision, the scaler, and the dtypes one forward/backward produces.

    The probe runs on a copy of the model, so the run's weights, BatchNorm statistics and RNG are untouched.
    """
    effective = effective_precision(accelerator)
    probe = copy.deepcopy(accelerator.unwrap_model(model)).train()
    first_conv = next(m for m in probe.modules() if isinstance(m, nn.Conv2d))
    seen: dict[str, torch.dtype] = {}

    def record_dtype(module: nn.Module, args: Any, output: torch.Tensor) -> None:
        seen["conv"] = output.dtype

    hook = first_conv.register_forward_hook(record_dtype)
    with accelerator.autocast():
        logits = probe(images)
        loss = loss_fn(logits, labels)
    loss.backward()
    hook.remove()
    scaler = accelerator.scaler
    return {
        "device": str(accelerator.device),
        "requested": requested,
        "requested_by": source,
        "effective": effective,
        "autocast_dtype": AUTOCAST_DTYPES.get(effective),
        "grad_scaler": scaler is not None,
        "initial_loss_scale": scaler.get_scale() if scaler is not None else None,
        "dtypes": {
            "conv_output": _name(seen["conv"]),
            "logits": _name(logits.dtype),
            "loss": _name(loss.dtype),
            "weights": _name(first_conv.weight.dtype),
            "gradients": _name(first_conv.weight.grad.dtype),
        },
    }


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def log_precision_report(report: dict[str, Any]) -> None:
    if report["effective"] != report["requested"]:
        logger.warning(
            f"mixed precision '{report['requested']}' is not available on {report['device']}: training runs in fp32 "
            "and is recorded as 'no' (use bf16 on a CPU)"
        )
    scaler = f"GradScaler, initial scale {report['initial_loss_scale']:g}" if report["grad_scaler"] else "no GradScaler"
    logger.info(
        f"precision: requested '{report['requested']}' ({report['requested_by']}), in effect '{report['effective']}' "
        f"on {report['device']}; autocast dtype {report['autocast_dtype'] or 'none (fp32)'}; {scaler}"
    )
    logger.info("dtypes of one batch: " + ", ".join(f"{k} {v}" for k, v in report["dtypes"].items()))


def check_step(
    accelerator: Accelerator,
    state: TrainerState,
    loss: torch.Tensor,
    grad_norm: torch.Tensor,
    max_consecutive_skipped_steps: int,
    output_dir: Path,
) -> None:
    """After an optimizer step: count steps the GradScaler skipped; stop a run that is no longer finite.

    With a GradScaler (fp16) a non-finite gradient is an overflow: the scaler skips the step and halves the
    scale, which is expected now and then; too many in a row means the run diverged. Without one (no, bf16)
    nothing can skip a bad step, so the first non-finite loss or gradient stops the run. The gradients were
    averaged over processes, so every process sees the same norm and stops at the same step.
    """
    if accelerator.scaler is not None:
        if not accelerator.optimizer_step_was_skipped:
            state.skipped_steps_in_a_row = 0
            return
        state.skipped_steps += 1
        state.skipped_steps_in_a_row += 1
        if state.skipped_steps_in_a_row > max_consecutive_skipped_steps:
            raise RunFault(
                f"the GradScaler skipped {state.skipped_steps_in_a_row} optimizer steps in a row (loss scale now "
                f"{accelerator.scaler.get_scale():g}) at epoch {state.epoch + 1}, optimizer step {state.global_step}: "
                "the gradients overflow at any scale, so training diverged; "
                + _what_to_do(output_dir, "a lower --learning_rate or --mixed_precision bf16")
            )
        return
    if not bool(torch.isfinite(loss) & torch.isfinite(grad_norm)):
        raise RunFault(
            f"non-finite training loss ({loss.item()}) or gradient norm ({grad_norm.item()}) at epoch "
            f"{state.epoch + 1}, optimizer step {state.global_step}; the run stops here rather than train on NaN "
            "weights; " + _what_to_do(output_dir, "a lower --learning_rate or --max_grad_norm 1")
        )


def loss_scale(accelerator: Accelerator) -> float | None:
    return accelerator.scaler.get_scale() if accelerator.scaler is not None else None


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


def _what_to_do(output_dir: Path, new_run: str) -> str:
    checkpoints = complete_checkpoints(output_dir)
    if not checkpoints:
        return f"no checkpoint was saved yet; start a new run with {new_run}"
    return (
        f"resume from the newest checkpoint, {checkpoints[-1]} (--resume_from_checkpoint latest, perhaps with "
        f"--max_grad_norm 1), or start a new run with {new_run}"
    )


def peak_memory(device: torch.device) -> tuple[float, str]:
    """Peak memory in MiB: allocated by tensors on the GPU, or the process's resident set on a CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20, "torch.cuda.max_memory_allocated"
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1024 if sys.platform == "darwin" else 1)
    return peak_kib / 1024, "peak resident set size of the main process"
