"""The one training config: defaults, YAML files, command-line flags and validation.

Every field of ``TrainConfig`` is a flag of the same name; its help text,
aliases and allowed range live in the field's metadata, so there is one
source for all of them. Values are merged as: defaults < ``--config`` file <
flags, except ``mixed_precision`` (see ``resolve_mixed_precision``).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shlex
import stat
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
import yaml
from accelerate.utils import parse_flag_from_env

from cifar_accel.errors import ArgumentParser, InputError, not_text, path_problem, suggest
from cifar_accel.images import IMAGE_SIZE
from cifar_accel.models import MODELS
from cifar_accel.schema import check_value, quote

Precision = Literal["no", "fp16", "bf16"]
TestTimeAugmentation = Literal["none", "flip", "flip_translate"]
PER_STEP_SCHEDULES = ("linear", "cosine_steps")  # the lr_scheduler_type values that step per optimizer step
ModelName = Literal[tuple(MODELS)]  # the registry's names (cifar_accel/models)
PRESETS_DIR = Path(__file__).parent / "configs"  # the packaged config files, selectable by name with --config
DEFAULT_CONFIG_FILE = PRESETS_DIR / "default.yaml"
CONFIG_FILE = "config.yaml"  # the effective config a run writes into its folder (config_yaml)
CONFIG_HEADER = "# The effective config of a cifar_accel training run"  # how a run's config.yaml is told from a user's
SECRET_FIELD = "hub_token"  # never shown: not in config.yaml, the log, the trackers, nor an error line
# How one command starts (from a checkpoint, over an earlier run), not a setting of the run: a run's config.yaml
# records their defaults, and one that recorded the command's (written before) is read without them, so that
# --config RUN/config.yaml starts a run set as that one, and resumes only where --resume_from_checkpoint says so.
STARTING_FIELDS = ("overwrite_output_dir", "resume_from_checkpoint")


# What a resumed run may do with a field: keep it as the checkpoint has it, or change it.
Resume = Literal["match", "may_change"]


def _field(
    default: Any,
    help: str,
    *,
    resume: Resume,
    aliases: tuple[str, ...] = (),
    pattern: tuple[str, str] | None = None,
    path: bool = False,
    plumbing: bool = False,
    **bounds: float,
) -> Any:
    """A config field: help text, what a resume may do with it, extra flag names, bounds (ge, gt, le, lt), for
    strings a (regular expression, description) pair the value must match, whether it is a path (or a name the run
    makes a folder of), and whether it is plumbing.

    ``resume="match"`` puts the field in the checkpoint's fingerprint: it changes shapes, the data split or
    order, or what the restored optimizer and scheduler compute, so a resume with another value is refused.
    ``plumbing=True``: the field says where a run goes and how it starts, not what it computes, so two runs
    that differ only there are the same experiment (``compare`` reuses one for the other).
    """
    metadata = {
        "help": help,
        "resume": resume,
        "aliases": aliases,
        "pattern": pattern,
        "path": path,
        "bounds": bounds,
        "plumbing": plumbing,
    }
    return field(default=default, metadata=metadata)


# The largest learning rate, learning-rate multiple and brightness shift taken: far beyond any that trains, and far
# enough below float32's largest number that the products the optimizers and augmentation make of them stay in it.
MAX_RATE = 1_000_000

MIN_EARLY_CROP = IMAGE_SIZE // 2  # --early_crop_size: the smallest window every model pools down to one value


@dataclass
class TrainConfig:
    # Data
    dataset_name: str = _field(
        "uoft-cs/cifar10",
        "Hub dataset id, or a local path that datasets.load_dataset reads (Hub-layout folder, parquet, image folder); "
        "the run records a local path as an absolute one.",
        resume="match",
        path=True,
    )
    image_column_name: str | None = _field(
        None, "Image column; default: the dataset's first Image column.", resume="match"
    )
    label_column_name: str | None = _field(
        None, "Label column; default: the first ClassLabel column, else 'label'.", resume="match"
    )
    normalization: Literal["auto", "computed", "cifar10"] = _field(
        "auto",
        "Per-channel mean and std the inputs are normalised with: 'computed' from the training split (cached with "
        "the decoded images), 'cifar10' (CIFAR-10's published constants), or 'auto': cifar10 for a dataset whose "
        "classes are CIFAR-10's ten, else computed. Saved with the run (preprocessing.json).",
        resume="match",
    )
    val_ratio: float = _field(
        0.1,
        "Fraction of the train split held out for validation (seeded), where the dataset has no 'validation' split "
        "of its own; 0 trains on all of the train split, with no validation and no early stopping, and tests the "
        "final weights.",
        resume="match",
        aliases=("--train_val_split",),
        ge=0,
        lt=1,
    )
    max_train_samples: int | None = _field(
        None,
        "Use only the first N examples of the train split, in the dataset's order (an image folder's come class by "
        "class), before the validation split.",
        resume="match",
        ge=1,
    )
    max_eval_samples: int | None = _field(
        None, "Use only the first N validation and N test examples.", resume="may_change", ge=1
    )
    augment: bool = _field(
        True, "Augment the training batches as the next flags say; --no-augment turns all of it off.", resume="match"
    )
    crop_padding: int = _field(
        4,
        "Random translation: pad by N pixels and crop back to 32x32 at a random place; 0 turns it off.",
        resume="match",
        ge=0,
        le=16,
    )
    early_crop_size: int = _field(
        0,
        "Train the first --early_crop_epochs epochs on random N x N windows of the padded images, which cost "
        "about (N/32)^2 of the full images' compute (fast_net: N of 24 about half); 0: the full size throughout.",
        resume="match",
        ge=0,
        le=IMAGE_SIZE - 1,
    )
    early_crop_epochs: int = _field(
        0,
        "How many of the first epochs train on windows of --early_crop_size; never the run's last, which trains on "
        "whole images.",
        resume="match",
        ge=0,
    )
    padding_mode: Literal["zeros", "reflect"] = _field(
        "zeros", "What the translation shifts in: black pixels, or the image's reflection.", resume="match"
    )
    flip: Literal["random", "alternate", "none"] = _field(
        "random",
        "Horizontal flip: each image with probability 1/2 each time, or mirrored in every other epoch "
        "from a random first epoch (alternate), or never.",
        resume="match",
    )
    color_jitter: bool = _field(
        True, "Colour jitter (brightness, contrast, saturation 0.2, hue 0.1) on training batches.", resume="match"
    )
    brightness_shift: float = _field(
        0.0,
        "Add a random amount in [-B, B] to each normalised training image (hiverge/cifar10-speedrun's brightness); "
        "0 turns it off.",
        resume="match",
        ge=0,
        le=MAX_RATE,
    )
    contrast_scale: float = _field(
        0.0,
        "Then multiply each normalised training image by a random factor in [1 - C, 1 + C] "
        "(hiverge/cifar10-speedrun's contrast); 0 turns it off.",
        resume="match",
        ge=0,
        lt=1,
    )
    mixup_alpha: float = _field(
        0.0,
        "MixUp: mix pairs of training images and their labels with a Beta(alpha, alpha) weight; 0 turns it off.",
        resume="match",
        ge=0,
    )
    cutmix_alpha: float = _field(
        0.0,
        "CutMix: paste a box of another training image, labels mixed by area; 0 turns it off. With MixUp too, "
        "each batch gets one of the two.",
        resume="match",
        ge=0,
    )

    # Model and optimisation
    model_name: ModelName = _field("simple_cnn", "Model architecture.", resume="match", aliases=("--model",))
    num_train_epochs: int = _field(
        30,
        "Number of training epochs. A resume may raise it to extend a finished run (not with the cosine schedule, "
        "whose period it is).",
        resume="may_change",
        aliases=("--epochs",),
        ge=1,
    )
    max_train_steps: int | None = _field(
        None,
        "Train this many optimizer steps in all, instead of --num_train_epochs whole epochs: the last epoch stops "
        "part way where the steps end there. A per-step schedule decays over these steps.",
        resume="match",
        ge=1,
    )
    per_device_train_batch_size: int = _field(
        64, "Training batch size per process.", resume="match", aliases=("--batch_size", "--batch-size"), ge=1
    )
    per_device_eval_batch_size: int = _field(500, "Evaluation batch size per process.", resume="may_change", ge=1)
    optimizer: Literal["adam", "adamw", "sgd", "muon"] = _field(
        "adam",
        "Optimizer. muon: Muon (momentum, then a Newton-Schulz orthogonalisation of the step) on the "
        "conv filter banks, SGD (--momentum, --nesterov, --weight_decay) on every other parameter.",
        resume="match",
    )
    learning_rate: float = _field(
        1e-3,
        "Learning rate (the peak of a per-step schedule).",
        resume="match",
        aliases=("--lr",),
        gt=0,
        le=MAX_RATE,
    )
    scale_lr: bool = _field(
        False,
        "Multiply the learning rate by processes x accumulation steps (linear scaling with the global batch).",
        resume="match",
    )
    momentum: float = _field(0.9, "SGD momentum.", resume="match", ge=0, lt=1)
    nesterov: bool = _field(False, "SGD (and Muon) with Nesterov momentum.", resume="match")
    muon_learning_rate: float = _field(
        0.24,
        "Muon: learning rate of the conv filter banks (each renormalised to norm sqrt(output channels) before "
        "its step); the schedule scales it as it scales --learning_rate, --scale_lr leaves it.",
        resume="match",
        gt=0,
        le=MAX_RATE,
    )
    muon_momentum: float = _field(0.6, "Muon: momentum of the conv filter banks.", resume="match", ge=0, lt=1)
    muon_ns_steps: int = _field(
        5, "Muon: Newton-Schulz iterations that orthogonalise each update.", resume="match", ge=1, le=10
    )
    muon_ns_dtype: Literal["float32", "bfloat16"] = _field(
        "float32",
        "Muon: the dtype of the Newton-Schulz iterations (bfloat16 is fast on CPUs with AVX-512 BF16 or AMX, "
        "and on recent GPUs).",
        resume="match",
    )
    whiten_bias_epochs: float = _field(
        0,
        "fast_net: train the whitening convolution's bias for this many epochs (a fraction is rounded to whole "
        "optimizer steps, at least one), its learning rate decaying linearly to 0 over them, then keep it (a "
        "single process stops computing its gradient then); 0 trains it throughout, on the run's schedule. Needs "
        "a per-step schedule.",
        resume="match",
        ge=0,
    )
    bias_lr_scale: float = _field(
        64.0,
        "fast_net: the biases' learning rate as a multiple of --learning_rate, their weight decay divided by it "
        "(so that the decay per step stays the same).",
        resume="match",
        gt=0,
        le=MAX_RATE,
    )
    weight_decay: float = _field(
        0.0,
        "Weight decay (coupled for adam and sgd, decoupled for adamw), scaled per parameter group by the model.",
        resume="match",
        ge=0,
    )
    label_smoothing: float = _field(0.0, "Label smoothing of the training loss.", resume="match", ge=0, lt=1)
    lr_scheduler_type: Literal["step", "cosine", "linear", "cosine_steps"] = _field(
        "step",
        "Schedule. Per epoch: StepLR, or cosine annealing to zero over --num_train_epochs. Per optimizer "
        "step: a linear warm-up (--warmup_ratio, from --lr_start_factor), then a linear or cosine decay to "
        "--lr_end_factor.",
        resume="match",
        aliases=("--scheduler",),
    )
    warmup_ratio: float = _field(
        0.0, "Per-step schedules: fraction of the steps spent warming up.", resume="match", ge=0, lt=1
    )
    lr_start_factor: float = _field(
        0.0,
        "Per-step schedules: the learning rate at step 0, as a fraction of --learning_rate.",
        resume="match",
        ge=0,
        le=1,
    )
    lr_end_factor: float = _field(
        0.0,
        "Per-step schedules: the learning rate at the last step, as a fraction of --learning_rate.",
        resume="match",
        ge=0,
        le=1,
    )
    lr_step_size: int = _field(15, "StepLR: epochs between learning-rate drops.", resume="match", ge=1)
    lr_gamma: float = _field(0.1, "StepLR: factor applied at each drop.", resume="match", gt=0, le=1)
    early_stopping_patience: int = _field(
        7,
        "Stop after this many epochs without a better validation accuracy; 0 turns it off.",
        resume="may_change",
        aliases=("--patience",),
        ge=0,
    )
    max_grad_norm: float | None = _field(
        None, "Clip the total gradient norm to this value (after unscaling).", resume="may_change", gt=0
    )
    gradient_accumulation_steps: int = _field(1, "Batches accumulated per optimizer step.", resume="match", ge=1)
    seed: int = _field(
        42,
        "Seed for the weights, the validation split, data order and augmentation.",
        resume="match",
        ge=0,
        le=2**32 - 1,
    )

    ema_decay: float = _field(
        0.0,
        "Exponential moving average of the weights, used for validation, test and model.safetensors; 0 turns "
        "it off. The decay warms up as min(decay, (1 + n) / (10 + n)) over the first updates.",
        resume="match",
        ge=0,
        lt=1,
    )
    tta: TestTimeAugmentation = _field(
        "none",
        "Test-time augmentation for the final test: none, flip (with the mirror image), or flip_translate "
        "(also 1-pixel shifts); results.json gives the accuracy without it too.",
        resume="may_change",
    )
    tta_below_confidence: float = _field(
        1.0,
        "Apply --tta only to the test images whose plain prediction has a probability below this "
        "(hiverge/cifar10-speedrun's selective TTA); 1 augments every image.",
        resume="may_change",
        gt=0,
        le=1,
    )

    # Hardware and precision
    mixed_precision: Precision | None = _field(
        None,
        "no, fp16 or bf16. Default: accelerate launch's choice, else the config file, else 'no'.",
        resume="match",  # compared as the precision in effect, see checkpoint.config_fingerprint
    )
    channels_last: bool = _field(
        True, "Run convolutions in channels_last memory format (faster on CPU and GPU).", resume="may_change"
    )
    torch_compile: bool = _field(
        False,
        "Compile the model with torch.compile (inductor; on a CPU it needs a C++ compiler). Checkpoints and "
        "model.safetensors stay interchangeable with uncompiled runs.",
        resume="may_change",
    )
    conv_weight_grads: Literal["auto", "kernel", "matmul"] = _field(
        "auto",
        "fast_net in bf16 on a CPU: the weight gradients of its 3x3 convolutions on maps of up to 7x7 from torch's "
        "kernel, or as matrix products ('matmul': the same sums in another order; 1.4x as fast on 7x7 maps and "
        "5x on 3x3 where oneDNN runs the kernel on AMX); 'auto': matmul on a CPU with AMX.",
        resume="may_change",
    )
    cpu: bool = _field(False, "Train on the CPU even when a GPU is present.", resume="may_change")

    max_consecutive_skipped_steps: int = _field(
        25,
        "fp16: stop when the GradScaler skips more than this many optimizer steps in a row.",
        resume="may_change",
        ge=1,
    )

    # Outputs
    output_dir: str = _field(
        "outputs/cifar10",
        "Where checkpoints, logs, model.safetensors and results.json go; a run's own config.yaml given to --config "
        "sets it to that file's folder.",
        resume="may_change",
        path=True,
        plumbing=True,
    )
    overwrite_output_dir: bool = _field(
        False,
        "Allow writing into a folder that already holds another run's results.",
        resume="may_change",
        plumbing=True,
    )
    resume_from_checkpoint: str | None = _field(
        None,
        "A checkpoint folder; 'latest' for the newest one in --output_dir; or 'auto': the newest one if --output_dir "
        "has one, else a new run (one command for a job's first start and its requeues).",
        resume="may_change",
        path=True,
        plumbing=True,
        aliases=("--resume",),
    )
    checkpointing_steps: str = _field(
        "epoch",
        "Save a checkpoint every N optimizer steps, or 'epoch'; one is always saved at each epoch's end.",
        resume="may_change",
        pattern=(r"epoch|[1-9][0-9]*", "'epoch' or a whole number of steps"),
    )
    checkpoints_total_limit: int = _field(
        2, "Keep the newest N checkpoints, plus the best one.", resume="may_change", ge=1
    )
    logging_steps: int = _field(
        100,
        "Every N optimizer steps, log loss, gradient norm, learning rate, loss scale and skipped steps.",
        resume="may_change",
        ge=1,
    )
    profile_steps: int = _field(
        0,
        "Profile N optimizer steps (after 2 more that warm up) with torch.profiler: a trace in <output_dir>/profile/ "
        "and a table of the top operators by self time, with their input dtype and share of the step; 0: off.",
        resume="may_change",
        plumbing=True,
        ge=0,
    )
    report_to: str = _field(
        "tensorboard",
        "Trackers: tensorboard, all (every installed one), none, or Accelerate's tracker names "
        "separated by commas (wandb, mlflow, comet_ml, aim, clearml, dvclive, swanlab, trackio).",
        resume="may_change",
        plumbing=True,
    )
    project_name: str = _field(
        "cifar_accel",
        "The trackers' project (MLflow experiment, W&B project); TensorBoard writes to "
        "<output_dir>/logs/<project_name>.",
        resume="may_change",
        path=True,
        plumbing=True,
        pattern=(r"[\w-][\w.-]*", "letters, digits, '.', '-' and '_', not starting with '.'"),
    )
    run_name: str | None = _field(
        None,
        "The run's name in the trackers and its model card; default: the output folder's name.",
        resume="may_change",
        plumbing=True,
    )
    push_to_hub: bool = _field(
        False,
        "Upload the output folder (weights, config, labels, model card, logs; not the checkpoints) to the "
        "Hugging Face Hub once everything is saved locally.",
        resume="may_change",
        plumbing=True,
    )
    hub_model_id: str | None = _field(
        None,
        "The Hub repository, 'name' or 'user/name'; default: the output folder's name.",
        resume="may_change",
        plumbing=True,
    )
    hub_token: str | None = _field(
        None,
        "A Hub token; default: HF_TOKEN or the cached login. Never written to config.yaml, logs, trackers or errors.",
        resume="may_change",
        plumbing=True,
    )
    hub_private_repo: bool = _field(False, "Create the Hub repository as private.", resume="may_change", plumbing=True)

    def to_dict(self) -> dict[str, Any]:
        """The values, as config.yaml, the log and the trackers show them: without the Hub token."""
        return {**dataclasses.asdict(self), SECRET_FIELD: None}


FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}
_TYPES = typing.get_type_hints(TrainConfig)


class OneConfig(argparse.Action):
    """--config's value, refused when given a second time: argparse would keep the last and drop the first's values
    without a word (a preset, then a file of a few values, trained the default recipe with those)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, value: Any, _: Any = None):
        if hasattr(namespace, self.dest):
            raise InputError(
                f"--config is given twice ('{getattr(namespace, self.dest)}', then '{value}'), and a run "
                "reads one config: give one, and the values to change as flags (or in a copy of its file)"
            )
        setattr(namespace, self.dest, value)


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="cifar_accel.train",
        description="Train a CIFAR-10 classifier with Hugging Face Accelerate.",
        argument_default=argparse.SUPPRESS,
        allow_abbrev=False,
    )
    parser.add_argument(
        "--config",
        action=OneConfig,
        help=f"A packaged preset ({', '.join(preset_names())}) or a YAML file of config values; flags override it.",
    )
    for name, f in FIELDS.items():
        flags = [f"--{name}", *f.metadata["aliases"]]
        kind, choices, _ = _unwrap(_TYPES[name])
        help_text = f"{f.metadata['help']} (default: {f.default})"
        if kind is bool:
            parser.add_argument(*flags, dest=name, action=argparse.BooleanOptionalAction, help=help_text)
        elif _unsettable(name):
            help_text = f"{f.metadata['help']} (default: {f.default}; none unsets it)"
            parser.add_argument(*flags, dest=name, type=_number_or_none(kind), help=help_text)
        else:
            parser.add_argument(*flags, dest=name, type=kind, choices=choices, help=help_text)
    return parser


def _unsettable(name: str) -> bool:
    """Whether the field is a number that may be None, which the flag's value ``none`` sets (unsetting what a config
    file gave); a text field keeps 'none' as text, a name that a column or a run may have."""
    kind, _, optional = _unwrap(_TYPES[name])
    return optional and kind in (int, float)


def _number_or_none(kind: type) -> typing.Callable[[str], int | float | None]:
    """An argparse type for an optional number: ``none`` is None, anything else must be a ``kind``."""

    def convert(value: str) -> int | float | None:
        if value.lower() == "none":
            return None
        try:
            return kind(value)
        except ValueError:
            what = "a whole number" if kind is int else "a number"
            raise argparse.ArgumentTypeError(f"expected {what} or none, not {value!r}") from None

    return convert


def given_flags(argv: typing.Sequence[str]) -> dict[str, Any]:
    """The training flags given in ``argv`` (aliases under their field's name), with their values; others ignored."""
    return vars(build_parser().parse_known_args(argv)[0])


def _unwrap(annotation: Any) -> tuple[type, tuple[str, ...] | None, bool]:
    """(base type, Literal choices or None, whether None is allowed) of a field annotation."""
    optional = False
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        optional = type(None) in args
        (annotation,) = [a for a in args if a is not type(None)]
    if typing.get_origin(annotation) is Literal:
        choices = typing.get_args(annotation)
        return type(choices[0]), choices, optional
    return annotation, None, optional


def _left_over(parser: argparse.ArgumentParser, argv: typing.Sequence[str], word: str) -> str:
    """Why ``word``, a value no flag took, is there, where it follows a text flag and its one value: a list
    (``--report_to tensorboard mlflow``, whose names go with commas) or a path with a space, not quoted. An unknown
    flag (``--bogus``) is no such value."""
    if word.startswith("-"):
        return ""
    position = argv.index(word)
    action = parser._option_string_actions.get(argv[position - 2]) if position >= 2 else None
    if action is None or action.dest not in _TYPES or _unwrap(_TYPES[action.dest])[0] is not str:
        return ""
    flag, value = argv[position - 2], argv[position - 1]
    if action.dest == SECRET_FIELD:
        return f"; {flag} takes one value: quote it if both are meant"
    together = f"{value},{word}" if action.dest == "report_to" else shlex.quote(f"{value} {word}")
    return f"; {flag} takes one value, '{value}' here: give {flag} {together} if both are meant"


FLOAT32 = torch.finfo(torch.float32)  # a hyperparameter outside its range overflows, or rounds to 0, in a tensor
INT64 = torch.iinfo(torch.int64)  # a count beyond it fails in torch, numpy and the standard library


def check_field(name: str, value: Any, origin: str) -> Any:
    """Return ``value`` as the field's type, or raise InputError naming ``origin``, the field and what it
    accepts (``schema.check_value``, with the field's bounds, and its pattern for strings)."""
    _, _, optional = _unwrap(_TYPES[name])
    if value is None and not optional:
        raise InputError(f"{origin}: '{name}' must not be empty")
    pattern = FIELDS[name].metadata["pattern"]
    if pattern and isinstance(value, int) and not isinstance(value, bool):
        value = str(value)  # a number of steps written without quotes in YAML

    def invalid(problem: str) -> InputError:
        if name == SECRET_FIELD:  # the problem shows the value
            return InputError(f"{origin}: '{name}' must be a string that is not empty (the value is not shown)")
        return InputError(f"{origin}: {problem}")

    value = check_value(_TYPES[name], value, name, invalid, FIELDS[name].metadata["bounds"])
    if isinstance(value, float) and value != 0 and not FLOAT32.tiny <= abs(value) <= FLOAT32.max:
        raise InputError(
            f"{origin}: '{name}' is {quote(value)}, outside the range of the float32 it is computed in "
            f"({FLOAT32.tiny:.4g} to {FLOAT32.max:.4g} in size, or 0)"
        )
    if isinstance(value, int) and not isinstance(value, bool) and not INT64.min <= value <= INT64.max:
        raise InputError(
            f"{origin}: '{name}' is {value}, beyond the 64-bit integers it is counted in (up to {INT64.max})"
        )
    if pattern and value is not None and not re.fullmatch(pattern[0], value):
        raise InputError(f"{origin}: '{name}' must be {pattern[1]}, not {quote(value)}")
    if FIELDS[name].metadata["path"] and value is not None:
        if problem := path_problem(os.path.expanduser(value)):  # not UTF-8 text (shown), or too long
            raise InputError(f"{origin}: '{name}' {problem}")
    elif isinstance(value, str) and not_text(value):  # config.yaml records it as text; not shown, for SECRET_FIELD
        raise InputError(f"{origin}: '{name}' is not UTF-8 text; give it in UTF-8 characters")
    return value


class DuplicateKeyError(yaml.YAMLError):
    """A mapping gives the same key twice."""

    def __init__(self, key: Any, lines: tuple[int, int]) -> None:
        super().__init__(key, lines)
        self.key, self.lines = key, lines


class ConfigLoader(yaml.SafeLoader):
    """PyYAML's safe loader, with YAML 1.2's booleans and floats where PyYAML follows YAML 1.1: only true and false
    are booleans, so ``mixed_precision: no`` is the string 'no' (1.1 reads False, as it does yes, on and off), and
    ``1e-3`` is a float, as on the command line (1.1 wants a dot and a signed exponent). A key given twice in one
    mapping is refused, as YAML 1.2 says, where PyYAML keeps the last value without a word."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        lines: dict[Any, int] = {}  # key -> the line it was first given on
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *defaults`, whose keys the mapping may override
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                first = lines.get(key)
            except TypeError:  # an unhashable key, which PyYAML refuses with its own message
                continue
            line = key_node.start_mark.line + 1
            if first is not None:
                raise DuplicateKeyError(key, (first, line))
            lines[key] = line
        return super().construct_mapping(node, deep)


ConfigLoader.yaml_implicit_resolvers = {
    first: [(tag, pattern) for tag, pattern in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
ConfigLoader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)
EXPONENT_FLOAT = re.compile(r"^[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)[eE][-+]?[0-9]+$")
ConfigLoader.add_implicit_resolver("tag:yaml.org,2002:float", EXPONENT_FLOAT, list("-+.0123456789"))


class ConfigDumper(yaml.SafeDumper):
    """PyYAML's safe dumper, quoting the strings that ``ConfigLoader`` would read as floats (a --run_name 1e-3)."""


ConfigDumper.add_implicit_resolver("tag:yaml.org,2002:float", EXPONENT_FLOAT, list("-+.0123456789"))

MAX_CONFIG_BYTES = 1 << 20  # a config file is a few hundred bytes; anything near this is not one
MAX_YAML_DEPTH = 8  # our keys take scalars; nesting only ever comes from a wrong file
MAX_YAML_ALIASES = 100
MAX_YAML_VALUES = 10_000  # keys and values, aliases expanded; a config has about 120


def _check_yaml_shape(text: str, path: str | os.PathLike) -> None:
    """Refuse nesting, alias use and sizes that no config needs, before PyYAML builds anything: deep nesting would
    exhaust its recursion, and aliases can expand a small file into a huge structure, so the values are counted
    as they would be expanded."""
    sizes: dict[str, int] = {}  # anchor -> elements of its value, expanded
    open_collections: list[list] = []  # [anchor, elements so far] of each collection being read, innermost last
    total = aliases = 0

    def read(elements: int, anchor: str | None = None) -> None:
        """A value of ``elements`` expanded elements (itself included) was read."""
        nonlocal total
        total += elements
        if total > MAX_YAML_VALUES:
            raise InputError(
                f"config file {path} holds more than {MAX_YAML_VALUES} values once its YAML aliases are "
                "expanded; it must hold a flat mapping of config keys"
            )
        if anchor is not None:
            sizes[anchor] = elements
        if open_collections:
            open_collections[-1][1] += elements

    try:
        for event in yaml.parse(text, Loader=yaml.SafeLoader):
            if isinstance(event, yaml.CollectionStartEvent):
                open_collections.append([event.anchor, 1])
                if len(open_collections) > MAX_YAML_DEPTH:
                    raise InputError(
                        f"config file {path} nests deeper than {MAX_YAML_DEPTH} levels; it must hold a "
                        "flat mapping of config keys"
                    )
            elif isinstance(event, yaml.CollectionEndEvent):
                anchor, elements = open_collections.pop()
                total -= elements - 1  # its elements were counted as they were read, and are counted again here
                read(elements, anchor)
            elif isinstance(event, yaml.ScalarEvent):
                read(1, event.anchor)
            elif isinstance(event, yaml.AliasEvent):
                aliases += 1
                if aliases > MAX_YAML_ALIASES:
                    raise InputError(
                        f"config file {path} uses more than {MAX_YAML_ALIASES} YAML aliases; write the values out"
                    )
                read(sizes.get(event.anchor, 1))
    except yaml.YAMLError:
        return  # safe_load reports the syntax error with its line


def preset_names() -> list[str]:
    return sorted(path.stem for path in PRESETS_DIR.glob("*.yaml"))


def config_path(spec: str) -> Path:
    """The file ``--config`` names: a packaged preset by its name, else a path."""
    if not spec.strip():
        raise InputError(
            f"--config is empty; pass a preset's name ({', '.join(preset_names())}) or the path of a YAML file, or "
            "leave --config out for the default recipe"
        )
    if spec in preset_names():
        return PRESETS_DIR / f"{spec}.yaml"
    path = Path(spec).expanduser()
    if problem := path_problem(str(path)):
        raise InputError(f"--config: the path {problem}")
    if not path.exists() and "/" not in spec and not spec.endswith((".yaml", ".yml")):
        raise InputError(
            f"--config '{quote(spec)[1:-1]}' is neither a preset ({', '.join(preset_names())}) nor a file; pass a "
            "preset's name or the path of a YAML file"
        )
    return path


def opens_with(path: str | os.PathLike, mark: str, size: int) -> bool:
    """Whether ``mark`` is within the first ``size`` characters of the file ``path`` (False where it cannot be
    read)."""
    try:
        with open(path, errors="replace") as file:
            return mark in file.read(size)
    except OSError:
        return False


def written_by_a_run(path: str | os.PathLike) -> bool:
    """Whether the config file ``path`` is one a training run wrote: it opens with ``CONFIG_HEADER``."""
    return opens_with(path, CONFIG_HEADER, len(CONFIG_HEADER))


def read_config_file(path: str | os.PathLike) -> dict[str, Any]:
    """Read a YAML config file into checked values, refusing unknown keys and wrong types.

    Only a regular file of at most ``MAX_CONFIG_BYTES`` is read (a FIFO or a device could block or never end).
    """
    try:
        info = os.stat(path)
        if stat.S_ISDIR(info.st_mode) and (Path(path) / CONFIG_FILE).is_file():  # a run folder
            raise InputError(f"config file {path} is a folder; pass its {CONFIG_FILE} ({Path(path) / CONFIG_FILE})")
        if not stat.S_ISREG(info.st_mode):
            raise InputError(f"config file {path} is not a regular file; pass a YAML file")
        if info.st_size > MAX_CONFIG_BYTES:
            raise InputError(
                f"config file {path} is {info.st_size} bytes, more than the {MAX_CONFIG_BYTES} a config may have"
            )
        with open(path, "rb") as file:
            raw = file.read(MAX_CONFIG_BYTES + 1)
        text = raw[:MAX_CONFIG_BYTES].decode()
    except OSError as err:
        raise InputError(f"cannot read config file {path}: {err.strerror}") from None
    except UnicodeDecodeError:
        raise InputError(f"config file {path} is not UTF-8 text; pass a YAML file") from None
    _check_yaml_shape(text, path)
    try:
        data = yaml.load(text, Loader=ConfigLoader)  # a SafeLoader
    except DuplicateKeyError as err:
        first, again = err.lines
        raise InputError(
            f"config file {path} gives {quote(str(err.key))} twice (lines {first} and {again}); keep one of them"
        ) from None
    except yaml.YAMLError as err:
        where = getattr(err, "problem_mark", None)
        line = f" at line {where.line + 1}" if where else ""
        if isinstance(err, yaml.constructor.ConstructorError):  # valid YAML, with a tag such as !!python/object
            raise InputError(
                f"config file {path}{line}: {err.problem}; a config holds plain values (numbers, text, true/false, "
                "none), so remove the tag"
            ) from None
        raise InputError(f"config file {path} is not valid YAML{line}; fix the syntax") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise InputError(f"config file {path} must hold a mapping of config keys, not {type(data).__name__}")
    values = {}
    for key, value in data.items():
        if key not in FIELDS:
            raise InputError(f"config file {path}: unknown key {quote(str(key))}{suggest(str(key)[:100], FIELDS)}")
        values[key] = check_field(key, value, f"config file {path}")
    return values


def check_launcher_environment() -> None:
    """Refuse, in one line, a launcher profile that asks for DeepSpeed or Megatron-LM, which Accelerate would set up
    (the package runs in one process or with DDP in several), and a RANK not below WORLD_SIZE (or LOCAL_RANK not
    below LOCAL_WORLD_SIZE), which only a hand-set environment has: that process waited for a rendezvous with
    processes that never come, deaf to Ctrl-C."""
    for variable, engine in (("ACCELERATE_USE_DEEPSPEED", "DeepSpeed"), ("ACCELERATE_USE_MEGATRON_LM", "Megatron-LM")):
        if parse_flag_from_env(variable):
            raise InputError(
                f"accelerate launch asked for {engine} ({variable}), which this package does not run with: it runs "
                "in one process or with DDP in several; launch with a profile without it (accelerate_configs/)"
            )
    for rank, size in (("RANK", "WORLD_SIZE"), ("LOCAL_RANK", "LOCAL_WORLD_SIZE")):
        numbers = os.environ.get(rank, ""), os.environ.get(size, "")
        if all(number.isdigit() for number in numbers) and int(numbers[0]) >= int(numbers[1]):
            raise InputError(
                f"{rank} is {numbers[0]} and {size} is {numbers[1]}, where a launcher (torchrun, accelerate launch) "
                f"numbers the processes from 0 to {size} - 1; unset them, or start the command through the launcher"
            )


def launcher_compiles() -> bool:
    """Whether accelerate launch asked torch dynamo to compile the model with inductor (ACCELERATE_DYNAMO_BACKEND),
    which --torch_compile does in place; another backend is refused."""
    dynamo = os.environ.get("ACCELERATE_DYNAMO_BACKEND", "no").lower()
    if dynamo not in ("no", "inductor"):
        raise InputError(
            f"accelerate launch asked torch dynamo for its '{dynamo}' backend; this package compiles the model itself, "
            "with inductor (--torch_compile), so that checkpoints load into a model compiled or not: choose no or "
            "inductor for dynamo in the accelerate profile (accelerate config), or launch with --dynamo_backend no"
        )
    return dynamo == "inductor"


def check_launcher_accumulation(config: TrainConfig, origins: dict[str, str]) -> None:
    """Refuse an ACCELERATE_GRADIENT_ACCUMULATION_STEPS other than the run's: Accelerate takes it over its argument."""
    accumulation = os.environ.get("ACCELERATE_GRADIENT_ACCUMULATION_STEPS")
    if accumulation is not None and accumulation != str(config.gradient_accumulation_steps):
        raise InputError(
            f"ACCELERATE_GRADIENT_ACCUMULATION_STEPS is {accumulation} (accelerate launch sets it for DeepSpeed), and "
            f"Accelerate would accumulate that many batches where {origins['gradient_accumulation_steps']} is "
            f"{config.gradient_accumulation_steps}; unset it, and give --gradient_accumulation_steps to "
            "cifar_accel.train"
        )


def launcher_precision() -> str | None:
    """The mixed precision accelerate launch asked for (its flag or profile, as ACCELERATE_MIXED_PRECISION), if
    any; one this package does not train in (fp8) is refused."""
    launcher = os.environ.get("ACCELERATE_MIXED_PRECISION")
    if launcher is not None and launcher not in typing.get_args(Precision):
        raise InputError(f"accelerate launch asked for mixed precision '{launcher}'; use no, fp16 or bf16")
    return launcher


def resolve_mixed_precision(flag: str | None, launcher: str | None, config_file: str | None) -> tuple[str, str]:
    """The requested precision and where it came from.

    Order: this script's flag, then ``accelerate launch`` (its flag or profile,
    seen as ACCELERATE_MIXED_PRECISION), then the config file, then 'no'. The
    launcher always exports a value and says 'no' when nothing was chosen, so
    its 'no' cannot be told from its default and does not override a file.
    """
    if flag is not None:
        return flag, "--mixed_precision flag"
    if launcher and launcher != "no":
        return launcher, "accelerate launch (flag or config profile)"
    if config_file is not None:
        return config_file, "config file"
    if launcher == "no":
        return "no", "accelerate launch (flag or config profile)"
    return "no", "default"


def looks_like_path(name: str) -> bool:
    """Whether a --dataset_name is a local path rather than a Hub id."""
    return name.startswith((".", "/", "~")) or name.count("/") > 1 or Path(name).exists()


def dataset_location(name: str) -> str:
    """A --dataset_name as a run records it: a local path that exists as an absolute one, so that evaluate and
    export find it from any folder; a Hub id (or a path that does not exist, refused later) as it is."""
    local = Path(name).expanduser()
    if not (looks_like_path(name) and local.exists()):
        return name
    location = str(local.resolve())
    if problem := not_text(location):  # the current folder's name, or a link's target
        raise InputError(f"--dataset_name: the absolute path of {quote(name)} {problem}")
    return location


def load_config(argv: typing.Sequence[str]) -> tuple[TrainConfig, str]:
    """Parse flags and an optional ``--config`` file into a checked config and the precision's source."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        raise InputError(parser.unknown_argument(unknown, lambda word: _left_over(parser, argv, word)))
    cli = {k: v for k, v in vars(args).items() if k in FIELDS}
    config_file = config_path(args.config) if hasattr(args, "config") else None
    from_file = read_config_file(config_file) if config_file else {}
    if config_file and config_file.name == CONFIG_FILE and written_by_a_run(config_file):
        # A run's own config.yaml stands for that run, wherever its folder is now and from whichever folder it is
        # given: the output_dir it records may be relative to another folder, or name the run's folder before it
        # was moved or copied (a copy's resume would go on in the original).
        from_file["output_dir"] = str(config_file.parent)
        for name in STARTING_FIELDS:
            from_file.pop(name, None)

    values = {**from_file, **cli}
    for name, value in cli.items():
        values[name] = check_field(name, value, f"--{name}")
    precision, source = resolve_mixed_precision(
        cli.get("mixed_precision"), launcher_precision(), from_file.get("mixed_precision")
    )
    values["mixed_precision"] = precision
    check_launcher_environment()
    if launcher_compiles() and "torch_compile" not in cli:  # after this script's flag, as for the precision
        values["torch_compile"] = True
    config = TrainConfig(**values)
    resume = config.resume_from_checkpoint
    config = dataclasses.replace(  # a leading ~ in a path from a config file, or in --flag=~/..., expanded
        config,
        dataset_name=dataset_location(config.dataset_name),
        output_dir=os.path.expanduser(config.output_dir),
        resume_from_checkpoint=os.path.expanduser(resume) if resume else resume,
    )
    source_file = getattr(args, "config", None)
    label = f"the {source_file} preset" if source_file in preset_names() else f"config file {source_file}"
    origins = (
        {name: f"'{name}' (the default)" for name in FIELDS}
        | {name: f"'{name}' in {label}" for name in from_file}
        | {name: f"--{name}" for name in cli}
    )
    check_combinations(config, origins)
    check_launcher_accumulation(config, origins)
    return config, source


def _either(*values: Any) -> typing.Callable[[Any], bool]:
    return lambda value: value in values


# Fields that act only where another field allows them: (that field, whether its value does, the values that do).
# Given as a flag where it cannot act, a field is refused, as the run would quietly train without it. Presets, config
# files and a run's config.yaml hold every field, acting or not (a flag that picks another optimizer leaves a
# preset's Muon settings idle), so values from a file are not checked; nor are flags that turn a feature off (0, off,
# none).
ACTS_ONLY_WITH: dict[str, tuple[str, typing.Callable[[Any], bool], str]] = {
    "momentum": ("optimizer", _either("sgd", "muon"), "sgd or muon"),
    **dict.fromkeys(
        ("muon_learning_rate", "muon_momentum", "muon_ns_steps", "muon_ns_dtype"),
        ("optimizer", _either("muon"), "muon"),
    ),
    **dict.fromkeys(("lr_step_size", "lr_gamma"), ("lr_scheduler_type", _either("step"), "step")),
    "lr_end_factor": ("lr_scheduler_type", _either(*PER_STEP_SCHEDULES), " or ".join(PER_STEP_SCHEDULES)),
    "lr_start_factor": ("warmup_ratio", lambda ratio: ratio > 0, "above 0 (the warm-up starts there)"),
    "early_stopping_patience": ("val_ratio", lambda ratio: ratio > 0, "above 0 (it watches validation accuracy)"),
    "tta_below_confidence": ("tta", _either("flip", "flip_translate"), "flip or flip_translate"),
    "early_crop_epochs": ("early_crop_size", lambda size: size > 0, "above 0"),
    **dict.fromkeys(
        (
            "crop_padding",
            "early_crop_size",
            "padding_mode",
            "flip",
            "color_jitter",
            "brightness_shift",
            "contrast_scale",
            "mixup_alpha",
            "cutmix_alpha",
        ),
        ("augment", bool, "on"),
    ),
    **dict.fromkeys(("hub_model_id", "hub_private_repo"), ("push_to_hub", bool, "on")),
}  # not hub_token: a credential, often set for every command alike, that nothing writes where it is idle


def as_flags(values: dict[str, Any]) -> str:
    """The train flags that set these fields to these values, quoted for a shell; a text field unset, which only
    leaving its flag out gives, is named as one to leave out."""
    given, left_out = [], []
    for name, value in values.items():
        if isinstance(value, bool):
            given.append(f"--{name}" if value else f"--no-{name}")
        elif value is None and not _unsettable(name):
            left_out.append(f"--{name}")
        else:
            given.append(f"--{name} {shlex.quote('none' if value is None else str(value))}")
    parts = [" ".join(given)] if given else []
    if left_out:
        parts.append(f"without {', '.join(left_out)}")
    return ", ".join(parts)


def _shown(value: Any) -> str:
    """A field's value as the refusals write it: booleans as on and off, text quoted."""
    if isinstance(value, bool):
        return "on" if value else "off"
    return f"'{value}'" if isinstance(value, str) else f"{value:g}"


def check_acts(name: str, values: typing.Mapping[str, Any], origins: typing.Mapping[str, str]) -> None:
    """Refuse the flag --``name`` where the field it needs (``ACTS_ONLY_WITH``) has a value in ``values`` that keeps
    it idle; ``origins`` says where that value came from."""
    decider, acts, needed = ACTS_ONLY_WITH[name]
    if not acts(values[decider]):
        raise InputError(
            f"--{name} has no effect unless --{decider} is {needed}, but {origins[decider]} is "
            f"{_shown(values[decider])}; leave --{name} out, or change that"
        )


def check_combinations(config: TrainConfig, origins: dict[str, str]) -> None:
    """The rules between fields, checked before any data is read. ``origins`` says where each value came from
    (a flag, the config file, the default), so the message points at what to change."""
    per_step = config.lr_scheduler_type in PER_STEP_SCHEDULES
    for name in ACTS_ONLY_WITH:
        if origins[name].startswith("--") and getattr(config, name) not in (False, None, "none"):
            check_acts(name, vars(config), origins)
    if 0 < config.early_crop_size < MIN_EARLY_CROP:
        raise InputError(
            f"{origins['early_crop_size']} is {config.early_crop_size}, under {MIN_EARLY_CROP} pixels (half the "
            f"images' {IMAGE_SIZE}), too few for the models' pooling; use {MIN_EARLY_CROP} to {IMAGE_SIZE - 1}, or 0"
        )
    if config.early_crop_size and origins["early_crop_size"].startswith("--") and not config.early_crop_epochs:
        raise InputError(
            f"--early_crop_size has no effect unless --early_crop_epochs is above 0, but {origins['early_crop_epochs']}"
            " is 0; add --early_crop_epochs N (the first N epochs train on the smaller windows), or leave it out"
        )
    if config.nesterov and (config.optimizer not in ("sgd", "muon") or config.momentum == 0):
        problem = (
            f"{origins['optimizer']} is {config.optimizer}"
            if config.optimizer not in ("sgd", "muon")
            else (f"{origins['momentum']} is 0")
        )
        raise InputError(
            f"Nesterov momentum ({origins['nesterov']}) needs --optimizer sgd or muon and a --momentum above 0, but "
            f"{problem}; add --no-nesterov, or change that"
        )
    if config.whiten_bias_epochs and not hasattr(MODELS[config.model_name], "init_from_data"):
        raise InputError(
            f"{origins['whiten_bias_epochs']} sets how long a whitening bias trains, but {origins['model_name']} is "
            f"'{config.model_name}', which has none; use --model fast_net, or --whiten_bias_epochs 0"
        )
    default_bias_lr_scale = FIELDS["bias_lr_scale"].default
    if config.bias_lr_scale != default_bias_lr_scale and not hasattr(MODELS[config.model_name], "parameter_groups"):
        raise InputError(
            f"{origins['bias_lr_scale']} scales the biases' learning rate, but {origins['model_name']} is "
            f"'{config.model_name}', which trains them at --learning_rate; use --model fast_net, or "
            f"--bias_lr_scale {default_bias_lr_scale:g}"
        )
    default_conv_weight_grads = FIELDS["conv_weight_grads"].default
    if config.conv_weight_grads != default_conv_weight_grads and not hasattr(
        MODELS[config.model_name], "set_conv_weight_grads"
    ):
        raise InputError(
            f"{origins['conv_weight_grads']} chooses how fast_net's convolutions compute their weight gradients, but "
            f"{origins['model_name']} is '{config.model_name}', which has no such choice; use --model fast_net, or "
            f"--conv_weight_grads {default_conv_weight_grads}"
        )
    if config.whiten_bias_epochs and not per_step:
        raise InputError(
            f"{origins['whiten_bias_epochs']} needs a per-step schedule, but {origins['lr_scheduler_type']} is "
            f"'{config.lr_scheduler_type}'; use --lr_scheduler_type linear or cosine_steps, or --whiten_bias_epochs 0"
        )
    if config.warmup_ratio and not per_step:
        raise InputError(
            f"a warm-up ({origins['warmup_ratio']}) needs a per-step schedule, but {origins['lr_scheduler_type']} is "
            f"'{config.lr_scheduler_type}'; use --lr_scheduler_type linear or cosine_steps, or --warmup_ratio 0"
        )


def config_yaml(config: TrainConfig) -> str:
    """The run's settings as the YAML text that ``read_config_file`` reads back, under ``CONFIG_HEADER``: the
    ``STARTING_FIELDS`` of the command that started it at their defaults."""
    values = config.to_dict() | {name: FIELDS[name].default for name in STARTING_FIELDS}
    return f"{CONFIG_HEADER}\n{yaml.dump(values, Dumper=ConfigDumper, sort_keys=False)}"


def flag_reference() -> str:
    """The flag reference, docs/flags.md: every flag of ``cifar_accel.train``, from the fields' own metadata
    (``scripts/write_flag_reference.py`` writes it, and a test checks that it is current)."""

    def cell(text: object) -> str:
        return str(text).replace("|", "\\|").replace("\n", " ")

    lines = [
        "# Flags of `cifar_accel.train`",
        "",
        "Generated from the fields of `TrainConfig` in `cifar_accel/config.py` by `python "
        "scripts/write_flag_reference.py`; a test fails when this page is out of date. Every flag is also a key "
        "of a `--config` YAML file. Values come from the defaults, then `--config`, then flags. A path that "
        "starts with `~` starts in the home folder, in a config file and in `--flag=~/...` too. *Resume*: "
        "whether `--resume_from_checkpoint` must keep the checkpoint's value (`match`) or may change it.",
        "",
        "| flag (aliases) | default | resume | what it does |",
        "|---|---|---|---|",
        f"| `--config` | | | A packaged preset ({', '.join(f'`{n}`' for n in preset_names())}) or a YAML file of "
        "config values; flags override it. |",
        "| `--debug` | | | Show tracebacks on errors. |",
        "| `--version` | | | Print the versions of cifar_accel, Python and the libraries it runs on, and exit (every "
        "command takes it). |",
    ]
    for name, f in FIELDS.items():
        kind, choices, _ = _unwrap(_TYPES[name])
        flag = f"`--{name}`" if kind is not bool else f"`--{name}`, `--no-{name}`"
        aliases = f" ({', '.join(f'`{a}`' for a in f.metadata['aliases'])})" if f.metadata["aliases"] else ""
        default = "" if f.default is None else f"`{f.default}`"
        allowed = f" One of {', '.join(f'`{c}`' for c in choices)}." if choices else ""
        symbols = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}
        if bounds := f.metadata["bounds"]:
            allowed += f" Range: {', '.join(f'{symbols[b]} {limit}' for b, limit in bounds.items())}."
        if pattern := f.metadata["pattern"]:
            allowed += f" Must be {pattern[1]}."
        if _unsettable(name):
            allowed += " `none` unsets it."
        if name in ACTS_ONLY_WITH:
            decider, _, needed = ACTS_ONLY_WITH[name]
            allowed += f" Acts only where `--{decider}` is {needed}; a flag given where it cannot act is refused."
        lines.append(f"| {flag}{aliases} | {default} | {f.metadata['resume']} | {cell(f.metadata['help'])}{allowed} |")
    return "\n".join(lines) + "\n"
