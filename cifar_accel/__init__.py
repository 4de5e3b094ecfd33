"""CIFAR-10 training with Hugging Face Accelerate: one plain PyTorch loop, in fp32, fp16 or bf16."""

import os
import sys

# The module that `python -m` runs, if any, and the console script, if any: what follows treats the commands apart
# from a program that imports the package.
_MODULE = sys.orig_argv[sys.orig_argv.index("-m") + 1] if "-m" in sys.orig_argv[:-1] else ""
_SCRIPT = os.path.basename(sys.argv[0]) if sys.argv else ""
_RUN_AS_MODULE = _MODULE.split(".")[0] == "cifar_accel"

# Folders that would stand for a library, taken off sys.path: this package's own, where evaluate.py is, which a
# command run as a file puts first (`accelerate launch cifar_accel/train.py`, as Accelerate's examples launch
# scripts); and under `python -m cifar_accel[.<command>]` the current folder, where a file of the user's (a script
# named datasets.py) may be; the commands import nothing from it, as their console scripts show.
_SHADOWING = {os.path.dirname(os.path.abspath(__file__))} | ({os.getcwd()} if _RUN_AS_MODULE else set())
sys.path[:] = [entry for entry in sys.path if os.path.abspath(entry or os.curdir) not in _SHADOWING]

if (_RUN_AS_MODULE or _SCRIPT.startswith("cifar-accel-")) and "--debug" not in sys.argv:
    from cifar_accel import errors

    errors.stop_at_once_while_importing()

from cifar_accel.inference import TrainedModel, load_model  # noqa: E402 - after the sys.path repair above

__version__ = "0.1.0"
__all__ = ["TrainedModel", "load_model"]
