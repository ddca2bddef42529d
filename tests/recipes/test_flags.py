"""The recipes' domain flags (predictor_training/recipes/flags.py): the list-valued flags' parsers and the rule of
--teacher / --action_ckpt for a method that reads the Teacher's weights.

Every recipe's own parser is checked case by case in tests/recipes/test_bad_input.py."""

from __future__ import annotations

import argparse

import pytest

from predictor_training.recipes.flags import (
    add_method_model_args, check_action_ckpt, format_pairs, parse_pairs, parse_source_blocks, parse_subset_cases,
)
from predictor_training.runtime.errors import CommandParser


def refused(parse, text: str) -> str:
    with pytest.raises(argparse.ArgumentTypeError) as error:
        parse(text)
    return str(error.value)


def test_source_blocks_keep_their_order_and_must_be_two_distinct_indices():
    assert parse_source_blocks("1,52") == (1, 52)
    assert parse_source_blocks(" 3 , 0 ") == (3, 0)
    for text in ("1,1", "4", "1,2,3", "-1,2"):
        assert "expected two distinct indices >= 0" in refused(parse_source_blocks, text), text
    assert "expected two integers like '1,52'" in refused(parse_source_blocks, "a,b")


def test_pairs_round_trip_and_need_anchor_before_target():
    assert parse_pairs("0-1, 1-2,2-3") == ((0, 1), (1, 2), (2, 3))
    assert format_pairs(parse_pairs("0-2,1-3")) == "0-2,1-3"
    assert "needs anchor < target" in refused(parse_pairs, "0-1,2-1")
    assert "needs anchor < target" in refused(parse_pairs, "1-1")
    assert "is not 'anchor-target'" in refused(parse_pairs, "0-1-2")
    assert "a pair is listed twice" in refused(parse_pairs, "0-1,0-1")
    assert "no pair given" in refused(parse_pairs, " , ")


def test_subset_cases_is_a_count_or_case_ids():
    assert parse_subset_cases("8") == 8
    assert parse_subset_cases("c004, c011") == ["c004", "c011"]
    assert parse_subset_cases("12,") == 12
    assert "expected a count like 8" in refused(parse_subset_cases, ",")


def test_a_method_reading_the_teachers_weights_needs_an_action_checkpoint_or_the_word_that_it_has_one(tmp_path,
                                                                                                    capsys):
    """--teacher alone is the base transformer of the real checkpoints: a method that reads its weights is refused
    in one line naming --action_ckpt, unless --no_action_ckpt says the folder holds the action weights."""
    def check(*argv, reads=True):
        parser = CommandParser(prog="method.py")
        add_method_model_args(parser, train="lora", init_weights="teacher", lora_rank=4, lora_alpha=4.0,
                              gradient_checkpointing=True, context_grad=True)
        args = parser.parse_args([str(item) for item in argv])
        check_action_ckpt(parser, args, reads_teacher_weights=reads)
        return args

    teacher, action = tmp_path / "teacher", tmp_path / "action.safetensors"
    with pytest.raises(SystemExit) as exit_info:
        check("--teacher", teacher)
    error = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and len(error.splitlines()) == 1
    assert "error: --action_ckpt is missing" in error and "--no_action_ckpt" in error
    assert check("--teacher", teacher, "--action_ckpt", action).action_ckpt == action
    assert check("--teacher", teacher, "--no_action_ckpt").no_action_ckpt
    assert check("--teacher", teacher, reads=False).action_ckpt is None  # from scratch: only the config is read
    assert check("--dry_run", "tiny").teacher is None
    with pytest.raises(SystemExit):
        check("--teacher", teacher, "--action_ckpt", action, "--no_action_ckpt")
    assert "give one or the other" in capsys.readouterr().err
