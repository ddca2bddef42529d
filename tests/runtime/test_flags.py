"""The command-line machinery (predictor_training/runtime/flags.py): the checked value parsers, the precedence
defaults < --preset < --config < command line, and the single-flag and cross-flag rules.

Every recipe's own parser is checked against these rules case by case in tests/recipes/test_bad_input.py."""

from __future__ import annotations

import argparse
import math

import pytest

from predictor_training.runtime.errors import CommandParser
from predictor_training.runtime.flags import (
    CLIP_OR_OFF, UNIT_INTERVAL, at_least, check_args, parse_recipe_args, positive,
)
from predictor_training.recipes.flags import parse_pairs


def refused(parse, text: str) -> str:
    with pytest.raises(argparse.ArgumentTypeError) as error:
        parse(text)
    return str(error.value)


def test_checked_parsers_accept_their_range_and_name_what_they_expected():
    steps = at_least(int, 1)
    assert steps("1") == 1 and steps.__name__ == "int" and steps.expected == ">= 1"
    assert refused(steps, "0") == "expected >= 1, got 0"
    assert refused(at_least(float, 0.5, " (a half at least)"), "0.25") == "expected >= 0.5 (a half at least), got 0.25"
    assert positive()("1e-9") == 1e-9
    for text in ("0", "-1", "nan"):  # NaN fails every comparison, so it is refused too
        assert refused(positive(), text) == f"expected > 0, got {text}"
    assert UNIT_INTERVAL("0") == 0.0 and UNIT_INTERVAL("0.999") == 0.999
    assert refused(UNIT_INTERVAL, "1") == "expected in [0, 1), got 1"
    assert CLIP_OR_OFF("-1") == -1.0 and CLIP_OR_OFF("0.5") == 0.5
    assert refused(CLIP_OR_OFF, "0") == "expected > 0, or -1, got 0"
    assert not positive().ok(math.nan) and positive().ok(2.0)


def test_argparse_names_the_flag_of_a_refused_value(capsys):
    parser = argparse.ArgumentParser(prog="tool.py")
    parser.add_argument("--r1_every", type=at_least(int, 1))
    with pytest.raises(SystemExit):
        parser.parse_args(["--r1_every", "0"])
    assert "argument --r1_every: expected >= 1, got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parser.parse_args(["--r1_every", "x"])
    assert "argument --r1_every: invalid int value: 'x'" in capsys.readouterr().err


def toy_parser() -> CommandParser:
    parser = CommandParser(prog="toy.py")
    parser.add_argument("--lr", type=positive(), default=1.0)
    parser.add_argument("--max_steps", type=int, default=10)
    parser.add_argument("--fast_path", action="store_true")
    parser.add_argument("--shuffle", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--pairs", type=parse_pairs, default=((0, 1),))
    return parser


PRESETS = {"quick": ["--max_steps", "2", "--lr", "0.5"]}


def test_defaults_then_preset_then_config_then_the_command_line(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("lr: 0.25\nfast_path: true\nshuffle: false\npairs: [0-1, 1-2]\n")
    parse = lambda *argv: parse_recipe_args(toy_parser(), list(argv), PRESETS)  # noqa: E731
    plain = parse()
    assert (plain.lr, plain.max_steps, plain.fast_path, plain.shuffle, plain.preset) == (1.0, 10, False, True, None)
    quick = parse("--preset", "quick")
    assert (quick.lr, quick.max_steps) == (0.5, 2)
    configured = parse("--preset", "quick", "--config", str(config))
    assert (configured.lr, configured.max_steps, configured.fast_path, configured.shuffle) == (0.25, 2, True, False)
    assert configured.pairs == ((0, 1), (1, 2))  # a YAML list goes through the flag's own parser
    explicit = parse("--lr", "0.125", "--config", str(config), "--preset", "quick", "--shuffle")
    assert (explicit.lr, explicit.max_steps, explicit.shuffle) == (0.125, 2, True)


@pytest.mark.parametrize("text, message", [
    ("max_step: 3\n", "unknown flag 'max_step'; did you mean 'max_steps'?"),
    ("fast_path: 1\n", "fast_path=1; expected true or false"),
    ("lr: 0\n", "argument --lr: expected > 0, got 0"),
    ("- lr\n", "expected a mapping of flag names to values, got list"),
])
def test_a_bad_config_file_is_one_line(tmp_path, capsys, text, message):
    config = tmp_path / "run.yaml"
    config.write_text(text)
    with pytest.raises(SystemExit) as exited:
        parse_recipe_args(toy_parser(), ["--config", str(config)], PRESETS)
    err = capsys.readouterr().err
    assert exited.value.code == 2 and len(err.splitlines()) == 1 and message in err, err


def test_flag_rules_and_cross_flag_rules_go_through_parser_error(tmp_path, capsys):
    parser = CommandParser(prog="toy.py")
    ok = argparse.Namespace(max_steps=10, warmup_steps=9, stop_at_step=-1, velocity_weight=1.0, hidden_weight=0.0,
                            sigma_min=0.0, sigma_max=1.0)
    check_args(parser, ok)  # nothing to refuse
    bad = argparse.Namespace(max_steps=10, warmup_steps=10, stop_at_step=11, velocity_weight=0.0, hidden_weight=0.0,
                             sigma_min=0.5, sigma_max=0.5)
    with pytest.raises(SystemExit):
        check_args(parser, bad)
    err = capsys.readouterr().err
    assert err.startswith("toy.py: error: --warmup_steps=10: expected in [0, max_steps=10); ")
    assert "--stop_at_step=11: expected -1 or in [1, max_steps=10]" in err
    assert "--velocity_weight=0 and --hidden_weight=0: nothing would be trained" in err
    assert "--sigma_min=0.5 --sigma_max=0.5: expected 0 <= min < max <= 1" in err
    (tmp_path / "data").mkdir()
    with pytest.raises(ValueError, match="pass dataset_config_name"):
        check_args(parser, argparse.Namespace(dataset_root=tmp_path / "data"))
    with pytest.raises(SystemExit):
        check_args(parser, argparse.Namespace(dataset_root=tmp_path / "data"), dataset_config_name="config.json")
    assert "--dataset_root=" in capsys.readouterr().err
    (tmp_path / "data" / "config.json").write_text("{}")
    check_args(parser, argparse.Namespace(dataset_root=tmp_path / "data"), dataset_config_name="config.json")
