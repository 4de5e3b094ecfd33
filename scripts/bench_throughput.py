"""Training images/s of three input pipelines feeding the same model and training step, per precision.

    python scripts/bench_throughput.py --dataset_name ../shared/data/cifar10-jpeg

(a) chapter:  the AMP chapter's pipeline: each JPEG decoded and augmented per image with PIL/torchvision
              (RandomCrop(32, 4), RandomHorizontalFlip, ColorJitter(0.2, 0.2, 0.2, 0.1), ToTensor, Normalize)
              in DataLoader worker processes;
(b) ours:     the package's pipeline: images decoded once into a cached uint8 tensor, whole batches augmented
              with torch ops (cifar_accel.transforms.BatchTransform), channels_last;
(c) compute:  the same training step on batches of (b) made before the clock starts (real images, augmented
              and normalised): the bound no pipeline can beat.

(b) and (c) train one model in alternating turns, so that the host's drifting speed affects both alike; (a) runs
on its own. Prints images/s and the ratios b/a and b/c, then the start-up time (process start to the first batch) of
(a) and (b), cold (empty `datasets` cache) and warm.
"""

from __future__ import annotations

import argparse
import itertools
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator

import datasets
import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from accelerate.utils import set_seed

from cifar_accel.config import TrainConfig
from cifar_accel.data import load_data, load_raw, make_loader
from cifar_accel.engine import training_step
from cifar_accel.models import build_model
from cifar_accel.transforms import BatchTransform

from chapter_pipeline import ChapterDataset, chapter_loader


def chapter_batches(dataset_name: str, batch_size: int) -> Iterable:
    split = load_raw(dataset_name, splits=("train",))["train"]
    loader = chapter_loader(ChapterDataset(split), batch_size)
    return ((images.contiguous(memory_format=torch.channels_last), labels) for images, labels in repeat(loader))


def our_batches(dataset_name: str, batch_size: int) -> Iterable:
    data = load_data(TrainConfig(dataset_name=dataset_name))
    transform = BatchTransform(augment=True, channels_last=True)
    loader = make_loader(data.train, batch_size, train=True)
    return ((transform(images), labels) for images, labels in repeat(loader))


def premade_batches(batches: Iterator, count: int) -> Iterable:
    """The next ``count`` of ``batches``, made before the clock starts and then repeated: the step without input
    work."""
    return itertools.cycle(list(itertools.islice(batches, count)))


def repeat(loader: Iterable) -> Iterator:
    while True:
        yield from loader


def images_per_second(
    pipelines: dict[str, Iterable], precision: str, steps: int, warmup: int, turns: int, compile_model: bool
) -> tuple[dict[str, float], dict[str, float]]:
    """Train SimpleCNN through Accelerate, as `cifar_accel.train` does, on each pipeline's batches (ready inputs
    and labels); images/s of each after its warm-up steps, and each one's warm-up seconds (the first pipeline's
    include compiling).

    The pipelines take turns of ``steps / turns`` steps on the same model, so that the machine's speed, which
    drifts from minute to minute on a shared host, is the same for all of them.
    """
    set_seed(0)
    accelerator = Accelerator(mixed_precision=precision, cpu=True)
    model = build_model("simple_cnn", num_classes=10).to(memory_format=torch.channels_last)
    if compile_model:
        model.compile()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)

    def train(batches: Iterator, count: int) -> tuple[float, int]:
        start, images = time.perf_counter(), 0
        for inputs, labels in itertools.islice(batches, count):
            training_step(accelerator, model, optimizer, F.cross_entropy, inputs, labels)
            images += len(labels)
        return time.perf_counter() - start, images

    batches = {name: iter(pipeline) for name, pipeline in pipelines.items()}
    warmup_seconds = {name: train(iterator, warmup)[0] for name, iterator in batches.items()}
    seconds, images = dict.fromkeys(batches, 0.0), dict.fromkeys(batches, 0)
    for _ in range(turns):
        for name, iterator in batches.items():
            turn_seconds, turn_images = train(iterator, steps // turns)
            seconds[name] += turn_seconds
            images[name] += turn_images
    AcceleratorState._reset_state(reset_partial_state=True)
    return {name: images[name] / seconds[name] for name in batches}, warmup_seconds


STARTUP = """
import sys, time
start = time.perf_counter()
sys.path.insert(0, {scripts!r})
import bench_throughput as bench
batches = bench.{pipeline}
next(iter(batches))
print(time.perf_counter() - start)
"""


def startup_seconds(pipeline: str, cache_dir: str) -> float:
    """Seconds from a fresh interpreter to the first training batch, with ``cache_dir`` as the datasets cache."""
    code = STARTUP.format(scripts=os.path.dirname(os.path.abspath(__file__)), pipeline=pipeline)
    env = {**os.environ, "HF_DATASETS_CACHE": cache_dir, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return float(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset_name", default="../shared/data/cifar10-jpeg")
    parser.add_argument("--precisions", nargs="+", default=["no", "bf16"], choices=["no", "bf16"])
    parser.add_argument("--batch_size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=100, help="Timed steps per measurement (after --warmup).")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument(
        "--turns", type=int, default=5, help="Ours and the compute bound alternate, each --steps in this many turns."
    )
    parser.add_argument(
        "--torch_compile", action="store_true", help="Also measure with the model compiled, as training's flag does."
    )
    parser.add_argument("--skip_startup", action="store_true", help="Do not measure the cold and warm start-up.")
    args = parser.parse_args()
    datasets.disable_progress_bars()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} cores, CPU capability "
          f"{torch.backends.cpu.get_cpu_capability()}; batch {args.batch_size}; {args.steps} timed steps")  # fmt: skip

    print(f"\n{'precision':<10}{'compile':<9}{'chapter':>10}{'ours':>10}{'compute':>10}{'ours/chapter':>14}"
          f"{'ours/compute':>14}{'warm-up s':>11}   (images/s)")  # fmt: skip
    ours = iter(our_batches(args.dataset_name, args.batch_size))  # the dataset is loaded once, for every row
    for precision in args.precisions:
        for compile_model in [False, True] if args.torch_compile else [False]:
            rate, warmup = images_per_second(
                {"ours": ours, "compute": premade_batches(ours, args.warmup + args.steps)},
                precision, args.steps, args.warmup, args.turns, compile_model,
            )  # fmt: skip
            # Compiling changes the step, not the input: the chapter pipeline is measured eager only, and on its own,
            # as its DataLoader workers would fill their queues while the others took their turns.
            if not compile_model:
                rate |= images_per_second(
                    {"chapter": chapter_batches(args.dataset_name, args.batch_size)},
                    precision,
                    args.steps,
                    args.warmup,
                    1,
                    compile_model,
                )[0]
            measured = "chapter" in rate
            chapter = f"{rate['chapter']:.0f}" if measured else "-"
            ours_vs_chapter = f"{rate['ours'] / rate['chapter']:.2f}x" if measured else "-"
            print(f"{precision:<10}{str(compile_model):<9}{chapter:>10}{rate['ours']:>10.0f}{rate['compute']:>10.0f}"
                  f"{ours_vs_chapter:>14}{rate['ours'] / rate['compute']:>13.2f}x{warmup['ours']:>11.1f}",
                  flush=True)  # fmt: skip

    if not args.skip_startup:
        print("\nstart-up, fresh process to first training batch (s):")
        for name, pipeline in (
            ("chapter", f"chapter_batches({args.dataset_name!r}, {args.batch_size})"),
            ("ours", f"our_batches({args.dataset_name!r}, {args.batch_size})"),
        ):
            with tempfile.TemporaryDirectory() as cache:
                cold, warm = startup_seconds(pipeline, cache), startup_seconds(pipeline, cache)
            print(f"  {name:<8} cold {cold:6.1f}   warm {warm:6.1f}")


if __name__ == "__main__":
    main()
