"""Checkpoints on top of ``accelerator.save_state`` / ``load_state``, with the trainer state as JSON.

A checkpoint is ``<output_dir>/checkpoints/step_NNNNNNNN/`` (named by optimizer
step): Accelerate's files (model weights as safetensors, optimizer, scheduler,
GradScaler, RNG states, sampler) plus ``trainer_state.json``, which holds the
progress as plain data; nothing of ours is pickled. A checkpoint is written
under a temporary name and renamed once complete, so a folder with the final
name is always whole.
"""

from __future__ import annotations

import dataclasses
import json
import shlex
import shutil
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from accelerate import Accelerator
from accelerate.utils import load as load_pickled

from cifar_accel.averaging import EMA_FILE, WeightAverage, load_ema, save_ema
from cifar_accel.config import FIELDS, TrainConfig, as_flags, dataset_location
from cifar_accel.errors import InputError, RunFault, counted, one_line
from cifar_accel.outputs import (
    CHECKPOINT_NAME,
    CHECKPOINTS_DIR,
    CONFIG_FILE,
    STATE_FILE,
    WEIGHTS_FILE,
    checkpoint_dir,
    complete_checkpoints,
    is_own_checkpoint,
)
from cifar_accel.schema import from_json
from cifar_accel.state import TrainerState, checkpoint_name

# Settings a resume must keep that a checkpoint with a data signature checks by the data's content instead.
CHECKED_BY_CONTENT = frozenset({"dataset_name"})
PARTIAL_PREFIX = ".partial-"


class CheckpointSaveError(RunFault):
    """A checkpoint could not be written (for example, the disk is full); earlier ones are untouched."""


def config_fingerprint(config: TrainConfig, mixed_precision: str) -> dict[str, Any]:
    """The config values a resume must share with the checkpoint: the fields whose metadata says
    ``resume="match"``, with the precision that was in effect rather than the one requested."""
    values = {name: getattr(config, name) for name, f in FIELDS.items() if f.metadata["resume"] == "match"}
    return {**values, "mixed_precision": mixed_precision}


def checkpoints_within(folder: Path) -> list[Path]:
    """The complete checkpoints of ``folder`` taken as a run folder, or as a run's checkpoints folder (named where
    one checkpoint was meant), oldest first."""
    return complete_checkpoints(folder if folder.name != CHECKPOINTS_DIR else folder.parent)


def remove_partial_checkpoints(output_dir: str | Path) -> None:
    """Delete checkpoints whose writing was cut off (by a crash or a kill)."""
    root = checkpoint_dir(output_dir)
    for partial in root.glob(f"{PARTIAL_PREFIX}*") if root.is_dir() else []:
        shutil.rmtree(partial)


def save_checkpoint(
    accelerator: Accelerator, output_dir: str | Path, state: TrainerState, keep: int, ema: WeightAverage | None = None
) -> Path:
    """Save the full training state (with the weight average, if any); keep the newest ``keep`` checkpoints and
    the best one."""
    final = checkpoint_dir(output_dir) / checkpoint_name(state.global_step)
    partial = final.with_name(PARTIAL_PREFIX + final.name)  # leftovers of killed runs go at start-up
    try:
        accelerator.save_state(str(partial))
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            if ema is not None:
                save_ema(ema, partial)
            (partial / STATE_FILE).write_text(json.dumps(dataclasses.asdict(state), indent=2))
    except Exception as err:  # torch.save, safetensors and json each report a full disk in their own way
        shutil.rmtree(partial, ignore_errors=True)
        previous = complete_checkpoints(output_dir)
        kept = f"the previous checkpoint {previous[-1]} is intact" if previous else "no earlier checkpoint exists"
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        if "unexpected pos" in reason:  # torch's zip writer on a short write: "[enforce fail at ...] unexpected pos"
            reason = f"a write fell short, so the disk is likely full: {reason}"
        raise CheckpointSaveError(
            f"saving checkpoint {final.name} failed ({reason}); {kept}; free space and resume with "
            "--resume_from_checkpoint latest"
        ) from err
    if accelerator.is_main_process:
        if final.exists():  # a run stopped on an epoch's last batch, resumed: that step is saved again at its end
            shutil.rmtree(final)
        partial.rename(final)
        for old in complete_checkpoints(output_dir)[:-keep]:
            if old.name != state.best_checkpoint:
                shutil.rmtree(old)
    accelerator.wait_for_everyone()
    return final


def adopt_best_checkpoint(resumed_from: Path, state: TrainerState, output_dir: Path) -> None:
    """A run resumed from another folder's checkpoint (a fork) copies that run's best checkpoint into its own
    folder, where its final test and its own checkpoints, which name it, look for it."""
    if state.best_checkpoint is None:
        return
    target = checkpoint_dir(output_dir) / state.best_checkpoint
    if target.exists():  # resumed in its own folder
        return
    partial = target.with_name(PARTIAL_PREFIX + target.name)
    try:
        shutil.copytree(resumed_from.parent / state.best_checkpoint, partial)
        partial.rename(target)
    except OSError as err:
        shutil.rmtree(partial, ignore_errors=True)
        raise RunFault(
            f"copying the best checkpoint {resumed_from.parent / state.best_checkpoint} into {target.parent} failed "
            f"({err.strerror or err}); free space there and run again"
        ) from None


def resolve_checkpoint(spec: str, output_dir: str | Path) -> tuple[Path, TrainerState]:
    """The checkpoint folder named by ``--resume_from_checkpoint`` (a path, or 'latest'; the run has resolved
    'auto' before), with its checked trainer state."""
    if spec == "latest":
        found = complete_checkpoints(output_dir)
        if not found:
            raise InputError(
                f"no complete checkpoint in {checkpoint_dir(output_dir)}; start without --resume_from_checkpoint (or "
                "with 'auto', which starts a new run where there is no checkpoint)"
            )
        path = found[-1]
    else:
        path = Path(spec)
        if path.exists() and not path.is_dir():
            raise InputError(
                f"'{spec}' is a file, where a resume needs a checkpoint folder (a run's checkpoints/step_N, with the "
                "optimizer's state); pass one, 'latest' or 'auto'"
            )
        if not path.is_dir():
            raise InputError(f"checkpoint '{spec}' does not exist; pass a checkpoint folder, 'latest' or 'auto'")
        if not (path / STATE_FILE).is_file():
            inside = checkpoints_within(path)
            if inside:
                raise InputError(
                    f"'{spec}' holds checkpoints but is not one; pass one, such as the newest: {inside[-1]}"
                )
            raise InputError(
                f"'{spec}' is not a complete checkpoint (it has no {STATE_FILE}, which a checkpoint's writing ends "
                "with); pass a checkpoint folder (a run's checkpoints/step_N), 'latest' or 'auto'"
            )
    return path, read_trainer_state(path)


def read_trainer_state(path: Path) -> TrainerState:
    """The trainer state of checkpoint ``path``, checked before it is used: every field and epoch record against
    its definition (``state.py``), then the fields against each other and the folders beside it."""

    def invalid(problem: str) -> InputError:
        return InputError(
            f"checkpoint '{path}' has an invalid {STATE_FILE} ({problem}); resume from another checkpoint"
        )

    try:
        data = json.loads((path / STATE_FILE).read_text())
    except (OSError, ValueError) as err:
        raise InputError(
            f"checkpoint '{path}' has an unreadable {STATE_FILE} ({one_line(err)[:200]}); resume from another "
            "checkpoint"
        ) from None
    totals = data.get("epoch_totals") if isinstance(data, dict) else None
    if isinstance(totals, list) and len(totals) == 3 and not any(isinstance(t, list) for t in totals):
        processes = data.get("num_processes") if type(data.get("num_processes")) is int else 1
        data["epoch_totals"] = [totals] + [[0.0] * 3] * (processes - 1)  # the sum of all, as once written
    state = from_json(TrainerState, data, invalid)
    match = CHECKPOINT_NAME.match(path.name)
    problem = state.consistency_problem(
        int(match.group(1)) if match else None,
        lambda name: bool(CHECKPOINT_NAME.match(name)) and (path.parent / name / STATE_FILE).is_file(),
    )
    if problem:
        raise invalid(problem)
    return state


def check_checkpoint_files(
    accelerator: Accelerator, path: Path, state: TrainerState, ema: WeightAverage | None = None
) -> None:
    """Every file a resume reads must be there and load as plain data: the weights (safetensors), optimizer,
    scheduler, the RNG state of each process that saved it, and the GradScaler when this run has one. Pickled
    files are read with ``weights_only=True``, so a file whose unpickling would run code is refused."""

    def numbered(stem: str, count: int, suffix: str) -> list[str]:  # Accelerate's names: x, x_1, x_2, ...
        return [f"{stem}{f'_{i}' if i else ''}{suffix}" for i in range(count)]

    names = [
        *numbered("model", len(accelerator._models), ".safetensors"),
        *numbered("optimizer", len(accelerator._optimizers), ".bin"),
        *numbered("scheduler", len(accelerator._schedulers), ".bin"),
        *(f"random_states_{rank}.pkl" for rank in range(state.num_processes)),
    ]
    if accelerator.scaler is not None:
        names.append("scaler.pt")
    if ema is not None:
        names.append(EMA_FILE)
    for name in names:
        file = path / name
        if not file.is_file():
            raise InputError(f"checkpoint '{path}' is incomplete: {name} is missing; resume from another checkpoint")
        read_checked(file, state)


def read_checked(file: Path, state: TrainerState) -> Any:
    """The contents of checkpoint file ``file`` (safetensors, or a pickle read with ``weights_only=True``), once
    ``value_problem`` finds nothing wrong with them; else one InputError naming the file."""
    checkpoint, name = file.parent, file.name
    try:
        saved = (
            safetensors.torch.load_file(file)
            if name.endswith(".safetensors")
            else load_pickled(file, weights_only=True)
        )
    except Exception as err:  # noqa: BLE001 - torch and safetensors raise many kinds for a bad file
        raise InputError(
            f"checkpoint '{checkpoint}': {name} cannot be read as plain tensors and numbers ({type(err).__name__}: "
            f"{one_line(err)[:200]}); it is damaged or unsafe, use another checkpoint"
        ) from None
    if problem := value_problem(name, saved, state):
        raise InputError(f"checkpoint '{checkpoint}': {name} {problem}; it is damaged, use another checkpoint")
    return saved


def value_problem(name: str, saved: object, state: TrainerState) -> str | None:
    """What is wrong with the values of a checkpoint file, or None: a run saves nothing non-finite (the weights,
    their average, the optimizer's moments), and the weight average has been updated once per optimizer step."""
    tensors = [saved] if isinstance(saved, torch.Tensor) else []
    pending = [saved]
    while pending:  # the tensors inside nested dicts and lists (an optimizer's state)
        item = pending.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, (list, tuple)) else []
        for child in children:
            (tensors if isinstance(child, torch.Tensor) else pending).append(child)
    if any(t.is_floating_point() and not bool(torch.isfinite(t).all()) for t in tensors):
        return "holds non-finite values (NaN or infinity)"
    if name == EMA_FILE:
        updates = saved.get("n_averaged")
        counted = None if updates is None or updates.numel() != 1 or updates.is_floating_point() else int(updates)
        if counted != state.global_step:
            return (
                f"counts {counted} updates of the weight average, but the checkpoint is of optimizer step "
                f"{state.global_step}, and the average is updated at each"
            )
    return None


def validated_weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The weights that were validated when ``checkpoint`` was saved: the weight average's (``ema.safetensors``)
    in a run that kept one, else the model's; checked as a resume checks them."""
    name = EMA_FILE if (checkpoint / EMA_FILE).is_file() else WEIGHTS_FILE
    saved = read_checked(checkpoint / name, read_trainer_state(checkpoint))
    if name == EMA_FILE:  # AveragedModel's state: the averaged module's, under 'module.', and its update count
        return {key.removeprefix("module."): value for key, value in saved.items() if key.startswith("module.")}
    return saved


def check_resume(path: Path, state: TrainerState, fingerprint: dict[str, Any], num_processes: int) -> None:
    """Refuse a checkpoint made with another config (see ``config_fingerprint``), or saved mid-epoch by another
    number of processes. A checkpoint that records its data's signature is checked by that once the data is
    loaded (``check_resumed_data``), not by where the dataset was, so a moved copy resumes."""
    # A field added after the checkpoint was written ran with its default there.
    saved = {
        key: state.config_fingerprint.get(key, FIELDS[key].default if key in FIELDS else None) for key in fingerprint
    }
    saved["dataset_name"] = dataset_location(saved["dataset_name"])  # recorded as typed before it was made absolute
    checked_later = CHECKED_BY_CONTENT if state.data_signature else frozenset()
    differing = [key for key, value in fingerprint.items() if saved[key] != value and key not in checked_later]
    if differing:
        differences = "; ".join(f"{key}: checkpoint {saved[key]!r}, now {fingerprint[key]!r}" for key in differing)
        settings = path.parent.parent / CONFIG_FILE  # the effective config of the run that saved the checkpoint
        all_of_them = (
            f"; all of the run's are in {shlex.quote(str(settings))}, for --config" if settings.is_file() else ""
        )
        raise InputError(
            f"checkpoint '{path}' was made with a different config ({differences}); resume with its settings "
            f"({as_flags({key: saved[key] for key in differing})}{all_of_them}), or start a new --output_dir"
        )
    if state.num_processes != num_processes and state.step_in_epoch:
        saved_by = counted(state.num_processes, "process", "processes")
        raise InputError(
            f"checkpoint '{path}' was saved mid-epoch by {saved_by} and cannot continue that epoch with "
            f"{num_processes}; resume it with {saved_by}, or resume an "
            "epoch-end checkpoint"
        )


def check_resumed_in_place(path: Path, output_dir: Path) -> None:
    """Refuse a checkpoint of ``output_dir`` itself that later checkpoints there follow: the resumed run would save
    a second history over theirs (other weights, where a flag a resume may change differs), and 'latest' would mix
    the two. A checkpoint of another folder is a fork, which writes only into its own."""
    if not is_own_checkpoint(path, output_dir):
        return
    names = [checkpoint.name for checkpoint in complete_checkpoints(output_dir)]  # oldest first
    later = names[names.index(path.name) + 1 :] if path.name in names else []  # a folder of another name
    if later:
        raise InputError(
            f"checkpoint '{path}' is not the newest of {output_dir} ({later[-1]} is), and resuming it there would "
            "save a second history over the later ones; resume it with another --output_dir (a fork of the run), or "
            f"remove the later checkpoints first: rm -r {shlex.join(str(path.parent / name) for name in later)}"
        )


def check_resumed_data(path: Path, state: TrainerState, signature: str, dataset_name: str) -> None:
    """Refuse data other than the checkpoint's: other images, labels, classes or split (a checkpoint without a
    signature was checked by the dataset's path)."""
    if state.data_signature not in (None, signature):
        raise InputError(
            f"checkpoint '{path}' was trained on other data than '{dataset_name}' holds now (its images, labels or "
            "classes differ); resume with the dataset it was trained on, or start a new --output_dir"
        )


def check_resumed_epochs(path: Path, state: TrainerState, num_train_epochs: int) -> None:
    """Refuse --num_train_epochs below the epochs a checkpoint has trained (or started): the run cannot go back,
    and its config.yaml would record fewer epochs than its results."""
    started = state.epoch + (1 if state.step_in_epoch else 0)
    if num_train_epochs < started:
        done = counted(state.epoch, "epoch") + (
            f" and {counted(state.step_in_epoch, 'batch', 'batches')}" if state.step_in_epoch else ""
        )
        raise InputError(
            f"checkpoint '{path}' has trained {done}, more than --num_train_epochs {num_train_epochs}; resume with "
            f"--num_train_epochs {started} or more, or evaluate the run as it is with 'python -m cifar_accel.evaluate "
            f"--model {shlex.quote(str(path))}'"
        )


def load_checkpoint(
    accelerator: Accelerator, path: Path, state: TrainerState, ema: WeightAverage | None = None
) -> None:
    """Restore everything ``save_checkpoint`` wrote into the prepared objects, after checking every file."""
    check_checkpoint_files(accelerator, path, state, ema)
    try:
        accelerator.load_state(str(path), load_kwargs={"weights_only": True})
        if ema is not None:
            load_ema(ema, path)
    except Exception as err:  # noqa: BLE001 - any failure here means the files are damaged
        raise InputError(
            f"checkpoint '{path}' cannot be loaded ({type(err).__name__}: {one_line(err)[:200]}); it is damaged, "
            "use another checkpoint"
        ) from None
