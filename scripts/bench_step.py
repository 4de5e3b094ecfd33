"""Images/s of the training step alone (SimpleCNN, ready tensors), per precision and memory format, and of
evaluation per batch size.

Shows whether bf16 and channels_last pay on this machine before you pick a profile, and which
--per_device_eval_batch_size evaluates fastest:

    python scripts/bench_step.py            # CPU, or the GPU when there is one
    python scripts/bench_step.py --cpu --steps 30
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.state import AcceleratorState

from cifar_accel.allocator import keep_freed_memory
from cifar_accel.engine import training_step
from cifar_accel.errors import AddUp, ArgumentParser, counted, exit_command, positive_int
from cifar_accel.models import SimpleCNN


def images_per_second(precision: str, channels_last: bool, batch_size: int, steps: int, cpu: bool) -> float:
    accelerator = Accelerator(mixed_precision=precision, cpu=cpu)
    model = SimpleCNN()
    memory_format = torch.channels_last if channels_last else torch.contiguous_format
    model = model.to(memory_format=memory_format)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    inputs = torch.randn(batch_size, 3, 32, 32, device=accelerator.device).contiguous(memory_format=memory_format)
    targets = torch.randint(0, 10, (batch_size,), device=accelerator.device)

    def run(n: int) -> None:
        for _ in range(n):
            training_step(accelerator, model, optimizer, F.cross_entropy, inputs, targets)
        if accelerator.device.type == "cuda":
            torch.cuda.synchronize()

    run(3)  # warm-up
    start = time.perf_counter()
    run(steps)
    seconds = time.perf_counter() - start
    AcceleratorState._reset_state(reset_partial_state=True)
    return batch_size * steps / seconds


def eval_images_per_second(precision: str, batch_size: int, images: int, cpu: bool) -> float:
    """Evaluation forward passes (no gradients, channels_last) over ``images`` images in batches of ``batch_size``."""
    accelerator = Accelerator(mixed_precision=precision, cpu=cpu)
    model = accelerator.prepare(SimpleCNN().to(memory_format=torch.channels_last)).eval()
    inputs = torch.randn(batch_size, 3, 32, 32, device=accelerator.device).contiguous(memory_format=torch.channels_last)

    @torch.no_grad()
    def run(n: int) -> None:
        for _ in range(n):
            with accelerator.autocast():
                model(inputs)
        if accelerator.device.type == "cuda":
            torch.cuda.synchronize()

    run(1)  # warm-up
    batches = max(1, images // batch_size)
    start = time.perf_counter()
    run(batches)
    seconds = time.perf_counter() - start
    AcceleratorState._reset_state(reset_partial_state=True)
    return batch_size * batches / seconds


def main(argv: Sequence[str]) -> None:
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch_size", type=positive_int, default=64, help="Training batch (default: %(default)s).")
    parser.add_argument("--steps", type=positive_int, default=50, help="Timed training steps.")
    parser.add_argument("--cpu", action="store_true", help="Benchmark the CPU even when a GPU is present.")
    parser.add_argument("--eval_batch_sizes", type=positive_int, nargs="+", action=AddUp, default=[64, 500, 2000],
                        help="Evaluation batches to measure (default: 64 500 2000).")  # fmt: skip
    parser.add_argument("--eval_images", type=positive_int, default=6000, help="Images per evaluation measurement.")
    args = parser.parse_args(argv)
    keep_freed_memory()  # as training does
    on_gpu = torch.cuda.is_available() and not args.cpu
    precisions = ["no", "fp16", "bf16"] if on_gpu else ["no", "bf16"]
    print(
        f"device: {torch.cuda.get_device_name() if on_gpu else 'cpu'}; torch {torch.__version__}; "
        f"CPU capability {torch.backends.cpu.get_cpu_capability()}; {counted(torch.get_num_threads(), 'thread')}"
    )
    print(f"{'precision':<10}{'layout':<15}{'images/s':>10}")
    for precision in precisions:
        for channels_last in (False, True):
            rate = images_per_second(precision, channels_last, args.batch_size, args.steps, args.cpu)
            print(f"{precision:<10}{'channels_last' if channels_last else 'NCHW':<15}{rate:>10.0f}")
    print(f"\nevaluation, channels_last\n{'precision':<10}{'eval batch':<15}{'images/s':>10}")
    for precision in precisions:
        for batch_size in args.eval_batch_sizes:
            rate = eval_images_per_second(precision, batch_size, args.eval_images, args.cpu)
            print(f"{precision:<10}{batch_size:<15}{rate:>10.0f}")


if __name__ == "__main__":
    exit_command(main)
