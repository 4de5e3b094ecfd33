"""`evaluate` metrics shipped with the package, loaded by path so they work offline."""

from __future__ import annotations

from pathlib import Path

import evaluate

METRICS_DIR = Path(__file__).parent


def load_metric(name: str) -> evaluate.EvaluationModule:
    """Load one of the metric modules under ``cifar_accel/metrics/`` (for example ``accuracy``)."""
    return evaluate.load(str(METRICS_DIR / name), keep_in_memory=True)
