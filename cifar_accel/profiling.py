"""--profile_steps N: where a training step's time goes, operator by operator, and in which precision.

After ``PROFILE_SKIP`` optimizer steps and ``PROFILE_WARMUP`` more that warm the profiler up, torch.profiler
(through Accelerate's ``ProfileKwargs``) records N optimizer steps. Each process writes its trace into
``<output_dir>/profile/`` (Perfetto and chrome://tracing open it, TensorBoard with the torch-tb-profiler plugin
too), and the main process writes and logs a table of the top operators by self time, each with the dtype of its
first input and its share of the recorded steps: the ops autocast moved to bf16 or fp16 show as such.
"""

from __future__ import annotations

import json
import os
import re
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import ProfileKwargs

from cifar_accel.errors import counted
from cifar_accel.outputs import PROFILE_DIR, write_atomic

logger = get_logger(__name__)

PROFILE_SKIP, PROFILE_WARMUP = 1, 1  # optimizer steps before the recorded ones: one-time costs, then a warm-up
STEPS_BEFORE_RECORDING = PROFILE_SKIP + PROFILE_WARMUP
TOP_OPERATORS = 15
TABLE_FILE, TABLE_JSON = "top_ops.md", "top_ops.json"
# The profiler's dtype names (c10's), as the precision flags name them.
DTYPE_NAMES = {
    "float": "fp32",
    "c10::BFloat16": "bf16",
    "c10::Half": "fp16",
    "double": "fp64",
    "unsigned char": "uint8",
    "long int": "int64",
    "int": "int32",
    "bool": "bool",
}


NOT_TENSORS = {"", "Scalar", "ScalarList", "TensorList", "GenericList"}  # inputs the profiler records no dtype of
OUTSIDE_OPERATORS = "(between operators: Python, the loop)"  # a step's own self time


def input_dtype(event: Any) -> str:
    """The dtype of an operator's first tensor input, named as the precision flags name it ('-' for none)."""
    name = next((dtype for dtype in event.input_dtypes if dtype not in NOT_TENSORS), "-")
    return DTYPE_NAMES.get(name, name)


def operator_table(events: list[Any], on_device: bool) -> dict[str, Any]:
    """The recorded steps' operators grouped by name and input dtype, by self time (on the GPU where the run is
    on one, else on the CPU), largest first, each with its share of the steps' time; and the time by dtype."""
    steps = [event for event in events if re.fullmatch(r"ProfilerStep[#*]\d*", event.name)]
    step_time = sum(event.cpu_time_total for event in steps)  # microseconds, the steps' wall time on the host
    totals, calls = defaultdict(float), defaultdict(int)
    for event in events:
        key = (OUTSIDE_OPERATORS, "-") if event in steps else (event.name, input_dtype(event))
        totals[key] += event.self_device_time_total if on_device else event.self_cpu_time_total
        calls[key] += 1
    rows = []
    for (name, dtype), time in sorted(totals.items(), key=lambda item: -item[1]):
        share = time / step_time if step_time else 0.0
        rows.append(
            {
                "operator": name,
                "input_dtype": dtype,
                "calls": calls[name, dtype],
                "self_ms": time / 1000,
                "share": share,
            }
        )
    by_dtype = defaultdict(float)
    for row in rows:
        by_dtype[row["input_dtype"]] += row["share"]
    return {
        "steps": len(steps),
        "ms_per_step": step_time / 1000 / max(1, len(steps)),
        "measure": "self time on the GPU" if on_device else "self time on the CPU",
        "top": rows[:TOP_OPERATORS],
        "share_by_input_dtype": dict(sorted(by_dtype.items(), key=lambda item: -item[1])),
    }


def format_table(table: dict[str, Any], title: str) -> str:
    """The table as Markdown: the docs show it, and the log prints it."""
    lines = [
        f"{title}: {counted(table['steps'], 'optimizer step')}, {table['ms_per_step']:.1f} ms each; {table['measure']}",
        "",
        "| operator | input dtype | calls | self ms | share of the step |",
        "|---|---|---:|---:|---:|",
    ]
    for row in table["top"]:
        lines.append(
            f"| `{row['operator']}` | {row['input_dtype']} | {row['calls']} | {row['self_ms']:.1f} | "
            f"{100 * row['share']:.1f}% |"
        )
    shares = ", ".join(f"{dtype} {100 * share:.1f}%" for dtype, share in table["share_by_input_dtype"].items())
    return "\n".join(lines + ["", f"share of the step by input dtype: {shares}"])


@contextmanager
def profiled(accelerator: Accelerator, steps: int, output_dir: Path, title: str) -> Iterator[Any]:
    """A profiler that records ``steps`` optimizer steps (each ended by its ``step()``) after the skipped and
    warm-up ones, then writes the trace and the table; None when ``steps`` is 0."""
    if not steps:
        yield None
        return
    # Kineto, the profiler's backend, writes its own notes to stderr, which is kept for the one-line error of the
    # exit-code contract; a KINETO_LOG_LEVEL of the user's shows them.
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    folder = output_dir / PROFILE_DIR
    on_device = accelerator.device.type == "cuda"

    def write_results(profiler: torch.profiler.profile) -> None:
        folder.mkdir(exist_ok=True)
        profiler.export_chrome_trace(str(folder / f"trace_rank{accelerator.process_index}.pt.trace.json"))
        if not accelerator.is_main_process:
            return
        table = operator_table(profiler.events(), on_device)
        text = format_table(table, title)
        write_atomic(folder / TABLE_FILE, text + "\n")
        write_atomic(folder / TABLE_JSON, json.dumps({"title": title, **table}, indent=2))
        logger.info(f"profile of {counted(steps, 'optimizer step')}, trace and table in {folder}:\n{text}")

    handler = ProfileKwargs(
        activities=["cpu", "cuda"] if on_device else ["cpu"],
        schedule_option={"skip_first": PROFILE_SKIP, "wait": 0, "warmup": PROFILE_WARMUP, "active": steps, "repeat": 1},
        on_trace_ready=write_results,
        record_shapes=True,  # also records each operator's input dtypes
    )
    with accelerator.profile(handler) as profiler:
        yield profiler
