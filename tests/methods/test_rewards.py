"""The NFT rewards (predictor_training/methods/rewards.py): the registry's parsing and
refusals, and the built-in rewards on hand-made frames."""

from __future__ import annotations

import pytest
import torch

from predictor_training.methods.rewards import REWARDS, RewardScorer, parse_reward_weights, select_frames


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py: tiny models run faster on one thread


# ---------------------------------------------------------------------------------------------------------------
# rewards
# ---------------------------------------------------------------------------------------------------------------
def _video(kind: str, frames: int = 6, size: int = 8) -> torch.Tensor:
    """Hand-made float frames [1, F, H, W, 3] in [0, 1]."""
    base = (torch.arange(size)[:, None] + torch.arange(size)[None]) % 2  # a checkerboard
    video = base.float()[None, :, :, None].expand(frames, size, size, 3).clone()
    if kind == "moving":
        video = torch.stack([torch.roll(video[0], shifts=f, dims=1) for f in range(frames)])
    elif kind == "flat":
        video = torch.full((frames, size, size, 3), 0.5)
    return video[None]


def test_reward_registry_parses_and_refuses_clearly():
    assert parse_reward_weights("smoothness:0.5, reference_agreement") == {"smoothness": 0.5,
                                                                          "reference_agreement": 1.0}
    with pytest.raises(ValueError, match=r"unknown reward 'smoothnes'.*registered rewards: \[.*'smoothness'"):
        parse_reward_weights("smoothnes:1")
    with pytest.raises(ValueError, match="appears twice"):
        parse_reward_weights("smoothness:1,smoothness:2")
    with pytest.raises(ValueError, match="not a number"):
        parse_reward_weights("smoothness:heavy")
    with pytest.raises(ValueError, match="no reward"):
        parse_reward_weights(" , ")
    with pytest.raises(ValueError, match="compares with a reference video"):
        RewardScorer({"reference_agreement": 1.0})(_video("static"))
    assert {reward.reads for reward in REWARDS.values()} == {"first_frame", "sampled_frames", "video"}


def test_builtin_rewards_on_hand_made_frames():
    static, moving, flat = _video("static"), _video("moving"), _video("flat")
    batch = torch.cat([static, moving, flat])
    scores = RewardScorer({"smoothness": 1.0, "contrast": 2.0})(batch)
    assert scores["smoothness"][0] == 0 and scores["smoothness"][2] == 0  # a static video is the smoothest
    assert scores["smoothness"][1] < 0
    assert scores["contrast"][2] == 0 and scores["contrast"][0] > 0.4  # a flat colour has none
    assert torch.allclose(scores["total"], scores["smoothness"] + 2 * scores["contrast"])
    # Reference agreement: the maximum (0) exactly when equal; worse the further away.
    reference = moving.expand(3, -1, -1, -1, -1)
    agreement = RewardScorer({"reference_agreement": 1.0})(batch, reference)["reference_agreement"]
    assert agreement[1] == 0 and agreement[0] < 0 and agreement[2] < 0
    # First-frame agreement reads frame 0 only: moving and static share it.
    first = RewardScorer({"first_frame_agreement": 1.0})(batch, reference)["first_frame_agreement"]
    assert first[0] == 0 and first[1] == 0 and first[2] < 0
    index = select_frames(torch.arange(10.0)[None, :, None, None, None].expand(1, 10, 1, 1, 3), "sampled_frames",
                          4)[0, :, 0, 0, 0]
    assert index.tolist() == [0.0, 3.0, 6.0, 9.0]  # spread evenly, first and last included
