"""Training images/s of a recipe's input pipeline against its own compute bound, per precision; for the default
recipe also against the AMP chapter's per-image pipeline.

    python scripts/bench_throughput.py --dataset_name ../shared/data/cifar10-jpeg          # the default recipe
    python scripts/bench_throughput.py --model fast_net --steps 12 --warmup 2 --turns 3 --skip_startup

--model NAME measures the preset made for that model (fast_net: fast, resnet18: resnet18; simple_cnn and resnet9:
the default recipe with that model); --config names a preset or file instead.

(a) chapter:  the AMP chapter's pipeline: each JPEG decoded and augmented per image with PIL/torchvision
              (RandomCrop(32, 4), RandomHorizontalFlip, ColorJitter(0.2, 0.2, 0.2, 0.1), ToTensor, Normalize)
              in DataLoader worker processes (default recipe only);
(b) ours:     the package's pipeline for the recipe (cifar_accel.train.batch_pipeline): images decoded once into
              a uint8 tensor, batches fetched whole and augmented with torch ops as the recipe says;
(c) compute:  the recipe's training step (its model, data-dependent initialisation, optimizer and loss) on
              batches of (b) made before the clock starts: the bound no pipeline can beat.

(b) and (c) train one model in alternating turns, so that the host's drifting speed affects both alike; (a) runs
on its own. Prints images/s and the ratios b/a and b/c, then the start-up time (process start to the first batch) of
(a) and (b), cold (empty `datasets` cache) and warm. bf16 is measured only on a CPU with native bf16 (AVX-512 BF16
or AMX) unless --precisions asks for it: elsewhere torch emulates it, which says nothing about the recipe.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator, Sequence

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from accelerate.utils import set_seed

from cifar_accel.allocator import keep_freed_memory
from cifar_accel.config import TrainConfig, config_path, read_config_file
from cifar_accel.data import CifarData, load_data, load_raw
from cifar_accel.engine import training_step
from cifar_accel.errors import AddUp, ArgumentParser, counted, exit_command, int_at_least, positive_int, user_path
from cifar_accel.models import build_model
from cifar_accel.optim import build_loss, build_optimizer
from cifar_accel.precision import native_bf16
from cifar_accel.telemetry import hardware, machine_name
from cifar_accel.train import DATA_INIT_IMAGES, batch_pipeline
from cifar_accel.transforms import BatchTransform

from chapter_pipeline import ChapterDataset, chapter_loader

PRESET_OF_MODEL = {"fast_net": "fast", "resnet18": "resnet18"}


def recipe(preset: str | None, model: str | None, dataset_name: str, batch_size: int | None) -> TrainConfig:
    """The config of ``preset`` (by default the one made for ``model``), with the model and batch size given."""
    values = read_config_file(config_path(preset or PRESET_OF_MODEL.get(model, "default")))
    values["dataset_name"] = dataset_name
    if model:
        values["model_name"] = model
    if batch_size:
        values["per_device_train_batch_size"] = batch_size
    return TrainConfig(**values)


def chapter_batches(dataset_name: str, batch_size: int) -> Iterable:
    split = load_raw(dataset_name, splits=("train",))["train"]
    loader = chapter_loader(ChapterDataset(split), batch_size)
    return ((images.contiguous(memory_format=torch.channels_last), labels) for images, labels in repeat(loader))


def default_recipe_batches(dataset_name: str) -> Iterator:
    config = TrainConfig(dataset_name=dataset_name)
    return our_batches(config, load_data(config))


def our_batches(config: TrainConfig, data: CifarData) -> Iterator:
    """(inputs, targets) as `cifar_accel.train` makes them, epoch after epoch."""
    loader, transform = batch_pipeline(config, data, torch.device("cpu"))
    for epoch in itertools.count():
        loader.dataset.set_epoch(epoch)  # alternating flips
        for images, labels in loader:
            yield transform(images, labels, epoch, config.num_train_epochs)


def premade_batches(batches: Iterator, count: int) -> Iterable:
    """The next ``count`` of ``batches`` (at most 32), made before the clock starts and then repeated: the step
    without input work."""
    count = min(count, 32)
    return itertools.cycle(list(itertools.islice(batches, count)))


def repeat(loader: Iterable) -> Iterator:
    while True:
        yield from loader


def images_per_second(
    pipelines: dict[str, Iterable], config: TrainConfig, data: CifarData, precision: str, steps: int, warmup: int,
    turns: int, compile_model: bool,
) -> tuple[dict[str, float], dict[str, float]]:  # fmt: skip
    """Train the recipe's model through Accelerate, as `cifar_accel.train` does (an optimizer step every
    --gradient_accumulation_steps batches), on each pipeline's batches (ready inputs and targets); images/s of each
    after its warm-up steps, and each one's warm-up seconds (the first pipeline's include compiling).

    The pipelines take turns of ``steps / turns`` steps on the same model, so that the machine's speed, which
    drifts from minute to minute on a shared host, is the same for all of them.
    """
    set_seed(0)
    accelerator = Accelerator(
        mixed_precision=precision, cpu=True, gradient_accumulation_steps=config.gradient_accumulation_steps
    )
    model = build_model(config.model_name, num_classes=len(data.class_names))
    if hasattr(model, "init_from_data"):
        model.init_from_data(BatchTransform(data.normalization)(data.train.images[:DATA_INIT_IMAGES]))
    if config.channels_last:
        model = model.to(memory_format=torch.channels_last)
    if compile_model:
        model.compile()
    optimizer = build_optimizer(config, model, config.learning_rate)
    loss_fn = build_loss(config)
    model, optimizer = accelerator.prepare(model, optimizer)

    def train(batches: Iterator, steps: int) -> tuple[float, int]:
        start, images = time.perf_counter(), 0
        for inputs, targets in itertools.islice(batches, steps * config.gradient_accumulation_steps):
            with accelerator.accumulate(model):
                training_step(accelerator, model, optimizer, loss_fn, inputs, targets)
            images += len(inputs)
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


def main(argv: Sequence[str]) -> None:
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--dataset_name",
        type=user_path,
        default="../shared/data/cifar10-jpeg",
        help="The dataset whose training images go through the pipeline (default: %(default)s).",
    )
    parser.add_argument("--model", choices=["simple_cnn", "fast_net", "resnet9", "resnet18"],
                        help="Measure the preset made for this model (see above).")  # fmt: skip
    parser.add_argument("--config", help="A preset's name or a config file (default: the one for --model).")
    parser.add_argument("--precisions", nargs="+", action=AddUp, choices=["no", "bf16"],
                        help="Default: no, and bf16 on a CPU with native bf16.")  # fmt: skip
    parser.add_argument("--batch_size", type=positive_int, help="Default: the recipe's.")
    parser.add_argument(
        "--steps", type=positive_int, default=100, help="Timed optimizer steps per measurement (after --warmup)."
    )
    parser.add_argument("--warmup", type=int_at_least(0), default=10, help="Untimed steps before each measurement.")
    parser.add_argument(
        "--turns",
        type=positive_int,
        default=5,
        help="Ours and the compute bound alternate, each --steps in this many turns.",
    )
    parser.add_argument(
        "--torch_compile", action="store_true", help="Also measure with the model compiled, as training's flag does."
    )
    parser.add_argument("--skip_startup", action="store_true", help="Do not measure the cold and warm start-up.")
    args = parser.parse_args(argv)
    keep_freed_memory()  # as training does
    config = recipe(args.config, args.model, args.dataset_name, args.batch_size)
    chapter_recipe = config == recipe("default", "simple_cnn", args.dataset_name, args.batch_size or 64)
    precisions = args.precisions or (["no", "bf16"] if native_bf16() else ["no"])
    hw = hardware()
    threads, cores = counted(hw["torch_threads"], "thread"), counted(hw["cpu_cores"], "core")
    print(f"{machine_name(hw)}; torch {torch.__version__}, {threads}, {cores}, "
          f"CPU capability {hw['torch_cpu_capability']}, native bf16: {native_bf16()}; model {config.model_name}, "
          f"batch {config.per_device_train_batch_size}, {config.gradient_accumulation_steps} per optimizer step; "
          f"{counted(args.steps, 'timed step')}")  # fmt: skip

    print(f"\n{'precision':<10}{'compile':<9}{'chapter':>10}{'ours':>10}{'compute':>10}{'ours/chapter':>14}"
          f"{'ours/compute':>14}{'warm-up s':>11}   (images/s)")  # fmt: skip
    data = load_data(config)
    ours = our_batches(config, data)  # the dataset is loaded once, for every row
    premade = (args.warmup + args.steps) * config.gradient_accumulation_steps  # batches
    for precision in precisions:
        for compile_model in [False, True] if args.torch_compile else [False]:
            rate, warmup = images_per_second(
                {"ours": ours, "compute": premade_batches(ours, premade)}, config, data,
                precision, args.steps, args.warmup, args.turns, compile_model,
            )  # fmt: skip
            # Compiling changes the step, not the input: the chapter pipeline is measured eager only, and on its own,
            # as its DataLoader workers would fill their queues while the others took their turns.
            if chapter_recipe and not compile_model:
                rate |= images_per_second(
                    {"chapter": chapter_batches(args.dataset_name, config.per_device_train_batch_size)},
                    config, data, precision, args.steps, args.warmup, 1, compile_model,
                )[0]  # fmt: skip
            measured = "chapter" in rate
            chapter = f"{rate['chapter']:.0f}" if measured else "-"
            ours_vs_chapter = f"{rate['ours'] / rate['chapter']:.2f}x" if measured else "-"
            print(f"{precision:<10}{str(compile_model):<9}{chapter:>10}{rate['ours']:>10.0f}{rate['compute']:>10.0f}"
                  f"{ours_vs_chapter:>14}{rate['ours'] / rate['compute']:>13.2f}x{warmup['ours']:>11.1f}",
                  flush=True)  # fmt: skip

    if chapter_recipe and not args.skip_startup:
        print("\nstart-up, fresh process to first training batch (s):")
        for name, pipeline in (
            ("chapter", f"chapter_batches({args.dataset_name!r}, {config.per_device_train_batch_size})"),
            ("ours", f"default_recipe_batches({args.dataset_name!r})"),
        ):
            with tempfile.TemporaryDirectory() as cache:
                cold, warm = startup_seconds(pipeline, cache), startup_seconds(pipeline, cache)
            print(f"  {name:<8} cold {cold:6.1f}   warm {warm:6.1f}")


if __name__ == "__main__":
    exit_command(main)
