"""Step schedules (predictor_training/rollout/schedule.py): `Schedule` letters and the chunk-0
rule, `StepPlan` letters, mixtures and errors."""

from __future__ import annotations

import pytest

from predictor_training.rollout.schedule import Schedule, StepPlan, parse_replace_steps


# ---------------------------------------------------------------------------------------------------------------
# Schedule: the eval's replaced steps
# ---------------------------------------------------------------------------------------------------------------
def test_schedule_letters_and_chunk0_rule():
    fppp = Schedule(parse_replace_steps("1,2,3"))
    assert fppp.letters() == "FPPP" and fppp.tag == "fppp" and not fppp.replaces(0, 1) and fppp.replaces(1, 1)
    assert Schedule((1, 3)).letters() == "FPFP" and Schedule((1, 2)).letters() == "FPPF"
    every = Schedule((1, 2), chunk0_full=False)
    assert every.replaces(0, 2) and every.tag == "fppf_allchunks"
    assert Schedule(parse_replace_steps("")).letters() == "FFFF"
    for bad in ((0, 1), (2, 1), (4,)):
        with pytest.raises(ValueError):
            Schedule(bad)


# ---------------------------------------------------------------------------------------------------------------
# StepPlan: the leaderboard's step plans
# ---------------------------------------------------------------------------------------------------------------
def test_step_plan_letters_mixtures_and_errors():
    plan = StepPlan.parse("F-R-R-R|F-R-R-F")
    assert [plan.letter(chunk, 3) for chunk in range(6)] == ["F", "R", "F", "R", "F", "R"]  # chunk 0 Full
    assert plan.letter(1, 1) == "R" and plan.tag == "frrr+frrf" and plan.full_steps() == 1.5
    assert StepPlan.parse("FRRP", chunk0_full=False).letter(0, 3) == "P"
    assert StepPlan.from_schedule(Schedule((1, 2)), "H").text == "F-H-H-F"
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
