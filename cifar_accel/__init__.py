"""CIFAR-10 training with Hugging Face Accelerate: one plain PyTorch loop, in fp32, fp16 or bf16."""

import os
import sys
import types

# A command run as a file (`accelerate launch cifar_accel/train.py`, as Accelerate's examples launch scripts) puts
# this folder first on sys.path, where evaluate.py would stand for the `evaluate` library: it is taken off again.
_PACKAGE_FOLDER = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [entry for entry in sys.path if os.path.abspath(entry or os.curdir) != _PACKAGE_FOLDER]


def _interrupted_in_one_line(
    kind: type[BaseException], value: BaseException, traceback: types.TracebackType | None
) -> None:
    """Ctrl-C while a command still imports its libraries (seconds, before its own error handling runs): one line on
    stderr, as later, rather than Python's traceback; the exit status stays that of SIGINT."""
    if issubclass(kind, KeyboardInterrupt):
        sys.stderr.write("error: interrupted\n")
    else:
        sys.__excepthook__(kind, value, traceback)


# What follows is for python -m cifar_accel.<command> and the console scripts, not for a program that imports the
# package.
_MODULE = sys.orig_argv[sys.orig_argv.index("-m") + 1] if "-m" in sys.orig_argv[:-1] else ""
_SCRIPT = os.path.basename(sys.argv[0]) if sys.argv else ""
if _MODULE.startswith("cifar_accel."):
    # python -m puts the current folder first on sys.path, where a file of the user's (a script named datasets.py)
    # would stand for a library; the commands import nothing from it, as their console scripts show.
    sys.path[:] = [entry for entry in sys.path if os.path.abspath(entry or os.curdir) != os.getcwd()]
if (_MODULE.startswith("cifar_accel.") or _SCRIPT.startswith("cifar-accel-")) and "--debug" not in sys.argv:
    sys.excepthook = _interrupted_in_one_line

from cifar_accel.inference import TrainedModel, load_model  # noqa: E402 - after the sys.path repair above

__version__ = "0.1.0"
__all__ = ["TrainedModel", "load_model"]
