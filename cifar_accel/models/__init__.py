"""Models by name, each family in its own module.

A model may define two optional hooks, found by name:

- ``init_from_data(images)``: a data-dependent initialisation, run once on (normalised) training images before
  ``accelerator.prepare``; whatever it computes must live in the weights, so a checkpoint or
  ``model.safetensors`` alone reproduces it (for example, the whitening filters of ``FastNet``);
- ``parameter_groups(bias_lr_scale)``: the parameters in groups, each with an ``lr_scale`` and a
  ``weight_decay_scale`` applied to the optimizer's settings (for example, ``--bias_lr_scale`` times the
  learning rate for the BatchNorm biases), and
  ``whitening_bias: True`` on the group that ``--whiten_bias_epochs`` schedules on its own;
- ``set_conv_weight_grads(way)``: how its convolutions' weight gradients are computed (``--conv_weight_grads``).
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from cifar_accel.models.fast_net import FastNet
from cifar_accel.models.resnet import ResNet9, resnet18
from cifar_accel.models.simple_cnn import SimpleCNN

MODELS: dict[str, Callable[..., nn.Module]] = {
    "simple_cnn": SimpleCNN,
    "fast_net": FastNet,
    "resnet9": ResNet9,
    "resnet18": resnet18,
}


def build_model(name: str, num_classes: int) -> nn.Module:
    return MODELS[name](num_classes=num_classes)


__all__ = ["MODELS", "FastNet", "ResNet9", "SimpleCNN", "build_model", "resnet18"]
