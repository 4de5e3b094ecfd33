"""Writing into an output folder without losing anything: atomic files, one run per folder, and an earlier
run that is replaced only once the new one has a checkpoint."""

from __future__ import annotations

import datetime
import errno
import fcntl
import hashlib
import json
import logging
import os
import re
import shlex
import shutil
import socket
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from accelerate import Accelerator
from accelerate.utils import broadcast_object_list
from safetensors import SafetensorError
from torch import nn

from cifar_accel.config import CONFIG_FILE, TrainConfig, looks_like_path, opens_with, written_by_a_run
from cifar_accel.errors import InputError, RunFault

logger = logging.getLogger(__name__)

WEIGHTS_FILE = "model.safetensors"  # a run's final weights
RESULTS_FILE = "results.json"  # what a finished run measured (telemetry.run_results)
LABELS_FILE = "labels.json"  # the class names, for evaluate, predict and load_model
PREPROCESSING_FILE = "preprocessing.json"  # the input normalisation (transforms.Normalization), for the same
CHECKPOINTS_DIR = "checkpoints"
CHECKPOINT_NAME = re.compile(r"^step_(\d{8,})$")  # checkpoints/step_NNNNNNNN/, by optimizer step
STATE_FILE = "trainer_state.json"  # written last into a checkpoint: one that has it is complete
LOGS_DIR = "logs"  # the trackers' files: TensorBoard's events under logs/<project_name>/
LOCK_INFO = ".lock"  # who holds the folder: pid, host, start time (while the run lasts)
REPLACED_RUN = ".replaced-run"  # an earlier run set aside by --overwrite_output_dir until the first checkpoint
DISCARDED_PREFIX = ".discarded-run-"  # a set-aside run being deleted (renamed first, so the deletion is all or none)
CARD_FILE = "README.md"  # the model card (card.py); a README.md without CARD_MARK is the user's and left alone
LIBRARY_NAME = "cifar-accel"
CARD_MARK = f"library_name: {LIBRARY_NAME}"
CURVES_FILE = "curves.png"
PROFILE_DIR = "profile"  # --profile_steps: the traces and the table of top operators
EXPORT_FILES = {"onnx": "model.onnx", "pt2": "model.pt2"}  # cifar_accel.export's, each with a .json beside it
METRICS_FILE = "metrics.json"  # cifar_accel.evaluate's report, in <run>/eval_<split>/ by default
# What a training run writes into its folder, and --overwrite_output_dir sets aside (with the model card and, if
# this package wrote it, config.yaml).
RUN_FILES = (
    (CHECKPOINTS_DIR, LOGS_DIR, RESULTS_FILE, WEIGHTS_FILE, LABELS_FILE, PREPROCESSING_FILE, CURVES_FILE, PROFILE_DIR)
    + tuple(EXPORT_FILES.values())
    + tuple(f"{name}.json" for name in EXPORT_FILES.values())
)
RUN_FOLDERS = (CHECKPOINTS_DIR, LOGS_DIR, PROFILE_DIR, REPLACED_RUN)  # the folders among them, and a run set aside


def is_model_card(path: Path) -> bool:
    """Whether ``path`` is a model card this package wrote (its metadata names the library)."""
    return opens_with(path, CARD_MARK, 4096)


def file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def is_run_config(path: Path) -> bool:
    """Whether ``path`` is a config.yaml a training run wrote: it opens with the header runs write (or, written
    before the header was, it has the run's labels.json beside it)."""
    return path.is_file() and (written_by_a_run(path) or (path.parent / LABELS_FILE).is_file())


def json_keys(path: Path) -> set[str]:
    """The top-level keys of the JSON object in ``path``; none if it is missing, unreadable or not an object."""
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return set()
    return set(value) if isinstance(value, dict) else set()


def _holds_something(path: Path) -> bool:
    """Whether ``path`` is a file, or a folder with something in it (an empty one, a mount point made for the run's
    logs say, holds nothing to write over)."""
    return path.is_file() or (path.is_dir() and any(path.iterdir()))


def refuse_foreign_files(
    folder: Path, names: Iterable[str], writer: str, ours: bool, flag: str = "--output_dir"
) -> None:
    """Refuse ``folder`` if it holds any of ``names``, the files ``writer`` writes there, and they are not the
    output of an earlier ``writer`` (``ours``): a user's own labels.json or metrics.json is never written over.
    ``flag`` is the option that chose where they go."""
    found = [f"{name}/" if (folder / name).is_dir() else name for name in names if _holds_something(folder / name)]
    if found and not ours:
        listing = " and ".join([", ".join(found[:-1]), found[-1]] if len(found) > 1 else found)
        raise InputError(
            f"'{folder}' already holds {listing}, which {writer} writes but did not write there; move "
            f"{'it' if len(found) == 1 else 'them'}, or pick another {flag}"
        )


def checkpoint_dir(output_dir: str | Path) -> Path:
    return Path(output_dir) / CHECKPOINTS_DIR


def complete_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints in ``output_dir``, oldest first."""
    root = checkpoint_dir(output_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if CHECKPOINT_NAME.match(p.name) and (p / STATE_FILE).is_file()]
    return sorted(found, key=lambda p: int(CHECKPOINT_NAME.match(p.name).group(1)))


def is_own_checkpoint(path: str | Path, output_dir: str | Path) -> bool:
    """Whether checkpoint ``path`` is one of ``output_dir``'s own (its checkpoints/step_N), not another folder's."""
    return Path(path).resolve().parent == checkpoint_dir(output_dir).resolve()


def starts_a_history(config: TrainConfig, output_dir: Path) -> bool:
    """Whether the run writes a history of its own into ``output_dir``: it starts from scratch, or resumes another
    folder's checkpoint (a fork); not when it goes on from one of the folder's own ('latest', or a path there).
    'auto' is resolved to one or the other before this is asked; a path that is no checkpoint (a file, a run's
    folder, its checkpoints/) is left to ``resolve_checkpoint`` to refuse, naming what it is."""
    resume = config.resume_from_checkpoint
    return resume is None or (
        resume != "latest" and (Path(resume) / STATE_FILE).is_file() and not is_own_checkpoint(resume, output_dir)
    )


def holds_run(folder: Path) -> bool:
    """Whether ``folder`` holds a run worth keeping: a finished one (results.json) or one with a complete checkpoint
    (a run killed while writing its first holds only a partial one, which nothing can resume)."""
    return (folder / RESULTS_FILE).exists() or bool(complete_checkpoints(folder))


def is_evaluation_report(path: Path) -> bool:
    """Whether ``path`` is a metrics.json that ``cifar_accel.evaluate`` wrote."""
    return "confusion_matrix" in json_keys(path)


def is_export_description(path: Path) -> bool:
    """Whether ``path`` is the .json that ``cifar_accel.export`` wrote beside an export."""
    return {"format", "file", "weights"} <= json_keys(path)


def earlier_run_files(folder: Path) -> list[Path]:
    """The files of a run in ``folder``: ``RUN_FILES``, its config.yaml and its model card, and what evaluate and
    export made of it there by default: its eval_<split>[_<checkpoint>]/ reports and its checkpoints' exports
    (model_<checkpoint>.onnx with their .json; the final weights' are among ``RUN_FILES``)."""
    files = [folder / name for name in RUN_FILES if (folder / name).exists()]
    files += [folder / CONFIG_FILE] if is_run_config(folder / CONFIG_FILE) else []
    files += [folder / CARD_FILE] if is_model_card(folder / CARD_FILE) else []
    files += [report.parent for report in sorted(folder.glob(f"eval_*/{METRICS_FILE}")) if is_evaluation_report(report)]
    for description in sorted(folder.glob("model_step_*.json")):
        if is_export_description(description):
            files += [path for path in (description.with_suffix(""), description) if path.exists()]
    return files


# What --push_to_hub uploads, with the model card and the TensorBoard events.
SHARED_FILES = (WEIGHTS_FILE, CONFIG_FILE, LABELS_FILE, PREPROCESSING_FILE, RESULTS_FILE, CURVES_FILE)


def shared_files(folder: Path, project_name: str) -> list[Path]:
    """What ``--push_to_hub`` uploads, and nothing else of ``folder``: the weights, config, labels, results,
    curves, the model card (a README.md of the user's is not one) and the TensorBoard event files."""
    files = [folder / name for name in SHARED_FILES if (folder / name).is_file()]
    files += [folder / CARD_FILE] if is_model_card(folder / CARD_FILE) else []
    events = folder / LOGS_DIR / project_name
    return files + sorted(p for p in events.glob("**/events.out.tfevents.*") if p.is_file())


def os_error(err: Exception) -> OSError:
    """``err`` as an OSError: itself, or the one that safetensors names in its message ("Error while serializing:
    I/O error: No space left on device (os error 28)")."""
    if isinstance(err, OSError):
        return err
    named = re.search(r"\(os error (\d+)\)", str(err))
    code = int(named[1]) if named else errno.EIO
    return OSError(code, os.strerror(code))


def disk_full(err: OSError) -> bool:
    """Whether a write failed for want of space: the disk is full, or the user's quota is."""
    return err.errno in (errno.ENOSPC, errno.EDQUOT)


def fix_for(err: OSError) -> str:
    """What the user can do about a failed write."""
    if disk_full(err):
        return "free space on that disk"
    if err.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        return "make that folder writable"
    return "check that folder"


def write_atomic(path: Path, data: str | bytes) -> None:
    """Write ``path`` through a temporary file in the same folder, flushed to disk and renamed over it, so the
    file is either the old one or the whole new one. A failure (a full disk) is one line, exit code 1."""
    save_atomic(path, lambda temporary: temporary.write_bytes(data.encode() if isinstance(data, str) else data))


def save_atomic(path: Path, write: Callable[[Path], object]) -> None:
    """``write(temporary_path)``, then flush and rename it to ``path`` (see ``write_atomic``); the temporary file
    goes whatever fails."""
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(temporary)
        with open(temporary, "rb") as written:
            os.fsync(written.fileno())
        os.replace(temporary, path)
    except OSError as err:
        raise RunFault(f"writing {path} failed ({err.strerror or err}); {fix_for(err)}") from None
    finally:
        if temporary.exists():  # renamed, or never made (unlink would fail on a read-only disk), unless a write failed
            temporary.unlink()


# flock's errors where the filesystem has no locks: Lustre mounted without -o flock, an NFS without its lock service.
NO_FILE_LOCKS = (errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP)


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
        except OSError as err:
            os.close(fd)
            if err.errno not in NO_FILE_LOCKS:
                raise
            logger.warning(
                f"the filesystem of '{self.folder}' cannot lock files ({err.strerror}), so a second run started in "
                "this folder meanwhile would not be stopped; give each run its own --output_dir"
            )
            return
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
    earlier run. Other files in the folder are left alone.

    ``check_earlier_run`` has made sure that when ``.replaced-run/`` is there already, what is beside it is only
    what a run that never saved a checkpoint left (config.yaml, labels.json, logs/): that goes, the run set aside
    stays."""
    aside = folder / REPLACED_RUN
    if aside.exists():
        for path in earlier_run_files(folder):
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        return aside
    if not holds_run(folder):
        return None
    aside.mkdir()
    for path in earlier_run_files(folder):
        path.rename(aside / path.name)
    return aside


def discard_replaced_run(folder: Path) -> None:
    """Delete the run set aside in ``.replaced-run/``: renamed first, so a kill half-way leaves no half run there."""
    discarded = folder / f"{DISCARDED_PREFIX}{os.getpid()}"
    (folder / REPLACED_RUN).rename(discarded)
    shutil.rmtree(discarded, ignore_errors=True)


def remove_discarded_runs(folder: Path) -> None:
    """Finish deletions that a kill cut short (see ``discard_replaced_run``)."""
    for discarded in folder.glob(f"{DISCARDED_PREFIX}*"):
        shutil.rmtree(discarded, ignore_errors=True)


def check_writable(folder: Path, what: str, flag: str) -> None:
    """Make ``folder`` if needed and check that a file can be written in it, else refuse it in one line that names
    it as ``what`` and the ``flag`` to change."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".write-test-{os.getpid()}"
        probe.touch()
        probe.unlink()
    except OSError as err:
        raise InputError(f"{what} '{folder}' is not writable ({err.strerror}); choose another {flag}") from None


@contextmanager
def writable_output_dir(
    output_dir: Path, what: str = "output directory", flag: str = "--output_dir", reads: str | None = None
) -> Iterator[Path]:
    """``output_dir`` (the folder of ``flag``, named ``what`` in refusals), created if needed and checked to be
    writable, and outside the dataset the command ``reads`` (a local one). The folders created here go again if the
    command fails while they are still empty (before its first write), so bad input found after they were made
    leaves nothing behind."""
    made = [folder for folder in (output_dir, *output_dir.parents) if not folder.exists()]  # deepest first
    if output_dir.resolve() == output_dir.resolve().parent:
        raise InputError(
            f"{what} '{output_dir}' is the file system's root, as '$RUNS/' gives where RUNS is not set; choose another "
            f"{flag}"
        )
    if output_dir.is_file():
        raise InputError(f"{what} '{output_dir}' is a file; choose another {flag}")
    check_outside_other_runs(output_dir, flag)
    check_outside_dataset(output_dir, reads, what, flag)
    check_writable(output_dir, what, flag)
    try:
        yield output_dir
    except BaseException:
        for folder in made:
            try:
                folder.rmdir()  # only an empty folder
            except OSError:
                break
        raise


def set_aside_note(folder: Path) -> str:
    """Where the earlier run of ``folder`` went, for messages about a folder whose run is set aside."""
    return (
        f"its earlier run waits in {folder / REPLACED_RUN}, set aside by an --overwrite_output_dir run that stopped "
        "before its first checkpoint"
    )


def restore_command(folder: Path) -> str:
    """The shell command that puts the run set aside in ``.replaced-run/`` back: it first removes what the run that
    set it aside left beside it (``check_earlier_run`` has made sure that is all: no results, no checkpoint), whose
    folders would stop ``mv``."""
    aside = shlex.quote(str(folder / REPLACED_RUN))
    move_back = f"mv {aside}/* {shlex.quote(str(folder))}/ && rmdir {aside}"
    left = [str(path) for path in earlier_run_files(folder)]
    return f"{shlex.join(['rm', '-r', *left])} && {move_back}" if left else move_back


def check_outside_other_runs(output_dir: Path, flag: str = "--output_dir") -> None:
    """Refuse a folder inside the folders a run keeps in its own (checkpoints/, logs/, profile/, a run set aside),
    for any command's output (``flag`` chose it): an --overwrite_output_dir of that run sets them aside and deletes
    them, with whatever a run, an evaluation or an export wrote there."""
    path = output_dir.resolve()
    for parent in path.parents:
        inner = path.relative_to(parent).parts[0]
        if inner in RUN_FOLDERS and (holds_run(parent) or is_run_config(parent / CONFIG_FILE)):
            raise InputError(
                f"'{output_dir}' is part of {inner}/, a folder that the run in '{parent}' manages (an "
                f"--overwrite_output_dir there deletes all of it); pick an {flag} outside it"
            )


def check_outside_dataset(output_dir: Path, dataset: str | None, what: str, flag: str) -> None:
    """Refuse a folder in the local dataset a command reads (named as ``what``, chosen by ``flag``): what it wrote
    there would become part of that dataset, as an image folder takes a run's curves.png for an image of a class."""
    if dataset is None or not looks_like_path(dataset):
        return
    data = Path(dataset).expanduser().resolve()
    if output_dir.resolve() == data or data in output_dir.resolve().parents:
        raise InputError(
            f"{what} '{output_dir}' is inside the dataset '{dataset}' that it reads, and its files would become part "
            f"of that dataset; choose another {flag}, outside it"
        )


def check_earlier_run(config: TrainConfig, output_dir: Path) -> None:
    """Refuse a folder that holds another run's results, unless told to resume or replace it; a folder with a run
    set aside, unless told to replace it; and a config.yaml, or any other file a run writes, that is the user's, not
    a run's. (One inside another run's own folders was refused as it was made, by ``writable_output_dir``.)"""
    aside = output_dir / REPLACED_RUN
    replacing = config.overwrite_output_dir and starts_a_history(config, output_dir)
    if aside.exists() and holds_run(output_dir):
        raise InputError(
            f"'{output_dir}' holds a run, and {set_aside_note(output_dir)}; neither is deleted: move one of them to "
            "another folder, or pick another --output_dir"
        )
    if aside.exists() and not replacing:
        raise InputError(
            f"'{output_dir}' holds no checkpoint: {set_aside_note(output_dir)}; restore it with "
            f"'{restore_command(output_dir)}', replace it with --overwrite_output_dir, or pick another --output_dir"
        )
    if holds_run(output_dir) and starts_a_history(config, output_dir) and not config.overwrite_output_dir:
        checkpoints = bool(complete_checkpoints(output_dir))
        earlier = [RESULTS_FILE] if (output_dir / RESULTS_FILE).exists() else []
        earlier += [CHECKPOINTS_DIR] if checkpoints else []
        resume = "continue it with --resume_from_checkpoint latest, " if checkpoints else ""
        forked = config.resume_from_checkpoint  # None, or another folder's checkpoint
        over = f", and resuming {forked}, another folder's checkpoint, there would write a second history over it"
        raise InputError(
            f"'{output_dir}' already holds a run ({', '.join(earlier)}){over if forked else ''}; {resume}replace it "
            "with --overwrite_output_dir, or pick another --output_dir"
        )
    config_file = output_dir / CONFIG_FILE
    if config_file.exists() and not is_run_config(config_file):
        raise InputError(
            f"'{config_file}' is not a config a run wrote, and a run writes its effective config there; move it, or "
            "pick another --output_dir"
        )
    ours = holds_run(output_dir) or is_run_config(config_file) or aside.exists()
    refuse_foreign_files(output_dir, RUN_FILES, "a training run", ours)


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
    except (OSError, SafetensorError) as caught:
        err = os_error(caught)
        raise RunFault(f"writing {output_dir / WEIGHTS_FILE} failed ({err.strerror or err}); {fix_for(err)}") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
