"""The fast recipes' parts: the augmentation choices, MixUp/CutMix, training on all the data, the presets."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import yaml
from accelerate import Accelerator
from safetensors.torch import load_file
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from cifar_accel.averaging import EMA_FILE
from cifar_accel.bookkeeping import RunBookkeeper
from cifar_accel.config import PRESETS_DIR, TrainConfig, load_config, read_config_file
from cifar_accel.data import Split, TrainImages
from cifar_accel.errors import InputError
from cifar_accel.run import Run
from cifar_accel.state import TrainerState
from cifar_accel.stopping import StopRequest
from cifar_accel.train import train_epoch
from cifar_accel.transforms import CIFAR10_NORMALIZATION, TrainingTransform, random_crop_and_flip

from conftest import assert_same_run, crashed_copy, read_results, tiny_args


@pytest.fixture
def images() -> torch.Tensor:
    return torch.randint(0, 256, (16, 3, 32, 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))


def test_each_translation_is_a_window_of_the_reflect_padded_image(images):
    torch.manual_seed(0)
    shifted = random_crop_and_flip(images, padding=2, flip=False, padding_mode="reflect")
    padded = F.pad(images.float(), (2, 2, 2, 2), mode="reflect").to(torch.uint8)
    offsets = []
    for img, out in zip(padded, shifted, strict=True):
        windows = {(dy, dx): img[:, dy : dy + 32, dx : dx + 32] for dy in range(5) for dx in range(5)}
        offsets += [offset for offset, window in windows.items() if torch.equal(window, out)]
    assert len(offsets) == len(images)  # every output is exactly one window: shifted, never mirrored
    assert len(set(offsets)) > 5


def test_alternating_flips_mirror_each_image_in_every_other_epoch(images):
    split = Split(images, torch.arange(16))
    dataset = TrainImages(split, alternate_flip=True, seed=3)
    epochs = []
    for epoch in range(3):
        dataset.set_epoch(epoch)
        epochs.append(dataset.__getitems__(list(range(16)))[0])
    mirrored = [torch.equal(first, image.flip(-1)) for first, image in zip(epochs[0], images, strict=True)]
    assert 4 <= sum(mirrored) <= 12  # a random half to start with
    assert torch.equal(epochs[1], epochs[0].flip(-1))  # then every image the other way round
    assert torch.equal(epochs[2], epochs[0])
    again = TrainImages(split, alternate_flip=True, seed=3)  # the flips come from the seed alone
    assert torch.equal(again.__getitems__(list(range(16)))[0], epochs[0])
    assert torch.equal(TrainImages(split).__getitems__([5, 2])[0], images[[5, 2]])


def test_mixed_targets_train_and_accuracy_counts_the_class_labels(images, tmp_path):
    """MixUp/CutMix give each image a mix of two classes as its target; the training accuracy still compares the
    predictions with the class labels. The model here always predicts class 0 and does not learn (lr 0)."""
    config = TrainConfig(mixup_alpha=0.4, cutmix_alpha=1.0, channels_last=False, output_dir=str(tmp_path))
    transform = TrainingTransform(config, 10, CIFAR10_NORMALIZATION)
    labels = torch.randint(0, 10, (16,), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    inputs, targets = transform(images, labels, 0, 1)
    assert inputs.shape == (16, 3, 32, 32) and targets.shape == (16, 10)
    assert torch.allclose(targets.sum(1), torch.ones(16))
    assert ((targets > 0).sum(1) <= 2).all() and (targets.max(1).values < 1).any()

    accelerator = Accelerator(cpu=True)
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 10))
    with torch.no_grad():
        model[1].weight.zero_()
        model[1].bias.copy_(torch.arange(10, 0, -1.0))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    loader = DataLoader(TensorDataset(images, labels), batch_size=8)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    run = Run(
        config=config, accelerator=accelerator, output_dir=tmp_path, data=None, model=model, optimizer=optimizer,
        scheduler=scheduler, loss_fn=F.cross_entropy, train_loader=loader, train_transform=transform, val_loader=None,
        test_loader=None, eval_transform=None, metric=None, precision={}, state=TrainerState(), last_checkpoint=None,
        global_batch_size=8, learning_rate=0.0, num_epochs=1, ema=None,
    )  # fmt: skip
    stats = train_epoch(run, RunBookkeeper(run, StopRequest()), epoch=0)
    assert stats["accuracy"] == pytest.approx((labels == 0).float().mean().item())
    assert stats["images"] == 16


def fast_args(dataset, out, *extra):
    """The fast preset, scaled down to the tiny dataset (steps of 4 accumulated batches of 8, as the preset's are of
    8 batches of 250), with its brightness and contrast jitter, and MixUp, CutMix, an average of the weights and
    windows of 24x24 pixels in the first 2 epochs on top; its whitening bias trains for the first 2 of the 3
    epochs."""
    return tiny_args(dataset, out, "--config", "fast", "--num_train_epochs", "3", "--whiten_bias_epochs", "2",
                     "--early_crop_size", "24", "--early_crop_epochs", "2",
                     "--per_device_train_batch_size", "8", "--gradient_accumulation_steps", "4",
                     "--mixup_alpha", "0.4", "--cutmix_alpha", "1.0", "--ema_decay", "0.95",
                     "--checkpointing_steps", "4", "--checkpoints_total_limit", "100", "--logging_steps", "5",
                     "--max_eval_samples", "40",
                     *extra)  # fmt: skip


def test_a_run_on_all_the_training_data_writes_what_it_promises_and_resumes_bitwise(tiny_dataset, train_here, tmp_path):
    straight = tmp_path / "straight"
    proc = train_here(fast_args(tiny_dataset, straight))
    assert proc.returncode == 0, proc.stderr
    results = read_results(straight)
    assert results["validation"] is False and results["val_samples"] == 0 and results["train_samples"] == 327
    assert (results["best_val_accuracy"], results["best_epoch"]) == (None, None)
    assert results["tested_epoch"] == results["epochs_completed"] == 3 and not results["stopped_early"]
    assert results["tta"] == "flip_translate" and results["test_samples"] == 40
    assert [r["val_accuracy"] for r in results["history"]] == [None] * 3
    assert "the weights of the last epoch, 3; no validation" in proc.stdout
    assert "| val loss" not in proc.stdout
    # The final average of the weights (10 optimizer steps per epoch) is what was tested and exported.
    last = straight / "checkpoints" / "step_00000030"
    average = load_file(last / EMA_FILE)
    exported = load_file(straight / "model.safetensors")
    assert int(average.pop("n_averaged")) == 30
    assert all(torch.equal(exported[name.removeprefix("module.")], t) for name, t in average.items())
    events = EventAccumulator(str(straight / "logs" / "cifar_accel"))
    events.Reload()
    assert "train/accuracy" in events.Tags()["scalars"] and "val/accuracy" not in events.Tags()["scalars"]

    resumed = crashed_copy(straight, tmp_path / "resumed", last_step=24)  # 4 batches into epoch 3
    proc = train_here([*fast_args(tiny_dataset, resumed), "--resume_from_checkpoint", "latest"])
    assert proc.returncode == 0, proc.stderr
    assert "2 epochs and 16 batches done" in proc.stdout
    assert_same_run(straight, resumed)


def test_the_fast_preset_in_bf16_with_matmul_weight_grads_resumes_bitwise_and_trains_other_bits_than_the_kernel(
    tiny_dataset, train_here, tmp_path
):
    def args(out, way):
        return fast_args(tiny_dataset, out, "--mixed_precision", "bf16", "--conv_weight_grads", way)

    runs = {way: tmp_path / way for way in ("matmul", "kernel")}
    for way, out in runs.items():
        proc = train_here(args(out, way))
        assert proc.returncode == 0, proc.stderr
        assert yaml.safe_load((out / "config.yaml").read_text())["conv_weight_grads"] == way
    matmul, kernel = (load_file(out / "model.safetensors") for out in runs.values())
    assert matmul.keys() == kernel.keys() and not all(torch.equal(matmul[k], kernel[k]) for k in matmul)

    resumed = crashed_copy(runs["matmul"], tmp_path / "resumed", last_step=24)  # 4 batches into epoch 3
    proc = train_here([*args(resumed, "matmul"), "--resume_from_checkpoint", "latest"])
    assert proc.returncode == 0, proc.stderr
    assert_same_run(runs["matmul"], resumed)


def test_presets_load_by_name_or_path_and_flags_override_them(tmp_path):
    for preset in ("default", "fast", "resnet18"):
        assert (PRESETS_DIR / f"{preset}.yaml").is_file()
        config, _ = load_config(["--config", preset])
        assert config == TrainConfig(**{**read_config_file(PRESETS_DIR / f"{preset}.yaml"), "mixed_precision": "no"})
    fast, _ = load_config(["--config", "fast", "--seed", "7"])
    assert (fast.model_name, fast.val_ratio, fast.flip, fast.padding_mode, fast.num_train_epochs) == (
        "fast_net",
        0.0,
        "alternate",
        "reflect",
        9,
    )
    assert (fast.muon_ns_steps, fast.muon_ns_dtype, fast.whiten_bias_epochs) == (3, "float32", 3)
    assert (fast.per_device_train_batch_size, fast.gradient_accumulation_steps, fast.per_device_eval_batch_size) == (
        250,
        8,
        250,
    )
    assert (fast.brightness_shift, fast.contrast_scale, fast.color_jitter) == (0.14, 0.13, False)
    assert (fast.tta, fast.tta_below_confidence) == ("flip_translate", 0.7)
    assert (fast.early_crop_size, fast.early_crop_epochs) == (28, 5)
    assert fast.seed == 7
    assert load_config(["--config", "resnet18"])[0].model_name == "resnet18"
    copy = tmp_path / "mine.yaml"
    copy.write_text(yaml.safe_dump({**yaml.safe_load((PRESETS_DIR / "fast.yaml").read_text()), "seed": 3}))
    assert load_config(["--config", str(copy)])[0] == TrainConfig(**{**fast.__dict__, "seed": 3})
    with pytest.raises(InputError, match=r"--config 'fastest' is neither a preset \(default, fast, resnet18\) nor a"):
        load_config(["--config", "fastest"])
