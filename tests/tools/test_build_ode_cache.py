"""tools/build_ode_cache.py --max_clips: at most N clips of each split, evenly spaced,
recorded in the cache's inputs; a final sample table refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.method_world import write_method_world


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py: tiny models run faster on one thread


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict[str, Path]:
    return write_method_world(tmp_path_factory.mktemp("fvtools"))


def test_ode_cache_max_clips_plans_an_evenly_spaced_subset_per_split(world):
    """tools/build_ode_cache.py --max_clips: at most N clips of each split (one count for all, or one per split),
    evenly spaced from the first; recorded in the cache's inputs; the seeds stay the clips' own."""
    import sys
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
    import build_ode_cache

    assert build_ode_cache.evenly_spaced(10, 4) == [0, 2, 5, 7]
    assert build_ode_cache.evenly_spaced(3, None) == build_ode_cache.evenly_spaced(3, 5) == [0, 1, 2]
    base = ["--teacher", str(world["teacher"]), "--video_latents", str(world["videos"]), "--splits", "train,holdout",
            "--out", "unused"]
    full, _, full_inputs = build_ode_cache.plan_jobs(build_ode_cache.parse_args(base))
    subset, _, inputs = build_ode_cache.plan_jobs(build_ode_cache.parse_args([*base, "--max_clips", "1"]))
    assert [(job.split, job.condition) for job in full] == [("train", ("train", 0)), ("train", ("train", 1)),
                                                            ("holdout", ("holdout", 0))]
    assert [(job.split, job.condition, job.seed) for job in subset] == [
        (job.split, job.condition, job.seed) for job in (full[0], full[2])]
    assert inputs["max_clips"] == {"holdout": 1, "train": 1} and "max_clips" not in full_inputs
    per_split, _, _ = build_ode_cache.plan_jobs(build_ode_cache.parse_args([*base, "--max_clips", "2,1"]))
    assert len(per_split) == 3
    for bad in (["--max_clips", "1,2,3"], ["--max_clips", "0"], ["--max_clips", "x"]):
        with pytest.raises(SystemExit):
            build_ode_cache.parse_args([*base, *bad])


def test_a_final_sample_table_is_refused(tmp_path, capsys):
    """The split nothing is chosen on never goes into a training cache (refused before anything is read)."""
    import sys
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
    import build_ode_cache

    with pytest.raises(SystemExit) as exited:
        build_ode_cache.parse_args(["--teacher", str(tmp_path / "teacher"), "--samples",
                                    f"{tmp_path / 'train.jsonl'},{tmp_path / 'final.jsonl'}", "--encoded",
                                    str(tmp_path / "encoded"), "--out", str(tmp_path / "cache")])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and "split 'final' is the split nothing is chosen on" in err
    assert not any(tmp_path.iterdir())
