"""Seconds per optimizer step of the fast preset (fast_net, 2000 images a step) under each change the record recipes
made and the CPU's own levers, measured in one process in alternating turns, so that a shared host's drift affects
every variant alike.

    python scripts/bench_fast_changes.py --precision no --steps 3 --turns 3

The variants (--variants):

- ``preset``: the fast preset as shipped (8 accumulated batches of 250, 3 float32 Newton-Schulz iterations);
- ``batch2000``: each step one batch of 2000, as airbench94_muon computes it;
- ``batch500``: each step 4 accumulated batches of 500 (the preset's batches until 8 of 250 proved faster);
- ``batch125``: each step 16 accumulated batches of 125;
- ``ns_bf16``: Muon's Newton-Schulz iterations in bfloat16, as airbench94_muon computes them (fast only where the
  CPU computes bfloat16 natively);
- ``compile``: the model compiled with torch.compile (--torch_compile; the compile itself is in the warm-up);
- ``silu``: fast_net with SiLU in place of GELU (hiverge/cifar10-speedrun);
- ``gelu_tanh``: fast_net with GELU's tanh approximation in place of the exact GELU;
- ``kernel_grads``: every convolution's weight gradient from torch's kernel (--conv_weight_grads kernel; the preset
  computes those of maps of up to 7x7 as matrix products in bf16 on a CPU with AMX);
- ``crop24``, ``crop28``: a step of an early epoch under --early_crop_size 24 or 28 (windows of 24x24 or 28x28);

and the optimizer step alone (on the gradients of one real step), as the preset takes it and as the record's
later changes would: every filter bank's Newton-Schulz batched in one padded 3-D tensor, and the renormalisation
of the filters every 4th step instead of every step.

The data are random tensors of the preset's shapes: the pipeline's own cost is `scripts/bench_throughput.py`'s.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from accelerate.utils import set_seed
from torch import nn

from cifar_accel.allocator import keep_freed_memory
from cifar_accel.config import TrainConfig, config_path, read_config_file
from cifar_accel.engine import training_step
from cifar_accel.errors import AddUp, ArgumentParser, counted, exit_command, int_at_least, positive_int
from cifar_accel.models import build_model
from cifar_accel.optim import MuonSGD, build_loss, build_optimizer, newton_schulz
from cifar_accel.telemetry import hardware, machine_name


def replace_gelu(activation: Callable[[], nn.Module]) -> Callable[[nn.Module], None]:
    """A change of fast_net: every GELU replaced by ``activation()``."""

    def change(model: nn.Module) -> None:
        for parent in model.modules():
            for name, child in parent.named_children():
                if isinstance(child, nn.GELU):
                    setattr(parent, name, activation())

    return change


VARIANTS = {  # name: (config overrides, a change of fast_net's modules, or None)
    "preset": ({}, None),
    "batch2000": ({"per_device_train_batch_size": 2000, "gradient_accumulation_steps": 1}, None),
    "batch500": ({"per_device_train_batch_size": 500, "gradient_accumulation_steps": 4}, None),
    "batch125": ({"per_device_train_batch_size": 125, "gradient_accumulation_steps": 16}, None),
    "ns_bf16": ({"muon_ns_dtype": "bfloat16"}, None),
    "compile": ({"torch_compile": True}, None),
    "silu": ({}, replace_gelu(nn.SiLU)),
    "gelu_tanh": ({}, replace_gelu(lambda: nn.GELU(approximate="tanh"))),
    "kernel_grads": ({}, lambda model: model.set_conv_weight_grads("kernel")),
    "crop24": ({"early_crop_size": 24, "early_crop_epochs": 1}, None),
    "crop28": ({"early_crop_size": 28, "early_crop_epochs": 1}, None),
}
STEP_IMAGES = 2000


def fast_config(**overrides) -> TrainConfig:
    return TrainConfig(**{**read_config_file(config_path("fast")), **overrides})


def build(
    config: TrainConfig,
    change: Callable[[nn.Module], None] | None,
    accelerator: Accelerator,
    batch: tuple[torch.Tensor, torch.Tensor],
):
    """The preset's model (with ``change`` made to it if given), optimizer and loss, prepared by an Accelerator, as
    training builds them, and ``config``."""
    set_seed(0)
    model = build_model("fast_net", num_classes=10)
    if change is not None:
        change(model)
    model.init_from_data(batch[0][:500])
    model = model.to(memory_format=torch.channels_last)
    if config.torch_compile:
        model.compile()
    optimizer = build_optimizer(config, model, config.learning_rate)
    model, optimizer = accelerator.prepare(model, optimizer)
    return accelerator, model, optimizer, build_loss(config), config


def optimizer_step(accelerator, model, optimizer, loss_fn, config, inputs, targets) -> None:
    """One optimizer step on ``inputs``, as training computes it under ``config``: batches of
    --per_device_train_batch_size, accumulated over --gradient_accumulation_steps, and with --early_crop_size on
    windows of that size, as in an early epoch."""
    if config.early_crop_size:
        size = config.early_crop_size
        inputs = inputs[..., :size, :size].contiguous(memory_format=torch.channels_last)
    accelerator.gradient_accumulation_steps = config.gradient_accumulation_steps
    accelerator.step = 0  # the accumulation count starts with the step
    size = config.per_device_train_batch_size
    for batch_inputs, batch_targets in zip(inputs.split(size), targets.split(size), strict=True):
        with accelerator.accumulate(model):
            training_step(accelerator, model, optimizer, loss_fn, batch_inputs, batch_targets)


def batched_newton_schulz(matrices: list[torch.Tensor], steps: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """hiverge's batched iteration: every (rows x columns) matrix, transposed to be wide, zero-padded into one
    (banks, rows, columns) tensor and iterated at once (zero padding leaves each matrix's iteration as it is)."""
    wide = [m if m.size(0) <= m.size(1) else m.T for m in matrices]
    rows, cols = max(m.size(0) for m in wide), max(m.size(1) for m in wide)
    x = torch.zeros(len(wide), rows, cols, dtype=dtype)
    for i, m in enumerate(wide):
        x[i, : m.size(0), : m.size(1)] = m / (m.norm() + 1e-7)
    a, b, c = 3.4445, -4.7750, 2.0315
    for _ in range(steps):
        gram = x @ x.transpose(1, 2)
        x = a * x + (b * gram + c * gram @ gram) @ x
    out = [x[i, : m.size(0), : m.size(1)] for i, m in enumerate(wide)]
    return [o if m.size(0) <= m.size(1) else o.T for o, m in zip(out, matrices, strict=True)]


def optimizer_seconds(optimizer: MuonSGD, repeats: int) -> dict[str, float]:
    """The Muon group's update as the preset computes it, batched, and with the renormalisation every 4th step."""
    group = optimizer.param_groups[-1]
    filters = [p for p in group["params"] if p.grad is not None]
    grads = [p.grad.reshape(len(p), -1) for p in filters]
    dtype = getattr(torch, group["ns_dtype"])

    def per_bank(renormalise: bool) -> None:
        for p, g in zip(filters, grads, strict=True):
            if renormalise:
                p.mul_(len(p) ** 0.5 / p.norm())
            newton_schulz(g, group["ns_steps"], dtype)

    def timed(work) -> float:
        start = time.perf_counter()
        for i in range(repeats):
            work(i)
        return (time.perf_counter() - start) / repeats

    with torch.no_grad():
        return {
            "per bank, renormalised every step (preset)": timed(lambda i: per_bank(True)),
            "per bank, renormalised every 4th step": timed(lambda i: per_bank(i % 4 == 0)),
            "batched in one padded tensor": timed(lambda i: batched_newton_schulz(grads, group["ns_steps"], dtype)),
        }


def main(argv: Sequence[str]) -> None:
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--precision", choices=["no", "bf16"], default="bf16", help="Default: %(default)s.")
    parser.add_argument("--steps", type=positive_int, default=6, help="Timed steps per variant and turn.")
    parser.add_argument("--turns", type=positive_int, default=3, help="Rounds in which the variants alternate.")
    parser.add_argument("--warmup", type=int_at_least(0), default=2, help="Untimed steps before each measurement.")
    parser.add_argument("--variants", nargs="+", action=AddUp, choices=list(VARIANTS), default=list(VARIANTS))
    args = parser.parse_args(argv)
    keep_freed_memory()  # as training does
    hw = hardware()
    print(f"{machine_name(hw)}; torch {torch.__version__}, {counted(hw['torch_threads'], 'thread')}; {args.precision}, "
          f"{STEP_IMAGES} images a step")  # fmt: skip
    torch.manual_seed(0)
    batch = (
        torch.randn(STEP_IMAGES, 3, 32, 32).contiguous(memory_format=torch.channels_last),
        torch.randint(0, 10, (STEP_IMAGES,)),
    )
    accelerator = Accelerator(mixed_precision=args.precision, cpu=True)
    built = {}
    for name in args.variants:
        overrides, change = VARIANTS[name]
        built[name] = build(fast_config(**overrides), change, accelerator, batch)
        start = time.perf_counter()
        for _ in range(args.warmup):
            optimizer_step(*built[name], *batch)
        print(f"  {name}: warm-up {time.perf_counter() - start:.1f} s for {counted(args.warmup, 'step')}", flush=True)
    seconds = dict.fromkeys(built, 0.0)
    for _ in range(args.turns):
        for name, parts in built.items():
            start = time.perf_counter()
            for _ in range(args.steps):
                optimizer_step(*parts, *batch)
            seconds[name] += time.perf_counter() - start
    base = seconds[args.variants[0]]
    print(f"\n{'variant':<12}{'s/step':>8}{'vs ' + args.variants[0]:>12}")
    for name, total in seconds.items():
        print(f"{name:<12}{total / (args.steps * args.turns):>8.2f}{base / total:>11.2f}x")
    _, model, optimizer, loss_fn, _ = built[args.variants[0]]
    with accelerator.autocast():
        loss = loss_fn(model(batch[0]), batch[1])
    accelerator.backward(loss)  # the gradients of one real step
    print("\nMuon's filter update alone (s):")
    for name, value in optimizer_seconds(optimizer.optimizer, repeats=8).items():
        print(f"  {name:<45}{value:.4f}")
    AcceleratorState._reset_state(reset_partial_state=True)


if __name__ == "__main__":
    exit_command(main)
