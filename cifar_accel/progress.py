"""Progress on stdout: tqdm's live bar on a terminal, and off a terminal (a batch job, ``make train > log``) one
plain line each time another tenth of the work is done, so a log file holds ten lines an epoch instead of a
carriage-return update per batch. ``TQDM_DISABLE=1`` turns both off."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any

from tqdm.auto import tqdm

LINES_PER_TASK = 10  # off a terminal: one line per tenth of an epoch (or of a decoding)


class LineProgress:
    """The part of tqdm's interface the package uses (iterate, ``update``, ``close``), writing ``desc: done/total unit
    (percent), seconds`` on stdout whenever another tenth of ``total`` is done."""

    def __init__(self, iterable: Iterable | None, total: int | None, desc: str, unit: str) -> None:
        self.iterable, self.desc, self.unit = iterable, desc, unit
        self.total = len(iterable) if total is None and hasattr(iterable, "__len__") else total
        self.done = self.tenths = 0
        self.start = time.perf_counter()

    def __iter__(self) -> Iterator[Any]:
        for item in self.iterable:
            yield item
            self.update(1)

    def update(self, count: int) -> None:
        self.done += count
        if not self.total:
            return
        tenths = min(LINES_PER_TASK, self.done * LINES_PER_TASK // self.total)
        if tenths > self.tenths:
            self.tenths = tenths
            seconds = time.perf_counter() - self.start
            print(
                f"{self.desc}: {self.done}/{self.total}{self.unit} ({100 * self.done // self.total}%), {seconds:.0f} s",
                file=sys.stdout,
                flush=True,
            )

    def close(self) -> None:
        """Nothing to clear: each line stays in the log."""


def progress(
    iterable: Iterable | None = None, *, desc: str, unit: str = " batches", total: int | None = None, show: bool = True
) -> Any:
    """A progress display for ``iterable`` (or for ``update`` calls up to ``total``): tqdm's bar on a terminal,
    ``LineProgress`` off one, nothing where ``show`` is False (other processes) or TQDM_DISABLE is set."""
    if not show or os.environ.get("TQDM_DISABLE", "").lower() in ("1", "true"):
        return tqdm(iterable, total=total, disable=True)
    if sys.stdout.isatty():
        # disable=False: tqdm's own default read TQDM_DISABLE once, at import; the check above reads it now
        return tqdm(
            iterable, total=total, desc=desc, unit=unit.strip() or "it", leave=False, file=sys.stdout, disable=False
        )
    return LineProgress(iterable, total, desc, unit)
