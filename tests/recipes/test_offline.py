"""Offline Predictor training (train_predictor_v4.py / train_predictor_disca.py) end to end on a tiny dataset.

The dataset is written here in the data.md layout (random tensors, sane cameras) for a saved tiny Teacher, so the
file stays fast; the real demo data path is exercised by the launchers. Covered: both entry scripts' run
directories, the pair step's context / variant wiring, loss falling, resume refusals, and the 2-rank gloo resume
equivalence (one torchrun launch running this file as its driver, see `resume_driver`).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors
import torch

import train_predictor_disca
import train_predictor_v4
from predictor_training.runtime.checkpoint import read_training_state
from predictor_training.runtime.provenance import absolute_paths_in
from tests.helpers.offline_dataset import ACTIONS, CASES, NUM_CHUNKS, read_log, train_args, write_tiny_dataset


REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny_dataset(tmp_path_factory) -> Path:
    return write_tiny_dataset(tmp_path_factory.mktemp("offline"))


# ---------------------------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("script, variant, pairs_per_trajectory", [
    (train_predictor_v4, "v4", 2 * 3),          # chunks 1-2 x 3 pairs
    (train_predictor_disca, "disca", 2 * 3),    # chunk 0 left out by default, like the user's recipe
])
def test_entry_script_writes_a_complete_run_dir(tiny_dataset, tmp_path, script, variant, pairs_per_trajectory):
    run_dir = tmp_path / variant
    assert script.main(train_args(tiny_dataset, run_dir)) == 0

    names = sorted(path.name for path in run_dir.iterdir())
    assert names == ["predictor_step_00002.safetensors", "predictor_step_00003.safetensors", "run.lock",
                     "train_config.json", "train_log.jsonl", "training_latest.pt", "training_prev.pt"]
    config = json.loads((run_dir / "train_config.json").read_text())
    trajectories = len(CASES) * len(ACTIONS)
    assert config["derived"]["variant"] == variant
    assert config["derived"]["global_batch"] == 2 * 1 * 1
    assert config["derived"]["num_pairs"] == trajectories * pairs_per_trajectory
    assert config["flags"]["pairs"] == [[0, 1], [1, 2], [2, 3]]
    records = read_log(run_dir)
    assert [record["step"] for record in records] == [1, 2, 3]
    for key in ("loss", "hidden_mse", "velocity_mse", "grad_norm", "lr/fusion", "lr/blocks", "time/step_s",
                "memory/cpu_peak_rss_gib"):
        assert all(key in record for record in records), key
    for record in records:
        assert record["loss"] == pytest.approx(record["velocity_mse"] + 0.1 * record["hidden_mse"], rel=1e-6)
    assert records[0]["lr/blocks"] == 0.0 and records[1]["lr/blocks"] > 0.0  # block warmup of 1 step

    state = read_training_state(run_dir / "training_latest.pt")
    assert state["meta"] == {"variant": variant, "source_blocks": [0, 1], "precision": "fp32"}
    assert state["run_state"]["global_step"] == 3
    assert all(tensor.dtype == torch.float32 for tensor in state["roles"]["predictor"]["model"].values())
    with safetensors.safe_open(str(run_dir / "predictor_step_00003.safetensors"), framework="pt") as handle:
        assert sorted(handle.keys()) == sorted(state["roles"]["predictor"]["model"])
        assert {handle.get_tensor(key).dtype for key in handle.keys()} == {torch.bfloat16}
    stream_count = {"v4": 3, "disca": 2}[variant]  # image, anchor (+ previous chunk)
    assert state["roles"]["predictor"]["model"]["fusion.proj.weight"].shape[1] == stream_count * 64
    # Provenance (runtime/provenance.py): the Teacher and the dataset config by hash, no path of this machine.
    provenance = json.loads(handle_metadata(run_dir / "predictor_step_00003.safetensors")["meta"])["provenance"]
    teacher_weights = tiny_dataset.parent / "teacher" / "diffusion_pytorch_model.safetensors"
    assert provenance["teacher_sha256"] == hashlib.sha256(teacher_weights.read_bytes()).hexdigest()
    assert provenance["dataset_config_sha256"] == hashlib.sha256(
        (tiny_dataset / "dataset_config.json").read_bytes()).hexdigest()
    assert provenance["parent_sha256"] is None and config["derived"]["provenance"] == provenance
    assert absolute_paths_in({key: json.loads(value) if key in ("meta", "config") else value
                              for key, value in handle_metadata(run_dir / "predictor_step_00003.safetensors").items()}
                             ) == []


def handle_metadata(path: Path) -> dict:
    with safetensors.safe_open(str(path), framework="pt") as handle:
        return handle.metadata()


def test_disca_include_chunk0_adds_the_first_chunk(tiny_dataset, tmp_path):
    run_dir = tmp_path / "disca0"
    train_predictor_disca.main(train_args(tiny_dataset, run_dir, "--include_chunk0", steps=2))
    config = json.loads((run_dir / "train_config.json").read_text())
    assert config["derived"]["num_pairs"] == len(CASES) * len(ACTIONS) * NUM_CHUNKS * 3


def test_loss_falls_over_twenty_steps(tiny_dataset, tmp_path):
    run_dir = tmp_path / "fall"
    train_predictor_v4.main(train_args(tiny_dataset, run_dir, "--batch_size", "4", "--ckpt_every", "-1", steps=20))
    losses = [record["loss"] for record in read_log(run_dir)]
    # 20 steps = 3.3 epochs of 6 batches: compare the first epoch with the last 6 steps (same batches, other order)
    first, last = sum(losses[:6]) / 6, sum(losses[-6:]) / 6
    assert last < 0.7 * first, losses


def test_fp32master_keeps_fp32_weights_and_adam_moments(tiny_dataset, tmp_path):
    """BF16 autocast with a BF16 Teacher (runs on the CPU too); what is trained and saved for resume stays FP32."""
    run_dir = tmp_path / "master"
    train_predictor_v4.main(train_args(tiny_dataset, run_dir, "--precision", "fp32master", steps=2))
    state = read_training_state(run_dir / "training_latest.pt")
    assert state["meta"]["precision"] == "fp32master"
    assert {tensor.dtype for tensor in state["roles"]["predictor"]["model"].values()} == {torch.float32}
    optimizer_state = state["roles"]["predictor"]["optimizer"]["state"]
    moments = [entry[name] for entry in optimizer_state.values() for name in ("exp_avg", "exp_avg_sq")]
    assert moments and {tensor.dtype for tensor in moments} == {torch.float32}
    assert all(record["loss"] > 0 for record in read_log(run_dir))


def test_resume_refuses_other_variant_blocks_or_precision(tiny_dataset, tmp_path, capsys):
    """One line and exit code 2 for each refusal, before the run directory is created."""
    run_dir = tmp_path / "base"
    train_predictor_v4.main(train_args(tiny_dataset, run_dir, steps=2))
    checkpoint = run_dir / "training_latest.pt"
    capsys.readouterr()

    def refusal(script, *extra) -> str:
        with pytest.raises(SystemExit) as refused:
            script.main(train_args(tiny_dataset, tmp_path / "other", "--resume", str(checkpoint), *extra, steps=4))
        err = capsys.readouterr().err
        assert refused.value.code == 2 and len(err.splitlines()) == 1, err
        return err

    assert "variant: saved 'v4', requested 'disca'" in refusal(train_predictor_disca)
    assert "source_blocks: saved [0, 1], requested [1, 0]" in refusal(train_predictor_v4, "--source_blocks", "1,0")
    assert "precision: saved 'fp32', requested 'fp32master'" in refusal(train_predictor_v4, "--precision",
                                                                         "fp32master")
    assert "missing.pt" in refusal(train_predictor_v4, "--resume", str(tmp_path / "missing.pt"))
    assert not (tmp_path / "other").exists()
    assert read_training_state(checkpoint)["run_state"]["global_step"] == 2  # untouched by the refusals


def test_second_launch_finishes_continues_or_refuses(tiny_dataset, tmp_path, capsys):
    """The same command twice: a finished run says so and does nothing; an interrupted one continues from its own
    training_latest.pt to the same losses as an uninterrupted run; other settings are refused in one line."""
    full, cut = tmp_path / "full", tmp_path / "cut"
    assert train_predictor_v4.main(train_args(tiny_dataset, full, steps=4)) == 0
    saved = (full / "training_latest.pt").stat().st_mtime_ns
    assert train_predictor_v4.main(train_args(tiny_dataset, full, steps=4)) == 0
    assert "already finished at step 4; nothing to do" in capsys.readouterr().out
    assert (full / "training_latest.pt").stat().st_mtime_ns == saved

    assert train_predictor_v4.main(train_args(tiny_dataset, cut, "--stop_at_step", "2", steps=4)) == 0
    assert train_predictor_v4.main(train_args(tiny_dataset, cut, steps=4)) == 0  # the interrupted run, relaunched
    assert "continuing the interrupted run" in capsys.readouterr().out
    for uninterrupted, continued in zip(read_log(full), read_log(cut), strict=True):
        for key in ("step", "loss", "hidden_mse", "velocity_mse", "grad_norm", "lr/fusion", "lr/blocks"):
            assert uninterrupted[key] == continued[key], (key, uninterrupted, continued)

    with pytest.raises(SystemExit) as conflict:
        train_predictor_v4.main(train_args(tiny_dataset, full, "--fusion_lr", "5e-4", steps=4))
    assert conflict.value.code == 2
    error = capsys.readouterr().err.strip()
    assert error.count("\n") == 0 and "--fusion_lr saved 0.001 now 0.0005" in error, error


def test_a_run_continues_with_half_the_batch_and_twice_the_accumulation_only_when_asked(tiny_dataset, tmp_path,
                                                                                       capsys):
    """After an out-of-memory crash: the same run with --batch_size 1 --grad_accum 2 (the same global batch) is
    refused naming the flags and the way on; with --allow_changed_settings it continues from its step, the data
    position carried over in items, and the config records the change. Other settings stay refused."""
    run_dir = tmp_path / "run"
    assert train_predictor_v4.main(train_args(tiny_dataset, run_dir, "--stop_at_step", "2", steps=4)) == 0
    smaller = ("--batch_size", "1", "--grad_accum", "2")
    with pytest.raises(SystemExit) as refused:
        train_predictor_v4.main(train_args(tiny_dataset, run_dir, *smaller, steps=4))
    error = capsys.readouterr().err.strip()
    assert refused.value.code == 2 and error.count("\n") == 0, error
    assert "--batch_size saved 2 now 1" in error and "--allow_changed_settings" in error, error
    with pytest.raises(SystemExit):  # the flag covers the batch settings only
        train_predictor_v4.main(train_args(tiny_dataset, run_dir, *smaller, "--allow_changed_settings",
                                           "--fusion_lr", "5e-4", steps=4))
    assert "--batch_size, --grad_accum" in capsys.readouterr().err
    assert train_predictor_v4.main(train_args(tiny_dataset, run_dir, *smaller, "--allow_changed_settings",
                                              steps=4)) == 0
    assert "with changed settings --batch_size 2 -> 1, --grad_accum 1 -> 2" in capsys.readouterr().out
    config = json.loads((run_dir / "train_config.json").read_text())
    assert config["flags"]["batch_size"] == 1 and config["derived"]["global_batch"] == 2
    assert config["derived"]["changed_settings"] == [{"step": 2, "flags": {"batch_size": [2, 1],
                                                                             "grad_accum": [1, 2]}}]
    state = read_training_state(run_dir / "training_latest.pt")
    assert state["run_state"]["global_step"] == 4
    assert state["config"]["derived"]["changed_settings"] == config["derived"]["changed_settings"]
    assert [record["step"] for record in read_log(run_dir)] == [1, 2, 3, 4]


def test_two_rank_gloo_resume_matches_uninterrupted_run(tiny_dataset, tmp_path):
    """One torchrun launch (2 ranks, gloo): 4 uninterrupted steps; 2 steps then a resume to 4 from the checkpoint."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}  # the file imports tests.helpers
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", __file__,
               str(tiny_dataset), str(tmp_path)]
    result = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-6000:]

    full_log, resumed_log = read_log(tmp_path / "full"), read_log(tmp_path / "cut")
    assert [r["step"] for r in full_log] == [r["step"] for r in resumed_log] == [1, 2, 3, 4]
    for full, resumed in zip(full_log, resumed_log):
        for key in ("loss", "hidden_mse", "velocity_mse", "grad_norm", "lr/fusion", "lr/blocks", "epoch"):
            assert full[key] == resumed[key], (full["step"], key, full[key], resumed[key])
    assert full_log[-1]["epoch"] == 1  # 3 batches per rank per epoch: step 4 starts the second epoch
    full_state = read_training_state(tmp_path / "full" / "training_latest.pt")
    resumed_state = read_training_state(tmp_path / "cut" / "training_latest.pt")
    assert full_state["world_size"] == 2
    assert full_state["run_state"] == resumed_state["run_state"]
    full_model, resumed_model = full_state["roles"]["predictor"]["model"], resumed_state["roles"]["predictor"]["model"]
    assert all(torch.equal(full_model[key], resumed_model[key]) for key in full_model)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def launcher_env(tiny_dataset: Path, output_root: Path, **extra: str) -> dict[str, str]:
    return {**os.environ, "DATASET_ROOT": str(tiny_dataset), "OUTPUT_ROOT": str(output_root), "NPROC_PER_NODE": "1",
            "MASTER_PORT": str(free_port()), "PYTHON": sys.executable, "OMP_NUM_THREADS": "1", **extra}


TINY_FLAGS = ["--precision", "fp32", "--batch_size", "2", "--scheduler_warmup_steps", "1", "--tracker", "none",
              "--num_workers", "0", "--no_progress"]


def test_launcher_names_the_run_and_tees_the_console(tiny_dataset, tmp_path):
    """tools/launch_predictor_disca_training.sh with a dataset: run name from the effective flags, positional source
    blocks, environment variables and extra flags forwarded, torchrun.log in the run directory; the same command
    a second time reports the finished run and exits 0."""
    env = launcher_env(tiny_dataset, tmp_path, FUSION_LR="2e-4", MAX_STEPS="2", BLOCK_WARMUP_STEPS="-1")
    command = ["bash", str(REPO_ROOT / "tools" / "launch_predictor_disca_training.sh"), "", "0,1", *TINY_FLAGS]
    result = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    device = "gpu" if torch.cuda.is_available() else "cpu"
    name = f"predictor_disca_blocks0-1_fp32_1{device}_flr2e-4_blr1e-5_schedsteps2_swarmup1_bwarmupnone_notracker"
    run_dir = tmp_path / name
    assert sorted(path.name for path in tmp_path.iterdir()) == [name]
    assert (run_dir / "torchrun.log").read_text().count("step 2/2") == 1
    config = json.loads((run_dir / "train_config.json").read_text())
    flags = config["flags"]
    assert (flags["source_blocks"], flags["fusion_lr"], flags["no_progress"]) == ([0, 1], 2e-4, True)
    assert config["derived"]["run_name"] == name
    assert [record["lr/blocks"] > 0 for record in read_log(run_dir)] == [True, True]  # no block warmup

    again = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "already finished at step 2; nothing to do" in again.stderr
    assert (run_dir / "torchrun.log").read_text().count("step 2/2") == 1  # nothing was started


@pytest.mark.parametrize("edit_default", [False, True])
def test_flags_or_edited_defaults_reach_the_run_and_its_name(tiny_dataset, tmp_path, edit_default):
    """`launch_predictor_v4_training.sh --fusion_lr 5e-4 --max_steps 2` (no positionals), or the same values
    written as the entry script's defaults: either way the run trains with them and its name says so."""
    root = tmp_path / "repo"
    shutil.copytree(REPO_ROOT / "tools", root / "tools")
    script = (REPO_ROOT / "train_predictor_v4.py").read_text()
    flags = ["--fusion_lr", "5e-4", "--max_steps", "2"]
    if edit_default:
        for old, new in (("fusion_lr=1e-4,", "fusion_lr=5e-4,"), ("max_steps=2000,", "max_steps=2,")):
            assert script.count(old) == 1, old
            script = script.replace(old, new)
        flags = []
    (root / "train_predictor_v4.py").write_text(script)
    env = launcher_env(tiny_dataset, tmp_path / "runs", PYTHONPATH=str(REPO_ROOT))
    command = ["bash", str(root / "tools" / "launch_predictor_v4_training.sh"), *flags, "--source_blocks", "0,1",
               "--block_warmup_steps", "1", *TINY_FLAGS]
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    (run_dir,) = (tmp_path / "runs").iterdir()
    assert "_flr5e-4_" in run_dir.name and "_schedsteps2_" in run_dir.name, run_dir.name
    config = json.loads((run_dir / "train_config.json").read_text())
    assert (config["flags"]["fusion_lr"], config["flags"]["max_steps"]) == (0.0005, 2)
    assert read_log(run_dir)[0]["lr/fusion"] == 5e-4  # one warmup step: the first update runs at the peak LR


def fresh_rendezvous(round_name: str) -> None:
    """Make the next init_process_group use a new TCPStore on a free port (rank 0 picks it and shares it through
    torchrun's agent store). Re-creating the default group on the agent store can read the previous group's stale
    gloo addresses and fail or hang."""
    agent_port = int(os.environ.setdefault("OFFLINE_TEST_AGENT_PORT", os.environ["MASTER_PORT"]))
    agent_store = torch.distributed.TCPStore(os.environ["MASTER_ADDR"], agent_port, is_master=False)
    key = f"offline_test/{round_name}/port"
    if os.environ["RANK"] == "0":
        with socket.socket() as probe:
            probe.bind((os.environ["MASTER_ADDR"], 0))
            agent_store.set(key, str(probe.getsockname()[1]))
    os.environ["MASTER_PORT"] = agent_store.get(key).decode()
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "False"


def resume_driver(dataset: str, out: str) -> None:
    """Run under torchrun by the test above: three main() calls in one launch, each with its own process group."""
    out, dataset = Path(out), Path(dataset)
    common = ("--batch_size", "4", "--seed", "3")
    fresh_rendezvous("full")
    train_predictor_v4.main(train_args(dataset, out / "full", *common, steps=4))
    fresh_rendezvous("cut")
    train_predictor_v4.main(train_args(dataset, out / "cut", *common, "--stop_at_step", "2", steps=4))
    fresh_rendezvous("resume")
    train_predictor_v4.main(train_args(dataset, out / "cut", *common, "--resume",
                                       str(out / "cut" / "training_latest.pt"), steps=4))


if __name__ == "__main__":
    resume_driver(*sys.argv[1:])
