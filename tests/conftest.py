"""Shared pytest fixtures, and the numerics every test process (and the subprocesses it starts) uses."""

import functools
import os
import re
from pathlib import Path

# MKL picks its kernels by the CPU's vector ISA, so an AVX-512 machine rounds float32 matmuls differently from the
# AVX2 machine that made the golden vectors, by up to 1.4x the strict conformance tier (tests/data/conformance/
# README.md section 11). MKL's COMPATIBLE path gives the same results on every x86 CPU. Read when MKL loads: this
# must run before torch is imported, and the environment passes it on to torchrun workers and tool subprocesses.
os.environ.setdefault("MKL_CBWR", "COMPATIBLE")
# One intra-op thread for the test process and every tool it starts (the tools' automatic choice otherwise depends
# on the machine's load, and torchrun workers use one thread as well).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(scope="module")
def one_thread():
    """Run a module's tensors on one intra-op thread.

    The test models are tiny, so one thread is as fast as two and does not stall when the machine is busy; it is
    also what every torchrun worker uses (OMP_NUM_THREADS=1), so bytes written in-process and by workers compare.
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


# The fast tier (`pytest -m "not slow"`, minutes on 2 cores) leaves out whole modules that launch torchrun, train
# demo-sized models or build datasets and worlds; single slow tests elsewhere carry @pytest.mark.slow themselves.
SLOW_MODULES = frozenset({
    "test_conformance_other_sizes.py", "test_context_modes.py", "test_dataset_builder.py", "test_demo_assets.py",
    "test_eval.py", "test_fsdp.py", "test_fvtools.py", "test_fvtools_adversarial.py", "test_fvtools_dmd2.py",
    "test_fvtools_nft.py", "test_fvtools_validation.py", "test_kd_memory_points.py", "test_offline_training.py",
    "test_rollout_training.py", "test_run_lock.py", "test_sharded_checkpoint.py", "test_teacher_samples.py",
    "test_validation.py", "test_video_latent_dataset.py", "test_world.py", "test_world_shipped.py",
    "test_world_vae.py", "test_encoders.py",
})


# Single tests of the other modules that start a tool or torchrun as a subprocess (10-70 s each on a busy 2-core
# machine, measured with --durations).
SLOW_TESTS = frozenset({
    "test_memory_rehearsal.py::test_method_fake_run_matches_the_real_cpu_run",
    "test_memory_rehearsal.py::test_fsdp_full_run_holds_the_per_rank_share",
    "test_memory_rehearsal.py::test_adversarial_fake_run_matches_the_real_cpu_run",
    "test_memory_rehearsal.py::test_eval_fake_run_matches_the_real_cpu_run",
    "test_memory_rehearsal.py::test_nft_fake_run_matches_the_real_cpu_run",
    "test_loop.py::test_ddp_two_ranks_resume_matches_uninterrupted",
    "test_loop.py::test_ddp_two_ranks_unsynchronised_role_is_refused_at_the_checkpoint",
    "test_metrics.py::test_cli_runs_as_a_script_and_reports_usage_errors",
    "test_sample_table.py::test_tool_writes_poses_and_three_disjoint_tables",
    "test_sample_table.py::test_tool_rejects_bad_cases_before_writing",
    "test_conformance.py::test_cli_prints_one_line_per_case_and_exit_codes",
    "test_ar_rollout.py::test_trajectory_tool_command_line",
    "test_distribution_matching.py::test_learned_critic_at_its_own_cadence",
    "test_run_names.py::test_bad_flag_on_the_command_line_has_no_traceback",
    "test_roles.py::test_two_rank_multi_role_resume_matches_uninterrupted_run",
    "test_checkpoint.py::test_training_state_survives_sigkill_during_write",
    "test_leaderboard.py::test_leaderboard_writes_its_table_intervals_and_plots",
    "test_leaderboard.py::test_leaderboard_rerun_resumes_and_keeps_the_calibration",
    "test_leaderboard.py::test_calibrating_on_the_evaluated_split_is_refused",
})


def pytest_collection_modifyitems(config, items):
    for item in items:
        name = f"{item.path.name}::{item.originalname}"
        if item.path.name in SLOW_MODULES or name in SLOW_TESTS:
            item.add_marker(pytest.mark.slow)


# The suite runs on 2 pytest-xdist workers (pyproject.toml: `-n 2 --dist loadscope`). Each worker is a process with
# its own module fixtures, so a module whose tests share a module- or session-scoped fixture (a demo world, a
# torchrun build, a trained run that several tests read) runs whole on one worker: the fixture is built once, not
# once per worker. The tests of every other module are scheduled one by one, so that long single tests (torchrun
# launches) do not queue behind each other at the end. (pytest-xdist's own `--dist loadgroup` cannot do this on
# pytest 9: it renames items through an attribute pytest no longer reads.)
SHARED_FIXTURE = re.compile(r"@pytest\.fixture\([^)]*scope=[\"'](module|package|session)[\"']")


@functools.lru_cache(maxsize=None)
def shares_module_fixtures(path: Path) -> bool:
    return path.suffix == ".py" and path.is_file() and SHARED_FIXTURE.search(path.read_text()) is not None


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist, absent under `-p no:xdist`
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadscope":
        return None  # pytest-xdist's own scheduler for --dist load, worksteal, ...
    from xdist.scheduler import LoadScopeScheduling

    class SharedFixtureScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return module if shares_module_fixtures(config.rootpath / module) else nodeid

    return SharedFixtureScheduling(config, log)
