"""CIFAR-10 through `datasets`: load, decode once into uint8 tensors, split, and build loaders.

Images are decoded a single time by ``Dataset.map`` into a (3, 32, 32) uint8
column, which `datasets` caches on disk keyed by the dataset's fingerprint, so
a second run starts in seconds. Training then works on in-memory tensors.
"""

from __future__ import annotations

import hashlib
import inspect
import io
import json
import logging
import math
import os
import time
import traceback
import typing
import unicodedata
from dataclasses import dataclass
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
import torch
from datasets.fingerprint import Hasher
from torch.utils.data import DataLoader, Dataset, TensorDataset

from cifar_accel.config import TrainConfig, looks_like_path
from cifar_accel.errors import InputError, RunFault, counted, first_ones, not_text, one_line
from cifar_accel.images import GIT_LFS_FIX, IMAGE_SIZE, GitLfsPointer, git_lfs_pointer, image_to_rgb32, to_rgb32
from cifar_accel.outputs import disk_full, fix_for
from cifar_accel.progress import progress
from cifar_accel.transforms import CIFAR10_NORMALIZATION, Normalization, normalized_by_cifar10_constants

E = typing.TypeVar("E", bound=BaseException)

logger = logging.getLogger(__name__)


DATASET_LAYOUTS = "Hub layout: data/train-*.parquet; image folder: train/<class>/"
SAMPLES_FLAGS = {"--split": "--max_eval_samples", "--check_split": "--check_samples"}  # each split flag's first-N flag


def first_git_lfs_pointer(folder: Path) -> Path | None:
    """The first Git LFS pointer among a dataset folder's files, if any (pointers are under 1 KB)."""
    for root, _, names in os.walk(folder):
        for name in sorted(names):
            path = Path(root, name)
            if path.is_file() and path.stat().st_size < 1024 and git_lfs_pointer(path):  # not a broken link
                return path
    return None


HUB_COPIES = {"CIFAR-10": "uoft-cs/cifar10", "CIFAR-100": "uoft-cs/cifar100"}


def pickled_cifar(folder: Path) -> str | None:
    """'CIFAR-10' or 'CIFAR-100' where a folder is (or holds, as torchvision's root folder does) that dataset's python
    version, cifar-10-batches-py or cifar-100-python, else None."""
    for inside in (folder, folder / "cifar-10-batches-py", folder / "cifar-100-python"):
        if (inside / "batches.meta").is_file() and (inside / "data_batch_1").is_file():
            return "CIFAR-10"
        if all((inside / name).is_file() for name in ("meta", "train", "test")):
            return "CIFAR-100"
    return None


def local_copy_hint(dataset_flag: str) -> str:
    return f"pass {dataset_flag} with a local copy in Hub layout, e.g. ../shared/data/cifar10-jpeg"


@dataclass
class Split:
    images: torch.Tensor  # (N, 3, 32, 32) uint8
    labels: torch.Tensor  # (N,) int64
    # A decoded split's per-channel pixel sums and sums of squares, (2, 3) int64, from the datasets cache
    pixel_moments: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.labels)

    def subset(self, indices: torch.Tensor) -> Split:
        return Split(self.images[indices], self.labels[indices])


@dataclass
class CifarData:
    train: Split
    val: Split
    test: Split
    class_names: list[str]
    normalization: Normalization
    image_column: str
    label_column: str
    val_split: str | None = None  # the dataset's own split validated on; None: a part of train held out, or none


def data_signature(data: CifarData) -> str:
    """SHA-256 of the class names and of every image and label a run trains, validates and tests on: what a
    resume checks the data by, wherever the dataset lies now (about 0.1 s for CIFAR-10)."""
    digest = hashlib.sha256(json.dumps(data.class_names).encode())
    for split in (data.train, data.val, data.test):
        for tensor in (split.images, split.labels):
            digest.update(tensor.contiguous().numpy())
    return digest.hexdigest()


# The variables that place the caches of `datasets` and of the Hub's downloads. Set but empty, each is taken as the
# current folder, where the cache's files would land among the user's (a local dataset's in its own folder).
CACHE_VARIABLES = ("HF_DATASETS_CACHE", "HF_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME")


def check_dataset_path(dataset_name: str, dataset_flag: str = "--dataset_name") -> None:
    """Refuse a local dataset path that does not exist or is a file, and a cache variable set but empty, before any
    work starts; ``dataset_flag`` is the flag that named the dataset."""
    for variable in CACHE_VARIABLES:
        if os.environ.get(variable) == "":
            raise InputError(
                f"{variable} is set but empty, which datasets and the Hub take as the current folder: their caches "
                f"would be written into {Path.cwd()} (a local dataset's into its own folder); unset {variable}, or "
                "set it to a folder for the cache"
            )
    if looks_like_path(dataset_name) and not Path(dataset_name).expanduser().exists():
        raise InputError(f"dataset path '{dataset_name}' does not exist; {local_copy_hint(dataset_flag)}")
    if looks_like_path(dataset_name) and Path(dataset_name).expanduser().is_file():
        raise InputError(f"dataset path '{dataset_name}' is a file; pass the dataset's folder ({DATASET_LAYOUTS})")


def cause_of(err: BaseException, kind: type[E]) -> E | None:
    """``err``, or the first exception of ``kind`` it was raised from or during (`datasets` wraps its causes)."""
    cause: BaseException | None = err
    while cause is not None and not isinstance(cause, kind):
        cause = cause.__cause__ or cause.__context__
    return cause


def datasets_cache_fault(err: BaseException, work: str) -> InputError | RunFault | None:
    """A failed write to the datasets cache (where load_dataset writes its Arrow files and locks, and decoding its
    tensors) as one line with its fix; ``work`` says what was being written. None for any other failure."""
    cause = cause_of(err, OSError)
    if cause is None:
        return None
    cache = Path(datasets.config.HF_DATASETS_CACHE)
    if disk_full(cause):
        return RunFault(
            f"{work} in the datasets cache {cache} failed ({cause.strerror}); {fix_for(cause)}, or set "
            "HF_DATASETS_CACHE to a folder on another, then run again"
        )
    failed = Path(cause.filename) if cause.filename else None
    if failed and (failed in (cache, *cache.parents) or cache in failed.parents):  # making it, or writing in it
        return InputError(
            f"the datasets cache {cache} is not writable ({cause.strerror}); set HF_DATASETS_CACHE (or HF_HOME) to "
            "a folder you can write to"
        )
    return None


def arrow_read_error(err: BaseException) -> bool:
    """Whether ``err`` is Arrow's failure to read a file: its ArrowInvalid, or the plain OSError without an errno it
    raises for a file cut short (where `datasets` raises FileNotFoundError, and the system an OSError with errno)."""
    io_error = cause_of(err, OSError)
    return cause_of(err, pa.ArrowInvalid) is not None or (type(io_error) is OSError and io_error.errno is None)


def damaged_cache_fault(folder: Path) -> RunFault | None:
    """A file of the datasets cache in ``folder`` (a dataset's folder there) that cannot be read back, cut short by a
    run killed while writing it or by a disk that filled, as one line that says to delete the folder: its
    dataset_info.json (which must name the splits) or an Arrow file. None where every file there reads whole (the
    fault is elsewhere: the user's files)."""
    damage = None
    info = folder / datasets.config.DATASET_INFO_FILENAME
    if info.is_file():
        try:
            if not datasets.DatasetInfo.from_directory(str(folder)).splits:
                damage = info, "it names no splits"
        except (ValueError, TypeError, AttributeError) as err:  # JSON cut short, not UTF-8, or of another shape
            damage = info, one_line(err)
    for file in sorted(folder.glob("*.arrow")) if damage is None else ():
        try:
            with pa.memory_map(str(file)) as source:
                pa.ipc.open_stream(source).read_all()
        except (OSError, pa.ArrowInvalid) as err:
            damage = file, one_line(err)
            break
    if damage is None:
        return None
    file, reason = damage
    return RunFault(
        f"the datasets cache holds a damaged file, {file} ({reason[:120]}), as a run killed while writing it leaves; "
        f"delete {folder} and run again, which reads and decodes the data again"
    )


def builder_cache_folder(err: BaseException) -> Path | None:
    """The cache folder of the `datasets` builder whose code raised ``err`` (found in its traceback), where it
    reads and writes a dataset's prepared files; None where no builder had one."""
    for frame, _ in traceback.walk_tb(err.__traceback__):
        builder = frame.f_locals.get("self")
        if isinstance(builder, datasets.DatasetBuilder) and getattr(builder, "_cache_dir", None):
            return Path(builder.cache_dir)
    return None


def name_not_text(folder: Path) -> str | None:
    """The first file or folder under ``folder`` whose name is not UTF-8 text (its other bytes shown as escapes),
    relative to it; None where every name is."""
    for root, folders, files in os.walk(folder):
        for name in (*folders, *files):
            if not_text(name):
                return os.fsencode(Path(root, name).relative_to(folder)).decode("utf-8", "backslashreplace")
    return None


def load_raw(
    dataset_name: str,
    splits: tuple[str, ...] = ("train", "test"),
    split_flag: str | None = None,
    dataset_flag: str = "--dataset_name",
) -> datasets.DatasetDict:
    """``datasets.load_dataset`` with failures turned into one actionable line; ``splits`` must be present (where
    ``split_flag`` chose them, that flag is the fix named when one is not). ``dataset_flag`` named the dataset."""
    check_dataset_path(dataset_name, dataset_flag)
    datasets.disable_progress_bars()  # they write to stderr, which the commands keep for their one error line
    try:
        path = str(Path(dataset_name).expanduser()) if looks_like_path(dataset_name) else dataset_name
        raw = datasets.load_dataset(path)
    except (ConnectionError, datasets.exceptions.DatasetNotFoundError) as err:
        parent = Path(dataset_name).parent
        if parent != Path() and parent.is_dir():  # 'data/cifar10' beside a folder data/: a local path, mistyped
            raise InputError(
                f"cannot load dataset '{dataset_name}': {parent}/ holds no '{Path(dataset_name).name}', and as a Hub "
                f"id it failed too ({err}); check the path"
            ) from None
        raise InputError(
            f"cannot load dataset '{dataset_name}' ({err}); offline, {local_copy_hint(dataset_flag)}"
        ) from None
    except Exception as err:  # noqa: BLE001 - a damaged cache file fails in many ways; others are raised below
        fault = datasets_cache_fault(err, f"preparing dataset '{dataset_name}'")
        if not fault and (folder := builder_cache_folder(err)):
            fault = damaged_cache_fault(folder)
        if fault:
            raise fault from None
        if cause_of(err, UnicodeEncodeError) and looks_like_path(dataset_name) and (name := name_not_text(Path(path))):
            raise InputError(
                f"dataset '{dataset_name}' holds '{name}', a name that is not UTF-8 text, which datasets cannot read; "
                "rename it"
            ) from None
        if "corresponds to no data" in str(err):  # how `datasets` reports a split without rows
            raise InputError(f"dataset '{dataset_name}' has an empty split ({err}); every split needs images") from None
        if looks_like_path(dataset_name) and (pointer := first_git_lfs_pointer(Path(path))):
            raise InputError(
                f"cannot load dataset '{dataset_name}': {pointer} is a Git LFS pointer, not the data it stands for; "
                f"{GIT_LFS_FIX}"
            ) from None
        generation = isinstance(err, datasets.exceptions.DatasetGenerationError) and not cause_of(err, OSError)
        if not generation and not isinstance(err, (FileNotFoundError, ValueError)):
            raise  # a fault of the machine (an I/O error) or of `datasets`, reported as such
        if looks_like_path(dataset_name) and (hub_copy := pickled_cifar(Path(path))):
            raise InputError(
                f"cannot load dataset '{dataset_name}': it holds {hub_copy}'s python version (the pickled batches "
                f"that torchvision downloads), which datasets does not read; pass {dataset_flag} "
                f"{HUB_COPIES[hub_copy]} (downloaded once and cached by datasets), or a local copy in Hub layout"
            ) from None
        fix = (
            f"; pass a folder that datasets.load_dataset reads ({DATASET_LAYOUTS})"
            if looks_like_path(dataset_name)
            else ""
        )
        reason = f"datasets could not read its files ({generation_failure(err)})" if generation else err
        raise InputError(f"cannot load dataset '{dataset_name}': {reason}{fix}") from None
    check_splits(raw, dataset_name, splits, split_flag)
    return raw


def generation_failure(err: datasets.exceptions.DatasetGenerationError) -> str:
    """What a `datasets` builder failed on as it read a dataset's files, which its error wraps: files whose columns
    differ, or the error of the reader (a CSV parser's, say)."""
    if columns := cause_of(err, datasets.table.CastError):
        return f"not all of them have the same columns: {columns.details().rstrip('.')}"
    cause = err.__cause__ or err.__context__ or err
    lines = str(cause).strip().splitlines()
    return f"{type(cause).__name__}: {lines[0] if lines else 'no message'}"


def check_splits(
    raw: datasets.DatasetDict,
    dataset_name: str,
    splits: tuple[str, ...],
    split_flag: str | None,
    also: tuple[str, ...] = (),
) -> None:
    """``splits`` must be present in ``raw``, the dataset ``dataset_name``; ``split_flag``, where it chose them, is
    the fix named when one is not, with the splits of ``raw`` and those in ``also`` to choose from."""
    for split in splits:
        if split not in raw:
            name = split.partition("[")[0]
            if split_flag and name in raw and split.endswith("]"):  # datasets' slice syntax, test[:100]
                raise InputError(
                    f"{split_flag} takes a split's name, not a slice ('{split}'): give {split_flag} {name}, and "
                    f"{SAMPLES_FLAGS[split_flag]} N for its first N images"
                )
            fix = (
                f"pick one of them with {split_flag}"
                if split_flag
                else f"add a '{split}' split (Hub layout: data/{split}-*.parquet; image folder: {split}/<class>/)"
            )
            raise InputError(
                f"dataset '{dataset_name}' has no '{split}' split (splits: {', '.join([*raw, *also])}); {fix}"
            )


IMAGE_SOURCE_DTYPES = ("string", "large_string", "binary", "large_binary")  # file paths or encoded bytes
IMAGE_STORAGE = {"bytes": ("binary", "large_binary"), "path": ("string", "large_string")}


def holds_images(feature: object) -> bool:
    """Whether a column is an Image, or the struct of encoded bytes and file path that `datasets` stores one as:
    what a parquet file written without `datasets`' metadata (by pandas or pyarrow) holds, which it reads as a
    struct."""
    if isinstance(feature, datasets.Image):
        return True
    return (
        isinstance(feature, dict)
        and bool(feature)
        and all(getattr(feature[key], "dtype", None) in IMAGE_STORAGE.get(key, ()) for key in feature)
    )


def find_columns(features: datasets.Features, image_column: str | None, label_column: str | None) -> tuple[str, str]:
    """The image and label column names: as given, or found from the feature types."""
    image_column = find_image_column(features, image_column)
    if label_column is None:
        label_column = next((k for k, v in features.items() if isinstance(v, datasets.ClassLabel)), "label")
    if label_column not in features:
        names = ", ".join(features)
        folder = (
            "; an image folder has labels only where every split's images sit in class folders, two or more "
            "(<split>/<class>/)"
            if all(isinstance(feature, datasets.Image) for feature in features.values())
            else ""
        )
        raise InputError(
            f"label column '{label_column}' not found (columns: {names}); name it with --label_column_name{folder}"
        )
    return image_column, label_column


def named_classes(raw: datasets.DatasetDict, label_column: str) -> datasets.DatasetDict:
    """``raw`` with a label column of class names (strings, as an image folder's metadata.csv has them) cast to a
    ClassLabel of those names, sorted, the same in every split; any other label column as it is. (`datasets`'
    ``class_encode_column`` would name each split's classes from that split alone.)"""
    feature = next(iter(raw.values())).features[label_column]
    if getattr(feature, "dtype", None) not in ("string", "large_string"):
        return raw
    names = sorted({name for dataset in raw.values() for name in dataset.unique(label_column) if name is not None})
    return raw.cast_column(label_column, datasets.ClassLabel(names=names))


def find_image_column(features: datasets.Features, image_column: str | None) -> str:
    """The image column's name: as given, or found from the feature types."""
    names = ", ".join(features)
    if image_column is None:
        image_column = next((k for k, v in features.items() if holds_images(v)), None)
        if image_column is None:
            raise InputError(f"no image column found (columns: {names}); name it with --image_column_name")
    elif image_column not in features:
        raise InputError(f"image column '{image_column}' not found (columns: {names}); fix --image_column_name")
    feature = features[image_column]
    if not holds_images(feature) and getattr(feature, "dtype", None) not in IMAGE_SOURCE_DTYPES:
        held = feature.dtype if isinstance(feature, datasets.Value) else type(feature).__name__
        images = [k for k, v in features.items() if holds_images(v)]
        raise InputError(
            f"image column '{image_column}' holds {held}, not images (Image columns: {', '.join(images) or 'none'}); "
            "fix --image_column_name"
        )
    return image_column


class DecodeProgress:
    """What decoding a split did: its progress on stdout (``progress.progress``), shown where INFO is logged (the
    main process), and the count of images decoded, which stays 0 when `datasets` had them cached."""

    def __init__(self, split: str, total: int) -> None:
        self.images = 0
        self.bar = progress(
            total=total, desc=f"decoding {split}", unit=" images", show=logger.isEnabledFor(logging.INFO)
        )

    def update(self, images: int) -> None:
        self.images += images
        self.bar.update(images)


def _decode_batch(batch: dict, indices: list[int], image_column: str, split: str, progress: DecodeProgress) -> dict:
    """Decode encoded images to (3, 32, 32) uint8 arrays; a row that cannot be decoded is named."""
    progress.update(len(indices))
    pixels, converted, moments = [], [], []
    for index, image in zip(indices, batch[image_column], strict=True):
        if image is None or (image["bytes"] is None and image["path"] is None):
            raise InputError(f"{split} image {index} (column '{image_column}') is empty; fix or drop that row")
        try:
            array, original = to_rgb32(io.BytesIO(image["bytes"]) if image["bytes"] is not None else image["path"])
        except Exception as err:  # noqa: BLE001 - PIL raises many kinds for a broken file
            where, fix = f"column '{image_column}'", "fix or drop that row"
            if image["bytes"] is None:  # a row of an image folder is a file, which its row number would not find
                where, fix = f"{where}, file {image['path']}", "fix or remove that file"
            if isinstance(err, GitLfsPointer):
                raise InputError(f"{split} image {index} ({where}) is {err}") from None
            reason = f"{type(err).__name__}: {one_line(err)[:200]}"
            raise InputError(f"{split} image {index} ({where}) cannot be decoded ({reason}); {fix}") from None
        pixels.append(array)
        converted.append(original is not None)
        channels = array.reshape(3, -1).astype(np.int64)
        moments.append(np.stack([channels.sum(1), (channels * channels).sum(1)]))
    return {"pixels": pixels, "converted": converted, "moments": moments}


DECODER_CODE = "".join(inspect.getsource(f) for f in (_decode_batch, to_rgb32, image_to_rgb32))


def check_label_values(labels: list, label_column: str, split: str) -> None:
    """The labels of a column of plain values must be whole class numbers: refuse empty cells and fractions, naming
    the first row."""
    for index, label in enumerate(labels):
        if label is None:
            problem = "is empty"
        elif isinstance(label, float) and not label.is_integer():
            problem = f"is {label}, not a whole class number"
        elif not isinstance(label, int | float) or isinstance(label, bool):
            problem = f"is a {type(label).__name__}, not a class number"
        else:
            continue
        raise InputError(f"{split} label {index} (column '{label_column}') {problem}; fix that row or the column")


def decode_split(
    dataset: datasets.Dataset, image_column: str, label_column: str, split: str, dataset_flag: str = "--dataset_name"
) -> Split:
    """One split as uint8 tensors; the decoded copy is cached by `datasets`."""
    if len(dataset) == 0:
        raise InputError(f"the '{split}' split is empty; point {dataset_flag} at a dataset with images in it")
    if not isinstance(dataset.features[label_column], datasets.ClassLabel):  # its empty cells are found once decoded
        check_label_values(label_values(dataset, label_column), label_column, split)
    dataset = dataset.cast_column(image_column, datasets.Image(decode=False))
    features = datasets.Features(
        {
            "pixels": datasets.Array3D((3, IMAGE_SIZE, IMAGE_SIZE), "uint8"),
            "converted": datasets.Value("bool"),
            "moments": datasets.Array2D((2, 3), "int64"),
            label_column: dataset.features[label_column],
        }
    )
    progress, start = DecodeProgress(split, len(dataset)), time.perf_counter()
    try:
        decoded = dataset.map(
            _decode_batch,
            batched=True,
            with_indices=True,
            fn_kwargs={"image_column": image_column, "split": split, "progress": progress},
            remove_columns=[c for c in dataset.column_names if c != label_column],
            features=features,
            # The cache key, given because the progress bar cannot be hashed: the data, what decoding depends on,
            # and the decoding code itself, so a change to it decodes again.
            new_fingerprint=Hasher.hash(
                [dataset._fingerprint, image_column, label_column, split, features, DECODER_CODE]
            ),
        ).with_format("arrow")[:]  # the numpy and torch formatters would widen uint8 to int64
        if decoded[label_column].null_count:
            empty = decoded[label_column].to_pylist().index(None)
            raise InputError(f"{split} label {empty} (column '{label_column}') is empty; fix that row or the column")
    except (OSError, pa.ArrowInvalid) as err:
        fault = datasets_cache_fault(err, f"caching the decoded {split} split")
        if not fault and arrow_read_error(err) and dataset.cache_files:
            fault = damaged_cache_fault(Path(dataset.cache_files[0]["filename"]).parent)
        if fault:
            raise fault from None
        raise
    progress.bar.close()
    if progress.images:
        seconds = time.perf_counter() - start
        logger.info(
            "%s: decoded %s in %.1f s, cached by datasets for later runs",
            split,
            counted(len(dataset), "image"),
            seconds,
        )
    else:
        logger.info("%s: %s from the datasets cache (decoded by an earlier run)", split, counted(len(dataset), "image"))
    converted = decoded["converted"].to_numpy().sum()
    if converted:
        logger.info("%s: converted %s to %dx%d RGB", split, counted(int(converted), "image"), IMAGE_SIZE, IMAGE_SIZE)
    pixels = decoded["pixels"].combine_chunks().to_numpy(zero_copy_only=False)
    moments = decoded["moments"].combine_chunks().to_numpy(zero_copy_only=False).sum(0)
    return Split(torch.tensor(pixels), torch.tensor(decoded[label_column].to_numpy()).long(), torch.tensor(moments))


def computed_normalization(split: Split, dataset_name: str) -> Normalization:
    """The per-channel mean and (population) std of a decoded split's pixels, scaled to [0, 1] and rounded to 4
    decimals as CIFAR-10's published constants are; from the split's cached integer sums, so exactly the same on
    every machine."""
    count = len(split) * IMAGE_SIZE * IMAGE_SIZE
    sums, squares = (split.pixel_moments[row].tolist() for row in (0, 1))
    mean = tuple(round(s / count / 255, 4) for s in sums)
    std = tuple(round(math.sqrt((count * q - s * s) / count**2) / 255, 4) for s, q in zip(sums, squares, strict=True))
    if min(std) == 0:
        raise InputError(
            f"a colour channel has the same value in every training image of '{dataset_name}', so its own statistics "
            "cannot normalise it; pass --normalization cifar10"
        )
    return Normalization(mean, std, f"computed from the {len(split)} training images of {dataset_name}")


def choose_normalization(config: TrainConfig, train: Split, class_names: list[str]) -> Normalization:
    """What ``--normalization`` asks for: CIFAR-10's constants, or statistics computed from the training split
    (``auto``: the constants for a dataset with CIFAR-10's classes, computed for any other)."""
    if normalized_by_cifar10_constants(config.normalization, class_names):
        return CIFAR10_NORMALIZATION
    return computed_normalization(train, config.dataset_name)


MAX_NUMBERED_CLASSES = 100_000  # ImageNet-21k has 21,841; a larger label is an id or a value, not a class number


def class_names_of(feature: object, labels: list, label_column: str, split_name: str) -> list[str]:
    """The class names of a label column (its ``feature``, and ``labels``, those of the whole split): a ClassLabel's
    names, else the label numbers 0..max (the first rows may not hold the largest; none where no label is 0 or
    more), at most ``MAX_NUMBERED_CLASSES`` of them."""
    if isinstance(feature, datasets.ClassLabel):
        for index, name in enumerate(feature.names):
            if not name.strip() or any(unicodedata.category(character) == "Cc" for character in name):
                problem = "is empty" if not name.strip() else "holds a line break or another control character"
                raise InputError(
                    f"the name of class {index} (label column '{label_column}') {problem} ({name!r}); the tables, "
                    "predictions and model card show each class on one line: rename it in the dataset"
                )
        return list(feature.names)
    check_label_values(labels, label_column, split_name)
    top = max((label for label in labels if label is not None), default=-1)
    if top >= MAX_NUMBERED_CLASSES:
        raise InputError(
            f"{split_name} label {top} at index {labels.index(top)} (column '{label_column}') is above "
            f"{MAX_NUMBERED_CLASSES - 1:,}, the largest class number taken (an id, not a class?); fix that row, or "
            "name the column of class numbers with --label_column_name"
        )
    return numbered(int(top) + 1)


def label_values(dataset: datasets.Dataset, label_column: str) -> list:
    """Every label of ``dataset``, as stored."""
    return dataset.with_format("arrow")[label_column].to_pylist()


def numbered(count: int) -> list[str]:
    """The class names of a label column of plain numbers: '0', '1', ..."""
    return [str(i) for i in range(count)]


EVALUATE_UNLABELLED_FIX = (
    "accuracy needs them: pick a labelled --split, or classify its images with cifar_accel.predict"
)
UNLABELLED_FIXES = {  # what to do about a split of a training run's dataset with no labels at all
    "train": "training needs them: give a dataset whose train split is labelled",
    "validation": "train without validation with --val_ratio 0, or give a dataset whose validation split is labelled",
    "test": "a run tests its final weights on them: give a dataset whose test split is labelled",
}


def check_labels(split_name: str, split: Split, num_classes: int, unlabelled_fix: str | None = None) -> None:
    """Every label a class number below ``num_classes``; a split with no labels at all (-1 in every row, as
    `datasets` marks a row without one) is refused with ``unlabelled_fix``, or the training run's fix for it."""
    if len(split.labels) and bool((split.labels == -1).all()):
        fix = unlabelled_fix or UNLABELLED_FIXES[split_name]
        raise InputError(
            f"the '{split_name}' split has no labels (-1 in every row, datasets' mark for a missing label); {fix}"
        )
    bad = ((split.labels < 0) | (split.labels >= num_classes)).nonzero()
    if len(bad):
        index = int(bad[0])
        label = int(split.labels[index])
        if label == -1:
            raise InputError(
                f"{split_name} label at index {index} is missing (-1, datasets' mark for a missing label); label "
                "that row, or drop the rows without labels"
            )
        if label < 0:
            raise InputError(
                f"{split_name} label {label} at index {index} is below 0, where class numbers start; fix the labels or "
                "--label_column_name"
            )
        raise InputError(
            f"{split_name} label {label} at index {index} is outside 0..{num_classes - 1}; "
            "fix the labels or --label_column_name"
        )


def first_rows(dataset: datasets.Dataset, count: int | None) -> datasets.Dataset:
    """The first ``count`` rows of ``dataset`` (all of them when ``count`` is None or larger)."""
    return dataset if count is None else dataset.select(range(min(count, len(dataset))))


def warn_if_classes_left_out(kept: torch.Tensor, every: list, split: str, flag: str) -> None:
    """A warning where ``flag`` kept the first rows of a split, with labels ``kept``, and they leave out classes
    that its labels ``every`` have though they are enough to hold each: rows are kept in the dataset's order, and an
    image folder's come class by class."""
    classes = {int(label) for label in every if label is not None}
    missing = classes - set(kept.tolist())
    if missing and len(kept) >= len(classes):
        logger.warning(
            "%s: %s kept its first %d images, which leave out %d of its %d classes (rows are kept in the dataset's "
            "order, and an image folder lists its images class by class)",
            split, flag, len(kept), len(missing), len(classes),
        )  # fmt: skip


def warn_if_classes_untrained(train_labels: list, test_labels: torch.Tensor, class_names: list[str]) -> None:
    """A warning where the test split has images of classes that no image of the train split (labels
    ``train_labels``) has: a model cannot learn them, and the test counts each such image as an error."""
    untrained = sorted(set(test_labels.tolist()) - {label for label in train_labels if label is not None})
    if untrained:
        images = int(torch.isin(test_labels, torch.tensor(untrained)).sum())
        names = first_ones([repr(class_names[label]) for label in untrained], 5)
        logger.warning(
            "test: %d of its images belong to classes that no training image has (%s): a model cannot learn them, "
            "and the test counts those images as errors; check the train split",
            images, names,
        )  # fmt: skip


def load_split(
    dataset_name: str,
    split: str,
    image_column: str | None,
    label_column: str | None,
    max_samples: int | None,
    split_flag: str = "--split",
    dataset_flag: str = "--dataset_name",
    classes: list[str] | None = None,
    run: TrainConfig | None = None,
) -> tuple[Split, list[str]]:
    """One split of a dataset as tensors (for evaluation), with the class names of its label column; ``split_flag``
    and ``dataset_flag`` are the flags that named the split and the dataset (evaluate's by default). Given a model's
    ``classes``, the labels become indices of those instead: matched by name where both name their classes, taken as
    they are where either has numbers. Given the ``run`` that trained on this dataset, 'validation' in a dataset
    without such a split is the part of train that the run held out and validated on (``held_out_validation``)."""
    raw = load_raw(dataset_name, splits=(), dataset_flag=dataset_flag)
    held_out = split == "validation" and split not in raw and run is not None
    if held_out and run.val_ratio == 0:
        raise InputError(
            f"dataset '{dataset_name}' has no 'validation' split, and the run held none out of train (--val_ratio 0); "
            f"pick one of its splits ({', '.join(raw)}) with {split_flag}"
        )
    source = "train" if held_out else split
    held_out_too = run is not None and run.val_ratio > 0 and "validation" not in raw
    also = ("validation (the run's, held out of train)",) if held_out_too else ()
    check_splits(raw, dataset_name, (source,), split_flag, also)
    image_column, label_column = find_columns(raw[source].features, image_column, label_column)
    raw = named_classes(raw, label_column)
    if held_out:
        tensors = held_out_validation(raw["train"], image_column, label_column, run, max_samples, dataset_flag)
    else:
        dataset = first_rows(raw[split], max_samples)
        tensors = decode_split(dataset, image_column, label_column, split, dataset_flag)
        if len(dataset) < len(raw[split]):
            every_label = label_values(raw[split], label_column)
            warn_if_classes_left_out(tensors.labels, every_label, split, "--max_eval_samples")
    feature = raw[source].features[label_column]
    if classes is None:
        classes = class_names_of(feature, label_values(raw[source], label_column), label_column, source)
    elif isinstance(feature, datasets.ClassLabel) and classes not in (feature.names, numbered(len(classes))):
        tensors = labels_by_name(tensors, feature.names, classes, split)
    check_labels(split, tensors, len(classes), EVALUATE_UNLABELLED_FIX)
    return tensors, classes


def held_out_validation(
    train: datasets.Dataset,
    image_column: str,
    label_column: str,
    run: TrainConfig,
    max_samples: int | None,
    dataset_flag: str,
) -> Split:
    """The validation images that ``run`` held out of the ``train`` split, in the order it validated on them: the
    part ``split_indices`` gives for its --val_ratio and --seed, of its first --max_train_samples (decoded as
    training decoded them, so from the datasets cache); the first ``max_samples`` of them where given, else the
    first --max_eval_samples of the run's, as it validated."""
    rows = first_rows(train, run.max_train_samples)
    _, val_indices = split_indices(len(rows), run.val_ratio, run.seed)
    first = max_samples if max_samples is not None else run.max_eval_samples
    return decode_split(rows, image_column, label_column, "train", dataset_flag).subset(val_indices[:first])


def load_images(
    dataset_name: str, split: str, image_column: str | None, max_samples: int | None, split_flag: str, dataset_flag: str
) -> torch.Tensor:
    """The images of one split of a dataset, (N, 3, 32, 32) uint8, whether it has labels or not (a folder of photos);
    ``split_flag`` and ``dataset_flag`` are the flags that named the split and the dataset."""
    raw = load_raw(dataset_name, splits=(split,), split_flag=split_flag, dataset_flag=dataset_flag)
    dataset = first_rows(raw[split], max_samples)
    image_column = find_image_column(dataset.features, image_column)
    # Decoding keeps a label column: -1 in every row, as `datasets` marks a row without a label.
    dataset = dataset.select_columns([image_column]).add_column("label", [-1] * len(dataset))
    return decode_split(dataset, image_column, "label", split, dataset_flag).images


def labels_by_name(split: Split, names: list[str], classes: list[str], split_name: str) -> Split:
    """``split``, whose labels index ``names``, with each label turned into the index of its name in ``classes``; a
    class of the split that ``classes`` does not have is refused in one line."""
    check_labels(split_name, split, len(names), EVALUATE_UNLABELLED_FIX)
    unknown = [names[i] for i in split.labels.unique().tolist() if names[i] not in classes]
    if unknown:
        listed, known = first_ones([repr(name) for name in unknown], 10), first_ones(classes, 20)
        raise InputError(
            f"the '{split_name}' split has images of classes the model does not know ({listed}); its "
            f"{len(classes)} classes are {known}: name the split's classes as the model does, or leave those images out"
        )
    index = torch.tensor([classes.index(name) if name in classes else -1 for name in names])
    return Split(split.images, index[split.labels])


def split_indices(size: int, val_ratio: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices of the training and validation parts of a train split of ``size`` images, shuffled by ``seed``;
    with ``val_ratio`` 0 the validation part is empty."""
    order = torch.randperm(size, generator=torch.Generator().manual_seed(seed))
    num_val = max(1, round(size * val_ratio)) if val_ratio > 0 else 0
    if num_val >= size:
        raise InputError(
            f"--val_ratio {val_ratio} leaves no training images out of {size}; lower it (0 trains on all of them)"
        )
    return order[num_val:], order[:num_val]


def load_data(config: TrainConfig) -> CifarData:
    """Train/validation/test splits as tensors. The validation split is the dataset's own 'validation' split where
    it has one, as Hugging Face's examples take it, else a part of the train split seeded by ``config.seed``; with
    ``--val_ratio 0`` there is none."""
    raw = load_raw(config.dataset_name)
    image_column, label_column = find_columns(raw["train"].features, config.image_column_name, config.label_column_name)
    raw = named_classes(raw, label_column)
    train_raw = first_rows(raw["train"], config.max_train_samples)
    full_train = decode_split(train_raw, image_column, label_column, "train")
    test = decode_split(raw["test"], image_column, label_column, "test")

    every_label = label_values(raw["train"], label_column)
    class_names = class_names_of(raw["train"].features[label_column], every_label, label_column, "train")
    check_labels("train", full_train, len(class_names))  # before the count: labels all below 0 number no class
    if len(class_names) < 2:
        raise InputError(
            f"dataset '{config.dataset_name}' has one class ({class_names[0]!r}, label column '{label_column}'), and "
            "a classifier needs two or more; check the labels, or name another column with --label_column_name"
        )
    check_labels("test", test, len(class_names))
    if len(train_raw) < len(raw["train"]):
        warn_if_classes_left_out(full_train.labels, every_label, "train", "--max_train_samples")
    warn_if_classes_untrained(every_label, test.labels, class_names)

    val_split = "validation" if config.val_ratio > 0 and "validation" in raw else None
    if val_split:
        train, val = full_train, decode_split(raw[val_split], image_column, label_column, val_split)
        check_labels("validation", val, len(class_names))
        logger.info("validation: the dataset's own 'validation' split (--val_ratio holds out a part of train only "
                    "where a dataset has none)")  # fmt: skip
    else:
        train_indices, val_indices = split_indices(len(full_train), config.val_ratio, config.seed)
        train, val = full_train.subset(train_indices), full_train.subset(val_indices)
    if config.max_eval_samples is not None:
        val = val.subset(torch.arange(min(config.max_eval_samples, len(val))))
        kept = test.subset(torch.arange(min(config.max_eval_samples, len(test))))
        warn_if_classes_left_out(kept.labels, test.labels.tolist(), "test", "--max_eval_samples")
        test = kept
    normalization = choose_normalization(config, full_train, class_names)
    logger.info("inputs normalised by mean %s, std %s: %s", normalization.mean, normalization.std, normalization.source)
    return CifarData(train, val, test, class_names, normalization, image_column, label_column, val_split)


class TrainImages(Dataset):
    """The training split for a DataLoader, on whichever device its tensors are: a batch is fetched with one
    indexing operation (``__getitems__``) rather than image by image.

    With ``alternate_flip`` each image is mirrored in every other epoch, starting from a random half of the
    images (drawn from ``seed``), so that every image is seen both ways round in any two epochs in a row. The
    flips depend only on the seed and the epoch the loader sets (``set_epoch``), so a resumed run sees the same.
    """

    def __init__(self, split: Split, alternate_flip: bool = False, seed: int = 0) -> None:
        self.images, self.labels = split.images, split.labels
        self.first_flips = None
        if alternate_flip:
            first = torch.randint(0, 2, (len(split),), generator=torch.Generator().manual_seed(seed), dtype=torch.bool)
            self.first_flips = first.to(split.images.device)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        images, labels = self.__getitems__([index])
        return images[0], labels[0]

    def __getitems__(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        index = torch.tensor(indices, device=self.images.device)
        images = self.images[index]
        if self.first_flips is not None:
            flipped = self.first_flips[index] ^ bool(self.epoch % 2)
            images = torch.where(flipped.view(-1, 1, 1, 1), images.flip(3), images)
        return images, self.labels[index]


def _batch_as_fetched(batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    return batch  # TrainImages.__getitems__ returns whole batches: nothing to collate


def make_loader(split: Split, batch_size: int, train: bool, seed: int = 0, alternate_flip: bool = False) -> DataLoader:
    """Batches of (uint8 images, labels); training batches are shuffled and the last partial one dropped.

    The loader gets a generator of its own, so iterating it (even unshuffled: each iteration draws a base seed)
    never draws from the global torch RNG that the augmentation uses: a run resumed mid-epoch then sees the same
    random numbers.
    """
    generator = torch.Generator().manual_seed(seed)
    if not train:
        return DataLoader(TensorDataset(split.images, split.labels), batch_size=batch_size, generator=generator)
    return DataLoader(
        TrainImages(split, alternate_flip, seed),
        batch_size=batch_size,
        shuffle=True,
        drop_last=True,
        collate_fn=_batch_as_fetched,
        generator=generator,
    )
