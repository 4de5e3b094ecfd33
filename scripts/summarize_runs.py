"""Print a Markdown table of finished runs from their results.json files, and with several runs (seeds of one
recipe) their mean and minimum test accuracy, with and without test-time augmentation.

python scripts/summarize_runs.py outputs/full_no outputs/full_bf16
python scripts/summarize_runs.py outputs/fast_seed0 outputs/fast_seed1 outputs/fast_seed2
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Sequence
from pathlib import Path

from cifar_accel.errors import InputError, exit_command
from cifar_accel.state import epochs_text, read_results


def main(argv: Sequence[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dirs", nargs="+", help="Run folders, each with the results.json of a finished run.")
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
    if len(runs) > 1:
        with_tta = [results.test_accuracy for results in runs]
        without = [results.test_accuracy_no_tta for results in runs]
        print(f"\n{len(runs)} runs: test accuracy mean {statistics.mean(with_tta):.4f}, min {min(with_tta):.4f}; "
              f"without TTA mean {statistics.mean(without):.4f}, min {min(without):.4f}")  # fmt: skip


if __name__ == "__main__":
    exit_command(main)
