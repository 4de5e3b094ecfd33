"""Milliseconds and GFLOP/s of each of fast_net's 3x3 convolutions on this CPU, one batch at a time: the forward
pass, the input gradient and the weight gradient from torch's kernels, the weight gradient computed the other way
(``--conv_weight_grads matmul``: one forward convolution on 3x3 maps, shifted matrix products on larger ones), and a
plain matrix product of about a layer's size for scale.

Shows whether a CPU's convolutions already run as fast as its matrix products, and which way of computing the
weight gradient pays on it:

    OMP_NUM_THREADS=1 python scripts/bench_conv_layers.py --precision bf16
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from cifar_accel.errors import ArgumentParser, counted, exit_command, positive_int
from cifar_accel.models.fast_net import Conv3x3, FastNet, small_map_weight_grad
from cifar_accel.telemetry import hardware, machine_name

DTYPES = {"no": torch.float32, "bf16": torch.bfloat16}


def milliseconds(run: Callable[[], object], repeats: int) -> float:
    """The fastest of ``repeats`` timed calls, after one untimed."""
    run()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def layer_shapes() -> list[tuple[int, int, int]]:
    """(input channels, output channels, map size) of each distinct Conv3x3 in fast_net, from a forward pass."""
    model = FastNet()
    shapes = []
    for module in model.modules():
        if isinstance(module, Conv3x3):
            module.register_forward_hook(
                lambda m, inputs, _: shapes.append((m.in_channels, m.out_channels, inputs[0].shape[-1]))
            )
    with torch.no_grad():
        model(torch.randn(2, 3, 32, 32))
    return list(dict.fromkeys(shapes))


def layer_times(
    channels_in: int, channels_out: int, size: int, batch_size: int, dtype: torch.dtype, repeats: int
) -> list[float]:
    """The milliseconds of one layer's forward pass, input gradient, weight gradient (the kernel's, then the matmul
    way's) and of nine matrix products with the same multiply-adds as any one of them."""

    def tensor(*shape: int) -> torch.Tensor:
        return torch.randn(*shape).to(dtype).contiguous(memory_format=torch.channels_last)

    x, weight = tensor(batch_size, channels_in, size, size), tensor(channels_out, channels_in, 3, 3)
    grad_out = tensor(batch_size, channels_out, size, size)
    rows = torch.randn(batch_size * size * size, channels_in).to(dtype)
    grads = torch.randn(channels_out, batch_size * size * size).to(dtype)

    def backward(mask: list[bool]) -> object:
        return torch.ops.aten.convolution_backward(
            grad_out, x, weight, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1, mask
        )

    return [
        milliseconds(lambda: F.conv2d(x, weight, padding=1), repeats),
        milliseconds(lambda: backward([True, False, False]), repeats),
        milliseconds(lambda: backward([False, True, False]), repeats),
        milliseconds(lambda: small_map_weight_grad(x, grad_out), repeats),
        milliseconds(lambda: [grads @ rows for _ in range(9)], repeats),
    ]


def main(argv: Sequence[str]) -> None:
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--precision", choices=list(DTYPES), default="bf16", help="Default: %(default)s.")
    parser.add_argument("--batch_size", type=positive_int, default=250, help="Images per batch (the fast preset's).")
    parser.add_argument(
        "--repeats", type=positive_int, default=5, help="Timed calls per measurement; the fastest counts."
    )
    args = parser.parse_args(argv)
    print(f"{machine_name(hardware())}; torch {torch.__version__}, {counted(torch.get_num_threads(), 'thread')}; "
          f"{args.precision}, batches of {args.batch_size}, channels_last; ms (GFLOP/s)")  # fmt: skip
    print("| layer | forward | input gradient | weight gradient | weight gradient, matmul way | matrix product |")
    print("|---|---|---|---|---|---|")
    for channels_in, channels_out, size in layer_shapes():
        times = layer_times(channels_in, channels_out, size, args.batch_size, DTYPES[args.precision], args.repeats)
        gflop = 2 * args.batch_size * channels_in * channels_out * 9 * size * size / 1e9
        cells = " | ".join(f"{ms:.1f} ({gflop / ms * 1e3:.0f})" for ms in times)
        print(f"| {channels_in} -> {channels_out}, {size}x{size} | {cells} |", flush=True)


if __name__ == "__main__":
    exit_command(main)
