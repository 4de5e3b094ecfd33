"""Compare precisions and seeds: one config trained under each precision this machine supports and each seed.

    python -m cifar_accel.compare --dataset_name ../shared/data/cifar10-jpeg --num_train_epochs 5
    python -m cifar_accel.compare --config fast --precisions bf16 --seeds 0 1 2 --jobs 2   # seed statistics

Every other flag goes to ``cifar_accel.train`` unchanged. Each precision and seed trains in its own folder,
``<output_dir>/<precision>_seed<seed>``; a folder that already holds a finished run of the same config is reused, an
interrupted one is resumed (one made with settings a resume must keep is refused, and so is a finished one made with
other settings than a smaller number of epochs), so a stopped comparison goes on where it was when started again
(SIGINT, SIGTERM or SIGHUP stops the runs in training at a checkpoint and starts no more, and so does a run that
fails).
``--jobs N`` trains N runs at a time, each on cores / N threads, with its output in ``<precision>_seed<seed>.log``. The
report is ``report.md`` (tables and plots), ``report.json`` (the same numbers) and PNG plots (with the ``plots`` extra):
validation accuracy and training loss per epoch, epoch time and peak memory, and for fp16 the loss scale. It gives each
seed's test accuracy with and without test-time augmentation and its training time, their mean, std, min and max, and
the environment the runs recorded when they trained (a reused run may come from another invocation or machine): the
CPU's model and flags, torch, the precision and each run's threads.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import signal
import statistics
import subprocess
import sys
import threading
import typing
from collections.abc import Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from cifar_accel.checkpoint import CHECKED_BY_CONTENT, complete_checkpoints
from cifar_accel.config import (
    FIELDS,
    Precision,
    TrainConfig,
    check_field,
    given_flags,
    load_config,
    read_config_file,
)
from cifar_accel.errors import (
    AddUp,
    ArgumentParser,
    InputError,
    RunFault,
    Stopped,
    counted,
    exit_command,
    one_line,
    positive_int,
    user_path,
)
from cifar_accel.outputs import (
    CONFIG_FILE,
    RESULTS_FILE,
    OutputDirLock,
    json_keys,
    refuse_foreign_files,
    save_atomic,
    writable_output_dir,
    write_atomic,
)
from cifar_accel.plots import MISSING, pyplot
from cifar_accel.precision import unsupported
from cifar_accel.processes import require_one_process
from cifar_accel.state import RunResults, epochs_text, read_results
from cifar_accel.stopping import STOP_WITH_PARENT, stop_signals
from cifar_accel.telemetry import machine_name
from cifar_accel.trackers import requested_trackers, tensorboard_dir
from cifar_accel.transforms import windowed_epochs

logger = logging.getLogger("cifar_accel.compare")

PRECISIONS = typing.get_args(Precision)
REPORT_FILES = ("report.json", "report.md", "curves.png", "cost.png", "loss_scale.png")  # what the report writes


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="cifar_accel.compare",
        description=__doc__.splitlines()[0],
        epilog="All other flags are passed to cifar_accel.train (see its --help).",
        allow_abbrev=False,
    )
    parser.add_argument(
        "--precisions",
        nargs="+",
        action=AddUp,
        choices=PRECISIONS,
        default=list(PRECISIONS),
        help="Precisions to compare (default: all; those this machine lacks are skipped).",
    )
    parser.add_argument(
        "--seeds", nargs="+", action=AddUp, type=int, default=[42], help="One run per seed (default: 42)."
    )
    parser.add_argument(
        "--jobs",
        type=positive_int,
        default=1,
        help="Runs trained at a time, each on cores / jobs threads (default: 1). Small models train faster on one "
        "thread per core: on 2 cores, 2 single-thread runs finish two seeds sooner than 2 two-thread runs in turn.",
    )
    parser.add_argument("--output_dir", type=user_path, default="outputs/compare", help="Runs and the report go here.")
    return parser


SET_PER_RUN = {  # training flags that compare gives each run, with what to give compare instead
    "seed": "compare gives each run its --seed from --seeds: give --seeds {value}",
    "mixed_precision": "compare gives each run its --mixed_precision from --precisions: give --precisions {value}",
    "resume_from_checkpoint": "compare resumes its unfinished runs and reuses its finished ones itself: run the same "
    "command again without it",
}


def check_train_args(args: argparse.Namespace, train_args: list[str], config: TrainConfig) -> None:
    """Refuse the training flags that compare sets for each run, which a run would otherwise override unseen, a
    push to the Hub, where the runs would overwrite each other, and a Hub token, which the report would show."""
    given = given_flags(train_args)
    for name, fix in SET_PER_RUN.items():
        if name in given:
            raise InputError(f"--{name} {given[name]} is not for compare; {fix.format(value=given[name])}")
    if config.push_to_hub:
        raise InputError(
            "push_to_hub is not for compare: every run would push to the one Hub repository of --hub_model_id, or to "
            "one named after its folder, such as no_seed42, over the others; leave it out, and upload the run you "
            "pick afterwards with hf upload"
        )
    if config.hub_token is not None:
        raise InputError(
            "hub_token is not for compare: it serves only push_to_hub, which compare refuses, and the report would "
            "show it in the command it records; leave it out"
        )
    check_seeds(args.seeds)
    if problem := listed_twice("--precisions", args.precisions):
        raise InputError(problem)


def check_seeds(seeds: list[int]) -> None:
    """Refuse a seed that training would refuse, and one listed twice."""
    for seed in seeds:
        check_field("seed", seed, "--seeds")
    if problem := listed_twice("--seeds", seeds):
        raise InputError(problem)


def check_loss_scale_logged(precisions: list[str], report_to: str) -> None:
    """fp16's GradScaler: the report plots its loss scale from each run's TensorBoard events, so refuse, before any
    run, a --report_to without TensorBoard."""
    trackers = requested_trackers(report_to)
    if "fp16" in precisions and trackers != "all" and "tensorboard" not in (trackers or []):
        raise InputError(
            f"--report_to {report_to} leaves out TensorBoard, whose events give the report the fp16 runs' loss "
            "scale; add tensorboard to it (e.g. --report_to tensorboard), or leave fp16 out of --precisions"
        )


def listed_twice(flag: str, values: list) -> str | None:
    """The refusal of a list ``flag`` that names a value more than once (a run each, so most likely a typo for
    another value), else None."""
    twice = [value for value in values if values.count(value) > 1]
    return f"{flag} lists {twice[0]} more than once; give each once" if twice else None


def config_differences(
    run_dir: Path, config: TrainConfig, resume_refuses: bool = False, ignore: Sequence[str] = ()
) -> list[str]:
    """Each setting that shapes a run's result where the run in ``run_dir`` differs from ``config``, as 'key saved
    (not wanted)', except those in ``ignore``; a run without a readable config.yaml differs in that, and a setting
    its config.yaml lacks (a run made before the setting existed) has its default. With ``resume_refuses``, only
    those a resume must keep (the dataset is checked by its content there, so it is left out)."""
    try:
        saved = read_config_file(run_dir / CONFIG_FILE)
    except InputError:  # missing or damaged: not a run of this config
        return [f"no readable {run_dir / CONFIG_FILE}"]
    keys = [key for key in config.to_dict() if not FIELDS[key].metadata["plumbing"] and key not in ignore]
    if resume_refuses:
        keys = [key for key in keys if FIELDS[key].metadata["resume"] == "match" and key not in CHECKED_BY_CONTENT]
    saved = {key: saved.get(key, FIELDS[key].default) for key in keys}
    return [
        f"{key} {saved[key]!r} (not {getattr(config, key)!r})" for key in keys if saved[key] != getattr(config, key)
    ]


def finished_results(run_dir: Path) -> RunResults | None:
    """A run's results, or None when its results.json is missing or unreadable (the run did not finish)."""
    try:
        return read_results(run_dir / RESULTS_FILE)
    except InputError:
        return None


class TrainingProcesses:
    """The comparison's training processes, each started in a process group of its own, so that a stop request
    (SIGINT, SIGTERM, SIGHUP) reaches each of them exactly once, from here: the runs in training stop at their next
    optimizer step with a checkpoint (a second SIGINT at once, as for any run), and no run starts after it. Use it
    as a context manager around the runs; it handles those signals while it is entered."""

    def __init__(self) -> None:
        self.signal_number = 0
        self._running: set[subprocess.Popen] = set()
        self._lock = threading.RLock()  # taken by the signal handler too, which runs in the main thread
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> TrainingProcesses:
        for number in stop_signals():
            self._previous[number] = signal.signal(number, self.stop)
        return self

    def __exit__(self, *exc_info: object) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)

    def stop(self, number: int, frame: object = None) -> int:
        """Pass signal ``number`` on to the runs in training, and start no other; returns how many it reached."""
        with self._lock:
            self.signal_number = number
            for proc in self._running:
                proc.send_signal(number)
            return len(self._running)

    def run(self, command: list[str], **kwargs: Any) -> subprocess.CompletedProcess | None:
        """Run ``command`` to its end, its stderr captured; None where a stop was requested before it started. The
        run stops at a checkpoint when this process ends, even by SIGKILL (``stopping.stop_with_parent``)."""
        env = {**kwargs.pop("env", os.environ), STOP_WITH_PARENT: str(os.getpid())}
        with self._lock:
            if self.signal_number:
                return None
            proc = subprocess.Popen(
                command, stderr=subprocess.PIPE, text=True, start_new_session=True, env=env, **kwargs
            )
            self._running.add(proc)
        try:
            _, stderr = proc.communicate()
        finally:
            with self._lock:
                self._running.discard(proc)
        return subprocess.CompletedProcess(command, proc.returncode, None, stderr)

    @property
    def exit_code(self) -> int:
        return 128 + self.signal_number


def train_run(
    processes: TrainingProcesses, train_args: list[str], precision: str, seed: int, run_dir: Path, threads: int | None
) -> tuple[RunResults | None, bool]:
    """The results of one finished run, and whether this comparison trained it: reused when present, else trained
    (or resumed) in a subprocess; with ``threads``, on that many threads and with its output in ``<run_dir>.log``.
    None where a stop request stopped the run or came before it started."""
    argv = [*train_args, "--mixed_precision", precision, "--seed", str(seed), "--output_dir", str(run_dir)]
    config, _ = load_config(argv)
    results = finished_results(run_dir)
    if results is not None and not config_differences(run_dir, config):
        logger.info(f"{run_dir.name}: reusing the finished run in {run_dir}")
        return results, False
    if complete_checkpoints(run_dir):
        # A finished run resumes only to train more epochs: with any other difference it would test the same
        # weights again and record settings that they did not train with.
        if results is not None:
            differences = config_differences(run_dir, config, ignore=("num_train_epochs", *CHECKED_BY_CONTENT))
        else:
            differences = config_differences(run_dir, config, resume_refuses=True)
        if differences:
            raise InputError(
                f"the {precision} run (seed {seed}) in {run_dir} was made with other settings "
                f"({'; '.join(differences)}); compare these settings in another --output_dir, or give the ones it "
                "was made with"
            )
        argv += ["--resume_from_checkpoint", "latest"]  # finishes or extends it
    if processes.signal_number:  # the comparison is stopping
        return None, True
    command = [sys.executable, "-m", "cifar_accel.train", *argv]
    if threads is None:
        logger.info(f"{run_dir.name}: {shlex.join(command)}")
        proc = processes.run(command)
    else:
        with run_dir.with_suffix(".log").open("w") as log:
            logger.info(f"{run_dir.name}: {shlex.join(command)}")
            proc = processes.run(command, stdout=log, env={**os.environ, "OMP_NUM_THREADS": str(threads)})
    lines = proc.stderr.strip().splitlines() if proc else []
    if proc is None or (processes.signal_number and proc.returncode > 128):  # stopped as asked, with its own line
        logger.info(f"{run_dir.name}: " + (one_line(lines[-1]) if lines else "not started"))
        # A stop after the run's last optimizer step lets it finish: a results.json other than the one the run
        # started with (a finished run's, which it was extending) says the run is done.
        written = finished_results(run_dir) if proc else None
        return (written if written != results else None), True
    if threads is not None:
        ended = "finished" if proc.returncode == 0 else f"ended with exit code {proc.returncode}"
        logger.info(f"{run_dir.name}: {ended} (its output is in {log.name})")
    if proc.returncode != 0:
        reason = lines[-1].removeprefix("error: ") if lines else f"exit code {proc.returncode}"
        error = InputError if proc.returncode == 2 else RunFault
        raise error(f"the {precision} run (seed {seed}) in {run_dir} failed: {one_line(reason)}")
    results = finished_results(run_dir)
    if results is None:
        raise RunFault(f"the {precision} run (seed {seed}) in {run_dir} finished but its results.json is unreadable")
    return results, True


def loss_scale_trace(run_dir: Path, results: RunResults) -> list[tuple[int, float]]:
    """(optimizer step, loss scale) as logged to TensorBoard; empty without a GradScaler, whose runs log none
    (and need not have logged to TensorBoard at all)."""
    if not results.precision_report["grad_scaler"]:
        return []
    project_name = TrainConfig(**read_config_file(run_dir / CONFIG_FILE)).project_name
    events = EventAccumulator(str(tensorboard_dir(run_dir, project_name)), size_guidance={"scalars": 0})
    events.Reload()
    if "step/loss_scale" not in events.Tags()["scalars"]:
        return []
    return [(event.step, event.value) for event in events.Scalars("step/loss_scale")]


def by_value(runs: dict[tuple[str, int], RunResults], value: typing.Callable[[RunResults], Any]) -> dict[Any, str]:
    """Each distinct ``value`` of the runs, with the runs that have it ("bf16 seed 0, bf16 seed 1")."""
    groups: dict[Any, list[str]] = {}
    for (precision, seed), results in runs.items():
        groups.setdefault(value(results), []).append(f"{precision} seed {seed}")
    return {key: ", ".join(names) for key, names in groups.items()}


def recorded_environment(runs: dict[tuple[str, int], RunResults]) -> dict[str, Any]:
    """The machine and threads the runs recorded when they trained, not this process's: a comparison may only
    reuse them. The threads are one number when every run recorded the same, else each value with its runs."""
    machines = by_value(runs, lambda r: json.dumps({k: v for k, v in r.hardware.items() if k != "torch_threads"}))
    threads = by_value(runs, lambda r: r.hardware.get("torch_threads", "not recorded"))
    if len(threads) == 1 and isinstance(only := next(iter(threads)), int):
        threads_per_run: int | str = only
    else:
        threads_per_run = "; ".join(f"{value} ({names})" for value, names in threads.items())
    return {
        "hardware": json.loads(next(iter(machines))),
        "other_machines": {machine_name(json.loads(hw)): names for hw, names in list(machines.items())[1:]},
        "threads_per_run": threads_per_run,
    }


def mean_and_spread(values: list[float]) -> dict[str, float]:
    return {"mean": statistics.fmean(values), "std": statistics.pstdev(values), "min": min(values), "max": max(values)}


def train_seconds(results: RunResults) -> float:
    """The run's training time: its epochs' seconds (validation included), summed over its resumes."""
    return sum(record.epoch_seconds for record in results.history)


def summarize(precision: str, runs: dict[int, tuple[Path, RunResults]]) -> dict[str, Any]:
    """One precision's numbers over its seeds."""
    results = [r for _, r in runs.values()]
    epochs = min(len(r.history) for r in results)

    def per_epoch(key: str) -> list[float] | None:  # None: the runs have no validation
        values = [[getattr(r.history[i], key) for r in results] for i in range(epochs)]
        return None if any(None in epoch for epoch in values) else [statistics.fmean(epoch) for epoch in values]

    def over_seeds(key: str) -> dict[str, float] | None:
        values = [getattr(r, key) for r in results]
        return None if None in values else mean_and_spread([float(value) for value in values])

    return {
        "precision": precision,
        "seeds": sorted(runs),
        "runs": {str(seed): str(run_dir) for seed, (run_dir, _) in sorted(runs.items())},
        "epochs": epochs,
        "epochs_trained": statistics.fmean(r.epochs_trained for r in results),
        "seconds_per_epoch": over_seeds("seconds_per_epoch"),
        "train_images_per_second": over_seeds("train_images_per_second"),
        "peak_memory_mib": over_seeds("peak_memory_mib"),
        "peak_memory_measure": results[0].peak_memory_measure,
        "best_val_accuracy": over_seeds("best_val_accuracy"),
        "test_accuracy": over_seeds("test_accuracy"),
        "test_accuracy_no_tta": over_seeds("test_accuracy_no_tta"),
        "train_seconds": mean_and_spread([train_seconds(r) for r in results]),
        "per_seed": [
            {
                "seed": seed,
                "test_accuracy": r.test_accuracy,
                "test_accuracy_no_tta": r.test_accuracy_no_tta,
                "tta": r.tta,
                "train_seconds": train_seconds(r),
                "epochs": r.epochs_completed,
            }
            for seed, (_, r) in sorted(runs.items())
        ],
        "skipped_steps": over_seeds("skipped_steps"),
        "val_accuracy_per_epoch": per_epoch("val_accuracy"),
        "train_accuracy_per_epoch": per_epoch("train_accuracy"),
        "train_loss_per_epoch": per_epoch("train_loss"),
        "epoch_seconds_per_epoch": per_epoch("epoch_seconds"),
        "loss_scale_trace": {str(seed): loss_scale_trace(run_dir, r) for seed, (run_dir, r) in sorted(runs.items())},
        "dtypes": results[0].precision_report["dtypes"],
        "versions": results[0].versions,
        "device": results[0].device,
    }


def add_ratios(summaries: list[dict[str, Any]]) -> None:
    """Speed-up, memory ratio and accuracy difference of each precision against 'no' (when 'no' ran)."""
    base = next((s for s in summaries if s["precision"] == "no"), None)
    for summary in summaries:
        if base is None:
            summary["vs_no"] = None
            continue
        summary["vs_no"] = {
            "speedup": base["seconds_per_epoch"]["mean"] / summary["seconds_per_epoch"]["mean"],
            "memory_ratio": summary["peak_memory_mib"]["mean"] / base["peak_memory_mib"]["mean"],
            "test_accuracy_points": 100 * (summary["test_accuracy"]["mean"] - base["test_accuracy"]["mean"]),
        }


def plot(summaries: list[dict[str, Any]], output_dir: Path) -> list[str]:
    """The report's PNGs; returns their file names (none without matplotlib)."""
    plt = pyplot()
    if plt is None:
        logger.warning(MISSING)
        return []
    written = []
    fig, (acc, loss) = plt.subplots(1, 2, figsize=(11, 4.2), dpi=100)
    validated = all(s["val_accuracy_per_epoch"] is not None for s in summaries)
    accuracy = "val_accuracy_per_epoch" if validated else "train_accuracy_per_epoch"  # --val_ratio 0: no validation
    for s in summaries:
        epochs = range(1, s["epochs"] + 1)
        acc.plot(epochs, s[accuracy], marker="o", label=s["precision"])
        loss.plot(epochs, s["train_loss_per_epoch"], marker="o", label=s["precision"])
    acc.set(
        title="validation accuracy" if validated else "training accuracy (no validation)",
        xlabel="epoch",
        ylabel="accuracy",
    )
    loss.set(title="training loss", xlabel="epoch", ylabel="cross-entropy")
    for ax in (acc, loss):
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.grid(alpha=0.3)
        ax.legend(title="precision")
    fig.tight_layout()
    save_atomic(output_dir / "curves.png", lambda temporary: fig.savefig(temporary, format="png"))
    written.append("curves.png")

    fig, (time_ax, memory_ax) = plt.subplots(1, 2, figsize=(11, 4.2), dpi=100)
    names = [s["precision"] for s in summaries]
    time_ax.bar(
        names,
        [s["seconds_per_epoch"]["mean"] for s in summaries],
        yerr=[s["seconds_per_epoch"]["std"] for s in summaries],
        color="tab:blue",
    )
    memory_ax.bar(names, [s["peak_memory_mib"]["mean"] for s in summaries], color="tab:orange")
    time_ax.set(title="seconds per epoch (lower is faster)", ylabel="s")
    memory_ax.set(title=f"peak memory ({summaries[0]['peak_memory_measure']})", ylabel="MiB")
    memory_ax.title.set_fontsize(9)
    fig.tight_layout()
    save_atomic(output_dir / "cost.png", lambda temporary: fig.savefig(temporary, format="png"))
    written.append("cost.png")

    traces = [(s["precision"], seed, t) for s in summaries for seed, t in s["loss_scale_trace"].items() if t]
    if traces:
        fig, ax = plt.subplots(figsize=(8, 4), dpi=100)
        for precision, seed, trace in traces:
            ax.step(*zip(*trace, strict=True), where="post", label=f"{precision}, seed {seed}")
        ax.set(title="GradScaler loss scale", xlabel="optimizer step", ylabel="scale", yscale="log")
        ax.legend()
        fig.tight_layout()
        save_atomic(output_dir / "loss_scale.png", lambda temporary: fig.savefig(temporary, format="png"))
        written.append("loss_scale.png")
    plt.close("all")
    return written


def seed_table(summary: dict[str, Any]) -> list[str]:
    """One precision's runs, a row per seed, then, over two or more, their mean, std, min and max."""
    tta = summary["per_seed"][0]["tta"]
    lines = [
        f"`{summary['precision']}`, each seed (test accuracy in %, with TTA `{tta}` and without):",
        "",
        "| seed | test acc | without TTA | train s |",
        "|---|---|---|---|",
    ]
    for run in summary["per_seed"]:
        lines.append(
            f"| {run['seed']} | {100 * run['test_accuracy']:.2f} | {100 * run['test_accuracy_no_tta']:.2f} "
            f"| {run['train_seconds']:.0f} |"
        )
    if len(summary["per_seed"]) == 1:  # one seed's statistics would be its own figures and a std of 0
        return lines
    stats = [summary[key] for key in ("test_accuracy", "test_accuracy_no_tta", "train_seconds")]
    for name in ("mean", "std", "min", "max"):
        lines.append(f"| {name} | {100 * stats[0][name]:.2f} | {100 * stats[1][name]:.2f} | {stats[2][name]:.0f} |")
    return lines


def markdown(report: dict[str, Any]) -> str:
    def pm(stat: dict[str, float] | None, fmt: str) -> str:
        if stat is None:  # runs without validation have no best validation accuracy
            return "-"
        return format(stat["mean"], fmt) + (f" ± {format(stat['std'], fmt)}" if len(report["seeds"]) > 1 else "")

    def versus_no(summary: dict[str, Any], key: str, fmt: str, unit: str = "") -> str:
        if summary["vs_no"] is None:  # 'no' did not run: nothing to compare with
            return "-"
        return format(summary["vs_no"][key], fmt) + unit

    hw = report["hardware"]
    versions = ", ".join(f"{k} {v}" for k, v in report["versions"].items())
    lines = [
        "# Mixed precision comparison",
        "",
        f"`{report['command']}`",
        "",
        f"- Hardware: {hw.get('gpu') or hw['cpu']} ({hw['cpu_cores']} CPU cores; flags "
        f"{' '.join(hw.get('cpu_flags', [])) or 'none of note'}; torch CPU capability {hw['torch_cpu_capability']}"
        + (f", native bf16: {hw['cpu_native_bf16']}" if "cpu_native_bf16" in hw else "")
        + f"); device `{report['precisions'][0]['device']}`",
        f"- Software: {versions}",
        f"- Config: {report['config_summary']}; seeds {', '.join(map(str, report['seeds']))}",
        f"- Threads per run, as the runs recorded: {report['threads_per_run']}; {training_text(report)}",
    ]
    others = "; ".join(f"{machine} ({names})" for machine, names in report.get("other_machines", {}).items())
    if others:
        lines.append(f"- Some runs trained on other machines, so their times do not compare with the rest: {others}")
    lines += [f"- Skipped `{name}`: {reason}" for name, reason in report["skipped"].items()]
    lines += [
        "",
        "| precision | s/epoch | speed-up vs no | train img/s | peak memory MiB | vs no | best val acc | test acc "
        "| test vs no (points) | skipped steps |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in report["precisions"]:
        lines.append(
            f"| {s['precision']} | {pm(s['seconds_per_epoch'], '.1f')} | {versus_no(s, 'speedup', '.2f', 'x')} "
            f"| {pm(s['train_images_per_second'], '.0f')} | {pm(s['peak_memory_mib'], '.0f')} "
            f"| {versus_no(s, 'memory_ratio', '.2f', 'x')} | {pm(s['best_val_accuracy'], '.4f')} "
            f"| {pm(s['test_accuracy'], '.4f')} | {versus_no(s, 'test_accuracy_points', '+.2f')} "
            f"| {pm(s['skipped_steps'], '.0f')} |"
        )
    lines += ["", f"Peak memory is the {report['precisions'][0]['peak_memory_measure']}.", ""]
    for s in report["precisions"]:
        lines += seed_table(s) + [""]
    lines += ["Dtypes one batch produced (from each run's precision report):", ""]
    lines += [
        f"- `{s['precision']}`: " + ", ".join(f"{k} {v}" for k, v in s["dtypes"].items()) for s in report["precisions"]
    ]
    lines += [""] + [f"![{name}]({name})" for name in report["plots"]]
    return "\n".join(lines) + "\n"


def training_text(report: dict[str, Any]) -> str:
    """How the comparison came by its runs: trained them, so many at a time, or reused runs trained before it (whose
    records do not say how many trained beside them). A report written before ``trained`` was recorded is read as
    having trained them all."""
    runs = sum(len(s["seeds"]) for s in report["precisions"])
    trained = report.get("trained", runs)
    if trained == runs:
        return f"this comparison trains {counted(report['jobs'], 'run')} at a time"
    if trained:
        return (
            f"this comparison trained {trained} of its {runs} runs, {report['jobs']} at a time, and reused the others"
        )
    return (
        "this comparison trained none of its runs: it reused runs trained before it, which do not record how many "
        "trained at a time"
    )


def results_table(reports: dict[str, dict[str, Any]], folder: str = "docs/results") -> str:
    """A results table: one row per precision of each named ``report.json``, its seeds' test accuracy (mean ± std,
    min and max, with TTA and without), training time per run and the machine it ran on; each run's name links to
    its report.md in ``folder``/<name>/."""
    lines = [
        "| run | precision | epochs | seeds | test accuracy with TTA: mean ± std (min, max) | without TTA: mean (min) "
        "| training per run | machine |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, report in sorted(reports.items()):
        hw = report["hardware"]
        machine = f"{machine_name(hw)}; threads per run: {report['threads_per_run']}"
        at_a_time = f"{report['jobs']} at a time" if report.get("trained", 1) else "trained before the comparison"
        for s in report["precisions"]:
            tta, plain, seconds = s["test_accuracy"], s["test_accuracy_no_tta"], s["train_seconds"]
            epochs = epochs_text(s.get("epochs_trained", s["epochs"]))  # reports written before it: whole epochs
            lines.append(
                f"| [{name}]({folder}/{name}/report.md) | {s['precision']} | {epochs} | {len(s['seeds'])} "
                f"| {100 * tta['mean']:.2f}% ± {100 * tta['std']:.2f} ({100 * tta['min']:.2f}, {100 * tta['max']:.2f}) "
                f"| {100 * plain['mean']:.2f}% ({100 * plain['min']:.2f}) | {seconds['mean'] / 60:.0f} min, "
                f"{at_a_time} | {machine} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str]) -> None:
    args, train_args = build_parser().parse_known_args(argv)
    require_one_process("compare")
    logging.basicConfig(format="%(asctime)s %(message)s", datefmt="%H:%M:%S", stream=sys.stdout)
    logger.setLevel(logging.INFO)  # its own lines; other libraries (TensorBoard's event reader) only warnings
    config, _ = load_config(train_args)  # bad training flags stop here, before anything runs
    check_train_args(args, train_args, config)
    # One comparison per folder; each training run locks its own subfolder.
    with writable_output_dir(Path(args.output_dir), reads=config.dataset_name) as output_dir, OutputDirLock(output_dir):
        ours = "precisions" in json_keys(output_dir / "report.json")  # an earlier comparison's report
        refuse_foreign_files(output_dir, REPORT_FILES, "compare", ours)
        compare(args, argv, train_args, config, output_dir)


def compare(
    args: argparse.Namespace, argv: Sequence[str], train_args: list[str], config: TrainConfig, output_dir: Path
) -> None:
    """Train (or reuse) one run per precision and seed, then write the report."""

    skipped = {p: reason for p in args.precisions if (reason := unsupported(p))}
    for precision, reason in skipped.items():
        logger.info(f"skipping {precision}: {reason}")
    precisions = [p for p in args.precisions if p not in skipped]
    check_loss_scale_logged(precisions, config.report_to)
    if not precisions:
        raise InputError("none of the requested precisions can run here; add --precisions no")

    threads = max(1, (os.cpu_count() or 1) // args.jobs) if args.jobs > 1 else None
    folders = {(p, seed): output_dir / f"{p}_seed{seed}" for p in precisions for seed in args.seeds}
    # Threads that each wait on one training process.
    with TrainingProcesses() as processes, ThreadPoolExecutor(max_workers=args.jobs) as pool:
        futures = {
            key: pool.submit(train_run, processes, train_args, key[0], key[1], folder, threads)
            for key, folder in folders.items()
        }
        wait(futures.values(), return_when=FIRST_EXCEPTION)
        failed = next((future.exception() for future in futures.values() if future.done() and future.exception()), None)
        if failed is not None:  # the other runs in training stop at a checkpoint, which the same command resumes
            if processes.stop(signal.SIGTERM):
                logger.info("a run failed: stopping the others at a checkpoint; the same command resumes them")
            pool.shutdown(cancel_futures=True)  # the runs not started yet
            raise failed
        outcomes = {key: future.result() for key, future in futures.items()}
    finished = {key: results for key, (results, _) in outcomes.items()}
    stopped = [folders[key].name for key, results in finished.items() if results is None]
    if stopped:
        raise Stopped(
            f"stopped by {signal.Signals(processes.signal_number).name}; the runs not finished, {len(stopped)} of "
            f"{len(folders)}: {', '.join(stopped)}; run the same command again to go on",
            processes.exit_code,
        )
    summaries = [summarize(p, {seed: (folders[p, seed], finished[p, seed]) for seed in args.seeds}) for p in precisions]
    add_ratios(summaries)

    steps = config.max_train_steps
    length = counted(steps, "optimizer step") if steps else counted(config.num_train_epochs, "epoch")
    windows, size = windowed_epochs(config.early_crop_epochs, summaries[0]["epochs"]), config.early_crop_size
    if config.augment and size and windows:
        length += f" (the first {'epoch' if windows == 1 else f'{windows} epochs'} on {size}x{size} windows)"
    report = {
        "command": shlex.join(["python", "-m", "cifar_accel.compare", *argv]),
        **recorded_environment(finished),
        "versions": summaries[0]["versions"],
        "config_summary": f"{config.dataset_name}, {length}, batch {config.per_device_train_batch_size}, lr "
        f"{config.learning_rate:g}, {config.model_name}",
        "seeds": args.seeds,
        "jobs": args.jobs,
        "trained": sum(trained for _, trained in outcomes.values()),
        "skipped": skipped,
        "precisions": summaries,
    }
    report["plots"] = plot(summaries, output_dir)
    write_atomic(output_dir / "report.json", json.dumps(report, indent=2))
    write_atomic(output_dir / "report.md", markdown(report))
    print(markdown(report))
    logger.info(f"wrote {output_dir / 'report.md'}, {output_dir / 'report.json'} and {len(report['plots'])} PNGs")
    if processes.signal_number:  # it came as the last runs were finishing, which they did, as a run does
        raise Stopped(
            f"stopped by {signal.Signals(processes.signal_number).name} as the runs were finishing; they finished "
            f"first, and the report is in {output_dir / 'report.md'}",
            processes.exit_code,
        )


def cli() -> None:
    exit_command(main)


if __name__ == "__main__":
    cli()
