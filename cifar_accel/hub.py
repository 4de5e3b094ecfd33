"""Sharing a finished run on the Hugging Face Hub (``--push_to_hub``), as the example scripts do, through
``huggingface_hub``."""

from __future__ import annotations

from pathlib import Path

from huggingface_hub import HfApi, get_token

from cifar_accel.config import TrainConfig
from cifar_accel.errors import InputError, RunFault, one_line
from cifar_accel.outputs import LOCK_INFO, REPLACED_RUN

# Not uploaded: the checkpoints (large, and only for resuming), the run's lock, an earlier run set aside.
UPLOAD_EXCLUDE = ["checkpoints/*", LOCK_INFO, f"{REPLACED_RUN}/*"]


def hub_repo(config: TrainConfig, output_dir: Path) -> str:
    return config.hub_model_id or output_dir.resolve().name


def check_hub_token(config: TrainConfig) -> None:
    """With --push_to_hub, a token must be at hand before any work: the flag, HF_TOKEN or a cached login."""
    if config.push_to_hub and not (config.hub_token or get_token()):
        raise InputError("--push_to_hub needs a Hugging Face token: pass --hub_token, set HF_TOKEN, or run 'hf auth "
                         "login' first")  # fmt: skip


def push_to_hub(config: TrainConfig, output_dir: Path) -> str:
    """Upload the output folder, less ``UPLOAD_EXCLUDE``, to the Hub repository (created if need be); returns its
    id. Any failure (no network, a bad token, the Hub refusing) is one line; everything stays saved locally."""
    repo = hub_repo(config, output_dir)
    try:
        api = HfApi(token=config.hub_token or get_token())
        repo_id = api.create_repo(repo, private=config.hub_private_repo, exist_ok=True).repo_id
        api.upload_folder(repo_id=repo_id, folder_path=output_dir, ignore_patterns=UPLOAD_EXCLUDE,
                          commit_message=f"cifar_accel run {output_dir.resolve().name}")  # fmt: skip
    except Exception as err:  # noqa: BLE001 - the network, the token and the Hub fail in many kinds
        exclude = " ".join(f"--exclude '{pattern}'" for pattern in UPLOAD_EXCLUDE)
        raise RunFault(
            f"pushing to the Hub as '{repo}' failed ({type(err).__name__}: {one_line(err)[:200]}); the run is saved "
            f"in full in {output_dir}; push it later with: hf upload {repo} {output_dir} {exclude}"
        ) from None
    return repo_id
