#!/usr/bin/env bash
# The profile tables of docs/performance.md: the default recipe and the fast preset, in fp32 and bf16, each on
# 5,000 training images of the local CIFAR-10 copy, with --profile_steps. Usage: scripts/profile_presets.sh [DATA] [OUT]
set -euo pipefail
data=${1:-../shared/data/cifar10-jpeg}
out=${2:-outputs/profiles}
python=${PYTHON:-.venv/bin/python}
mkdir -p "$out"
common=(--dataset_name "$data" --max_train_samples 5000 --max_eval_samples 1000 --report_to none --overwrite_output_dir)
for precision in no bf16; do
  "$python" -m cifar_accel.train "${common[@]}" --mixed_precision "$precision" --num_train_epochs 1 \
    --profile_steps 20 --output_dir "$out/default_$precision" > "$out.default_$precision.log"
  "$python" -m cifar_accel.train "${common[@]}" --config fast --mixed_precision "$precision" --num_train_epochs 3 \
    --profile_steps 4 --output_dir "$out/fast_$precision" > "$out.fast_$precision.log"
done
for run in default_no default_bf16 fast_no fast_bf16; do
  echo; cat "$out/$run/profile/top_ops.md"
done
