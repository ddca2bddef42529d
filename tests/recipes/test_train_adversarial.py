"""DisCa-style adversarial training (fvtools/train_adversarial.py) on the tiny offline dataset of
tests/helpers/offline_dataset.py (CPU, one process).

Covered: --adv_weight 0 equals train_predictor_v4.py bit for bit; lazy R1 only on its cadence; an interrupted
two-role run continued from its checkpoint equals the uninterrupted run in both roles; the on-policy mode (--data
rollout) runs a step with both roles. One real step of the recipe's step (where each loss's gradients reach, the
discriminator's inputs, R1's cadence) is in tests/recipes/test_adversarial.py; the discriminator's toy separation in
tests/methods/test_adversarial.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import fvtools.train_adversarial as adversarial
import train_predictor_v4
from predictor_training.runtime.checkpoint import read_training_state
from tests.helpers.offline_dataset import adversarial_args, read_log, train_args, write_tiny_dataset
from tests.helpers.two_ranks import assert_finished, run_two_ranks


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def tiny_dataset(tmp_path_factory) -> Path:
    return write_tiny_dataset(tmp_path_factory.mktemp("adversarial"))


def roles_state(run_dir: Path) -> dict:
    return read_training_state(run_dir / "training_latest.pt")["roles"]


# ---------------------------------------------------------------------------------------------------------------
def test_adv_weight_zero_equals_the_offline_v4_recipe_bit_for_bit(tiny_dataset, tmp_path):
    """Same data, seed and flags: the Predictor's weights (every step's checkpoint) and losses are identical, although
    the discriminator was initialised, trained every step (with R1) and measured."""
    v4_dir, adv_dir = tmp_path / "v4", tmp_path / "adv"
    common = ("--seed", "5", "--batch_size", "3")
    assert train_predictor_v4.main(train_args(tiny_dataset, v4_dir, *common, steps=4)) == 0
    assert adversarial.main(adversarial_args(tiny_dataset, adv_dir, *common, "--adv_weight", "0",
                                             "--r1_every", "2", steps=4)) == 0

    v4_model = roles_state(v4_dir)["predictor"]["model"]
    adv_roles = roles_state(adv_dir)
    assert sorted(adv_roles) == ["discriminator", "predictor"]
    assert sorted(v4_model) == sorted(adv_roles["predictor"]["model"])
    assert all(torch.equal(v4_model[key], adv_roles["predictor"]["model"][key]) for key in v4_model)
    for v4_record, adv_record in zip(read_log(v4_dir), read_log(adv_dir), strict=True):
        for key in ("loss", "hidden_mse", "velocity_mse"):
            assert v4_record[key] == adv_record[key], (key, v4_record, adv_record)
        assert v4_record["grad_norm"] == adv_record["grad_norm/predictor"]
        assert v4_record["lr/fusion"] == adv_record["lr/predictor/fusion"]
        assert adv_record["adversarial/weight"] == 0.0 and adv_record["updates/discriminator"] == v4_record["step"]
    # The discriminator did train (its weights moved from their initialisation) and is logged.
    records = read_log(adv_dir)
    assert all(0.0 <= record["discriminator/accuracy"] <= 1.0 for record in records)
    assert records[-1]["discriminator/loss"] != records[0]["discriminator/loss"]


def test_lazy_r1_only_on_its_cadence(tiny_dataset, tmp_path):
    """D every 2 steps, R1 on every 2nd D update (its 1st, 3rd, ...): steps 2 and 6 of 6, and nowhere else (each
    step's record says whether R1 ran and, where it did, the penalty it computed)."""
    run_dir = tmp_path / "r1"
    adversarial.main(adversarial_args(tiny_dataset, run_dir, "--discriminator_every", "2", "--r1_every", "2",
                                      "--r1_weight", "10", steps=6))
    records = read_log(run_dir)
    assert [record["discriminator/r1_applied"] for record in records] == [0, 1, 0, 0, 0, 1]
    assert [("discriminator/r1" in record) for record in records] == [False, True, False, False, False, True]
    assert all(record["discriminator/r1"] > 0 for record in records if "discriminator/r1" in record)
    assert [record["updates/discriminator"] for record in records] == [0, 1, 1, 2, 2, 3]
    assert [("grad_norm/discriminator" in record) for record in records] == [False, True] * 3


def test_interrupted_two_role_run_continues_to_the_uninterrupted_result(tiny_dataset, tmp_path):
    """4 steps at once vs 2 steps + a relaunch of the same command: both roles' weights, optimizers and every logged
    value are identical (D every 2 steps and R1 every 2nd D update, so both cadences cross the resume)."""
    full, cut = tmp_path / "full", tmp_path / "cut"
    flags = ("--adv_weight", "0.2", "--adv_warmup_steps", "3", "--discriminator_every", "2", "--r1_every", "2")
    adversarial.main(adversarial_args(tiny_dataset, full, *flags, steps=5))
    adversarial.main(adversarial_args(tiny_dataset, cut, *flags, "--stop_at_step", "2", steps=5))
    assert read_training_state(cut / "training_latest.pt")["run_state"]["global_step"] == 2
    adversarial.main(adversarial_args(tiny_dataset, cut, *flags, steps=5))

    full_roles, cut_roles = roles_state(full), roles_state(cut)
    for role in ("predictor", "discriminator"):
        for key, tensor in full_roles[role]["model"].items():
            assert torch.equal(tensor, cut_roles[role]["model"][key]), (role, key)
        assert full_roles[role]["updates"] == cut_roles[role]["updates"]
        for index, state in full_roles[role]["optimizer"]["state"].items():
            assert all(torch.equal(value, cut_roles[role]["optimizer"]["state"][index][name])
                       for name, value in state.items() if torch.is_tensor(value))
    ignored = {"time/step_s", "time/data_s", "memory/cpu_peak_rss_gib"}
    for uninterrupted, continued in zip(read_log(full), read_log(cut), strict=True):
        assert {k: v for k, v in uninterrupted.items() if k not in ignored} == \
               {k: v for k, v in continued.items() if k not in ignored}
    weights = [record["adversarial/weight"] for record in read_log(full)]
    assert weights == pytest.approx([0.0, 0.2 / 3, 0.4 / 3, 0.2, 0.2])
    assert (full / "discriminator_step_00005.safetensors").is_file()
    assert (full / "predictor_step_00005.safetensors").is_file()


def test_a_continued_run_still_records_the_weights_it_started_from(tiny_dataset, tmp_path):
    """A run from --init_from, stopped and relaunched, writes the same train_config.json as the uninterrupted run:
    the continuing launch loads no --init_from file (the weights come from the training state) but still records
    its metadata (benchmarks/fault_injection.py found it null after a kill, in rollout's config and checkpoints)."""
    init, full, cut = tmp_path / "init", tmp_path / "full", tmp_path / "cut"
    assert train_predictor_v4.main(train_args(tiny_dataset, init, steps=2)) == 0
    flags = ("--init_from", str(init / "training_latest.pt"), "--adv_warmup_steps", "0")
    adversarial.main(adversarial_args(tiny_dataset, full, *flags, steps=3))
    adversarial.main(adversarial_args(tiny_dataset, cut, *flags, "--stop_at_step", "2", steps=3))
    adversarial.main(adversarial_args(tiny_dataset, cut, *flags, steps=3))
    recorded = json.loads((cut / "train_config.json").read_text())["derived"]
    assert recorded["init_meta"]["source_blocks"] == [0, 1]
    assert recorded == json.loads((full / "train_config.json").read_text())["derived"]
    assert read_training_state(cut / "training_latest.pt")["config"]["derived"] == recorded


def test_rollout_mode_trains_both_roles_on_the_states_the_predictor_visits(tmp_path):
    """--data rollout: one step on one trajectory (chunk 0 + one trained F-P-P-P chunk) from an offline init; both
    roles are updated and the discriminator sees the 3 Predictor steps' hiddens."""
    from tests.helpers.rollout_setup import SOURCE_BLOCKS, write_rollout_setup

    paths = write_rollout_setup(tmp_path, num_latents=8, case_ids=["c000"], actions=(2,))
    run_dir = tmp_path / "run"
    assert adversarial.main([
        "--data", "rollout", "--dataset_root", str(paths["dataset"]), "--teacher", str(paths["teacher"]),
        "--init_from", str(paths["init"]), "--output_dir", str(run_dir),
        "--source_blocks", ",".join(map(str, SOURCE_BLOCKS)), "--precision", "fp32", "--max_steps", "2",
        "--scheduler_warmup_steps", "1", "--block_warmup_steps", "-1", "--adv_warmup_steps", "0",
        "--adv_weight", "0.1", "--r1_every", "1", "--discriminator_width", "16", "--num_workers", "0",
        "--tracker", "none", "--no_progress"]) == 0
    records = read_log(run_dir)
    assert [record["updates/discriminator"] for record in records] == [1, 2]
    for record in records:
        assert record["grad_norm/predictor"] > 0 and record["grad_norm/discriminator"] > 0
        assert record["loss"] == pytest.approx(record["regression_loss"] + 0.1 * record["adversarial/generator_loss"])
        assert record["monitor/teacher_hidden_std"] > 0 and record["discriminator/r1"] > 0
    config = json.loads((run_dir / "train_config.json").read_text())
    assert config["derived"]["recipe"] == "adversarial_rollout"


def test_two_ranks_train_both_roles_and_keep_their_replicas_identical(tiny_dataset, tmp_path):
    """torchrun x2 (gloo), offline pairs: 2 steps with a checkpoint after each. The loop's checkpoint refuses
    replicas that differ over ranks, so finishing proves the DDP Predictor and the all-reduced discriminator (built
    from its own stream on every rank) stayed identical on both ranks."""
    run_dir = tmp_path / "run"
    result = run_two_ranks("fvtools/train_adversarial.py",
                           *adversarial_args(tiny_dataset, run_dir, "--adv_weight", "0.5", "--adv_warmup_steps", "0",
                                             "--r1_every", "1", "--ckpt_every", "1", steps=2))
    assert_finished(result)
    assert read_training_state(run_dir / "training_latest.pt")["world_size"] == 2
    log = read_log(run_dir)
    assert [record["step"] for record in log] == [1, 2]
    assert all(record["updates/discriminator"] == record["step"] for record in log)
    assert log[1]["adversarial/weight"] == 0.5
