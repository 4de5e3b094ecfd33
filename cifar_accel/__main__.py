"""List the package's commands, each of which runs as a module of its own: `python -m cifar_accel.<command>`."""

from __future__ import annotations

import argparse
import ast
import shlex
from collections.abc import Sequence
from pathlib import Path

from cifar_accel.errors import ArgumentParser, InputError, exit_command, suggest

COMMANDS = ["train", "evaluate", "predict", "compare", "export"]


def summary(command: str) -> str:
    """The first line of the command's module docstring, read from its source (not imported: that takes seconds)."""
    source = (Path(__file__).parent / f"{command}.py").read_text()
    return ast.get_docstring(ast.parse(source)).splitlines()[0]


def build_parser() -> ArgumentParser:
    commands = "\n".join(f"  {command:<9} {summary(command)}" for command in COMMANDS)
    return ArgumentParser(
        prog="python -m cifar_accel",
        usage="python -m cifar_accel.COMMAND [flags], or accelerate launch -m cifar_accel.train [flags]",
        description=__doc__.splitlines()[0],
        epilog=f"commands (each takes --help):\n{commands}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def main(argv: Sequence[str]) -> None:
    parser = build_parser()
    _, rest = parser.parse_known_args(argv)
    if not rest:
        parser.print_help()
        return
    command = rest[0]
    if command.startswith("-"):  # a command's flag, without its command
        flag = command.split("=")[0]
        raise InputError(f"unknown argument '{flag}': flags follow a command, python -m cifar_accel.COMMAND {flag} ... "
                         "(see --help)")  # fmt: skip
    if command in COMMANDS:
        at = list(argv).index(command)  # the parser's own flags (--debug) take no value: this is the command word
        run_as = shlex.join(["python", "-m", f"cifar_accel.{command}", *argv[:at], *argv[at + 1 :]])
        raise InputError(f"each command is a module of its own: run {run_as}")
    commands = ", ".join(COMMANDS)
    raise InputError(f"'{command}' is not a command{suggest(command, COMMANDS)} (the commands: {commands}; see --help)")


if __name__ == "__main__":
    exit_command(main)
