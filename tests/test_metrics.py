"""The shipped `evaluate` metrics: F1 over a label set counts every class of it."""

from __future__ import annotations

import pytest
import torch

from cifar_accel.metrics import classification_report, load_metric

# Per class: 0 has 1 true positive of 1 predicted and 2 actual (F1 2/3), 1 has 1 of 2 and 1 (2/3), 2 is exact (1),
# and class 3 appears in neither list.
PREDICTIONS, REFERENCES = [0, 1, 1, 2], [0, 1, 0, 2]


def test_macro_f1_over_a_label_set_counts_classes_absent_from_the_split():
    f1 = load_metric("f1")
    assert f1.compute(predictions=PREDICTIONS, references=REFERENCES)["f1"] == pytest.approx((2 / 3 + 2 / 3 + 1) / 3)
    labels = [0, 1, 2, 3]
    assert f1.compute(predictions=PREDICTIONS, references=REFERENCES, labels=labels)["f1"] == pytest.approx(
        (2 / 3 + 2 / 3 + 1 + 0) / 4
    )
    per_class = f1.compute(predictions=PREDICTIONS, references=REFERENCES, labels=labels, average=None)["f1"]
    assert per_class.tolist() == pytest.approx([2 / 3, 2 / 3, 1, 0])
    assert f1.compute(predictions=PREDICTIONS, references=REFERENCES, average="micro")["f1"] == 0.75


def test_the_evaluation_report_averages_f1_over_all_of_the_models_classes():
    report = classification_report(torch.tensor(PREDICTIONS), torch.tensor(REFERENCES), ["a", "b", "c", "d"])
    assert report["accuracy"] == 0.75
    assert report["macro_f1"] == pytest.approx((2 / 3 + 2 / 3 + 1 + 0) / 4)
    assert report["per_class"][3] == {"class": "d", "correct": 0, "total": 0, "accuracy": None}
