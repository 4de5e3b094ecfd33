"""Stopping on request: SIGINT, SIGTERM or SIGHUP (the terminal closed; not under ``nohup``, which ignores it),
whenever it arrives, or the reader of stdout going away (``| head``), taken as SIGPIPE.

While a run is being set up (loading and decoding data, building the model) nothing of it is written yet, so a
signal stops it at once. Once it writes, a signal is recorded instead and the run stops at the next safe point:
after the current optimizer step with a checkpoint, or, where that step was the run's last, after the final test
and export. The first signal names the stop; a second SIGINT stops at once.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from types import FrameType

import torch
from accelerate import Accelerator

from cifar_accel.errors import Stdout, Stopped

STOP_WITH_PARENT = "CIFAR_ACCEL_STOP_WITH_PARENT"  # the pid of the command that started a run
PR_SET_PDEATHSIG = 1  # prctl(2)
LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None  # loaded before any fork


def term_when_parent_ends(parent: int) -> None:
    """Ask the kernel for SIGTERM to this process when its parent, pid ``parent``, ends, however it ends (SIGKILL
    too). Linux only (prctl); elsewhere nothing."""
    if LIBC is None:
        return
    LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:  # it ended before the request was made
        os.kill(os.getpid(), signal.SIGTERM)


def stop_with_parent() -> None:
    """A run that compare or scripts/side_by_side.py started (STOP_WITH_PARENT names it) stops at a checkpoint when
    its parent ends, instead of training on unseen: that command itself, or the launcher between them, which the
    command's end ends."""
    starter = os.environ.pop(STOP_WITH_PARENT, None)
    if starter is None or LIBC is None:
        return
    term_when_parent_ends(os.getppid())
    try:
        os.kill(int(starter), 0)
    except ProcessLookupError:  # it ended before the request was made
        os.kill(os.getpid(), signal.SIGTERM)
    except PermissionError:  # its pid is another user's process now, which cannot be told from it: taken as running
        pass


def stop_signals() -> list[int]:
    """The signals taken as a request to stop: SIGINT, SIGTERM, and SIGHUP unless this process ignores it."""
    hangup = [] if signal.getsignal(signal.SIGHUP) is signal.SIG_IGN else [signal.SIGHUP]
    return [signal.SIGINT, signal.SIGTERM, *hangup]


class StopRequest:
    """SIGINT/SIGTERM/SIGHUP handling for one run; use it as a context manager around the run."""

    def __init__(self) -> None:
        self.signal_number = 0
        self.immediate = True  # until ``defer``: stop at once
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopRequest:
        for number in stop_signals():
            self._previous[number] = signal.signal(number, self._record)
        if isinstance(sys.stdout, Stdout):
            sys.stdout.on_reader_gone = self._reader_gone
        stop_with_parent()
        return self

    def __exit__(self, *exc_info: object) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        self._previous.clear()
        if isinstance(sys.stdout, Stdout):
            sys.stdout.on_reader_gone = lambda: None

    def defer(self) -> None:
        """From now on a signal is recorded and honoured at the next safe point (``requested``). A reader of stdout
        that went away during the set-up stops the run here, before its first write."""
        if self.signal_number:
            raise Stopped(
                f"stopped by {self.name} before training started; nothing of the run was written", self.exit_code
            )
        self.immediate = False

    def _reader_gone(self) -> None:
        """Recorded, never raised: it is called from inside a write to stdout (a log line), whose handler would
        print the exception instead of passing it on."""
        self.signal_number = self.signal_number or signal.SIGPIPE

    def _record(self, number: int, frame: FrameType | None) -> None:
        if self.immediate:
            self.signal_number = number
            raise Stopped(
                f"stopped by {self.name} before training started; nothing of the run was written", self.exit_code
            )
        if number == signal.SIGINT and self.signal_number == signal.SIGINT:
            raise KeyboardInterrupt
        # The first request names the stop: `accelerate launch` passes a Ctrl-C, which reached the run too, on as
        # SIGTERM.
        self.signal_number = self.signal_number or number

    def requested(self, accelerator: Accelerator) -> bool:
        """Whether any process was asked to stop, agreed by all processes so they stop at the same step."""
        if accelerator.num_processes > 1:
            flag = accelerator.reduce(torch.tensor(self.signal_number, device=accelerator.device), reduction="max")
            self.signal_number = int(flag)
        return self.signal_number != 0

    @property
    def exit_code(self) -> int:
        return 128 + self.signal_number

    @property
    def name(self) -> str:
        return signal.Signals(self.signal_number).name
