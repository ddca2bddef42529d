"""Bad input always gets one clear line and never costs data (issues 40 and 49; docs/runs.md, Bad input).

A table of bad inputs across the entry scripts, fvtools, the tools and the launchers, on tiny inputs built once per
module. Every case must end with:

* exit code 2;
* exactly one line on stderr, `<command>: error: ...`, that contains the name of the file, field or flag
  (progress-bar fragments and the `cpu threads:` notice a tool prints at start are not counted);
* no "Traceback" anywhere in the output;
* every file under the module's folder byte-identical to before, and nothing created (no run directory, no
  run.lock, no eval folder, no staging folder).

Most cases call `main(argv)` in-process (what the command line runs, through `runtime.errors.command`); a few run
as the user does, a subprocess per command, to show the interpreter prints no traceback, and the launchers run
through bash. The range cases are generated from the parsers themselves: every flag of `runtime.flags.FLAG_RULES`
a recipe has, and every `type=` made by `runtime.flags.checked`, gets a value its own rule refuses.

Section 7 holds a row (or more) for each class of issue 49: a builder writing into another kind of folder, a run
into a folder with step files it did not write, held-out splits and tables that disagree with the dataset, shards
checked when opened, inputs that used to end in a traceback (GPU-only flags, checkpoint keys and headers, broken
configs, values out of range, NaN or wrong-shape targets, an unresolvable MASTER_ADDR), and refusals met after a
command began writing (a Teacher whose weights do not fit, a NaN target met at step 1), which must leave nothing.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch

import fvtools.train_adversarial as train_adversarial
import fvtools.train_df_sft as train_df_sft
import fvtools.train_dmd2 as train_dmd2
import fvtools.train_kd as train_kd
import fvtools.train_nft as train_nft
import train_predictor_disca
import train_predictor_v4
import train_predictor_v4_rollout
from predictor_training.data.dataset_config import DATASET_CONFIG_NAME
from predictor_training.data.ode_cache import CACHE_CONFIG_NAME
from predictor_training.data.video_latents import CONFIG_NAME as VIDEO_CONFIG_NAME
from predictor_training.runtime.checkpoint import load_state_file
from predictor_training.runtime.inference_weights import TENSORS_SHA256_KEY, read_inference_metadata
from predictor_training.runtime.errors import DEBUG_ENV
from predictor_training.runtime.flags import FLAG_RULES
from tests.helpers.eval_world import write_eval_world
from tests.helpers.method_world import write_method_world
from tests.helpers.offline_dataset import train_args, write_tiny_dataset
from tests.helpers.rollout_setup import write_rollout_setup


REPO_ROOT = Path(__file__).resolve().parents[2]
PROGRESS = re.compile(r"\d+%\||\bit/s\]|^\s*$")  # tqdm fragments (tqdm redraws with \r) and blank pieces


def load_tool(name: str):
    spec = importlib.util.spec_from_file_location(f"bad_input_{name}", REPO_ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TOOLS = {name: load_tool(name) for name in (
    "eval_predictor", "leaderboard", "compute_video_metrics", "estimate_memory", "convert_sharded_checkpoint",
    "make_demo_assets", "make_sample_table", "build_demo_world", "build_predictor_dataset",
    "build_video_latent_dataset", "build_ode_cache", "encode_cases")}
MAINS = {
    "v4": train_predictor_v4.main, "disca": train_predictor_disca.main, "rollout": train_predictor_v4_rollout.main,
    "df_sft": train_df_sft.main, "kd": train_kd.main, "dmd2": train_dmd2.main, "nft": train_nft.main,
    "adversarial": train_adversarial.main, **{name: module.main for name, module in TOOLS.items()},
}


# ---------------------------------------------------------------------------------------------------------------
# The checks every case makes
# ---------------------------------------------------------------------------------------------------------------
def error_lines(stderr: str) -> list[str]:
    """The lines of stderr that are not progress bars or the cpu-threads notice."""
    return [line for line in re.split(r"[\r\n]", stderr) if not PROGRESS.search(line) and "cpu threads:" not in line]


def snapshot(root: Path) -> dict[str, str]:
    """{relative path: sha256 (files) or "dir"} of everything under `root`."""
    entries = {}
    for path in sorted(root.rglob("*")):
        relative = str(path.relative_to(root))
        entries[relative] = "dir" if path.is_dir() else hashlib.sha256(path.read_bytes()).hexdigest()
    return entries


def assert_one_line(returncode, stdout: str, stderr: str, names: str) -> str:
    lines = error_lines(stderr)
    assert returncode == 2, (returncode, stdout, stderr)
    assert "Traceback" not in stdout + stderr, stderr
    assert len(lines) == 1 and ": error: " in lines[0], stderr
    assert names in lines[0], (names, lines[0])
    return lines[0]


def refuse(capsys, command: str, argv: list[str], names: str, world: dict) -> str:
    """Run `command`'s main(argv) in-process: one line naming `names`, exit code 2, nothing changed on disk."""
    before = snapshot(world["root"])
    capsys.readouterr()
    try:
        with pytest.raises(SystemExit) as exited:
            MAINS[command]([str(arg) for arg in argv])
    finally:
        created = empty_outputs(world)
    out, err = capsys.readouterr()
    line = assert_one_line(exited.value.code, out, err, names)
    assert not created, f"{command} {argv}: created {created}"
    assert snapshot(world["root"]) == before, f"{command} {argv}: files changed"
    return line


def empty_outputs(world: dict) -> list[str]:
    """What a case created in the outputs folder, which is then emptied (so that a case that fails here does not
    hide, or fail, the next ones)."""
    created = sorted(str(path.relative_to(world["out"])) for path in world["out"].rglob("*"))
    shutil.rmtree(world["out"])
    world["out"].mkdir()
    return created


def run_subprocess(argv: list, env: dict | None = None) -> subprocess.CompletedProcess:
    # DATASET_ROOT set: a launcher never falls back to its CPU demo (which would build demo data)
    full_env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1", "DATASET_ROOT": "/nonexistent",
                "DEMO_ROOT": "/nonexistent", **(env or {})}
    return subprocess.run([str(arg) for arg in argv], cwd=REPO_ROOT, env=full_env, capture_output=True, text=True,
                          timeout=300)


# ---------------------------------------------------------------------------------------------------------------
# The tiny world every case reads (and must leave as it was)
# ---------------------------------------------------------------------------------------------------------------
def nan_copy(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    name = next(name for name, tensor in tensors.items() if tensor.is_floating_point() and tensor.numel() > 1)
    damaged = {key: value.clone() for key, value in tensors.items()}
    damaged[name].view(-1)[0] = float("nan")
    return damaged


def write_bad_files(bad: Path, good_safetensors: Path, good_state: Path) -> None:
    """Damaged copies of a good inference file and a good training state, and files of other kinds."""
    bad.mkdir()
    data = good_safetensors.read_bytes()
    (bad / "truncated.safetensors").write_bytes(data[: len(data) // 2])
    (bad / "empty.safetensors").write_bytes(b"")
    (bad / "garbage.safetensors").write_bytes(b"not a safetensors file at all " * 20)
    tensors = safetensors.torch.load_file(good_safetensors)
    with open(good_safetensors, "rb") as handle:  # the header's metadata, kept as written
        header = json.loads(handle.read(int.from_bytes(handle.read(8), "little")))["__metadata__"]
    # NaN weights in a file of the format before checksums (no tensors_sha256): the finite check must catch them
    old_format = {key: value for key, value in header.items() if key != TENSORS_SHA256_KEY}
    safetensors.torch.save_file(nan_copy(tensors), str(bad / "nan_step_00002.safetensors"), metadata=old_format)
    # Weights changed after writing (the checksum in the metadata no longer matches)
    changed = {key: value.clone() for key, value in tensors.items()}
    first = next(key for key, value in changed.items() if value.is_floating_point())
    changed[first].view(-1)[0] += 1
    safetensors.torch.save_file(changed, str(bad / "tampered_step_00002.safetensors"), metadata=header)
    state = good_state.read_bytes()
    (bad / "truncated.pt").write_bytes(state[: len(state) // 2])
    (bad / "garbage.pt").write_bytes(b"garbage " * 100)
    payload = load_state_file(good_state)
    payload["roles"]["predictor"]["model"] = nan_copy(payload["roles"]["predictor"]["model"])
    torch.save(payload, bad / "nan_training_latest.pt")
    (bad / "notes.txt").write_text("not a checkpoint\n")
    (bad / "a_file").write_text("a file where a folder is expected\n")


def damaged_datasets(root: Path, dataset: Path) -> dict[str, Path]:
    """Copies of the offline dataset, each with one problem."""
    made = {}

    def copy(name: str) -> Path:
        made[name] = root / name
        shutil.copytree(dataset, made[name])
        return made[name]

    trajectory = sorted((dataset / "trajectories").iterdir())[0].name
    (copy("missing_shard") / "trajectories" / trajectory).unlink()
    with open(copy("bad_manifest_line") / "manifest.jsonl", "a") as handle:
        handle.write("{this is not json\n")
    with open(copy("non_ascii_manifest") / "manifest.jsonl", "ab") as handle:
        handle.write(b'{"case_id": "\xff"}\n')
    (copy("bad_config") / DATASET_CONFIG_NAME).write_text("{not json")
    config = json.loads((dataset / DATASET_CONFIG_NAME).read_text())
    del config["num_steps"]
    (copy("config_without_num_steps") / DATASET_CONFIG_NAME).write_text(json.dumps(config))
    (copy("no_manifest") / "manifest.jsonl").unlink()
    return made


def write_tables(folder: Path, table: Path) -> dict[str, Path]:
    """Sample tables with one problem each, next to the good `table` (same poses and images)."""
    good = table.read_text().splitlines()
    first = json.loads(good[0])
    tables = {
        "bad_json": good[:1] + ["{not json"],
        "missing_field": [json.dumps({key: value for key, value in first.items() if key != "pose"})],
        "unknown_case": [json.dumps({**first, "case_id": "nobody"})],
        "not_an_object": ["[1, 2, 3]"],
    }
    paths = {}
    for name, lines in tables.items():
        paths[name] = folder / f"{name}.jsonl"
        paths[name].write_text("\n".join(lines) + "\n")
    paths["non_utf8_caption"] = folder / "non_utf8_caption.jsonl"
    paths["non_utf8_caption"].write_bytes(good[0].replace(first["caption"], "caf\udcff").encode(
        "utf-8", "surrogateescape") + b"\n")
    return paths


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("bad_input")
    w = {"root": root}
    # 1. The offline dataset and its Teacher; two finished v4 runs of other seeds.
    w["dataset"] = write_tiny_dataset(root / "offline")
    w["teacher"] = root / "offline" / "teacher"
    w["runs"] = root / "runs"
    for name, seed in (("a", "0"), ("b", "1")):
        assert train_predictor_v4.main(train_args(w["dataset"], w["runs"] / name, "--seed", seed, "--ckpt_every",
                                                  "1", steps=2)) == 0
    w["a"], w["b"] = w["runs"] / "a", w["runs"] / "b"
    write_bad_files(root / "bad", w["a"] / "predictor_step_00002.safetensors", w["a"] / "training_latest.pt")
    w["bad"] = root / "bad"
    w["damaged"] = damaged_datasets(root / "damaged", w["dataset"])
    # a copy of run a whose training_latest.pt is cut in half
    shutil.copytree(w["a"], root / "cut_run")
    latest = root / "cut_run" / "training_latest.pt"
    latest.write_bytes(latest.read_bytes()[:1000])
    w["cut_run"] = root / "cut_run"
    # 2. The rollout recipe's inputs (a case-only dataset, a sample table, an init file) and bad tables.
    w["rollout"] = write_rollout_setup(root / "rollout", 8, ["c0", "c1"], (0, 1))
    w["tables"] = write_tables(root / "rollout" / "samples", w["rollout"]["table"])
    # 3. The fvtools methods' video-latent dataset and Teacher.
    w["method"] = write_method_world(root / "method")
    # 4. The eval's tiny world (Teacher, VAE, encoded case, sample tables, an untrained checkpoint).
    w["eval"] = write_eval_world(root / "eval_world")
    # 5. Videos for compute_video_metrics: a scored pair with its earlier results, tiny frames, a non-image frame.
    w["videos"] = write_videos(root / "videos")
    # 6. Fake dataset roots: just the file that marks each kind (enough for the flag checks).
    for name, marker in (("fake_videos", VIDEO_CONFIG_NAME), ("fake_cache", CACHE_CONFIG_NAME)):
        (root / name).mkdir()
        (root / name / marker).write_text("{}")
    # 7. Issue 49's inputs: step files of another run, damaged copies of datasets, checkpoints and configs.
    write_issue49_inputs(root, w)
    w["out"] = root / "outputs"  # where a refused command would write: it must stay empty
    w["out"].mkdir()
    return w


def rewrite_trajectories(root: Path, change) -> None:
    """Apply `change(tensors)` to every trajectory file of the dataset at `root`, and record the new files in its
    manifest as the builder would (so the checksums match: the values themselves are bad)."""
    from predictor_training.data.shards import read_jsonl, write_jsonl_atomic, write_safetensors_atomic

    entries = read_jsonl(root / "manifest.jsonl")
    for entry in entries:
        if entry["kind"] == "trajectory":
            tensors = safetensors.torch.load_file(str(root / entry["file"]))
            change(tensors)
            facts = write_safetensors_atomic(root / entry["file"], tensors)
            entry.update(bytes=facts["bytes"], sha256=facts["sha256"], tensors=facts["tensors"],
                         tensor_crc32=facts["tensor_crc32"])
    write_jsonl_atomic(root / "manifest.jsonl", entries)


def inference_copy(source: Path, target: Path, change_tensors=None, change_header=None) -> Path:
    """A copy of an inference file whose tensors (checksum recomputed) or header fields are changed."""
    from predictor_training.runtime.inference_weights import tensors_sha256
    from predictor_training.runtime.io import save_safetensors

    tensors = safetensors.torch.load_file(str(source))
    with open(source, "rb") as handle:
        header = json.loads(handle.read(int.from_bytes(handle.read(8), "little")))["__metadata__"]
    if change_tensors is not None:
        change_tensors(tensors)
        header[TENSORS_SHA256_KEY] = tensors_sha256(tensors)
    if change_header is not None:
        change_header(header)
    save_safetensors(tensors, target, header)
    return target


def write_issue49_inputs(root: Path, w: dict) -> None:
    bad = w["bad"]
    # a folder that holds another run's step files (no training state of its own)
    (root / "foreign_steps").mkdir()
    shutil.copy(w["a"] / "predictor_step_00002.safetensors", root / "foreign_steps")
    w["foreign_steps"] = root / "foreign_steps"
    # offline datasets: a trajectory cut in half, NaN velocities (checksums match), a velocity of the wrong shape
    made = w["damaged"]
    trajectory = sorted((w["dataset"] / "trajectories").iterdir())[0].name
    shutil.copytree(w["dataset"], root / "damaged" / "cut_shard")
    cut = root / "damaged" / "cut_shard" / "trajectories" / trajectory
    cut.write_bytes(cut.read_bytes()[: cut.stat().st_size // 2])
    made["cut_shard"] = root / "damaged" / "cut_shard"

    def nan_velocities(tensors):
        for name in [name for name in tensors if name.endswith(".velocity")]:
            tensors[name] = torch.full_like(tensors[name], float("nan"))

    def narrow_velocity(tensors):
        tensors["chunk1.step2.velocity"] = tensors["chunk1.step2.velocity"][..., :-1].contiguous()

    for name, change in (("nan_targets", nan_velocities), ("wrong_shape_target", narrow_velocity)):
        shutil.copytree(w["dataset"], root / "damaged" / name)
        rewrite_trajectories(root / "damaged" / name, change)
        made[name] = root / "damaged" / name
    # the rollout dataset: a case the manifest records as held out (the table was rewritten since), a case cut short
    from predictor_training.data.shards import read_jsonl, write_jsonl_atomic

    held_out = root / "rollout_held_out"
    shutil.copytree(w["rollout"]["dataset"], held_out)
    entries = read_jsonl(held_out / "manifest.jsonl")
    for entry in entries:
        if entry["case_id"] == "c1":
            entry["split"] = "holdout25"
    write_jsonl_atomic(held_out / "manifest.jsonl", entries)
    w["rollout_held_out"] = held_out
    cut_case = root / "rollout_cut_case"
    shutil.copytree(w["rollout"]["dataset"], cut_case)
    case = cut_case / "cases" / "c0.safetensors"
    case.write_bytes(case.read_bytes()[:100])
    w["rollout_cut_case"] = cut_case
    # checkpoints: a wrong shape, a missing key, a header without meta or with a broken one; a training state whose
    # model has a key too many; a Teacher whose weights have one; a Teacher whose config.json is not JSON
    init = w["rollout"]["init"]
    first = next(name for name, tensor in safetensors.torch.load_file(str(init)).items() if tensor.dim() == 2)

    def narrow(tensors):
        tensors[first] = tensors[first][:, :-1].contiguous()

    inference_copy(init, bad / "wrong_shape_step_00100.safetensors", change_tensors=narrow)
    inference_copy(init, bad / "missing_key_step_00100.safetensors", change_tensors=lambda tensors: tensors.pop(first))
    inference_copy(init, bad / "no_meta_step_00100.safetensors", change_header=lambda header: header.pop("meta"))
    inference_copy(init, bad / "broken_meta_step_00100.safetensors",
                   change_header=lambda header: header.update(meta="{broken"))
    inference_copy(w["eval"]["ckpt"], bad / "eval_wrong_shape_step_00001.safetensors",
                   change_tensors=lambda tensors: tensors.update(extra=torch.zeros(2)))
    payload = load_state_file(w["a"] / "training_latest.pt")
    payload["roles"]["predictor"]["model"]["extra.weight"] = torch.zeros(2)
    torch.save(payload, bad / "extra_key_training_latest.pt")
    shutil.copytree(w["teacher"], root / "teacher_extra_key")
    weights = root / "teacher_extra_key" / "diffusion_pytorch_model.safetensors"
    safetensors.torch.save_file({**safetensors.torch.load_file(str(weights)), "extra.weight": torch.zeros(2)},
                                str(weights))
    shutil.copytree(w["teacher"], root / "teacher_bad_config")
    (root / "teacher_bad_config" / "config.json").write_text("{not json")
    # configs that are not JSON: an ODE cache's, a video-latent dataset's
    (root / "bad_cache").mkdir()
    (root / "bad_cache" / CACHE_CONFIG_NAME).write_text("{not json")
    shutil.copytree(w["method"]["videos"], root / "bad_videos")
    (root / "bad_videos" / VIDEO_CONFIG_NAME).write_text("{not json")


def write_videos(folder: Path) -> dict[str, Path]:
    from PIL import Image

    def frames(path: Path, size: int, count: int = 3) -> None:
        path.mkdir(parents=True)
        for index in range(count):
            Image.new("RGB", (size, size), (index * 40, 10, 20)).save(path / f"frame_{index}.png")

    for side in ("ref", "test"):
        frames(folder / side / "clip", 16)
        frames(folder / f"tiny_{side}" / "clip", 8)
        frames(folder / f"broken_{side}" / "clip", 16)
    (folder / "broken_test" / "clip" / "frame_1.png").write_bytes(b"not a png")
    (folder / "scored").mkdir()
    for name in ("metrics.json", "per_video.csv", "aggregate.csv"):
        (folder / "scored" / name).write_text(f"earlier results: {name}\n")
    return {name: folder / name for name in ("ref", "test", "tiny_ref", "tiny_test", "broken_ref", "broken_test",
                                              "scored")}


# ---------------------------------------------------------------------------------------------------------------
# 1. The offline recipes: runs, checkpoints, datasets, output folders
# ---------------------------------------------------------------------------------------------------------------
def offline(w, *extra, out: str = "new_run") -> list:
    return train_args(w["dataset"], w["out"] / out, *extra, steps=2)


def without_output_dir(argv: list) -> list:
    index = argv.index("--output_dir")
    return argv[:index] + argv[index + 2:]


OFFLINE_CASES = {
    # a resume must belong to the run directory it writes into (the issue's destroyed run)
    "resume_other_runs_prev_into_a_finished_run": (
        "v4", lambda w: train_args(w["dataset"], w["a"], "--resume", w["b"] / "training_prev.pt", steps=4),
        lambda w: "belongs to another run"),
    "resume_other_runs_latest_into_a_run": (
        "v4", lambda w: train_args(w["dataset"], w["a"], "--resume", w["b"] / "training_latest.pt", steps=4),
        lambda w: "--seed 1 there, 0 here"),
    "cross_variant_resume": (
        "disca", lambda w: offline(w, "--resume", w["a"] / "training_latest.pt"), lambda w: "variant"),
    "resume_other_source_blocks": (
        "v4", lambda w: offline(w, "--resume", w["a"] / "training_latest.pt", "--source_blocks", "1,0"),
        lambda w: "source_blocks"),
    "resume_other_precision": (
        "v4", lambda w: offline(w, "--resume", w["a"] / "training_latest.pt", "--precision", "fp32master"),
        lambda w: "precision"),
    "resume_missing_file": ("v4", lambda w: offline(w, "--resume", w["out"] / "gone.pt"), lambda w: "gone.pt"),
    "resume_truncated_state": (
        "v4", lambda w: offline(w, "--resume", w["bad"] / "truncated.pt"), lambda w: "truncated.pt"),
    "resume_garbage_state": ("v4", lambda w: offline(w, "--resume", w["bad"] / "garbage.pt"), lambda w: "garbage.pt"),
    "resume_text_file": ("v4", lambda w: offline(w, "--resume", w["bad"] / "notes.txt"), lambda w: "notes.txt"),
    "resume_nan_weights": (
        "v4", lambda w: offline(w, "--resume", w["bad"] / "nan_training_latest.pt"), lambda w: "NaN/Inf"),
    "continue_a_damaged_run": ("v4", lambda w: train_args(w["dataset"], w["cut_run"], "--seed", "0", "--ckpt_every",
                                                          "1", steps=2), lambda w: "training_latest.pt is damaged"),
    "run_directory_holds_other_settings": (
        "v4", lambda w: train_args(w["dataset"], w["a"], "--seed", "0", "--ckpt_every", "1", "--fusion_lr", "5e-3",
                                   steps=2), lambda w: "--fusion_lr"),
    "output_dir_is_the_dataset": (
        "v4", lambda w: train_args(w["dataset"], w["dataset"], steps=2), lambda w: "inside --dataset_root"),
    "output_dir_inside_the_dataset": (
        "disca", lambda w: train_args(w["dataset"], w["dataset"] / "runs" / "x", steps=2),
        lambda w: "inside --dataset_root"),
    "output_dir_inside_the_teacher": (
        "v4", lambda w: train_args(w["dataset"], w["teacher"] / "run", steps=2),
        lambda w: f"inside teacher.folder of {w['dataset'] / DATASET_CONFIG_NAME}"),
    "output_dir_inside_the_teacher_flag": (
        "disca", lambda w: train_args(w["dataset"], w["teacher"] / "run", "--teacher", w["teacher"], steps=2),
        lambda w: "inside --teacher"),
    "output_dir_is_a_file": (
        "v4", lambda w: train_args(w["dataset"], w["bad"] / "a_file", steps=2), lambda w: "a_file"),
    "output_root_under_a_file": (
        "v4", lambda w: without_output_dir(offline(w)) + ["--output_root", w["bad"] / "a_file" / "runs"],
        lambda w: "is a file"),
    "source_blocks_past_the_teacher": (
        "v4", lambda w: offline(w, "--source_blocks", "1,9"), lambda w: "--source_blocks 1,9"),
    "source_blocks_past_the_teacher_disca": (
        "disca", lambda w: offline(w, "--source_blocks", "0,2"), lambda w: "2 double blocks"),
    "blocks_lr_inf": ("v4", lambda w: offline(w, "--blocks_lr", "inf"), lambda w: "--blocks_lr"),
    "fusion_lr_nan": ("v4", lambda w: offline(w, "--fusion_lr", "nan"), lambda w: "--fusion_lr"),
    "pairs_past_the_last_step": ("v4", lambda w: offline(w, "--pairs", "0-5"), lambda w: "--pairs"),
    "pairs_not_a_pair": ("v4", lambda w: offline(w, "--pairs", "0-1-2"), lambda w: "--pairs"),
    "pairs_backwards": ("disca", lambda w: offline(w, "--pairs", "2-1"), lambda w: "--pairs"),
    "split_not_in_the_dataset": ("v4", lambda w: offline(w, "--split", "nope"), lambda w: "split 'nope'"),
    "batch_larger_than_the_dataset": ("disca", lambda w: offline(w, "--batch_size", "500"), lambda w: "--batch_size"),
    "teacher_folder_without_config": ("v4", lambda w: offline(w, "--teacher", w["out"]), lambda w: "--teacher"),
    "action_ckpt_missing": ("v4", lambda w: offline(w, "--action_ckpt", w["out"] / "a.safetensors"),
                            lambda w: "--action_ckpt"),
    "dataset_root_missing": ("v4", lambda w: train_args(w["out"] / "no_dataset", w["out"] / "r", steps=2),
                             lambda w: "--dataset_root"),
    "config_file_missing": ("v4", lambda w: offline(w, "--config", w["out"] / "recipe.yaml"), lambda w: "recipe.yaml"),
    "config_file_unknown_key": ("v4", lambda w: offline(w, "--config", w["root"] / "typo.yaml"),
                                lambda w: "fusion_lrr"),
    "config_file_not_a_mapping": ("disca", lambda w: offline(w, "--config", w["root"] / "list.yaml"),
                                  lambda w: "expected a mapping"),
    "unknown_flag": ("v4", lambda w: offline(w, "--fusion-lr", "1e-3"), lambda w: "--fusion-lr"),
    "not_a_number": ("v4", lambda w: offline(w, "--max_steps", "ten"), lambda w: "--max_steps"),
    "unknown_choice": ("disca", lambda w: offline(w, "--precision", "fp8"), lambda w: "--precision"),
    "velocity_and_hidden_weight_zero": ("v4", lambda w: offline(w, "--velocity_weight", "0", "--hidden_weight", "0"),
                                        lambda w: "nothing would be trained"),
}

for _name, _dataset in (("missing_shard", "does not exist"), ("bad_manifest_line", "not valid JSON"),
                        ("non_ascii_manifest", "not ASCII"), ("bad_config", "not valid JSON"),
                        ("config_without_num_steps", "num_steps"), ("no_manifest", "manifest not found")):
    for _command in ("v4", "disca"):
        OFFLINE_CASES[f"dataset_{_name}_{_command}"] = (
            _command, lambda w, name=_name: train_args(w["damaged"][name], w["out"] / "r", steps=2),
            lambda w, name=_name, text=_dataset: text)


@pytest.fixture(scope="module")
def config_files(world):
    (world["root"] / "typo.yaml").write_text("fusion_lrr: 1e-3\n")
    (world["root"] / "list.yaml").write_text("- 1\n- 2\n")
    return world


@pytest.mark.parametrize("case", sorted(OFFLINE_CASES))
def test_offline_recipes(case, config_files, capsys):
    command, argv, names = OFFLINE_CASES[case]
    refuse(capsys, command, argv(config_files), names(config_files), config_files)


def test_read_only_output_folder(world, capsys, monkeypatch):
    """A folder this user cannot write (as root every folder is writable, so the permission is what os.access
    reports): refused before the run directory or its lock is made."""
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: False if Path(path) == world["out"] else
                        real_access(path, mode))
    line = refuse(capsys, "v4", offline(world, out="locked/run"), "not writable", world)
    assert str(world["out"]) in line


# ---------------------------------------------------------------------------------------------------------------
# 2. The rollout recipe: its init weights and sample tables
# ---------------------------------------------------------------------------------------------------------------
def rollout(w, *extra, init=None) -> list:
    paths = w["rollout"]
    return ["--dataset_root", paths["dataset"], "--teacher", paths["teacher"], "--output_dir", w["out"] / "rollout",
            "--source_blocks", "1,2", "--precision", "fp32", "--backend", "gloo", "--num_workers", "0",
            "--tracker", "none", "--no_progress", "--max_steps", "2", "--scheduler_warmup_steps", "1",
            "--block_warmup_steps", "1", "--init_from", init or paths["init"], *extra]


ROLLOUT_CASES = {
    "init_from_nan_weights": (lambda w: rollout(w, "--source_blocks", "0,1",
                                                init=w["bad"] / "nan_step_00002.safetensors"), lambda w: "NaN/Inf"),
    "init_from_tampered_weights": (lambda w: rollout(w, "--source_blocks", "0,1",
                                                     init=w["bad"] / "tampered_step_00002.safetensors"),
                                   lambda w: TENSORS_SHA256_KEY),
    "init_from_truncated_safetensors": (lambda w: rollout(w, init=w["bad"] / "truncated.safetensors"),
                                        lambda w: "truncated.safetensors"),
    "init_from_empty_safetensors": (lambda w: rollout(w, init=w["bad"] / "empty.safetensors"),
                                    lambda w: "empty.safetensors"),
    "init_from_garbage_safetensors": (lambda w: rollout(w, init=w["bad"] / "garbage.safetensors"),
                                      lambda w: "garbage.safetensors"),
    "init_from_truncated_state": (lambda w: rollout(w, init=w["bad"] / "truncated.pt"), lambda w: "truncated.pt"),
    "init_from_nan_state": (lambda w: rollout(w, "--source_blocks", "0,1", init=w["bad"] / "nan_training_latest.pt"),
                            lambda w: "NaN/Inf"),
    "init_from_other_blocks": (lambda w: rollout(w, init=w["a"] / "predictor_step_00002.safetensors"),
                               lambda w: "source_blocks"),
    "init_from_wrong_kind_of_file": (lambda w: rollout(w, init=w["bad"] / "notes.txt"), lambda w: "--init_from"),
    "init_from_missing": (lambda w: rollout(w, init=w["out"] / "gone.safetensors"), lambda w: "gone.safetensors"),
    "sample_table_missing": (lambda w: rollout(w, "--sample_table", w["out"] / "gone.jsonl"), lambda w: "gone.jsonl"),
    "sample_table_bad_json": (lambda w: rollout(w, "--sample_table", w["tables"]["bad_json"]),
                              lambda w: "bad_json.jsonl line 2"),
    "sample_table_missing_field": (lambda w: rollout(w, "--sample_table", w["tables"]["missing_field"]),
                                   lambda w: "'pose'"),
    "sample_table_unknown_case": (lambda w: rollout(w, "--sample_table", w["tables"]["unknown_case"]),
                                  lambda w: "nobody"),
    "sample_table_not_an_object": (lambda w: rollout(w, "--sample_table", w["tables"]["not_an_object"]),
                                   lambda w: "not_an_object.jsonl line 1"),
    "sample_table_non_utf8_caption": (lambda w: rollout(w, "--sample_table", w["tables"]["non_utf8_caption"]),
                                      lambda w: "non_utf8_caption.jsonl line 1"),
    "subset_larger_than_the_table": (lambda w: rollout(w, "--subset_cases", "9"), lambda w: "subset_cases"),
    "subset_unknown_case": (lambda w: rollout(w, "--subset_cases", "c0,zz"), lambda w: "zz"),
    "source_blocks_past_the_teacher": (lambda w: rollout(w, "--source_blocks", "1,9"), lambda w: "--source_blocks"),
    "replace_steps_out_of_range": (lambda w: rollout(w, "--replace_steps", "0,4"), lambda w: "--replace_steps"),
    "init_from_and_resume": (lambda w: rollout(w, "--resume", w["a"] / "training_latest.pt"), lambda w: "--init_from"),
}


@pytest.mark.parametrize("case", sorted(ROLLOUT_CASES))
def test_rollout_recipe(case, world, capsys):
    argv, names = ROLLOUT_CASES[case]
    refuse(capsys, "rollout", argv(world), names(world), world)


# ---------------------------------------------------------------------------------------------------------------
# 3. The fvtools methods
# ---------------------------------------------------------------------------------------------------------------
def method(w, *extra, dataset=None) -> list:
    return ["--dataset_root", dataset or w["method"]["videos"], "--teacher", w["method"]["teacher"],
            "--no_action_ckpt", "--output_dir", w["out"] / "method", "--precision", "fp32", "--backend", "gloo", "--num_workers", "0",
            "--tracker", "none", "--no_progress", "--max_steps", "2", "--warmup_steps", "1", *extra]


METHOD_CASES = {
    "df_sft_dataset_missing": ("df_sft", lambda w: method(w, dataset=w["out"] / "none"), lambda w: "--dataset_root"),
    "df_sft_split_missing": ("df_sft", lambda w: method(w, "--split", "nope"), lambda w: "'nope'"),
    "df_sft_output_inside_dataset": (
        "df_sft", lambda w: [*method(w), "--output_dir", w["method"]["videos"] / "run"], lambda w: "inside"),
    "df_sft_sigma_range_reversed": ("df_sft", lambda w: method(w, "--sigma_min", "0.9", "--sigma_max", "0.1"),
                                    lambda w: "--sigma_min"),
    "df_sft_lora_rank_zero": ("df_sft", lambda w: method(w, "--lora_rank", "0"), lambda w: "--lora_rank"),
    "df_sft_teacher_missing": ("df_sft", lambda w: [*method(w), "--teacher", w["out"]], lambda w: "--teacher"),
    "df_sft_resume_other_method": (
        "df_sft", lambda w: method(w, "--resume", w["a"] / "training_latest.pt"), lambda w: "method"),
    "kd_cache_missing": ("kd", lambda w: ["--cache_root", w["out"] / "none", "--teacher", w["method"]["teacher"],
                                          "--no_action_ckpt", "--output_dir", w["out"] / "kd"],
                         lambda w: "--cache_root"),
    "dmd2_init_from_missing": ("dmd2", lambda w: method(w, "--real_score", w["method"]["teacher"], "--init_from",
                                                        w["out"] / "gone.pt", "--generator_every", "1"),
                               lambda w: "gone.pt"),
    "dmd2_truth_weight_negative": ("dmd2", lambda w: method(w, "--real_score", w["method"]["teacher"],
                                                            "--truth_weight", "-1"),
                                   lambda w: "--truth_weight"),
    "nft_rewards_unknown": ("nft", lambda w: method(w, "--rewards", "beauty:1"), lambda w: "beauty"),
    "adversarial_source_blocks_past_the_teacher": (
        "adversarial", lambda w: offline(w, "--source_blocks", "0,7"), lambda w: "--source_blocks"),
}


@pytest.mark.parametrize("case", sorted(METHOD_CASES))
def test_fvtools_methods(case, world, capsys):
    command, argv, names = METHOD_CASES[case]
    refuse(capsys, command, argv(world), names(world), world)


# ---------------------------------------------------------------------------------------------------------------
# 4. The tools
# ---------------------------------------------------------------------------------------------------------------
def evaluate(w, *extra, ckpt=None) -> list:
    root = w["eval"]["root"]
    return ["--teacher", root / "teacher", "--vae", root / "vae", "--samples_dir", root / "samples", "--encoded",
            root / "encoded", "--split", "holdout25", "--num_latents", "8", "--ckpt", ckpt or w["eval"]["ckpt"],
            "--lpips_random_backbone", "--output_root", w["out"] / "eval", "--no_progress", *extra]


def metrics(w, ref, test, *extra, out=None) -> list:
    return [w["videos"][ref], w["videos"][test], "--out", out or w["out"] / "metrics", "--lpips_random_backbone",
            "--device", "cpu", *extra]


TOOL_CASES = {
    "eval_ckpt_nan_weights": ("eval_predictor", lambda w: evaluate(w, ckpt=w["bad"] / "nan_step_00002.safetensors"),
                              lambda w: "NaN/Inf"),
    "eval_ckpt_tampered": ("eval_predictor", lambda w: evaluate(w, ckpt=w["bad"] / "tampered_step_00002.safetensors"),
                           lambda w: TENSORS_SHA256_KEY),
    "eval_ckpt_truncated": ("eval_predictor", lambda w: evaluate(w, ckpt=w["bad"] / "truncated.safetensors"),
                            lambda w: "truncated.safetensors"),
    "eval_ckpt_empty": ("eval_predictor", lambda w: evaluate(w, ckpt=w["bad"] / "empty.safetensors"),
                        lambda w: "empty.safetensors"),
    "eval_ckpt_garbage": ("eval_predictor", lambda w: evaluate(w, ckpt=w["bad"] / "garbage.safetensors"),
                          lambda w: "garbage.safetensors"),
    "eval_ckpt_damaged_state": ("eval_predictor", lambda w: evaluate(w, ckpt=w["bad"] / "truncated.pt"),
                                lambda w: "truncated.pt"),
    "eval_ckpt_missing": ("eval_predictor", lambda w: evaluate(w, ckpt=w["out"] / "gone.safetensors"),
                          lambda w: "gone.safetensors"),
    "eval_ckpt_wrong_kind": ("eval_predictor", lambda w: evaluate(w, ckpt=w["bad"] / "notes.txt"),
                             lambda w: "notes.txt"),
    "eval_split_unknown": ("eval_predictor", lambda w: evaluate(w, "--split", "nope"), lambda w: "--split"),
    "leaderboard_baseline_not_a_row": ("leaderboard", lambda w: evaluate(w, "--samplers", "3", "--caches", "",
                                                                         "--baseline", "sampler_1step_frrr"),
                                       lambda w: "--baseline"),
    "eval_replace_steps_out_of_range": ("eval_predictor", lambda w: evaluate(w, "--replace_steps", "0,1"),
                                        lambda w: "outside 1..3"),
    "metrics_out_holds_earlier_results": ("compute_video_metrics",
                                          lambda w: metrics(w, "ref", "test", out=w["videos"]["scored"]),
                                          lambda w: "--overwrite"),
    "metrics_out_inside_an_input": ("compute_video_metrics",
                                    lambda w: metrics(w, "ref", "test", out=w["videos"]["ref"] / "m"),
                                    lambda w: "inside REF_DIR"),
    "metrics_tiny_frames": ("compute_video_metrics", lambda w: metrics(w, "tiny_ref", "tiny_test"),
                            lambda w: "8x8 pixels"),
    "metrics_non_image_frame": ("compute_video_metrics", lambda w: metrics(w, "broken_ref", "broken_test"),
                                lambda w: "frame_1.png"),
    "metrics_frame_batch_zero": ("compute_video_metrics", lambda w: metrics(w, "ref", "test", "--frame_batch", "0"),
                                 lambda w: "--frame_batch"),
    "metrics_no_videos_in_test": ("compute_video_metrics", lambda w: metrics(w, "ref", "scored"),
                                  lambda w: "scored"),
    "metrics_missing_folder": ("compute_video_metrics",
                               lambda w: [w["out"] / "none", w["videos"]["test"], "--out", w["out"] / "m"],
                               lambda w: "REF_DIR"),
    "estimate_context_frames_500": ("estimate_memory", lambda w: ["--recipe", "v4", "--context_frames", "500"],
                                    lambda w: "--context_frames 500"),
    "estimate_context_frames_not_whole_chunks": ("estimate_memory",
                                                 lambda w: ["--recipe", "v4", "--context_frames", "6"],
                                                 lambda w: "--context_frames 6"),
    "estimate_context_frames_negative": ("estimate_memory", lambda w: ["--recipe", "v4", "--context_frames", "-4"],
                                         lambda w: "--context_frames -4"),
    "estimate_text_tokens_past_the_encoder": ("estimate_memory",
                                              lambda w: ["--recipe", "v4", "--text_tokens", "5000"],
                                              lambda w: "--text_tokens 5000"),
    "estimate_text_tokens_zero": ("estimate_memory", lambda w: ["--recipe", "disca", "--text_tokens", "0"],
                                  lambda w: "--text_tokens 0"),
    "estimate_batch_size_zero": ("estimate_memory", lambda w: ["--recipe", "v4", "--batch_size", "0"],
                                 lambda w: "--batch_size"),
    "estimate_chunks_one": ("estimate_memory", lambda w: ["--recipe", "rollout", "--chunks", "1"],
                            lambda w: "--chunks"),
    "estimate_replace_steps_zero": ("estimate_memory", lambda w: ["--recipe", "rollout", "--replace_steps", "0"],
                                    lambda w: "--replace_steps"),
    "estimate_unknown_recipe": ("estimate_memory", lambda w: ["--recipe", "v5"], lambda w: "--recipe"),
    "convert_not_sharded": ("convert_sharded_checkpoint",
                            lambda w: [w["a"] / "training_latest.pt", "--out", w["out"] / "c.safetensors"],
                            lambda w: "holds no sharded role"),
    "convert_garbage_state": ("convert_sharded_checkpoint",
                              lambda w: [w["bad"] / "garbage.pt", "--out", w["out"] / "c.safetensors"],
                              lambda w: "garbage.pt"),
    "convert_folder_not_sharded": ("convert_sharded_checkpoint",
                                   lambda w: [w["root"] / "empty.dcp", "--out", w["out"] / "c.safetensors"],
                                   lambda w: "empty.dcp"),
    "convert_damaged_metadata": ("convert_sharded_checkpoint",
                                 lambda w: [w["root"] / "damaged.dcp", "--out", w["out"] / "c.safetensors"],
                                 lambda w: ".metadata"),
    "convert_out_exists": ("convert_sharded_checkpoint",
                           lambda w: [w["a"] / "training_latest.pt", "--out", w["a"] / "predictor_step_00002.safetensors"],
                           lambda w: "--overwrite"),
    "demo_assets_without_world_weights": ("make_demo_assets",
                                          lambda w: ["--out", w["out"] / "demo", "--world_weights", w["out"] / "none"],
                                          lambda w: "vae/config.json"),
    "demo_assets_out_exists": ("make_demo_assets", lambda w: ["--out", w["a"], "--kind", "random"],
                               lambda w: "--overwrite"),
    "world_build_kd_lr_per_round": ("build_demo_world", lambda w: ["--out", w["out"] / "world", "--teacher_from", "kd",
                                                                   "--kd_steps", "5,6,7", "--kd_lr", "1e-4,2e-4"],
                                    lambda w: "--kd_lr: 2 values for 3 rounds of --kd_steps; expected one or one per round"),
    "world_build_dmd_truth_weight_negative": (
        "build_demo_world", lambda w: ["--out", w["out"] / "world", "--teacher_from", "dmd", "--dmd_truth_weight", "-1"],
        lambda w: "--dmd_truth_weight"),
    "world_build_kd_steps_not_numbers": ("build_demo_world", lambda w: ["--out", w["out"] / "world", "--kd_steps", "5,x"],
                                         lambda w: "--kd_steps / --kd_lr: comma-separated numbers expected"),
    "sample_table_tool_non_utf8_cases": ("make_sample_table",
                                         lambda w: ["--cases", w["tables"]["non_utf8_caption"], "--out",
                                                    w["out"] / "tables"], lambda w: "non_utf8_caption.jsonl line 1"),
    "sample_table_tool_unknown_action": ("make_sample_table",
                                         lambda w: ["--cases", w["tables"]["bad_json"], "--out", w["out"] / "t",
                                                    "--actions", "0,9"], lambda w: "--actions"),
}


@pytest.fixture(scope="module")
def sharded_folders(world):
    (world["root"] / "empty.dcp").mkdir()
    (world["root"] / "damaged.dcp").mkdir()
    (world["root"] / "damaged.dcp" / ".metadata").write_bytes(b"junk metadata")
    return world


@pytest.mark.parametrize("case", sorted(TOOL_CASES))
def test_tools(case, sharded_folders, capsys):
    command, argv, names = TOOL_CASES[case]
    refuse(capsys, command, argv(sharded_folders), names(sharded_folders), sharded_folders)


# ---------------------------------------------------------------------------------------------------------------
# 5. Range cases generated from the parsers: a refused value for every rule
# ---------------------------------------------------------------------------------------------------------------
def base_argv(w, recipe: str) -> list:
    """Flags each recipe's parser accepts on the tiny world (the start of every generated case)."""
    fake_videos, teacher = w["root"] / "fake_videos", w["method"]["teacher"]
    return {
        "v4": offline(w), "disca": offline(w), "adversarial": offline(w),
        "rollout": rollout(w),
        "df_sft": method(w, dataset=fake_videos),
        "nft": method(w, dataset=fake_videos),
        "dmd2": method(w, "--generator", "student", "--real_score", teacher, dataset=fake_videos),
        "kd": ["--cache_root", w["root"] / "fake_cache", "--teacher", teacher, "--no_action_ckpt", "--output_dir",
               w["out"] / "kd"],
    }[recipe]


PARSERS = {"v4": train_predictor_v4, "disca": train_predictor_disca, "rollout": train_predictor_v4_rollout,
           "df_sft": train_df_sft, "kd": train_kd, "dmd2": train_dmd2, "nft": train_nft,
           "adversarial": train_adversarial}
CANDIDATES = (-1, 0, -2, 10**9, 0.5, 1.5, -0.5)


def refused_value(ok, parse_flags: dict):
    """A value the rule refuses (the first of a few candidates), or None for a rule on paths."""
    for value in CANDIDATES:
        try:
            if not ok(value, parse_flags):
                return value
        except (TypeError, AttributeError):
            return None
    return None


def parser_of(module) -> argparse.ArgumentParser:
    """The recipe's parser, as built by its parse_args (caught before it parses)."""
    captured = {}
    original = argparse.ArgumentParser.parse_args

    def capture(self, args=None, namespace=None):
        captured.setdefault("parser", self)
        raise SystemExit(0)

    argparse.ArgumentParser.parse_args = capture
    try:
        with pytest.raises(SystemExit):
            module.parse_args(["--help"])
    finally:
        argparse.ArgumentParser.parse_args = original
    return captured["parser"]


def generated_cases() -> list[tuple[str, str, str]]:
    """(recipe, flag, value) for every flag rule and every checked type of every recipe parser."""
    cases = []
    for recipe, module in PARSERS.items():
        parser = parser_of(module)
        defaults = {action.dest: action.default for action in parser._actions}
        defaults["dataset_config_name"] = "config.json"
        for action in parser._actions:
            if not action.option_strings:
                continue
            ok = None
            if action.dest in FLAG_RULES:
                ok = FLAG_RULES[action.dest][0]
            elif hasattr(action.type, "ok"):
                type_ok = action.type.ok
                ok = lambda value, flags, type_ok=type_ok: type_ok(value)  # noqa: E731
            if ok is None:
                continue
            value = refused_value(ok, defaults)
            if value is None:  # a rule on paths: a folder that does not exist
                value = "/nonexistent/bad_input_path"
            cases.append((recipe, action.option_strings[0], str(value)))
    return cases


GENERATED = generated_cases()


@pytest.mark.parametrize("recipe, flag, value", GENERATED, ids=[f"{r}{f}={v}" for r, f, v in GENERATED])
def test_generated_range_cases(recipe, flag, value, world, capsys):
    """The recipe's parse: one line naming the flag and exit 2 (nothing runs after a parse error, so nothing on
    disk can change; the in-process parse is enough)."""
    argv = [str(arg) for arg in base_argv(world, recipe)]
    with pytest.raises(SystemExit) as exited:
        PARSERS[recipe].parse_args([*argv, flag, value])
    out, err = capsys.readouterr()
    assert_one_line(exited.value.code, out, err, flag)


def test_every_recipe_parser_has_generated_cases():
    """A parser that no longer reaches this test (renamed, or its rules moved) would silently drop its cases."""
    counts = {recipe: sum(1 for case in GENERATED if case[0] == recipe) for recipe in PARSERS}
    assert all(count >= 15 for count in counts.values()), counts


# ---------------------------------------------------------------------------------------------------------------
# 6. As the user runs them: subprocesses and launchers (no interpreter traceback, no run directory)
# ---------------------------------------------------------------------------------------------------------------
SUBPROCESS_CASES = {
    "v4_resume_garbage": (lambda w: [sys.executable, "train_predictor_v4.py", *offline(w, "--resume",
                                                                                       w["bad"] / "garbage.pt")],
                          None, lambda w: "garbage.pt"),
    "eval_nan_ckpt": (lambda w: [sys.executable, "tools/eval_predictor.py",
                                 *evaluate(w, ckpt=w["bad"] / "nan_step_00002.safetensors")], None,
                      lambda w: "NaN/Inf"),
    "df_sft_missing_dataset": (lambda w: [sys.executable, "fvtools/train_df_sft.py",
                                          *method(w, dataset=w["out"] / "none")], None, lambda w: "--dataset_root"),
    "metrics_earlier_results": (lambda w: [sys.executable, "tools/compute_video_metrics.py",
                                           *metrics(w, "ref", "test", out=w["videos"]["scored"])], None,
                                lambda w: "--overwrite"),
    "launcher_nproc_zero": (lambda w: ["bash", "tools/launch_predictor_v4_training.sh", *offline(w)],
                            {"NPROC_PER_NODE": "0"}, lambda w: "NPROC_PER_NODE=0"),
    "launcher_nproc_not_a_number": (lambda w: ["bash", "tools/launch_fvtools_df_sft.sh", *method(w)],
                                    {"NPROC_PER_NODE": "abc"}, lambda w: "NPROC_PER_NODE=abc"),
    "launcher_pairs_past_the_last_step": (lambda w: ["bash", "tools/launch_predictor_v4_training.sh", *offline(w)],
                                          {"PAIRS": "0-5", "NPROC_PER_NODE": "1"}, lambda w: "--pairs"),
    "launcher_blocks_lr_inf": (lambda w: ["bash", "tools/launch_predictor_disca_training.sh", *offline(w),
                                          "--blocks_lr", "inf"], {"NPROC_PER_NODE": "1"}, lambda w: "--blocks_lr"),
    "launcher_resume_other_run": (lambda w: ["bash", "tools/launch_predictor_v4_training.sh", w["a"], "0,1",
                                             w["b"] / "training_prev.pt",
                                             *without_output_dir(train_args(w["dataset"], w["a"], steps=4))],
                                  {"NPROC_PER_NODE": "1"}, lambda w: "belongs to another run"),
}


@pytest.mark.slow  # a Python start with torch per case (launchers: two), 5-30 s each on a busy 2-core machine
@pytest.mark.parametrize("case", sorted(SUBPROCESS_CASES))
def test_as_the_user_runs_it(case, world):
    argv, env, names = SUBPROCESS_CASES[case]
    before = snapshot(world["root"])
    result = run_subprocess(argv(world), env)
    created = empty_outputs(world)
    assert_one_line(result.returncode, result.stdout, result.stderr, names(world))
    assert not created and snapshot(world["root"]) == before, created


@pytest.mark.slow
def test_debug_environment_variable_shows_the_traceback(world):
    result = run_subprocess([sys.executable, "train_predictor_v4.py", *offline(world, "--resume",
                                                                              world["bad"] / "garbage.pt")],
                            {DEBUG_ENV: "1"})
    assert result.returncode != 0 and "Traceback" in result.stderr and "DamagedTrainingStateError" in result.stderr


def test_an_inference_file_carries_the_checksum_of_its_tensors(world):
    """What `tampered` and `nan` rely on: a new file records tensors_sha256; an old file without it still loads."""
    from predictor_training.runtime.inference_weights import read_inference_weights

    good = world["a"] / "predictor_step_00002.safetensors"
    with open(good, "rb") as handle:
        header = json.loads(handle.read(int.from_bytes(handle.read(8), "little")))["__metadata__"]
    assert len(header[TENSORS_SHA256_KEY]) == 64 and "step" in read_inference_metadata(good)
    old = world["out"] / "old_format_step_00002.safetensors"
    tensors = safetensors.torch.load_file(good)
    safetensors.torch.save_file(tensors, str(old), metadata={k: v for k, v in header.items()
                                                               if k != TENSORS_SHA256_KEY})
    try:
        loaded = read_inference_weights(old)
        assert all(torch.equal(loaded[name], tensors[name]) for name in tensors)
    finally:
        old.unlink()


def test_a_caption_cut_at_the_token_limit_is_named(capsys):
    """A caption that fills every text token was cut there: one warning naming the case (the encoders' tokenizer
    keeps at most its max length, as upstream); a shorter one says nothing."""
    from predictor_training.data.encoders import warn_if_caption_truncated

    warn_if_caption_truncated({"prompt_mask": torch.ones(1, 8, dtype=torch.long)}, "case 'c007'", "x" * 10**6)
    warning = capsys.readouterr().err.strip()
    assert warning.startswith("warning: case 'c007'") and "1000000 characters" in warning and "8 text tokens" in warning
    warn_if_caption_truncated({"prompt_mask": torch.tensor([[1, 1, 0, 0]])}, "case 'c008'", "short")
    assert capsys.readouterr().err == ""


# ---------------------------------------------------------------------------------------------------------------
# 7. Issue 49: each class of bad input closed where it arises
# ---------------------------------------------------------------------------------------------------------------
def video_build(w, out) -> list:
    return ["--clips", w["tables"]["bad_json"], "--encoders", w["root"], "--out", out, "--device", "cpu"]


def predictor_build(w, out) -> list:
    return ["--teacher", w["teacher"], "--samples", w["rollout"]["table"], "--encoded", w["root"], "--out", out,
            "--device", "cpu"]


def ode_build(w, out, *extra) -> list:
    return ["--teacher", w["method"]["teacher"], "--video_latents", w["method"]["videos"], "--steps", "4",
            "--dtype", "float32", "--backend", "gloo", "--out", out, *extra]


ISSUE49_CASES = {
    # 1. A builder writes only into a new or empty folder, or its own kind alone.
    "video_builder_into_a_predictor_dataset": ("build_video_latent_dataset", lambda w: video_build(w, w["dataset"]),
                                               lambda w: f"--out {w['dataset']}: holds a Predictor dataset"),
    "predictor_builder_into_a_video_dataset": ("build_predictor_dataset",
                                               lambda w: predictor_build(w, w["method"]["videos"]),
                                               lambda w: "holds a video-latent dataset"),
    "predictor_builder_into_a_plain_folder": ("build_predictor_dataset",
                                              lambda w: predictor_build(w, w["root"] / "bad"),
                                              lambda w: "but no dataset_config.json"),
    "ode_cache_into_a_run_directory": ("build_ode_cache", lambda w: ode_build(w, w["a"]),
                                       lambda w: f"--out {w['a']}: holds a run directory"),
    "ode_cache_into_a_video_dataset": ("build_ode_cache", lambda w: ode_build(w, w["method"]["videos"]),
                                       lambda w: "holds a video-latent dataset"),
    "demo_assets_overwrite_a_dataset": ("make_demo_assets", lambda w: ["--out", w["dataset"], "--overwrite", "--kind",
                                                                       "random"],
                                        lambda w: "holds a Predictor dataset"),
    "sample_tables_into_a_dataset": ("make_sample_table", lambda w: ["--cases", w["tables"]["bad_json"], "--out",
                                                                     w["dataset"]],
                                     lambda w: "--out " + str(w["dataset"]) + ": holds a Predictor dataset"),
    "encoder_outputs_into_a_dataset": ("encode_cases", lambda w: ["--encoders", w["root"], "--cases",
                                                                  w["tables"]["bad_json"], "--out", w["dataset"],
                                                                  "--device", "cpu"],
                                       lambda w: "holds a Predictor dataset"),
    # 2. A run never overwrites or prunes step files it did not write.
    "run_into_a_folder_with_another_runs_step_files": (
        "v4", lambda w: train_args(w["dataset"], w["foreign_steps"], steps=2),
        lambda w: "predictor_step_00002.safetensors (1 step file(s)) but no training_latest.pt"),
    # 3. Held-out splits are not trained on; a table the dataset records otherwise is refused.
    "v4_held_out_split": ("v4", lambda w: offline(w, "--split", "holdout25"), lambda w: "--split='holdout25'"),
    "disca_held_out_split": ("disca", lambda w: offline(w, "--split", "holdout50"), lambda w: "--split='holdout50'"),
    "rollout_held_out_split": ("rollout", lambda w: rollout(w, "--split", "holdout25"), lambda w: "--split"),
    "df_sft_held_out_split": ("df_sft", lambda w: method(w, "--split", "holdout"), lambda w: "--split='holdout'"),
    "rollout_table_with_a_case_the_dataset_holds_out": (
        "rollout", lambda w: [*rollout(w), "--dataset_root", w["rollout_held_out"]],
        lambda w: "case 'c1' (1 of 2 cases) is recorded as split 'holdout25'"),
    # 4. Every file a run reads is checked against its manifest size when the dataset is opened.
    "v4_shard_cut_in_half": ("v4", lambda w: train_args(w["damaged"]["cut_shard"], w["out"] / "r", steps=2),
                             lambda w: "records"),
    "disca_shard_cut_in_half": ("disca", lambda w: train_args(w["damaged"]["cut_shard"], w["out"] / "r", steps=2),
                                lambda w: "bytes, but"),
    "rollout_case_cut_short": ("rollout", lambda w: [*rollout(w), "--dataset_root", w["rollout_cut_case"]],
                               lambda w: "c0.safetensors: 100 bytes"),
    # 5. One line instead of a traceback: checkpoint keys, shapes and headers; broken configs; values out of
    #    range; NaN or wrong-shape targets.
    "rollout_init_from_a_wrong_shape": ("rollout", lambda w: rollout(
        w, "--source_blocks", "0,2", init=w["bad"] / "wrong_shape_step_00100.safetensors"),
        lambda w: "wrong_shape_step_00100.safetensors: its weights do not fit the model"),
    "rollout_init_from_a_missing_key": ("rollout", lambda w: rollout(
        w, "--source_blocks", "0,2", init=w["bad"] / "missing_key_step_00100.safetensors"), lambda w: "1 missing keys"),
    "rollout_init_from_a_header_without_meta": ("rollout", lambda w: rollout(
        w, init=w["bad"] / "no_meta_step_00100.safetensors"), lambda w: "no_meta_step_00100.safetensors: the header "
                                                                         "has no 'meta' field"),
    "rollout_init_from_a_broken_header": ("rollout", lambda w: rollout(
        w, init=w["bad"] / "broken_meta_step_00100.safetensors"), lambda w: "'meta' field is not valid JSON"),
    "eval_ckpt_with_an_extra_key": ("eval_predictor", lambda w: evaluate(
        w, ckpt=w["bad"] / "eval_wrong_shape_step_00001.safetensors"), lambda w: "1 unexpected keys (e.g. extra)"),
    "resume_a_state_with_an_extra_key": ("v4", lambda w: offline(w, "--resume",
                                                                 w["bad"] / "extra_key_training_latest.pt"),
                                         lambda w: "(role 'predictor'): its weights do not fit the model"),
    "teacher_weights_with_an_extra_key": ("v4", lambda w: offline(w, "--teacher", w["root"] / "teacher_extra_key"),
                                          lambda w: "unexpected keys (1): extra.weight"),
    "teacher_config_not_json": ("v4", lambda w: offline(w, "--teacher", w["root"] / "teacher_bad_config"),
                                lambda w: "config.json: not valid JSON"),
    "builder_teacher_config_not_json": ("build_predictor_dataset", lambda w: [
        *predictor_build(w, w["out"] / "ds"), "--teacher", w["root"] / "teacher_bad_config"],
        lambda w: "config.json: not valid JSON"),
    "ode_cache_config_not_json": ("kd", lambda w: ["--cache_root", w["root"] / "bad_cache", "--teacher",
                                                   w["method"]["teacher"], "--output_dir", w["out"] / "kd"],
                                  lambda w: f"{CACHE_CONFIG_NAME}: not valid JSON"),
    "video_dataset_config_not_json": ("df_sft", lambda w: method(w, dataset=w["root"] / "bad_videos"),
                                      lambda w: f"{VIDEO_CONFIG_NAME}: not valid JSON"),
    "seed_past_numpy": ("v4", lambda w: offline(w, "--seed", str(2**32)), lambda w: "--seed"),
    "method_seed_past_numpy": ("nft", lambda w: method(w, "--seed", str(2**40)), lambda w: "--seed"),
    "subset_seed_past_the_range": ("rollout", lambda w: rollout(w, "--subset_cases", "1", "--subset_seed",
                                                                str(2**70)), lambda w: "--subset_seed"),
    "split_seed_negative": ("make_sample_table", lambda w: ["--cases", w["tables"]["bad_json"], "--out",
                                                            w["out"] / "t", "--split-seed", "-1"],
                            lambda w: "--split-seed"),
    "ode_cache_seed_past_the_range": ("build_ode_cache", lambda w: ode_build(w, w["out"] / "c", "--seed", str(2**33)),
                                      lambda w: "--seed"),
    "lora_rank_past_the_teacher": ("df_sft", lambda w: method(w, "--lora_rank", "100000"),
                                   lambda w: "--lora_rank 100000"),
    "nan_training_targets": ("v4", lambda w: train_args(w["damaged"]["nan_targets"], w["out"] / "r", steps=2),
                             lambda w: "holds NaN/Inf"),
    "wrong_shape_training_target": (
        "disca", lambda w: train_args(w["damaged"]["wrong_shape_target"], w["out"] / "r", steps=2),
        lambda w: "tensor 'chunk1.step2.velocity' has shape [4, 4, 2, 2]; expected [4, 4, 2, 3]"),
}


@pytest.mark.parametrize("case", sorted(ISSUE49_CASES))
def test_issue49_classes(case, world, capsys):
    command, argv, names = ISSUE49_CASES[case]
    refuse(capsys, command, argv(world), names(world), world)


def test_the_nan_target_file_is_named(world, capsys):
    line = refuse(capsys, "v4", train_args(world["damaged"]["nan_targets"], world["out"] / "r", steps=2), "NaN/Inf",
                  world)
    assert str(world["damaged"]["nan_targets"] / "trajectories") in line and ".velocity" in line


GPU_ONLY = {
    "v4_backend_nccl": ("v4", lambda w: offline(w, "--backend", "nccl")),
    "df_sft_backend_nccl": ("df_sft", lambda w: [*method(w), "--backend", "nccl"]),
    "video_builder_device_cuda": ("build_video_latent_dataset", lambda w: [*video_build(w, w["out"] / "v"),
                                                                           "--device", "cuda"]),
    "predictor_builder_device_cuda": ("build_predictor_dataset", lambda w: [*predictor_build(w, w["out"] / "d"),
                                                                            "--device", "cuda"]),
    "ode_cache_backend_nccl": ("build_ode_cache", lambda w: [*ode_build(w, w["out"] / "c"), "--backend", "nccl"]),
    "eval_backend_nccl": ("eval_predictor", lambda w: evaluate(w, "--backend", "nccl")),
    "encode_cases_device_cuda": ("encode_cases", lambda w: ["--encoders", w["root"], "--cases",
                                                            w["tables"]["bad_json"], "--out", w["out"] / "e"]),
}


@pytest.mark.parametrize("case", sorted(GPU_ONLY))
def test_gpu_only_flags_on_a_machine_without_cuda(case, world, capsys, monkeypatch):
    """On a CPU machine (CUDA hidden where there is one) a GPU-only flag is one line naming it, before anything."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    command, argv = GPU_ONLY[case]
    refuse(capsys, command, argv(world), "--device cuda" if "device" in case else "--backend nccl", world)


def test_metrics_on_a_cuda_device_the_machine_lacks(world, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    refuse(capsys, "compute_video_metrics", [*metrics(world, "ref", "test"), "--device", "cuda:0"], "--device", world)


def test_an_unresolvable_master_address_ends_with_one_line(world, capsys, monkeypatch):
    """torch's rendezvous would retry the name without end; the launch looks it up for a bounded wait first."""
    import predictor_training.runtime.distributed as distributed

    monkeypatch.setattr(distributed, "MASTER_ADDRESS_WAIT_S", 0.0)
    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "no-such-host.invalid",
                        "MASTER_PORT": "29517"}.items():
        monkeypatch.setenv(name, value)
    refuse(capsys, "v4", offline(world), "MASTER_ADDR='no-such-host.invalid': cannot be resolved", world)
