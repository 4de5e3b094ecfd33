"""Run the record recipe (airbench94_muon, ported to this CPU) beside the fast preset: the same data, precision
and seed, one thread each, at the same time, so that both see the same machine (or, with --one_after_other, the
anchor and then the preset, each alone on an idle machine). Prints and writes a table of each seed's accuracy with
and without test-time augmentation, wall and CPU time, and the preset's ratios.

    python scripts/side_by_side.py --anchor ../shared/anchors/airbench94_muon_cpu.py \\
        --dataset_name ../shared/data/cifar10-jpeg --precision bf16 --seeds 0 1 2 --output_dir outputs/side_by_side

Flags after ``--`` go to the preset's ``cifar_accel.train`` (for example ``-- --num_train_epochs 10``), except
those the pair sets for both scripts (``--seed``, ``--mixed_precision``, ``--dataset_name``, ``--output_dir``:
give the script's own) and ``--resume_from_checkpoint``. Each
seed's pair writes ``seed<N>/`` (both logs and ``pair.json``) and the preset's run folder ``<precision>_seed<N>/``,
where ``python -m cifar_accel.compare --config fast --precisions <precision> --seeds ... --output_dir`` (the same
folder) finds and reuses it for its seed statistics. A seed whose ``pair.json`` exists is not run again, so a
stopped comparison (Ctrl-C stops both scripts, and so does the script's own end, even by SIGKILL) goes on where it
was; a pair that did not finish runs again from the start, over its preset run, since a pair is timed as a whole.
A pair whose anchor ran another command, or whose preset run has another config (precision, data or a training
flag), or that ran its scripts the other way (together, or one after the other), stops the script instead. The
table is ``side_by_side.md`` and ``side_by_side.json``; the CPU and torch it names are those each preset run
recorded in its ``results.json``. Bad input (the refusals above, flags the preset's run would refuse, data without
the parquet files the anchor reads) is one line and exit code 2 before either script starts; a script that fails
stops the other, and this script exits 1 with its line. A second comparison started in the same folder meanwhile is
refused, as a second run of a folder is.

Wall time is from process start to exit. The preset's includes its start-up (imports, reading the decoded images
from the ``datasets`` cache, which this script fills first, untimed); the anchor's includes decoding the JPEGs,
which it does in every run. Each script's own figure (``own s``) is what it reports: the anchor times its
training and TTA evaluation, the preset its epochs and test.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from cifar_accel.compare import check_seeds, config_differences
from cifar_accel.config import TrainConfig, given_flags, load_config
from cifar_accel.data import check_dataset_path, load_data
from cifar_accel.errors import AddUp, ArgumentParser, InputError, RunFault, Stopped, exit_command, user_path
from cifar_accel.outputs import OutputDirLock, writable_output_dir, write_atomic
from cifar_accel.state import read_results
from cifar_accel.stopping import STOP_WITH_PARENT, term_when_parent_ends

ONE_THREAD = {name: "1" for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")}
ANCHOR_FILES = ("plain_text/train-00000-of-00001.parquet", "plain_text/test-00000-of-00001.parquet")  # what it reads
ANCHOR_RESULT = re.compile(r"tta_acc (?P<tta>[\d.]+) plain_acc (?P<plain>[\d.]+) time (?P<own>[\d.]+) s")


def start(command: list[str], log: Path) -> tuple[subprocess.Popen, float]:
    """``command`` started on one thread, its output to ``log``; and when it started. It gets SIGTERM when this
    script ends, even by SIGKILL, rather than run on unseen; a run under the launcher stops when the launcher ends."""
    with log.open("w") as out:
        proc = subprocess.Popen(
            command,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, **ONE_THREAD, STOP_WITH_PARENT: str(os.getpid())},
            preexec_fn=functools.partial(term_when_parent_ends, os.getpid()),  # one prctl call, taking no lock
        )
    return proc, time.perf_counter()


def stop(pids: list[int]) -> None:
    """SIGTERM to each process (a launcher passes it on to its run), then wait for it."""
    for pid in pids:
        os.kill(pid, signal.SIGTERM)
    for pid in pids:
        os.waitpid(pid, 0)


def what_went_wrong(log: Path) -> str:
    """The line of a failed script's log that says why, as ': line': a run's one-line error ('error: ...'), else the
    log's last line (a traceback ends with the exception); '' for an empty log."""
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    said = [line.removeprefix("error: ") for line in lines if line.startswith("error: ")] or lines[-1:]
    return f": {said[-1]}" if said else ""


def finish(runs: dict[str, tuple[subprocess.Popen, float]], folder: Path) -> dict[str, dict[str, float]]:
    """Wait for every process of ``runs``, each timed when it exits (whichever exits first): its wall and CPU
    seconds (user + system, its children included). Ctrl-C stops both, and the script; so does either failing,
    since a pair is timed as a whole and the other would run on for nothing."""
    names = {proc.pid: name for name, (proc, _) in runs.items()}
    times = {}
    while names:
        try:
            pid, status, usage = os.wait4(-1, 0)
        except KeyboardInterrupt:
            stop(list(names))
            raise Stopped(
                f"stopped; the pair in {folder} is not finished: the same command runs it again", 130
            ) from None
        name, code = names.pop(pid), os.waitstatus_to_exitcode(status)
        if code != 0:
            stop(list(names))
            log = folder / f"{name}.log"
            raise RunFault(f"the {name} failed (exit code {code}){what_went_wrong(log)}; see {log}")
        times[name] = {"wall_s": time.perf_counter() - runs[name][1], "cpu_s": usage.ru_utime + usage.ru_stime}
    return times


SET_FOR_BOTH = {"seed": "--seeds", "mixed_precision": "--precision", "dataset_name": "--dataset_name",
                "output_dir": "--output_dir"}  # fmt: skip


def preset_flags(args: argparse.Namespace, train_args: list[str], seed: int, run_dir: Path) -> list[str]:
    """The preset's ``cifar_accel.train`` flags for ``seed``."""
    return [
        "--config", "fast", "--dataset_name", args.dataset_name, "--mixed_precision", args.precision,
        "--seed", str(seed), "--output_dir", str(run_dir), *train_args,
    ]  # fmt: skip


def commands(args: argparse.Namespace, seed: int, flags: list[str]) -> dict[str, list[str]]:
    anchor = [sys.executable, args.anchor, args.dataset_name, "--precision", args.precision, "--seed", str(seed)]
    preset = [
        sys.executable, "-m", "accelerate.commands.launch", "--quiet", "--cpu", "--num_processes", "1",
        "--num_machines", "1", "--dynamo_backend", "no", "-m", "cifar_accel.train", *flags,
    ]  # fmt: skip
    return {"anchor": anchor, "preset": preset}


def run_pair(commands: dict[str, list[str]], seed: int, folder: Path, run_dir: Path, together: bool) -> dict:
    """Both scripts at the same time (``together``), or the anchor and then the preset; a preset run left by a pair
    that did not finish is replaced, since the pair is timed as a whole."""
    folder.mkdir(parents=True, exist_ok=True)
    if run_dir.exists():
        commands = {**commands, "preset": [*commands["preset"], "--overwrite_output_dir"]}
    if together:
        times = finish({name: start(command, folder / f"{name}.log") for name, command in commands.items()}, folder)
    else:
        times = {}
        for name, command in commands.items():
            times |= finish({name: start(command, folder / f"{name}.log")}, folder)
    found = ANCHOR_RESULT.search((folder / "anchor.log").read_text())
    if found is None:
        raise RunFault(f"no result line in {folder / 'anchor.log'}")
    results = read_results(run_dir / "results.json")
    own_preset = sum(record.epoch_seconds for record in results.history)
    pair = {
        "seed": seed,
        "together": together,
        "anchor": {"tta": float(found["tta"]), "plain": float(found["plain"]), "own_s": float(found["own"]),
                   **times["anchor"], "command": commands["anchor"]},
        "preset": {"tta": results.test_accuracy, "plain": results.test_accuracy_no_tta, "own_s": own_preset,
                   "epochs": results.epochs_completed, **times["preset"], "command": commands["preset"]},
    }  # fmt: skip
    write_atomic(folder / "pair.json", json.dumps(pair, indent=2))
    return pair


def reuse_pair(done: Path, anchor: list[str], run_dir: Path, flags: list[str], together: bool) -> dict:
    """An earlier pair of this seed, if its anchor ran the command ``anchor`` and its preset run (``run_dir``) the
    config of ``flags``, both run ``together`` or not as now, whatever the interpreter and wherever the folder was
    then."""
    try:
        pair = json.loads(done.read_text())
        pair.setdefault("together", True)  # as every pair ran before --one_after_other
        ran_together, ran = pair["together"], shlex.join(pair["anchor"]["command"][1:])
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise InputError(
            f"{done} is not the record of a finished pair ({type(err).__name__}: {err}); delete it, and the same "
            "command runs the pair again"
        ) from None
    if ran_together != together:
        how = "at the same time" if ran_together else "one after the other"
        raise InputError(f"{done} ran its scripts {how}; give the same flags again, or another --output_dir")
    asked = shlex.join(anchor[1:])
    if ran != asked:
        raise InputError(
            f"{done} ran the anchor as '{ran}', not '{asked}'; give the same flags again, or another --output_dir"
        )
    differences = config_differences(run_dir, load_config(flags)[0])
    if differences:
        raise InputError(
            f"{run_dir} trained the preset with {', '.join(differences)}; give the same flags again, or another "
            "--output_dir"
        )
    return pair


def machine(run_dir: Path) -> str:
    """The CPU and torch a preset run recorded in its results."""
    results = read_results(run_dir / "results.json")
    hw = results.hardware
    flags = ", ".join(hw.get("cpu_flags", [])) or "none of note"
    return f"{hw['cpu']} ({hw['cpu_cores']} cores); flags: {flags}; torch {results.versions['torch']}"


def table(pairs: list[dict], precision: str, machines: dict[str, list[int]], together: bool) -> str:
    """The pairs' table; ``machines`` are the CPUs the preset runs recorded, each with its seeds."""
    if len(machines) == 1:
        ran_on = [f"- CPU: {next(iter(machines))}"]
    else:
        ran_on = ["- The pairs ran on different machines; times compare only within a pair:"]
        ran_on += [f"  - seeds {', '.join(map(str, seeds))}: {name}" for name, seeds in machines.items()]
    lines = [
        f"# Side by side: airbench94_muon (CPU port) and the fast preset, {precision}, one thread each",
        "",
        *ran_on,
        "- One thread per process; "
        + ("both processes at the same time" if together else "the anchor, then the preset, each alone"),
        "",
        "| seed | script | TTA acc | plain acc | own s | wall s | CPU s | wall vs anchor | CPU vs anchor |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for pair in pairs:
        anchor = pair["anchor"]
        for name in ("anchor", "preset"):
            run = pair[name]
            lines.append(
                f"| {pair['seed']} | {name} | {100 * run['tta']:.2f} | {100 * run['plain']:.2f} | {run['own_s']:.0f} "
                f"| {run['wall_s']:.0f} | {run['cpu_s']:.0f} | {run['wall_s'] / anchor['wall_s']:.2f}x "
                f"| {run['cpu_s'] / anchor['cpu_s']:.2f}x |"
            )
    lines.append("")
    for name in ("anchor", "preset"):
        tta = [100 * p[name]["tta"] for p in pairs]
        plain = [100 * p[name]["plain"] for p in pairs]
        wall = sum(p[name]["wall_s"] for p in pairs) / sum(p["anchor"]["wall_s"] for p in pairs)
        cpu = sum(p[name]["cpu_s"] for p in pairs) / sum(p["anchor"]["cpu_s"] for p in pairs)
        if len(pairs) == 1:
            accuracy = f"TTA {tta[0]:.2f}%, plain {plain[0]:.2f}% at seed {pairs[0]['seed']}"
        else:
            accuracy = (
                f"TTA {statistics.fmean(tta):.2f}% ± {statistics.pstdev(tta):.2f} (min {min(tta):.2f}), plain "
                f"{statistics.fmean(plain):.2f}% over {len(pairs)} seeds"
            )
        lines.append(f"- {name}: {accuracy}; wall {wall:.2f}x, CPU {cpu:.2f}x the anchor's")
    return "\n".join(lines) + "\n"


def check_train_args(args: argparse.Namespace, train_args: list[str]) -> None:
    """Refuse, before anything runs, the seeds and the flags after -- that the preset's run would refuse, and the
    flags that would part the preset from its anchor or are not needed."""
    check_seeds(args.seeds)
    given = given_flags(train_args)
    for name, own in SET_FOR_BOTH.items():
        if name in given:
            raise InputError(f"--{name} after -- would part the preset from its anchor; give {own} before --")
    if "config" in given:
        raise InputError(
            "--config after -- would train another recipe than the fast preset that the pair compares with its "
            "anchor; give the preset's values to change as flags after --"
        )
    if "resume_from_checkpoint" in given:
        raise InputError(
            "--resume_from_checkpoint after -- is not needed: the same command skips the pairs done and runs an "
            "unfinished one again from its start, as a pair is timed whole"
        )
    load_config(["--config", "fast", *train_args])  # the run's own refusal of its flags, at once


def check_anchor_input(anchor: str, dataset_name: str) -> None:
    """The anchor script, and the parquet files of CIFAR-10 it reads from ``dataset_name`` (the Hub's layout)."""
    if not Path(anchor).is_file():
        raise InputError(f"--anchor {anchor} is not a file; give the path of airbench94_muon_cpu.py")
    check_dataset_path(dataset_name)
    missing = [name for name in ANCHOR_FILES if not (Path(dataset_name) / name).is_file()]
    if missing:
        raise InputError(
            f"the anchor reads CIFAR-10 from {' and '.join(ANCHOR_FILES)} of --dataset_name, and '{dataset_name}' has "
            f"no {missing[0]}; pass a local copy of the Hub's parquet CIFAR-10, such as ../shared/data/cifar10-jpeg"
        )


def main(argv: Sequence[str]) -> None:
    argv = list(argv)
    train_args = argv[argv.index("--") + 1 :] if "--" in argv else []
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--anchor", type=user_path, required=True, help="Path of airbench94_muon_cpu.py.")
    parser.add_argument(
        "--dataset_name",
        type=user_path,
        default="../shared/data/cifar10-jpeg",
        help="CIFAR-10 in the Hub's layout, a local copy with its parquet files (default: %(default)s).",
    )
    parser.add_argument(
        "--precision", choices=["no", "bf16"], default="bf16", help="Both scripts' precision (default: %(default)s)."
    )
    parser.add_argument(
        "--seeds", type=int, nargs="+", action=AddUp, default=[0, 1, 2], help="One pair per seed (default: 0 1 2)."
    )
    parser.add_argument(
        "--output_dir",
        type=user_path,
        default="outputs/side_by_side",
        help="Each pair's runs and the table go here (default: %(default)s).",
    )
    parser.add_argument(
        "--one_after_other",
        action="store_true",
        help="Run the anchor, then the preset, each alone (on an idle machine), instead of both at the same time.",
    )
    args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    check_train_args(args, train_args)
    output_dir = Path(args.output_dir)
    folders = {seed: (output_dir / f"seed{seed}", output_dir / f"{args.precision}_seed{seed}") for seed in args.seeds}
    flags = {seed: preset_flags(args, train_args, seed, run_dir) for seed, (_, run_dir) in folders.items()}
    wanted = {seed: commands(args, seed, flags[seed]) for seed in args.seeds}
    together = not args.one_after_other
    earlier = {  # checked before anything runs
        seed: reuse_pair(folder / "pair.json", wanted[seed]["anchor"], run_dir, flags[seed], together)
        for seed, (folder, run_dir) in folders.items()
        if (folder / "pair.json").exists()
    }
    if len(earlier) < len(folders):
        check_anchor_input(args.anchor, args.dataset_name)
    with writable_output_dir(output_dir, reads=args.dataset_name), OutputDirLock(output_dir):  # one comparison a folder
        # Fill the datasets cache once, untimed: a first run decodes every JPEG into it.
        load_data(TrainConfig(dataset_name=args.dataset_name, val_ratio=0.0))
        pairs, machines = [], {}
        for seed, (folder, run_dir) in folders.items():
            pair = earlier.get(seed) or run_pair(wanted[seed], seed, folder, run_dir, together)
            pairs.append(pair)
            ran_on = machine(run_dir)
            machines.setdefault(ran_on, []).append(seed)
            print(table(pairs[-1:], args.precision, {ran_on: [seed]}, together), flush=True)
        summary = {
            "precision": args.precision,
            "threads": 1,
            "together": together,
            "machines": machines,
            "pairs": pairs,
        }
        write_atomic(output_dir / "side_by_side.json", json.dumps(summary, indent=2))
        write_atomic(output_dir / "side_by_side.md", table(pairs, args.precision, machines, together))
        print(table(pairs, args.precision, machines, together))


if __name__ == "__main__":
    exit_command(main)
