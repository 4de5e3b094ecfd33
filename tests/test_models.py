"""Models by name, their hooks (data-dependent initialisation, parameter groups), optimizers and per-step
schedules."""

from __future__ import annotations

import json

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn
from torch.nn.grad import conv2d_weight

from cifar_accel.config import TrainConfig
from cifar_accel.data import load_split
from cifar_accel.models import MODELS, build_model
from cifar_accel.models.fast_net import Conv3x3, patches_of, small_map_weight_grad
from cifar_accel.optim import StepSchedule, build_optimizer
from cifar_accel.precision import cpu_flags
from cifar_accel.transforms import CIFAR10_NORMALIZATION, BatchTransform

from conftest import CIFAR10_JPEG, assert_same_run, crashed_copy, read_results, tiny_args

needs_cifar = pytest.mark.skipif(not CIFAR10_JPEG.is_dir(), reason=f"needs the CIFAR-10 copy at {CIFAR10_JPEG}")


def cifar_images(count: int) -> torch.Tensor:
    """The first ``count`` real training images, normalised as training batches are."""
    images = load_split(str(CIFAR10_JPEG), "train", None, None, max_samples=count)[0].images
    return BatchTransform(CIFAR10_NORMALIZATION)(images)


@needs_cifar
def test_whitening_makes_the_covariance_of_the_patches_it_sees_close_to_the_identity():
    """Exact-math properties, so checked in float64: in float32 the faintest of the 12 directions, scaled up by
    1/sqrt(eigenvalue + 1e-9), carries rounding that differs from one CPU's kernels to the next."""
    images = cifar_images(2000).double()
    model = build_model("fast_net", num_classes=10)
    raw = patches_of(images, 2)
    raw_covariance = raw.T @ raw / len(raw)
    model.init_from_data(images)
    whitened = torch.nn.functional.conv2d(images, model.whiten.weight[:12].double())  # without their negatives
    flat = whitened.permute(0, 2, 3, 1).reshape(-1, 12)
    covariance = flat.T @ flat / len(flat)
    # Before: strongly correlated neighbouring pixels and channels. After: uncorrelated, each direction with
    # variance eigenvalue / (eigenvalue + eps), which is 1 but for the faintest directions of the 12.
    eigenvalues = torch.linalg.eigvalsh(raw_covariance)
    assert (raw_covariance - torch.diag(raw_covariance.diag())).abs().max() > 0.5
    assert (covariance - torch.diag(covariance.diag())).abs().max() < 0.01
    assert covariance.diag().tolist() == pytest.approx((eigenvalues / (eigenvalues + 5e-4)).tolist(), abs=0.01)
    model.init_from_data(images, eps=1e-9)
    exact = torch.nn.functional.conv2d(images, model.whiten.weight[:12].double()).permute(0, 2, 3, 1).reshape(-1, 12)
    assert (exact.T @ exact / len(exact) - torch.eye(12, dtype=torch.float64)).abs().max() < 0.01
    assert torch.equal(model.whiten.weight[12:], -model.whiten.weight[:12])
    assert not model.whiten.weight.requires_grad  # frozen: the checkpoint's weights carry it


def test_every_model_maps_a_batch_to_class_scores_and_fast_net_groups_its_biases():
    for name in MODELS:
        logits = build_model(name, num_classes=7)(torch.randn(2, 3, 32, 32))
        assert logits.shape == (2, 7), name
    model = build_model("fast_net", num_classes=10)
    config = TrainConfig(optimizer="sgd", momentum=0.85, nesterov=True, weight_decay=1e-3, bias_lr_scale=85.5)
    optimizer = build_optimizer(config, model, learning_rate=0.5)
    others, biases, whitening = optimizer.param_groups  # the plain group first: its rate is the one logged
    for group in (biases, whitening):
        assert (group["lr"], others["lr"]) == (0.5 * 85.5, 0.5)
        assert group["lr"] * group["weight_decay"] == pytest.approx(others["lr"] * others["weight_decay"])
    norms = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    assert {id(p) for p in biases["params"]} == {id(m.bias) for m in norms}
    assert whitening["params"] == [model.whiten.bias] and whitening["whitening_bias"]
    trained = {id(p) for p in model.parameters() if p.requires_grad}
    assert {id(p) for g in optimizer.param_groups for p in g["params"]} == trained  # nothing frozen, nothing missed
    assert others["nesterov"] and others["momentum"] == 0.85


@pytest.mark.parametrize("name", ["fast_net", "resnet9", "resnet18"])
def test_each_model_learns_above_chance_on_a_small_slice(tiny_dataset, train_here, tmp_path, name):
    out = tmp_path / "run"
    args = tiny_args(tiny_dataset, out, "--model_name", name, "--num_train_epochs", "3", "--max_train_samples", "160",
                     "--per_device_train_batch_size", "16", "--no-augment")  # fmt: skip
    proc = train_here(args)
    assert proc.returncode == 0, proc.stderr
    results = read_results(out)
    assert results["test_accuracy"] > 0.4, results["history"]  # chance is 0.1; the classes differ in colour


@pytest.mark.parametrize("size", [(3, 3), (2, 5), (4, 6), (7, 7), (15, 15)])
@pytest.mark.parametrize("layout", [torch.contiguous_format, torch.channels_last])
def test_the_weight_gradient_as_matrix_products_is_the_kernels_to_float64_rounding(size, layout):
    """The same sums in another order, on maps that take each way (one forward convolution up to 3 wide, shifted
    products above), in either memory layout: checked in float64, where only rounding separates them."""
    torch.manual_seed(0)
    x = torch.randn(5, 6, *size, dtype=torch.float64).contiguous(memory_format=layout)
    grad_out = torch.randn(5, 4, *size, dtype=torch.float64).contiguous(memory_format=layout)
    expected = conv2d_weight(x, (4, 6, 3, 3), grad_out, padding=1)
    computed = small_map_weight_grad(x, grad_out)
    assert computed.shape == expected.shape
    assert (computed - expected).abs().max() <= 1e-12 * expected.abs().max()


def backward_name(conv: nn.Module, size: int, **autocast) -> str | None:
    """The autograd node of ``conv``'s output for a batch of ``size`` x ``size`` maps, under ``autocast``."""
    with torch.autocast("cpu", **autocast):
        grad_fn = conv(torch.randn(2, conv.in_channels, size, size)).grad_fn
    return grad_fn and type(grad_fn).__name__


def test_conv3x3_takes_matmul_weight_grads_only_in_training_in_bf16_on_maps_up_to_7x7():
    conv = Conv3x3(4, 4)
    conv.matmul_weight_grads = True
    assert backward_name(conv, 7, dtype=torch.bfloat16) == backward_name(conv, 3, dtype=torch.bfloat16)
    assert backward_name(conv, 7, dtype=torch.bfloat16) == "SmallMapConvBackward"
    assert backward_name(conv, 8, dtype=torch.bfloat16) == "ConvolutionBackward0"
    assert backward_name(conv, 7, dtype=torch.float16) == "ConvolutionBackward0"
    assert backward_name(conv, 7, enabled=False) == "ConvolutionBackward0"
    with torch.no_grad():
        assert backward_name(conv, 7, dtype=torch.bfloat16) is None
    conv.matmul_weight_grads = False
    assert backward_name(conv, 7, dtype=torch.bfloat16) == "ConvolutionBackward0"


@pytest.mark.parametrize(("way", "matmul"), [("kernel", False), ("matmul", True), ("auto", "amx_bf16" in cpu_flags())])
def test_fast_net_sets_every_conv3x3_as_conv_weight_grads_says(way, matmul):
    model = build_model("fast_net", num_classes=10)
    model.set_conv_weight_grads(way)
    convs = [m for m in model.modules() if isinstance(m, Conv3x3)]
    assert len(convs) == 6 and all(conv.matmul_weight_grads == matmul for conv in convs)


@pytest.mark.parametrize("size", [3, 7])
def test_under_bf16_autocast_matmul_weight_grads_change_only_the_weight_gradients_order_of_sums(size):
    """The output and the input gradient come from the same kernels as without; the weight gradient is the same
    bf16 sums as the kernel's, each within bf16 rounding of the exact sum of the bf16 inputs' products."""
    torch.manual_seed(0)
    x = torch.randn(8, 16, size, size).contiguous(memory_format=torch.channels_last)
    grad_out = torch.randn(8, 32, size, size).to(torch.bfloat16)
    exact = conv2d_weight(x.to(torch.bfloat16).double(), (32, 16, 3, 3), grad_out.double(), padding=1)
    conv, runs = Conv3x3(16, 32), []
    for matmul in (False, True):
        conv.matmul_weight_grads, conv.weight.grad = matmul, None
        inputs = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = conv(inputs)
        out.backward(grad_out)
        runs.append((out, inputs.grad, conv.weight.grad))
    (out, grad_x, grad_w), (matmul_out, matmul_grad_x, matmul_grad_w) = runs
    assert torch.equal(matmul_out, out) and torch.equal(matmul_grad_x, grad_x)
    assert matmul_grad_w.dtype == grad_w.dtype == torch.float32
    for computed in (grad_w, matmul_grad_w):
        assert (computed.double() - exact).norm() <= 1e-2 * exact.norm()


def test_the_step_schedule_is_a_pure_function_of_the_step():
    triangle = StepSchedule("linear", total_steps=100, warmup_steps=23, start_factor=0.2, end_factor=0.07)
    assert [triangle(s) for s in (0, 23, 100, 150)] == pytest.approx([0.2, 1.0, 0.07, 0.07])
    assert triangle(10) == pytest.approx(0.2 + 0.8 * 10 / 23)
    assert triangle(60) == pytest.approx(1 - 0.93 * 37 / 77)
    cosine = StepSchedule("cosine_steps", total_steps=10, warmup_steps=0, start_factor=0.0, end_factor=0.0)
    assert [cosine(s) for s in (0, 5, 10)] == pytest.approx([1.0, 0.5, 0.0])


def per_step_args(dataset, out, *extra):
    """Three epochs of 9 batches, accumulated in pairs: 5 optimizer steps an epoch (the last one of a single
    batch, at the loader's end), a linear schedule over 15 steps with a warm-up of 3."""
    return tiny_args(dataset, out, "--num_train_epochs", "3", "--gradient_accumulation_steps", "2",
                     "--lr_scheduler_type", "linear", "--warmup_ratio", "0.2", "--lr_start_factor", "0.1",
                     "--lr_end_factor", "0.05", "--logging_steps", "1", "--checkpointing_steps", "2",
                     "--checkpoints_total_limit", "100", "--max_eval_samples", "40", *extra)  # fmt: skip


def test_a_per_step_schedule_steps_once_per_optimizer_step_and_resumes_exactly(tiny_dataset, train_here, tmp_path):
    straight = tmp_path / "straight"
    proc = train_here(per_step_args(tiny_dataset, straight))
    assert proc.returncode == 0, proc.stderr
    events = EventAccumulator(str(straight / "logs" / "cifar_accel"))
    events.Reload()
    logged = events.Scalars("step/learning_rate")
    assert [e.step for e in logged] == list(range(1, 16))  # 15 optimizer steps from 27 batches
    schedule = StepSchedule("linear", total_steps=15, warmup_steps=3, start_factor=0.1, end_factor=0.05)
    # Each step trains with the rate of the steps before it, then the schedule steps once.
    assert [e.value for e in logged] == pytest.approx([1e-3 * schedule(step - 1) for step in range(1, 16)], rel=1e-6)
    history = read_results(straight)["history"]
    assert [r["learning_rate"] for r in history] == pytest.approx([1e-3 * schedule(s) for s in (0, 5, 10)])
    state = json.loads((straight / "checkpoints" / "step_00000015" / "trainer_state.json").read_text())
    assert state["global_step"] == 15

    resumed = crashed_copy(straight, tmp_path / "resumed", last_step=12)  # 2 optimizer steps into epoch 3
    proc = train_here([*per_step_args(tiny_dataset, resumed), "--resume_from_checkpoint", "latest"])
    assert proc.returncode == 0, proc.stderr
    assert "2 epochs and 4 batches done" in proc.stdout
    assert_same_run(straight, resumed)

    proc = train_here([*per_step_args(tiny_dataset, resumed), "--num_train_epochs", "4", "--resume", "latest"])
    assert proc.returncode == 2
    assert "follows a 'linear' schedule over 15 optimizer steps, and this run would take 20" in proc.stderr
