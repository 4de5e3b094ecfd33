"""CIFAR-10 training with Hugging Face Accelerate: one plain PyTorch loop, in fp32, fp16 or bf16."""

import os
import sys

# A command run as a file (`accelerate launch cifar_accel/train.py`, as Accelerate's examples launch scripts) puts
# this folder first on sys.path, where evaluate.py would stand for the `evaluate` library: it is taken off again.
_PACKAGE_FOLDER = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [entry for entry in sys.path if os.path.abspath(entry or os.curdir) != _PACKAGE_FOLDER]

from cifar_accel.inference import TrainedModel, load_model  # noqa: E402 - after the sys.path repair above

__version__ = "0.1.0"
__all__ = ["TrainedModel", "load_model"]
