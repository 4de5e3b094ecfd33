"""Mixed precision made visible: the dtype report, clipping after unscaling, step telemetry and gradient
accumulation. (Skipped steps and the non-finite guards: test_bookkeeping.py.)"""

from __future__ import annotations

import copy
import json
import types

import pytest
import torch
import torch.nn.functional as F
from accelerate import Accelerator
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn
from torch.nn.utils import get_total_norm
from torch.utils.data import DataLoader, TensorDataset

from cifar_accel import evaluate, load_model, predict
from cifar_accel.checkpoint import complete_checkpoints
from cifar_accel.config import TrainConfig
from cifar_accel.engine import training_step
from cifar_accel.errors import InputError, run_cli
from cifar_accel.images import image_to_rgb32
from cifar_accel.inference import inference_precision
from cifar_accel.models import build_model
from cifar_accel.precision import hardware_advice, precision_report
from cifar_accel.telemetry import cpu_name

from conftest import fp16_accelerator, read_results, reset_accelerate_state, tiny_args

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


def batch(size: int = 16, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(size, 3, 32, 32, generator=generator), torch.randint(0, 10, (size,), generator=generator)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_clipping_measures_and_clips_unscaled_gradients(device):
    """With a loss scale of 2**14 in play, the norm our step reports is the norm of the true gradients (the same
    batch through the same fp16 autocast, without a scaler), and the SGD(lr=1) update has exactly the clipped
    norm. Had clipping seen the scaled gradients, the norm would be 16384 times larger and the update tiny."""
    torch.manual_seed(0)
    model = build_model("simple_cnn", num_classes=10)
    reference = copy.deepcopy(model)
    accelerator = fp16_accelerator(device, init_scale=2.0**14)
    images, labels = (t.to(accelerator.device) for t in batch())
    with torch.autocast(accelerator.device.type, dtype=torch.float16):
        F.cross_entropy(reference.to(accelerator.device)(images), labels).backward()
    true_norm = get_total_norm([p.grad for p in reference.parameters()]).item()

    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    model, optimizer = accelerator.prepare(model, optimizer)
    before = [p.detach().clone() for p in model.parameters()]
    _, _, grad_norm = training_step(
        accelerator, model, optimizer, F.cross_entropy, images, labels, max_grad_norm=true_norm / 2
    )
    assert not accelerator.optimizer_step_was_skipped and accelerator.scaler.get_scale() == 2.0**14
    assert grad_norm.item() == pytest.approx(true_norm, rel=1e-3)
    update = get_total_norm([b - p.detach() for b, p in zip(before, model.parameters(), strict=True)]).item()
    assert update == pytest.approx(true_norm / 2, rel=1e-3)


@pytest.mark.parametrize(
    ("precision", "autocast", "conv_dtype", "scaler"),
    [("no", None, "float32", False), ("bf16", "bfloat16", "bfloat16", False), ("fp16", "float16", "float16", True)],
)
def test_the_report_shows_the_dtypes_one_batch_really_has(precision, autocast, conv_dtype, scaler):
    if precision == "fp16":
        accelerator = fp16_accelerator("cpu", init_scale=4096.0)
    else:
        accelerator = Accelerator(mixed_precision=precision, cpu=True)
    model = accelerator.prepare(build_model("simple_cnn", num_classes=10))
    weights = copy.deepcopy(model.state_dict())
    report = precision_report(accelerator, model, F.cross_entropy, *batch(), precision, "test")
    assert report["effective"] == precision and report["autocast_dtype"] == autocast
    assert report["grad_scaler"] == scaler and report["initial_loss_scale"] == (4096.0 if scaler else None)
    # Accelerate hands the model's outputs back in fp32, so logits and loss are float32 in every mode.
    assert report["dtypes"] == {
        "conv_output": conv_dtype, "logits": "float32", "loss": "float32", "weights": "float32",
        "gradients": "float32",
    }  # fmt: skip
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())  # the probe used a copy


def test_fp16_requested_on_a_cpu_is_reported_as_fp32():
    accelerator = Accelerator(mixed_precision="fp16", cpu=True)
    model = accelerator.prepare(build_model("simple_cnn", num_classes=10))
    report = precision_report(accelerator, model, F.cross_entropy, *batch(), "fp16", "test")
    assert (report["requested"], report["effective"], report["autocast_dtype"]) == ("fp16", "no", None)
    assert report["dtypes"]["conv_output"] == "float32" and not report["grad_scaler"]


def train_with_accumulation(accumulation_steps: int, batch_size: int) -> tuple[list[torch.Tensor], int, int]:
    """Two optimizer steps over 128 images on a BatchNorm-free model, SGD with momentum and a learning rate halved
    at every scheduler step; returns the weights, the optimizer steps taken and the scheduler steps taken."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(32, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5**step)
    loader = DataLoader(TensorDataset(*batch(size=128, seed=1)), batch_size=batch_size)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=accumulation_steps)
    model, optimizer, scheduler, loader = accelerator.prepare(model, optimizer, scheduler, loader)
    optimizer_steps = 0
    for images, labels in loader:
        with accelerator.accumulate(model):
            _, _, grad_norm = training_step(accelerator, model, optimizer, F.cross_entropy, images, labels)
            scheduler.step()
        optimizer_steps += grad_norm is not None  # the norm is measured (and clipping done) on update steps only
    weights = [p.detach().clone() for p in model.parameters()]
    reset_accelerate_state()
    return weights, optimizer_steps, scheduler.scheduler.last_epoch


def test_two_accumulated_batches_of_32_match_one_batch_of_64():
    accumulated, steps_a, schedule_a = train_with_accumulation(accumulation_steps=2, batch_size=32)
    single, steps_b, schedule_b = train_with_accumulation(accumulation_steps=1, batch_size=64)
    assert steps_a == steps_b == 2
    assert schedule_a == schedule_b == 2  # the scheduler stepped once per optimizer step, not per batch
    for a, b in zip(accumulated, single, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_accumulation_run_logs_telemetry_on_optimizer_steps_and_scales_lr(tiny_dataset, train_here, tmp_path):
    out = tmp_path / "run"
    args = tiny_args(
        tiny_dataset, out, "--num_train_epochs", "2", "--gradient_accumulation_steps", "2", "--scale_lr",
        "--lr_step_size", "1", "--lr_gamma", "0.5", "--logging_steps", "1", "--max_grad_norm", "1.0",
    )  # fmt: skip
    proc = train_here(args)
    assert proc.returncode == 0, proc.stderr
    assert "32 per process x 1 process x 2 accumulation steps = 64 global; learning rate 0.002 = 0.001 x 2" in (
        proc.stdout
    )
    assert "dtypes of one batch: conv_output float32, logits float32, loss float32" in proc.stdout
    results = read_results(out)
    assert (results["global_batch_size"], results["learning_rate"]) == (64, 0.002)
    assert [r["learning_rate"] for r in results["history"]] == [0.002, 0.001]  # the schedule is per epoch
    assert results["precision_report"]["effective"] == "no" and results["skipped_steps"] == 0
    assert results["peak_memory_mib"] > 50

    events = EventAccumulator(str(out / "logs" / "cifar_accel"))
    events.Reload()
    norms = events.Scalars("step/grad_norm")
    assert [e.step for e in norms] == list(range(1, 11))  # 9 batches an epoch make 5 optimizer steps
    assert all(e.value > 0 for e in norms)
    assert [e.value for e in events.Scalars("step/learning_rate")] == pytest.approx([0.002] * 5 + [0.001] * 5)
    assert "step/loss_scale" not in events.Tags()["scalars"]  # no GradScaler without fp16
    assert complete_checkpoints(out)[-1].name == "step_00000010"


def test_evaluate_and_predict_run_in_the_runs_precision_unless_told(tiny_dataset, train_here, tmp_path, capsys):
    """evaluate and predict ran in fp32 unless --mixed_precision said otherwise, so a bf16 run's test accuracy was
    not what `evaluate --model RUN` gave (0.7831 against 0.7952 on a tiny run), though the docs promise it: now
    they run in the run's precision, and a flag still chooses another."""
    out = tmp_path / "run"
    assert train_here(tiny_args(tiny_dataset, out, "--mixed_precision", "bf16")).returncode == 0
    reset_accelerate_state()
    assert run_cli(evaluate.main, ["--model", str(out), "--output_dir", str(tmp_path / "eval")]) == 0
    metrics = json.loads((tmp_path / "eval" / "metrics.json").read_text())
    assert metrics["mixed_precision"] == "bf16"
    assert metrics["accuracy"] == read_results(out)["test_accuracy_no_tta"]
    reset_accelerate_state()
    assert run_cli(evaluate.main, ["--model", str(out), "--output_dir", str(tmp_path / "fp32"), "--mixed_precision",
                                   "no"]) == 0  # fmt: skip
    assert json.loads((tmp_path / "fp32" / "metrics.json").read_text())["mixed_precision"] == "no"

    image = tmp_path / "cat.png"
    Image.new("RGB", (32, 32), (200, 30, 30)).save(image)
    trained = load_model(out)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = trained.predict(torch.tensor(image_to_rgb32(Image.open(image))[0])[None], top_k=3)[0]
    capsys.readouterr()
    reset_accelerate_state()
    assert run_cli(predict.main, ["--model", str(out), str(image)]) == 0
    shown = "  ".join(f"{name} {probability:.3f}" for name, probability in expected)
    assert capsys.readouterr().out == f"{image}: {shown}\n"


@pytest.mark.parametrize(
    ("flag", "launcher", "expected"),
    [(None, None, ("fp16", False)), ("no", None, ("no", True)), (None, "bf16", ("bf16", True)),
     (None, "no", ("fp16", False)), ("bf16", "no", ("bf16", True))],
)  # fmt: skip
def test_inference_takes_the_flag_then_the_launcher_then_the_runs_precision(flag, launcher, expected, monkeypatch):
    """Only a precision asked for (by the flag or the launcher) is worth a warning where the device has none: a GPU
    run's fp16, evaluated on a CPU, runs in fp32 as a run there would."""
    if launcher is None:
        monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    else:
        monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", launcher)
    trained = types.SimpleNamespace(config=TrainConfig(mixed_precision="fp16"))
    assert inference_precision(flag, trained) == expected


def test_the_hardware_advice_warns_of_emulated_bf16_and_points_native_bf16_out():
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    emulated = hardware_advice("bf16", cpu, has_native_bf16=False)
    assert emulated["level"] == "WARNING"
    assert "several times slower than in fp32; use --mixed_precision no" in emulated["message"]
    native = hardware_advice("no", cpu, has_native_bf16=True)
    assert native["level"] == "INFO" and "--mixed_precision bf16 would train faster" in native["message"]
    assert hardware_advice("bf16", cpu, has_native_bf16=True) is None
    assert hardware_advice("no", cpu, has_native_bf16=False) is None
    assert hardware_advice("bf16", gpu, has_native_bf16=False) is None


ZEN4 = (
    "processor\t: {n}\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 17\nmodel name\t: AMD EPYC\n"
    "flags\t\t: avx2\n"
)
ZEN5 = ZEN4.replace("cpu family\t: 25", "cpu family\t: 26").replace("model\t\t: 17", "model\t\t: 2")


def test_the_cpu_is_named_with_its_x86_family_and_model():
    """Two machines whose model name is the same bare "AMD EPYC" are told apart; /proc/cpuinfo without them (an Arm
    machine) gives its name alone, or "?"."""
    zen4 = "\n".join(ZEN4.format(n=n) for n in range(2))
    assert cpu_name(zen4) == "AMD EPYC (family 25 model 17)"
    assert cpu_name("\n".join(ZEN5.format(n=n) for n in range(2))) == "AMD EPYC (family 26 model 2)"
    intel = "processor\t: 0\ncpu family\t: 6\nmodel\t\t: 143\nmodel name\t: Intel(R) Xeon(R) Platinum 8488C\n"
    assert cpu_name(intel) == "Intel(R) Xeon(R) Platinum 8488C (family 6 model 143)"
    assert cpu_name("processor\t: 0\nBogoMIPS\t: 50.00\nCPU implementer\t: 0x41\n") == "?"


@pytest.mark.parametrize(
    ("variable", "value", "line"),
    [("ACCELERATE_MIXED_PRECISION", "fp8", "accelerate launch asked for mixed precision 'fp8'; use no, fp16 or bf16"),
     ("ACCELERATE_USE_DEEPSPEED", "true", "accelerate launch asked for DeepSpeed (ACCELERATE_USE_DEEPSPEED), which "
      "this package does not run with: it runs in one process or with DDP in several; launch with a profile without "
      "it (accelerate_configs/)")],
    ids=["fp8", "deepspeed"],
)  # fmt: skip
def test_a_launcher_setting_this_package_does_not_run_is_one_line_for_evaluate_and_predict_too(
    variable, value, line, monkeypatch
):
    """accelerate launch --mixed_precision fp8, or a DeepSpeed profile, made evaluate and predict fail in Accelerate
    ('ValueError: Using `fp8` precision requires `transformer_engine`...', an ImportError), where train refused them."""
    monkeypatch.setenv(variable, value)
    trained = types.SimpleNamespace(config=TrainConfig())
    with pytest.raises(InputError) as err:
        inference_precision(None, trained)
    assert str(err.value) == line
