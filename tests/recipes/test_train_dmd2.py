"""fvtools DMD2 + Self-Forcing (fvtools/train_dmd2.py) on tiny models (CPU, single process).

World: the demo Teacher config (4 blocks, width 64, random weights with every path active), three procedural clips of
8 latents (2 chunks) at 2 x 3 (two train, one holdout), a v4 Predictor on blocks 1, 2 with random (non-zero) output
layers saved as an inference file (`--init_from`), and the Teacher folder itself as the real score's model folder.
The DMD losses and their sign are tested on 1-D Gaussians in tests/methods/test_dmd2.py, the recipe's step and build
(which roles train, the DMD gradient at the generator's sample) in tests/recipes/test_dmd2.py; here the script's runs
are."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import fvtools.train_dmd2 as dmd2
from predictor_training.predictor.model import build_predictor
from predictor_training.runtime.checkpoint import read_training_state
from predictor_training.teacher import WorldPlayTransformer
from tests.helpers.method_world import dmd2_argv, write_dmd2_world
from tests.helpers.two_ranks import assert_finished, run_two_ranks


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py: tiny models run faster on one thread


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict[str, Path]:
    return write_dmd2_world(tmp_path_factory.mktemp("dmd2"))


def _log(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "train_log.jsonl").read_text().splitlines()]


def test_cadence_generator_every_n_steps_critic_every_step(world, tmp_path):
    out = tmp_path / "cadence"
    assert dmd2.main(dmd2_argv(world, out, "--generator_every", "2")) == 0
    log = _log(out)
    assert [record["updates/predictor"] for record in log] == [0, 1, 1, 2]
    assert [record["updates/fake_score"] for record in log] == [1, 2, 3, 4]
    assert ["generator_loss" in record for record in log] == [False, True, False, True]
    assert ["grad_norm/predictor" in record for record in log] == [False, True, False, True]
    assert all("monitor/std_ratio" in record for record in log[1::2])  # --monitor_every 2
    assert all(f"monitor/chunk1/{name}" in log[1] for name in ("std_ratio", "temporal_ratio"))
    saved = read_training_state(out / "training_latest.pt")
    assert sorted(saved["roles"]) == ["fake_score", "predictor"]


def test_resume_mid_interval_equals_an_uninterrupted_run_in_every_role(world, tmp_path):
    whole, split = tmp_path / "whole", tmp_path / "split"
    common = ["--generator_every", "2", "--ckpt_every", "3"]
    assert dmd2.main(dmd2_argv(world, whole, *common)) == 0
    assert dmd2.main(dmd2_argv(world, split, *common, "--stop_at_step", "3")) == 0
    assert len(_log(split)) == 3
    assert dmd2.main(dmd2_argv(world, split, *common)) == 0  # the directory's own run continues at step 4
    drop = ("time/step_s", "time/data_s", "memory/cpu_peak_rss_gib")
    assert [{k: v for k, v in r.items() if k not in drop} for r in _log(split)] == \
           [{k: v for k, v in r.items() if k not in drop} for r in _log(whole)]
    whole_roles = read_training_state(whole / "training_latest.pt")["roles"]
    split_roles = read_training_state(split / "training_latest.pt")["roles"]
    for role in ("predictor", "fake_score"):
        assert whole_roles[role]["model"].keys() == split_roles[role]["model"].keys()
        for name, tensor in whole_roles[role]["model"].items():
            assert torch.equal(tensor, split_roles[role]["model"][name]), (role, name)


def test_the_predictor_checkpoint_loads_in_the_eval(world, tmp_path):
    from predictor_training.eval.predictor_checkpoints import load_predictor, read_predictor_checkpoint

    out = tmp_path / "evaluable"
    assert dmd2.main(dmd2_argv(world, out, "--max_steps", "2", "--generator_every", "1")) == 0
    ckpt = read_predictor_checkpoint(out / "predictor_step_00002.safetensors")
    assert ckpt.variant == "v4" and ckpt.meta["source_blocks"] == [1, 2] and ckpt.step == 2
    teacher = WorldPlayTransformer.from_pretrained(str(world["teacher"]))
    predictor = load_predictor(teacher, ckpt)
    saved = read_training_state(out / "training_latest.pt")["roles"]["predictor"]["model"]
    loaded = predictor.state_dict()
    assert loaded.keys() == saved.keys()
    for name, tensor in saved.items():  # the inference file holds the trained weights in BF16
        assert torch.equal(loaded[name].float(), tensor.to(torch.bfloat16).float()), name


def test_refuses_the_raw_teacher_as_real_score_without_the_flag_or_below_its_sigmas(world, tmp_path, capsys):
    argv = dmd2_argv(world, tmp_path / "raw")
    argv[argv.index("--real_score") + 1] = "teacher"
    with pytest.raises(SystemExit):
        dmd2.parse_args(argv)
    assert "--real_score teacher: the distilled 4-step Teacher is not a score model" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        dmd2.parse_args([*argv, "--allow_raw_teacher_score"])
    assert "--score_sigma_min=0.02 with --real_score teacher" in capsys.readouterr().err
    args = dmd2.parse_args([*argv, "--allow_raw_teacher_score", "--score_sigma_min", "0.625"])
    assert args.real_score_kind == "teacher"
    with pytest.raises(SystemExit):
        dmd2.parse_args([*dmd2_argv(world, tmp_path / "bad"), "--real_score", str(tmp_path)])
    assert "expected a model folder with config.json" in capsys.readouterr().err


def test_two_ranks_train_both_roles_and_keep_their_replicas_identical(world, tmp_path):
    """torchrun x2 (gloo): 2 steps (the generator due at step 2), a checkpoint after each. The loop's checkpoint
    refuses replicas that differ over ranks, so finishing proves the DDP Predictor and the all-reduced fake score
    stayed identical on both ranks."""
    run_dir = tmp_path / "run"
    result = run_two_ranks("fvtools/train_dmd2.py", *dmd2_argv(world, run_dir, "--max_steps", "2", "--ckpt_every",
                                                               "1", "--monitor_every", "2"))
    assert_finished(result)
    assert read_training_state(run_dir / "training_latest.pt")["world_size"] == 2
    log = _log(run_dir)
    assert [record["step"] for record in log] == [1, 2]
    assert [record["updates/fake_score"] for record in log] == [1, 2]
    assert [record["updates/predictor"] for record in log] == [0, 1]
    assert all(torch.isfinite(torch.tensor(record["critic_loss"])) for record in log)
    assert "generator_loss" in log[1] and "monitor/std_ratio" in log[1]


def test_dry_run_lists_every_role_with_the_predictor_counted_on_its_blocks(capsys):
    """--dry_run at a preset's size (meta device): the Predictor generator's trained parameters are those of a v4
    Predictor built on the named Teacher blocks."""
    assert dmd2.main(["--dry_run", "demo", "--source_blocks", "1,2"]) == 0
    report = capsys.readouterr().out
    with torch.device("meta"):
        expected = sum(param.numel() for param in build_predictor(WorldPlayTransformer.from_preset("demo"), "v4", (1, 2))
                       .parameters() if param.requires_grad)
    assert f"role predictor: v4 Predictor on Teacher blocks [1, 2]: {expected:,} trained parameters" in report
    assert [line.split(":")[0] for line in report.splitlines()[2:]] == [
        "role teacher", "role predictor", "role real_score", "role fake_score"]


def test_the_generator_ema_is_exported_next_to_the_raw_weights(world, tmp_path):
    """--ema_decay 0.5 --ema_start_step 1, 3 updates: the EMA copies update 1, then averages updates 2 and 3; the
    predictor_ema_step_00003.safetensors holds that shadow (BF16) and loads in the eval like the raw weights."""
    from predictor_training.eval.predictor_checkpoints import load_predictor, read_predictor_checkpoint

    out = tmp_path / "ema"
    assert dmd2.main(dmd2_argv(world, out, "--max_steps", "3", "--generator_every", "1", "--ema_decay", "0.5",
                               "--ema_start_step", "1", "--keep_last", "1")) == 0
    saved = read_training_state(out / "training_latest.pt")["roles"]["predictor"]
    assert saved["ema"]["updates"] == 3 and saved["ema"]["decay"] == 0.5 and saved["ema"]["start_update"] == 1
    ckpt = read_predictor_checkpoint(out / "predictor_ema_step_00003.safetensors")
    assert ckpt.step == 3 and ckpt.meta["ema"] == {"decay": 0.5, "start_update": 1, "updates": 3}
    assert ckpt.meta["provenance"] == read_training_state(out / "training_latest.pt")["config"]["derived"][
        "provenance"] and ckpt.meta["provenance"]["teacher_sha256"] is not None  # runtime/provenance.py
    teacher = WorldPlayTransformer.from_pretrained(str(world["teacher"]))
    loaded = load_predictor(teacher, ckpt).state_dict()
    assert loaded.keys() == saved["model"].keys()
    differs = 0
    for name, tensor in saved["model"].items():
        expected = saved["ema"]["shadow"].get(name, tensor)
        assert torch.equal(loaded[name].float(), expected.to(torch.bfloat16).float()), name
        differs += not torch.equal(saved["ema"]["shadow"].get(name, tensor), tensor)
    assert differs > 0  # the average lags the trained weights
    assert (out / "predictor_step_00003.safetensors").is_file()
