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
# Paths are relative to tests/ (test files of different folders may share a name).
SLOW_MODULES = frozenset({
    "conformance/test_conformance_other_sizes.py", "data/test_builder.py", "data/test_encoders.py",
    "data/test_ode_cache.py", "data/test_shards.py", "data/test_teacher_samples.py", "data/test_video_latent_build.py",
    "data/test_video_latents.py", "eval/test_inputs.py", "eval/test_run.py",
    "eval/test_validation.py", "methods/test_method_model.py",
    "methods/test_rewards.py", "recipes/test_kd_memory_points.py",
    "recipes/test_method_validation.py", "recipes/test_offline.py", "recipes/test_run_lock.py",
    "recipes/test_train_adversarial.py", "recipes/test_train_df_sft.py", "recipes/test_train_dmd2.py",
    "recipes/test_train_kd.py", "recipes/test_train_nft.py", "recipes/test_train_predictor_v4_rollout.py",
    "test_doc_commands.py",
    "rollout/test_context_modes.py", "rollout/test_teacher_forcing.py", "runtime/test_fsdp.py",
    "runtime/test_sharded_checkpoint.py", "teacher/test_flops.py", "teacher/test_frame_kv_cache.py",
    "tools/test_build_demo_world.py", "tools/test_build_ode_cache.py", "tools/test_check_conformance.py",
    "tools/test_check_trajectory_conformance.py", "tools/test_compute_video_metrics.py", "tools/test_encode_cases.py",
    "tools/test_eval_predictor.py", "tools/test_make_demo_assets.py",
    "tools/test_print_flop_bounds.py", "world/test_demo_assets.py", "world/test_render.py", "world/test_scene.py",
    "world/test_shipped.py", "world/test_vae.py",
})


# Single tests of the other modules that start a tool or torchrun as a subprocess (10-70 s each on a busy 2-core
# machine, measured with --durations), or that came from a module of the slow tier when the tests were split by
# package module (tests/<layer>/test_<module>.py).
SLOW_TESTS = frozenset({
    "eval/test_rehearsal.py::test_eval_fake_run_matches_the_real_cpu_run",
    "methods/test_chunk_generators.py::test_the_composite_sample_is_its_final_latent_with_the_predictor_graph",
    "methods/test_chunk_generators.py::test_teacher_chunks_are_the_teachers_rollout_of_the_noise",
    "methods/test_dmd2.py::test_learned_critic_at_its_own_cadence",
    "methods/test_dmd2_models.py::test_a_student_ema_is_exported_as_its_own_adapter_and_the_trained_weights_stay",
    "methods/test_nft.py::test_old_policy_follows_its_schedule",
    "recipes/test_run_names.py::test_bad_flag_on_the_command_line_has_no_traceback",
    "runtime/test_checkpoint.py::test_training_state_survives_sigkill_during_write",
    "runtime/test_loop.py::test_ddp_two_ranks_resume_matches_uninterrupted",
    "runtime/test_loop.py::test_ddp_two_ranks_unsynchronised_role_is_refused_at_the_checkpoint",
    "runtime/test_roles.py::test_two_rank_multi_role_resume_matches_uninterrupted_run",
    "runtime/test_run_directory.py::test_a_held_lock_refuses_and_dies_with_its_holder",
    "tools/test_estimate_memory.py::test_adversarial_fake_run_matches_the_real_cpu_run",
    "tools/test_estimate_memory.py::test_fsdp_full_run_holds_the_per_rank_share",
    "tools/test_estimate_memory.py::test_method_fake_run_matches_the_real_cpu_run",
    "tools/test_estimate_memory.py::test_nft_fake_run_matches_the_real_cpu_run",
    "tools/test_leaderboard.py::test_calibrating_on_the_evaluated_split_is_refused",
    "tools/test_leaderboard.py::test_leaderboard_rerun_resumes_and_keeps_the_calibration",
    "tools/test_leaderboard.py::test_leaderboard_writes_its_table_intervals_and_plots",
    "tools/test_make_sample_table.py::test_tool_rejects_bad_cases_before_writing",
    "tools/test_make_sample_table.py::test_tool_writes_poses_and_three_disjoint_tables",
    "world/test_clips.py::test_bad_settings_are_refused",
    "world/test_clips.py::test_mp4_worlds_are_lossless",
    "world/test_clips.py::test_world_tables_are_accepted_by_the_video_latent_builder_and_hold_the_promised_splits",
    "world/test_paths.py::test_pose_strings_have_the_asked_steps_and_only_vocabulary_words",
    "world/test_paths.py::test_video_frame_cameras_hit_the_latent_poses_exactly_and_interpolate_between",
})

TESTS_DIR = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    for item in items:
        module = item.path.relative_to(TESTS_DIR).as_posix()
        if module in SLOW_MODULES or f"{module}::{item.originalname}" in SLOW_TESTS:
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
