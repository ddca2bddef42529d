"""The stand-ins tests/test_doc_commands.py puts at the docs' paths (docs/walkthrough.md § Paths): tiny versions of
every input a documented command reads, each of the kind and format the real one has, written where the walkthrough's
variables point.

    paths = walkthrough_paths(sandbox)          # {"TEACHER": ..., "DATASET": ..., "OFFLINE": ..., ...}
    demo = write_demo_world(sandbox)            # demo_data/: the CPU demo's assets, datasets and runs
    write_real_world(paths, sandbox, demo)      # the real model's inputs and runs, at tiny size

The real model's Teacher is a 54-block Teacher of the tiny width (so `--source_blocks 1,52` and `0,53` are blocks it
has), its action checkpoint its own state dict, its encoders the demo world's (tiny text encoders and the world
VAE, which its config fits). The sample tables are made by tools/make_sample_table.py from the walkthrough's camera paths over ten cases,
their encoder outputs by the encoder stage's own functions, and the Predictor dataset's config by the dataset
builder's own `dataset_config` (its tensors are random, of the builder's layout). A run directory holds a training
state and inference weights of a v4 Predictor of its source blocks whose saved config is what its documented launch
computes (so a launch of the same command finds its own run, finished). Nothing here is trained.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import torch
from PIL import Image

from predictor_training.data.build_plan import read_plan
from predictor_training.data.builder import BuildOptions, dataset_config
from predictor_training.data.encoders import (
    CaseEncoder,
    check_or_write_encode_config,
    encode_cases_to_folder,
    encode_settings,
    jobs_from_cases,
)
from predictor_training.data.sample_table import read_cases, read_sample_table
from predictor_training.data.shards import append_jsonl, make_manifest_entry, write_safetensors_atomic
from predictor_training.methods.method_model import method_meta
from predictor_training.predictor.model import build_predictor
from predictor_training.rollout.camera import pose_string_to_json
from predictor_training.runtime.checkpoint import RunState, checkpoint_meta, save_training_state
from predictor_training.runtime.inference_weights import inference_weights_name, save_inference_weights
from predictor_training.runtime.optim import WarmupCosineSchedule, build_optimizer, build_optimizer_and_schedule
from predictor_training.runtime.roles import Role
from predictor_training.runtime.run_directory import run_config
from predictor_training.runtime.sharded_checkpoint import publish_sharded_folder, referenced_tokens, save_sharded_roles
from predictor_training.teacher import WorldPlayTransformer, randomize_zero_initialised_
from predictor_training.teacher.adapters import add_lora, save_lora

REPO_ROOT = Path(__file__).resolve().parents[2]
WORLD_TEACHER = REPO_ROOT / "predictor_training" / "world" / "weights" / "teacher"
WALKTHROUGH = REPO_ROOT / "docs" / "walkthrough.md"
REAL_DEPTH = 54  # the real Teacher's double blocks: --source_blocks 1,52 and 0,53 must exist
IMAGE_SIZE = (32, 48)  # encoded at 32 x 48: a 4 x 6 latent grid with the world's VAE (spatial factor 8)
STAND_IN_CASES = 180  # enough for tools/make_sample_table.py's default split sizes (100 + 25 + 50)


# ---------------------------------------------------------------------------------------------------------------
# 1. The walkthrough's paths, evaluated in the sandbox
# ---------------------------------------------------------------------------------------------------------------
def paths_block() -> list[str]:
    """The assignment lines of the walkthrough's § Paths block, in order."""
    text = WALKTHROUGH.read_text(encoding="utf-8")
    block = text.split("## Paths", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    return [line.split("#", 1)[0].strip() for line in block.splitlines() if line.split("#", 1)[0].strip()]


def walkthrough_paths(sandbox: Path) -> dict[str, str]:
    """Every variable of the walkthrough's § Paths, as bash evaluates them in order, with the two roots moved into
    the sandbox (CKPTS, WORK); the run directories stay relative, as written (under checkpoints/ of the working
    directory, the sandbox)."""
    roots = {"CKPTS": str(sandbox / "ckpts"), "WORK": str(sandbox / "work")}
    lines = paths_block()
    names = [line.split("=", 1)[0] for line in lines]
    script = [f"{name}={shlex.quote(roots[name])}" if name in roots else line for name, line in zip(names, lines)]
    script += [f"export {' '.join(names)}", "env -0"]
    result = subprocess.run(["bash", "-c", "\n".join(script)], capture_output=True, check=True,
                            env={"PATH": os.environ["PATH"]}, cwd=sandbox)
    values = dict(item.split("=", 1) for item in result.stdout.decode().split("\0") if "=" in item)
    return {name: values[name] for name in names}


# ---------------------------------------------------------------------------------------------------------------
# 2. The real model's inputs at tiny size
# ---------------------------------------------------------------------------------------------------------------
def write_teacher(folder: Path, depth: int = REAL_DEPTH) -> WorldPlayTransformer:
    """The demo world Teacher's config (width 64, 16 latent channels: the demo's video latents fit it) at `depth`
    double blocks, random weights, saved in `folder`."""
    config = WorldPlayTransformer.constructor_arguments(
        json.loads((WORLD_TEACHER / "config.json").read_text(encoding="utf-8")), source="world Teacher")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        teacher = WorldPlayTransformer(**{**config, "mm_double_blocks_depth": depth})
    randomize_zero_initialised_(teacher, torch.Generator().manual_seed(1))
    teacher.save_pretrained(str(folder))
    return teacher.eval().requires_grad_(False)


def write_cases(path: Path, count: int) -> Path:
    """`count` image-caption cases c0001.. with 16 x 16 images beside `path`."""
    (path.parent / "images").mkdir(parents=True, exist_ok=True)
    lines = []
    for index in range(1, count + 1):
        case_id = f"c{index:04d}"
        Image.new("RGB", (64, 48), ((37 * index) % 256, (91 * index) % 256, 128)).save(
            path.parent / "images" / f"{case_id}.png")
        lines.append(json.dumps({"case_id": case_id, "source_image": f"images/{case_id}.png",
                                 "caption": f"a scene numbered {index}"}))
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def write_camera_paths(work: Path) -> Path:
    """The walkthrough's example camera paths (a pose string, an orbit, one case's walk) and their pose files."""
    (work / "cams").mkdir(parents=True, exist_ok=True)
    for name, pose_string in (("orbit_left", "left-31"), ("c0001_walk", "w-10, a-11, s-10")):
        (work / "cams" / f"{name}.json").write_text(json.dumps(pose_string_to_json(pose_string)), encoding="utf-8")
    rows = [{"action_id": 0, "pose_string": "w-31", "name": "forward"},
            {"action_id": 4, "pose": "cams/orbit_left.json", "name": "orbit_left"},
            {"action_id": 7, "pose": "cams/c0001_walk.json", "case_id": "c0001", "name": "walk"}]
    path = work / "camera_paths.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def make_sample_tables(cases: Path, poses: Path, out: Path) -> None:
    """tools/make_sample_table.py over the first ten cases (c0001 among them): 8 train (overfit8's subset), 1 + 1
    held out."""
    few = out.parent / "cases_for_samples.jsonl"
    few.write_text("".join(cases.read_text(encoding="utf-8").splitlines(keepends=True)[:10]), encoding="utf-8")
    if few.parent != cases.parent:
        shutil.copytree(cases.parent / "images", few.parent / "images", dirs_exist_ok=True)
    tool = _load_tool("make_sample_table")
    tool.main(["--cases", str(few), "--poses", str(poses), "--out", str(out), "--train-size", "8",
               "--holdout25-size", "1", "--holdout50-size", "1"])


def encode(encoders: Path, cases: Path, out: Path) -> None:
    """The encoder stage's own functions (tools/encode_cases.py) on `cases` at IMAGE_SIZE."""
    encoder = CaseEncoder.from_pretrained(encoders, "cpu", torch.float32, byt5_dtype=torch.float32,
                                          vae_dtype=torch.float32)
    jobs = jobs_from_cases(read_cases(cases))
    check_or_write_encode_config(out, encode_settings(encoder, *IMAGE_SIZE), write=True)
    encode_cases_to_folder(encoder, jobs, out, *IMAGE_SIZE, show_progress=False)


def write_dataset(root: Path, teacher: WorldPlayTransformer, teacher_folder: Path, action_ckpt: Path | None,
                  tables: list[Path], encoded: Path) -> Path:
    """A Teacher-trajectory dataset in the builder's layout: dataset_config.json from the builder's own
    `dataset_config` (the config `tools/build_predictor_dataset.py` would write for these inputs), and random case
    and trajectory tensors of every row, each listed in manifest.jsonl."""
    teacher_config = WorldPlayTransformer.constructor_arguments(dict(teacher.config), source="stand-in")
    plan = read_plan(tables, encoded, 32, teacher_config)
    depth = teacher.num_layers
    options = BuildOptions(teacher=teacher_folder, samples=[str(table) for table in tables], encoded=encoded,
                           out=root, action_ckpt=action_ckpt, prefeature_layers=(0, 1, depth - 2, depth - 1))
    grid = (teacher.config.in_channels, *plan.grid)
    config = dataset_config(options, plan, teacher_config, grid)
    root.mkdir(parents=True, exist_ok=True)
    (root / "dataset_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    generator = torch.Generator().manual_seed(7)
    channels, height, width = grid
    heads, hidden = teacher.heads_num, teacher.config.hidden_size

    def randn(*shape):
        return torch.randn(*shape, generator=generator).bfloat16()

    for job in plan.cases:
        facts = write_safetensors_atomic(root / job.file, {
            "image_cond": randn(1, channels, 1, height, width),
            "text_k": randn(depth, heads, 3, hidden // heads), "text_v": randn(depth, heads, 3, hidden // heads)})
        append_jsonl(root / "manifest.jsonl", make_manifest_entry("case", job.file, facts, job.case_id, None,
                                                                  job.split))
    frames, tokens = 32, 4 * height * width
    for job in plan.trajectories:
        tensors = {"viewmats": torch.eye(4).repeat(frames, 1, 1),
                   "Ks": torch.tensor([[0.8, 0.0, 0.5], [0.0, 0.8, 0.5], [0.0, 0.0, 1.0]]).repeat(frames, 1, 1),
                   "action": torch.zeros(frames, dtype=torch.int64),
                   "timesteps": torch.tensor(config["timesteps"]), "sigmas": torch.tensor(config["sigmas"]),
                   "seed": torch.tensor([job.seed], dtype=torch.int64)}
        for chunk in range(8):
            if chunk:
                indices = torch.arange(max(0, 4 * chunk - 20), 4 * chunk)
                tensors[f"chunk{chunk}.ctx_indices"] = indices
                for layer in config["prefeature_layers"]:
                    tensors[f"chunk{chunk}.ctx_prefeature.layer{layer}"] = randn(indices.numel() * height * width,
                                                                                 hidden)
            for step in range(4):
                tensors[f"chunk{chunk}.step{step}.latent_in"] = randn(channels, 4, height, width)
                tensors[f"chunk{chunk}.step{step}.final_hidden"] = randn(tokens, hidden)
                tensors[f"chunk{chunk}.step{step}.velocity"] = randn(channels, 4, height, width)
            tensors[f"chunk{chunk}.final_latent"] = randn(channels, 4, height, width)
        facts = write_safetensors_atomic(root / job.file, tensors)
        append_jsonl(root / "manifest.jsonl", make_manifest_entry("trajectory", job.file, facts, job.case_id,
                                                                  job.action_id, job.split))
    return root


def write_ground_truth(folder: Path, tables: list[Path]) -> None:
    """A folder of two PNG frames <case>__a<action>/ for every row of `tables` (what the eval looks for)."""
    for table in tables:
        for row in read_sample_table(table):
            frames = folder / f"{row.case_id}__a{row.action_id}"
            frames.mkdir(parents=True, exist_ok=True)
            for index in range(2):
                Image.new("RGB", (48, 32), (40 * index, 90, 160)).save(frames / f"{index:05d}.png")


# ---------------------------------------------------------------------------------------------------------------
# 3. Run directories
# ---------------------------------------------------------------------------------------------------------------
def recipe_flags(script: str, argv: list[str], world_size: int, cwd: Path) -> object:
    """The flags `script` parses from `argv` in the working directory `cwd` at `world_size` (WORLD_SIZE set, as a
    launcher's dry run sets it)."""
    module = _load_tool(script)
    saved, here = os.environ.get("WORLD_SIZE"), os.getcwd()
    os.environ["WORLD_SIZE"] = str(world_size)
    os.chdir(cwd)
    try:
        return module.parse_args(argv)
    finally:
        os.chdir(here)
        if saved is None:
            os.environ.pop("WORLD_SIZE")
        else:
            os.environ["WORLD_SIZE"] = saved


def write_predictor_run(run_dir: Path, args, teacher: WorldPlayTransformer, *, step: int, world_size: int,
                        device: str = "cuda", meta_extra: dict | None = None, previous: bool = False) -> None:
    """training_latest.pt (and training_prev.pt) and predictor_step_<step>.safetensors of a v4 Predictor on
    `args.source_blocks`, recording `args`' flags: the run a launch with those flags finds (finished at `step`)."""
    predictor = build_predictor(teacher, "v4", tuple(args.source_blocks))
    optimizer, schedule = build_optimizer_and_schedule(
        predictor, fusion_lr=args.fusion_lr, blocks_lr=args.blocks_lr, betas=(args.adam_beta1, args.adam_beta2),
        weight_decay=args.weight_decay, warmup_steps=args.scheduler_warmup_steps, max_steps=args.max_steps,
        block_warmup_steps=args.block_warmup_steps)
    meta = {**checkpoint_meta("v4", args.source_blocks, args.precision), **(meta_extra or {})}
    name = f"{world_size}{'gpu' if device == 'cuda' else 'cpu'}"
    recipe = {"recipe": meta["recipe"]} if "recipe" in meta else {}  # as the rollout recipe records it
    config = run_config(args, run_name=run_dir.name, variant="v4", **recipe, world_size=world_size, device=name,
                        predictor=predictor.predictor_config())
    run_dir.mkdir(parents=True, exist_ok=True)
    states = ["training_prev.pt", "training_latest.pt"] if previous else ["training_latest.pt"]
    for state in states:
        save_training_state(run_dir / state, roles=[Role("predictor", predictor, optimizer, schedule)],
                            run_state=RunState(global_step=step, micro_step=step, epoch=1,
                                               data={"epoch": 1, "position": 0, "seed": args.seed}),
                            config=config, meta=meta)
    save_inference_weights(run_dir / inference_weights_name(step), predictor, metadata={**meta, "step": step},
                           config=config)


def write_sharded_run(run_dir: Path, teacher_folder: Path, args) -> None:
    """A --train full method run: its exported model/ (a Teacher folder) and a training_latest.pt whose "student"
    role is stored sharded in training_latest.dcp/ (the format of runtime/sharded_checkpoint.py, written in one
    process)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    shutil.copytree(teacher_folder, run_dir / "model", dirs_exist_ok=True)
    model = torch.nn.Linear(4, 4)
    optimizer = build_optimizer({"student": list(model.parameters())}, {"student": args.lr}, betas=(0.9, 0.999),
                                weight_decay=0.0)
    role = Role("student", model, optimizer, WarmupCosineSchedule(optimizer, warmup_steps=0, max_steps=1))
    path = run_dir / "training_latest.pt"
    save_training_state(path, roles=[role], run_state=RunState(global_step=args.max_steps),
                        config=run_config(args, run_name=run_dir.name),
                        meta=method_meta("df_sft", train=args.train, precision=args.precision,
                                         lora_rank=args.lora_rank))
    entries = save_sharded_roles(path, [role])
    publish_sharded_folder(path, referenced_tokens(path))
    payload = torch.load(path, weights_only=True)
    payload["roles"]["student"] = {**payload["roles"]["student"], "model": {}, "sharded": entries["student"]}
    torch.save(payload, path)


def write_lora_run(run_dir: Path, teacher: WorldPlayTransformer) -> None:
    """A df_sft LoRA run's lora_student.safetensors on `teacher` (the DMD2 real score)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    add_lora(teacher, "student", 4, 4.0)
    save_lora(teacher, "student", run_dir / "lora_student.safetensors")


def _load_tool(name: str):
    """An entry script as a module (tools/<name>.py, or a path under the repository)."""
    import importlib.util

    path = REPO_ROOT / (name if name.endswith(".py") else f"tools/{name}.py")
    module_name = "doc_world_" + re.sub(r"\W", "_", str(path.relative_to(REPO_ROOT)))
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------------------------------------------------------
# 4. The two worlds
# ---------------------------------------------------------------------------------------------------------------
def write_demo_world(sandbox: Path) -> dict[str, Path]:
    """demo_data/ as the CPU demo's launchers make it: the real demo assets (one scene per split), the real
    video-latent dataset of their clips, a Predictor dataset of their tables (stand-in tensors), the two runs of the
    main job's demo (finished), and the df_sft demo run's exported model."""
    demo = sandbox / "demo_data"
    _load_tool("make_demo_assets").main(["--out", str(demo / "assets"), "--num_train", "1", "--num_holdout25", "1",
                                         "--num_holdout50", "1", "--threads", "1"])
    assets = demo / "assets"
    from predictor_training.data import video_latent_build as vb

    assert vb.run(vb.VideoBuildOptions(
        clips=[assets / "clips" / "train.jsonl", assets / "clips" / "holdout.jsonl"], encoders=assets / "encoders",
        out=demo / "video_latents", height=32, width=48, num_frames=125, dtype="float32", storage_dtype="float32",
        device="cpu")) == 0
    teacher = WorldPlayTransformer.from_pretrained(str(assets / "teacher")).eval().requires_grad_(False)
    write_dataset(demo / "dataset", teacher, assets / "teacher", None, sorted(t for t in (assets / "samples").glob("*.jsonl") if t.stem != "final"),
                  assets / "encoded")
    # The launchers' own flags of the main job's two runs (tools/launch_predictor_v4_rollout_training.sh): the
    # offline run, then the rollout run from its training_latest.pt (a path relative to the working directory).
    dataset = f"{sandbox}/demo_data/dataset"
    offline = recipe_flags("train_predictor_v4.py", ["--preset", "demo", "--dataset_root", dataset], 2, sandbox)
    offline_dir = Path("checkpoints") / f"predictor_v4_prefeature_demo_blocks1-10_fp32_2cpu_flr1e-4_blr1e-5_" \
        "schedsteps240_swarmup10_bwarmup10_notracker"
    write_predictor_run(sandbox / offline_dir, offline, teacher, step=240, world_size=2, device="cpu")
    rollout = recipe_flags("train_predictor_v4_rollout.py", ["--preset", "demo", "--dataset_root", dataset,
                                                             "--init_from", str(offline_dir / "training_latest.pt")],
                           2, sandbox)
    write_predictor_run(sandbox / "checkpoints" / "predictor_v4_rollout_fppp_demo_blocks1-10_fp32_2cpu_flr5e-4_"
                        "blr5e-5_schedsteps96_swarmup2_bwarmup2_notracker", rollout, teacher, step=96, world_size=2,
                        device="cpu", meta_extra={"recipe": "rollout_fppp"})
    shutil.copytree(assets / "teacher", sandbox / "checkpoints" /
                    "df_sft_demo_full-scratch_fp32_2cpu_lr1e-3_steps300_warmup20_notracker" / "model")
    # docs/demo_world.md's rendered world (tools/render_world.py --out demo_data/world): its clip tables
    write_clip_tables(assets / "clips", demo / "world")
    return {"assets": assets, "video_latents": demo / "video_latents", "teacher": teacher}


def write_real_world(paths: dict[str, str], sandbox: Path, demo: dict) -> None:
    """Every path of the walkthrough's § Paths, a tiny stand-in of its kind (module docstring)."""
    where = {name: Path(value) if Path(value).is_absolute() else sandbox / value for name, value in paths.items()}
    for folder in ("CKPTS", "WORK"):
        where[folder].mkdir(parents=True, exist_ok=True)
    # 1. The checkpoints: the Teacher, its action checkpoint (its own state dict), encoders, the LPIPS trunk.
    teacher = write_teacher(where["TEACHER"])
    where["ACTION_CKPT"].parent.mkdir(parents=True, exist_ok=True)
    from safetensors.torch import save_file

    save_file({name: tensor.contiguous() for name, tensor in teacher.state_dict().items()}, str(where["ACTION_CKPT"]))
    where["ENCODERS"].symlink_to(demo["assets"] / "encoders")  # the world's: tiny text encoders, its VAE
    where["ALEXNET"].write_bytes(b"stand-in: its kind (a file) is what a check looks at")
    # 2. Cases, camera paths, sample tables, encoder outputs, the dataset, ground truth.
    write_cases(where["CASES"], STAND_IN_CASES)
    poses = write_camera_paths(where["WORK"])
    make_sample_tables(where["CASES"], poses, where["SAMPLES"])
    encode(where["ENCODERS"], where["SAMPLES"].parent / "cases_for_samples.jsonl", where["ENCODED"])
    tables = [where["SAMPLES"] / f"{split}.jsonl" for split in ("train", "holdout25", "holdout50")]
    write_dataset(where["DATASET"], teacher, where["TEACHER"], where["ACTION_CKPT"], tables, where["ENCODED"])
    write_ground_truth(where["GT"], tables[1:])
    shutil.copytree(where["GT"], where["WORK"] / "generated")  # docs/video_metrics.md's second folder
    # 3. Video latents (the demo's), clip tables of 125-frame clips, an ODE cache of the 4-step grid.
    where["VIDEO_LATENTS"].symlink_to(demo["video_latents"])
    write_clip_tables(demo["assets"] / "clips", where["WORK"] / "clips")
    write_ode_cache(demo["teacher"], demo["video_latents"], where["WORK"] / "ode_cache")
    # docs/cluster.md's estimates.jsonl (tools/estimate_memory.py --json > estimates.jsonl): one report per recipe
    (sandbox / "estimates.jsonl").write_text("".join(json.dumps({"name": f"{recipe} stand-in", "peak_gib": 40.0})
                                                     + "\n" for recipe in ("v4", "disca", "rollout")))
    # 4. The runs, each with the flags of the launch the docs show for it (docs/walkthrough.md, rollout.md, ...).
    dataset, offline_init = str(where["DATASET"]), f"{paths['OFFLINE']}/training_latest.pt"
    runs = {
        "OFFLINE": ("train_predictor_v4.py", ["--dataset_root", dataset], {}),
        "OFFLINE_0_53": ("train_predictor_v4.py", ["--dataset_root", dataset, "--source_blocks", "0,53"], {}),
        "ROLLOUT": ("train_predictor_v4_rollout.py", ["--dataset_root", dataset, "--init_from", offline_init],
                    {"recipe": "rollout_fppp"}),
        "ROLLOUT_FPPF": ("train_predictor_v4_rollout.py", ["--dataset_root", dataset, "--init_from", offline_init,
                                                           "--replace_steps", "1,2"], {"recipe": "rollout_fppf"}),
        "ROLLOUT_FRRP": ("train_predictor_v4_rollout.py", ["--dataset_root", dataset, "--init_from", offline_init,
                                                           "--reuse_steps", "1,2", "--replace_steps", "3"],
                         {"recipe": "rollout_frrp"}),
        "ADV": ("fvtools/train_adversarial.py", ["--dataset_root", dataset], {"recipe": "adversarial_offline"}),
    }
    for name, (script, argv, meta) in runs.items():  # OFFLINE first: the rollout runs start from it
        write_predictor_run(sandbox / paths[name], recipe_flags(script, argv, 8, sandbox), teacher, step=2000,
                            world_size=8, meta_extra=meta, previous=name == "ROLLOUT")
    df_sft = recipe_flags("fvtools/train_df_sft.py", ["--teacher", str(where["TEACHER"]), "--action_ckpt",
                                                      str(where["ACTION_CKPT"]), "--dataset_root",
                                                      str(where["VIDEO_LATENTS"]), "--train", "full"], 8, sandbox)
    write_sharded_run(where["DF_SFT_RUN"], where["TEACHER"], df_sft)
    write_lora_run(where["REAL_SCORE_RUN"], teacher)


def write_clip_tables(source: Path, out: Path) -> None:
    """The demo's clip tables with absolute video and pose paths, as `out`/{train,holdout}.jsonl."""
    out.mkdir(parents=True, exist_ok=True)
    for name in ("train", "holdout"):
        lines = []
        for line in (source / f"{name}.jsonl").read_text(encoding="utf-8").splitlines():
            clip = json.loads(line)
            clip.update(video=str((source / clip["video"]).resolve()), pose=str((source / clip["pose"]).resolve()))
            lines.append(json.dumps(clip) + "\n")
        (out / f"{name}.jsonl").write_text("".join(lines), encoding="utf-8")


def write_ode_cache(teacher: WorldPlayTransformer, videos: Path, out: Path) -> None:
    """A 4-step ODE cache (the student's grid at shift 5) of one train and one holdout clip of `videos`."""
    from predictor_training.data.ode_cache import CacheJob, CacheSettings, build_cache
    from predictor_training.data.video_latents import VideoLatentDataset
    from predictor_training.runtime.distributed import DistEnv

    datasets = {split: VideoLatentDataset(videos, split) for split in ("train", "holdout")}
    jobs = [CacheJob(index, f"{split}0", split, 100 + index, (split, 0))
            for index, split in enumerate(("train", "holdout"))]
    settings = CacheSettings(steps=4, shift=5.0, store_grid=4, compute_dtype="float32", storage_dtype="float32")
    env = DistEnv(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), backend=None, is_main=True)
    build_cache(teacher, jobs, lambda job: datasets[job.condition[0]][job.condition[1]], settings, out, env=env,
                inputs={"stand_in": True})
