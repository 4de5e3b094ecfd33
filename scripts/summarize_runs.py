"""Print a Markdown table of finished runs from their results.json files.

python scripts/summarize_runs.py outputs/full_no outputs/full_bf16
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(run_dirs: list[str]) -> None:
    print("| run | precision | epochs | s/epoch | train img/s | best val acc | test acc |")
    print("|---|---|---|---|---|---|---|")
    for run_dir in run_dirs:
        results = json.loads((Path(run_dir) / "results.json").read_text())
        stopped = " (early stop)" if results["stopped_early"] else ""
        print(
            f"| {Path(run_dir).name} | {results['mixed_precision']} | {results['epochs_completed']}{stopped} | "
            f"{results['seconds_per_epoch']:.1f} | {results['train_images_per_second']:.0f} | "
            f"{results['best_val_accuracy']:.4f} (epoch {results['best_epoch']}) | {results['test_accuracy']:.4f} |"
        )


if __name__ == "__main__":
    main(sys.argv[1:])
