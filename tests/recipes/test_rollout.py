"""The rollout recipe's wiring in the package (predictor_training/recipes/rollout.py): the latent-gradient check
and its schedule rule. The recipe end to end: tests/recipes/test_train_predictor_v4_rollout.py."""

from __future__ import annotations

import math

import pytest

from predictor_training.recipes.rollout import check_latent_grads, latent_grad_check
from predictor_training.rollout.schedule import StepPlan


@pytest.mark.parametrize("replace_steps, checked", [((1, 2, 3), True), ((1, 2), True), ((2, 3), True),
                                                    ((1, 3), False), ((3,), False), ((1,), False)])
def test_the_latent_path_is_checked_only_with_consecutive_predictor_steps(replace_steps, checked):
    """F-P-P-P, F-P-P-F, F-F-P-P have a Predictor-made latent entering a Predictor step; F-P-F-P and F-R-R-P do not."""
    assert (latent_grad_check(StepPlan.from_steps(replace_steps)) is check_latent_grads) == checked


@pytest.mark.parametrize("value", [0.0, math.nan, -1.0])
def test_a_cut_latent_path_stops_the_run(value):
    with pytest.raises(RuntimeError, match="latent_grad_l1_min"):
        check_latent_grads(7, {"latent_grad_l1_min": value})
    check_latent_grads(7, {"latent_grad_l1_min": 1e-9})  # any gradient passes


def test_the_return_term_reads_the_rows_own_pose(tmp_path):
    """--revisit_weight > 0: each row's revisit pairs come from its pose file (forward 3, back 3: latent 6 is
    latent 0's camera again, 5 is 1's, 4 is 2's); off (0): none are read."""
    import json

    from predictor_training.recipes.rollout import row_revisit_pairs
    from predictor_training.rollout.camera import pose_string_to_json

    pose = tmp_path / "pose.json"
    pose.write_text(json.dumps(pose_string_to_json("w-3, s-3")))
    assert row_revisit_pairs({"pose": str(pose)}, 0.1) == {4: 2, 5: 1, 6: 0}
    assert row_revisit_pairs({"pose": str(pose)}, 0.0) is None


def test_each_rows_return_term_reads_its_own_pose_once(tmp_path, monkeypatch):
    """Two rows of one case on different camera paths (forward 3 then back 3; forward 2 then back 2) and the first
    path again: each trajectory gets the revisit pairs of its own row's pose, and each pose file is read once.
        w-3, s-3: latents 0 1 2 3 2' 1' 0'  -> {4: 2, 5: 1, 6: 0}
        w-2, s-2: latents 0 1 2 1' 0'       -> {3: 1, 4: 0}"""
    import json

    import predictor_training.recipes.rollout as rollout_recipe
    from predictor_training.predictor.self_rollout import SelfRolloutSettings
    from predictor_training.rollout.camera import pose_string_to_json
    from predictor_training.runtime.distributed import DistEnv

    poses = {}
    for name, path in (("long", "w-3, s-3"), ("short", "w-2, s-2")):
        poses[name] = tmp_path / f"{name}.json"
        poses[name].write_text(json.dumps(pose_string_to_json(path)))
    reads, handed = [], []
    read_pairs = rollout_recipe.row_revisit_pairs

    def counted_read(item, weight):
        reads.append(item["pose"])
        return read_pairs(item, weight)

    monkeypatch.setattr(rollout_recipe, "row_revisit_pairs", counted_read)
    monkeypatch.setattr(rollout_recipe, "trajectory_for_row",
                        lambda item, case, **kwargs: handed.append(kwargs["revisit_pairs"]))
    monkeypatch.setattr(rollout_recipe, "train_trajectory", lambda trajectory, sync: {"loss": 0.0})
    step = rollout_recipe.RolloutStep(
        model=None, teacher=None, dataset=type("Cases", (), {"load_case": staticmethod(lambda case_id: {})})(),
        rollout_config=None, settings=SelfRolloutSettings(velocity_weight=1.0, hidden_weight=0.1, revisit_weight=0.5),
        env=DistEnv(rank=0, local_rank=0, world_size=1, device="cpu", backend=None, is_main=True))
    for action, pose in enumerate((poses["long"], poses["short"], poses["long"])):
        step({"key": ["case0", action], "case_id": "case0", "pose": str(pose)}, sync=True, due=frozenset({"predictor"}))
    assert handed == [{4: 2, 5: 1, 6: 0}, {3: 1, 4: 0}, {4: 2, 5: 1, 6: 0}]
    assert reads == [str(poses["long"]), str(poses["short"])]
