"""Loading through `datasets`: columns, decoding, the seeded validation split and the sample limits."""

from __future__ import annotations

import dataclasses
import logging
import re
import shutil

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

from cifar_accel.config import TrainConfig
from cifar_accel.data import load_data, load_split
from cifar_accel.errors import InputError

from conftest import good_split, make_images, write_hub_dataset, write_image_folder, write_split_files


@pytest.fixture(autouse=True)
def datasets_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "cache")


def config_for(dataset, **changes) -> TrainConfig:
    return dataclasses.replace(TrainConfig(dataset_name=str(dataset)), **changes)


def test_decoding_shows_progress_and_the_next_load_is_a_cache_hit(tiny_dataset, caplog, capsys, monkeypatch):
    monkeypatch.delenv("TQDM_DISABLE", raising=False)  # as a user's shell has it
    caplog.set_level(logging.INFO, logger="cifar_accel.data")
    first = load_data(config_for(tiny_dataset))
    assert "train: decoded 327 images in" in caplog.text and "test: decoded 83 images in" in caplog.text
    assert "decoding train: " in capsys.readouterr().out  # the bar goes to stdout, stderr is for errors
    caplog.clear()
    second = load_data(config_for(tiny_dataset))
    assert "train: 327 images from the datasets cache (decoded by an earlier run)" in caplog.text
    assert "test: 83 images from the datasets cache" in caplog.text and "decoded 327" not in caplog.text
    assert torch.equal(first.train.images, second.train.images)
    capsys.readouterr()
    caplog.set_level(logging.WARNING, logger="cifar_accel.data")  # as on processes other than the main one
    load_data(config_for(tiny_dataset))
    assert "decoding" not in capsys.readouterr().out


def test_splits_are_uint8_tensors_with_class_names(tiny_dataset):
    data = load_data(config_for(tiny_dataset))
    assert data.train.images.dtype == torch.uint8 and data.train.images.shape[1:] == (3, 32, 32)
    assert (len(data.train), len(data.val), len(data.test)) == (294, 33, 83)
    assert data.class_names[0] == "airplane" and len(data.class_names) == 10
    # train and validation together are exactly the stored images, pixel for pixel
    images, labels = make_images(327, seed=0)
    stored = sorted((bytes(np.array(i).transpose(2, 0, 1)), y) for i, y in zip(images, labels, strict=True))
    split = torch.cat([data.train.images, data.val.images]), torch.cat([data.train.labels, data.val.labels])
    assert sorted((bytes(x.numpy()), int(y)) for x, y in zip(*split, strict=True)) == stored


def test_validation_split_is_seeded_and_disjoint(tiny_dataset):
    a = load_data(config_for(tiny_dataset, seed=1))
    b = load_data(config_for(tiny_dataset, seed=1))
    c = load_data(config_for(tiny_dataset, seed=2))
    assert torch.equal(a.val.images, b.val.images) and torch.equal(a.train.labels, b.train.labels)
    assert not torch.equal(a.val.images, c.val.images)
    train_rows = {bytes(x.numpy()) for x in a.train.images}
    assert not any(bytes(x.numpy()) in train_rows for x in a.val.images)


def test_sample_limits(tiny_dataset):
    data = load_data(config_for(tiny_dataset, max_train_samples=100, max_eval_samples=7))
    assert (len(data.train), len(data.val), len(data.test)) == (90, 7, 7)


def test_odd_images_are_converted_to_32x32_rgb(tmp_path):
    root = write_hub_dataset(tmp_path / "odd", train_size=20, test_size=10)
    features = datasets.Features(
        {"img": datasets.Image(), "label": datasets.ClassLabel(names=[str(i) for i in range(10)])}
    )
    odd = [Image.new("L", (32, 32), 128), Image.new("RGBA", (40, 24), (255, 0, 0, 255))]
    datasets.Dataset.from_dict({"img": odd * 5, "label": list(range(10))}, features=features).to_parquet(
        root / "data" / "test-00000-of-00001.parquet"
    )
    data = load_data(config_for(root))
    assert data.test.images.shape == (10, 3, 32, 32)
    assert data.test.images[0].unique().tolist() == [128]
    assert data.test.images[1, 0].unique().tolist() == [255] and data.test.images[1, 1:].max() == 0


def test_named_columns_and_missing_columns(tmp_path):
    root = tmp_path / "renamed"
    features = datasets.Features({"picture": datasets.Image(), "target": datasets.Value("int64")})
    images, labels = make_images(30, seed=0)
    for split in ("train", "test"):
        (root / "data").mkdir(parents=True, exist_ok=True)
        datasets.Dataset.from_dict({"picture": images, "target": labels}, features=features).to_parquet(
            root / "data" / f"{split}-00000-of-00001.parquet"
        )
    with pytest.raises(InputError, match="label column 'label' not found .*--label_column_name"):
        load_data(config_for(root))
    data = load_data(config_for(root, image_column_name="picture", label_column_name="target"))
    assert len(data.class_names) == 10 and len(data.test) == 30


def test_an_image_folder_loads_with_folder_names_as_classes(tmp_path):
    images, labels = make_images(40, seed=3)
    for split in ("train", "test"):
        for index, (image, label) in enumerate(zip(images, labels, strict=True)):
            folder = tmp_path / "folder" / split / f"class_{label}"
            folder.mkdir(parents=True, exist_ok=True)
            image.save(folder / f"{index}.png")
    data = load_data(config_for(tmp_path / "folder"))
    assert data.class_names == [f"class_{i}" for i in range(10)]
    assert len(data.train) + len(data.val) == 40 and len(data.test) == 40
    assert sorted(data.test.labels.tolist()) == sorted(labels)


def test_an_image_folder_whose_test_images_sit_outside_class_folders_is_told_why_it_has_no_labels(tmp_path):
    """`datasets` drops the labels of every split when one split's images are not in class folders."""
    root = write_image_folder(tmp_path / "folder", ["cat", "dog"], {"train": 4})
    (root / "test").mkdir()
    Image.new("RGB", (32, 32)).save(root / "test" / "0.png")
    with pytest.raises(InputError) as err:
        load_data(config_for(root))
    assert str(err.value) == (
        "label column 'label' not found (columns: image); name it with --label_column_name; an image folder has "
        "labels only where every split's images sit in class folders, two or more (<split>/<class>/)"
    )


def test_class_names_in_a_label_column_number_every_split_alike(tmp_path):
    """An image folder's metadata.csv gives each image's class by name. The names of all splits, sorted, become one
    ClassLabel, so a test split without birds numbers its cats as the train split does; evaluation matches them to
    a model's classes by name."""
    images, _ = make_images(12, seed=4)
    names = {"train": ["cat", "dog", "bird"] * 3, "test": ["dog", "cat", "dog"]}
    for split, classes in names.items():
        folder = tmp_path / "meta" / split
        folder.mkdir(parents=True)
        rows = ["file_name,label"]
        for index, name in enumerate(classes):
            images[index].save(folder / f"{index}.png")
            rows.append(f"{index}.png,{name}")
        (folder / "metadata.csv").write_text("\n".join(rows) + "\n")
    data = load_data(config_for(tmp_path / "meta", val_ratio=0.0))
    assert data.class_names == ["bird", "cat", "dog"]
    assert sorted(data.train.labels.tolist()) == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert data.test.labels.tolist() == [2, 1, 2]
    split, classes = load_split(str(tmp_path / "meta"), "test", None, None, None, classes=["cat", "dog", "frog"])
    assert classes == ["cat", "dog", "frog"] and split.labels.tolist() == [1, 0, 1]


def test_first_rows_that_leave_out_classes_warn_and_every_class_is_kept(tmp_path, caplog):
    """An image folder lists its images class by class, so the first rows that --max_train_samples and
    --max_eval_samples keep may hold the first classes only: the run says so, and its classes are still all of the
    split's, numbered labels too (their count was once the largest kept label's)."""
    caplog.set_level(logging.WARNING, logger="cifar_accel.data")
    folder = write_image_folder(tmp_path / "folder", ["cat", "dog", "frog"], {"train": 10, "test": 4})
    data = load_data(config_for(folder, max_train_samples=12, max_eval_samples=4, val_ratio=0.0))
    assert data.class_names == ["cat", "dog", "frog"] and sorted(set(data.train.labels.tolist())) == [0, 1]
    assert "train: --max_train_samples kept its first 12 images, which leave out 1 of its 3 classes" in caplog.text
    assert "test: --max_eval_samples kept its first 4 images, which leave out 2 of its 3 classes" in caplog.text
    caplog.clear()
    load_data(config_for(folder, max_eval_samples=2, val_ratio=0.0))  # too few to hold 3 classes: no news
    assert "--max_eval_samples kept" not in caplog.text and "--max_train_samples" not in caplog.text

    features = datasets.Features({"img": datasets.Image(), "label": datasets.Value("int64")})
    images, _ = make_images(30, seed=1)
    for order, warned in ((lambda labels: labels, False), (sorted, True)):
        caplog.clear()
        rows = datasets.Dataset.from_dict({"img": images, "label": order([i % 10 for i in range(30)])}, features)
        root = write_split_files(tmp_path / f"numbered_{warned}", rows, rows)
        data = load_data(config_for(root, max_train_samples=10, val_ratio=0.0))
        assert data.class_names == [str(i) for i in range(10)]
        assert ("leave out 6 of its 10 classes" in caplog.text) is warned, caplog.text


def test_test_classes_that_no_training_image_has_are_named_in_a_warning(tmp_path, caplog):
    """An image folder whose test split has a class folder that train lacks trained quietly on that class's name
    with no images, and its test counted that class's images as errors: the run says so."""
    caplog.set_level(logging.WARNING, logger="cifar_accel.data")
    folder = write_image_folder(tmp_path / "folder", ["cat", "dog", "frog"], {"train": 10, "test": 4})
    load_data(config_for(folder, val_ratio=0.0))
    assert "no training image has" not in caplog.text
    shutil.rmtree(folder / "train" / "frog")
    data = load_data(config_for(folder, val_ratio=0.0))
    assert data.class_names == ["cat", "dog", "frog"] and sorted(set(data.train.labels.tolist())) == [0, 1]
    assert "test: 4 of its images belong to classes that no training image has ('frog'): a model cannot learn them, " \
           "and the test counts those images as errors; check the train split" in caplog.text  # fmt: skip


def test_a_datasets_own_validation_split_is_the_validation_split(tmp_path, caplog):
    """As Hugging Face's examples do: the 'validation' split validates, and all of train trains; --val_ratio holds
    out a part of train only where a dataset has no validation split, and 0 still means no validation."""
    caplog.set_level(logging.INFO, logger="cifar_accel.data")
    root = write_split_files(tmp_path / "three", good_split(40, 0), good_split(20, 1))
    good_split(12, 2).to_parquet(root / "data" / "validation-00000-of-00001.parquet")
    data = load_data(config_for(root))
    assert (len(data.train), len(data.val), len(data.test), data.val_split) == (40, 12, 20, "validation")
    assert torch.equal(data.val.images, load_split(str(root), "validation", None, None, None)[0].images)
    assert "validation: the dataset's own 'validation' split" in caplog.text
    data = load_data(config_for(root, val_ratio=0.0))
    assert (len(data.train), len(data.val)) == (40, 0)
    (root / "data" / "validation-00000-of-00001.parquet").unlink()
    data = load_data(config_for(root, val_ratio=0.25))
    assert (len(data.train), len(data.val), data.val_split) == (30, 10, None)


def test_a_missing_split_is_named_with_its_fix(tmp_path):
    root = tmp_path / "train_only"
    (root / "data").mkdir(parents=True)
    good_split().to_parquet(root / "data" / "train-00000-of-00001.parquet")
    # Training needs a test split of the dataset's own; evaluation and the export check name theirs by a flag.
    with pytest.raises(InputError, match=r"no 'test' split \(splits: train\); add a 'test' split \(Hub layout: "
                       r"data/test-\*\.parquet; image folder: test/<class>/\)$"):  # fmt: skip
        load_data(config_for(root))
    with pytest.raises(InputError, match=r"no 'validation' split \(splits: train\); pick one of them with --split$"):
        load_split(str(root), "validation", None, None, None)
    assert len(load_split(str(root), "train", None, None, None)[0]) == 40
    # datasets' slice syntax names the split and the flag that takes the first N images
    with pytest.raises(InputError, match=r"^--split takes a split's name, not a slice \('train\[:10\]'\): give --split "
                       r"train, and --max_eval_samples N for its first N images$"):  # fmt: skip
        load_split(str(root), "train[:10]", None, None, None)
    with pytest.raises(InputError, match=r"no 'tset\[:10\]' split \(splits: train\); pick one of them with --split$"):
        load_split(str(root), "tset[:10]", None, None, None)


def test_a_folder_without_data_files_is_named_with_the_layouts_read(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputError) as refused:
        load_data(config_for(tmp_path / "empty"))
    assert str(refused.value).startswith(f"cannot load dataset '{tmp_path / 'empty'}': ")
    assert str(refused.value).endswith(
        "; pass a folder that datasets.load_dataset reads (Hub layout: data/train-*.parquet; image folder: "
        "train/<class>/)"
    )


def test_parquet_written_without_datasets_metadata_is_read_as_the_same_images(tmp_path):
    """pandas or pyarrow write an image column as the struct of bytes and path that `datasets` stores, without the
    metadata that names it an Image: the images were refused ("no image column found"), and named by
    --image_column_name, as "holds dict, not images", with nothing left to fix."""
    with_metadata = write_hub_dataset(tmp_path / "hub", 40, 10)
    without = tmp_path / "plain"
    (without / "data").mkdir(parents=True)
    for file in (with_metadata / "data").iterdir():
        table = pq.read_table(file).replace_schema_metadata(None)
        assert table.schema.field("img").type == pa.struct({"bytes": pa.binary(), "path": pa.string()})
        pq.write_table(table, without / "data" / file.name)
    assert datasets.load_dataset(str(without))["train"].features["img"] == {
        "bytes": datasets.Value("binary"),
        "path": datasets.Value("string"),
    }
    expected, plain = load_data(config_for(with_metadata)), load_data(config_for(without))
    assert plain.image_column == "img" and plain.class_names == [str(i) for i in range(10)]
    for split in ("train", "val", "test"):
        assert torch.equal(getattr(plain, split).images, getattr(expected, split).images)
        assert torch.equal(getattr(plain, split).labels, getattr(expected, split).labels)


@pytest.mark.parametrize(
    ("last", "line"),
    [
        (float("nan"), "train label 39 (column 'label') is nan, not a whole class number"),
        (2.0**40, "train label 1099511627776.0 at index 39 (column 'label') is above 99,999, the largest class number"),
    ],
)
def test_labels_past_max_train_samples_are_checked_before_they_number_the_classes(tmp_path, last, line):
    """The classes of a label column of plain numbers are 0 to its largest label in the whole train split, also
    past the first --max_train_samples rows that are decoded: a NaN there failed as a ValueError (exit code 1), and
    an id made that many class names until the run was killed for memory."""
    images, labels = make_images(40, 0)
    features = datasets.Features({"img": datasets.Image(), "label": datasets.Value("float64")})
    train = datasets.Dataset.from_dict({"img": images, "label": [*map(float, labels[:39]), last]}, features=features)
    root = write_split_files(tmp_path / "ds", train, good_split(20, 1))
    with pytest.raises(InputError, match=f"^{re.escape(line)}"):
        load_data(config_for(root, max_train_samples=20))


def write_files_that_differ(root, kind: str) -> None:
    """A folder whose files `datasets` picks a reader for and then fails on."""
    root.mkdir()
    if kind == "parquet-columns":  # a shard of train written with its image column named otherwise
        (root / "data").mkdir()
        good_split().to_parquet(root / "data" / "train-00000-of-00002.parquet")
        good_split().rename_column("img", "picture").to_parquet(root / "data" / "train-00001-of-00002.parquet")
        good_split().to_parquet(root / "data" / "test-00000-of-00001.parquet")
    elif kind == "csv":
        for split in ("train", "test"):
            (root / f"{split}.csv").write_text('img,label\nx.png,1\ny.png,2,3,4\n"unterminated\n')
    else:  # a run's output folder given as the dataset: JSON files with other keys
        (root / "results.json").write_text('{"test_accuracy": 0.5}')
        (root / "labels.json").write_text('{"class_names": ["cat"]}')


@pytest.mark.parametrize(
    ("kind", "reason"),
    [
        ("parquet-columns", "not all of them have the same columns: there are 1 new columns ({'picture'}) and 1 "
         "missing columns ({'img'})"),
        ("csv", "ParserError: Error tokenizing data. C error: Expected 2 fields in line 3, saw 4"),
        ("json-keys", "not all of them have the same columns: there are 1 new columns ({'test_accuracy'})"),
    ],
)  # fmt: skip
def test_files_that_datasets_cannot_read_are_input_errors_with_their_reason(tmp_path, kind, reason):
    """`datasets` reports them as a DatasetGenerationError, whose own message says only that an error occurred
    ("while generating the dataset"), and the run failed with exit code 1 as if the machine had."""
    write_files_that_differ(tmp_path / kind, kind)
    with pytest.raises(InputError) as refused:
        load_data(config_for(tmp_path / kind))
    assert str(refused.value) == (
        f"cannot load dataset '{tmp_path / kind}': datasets could not read its files ({reason}); pass a folder that "
        "datasets.load_dataset reads (Hub layout: data/train-*.parquet; image folder: train/<class>/)"
    )


@pytest.mark.parametrize("below", ["cache", "deeper/cache"])  # the cache, or a folder above it, cannot be made
def test_a_datasets_cache_that_cannot_be_written_is_named_with_its_fix(tmp_path, monkeypatch, below):
    (tmp_path / "a_file").write_text("")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "a_file" / below)
    with pytest.raises(InputError) as refused:
        load_data(config_for(write_hub_dataset(tmp_path / "ds", 20, 10)))
    assert str(refused.value) == (
        f"the datasets cache {tmp_path / 'a_file' / below} is not writable (Not a directory); set "
        "HF_DATASETS_CACHE (or HF_HOME) to a folder you can write to"
    )
