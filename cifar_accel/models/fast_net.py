"""A small fast net in the style of airbench94 (Keller Jordan, 2024): a frozen 2x2 whitening convolution, three
conv groups of 64/256/256 channels with BatchNorm and GELU, max-pooling, and scaled-down logits."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from cifar_accel.precision import cpu_flags

WHITEN_KERNEL = 2
WHITEN_WIDTH = 2 * 3 * WHITEN_KERNEL**2  # each whitening filter and its negative
WIDTHS = (64, 256, 256)
BATCHNORM_MOMENTUM = 0.4  # torch's convention (airbench's 0.6 is the weight of the running statistics)
LOGIT_SCALE = 1 / 9
SMALL_MAP = 7  # the largest feature map (height and width) whose weight gradient Conv3x3 computes itself


class Conv3x3(nn.Conv2d):
    """A 3x3 convolution ("same" padding, no bias) initialised near the identity: its first ``channels_in`` filters
    are Dirac deltas.

    With ``matmul_weight_grads`` (``FastNet.set_conv_weight_grads``), in training under bf16 autocast on a CPU,
    its weight gradient on feature maps of up to 7x7 comes from ``small_map_weight_grad`` (the same sums in another
    order): oneDNN's backward-weights kernel for AMX runs fast_net's 7x7 and 3x3 maps at about a quarter and a
    sixth of the speed of its forward kernel.
    """

    def __init__(self, channels_in: int, channels_out: int) -> None:
        super().__init__(channels_in, channels_out, kernel_size=3, padding="same", bias=False)
        with torch.no_grad():
            nn.init.dirac_(self.weight[:channels_in])
        self.matmul_weight_grads = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (
            self.matmul_weight_grads
            and x.shape[-1] <= SMALL_MAP
            and torch.is_grad_enabled()
            and x.device.type == "cpu"
            and torch.is_autocast_enabled("cpu")
            and torch.get_autocast_dtype("cpu") == torch.bfloat16
        ):
            return super().forward(x)
        with torch.autocast("cpu", enabled=False):  # cast as autocast would, once, for both passes
            return SmallMapConv.apply(x.to(torch.bfloat16), self.weight.to(torch.bfloat16))


class SmallMapConv(torch.autograd.Function):
    """conv2d(x, weight, padding=1) with 3x3 weights: the input gradient from torch's kernel, the weight gradient
    from ``small_map_weight_grad``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        return F.conv2d(x, weight, padding=1)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        x, weight = ctx.saved_tensors
        grad_x = None
        if ctx.needs_input_grad[0]:  # as autograd computes it without this class: the same call, on the same input
            grad_x = torch.ops.aten.convolution_backward(
                grad_out, x, weight, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1, [True, False, False]
            )[0]
        return grad_x, small_map_weight_grad(x, grad_out)


def small_map_weight_grad(x: torch.Tensor, grad_out: torch.Tensor) -> torch.Tensor:
    """The gradient of a 3x3 convolution's weights (padding 1, stride 1) from its input ``x`` (N, C, H, W) and the
    gradient of its output ``grad_out`` (N, O, H, W): for each (dy, dx), the sum over images and positions of
    grad_out[n, :, y, x] times x[n, :, y + dy - 1, x + dx - 1], as matrix products.

    - Maps of 3x3: one forward convolution, of x with its images as channels by grad_out with its images as
      channels (its output, 3x3, holds the nine offsets).
    - Larger maps: x padded and grad_out padded after each row and image to the same (H + 2) x (W + 2) grid, both
      flattened to (grid positions, channels); grad_out against x's rows shifted by dy * (W + 2) + dx gives the
      offset's sum in one product (grad_out's padding, zero, drops the pairs that would cross a row or an image).
    """
    if x.shape[-1] <= 3:
        images_as_channels = x.transpose(0, 1).contiguous(memory_format=torch.channels_last)
        filters = grad_out.transpose(0, 1).contiguous(memory_format=torch.channels_last)
        return F.conv2d(images_as_channels, filters, padding=1).transpose(0, 1)
    n, channels, height, width = x.shape
    rows = F.pad(x, (1, 1, 1, 1)).permute(0, 2, 3, 1).reshape(-1, channels)
    grads = F.pad(grad_out, (0, 2, 0, 2)).transpose(0, 1).reshape(grad_out.shape[1], -1)
    length = len(rows) - 2 * (width + 2) - 2  # the positions every shifted window covers
    grads = grads[:, :length]
    sums = [grads @ rows[dy * (width + 2) + dx :][:length] for dy in range(3) for dx in range(3)]
    return torch.stack(sums, dim=2).view(-1, channels, 3, 3)


def batch_norm(channels: int) -> nn.BatchNorm2d:
    """BatchNorm with a learned bias but a fixed scale of 1."""
    norm = nn.BatchNorm2d(channels, eps=1e-12, momentum=BATCHNORM_MOMENTUM)
    norm.weight.requires_grad_(False)
    return norm


class ConvGroup(nn.Sequential):
    """conv -> 2x2 max-pool -> BatchNorm -> GELU -> conv -> BatchNorm -> GELU."""

    def __init__(self, channels_in: int, channels_out: int) -> None:
        super().__init__(
            Conv3x3(channels_in, channels_out),
            nn.MaxPool2d(2),
            batch_norm(channels_out),
            nn.GELU(),
            Conv3x3(channels_out, channels_out),
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
            nn.MaxPool2d(3, ceil_mode=True),  # 3x3 maps to 1x1; the 2x2 maps of 24x24 inputs too
        )
        self.classifier = nn.Linear(WIDTHS[2], num_classes, bias=False)
        self.set_conv_weight_grads("auto")

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

    def set_conv_weight_grads(self, way: str) -> None:
        """--conv_weight_grads: the 3x3 convolutions' weight gradients on small maps in bf16 on a CPU from torch's
        kernel ('kernel') or as matrix products ('matmul'); 'auto' is matmul on a CPU with AMX."""
        matmul = way == "matmul" or (way == "auto" and "amx_bf16" in cpu_flags())
        for module in self.modules():
            if isinstance(module, Conv3x3):
                module.matmul_weight_grads = matmul

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
