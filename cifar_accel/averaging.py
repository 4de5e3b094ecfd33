"""An exponential moving average of the weights, used for validation, test and the exported model.

Built on ``torch.optim.swa_utils.AveragedModel`` (buffers averaged too, so BatchNorm statistics follow), with an
update that never waits for the device. Its state is saved next to each checkpoint as safetensors
(``ema.safetensors``), nothing pickled.
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


class WeightAverage(AveragedModel):
    """An ``AveragedModel`` of the weights and buffers that moves each floating-point tensor by
    ``1 - ema_decay_at(decay, n)`` towards the model's at each update (the first update copies), and copies the
    integer counters (BatchNorm's ``num_batches_tracked``).

    ``AveragedModel.update_parameters`` reads its update counter, a tensor, on the host at every update, which on
    a GPU waits for the device at every step; this one keeps the count on the host too (``updates``), so an update
    never waits. ``n_averaged`` is kept as well: it is what the checkpoint saves.
    """

    def __init__(self, model: nn.Module, decay: float) -> None:
        super().__init__(model, use_buffers=True)
        self.decay = decay
        self.updates = 0

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        averages = [*self.module.parameters(), *self.module.buffers()]
        weights = [t.detach() for t in (*model.parameters(), *model.buffers())]
        if self.updates == 0:
            torch._foreach_copy_(averages, weights)
        else:
            floats = [(a, w) for a, w in zip(averages, weights, strict=True) if a.is_floating_point()]
            decay = ema_decay_at(self.decay, self.updates - 1)
            torch._foreach_lerp_([a for a, _ in floats], [w for _, w in floats], 1 - decay)
            for average, weight in zip(averages, weights, strict=True):
                if not average.is_floating_point():
                    average.copy_(weight)
        self.updates += 1
        self.n_averaged += 1

    def load_state_dict(self, state_dict: dict[str, torch.Tensor], strict: bool = True):  # noqa: ANN201
        result = super().load_state_dict(state_dict, strict)
        self.updates = int(self.n_averaged)  # once, when a checkpoint is loaded
        return result


def save_ema(ema: WeightAverage, folder: Path) -> None:
    safetensors.torch.save_file({k: v.contiguous() for k, v in ema.state_dict().items()}, folder / EMA_FILE)


def load_ema(ema: WeightAverage, folder: Path) -> None:
    ema.load_state_dict(safetensors.torch.load_file(folder / EMA_FILE, device=str(ema.n_averaged.device)))
