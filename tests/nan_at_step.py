"""Run the training CLI with the inputs of batch ``$NAN_AT_BATCH`` (counted from 1) turned into NaN.

Launched in a subprocess by tests, standing in for a batch whose loss goes non-finite (bad data, an overflow).
"""

import os
import sys

from cifar_accel import engine, train

training_step = engine.training_step
poisoned_batch = int(os.environ["NAN_AT_BATCH"])
batches = 0


def training_step_with_a_nan_batch(accelerator, model, optimizer, loss_fn, inputs, *args, **kwargs):
    global batches
    batches += 1
    if batches == poisoned_batch:
        inputs = inputs * float("nan")
    return training_step(accelerator, model, optimizer, loss_fn, inputs, *args, **kwargs)


engine.training_step = training_step_with_a_nan_batch
sys.exit(train.run_cli(train.main))
