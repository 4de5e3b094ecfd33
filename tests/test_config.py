"""The typed config: defaults, YAML, flags and aliases, precedence and validation."""

from __future__ import annotations

import dataclasses
import shlex
from pathlib import Path

import pytest

from cifar_accel.checkpoint import TrainerState, check_resume, config_fingerprint
from cifar_accel.config import (
    ACTS_ONLY_WITH,
    DEFAULT_CONFIG_FILE,
    FIELDS,
    TrainConfig,
    _field,
    build_parser,
    given_flags,
    load_config,
    read_config_file,
    resolve_mixed_precision,
)
from cifar_accel.errors import InputError

from conftest import run_cli


@pytest.fixture(autouse=True)
def no_launcher(monkeypatch):
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)


def test_shipped_default_yaml_is_the_built_in_recipe():
    assert read_config_file(DEFAULT_CONFIG_FILE) == {k: v for k, v in TrainConfig().to_dict().items()}
    config = TrainConfig()
    assert (config.model_name, config.learning_rate, config.num_train_epochs) == ("simple_cnn", 1e-3, 30)
    assert (config.per_device_train_batch_size, config.early_stopping_patience, config.val_ratio) == (64, 7, 0.1)
    assert (config.lr_scheduler_type, config.lr_step_size, config.lr_gamma) == ("step", 15, 0.1)


def test_every_field_is_a_flag_with_help():
    options = {o for action in build_parser()._actions for o in action.option_strings}
    for name, f in FIELDS.items():
        assert f"--{name}" in options
        assert f.metadata["help"]


@pytest.mark.parametrize(
    ("argv", "field", "value"),
    [
        (["--lr", "0.01"], "learning_rate", 0.01),
        (["--epochs", "3"], "num_train_epochs", 3),
        (["--batch_size", "16"], "per_device_train_batch_size", 16),
        (["--batch-size", "16"], "per_device_train_batch_size", 16),
        (["--resume", "latest"], "resume_from_checkpoint", "latest"),
        (["--train_val_split", "0.2"], "val_ratio", 0.2),
        (["--no-augment"], "augment", False),
        (["--max_grad_norm", "1"], "max_grad_norm", 1.0),
    ],
)
def test_aliases_from_the_chapter_and_hf_examples(argv, field, value):
    config, _ = load_config(argv)
    assert getattr(config, field) == value


def test_flags_override_the_config_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("learning_rate: 0.5\nnum_train_epochs: 4\n")
    config, _ = load_config(["--config", str(path), "--lr", "0.25"])
    assert (config.learning_rate, config.num_train_epochs) == (0.25, 4)


def test_a_second_config_is_refused_rather_than_dropping_the_first(tmp_path):
    """argparse kept the last --config: a preset, then a file of two values, trained the default recipe with them."""
    path = tmp_path / "c.yaml"
    path.write_text("learning_rate: 0.5\nnum_train_epochs: 4\n")
    for argv, shown in ((["--config", "fast", "--config", str(path)], f"'fast', then '{path}'"),
                        (["--config=fast", "--lr", "0.1", "--config", "fast"], "'fast', then 'fast'")):  # fmt: skip
        with pytest.raises(InputError) as refused:
            load_config(argv)
        assert str(refused.value) == (
            f"--config is given twice ({shown}), and a run reads one config: give one, and the values to change as "
            "flags (or in a copy of its file)"
        )
    assert load_config(["--config", "fast", "--lr", "0.5"])[0].model_name == "fast_net"


def test_none_on_the_command_line_unsets_an_optional_number_that_the_config_file_gave(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("max_grad_norm: 1.0\nmax_train_samples: 100\nmax_train_steps: 7\nmax_eval_samples: 50\n")
    config, _ = load_config(["--config", str(path)])
    assert (config.max_grad_norm, config.max_train_samples, config.max_train_steps, config.max_eval_samples) == (
        1.0, 100, 7, 50
    )  # fmt: skip
    argv = ["--max_grad_norm", "none", "--max_train_samples", "None", "--max_train_steps=NONE"]
    config, _ = load_config(["--config", str(path), *argv])
    assert (config.max_grad_norm, config.max_train_samples, config.max_train_steps, config.max_eval_samples) == (
        None, None, None, 50
    )  # fmt: skip


def test_a_config_file_reads_numbers_and_no_as_the_command_line_does(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("learning_rate: 1e-3\nweight_decay: 5E-4\nmomentum: 9.0e-1\nlabel_smoothing: .1e0\n")
    assert read_config_file(path) == {"learning_rate": 0.001, "weight_decay": 0.0005, "momentum": 0.9,
                                      "label_smoothing": 0.1}  # fmt: skip
    config, _ = load_config(["--config", str(path), "--optimizer", "sgd"])
    numbers = ["--lr", "1e-3", "--weight_decay", "5E-4", "--momentum", "9.0e-1", "--label_smoothing", ".1e0"]
    flags, _ = load_config([*numbers, "--optimizer", "sgd"])
    assert config == flags
    path.write_text("num_train_epochs: 1e1\n")  # a float still, where an int is due
    with pytest.raises(InputError, match="'num_train_epochs' must be int, not float"):
        read_config_file(path)
    path.write_text("mixed_precision: no\naugment: false\nchannels_last: True\n")  # YAML 1.1 would read False
    assert read_config_file(path) == {"mixed_precision": "no", "augment": False, "channels_last": True}
    path.write_text("augment: yes\n")
    with pytest.raises(InputError, match=r"'augment' must be bool: true or false, not str \('yes'\)"):
        read_config_file(path)


def test_a_tagged_value_in_a_config_file_is_named_as_such(tmp_path):
    """A tag the safe loader does not construct (!!python/object, a custom !tag) was 'not valid YAML at line 2; fix
    the syntax', for a file whose syntax is fine."""
    path = tmp_path / "c.yaml"
    path.write_text("seed: 1\nx: !!python/object:os.system {}\n")
    with pytest.raises(InputError) as refused:
        read_config_file(path)
    assert str(refused.value) == (
        f"config file {path} at line 2: could not determine a constructor for the tag "
        "'tag:yaml.org,2002:python/object:os.system'; a config holds plain values (numbers, text, true/false, none), "
        "so remove the tag"
    )


def test_a_key_given_twice_in_a_config_file_is_refused_with_both_lines(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("learning_rate: 0.1\nseed: 1\n\n'learning_rate': 0.01\n")  # PyYAML alone keeps 0.01
    with pytest.raises(InputError, match=r"gives 'learning_rate' twice \(lines 1 and 4\); keep one of them"):
        load_config(["--config", str(path)])
    path.write_text("<<: {seed: 1, learning_rate: 0.1}\nseed: 2\n")  # a merged key may be overridden
    assert read_config_file(path) == {"seed": 2, "learning_rate": 0.1}


@pytest.mark.parametrize(
    ("flag", "launcher", "file", "expected"),
    [
        ("bf16", "fp16", "no", ("bf16", "--mixed_precision flag")),
        (None, "fp16", "bf16", ("fp16", "accelerate launch (flag or config profile)")),
        (None, "no", "bf16", ("bf16", "config file")),
        (None, None, "bf16", ("bf16", "config file")),
        (None, "no", None, ("no", "accelerate launch (flag or config profile)")),
        (None, None, None, ("no", "default")),
    ],
)
def test_mixed_precision_precedence(flag, launcher, file, expected):
    assert resolve_mixed_precision(flag, launcher, file) == expected


def test_launcher_precision_is_read_from_the_environment(monkeypatch):
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    config, source = load_config([])
    assert config.mixed_precision == "bf16" and source.startswith("accelerate launch")


@pytest.mark.parametrize(
    ("yaml_text", "message"),
    [
        ("learning_rat: 0.1\n", "unknown key 'learning_rat'; did you mean 'learning_rate'?"),
        ("num_train_epochs: three\n", "'num_train_epochs' must be int, not str"),
        ("augment: 1\n", "'augment' must be bool: true or false, not int"),
        ("learning_rate: 0\n", "'learning_rate' must be > 0"),
        ("per_device_train_batch_size: 0\n", "'per_device_train_batch_size' must be >= 1"),
        ("val_ratio: 1.0\n", "'val_ratio' must be < 1"),
        ("num_train_epochs: 0\n", "'num_train_epochs' must be >= 1"),
        ("early_stopping_patience: -1\n", "'early_stopping_patience' must be >= 0"),
        ("max_grad_norm: -1\n", "'max_grad_norm' must be > 0"),
        ("weight_decay: 1e39\n", "'weight_decay' is 1e+39, outside the range of the float32 it is computed in"),
        ("learning_rate: 1e39\n", "'learning_rate' must be <= 1000000, got 1e+39"),
        ("max_train_steps: none\n", "'max_train_steps' must be int or null, not 'none': YAML's none is null"),
        ("lr_scheduler_type: exponential\n", "'lr_scheduler_type' must be one of step, cosine, linear, cosine_steps"),
        ("mixed_precision: fp8\n", "'mixed_precision' must be one of no, fp16, bf16"),
        ("model_name: resnet\n", "'model_name' must be one of simple_cnn"),
        ("- just\n- a list\n", "must hold a mapping"),
        ("learning_rate: [0.1\n", "is not valid YAML at line"),
    ],
)
def test_bad_config_files_are_refused(tmp_path, yaml_text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml_text)
    with pytest.raises(InputError, match=None) as err:
        load_config(["--config", str(path)])
    assert message in str(err.value)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--learning_rat", "0.1"], "unknown argument '--learning_rat'; did you mean '--learning_rate'?"),
        (
            ["--report_to", "tensorboard", "mlflow"],
            "unknown argument 'mlflow'; --report_to takes one value, 'tensorboard' here: give --report_to "
            "tensorboard,mlflow if both are meant",
        ),
        (
            ["--output_dir", "my", "run"],
            "unknown argument 'run'; --output_dir takes one value, 'my' here: give --output_dir 'my run' if both are "
            "meant",
        ),
        (["--lr", "abc"], "invalid float value: 'abc'"),
        (["--max_train_steps", "2.5"], "argument --max_train_steps: expected a whole number or none, not '2.5'"),
        (["--max_grad_norm", "nan"], "'max_grad_norm' must be a finite number"),
        (["--max_grad_norm", "off"], "argument --max_grad_norm: expected a number or none, not 'off'"),
        (["--max_train_samples", "0"], "'max_train_samples' must be >= 1"),
        (["--lr", "-1"], "'learning_rate' must be > 0"),
        (["--val_ratio", "-0.1"], "'val_ratio' must be >= 0"),
        (["--mixed_precision", "fp32"], "invalid choice: 'fp32'"),
        (["--lr_scheduler_type", "exponential"], "invalid choice: 'exponential'"),
    ],
)
def test_bad_flags_are_refused(argv, message):
    with pytest.raises(InputError) as err:
        load_config(argv)
    assert message in str(err.value)


@pytest.mark.parametrize(
    ("argv", "word"),
    [(["--lr", "0.1", "0.2"], "0.2"), (["--output_dir", "runs/a", "--bogus", "3"], "--bogus"), (["--zzz"], "--zzz")],
)
def test_a_number_or_an_unknown_flag_left_over_gets_no_advice_to_quote_it(argv, word):
    with pytest.raises(InputError) as err:
        load_config(argv)
    assert str(err.value) == f"unknown argument '{word}' (see --help)"


@pytest.mark.parametrize(
    "argv",
    [["--learning_rat", "0.1"], ["--per_device_train_batch_size", "0"], ["--config", "/nonexistent.yaml"]],
)
def test_config_errors_exit_2_with_one_line_before_any_work(cli_env, tmp_path, argv):
    out = tmp_path / "out"
    proc = run_cli([*argv, "--output_dir", str(out)], cli_env)
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert len(proc.stderr.strip().splitlines()) == 1 and proc.stderr.startswith("error: ")
    assert not out.exists()


def test_debug_shows_the_traceback(cli_env):
    proc = run_cli(["--lr", "-1", "--debug"], cli_env)
    assert proc.returncode != 0 and "Traceback" in proc.stderr


def test_config_round_trips_through_yaml(tmp_path):
    from cifar_accel.config import config_yaml

    config = dataclasses.replace(TrainConfig(), learning_rate=0.02, mixed_precision="bf16", max_train_samples=10)
    (tmp_path / "config.yaml").write_text(config_yaml(config))
    assert TrainConfig(**read_config_file(tmp_path / "config.yaml")) == config
    for run_name in ("1e-3", "no", "yes", "true", "null", "3"):  # strings that look like other values
        config = dataclasses.replace(TrainConfig(), mixed_precision="no", run_name=run_name)
        (tmp_path / "config.yaml").write_text(config_yaml(config))
        assert TrainConfig(**read_config_file(tmp_path / "config.yaml")) == config


def test_a_runs_own_config_yaml_stands_for_the_folder_it_is_in(tmp_path, monkeypatch):
    """Wherever the run's folder is now and from whichever folder --config names it; --output_dir still overrides
    it. A config file of the user's keeps its output_dir, even named config.yaml."""
    from cifar_accel.config import config_yaml

    run = tmp_path / "moved" / "run"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(config_yaml(dataclasses.replace(TrainConfig(), output_dir="/old/place/run")))
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert load_config(["--config", "../moved/run/config.yaml"])[0].output_dir == "../moved/run"
    assert load_config(["--config", str(run / "config.yaml")])[0].output_dir == str(run)
    assert load_config(["--config", "../moved/run/config.yaml", "--output_dir", "fork"])[0].output_dir == "fork"

    (run / "config.yaml").write_text("output_dir: runs/a\nlearning_rate: 0.01\n")  # no header: the user's file
    assert load_config(["--config", "../moved/run/config.yaml"])[0].output_dir == "runs/a"


def test_a_runs_config_yaml_records_its_settings_not_how_a_command_started_it(tmp_path):
    """A resumed run's config.yaml recorded 'resume_from_checkpoint: latest', so --config RUN/config.yaml --output_dir
    new, to start a run set as that one, failed: 'no complete checkpoint in new/checkpoints'. The run writes the
    defaults of both fields; one written before is read without them; a user's file (no header) keeps them."""
    from cifar_accel.config import CONFIG_HEADER, config_yaml

    started = dataclasses.replace(TrainConfig(), resume_from_checkpoint="latest", overwrite_output_dir=True)
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(config_yaml(started))
    saved = read_config_file(run / "config.yaml")
    assert (saved["resume_from_checkpoint"], saved["overwrite_output_dir"]) == (None, False)
    (run / "config.yaml").write_text(f"{CONFIG_HEADER}\nresume_from_checkpoint: latest\noverwrite_output_dir: true\n")
    config, _ = load_config(["--config", str(run / "config.yaml"), "--output_dir", str(tmp_path / "new")])
    assert (config.resume_from_checkpoint, config.overwrite_output_dir) == (None, False)
    (tmp_path / "mine.yaml").write_text("resume_from_checkpoint: auto\noverwrite_output_dir: true\n")
    config, _ = load_config(["--config", str(tmp_path / "mine.yaml")])
    assert (config.resume_from_checkpoint, config.overwrite_output_dir) == ("auto", True)


def test_every_field_says_what_a_resume_may_do_with_it():
    """The resume fingerprint is derived from the fields' metadata; a field without it cannot be declared."""
    for name, f in FIELDS.items():
        assert f.metadata.get("resume") in ("match", "may_change"), f"field '{name}' is unclassified"
    fingerprint = config_fingerprint(TrainConfig(), mixed_precision="bf16")
    assert set(fingerprint) == {name for name, f in FIELDS.items() if f.metadata["resume"] == "match"}
    assert fingerprint["mixed_precision"] == "bf16"  # the precision in effect, not the requested one (None)
    # Checkpoints written before a field existed lack its key; they resume when the field has its default.
    older = {k: v for k, v in fingerprint.items() if k not in ("optimizer", "label_smoothing", "warmup_ratio")}
    state = TrainerState(config_fingerprint=older)
    check_resume(Path("step_00000009"), state, fingerprint, num_processes=1)
    changed = config_fingerprint(TrainConfig(optimizer="sgd"), mixed_precision="bf16")
    with pytest.raises(InputError, match="optimizer: checkpoint 'adam', now 'sgd'"):
        check_resume(Path("step_00000009"), state, changed, num_processes=1)
    with pytest.raises(TypeError, match="resume"):
        _field(1, "a field that says nothing about resuming")


def test_the_flags_a_refused_resume_names_give_the_checkpoints_settings_back():
    """The refusal named the differing settings and told the user to add --config with the run's config.yaml, even
    where that was given and a flag was what differed. It names the flags that give the checkpoint's values back:
    they parse to those values (a boolean as --x or --no-x, a number unset as none, text quoted for a shell), and a
    text setting the checkpoint left unset is named as one to leave out."""
    checkpoint = dict(dataset_name="/data/my cifar", image_column_name=None, augment=False, max_train_steps=None,
                      learning_rate=0.003)  # fmt: skip
    now = dict(dataset_name="/data/cifar", image_column_name="img", augment=True, max_train_steps=50,
               learning_rate=0.001)  # fmt: skip
    state = TrainerState(config_fingerprint=config_fingerprint(TrainConfig(**checkpoint), mixed_precision="no"))
    with pytest.raises(InputError) as refused:
        check_resume(Path("step_00000009"), state, config_fingerprint(TrainConfig(**now), "no"), num_processes=1)
    named = str(refused.value).split("resume with its settings (")[1].removesuffix("), or start a new --output_dir")
    flags, left_out = named.split(", without ")
    assert left_out == "--image_column_name"
    assert flags == "--dataset_name '/data/my cifar' --no-augment --max_train_steps none --learning_rate 0.003"
    given = {name: value for name, value in given_flags(shlex.split(flags)).items() if name in checkpoint}
    assert given == {name: value for name, value in checkpoint.items() if name != "image_column_name"}


def test_a_checkpoint_that_recorded_a_relative_dataset_path_resumes_with_the_absolute_one(tmp_path, monkeypatch):
    (tmp_path / "data" / "cifar").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    config, _ = load_config(["--dataset_name", "./data/cifar"])
    assert config.dataset_name == str(tmp_path.resolve() / "data" / "cifar")
    fingerprint = config_fingerprint(config, mixed_precision="no")
    older = TrainerState(config_fingerprint={**fingerprint, "dataset_name": "./data/cifar"})  # as typed
    check_resume(Path("step_00000009"), older, fingerprint, num_processes=1)
    other = TrainerState(config_fingerprint={**fingerprint, "dataset_name": "./data/cifar100"})
    with pytest.raises(InputError, match="dataset_name: checkpoint "):
        check_resume(Path("step_00000009"), other, fingerprint, num_processes=1)


# Each field that acts only with another: (the flag with a value that would act, the other field's flags where it
# keeps the flag idle, and where it lets it act).
IDLE = {
    "momentum": (["--momentum", "0.5"], [], ["--optimizer", "sgd"]),
    "muon_learning_rate": (["--muon_learning_rate", "0.1"], ["--optimizer", "sgd"], ["--optimizer", "muon"]),
    "muon_momentum": (["--muon_momentum", "0.5"], [], ["--optimizer", "muon"]),
    "muon_ns_steps": (["--muon_ns_steps", "3"], [], ["--optimizer", "muon"]),
    "muon_ns_dtype": (["--muon_ns_dtype", "float32"], [], ["--optimizer", "muon"]),
    "lr_step_size": (["--lr_step_size", "3"], ["--lr_scheduler_type", "cosine"], []),
    "lr_gamma": (["--lr_gamma", "0.5"], ["--lr_scheduler_type", "linear"], []),
    "lr_end_factor": (["--lr_end_factor", "0.1"], [], ["--lr_scheduler_type", "cosine_steps"]),
    "lr_start_factor": (["--lr_start_factor", "0.1"], ["--lr_scheduler_type", "linear"],
                        ["--lr_scheduler_type", "linear", "--warmup_ratio", "0.1"]),
    "early_stopping_patience": (["--early_stopping_patience", "3"], ["--val_ratio", "0"], []),
    "tta_below_confidence": (["--tta_below_confidence", "0.7"], [], ["--tta", "flip"]),
    "early_crop_size": (["--early_crop_size", "24", "--early_crop_epochs", "2"], ["--no-augment"], []),
    "early_crop_epochs": (["--early_crop_epochs", "2"], [], ["--early_crop_size", "24"]),
    "crop_padding": (["--crop_padding", "2"], ["--no-augment"], []),
    "padding_mode": (["--padding_mode", "reflect"], ["--no-augment"], []),
    "flip": (["--flip", "alternate"], ["--no-augment"], []),
    "color_jitter": (["--color_jitter"], ["--no-augment"], []),
    "brightness_shift": (["--brightness_shift", "0.1"], ["--no-augment"], []),
    "contrast_scale": (["--contrast_scale", "0.1"], ["--no-augment"], []),
    "mixup_alpha": (["--mixup_alpha", "0.2"], ["--no-augment"], []),
    "cutmix_alpha": (["--cutmix_alpha", "1"], ["--no-augment"], []),
    "hub_model_id": (["--hub_model_id", "me/cifar"], [], ["--push_to_hub"]),
    "hub_private_repo": (["--hub_private_repo"], [], ["--push_to_hub"]),
}  # fmt: skip


def test_the_idle_table_covers_every_field_that_acts_only_with_another():
    assert set(IDLE) == set(ACTS_ONLY_WITH)


@pytest.mark.parametrize("name", list(IDLE))
def test_a_flag_that_would_have_no_effect_is_refused_naming_what_it_needs(name):
    """Such a flag was accepted and the run trained without it (--momentum with Adam, --early_stopping_patience
    with no validation, --tta_below_confidence with no TTA): a flag given where it cannot act is refused, and the
    same flag acts once the field it needs allows it."""
    flag, idle, acting = IDLE[name]
    decider, acts, needed = ACTS_ONLY_WITH[name]
    with pytest.raises(InputError) as err:
        load_config([*idle, *flag])
    shown = {"adam": "'adam'", "sgd": "'sgd'", "step": "'step'", "cosine": "'cosine'", "linear": "'linear'"}
    idle_value = dict(zip(idle[::2], idle[1::2], strict=False)).get(f"--{decider}")
    assert str(err.value).startswith(f"--{name} has no effect unless --{decider} is {needed}, but ")
    assert str(err.value).endswith(f"; leave --{name} out, or change that")
    if idle_value is not None:
        assert f", but --{decider} is {shown.get(idle_value, idle_value)};" in str(err.value)
    config, _ = load_config([*acting, *flag])
    assert acts(getattr(config, decider))


def test_idle_values_from_a_config_file_and_flags_that_turn_a_feature_off_are_accepted(tmp_path):
    """A preset or a run's config.yaml holds every field: a flag that picks another optimizer leaves the fast
    preset's Muon settings idle, and is accepted. So are flags that turn an idle feature off."""
    config, _ = load_config(["--config", "fast", "--optimizer", "sgd"])
    assert (config.optimizer, config.muon_ns_steps) == ("sgd", 3)
    path = tmp_path / "c.yaml"
    path.write_text("optimizer: adam\nmomentum: 0.5\nval_ratio: 0\nearly_stopping_patience: 3\n")
    config, _ = load_config(["--config", str(path)])
    assert (config.momentum, config.early_stopping_patience) == (0.5, 3)
    config, _ = load_config(["--val_ratio", "0", "--early_stopping_patience", "0", "--no-augment", "--flip", "none",
                             "--mixup_alpha", "0", "--no-color_jitter", "--no-hub_private_repo"])  # fmt: skip
    assert (config.early_stopping_patience, config.flip, config.color_jitter) == (0, "none", False)


def test_accelerates_gradient_accumulation_variable_is_refused_where_it_would_override_the_run(monkeypatch):
    """Accelerate takes ACCELERATE_GRADIENT_ACCUMULATION_STEPS over the Accelerator's own argument: with it at 4, a
    run of the default recipe accumulated 4 batches a step while its log and config.yaml said 1."""
    monkeypatch.setenv("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "4")
    with pytest.raises(InputError) as err:
        load_config([])
    assert str(err.value) == (
        "ACCELERATE_GRADIENT_ACCUMULATION_STEPS is 4 (accelerate launch sets it for DeepSpeed), and Accelerate would "
        "accumulate that many batches where 'gradient_accumulation_steps' (the default) is 1; unset it, and give "
        "--gradient_accumulation_steps to cifar_accel.train"
    )
    config, _ = load_config(["--gradient_accumulation_steps", "4"])  # the two agree
    assert config.gradient_accumulation_steps == 4


@pytest.mark.parametrize(("variable", "engine"), [("ACCELERATE_USE_DEEPSPEED", "DeepSpeed"),
                                                  ("ACCELERATE_USE_MEGATRON_LM", "Megatron-LM")])  # fmt: skip
def test_a_launcher_profile_with_deepspeed_or_megatron_is_refused_in_one_line(variable, engine, monkeypatch):
    """Such a profile made the run fail in Accelerate (an ImportError without the engine installed), where the
    loop was never built for it."""
    monkeypatch.setenv(variable, "false")
    load_config([])
    monkeypatch.setenv(variable, "true")
    with pytest.raises(InputError) as err:
        load_config([])
    assert str(err.value) == (
        f"accelerate launch asked for {engine} ({variable}), which this package does not run with: it runs in one "
        "process or with DDP in several; launch with a profile without it (accelerate_configs/)"
    )
