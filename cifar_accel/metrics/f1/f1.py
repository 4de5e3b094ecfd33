"""F1 score: the harmonic mean of precision and recall, per class and averaged.

A local `evaluate` module with the same inputs and output key as the Hub's ``f1``
(``average`` = "macro", "micro" or None), shipped with the package so it works offline.
"""

import datasets
import evaluate
import numpy as np

_DESCRIPTION = "F1 = 2 * precision * recall / (precision + recall), computed per class and averaged."

_KWARGS_DESCRIPTION = """
Args:
    predictions (list of int): predicted labels.
    references (list of int): ground-truth labels.
    labels (list of int, optional): the label set to score. Every class in it counts, including one that
        appears in neither predictions nor references (it scores 0, as in scikit-learn). Default: the
        classes present in predictions or references.
    average (str or None): "macro" (unweighted mean over the label set, the default), "micro" (over all
        samples), or None (one score per class of the label set, in its order).
Returns:
    f1 (float, or array of float with average=None).
Example:
    >>> metric = evaluate.load("cifar_accel/metrics/f1")
    >>> metric.compute(predictions=[0, 1, 1], references=[0, 1, 0])
    {'f1': 0.6666666666666666}
    >>> metric.compute(predictions=[0, 1, 1], references=[0, 1, 0], labels=[0, 1, 2])
    {'f1': 0.4444444444444444}
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class F1(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features({"predictions": datasets.Value("int32"), "references": datasets.Value("int32")}),
        )

    def _compute(self, predictions, references, labels=None, average="macro"):
        predictions, references = np.asarray(predictions), np.asarray(references)
        if average == "micro":
            return {"f1": float((predictions == references).mean())}
        classes = np.union1d(predictions, references) if labels is None else np.asarray(labels)
        scores = []
        for label in classes:
            true_positive = np.sum((predictions == label) & (references == label))
            predicted, actual = np.sum(predictions == label), np.sum(references == label)
            denominator = predicted + actual
            scores.append(2.0 * true_positive / denominator if denominator else 0.0)
        scores = np.asarray(scores)
        return {"f1": float(scores.mean()) if average == "macro" else scores}
