"""Exit-code contract shared by the command-line entry points.

0 success; 2 bad input (config, flags, data, checkpoint); 1 a fault at run
time. Both failures print one line on stderr; ``--debug`` shows the traceback.
A run stopped by SIGINT, SIGTERM or SIGHUP exits with 130, 143 or 129 after saving a checkpoint, and one whose
stdout reader went away (``| head``) with 141, as SIGPIPE would.
"""

from __future__ import annotations

import argparse
import difflib
import gc
import io
import logging
import os
import platform
import re
import signal
import sys
import threading
import types
import typing
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NoReturn


class InputError(Exception):
    """Something the user gave us is wrong; the message says what and how to fix it."""


class Stopped(BaseException):
    """The run was stopped on request (SIGINT, SIGTERM, SIGHUP). Like KeyboardInterrupt it is not an error, so the
    ``except Exception`` around a decode or a file check cannot mistake it for one."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class RunFault(Exception):
    """A fault during the run whose message already says what happened and what to do (exit code 1)."""


def suggest(name: str, candidates: typing.Iterable[str]) -> str:
    """``; did you mean '...'?`` naming the candidate closest to ``name``, or '' where none is close."""
    close = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return f"; did you mean '{close[0]}'?" if close else ""


def versions() -> dict[str, str]:
    """The versions of this package, Python and the libraries a run's numbers depend on (torch's with its build, as
    ``+cu130``), as results.json records them and ``--version`` prints them."""
    import accelerate  # imported by every command already; here rather than at the top, which stays light
    import datasets
    import evaluate
    import torch

    from cifar_accel import __version__

    return {
        "cifar_accel": __version__,
        "python": platform.python_version(),
        **{module.__name__: module.__version__ for module in (torch, accelerate, datasets, evaluate)},
    }


class PrintVersions(argparse.Action):
    """``--version``: the versions, on one line, and exit."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: typing.Any) -> None:
        kwargs.pop("default", None)  # a parser's argument_default; this flag takes no value
        super().__init__(option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, nargs=0, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *args: typing.Any) -> NoReturn:
        first, *others = (f"{name} {version}" for name, version in versions().items())
        print(f"{first} ({', '.join(others)})")
        parser.exit()


class AddUp(argparse.Action):
    """A list flag (``nargs="+"``) whose values add up when it is given again, where argparse keeps only the last
    list: ``--seeds 0 1 --seeds 2`` is seeds 0, 1 and 2. The default stands until the flag is given."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: typing.Any, _=None):
        earlier = getattr(namespace, self.dest)
        setattr(namespace, self.dest, [*([] if earlier is self.default else earlier), *values])


class ArgumentParser(argparse.ArgumentParser):
    """argparse that reports bad flags as an InputError (one line, exit code 2) instead of printing usage, and an
    unknown flag with the one it was probably meant to be; every command takes ``--version``, and ``--debug``, which
    ``run_cli`` reads."""

    def __init__(self, *args: typing.Any, **kwargs: typing.Any) -> None:
        super().__init__(*args, **kwargs)
        self.add_argument(
            "--version",
            action=PrintVersions,
            help="Print the versions of cifar_accel, Python and the libraries it runs on, and exit.",
        )
        self.add_argument("--debug", action="store_true", help="Show tracebacks on errors.")

    def error(self, message: str) -> NoReturn:
        raise InputError(f"{message} (see --help)")

    def parse_args(self, args: Sequence[str] | None = None, namespace: typing.Any = None) -> argparse.Namespace:
        parsed, unknown = self.parse_known_args(args, namespace)
        if any(not word.startswith("-") for word in unknown) and self._get_positional_actions():
            # Values after a flag that ends a list of positional ones (predict's images): parse them intermixed, as
            # a shell user writes them (cat.png --top_k 1 dog.png).
            parsed, unknown = self.parse_known_intermixed_args(args, namespace)
        if unknown:
            raise InputError(self.unknown_argument(unknown))
        return parsed

    def unknown_argument(self, unknown: list[str], advice: Callable[[str], str] = lambda word: "") -> str:
        """The line for the first unknown flag in ``unknown`` (else its first value that no flag took): the flag it
        was probably meant to be, else ``advice`` for it, else a pointer to --help."""
        word = next((u for u in unknown if u.startswith("-")), unknown[0])
        options = [option for action in self._actions for option in action.option_strings]
        flag = word.split("=")[0] if word.startswith("-") else word  # not its value: --hub_tokn=hf_... is a secret
        return f"unknown argument '{flag}'" + (suggest(flag, options) or advice(word) or " (see --help)")


def counted(count: int, noun: str, plural: str | None = None) -> str:
    """``count`` and ``noun``, in the plural (``noun`` + 's' unless given) but for a count of one: '1 epoch',
    '2 epochs', '4 processes'."""
    return f"{count} {noun if count == 1 else plural or noun + 's'}"


def first_ones(items: Sequence[str], most: int) -> str:
    """The first ``most`` of ``items``, joined by commas, then '...' where there are more: 'a, b, c, ...'."""
    return ", ".join(items[:most]) + (", ..." if len(items) > most else "")


def non_empty(value: str) -> str:
    """An argparse type for names and paths: an empty value (a shell variable that was not set) is refused rather
    than read as 'the default' or as the current folder."""
    if not value.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return value


NAME_MAX, PATH_MAX = 255, 4096  # bytes: Linux's file systems' limit on one name, and the kernel's on a path


def path_problem(path: str, text: bool = True) -> str | None:
    """What makes ``path`` unusable as a run's path, with what to do instead; None where nothing does. A path too
    long for the file system fails every file call with 'File name too long'. A name that is not UTF-8 text, which
    Linux allows (a folder copied from an older system), cannot be written into the files that record a run's
    paths (config.yaml, the JSON files), nor opened by safetensors or datasets; ``text=False`` lets it pass."""
    if text and (problem := not_text(path)):
        return problem
    if problem := too_long(path):
        return f"{problem}; use a shorter one"
    return link_to_nothing(path)


def link_to_nothing(path: str) -> str | None:
    """Why ``path`` leads nowhere through a symbolic link, itself or a folder above it (whose target is missing, or
    links back in a loop), where every file call on it would fail (a loop even as a RuntimeError of pathlib's);
    None where no link of it does."""
    for link in (Path(path), *Path(path).parents):
        if link.is_symlink() and not link.exists():
            return (
                f"goes through the symbolic link '{link}' -> '{os.readlink(link)}', which leads to nothing (its "
                "target is missing, or the links loop); fix the link, or use another path"
            )
    return None


def not_text(path: str) -> str | None:
    """Why ``path`` cannot be written as UTF-8 text; None where it can."""
    for name in path.split("/"):
        try:
            name.encode("utf-8")
        except UnicodeEncodeError:  # bytes that the file system encoding could not read, kept as surrogates
            raw = os.fsencode(name)
            try:
                return (
                    f"holds a name ('{raw.decode('utf-8')}') that Python reads as {sys.getfilesystemencoding()} here; "
                    "set PYTHONUTF8=1 or a UTF-8 locale (LANG=C.UTF-8)"
                )
            except UnicodeDecodeError:
                return f"holds a name that is not UTF-8 text ('{raw.decode('utf-8', 'backslashreplace')}'); rename it"
    return None


def too_long(path: str) -> str | None:
    """Why ``path`` is too long to be a path here, where every file call on it would fail with 'File name too
    long'; None where it is not."""
    encoded = os.fsencode(os.path.abspath(path))
    if len(encoded) >= PATH_MAX:
        return f"is {len(encoded)} bytes long as an absolute path, more than the {PATH_MAX - 1} a path may have"
    longest = max(encoded.split(b"/"), key=len)
    if len(longest) > NAME_MAX:
        name = os.fsdecode(longest)
        return (
            f"holds a name of {len(longest)} bytes ('{name[:24]}...'), more than the {NAME_MAX} a file or folder "
            "name may have"
        )
    return None


def user_path(value: str) -> str:
    """An argparse type for paths (and dataset names, which may be paths): ``non_empty``, with a leading ~ expanded
    as the shell would have, had it not been in ``--flag=~/...``, in quotes or in a config file, and without a
    ``path_problem``."""
    return _checked_path(value, text=True)


def image_path(value: str) -> str:
    """``user_path`` for the images ``predict`` only reads and names: PIL opens a name of any bytes, and the output
    shows it (see ``Stdout``); too long a path is still refused."""
    return _checked_path(value, text=False)


def _checked_path(value: str, text: bool) -> str:
    path = os.path.expanduser(non_empty(value))
    if problem := path_problem(path, text):
        raise argparse.ArgumentTypeError(f"the path {problem}")
    return path


def int_at_least(least: int) -> Callable[[str], int]:
    """An argparse type for whole numbers of at least ``least``."""

    def parse(value: str) -> int:
        try:
            number = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid int value: '{value}'") from None
        if number < least:
            raise argparse.ArgumentTypeError(f"must be at least {least}, not {number}")
        return number

    return parse


positive_int = int_at_least(1)  # counts


MAX_ERROR_CHARACTERS = 2000


def one_line(message: object) -> str:
    """``message`` as a single line, whatever characters it holds, cut to ``MAX_ERROR_CHARACTERS``."""
    line = " ".join(str(message).splitlines())
    return line if len(line) <= MAX_ERROR_CHARACTERS else line[:MAX_ERROR_CHARACTERS] + "..."


class _StdoutHandler(logging.Handler):
    """Writes to whatever ``sys.stdout`` is at the time."""

    def emit(self, record: logging.LogRecord) -> None:
        print(self.format(record), file=sys.stdout)


def keep_stderr_for_errors() -> None:
    """Send what libraries would print on stderr to stdout instead: Python warnings (torch's, PIL's, ...) as
    log lines, and the log handlers that `datasets`, `evaluate`, `huggingface_hub` and torch (its compiler's
    warnings) install for themselves."""
    logging.captureWarnings(True)
    warnings_logger = logging.getLogger("py.warnings")
    if not any(isinstance(h, _StdoutHandler) for h in warnings_logger.handlers):
        warnings_logger.addHandler(_StdoutHandler())
        warnings_logger.propagate = False
    libraries = ("datasets", "evaluate", "huggingface_hub", "torch")
    for name in [n for n in logging.root.manager.loggerDict if n.split(".")[0] in libraries]:
        logger = logging.getLogger(name)
        for handler in [h for h in logger.handlers if getattr(h, "stream", None) is sys.stderr]:
            replacement = _StdoutHandler(handler.level)  # the same lines, in the library's format, on stdout
            replacement.setFormatter(handler.formatter)
            logger.removeHandler(handler)
            logger.addHandler(replacement)
            logger.propagate = False  # printed once, by its own handler, not again by the command's (basicConfig)


def report_thread_failure(args: threading.ExceptHookArgs) -> None:
    """A background thread's exception (TensorBoard's event writer on a full disk) as one log line on stdout,
    not a traceback on stderr: the writer raises it again in the main thread, where it becomes the one error
    line of the exit-code contract."""
    name = args.exc_type.__name__ if args.exc_type else "error"
    print(f"background thread {args.thread.name if args.thread else '?'} failed: {name}: {one_line(args.exc_value)}")


class Stdout:
    """``sys.stdout`` of a command, which outlives its reader. When the reader goes away (``| head``), the rest goes
    to /dev/null (file descriptor 1 is pointed there, as the Python docs advise for a BrokenPipeError) and
    ``on_reader_gone`` is called once: a training run then stops as SIGPIPE would, with a checkpoint (see
    ``StopRequest``); the other commands finish quietly. A character the stream's encoding cannot hold (a path that
    is not UTF-8, a class name outside ASCII under ``PYTHONIOENCODING=ascii``) is written as a backslash escape, as
    Python writes it on stderr, where a strict stream would fail the write."""

    def __init__(self, stream: typing.TextIO) -> None:
        if isinstance(stream, io.TextIOWrapper) and stream.errors == "strict":
            stream.reconfigure(errors="backslashreplace")
        self.stream, self.reader_gone = stream, False
        self.on_reader_gone: Callable[[], None] = lambda: None
        self.failure: RunFault | None = None  # a write that failed otherwise (a full disk), reported at the end

    def write(self, text: str) -> int:
        try:
            return self.stream.write(text)
        except BrokenPipeError:
            self._went_away()
            return len(text)
        except OSError as err:
            raise self._failed(err) from None

    def flush(self) -> None:
        try:
            self.stream.flush()
        except BrokenPipeError:
            self._went_away()
        except OSError as err:
            raise self._failed(err) from None

    def _failed(self, err: OSError) -> RunFault:
        """A write that failed for another reason than a reader gone (a full disk where the output goes), raised to
        the writer and kept for ``run_cli``: a log call's handler would print it as a traceback, so the logging
        module is told to stop printing its own failures."""
        logging.raiseExceptions = False
        self.failure = self.failure or RunFault(
            f"writing to standard output failed ({err.strerror or err}); free space where it goes, or send it elsewhere"
        )
        return self.failure

    def __getattr__(self, name: str) -> typing.Any:  # isatty, fileno, encoding, ...
        return getattr(self.stream, name)

    def _went_away(self) -> None:
        if not self.reader_gone:
            self.reader_gone = True
            os.dup2(os.open(os.devnull, os.O_WRONLY), self.stream.fileno())
            self.on_reader_gone()


def run_cli(main: Callable[[Sequence[str]], None], argv: Sequence[str] | None = None) -> int:
    """Run ``main(argv)`` with ``sys.stdout`` a ``Stdout``, and turn exceptions into the exit-code contract: one
    line on stderr for a failure, with at most ``MAX_ERROR_CHARACTERS`` characters."""
    open_closed_std_streams()
    stdout, raise_exceptions = sys.stdout, logging.raiseExceptions
    sys.stdout = ours = Stdout(stdout)
    try:
        code = _exit_code(main, argv)
        if code == 0 and ours.failure is not None:  # seen only by a log call, which kept it to itself
            print_error(f"error: {one_line(ours.failure)}")
            return 1
        return code
    finally:
        sys.stdout, logging.raiseExceptions = stdout, raise_exceptions


def exit_command(main: Callable[[Sequence[str]], None]) -> NoReturn:
    """A command's process: ``run_cli(main)``, then exit with its code. The objects left at the end (torch's and
    its compiler's, hundreds of thousands) are frozen out of the garbage collections that Python's shutdown runs,
    which took a second of every command's exit on a 2-core Zen 4 and would collect nothing the command still
    needed: its files are closed and its trackers ended by then."""
    code = run_cli(main)
    gc.freeze()
    sys.exit(code)


def open_closed_std_streams() -> None:
    """Point a standard output or error that the command was started without (``>&-``) at /dev/null, as daemons
    do: Python would leave ``sys.stdout`` None, which every log line would fail on with a traceback on stderr, and
    the first file the command opens would take its descriptor, where a C library's output would then land."""
    for fd, name in ((1, "stdout"), (2, "stderr")):
        try:
            os.fstat(fd)
        except OSError:
            null = os.open(os.devnull, os.O_WRONLY)
            if null != fd:
                os.dup2(null, fd)
                os.close(null)
            setattr(sys, name, open(fd, "w", closefd=False))  # open as long as the process runs


def print_error(line: str) -> None:
    """``line`` on stderr in one write: processes that fail together (the ranks of one run, sharing the launcher's
    stderr) then never run their lines together, as print's separate write of the newline let them."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def stop_at_once_while_importing() -> None:
    """Ctrl-C in the seconds a command spends importing torch and the rest, before its own handling below runs:
    one line and the exit status of SIGINT, at once. A KeyboardInterrupt raised there printed the import's
    traceback, or aborted the process when it landed in a C++ extension's initialisation (pybind11 cannot carry
    it out). Where SIGINT is ignored (``nohup``, a shell's background job) it stays ignored."""
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _interrupted_while_importing)


def _interrupted_while_importing(number: int, frame: types.FrameType | None) -> None:
    print_error("error: interrupted")
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGINT)


def _exit_code(main: Callable[[Sequence[str]], None], argv: Sequence[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if signal.getsignal(signal.SIGINT) is _interrupted_while_importing:  # imported: Ctrl-C raises, caught below
        signal.signal(signal.SIGINT, signal.default_int_handler)
    keep_stderr_for_errors()
    debug = "--debug" in argv
    if not debug:
        threading.excepthook = report_thread_failure
    try:
        main(argv)
    except InputError as err:
        if debug:
            raise
        print_error(f"error: {one_line(err)}")
        return 2
    except RunFault as err:
        if debug:
            raise
        print_error(f"error: {one_line(err)}")
        return 1
    except Stopped as stop:
        print_error(one_line(stop))
        return stop.exit_code
    except KeyboardInterrupt:
        if debug:
            raise
        print_error("error: interrupted")
        return 130
    except Exception as err:  # noqa: BLE001 - every other fault is a run-time fault
        if debug:
            raise
        if (problem := environment_problem(err)) is not None:
            print_error(f"error: {problem}")
            return 2
        print_error(f"error: {type(err).__name__}: {one_line(err)} (rerun with --debug for the traceback)")
        return 1
    return 0


TRUTH_VALUE_ERROR = re.compile(r"invalid truth value (.*)")  # accelerate.utils.str_to_bool's ValueError
NUMBER_ERROR = re.compile(r"invalid literal for int\(\) with base 10: '(.*)'")
RENDEZVOUS_ERROR = re.compile(r".*env:// rendezvous: environment variable (\w+) expected, but not set")  # torch's
# The whole numbers a launcher (torchrun, accelerate launch, srun through them) sets for each process it starts.
LAUNCHER_NUMBERS = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "MASTER_PORT")


def environment_problem(err: Exception) -> str | None:
    """The line for a ValueError that an environment variable caused, naming it: one that Accelerate reads as
    true or false (set by hand, or by a launcher profile) holding something else, one of a launcher's numbers
    that is not a whole number, or a launcher's variables set in part (LOCAL_RANK alone makes Accelerate join the
    processes through torch's rendezvous, which needs the others); else None."""
    if not isinstance(err, ValueError):
        return None
    if match := TRUTH_VALUE_ERROR.fullmatch(str(err)):
        settings = [f"{name} is {value!r}" for name, value in sorted(os.environ.items()) if value.lower() == match[1]]
        return (
            f"{' and '.join(settings) or f'an environment variable is {match[1]!r}'}, which Accelerate reads as true "
            "or false; set it to true or false (1 or 0), or unset it"
        )
    if match := NUMBER_ERROR.fullmatch(str(err)):
        settings = [f"{name} is {os.environ[name]!r}" for name in LAUNCHER_NUMBERS if os.environ.get(name) == match[1]]
        if settings:
            return (
                f"{' and '.join(settings)}, where a launcher (torchrun, accelerate launch) puts a whole number; unset "
                "it, or start the command through the launcher"
            )
    if match := RENDEZVOUS_ERROR.fullmatch(str(err)):
        present = [name for name in (*LAUNCHER_NUMBERS, "MASTER_ADDR") if name in os.environ]
        settings = [f"{name} is {os.environ[name]!r}" for name in present]
        return (
            f"{' and '.join(settings)} but {match[1]} is not set, which torch.distributed needs to join the processes "
            "(a launcher, torchrun or accelerate launch, sets them all); unset them, or start the command through the "
            "launcher"
        )
    return None
