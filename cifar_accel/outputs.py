"""Writing into an output folder without losing anything: atomic files, one run per folder, and an earlier
run that is replaced only once the new one has a checkpoint."""

from __future__ import annotations

import datetime
import fcntl
import json
import os
import shutil
import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from accelerate import Accelerator
from accelerate.utils import broadcast_object_list
from torch import nn

from cifar_accel.config import TrainConfig
from cifar_accel.errors import InputError, RunFault

WEIGHTS_FILE = "model.safetensors"  # a run's final weights
LOCK_INFO = ".lock"  # who holds the folder: pid, host, start time (while the run lasts)
REPLACED_RUN = ".replaced-run"  # an earlier run set aside by --overwrite_output_dir until the first checkpoint
# What a training run writes into its folder, and --overwrite_output_dir sets aside.
CARD_FILE = "README.md"  # the model card (card.py); a README.md without CARD_MARK is the user's and left alone
LIBRARY_NAME = "cifar-accel"
CARD_MARK = f"library_name: {LIBRARY_NAME}"
CURVES_FILE = "curves.png"
RUN_FILES = ("checkpoints", "logs", "results.json", "model.safetensors", "config.yaml", "labels.json", CURVES_FILE)


def is_model_card(path: Path) -> bool:
    """Whether ``path`` is a model card this package wrote (its metadata names the library)."""
    try:
        with open(path, errors="replace") as file:
            return CARD_MARK in file.read(4096)
    except OSError:
        return False


def earlier_run_files(folder: Path) -> list[Path]:
    """The files of a run in ``folder``: ``RUN_FILES`` and its model card."""
    files = [folder / name for name in RUN_FILES if (folder / name).exists()]
    return files + [folder / CARD_FILE] if is_model_card(folder / CARD_FILE) else files


def write_atomic(path: Path, data: str | bytes) -> None:
    """Write ``path`` through a temporary file in the same folder, flushed to disk and renamed over it, so the
    file is either the old one or the whole new one. A failure (a full disk) is one line, exit code 1."""
    save_atomic(path, lambda temporary: temporary.write_bytes(data.encode() if isinstance(data, str) else data))


def save_atomic(path: Path, write: Callable[[Path], object]) -> None:
    """``write(temporary_path)``, then flush and rename it to ``path`` (see ``write_atomic``)."""
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(temporary)
        with open(temporary, "rb") as written:
            os.fsync(written.fileno())
        os.replace(temporary, path)
    except OSError as err:
        temporary.unlink(missing_ok=True)
        raise RunFault(
            f"writing {path} failed ({err.strerror or err}); free space on that disk and run again"
        ) from None


class OutputDirLock:
    """An exclusive advisory lock (``flock``) on the output folder itself, held for the whole run.

    The kernel releases it when the process ends, however it ends, so a run killed with SIGKILL never leaves a
    stale lock behind. While it holds the lock the run writes its pid, host and start time to ``.lock`` in the
    folder, so that a second run can say who holds it; the file goes when the lock is released.
    """

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._fd: int | None = None

    def acquire(self) -> None:
        fd = os.open(self.folder, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise InputError(
                f"'{self.folder}' is in use by another run ({self._holder()}); wait for it to finish, or pick "
                "another --output_dir"
            ) from None
        self._fd = fd
        started = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        info = {"pid": os.getpid(), "host": socket.gethostname(), "started": started}
        (self.folder / LOCK_INFO).write_text(json.dumps(info))

    def _holder(self) -> str:
        try:
            info = json.loads((self.folder / LOCK_INFO).read_text())
            return f"pid {info['pid']} on {info['host']}, started {info['started']}"
        except (OSError, ValueError, KeyError, TypeError):
            return "its details are not written yet"

    def release(self) -> None:
        if self._fd is None:
            return
        (self.folder / LOCK_INFO).unlink(missing_ok=True)
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> OutputDirLock:
        self.acquire()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


def set_aside_earlier_run(folder: Path) -> Path | None:
    """Move an earlier run's files (``earlier_run_files``) into ``.replaced-run/``, where they stay until the new
    run has written its first checkpoint (``discard_replaced_run``); returns that folder, or None if there was no
    earlier run. Other files in the folder are left alone."""
    earlier = earlier_run_files(folder)
    aside = folder / REPLACED_RUN
    if not earlier:
        return aside if aside.exists() else None
    if aside.exists():  # the earlier run is set aside already; what is here is a run that never saved a checkpoint
        for path in earlier:
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink()
        return aside
    aside.mkdir()
    for path in earlier:
        path.rename(aside / path.name)
    return aside


def discard_replaced_run(folder: Path) -> None:
    shutil.rmtree(folder / REPLACED_RUN, ignore_errors=True)


def make_output_dir(config: TrainConfig) -> Path:
    """Create ``output_dir`` if needed and make sure it is writable."""
    output_dir = Path(config.output_dir)
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        probe = output_dir / f".write-test-{os.getpid()}"
        probe.touch()
        probe.unlink()
    except OSError as err:
        raise InputError(
            f"output directory '{output_dir}' is not writable ({err.strerror}); choose another --output_dir"
        ) from None
    return output_dir


def check_earlier_run(config: TrainConfig, output_dir: Path) -> None:
    """Refuse a folder that holds another run's results, unless told to resume or replace it."""
    earlier = [p.name for p in (output_dir / "results.json", output_dir / "checkpoints") if p.exists()]
    if earlier and config.resume_from_checkpoint is None and not config.overwrite_output_dir:
        raise InputError(
            f"'{output_dir}' already holds a run ({', '.join(earlier)}); continue it with "
            "--resume_from_checkpoint latest, replace it with --overwrite_output_dir, or pick another --output_dir"
        )


@contextmanager
def exclusive_output_dir(accelerator: Accelerator, output_dir: Path) -> Iterator[None]:
    """Hold the folder's lock (on the main process) for the whole run; every process hears of a refusal."""
    lock = OutputDirLock(output_dir)
    refusal = None
    if accelerator.is_main_process:
        try:
            lock.acquire()
        except InputError as err:
            refusal = str(err)
    if accelerator.num_processes > 1:
        refusal = broadcast_object_list([refusal])[0]
    if refusal is not None:
        raise InputError(refusal)
    try:
        yield
    finally:
        lock.release()


def export_weights(accelerator: Accelerator, model: nn.Module, output_dir: Path) -> None:
    """``accelerator.save_model`` into a staging folder, then one atomic rename to ``model.safetensors``."""
    staging = output_dir / f".export-{os.getpid()}"
    try:
        accelerator.save_model(model, staging)
        if accelerator.is_main_process:
            save_atomic(output_dir / WEIGHTS_FILE, lambda temporary: (staging / WEIGHTS_FILE).rename(temporary))
    except OSError as err:
        raise RunFault(
            f"writing {output_dir / WEIGHTS_FILE} failed ({err.strerror or err}); free space and run again with "
            "--resume_from_checkpoint latest"
        ) from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
