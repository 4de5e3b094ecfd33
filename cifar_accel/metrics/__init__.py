"""`evaluate` metrics shipped with the package, loaded by path so they work offline."""

from __future__ import annotations

import errno
from pathlib import Path
from typing import Any

import evaluate
import torch

from cifar_accel.errors import InputError, RunFault
from cifar_accel.outputs import disk_full, fix_for

METRICS_DIR = Path(__file__).parent


def load_metric(name: str) -> evaluate.EvaluationModule:
    """Load one of the metric modules under ``cifar_accel/metrics/`` (for example ``accuracy``). `evaluate` copies
    it into the Hugging Face cache (HF_HOME, by default ~/.cache/huggingface) first: a cache it cannot write to is
    one line with the fix."""
    try:
        return evaluate.load(str(METRICS_DIR / name), keep_in_memory=True)
    except OSError as err:
        unwritable = err.errno in (errno.EROFS, errno.EACCES, errno.EPERM)
        if not (unwritable or disk_full(err)):
            raise
        problem = InputError if unwritable else RunFault
        where = err.filename or evaluate.config.HF_MODULES_CACHE
        raise problem(
            f"loading the metric '{name}' failed: `evaluate` copies it into the Hugging Face cache ({where}), which "
            f"failed ({err.strerror}); {fix_for(err)}, or set HF_HOME to a folder you can write to"
        ) from None


def classification_report(
    predictions: torch.Tensor, references: torch.Tensor, class_names: list[str]
) -> dict[str, Any]:
    """Accuracy and macro F1 (through the shipped `evaluate` modules), per-class accuracy and the confusion matrix."""
    num_classes = len(class_names)
    confusion = torch.bincount(references * num_classes + predictions, minlength=num_classes**2)
    confusion = confusion.view(num_classes, num_classes)  # rows: true class, columns: predicted class
    totals, correct = confusion.sum(1), confusion.diag()
    return {
        "accuracy": load_metric("accuracy").compute(predictions=predictions, references=references)["accuracy"],
        # Over all classes of the model, so a class missing from the split still counts (with F1 0).
        "macro_f1": load_metric("f1").compute(
            predictions=predictions, references=references, labels=list(range(num_classes)), average="macro"
        )["f1"],
        "samples": len(references),
        "per_class": [
            {"class": name, "correct": int(c), "total": int(t), "accuracy": (int(c) / int(t)) if t else None}
            for name, c, t in zip(class_names, correct, totals, strict=True)
        ],
        "confusion_matrix": confusion.tolist(),
    }
