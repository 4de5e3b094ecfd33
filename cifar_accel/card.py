"""The model card: README.md beside the weights, in the Hub's format (YAML metadata, then prose and tables), and the
training curves it shows (curves.png)."""

from __future__ import annotations

import json
import logging
import shlex
from pathlib import Path

from huggingface_hub import EvalResult, ModelCard, ModelCardData

from cifar_accel.config import TrainConfig, config_yaml, looks_like_path
from cifar_accel.errors import counted
from cifar_accel.outputs import (
    CARD_FILE,
    CURVES_FILE,
    EXPORT_FILES,
    LIBRARY_NAME,
    WEIGHTS_FILE,
    file_sha256,
    is_model_card,
    save_atomic,
    write_atomic,
)
from cifar_accel.plots import pyplot
from cifar_accel.state import EpochRecord, RunResults, epochs_text
from cifar_accel.trackers import run_name
from cifar_accel.transforms import CIFAR10_CLASSES, CIFAR10_NORMALIZATION

logger = logging.getLogger(__name__)  # not Accelerate's: export writes cards with no Accelerator


def plot_curves(history: list[EpochRecord], path: Path) -> bool:
    """Loss and accuracy per epoch, training and (where there was one) validation; False without matplotlib."""
    plt = pyplot()
    if plt is None:
        return False
    epochs = [record.epoch for record in history]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, metric in zip(axes, ("loss", "accuracy"), strict=True):
        ax.plot(epochs, [getattr(record, f"train_{metric}") for record in history], marker="o", label="train")
        if history and getattr(history[0], f"val_{metric}") is not None:
            ax.plot(epochs, [getattr(record, f"val_{metric}") for record in history], marker="o", label="validation")
        ax.set_xlabel("epoch")
        ax.set_ylabel(metric)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    save_atomic(path, lambda temporary: fig.savefig(temporary, format="png"))
    plt.close(fig)
    return True


def dataset_title(config: TrainConfig, class_names: list[str]) -> str:
    """How the card names the dataset: CIFAR-10 for one with CIFAR-10's classes, else its Hub id or folder name."""
    name = Path(config.dataset_name).name if looks_like_path(config.dataset_name) else config.dataset_name
    return "CIFAR-10" if class_names == CIFAR10_CLASSES else name


def card_metadata(config: TrainConfig, results: RunResults, run_name: str, class_names: list[str]) -> ModelCardData:
    """The card's YAML block: library, tags, dataset, metric, and a model-index entry with the test accuracy."""
    local, folder = looks_like_path(config.dataset_name), Path(config.dataset_name).name
    title = dataset_title(config, class_names)
    dataset_id = ("cifar10" if title == "CIFAR-10" else folder) if local else config.dataset_name
    dataset_label = f"{title} ({folder})" if local and title != folder else title
    return ModelCardData(
        library_name=LIBRARY_NAME,  # also how a later run tells the card for its own (outputs.is_model_card)
        pipeline_tag="image-classification",
        tags=[
            "image-classification",
            dataset_id.split("/")[-1],
            "accelerate",
            config.model_name,
            f"precision-{results.mixed_precision}",
        ],
        datasets=None if local else [config.dataset_name],
        metrics=["accuracy"],
        model_name=run_name,
        eval_results=[
            EvalResult(
                task_type="image-classification",
                task_name="Image Classification",
                dataset_type=dataset_id,
                dataset_name=dataset_label,
                dataset_split=tested_split(config, results),
                metric_type="accuracy",
                metric_value=results.test_accuracy,
                metric_name=f"Test accuracy (TTA: {results.tta})",
            )
        ],
    )


def exports_text(exports: list[dict]) -> str:
    """The card's section on the run's exports (cifar_accel.export's descriptions), or nothing without one."""
    if not exports:
        return ""
    rows = []
    for export in exports:
        check = export["check"]
        if export.get("stale"):
            checked = "made from earlier weights, not these: export again"
        elif check:
            checked = (
                f"{check['same_predictions']}/{check['images']} predictions as load_model, probabilities within "
                f"{check['max_probability_difference']:.1e} ({check['split']} split of `{check['dataset']}`)"
            )
        else:
            checked = "not checked"
        source = export["input"]
        rows.append(f"| `{export['file']}` | {export['format']} | {source['dtype']} {source['values']} | {checked} |")
    return (
        "\n## Exported\n\n"
        "Each takes RGB images of shape (batch, 3, 32, 32), normalises them itself as above, and returns `logits` "
        "and `probabilities`; its `.json` file beside it says the same.\n\n"
        "| file | format | input | check |\n|---|---|---|---|\n" + "\n".join(rows) + "\n"
    )


def model_card(
    config: TrainConfig,
    results: RunResults,
    run_name: str,
    class_names: list[str],
    curves: bool,
    exports: list[dict] = (),
) -> ModelCard:
    """The card of a finished run, from its config, results.json, class names and exports."""
    hardware = results.hardware
    machine = hardware.get("gpu") or f"{hardware['cpu']} ({counted(hardware['cpu_cores'], 'core')})"
    tested = (
        f"the weights of epoch {results.tested_epoch}, the best validation accuracy ({results.best_val_accuracy:.4f})"
        if results.validation
        else f"the weights of the last epoch, {results.tested_epoch} (no validation split)"
    )
    averaged = f", averaged (EMA, decay {config.ema_decay})" if config.ema_decay else ""
    below = config.tta_below_confidence
    selective = f" --tta_below_confidence {below:g}" if below < 1 and results.tta != "none" else ""
    curves_text = f"![training curves]({CURVES_FILE})" if curves else "(matplotlib was not installed: no curves.png)"
    body = f"""
# {run_name}

A `{config.model_name}` trained on {dataset_title(config, class_names)} (`{config.dataset_name}`, label column
`{results.label_column}`, {len(class_names)} classes) with `cifar_accel`: one plain PyTorch loop prepared by
Hugging Face Accelerate.

## Results

| | |
|---|---|
| test accuracy | {results.test_accuracy:.4f} (test-time augmentation: {results.tta}) |
| test accuracy without TTA | {results.test_accuracy_no_tta:.4f} |
| tested | {tested}{averaged} |
| test images | {tested_images(config, results)} |
| epochs | {epochs_text(results.epochs_trained)}{epochs_note(config, results)} |

## Training

| | |
|---|---|
| precision in effect | {results.mixed_precision} (requested `{results.requested_mixed_precision}` by {results.mixed_precision_source}) |
| hardware | {machine}, {counted(results.num_processes, "process", "processes")}, device `{results.device}` |
| batch, learning rate | {results.global_batch_size} global, {results.learning_rate:g} ({config.optimizer}, {config.lr_scheduler_type} schedule) |
| training images | {training_images(config, results)} |
| speed | {results.seconds_per_epoch:.1f} s per epoch, {results.train_images_per_second:.0f} training images/s |
| peak memory | {results.peak_memory_mib:.0f} MiB ({results.peak_memory_measure}) |
| input | {normalization_text(results)} |

{curves_text}
{exports_text(list(exports))}
<details><summary>The effective config (config.yaml)</summary>

```yaml
{config_yaml(config).rstrip()}
```

</details>

## How to use

```python
from cifar_accel import load_model

classifier = load_model("path/to/this/folder")   # {WEIGHTS_FILE}, config.yaml and labels.json
classifier.predict([image], top_k=3)              # PIL images, or a uint8 batch (N, 3, 32, 32)
```

or from the command line: `python -m cifar_accel.predict --model path/to/this/folder images/` and
`python -m cifar_accel.evaluate --model path/to/this/folder --tta {results.tta}{selective}`.
"""  # noqa: E501 - table rows
    metadata = card_metadata(config, results, run_name, class_names)
    return ModelCard(f"---\n{metadata.to_yaml()}\n---\n{body}")


def epochs_note(config: TrainConfig, results: RunResults) -> str:
    """What the epochs row adds: that validation stopped the run early, or that --max_train_steps set its length
    (and where it ended part way through an epoch, which one)."""
    if results.stopped_early:
        return " (stopped early)"
    if not config.max_train_steps:
        return ""
    cut = results.epochs_trained != results.epochs_completed
    last = f"; epoch {results.epochs_completed} cut short" if cut else ""
    return f" ({counted(config.max_train_steps, 'optimizer step')}: --max_train_steps{last})"


def training_images(config: TrainConfig, results: RunResults) -> str:
    """The training images, where they came from (--max_train_samples) and where the validation images came from,
    as the card states them."""
    first = config.max_train_samples
    source = (
        f"from the train split's first {counted(first, 'image')}, --max_train_samples; " if first is not None else ""
    )
    if results.val_split:
        validation = f"{results.val_samples} validation images: the '{results.val_split}' split"
    elif results.val_samples:  # --max_eval_samples may validate on fewer than were held out
        validation = f"validated on {counted(results.val_samples, 'image')} held out of the train split"
    else:
        validation = "no validation"
    return f"{results.train_samples} ({source}{validation})"


def tested_subset(config: TrainConfig, results: RunResults) -> bool:
    """Whether --max_eval_samples tested the first images of the test split only (fewer than it holds, or all)."""
    return config.max_eval_samples is not None and results.test_samples == config.max_eval_samples


def tested_split(config: TrainConfig, results: RunResults) -> str:
    """The test split as the card's metadata names it: with --max_eval_samples, in the slicing notation of
    ``datasets`` (``test[:N]``), so that the Hub does not show the accuracy of a part as the whole split's."""
    return f"test[:{results.test_samples}]" if tested_subset(config, results) else "test"


def tested_images(config: TrainConfig, results: RunResults) -> str:
    """The test images, as the card states them."""
    if tested_subset(config, results):
        return f"{results.test_samples} (the first {results.test_samples} of the test split: --max_eval_samples)"
    return str(results.test_samples)


def normalization_text(results: RunResults) -> str:
    """The input and its normalisation, as the card states them."""
    values = results.normalization
    if values is None:  # a run written before results.json recorded it normalised with CIFAR-10's constants
        values = CIFAR10_NORMALIZATION.to_dict()
    return f"{values['input']}; {values['formula']}, mean {values['mean']}, std {values['std']} ({values['source']})"


def read_export_description(path: Path) -> dict | None:
    """An export's description (cifar_accel.export), or None where there is none or it cannot be read."""
    if not path.is_file():
        return None
    try:
        description = json.loads(path.read_text())
        if all(key in description for key in ("file", "format", "input", "check")):
            return description
    except (OSError, ValueError):
        pass
    logger.warning(f"{path} is not an export description of cifar_accel.export, so the model card does not list it")
    return None


def write_model_card(config: TrainConfig, results: RunResults, output_dir: Path, class_names: list[str]) -> bool:
    """curves.png and README.md in the output folder; False where a README.md of the user's there is left as it is
    and no card is written."""
    curves = plot_curves(results.history, output_dir / CURVES_FILE)
    card = output_dir / CARD_FILE
    if card.exists() and not is_model_card(card):
        logger.warning(f"{card} is not a model card of this package, so it is left as it is and no card is written")
        return False
    exports = [read_export_description(output_dir / f"{name}.json") for name in EXPORT_FILES.values()]
    exports = [export for export in exports if export]
    if exports:
        weights = file_sha256(output_dir / WEIGHTS_FILE)
        exports = [mark_stale(export, output_dir, weights) for export in exports]
    name = run_name(config, output_dir)
    write_atomic(card, str(model_card(config, results, name, class_names, curves, exports)))
    return True


def mark_stale(export: dict, output_dir: Path, weights_sha256: str) -> dict:
    """``export`` with "stale" set where it was made from other weights than the run's final ones (SHA-256
    ``weights_sha256``; a run extended after its export), and a warning that says how to export again."""
    source = export.get("weights")
    made_from = source.get("sha256") if isinstance(source, dict) else None  # None: an export that did not say
    if made_from is None or made_from == weights_sha256:
        return export
    logger.warning(
        f"{output_dir / export['file']} was exported from earlier weights than {output_dir / WEIGHTS_FILE}; export "
        "again: "
        + shlex.join(
            ["python", "-m", "cifar_accel.export", "--model", str(output_dir), "--format", export["format"]]
            + ["--input", export["input"]["dtype"]]
        )
    )
    return {**export, "stale": True}
