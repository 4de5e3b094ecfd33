"""Run the training CLI, saving this rank's weights right after the first validation to ``$RANK_WEIGHTS_DIR``.

Launched by torchrun in tests: each rank writes ``rank<N>.safetensors`` so the test can compare what every
process holds after one epoch (parameters, and BatchNorm buffers, which DDP broadcasts at each forward).
"""

import os

from safetensors.torch import save_file

from cifar_accel import train
from cifar_accel.bookkeeping import RunBookkeeper
from cifar_accel.errors import exit_command


class SaveEachRanksWeights(RunBookkeeper):
    def end_epoch(self, train, val):
        if self.state.epoch == 0:
            accelerator = self.run.accelerator
            model = accelerator.unwrap_model(self.run.model)
            weights = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
            name = f"rank{accelerator.process_index}.safetensors"
            save_file(weights, os.path.join(os.environ["RANK_WEIGHTS_DIR"], name))
        return super().end_epoch(train, val)


exit_command(lambda argv: train.main(argv, bookkeeper_type=SaveEachRanksWeights))
