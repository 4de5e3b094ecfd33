"""Train a CIFAR-10 classifier: `accelerate launch -m cifar_accel.train [flags]` or `python -m cifar_accel.train`."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import yaml
from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.logging import get_logger
from accelerate.utils import ProjectConfiguration, set_seed
from torch.utils.data import DataLoader

from cifar_accel.allocator import keep_freed_memory
from cifar_accel.averaging import WeightAverage
from cifar_accel.bookkeeping import RunBookkeeper
from cifar_accel.card import write_model_card
from cifar_accel.checkpoint import (
    adopt_best_checkpoint,
    check_resume,
    check_resumed_data,
    check_resumed_epochs,
    check_resumed_in_place,
    checkpoint_dir,
    complete_checkpoints,
    config_fingerprint,
    load_checkpoint,
    remove_partial_checkpoints,
    resolve_checkpoint,
    validated_weights,
)
from cifar_accel.config import TrainConfig, config_yaml, dataset_location, load_config
from cifar_accel.data import CifarData, Split, check_dataset_path, data_signature, load_data, make_loader
from cifar_accel.engine import TrainTransform, evaluate_model, progress_bar, training_step
from cifar_accel.errors import InputError, RunFault, Stopped, counted, exit_command, first_ones, one_line
from cifar_accel.evaluate import warn_of_earlier_evaluations
from cifar_accel.hub import check_hub_settings, push_to_hub
from cifar_accel.metrics import classification_report, load_metric
from cifar_accel.models import build_model
from cifar_accel.optim import (
    build_loss,
    build_optimizer,
    build_scheduler,
    check_resumed_schedule,
    freeze_decayed_whitening_bias,
    total_epochs,
    total_steps,
)
from cifar_accel.outputs import (
    CONFIG_FILE,
    LABELS_FILE,
    LOGS_DIR,
    PREPROCESSING_FILE,
    RESULTS_FILE,
    check_earlier_run,
    exclusive_output_dir,
    export_weights,
    remove_discarded_runs,
    set_aside_earlier_run,
    starts_a_history,
    writable_output_dir,
    write_atomic,
)
from cifar_accel.pictures import (
    AUGMENTED_IMAGES,
    log_augmentation,
    log_hparams,
    log_test_pictures,
    tensorboard_writer,
)
from cifar_accel.precision import (
    effective_precision,
    log_precision_report,
    precision_report,
    warn_if_not_in_effect,
)
from cifar_accel.processes import check_joined, launched_rank
from cifar_accel.profiling import STEPS_BEFORE_RECORDING, profiled
from cifar_accel.run import Run
from cifar_accel.state import RunResults, TrainerState
from cifar_accel.stopping import StopRequest
from cifar_accel.telemetry import run_results
from cifar_accel.trackers import (
    check_continued_runs,
    check_trackers,
    requested_trackers,
    start_trackers,
    tracker_config,
    tracker_write_fault,
    trackers_ended_with_the_run,
)
from cifar_accel.transforms import BatchTransform, TrainingTransform, windowed_epochs

logger = get_logger(__name__)

DATA_INIT_IMAGES = 5000  # training images a model's data-dependent initialisation sees

# The training input: (config, data, device) -> (loader of training batches, transform applied to each batch).
TrainPipeline = Callable[[TrainConfig, CifarData, torch.device], tuple[DataLoader, TrainTransform]]


def batch_pipeline(config: TrainConfig, data: CifarData, device: torch.device) -> tuple[DataLoader, TrainTransform]:
    """Shuffled uint8 batches of the train split, which is copied to the training device once, and augmented there
    as whole batches."""
    on_device = Split(data.train.images.to(device), data.train.labels.to(device))
    alternate_flip = config.augment and config.flip == "alternate"
    loader = make_loader(on_device, config.per_device_train_batch_size, True, config.seed, alternate_flip)
    return loader, TrainingTransform(config, len(data.class_names), data.normalization)


def build_accelerator(config: TrainConfig, output_dir: Path, trackers: list[str] | str | None) -> Accelerator:
    # torch.optim imports torch._dynamo with the first optimizer; imported after gloo's threads had started, a rank
    # of a two-rank run sometimes aborted as it exited ("terminate called without an active exception"), so it is
    # imported before Accelerate starts a process group.
    import torch._dynamo  # noqa: F401

    accelerator = Accelerator(
        mixed_precision=config.mixed_precision,
        cpu=config.cpu,
        gradient_accumulation_steps=config.gradient_accumulation_steps,
        log_with=trackers,
        project_config=ProjectConfiguration(project_dir=str(output_dir), logging_dir=str(output_dir / LOGS_DIR)),
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=config.seed),
        step_scheduler_with_optimizer=False,  # the loop steps the schedule: per epoch, or once per optimizer step
        dynamo_backend="no",  # --torch_compile compiles the model in place (a launcher's inductor turns it on)
    )
    check_joined(accelerator, "train")
    return accelerator


def load_run_data(config: TrainConfig, accelerator: Accelerator) -> tuple[CifarData, int, float]:
    """Seed everything, load the splits, and work out the global batch and the learning rate."""
    set_seed(config.seed)
    with accelerator.main_process_first():
        data = load_data(config)
    batch_per_step = config.per_device_train_batch_size * accelerator.num_processes
    if len(data.train) < batch_per_step:
        fixes = ["lower --per_device_train_batch_size"]
        if data.val_split is None and len(data.val):
            fixes.append(f"lower --val_ratio ({len(data.val)} held out for validation)")
        if config.max_train_samples is not None:
            fixes.append("raise --max_train_samples")
        raise InputError(
            f"{len(data.train)} training images are fewer than one batch of {batch_per_step}; " + ", or ".join(fixes)
        )
    global_batch = batch_per_step * config.gradient_accumulation_steps
    scale = global_batch // config.per_device_train_batch_size if config.scale_lr else 1
    learning_rate = config.learning_rate * scale
    logger.info(
        f"data: {len(data.train)} train, {len(data.val)} validation, {len(data.test)} test images of "
        f"{len(data.class_names)} classes ({first_ones(data.class_names, 10)}); "
        f"batch {config.per_device_train_batch_size} per process x "
        f"{counted(accelerator.num_processes, 'process', 'processes')} x "
        f"{counted(config.gradient_accumulation_steps, 'accumulation step')} = {global_batch} global; learning rate "
        f"{learning_rate:g}" + (f" = {config.learning_rate:g} x {scale} (--scale_lr)" if config.scale_lr else "")
    )
    return data, global_batch, learning_rate


def set_up_run(
    config: TrainConfig,
    accelerator: Accelerator,
    output_dir: Path,
    precision_source: str,
    train_pipeline: TrainPipeline,
) -> Run:
    """Check every input, load the data, build and prepare the model, optimizer, schedule and loaders, and
    restore the state of a resumed run. Nothing is written: a run refused here leaves its folder as it was."""
    if config.resume_from_checkpoint == "auto":  # one command for a job's first start and its requeues
        resume = "latest" if complete_checkpoints(output_dir) else None
        found = "resuming from the newest checkpoint in" if resume else "a new run starts, as there is no checkpoint in"
        logger.info(f"--resume_from_checkpoint auto: {found} {output_dir}")
        config = dataclasses.replace(config, resume_from_checkpoint=resume)
    check_earlier_run(config, output_dir)
    logger.info("effective config:\n" + yaml.safe_dump(config.to_dict(), sort_keys=False).rstrip())
    fingerprint = config_fingerprint(config, effective_precision(accelerator))
    resume_path, resumed = None, None
    if config.resume_from_checkpoint:
        resume_path, resumed = resolve_checkpoint(config.resume_from_checkpoint, output_dir)
        check_resumed_in_place(resume_path, output_dir)
        check_resume(resume_path, resumed, fingerprint, accelerator.num_processes)
        if not config.max_train_steps:  # a run of --max_train_steps resumes with its own, as the fingerprint holds
            check_resumed_epochs(resume_path, resumed, config.num_train_epochs)
        check_continued_runs(accelerator, output_dir, resumed.global_step)

    if config.torch_compile and accelerator.device.type == "cpu":
        check_cpp_compiler()
    data, global_batch, learning_rate = load_run_data(config, accelerator)
    signature = data_signature(data)
    if resumed is not None:
        check_resumed_data(resume_path, resumed, signature, config.dataset_name)
        resumed.data_signature = signature  # for a checkpoint written before signatures were
        trained_on = dataset_location(resumed.config_fingerprint.get("dataset_name", config.dataset_name))
        if trained_on != config.dataset_name:
            logger.info(f"the dataset is at {config.dataset_name} now, the same images and labels as at {trained_on}")
    eval_transform = BatchTransform(data.normalization, channels_last=config.channels_last)
    model = build_run_model(config, data, eval_transform)
    base_optimizer = build_optimizer(config, model, learning_rate)
    train_loader, train_transform = train_pipeline(config, data, accelerator.device)
    val_loader = make_loader(data.val, config.per_device_eval_batch_size, train=False)
    test_loader = make_loader(data.test, config.per_device_eval_batch_size, train=False)
    model, optimizer, train_loader, val_loader, test_loader = accelerator.prepare(
        model, base_optimizer, train_loader, val_loader, test_loader
    )
    if config.gradient_accumulation_steps > len(train_loader):
        raise InputError(
            f"--gradient_accumulation_steps {config.gradient_accumulation_steps} is more than the "
            f"{counted(len(train_loader), 'batch', 'batches')} an epoch has on each process, so no optimizer step "
            f"would see the global batch of {global_batch}; use at most {len(train_loader)}, or a smaller "
            "--per_device_train_batch_size"
        )
    # An epoch's optimizer steps: Accelerate also steps at the end of the loader when accumulation is partway.
    steps_per_epoch = math.ceil(len(train_loader) / config.gradient_accumulation_steps)
    check_profile_steps(config, steps_per_epoch, resumed)
    if config.max_train_steps:
        epochs, last = divmod(config.max_train_steps, steps_per_epoch)
        logger.info(
            f"--max_train_steps {config.max_train_steps}: {counted(epochs, 'epoch')} of "
            f"{counted(steps_per_epoch, 'optimizer step')}" + (f", then {last} of epoch {epochs + 1}" if last else "")
        )
    num_epochs = total_epochs(config, steps_per_epoch)
    windows, size = windowed_epochs(config.early_crop_epochs, num_epochs), config.early_crop_size
    if config.augment and size and windows < config.early_crop_epochs:  # without augmentation no epoch has windows
        logger.info(
            f"early_crop_epochs is {config.early_crop_epochs}, but the run trains {counted(num_epochs, 'epoch')}: "
            + (f"the first {windows} train on {size}x{size} windows, and the last" if windows else "it trains")
            + " on whole images, the size the model is tested at"
        )
    run = Run(
        config=config,
        accelerator=accelerator,
        output_dir=output_dir,
        data=data,
        model=model,
        optimizer=optimizer,
        scheduler=accelerator.prepare(build_scheduler(config, base_optimizer, steps_per_epoch)),
        loss_fn=build_loss(config),
        train_loader=train_loader,
        train_transform=train_transform,
        val_loader=val_loader,
        test_loader=test_loader,
        eval_transform=eval_transform,
        metric=load_metric("accuracy"),
        precision={},
        state=TrainerState(
            config_fingerprint=fingerprint, data_signature=signature, num_processes=accelerator.num_processes
        ),
        last_checkpoint=None,
        global_batch_size=global_batch,
        learning_rate=learning_rate,
        num_epochs=num_epochs,
        ema=WeightAverage(accelerator.unwrap_model(model), config.ema_decay) if config.ema_decay else None,
    )
    run.precision = measure_precision(run, precision_source)
    if resume_path is not None:
        restore_checkpoint(run, resume_path, resumed, steps_per_epoch)
    return run


def check_profile_steps(config: TrainConfig, steps_per_epoch: int, resumed: TrainerState | None) -> None:
    """--profile_steps must fit in the optimizer steps the run has left, after those the profiler skips."""
    if not config.profile_steps:
        return
    done = resumed.global_step if resumed else 0
    left = total_steps(config, steps_per_epoch) - done
    needed = config.profile_steps + STEPS_BEFORE_RECORDING
    if needed > left:
        raise InputError(
            f"--profile_steps {config.profile_steps} needs {needed} optimizer steps ({STEPS_BEFORE_RECORDING} "
            f"before the recorded ones) but the run has {left} left; use at most "
            f"{max(0, left - STEPS_BEFORE_RECORDING)}, or train longer"
        )


def build_run_model(config: TrainConfig, data: CifarData, eval_transform: BatchTransform) -> torch.nn.Module:
    """The model by name, initialised from the training images where it has a data-dependent initialisation,
    with its convolutions' weight gradients as --conv_weight_grads says where it has a choice, in the run's
    memory layout, compiled if asked."""
    model = build_model(config.model_name, num_classes=len(data.class_names))
    if hasattr(model, "init_from_data"):  # data-dependent initialisation; the result lives in the weights
        model.init_from_data(eval_transform(data.train.images[:DATA_INIT_IMAGES]))
    if hasattr(model, "set_conv_weight_grads"):
        model.set_conv_weight_grads(config.conv_weight_grads)
    if config.channels_last:
        model = model.to(memory_format=torch.channels_last)
    if config.torch_compile:
        model.compile()  # in place: parameter names stay those of the plain model, in checkpoints and weights
    return model


def check_cpp_compiler() -> None:
    """--torch_compile on a CPU: inductor builds its kernels with the machine's C++ compiler, so one must run (a
    slim container has none); without one the first step would fail, after the run folder was written."""
    from torch._inductor.cpp_builder import get_cpp_compiler

    try:
        get_cpp_compiler()
    except Exception as err:  # noqa: BLE001 - InvalidCxxCompiler, or a compiler that cannot start
        raise InputError(
            f"--torch_compile on a CPU needs a C++ compiler, which inductor builds its kernels with ("
            f"{type(err).__name__}: {one_line(err)[:200]}); install one (g++, or set CXX), or leave --torch_compile out"
        ) from None


def measure_precision(run: Run, source: str) -> dict[str, Any]:
    """The dtype report (what precision is in effect) of one batch through the prepared model, logged."""
    probe = run.data.val if len(run.data.val) else run.data.train  # --val_ratio 0 leaves no validation images
    batch = run.config.per_device_train_batch_size
    images, labels = (t[:batch].to(run.accelerator.device) for t in (probe.images, probe.labels))
    report = precision_report(
        run.accelerator, run.model, run.loss_fn, run.eval_transform(images), labels, run.config.mixed_precision, source
    )
    warn_if_not_in_effect(run.accelerator, "training runs in fp32 and is recorded as 'no'")
    log_precision_report(report)
    return report


def restore_checkpoint(run: Run, path: Path, resumed: TrainerState, steps_per_epoch: int) -> None:
    """Load checkpoint ``path`` into the prepared run, which then goes on from its trainer state ``resumed``."""
    accelerator = run.accelerator
    load_checkpoint(accelerator, path, resumed, run.ema)
    check_resumed_schedule(run.scheduler.scheduler, run.config, steps_per_epoch, path)
    run.state, run.last_checkpoint = resumed, path
    logger.info(
        f"resumed from {path}: {counted(resumed.epoch, 'epoch')} and "
        f"{counted(resumed.step_in_epoch, 'batch', 'batches')} done, "
        f"best val accuracy {resumed.best_val_accuracy}"
    )
    if resumed.num_processes != accelerator.num_processes:
        logger.warning(
            f"the checkpoint was written by {counted(resumed.num_processes, 'process', 'processes')} and this run has "
            f"{accelerator.num_processes}: the global batch becomes {run.global_batch_size}, so steps per epoch and "
            "the data order change and the result will differ from an uninterrupted run; the learning rate and its "
            "schedule continue from the checkpoint"
        )
        resumed.num_processes = accelerator.num_processes


def train_epochs(run: Run, books: RunBookkeeper) -> None:
    """The epoch loop: train, validate, step an epoch-wise schedule, then record, log and save the epoch; with
    --profile_steps, under the profiler."""
    title = f"{run.config.model_name}, {run.precision['effective']}, batch {run.config.per_device_train_batch_size}"
    with profiled(run.accelerator, run.config.profile_steps, run.output_dir, title) as run.profiler:
        for epoch in range(run.state.epoch, run.num_epochs):
            if books.stops_early():
                break
            if run.accelerator.num_processes == 1:
                freeze_decayed_whitening_bias(run.optimizer)
            train_stats = train_epoch(run, books, epoch)
            val_stats = None  # --val_ratio 0: no validation
            if len(run.data.val):
                val_stats = evaluate_model(
                    run.accelerator, run.eval_model, run.val_loader, run.eval_transform, run.metric
                )
            if not run.schedule_per_step:
                run.scheduler.step()
            books.end_epoch(train_stats, val_stats)


def train_epoch(run: Run, books: RunBookkeeper, epoch: int) -> dict[str, float]:
    """One epoch of training steps, or those left of --max_train_steps, and after each optimizer step, in this
    order: count it (and note whether it stayed finite), log it, step a per-step schedule, update the weight average,
    mark it for the profiler, save a checkpoint or stop."""
    accelerator = run.accelerator
    averaged = accelerator.unwrap_model(run.model)  # what the weight average follows
    run.model.train()
    batches = progress_bar(books.begin_epoch(epoch), accelerator, f"epoch {epoch + 1}/{run.num_epochs}")
    for images, labels in batches:
        if run.state.global_step == run.config.max_train_steps:
            break  # part way through the epoch, which ends here (and its end saves the checkpoint)
        inputs, targets = run.train_transform(images, labels, epoch, run.num_epochs)
        with accelerator.accumulate(run.model):
            loss, logits, grad_norm = training_step(
                accelerator, run.model, run.optimizer, run.loss_fn, inputs, targets, run.config.max_grad_norm
            )
        books.count_batch(loss, logits, labels)
        if not accelerator.sync_gradients:
            continue  # accumulated for the next optimizer step
        books.count_step(loss, grad_norm)
        books.log_step(loss, grad_norm)
        if run.schedule_per_step:  # also after a step the GradScaler skipped: the schedule counts steps taken
            run.scheduler.step()
        if run.ema is not None:
            run.ema.update(averaged)
        if run.profiler is not None:
            run.profiler.step()
        books.save_or_stop()
    return books.epoch_training()


def finish_run(run: Run) -> RunResults:
    """Test the weights (or their average) with the best validation accuracy, or the final ones when there was no
    validation, export them as model.safetensors, write results.json."""
    accelerator, state, output_dir = run.accelerator, run.state, run.output_dir
    if state.epoch == 0:
        raise InputError("no epoch was trained; raise --num_train_epochs")
    if state.best_checkpoint is not None:  # the model's weights, or their average, as validated
        best = validated_weights(checkpoint_dir(output_dir) / state.best_checkpoint)
        (run.ema.module if run.ema else accelerator.unwrap_model(run.model)).load_state_dict(best)
    test_stats = evaluate_model(
        accelerator,
        run.eval_model,
        run.test_loader,
        run.eval_transform,
        run.metric,
        run.config.tta,
        run.config.tta_below_confidence,
    )
    test_scalars = {"test/loss": test_stats["loss"], "test/accuracy": test_stats["accuracy"]}
    accelerator.log(test_scalars, step=state.global_step)
    results = run_results(run, test_stats)
    card_written = False
    try:
        export_weights(accelerator, run.eval_model, output_dir)
        if accelerator.is_main_process:
            write_atomic(output_dir / RESULTS_FILE, json.dumps(results.to_dict(), indent=2))
            card_written = write_model_card(run.config, results, output_dir, run.data.class_names)
            warn_of_earlier_evaluations(output_dir)
    except RunFault as err:  # the checkpoints hold the finished run: its resume tests and exports it again
        raise RunFault(f"{err}, then resume with --resume_from_checkpoint latest to test and export again") from None
    log_final_pictures(run, test_stats, results)
    tested = (
        f"best validation {results.best_val_accuracy:.4f} at epoch {results.best_epoch}"
        if state.best_checkpoint is not None
        else f"the weights of the last epoch, {state.epoch}; no validation"
    )
    card = "the model card (README.md), " if card_written else ""
    logger.info(
        f"test accuracy {results.test_accuracy:.4f} ({tested}); model.safetensors, results.json, {card}config.yaml, "
        f"checkpoints/ and logs/ are in {output_dir.resolve()}"
    )
    return results


def log_final_pictures(run: Run, test: dict[str, Any], results: RunResults) -> None:
    """TensorBoard: the confusion matrix, per-class accuracy and confident mistakes of the final test, and the
    config with the test accuracy in the HParams panel."""
    writer = tensorboard_writer(run.accelerator)
    if writer is None:
        return
    class_names = run.data.class_names
    report = classification_report(test["predictions"].cpu(), test["references"].cpu(), class_names)
    log_test_pictures(writer, report, test, run.data.test.images, class_names, step=run.state.global_step)
    metrics = {k: getattr(results, k) for k in ("test_accuracy", "test_accuracy_no_tta", "test_loss")}
    log_hparams(writer, tracker_config(run.config), metrics)


def log_augmented_batch(run: Run) -> None:
    """TensorBoard, at the start of a new run: a batch of training images as stored and as the training step gets
    them (augmented by the training transform; drawn from a forked RNG, so training's random numbers are
    untouched)."""
    writer = tensorboard_writer(run.accelerator)
    if writer is None or run.state.global_step:
        return
    device = run.accelerator.device
    images, labels = (t[:AUGMENTED_IMAGES] for t in (run.data.train.images, run.data.train.labels))
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        augmented, _ = run.train_transform(images.to(device), labels.to(device), 0, run.num_epochs)
    log_augmentation(writer, images, augmented, run.data.normalization)


def open_run_outputs(run: Run) -> Path | None:
    """The run's first writes, once every input check has passed: set an earlier run aside (with
    --overwrite_output_dir; returns where), clear partial checkpoints, write config.yaml and labels.json, and
    start the trackers."""
    accelerator, config, output_dir = run.accelerator, run.config, run.output_dir
    replaced = None
    if accelerator.is_main_process:
        if config.overwrite_output_dir and starts_a_history(config, output_dir):
            replaced = set_aside_earlier_run(output_dir)
            if replaced is not None:
                logger.info(f"--overwrite_output_dir: the earlier run waits in {replaced} until the first checkpoint")
        remove_discarded_runs(output_dir)
        remove_partial_checkpoints(output_dir)
        if run.last_checkpoint is not None:
            adopt_best_checkpoint(run.last_checkpoint, run.state, output_dir)
        write_atomic(output_dir / CONFIG_FILE, config_yaml(config))
        write_atomic(output_dir / LABELS_FILE, json.dumps({"class_names": run.data.class_names}, indent=2))
        write_atomic(output_dir / PREPROCESSING_FILE, json.dumps(run.data.normalization.to_dict(), indent=2))
        (output_dir / LOGS_DIR).mkdir(exist_ok=True)
    accelerator.wait_for_everyone()
    start_trackers(accelerator, config, output_dir, run.state.global_step)
    log_augmented_batch(run)
    return replaced


def run_training(
    config: TrainConfig,
    precision_source: str,
    train_pipeline: TrainPipeline = batch_pipeline,
    bookkeeper_type: type[RunBookkeeper] = RunBookkeeper,
) -> RunResults:
    """Set up the run, train it epoch by epoch, then test and export; returns what results.json holds.

    A SIGINT, SIGTERM or SIGHUP stops the set-up at once, since nothing is written yet; from the first write on, it
    stops the run after the current optimizer step with a checkpoint, or, once the last one is done, after the final
    test and export.
    """
    with StopRequest() as stop:
        trackers = requested_trackers(config.report_to)
        check_trackers(trackers, Path(config.output_dir))
        check_dataset_path(config.dataset_name)
        with writable_output_dir(Path(config.output_dir), reads=config.dataset_name) as output_dir:
            check_hub_settings(config, output_dir)  # after the folder's checks: it may make the Hub repository
            accelerator = build_accelerator(config, output_dir, trackers)
            with exclusive_output_dir(accelerator, output_dir):
                run = set_up_run(config, accelerator, output_dir, precision_source, train_pipeline)
                stop.defer()
                with trackers_ended_with_the_run(accelerator):
                    replaced = open_run_outputs(run)
                    books = bookkeeper_type(run, stop, replaced)
                    try:
                        train_epochs(run, books)
                        results = finish_run(run)
                        stopping = stop.requested(accelerator)
                        accelerator.end_training()  # flushes the trackers, ends the process group of several processes
                    except OSError as err:  # a write of the trackers
                        raise tracker_write_fault(err, output_dir, books.last_checkpoint) from None
                if config.push_to_hub and accelerator.is_main_process and not stopping:
                    logger.info(f"pushed {output_dir} to the Hub: {push_to_hub(config, output_dir)}")
                if stopping:
                    raise Stopped(
                        f"stopped by {stop.name} as the run was finishing, which it did first: "
                        f"results.json and model.safetensors are in {output_dir}",
                        exit_code=stop.exit_code,
                    )
                return results


def main(
    argv: Sequence[str],
    train_pipeline: TrainPipeline = batch_pipeline,
    bookkeeper_type: type[RunBookkeeper] = RunBookkeeper,
) -> None:
    config, precision_source = load_config(argv)
    # Logs and progress go to stdout; stderr is kept for the one-line error of the exit-code contract. The main
    # process logs the package's own INFO lines; other libraries (Accelerate's per-file checkpoint messages,
    # matplotlib's notes), and the other processes, only warnings.
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S", stream=sys.stdout)
    if launched_rank() == 0:
        for name in ("cifar_accel", __name__):  # __name__ is __main__ under `python -m`
            logging.getLogger(name).setLevel(logging.INFO)
    keep_freed_memory()
    run_training(config, precision_source, train_pipeline, bookkeeper_type)


def cli() -> None:
    exit_command(main)


if __name__ == "__main__":
    cli()
