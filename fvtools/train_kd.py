"""Causal knowledge distillation: a few-step AR student from a many-step teacher's ODE states (docs/methods/kd.md).

The cache (`tools/build_ode_cache.py`) holds, per sample, the many-step teacher's AR rollout: every chunk's latents
at the noise levels of the student's schedule and its final latents. Per micro-batch every rank takes one sample
and trains `--chunks_per_clip` of its chunks. For chunk c it draws one of the student's `--student_steps` noise
levels sigma_k (default the real distilled schedule: 4 steps at shift 5, sigma = 1, .9375, .8333, .625), feeds the
teacher's state x at sigma_k, and regresses the student's clean estimate `x - sigma_k v` onto the teacher's final
latents of the chunk: loss `0.5 mse` (FP32). The student's context is its own prefill of the teacher's earlier
final latents, built exactly as in the AR loop (`predictor_training/rollout/teacher_forcing.py`) with the sample's own
memory-retrieval points (its seed's, as the teacher's rollout drew them): past `memory_frames` latents the memory is
ranked by a Monte-Carlo FOV overlap, and other points could pick other context frames than the ones the teacher's
target was made with. One backward per chunk.

The student is a LoRA on the teacher (`--train lora`) or every parameter of a model of its architecture
(`--train full`, from the teacher's weights by default). Before and after training, the student's own
`--student_steps`-step AR rollout is compared with the teacher's final latents on `--eval_split` (same seed, same
noise): `kd_eval.json` in the run directory, and the summary line, say how much closer it came. While training
(`--val_every N`, off by default; the demo every 50 steps) the same rollout on the first `--val_videos` samples of
`--val_split` (default `--eval_split`) is decoded (`--val_vae`, default the VAE of the video latents the cache was
built from) and scored against the teacher's decoded final latents: val/psnr_vs_teacher, val/ssim_vs_teacher.

    torchrun --nproc_per_node 8 fvtools/train_kd.py --teacher RUN/model --cache_root /data/ode_cache
    bash tools/launch_fvtools_kd.sh                # 8 GPUs; without GPU and data: the CPU demo
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from predictor_training.data.batches import one_item_per_rank_batches
from predictor_training.data.ode_cache import CACHE_CONFIG_NAME, OdeCacheDataset
from predictor_training.data.provenance import run_provenance
from predictor_training.methods.method_model import (
    dry_run_report,
    export_method_model,
    method_meta,
)
from predictor_training.methods.rewards import default_vae_folder
from predictor_training.recipes.flags import (
    add_method_model_args, add_method_optimization_args, add_validation_args, check_action_ckpt,
)
from predictor_training.recipes.kd import METHOD, ROLE, StudentDistance, build, student_state_indices
from predictor_training.runtime.distributed import log0
from predictor_training.runtime.errors import CommandParser, MissingFieldError, command
from predictor_training.runtime.flags import add_run_args, add_tracker_args, check_args, parse_recipe_args
from predictor_training.runtime.io import read_json_file
from predictor_training.runtime.launch import Launch, Recipe, RunPlan, run_recipe
from predictor_training.runtime.logger import log_summary, method_summary_rows
from predictor_training.runtime.provenance import with_provenance
from predictor_training.runtime.recipe import RecipeData, RecipeParts
from predictor_training.runtime.run_directory import (
    environment_summary,
    method_run_name,
    run_config,
    write_train_config,
)
from predictor_training.teacher.config import DISTILLED_SHIFT

PRESETS = {
    # The CPU demo: every parameter of the df_sft demo model, distilled from its own 32-step rollouts (the demo
    # cache) to 4 steps; FP32, no tracker.
    # --no_action_ckpt: the demo world's Teacher (and a df_sft model/ export) holds its action weights.
    "demo": ["--experiment", "kd_demo", "--train", "full", "--init_weights", "teacher", "--precision", "fp32",
             "--lr", "3e-4", "--max_steps", "200", "--warmup_steps", "10", "--chunks_per_clip", "2",
             "--no-gradient_checkpointing", "--ckpt_every", "100", "--keep_last", "2", "--tracker", "none",
             "--num_workers", "0", "--val_every", "50", "--val_videos", "1", "--no_action_ckpt"],
    # The recipe at the size the memory rehearsal plans for (tools/estimate_memory.py): its defaults.
    "real_size": ["--train", "lora", "--precision", "fp32master", "--gradient_checkpointing"],
}


def cache_config_field(cache_root: Path, name: str):
    """One field of the cache's ode_cache_config.json; a file that is not a JSON object with it is named."""
    path = cache_root / CACHE_CONFIG_NAME
    config = read_json_file(path)
    if not isinstance(config, dict) or name not in config:
        raise MissingFieldError(f"{path}: no field {name!r}; expected the config tools/build_ode_cache.py wrote")
    return config[name]


def parse_args(argv=None) -> argparse.Namespace:
    """The kd recipe: every default below is the recipe (docs/methods/kd.md)."""
    parser = CommandParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    data = parser.add_argument_group("data")
    data.add_argument("--cache_root", type=Path, default=None,
                      help="finished ODE-state cache (tools/build_ode_cache.py); required to train")
    data.add_argument("--split", type=str, default="train", help="cache split to train on (default %(default)s)")
    data.add_argument("--eval_split", type=str, default="holdout",
                      help="cache split on which the student's own rollout is compared with the teacher before and "
                           "after training (default %(default)s)")
    data.add_argument("--eval_samples", type=int, default=4,
                      help="samples of --eval_split compared (default %(default)s)")
    data.add_argument("--chunks_per_clip", type=int, default=4,
                      help="chunks of each sample trained per micro-batch, each at one of the student's noise levels "
                           "(default %(default)s; the sample's chunk count caps it)")
    data.add_argument("--num_workers", type=int, default=2,
                      help="DataLoader worker processes per rank, 0 = main process (default %(default)s)")
    data.add_argument("--verify_dataset", action="store_true",
                      help="check size and sha256 of every cache file before training")
    student = parser.add_argument_group("student schedule")
    student.add_argument("--student_steps", type=int, default=4,
                         help="the student's denoising steps per chunk (default %(default)s)")
    student.add_argument("--student_shift", type=float, default=DISTILLED_SHIFT,
                         help="the student's schedule shift (default %(default)g); its noise levels must be among "
                              "the cache's stored ones")
    add_method_model_args(parser, train="lora", init_weights="teacher", lora_rank=64, lora_alpha=64.0,
                          gradient_checkpointing=True, context_grad=True)
    add_method_optimization_args(parser, lr=1e-4, max_steps=2000, warmup_steps=100, grad_accum=1, weight_decay=0.01,
                                 adam_beta1=0.9, adam_beta2=0.999, grad_clip=1.0)
    add_run_args(parser, experiment=METHOD, precision="fp32master", ckpt_every=200, keep_last=5, log_every=10, seed=0)
    add_tracker_args(parser, tracker="swanlab", project="hy-fvtools")
    add_validation_args(parser, val_every=0, val_videos=2)
    args = parse_recipe_args(parser, argv, PRESETS)
    if args.dry_run is not None:
        return args
    missing = [f"--{flag}" for flag in ("teacher", "cache_root") if getattr(args, flag) is None]
    if missing:
        parser.error(f"{' and '.join(missing)} missing (or pass --dry_run CONFIG)")
    check_args(parser, args)
    # Rules only this recipe has.
    if not (args.cache_root / CACHE_CONFIG_NAME).is_file():
        parser.error(f"--cache_root={str(args.cache_root)!r}: no {CACHE_CONFIG_NAME} there (build the cache with "
                     "tools/build_ode_cache.py)")
    for flag in ("chunks_per_clip", "student_steps", "eval_samples"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag}={getattr(args, flag)}: expected >= 1")
    stored = cache_config_field(args.cache_root, "stored_sigmas")
    try:
        student_state_indices(args.student_steps, args.student_shift, stored)
    except ValueError as error:
        parser.error(f"--student_steps={args.student_steps} --student_shift={args.student_shift:g}: {error}")
    check_validation_args(parser, args)
    check_action_ckpt(parser, args,
                      reads_teacher_weights=not (args.train == "full" and args.init_weights == "scratch"))
    return args


def check_validation_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--val_split defaults to --eval_split (the cache's held-out split); without --val_vae the VAE is the one of
    the video-latent dataset the cache was built from (its config's inputs.video_latents), when it records one."""
    if args.val_every == 0:  # check_args has checked --val_every >= 0, --val_videos >= 1, --val_vae
        return
    if args.val_ground_truth is not None:
        parser.error("--val_ground_truth: kd validates against the teacher's stored final latents; drop the flag")
    args.val_split = args.val_split or args.eval_split
    if args.val_vae is None:
        source = cache_config_field(args.cache_root, "inputs").get("video_latents")
        try:
            if source is None:
                raise ValueError(f"{args.cache_root / CACHE_CONFIG_NAME} records no source video-latent dataset")
            args.val_vae = default_vae_folder(Path(source))
        except (OSError, KeyError, ValueError) as error:
            parser.error(f"--val_every={args.val_every}: no VAE to decode the validation videos ({error}); pass "
                         "--val_vae DIR")


def check_inputs(args: argparse.Namespace) -> RunPlan:
    """1. The cache, opened before anything is created (the launcher's dry run too); the run is named from the
    flags."""
    OdeCacheDataset(args.cache_root, args.split)
    return RunPlan(meta=method_meta(METHOD, train=args.train, precision=args.precision, lora_rank=args.lora_rank),
                   naming=method_run_name)


def load_data(launch: Launch) -> RecipeData:
    """2. Data: one cached sample per rank per micro-batch, the cache states at the student's noise levels; the
    evaluation split."""
    args = launch.args
    dataset = OdeCacheDataset(args.cache_root, args.split, verify=args.verify_dataset)
    return RecipeData(
        batches=one_item_per_rank_batches(dataset, launch.env, seed=args.seed, num_workers=args.num_workers),
        dataset=dataset,
        values={"eval_dataset": OdeCacheDataset(args.cache_root, args.eval_split),
                "state_indices": student_state_indices(args.student_steps, args.student_shift,
                                                       dataset.stored_sigmas)})


def build_run(launch: Launch) -> RecipeParts:
    """3. The student (LoRA on the teacher, or every parameter) with its optimizer and schedule, the step and the
    validation (see build), and the run's provenance. Resume then restores the role and the data position."""
    args, start = launch.args, launch.start
    parts = build(args, launch.env, launch.policy, state_indices=launch.data.values["state_indices"],
                  run_dir=start.run_dir)
    parts.derived["provenance"] = run_provenance(start, launch.env, teacher=args.teacher,
                                                 action_ckpt=args.action_ckpt, parent=None, data_root=args.cache_root)
    return parts


def summarize(launch: Launch) -> dict:
    """4. The run's config (train_config.json on rank 0) and the summary block; the student's distance to the
    teacher before training (a fresh run only). Returns the config."""
    args, start, env, policy, dataset, parts = (launch.args, launch.start, launch.env, launch.policy,
                                                launch.data.dataset, launch.parts)
    method_model = parts.objects["method_model"]
    config = run_config(
        args, run_name=start.run_name, method=METHOD, world_size=env.world_size, device=str(env.device),
        backend=env.backend, global_batch=env.world_size * args.grad_accum, num_samples=len(dataset),
        cache=dataset.config, trainable_parameters=method_model.trainable_parameter_count(),
        provenance=parts.derived["provenance"], environment=environment_summary(), **start.recorded(),
    )
    if env.is_main:
        write_train_config(start.run_dir, config)
    cache = dataset.config
    log_summary("causal KD", {
        **method_summary_rows(args, run_dir=start.run_dir, precision=policy.describe(),
                              trained=method_model.describe(), first_step=parts.run_state.global_step + 1,
                              stop_step=start.stop_step),
        "data": f"{args.cache_root} (split {args.split}): {len(dataset)} samples; teacher {cache['steps']} steps "
                f"at shift {cache['shift']:g}; student {args.student_steps} steps at shift "
                f"{args.student_shift:g}; {args.chunks_per_clip} chunks per sample",
        "batch": f"1 sample per rank x {env.world_size} ranks x {args.grad_accum} accumulation",
    })
    distance = StudentDistance(args, env, policy, launch.data.values["eval_dataset"], start.run_dir)
    distance.before(method_model.model)
    parts.objects["distance"] = distance
    if parts.validation is not None:
        log0(f"validation every {args.val_every} steps: {parts.validation.describe()}")
    return config


def export(launch: Launch) -> None:
    """After the loop: the student's distance to the teacher again; the student exported (a LoRA file or a Teacher
    folder)."""
    student, step = launch.parts.objects["method_model"], launch.run_state.global_step
    launch.parts.objects["distance"].after(student.model, step)
    exported = export_method_model(student, launch.start.run_dir,
                                   with_provenance({**launch.plan.meta, "step": step}, launch.config), launch.env)
    log0(f"exported the trained {launch.args.train} student: {exported}")


@command
def main(argv=None) -> int:
    """--dry_run prints the parameter counts; otherwise the recipe's steps in order, the shared loop between
    summarize and export (`runtime/launch.run_recipe`)."""
    args = parse_args(argv)
    if args.dry_run is not None:
        print(dry_run_report(args.dry_run, {ROLE: args.train, "teacher": "frozen"}, lora_rank=args.lora_rank))
        return 0
    return run_recipe(args, Recipe(plan=check_inputs, data=load_data, build=build_run, summarize=summarize,
                                   after=export))


if __name__ == "__main__":
    sys.exit(main())
