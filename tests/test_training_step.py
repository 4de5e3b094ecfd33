"""The training step itself, on tiny models whose updates can be computed by hand."""

from __future__ import annotations

import pytest
import torch
from accelerate import Accelerator
from torch import nn

from cifar_accel.engine import training_step


def one_weight_model() -> nn.Linear:
    model = nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    return model


def test_the_chapters_cpu_check_loss_16_weight_2_6():
    """w=1, x=2, y=6, MSE, SGD lr 0.1: loss (2-6)^2 = 16, grad 2*(2-6)*2 = -16, w = 1 + 1.6 = 2.6."""
    accelerator = Accelerator(mixed_precision="no", cpu=True)
    model = one_weight_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)

    loss, _, grad_norm = training_step(
        accelerator, model, optimizer, nn.functional.mse_loss, torch.tensor([[2.0]]), torch.tensor([[6.0]])
    )
    assert loss.item() == pytest.approx(16.0)
    assert grad_norm.item() == pytest.approx(16.0)  # measured, not clipped
    assert model.weight.item() == pytest.approx(2.6)
    assert model.weight.grad is None or model.weight.grad.abs().sum() == 0


def test_max_grad_norm_clips_the_update():
    """Same problem, SGD lr 1: unclipped the gradient -16 would move w to 17; clipped to norm 1 it moves to 2."""
    accelerator = Accelerator(mixed_precision="no", cpu=True)
    model = one_weight_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    model, optimizer = accelerator.prepare(model, optimizer)

    _, _, grad_norm = training_step(
        accelerator,
        model,
        optimizer,
        nn.functional.mse_loss,
        torch.tensor([[2.0]]),
        torch.tensor([[6.0]]),
        max_grad_norm=1.0,
    )
    assert model.weight.item() == pytest.approx(2.0, abs=1e-5)
    assert grad_norm.item() == pytest.approx(16.0)  # the norm before clipping
