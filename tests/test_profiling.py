"""--profile_steps: a trace and a table of the top operators with their input dtype, from a real torch.profiler
run that changes nothing the run computes."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file

from conftest import run_cli, tiny_args, train_in_process

# oneDNN's kernels where the CPU has them for the dtype; ATen's own where it does not (bf16 without AVX-512 BF16).
CONVOLUTIONS = {"aten::mkldnn_convolution", "aten::convolution_backward", "aten::_convolution", "aten::conv2d",
                "aten::_slow_conv2d_forward", "aten::_slow_conv2d_backward"}  # fmt: skip


@pytest.fixture(scope="module")
def profiled_runs(tiny_dataset, cli_env, tmp_path_factory) -> dict:
    """The tiny run in fp32 without a profile, and in fp32 and bf16 with 3 profiled steps, through the real CLI: the
    profiler's native state (Kineto's) then never outlives a run inside the test worker."""
    root = tmp_path_factory.mktemp("profiled")
    assert train_in_process(tiny_args(tiny_dataset, root / "plain")) == 0
    for precision in ("no", "bf16"):
        args = tiny_args(tiny_dataset, root / precision, "--mixed_precision", precision, "--profile_steps", "3")
        proc = run_cli(args, cli_env)
        # The exit-code contract keeps stderr for the one-line error: the profiler's own notes stay off it.
        assert proc.returncode == 0 and proc.stderr == "", proc.stderr
        assert "profile of 3 optimizer steps, trace and table in" in proc.stdout
    return {"plain": root / "plain", "no": root / "no", "bf16": root / "bf16"}


def table(run) -> dict:
    return json.loads((run / "profile" / "top_ops.json").read_text())


def test_the_profile_writes_a_trace_and_a_table_whose_shares_add_up(profiled_runs):
    for precision in ("no", "bf16"):
        run = profiled_runs[precision]
        trace = json.loads((run / "profile" / "trace_rank0.pt.trace.json").read_text())
        operators = [event for event in trace["traceEvents"] if event.get("cat") == "cpu_op"]
        assert {event["name"] for event in operators} & CONVOLUTIONS  # the step's own ops were traced
        assert sum(1 for event in trace["traceEvents"] if event["name"].startswith("ProfilerStep#")) == 3
        profile = table(run)
        assert profile["steps"] == 3 and profile["ms_per_step"] > 0 and len(profile["top"]) == 15
        assert sum(profile["share_by_input_dtype"].values()) == pytest.approx(1.0, abs=1e-6)  # self times partition
        shares = [row["share"] for row in profile["top"]]
        assert shares == sorted(shares, reverse=True) and 0 < sum(shares) <= 1 + 1e-9
        markdown = (run / "profile" / "top_ops.md").read_text()
        assert "| operator | input dtype | calls | self ms | share of the step |" in markdown
        assert markdown.count("\n| `") == 15
    assert not (profiled_runs["plain"] / "profile").exists()


def test_the_table_shows_which_operators_autocast_moved_to_bf16(profiled_runs):
    for precision, dtype in (("no", "fp32"), ("bf16", "bf16")):
        rows = [row for row in table(profiled_runs[precision])["top"] if row["operator"] in CONVOLUTIONS]
        assert rows and {row["input_dtype"] for row in rows} == {dtype}
    assert table(profiled_runs["bf16"])["share_by_input_dtype"].get("bf16", 0) > 0.2
    assert "bf16" not in table(profiled_runs["no"])["share_by_input_dtype"]


def test_profiling_changes_nothing_the_run_computes(profiled_runs):
    plain, profiled = (load_file(profiled_runs[name] / "model.safetensors") for name in ("plain", "no"))
    assert plain.keys() == profiled.keys() and all(plain[k].equal(profiled[k]) for k in plain)


def test_more_profile_steps_than_the_run_has_are_refused_before_anything_is_written(train_here, tiny_dataset, tmp_path):
    proc = train_here(tiny_args(tiny_dataset, tmp_path / "run", "--profile_steps", "8"))  # 9 steps, 2 before
    assert proc.returncode == 2
    assert (
        "--profile_steps 8 needs 10 optimizer steps (2 before the recorded ones) but the run has 9 left" in proc.stderr
    )
    assert "use at most 7" in proc.stderr and not (tmp_path / "run" / "config.yaml").exists()
