"""Residual networks for 32x32 images: a Myrtle-style ResNet-9 and a CIFAR-style ResNet-18."""

from __future__ import annotations

import torch
from torch import nn


def conv_bn_relu(channels_in: int, channels_out: int, pool: bool = False) -> nn.Sequential:
    layers = [
        nn.Conv2d(channels_in, channels_out, kernel_size=3, padding=1, bias=False),
        nn.BatchNorm2d(channels_out),
        nn.ReLU(inplace=True),
    ]
    return nn.Sequential(*layers, nn.MaxPool2d(2)) if pool else nn.Sequential(*layers)


class Residual(nn.Module):
    """x + two conv-BN-ReLU layers of x."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.body = nn.Sequential(conv_bn_relu(channels, channels), conv_bn_relu(channels, channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.body(x)


class ResNet9(nn.Module):
    """The ResNet-9 of Myrtle.ai's DAWNBench entry (David Page, 2018): 64/128/256/512 channels, two residual
    blocks, global max-pool and logits scaled by 1/8."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            conv_bn_relu(3, 64),
            conv_bn_relu(64, 128, pool=True),
            Residual(128),
            conv_bn_relu(128, 256, pool=True),
            conv_bn_relu(256, 512, pool=True),
            Residual(512),
            nn.AdaptiveMaxPool2d(1),
        )
        self.classifier = nn.Linear(512, num_classes, bias=False)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(images).flatten(1)) * 0.125


def resnet18(num_classes: int = 10) -> nn.Module:
    """torchvision's ResNet-18 with the CIFAR stem: a 3x3 stride-1 first convolution and no max-pool, so the
    32x32 image is not shrunk fourfold before the first block."""
    import torchvision  # here, not at the top: importing it takes a second (it loads torch._dynamo)

    model = torchvision.models.ResNet(torchvision.models.resnet.BasicBlock, [2, 2, 2, 2], num_classes=num_classes)
    model.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()
    return model
