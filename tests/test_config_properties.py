"""Property: any YAML mapping either loads into a valid config or is refused with exit code 2 and one line."""

from __future__ import annotations

import tempfile
from pathlib import Path

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cifar_accel.config import FIELDS, TrainConfig, check_field, load_config
from cifar_accel.errors import run_cli

values = st.recursive(
    st.none() | st.booleans() | st.integers(-(10**6), 10**6) | st.floats(allow_nan=True) | st.text(max_size=12),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=5), children, max_size=3),
    max_leaves=5,
)
keys = st.sampled_from(sorted(FIELDS)) | st.text(min_size=1, max_size=20)
choice_values = st.sampled_from(["no", "fp16", "bf16", "step", "cosine", "simple_cnn", "latest", 0.5, 1e-3, 64, 1])
mappings = st.dictionaries(keys, values | choice_values, max_size=6)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mapping=mappings)
def test_any_yaml_mapping_loads_valid_or_exits_2_with_one_line(mapping, capsys, monkeypatch):
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "config.yaml"
        path.write_text(yaml.safe_dump(mapping))
        loaded: list[TrainConfig] = []
        code = run_cli(lambda argv: loaded.append(load_config(argv)[0]), ["--config", str(path)])
    stderr = capsys.readouterr().err
    if code == 0:
        (config,) = loaded
        assert stderr == ""
        for name in FIELDS:
            assert check_field(name, getattr(config, name), "loaded") == getattr(config, name)
        for key, value in mapping.items():
            expected = "no" if key == "mixed_precision" and value is None else value  # unset: the default, 'no'
            assert getattr(config, key) in (expected, str(expected))  # a step count may be written as a number
    else:
        assert code == 2
        assert len(stderr.strip().splitlines()) == 1 and stderr.startswith("error: ")
