#!/usr/bin/env bash
# The default recipe on the local CIFAR-10 copy, once per precision, then a table of the results.
#   bash scripts/train_full_recipe.sh [DATA] [PRECISIONS...]     e.g. bash scripts/train_full_recipe.sh ../shared/data/cifar10-jpeg no bf16
set -euo pipefail
data=${1:-../shared/data/cifar10-jpeg}
shift || true
if [ $# -gt 0 ]; then precisions=("$@"); else precisions=(no bf16); fi
runs=()
for precision in "${precisions[@]}"; do
    out=outputs/full_${precision}
    accelerate launch --config_file accelerate_configs/cpu.yaml -m cifar_accel.train \
        --dataset_name "$data" --output_dir "$out" --mixed_precision "$precision" --overwrite_output_dir
    runs+=("$out")
done
python scripts/summarize_runs.py "${runs[@]}"
