"""The ODE cache (predictor_training/data/ode_cache.py) of the tiny method world: resumable,
checksummed, marked complete, refused when unfinished or built with other settings."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from predictor_training.data.ode_cache import COMPLETE_MARKER, OdeCacheDataset, OdeCacheError
from tests.helpers.method_world import write_method_world, write_ode_cache


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py: tiny models run faster on one thread


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict[str, Path]:
    return write_method_world(tmp_path_factory.mktemp("fvtools"))


def test_ode_cache_is_resumable_checksummed_and_marked_complete(world, tmp_path):
    out = write_ode_cache(world, tmp_path / "cache")
    assert (out / COMPLETE_MARKER).is_file()
    dataset = OdeCacheDataset(out, "train")
    item = dataset[0]
    assert item["states"].shape == (4, 4, 8, 2, 3) and item["final"].shape == (4, 8, 2, 3)
    assert torch.allclose(item["sigmas"], torch.tensor([1.0, 0.9375, 0.8333333, 0.625]), atol=1e-6)
    assert torch.equal(item["states"][0], torch.randn(1, 4, 8, 2, 3, generator=torch.Generator().manual_seed(
        100))[0])  # step 0 of every chunk is the seed's noise
    mtimes = {path: path.stat().st_mtime_ns for path in (out / "samples").iterdir()}
    write_ode_cache(world, out)  # a rerun keeps every verified sample
    assert mtimes == {path: path.stat().st_mtime_ns for path in (out / "samples").iterdir()}
    (out / COMPLETE_MARKER).unlink()
    with pytest.raises(OdeCacheError, match="not finished"):
        OdeCacheDataset(out, "train")
    with pytest.raises(Exception, match="other settings"):
        write_ode_cache(world, out, steps=16)
