"""Image files to what the model takes: a (3, 32, 32) uint8 array. Training data, ``predict`` and
``load_model().predict`` decode through the same function, so an image is read the same way by each."""

from __future__ import annotations

import io
import os
import warnings
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

IMAGE_SIZE = 32

# What a clone of a dataset repository without git-lfs holds in place of each large file: a small text file that
# starts so (https://github.com/git-lfs/git-lfs/blob/main/docs/spec.md).
GIT_LFS_POINTER = b"version https://git-lfs.github.com/spec/"
GIT_LFS_FIX = "a clone without git-lfs leaves these; run `git lfs install` and `git lfs pull` in the repository"


def git_lfs_pointer(source: str | os.PathLike | io.BytesIO) -> bool:
    """Whether a file (or the bytes of one) is a Git LFS pointer rather than the content it stands for."""
    if isinstance(source, io.BytesIO):
        return source.getvalue().startswith(GIT_LFS_POINTER)
    try:
        with open(source, "rb") as file:
            return file.read(len(GIT_LFS_POINTER)) == GIT_LFS_POINTER
    except OSError:
        return False


# Larger images are refused before they are decoded: a 32x32 classifier needs no more, and a file that
# declares more pixels is more likely a decompression bomb (a small file that decodes to gigabytes) than a
# photo. 8192 x 8192 still takes any phone or camera picture.
MAX_IMAGE_PIXELS = 8192 * 8192
EXIF_ORIENTATION = 0x0112


class ImageTooLarge(ValueError):
    """An image declares more than ``MAX_IMAGE_PIXELS`` pixels."""


class GitLfsPointer(ValueError):
    """An image file that is a Git LFS pointer, not the image."""


def to_rgb32(source: str | Path | io.BytesIO) -> tuple[np.ndarray, str | None]:
    """Decode an image file into a (3, 32, 32) uint8 array, converting other modes and sizes (``image_to_rgb32``).

    Training data and the images given to ``predict`` go through this same function. Raises ``ImageTooLarge``
    above ``MAX_IMAGE_PIXELS``, ``GitLfsPointer`` for the pointer a clone without git-lfs leaves, and PIL's errors
    for a file that is not a readable image.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)  # refused below instead of warned about
        try:
            opened = Image.open(source)
        except UnidentifiedImageError:
            if git_lfs_pointer(source):
                raise GitLfsPointer(f"a Git LFS pointer, not the image; {GIT_LFS_FIX}") from None
            raise
        with opened as image:
            if image.width * image.height > MAX_IMAGE_PIXELS:
                raise ImageTooLarge(f"{image.width}x{image.height} pixels, more than the {MAX_IMAGE_PIXELS:,} accepted")
            image.load()
            return image_to_rgb32(image)


def image_to_rgb32(image: Image.Image) -> tuple[np.ndarray, str | None]:
    """A PIL image as a (3, 32, 32) uint8 array: its EXIF orientation applied, converted to RGB and resized to
    32x32 (bilinear) where it is not. Returns the array and, when the image had to be converted, what it was (for
    example 'L 64x48', or 'RGB 4032x3024, EXIF-rotated' for a phone photo).

    Three conversions are not PIL's ``convert("RGB")``, which keeps a pixel's number and drops its transparency:
    16-bit greyscale (modes I;16 and I, as PIL opens 16-bit PNG, TIFF and PGM files) keeps its high byte, as PIL
    reads 16-bit colour files, where PIL would clip every value above 255 to white (a 32-bit integer image, mode I
    too, with values outside 0-65535 is refused); floating-point greyscale (mode
    F, 32-bit TIFF) is read as intensities from 0 to 1, as Hugging Face's image processors read float images, where
    PIL would round them to black (values outside that range are refused: what they mean is not known); and
    transparent pixels are laid over white, as those processors do, where PIL would show the colour stored under
    them (often black)."""
    original = f"{image.mode} {image.width}x{image.height}"
    rotated = image.getexif().get(EXIF_ORIENTATION, 1) not in (1, None)
    if rotated:
        image = ImageOps.exif_transpose(image)
        original += ", EXIF-rotated"
    if image.mode == "I" or image.mode.startswith("I;16"):
        values = np.asarray(image)
        if values.min() < 0 or values.max() > 65535:  # a 32-bit integer image (mode I) can hold them
            raise ValueError(
                f"an integer image with values from {values.min()} to {values.max()}, where 16-bit intensities from "
                "0 to 65535 are read; save it with 8 or 16 bits per channel"
            )
        image = Image.fromarray((values >> 8).astype(np.uint8))
    elif image.mode == "F":
        values = np.asarray(image)
        if not (values.min() >= 0 and values.max() <= 1):  # NaN fails both
            raise ValueError(
                f"a floating-point image with values from {values.min():g} to {values.max():g}, where intensities "
                "from 0 to 1 are read; save it with 8 bits per channel"
            )
        image = Image.fromarray((values * 255).round().astype(np.uint8))
    if image.has_transparency_data:
        image = Image.alpha_composite(Image.new("RGBA", image.size, "white"), image.convert("RGBA"))
    converted = rotated or image.mode != "RGB" or image.size != (IMAGE_SIZE, IMAGE_SIZE)
    if converted:
        image = image.convert("RGB").resize((IMAGE_SIZE, IMAGE_SIZE), Image.Resampling.BILINEAR)
    return np.asarray(image, dtype=np.uint8).transpose(2, 0, 1), original if converted else None
