"""The AMP chapter's exercises, runnable: what the GradScaler does, and what goes wrong without it.

    python scripts/amp_exercises.py overflow      # an overflow halves the loss scale and skips steps; it grows back
    python scripts/amp_exercises.py pure_fp16     # model.half() without autocast or scaler: underflow, then NaN
    python scripts/amp_exercises.py resume_scale  # resuming without the scaler's state: the scale jumps back
    python scripts/amp_exercises.py all

Each runs in seconds on a GPU and in about 25 s on a 2-core CPU (torch has fp16 autocast and a GradScaler
there too), with SimpleCNN on a fixed batch of random images: the mechanisms, not accuracy, are the point.
The demos call torch.autocast and torch.amp.GradScaler directly, to show what Accelerate does inside
``accelerator.backward`` (scale the loss), ``accelerator.clip_grad_norm_`` (unscale) and ``optimizer.step``
(skip on overflow, update the scale); a training run logs the same as step/loss_scale and step/skipped_steps.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from cifar_accel.errors import ArgumentParser, exit_command
from cifar_accel.models import build_model

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
SMALLEST_FP16 = 2.0**-24  # the smallest positive (subnormal) float16; anything smaller becomes 0


def model_and_batch(batch_size: int = 32) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    images = torch.randn(batch_size, 3, 32, 32, device=DEVICE)
    labels = torch.randint(0, 10, (batch_size,), device=DEVICE)
    return build_model("simple_cnn", num_classes=10).to(DEVICE), images, labels


def amp_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    images: torch.Tensor,
    labels: torch.Tensor,
    loss_factor: float = 1.0,
) -> tuple[float, bool]:
    """One AMP step; returns the loss and whether the scaler skipped the update."""
    with torch.autocast(DEVICE.type, dtype=torch.float16):
        loss = F.cross_entropy(model(images), labels) * loss_factor
    scaler.scale(loss).backward()
    scale_before = scaler.get_scale()
    scaler.step(optimizer)  # unscales, and skips the update if any gradient is inf or NaN
    scaler.update()  # halves the scale after a skip; doubles it after growth_interval clean steps
    optimizer.zero_grad()
    return loss.item(), scaler.get_scale() < scale_before


def first_conv_output_grad(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, loss_factor: float):
    """The gradient of the loss with respect to the first convolution's output, divided back by loss_factor."""
    grads = []

    def keep_output_grad(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        output.register_hook(grads.append)

    model.features[0][0].register_forward_hook(keep_output_grad)
    (F.cross_entropy(model(images), labels) * loss_factor).backward()
    return grads[0].float() / loss_factor


def overflow() -> None:
    print("== overflow: steps 15-18 get an inf loss (as a too-high learning rate or a bad batch would) ==")
    model, images, labels = model_and_batch()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler(DEVICE.type, init_scale=2.0**16, growth_interval=10)  # default interval: 2000
    print(f"{'step':>4}  {'loss':>8}  {'scale':>8}  event")
    skipped, lowest = [], scaler.get_scale()
    for step in range(1, 51):
        weights = model.classifier.weight.detach().clone()
        scale = scaler.get_scale()
        loss, was_skipped = amp_step(model, optimizer, scaler, images, labels, float("inf") if 15 <= step <= 18 else 1)
        if was_skipped:
            skipped.append(step)
            assert torch.equal(model.classifier.weight, weights), "a skipped step must not change the weights"
        lowest = min(lowest, scaler.get_scale())
        if scaler.get_scale() != scale or step in (1, 50):
            event = (
                "skipped, scale halved"
                if was_skipped
                else "scale doubled after 10 clean steps" * (scaler.get_scale() > scale)
            )
            print(f"{step:>4}  {loss:>8.4f}  {scaler.get_scale():>8g}  {event}")
    print(f"skipped steps: {skipped}, weights untouched on each; the scale fell to {lowest:g} and grew back 2x per "
          "10 clean steps. In a run a few skips are normal; a long streak means the run diverged.\n")  # fmt: skip


def pure_fp16() -> None:
    print("== pure fp16: model.half(), no autocast, no GradScaler, next to AMP ==")
    model, images, labels = model_and_batch(batch_size=128)
    print("1) gradients of the first conv's output, one batch:")
    for name, probe, inputs, loss_factor in (
        ("fp32", copy.deepcopy(model), images, 1.0),
        ("pure fp16", copy.deepcopy(model).half(), images.half(), 1.0),
        ("pure fp16, loss x 1024 (a GradScaler)", copy.deepcopy(model).half(), images.half(), 1024.0),
    ):
        grad = first_conv_output_grad(probe, inputs, labels, loss_factor)
        print(f"   {name:<38} zero: {(grad == 0).float().mean().item():6.1%}   median |grad| "
              f"{grad.abs().median().item():.2e}")  # fmt: skip
    print(
        f"   fp16 cannot hold magnitudes below {SMALLEST_FP16:.1e}: most of these gradients flush to zero, and "
        "scaling the loss up before backward (and the gradients down after) keeps them."
    )

    print("2) 20 Adam steps on the same batch:")
    images, labels = images[:32], labels[:32]
    pure, amp = copy.deepcopy(model).half(), copy.deepcopy(model)
    pure_optimizer = torch.optim.Adam(pure.parameters(), lr=1e-3)
    amp_optimizer = torch.optim.Adam(amp.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler(DEVICE.type)
    print(f"   {'step':>4}  {'pure fp16 loss':>14}  {'AMP loss':>8}")
    for step in range(1, 21):
        pure_loss = F.cross_entropy(pure(images.half()), labels)
        pure_loss.backward()
        pure_optimizer.step()
        pure_optimizer.zero_grad()
        amp_loss, _ = amp_step(amp, amp_optimizer, scaler, images, labels)
        if step <= 3 or step % 5 == 0:
            print(f"   {step:>4}  {pure_loss.item():>14.4f}  {amp_loss:>8.4f}")
    print(f"   pure fp16 weights hold NaN: {any(p.isnan().any().item() for p in pure.parameters())}. Adam's eps "
          "(1e-8) and small squared gradients are 0 in fp16, so its first update divides by zero. AMP keeps fp32 "
          "master weights and optimizer state, computes in fp16 under autocast, and scales the loss.\n")  # fmt: skip


def resume_scale() -> None:
    print("== resume: with and without the GradScaler's state ==")
    model, images, labels = model_and_batch()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler(DEVICE.type, init_scale=2.0**16, growth_interval=10)
    loss_factor = 4096.0  # large gradients (think of a summed loss): they overflow fp16 at the default scale
    skips = sum(amp_step(model, optimizer, scaler, images, labels, loss_factor)[1] for _ in range(40))
    print(f"trained 40 steps: {skips} skipped while the scale settled at {scaler.get_scale():g}; checkpoint saved")
    checkpoint = copy.deepcopy(
        {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scaler": scaler.state_dict()}
    )  # what accelerator.save_state writes (the scaler as scaler.pt)

    for restore_scaler in (True, False):
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        scaler = torch.amp.GradScaler(DEVICE.type, init_scale=2.0**16, growth_interval=10)
        if restore_scaler:
            scaler.load_state_dict(checkpoint["scaler"])
        start = scaler.get_scale()
        skipped = [step for step in range(1, 11) if amp_step(model, optimizer, scaler, images, labels, loss_factor)[1]]
        label = "scaler restored    " if restore_scaler else "scaler NOT restored"
        print(f"{label}: resumes at scale {start:>7g}; skipped steps in the next 10: {skipped or 'none'}")
    print("Without its state the scale jumps back to the initial 65536 and the first steps after resuming are "
          "thrown away (with the model's updates) until it has shrunk again; with it, training continues as if "
          "never stopped. The package's checkpoints include it (scaler.pt, via accelerator.save_state).\n")  # fmt: skip


DEMOS = {"overflow": overflow, "pure_fp16": pure_fp16, "resume_scale": resume_scale}


def main(argv: Sequence[str]) -> None:
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "demo",
        choices=[*DEMOS, "all"],
        help="overflow: an overflow halves the loss scale and skips steps; pure_fp16: model.half() without autocast "
        "or scaler; resume_scale: resuming without the scaler's state; all: each in turn.",
    )
    demo = parser.parse_args(argv).demo
    print(f"device: {DEVICE}, torch {torch.__version__}\n")
    for name, run in DEMOS.items():
        if demo in (name, "all"):
            run()


if __name__ == "__main__":
    exit_command(main)
