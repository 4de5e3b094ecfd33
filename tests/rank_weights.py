"""Run the training CLI, saving this rank's weights right after the first validation to ``$RANK_WEIGHTS_DIR``.

Launched by torchrun in tests: each rank writes ``rank<N>.safetensors`` so the test can compare what every
process holds after one epoch (parameters, and BatchNorm buffers, which DDP broadcasts at each forward).
"""

import os
import sys

from safetensors.torch import save_file

from cifar_accel import train

evaluate_model = train.evaluate_model
saved = []


def evaluate_and_save_weights(accelerator, model, *args, **kwargs):
    stats = evaluate_model(accelerator, model, *args, **kwargs)
    if not saved:
        weights = {k: v.detach().clone().contiguous() for k, v in accelerator.unwrap_model(model).state_dict().items()}
        save_file(weights, os.path.join(os.environ["RANK_WEIGHTS_DIR"], f"rank{accelerator.process_index}.safetensors"))
        saved.append(True)
    return stats


train.evaluate_model = evaluate_and_save_weights
sys.exit(train.run_cli(train.main))
