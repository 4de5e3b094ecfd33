"""--push_to_hub without a network: the run is refused before any work, as the repository cannot be made; an upload
that fails at the end (the network gone since) leaves everything saved locally, with one line and exit code 1; the
token is written nowhere. The Hub itself is unreachable here, so the upload is never seen to land."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import huggingface_hub
import pytest
from accelerate import PartialState

from cifar_accel.config import config_yaml, load_config
from cifar_accel.errors import RunFault
from cifar_accel.hub import push_to_hub
from cifar_accel.outputs import shared_files

from conftest import read_results, run_cli, snapshot, tiny_args, train_in_process

# What a run folder shares on the Hub, and nothing else (the README names these).
SHARED = [
    "model.safetensors",
    "config.yaml",
    "labels.json",
    "preprocessing.json",
    "results.json",
    "curves.png",
    "README.md",
]
NO_HUB = {"HF_HUB_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:9"}  # a closed port: no Hub to reach


def test_a_push_without_a_network_is_refused_before_any_work(tiny_dataset, cli_env, tmp_path):
    """As the Hugging Face example scripts do, the repository is made before the run trains, so a push that cannot
    land is found before the training, not after it."""
    out = tmp_path / "run"
    args = tiny_args(tiny_dataset, out, "--push_to_hub", "--hub_model_id", "someone/tiny", "--hub_token", "hf_secret1")
    proc = run_cli(args, {**cli_env, **NO_HUB})
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("error: --push_to_hub: the Hub repository 'someone/tiny' cannot be made or reached (")
    assert line.endswith(
        "check the network, the token and --hub_model_id, or train without --push_to_hub and upload the run later "
        "with hf upload"
    )
    assert not out.exists() and "epoch 1" not in proc.stdout
    assert "hf_secret1" not in proc.stdout + proc.stderr  # the token: nowhere


def test_an_output_folder_that_is_refused_is_refused_before_the_hub_is_asked(tiny_dataset, cli_env, tmp_path):
    """The Hub repository was made before the output folder was checked, so a folder refused afterwards (here a
    file, with no network to make the repository) left a new empty repository behind, or, as here, named the
    Hub's failure instead of the folder's."""
    out = tmp_path / "run"
    out.write_text("mine")
    args = tiny_args(tiny_dataset, out, "--push_to_hub", "--hub_model_id", "someone/tiny", "--hub_token", "hf_x")
    proc = run_cli(args, {**cli_env, **NO_HUB})
    assert (proc.returncode, proc.stderr) == (2, f"error: output directory '{out}' is a file; choose another "
                                                 "--output_dir\n")  # fmt: skip
    assert out.read_text() == "mine"


def test_an_upload_that_fails_at_the_end_leaves_the_run_saved_with_the_command_that_pushes_it(
    run_with_private_files, monkeypatch
):
    """The network gone between the start, which made the repository, and the end: the real upload fails against
    the closed port, and the run's files stay as they were."""
    out = run_with_private_files
    before = snapshot(out)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)  # read once, at import
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", NO_HUB["HF_ENDPOINT"])
    config, _ = load_config(tiny_args(Path("unused"), out, "--push_to_hub", "--hub_model_id", "someone/tiny",
                                      "--hub_token", "hf_secret1"))  # fmt: skip
    PartialState(cpu=True)  # as in the training process, which pushes at its end
    with pytest.raises(RunFault) as failure:
        push_to_hub(config, out)
    line = str(failure.value)
    assert line.startswith("pushing to the Hub as 'someone/tiny' failed (ConnectError: ")
    include = " ".join(f"--include {name}" for name in SHARED)
    assert f"the run is saved in full in {out}; push it later with: hf upload someone/tiny {out} {include}" in line
    assert snapshot(out) == before and read_results(out)["epochs_completed"] == 1
    assert not any(b"hf_secret1" in f.read_bytes() for f in out.rglob("*") if f.is_file())  # the token: nowhere
    assert "hf_secret1" not in line


def test_a_push_without_a_token_is_refused_before_any_work(tiny_dataset, cli_env, tmp_path):
    out = tmp_path / "run"
    env = {k: v for k, v in cli_env.items() if k != "HF_TOKEN"}
    proc = run_cli(tiny_args(tiny_dataset, out, "--push_to_hub"), env)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "error: --push_to_hub needs a Hugging Face token: pass --hub_token, set HF_TOKEN, or run 'hf auth login' first"
    )
    assert not out.exists()


def test_the_token_is_not_in_the_effective_config():
    config, _ = load_config(["--hub_token", "hf_secret2", "--push_to_hub"])
    assert config.hub_token == "hf_secret2"  # used for the upload
    assert "hf_secret2" not in config_yaml(config) and "hf_secret2" not in json.dumps(config.to_dict())


NOT_SHOWN = "'hub_token' must be a string that is not empty (the value is not shown)"


@pytest.mark.parametrize(
    ("module", "argv", "config", "line"),
    [
        ("train", ["--hub_tokn=hf_secret3"], "", "unknown argument '--hub_tokn'; did you mean '--hub_token'?"),
        ("compare", ["--hub_tokn=hf_secret3"], "", "unknown argument '--hub_tokn'; did you mean '--hub_token'?"),
        ("train", ["--hub_token", "hf_secret3", "extra"], "",
         "unknown argument 'extra'; --hub_token takes one value: quote it if both are meant"),
        ("train", ["--config", "c.yaml"], "hub_token: [hf_secret3]\n", f"config file c.yaml: {NOT_SHOWN}"),
        ("train", ["--config", "c.yaml"], "hub_token: 12345\n", f"config file c.yaml: {NOT_SHOWN}"),
    ],
    ids=["misspelt-flag", "compare-misspelt-flag", "two-words", "list-in-config", "number-in-config"],
)  # fmt: skip
def test_a_refusal_never_shows_the_token(module, argv, config, line, cli_env, tmp_path):
    """Each line showed it: the misspelt flag with its value, the value the flag took, the value of the wrong
    type; stderr goes to CI logs and terminals that others see."""
    config_file = tmp_path / "c.yaml"
    config_file.write_text(config)
    proc = run_cli([str(config_file) if a == "c.yaml" else a for a in argv], cli_env, module=f"cifar_accel.{module}")
    assert (proc.returncode, proc.stderr) == (2, f"error: {line.replace('c.yaml', str(config_file))}\n")
    assert "secret3" not in proc.stdout and "12345" not in proc.stdout


@pytest.fixture(scope="module")
def run_with_private_files(tiny_dataset, tmp_path_factory) -> Path:
    """A finished run in a project folder that holds the user's own files too (``--output_dir .``)."""
    out = tmp_path_factory.mktemp("project")
    (out / ".env").write_text("HF_TOKEN=hf_private\n")
    (out / "notes.md").write_text("my notes")
    assert train_in_process(tiny_args(tiny_dataset, out, "--overwrite_output_dir")) == 0
    (out / "eval_test").mkdir()
    (out / "eval_test" / "metrics.json").write_text("{}")
    (out / "logs" / "mine.txt").write_text("not a TensorBoard file")
    return out


def test_only_the_runs_own_files_are_pushed_and_the_log_lists_them(run_with_private_files, monkeypatch, caplog):
    """The upload (``HfApi.create_commit``, the network) is replaced by a recorder: what matters here is which
    files the commit would carry."""
    out = run_with_private_files
    commits = []
    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", lambda self, repo, **kw: huggingface_hub.RepoUrl(
        f"https://huggingface.co/{repo}"))  # fmt: skip
    monkeypatch.setattr(huggingface_hub.HfApi, "create_commit", lambda self, repo_id, operations, **kw: commits.append(
        (repo_id, [(op.path_in_repo, op.path_or_fileobj) for op in operations])))  # fmt: skip
    config, _ = load_config(tiny_args(Path("unused"), out, "--push_to_hub", "--hub_model_id", "someone/tiny",
                                      "--hub_token", "hf_x"))  # fmt: skip
    caplog.set_level(logging.INFO)
    PartialState(cpu=True)  # as in the training process, which pushes at its end
    assert push_to_hub(config, out) == "someone/tiny"
    ((repo_id, files),) = commits
    logs = out / "logs" / "cifar_accel"
    events = {p.relative_to(out).as_posix() for p in logs.rglob("events.out.tfevents.*")}
    assert len(events) >= 2  # the scalars, and the HParams panel's runs (TensorBoard reads nothing else)
    names = [name for name, _ in files]
    assert names[: len(SHARED)] == SHARED and set(names[len(SHARED) :]) == events
    assert len(names) == len(SHARED) + len(events)
    assert all(Path(path) == out / name for name, path in files)
    assert f"pushing {len(names)} files to the Hub as 'someone/tiny': model.safetensors, " in caplog.text
    assert [p.relative_to(out).as_posix() for p in shared_files(out, "cifar_accel")] == names


@pytest.mark.parametrize("private", [False, True])
def test_the_later_push_command_keeps_a_private_repository_private(run_with_private_files, monkeypatch, private):
    """The push failed before the repository was made (the network): the command the line gives makes it, and
    makes it private where --hub_private_repo asked for that."""

    def unreachable(self, repo, **kwargs):
        raise ConnectionError("no route to the Hub")

    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", unreachable)
    flags = ["--push_to_hub", "--hub_model_id", "someone/tiny", "--hub_token", "hf_x"]
    config, _ = load_config(
        tiny_args(Path("unused"), run_with_private_files, *flags, *(["--hub_private_repo"] * private))
    )
    PartialState(cpu=True)  # as in the training process, which pushes at its end
    with pytest.raises(RunFault) as failure:
        push_to_hub(config, run_with_private_files)
    command = str(failure.value).split("push it later with: ", 1)[1]
    assert command.startswith(f"hf upload someone/tiny {run_with_private_files} --include model.safetensors ")
    assert command.endswith(" --private") == private


@pytest.mark.parametrize(
    ("flags", "folder", "message"),
    [
        (["--hub_model_id", "someone/tiny/extra"], "run", "--hub_model_id is not a Hub repository id (Repo id must be"),
        (["--hub_model_id", "bad name"], "run", "--hub_model_id is not a Hub repository id"),
        ([], "my run", "the output folder's name (the default id), 'my run', is not a Hub repository id"),
    ],
)
def test_a_hub_id_the_hub_would_refuse_is_refused_before_any_work(tiny_dataset, train_here, tmp_path, flags, folder,
                                                                  message):  # fmt: skip
    out = tmp_path / folder
    proc = train_here([*tiny_args(tiny_dataset, out, "--push_to_hub", "--hub_token", "hf_x"), *flags])
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(f"error: {message}") and "pass --hub_model_id 'name' or 'user/name'" in line
    assert not out.exists()
