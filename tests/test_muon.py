"""--optimizer muon: the Newton-Schulz orthogonalisation, the step of each kind of group, and which parameters
each kind gets."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cifar_accel.config import TrainConfig, config_path, read_config_file
from cifar_accel.engine import training_step
from cifar_accel.models import build_model
from cifar_accel.optim import MuonSGD, build_optimizer, build_scheduler, freeze_decayed_whitening_bias, newton_schulz

from conftest import fp16_accelerator, reset_accelerate_state


@pytest.mark.parametrize("shape", [(64, 576), (576, 64), (256, 256)])
def test_newton_schulz_keeps_the_singular_vectors_and_brings_the_singular_values_near_one(shape):
    torch.manual_seed(0)
    rank = min(shape)
    left, right = torch.linalg.qr(torch.randn(shape[0], rank))[0], torch.linalg.qr(torch.randn(shape[1], rank))[0]
    singular_values = torch.logspace(0, -1, rank)  # a condition number of 10
    matrix = left @ torch.diag(singular_values) @ right.T
    in_svd_basis = left.T @ newton_schulz(matrix) @ right
    diagonal = in_svd_basis.diagonal()
    assert (in_svd_basis - torch.diag(diagonal)).abs().max() < 1e-4  # U S' V^T: the same singular vectors
    # The quintic's band: every singular value lands in about 0.7-1.2, however small it was.
    assert diagonal.min() > 0.6 and diagonal.max() < 1.25


def test_newton_schulz_agrees_with_torch_muon_on_a_matrix():
    """torch.optim.Muon (2-D parameters only, its iteration in bfloat16) takes the same step on a matrix with
    momentum 0 and no learning-rate adjustment, up to bfloat16 rounding."""
    torch.manual_seed(1)
    weight = nn.Parameter(torch.zeros(32, 96))
    weight.grad = torch.randn(32, 96)
    torch.optim.Muon([weight], lr=1.0, weight_decay=0.0, momentum=0.0, nesterov=False).step()
    ours = newton_schulz(weight.grad)
    assert (-weight.detach() - ours).abs().max() < 0.03
    assert (-weight.detach() - ours).abs().max() < 0.1 * ours.abs().max()


@pytest.mark.parametrize("shape", [(64, 216), (256, 2304)])
def test_three_bfloat16_newton_schulz_steps_stay_within_bfloat16_rounding_of_the_exact_iteration(shape):
    """airbench94_muon's iteration (3 steps in bfloat16) against the same 3 steps in float64: bfloat16 keeps 8
    bits, so each product is within about 0.4% and the result within a few percent; its singular values are in
    the same band as the exact iteration's."""
    torch.manual_seed(0)
    matrix = torch.randn(*shape, dtype=torch.float64)
    fast, exact = newton_schulz(matrix, 3, torch.bfloat16), newton_schulz(matrix, 3, torch.float64)
    assert fast.dtype == torch.bfloat16
    assert (fast.double() - exact).norm() / exact.norm() < 0.05
    singular_values, exact_values = torch.linalg.svdvals(fast.double()), torch.linalg.svdvals(exact)
    assert (singular_values - exact_values).abs().max() < 0.05
    assert singular_values.min() > 0.6 and singular_values.max() < 1.25


def test_the_muon_group_takes_its_newton_schulz_steps_and_dtype_from_the_config():
    torch.manual_seed(4)
    model = build_model("fast_net", num_classes=10)
    config = TrainConfig(optimizer="muon", momentum=0.85, nesterov=True, muon_ns_steps=3, muon_ns_dtype="bfloat16")
    optimizer = build_optimizer(config, model, learning_rate=1.0)
    muon = optimizer.param_groups[-1]
    assert (muon["ns_steps"], muon["ns_dtype"]) == (3, "bfloat16")
    bank = muon["params"][0]
    bank.grad = torch.randn_like(bank)
    before, grad = bank.detach().clone(), bank.grad.clone()
    optimizer.step()
    renormalised = before * (len(before) ** 0.5 / before.norm())
    orthogonalised = newton_schulz((grad + 0.6 * grad).reshape(len(bank), -1), 3, torch.bfloat16)  # Nesterov
    assert torch.allclose(bank.detach(), renormalised - 0.24 * orthogonalised.float().view_as(bank), atol=1e-6)
    # 5 float32 steps take another step: the config chose this one
    assert not torch.allclose(orthogonalised.float(), newton_schulz(grad.reshape(len(bank), -1) * 1.6), atol=1e-3)


def test_the_whitening_bias_learns_for_its_epochs_with_a_decay_of_its_own_then_stays():
    """--whiten_bias_epochs 3 with 10 steps an epoch: the whitening bias's rate falls linearly from 64x the
    base rate to 0 at step 30 while the others follow the run's linear decay over 8 epochs; after step 30 real
    training steps leave the bias as it is and change the BatchNorm biases; the schedule survives a state-dict
    round trip, as in a checkpoint."""
    torch.manual_seed(5)
    model = build_model("fast_net", num_classes=10)
    config = TrainConfig(model_name="fast_net", optimizer="muon", momentum=0.85, nesterov=True, num_train_epochs=8,
                         lr_scheduler_type="linear", lr_start_factor=1.0, whiten_bias_epochs=3)  # fmt: skip
    optimizer = build_optimizer(config, model, learning_rate=1.0)
    scheduler = build_scheduler(config, optimizer, steps_per_epoch=10)
    plain, norm_biases, whitening, _ = optimizer.param_groups
    loss_fn = torch.nn.CrossEntropyLoss()
    images, labels = torch.randn(16, 3, 32, 32), torch.randint(0, 10, (16,))

    def step() -> None:
        loss_fn(model(images), labels).backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()

    for _ in range(15):
        step()
    assert whitening["lr"] == pytest.approx(64 * 0.5) and norm_biases["lr"] == pytest.approx(64 * (1 - 15 / 80))
    assert plain["lr"] == pytest.approx(1 - 15 / 80)
    saved = copy.deepcopy(scheduler.state_dict())
    for _ in range(15):
        step()
    assert whitening["lr"] == 0.0 and norm_biases["lr"] == pytest.approx(64 * (1 - 30 / 80))
    bias, norm_bias = model.whiten.bias.detach().clone(), norm_biases["params"][0].detach().clone()
    for _ in range(3):
        step()
    assert torch.equal(model.whiten.bias, bias) and not torch.equal(norm_biases["params"][0], norm_bias)

    resumed = build_scheduler(config, build_optimizer(config, build_model("fast_net", 10), 1.0), steps_per_epoch=10)
    resumed.load_state_dict(saved)
    assert [schedule.total_steps for schedule in resumed.lr_lambdas] == [80, 80, 30, 80]


def test_the_whitening_bias_stops_taking_gradients_once_its_rate_is_0_and_the_weights_stay_the_same():
    """Two copies of fast_net trained alike, 4 steps an epoch, --whiten_bias_epochs 2; one is frozen where the loop
    does it, at each epoch's start. The bias keeps its gradient while it learns (at epoch 2's start its rate is
    still 64 x 0.5) and loses it from epoch 3 on, when its rate is 0; every weight of the two copies is the same,
    bit for bit, after 4 epochs."""
    config = TrainConfig(model_name="fast_net", optimizer="muon", momentum=0.85, nesterov=True, num_train_epochs=4,
                         lr_scheduler_type="linear", lr_start_factor=1.0, whiten_bias_epochs=2,
                         weight_decay=5e-3)  # fmt: skip
    torch.manual_seed(5)
    batches = [(torch.randn(16, 3, 32, 32), torch.randint(0, 10, (16,))) for _ in range(4)]
    twins = []
    for freeze in (False, True):
        torch.manual_seed(6)
        model = build_model("fast_net", num_classes=10)
        optimizer = build_optimizer(config, model, learning_rate=0.1)
        scheduler = build_scheduler(config, optimizer, steps_per_epoch=4)
        trained_bias = []
        for _ in range(4):
            if freeze:
                freeze_decayed_whitening_bias(optimizer)
            trained_bias.append(model.whiten.bias.requires_grad)
            for images, labels in batches:
                F.cross_entropy(model(images), labels).backward()
                optimizer.step()
                optimizer.zero_grad()
                scheduler.step()
        twins.append((model, trained_bias))
    (plain, plain_trained), (frozen, frozen_trained) = twins
    assert plain_trained == [True] * 4 and frozen_trained == [True, True, False, False]
    for (name, ours), theirs in zip(frozen.state_dict().items(), plain.state_dict().values(), strict=True):
        assert torch.equal(ours, theirs), name
    assert frozen.whiten.bias.grad is None and not torch.equal(frozen.whiten.bias, torch.zeros(24))


def test_the_sgd_groups_step_exactly_as_torch_sgd_and_the_muon_group_as_its_formula():
    torch.manual_seed(2)
    plain, filters = torch.randn(10, 256), torch.randn(8, 4, 3, 3)
    ours = [nn.Parameter(plain.clone()), nn.Parameter(filters.clone())]
    reference = nn.Parameter(plain.clone())
    optimizer = MuonSGD([{"params": [ours[0]]}, {"params": [ours[1]], "lr": 0.24, "momentum": 0.6, "weight_decay": 0.0,
                         "muon": True}], lr=0.1, momentum=0.85, nesterov=True, weight_decay=5e-3)  # fmt: skip
    sgd = torch.optim.SGD([reference], lr=0.1, momentum=0.85, nesterov=True, weight_decay=5e-3, foreach=False)
    by_hand, buffer = filters.clone(), torch.zeros_like(filters)
    for _ in range(3):
        grads = torch.randn(10, 256), torch.randn(8, 4, 3, 3)
        ours[0].grad, reference.grad, ours[1].grad = grads[0], grads[0].clone(), grads[1]
        optimizer.step()
        sgd.step()
        buffer = 0.6 * buffer + grads[1]
        by_hand = by_hand * (8**0.5 / by_hand.norm())
        by_hand = by_hand - 0.24 * newton_schulz((grads[1] + 0.6 * buffer).reshape(8, -1)).view(8, 4, 3, 3)
        assert torch.equal(ours[0], reference)
        assert torch.allclose(ours[1], by_hand, atol=1e-6)
    assert torch.equal(optimizer.state[ours[0]]["momentum_buffer"], sgd.state[reference]["momentum_buffer"])
    # The filter bank's norm is back near sqrt(8) after each step: the orthogonalised step is small against it.
    assert ours[1].norm().item() == pytest.approx(8**0.5, rel=0.1)


@pytest.mark.parametrize("name", ["fast_net", "resnet18"])
def test_muon_gets_every_trained_filter_bank_and_sgd_the_rest_with_the_models_scales(name):
    model = build_model(name, num_classes=10)
    config = TrainConfig(optimizer="muon", momentum=0.85, nesterov=True, weight_decay=2e-3, muon_learning_rate=0.3,
                         muon_momentum=0.5, lr_scheduler_type="linear", lr_start_factor=1.0)  # fmt: skip
    optimizer = build_optimizer(config, model, learning_rate=1.5)
    *sgd_groups, muon = optimizer.param_groups
    trained = [p for p in model.parameters() if p.requires_grad]
    assert {id(p) for p in muon["params"]} == {id(p) for p in trained if p.ndim == 4}
    assert {id(p) for g in sgd_groups for p in g["params"]} == {id(p) for p in trained if p.ndim != 4}
    assert (muon["muon"], muon["lr"], muon["momentum"], muon["weight_decay"]) == (True, 0.3, 0.5, 0.0)
    assert not any(g["muon"] for g in sgd_groups) and all(g["momentum"] == 0.85 for g in sgd_groups)
    assert sgd_groups[0]["lr"] == 1.5 and sgd_groups[0]["weight_decay"] == 2e-3  # the plain group first, logged
    if name == "fast_net":  # the classifier, then BatchNorm's biases and the whitening bias at 64x the rate
        assert [len(g["params"]) for g in sgd_groups] == [1, 6, 1] and sgd_groups[1]["lr"] == 1.5 * 64
        assert sgd_groups[2]["params"][0] is model.whiten.bias and sgd_groups[2]["lr"] == 1.5 * 64
        assert [g["whitening_bias"] for g in sgd_groups] == [False, False, True]
        assert not model.whiten.weight.requires_grad and all(id(p) != id(model.whiten.weight) for p in muon["params"])
    scheduler = build_scheduler(config, optimizer, steps_per_epoch=10)  # linear 1 -> 0 over 30 epochs x 10 steps
    for _ in range(150):
        optimizer.step()
        scheduler.step()
    assert muon["lr"] == pytest.approx(0.15) and sgd_groups[0]["lr"] == pytest.approx(0.75)


# Newton-Schulz as 5 float32 steps, and as the fast preset's 3 bfloat16 steps: there the by-hand unscaling, whose
# last bits differ from the scaler's, can round an update entry (below 0.25 in size, times the rate 0.24) to the
# next bfloat16 value, 2**-8 of it away.
def check_scaled_step(accelerator, optimizer, before, model, reference, init_scale, atol) -> None:
    """At an init scale of 2**40 the fp16 gradients overflowed: the step was skipped, the weights and the momentum
    left alone. Otherwise it was taken, and the weights equal the reference's, stepped on unscaled gradients."""
    skipped = accelerator.optimizer_step_was_skipped
    reset_accelerate_state()
    if init_scale == 2.0**40:
        assert skipped and not optimizer.state
        assert all(torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))
        return
    assert not skipped and optimizer.state
    for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=atol)


@pytest.mark.parametrize(("ns_steps", "ns_dtype", "atol"), [(5, "float32", 1e-6), (3, "bfloat16", 2.5e-4)])
@pytest.mark.parametrize("init_scale", [2.0**14, 2.0**40])
def test_under_fp16_muon_steps_on_the_unscaled_gradients_and_a_skipped_step_leaves_it_alone(
    init_scale, ns_steps, ns_dtype, atol
):
    """With a real GradScaler: at 2**14 the step equals the step on the gradients of the same fp16 forward and loss
    scaled and unscaled by hand (so the optimizer saw unscaled gradients); at 2**40 the scaled fp16 gradients
    overflow, so the step is skipped and neither the weights nor the momentum change."""
    torch.manual_seed(3)
    config = TrainConfig(optimizer="muon", momentum=0.85, nesterov=True, weight_decay=1e-3, muon_ns_steps=ns_steps,
                         muon_ns_dtype=ns_dtype)  # fmt: skip
    model = build_model("simple_cnn", num_classes=10)
    reference = copy.deepcopy(model)
    images, labels = torch.randn(16, 3, 32, 32), torch.randint(0, 10, (16,))
    with torch.autocast("cpu", dtype=torch.float16):
        (F.cross_entropy(reference(images), labels) * 2.0**14).backward()
    for p in reference.parameters():
        p.grad /= 2.0**14  # the scaler's own arithmetic, by hand
    reference_optimizer = build_optimizer(config, reference, learning_rate=0.05)
    reference_optimizer.step()

    accelerator = fp16_accelerator("cpu", init_scale=init_scale)
    before = [p.detach().clone() for p in model.parameters()]
    model, optimizer = accelerator.prepare(model, build_optimizer(config, model, learning_rate=0.05))
    training_step(accelerator, model, optimizer, F.cross_entropy, images, labels)
    check_scaled_step(accelerator, optimizer, before, model, reference, init_scale, atol)
    if init_scale != 2.0**40:
        assert len(optimizer.state) == len(list(model.parameters()))


@pytest.mark.parametrize("init_scale", [2.0**14, 2.0**40])
def test_under_fp16_the_fast_presets_accumulated_batches_make_one_step_on_their_unscaled_gradients(init_scale):
    """The fast preset's step: 8 accumulated batches (BatchNorm's statistics each batch's own) under a real
    GradScaler. Nothing moves before the 8th batch; then at 2**14 the one step equals the step on the eight
    batches' gradients (each loss divided by 8, as Accelerate does) scaled and unscaled by hand; at 2**40 the scaled
    fp16 gradients overflow and the step is skipped, leaving the weights and the momentum alone."""
    torch.manual_seed(4)
    config = TrainConfig(**read_config_file(config_path("fast")))
    assert (config.per_device_train_batch_size, config.gradient_accumulation_steps) == (250, 8)
    steps = config.gradient_accumulation_steps
    model = build_model("fast_net", num_classes=10)
    reference = copy.deepcopy(model)
    images, labels = torch.randn(2 * steps, 3, 32, 32), torch.randint(0, 10, (2 * steps,))
    batches = list(zip(images.split(2), labels.split(2), strict=True))
    for batch_images, batch_labels in batches:
        with torch.autocast("cpu", dtype=torch.float16):
            (F.cross_entropy(reference(batch_images), batch_labels) / steps * 2.0**14).backward()
    for p in reference.parameters():
        if p.grad is not None:
            p.grad /= 2.0**14
    reference_optimizer = build_optimizer(config, reference, learning_rate=0.05)
    reference_optimizer.step()

    accelerator = fp16_accelerator("cpu", init_scale=init_scale)
    accelerator.gradient_accumulation_steps = steps
    before = [p.detach().clone() for p in model.parameters()]
    model, optimizer = accelerator.prepare(model, build_optimizer(config, model, learning_rate=0.05))
    for i, (batch_images, batch_labels) in enumerate(batches):
        if i == steps - 1:  # all but the last batch in: gradients accumulated, nothing stepped
            assert not optimizer.state
            assert all(torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))
        with accelerator.accumulate(model):
            training_step(accelerator, model, optimizer, F.cross_entropy, batch_images, batch_labels)
    check_scaled_step(accelerator, optimizer, before, model, reference, init_scale, atol=1e-6)
    if init_scale != 2.0**40:
        assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))


@pytest.mark.parametrize(("epochs", "steps_per_epoch", "steps"), [(0.19, 33, 6), (0.5, 25, 12), (0.01, 10, 1)])
def test_a_fraction_of_an_epoch_trains_the_whitening_bias_for_whole_steps_at_its_own_rate(
    epochs: float, steps_per_epoch: int, steps: int
) -> None:
    """--whiten_bias_epochs 0.19 with 33 steps an epoch (hiverge's length, in this loop's steps of 1536 images)
    decays the whitening bias's rate over round(6.27) = 6 steps; a length under one step still takes one. Its
    rate starts at --bias_lr_scale times the base rate, as the BatchNorm biases' does."""
    config = TrainConfig(model_name="fast_net", optimizer="muon", num_train_epochs=8, lr_scheduler_type="linear",
                         lr_start_factor=1.0, whiten_bias_epochs=epochs, bias_lr_scale=85.6)  # fmt: skip
    optimizer = build_optimizer(config, build_model("fast_net", num_classes=10), learning_rate=1.0)
    scheduler = build_scheduler(config, optimizer, steps_per_epoch=steps_per_epoch)
    assert [schedule.total_steps for schedule in scheduler.lr_lambdas] == [8 * steps_per_epoch] * 2 + [steps] + [
        8 * steps_per_epoch
    ]
    plain, norm_biases, whitening, _ = optimizer.param_groups
    assert (plain["lr"], norm_biases["lr"], whitening["lr"]) == (1.0, 85.6, 85.6)
    for _ in range(steps - 1):
        optimizer.step()
        scheduler.step()
    assert whitening["lr"] == pytest.approx(85.6 / steps)
    optimizer.step()
    scheduler.step()
    assert whitening["lr"] == 0.0
