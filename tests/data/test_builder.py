"""Dataset builder (predictor_training/data/builder.py): torchrun build, resume, teacher-equality,
set A through the builder, dry-run estimates, bad input.

Builds use a subset of the demo assets (3 cases, 5 trajectories of 12 latents, plus one 32-latent trajectory) and
one CPU thread per process, so the whole file runs in about a minute. In-process builds call
``predictor_training.data.builder.run``; the command lines (``tools/build_predictor_dataset.py`` under torchrun and
with ``--demo``, ``tools/make_demo_assets.py``) run as subprocesses."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from predictor_training.conformance import SET_A
import predictor_training.conformance.trajectory as trajectory_check
from predictor_training.data import builder
from predictor_training.data.encoders import EncodedCaseError, load_encoded_case
from predictor_training.data.pair_dataset import PairDataset
from predictor_training.data.sample_table import SampleTableError
from predictor_training.data.shards import (
    TENSOR_CHECKSUM_FIELD,
    file_tensor_crc32,
    load_tensors,
    read_jsonl,
    verify_file,
    write_jsonl_atomic,
)
from predictor_training.rollout.ar_rollout import RolloutConfig, RolloutInputs, make_initial_noise, record_rollout
from predictor_training.rollout.camera import pose_to_input
from predictor_training.rollout.memory_retrieval import make_retrieval_points, select_aligned_memory_frames
from predictor_training.teacher import TEACHER_PRESETS, TextKV, WorldPlayTransformer


REPO_ROOT = Path(__file__).resolve().parents[2]
TOOLS = REPO_ROOT / "tools"
SHORT_LATENTS = 12
ONE_THREAD_ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


# =============================================================================================================
# demo assets and a small subset of them
# =============================================================================================================
@pytest.fixture(scope="module")
def demo(tmp_path_factory, one_thread):
    root = tmp_path_factory.mktemp("demo") / "D"
    command = [sys.executable, str(TOOLS / "make_demo_assets.py"), "--out", str(root), "--num_train", "2",
               "--num_holdout25", "1", "--num_holdout50", "1", "--kind", "random"]
    result = subprocess.run(command, capture_output=True, text=True, env=ONE_THREAD_ENV, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return root


def _write_table(demo: Path, folder: Path, split: str, rows: list[dict], num_latents: int) -> Path:
    """A sample table in ``folder`` over demo rows, pose files truncated to ``num_latents`` latents."""
    (folder / "poses").mkdir(parents=True, exist_ok=True)
    with open(folder / f"{split}.jsonl", "w") as handle:
        for row in rows:
            pose = json.loads((demo / "samples" / row["pose"]).read_text())
            (folder / row["pose"]).write_text(json.dumps({str(i): pose[str(i)] for i in range(num_latents)}))
            image = (demo / "samples" / row["source_image"]).resolve()
            handle.write(json.dumps({**row, "source_image": str(image)}) + "\n")
    return folder / f"{split}.jsonl"


def _demo_rows(demo: Path, split: str) -> list[dict]:
    return [json.loads(line) for line in (demo / "samples" / f"{split}.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def subset(demo, tmp_path_factory):
    """train: 2 cases x actions (0, 2); holdout25: 1 case x action 1; 12 latents (3 chunks) each."""
    folder = tmp_path_factory.mktemp("subset")
    train = [row for row in _demo_rows(demo, "train") if row["action_id"] in (0, 2)]
    holdout = [row for row in _demo_rows(demo, "holdout25") if row["action_id"] == 1]
    tables = [_write_table(demo, folder, "train", train, SHORT_LATENTS),
              _write_table(demo, folder, "holdout25", holdout, SHORT_LATENTS)]
    return folder, ",".join(map(str, tables))


def _subset_args(demo: Path, tables: str, out: Path, *extra: str) -> list[str]:
    return ["--teacher", str(demo / "teacher"), "--samples", tables, "--encoded", str(demo / "encoded"),
            "--num_latents", str(SHORT_LATENTS), "--dtype", "float32", "--device", "cpu", "--out", str(out), *extra]


def _options(demo: Path, tables: str, out: Path, **changes) -> builder.BuildOptions:
    """What the command line makes of ``--teacher D/teacher --samples TABLES --encoded D/encoded --dtype float32
    --device cpu --out OUT`` (tables comma-separated), with ``changes`` applied."""
    options = builder.BuildOptions(teacher=demo / "teacher", samples=tables.split(","), encoded=demo / "encoded",
                                   out=out, dtype="float32", device="cpu")
    for name, value in changes.items():
        setattr(options, name, value)
    return options


def _subset_options(demo: Path, tables: str, out: Path, **changes) -> builder.BuildOptions:
    """The build of ``_subset_args`` (12 latents)."""
    return _options(demo, tables, out, num_latents=SHORT_LATENTS, **changes)


def _snapshot(root: Path) -> dict[str, tuple[bytes, int, int]]:
    """{relative path: (bytes, inode, mtime_ns)} of every file under root."""
    return {str(path.relative_to(root)): (path.read_bytes(), path.stat().st_ino, path.stat().st_mtime_ns)
            for path in sorted(root.rglob("*")) if path.is_file()}


@pytest.fixture(scope="module")
def torchrun_build(demo, subset, tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp") / "DS"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               str(TOOLS / "build_predictor_dataset.py"), *_subset_args(demo, subset[1], out)]
    result = subprocess.run(command, capture_output=True, text=True, env=ONE_THREAD_ENV, cwd=REPO_ROOT, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return out, result.stdout + result.stderr


# =============================================================================================================
# builds
# =============================================================================================================
def test_torchrun_build_writes_a_complete_verified_dataset(torchrun_build):
    out, log = torchrun_build
    manifest = read_jsonl(out / "manifest.jsonl")
    assert [entry["file"] for entry in manifest] == sorted(entry["file"] for entry in manifest)
    kinds = [entry["kind"] for entry in manifest]
    assert kinds.count("case") == 3 and kinds.count("trajectory") == 5
    for entry in manifest:
        verify_file(entry, out)
        assert entry[TENSOR_CHECKSUM_FIELD] == file_tensor_crc32(out / entry["file"])  # every tensor, every file
        assert sorted(entry[TENSOR_CHECKSUM_FIELD]) == sorted(entry["tensors"])
    splits = [entry["split"] for entry in manifest if entry["kind"] == "trajectory"]
    assert sorted(splits) == ["holdout25"] + ["train"] * 4
    assert "[rank 0] trajectories built 3" in log and "[rank 1] trajectories built 2" in log
    assert not (out / "manifest_parts").exists()
    config = json.loads((out / "dataset_config.json").read_text())
    assert config["prefeature_layers"] == [0, 1, 2, 3] and config["num_chunks"] == 3  # demo Teacher: 4 blocks
    # the data.md tensor list of one trajectory
    entry = next(entry for entry in manifest if entry["kind"] == "trajectory")
    names = set(entry["tensors"])
    assert {"viewmats", "Ks", "action", "timesteps", "sigmas", "seed", "chunk0.final_latent"} <= names
    assert "chunk0.ctx_indices" not in names and entry["tensors"]["chunk2.ctx_indices"] == [[8], "int64"]
    assert entry["tensors"]["chunk2.ctx_prefeature.layer3"] == [[8 * 24, 64], "bfloat16"]
    assert entry["tensors"]["chunk1.step3.final_hidden"] == [[96, 64], "bfloat16"]
    assert entry["tensors"]["chunk1.step0.velocity"] == [[4, 4, 4, 6], "bfloat16"]
    case = next(entry for entry in manifest if entry["kind"] == "case")
    assert case["tensors"]["image_cond"] == [[1, 4, 1, 4, 6], "bfloat16"]
    assert case["tensors"]["text_k"][0][:2] == [4, 2] and case["action_id"] is None
    # the offline-training reader accepts it (sizes, tensor lists and checksums)
    pairs = PairDataset(out, split="train", source_layers=(1, 2), verify=True)
    assert len(pairs) == 4 * 2 * 3 and pairs[0]["n_ctx"] == 4


def test_interrupted_build_resumes_without_redoing_work_and_matches(demo, subset, torchrun_build, tmp_path, capsys):
    out = tmp_path / "DS"
    assert builder.run(_subset_options(demo, subset[1], out, stop_after=2)) == 0
    assert not (out / "manifest.jsonl").exists()
    finished = {key: value for key, value in _snapshot(out).items() if key.startswith(("trajectories/", "cases/"))}
    assert sum(key.startswith("trajectories/") for key in finished) == 2
    with open(out / "manifest_parts" / "rank0.jsonl", "a") as handle:  # as if killed inside an append
        handle.write('{"kind": "traj')
    capsys.readouterr()

    assert builder.run(_subset_options(demo, subset[1], out)) == 0
    log = capsys.readouterr().out
    assert "trajectories built 3, skipped 2; cases built 0, skipped 3" in log
    after = _snapshot(out)
    for key, value in finished.items():  # same inode and mtime: not rewritten
        assert after[key] == value, key
    # byte-identical to the uninterrupted 2-rank build: files, manifest and dataset config
    reference = _snapshot(torchrun_build[0])
    assert sorted(after) == sorted(reference)
    for key in reference:
        assert after[key][0] == reference[key][0], key

    # a damaged file is detected (sha256) and rebuilt; everything else is skipped
    damaged = out / "trajectories" / sorted(key for key in finished if key.startswith("trajectories/"))[0].split("/")[1]
    data = bytearray(damaged.read_bytes())
    data[-1] ^= 0xFF
    damaged.write_bytes(bytes(data))
    assert builder.run(_subset_options(demo, subset[1], out)) == 0
    log = capsys.readouterr().out
    assert "rebuilding" in log and "field 'sha256'" in log and "trajectories built 1, skipped 4" in log
    assert damaged.read_bytes() == reference[str(damaged.relative_to(out))][0]
    assert (out / "manifest.jsonl").read_bytes() == reference["manifest.jsonl"][0]


def test_bfloat16_build_follows_the_real_pipeline_precision(demo, subset, torchrun_build, tmp_path):
    config = builder.rollout_config((0, 3), torch.bfloat16)
    assert config.state_dtype == torch.bfloat16 and config.autocast_dtype == torch.bfloat16
    assert builder.rollout_config((0, 3), torch.float32).autocast_dtype is None
    train_table = subset[1].split(",")[0]
    assert builder.run(_subset_options(demo, train_table, tmp_path / "bf16", dtype="bfloat16", stop_after=1)) == 0
    name = sorted((tmp_path / "bf16" / "trajectories").iterdir())[0].name
    bf16 = load_tensors(tmp_path / "bf16" / "trajectories" / name)
    fp32 = load_tensors(torchrun_build[0] / "trajectories" / name)
    assert json.loads((tmp_path / "bf16" / "dataset_config.json").read_text())["compute_dtype"] == "bfloat16"
    assert torch.equal(bf16["chunk0.step0.latent_in"], fp32["chunk0.step0.latent_in"])  # same noise, bf16-rounded
    for key in ("chunk1.step3.velocity", "chunk2.step2.final_hidden", "chunk2.final_latent"):
        difference = (bf16[key].float() - fp32[key].float()).abs().max()
        assert 0 < difference < 0.1, (key, difference)


@pytest.fixture(scope="module")
def full_build(demo, tmp_path_factory):
    """One 32-latent (8-chunk) trajectory, float32 compute."""
    folder = tmp_path_factory.mktemp("full")
    row = [row for row in _demo_rows(demo, "train") if row["action_id"] == 2][0]
    table = _write_table(demo, folder, "train", [row], 32)
    out = folder / "DS"
    assert builder.run(_options(demo, str(table), out)) == 0
    return out, row, table


def test_stored_targets_equal_a_fresh_teacher_rollout(demo, full_build):
    out, row, table = full_build
    manifest = read_jsonl(out / "manifest.jsonl")
    trajectory_file = out / next(entry["file"] for entry in manifest if entry["kind"] == "trajectory")
    stored = load_tensors(trajectory_file)
    # an independent rollout from the encoder output, the row's seed and pose (not through the builder)
    teacher = WorldPlayTransformer.from_pretrained(str(demo / "teacher")).eval()
    config = json.loads((out / "dataset_config.json").read_text())
    encoded = load_encoded_case(demo / "encoded" / f"{row['case_id']}.pt", teacher.config, None)
    with torch.no_grad():
        text_kv = teacher.text_prefill(encoded["prompt_embeds"].float(), encoded["prompt_mask"],
                                       encoded["byt5_text_states"].float(), encoded["byt5_text_mask"],
                                       encoded["vision_states"].float())
    viewmats, Ks, action = pose_to_input(table.parent / row["pose"], 32)
    image_cond = encoded["image_cond"].bfloat16().float()  # the case file stores it in bf16
    inputs = RolloutInputs(make_initial_noise(row["seed"], (1, 4, 32, 4, 6)), image_cond, viewmats, Ks, action,
                           memory_points=make_retrieval_points(row["seed"]))
    rounded_kv = TextKV([k.bfloat16().float() for k in text_kv.k], [v.bfloat16().float() for v in text_kv.v])
    layers = tuple(config["prefeature_layers"])
    _, exact = record_rollout(teacher, rounded_kv, inputs, RolloutConfig(prefeature_layers=layers))
    _, unrounded = record_rollout(teacher, text_kv, inputs, RolloutConfig(prefeature_layers=layers))

    case = load_tensors(out / "cases" / f"{row['case_id']}.safetensors")
    assert torch.equal(case["text_k"], torch.cat(text_kv.k).bfloat16())
    assert torch.equal(case["image_cond"], encoded["image_cond"].bfloat16())
    assert torch.equal(stored["seed"], torch.tensor([row["seed"]]))
    assert torch.equal(stored["action"], action) and torch.equal(stored["viewmats"], viewmats.float())
    checked = 0
    for chunk in exact.chunks:
        prefix = f"chunk{chunk.chunk_index}"
        start = 4 * chunk.chunk_index
        if chunk.chunk_index:
            expected = select_aligned_memory_frames(viewmats, start, points=make_retrieval_points(row["seed"]))
            assert stored[f"{prefix}.ctx_indices"].tolist() == chunk.ctx_indices == expected
        for layer in layers if chunk.chunk_index else ():
            assert torch.equal(stored[f"{prefix}.ctx_prefeature.layer{layer}"], chunk.prefeatures[layer][0].bfloat16())
        for k, step in enumerate(chunk.steps):
            for name in ("latent_in", "velocity", "final_hidden"):
                fresh = getattr(step, name)[0]
                assert torch.equal(stored[f"{prefix}.step{k}.{name}"], fresh.bfloat16()), f"{prefix}.step{k}.{name}"
                # against the rollout on the unrounded fp32 text K/V: bf16 storage + bf16 text K/V tolerance
                other = getattr(unrounded.chunks[chunk.chunk_index].steps[k], name)[0]
                torch.testing.assert_close(stored[f"{prefix}.step{k}.{name}"].float(), other, rtol=2**-8, atol=1e-3)
                checked += 1
        assert torch.equal(stored[f"{prefix}.final_latent"], chunk.final_latent[0].bfloat16())
    assert checked == 8 * 4 * 3
    assert [len(chunk.ctx_indices) for chunk in exact.chunks] == [0, 4, 8, 12, 16, 20, 20, 20]


def test_resume_adds_per_tensor_checksums_to_an_older_manifest(demo, full_build, tmp_path, capsys):
    """A dataset whose manifest predates per-tensor checksums: a rerun skips every file and adds the checksums."""
    out, _, table = full_build
    older = tmp_path / "DS"
    shutil.copytree(out, older)
    entries = read_jsonl(older / "manifest.jsonl")
    write_jsonl_atomic(older / "manifest.jsonl", [
        {key: value for key, value in entry.items() if key != TENSOR_CHECKSUM_FIELD} for entry in entries
    ])
    files = {key: value for key, value in _snapshot(older).items() if key.startswith(("cases/", "trajectories/"))}
    capsys.readouterr()
    assert builder.run(_options(demo, str(table), older)) == 0
    assert "trajectories built 0, skipped 1; cases built 0, skipped 1" in capsys.readouterr().out
    assert (older / "manifest.jsonl").read_bytes() == (out / "manifest.jsonl").read_bytes()
    after = _snapshot(older)
    assert all(after[key] == value for key, value in files.items())  # no shard rewritten


def test_builder_rollout_reproduces_set_a_golden_trajectory():
    golden = trajectory_check.GoldenTrajectory.load(SET_A)
    config = builder.rollout_config(golden.prefeature_layers(), torch.float32)
    assert config == trajectory_check.rollout_config_for(golden, golden.prefeature_layers())
    report = trajectory_check.compare_with_golden(golden, trajectory_check.our_trajectory(golden, config), "strict")
    assert report.passed, [(item.name, item.worst_ratio, item.note) for item in report.failures()]


def test_dry_run_estimates(demo, full_build, tmp_path, capsys):
    command = [sys.executable, str(TOOLS / "build_predictor_dataset.py"), "--demo", str(demo), "--out",
               str(tmp_path / "unused"), "--dry_run"]
    result = subprocess.run(command, capture_output=True, text=True, env=ONE_THREAD_ENV, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    assert "dry run: 16 trajectories, 4 cases" in out and not (tmp_path / "unused").exists()
    estimated = int(out.split("per trajectory ")[1].split("(")[1].split(" bytes")[0])
    manifest = read_jsonl(full_build[0] / "manifest.jsonl")
    built = full_build[0] / next(entry["file"] for entry in manifest if entry["kind"] == "trajectory")
    assert abs(estimated - built.stat().st_size) / built.stat().st_size < 0.02
    # the real 480p_i2v Teacher at 30x52 (config only, no weights): the 8 rows of the demo train table
    real = tmp_path / "real_teacher"
    real.mkdir()
    (real / "config.json").write_text(json.dumps(TEACHER_PRESETS["worldplay_480p_i2v"]))
    options = builder.BuildOptions(teacher=real, samples=[str(demo / "samples" / "train.jsonl")], encoded=None,
                                   out=tmp_path / "unused", dry_run=True, assume_grid=(30, 52), assume_text_tokens=1000)
    assert builder.run(options) == 0
    out = capsys.readouterr().out
    per_trajectory = int(out.split("per trajectory ")[1].split("(")[1].split(" bytes")[0])
    tokens, hidden = 4 * 30 * 52, 2048
    steps = 8 * 4 * (2 * 32 * tokens * 2 + tokens * hidden * 2) + 8 * 32 * tokens * 2
    prefeatures = 4 * sum([0, 4, 8, 12, 16, 20, 20, 20]) * 30 * 52 * hidden * 2  # layers 0, 1, 52, 53
    assert abs(per_trajectory - (steps + prefeatures)) / per_trajectory < 1e-3
    assert "prefeature layers [0, 1, 52, 53]" in out and "8 trajectories" in out


# =============================================================================================================
# bad input: clear errors, finished shards untouched
# =============================================================================================================
def test_bad_inputs_name_file_and_field_and_leave_shards_untouched(demo, full_build, tmp_path):
    out, row, table = full_build
    before = _snapshot(out)

    def run(samples, encoded):
        return builder.run(_options(demo, str(samples), out, encoded=encoded))

    # 1. pose file with the wrong number of latents
    short = _write_table(demo, tmp_path / "short", "train", [row], SHORT_LATENTS)
    with pytest.raises(builder.DatasetInputError, match="num_latents=32") as error:
        run(short, demo / "encoded")
    assert str((short.parent / row["pose"]).resolve()) in str(error.value) and "field 'pose'" in str(error.value)

    # 2. encoder output with a wrong shape
    encoded = tmp_path / "encoded"
    shutil.copytree(demo / "encoded", encoded)
    payload = torch.load(encoded / f"{row['case_id']}.pt", weights_only=True)
    payload["image_cond"] = payload["image_cond"][:, :3]
    torch.save(payload, encoded / f"{row['case_id']}.pt")
    with pytest.raises(EncodedCaseError, match="field 'image_cond' has shape \\[1, 3, 1, 4, 6\\], expected \\[1, 4, 1"):
        run(table, encoded)

    # 3. missing encoder output
    (encoded / f"{row['case_id']}.pt").unlink()
    with pytest.raises(builder.DatasetInputError, match=f"{row['case_id']}.pt does not exist"):
        run(table, encoded)

    # 4. missing source image
    missing_image = tmp_path / "noimage" / "train.jsonl"
    missing_image.parent.mkdir()
    shutil.copytree(table.parent / "poses", missing_image.parent / "poses")
    missing_image.write_text(json.dumps({**row, "source_image": str(tmp_path / "nope.png")}) + "\n")
    with pytest.raises(SampleTableError, match="field 'source_image'.*nope.png"):
        run(missing_image, demo / "encoded")

    # 5. other settings than the dataset in --out was built with
    with pytest.raises(builder.DatasetInputError, match="prefeature_layers"):
        builder.run(_options(demo, str(table), out, prefeature_layers=(0,)))

    assert _snapshot(out) == before
