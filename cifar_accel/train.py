"""Train a CIFAR-10 classifier: `accelerate launch -m cifar_accel.train [flags]` or `python -m cifar_accel.train`."""

from __future__ import annotations

import json
import logging
import os
import platform
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import accelerate
import datasets
import safetensors.torch
import torch
import torch.nn.functional as F
import yaml
from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.logging import get_logger
from accelerate.utils import ProjectConfiguration, set_seed
from torch.utils.data import DataLoader

from cifar_accel.checkpoint import (
    TrainerState,
    checkpoint_dir,
    config_fingerprint,
    load_checkpoint,
    remove_partial_checkpoints,
    resolve_checkpoint,
    save_checkpoint,
)
from cifar_accel.config import TrainConfig, load_config, save_config
from cifar_accel.data import LABELS_FILE, CifarData, check_dataset_path, load_data, make_loader
from cifar_accel.engine import Transform, evaluate_model, train_one_epoch
from cifar_accel.errors import InputError, Stopped, run_cli
from cifar_accel.metrics import load_metric
from cifar_accel.models import build_model
from cifar_accel.precision import (
    check_step,
    effective_precision,
    log_precision_report,
    log_step,
    loss_scale,
    peak_memory,
    precision_report,
)
from cifar_accel.stopping import StopRequest
from cifar_accel.transforms import BatchTransform

logger = get_logger(__name__)

# The training input: (config, data) -> (loader of training batches, transform applied to each batch).
TrainPipeline = Callable[[TrainConfig, CifarData], tuple[DataLoader, Transform]]


def batch_pipeline(config: TrainConfig, data: CifarData) -> tuple[DataLoader, Transform]:
    """Shuffled uint8 batches of the in-memory train split, augmented as whole batches on the training device."""
    loader = make_loader(data.train, config.per_device_train_batch_size, train=True, seed=config.seed)
    return loader, BatchTransform(augment=config.augment, channels_last=config.channels_last)


def prepare_output_dir(config: TrainConfig) -> Path:
    """Make sure ``output_dir`` is writable and holds no other run's results (unless told otherwise)."""
    output_dir = Path(config.output_dir)
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        probe = output_dir / f".write-test-{os.getpid()}"
        probe.touch()
        probe.unlink()
    except OSError as err:
        raise InputError(
            f"output directory '{output_dir}' is not writable ({err.strerror}); choose another --output_dir"
        ) from None
    earlier = [p.name for p in (output_dir / "results.json", output_dir / "checkpoints") if p.exists()]
    if earlier and config.resume_from_checkpoint is None and not config.overwrite_output_dir:
        raise InputError(
            f"'{output_dir}' already holds a run ({', '.join(earlier)}); continue it with "
            "--resume_from_checkpoint latest, replace it with --overwrite_output_dir, or pick another --output_dir"
        )
    return output_dir


def build_scheduler(config: TrainConfig, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    """The epoch-wise learning-rate schedule."""
    if config.lr_scheduler_type == "cosine":
        return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=config.num_train_epochs)
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=config.lr_step_size, gamma=config.lr_gamma)


def tracker_config(config: TrainConfig) -> dict[str, Any]:
    """The config as TensorBoard hyperparameters (which cannot hold None)."""
    return {k: ("none" if v is None else v) for k, v in config.to_dict().items()}


def build_accelerator(config: TrainConfig, output_dir: Path) -> Accelerator:
    accelerator = Accelerator(
        mixed_precision=config.mixed_precision,
        cpu=config.cpu,
        gradient_accumulation_steps=config.gradient_accumulation_steps,
        log_with="tensorboard",
        project_config=ProjectConfiguration(project_dir=str(output_dir), logging_dir=str(output_dir / "logs")),
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=config.seed),
        step_scheduler_with_optimizer=False,  # the schedule steps once per epoch
    )
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and accelerator.num_processes == 1:
        raise InputError(
            f"{os.environ['WORLD_SIZE']} processes were started but they are not connected into one process group; "
            "on CPUs launch with 'torchrun --nproc_per_node N -m cifar_accel.train --cpu', on GPUs with "
            "'accelerate launch --config_file accelerate_configs/multi_gpu_fp16.yaml -m cifar_accel.train'"
        )
    return accelerator


def epoch_record(
    epoch: int,
    train: dict,
    val: dict,
    learning_rate: float,
    seconds: float,
    accelerator: Accelerator,
    state: TrainerState,
) -> dict[str, Any]:
    return {
        "epoch": epoch,
        "train_loss": train["loss"],
        "train_accuracy": train["accuracy"],
        "val_loss": val["loss"],
        "val_accuracy": val["accuracy"],
        "val_samples": val["samples"],
        "learning_rate": learning_rate,
        "train_images": train["images"],
        "train_seconds": train["seconds"],
        "train_images_per_second": train["images"] / train["seconds"],
        "epoch_seconds": seconds,
        "skipped_steps": state.skipped_steps,
        "loss_scale": loss_scale(accelerator),
    }


def log_epoch(accelerator: Accelerator, record: dict[str, Any]) -> None:
    accelerator.log(
        {
            "train/loss": record["train_loss"],
            "train/accuracy": record["train_accuracy"],
            "val/loss": record["val_loss"],
            "val/accuracy": record["val_accuracy"],
            "learning_rate": record["learning_rate"],
            "train/images_per_second": record["train_images_per_second"],
            "epoch_seconds": record["epoch_seconds"],
        },
        step=record["epoch"],
    )
    logger.info(
        f"epoch {record['epoch']}: train loss {record['train_loss']:.4f} acc {record['train_accuracy']:.4f} | "
        f"val loss {record['val_loss']:.4f} acc {record['val_accuracy']:.4f} | lr {record['learning_rate']:.2e} | "
        f"{record['train_images_per_second']:.0f} img/s | {record['epoch_seconds']:.1f} s"
    )


def run_training(
    config: TrainConfig, precision_source: str, train_pipeline: TrainPipeline = batch_pipeline
) -> dict[str, Any]:
    check_dataset_path(config.dataset_name)
    output_dir = prepare_output_dir(config)
    accelerator = build_accelerator(config, output_dir)
    if accelerator.is_main_process:
        if config.overwrite_output_dir and config.resume_from_checkpoint is None:
            for stale in ("checkpoints", "logs"):
                if (output_dir / stale).exists():
                    logger.info(f"--overwrite_output_dir: removing the earlier run's {output_dir / stale}")
                    shutil.rmtree(output_dir / stale)
        remove_partial_checkpoints(output_dir)
    accelerator.wait_for_everyone()

    logger.info("effective config:\n" + yaml.safe_dump(config.to_dict(), sort_keys=False).rstrip())
    mixed_precision = effective_precision(accelerator)
    fingerprint = config_fingerprint(config, mixed_precision)
    resume_path = (
        resolve_checkpoint(config.resume_from_checkpoint, output_dir) if config.resume_from_checkpoint else None
    )

    set_seed(config.seed)
    with accelerator.main_process_first():
        data = load_data(config)
    batch_per_step = config.per_device_train_batch_size * accelerator.num_processes
    if len(data.train) < batch_per_step:
        raise InputError(
            f"{len(data.train)} training images are fewer than one batch of {batch_per_step}; "
            "lower --per_device_train_batch_size"
        )
    global_batch = batch_per_step * config.gradient_accumulation_steps
    scale = global_batch // config.per_device_train_batch_size if config.scale_lr else 1
    learning_rate = config.learning_rate * scale
    logger.info(
        f"data: {len(data.train)} train, {len(data.val)} validation, {len(data.test)} test images; "
        f"batch {config.per_device_train_batch_size} per process x {accelerator.num_processes} processes x "
        f"{config.gradient_accumulation_steps} accumulation steps = {global_batch} global; learning rate "
        f"{learning_rate:g}" + (f" = {config.learning_rate:g} x {scale} (--scale_lr)" if config.scale_lr else "")
    )

    model = build_model(config.model_name, num_classes=len(data.class_names))
    if config.channels_last:
        model = model.to(memory_format=torch.channels_last)
    if config.torch_compile:
        model.compile()  # in place: parameter names stay those of the plain model, in checkpoints and weights
    optimizer = torch.optim.Adam(model.parameters(), lr=learning_rate, weight_decay=config.weight_decay)
    scheduler = build_scheduler(config, optimizer)
    train_loader, train_transform = train_pipeline(config, data)
    val_loader = make_loader(data.val, config.per_device_eval_batch_size, train=False)
    test_loader = make_loader(data.test, config.per_device_eval_batch_size, train=False)
    model, optimizer, scheduler, train_loader, val_loader, test_loader = accelerator.prepare(
        model, optimizer, scheduler, train_loader, val_loader, test_loader
    )
    metric = load_metric("accuracy")
    eval_transform = BatchTransform(augment=False, channels_last=config.channels_last)
    probe_images, probe_labels = (
        t[: config.per_device_train_batch_size].to(accelerator.device) for t in (data.val.images, data.val.labels)
    )
    report = precision_report(
        accelerator, model, F.cross_entropy, eval_transform(probe_images), probe_labels, config.mixed_precision,
        precision_source,
    )  # fmt: skip
    log_precision_report(report)

    state = TrainerState(config_fingerprint=fingerprint, num_processes=accelerator.num_processes)
    if resume_path is not None:
        state = load_checkpoint(accelerator, resume_path, fingerprint)
        logger.info(
            f"resumed from {resume_path}: {state.epoch} epochs and {state.step_in_epoch} batches done, "
            f"best val accuracy {state.best_val_accuracy}"
        )
        if state.num_processes != accelerator.num_processes:
            logger.warning(
                f"the checkpoint was written by {state.num_processes} processes and this run has "
                f"{accelerator.num_processes}: the global batch becomes {global_batch}, so steps per epoch and the "
                "data order change and the result will differ from an uninterrupted run; the learning rate and its "
                "schedule continue from the checkpoint"
            )
            state.num_processes = accelerator.num_processes
    if accelerator.is_main_process:
        save_config(config, output_dir / "config.yaml")
        (output_dir / LABELS_FILE).write_text(json.dumps({"class_names": data.class_names}, indent=2))
    accelerator.init_trackers("tensorboard", config=tracker_config(config))
    stop = StopRequest().install()
    steps_between_saves = 0 if config.checkpointing_steps == "epoch" else int(config.checkpointing_steps)

    def save(state: TrainerState) -> Path:
        return save_checkpoint(accelerator, output_dir, state, keep=config.checkpoints_total_limit)

    def stopped(checkpoint: Path) -> Stopped:
        return Stopped(
            f"stopped by {stop.name} after {state.epoch} epochs and {state.step_in_epoch} batches "
            f"(optimizer step {state.global_step}); saved {checkpoint}; resume with --resume_from_checkpoint latest",
            exit_code=stop.exit_code,
        )

    for epoch in range(state.epoch, config.num_train_epochs):
        if state.should_stop_early(config.early_stopping_patience):
            logger.info(f"early stopping: no better validation accuracy for {config.early_stopping_patience} epochs")
            break
        epoch_start = time.perf_counter()
        epoch_lr = scheduler.get_last_lr()[0]
        train_loader.set_epoch(epoch)
        loader = (
            accelerator.skip_first_batches(train_loader, state.step_in_epoch) if state.step_in_epoch else train_loader
        )
        totals = torch.zeros(3, device=accelerator.device)
        if accelerator.is_main_process:  # a resumed epoch's first part, counted once
            totals += torch.tensor(state.epoch_totals, device=accelerator.device)
        seconds_before = state.epoch_train_seconds

        def after_step(
            totals: torch.Tensor,
            loss: torch.Tensor,
            grad_norm: torch.Tensor | None,
            epoch_start: float = epoch_start,
            seconds_before: float = seconds_before,
        ):
            state.step_in_epoch += 1
            if not accelerator.sync_gradients:  # clipping, checks and telemetry happen on optimizer steps
                return
            state.global_step += 1
            check_step(accelerator, state, loss, grad_norm, config.max_consecutive_skipped_steps, output_dir)
            if state.global_step % config.logging_steps == 0:
                log_step(accelerator, state, loss, grad_norm, optimizer.param_groups[0]["lr"])
            stopping = stop.requested(accelerator)
            if stopping or (steps_between_saves and state.global_step % steps_between_saves == 0):
                state.epoch_totals = accelerator.reduce(totals.clone(), reduction="sum").tolist()
                state.epoch_train_seconds = seconds_before + time.perf_counter() - epoch_start
                checkpoint = save(state)
                if stopping:
                    raise stopped(checkpoint)

        train_stats = train_one_epoch(
            accelerator, model, loader, optimizer, train_transform, config.max_grad_norm, totals, after_step,
            description=f"epoch {epoch + 1}/{config.num_train_epochs}",
        )  # fmt: skip
        train_stats["seconds"] += seconds_before
        val_stats = evaluate_model(accelerator, model, val_loader, eval_transform, metric)
        scheduler.step()
        record = epoch_record(
            epoch + 1, train_stats, val_stats, epoch_lr, time.perf_counter() - epoch_start, accelerator, state
        )
        state.record_epoch(record)
        log_epoch(accelerator, record)
        checkpoint = save(state)
        if stop.requested(accelerator):
            raise stopped(checkpoint)

    if state.best_epoch is None:
        raise InputError("no epoch was trained; raise --num_train_epochs")
    # Test once, with the weights that had the best validation accuracy; those become model.safetensors.
    best_weights = safetensors.torch.load_file(checkpoint_dir(output_dir) / state.best_checkpoint / "model.safetensors")
    accelerator.unwrap_model(model).load_state_dict(best_weights)
    test_stats = evaluate_model(accelerator, model, test_loader, eval_transform, metric)
    accelerator.log({"test/loss": test_stats["loss"], "test/accuracy": test_stats["accuracy"]}, step=state.epoch)
    accelerator.save_model(model, output_dir)

    memory, memory_measure = peak_memory(accelerator.device)
    results = {
        "best_val_accuracy": state.best_val_accuracy,
        "best_epoch": state.best_epoch,
        "test_accuracy": test_stats["accuracy"],
        "test_loss": test_stats["loss"],
        "test_samples": test_stats["samples"],
        "epochs_completed": state.epoch,
        "stopped_early": state.should_stop_early(config.early_stopping_patience),
        "mixed_precision": mixed_precision,
        "requested_mixed_precision": config.mixed_precision,
        "mixed_precision_source": precision_source,
        "train_images_per_second": sum(r["train_images"] for r in state.history)
        / sum(r["train_seconds"] for r in state.history),
        "seconds_per_epoch": sum(r["epoch_seconds"] for r in state.history) / len(state.history),
        "skipped_steps": state.skipped_steps,
        "peak_memory_mib": memory,
        "peak_memory_measure": memory_measure,
        "precision_report": report,
        "num_processes": accelerator.num_processes,
        "global_batch_size": global_batch,
        "learning_rate": learning_rate,
        "device": str(accelerator.device),
        "train_samples": len(data.train),
        "val_samples": len(data.val),
        "history": state.history,
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "accelerate": accelerate.__version__,
            "datasets": datasets.__version__,
        },
    }
    if accelerator.is_main_process:
        (output_dir / "results.json").write_text(json.dumps(results, indent=2))
    accelerator.end_training()
    logger.info(
        f"test accuracy {results['test_accuracy']:.4f} (best validation {results['best_val_accuracy']:.4f} at epoch "
        f"{results['best_epoch']}); model.safetensors, results.json, config.yaml, checkpoints/ and logs/ are in "
        f"{output_dir.resolve()}"
    )
    return results


def main(argv: Sequence[str], train_pipeline: TrainPipeline = batch_pipeline) -> None:
    config, precision_source = load_config(argv)
    # Logs and progress go to stdout; stderr is kept for the one-line error of the exit-code contract.
    logging.basicConfig(
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stdout,
        level=logging.INFO if int(os.environ.get("RANK", "0")) == 0 else logging.WARNING,
    )
    logging.getLogger("accelerate").setLevel(logging.WARNING)  # its per-file checkpoint messages drown the epochs
    datasets.disable_progress_bars()  # they write to stderr; decoding is logged instead
    run_training(config, precision_source, train_pipeline)


def cli() -> None:
    sys.exit(run_cli(main))


if __name__ == "__main__":
    cli()
