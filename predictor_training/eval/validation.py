"""Held-out video quality while a Predictor trains, by the eval's own code path (docs/validation.md).

Every `--val_every` steps (and at the last step) the loop calls a `PredictorValidation`: for the first
`--val_videos` rows of the held-out split, sharded over the ranks, the eval's AR loop (`EvalRuntime.rollout`, the
row's own seed for noise and memory points) rolls out the training Predictor under the recipe's schedule and
context mode; the VAE decodes it and `score_video` scores it against the Teacher's F-F-F-F of the same row and,
with `--val_ground_truth`, against the true video. The reference rollouts and the ground truth are computed once
per process and reused at every validation. Reported (the same on every rank, gathered): val/psnr_vs_reference,
val/ssim_vs_reference, their last-chunk values, the same against the truth (val/*_vs_truth), and val/seconds.
Rank 0 writes a contact sheet of the first row (truth | F-F-F-F | Predictor at evenly spaced frames) as
`validation/step_XXXXX.png` in the run directory.

Validation changes nothing of the training: it runs without gradients on the unwrapped Predictor in eval mode,
and every random state (python, numpy, torch) is restored afterwards.
"""

from __future__ import annotations

import dataclasses
import random
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from predictor_training.data.dataset_config import (
    DATASET_CONFIG_NAME,
    config_field,
    read_dataset_config,
    recorded_sample_table,
)
from predictor_training.data.trajectory_dataset import TrajectoryTableDataset
from predictor_training.data.video_latents import CHUNK_LATENTS, VideoLatentDataset, read_clip_manifest
from predictor_training.eval.methods import (
    PlannedMethod,
    PredictorCheckpoint,
    PredictorMethod,
    ReferenceMethod,
    VelocityReuse,
    make_step_fn,
)
from predictor_training.eval.revisits import PSNR_CAP_DB
from predictor_training.eval.runtime import EvalRuntime, score_video
from predictor_training.eval.timing import Stopwatch
from predictor_training.methods.monitors import collapse_monitors
from predictor_training.methods.rewards import default_vae_folder
from predictor_training.rollout.ar_rollout import ARRollout, RolloutConfig, RolloutInputs
from predictor_training.rollout.schedule import StepPlan
from predictor_training.rollout.teacher_forcing import clip_text_kv
from predictor_training.runtime.distributed import DistEnv, all_gather_objects, unwrap_model
from predictor_training.runtime.errors import MissingFileError
from predictor_training.runtime.io import atomic_write
from predictor_training.runtime.precision import autocast
from predictor_training.teacher.adapters import adapter
from predictor_training.video.ground_truth import find_ground_truth_videos, load_ground_truth, video_key
from predictor_training.video.metrics import chunk_frame_ranges
from predictor_training.video.vae_decoder import VaeDecoder

VALIDATION_DIR = "validation"
CONTACT_SHEET_COLUMNS = 6
CONTACT_SHEET_MIN_HEIGHT = 128  # pixels per row after nearest-neighbour scaling


def default_val_split(dataset_root: Path) -> str:
    """The first held-out split the dataset records (sample tables other than train.jsonl, by name)."""
    tables = [Path(path).stem for path in config_field(read_dataset_config(dataset_root), "sample_tables",
                                                        dataset_root)]
    held_out = sorted(name for name in tables if name != "train")
    if not held_out:
        raise ValueError(f"{dataset_root}: the dataset records no held-out sample table ({tables}); pass --val_split")
    return held_out[0]


class restored_random_state:
    """Everything random (python, numpy, torch CPU and CUDA) as it was before the block."""

    def __enter__(self):
        self.python, self.numpy = random.getstate(), np.random.get_state()
        self.fork = torch.random.fork_rng(devices=range(torch.cuda.device_count()) if torch.cuda.is_available()
                                          else [])
        self.fork.__enter__()

    def __exit__(self, *exc):
        self.fork.__exit__(*exc)
        random.setstate(self.python)
        np.random.set_state(self.numpy)


class PredictorValidation:
    """`validation(step)` -> the gathered val/* figures (see the module docstring); best.json ranks the steps by
    `best_metric`."""

    best_metric = "val/psnr_vs_reference"

    def __init__(self, *, teacher, predictor, plan: StepPlan, rollout_config: RolloutConfig, dataset_root: Path,
                 split: str, num_videos: int, vae: Path, ground_truth: Path | None, env: DistEnv, run_dir: Path):
        self.env = env
        self.run_dir = Path(run_dir)
        dataset = TrajectoryTableDataset(
            recorded_sample_table(dataset_root, split), dataset_root=dataset_root,
            num_latents=int(config_field(read_dataset_config(dataset_root), "num_latents", dataset_root)),
        )
        self.rows = list(range(min(num_videos, len(dataset))))
        self.mine = self.rows[env.rank::env.world_size]
        raw = unwrap_model(predictor)
        label = PredictorCheckpoint(self.run_dir, self.run_dir.name, 0, {}, raw.predictor_config(), {},
                                    label="training", panel="training")
        self.predictor = raw
        self.method = PredictorMethod(raw, label)
        if plan.reuse_steps:  # F-R-R-P: the Predictor's steps and velocity reuse, as the leaderboard runs it
            self.method = PlannedMethod("predictor_training", plan, {"P": self.method, "R": VelocityReuse()},
                                        "training", ckpt=label)
        self.runtime = EvalRuntime(
            teacher=teacher, methods=[ReferenceMethod(), self.method], plan=plan,
            rollout_config=rollout_config, decoder=VaeDecoder.from_folder(vae, env.device, torch.float32, False),
            scorer=None, dataset=dataset, case_source="dataset", device=env.device,
            state_dtype=rollout_config.state_dtype, chunk_latents=rollout_config.chunk_latents,
        )
        self.ground_truth = {}
        if ground_truth is not None:
            keys = [video_key(dataset[row]["case_id"], dataset[row]["action_id"]) for row in self.rows]
            self.ground_truth = find_ground_truth_videos(Path(ground_truth), keys)
        self.cache: dict[int, dict] = {}  # row -> reference frames, truth, text K/V, case, frame ranges
        self.split = split

    def describe(self) -> str:
        truth = "and the ground truth" if self.ground_truth else "(no ground truth)"
        return (f"{len(self.rows)} videos of {self.split}, against F-F-F-F {truth}, "
                f"{len(self.mine)} on this rank")

    def _reference(self, row: int) -> dict:
        """The row's inputs, F-F-F-F frames and ground truth, computed once."""
        if row not in self.cache:
            item = self.runtime.dataset[row]
            case = self.runtime.dataset.load_case(item["case_id"])
            text_kv, _ = self.runtime.text_kv(case)
            rollout = self.runtime.rollout(self.runtime.methods[0], text_kv, item, case, Stopwatch(self.env.device))
            reference = self.runtime.decoder.decode(rollout.latents)
            ranges = chunk_frame_ranges(item["viewmats"].shape[0], self.runtime.chunk_latents,
                                        self.runtime.decoder.temporal_compression)
            key = video_key(item["case_id"], item["action_id"])
            truth = None
            if key in self.ground_truth:
                truth = load_ground_truth(self.ground_truth[key], tuple(reference.shape[:3]))
            self.cache[row] = {"item": item, "case": case, "text_kv": text_kv, "reference": reference,
                               "truth": truth, "ranges": ranges}
        return self.cache[row]

    @torch.no_grad()
    def __call__(self, step: int) -> dict[str, float]:
        start = time.perf_counter()
        raw = self.predictor
        was_training = raw.training
        raw.eval()
        scores, sheet = [], None
        try:
            with restored_random_state():
                for row in self.mine:
                    entry = self._reference(row)
                    rollout = self.runtime.rollout(self.method, entry["text_kv"], entry["item"], entry["case"],
                                                   Stopwatch(self.env.device))
                    frames = self.runtime.decoder.decode(rollout.latents)
                    record = {"vs_reference": score_video(entry["reference"], frames, None, entry["ranges"],
                                                          self.env.device)}
                    if entry["truth"] is not None:
                        record["vs_truth"] = score_video(entry["truth"], frames, None, entry["ranges"],
                                                         self.env.device)
                    scores.append(summarise(record))
                    if row == self.rows[0]:
                        sheet = contact_sheet([entry["truth"], entry["reference"], frames])
        finally:
            raw.train(was_training)
        gathered = [score for part in all_gather_objects(scores) for score in part]
        return finish_validation(gathered, sheet, step, start, self.env, self.run_dir)


    def image(self, step: int) -> Path | None:
        return contact_sheet_path(self.run_dir, step) if self.env.is_main else None


def contact_sheet_path(run_dir: Path, step: int) -> Path | None:
    """The contact sheet a validation at `step` wrote, if it wrote one."""
    path = Path(run_dir) / VALIDATION_DIR / f"step_{step:05d}.png"
    return path if path.is_file() else None


def finish_validation(gathered: list[dict], sheet: Image.Image | None, step: int, start: float, env: DistEnv,
                      run_dir: Path) -> dict[str, float]:
    """Every video's figures (all ranks') -> their means, val/videos and val/seconds (the slowest rank's, a
    collective); rank 0 writes the contact sheet."""
    figures = {key: float(np.mean([score[key] for score in gathered])) for key in gathered[0]}
    figures["val/videos"] = float(len(gathered))
    figures["val/seconds"] = max(all_gather_objects(time.perf_counter() - start))
    if env.is_main and sheet is not None:
        path = Path(run_dir) / VALIDATION_DIR / f"step_{step:05d}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, lambda tmp: sheet.save(tmp, format="PNG"))
    return figures


def summarise(record: dict) -> dict[str, float]:
    """{val/psnr_vs_reference, val/ssim_vs_reference, val/psnr_last_chunk_vs_reference, ...} of one video."""
    out = {}
    for against, scored in record.items():
        for metric, name in (("psnr_full", "psnr"), ("ssim", "ssim")):
            out[f"val/{name}_{against}"] = float(scored["metrics"][metric])
            out[f"val/{name}_last_chunk_{against}"] = float(scored["per_chunk"][-1][metric])
    return out


def contact_sheet(videos: list) -> Image.Image:
    """Rows of uint8 [F, H, W, 3] videos (None rows skipped) at CONTACT_SHEET_COLUMNS evenly spaced frames."""
    rows = [video for video in videos if video is not None]
    frames = rows[0].shape[0]
    picks = np.linspace(0, frames - 1, CONTACT_SHEET_COLUMNS).round().astype(int)
    grid = torch.cat([torch.cat([video[index] for index in picks], dim=1) for video in rows], dim=0)
    scale = max(1, -(-CONTACT_SHEET_MIN_HEIGHT // rows[0].shape[1]))  # small demo frames, scaled up (nearest)
    grid = grid.repeat_interleave(scale, dim=0).repeat_interleave(scale, dim=1)
    return Image.fromarray(grid.numpy())


def predictor_validation(*, every: int, split: str | None, videos: int, vae: Path | None,
                         ground_truth: Path | None, dataset_root: Path, teacher, predictor, teacher_folder: Path,
                         plan: StepPlan, rollout_config: RolloutConfig | None, env: DistEnv, run_dir: Path,
                         autocast_dtype: torch.dtype | None = None) -> PredictorValidation | None:
    """A Predictor recipe's validation of its `plan` (None with every 0: its --val_every, --val_split, --val_videos,
    --val_vae, --val_ground_truth). Without `vae` the VAE is the `encoders/vae` folder beside the Teacher's folder, and without
    `ground_truth` the truth is its `ground_truth` folder, when they exist (the demo assets' layout).
    `rollout_config`: the recipe's AR loop (None: the dataset's, running latents in the Teacher's dtype,
    `autocast_dtype` for its calls). Built without touching any random state."""
    if every <= 0:
        return None
    assets = Path(teacher_folder).parent
    vae = vae or (assets / "encoders" / "vae")
    if not (vae / "config.json").is_file():
        raise MissingFileError(f"--val_every {every}: no VAE to decode the validation videos ({vae} has no "
                                "config.json); pass --val_vae DIR")
    truth = ground_truth
    if truth is None and (assets / "ground_truth").is_dir():
        truth = assets / "ground_truth"
    if rollout_config is None:
        rollout_config = RolloutConfig.from_dataset_config(
            read_dataset_config(dataset_root), str(Path(dataset_root) / DATASET_CONFIG_NAME),
            state_dtype=teacher.dtype, autocast_dtype=autocast_dtype)
    check_plan_fits(plan, rollout_config)
    split = split or default_val_split(dataset_root)
    with restored_random_state():
        return PredictorValidation(teacher=teacher, predictor=predictor, plan=plan, rollout_config=rollout_config,
                                   dataset_root=Path(dataset_root), split=split, num_videos=videos, vae=vae,
                                   ground_truth=truth, env=env, run_dir=run_dir)


def check_plan_fits(plan: StepPlan, rollout_config: RolloutConfig) -> None:
    """A plan has one letter per step of the rollout it runs in."""
    if plan.num_steps != rollout_config.num_steps:
        raise ValueError(f"plan {plan.text} has {plan.num_steps} steps; the rollout runs {rollout_config.num_steps}")


def default_video_val_split(dataset_root: Path, train_split: str = "train") -> str:
    """The held-out split of a video-latent dataset: the first split of its manifest, by name, other than the
    training split (e.g. "holdout")."""
    splits = sorted({entry.split for entry in read_clip_manifest(dataset_root)} - {train_split})
    if not splits:
        raise ValueError(f"{dataset_root}: the video-latent dataset has no split besides {train_split!r}; pass "
                         "--val_split")
    return splits[0]


def resolve_video_val_inputs(parser, method: str, *, val_every: int, val_vae: Path | None, val_split: str | None,
                             val_ground_truth: Path | None, dataset_root: Path, split: str
                             ) -> tuple[Path | None, str | None]:
    """(--val_vae, --val_split) of a video-latent run: the given ones, else the VAE the dataset's config records
    and its held-out split (`parser.error` naming the flags when neither can be found); unchanged with
    --val_every 0. `method` names the recipe refusing --val_ground_truth (it validates against the clips' own
    latents)."""
    if val_every == 0:  # check_args has checked --val_every >= 0, --val_videos >= 1, --val_vae
        return val_vae, val_split
    if val_ground_truth is not None:
        parser.error(f"--val_ground_truth: {method} validates against the clips' own decoded latents; drop the flag")
    try:
        val_vae = val_vae or default_vae_folder(dataset_root)
        val_split = val_split or default_video_val_split(dataset_root, split)
    except (OSError, KeyError, ValueError) as error:
        parser.error(f"--val_every={val_every}: {error}; pass --val_vae DIR / --val_split NAME")
    return val_vae, val_split


def generator_validation(*, every: int, dataset_root: Path, split: str, videos: int, vae: Path, seed: int, teacher,
                         generator_role, student, plan: StepPlan | None, student_steps: int, student_shift: float,
                         rollout_config: RolloutConfig, env: DistEnv, run_dir: Path) -> ClipRolloutValidation | None:
    """DMD2's validation (fvtools/train_dmd2.py; its --val_every, --dataset_root, --val_split, --val_videos,
    --val_vae, --seed): the generator's rollout on the first `videos` clips of `split` (the composite of
    `plan` through the eval's own step hook on the frozen Teacher, or the student's own `student_steps`
    rollout at `student_shift`) against the clip's decoded latents (val/*_vs_truth) and the Teacher's F-F-F-F of the
    same noise (val/*_vs_teacher), plus the collapse monitors of the generator's latents against the Teacher's
    (val/monitor/*). `student`: the student's ScoreModel, or None for the Predictor. None with every 0."""
    if every <= 0:
        return None
    dataset = VideoLatentDataset(dataset_root, split)
    autocast_dtype = rollout_config.autocast_dtype
    teacher_rollout = composite_rollout(teacher, None, None, rollout_config, env.device, autocast_dtype, run_dir)

    def reference(item, noise, memory_seed):
        with adapter(teacher, None):
            return teacher_rollout(item, noise, memory_seed)

    if student is None:  # the Predictor
        predictor = unwrap_model(generator_role.module)
        modules = [predictor]
        check_plan_fits(plan, rollout_config)
        composite = composite_rollout(teacher, predictor, plan, rollout_config, env.device, autocast_dtype, run_dir)

        def generate(item, noise, memory_seed):
            with adapter(teacher, None):
                return composite(item, noise, memory_seed)
    else:
        modules = [student.model]
        config = RolloutConfig(num_steps=student_steps, shift=student_shift, state_dtype=torch.float32,
                               autocast_dtype=autocast_dtype)
        own = own_rollout(student.model, config, env.device, autocast_dtype)

        def generate(item, noise, memory_seed):
            with student.active():
                return own(item, noise, memory_seed)

    def monitors(latents, reference_latents, item):
        figures = collapse_monitors(latents, reference_latents, rollout_config.chunk_latents)
        return {f"val/{key}": value for key, value in figures.items()}

    return ClipRolloutValidation(
        generate=generate, reference=reference, extra=monitors, dataset=dataset, num_videos=videos, vae=vae, env=env,
        run_dir=run_dir, seed=seed, chunk_latents=rollout_config.chunk_latents, collective=generator_role.is_fsdp,
        modules=modules, split=split, reference_name="teacher")


def reward_validation(*, every: int, dataset_root: Path, split: str, videos: int, seed: int, step_fn, vae: Path,
                      env: DistEnv, run_dir: Path) -> ClipRolloutValidation | None:
    """NFT's validation (fvtools/train_nft.py: its --val_every, --dataset_root, --eval_split, --val_videos, --seed;
    `step_fn` its NftStep, `vae` the folder that decodes its samples): held-out reward while training (None with
    every 0): the policy's rollout on the first `videos` clips of `split`, from the eval's own noise streams, scored
    against the clip's truth and the reference's rollout from the same noise (its drift from the reference), with
    every reward of both as val/reward/<name> and val/reward_reference/<name>."""
    if every <= 0:
        return None
    dataset = VideoLatentDataset(dataset_root, split)
    row_of = {dataset[row]["clip_id"]: row for row in range(min(videos, len(dataset)))}

    def rollout(role: str):
        return lambda item, noise, memory_seed: step_fn.eval_rollout(item, role, row_of[item["clip_id"]])

    def rewards(latents, reference_latents, item) -> dict[str, float]:
        scores = step_fn.rewards(torch.cat([latents, reference_latents]), item)
        return {**{f"val/reward/{name}": float(values[0]) for name, values in scores.items()},
                **{f"val/reward_reference/{name}": float(values[1]) for name, values in scores.items()}}

    return ClipRolloutValidation(generate=rollout("policy"), reference=rollout("reference"), extra=rewards,
                                 dataset=dataset, num_videos=videos, vae=vae, env=env, run_dir=run_dir, seed=seed,
                                 chunk_latents=CHUNK_LATENTS, split=split)


def own_rollout(model, rollout_config: RolloutConfig, device: torch.device, autocast_dtype):
    """`generate` of a model that samples by itself (a df_sft / kd student, a Teacher): its AR rollout under
    `rollout_config` (its step count and shift) from the clip's noise and memory points, its own text prefill."""
    def generate(item, noise, memory_seed):
        text_kv = clip_text_kv(model, item, device, autocast_dtype, grad=False)
        inputs = RolloutInputs.from_clip(item, noise, memory_seed)
        return ARRollout(model, text_kv, inputs, rollout_config, device=device).run().float().cpu()

    return generate


def composite_rollout(teacher, predictor, plan: StepPlan | None, rollout_config: RolloutConfig,
                      device: torch.device, autocast_dtype, run_dir: Path):
    """`generate` of the F-P-P-P composite: the frozen Teacher's AR loop with the eval's own step hook
    (`PredictorMethod` + `make_step_fn` under `plan`); `predictor=None` (and plan None) gives the Teacher's own
    F-F-F-F (`ReferenceMethod`)."""
    if predictor is None:
        method = ReferenceMethod()
    else:
        raw = unwrap_model(predictor)
        label = PredictorCheckpoint(Path(run_dir), Path(run_dir).name, 0, {}, raw.predictor_config(), {},
                                    label="training", panel="training")
        method = PredictorMethod(raw, label)
    config = dataclasses.replace(rollout_config, context_mode=method.context_mode)
    scope = lambda: autocast(device, autocast_dtype)

    def generate(item, noise, memory_seed):
        text_kv = clip_text_kv(teacher, item, device, autocast_dtype, grad=False)
        inputs = RolloutInputs.from_clip(item, noise, memory_seed)
        step_fn = make_step_fn(method, plan, Stopwatch(device), scope)
        return ARRollout(teacher, text_kv, inputs, config, device=device).run(step_fn).float().cpu()

    return generate




class ClipRolloutValidation:
    """Held-out validation of the generic methods (fvtools): a model's own AR rollout on the first `num_videos`
    held-out clips, from fixed noise and memory points (the row's own, drawn from `seed` on a private generator),
    decoded by the VAE and scored against the clip's true video (`truth(item)`: latents [1, C, T, H, W], by default
    its stored video latents; decoded once) and, given a `reference`, against the Teacher's rollout from the same
    noise (computed once). `truth_name` names the truth in the figures (val/psnr_vs_<truth_name>, ...; kd: the
    teacher's stored final latents, "teacher"). `extra(latents, reference_latents, item)` adds a method's own
    figures (collapse monitors, rewards); they are averaged like the rest.

    generate / reference: `(item, noise [1, C, T, H, W], memory_seed) -> latents [1, C, T, H, W]`.
    modules: put in eval mode while validating (their training mode is restored after).
    collective: every rank rolls out every clip (a sharded model's forwards are collectives); otherwise the clips
    are sharded over the ranks. best.json ranks the steps by val/psnr_vs_<truth_name>. A PSNR of identical videos
    (inf: e.g. a fresh LoRA student against the Teacher it is an adapter of) is reported as PSNR_CAP_DB (100 dB). Nothing
    random outside the private generator is drawn: every random state is restored afterwards, and no gradient is
    recorded."""

    def __init__(self, *, generate, reference=None, extra=None, dataset, num_videos: int, vae: Path, env: DistEnv,
                 run_dir: Path, seed: int, chunk_latents: int, collective: bool = False, truth=None,
                 truth_name: str = "truth", modules=(), split: str = "", reference_name: str = "reference"):
        self.generate, self.reference, self.extra = generate, reference, extra
        self.dataset, self.env, self.run_dir, self.seed = dataset, env, Path(run_dir), seed
        self.chunk_latents = chunk_latents
        self.truth = truth if truth is not None else (lambda item: item["latents"][None].float())
        self.truth_name, self.reference_name = truth_name, reference_name
        self.best_metric = f"val/psnr_vs_{truth_name}"
        self.modules = list(modules)
        self.split = split
        self.rows = list(range(min(num_videos, len(dataset))))
        if not self.rows:
            raise ValueError(f"validation split {split!r} holds no clip")
        self.mine = self.rows if collective else self.rows[env.rank::env.world_size]
        self.collective = collective
        with restored_random_state():
            self.decoder = VaeDecoder.from_folder(vae, env.device, torch.float32, False)
        self.cache: dict[int, dict] = {}

    def describe(self) -> str:
        reference = f" and the {self.reference_name}" if self.reference is not None else ""
        spread = "every clip on every rank" if self.collective else f"{len(self.mine)} on this rank"
        return (f"{len(self.rows)} clips of {self.split or 'the held-out split'}, own rollout against the "
                f"{self.truth_name}{reference}; {spread}")

    def _inputs(self, row: int) -> dict:
        if row not in self.cache:
            item = self.dataset[row]
            latents = self.truth(item)
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + row)
            noise = torch.randn(latents.shape, generator=generator).to(self.env.device)
            memory_seed = self.seed * 1_000_003 + row
            truth = self.decoder.decode(latents)
            ranges = chunk_frame_ranges(latents.shape[2], self.chunk_latents, self.decoder.temporal_compression)
            entry = {"item": item, "noise": noise, "memory_seed": memory_seed, "truth": truth, "ranges": ranges,
                     "reference": None, "reference_latents": None}
            if self.reference is not None:
                entry["reference_latents"] = self.reference(item, noise.clone(), memory_seed)
                entry["reference"] = self.decoder.decode(entry["reference_latents"])
            self.cache[row] = entry
        return self.cache[row]

    @torch.no_grad()
    def __call__(self, step: int) -> dict[str, float]:
        start = time.perf_counter()
        scores, sheet = [], None
        modes = [module.training for module in self.modules]
        for module in self.modules:
            module.eval()
        try:
            with restored_random_state():
                for row in self.mine:
                    entry = self._inputs(row)
                    latents = self.generate(entry["item"], entry["noise"].clone(), entry["memory_seed"])
                    frames = self.decoder.decode(latents)
                    record = {f"vs_{self.truth_name}": score_video(entry["truth"], frames, None, entry["ranges"],
                                                                   self.env.device)}
                    if entry["reference"] is not None:
                        record[f"vs_{self.reference_name}"] = score_video(entry["reference"], frames, None,
                                                                          entry["ranges"], self.env.device)
                    figures = {key: min(value, PSNR_CAP_DB) if "/psnr" in key else value
                               for key, value in summarise(record).items()}
                    if self.extra is not None:
                        figures.update(self.extra(latents, entry["reference_latents"], entry["item"]))
                    scores.append(figures)
                    if row == self.rows[0]:
                        sheet = contact_sheet([entry["truth"], entry["reference"], frames])
        finally:
            for module, mode in zip(self.modules, modes):
                module.train(mode)
        gathered = scores if self.collective else [score for part in all_gather_objects(scores) for score in part]
        return finish_validation(gathered, sheet, step, start, self.env, self.run_dir)

    def image(self, step: int) -> Path | None:
        return contact_sheet_path(self.run_dir, step) if self.env.is_main else None
