"""Exit-code contract shared by the command-line entry points.

0 success; 2 bad input (config, flags, data, checkpoint); 1 a fault at run
time. Both failures print one line on stderr; ``--debug`` shows the traceback.
A run stopped by SIGINT or SIGTERM exits with 130 or 143 after saving a checkpoint.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn


class InputError(Exception):
    """Something the user gave us is wrong; the message says what and how to fix it."""


class Stopped(Exception):
    """The run was stopped on request (SIGINT, SIGTERM) after saving a checkpoint."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class RunFault(Exception):
    """A fault during the run whose message already says what happened and what to do (exit code 1)."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse that reports bad flags as an InputError (one line, exit code 2) instead of printing usage."""

    def error(self, message: str) -> NoReturn:
        raise InputError(f"{message} (see --help)")


def one_line(message: object) -> str:
    """``message`` as a single line, whatever characters it holds."""
    return " ".join(str(message).splitlines())


def run_cli(main: Callable[[Sequence[str]], None], argv: Sequence[str] | None = None) -> int:
    """Run ``main(argv)`` and turn exceptions into the exit-code contract."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    try:
        main(argv)
    except InputError as err:
        if debug:
            raise
        print(f"error: {one_line(err)}", file=sys.stderr)
        return 2
    except RunFault as err:
        if debug:
            raise
        print(f"error: {one_line(err)}", file=sys.stderr)
        return 1
    except Stopped as stop:
        print(one_line(stop), file=sys.stderr)
        return stop.exit_code
    except KeyboardInterrupt:
        if debug:
            raise
        print("error: interrupted", file=sys.stderr)
        return 130
    except Exception as err:  # noqa: BLE001 - every other fault is a run-time fault
        if debug:
            raise
        print(f"error: {type(err).__name__}: {one_line(err)} (rerun with --debug for the traceback)", file=sys.stderr)
        return 1
    return 0
