"""The AMP chapter's input pipeline, for comparison with the package's: per-image PIL decoding and torchvision
transforms in DataLoader worker processes.

Run as a script, it trains exactly as `cifar_accel.train` does (same flags, model, optimizer, schedule, seed,
validation split, evaluation and outputs) with only the training input replaced by this pipeline:

    python scripts/chapter_pipeline.py --dataset_name ../shared/data/cifar10-jpeg --output_dir outputs/chapter_no
"""

from __future__ import annotations

import datasets
import torch
import torchvision.transforms as T
from torch.utils.data import DataLoader

from cifar_accel.config import TrainConfig
from cifar_accel.data import CifarData, find_columns, first_rows, load_raw, split_indices
from cifar_accel.engine import TrainTransform
from cifar_accel.errors import exit_command
from cifar_accel.train import main
from cifar_accel.transforms import CIFAR10_MEAN, CIFAR10_STD

CHAPTER_TRANSFORM = T.Compose([
    T.RandomCrop(32, padding=4),
    T.RandomHorizontalFlip(),
    T.ColorJitter(brightness=0.2, contrast=0.2, saturation=0.2, hue=0.1),
    T.ToTensor(),
    T.Normalize(CIFAR10_MEAN, CIFAR10_STD),
])  # fmt: skip
WORKERS = 2


class ChapterDataset(torch.utils.data.Dataset):
    """Rows of a `datasets` split, each JPEG decoded and augmented one image at a time, as the chapter does."""

    def __init__(self, split: datasets.Dataset, image_column: str = "img", label_column: str = "label") -> None:
        self.split, self.image_column, self.label_column = split, image_column, label_column

    def __len__(self) -> int:
        return len(self.split)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        row = self.split[index]
        return CHAPTER_TRANSFORM(row[self.image_column].convert("RGB")), row[self.label_column]


def chapter_loader(split: ChapterDataset, batch_size: int, seed: int = 0) -> DataLoader:
    return DataLoader(
        split, batch_size=batch_size, shuffle=True, drop_last=True, num_workers=WORKERS,
        persistent_workers=True, generator=torch.Generator().manual_seed(seed),
    )  # fmt: skip


def chapter_pipeline(config: TrainConfig, data: CifarData, device: torch.device) -> tuple[DataLoader, TrainTransform]:
    """The training images of ``data`` (same validation split), read from the raw dataset per image; Accelerate
    moves each batch to ``device``."""
    raw = first_rows(load_raw(config.dataset_name, splits=("train",))["train"], config.max_train_samples)
    columns = find_columns(raw.features, config.image_column_name, config.label_column_name)
    train_indices, _ = split_indices(len(raw), config.val_ratio, config.seed)
    loader = chapter_loader(ChapterDataset(raw.select(train_indices), *columns), config.per_device_train_batch_size,
                            config.seed)  # fmt: skip
    memory_format = torch.channels_last if config.channels_last else torch.contiguous_format
    return loader, lambda images, labels, epoch, num_epochs: (images.contiguous(memory_format=memory_format), labels)


if __name__ == "__main__":
    exit_command(lambda argv: main(argv, chapter_pipeline))
