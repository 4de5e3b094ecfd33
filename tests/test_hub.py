"""--push_to_hub without a network: it fails after the local save, with one line and exit code 1, and nothing local
is lost; the token is written nowhere. The Hub itself is unreachable here, so the upload is never seen to land."""

from __future__ import annotations

import json

from cifar_accel.config import config_yaml, load_config

from conftest import read_results, run_cli, tiny_args


def test_a_push_without_a_network_fails_after_everything_is_saved_locally(tiny_dataset, cli_env, tmp_path):
    out = tmp_path / "run"
    env = {**cli_env, "HF_HUB_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:9"}  # a closed port: no Hub to reach
    args = tiny_args(tiny_dataset, out, "--push_to_hub", "--hub_model_id", "someone/tiny", "--hub_token", "hf_secret1")
    proc = run_cli(args, env)
    assert proc.returncode == 1
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("error: pushing to the Hub as 'someone/tiny' failed (")
    assert f"the run is saved in full in {out}; push it later with: hf upload someone/tiny {out} --exclude" in line
    assert read_results(out)["epochs_completed"] == 1
    for name in ("model.safetensors", "README.md", "curves.png", "config.yaml", "labels.json"):
        assert (out / name).is_file(), name
    assert not any(b"hf_secret1" in f.read_bytes() for f in out.rglob("*") if f.is_file())  # the token: nowhere
    assert "hf_secret1" not in proc.stdout


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
