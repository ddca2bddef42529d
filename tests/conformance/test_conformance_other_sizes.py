"""Both conformance tools on synthetic folders whose sizes differ from set A in every dimension.

The folders are written by ``tests/helpers/conformance_writer.py`` from our own teacher (self-consistency), so what this
checks is that nothing in ``predictor_training.conformance`` (the logic of ``tools/check_conformance.py`` and
``tools/check_trajectory_conformance.py``) or the rest of the library depends on set A's sizes; and that a copy with
one weight nudged by 1e-2 fails both checks.
"""

from __future__ import annotations

import json
import lzma
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load as load_safetensors_bytes, save

from predictor_training.conformance.calls import DECOMPRESSED_WEIGHTS_ENTRY, run_conformance
from predictor_training.conformance.trajectory import check_trajectory
from tests.helpers.conformance_writer import SyntheticSetSpec, _sha, write_conformance_folder


# Set B: wide heads, shallow, 40 latents (10 chunks, the retrieval branch from chunk start 24 on), points not stored,
# a non-contiguous 12-frame context, chunk frames 20..23 at timestep index 1.
SPEC_B = SyntheticSetSpec(
    name="synthetic_B",
    model=dict(hidden_size=96, heads_num=3, rope_dim_list=[8, 12, 12], mm_double_blocks_depth=2, in_channels=3,
               out_channels=3, text_states_dim=24, vision_states_dim=12, byt5_states_dim=20, byt5_hidden_dim=28),
    height=3, width=5,
    text_mask=[1, 1, 1, 1, 1, 0, 0], holes_text_mask=[0, 1, 0, 1, 1, 0, 1],
    byt5_mask=[1, 1, 1, 0], holes_byt5_mask=[1, 0, 1, 1], vision_tokens=3,
    pose_string="w-5, right-6, d-4, up-3, s-5, left-7, a-3, down-2, w-4",
    string_pose_string="a-2, w-3, left-4, down-2",
    context_frames=[0, 1, 2, 3, 8, 9, 10, 11, 12, 13, 14, 15], chunk_start=20, chunk_timestep_index=1,
    store_points=False, prefeature_layers=(0, 1), weights_seed=3, input_seed=4, noise_seed=7, image_cond_seed=8,
    retrieval_seed=5,
)


# Set C: one 48-wide head, deep, 16 latents (4 chunks), points stored, a 6-frame context with a gap, no txt_small
# group, pre-features of blocks 0 and 2, chunk frames 12..15 at timestep index 3.
SPEC_C = SyntheticSetSpec(
    name="synthetic_C",
    model=dict(hidden_size=48, heads_num=1, rope_dim_list=[16, 16, 16], mm_double_blocks_depth=4, in_channels=2,
               out_channels=2, text_states_dim=20, vision_states_dim=8, byt5_states_dim=12, byt5_hidden_dim=16),
    height=2, width=3,
    text_mask=[1, 1, 1, 0, 0], holes_text_mask=[0, 1, 1, 0, 1],
    byt5_mask=[1, 1, 0], holes_byt5_mask=[0, 1, 1], vision_tokens=2,
    pose_string="right-3, w-4, up-2, d-3, left-3",
    string_pose_string="s-3, right-2, up-1",
    context_frames=[0, 1, 2, 3, 6, 7], chunk_start=12, chunk_timestep_index=3,
    text_groups=("txt", "txt_holes", "txt_t2v"), store_points=True, prefeature_layers=(0, 2),
)


def _nudge_one_weight(source: Path, target: Path, name: str, delta: float) -> None:
    """Copy a folder with one weight changed by ``delta`` (sha256 sums updated, so it loads cleanly)."""
    shutil.copytree(source, target)
    weights = load_safetensors_bytes(lzma.decompress((target / "weights.safetensors.xz").read_bytes()))
    weights[name] = weights[name].clone()
    weights[name].view(-1)[0] += delta
    raw = save(weights)
    (target / "weights.safetensors.xz").write_bytes(lzma.compress(raw, preset=1))
    info = json.loads((target / "vectors.json").read_text())
    info["files"]["weights.safetensors.xz"]["sha256"] = _sha((target / "weights.safetensors.xz").read_bytes())
    info["files"][DECOMPRESSED_WEIGHTS_ENTRY]["sha256"] = _sha(raw)
    (target / "vectors.json").write_text(json.dumps(info))


@pytest.fixture(scope="module", params=[SPEC_B, SPEC_C], ids=lambda spec: spec.name)
def synthetic_set(request, tmp_path_factory):
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp(request.param.name)
    summary = write_conformance_folder(folder, request.param)
    return request.param, folder, summary


def test_conformance_tool_passes_on_other_sizes(synthetic_set):
    spec, folder, summary = synthetic_set
    results = run_conformance(folder, tier="strict")
    failures = [result.line() for result in results if not result.passed]
    assert not failures, "\n".join(failures)
    names = {result.name for result in results}
    depth = spec.model["mm_double_blocks_depth"]
    expected = {f"{group}.layer{depth - 1}.k_txt" for group in spec.text_groups}
    expected |= {f"ctx.layer{depth - 1}.v_vision", "ctx.vec", "pose_str.from_file.action", "sched.step3.prev_sample"}
    expected |= {f"{group}.velocity" for group in ("chunk", "chunk_noctx", "chunk_first", "chunk_small")}
    expected |= {f"retr.selected.cur{start:02d}" for start in range(0, summary["num_latents"], 4)}
    expected |= {f"retr.candidates.cur{start}.distances" for start in range(24, summary["num_latents"], 4)}
    if spec.store_points:
        expected.add("retr.points")
    assert expected <= names, sorted(expected - names)
    assert not any(name.startswith("txt_small") for name in names) or "txt_small" in spec.text_groups


def test_trajectory_tool_passes_on_other_sizes(synthetic_set):
    spec, folder, summary = synthetic_set
    report = check_trajectory(folder, tier="strict")
    assert report.passed, [(item.name, item.max_abs, item.note) for item in report.failures()]
    num_chunks = summary["num_latents"] // 4
    names = {item.name for item in report.comparisons}
    assert f"chunk{num_chunks - 1}.step3.latent_out" in names and "final.latents" in names
    for layer in spec.prefeature_layers:
        assert f"chunk{num_chunks - 1}.ctx.block{layer}_in" in names
    assert any(spec.store_points == note.startswith("memory points: retr.points") for note in report.notes)
    if summary["num_latents"] > 24:  # past chunk start 20 the memory makes non-contiguous contexts (compacted RoPE)
        contexts = summary["trajectory_context"]
        assert any(indices and indices != list(range(len(indices))) for indices in contexts), contexts


def test_perturbed_copy_fails_both_tools(synthetic_set, tmp_path):
    spec, folder, _ = synthetic_set
    perturbed = tmp_path / "perturbed"
    last = spec.model["mm_double_blocks_depth"] - 1
    _nudge_one_weight(folder, perturbed, f"double_blocks.{last}.img_mlp.fc2.bias", 1e-2)
    failed = {result.name for result in run_conformance(perturbed, tier="portable", cases=["chunk", "text"])
              if not result.passed}
    assert {"chunk.velocity", "chunk_first.velocity", "chunk_small.velocity"} <= failed
    assert not any(name.startswith("txt") for name in failed)  # the image MLP does not touch the text stream
    report = check_trajectory(perturbed, tier="portable")
    assert not report.passed
    assert "final.latents" in {item.name for item in report.failures()}
