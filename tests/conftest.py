"""Shared fixtures: a tiny CIFAR-like dataset in Hub layout and a runner for the real CLI."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import GradScalerKwargs
from PIL import Image
from safetensors.torch import load_file

from cifar_accel import train
from cifar_accel.bookkeeping import RunBookkeeper
from cifar_accel.checkpoint import complete_checkpoints
from cifar_accel.errors import run_cli as run_main

REPO = Path(__file__).resolve().parents[1]
CIFAR10_JPEG = REPO.parent / "shared" / "data" / "cifar10-jpeg"
CLASS_NAMES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]

# The suite starts about 300 Python processes. Where PYTHONDONTWRITEBYTECODE is set, each one compiled the package's
# modules again (0.6 s of every start on 2 cores); here the first one writes their bytecode, into the checkout's
# __pycache__ folders, which git ignores, as a default Python does for every command.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

# The xdist workers share the cores: torch's default of a thread per core in each worker, and in each subprocess
# it starts, oversubscribes them (on 2 cores the suite took 1.5x as long). OMP_NUM_THREADS, where set, stands.
if "PYTEST_XDIST_WORKER" in os.environ:
    workers = int(os.environ["PYTEST_XDIST_WORKER_COUNT"])
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // workers)))
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


# A test that uses one of these trains a model (on the tiny dataset, in this process or in a subprocess) or
# starts a subprocess: it belongs to the slow lane, unless it is the fast lane's one end-to-end run.
TRAINING_FIXTURES = {"tiny_dataset", "cli_env", "train_here"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark the slow lane; ``pytest -m "not slow"`` runs the rest, every test that trains nothing and one tiny
    end-to-end run (marked ``end_to_end``)."""
    for item in items:
        trains = TRAINING_FIXTURES & set(getattr(item, "fixturenames", ())) or "test_learning" in item.nodeid
        if trains and not item.get_closest_marker("end_to_end"):
            item.add_marker(pytest.mark.slow)


def make_images(count: int, seed: int) -> tuple[list[Image.Image], list[int]]:
    """Learnable 32x32 RGB images: each class has its own mean colour (the same in every split), plus noise."""
    palette = np.random.default_rng(1234).integers(30, 226, size=(len(CLASS_NAMES), 3))
    rng = np.random.default_rng(seed)
    labels = [i % len(CLASS_NAMES) for i in range(count)]
    images = []
    for label in labels:
        pixels = palette[label] + rng.normal(0, 25, size=(32, 32, 3))
        images.append(Image.fromarray(pixels.clip(0, 255).astype(np.uint8)))
    return images, labels


# What a clone of a dataset repository without git-lfs holds in place of a large file.
GIT_LFS_POINTER = (
    "version https://git-lfs.github.com/spec/v1\n"
    "oid sha256:4d7a214614ab2935c943f9e0ff69d22eadbb8f32b1258daaa5e2ca24d17e2393\nsize 120200000\n"
)


def write_hub_dataset(root: Path, train_size: int, test_size: int) -> Path:
    """A dataset folder laid out like the Hub's uoft-cs/cifar10 (columns img, label) as parquet."""
    features = datasets.Features({"img": datasets.Image(), "label": datasets.ClassLabel(names=CLASS_NAMES)})
    for split, size, seed in (("train", train_size, 0), ("test", test_size, 1)):
        images, labels = make_images(size, seed)
        dataset = datasets.Dataset.from_dict({"img": images, "label": labels}, features=features)
        (root / "data").mkdir(parents=True, exist_ok=True)
        dataset.to_parquet(root / "data" / f"{split}-00000-of-00001.parquet")
    return root


FINE_NAMES = [f"fine_{i:02d}" for i in range(100)]
COARSE_NAMES = [f"coarse_{i:02d}" for i in range(20)]


def write_cifar100_dataset(root: Path, train_size: int, test_size: int) -> Path:
    """A dataset folder laid out like the Hub's uoft-cs/cifar100 (columns img, fine_label, coarse_label; 100 fine
    classes in 20 coarse ones, five each) as parquet. Its images are darker and redder than CIFAR-10's, so its own
    statistics differ from CIFAR-10's constants."""
    features = datasets.Features(
        {
            "img": datasets.Image(),
            "fine_label": datasets.ClassLabel(names=FINE_NAMES),
            "coarse_label": datasets.ClassLabel(names=COARSE_NAMES),
        }
    )
    palette = np.random.default_rng(100).integers(0, 160, size=(100, 3)) + np.array([60, 0, 0])
    for split, size, seed in (("train", train_size, 0), ("test", test_size, 1)):
        rng = np.random.default_rng(seed)
        fine = [i % 100 for i in range(size)]
        images = [
            Image.fromarray((palette[label] + rng.normal(0, 20, size=(32, 32, 3))).clip(0, 255).astype(np.uint8))
            for label in fine
        ]
        rows = {"img": images, "fine_label": fine, "coarse_label": [label // 5 for label in fine]}
        (root / "data").mkdir(parents=True, exist_ok=True)
        dataset = datasets.Dataset.from_dict(rows, features=features)
        dataset.to_parquet(root / "data" / f"{split}-00000-of-00001.parquet")
    return root


def write_image_folder(root: Path, class_names: list[str], per_class: dict[str, int]) -> Path:
    """An image folder as datasets' imagefolder loader reads it: root/<split>/<class>/<n>.png, 40x30 greyscale
    and RGB images (converted to 32x32 RGB on decoding), each class its own brightness."""
    rng = np.random.default_rng(7)
    for split, count in per_class.items():
        for index, name in enumerate(class_names):
            folder = root / split / name
            folder.mkdir(parents=True)
            for n in range(count):
                level = 40 + 170 * index / max(1, len(class_names) - 1)
                pixels = (level + rng.normal(0, 15, size=(30, 40))).clip(0, 255).astype(np.uint8)
                image = Image.fromarray(pixels, mode="L")
                (image if n % 2 else image.convert("RGB")).save(folder / f"{n}.png")
    return root


@pytest.fixture(scope="session")
def cifar100_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """400 training and 200 test images in CIFAR-100's layout, 100 classes."""
    return write_cifar100_dataset(tmp_path_factory.mktemp("cifar100"), train_size=400, test_size=200)


@pytest.fixture(scope="session")
def cifar100_run(cifar100_dataset: Path, cli_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default recipe on the CIFAR-100-layout dataset's fine labels, one epoch, through the real CLI."""
    out = tmp_path_factory.mktemp("cifar100_run") / "run"
    proc = run_cli(tiny_args(cifar100_dataset, out, "--label_column_name", "fine_label"), cli_env)
    assert proc.returncode == 0, proc.stderr
    return out


def snapshot(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` with a hash of its bytes."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.rglob("*") if p.is_file()
    }


def write_split_files(root: Path, train: datasets.Dataset, test: datasets.Dataset) -> Path:
    (root / "data").mkdir(parents=True)
    train.to_parquet(root / "data" / "train-00000-of-00001.parquet")
    test.to_parquet(root / "data" / "test-00000-of-00001.parquet")
    return root


FEATURES = datasets.Features({"img": datasets.Image(), "label": datasets.ClassLabel(names=CLASS_NAMES)})


def good_split(count: int = 40, seed: int = 0) -> datasets.Dataset:
    images, labels = make_images(count, seed)
    return datasets.Dataset.from_dict({"img": images, "label": labels}, features=FEATURES)


def corrupt_dataset(root: Path) -> Path:
    images, labels = make_images(40, 0)
    encoded = [datasets.Image().encode_example(image) for image in images]
    encoded[17] = {"bytes": b"this is not an image", "path": None}
    train = datasets.Dataset.from_dict({"img": encoded, "label": labels}, features=FEATURES)
    return write_split_files(root, train, good_split(20, 1))


@pytest.fixture(scope="session")
def tiny_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """327 training and 83 test images: odd sizes, so the last batches are uneven."""
    return write_hub_dataset(tmp_path_factory.mktemp("tiny_cifar"), train_size=327, test_size=83)


@pytest.fixture(scope="session")
def torchrun(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """The launcher of two ranks on this machine. --standalone gives each launch a free port of its own, where the
    two test workers' launches would otherwise both take torchrun's default, 29500; its logs go to the test
    session's own folder, not to a new /tmp/torchelastic_* of each launch."""
    logs = tmp_path_factory.mktemp("torchrun_logs")
    return [
        str(Path(sys.executable).parent / "torchrun"),
        "--standalone",
        "--nproc_per_node",
        "2",
        "--log-dir",
        str(logs),
    ]


@pytest.fixture(scope="session")
def cli_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Environment for CLI subprocesses: offline, with a `datasets` cache of the test session's own."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCELERATE_")}
    env.update(
        HF_HUB_OFFLINE="1",
        HF_DATASETS_CACHE=str(tmp_path_factory.mktemp("hf_datasets_cache")),
        HF_HOME=str(tmp_path_factory.mktemp("hf_home")),
        PYTHONPATH=str(REPO),
        TQDM_DISABLE="1",
    )
    return env


def run_cli(
    args: list[str],
    env: dict[str, str],
    module: str = "cifar_accel.train",
    launcher: list[str] | None = None,
    timeout: int = 300,
) -> subprocess.CompletedProcess:
    """Run ``python -m module args`` (or ``launcher + [-m, module] + args``) in a real subprocess."""
    command = (launcher or [sys.executable]) + ["-m", module, *args]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)


def wait_until(
    condition: Callable[[], object], process: subprocess.Popen | None = None, seconds: float = 120, poll: float = 0.01
) -> None:
    """Check ``condition`` every ``poll`` seconds until it holds; fail if ``process`` ends first or ``seconds`` pass."""
    deadline = time.monotonic() + seconds
    while not condition():
        assert process is None or process.poll() is None, f"the process ended (exit code {process.returncode}) first"
        assert time.monotonic() < deadline, f"not so after {seconds} s"
        time.sleep(poll)


def run_on_a_small_disk(
    disk: Path,
    size: str,
    args: list[str],
    env: dict,
    then: str = "",
    before: str = ":",
    module: str = "cifar_accel.train",
) -> tuple[str, str, str]:
    """Run ``python -m module args`` with ``disk`` a tmpfs of ``size`` in a private mount namespace, between the
    shell commands ``before`` and ``then``; returns its stderr line, its exit status line and the stdout of both."""
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare (util-linux) for a private tmpfs")
    script = (
        f"mount -t tmpfs -o size={size} tmpfs {disk} || exit 99; {before} || exit 98; "
        f'{sys.executable} -m {module} {" ".join(args)}; echo "exit=$?" >&2; {then}'
    )
    proc = subprocess.run(["unshare", "-rm", "sh", "-c", script], env=env, capture_output=True, text=True, timeout=300)
    if "exit=" not in proc.stderr:
        pytest.skip(f"cannot mount a private tmpfs here: {proc.stderr.strip()[-200:]}")
    error, status = proc.stderr.strip().splitlines()
    return error, status, proc.stdout


def reset_accelerate_state() -> None:
    """Forget the Accelerator of a test: its state is a process-wide singleton."""
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    yield
    reset_accelerate_state()


@pytest.fixture(autouse=True)
def fresh_log_levels():
    """The entry points set the level of the package's loggers for their process (training and compare log INFO);
    one called in this process must not leave it set for the tests after it."""
    yield
    for name in ("cifar_accel", *(n for n in logging.root.manager.loggerDict if n.startswith("cifar_accel."))):
        logging.getLogger(name).setLevel(logging.NOTSET)


@pytest.fixture
def hangup_as_a_terminal_sends_it():
    """SIGHUP with its default action for the test, as in a terminal: a test run started under nohup inherits it
    ignored, and the package rightly leaves an ignored SIGHUP ignored (so would the processes it starts)."""
    previous = signal.signal(signal.SIGHUP, signal.SIG_DFL)
    yield
    signal.signal(signal.SIGHUP, previous)


@pytest.fixture(scope="session", autouse=True)
def datasets_cache_of_this_session(tmp_path_factory: pytest.TempPathFactory):
    """Runs in the test process cache decoded data in a folder of the session's own, as subprocesses do."""
    previous = datasets.config.HF_DATASETS_CACHE
    datasets.config.HF_DATASETS_CACHE = tmp_path_factory.mktemp("hf_datasets_cache_in_process")
    yield
    datasets.config.HF_DATASETS_CACHE = previous


def train_in_process(args: list[str], bookkeeper_type: type[RunBookkeeper] = RunBookkeeper) -> int:
    """Run ``cifar_accel.train`` in this process as its CLI would (flags, exit code, one-line errors), with the
    bookkeeper type of one's choice: the seam where a test injects a fault. Faster than a subprocess, which
    spends seconds importing torch."""
    try:
        return run_main(lambda argv: train.main(argv, bookkeeper_type=bookkeeper_type), args)
    finally:
        reset_accelerate_state()


@pytest.fixture
def train_here(
    capsys: pytest.CaptureFixture, caplog: pytest.LogCaptureFixture
) -> Callable[..., subprocess.CompletedProcess]:
    """``train_in_process`` that returns what a subprocess would: exit code, the log and stdout, stderr."""
    caplog.set_level(logging.INFO)

    def run(args: list[str], bookkeeper_type: type[RunBookkeeper] = RunBookkeeper) -> subprocess.CompletedProcess:
        capsys.readouterr()
        caplog.clear()
        code = train_in_process(args, bookkeeper_type)
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(args, code, caplog.text + out, err)

    return run


def fp16_accelerator(device: str, init_scale: float) -> Accelerator:
    """Accelerate's fp16 path (autocast, loss scaling in ``backward``, unscaling in ``clip_grad_norm_``, skipped
    steps in the optimizer) with a real GradScaler of the given scale. On a GPU this is Accelerate's own scaler;
    Accelerate turns fp16 off on CPUs, where torch has fp16 autocast and a GradScaler too, so there it is
    switched on before ``prepare``."""
    if device == "cuda":
        return Accelerator(mixed_precision="fp16", kwargs_handlers=[GradScalerKwargs(init_scale=init_scale)])
    accelerator = Accelerator(mixed_precision="fp16", cpu=True)
    accelerator.native_amp = True
    accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    return accelerator


def tiny_args(dataset: Path, output_dir: Path, *extra: str) -> list[str]:
    """Flags for a fast one-epoch run on the tiny dataset."""
    return [
        "--dataset_name",
        str(dataset),
        "--output_dir",
        str(output_dir),
        "--num_train_epochs",
        "1",
        "--per_device_train_batch_size",
        "32",
        "--per_device_eval_batch_size",
        "50",
        *extra,
    ]


def read_results(output_dir: Path) -> dict:
    return json.loads((output_dir / "results.json").read_text())


TIMING = {"train_seconds", "train_images_per_second", "epoch_seconds"}


def assert_same_run(expected: Path, actual: Path) -> tuple[int, float]:
    """Bitwise-equal final weights and equal logged metrics; returns (tensors compared, max abs difference)."""
    a, b = load_file(expected / "model.safetensors"), load_file(actual / "model.safetensors")
    assert a.keys() == b.keys()
    max_diff = max((a[k].double() - b[k].double()).abs().max().item() for k in a)
    for name in a:
        assert torch.equal(a[name], b[name]), name
    metrics = [[{k: v for k, v in r.items() if k not in TIMING} for r in read_results(run)["history"]]
               for run in (expected, actual)]  # fmt: skip
    assert metrics[0] == metrics[1]
    assert read_results(expected)["test_accuracy"] == read_results(actual)["test_accuracy"]
    return len(a), max_diff


def crashed_copy(run: Path, destination: Path, last_step: int) -> Path:
    """The folder a run crashed after ``last_step`` would leave: its checkpoints up to that step, no results."""
    shutil.copytree(run, destination)
    for checkpoint in complete_checkpoints(destination):
        if int(checkpoint.name.split("_")[1]) > last_step:
            shutil.rmtree(checkpoint)
    (destination / "results.json").unlink()
    (destination / "model.safetensors").unlink()
    return destination
