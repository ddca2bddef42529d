"""Train the demo world's VAE (`predictor_training/world/vae.py`) on rendered clips (docs/demo_world.md).

    python tools/render_world.py --out demo_data/world/render
    python tools/train_world_vae.py --clips demo_data/world/render/train.jsonl \
        --holdout demo_data/world/render/holdout.jsonl --output_dir demo_data/world/vae_run

One clip window per micro-batch (batch 1: diffusers 0.42.1's causal attention mask fails for batch > 1), a mix of
short and long windows, MSE + KL, AdamW with warmup + cosine, the shared training loop (checkpoints, exact resume:
run the same command again). At the end: PSNR of full held-out clips (`vae_eval.json`), the latent scale set so
the posterior means have unit variance, and the VAE saved as a diffusers folder `<output_dir>/vae/`.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import safetensors.torch
import torch

from predictor_training.data.batches import one_item_per_rank_batches
from predictor_training.runtime.checkpoint import RunState, load_model_weights
from predictor_training.runtime.distributed import (
    DistEnv,
    cleanup_distributed,
    init_distributed,
    log0,
    seed_everything,
)
from predictor_training.runtime.errors import CommandParser, command
from predictor_training.runtime.flags import add_run_args, add_tracker_args, check_args, parse_recipe_args
from predictor_training.recipes.flags import add_method_optimization_args
from predictor_training.runtime.io import write_json_atomic
from predictor_training.runtime.launch import RunSettings, resume_roles, run_training
from predictor_training.runtime.optim import WarmupCosineSchedule, build_optimizer
from predictor_training.runtime.precision import PrecisionPolicy, precision_policy
from predictor_training.runtime.recipe import RecipeParts
from predictor_training.runtime.roles import Role
from predictor_training.runtime.run_directory import (
    format_lr,
    plan_run,
    report_check,
    report_run_start,
    run_config,
    write_train_config,
)
from predictor_training.video.io import read_video
from predictor_training.world.vae import (
    ClipVideo,
    ClipWindows,
    build_world_vae,
    latent_std,
    psnr,
    reconstruction_scores,
    world_vae_config,
)

ROLE = "vae"
EVAL_NAME = "vae_eval.json"


def parse_args(argv=None) -> argparse.Namespace:
    parser = CommandParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    data = parser.add_argument_group("data")
    data.add_argument("--clips", type=Path, default=None, help="clip table (JSONL) of the training clips; required")
    data.add_argument("--holdout", type=Path, default=None, help="clip table of the held-out clips (PSNR at the end)")
    data.add_argument("--num_frames", type=int, default=125, help="frames per clip (default %(default)s)")
    data.add_argument("--short", type=int, default=17, help="frames of a short window, 4k+1 (default %(default)s)")
    data.add_argument("--long_min", type=int, default=65,
                      help="shortest long window, 4k+1; long windows run up to the whole clip (default %(default)s)")
    data.add_argument("--long_fraction", type=float, default=0.3,
                      help="share of long windows (default %(default)g)")
    data.add_argument("--eval_clips", type=int, default=8,
                      help="held-out clips scored at the end, per group: when the holdout table sits in a rendered "
                      "world (world_config.json beside it), this many clips of held-out scenes and this many new paths "
                      "of train scenes, evenly spaced over each group; else the table's first clips (default "
                      "%(default)s)")
    data.add_argument("--eval_every", type=int, default=0,
                      help="also score the first --eval_clips of those held-out clips every this many steps "
                      "(vae_eval_log.jsonl; default %(default)s: only at the end)")
    data.add_argument("--windows_per_item", type=int, default=1,
                      help="short windows per micro-batch (a batch of one length; default %(default)s). On CPU a batch "
                      "of >= 2 runs Conv3d through oneDNN instead of torch's slow path: 4 cost about what 1 costs")
    data.add_argument("--long_windows_per_item", type=int, default=None,
                      help="long windows per micro-batch (default: --windows_per_item)")
    data.add_argument("--num_workers", type=int, default=0, help="DataLoader workers (default %(default)s)")
    model = parser.add_argument_group("model")
    model.add_argument("--latent_channels", type=int, default=16, help="latent channels (default %(default)s)")
    model.add_argument("--block_out_channels", type=str, default="8,16,32,32",
                       help="four channel widths (spatial factor 8) (default %(default)s)")
    model.add_argument("--kl_weight", type=float, default=1e-6, help="weight of the KL term (default %(default)g)")
    model.add_argument("--init_from", type=Path, default=None,
                       help="start from these VAE weights (a diffusers vae/ folder such as predictor_training/world/"
                            "weights/vae, or a vae_step_XXXXX.safetensors) with a fresh optimizer and schedule; the "
                            "config must match --latent_channels / --block_out_channels")
    add_method_optimization_args(parser, lr=1.5e-3, max_steps=3000, warmup_steps=50, grad_accum=2, weight_decay=0.0,
                                 adam_beta1=0.9, adam_beta2=0.99, grad_clip=1.0)
    add_run_args(parser, experiment="world_vae", precision="fp32", ckpt_every=250, keep_last=2, log_every=10, seed=0)
    add_tracker_args(parser, tracker="none", project="hy-world")
    args = parse_recipe_args(parser, argv, presets={})
    check_args(parser, args)
    if args.clips is None or not args.clips.is_file():
        parser.error(f"--clips={args.clips!s}: expected an existing clip table")
    if args.holdout is not None and not args.holdout.is_file():
        parser.error(f"--holdout={args.holdout!s}: no such file")
    if args.init_from is not None and not (args.init_from.is_file() or (args.init_from / "config.json").is_file()):
        parser.error(f"--init_from={str(args.init_from)!r}: expected a vae folder (config.json) or a .safetensors")
    if args.precision != "fp32":
        parser.error("--precision: the world VAE trains in fp32")
    try:
        args.block_out_channels = tuple(int(item) for item in args.block_out_channels.split(","))
        world_vae_config(args.latent_channels, args.block_out_channels)
    except ValueError as error:
        parser.error(f"--block_out_channels={args.block_out_channels}: {error}")
    return args


def eval_groups(holdout: Path, count: int) -> dict[str, list[ClipVideo]]:
    """The held-out clips scored at the end, by group (see --eval_clips)."""
    clips = read_clip_table(holdout)
    config_path = holdout.parent / "world_config.json"
    if not config_path.is_file():
        return {"holdout": clips[:count]}
    config = json.loads(config_path.read_text(encoding="utf-8"))
    held_out_scenes = set(config["splits"]["holdout"]["held_out_scenes"])
    scene_of = {clip["clip_id"]: clip["scene_index"] for clip in config["clips"]}
    groups = {"held_out_scenes": [clip for clip in clips if scene_of.get(clip.clip_id) in held_out_scenes],
              "new_paths": [clip for clip in clips if scene_of.get(clip.clip_id) not in held_out_scenes]}

    def spaced(items: list) -> list:
        if len(items) <= count:
            return items
        return [items[(index * len(items)) // count] for index in range(count)]

    return {name: spaced(items) for name, items in groups.items() if items}


def score_groups(vae, groups: dict[str, list[ClipVideo]], device: torch.device) -> dict:
    """Whole-clip reconstruction figures of each group (`reconstruction_scores`), per clip and averaged."""
    report: dict = {}
    all_scores = []
    for name, clips in groups.items():
        scores = reconstruction_scores(vae, [read_video(clip.video) for clip in clips], device)
        all_scores += scores
        report[f"{name}_psnr"] = {clip.clip_id: round(score["psnr"], 3) for clip, score in zip(clips, scores)}
        for key in scores[0]:
            report[f"{name}_{key}_mean"] = sum(score[key] for score in scores) / len(scores)
    report["holdout_psnr_mean"] = sum(score["psnr"] for score in all_scores) / len(all_scores)
    report["holdout_first_frame_psnr_mean"] = sum(score["first_frame_psnr"] for score in all_scores) / len(all_scores)
    report["holdout_colour_error_mean"] = sum(score["colour_error"] for score in all_scores) / len(all_scores)
    return report


class PeriodicEval:
    """`extra_step_check`: every `every` steps, whole-clip PSNR of a few held-out clips -> vae_eval_log.jsonl."""

    def __init__(self, vae, clips: list[ClipVideo], every: int, path: Path, device: torch.device, is_main: bool):
        self.vae, self.clips, self.every, self.path, self.device, self.is_main = vae, clips, every, path, device, is_main
        self.videos = None

    def __call__(self, step: int, metrics: dict[str, float]) -> None:
        if not self.is_main or self.every <= 0 or step % self.every:
            return
        if self.videos is None:
            self.videos = [read_video(clip.video) for clip in self.clips]
        was_training = self.vae.training
        self.vae.eval()
        scores = reconstruction_scores(self.vae, self.videos, self.device)
        self.vae.train(was_training)
        record = {"step": step, **{key: sum(score[key] for score in scores) / len(scores) for key in scores[0]},
                  "clips": [clip.clip_id for clip in self.clips]}
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(record) + "\n")
        log0(f"step {step}: held-out whole-clip PSNR {record['psnr']:.2f} dB (first frame "
             f"{record['first_frame_psnr']:.2f} dB, colour error {record['colour_error']:.4f})")


def vae_run_name(flags: dict, *, world_size: int, device_type: str, subset: str = "") -> str:
    blocks = "-".join(str(channels) for channels in flags["block_out_channels"])
    return (f"{flags['experiment']}_c{flags['latent_channels']}_b{blocks}_lr{format_lr(flags['lr'])}_"
            f"steps{flags['max_steps']}_{world_size}{'gpu' if device_type == 'cuda' else 'cpu'}")


def read_clip_table(path: Path) -> list[ClipVideo]:
    """The clips of a clip table (`video` relative to the table's folder)."""
    clips = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if line.strip():
            record = json.loads(line)
            if "clip_id" not in record or "video" not in record:
                raise ValueError(f"{path} line {number}: expected fields 'clip_id' and 'video'")
            clips.append(ClipVideo(str(record["clip_id"]), str((path.parent / record["video"]).resolve())))
    if not clips:
        raise ValueError(f"{path}: no clips")
    return clips


class VaeStep:
    """`step_fn`: reconstruct one window, MSE + kl_weight x KL; the posterior noise comes from (seed, micro-step)."""

    def __init__(self, vae, kl_weight: float, seed: int, run_state: RunState, device: torch.device):
        self.vae, self.kl_weight, self.seed, self.run_state, self.device = vae, kl_weight, seed, run_state, device

    def __call__(self, item: dict, *, sync: bool, due: frozenset[str]) -> dict[str, float]:
        x = item["frames"].to(self.device)
        posterior = self.vae.encode(x).latent_dist
        generator = torch.Generator(device=self.device).manual_seed(self.seed * 1_000_003 + self.run_state.micro_step)
        reconstruction = self.vae.decode(posterior.sample(generator=generator)).sample
        mse = torch.mean((reconstruction - x) ** 2)
        kl = posterior.kl().mean() / x[0, 0].numel()
        (mse + self.kl_weight * kl).backward()
        return {"loss": mse.item() + self.kl_weight * kl.item(), "mse": mse.item(), "kl": kl.item(),
                "psnr": psnr(reconstruction.detach(), x), "frames": float(x.shape[2])}


def load_initial_weights(vae, source: Path) -> None:
    """Strictly load a vae/ folder's or a loop checkpoint's weights (cast to the model's FP32)."""
    if source.is_dir():
        from diffusers import AutoencoderKLHunyuanVideo15

        state = AutoencoderKLHunyuanVideo15.from_pretrained(str(source)).state_dict()
    else:
        state = safetensors.torch.load_file(str(source))
    vae.load_state_dict({name: tensor.float() for name, tensor in state.items()}, strict=True)
    log0(f"world VAE initialised from {source}")


def save_vae_folder(vae, folder: Path) -> None:
    """`save_pretrained` into a staging folder, then renamed into place."""
    staging = folder.parent / f".{folder.name}.writing"
    if staging.exists():
        shutil.rmtree(staging)
    vae.save_pretrained(str(staging))
    if folder.exists():
        shutil.rmtree(folder)
    staging.rename(folder)


def build(args: argparse.Namespace, env: DistEnv, policy: PrecisionPolicy, *, resuming: bool = False,
          run_dir: Path | None = None) -> RecipeParts:
    """Step 2: the world VAE (seeded from --seed; FP32 only, as parse_args requires, so `policy` is fp32's and
    changes nothing; --init_from's weights unless a training state is resumed: `resuming`), AdamW with warmup + cosine, its role (gradients all-reduced), the VAE step and,
    with --holdout and --eval_every, the periodic held-out PSNR (`extra_step_check`, into `run_dir`)."""
    vae = build_world_vae(world_vae_config(args.latent_channels, args.block_out_channels), args.seed)
    vae = vae.to(env.device).train()
    if not resuming and args.init_from is not None:
        load_initial_weights(vae, args.init_from)
    optimizer = build_optimizer({ROLE: list(vae.parameters())}, {ROLE: args.lr},
                                betas=(args.adam_beta1, args.adam_beta2), weight_decay=args.weight_decay)
    schedule = WarmupCosineSchedule(optimizer, warmup_steps=args.warmup_steps, max_steps=args.max_steps)
    role = Role(ROLE, vae, optimizer, schedule, grad_clip=args.grad_clip, grad_sync="all_reduce")
    run_state = RunState()
    periodic = None
    if args.holdout is not None and args.eval_every > 0:
        watched = [clip for group in eval_groups(args.holdout, args.eval_clips).values() for clip in group]
        periodic = PeriodicEval(vae, watched[:args.eval_clips], args.eval_every, Path(run_dir) / "vae_eval_log.jsonl",
                                env.device, env.is_main)
    return RecipeParts(roles=[role], step_fn=VaeStep(vae, args.kl_weight, args.seed, run_state, env.device),
                       models=[vae], run_state=run_state, loop_options={"extra_step_check": periodic},
                       objects={"vae": vae})


def build_data(args: argparse.Namespace, env: DistEnv) -> tuple[list[ClipVideo], object]:
    """Step 3: the training clips and this rank's batches of their windows (a mix of short and long ones)."""
    clips = read_clip_table(args.clips)
    dataset = ClipWindows(clips, num_frames=args.num_frames, short=args.short, long_min=args.long_min,
                          long_fraction=args.long_fraction, windows_per_clip=8, seed=args.seed,
                          windows_per_item=args.windows_per_item, long_windows_per_item=args.long_windows_per_item)
    return clips, one_item_per_rank_batches(dataset, env, seed=args.seed, num_workers=args.num_workers)


def finish(args: argparse.Namespace, vae, env: DistEnv, run_dir: Path) -> None:
    """Step 7 (rank 0): the latent scale (posterior means of unit variance on the first --eval_clips training clips),
    held-out PSNR of whole clips (vae_eval.json) and the diffusers folder <run_dir>/vae/."""
    vae.eval()
    train_videos = [read_video(clip.video) for clip in read_clip_table(args.clips)[:args.eval_clips]]
    std = latent_std(vae, train_videos, env.device)
    vae.register_to_config(scaling_factor=1.0 / std)
    report = {"latent_std": std, "scaling_factor": 1.0 / std}
    if args.holdout is not None:
        groups = eval_groups(args.holdout, args.eval_clips)
        report.update(score_groups(vae, groups, env.device))
        log0(f"held-out full-clip PSNR {report['holdout_psnr_mean']:.2f} dB over "
             f"{sum(len(group) for group in groups.values())} clips "
             + ", ".join(f"{name} {report[f'{name}_psnr_mean']:.2f} dB" for name in groups))
    write_json_atomic(run_dir / EVAL_NAME, report)
    save_vae_folder(vae, run_dir / "vae")
    log0(f"world VAE saved: {run_dir / 'vae'} (scaling_factor {1.0 / std:.4f})")


@command
def main(argv=None) -> int:
    args = parse_args(argv)
    # 1. The run directory, named from the flags; a finished run whose vae/ is exported has nothing left to do.
    meta = {"method": "world_vae", "precision": args.precision}
    start = plan_run(args, meta=meta, naming=vae_run_name)
    if args.check_only:
        read_clip_table(args.clips)  # the clip tables read first
        if args.holdout is not None:
            read_clip_table(args.holdout)
        return report_check(start)
    if args.print_run_dir:
        return report_run_start(start)
    if start.kind == "finished" and (start.run_dir / "vae" / "config.json").is_file():
        log0(start.describe())
        return 0
    env = init_distributed(args.backend)
    try:
        log0(start.describe())
        seed_everything(args.seed, rank=env.rank)
        # 2. The VAE, its optimizer and role, the step and the periodic eval (see build).
        parts = build(args, env, precision_policy(args.precision, env.device),
                      resuming=start.resume_path is not None, run_dir=start.run_dir)
        vae = parts.objects["vae"]
        if start.kind == "finished":  # trained, but stopped before the export of step 7
            load_model_weights(start.resume_path, vae, expect=meta, role=ROLE)
        else:
            if env.is_main:
                start.run_dir.mkdir(parents=True, exist_ok=True)
            # 3. Data: clip windows, one item per rank per micro-batch.
            clips, batches = build_data(args, env)
            # 4. Resume (the run directory's own unfinished run): the role and the data position.
            run_state = resume_roles(start, parts.roles, batches, meta, parts.run_state)
            # 5. Config and summary.
            config = run_config(args, run_name=start.run_name, vae_config=world_vae_config(
                args.latent_channels, args.block_out_channels), num_clips=len(clips), world_size=env.world_size)
            if env.is_main:
                write_train_config(start.run_dir, config)
            log0(f"world VAE: {sum(p.numel() for p in vae.parameters()):,} parameters; {len(clips)} training clips; "
                 f"steps {run_state.global_step + 1}..{start.stop_step}")
            # 6. Train: the VAE step and the shared loop.
            run_training(RunSettings.from_flags(args), start, env, roles=parts.roles, batches=batches,
                         step_fn=parts.step_fn, run_state=run_state, config=config, meta=meta, **parts.loop_options)
            if start.stop_step < args.max_steps:
                return 0
        # 7. Finish: the latent scale, held-out PSNR of whole clips, the diffusers folder.
        if env.is_main:
            finish(args, vae, env, start.run_dir)
        return 0
    finally:
        cleanup_distributed()


if __name__ == "__main__":
    sys.exit(main())
