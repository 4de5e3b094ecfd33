"""Graceful stop: SIGINT or SIGTERM asks the run to stop after the current optimizer step."""

from __future__ import annotations

import signal
from types import FrameType

import torch
from accelerate import Accelerator


class StopRequest:
    """Records SIGINT/SIGTERM instead of dying mid-step; a second SIGINT stops at once."""

    def __init__(self) -> None:
        self.signal_number = 0
        self._previous: dict[int, object] = {}

    def install(self) -> StopRequest:
        for number in (signal.SIGINT, signal.SIGTERM):
            self._previous[number] = signal.signal(number, self._record)
        return self

    def uninstall(self) -> None:
        """Put back the handlers that were there before ``install``."""
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        self._previous.clear()

    def _record(self, number: int, frame: FrameType | None) -> None:
        if number == signal.SIGINT and self.signal_number == signal.SIGINT:
            raise KeyboardInterrupt
        self.signal_number = number

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
