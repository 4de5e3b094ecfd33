"""Export a trained model: `python -m cifar_accel.export --model outputs/cifar10 --format onnx`.

The exported model takes images, not normalised tensors: uint8 RGB (N, 3, 32, 32), or float32 in [0, 1] with
``--input float32``, with a dynamic batch axis, and applies the run's normalisation itself. It returns logits and
softmax probabilities. ``--format onnx`` writes an ONNX file (the optional extra 'export': onnx, onnxscript and
onnxruntime), ``--format pt2`` a ``torch.export`` program. A JSON file beside it states the input, the
preprocessing and the outputs, and the model card of the run gets the same. The export is then checked on the
test split of the run's dataset: its predictions must be those of ``load_model``, its probabilities within
``--tolerance``.
"""

from __future__ import annotations

import argparse
import copy
import importlib
import io
import json
import logging
import sys
import typing
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from torch import nn

from cifar_accel.card import write_model_card
from cifar_accel.data import load_images
from cifar_accel.errors import (
    ArgumentParser,
    InputError,
    RunFault,
    counted,
    exit_command,
    non_empty,
    one_line,
    user_path,
)
from cifar_accel.inference import TrainedModel, dataset_to_read, load_model, output_beside
from cifar_accel.outputs import (
    EXPORT_FILES,
    RESULTS_FILE,
    WEIGHTS_FILE,
    file_sha256,
    is_export_description,
    refuse_foreign_files,
    save_atomic,
    writable_output_dir,
    write_atomic,
)
from cifar_accel.processes import require_one_process
from cifar_accel.state import read_results
from cifar_accel.transforms import Normalization

logger = logging.getLogger(__name__)

ExportFormat = Literal["onnx", "pt2"]
InputDtype = Literal["uint8", "float32"]
ONNX_MODULES = ("onnx", "onnxscript", "onnxruntime")  # torch.onnx.export needs the first two, the check the third
EXTRA_HINT = "pip install onnx onnxscript onnxruntime"  # what the 'export' extra brings, however this was installed
INPUT_NAME, OUTPUT_NAMES = "images", ("logits", "probabilities")
EXAMPLE_BATCH = 4  # the batch traced; the exported batch axis is dynamic
CHECK_BATCH = 500


class ImageClassifier(nn.Module):
    """A run's network with its preprocessing in front: images (uint8 in 0..255, or float in [0, 1]) ->
    (logits, probabilities), normalised by the run's statistics as training normalised them."""

    def __init__(self, model: nn.Module, normalization: Normalization) -> None:
        super().__init__()
        self.model = model
        self.register_buffer("mean", torch.tensor(normalization.mean).view(1, 3, 1, 1))
        self.register_buffer("std", torch.tensor(normalization.std).view(1, 3, 1, 1))

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pixels = images.float() / 255 if images.dtype == torch.uint8 else images
        logits = self.model((pixels - self.mean) / self.std).float()
        return logits, logits.softmax(1)


def example_images(input_dtype: InputDtype, count: int = EXAMPLE_BATCH) -> torch.Tensor:
    images = torch.randint(0, 256, (count, 3, 32, 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    return images if input_dtype == "uint8" else images.float() / 255


def require_onnx() -> None:
    """Import the optional extra's modules, or say in one line how to install them."""
    for name in ONNX_MODULES:
        try:
            importlib.import_module(name)
        except ImportError as err:
            raise InputError(f"--format onnx needs the 'export' extra: {EXTRA_HINT} ({one_line(err)})") from None


def export_program(classifier: ImageClassifier, input_dtype: InputDtype) -> torch.export.ExportedProgram:
    """``torch.export``'s program of the classifier, with a dynamic batch axis."""
    batch = {INPUT_NAME: {0: torch.export.Dim("batch", min=1)}}
    return torch.export.export(classifier, (example_images(input_dtype),), dynamic_shapes=batch)


def write_export(classifier: ImageClassifier, export_format: ExportFormat, input_dtype: InputDtype, path: Path) -> None:
    """The exported file at ``path``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the exporters' notes on torch internals say nothing about this model
        if export_format == "pt2":  # through memory: torch.export.save to a file aborts when the disk fills
            program = io.BytesIO()
            torch.export.save(export_program(classifier, input_dtype), program)
            path.write_bytes(program.getvalue())
        else:
            torch.onnx.export(
                classifier,
                (example_images(input_dtype),),
                path,
                input_names=[INPUT_NAME],
                output_names=list(OUTPUT_NAMES),
                dynamic_shapes={INPUT_NAME: {0: torch.export.Dim("batch", min=1)}},
                dynamo=True,
                external_data=False,  # one file; these models are far below ONNX's 2 GB limit
                verbose=False,
            )


def exported_runner(export_format: ExportFormat, path: Path) -> Callable[[torch.Tensor], np.ndarray]:
    """A function from an image batch to the exported model's probabilities: ONNX Runtime on the ONNX file, or
    the loaded ``torch.export`` program."""
    if export_format == "onnx":
        import onnxruntime

        session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        return lambda images: session.run([OUTPUT_NAMES[1]], {INPUT_NAME: images.numpy()})[0]
    program = torch.export.load(path).module()
    return lambda images: program(images)[1].detach().numpy()


def check_export(
    trained: TrainedModel, run: Callable[[torch.Tensor], np.ndarray], images: torch.Tensor, input_dtype: InputDtype
) -> dict:
    """The exported model against ``load_model``'s on ``images`` (uint8): how many predictions agree and the
    largest difference of a probability."""
    agree, largest = 0, 0.0
    for batch in images.split(CHECK_BATCH):
        expected = trained.probabilities(batch).numpy()
        exported = run(batch if input_dtype == "uint8" else batch.float() / 255)
        agree += int((expected.argmax(1) == exported.argmax(1)).sum())
        largest = max(largest, float(np.abs(expected - exported).max()))
    return {"images": len(images), "same_predictions": agree, "max_probability_difference": largest}


CHECK_FLAGS = ("check_dataset", "check_split", "image_column_name", "check_samples", "tolerance")  # --skip_check's


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="cifar_accel.export", description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument(
        "--model", type=user_path, required=True, help="A run's output folder, a checkpoint folder or a .safetensors."
    )
    parser.add_argument("--format", choices=typing.get_args(ExportFormat), default="onnx", help="Default: onnx.")
    parser.add_argument(
        "--input",
        choices=typing.get_args(InputDtype),
        default="uint8",
        help="What the exported model takes: uint8 pixels (default) or float32 pixels in [0, 1].",
    )
    parser.add_argument(
        "--output",
        type=user_path,
        help="Where to write it, its folders made as needed; default: model.onnx or model.pt2 beside the weights (a "
        "checkpoint's: model_<checkpoint>.onnx in its run folder).",
    )
    parser.add_argument(
        "--check_dataset", type=user_path, help="The dataset whose images check the export (default: the run's own)."
    )
    parser.add_argument("--check_split", type=non_empty, default="test", help="Its split (default: test).")
    parser.add_argument(
        "--image_column_name", type=non_empty, help="Its image column; default: the run's, else found by type."
    )
    parser.add_argument("--check_samples", type=int, help="Check on the split's first N images (default: all of them).")
    parser.add_argument(
        "--tolerance",
        type=float,
        default=1e-4,
        help="The largest difference of a probability the check accepts (default: 1e-4).",
    )
    parser.add_argument("--skip_check", action="store_true", help="Write the export without checking it.")
    return parser


def main(argv: Sequence[str]) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(format="%(message)s", stream=sys.stdout)  # the exporters' own INFO lines are not shown
    logger.setLevel(logging.INFO)
    if args.check_samples is not None and args.check_samples < 1:
        raise InputError(f"--check_samples must be at least 1, not {args.check_samples}")
    if not 0 <= args.tolerance < 1:
        raise InputError(f"--tolerance must be from 0 to below 1, not {args.tolerance}")
    idle = [flag for flag in CHECK_FLAGS if args.skip_check and getattr(args, flag) != parser.get_default(flag)]
    if idle:
        raise InputError(
            f"--{idle[0]} has no effect with --skip_check, which writes the export without checking it; leave one "
            "of them out"
        )
    require_one_process("export")
    if args.format == "onnx":
        require_onnx()
    trained = load_model(args.model)
    path = Path(args.output) if args.output else output_beside(trained.weights, EXPORT_FILES[args.format])
    suffix = Path(EXPORT_FILES[args.format]).suffix
    if path.suffix != suffix:
        raise InputError(f"--output '{path}' must end in {suffix} for --format {args.format}")
    if path.is_dir() or path.resolve() == trained.weights.resolve():
        raise InputError(f"--output '{path}' is a folder or the weights themselves; name a new file")
    dataset = None if args.skip_check else dataset_to_read(args.check_dataset, trained, "--check_dataset")
    with writable_output_dir(path.parent, "--output's folder", "--output", reads=dataset):
        export_model(args, trained, dataset, path)


def export_model(args: argparse.Namespace, trained: TrainedModel, dataset: str | None, path: Path) -> None:
    """Export ``trained`` to ``path`` as ``args`` say, with its description beside it, and check the export on
    ``dataset`` (None: no check)."""
    description_file = path.with_name(path.name + ".json")
    ours = is_export_description(description_file)  # an earlier export's, replaced
    refuse_foreign_files(path.parent, (path.name, description_file.name), "export", ours, "--output")
    images = None
    if dataset is not None:  # read before anything is written: a missing dataset leaves no export behind
        images = load_images(  # the check compares predictions with load_model's, so any images will do
            dataset,
            args.check_split,
            args.image_column_name or trained.config.image_column_name,
            args.check_samples,
            split_flag="--check_split",
            dataset_flag="--check_dataset",
        )

    normalization = trained.preprocess.normalization
    network = copy.deepcopy(trained.model).to(memory_format=torch.contiguous_format)
    classifier = ImageClassifier(network, normalization)
    check = None

    def export_and_check(temporary: Path) -> None:
        nonlocal check
        write_export(classifier.eval(), args.format, args.input, temporary)
        if images is not None:
            check = check_export(trained, exported_runner(args.format, temporary), images, args.input)

    # Written and checked under a temporary name, which takes the export's place once the check is done: a run
    # stopped before that leaves no half file, nor an unchecked export without a description (or with an earlier
    # export's).
    save_atomic(path, export_and_check)
    description = {
        "format": args.format,
        "file": path.name,
        "input": {
            "name": INPUT_NAME,
            "dtype": args.input,
            "shape": ["batch", 3, 32, 32],
            "values": "0..255" if args.input == "uint8" else "0.0..1.0 (pixels / 255)",
            "layout": "RGB, channels first",
        },
        "preprocessing": {
            "formula": ("(images / 255 - mean) / std" if args.input == "uint8" else "(images - mean) / std")
            + ", per channel, applied by the exported model itself: pass images, not normalised tensors",
            "mean": list(normalization.mean),
            "std": list(normalization.std),
            "source": normalization.source,
        },
        "outputs": {OUTPUT_NAMES[0]: ["batch", len(trained.class_names)], OUTPUT_NAMES[1]: "softmax of the logits"},
        "class_names": trained.class_names,
        "weights": {"file": str(trained.weights), "sha256": file_sha256(trained.weights)},
        "torch": torch.__version__,
        "check": None,
    }
    if check is not None:
        description["check"] = {**check, "dataset": dataset, "split": args.check_split, "tolerance": args.tolerance}
        logger.info(
            f"checked on {counted(check['images'], 'image')} of {dataset} ({args.check_split}): "
            f"{counted(check['same_predictions'], 'prediction')} the same as load_model's, largest probability "
            f"difference {check['max_probability_difference']:.2e}"
        )
    write_atomic(description_file, json.dumps(description, indent=2))
    update_model_card(trained, path)
    logger.info(f"wrote {path} and {path.name}.json")
    disagrees = check and (
        check["same_predictions"] != check["images"] or check["max_probability_difference"] > args.tolerance
    )
    if disagrees:
        raise RunFault(
            f"the export in {path} disagrees with load_model: {check['images'] - check['same_predictions']} of "
            f"{check['images']} predictions differ, largest probability difference "
            f"{check['max_probability_difference']:.2e} (tolerance {args.tolerance:g})"
        )


def update_model_card(trained: TrainedModel, path: Path) -> None:
    """Rewrite the run's model card with its exports listed, when the export sits beside the run's own final
    weights (a checkpoint's export has its JSON file only)."""
    run_dir = trained.weights.parent
    if trained.weights.name != WEIGHTS_FILE or path.parent.resolve() != run_dir.resolve():
        return
    if (run_dir / RESULTS_FILE).is_file():
        write_model_card(trained.config, read_results(run_dir / RESULTS_FILE), run_dir, trained.class_names)


def cli() -> None:
    exit_command(main)


if __name__ == "__main__":
    cli()
