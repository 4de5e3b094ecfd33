"""Accuracy: the fraction of predictions that equal their references.

A local `evaluate` module with the same inputs and output key as the Hub's
``accuracy``, shipped with the package so metrics work without the Hub.
"""

import datasets
import evaluate
import numpy as np

_DESCRIPTION = "Accuracy is the proportion of correct predictions among all predictions."

_KWARGS_DESCRIPTION = """
Args:
    predictions (list of int): predicted labels.
    references (list of int): ground-truth labels.
    normalize (bool): if False, return the number of correct predictions instead of the fraction. Default True.
    sample_weight (list of float): optional weight of each sample.
Returns:
    accuracy (float or int): the fraction (or count) of correct predictions.
Example:
    >>> metric = evaluate.load("cifar_accel/metrics/accuracy")
    >>> metric.compute(predictions=[0, 1, 1], references=[0, 1, 0])
    {'accuracy': 0.6666666666666666}
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class Accuracy(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features({"predictions": datasets.Value("int32"), "references": datasets.Value("int32")}),
        )

    def _compute(self, predictions, references, normalize=True, sample_weight=None):
        correct = np.asarray(predictions) == np.asarray(references)
        weights = np.ones(len(correct)) if sample_weight is None else np.asarray(sample_weight, dtype=float)
        score = float((correct * weights).sum())
        if normalize:
            score /= float(weights.sum())
        elif sample_weight is None:
            score = int(score)
        return {"accuracy": score}
