"""Sharing a finished run on the Hugging Face Hub (``--push_to_hub``), as the example scripts do, through
``huggingface_hub``."""

from __future__ import annotations

import shlex
from pathlib import Path

from accelerate.logging import get_logger
from huggingface_hub import CommitOperationAdd, HfApi, get_token
from huggingface_hub.utils import HFValidationError, validate_repo_id

from cifar_accel.config import TrainConfig
from cifar_accel.errors import InputError, RunFault, one_line
from cifar_accel.outputs import shared_files
from cifar_accel.processes import launched_rank

logger = get_logger(__name__)


def hub_repo(config: TrainConfig, output_dir: Path) -> str:
    return config.hub_model_id or output_dir.resolve().name


def check_hub_settings(config: TrainConfig, output_dir: Path) -> None:
    """With --push_to_hub, before any work: the repository id must be one the Hub accepts, a token must be at hand
    (the flag, HF_TOKEN or a cached login), and the repository must exist or be made with it, as the Hugging Face
    example scripts make it before they train; so no network, a token the Hub refuses, or an id that is someone
    else's stops the run here instead of after all of its training."""
    if not config.push_to_hub:
        return
    repo = hub_repo(config, output_dir)
    try:
        validate_repo_id(repo)
    except HFValidationError as err:
        given = "--hub_model_id" if config.hub_model_id else f"the output folder's name (the default id), {repo!r},"
        raise InputError(
            f"{given} is not a Hub repository id ({one_line(err)[:200]}); pass --hub_model_id 'name' or "
            "'user/name' with letters, digits, '-', '_' and '.'"
        ) from None
    token = config.hub_token or get_token()
    if not token:
        raise InputError(
            "--push_to_hub needs a Hugging Face token: pass --hub_token, set HF_TOKEN, or run 'hf auth login' first"
        )
    if launched_rank() != 0:
        return  # one process of several asks the Hub; its refusal stops them all
    try:
        HfApi(token=token).create_repo(repo, private=config.hub_private_repo, exist_ok=True)
    except Exception as err:  # noqa: BLE001 - the network, the token and the Hub fail in many kinds
        raise InputError(
            f"--push_to_hub: the Hub repository '{repo}' cannot be made or reached ({type(err).__name__}: "
            f"{one_line(err)[:200]}); check the network, the token and --hub_model_id, or train without "
            "--push_to_hub and upload the run later with hf upload"
        ) from None


def push_to_hub(config: TrainConfig, output_dir: Path) -> str:
    """Upload the run's own files (``outputs.shared_files``), and nothing else of the folder, to the Hub
    repository (created if need be, public unless --hub_private_repo); returns its id. Any failure (no network,
    a bad token, the Hub refusing) is one line; everything stays saved locally."""
    repo = hub_repo(config, output_dir)
    files = shared_files(output_dir, config.project_name)
    names = [path.relative_to(output_dir).as_posix() for path in files]
    logger.info(f"pushing {len(names)} files to the Hub as '{repo}': {', '.join(names)}")
    try:
        api = HfApi(token=config.hub_token or get_token())
        repo_id = api.create_repo(repo, private=config.hub_private_repo, exist_ok=True).repo_id
        operations = [
            CommitOperationAdd(path_in_repo=name, path_or_fileobj=str(path))
            for name, path in zip(names, files, strict=True)
        ]
        api.create_commit(repo_id, operations, commit_message=f"cifar_accel run {output_dir.resolve().name}")
    except Exception as err:  # noqa: BLE001 - the network, the token and the Hub fail in many kinds
        include = " ".join(f"--include {shlex.quote(name)}" for name in names)
        private = " --private" if config.hub_private_repo else ""  # else hf upload would create a public repository
        raise RunFault(
            f"pushing to the Hub as '{repo}' failed ({type(err).__name__}: {one_line(err)[:200]}); the run is saved "
            f"in full in {output_dir}; push it later with: hf upload {shlex.quote(repo)} "
            f"{shlex.quote(str(output_dir))} {include}{private}"
        ) from None
    return repo_id
