"""The shipped `evaluate` metrics: F1 over a label set counts every class of it; the per-class figure draws each
class."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch

from cifar_accel.evaluate import columns, format_report
from cifar_accel.metrics import classification_report, load_metric
from cifar_accel.pictures import confusion_figure, mistakes_figure, per_class_figure

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


def test_the_per_class_figure_draws_one_bar_per_class_in_order_whatever_the_names(caplog):
    # Class names made from integer labels are digits, which matplotlib takes as categories (and says so in the
    # log) when they are the bars' x values; and two classes of the same name would share one bar.
    names = ["1", "0", "1", "10"]
    accuracies = [0.5, 0.25, 0.75, 1.0]
    rows = [{"class": n, "accuracy": a, "correct": 1, "total": 2} for n, a in zip(names, accuracies, strict=True)]
    with caplog.at_level(logging.INFO):
        ax = per_class_figure(rows, "test accuracy per class").axes[0]
    bars = sorted(ax.patches, key=lambda bar: bar.get_x())
    assert [bar.get_x() + bar.get_width() / 2 for bar in bars] == pytest.approx([0, 1, 2, 3])
    assert [bar.get_height() for bar in bars] == accuracies
    assert [label.get_text() for label in ax.get_xticklabels()] == names
    assert not [r for r in caplog.records if r.name.startswith("matplotlib")]


def test_figures_label_a_class_no_font_draws_by_its_number_and_show_a_dollar_as_itself():
    """A class name with a character no font here has (CJK names on a machine without a CJK font; here an
    unassigned code point, which no font has) was drawn as empty boxes, with matplotlib's warning on evaluate's
    stderr; a '$' pair started math."""
    names = ["cat", "dog \u0378", "$5 or $6"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a missing glyph's warning fails the test
        fig = confusion_figure([[1, 0, 0], [0, 1, 0], [0, 0, 1]], names, "run \u0378")
        fig.canvas.draw()
    ax = fig.axes[0]
    assert [label.get_text() for label in ax.get_xticklabels()] == ["cat", "#1", r"\$5 or \$6"]
    assert ax.get_title() == "run ?"


def test_the_mistakes_figure_shows_each_image_under_its_caption_in_order():
    """Nine images in solid colours (a second row of the grid): each is drawn whole, left to right and then down,
    and its caption names its true class, the predicted one and the confidence."""
    colours = torch.randint(0, 256, (9, 3), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    images = colours.view(9, 3, 1, 1).expand(9, 3, 32, 32).contiguous()
    names = [f"class {i}" for i in range(9)]
    fig = mistakes_figure(images, names, names[::-1], [i / 10 for i in range(9)], "mistakes")
    fig.canvas.draw()
    (ax,) = fig.axes
    (picture,) = ax.get_images()
    grid = torch.from_numpy(picture.get_array().data)  # (rows, columns, RGB)
    centres = [text.get_position() for text in ax.texts]
    for index, (x, y) in enumerate(centres):  # each image lies right under its caption
        image = grid[int(y) + 1 : int(y) + 33, int(x) - 16 : int(x) + 16]
        assert image.shape == (32, 32, 3) and (image == colours[index]).all()
    assert centres == sorted(centres, key=lambda c: (c[1], c[0])) and len({y for _, y in centres}) == 2  # 2 rows
    assert ax.texts[1].get_text() == "class 1\n-> class 7 0.10"
    assert (grid == 255).all(-1).sum() == grid.shape[0] * grid.shape[1] - 9 * 32 * 32  # the rest is white


def test_the_printed_report_aligns_wide_class_names_and_short_ones():
    """CJK class names take two terminal columns a character: counted as one, they pushed their rows' numbers
    out of line; and names shorter than 'class' shifted the header."""
    report = classification_report(torch.tensor([0, 1, 1]), torch.tensor([0, 1, 0]), ["c", "犬犬"])
    lines = format_report(report, ["c", "犬犬"]).splitlines()
    table, matrix = lines[:3], lines[5:]
    assert len({columns(line) for line in table}) == 1 and len({columns(line) for line in matrix}) == 1
    assert [columns(line.split("  ")[0]) for line in table] == [5, 1, 4]
    assert matrix[0].endswith(" c   犬犬") and matrix[2].startswith("犬犬   ")
