#!/usr/bin/env bash
# The GPU check in one go, for whenever a GPU is at hand (about 5 minutes on one recent GPU):
#  1. one epoch of the default recipe on the real CIFAR-10 in no, fp16 and bf16 (python -m cifar_accel.compare):
#     dtype report, seconds per epoch, images/s, peak GPU memory, skipped steps and the fp16 loss-scale trace
#     (loss_scale.png), written to OUT/report.md;
#  2. the clip-after-unscale test with Accelerate's own fp16 GradScaler (tests/test_precision.py, GPU case);
#  3. the AMP exercises (overflow, pure fp16, scaler resume) on the GPU;
#  4. the fast preset (--config fast: 9 epochs on all 50,000 training images, the first 5 on 28x28 windows) in bf16
#     and fp16: wall time, seconds per epoch, peak memory and test accuracy with and without TTA. On the lossless
#     CIFAR-10 (DATA=uoft-cs/cifar10) airbench94_muon, whose recipe it is, reaches 94% there, so the wall time is
#     the time to 94%; on the JPEG copy its CPU port reached 90.7-90.8% with TTA over seeds 0-2.
#
#   bash scripts/gpu_check.sh [DATA] [OUT] [extra cifar_accel.train flags...]
#   bash scripts/gpu_check.sh ../shared/data/cifar10-jpeg outputs/gpu_check
set -euo pipefail
data=${1:-../shared/data/cifar10-jpeg}
out=${2:-outputs/gpu_check}
shift $(($# < 2 ? $# : 2))
python=${PYTHON:-python}

if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
else
    echo "no nvidia-smi: this check is meant for a GPU machine; on a CPU fp16 is skipped and bf16 is slow"
fi
"$python" -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'GPU', torch.cuda.is_available())"

"$python" -m cifar_accel.compare --dataset_name "$data" --output_dir "$out" --num_train_epochs 1 \
    --logging_steps 20 --precisions no fp16 bf16 "$@"
"$python" -m pytest -q -n 0 tests/test_precision.py -k clipping -rs
"$python" scripts/amp_exercises.py all
for precision in bf16 fp16; do
    start=$(date +%s)
    "$python" -m cifar_accel.train --config fast --dataset_name "$data" --mixed_precision "$precision" \
        --output_dir "$out/fast_$precision" --overwrite_output_dir "$@"
    "$python" - "$out/fast_$precision/results.json" $(($(date +%s) - start)) <<'EOF'
import sys
from pathlib import Path
from cifar_accel.state import read_results
r = read_results(Path(sys.argv[1]))
print(f"fast preset, {r.mixed_precision}: test accuracy {r.test_accuracy:.4f} with {r.tta} TTA "
      f"({r.test_accuracy_no_tta:.4f} without), {sys.argv[2]} s wall, {r.seconds_per_epoch:.1f} s/epoch, "
      f"{r.train_images_per_second:.0f} images/s, peak {r.peak_memory_mib:.0f} MiB ({r.peak_memory_measure})")
EOF
done
echo "report: $out/report.md"
