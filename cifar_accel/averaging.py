"""An exponential moving average of the weights, used for validation, test and the exported model.

Built on ``torch.optim.swa_utils.AveragedModel`` (buffers averaged too, so BatchNorm statistics follow). Its state
is saved next to each checkpoint as safetensors (``ema.safetensors``), nothing pickled.
"""

from __future__ import annotations

from pathlib import Path

import safetensors.torch
import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel

EMA_FILE = "ema.safetensors"


def ema_decay_at(decay: float, updates: int) -> float:
    """The decay of update number ``updates`` (counted from 0 after the first copy): it warms up as
    (1 + n) / (10 + n), so that early averages are not dominated by the random initial weights."""
    return min(decay, (1 + updates) / (10 + updates))


def build_ema(model: nn.Module, decay: float) -> AveragedModel:
    """An average that starts as a copy of ``model`` and moves each weight by ``1 - decay_at(n)`` towards it."""

    @torch.no_grad()
    def update(averages: list[torch.Tensor], weights: list[torch.Tensor], updates: torch.Tensor) -> None:
        if averages[0].is_floating_point():  # the lists hold one dtype each
            torch._foreach_lerp_(averages, weights, 1 - ema_decay_at(decay, int(updates) - 1))
        else:  # counters such as BatchNorm's num_batches_tracked follow the model
            torch._foreach_copy_(averages, weights)

    return AveragedModel(model, multi_avg_fn=update, use_buffers=True)


def save_ema(ema: AveragedModel, folder: Path) -> None:
    safetensors.torch.save_file({k: v.contiguous() for k, v in ema.state_dict().items()}, folder / EMA_FILE)


def load_ema(ema: AveragedModel, folder: Path) -> None:
    ema.load_state_dict(safetensors.torch.load_file(folder / EMA_FILE, device=str(ema.n_averaged.device)))
