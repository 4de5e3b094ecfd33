"""A small fast net in the style of airbench94 (Keller Jordan, 2024): a frozen 2x2 whitening convolution, three
conv groups of 64/256/256 channels with BatchNorm and GELU, max-pooling, and scaled-down logits."""

from __future__ import annotations

import torch
from torch import nn

WHITEN_KERNEL = 2
WHITEN_WIDTH = 2 * 3 * WHITEN_KERNEL**2  # each whitening filter and its negative
WIDTHS = (64, 256, 256)
BATCHNORM_MOMENTUM = 0.4  # torch's convention (airbench's 0.6 is the weight of the running statistics)
LOGIT_SCALE = 1 / 9


def conv3x3(channels_in: int, channels_out: int) -> nn.Conv2d:
    """A 3x3 convolution initialised near the identity: its first ``channels_in`` filters are Dirac deltas."""
    conv = nn.Conv2d(channels_in, channels_out, kernel_size=3, padding="same", bias=False)
    with torch.no_grad():
        nn.init.dirac_(conv.weight[:channels_in])
    return conv


def batch_norm(channels: int) -> nn.BatchNorm2d:
    """BatchNorm with a learned bias but a fixed scale of 1."""
    norm = nn.BatchNorm2d(channels, eps=1e-12, momentum=BATCHNORM_MOMENTUM)
    norm.weight.requires_grad_(False)
    return norm


class ConvGroup(nn.Sequential):
    """conv -> 2x2 max-pool -> BatchNorm -> GELU -> conv -> BatchNorm -> GELU."""

    def __init__(self, channels_in: int, channels_out: int) -> None:
        super().__init__(
            conv3x3(channels_in, channels_out),
            nn.MaxPool2d(2),
            batch_norm(channels_out),
            nn.GELU(),
            conv3x3(channels_out, channels_out),
            batch_norm(channels_out),
            nn.GELU(),
        )


class FastNet(nn.Module):
    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.whiten = nn.Conv2d(3, WHITEN_WIDTH, kernel_size=WHITEN_KERNEL, padding=0, bias=True)
        self.whiten.weight.requires_grad_(False)  # set from the data by init_from_data, then frozen
        self.features = nn.Sequential(
            nn.GELU(),
            ConvGroup(WHITEN_WIDTH, WIDTHS[0]),
            ConvGroup(WIDTHS[0], WIDTHS[1]),
            ConvGroup(WIDTHS[1], WIDTHS[2]),
            nn.MaxPool2d(3),
        )
        self.classifier = nn.Linear(WIDTHS[2], num_classes, bias=False)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(self.whiten(images)).flatten(1)) * LOGIT_SCALE

    @torch.no_grad()
    def init_from_data(self, images: torch.Tensor, eps: float = 5e-4) -> None:
        """Whitening filters from the 2x2 patches of ``images`` (normalised, (N, 3, H, W)): the eigenvectors of
        the patch covariance scaled by 1/sqrt(eigenvalue + eps), each with its negative (so that GELU keeps
        both signs). The covariance of whitened patches is then close to the identity. Computed in float32, or
        in float64 for float64 images."""
        patches = patches_of(images.to(torch.promote_types(images.dtype, torch.float32)), WHITEN_KERNEL)
        covariance = patches.T @ patches / len(patches)
        eigenvalues, eigenvectors = torch.linalg.eigh(covariance)
        filters = (eigenvectors.T / (eigenvalues + eps).sqrt().unsqueeze(1)).view(-1, 3, WHITEN_KERNEL, WHITEN_KERNEL)
        self.whiten.weight.copy_(torch.cat((filters, -filters)))

    def parameter_groups(self, bias_lr_scale: float) -> list[dict]:
        """Every trained weight but the biases, then the biases (BatchNorm's, and the whitening's in a group of
        its own, marked ``whitening_bias`` for --whiten_bias_epochs) with ``bias_lr_scale`` (--bias_lr_scale)
        times the learning rate and the weight decay divided by it (the decay per step, learning rate x weight
        decay, stays the same)."""
        norm_biases = [m.bias for m in self.modules() if isinstance(m, nn.BatchNorm2d)]
        ids = {id(p) for p in (self.whiten.bias, *norm_biases)}
        others = [p for p in self.parameters() if p.requires_grad and id(p) not in ids]
        bias_scales = {"lr_scale": bias_lr_scale, "weight_decay_scale": 1 / bias_lr_scale}
        return [  # the plain group first: the learning rate that logs and records report is its
            {"params": others, "lr_scale": 1.0, "weight_decay_scale": 1.0},
            {"params": norm_biases, **bias_scales},
            {"params": [self.whiten.bias], **bias_scales, "whitening_bias": True},
        ]


def patches_of(images: torch.Tensor, size: int) -> torch.Tensor:
    """Every ``size`` x ``size`` patch of ``images`` (N, C, H, W), flattened: (patches, C * size * size)."""
    channels = images.shape[1]
    patches = images.unfold(2, size, 1).unfold(3, size, 1)  # N, C, H', W', size, size
    return patches.permute(0, 2, 3, 1, 4, 5).reshape(-1, channels * size * size)
