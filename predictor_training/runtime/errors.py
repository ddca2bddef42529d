"""One error path for every command: a mistake in what the user gave (a flag, file, folder, checkpoint, table or
launcher variable) ends the command with one line on stderr and exit code 2, before anything is written.

    parser = CommandParser(description=__doc__)   # argparse whose errors are one line: "<prog>: error: <message>"

    @command                                      # UserInputError / a file-system error -> that one line, exit 2
    def main(argv=None) -> int:
        ...
        raise UserInputError(f"--ckpt {path}: holds NaN in 3 tensors; expected finite weights")

The line names the file, field or flag, what was found and what was expected. `PREDICTOR_DEBUG=1` in the
environment lets the error propagate with its traceback instead (for a bug report). Anything else (a bug) keeps
its traceback.
"""

from __future__ import annotations

import argparse
import errno
import functools
import math
import os
import sys
from pathlib import Path
from typing import Callable, NoReturn

DEBUG_ENV = "PREDICTOR_DEBUG"
USER_ERROR_EXIT = 2

# OS errors that say something about the path the user gave (not about the code): reported as one line.
_PATH_ERRNOS = frozenset({errno.ENOENT, errno.EACCES, errno.EPERM, errno.EROFS, errno.EISDIR, errno.ENOTDIR,
                          errno.EEXIST, errno.ENOSPC, errno.EDQUOT, errno.ENAMETOOLONG, errno.ENOTEMPTY})


class UserInputError(ValueError):
    """Something the user gave is wrong; the message is the one line the command ends with (it names the file,
    field or flag, what was found and what was expected)."""


class MissingFileError(UserInputError, FileNotFoundError):
    """A file or folder the user named (or one a manifest, table or config lists) does not exist."""


class MissingFieldError(UserInputError, KeyError):
    """A file (a config, manifest, table or checkpoint) lacks a field the command needs."""

    __str__ = ValueError.__str__  # KeyError's would quote the message


def one_line(text: object) -> str:
    """`text` with every run of whitespace (newlines included) as one space."""
    return " ".join(str(text).split())


def debug_requested() -> bool:
    """Whether `PREDICTOR_DEBUG` asks for tracebacks instead of one-line errors."""
    return os.environ.get(DEBUG_ENV, "").strip() not in ("", "0")


def fail(prog: str, message: object) -> NoReturn:
    """Print `<prog>: error: <message>` as one line on stderr and exit with code 2."""
    print(f"{prog}: error: {one_line(message)}", file=sys.stderr, flush=True)
    raise SystemExit(USER_ERROR_EXIT)


def describe_os_error(error: OSError) -> str | None:
    """One line for an OS error about a path ("<path>: Permission denied (expected ...)"), or None for one that
    names no path or is not about the path."""
    if error.filename is None or error.errno not in _PATH_ERRNOS:
        return None
    path = str(error.filename) + (f" -> {error.filename2}" if error.filename2 is not None else "")
    expected = {errno.ENOENT: "expected an existing path", errno.EACCES: "expected read/write permission",
                errno.EPERM: "expected read/write permission", errno.EROFS: "expected a writable file system",
                errno.ENOSPC: "expected free disk space", errno.EDQUOT: "expected free disk quota"}.get(error.errno)
    return f"{path}: {error.strerror}" + (f" ({expected})" if expected else "")


def program_name(function: Callable) -> str:
    """The file name of the script that defines `function` (what a user typed), else its module name."""
    module = sys.modules.get(function.__module__)
    file = getattr(module, "__file__", None)
    return Path(file).name if file else function.__module__


def command(main: Callable) -> Callable:
    """Wrap a command's `main(argv=None)`: a `UserInputError`, or an OS error about a path, ends it with one line
    and exit code 2 (unless `PREDICTOR_DEBUG` is set). Calls from tests see `SystemExit(2)`."""
    prog = program_name(main)

    @functools.wraps(main)
    def run(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except UserInputError as error:
            if debug_requested():
                raise
            fail(prog, error)
        except OSError as error:
            message = describe_os_error(error)
            if message is None or debug_requested():
                raise
            fail(prog, message)

    return run


class CommandParser(argparse.ArgumentParser):
    """argparse whose errors are one line, `<prog>: error: <message> (see --help)`, and exit code 2 (argparse's own
    prints the usage block first). A float flag given as nan or inf (which `float()` accepts) is refused. A flag
    group may `derive` a value from its flags, set on every parse (e.g. `args.plan`, recipes/flags.py)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.derived: list[tuple[str, Callable[[argparse.Namespace], object]]] = []

    def derive(self, name: str, value: Callable[[argparse.Namespace], object]) -> None:
        """After every parse, `args.<name> = value(args)`; a ValueError is a refusal of the flags (one line, exit
        2). The value is no flag: `run_directory.plain_flags` records the flags it comes from, not it."""
        self.derived.append((name, value))

    def parse_known_args(self, args=None, namespace=None):
        namespace, extras = super().parse_known_args(args, namespace)
        for action in self._actions:
            value = getattr(namespace, action.dest, None)
            values = value if isinstance(value, (list, tuple)) else [value]
            if action.option_strings and any(isinstance(item, float) and not math.isfinite(item) for item in values):
                self.error(f"{action.option_strings[0]}={value!r}: expected a finite number")
        for name, value in self.derived:
            try:
                setattr(namespace, name, value(namespace))
            except ValueError as error:
                self.error(str(error))
        return namespace, extras

    def error(self, message: str) -> NoReturn:
        self.exit(USER_ERROR_EXIT, f"{self.prog}: error: {one_line(message)} (see --help)\n")
