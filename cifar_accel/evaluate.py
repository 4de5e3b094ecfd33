"""Evaluate a trained model on a dataset split: `python -m cifar_accel.evaluate --model outputs/cifar10`.

Prints overall and per-class accuracy, macro F1 and (up to 20 classes) a confusion matrix, and writes them as
``metrics.json`` and ``confusion_matrix.png``. Works under ``accelerate launch`` and ``torchrun``:
predictions are gathered so that every sample counts exactly once.
"""

from __future__ import annotations

import argparse
import json
import logging
import shlex
import sys
import typing
import unicodedata
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from accelerate import Accelerator

from cifar_accel.config import Precision, check_field
from cifar_accel.data import load_split, make_loader
from cifar_accel.engine import predict
from cifar_accel.errors import ArgumentParser, counted, exit_command, non_empty, user_path
from cifar_accel.inference import (
    TrainedModel,
    add_tta_flags,
    check_tta_flags,
    dataset_to_read,
    inference_precision,
    load_model,
    output_beside,
)
from cifar_accel.metrics import classification_report
from cifar_accel.outputs import (
    METRICS_FILE,
    WEIGHTS_FILE,
    file_sha256,
    is_evaluation_report,
    refuse_foreign_files,
    save_atomic,
    writable_output_dir,
    write_atomic,
)
from cifar_accel.pictures import LABELLED_CLASSES, confusion_figure
from cifar_accel.plots import MISSING, pyplot
from cifar_accel.precision import effective_precision, warn_if_not_in_effect
from cifar_accel.processes import check_joined

CONFUSION_FILE = "confusion_matrix.png"

logger = logging.getLogger(__name__)


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="cifar_accel.evaluate", description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument(
        "--model", type=user_path, required=True, help="A run's output folder, a checkpoint folder or a .safetensors."
    )
    parser.add_argument(
        "--dataset_name", type=user_path, help="Hub id or local path; default: the dataset the run trained on."
    )
    parser.add_argument(
        "--split",
        type=non_empty,
        default="test",
        help="Dataset split to evaluate (default: test). 'validation', where the run's dataset has none, is the part "
        "of train that the run held out and validated on (its --val_ratio and --seed).",
    )
    parser.add_argument(
        "--image_column_name", type=non_empty, help="Image column; default: the run's, else found by type."
    )
    parser.add_argument(
        "--label_column_name", type=non_empty, help="Label column; default: the run's, else found by type."
    )
    parser.add_argument("--max_eval_samples", type=int, help="Evaluate only the first N images.")
    parser.add_argument("--per_device_eval_batch_size", type=int, help="Batch size per process; default: the run's.")
    parser.add_argument(
        "--mixed_precision",
        choices=typing.get_args(Precision),
        help="Default: the launcher's, else the run's own (which its test accuracy was measured in).",
    )
    add_tta_flags(parser)
    parser.add_argument("--cpu", action="store_true", help="Run on the CPU even when a GPU is present.")
    parser.add_argument(
        "--output_dir",
        type=user_path,
        help="Where metrics.json and the PNG go; default: <model folder>/eval_<split> (for a checkpoint: "
        "<run>/eval_<split>_<checkpoint>).",
    )
    return parser


def columns(text: str) -> int:
    """The columns ``text`` takes on a terminal: two for each wide character (CJK), one for any other."""
    return sum(2 if unicodedata.east_asian_width(character) in "WF" else 1 for character in text)


def padded(text: str, width: int, right: bool = False) -> str:
    """``text`` filled with spaces to ``width`` columns, on the left where ``right`` (aligned right)."""
    fill = " " * (width - columns(text))
    return fill + text if right else text + fill


def clipped(text: str, width: int) -> str:
    """The longest start of ``text`` that fits in ``width`` columns."""
    while columns(text) > width:
        text = text[:-1]
    return text


def format_report(report: dict[str, Any], class_names: list[str]) -> str:
    width = max(columns(name) for name in [*class_names, "class"]) + 2
    lines = [f"{padded('class', width)}{'correct':>8}{'total':>8}{'accuracy':>10}"]
    for row in report["per_class"]:
        accuracy = "-" if row["accuracy"] is None else f"{row['accuracy']:.4f}"
        lines.append(f"{padded(row['class'], width)}{row['correct']:>8}{row['total']:>8}{accuracy:>10}")
    lines.append(
        f"overall accuracy {report['accuracy']:.4f} | macro F1 {report['macro_f1']:.4f} | "
        f"{counted(report['samples'], 'image')}"
        + (f" | test-time augmentation: {report['tta']}" if report.get("tta", "none") != "none" else "")
    )
    if len(class_names) > LABELLED_CLASSES:  # too wide to print; the figure and metrics.json hold it
        return "\n".join(lines)
    lines.append("confusion matrix (rows: true class, columns: predicted class):")
    lines.append(" " * width + "".join(padded(clipped(name, 6), 7, right=True) for name in class_names))
    for name, row in zip(class_names, report["confusion_matrix"], strict=True):
        lines.append(padded(name, width) + "".join(f"{count:>7}" for count in row))
    return "\n".join(lines)


def plot_confusion_matrix(confusion: list[list[int]], class_names: list[str], title: str, path: Path) -> bool:
    """Write the confusion matrix as a PNG; False when matplotlib is not installed."""
    plt = pyplot()
    if plt is None:
        return False
    fig = confusion_figure(confusion, class_names, title)
    save_atomic(path, lambda temporary: fig.savefig(temporary, format="png"))
    plt.close(fig)
    return True


def main(argv: Sequence[str]) -> None:
    args = build_parser().parse_args(argv)
    for flag in ("per_device_eval_batch_size", "max_eval_samples"):  # training's bounds
        if getattr(args, flag) is not None:
            check_field(flag, getattr(args, flag), f"--{flag}")
    check_tta_flags(args)
    logging.basicConfig(format="%(message)s", stream=sys.stdout, level=logging.WARNING)
    trained = load_model(args.model)
    dataset = dataset_to_read(args.dataset_name, trained, "--dataset_name")
    output_dir = Path(args.output_dir or output_beside(trained.weights, f"eval_{args.split}"))
    with writable_output_dir(output_dir, reads=dataset):
        ours = is_evaluation_report(output_dir / METRICS_FILE)  # an earlier evaluation's
        refuse_foreign_files(output_dir, (METRICS_FILE, CONFUSION_FILE), "evaluate", ours)
        evaluate_model(args, trained, dataset, output_dir)


def evaluate_model(args: argparse.Namespace, trained: TrainedModel, dataset: str, output_dir: Path) -> None:
    """Evaluate ``trained`` on ``dataset`` as ``args`` say; the report and the confusion matrix go to
    ``output_dir``."""
    run = trained.config
    precision, asked = inference_precision(args.mixed_precision, trained)
    # The model as the run tested it: uncompiled, whatever torch dynamo backend a launcher profile names.
    accelerator = Accelerator(mixed_precision=precision, cpu=args.cpu, dynamo_backend="no")
    check_joined(accelerator, "evaluate")
    if asked:
        warn_if_not_in_effect(accelerator, "evaluation runs in fp32 and metrics.json records 'no'")
    with accelerator.main_process_first():
        split, _ = load_split(
            dataset,
            args.split,
            args.image_column_name or run.image_column_name,
            args.label_column_name or run.label_column_name,
            args.max_eval_samples,
            classes=trained.class_names,
            run=run if dataset == run.dataset_name else None,  # its validation images are a part of this one's train
        )
    batch_size = args.per_device_eval_batch_size or run.per_device_eval_batch_size
    model, loader = accelerator.prepare(trained.model, make_loader(split, batch_size, train=False))
    found = predict(accelerator, model, loader, trained.preprocess, args.tta, args.tta_below_confidence)
    report = classification_report(found.classes.cpu(), found.labels.cpu(), trained.class_names)
    report.update(
        model=str(trained.weights),
        weights_sha256=file_sha256(trained.weights),
        dataset=dataset,
        split=args.split,
        mixed_precision=effective_precision(accelerator),
        tta=args.tta,
        tta_below_confidence=args.tta_below_confidence,
        num_processes=accelerator.num_processes,
    )
    if accelerator.is_main_process:
        write_atomic(output_dir / METRICS_FILE, json.dumps(report, indent=2))
        title = f"{trained.weights.parent.name}, {args.split}: accuracy {report['accuracy']:.4f}"
        plotted = plot_confusion_matrix(
            report["confusion_matrix"], trained.class_names, title, output_dir / CONFUSION_FILE
        )
        print(format_report(report, trained.class_names))
        print(f"wrote {output_dir / METRICS_FILE}")
        print(f"wrote {output_dir / CONFUSION_FILE}" if plotted else MISSING)


def warn_of_earlier_evaluations(run_dir: Path) -> None:
    """A warning for each report of the run's final weights (the eval_<split> folders beside them) that evaluated
    other weights than the final ones now there: the run was trained further since."""
    reports = sorted(run_dir.glob(f"eval_*/{METRICS_FILE}"))
    weights = file_sha256(run_dir / WEIGHTS_FILE) if reports else None
    for path in reports:
        try:
            report = json.loads(path.read_text())
            split, made_from = report["split"], report["weights_sha256"]
        except (OSError, ValueError, KeyError, TypeError):  # not evaluate's report, or one that did not record it
            continue
        if path.parent.name == f"eval_{split}" and made_from != weights:
            logger.warning(
                f"{path.parent} evaluated earlier weights than {run_dir / WEIGHTS_FILE}; evaluate again: "
                + shlex.join(["python", "-m", "cifar_accel.evaluate", "--model", str(run_dir), "--split", split])
            )


def cli() -> None:
    exit_command(main)


if __name__ == "__main__":
    cli()
