"""Step plans (predictor_training/rollout/schedule.py): `StepPlan` letters, the chunk-0 rule, mixtures, the flags'
one check (`from_steps`) and a run's recorded flags read back (`from_flags`)."""

from __future__ import annotations

import pytest

from predictor_training.rollout.schedule import StepPlan, parse_replace_steps


# ---------------------------------------------------------------------------------------------------------------
# From the flags: --replace_steps / --reuse_steps
# ---------------------------------------------------------------------------------------------------------------
def test_the_flags_plan_letters_and_chunk0_rule():
    fppp = StepPlan.from_steps(parse_replace_steps("1,2,3"))
    assert fppp.pattern == "FPPP" and fppp.tag == "fppp" and not fppp.replaces(0, 1) and fppp.replaces(1, 1)
    assert StepPlan.from_steps((1, 3)).pattern == "FPFP" and StepPlan.from_steps((1, 2)).text == "F-P-P-F"
    every = StepPlan.from_steps((1, 2), chunk0_full=False)
    assert every.replaces(0, 2) and every.tag == "fppf_allchunks" and every.describe() == "every chunk F-P-P-F"
    assert fppp.describe() == "chunk 0 F-F-F-F, later chunks F-P-P-P"
    none = StepPlan.from_steps(parse_replace_steps(""), chunk0_full=False)
    assert none.pattern == "FFFF" and none.tag == "ffff" and none.replaced_steps == ()
    frrp = StepPlan.from_steps((3,), (1, 2))
    assert (frrp.text, frrp.tag, frrp.predictor_steps, frrp.reuse_steps, frrp.replaced_steps) == (
        "F-R-R-P", "frrp", (3,), (1, 2), (1, 2, 3))
    assert frrp.with_letter("P").text == "F-P-P-P" and fppp.with_letter("H").text == "F-H-H-H"
    for replace, reuse, message in (((0, 1), (), "outside 1..3"), ((2, 1), (), "ascending"), ((4,), (), "outside"),
                                    ((2, 3), (1, 2), r"steps \[2\] are also in --replace_steps"),
                                    ((3,), (2, 1), r"--reuse_steps \[2, 1\]")):
        with pytest.raises(ValueError, match=message):
            StepPlan.from_steps(replace, reuse)


def test_a_runs_plan_is_read_back_from_its_recorded_flags():
    """P at the run's --replace_steps (1,2,3 without the flag: the offline recipes train every step), R at its
    --reuse_steps (none without the flag), as lists (train_config.json) or comma text."""
    assert StepPlan.from_flags({"replace_steps": [3], "reuse_steps": [1, 2]}).text == "F-R-R-P"
    assert StepPlan.from_flags({"replace_steps": "3", "reuse_steps": "1,2"}).text == "F-R-R-P"
    assert StepPlan.from_flags({"replace_steps": [1, 2]}).text == "F-P-P-F"
    assert StepPlan.from_flags({}).text == "F-P-P-P"


# ---------------------------------------------------------------------------------------------------------------
# The leaderboard's plans: mixtures and the other letters
# ---------------------------------------------------------------------------------------------------------------
def test_step_plan_letters_mixtures_and_errors():
    plan = StepPlan.parse("F-R-R-R|F-R-R-F")
    assert [plan.letter(chunk, 3) for chunk in range(6)] == ["F", "R", "F", "R", "F", "R"]  # chunk 0 Full
    assert plan.letter(1, 1) == "R" and plan.tag == "frrr+frrf" and plan.full_steps() == 1.5
    assert plan.replaced_steps == (1, 2, 3)
    with pytest.raises(ValueError, match="mixture"):
        plan.pattern
    assert StepPlan.parse("FRRP", chunk0_full=False).letter(0, 3) == "P"
    for bad in ("R-F-F-F", "F-X-F-F", "F-R-R", "F-R-R-R|F-R"):
        with pytest.raises(ValueError):
            StepPlan.parse(bad)


def test_a_students_plan_runs_one_model_from_its_first_step():
    """S (a student's whole-model step) may start a chunk and counts as a Full step; S and F never share a plan; a
    student's plan in every chunk gives chunk 0 its own letters, with chunk 0 Full it would run S there."""
    plan = StepPlan.parse("S-R-R-S", chunk0_full=False)
    assert [plan.letter(0, step) for step in range(4)] == ["S", "R", "R", "S"] and plan.full_steps() == 2
    assert StepPlan.parse("S-R-R-R").letter(0, 2) == "S" and StepPlan.parse("S-R-R-R").letter(1, 2) == "R"
    for bad in ("S-R-R-F", "F-S-R-R", "R-S-S-S"):
        with pytest.raises(ValueError):
            StepPlan.parse(bad)
