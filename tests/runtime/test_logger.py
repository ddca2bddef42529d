"""The metrics logger (predictor_training/runtime/logger.py): a no-op off rank 0, the SwanLab
mode's resolution, and the API key never reaching a file."""

import pytest
import torch

from predictor_training.runtime.checkpoint import RunState, read_training_state, save_training_state
from predictor_training.runtime.distributed import DistEnv
from predictor_training.runtime.logger import MetricsLogger, resolve_swanlab_mode
from predictor_training.runtime.roles import Role
from tests.helpers.toy_loop import META, SINGLE, read_log, setup_loop


# ------------------------------------------------------------------------------------------------ logging
def test_metrics_logger_is_a_no_op_off_rank_0(tmp_path):
    rank1 = DistEnv(rank=1, local_rank=1, world_size=2, device=torch.device("cpu"), backend="gloo", is_main=False)
    with MetricsLogger(tmp_path / "run", rank1, tracker="swanlab", project="p", experiment="e") as logger:
        logger.log(1, {"loss": 1.0})
        assert logger.discard_after(0) == 0
    assert not (tmp_path / "run").exists()


def test_swanlab_mode_resolution(monkeypatch):
    monkeypatch.delenv("SWANLAB_MODE", raising=False)
    assert resolve_swanlab_mode(None) == "online"  # "cloud" is SwanLab's "online"
    monkeypatch.setenv("SWANLAB_MODE", "offline")
    assert resolve_swanlab_mode(None) == "offline"
    assert resolve_swanlab_mode("disabled") == "disabled"  # the flag wins over the environment
    monkeypatch.setenv("SWANLAB_MODE", "cloudy")
    with pytest.raises(ValueError, match="SWANLAB_MODE"):
        resolve_swanlab_mode(None)


def test_swanlab_api_key_never_reaches_a_file(tmp_path, monkeypatch):
    fake_key = "sk-FAKE-test-key-8f3a2b1c"
    monkeypatch.setenv("SWANLAB_API_KEY", fake_key)
    monkeypatch.delenv("SWANLAB_MODE", raising=False)
    run_dir = tmp_path / "run"
    config = {"lr": 1e-4, "swanlab_api_key": fake_key, "nested": {"token": fake_key, "note": f"key={fake_key}"}}
    with MetricsLogger(run_dir, SINGLE, tracker="swanlab", project="predictor-test", experiment="leak",
                       config=config, swanlab_mode="offline") as logger:
        for step in range(1, 4):
            logger.log(step, {"loss": 1.0 / step})
    model, optimizer, schedule, _, _ = setup_loop(tmp_path, max_steps=2)
    save_training_state(run_dir / "training_latest.pt", roles=[Role("predictor", model, optimizer, schedule)],
                        run_state=RunState(), config=config, meta=META)

    files = [path for path in run_dir.rglob("*") if path.is_file()]
    assert any("swanlab" in path.parts for path in files), "swanlab wrote nothing; the check would be vacuous"
    assert len(read_log(run_dir)) == 3
    leaking = [path for path in files if fake_key.encode() in path.read_bytes()]
    assert leaking == []
    saved_config = read_training_state(run_dir / "training_latest.pt")["config"]
    assert saved_config == {"lr": 1e-4, "nested": {"note": "<redacted>"}}
