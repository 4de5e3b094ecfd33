"""Classify image files: `python -m cifar_accel.predict --model outputs/cifar10 cat.png photos/`.

Images of any size or mode are converted to 32x32 RGB exactly as training data is (and the
output says so), then the top-k classes are printed as a table or as JSON lines.
"""

from __future__ import annotations

import json
import logging
import sys
import typing
import unicodedata
from collections.abc import Sequence
from pathlib import Path

import torch
from accelerate import Accelerator
from PIL import Image

from cifar_accel.config import Precision
from cifar_accel.errors import (
    ArgumentParser,
    InputError,
    counted,
    exit_command,
    first_ones,
    image_path,
    one_line,
    user_path,
)
from cifar_accel.images import to_rgb32
from cifar_accel.inference import add_tta_flags, check_tta_flags, inference_precision, load_model
from cifar_accel.precision import warn_if_not_in_effect
from cifar_accel.processes import require_one_process

IMAGE_SUFFIXES = {suffix for suffix, _ in Image.registered_extensions().items()}


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="cifar_accel.predict", description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument(
        "images",
        nargs="+",
        type=image_path,
        help="Image files, or folders whose images (not their subfolders') are all classified.",
    )
    parser.add_argument(
        "--model", type=user_path, required=True, help="A run's output folder, a checkpoint folder or a .safetensors."
    )
    parser.add_argument("--top_k", type=int, default=3, help="How many classes to show per image (default: 3).")
    parser.add_argument("--format", choices=["table", "jsonl"], default="table", help="Output format.")
    add_tta_flags(parser)
    parser.add_argument(
        "--mixed_precision",
        choices=typing.get_args(Precision),
        help="Default: the launcher's, else the run's own (which its test accuracy was measured in).",
    )
    parser.add_argument("--cpu", action="store_true", help="Run on the CPU even when a GPU is present.")
    return parser


def image_files(paths: Sequence[str]) -> tuple[list[Path], list[tuple[Path, str]]]:
    """The image files to classify (files named directly, and the regular image files directly inside a named
    folder), and what else a folder held, with why it was skipped: subfolders, FIFOs, sockets and devices are
    never opened, so nothing blocks."""
    files, skipped = [], []
    for name in paths:
        path = Path(name)
        if path.is_dir():
            for entry in sorted(path.iterdir()):
                if not entry.is_file():
                    skipped.append((entry, "not a regular file"))
                elif entry.suffix.lower() not in IMAGE_SUFFIXES:
                    skipped.append((entry, "not an image file name"))
                else:
                    files.append(entry)
        elif path.is_file():
            files.append(path)
        elif path.exists():
            raise InputError(f"'{name}' is not a regular file or a folder; pass image files or folders of images")
        else:
            raise InputError(missing_image(name))
    if not files:
        folders = [str(entry) for entry, _ in skipped if entry.is_dir()]
        inside = f"; a folder's subfolders are not searched, so name them ({first_ones(folders, 3)})" if folders else ""
        raise InputError(f"no image files found in {', '.join(paths)}{inside}")
    return files, skipped


def missing_image(name: str) -> str:
    """Why an image path that does not exist was given, for the usual mistakes (a web address, '-' for standard
    input, a pattern the shell did not expand), with what to pass instead."""
    if name.startswith(("http://", "https://")):
        return f"'{name}' is a web address, and predict reads files: download the image (curl -O URL), then pass it"
    if name == "-":
        return "'-' is not a file: predict reads image files, not standard input; pass the files or their folder"
    if any(character in name for character in "*?["):
        return (
            f"no file is named '{name}': the shell expands such a pattern before predict starts, unless it is quoted "
            f"or matches no file; leave it unquoted, or pass its folder ({Path(name).parent})"
        )
    return f"'{name}' does not exist; pass image files or folders of images"


def read_images(
    files: list[Path], named: set[Path]
) -> tuple[list[Path], torch.Tensor, list[str | None], list[tuple[Path, str]]]:
    """The readable files, as one uint8 batch (N, 3, 32, 32), and for each what it was converted from, if anything;
    then the files of a folder that could not be read, with why. A file named directly that cannot be read is an
    InputError: it was asked for by name."""
    readable, arrays, originals, unreadable = [], [], [], []
    for file in files:
        try:
            array, original = to_rgb32(file)
        except Exception as err:  # noqa: BLE001 - PIL raises many kinds for a broken file
            why = f"{type(err).__name__}: {one_line(err)[:200]}"
            if file in named:
                raise InputError(f"cannot read image '{file}' ({why})") from None
            unreadable.append((file, f"cannot be read ({why})"))
            continue
        readable.append(file)
        arrays.append(torch.tensor(array))
        originals.append(original)
    if not readable:
        raise InputError(
            f"no image could be read ({counted(len(files), 'image file')} found): "
            f"'{unreadable[0][0]}' {unreadable[0][1]}"
        )
    return readable, torch.stack(arrays), originals, unreadable


def main(argv: Sequence[str]) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(format="%(message)s", stream=sys.stdout, level=logging.WARNING)
    if args.top_k < 1:
        raise InputError(f"--top_k must be >= 1, got {args.top_k}")
    check_tta_flags(args)
    require_one_process("predict")
    trained = load_model(args.model)
    files, skipped = image_files(args.images)
    files, images, originals, unreadable = read_images(files, named={Path(name) for name in args.images})
    precision, asked = inference_precision(args.mixed_precision, trained)
    # The model as the run tested it: uncompiled, whatever torch dynamo backend a launcher profile names.
    accelerator = Accelerator(mixed_precision=precision, cpu=args.cpu, dynamo_backend="no")
    if asked:
        warn_if_not_in_effect(accelerator, "prediction runs in fp32")
    trained.model = accelerator.prepare(trained.model)
    batch_size = trained.config.per_device_eval_batch_size  # the rows of a batch are printed before the next starts
    for start in range(0, len(files), batch_size):
        batch = slice(start, start + batch_size)
        with accelerator.autocast():
            top = trained.probabilities(images[batch], args.tta, args.tta_below_confidence).topk(
                min(args.top_k, len(trained.class_names)), dim=1
            )
        for file, original, scores, indices in zip(
            files[batch], originals[batch], top.values, top.indices, strict=True
        ):
            print_prediction(file, original, [trained.class_names[i] for i in indices], scores, args.format)
    for entry, reason in skipped + unreadable:
        print(
            json.dumps({"file": str(entry), "skipped": reason})
            if args.format == "jsonl"
            else f"{one_line_name(entry)}: skipped, {reason}"
        )


def print_prediction(file: Path, original: str | None, classes: list[str], scores: torch.Tensor, form: str) -> None:
    if form == "jsonl":
        row = {
            "file": str(file),
            "top_k": [{"class": c, "probability": round(float(p), 6)} for c, p in zip(classes, scores, strict=True)],
        }
        if original:
            row["converted_from"] = original
        print(json.dumps(row))
    else:
        ranked = "  ".join(f"{c} {float(p):.3f}" for c, p in zip(classes, scores, strict=True))
        note = f"  (converted from {original} to RGB 32x32)" if original else ""
        print(f"{one_line_name(file)}: {ranked}{note}")


def one_line_name(file: Path) -> str:
    """A file's path as the table prints it, on its one line: a control character in it (a newline, which Linux
    allows in a name) as its escape, ``\\n``; the JSON lines escape it themselves."""
    return "".join(c.encode("unicode_escape").decode() if unicodedata.category(c) == "Cc" else c for c in str(file))


def cli() -> None:
    exit_command(main)


if __name__ == "__main__":
    cli()
