"""Mixed precision made visible: which precision can run where, and what is really in effect.

AMP fails quietly: fp16 asked for on a CPU runs fp32 without a word. The report shows the dtypes one batch
actually produces; the step telemetry (``telemetry.py``) and the non-finite guards (``bookkeeping.py``) watch the
loss scale, skipped steps and gradient norm as the run goes.
"""

from __future__ import annotations

import copy
import functools
import logging
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.logging import get_logger
from torch import nn

from cifar_accel.engine import LossFn

logger = get_logger(__name__)

AUTOCAST_DTYPES = {"fp16": "float16", "bf16": "bfloat16"}


def unsupported(precision: str) -> str | None:
    """Why this machine cannot run ``precision`` for real, or None."""
    if precision == "fp16" and not torch.cuda.is_available():
        return "needs a CUDA GPU: Accelerate autocasts fp16 only on GPUs, on a CPU the run would be fp32"
    if precision == "bf16" and torch.cuda.is_available() and not torch.cuda.is_bf16_supported():
        return "this GPU has no bf16 support"
    return None


@functools.cache  # the CPU does not change during a run: /proc/cpuinfo is read once
def cpu_flags() -> set[str]:
    """The CPU's feature flags, as /proc/cpuinfo lists them (none where there is no /proc/cpuinfo)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return set(cpuinfo.read().split())
    except OSError:
        return set()


def native_bf16() -> bool:
    """Whether this CPU computes bf16 natively (AVX-512 BF16 or AMX), as /proc/cpuinfo says; elsewhere torch emulates
    bf16 on a CPU, several times slower than fp32."""
    return bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})


def hardware_advice(effective: str, device: torch.device, has_native_bf16: bool) -> dict[str, str] | None:
    """Advice on the precision for this hardware: bf16 on a CPU without native bf16 is emulated and slow (a
    warning); fp32 on a CPU with native bf16 leaves speed unused (information). None when there is nothing to say."""
    if device.type != "cpu":
        return None
    if effective == "bf16" and not has_native_bf16:
        return {
            "level": "WARNING",
            "message": "bf16 on this CPU is emulated (no AVX-512 BF16 or AMX): a training step runs several times "
            "slower than in fp32; use --mixed_precision no here (bf16 pays on CPUs with AMX or AVX-512 BF16, on GPUs)",
        }
    if effective == "no" and has_native_bf16:
        return {
            "level": "INFO",
            "message": "this CPU computes bf16 natively (AVX-512 BF16 or AMX): --mixed_precision bf16 would train "
            "faster, usually to the same accuracy",
        }
    return None


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
    first_conv = next(m for m in probe.modules() if isinstance(m, nn.Conv2d) and m.weight.requires_grad)
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
        "advice": hardware_advice(effective, accelerator.device, native_bf16()),
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


def warn_if_not_in_effect(accelerator: Accelerator, work: str) -> None:
    """A warning where the precision asked for is not the one in effect (fp16 on a CPU), which Accelerate replaces
    by fp32 without a word; ``work`` says what runs in fp32 instead ("prediction runs in fp32")."""
    requested = accelerator.mixed_precision
    if effective_precision(accelerator) != requested:
        logger.warning(
            f"mixed precision '{requested}' is not available on {accelerator.device.type}: {work} (use bf16 on a CPU)"
        )


def log_precision_report(report: dict[str, Any]) -> None:
    scaler = f"GradScaler, initial scale {report['initial_loss_scale']:g}" if report["grad_scaler"] else "no GradScaler"
    logger.info(
        f"precision: requested '{report['requested']}' ({report['requested_by']}), in effect '{report['effective']}' "
        f"on {report['device']}; autocast dtype {report['autocast_dtype'] or 'none (fp32)'}; {scaler}"
    )
    logger.info("dtypes of one batch: " + ", ".join(f"{k} {v}" for k, v in report["dtypes"].items()))
    if report["advice"] is not None:
        logger.log(logging.getLevelName(report["advice"]["level"]), report["advice"]["message"])
