"""Print a Markdown table of finished runs from their results.json files, and with several seeds of one recipe
their mean and minimum test accuracy, with and without test-time augmentation (runs that differ in more than the
seed get the table, and what keeps them apart instead).

python scripts/summarize_runs.py outputs/full_no outputs/full_bf16
python scripts/summarize_runs.py outputs/fast_seed0 outputs/fast_seed1 outputs/fast_seed2
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path

from cifar_accel.compare import config_differences
from cifar_accel.config import CONFIG_FILE, TrainConfig, read_config_file
from cifar_accel.errors import ArgumentParser, InputError, exit_command, user_path
from cifar_accel.state import RunResults, epochs_text, read_results


def recipe_differences(run_dirs: list[Path], runs: list[RunResults]) -> list[str]:
    """What keeps the runs from being seeds of one recipe: per run after the first, the settings other than the
    seed in which its config.yaml differs from the first run's, and the precision in effect where it differs."""
    try:
        first = TrainConfig(**read_config_file(run_dirs[0] / CONFIG_FILE))
    except InputError:
        return [f"no readable {run_dirs[0] / CONFIG_FILE}"]
    differences = []
    for run_dir, results in zip(run_dirs[1:], runs[1:], strict=True):
        found = config_differences(run_dir, first, ignore=("seed", "mixed_precision"))
        if results.mixed_precision != runs[0].mixed_precision:
            found.append(f"precision {results.mixed_precision!r} (not {runs[0].mixed_precision!r})")
        differences += [f"{run_dir} has {', '.join(found)}"] if found else []
    return differences


def main(argv: Sequence[str]) -> None:
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "run_dirs", nargs="+", type=user_path, help="Run folders, each with the results.json of a finished run."
    )
    run_dirs = parser.parse_args(argv).run_dirs
    for index, run_dir in enumerate(run_dirs):  # a run given twice would count twice in the mean
        if same := next((d for d in run_dirs[:index] if Path(d).resolve() == Path(run_dir).resolve()), None):
            raise InputError(f"'{run_dir}' is the run '{same}' again; give each run once")
    runs = [read_results(Path(run_dir) / "results.json") for run_dir in run_dirs]
    print("| run | precision | epochs | s/epoch | train img/s | minutes | best val acc | test acc | test acc, no TTA |")
    print("|---|---|---|---|---|---|---|---|---|")
    for run_dir, results in zip(run_dirs, runs, strict=True):
        stopped = " (early stop)" if results.stopped_early else ""
        best = (f"{results.best_val_accuracy:.4f} (epoch {results.best_epoch})"
                if results.best_val_accuracy is not None else "no validation")  # fmt: skip
        minutes = sum(record.epoch_seconds for record in results.history) / 60
        print(
            f"| {Path(run_dir).name} | {results.mixed_precision} | {epochs_text(results.epochs_trained)}{stopped} | "
            f"{results.seconds_per_epoch:.1f} | {results.train_images_per_second:.0f} | {minutes:.1f} | {best} | "
            f"{results.test_accuracy:.4f} (TTA {results.tta}) | {results.test_accuracy_no_tta:.4f} |"
        )
    differences = recipe_differences([Path(run_dir) for run_dir in run_dirs], runs) if len(runs) > 1 else []
    if differences:
        print(f"\nno mean: the runs are not seeds of one recipe ({'; '.join(differences)})")
    elif len(runs) > 1:
        with_tta = [results.test_accuracy for results in runs]
        without = [results.test_accuracy_no_tta for results in runs]
        print(f"\n{len(runs)} runs: test accuracy mean {statistics.mean(with_tta):.4f}, min {min(with_tta):.4f}; "
              f"without TTA mean {statistics.mean(without):.4f}, min {min(without):.4f}")  # fmt: skip


if __name__ == "__main__":
    exit_command(main)
