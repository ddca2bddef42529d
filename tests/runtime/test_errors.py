"""One error path for every command (predictor_training/runtime/errors.py): a user's mistake ends the command with
one line `<prog>: error: ...` and exit code 2; PREDICTOR_DEBUG=1 shows the traceback instead; a bug keeps its
traceback; argparse errors and non-finite float flags go the same way."""

from __future__ import annotations

import errno
import os

import pytest

from predictor_training.runtime.errors import (
    DEBUG_ENV,
    USER_ERROR_EXIT,
    CommandParser,
    MissingFieldError,
    MissingFileError,
    UserInputError,
    command,
    debug_requested,
    describe_os_error,
    fail,
    one_line,
)


def test_one_line_folds_every_whitespace_run():
    assert one_line("a\n  b\t\tc \n") == "a b c"
    assert one_line(ValueError("x\ny")) == "x y"


def test_debug_is_requested_by_any_value_but_empty_or_zero(monkeypatch):
    monkeypatch.delenv(DEBUG_ENV, raising=False)
    assert not debug_requested()
    for value, requested in (("", False), (" ", False), ("0", False), ("1", True), ("yes", True)):
        monkeypatch.setenv(DEBUG_ENV, value)
        assert debug_requested() is requested, value


def test_fail_prints_one_line_and_exits_2(capsys):
    with pytest.raises(SystemExit) as exited:
        fail("tool.py", "bad value\n  for --x")
    assert exited.value.code == USER_ERROR_EXIT == 2
    out, err = capsys.readouterr()
    assert out == "" and err == "tool.py: error: bad value for --x\n"


def test_os_errors_about_a_path_are_described_and_others_are_not():
    missing = FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), "/data/x.pt")
    assert describe_os_error(missing) == "/data/x.pt: No such file or directory (expected an existing path)"
    denied = PermissionError(errno.EACCES, os.strerror(errno.EACCES), "/runs/a", None, "/runs/b")  # as os.rename
    assert describe_os_error(denied) == "/runs/a -> /runs/b: Permission denied (expected read/write permission)"
    exists = FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), "/runs/a")
    assert describe_os_error(exists) == "/runs/a: File exists"  # about the path, no expectation to add
    assert describe_os_error(OSError(errno.EIO, "Input/output error", "/dev/sda")) is None  # not about the path
    assert describe_os_error(OSError(errno.ENOENT, "No such file or directory")) is None  # names no path


def test_command_turns_user_errors_into_one_line_and_lets_bugs_through(monkeypatch, capsys):
    monkeypatch.delenv(DEBUG_ENV, raising=False)

    @command
    def main(what: str) -> int:
        if what == "user":
            raise UserInputError("--ckpt x.pt: holds NaN;\nexpected finite weights")
        if what == "path":
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), "/nowhere/table.jsonl")
        if what == "io":
            raise OSError(errno.EIO, "Input/output error", "/dev/sda")
        if what == "bug":
            raise RuntimeError("a bug")
        return 7

    assert main("fine") == 7
    with pytest.raises(SystemExit) as exited:
        main("user")
    assert exited.value.code == 2
    assert capsys.readouterr().err == "test_errors.py: error: --ckpt x.pt: holds NaN; expected finite weights\n"
    with pytest.raises(SystemExit):
        main("path")
    assert capsys.readouterr().err == ("test_errors.py: error: /nowhere/table.jsonl: No such file or directory "
                                       "(expected an existing path)\n")
    with pytest.raises(OSError, match="Input/output error"):
        main("io")
    with pytest.raises(RuntimeError, match="a bug"):
        main("bug")
    monkeypatch.setenv(DEBUG_ENV, "1")
    with pytest.raises(UserInputError, match="holds NaN"):
        main("user")
    with pytest.raises(FileNotFoundError):
        main("path")
    assert capsys.readouterr().err == ""


def test_missing_file_and_field_errors_are_user_errors_of_their_kind():
    assert isinstance(MissingFileError("x"), FileNotFoundError) and isinstance(MissingFileError("x"), UserInputError)
    field = MissingFieldError("config.json: missing field 'shift'")
    assert isinstance(field, KeyError) and isinstance(field, UserInputError)
    assert str(field) == "config.json: missing field 'shift'"  # KeyError would print it quoted


def test_the_parser_errs_in_one_line_and_refuses_non_finite_floats(capsys):
    parser = CommandParser(prog="tool.py")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--betas", type=float, nargs="+", default=[0.9])
    parser.add_argument("--steps", type=int, required=True)
    assert parser.parse_args(["--steps", "3", "--lr", "0.5"]).lr == 0.5
    for argv, message in ((["--lr", "0.1"], "the following arguments are required: --steps"),
                          (["--steps", "3", "--lr", "nan"], "--lr=nan: expected a finite number"),
                          (["--steps", "3", "--betas", "0.9", "inf"], "--betas=[0.9, inf]: expected a finite number")):
        with pytest.raises(SystemExit) as exited:
            parser.parse_args(argv)
        err = capsys.readouterr().err
        assert exited.value.code == 2 and err == f"tool.py: error: {message} (see --help)\n", (argv, err)


@pytest.mark.parametrize("bug", [ValueError("a bug"), KeyError("weights"), IndexError("3"), TypeError("None")])
def test_a_bug_of_any_built_in_type_keeps_its_traceback(bug, monkeypatch, capsys):
    """Only `UserInputError` (and its file / field kinds) is the user's mistake: a plain ValueError or KeyError that
    code raises is a bug, never a one-line usage error, with or without PREDICTOR_DEBUG."""
    monkeypatch.delenv(DEBUG_ENV, raising=False)

    @command
    def main() -> int:
        raise bug

    with pytest.raises(type(bug)) as raised:
        main()
    assert raised.value is bug and capsys.readouterr().err == ""


def test_only_user_errors_become_one_line(monkeypatch, capsys):
    """Each kind of user error, whatever built-in type it also is (a missing field is a KeyError too), ends with the
    one line and exit code 2; PREDICTOR_DEBUG=1 turns it back into its traceback."""
    monkeypatch.delenv(DEBUG_ENV, raising=False)
    for error in (UserInputError("--x 3: expected\n1 or 2"), MissingFieldError("config.json: no 'shift'"),
                  MissingFileError("table.jsonl: no such file")):
        @command
        def main() -> int:
            raise error

        with pytest.raises(SystemExit) as exited:
            main()
        assert exited.value.code == 2
        assert capsys.readouterr().err == f"test_errors.py: error: {one_line(error)}\n"
        monkeypatch.setenv(DEBUG_ENV, "1")
        with pytest.raises(type(error)):
            main()
        monkeypatch.delenv(DEBUG_ENV)
