"""Rebuild the demo world from nothing: render -> VAE -> encoders -> encode -> df_sft [-> df_sft_continue]
[-> ODE cache -> kd [-> dmd]] -> ship (docs/demo_world.md).

    python tools/build_demo_world.py --out demo_data/world            # every stage; rerun to resume
    python tools/build_demo_world.py --out demo_data/world --stages render,vae
    python tools/build_demo_world.py --out demo_data/world --teacher_from kd   # also distil, and ship the kd model
    python tools/build_demo_world.py --out demo_data/world --teacher_from df_sft_continue  # train df_sft on, ship it
    python tools/build_demo_world.py --out demo_data/world --teacher_from dmd  # kd, then distribution matching

Each stage is one of the project's own commands, run as a subprocess, and each resumes where it stopped (they
keep their completion markers: the render's world_config.json, the VAE run's vae/ folder, the encoders'
model_index.json, the dataset's manifest.jsonl, a run's exported model/, the cache's COMPLETE), so running this again
continues the first unfinished stage. Each stage's wall time (summed over runs) and headline figure go to
`<out>/build_report.json`.

Stages and outputs (all under --out):
    render     render/            tools/render_world.py: clips, poses, captions, train / holdout tables
    vae        vae_run/vae/       tools/train_world_vae.py: the world VAE (held-out PSNR in vae_run/vae_eval.json)
    encoders   encoders/          tiny text / glyph / vision encoders + the world VAE (predictor_training.world.assets)
    encode     video_latents/     tools/build_video_latent_dataset.py over both tables (with --reuse_weights and
               --distil_clips only the clips the distillation uses, tables in distil_clips/)
    df_sft     df_sft/model/      fvtools/train_df_sft.py: the world Teacher, every parameter from scratch
    df_sft_continue  df_sft_continue/model/   fvtools/train_df_sft.py again, from df_sft/model/ with a new
               learning-rate schedule (--df_sft_continue_steps, --df_sft_continue_lr, and the lowest noise level
               it trains, --df_sft_continue_sigma_min); with several rounds
               (--df_sft_continue_steps 4000,5000) round k trains round k-1's model on into df_sft_continue_<k>/
               and the last round's model ships                                  (--teacher_from df_sft_continue)
    ode_cache  ode_cache/         tools/build_ode_cache.py: the many-step rollouts of the model named by --distil_from
               (default the df_sft model; --distil_clips caches a subset of the clips)   (--teacher_from kd)
    kd         kd/model/          fvtools/train_kd.py: a 4-step student of them at shift 5; with several rounds
               (--kd_steps 1500,1500 --kd_lr 3e-4,1e-4) round k trains round k-1's student on, on the same
               cache, into kd_<k>/, and the last round's student ships                 (--teacher_from kd)
    dmd        dmd/ema/model/     fvtools/train_dmd2.py --generator student --train full: distribution matching
               distillation of a 4-step student (from the kd stage's last round, or --dmd_from DIR) on its own
               rollouts (Self-Forcing: every chunk on the student's own history, which is also the context the
               real and fake scores see, with the same memory frames); the real score is the many-step model of
               --distil_from, the fake score a full copy of it trained online; the generator's EMA ships
                                                                                      (--teacher_from dmd)
    ship       predictor_training/world/weights/{vae,teacher}/, plus world_config.json and build_report.json:
               what the package ships (commit it; git keeps every version, so rarely)

Which model is shipped as the Teacher (`--teacher_from`): by default the df_sft model, run with the real 4-step
schedule at shift 5. `--teacher_from kd` adds the two distillation stages and ships their student. The Teacher the
package ships is such a student, 4-step distilled as the real model is: kd in two rounds from the 4-step rollouts of
a df_sft_continue model (docs/demo_world.md has both builds' commands; a kd student of 16-step rollouts drifted on
its own history, benchmarks/results/2026-12-02-demo-world-build.md);
`--teacher_from df_sft_continue` trains the df_sft model on (a second cosine schedule: a finished run's schedule
cannot be lengthened in place) and ships that.

Distilling a world that was already built (`--reuse_weights DIR`, e.g. the shipped predictor_training/world/weights):
the vae stage copies DIR/vae/ and DIR/vae_eval.json into vae_run/ instead of training (after checking that the
render stage made the world of DIR/world_config.json), the df_sft stages are left out, and the distillation stages
distil DIR/teacher/ (`--distil_from weights`, the default with --reuse_weights); the shipped report is then DIR's
with this build's distillation stages added. A 4-step student of a weights folder FM (e.g. the flow-matching Teacher
of build 1), from 400 train clips' 4-step rollouts, without touching the shipped weights (no ship stage):

    python tools/build_demo_world.py --out demo_data/world_kd --reuse_weights FM --teacher_from kd \
        --stages render,vae,encoders,encode,ode_cache,kd --distil_clips 400,8 --teacher_steps 4 \
        --kd_steps 1500,1500 --kd_lr 3e-4,1e-4 \
        --num_scenes 400 --holdout_scenes 12 --paths_per_scene 4 --holdout_paths 1 --revisit_paths 2
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

from predictor_training.runtime.errors import CommandParser, UserInputError, command
from predictor_training.runtime.flags import SEED, add_check_only_arg, report_check_only
from predictor_training.runtime.io import write_json_atomic
from predictor_training.world.clips import WorldSettings

REPO_ROOT = Path(__file__).resolve().parents[1]
STAGES = ("render", "vae", "encoders", "encode", "df_sft", "df_sft_continue", "ode_cache", "kd", "dmd", "ship")
# Stages run by default only when --teacher_from names the model they make (or one made from it).
OPTIONAL_STAGES = {"df_sft_continue": ("df_sft_continue",), "kd": ("ode_cache", "kd"), "dmd": ("ode_cache", "kd", "dmd")}
DISTIL_SOURCES = ("df_sft", "df_sft_continue", "weights")
REUSED_FILES = ("vae/config.json", "vae_eval.json", "teacher/config.json", "world_config.json")


def parse_args(argv=None) -> argparse.Namespace:
    parser = CommandParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="the world's build folder")
    parser.add_argument("--stages", type=str, default=None,
                        help=f"comma-separated stages to run, in this order: {','.join(STAGES)} (default: all, "
                        "without the optional stages of a --teacher_from that is not chosen: "
                        + "; ".join(f"{','.join(stages)} unless --teacher_from {name}"
                                    for name, stages in OPTIONAL_STAGES.items()) + ")")
    parser.add_argument("--teacher_from", choices=("df_sft", *OPTIONAL_STAGES), default="df_sft",
                        help="which model the ship stage ships as the world Teacher (default %(default)s)")
    parser.add_argument("--seed", type=SEED, default=0, help="seed of every stage (default %(default)s)")
    world = parser.add_argument_group("world (render stage; tools/render_world.py's flags, same defaults)")
    for name, value in asdict(WorldSettings()).items():
        if name not in ("seed", "video_format"):
            world.add_argument(f"--{name}", type=int, default=value, help="(default %(default)s)")
    parser.add_argument("--vae_steps", type=int, default=2000, help="VAE optimizer steps (default %(default)s)")
    vae = parser.add_argument_group("VAE (tools/train_world_vae.py's flags)")
    vae.add_argument("--vae_latent_channels", type=int, default=16, help="(default %(default)s)")
    vae.add_argument("--vae_block_out_channels", type=str, default="8,16,32,32", help="(default %(default)s)")
    vae.add_argument("--vae_lr", type=float, default=1.5e-3, help="(default %(default)g)")
    vae.add_argument("--vae_warmup_steps", type=int, default=50, help="(default %(default)s)")
    vae.add_argument("--vae_grad_accum", type=int, default=2, help="(default %(default)s)")
    vae.add_argument("--vae_long_fraction", type=float, default=0.3, help="(default %(default)g)")
    vae.add_argument("--vae_eval_every", type=int, default=0,
                     help="held-out whole-clip PSNR every this many steps (default %(default)s: at the end only)")
    vae.add_argument("--vae_ckpt_every", type=int, default=250, help="(default %(default)s)")
    vae.add_argument("--vae_windows_per_item", type=int, default=1,
                     help="short windows per micro-batch (default %(default)s; >= 2 is ~3x faster per window on CPU)")
    vae.add_argument("--vae_long_windows_per_item", type=int, default=None,
                     help="long windows per micro-batch (default: --vae_windows_per_item)")
    parser.add_argument("--df_sft_steps", type=int, default=5000, help="df_sft optimizer steps (default %(default)s)")
    parser.add_argument("--df_sft_warmup_steps", type=int, default=100,
                        help="warmup steps of the df_sft run and of each df_sft_continue round (default %(default)s)")
    parser.add_argument("--df_sft_val_every", type=int, default=1000,
                        help="df_sft: validate (the model's own 4-step rollout of held-out clips against their truth, "
                             "val/psnr_vs_truth in df_sft/train_log.jsonl) every N steps; 0 = never "
                             "(default %(default)s)")
    parser.add_argument("--df_sft_val_videos", type=int, default=4,
                        help="df_sft: held-out videos per validation (default %(default)s)")
    parser.add_argument("--df_sft_continue_steps", type=str, default="4000",
                        help="df_sft_continue: optimizer steps of each round, comma-separated; round k trains round "
                             "k-1's model on with a new cosine schedule (default %(default)s: one round)")
    parser.add_argument("--df_sft_continue_lr", type=str, default="5e-4",
                        help="df_sft_continue: peak learning rate of each round, comma-separated, or one for every "
                             "round (default %(default)s)")
    parser.add_argument("--df_sft_continue_sigma_min", type=str, default="0",
                        help="df_sft_continue: lowest noise level of each round's uniform draw, comma-separated, or "
                             "one for every round; 0.6 trains only the levels the 4-step schedule at shift 5 visits "
                             "(1, 0.94, 0.83, 0.625) (default %(default)s)")
    parser.add_argument("--kd_steps", type=str, default="1500",
                        help="kd: optimizer steps of each round, comma-separated; round k >= 2 trains round k-1's "
                             "student on, on the same ODE cache, with a new schedule (default %(default)s: one round)")
    parser.add_argument("--kd_lr", type=str, default="3e-4",
                        help="kd: peak learning rate of each round, comma-separated, or one for every round "
                             "(default %(default)s)")
    parser.add_argument("--kd_warmup_steps", type=int, default=50, help="kd warmup steps (default %(default)s)")
    parser.add_argument("--teacher_steps", type=int, default=16,
                        help="steps of the distilled model's rollouts that kd distils (default %(default)s)")
    dmd = parser.add_argument_group("dmd stage (fvtools/train_dmd2.py --generator student --train full)")
    dmd.add_argument("--dmd_from", type=Path, default=None,
                     help="the 4-step student distribution matching starts from (a model folder, e.g. the shipped "
                          "kd Teacher predictor_training/world/weights/teacher); the ode_cache and kd stages are then "
                          "left out of the default stages (default: the kd stage's last round's model)")
    dmd.add_argument("--dmd_steps", type=int, default=2000,
                     help="loop steps (the fake score trains every step, the student every "
                          "--dmd_generator_every) (default %(default)s)")
    dmd.add_argument("--dmd_lr", type=float, default=2e-5, help="the student's peak LR (default %(default)g)")
    dmd.add_argument("--dmd_fake_score_lr", type=float, default=4e-5,
                     help="the fake score's peak LR (default %(default)g)")
    dmd.add_argument("--dmd_generator_every", type=int, default=5,
                     help="student updates every N loop steps (default %(default)s, as Self-Forcing)")
    dmd.add_argument("--dmd_warmup_steps", type=int, default=100, help="(default %(default)s)")
    dmd.add_argument("--dmd_student_sampler", choices=("renoise", "euler"), default="renoise",
                     help="how the student's training rollout moves between steps before its exit step "
                          "(fvtools/train_dmd2.py --student_sampler): renoise = Self-Forcing's (the x0 estimate "
                          "noised again with fresh noise), euler = along the velocity; the shipped Teacher samples "
                          "with Euler steps either way, as the real one does (default %(default)s)")
    dmd.add_argument("--dmd_score_sigma_min", type=float, default=0.02,
                     help="the lowest noise level the real and fake scores see (fvtools/train_dmd2.py "
                          "--score_sigma_min); 0.6 keeps them where a real score trained by a last df_sft_continue "
                          "round at --df_sft_continue_sigma_min 0.6 was trained last (default %(default)g)")
    dmd.add_argument("--dmd_truth_weight", type=float, default=0.0,
                     help="weight of the mse of the student's chunks against the rendered clip's latents in its "
                          "loss (fvtools/train_dmd2.py --truth_weight; 0 = distribution matching alone) "
                          "(default %(default)g)")
    dmd.add_argument("--dmd_val_every", type=int, default=250,
                     help="validate the student's own rollout of held-out clips against their truth every N steps; "
                          "0 = never (default %(default)s)")
    dmd.add_argument("--dmd_ckpt_every", type=int, default=100, help="(default %(default)s)")
    parser.add_argument("--reuse_weights", type=Path, default=None,
                        help="a world-weights folder (vae/, teacher/, vae_eval.json, world_config.json; e.g. the "
                             "shipped predictor_training/world/weights) whose VAE the vae stage copies instead of "
                             "training and whose Teacher the distillation stages distil; the df_sft stages are then "
                             "left out of the default stages (default: none, train everything)")
    parser.add_argument("--distil_from", choices=DISTIL_SOURCES, default=None,
                        help="the many-step model the ode_cache and kd stages distil: df_sft (df_sft/model), "
                             "df_sft_continue (the last round's model) or weights (--reuse_weights DIR/teacher) "
                             "(default: weights with --reuse_weights, else df_sft)")
    parser.add_argument("--distil_clips", type=str, default=None,
                        help="ode_cache: at most this many clips of train,holdout, evenly spaced (e.g. 400,8: one "
                             "number per split, or one for both; tools/build_ode_cache.py --max_clips; default: "
                             "every clip); with --reuse_weights the encode stage also encodes only those clips "
                             "(tables in distil_clips/)")
    add_check_only_arg(parser, what="each stage it would run and that stage's command (a stage's inputs are the "
                       "outputs of the ones before it: each command checks them when it runs)")
    args = parser.parse_args(argv)
    if args.distil_clips is not None:
        try:
            counts = [int(item) for item in args.distil_clips.split(",")]
        except ValueError:
            counts = []
        if len(counts) not in (1, 2) or min(counts) < 1:
            parser.error(f"--distil_clips={args.distil_clips!r}: one count >= 1 for train and holdout, or two (N,M)")
    if args.distil_from is None:
        args.distil_from = "weights" if args.reuse_weights is not None else "df_sft"
    if args.distil_from == "weights" and args.reuse_weights is None:
        parser.error("--distil_from weights needs --reuse_weights DIR")
    if args.reuse_weights is not None:
        missing = [name for name in REUSED_FILES if not (args.reuse_weights / name).exists()]
        if missing:
            parser.error(f"--reuse_weights={str(args.reuse_weights)!r}: {', '.join(missing)} missing there")
        if args.teacher_from not in ("kd", "dmd"):
            parser.error(f"--reuse_weights reuses the world Teacher, so --teacher_from {args.teacher_from} (a model "
                         "the df_sft stages train) has nothing to ship; use --teacher_from kd or dmd")
    if args.dmd_from is not None and not (args.dmd_from / "config.json").is_file():
        parser.error(f"--dmd_from={str(args.dmd_from)!r}: no config.json there; expected a model folder (config.json "
                     "+ diffusion_pytorch_model.safetensors)")
    for name in ("dmd_steps", "dmd_generator_every", "dmd_ckpt_every"):
        if getattr(args, name) < 1:
            parser.error(f"--{name}={getattr(args, name)}: expected an integer >= 1")
    if not 0 <= args.dmd_warmup_steps < args.dmd_steps:
        parser.error(f"--dmd_warmup_steps={args.dmd_warmup_steps}: expected 0 <= it < --dmd_steps ({args.dmd_steps})")
    if not 0 <= args.dmd_score_sigma_min < 0.98:
        parser.error(f"--dmd_score_sigma_min={args.dmd_score_sigma_min}: expected 0 <= it < 0.98 (the scores' highest "
                     "level)")
    if args.dmd_truth_weight < 0:
        parser.error(f"--dmd_truth_weight={args.dmd_truth_weight}: expected a number >= 0")
    if args.dmd_val_every < 0:
        parser.error(f"--dmd_val_every={args.dmd_val_every}: expected an integer >= 0")
    for name in ("dmd_lr", "dmd_fake_score_lr"):
        if not getattr(args, name) > 0:
            parser.error(f"--{name}={getattr(args, name)}: expected a number > 0")
    if args.stages is None:
        chosen = set(OPTIONAL_STAGES.get(args.teacher_from, ()))
        if args.teacher_from == "dmd" and args.dmd_from is not None:
            chosen = {"dmd"}  # distribution matching from a given student: no kd stages to run
        skipped = {stage for stages in OPTIONAL_STAGES.values() for stage in stages} - chosen
        if args.reuse_weights is not None:
            skipped |= {"df_sft", "df_sft_continue"}
        args.stages = [stage for stage in STAGES if stage not in skipped]
    else:
        args.stages = [stage for stage in args.stages.split(",") if stage]
    unknown = sorted(set(args.stages) - set(STAGES))
    if unknown:
        parser.error(f"--stages: unknown stage(s) {unknown}; expected among {list(STAGES)}")
    for steps_flag, per_round_flags in (("df_sft_continue_steps", ("df_sft_continue_lr", "df_sft_continue_sigma_min")),
                                        ("kd_steps", ("kd_lr",))):
        try:
            setattr(args, steps_flag, [int(steps) for steps in getattr(args, steps_flag).split(",")])
            per_round = {name: [float(value) for value in getattr(args, name).split(",")] for name in per_round_flags}
        except ValueError as error:
            parser.error(f"--{steps_flag} / {', '.join('--' + name for name in per_round_flags)}: comma-separated "
                         f"numbers expected ({error})")
        rounds = len(getattr(args, steps_flag))
        for name, values in per_round.items():
            if len(values) not in (1, rounds):
                parser.error(f"--{name}: {len(values)} values for {rounds} rounds of --{steps_flag}; "
                             "expected one or one per round")
            setattr(args, name, values * rounds if len(values) == 1 else values)
    return args


def chained_rounds(stage: str, start: Path, out: Path, **per_round: list) -> list[dict]:
    """Rounds of a stage trained one after another: round 1 from the model folder `start` into <out>/<stage>/, round
    k >= 2 from round k-1's model into <out>/<stage>_<k>/. per_round: one list per setting (steps, lr, ...), a value
    per round; each round's dict holds them with its name, index, init (the model it starts from) and run_dir."""
    rounds, init = [], start
    for index, values in enumerate(zip(*per_round.values()), start=1):
        name = stage if index == 1 else f"{stage}_{index}"
        rounds.append({"name": name, "index": index, "init": init, "run_dir": out / name,
                       **dict(zip(per_round, values))})
        init = out / name / "model"
    return rounds


def continue_rounds(args, out: Path) -> list[dict]:
    """The df_sft_continue stage's rounds (`chained_rounds` from df_sft/model), each with its own cosine schedule
    and seed + k."""
    seeds = [args.seed + index for index in range(1, len(args.df_sft_continue_steps) + 1)]
    return chained_rounds("df_sft_continue", out / "df_sft" / "model", out, steps=args.df_sft_continue_steps,
                          lr=args.df_sft_continue_lr, sigma_min=args.df_sft_continue_sigma_min, seed=seeds)


def kd_rounds(args, out: Path) -> list[dict]:
    """The kd stage's rounds (`chained_rounds`): round 1 distils the --distil_from model's ODE cache into kd/
    (student initialised from that model), round k >= 2 trains round k-1's student on, on the same cache, each with
    its own schedule and the build's seed."""
    return chained_rounds("kd", distilled_model(args, out), out, steps=args.kd_steps, lr=args.kd_lr)


def shipped_teacher(args, out: Path) -> Path:
    """The model folder the ship stage ships as the world Teacher."""
    if args.teacher_from == "df_sft_continue":
        return continue_rounds(args, out)[-1]["run_dir"] / "model"
    if args.teacher_from == "kd":
        return kd_rounds(args, out)[-1]["run_dir"] / "model"
    if args.teacher_from == "dmd":
        return out / "dmd" / "ema" / "model"  # the generator's EMA, as Self-Forcing samples with
    return out / args.teacher_from / "model"


def dmd_start(args, out: Path) -> Path:
    """The 4-step student the dmd stage starts from: --dmd_from, else the kd stage's last round's model."""
    return args.dmd_from.resolve() if args.dmd_from is not None else kd_rounds(args, out)[-1]["run_dir"] / "model"


def distilled_model(args, out: Path) -> Path:
    """The many-step model the ode_cache and kd stages distil (--distil_from)."""
    if args.distil_from == "weights":
        return args.reuse_weights.resolve() / "teacher"
    if args.distil_from == "df_sft_continue":
        return continue_rounds(args, out)[-1]["run_dir"] / "model"
    return out / "df_sft" / "model"


# The vae stage under --reuse_weights: check that the rendered world is the weights' world, then copy their VAE (a
# rerun finds the same files and keeps them).
REUSE_VAE_CODE = """
import filecmp, json, shutil, sys
from pathlib import Path
out, weights = Path(sys.argv[1]), Path(sys.argv[2])
rendered = json.loads((out / 'render' / 'world_config.json').read_text())
recorded = json.loads((weights / 'world_config.json').read_text())
different = [key for key in ('settings', 'clips') if rendered.get(key) != recorded.get(key)]
if different:
    sys.exit(f'{out}/render is not the world of {weights} (different {different}): render it with the world flags '
             'the weights were built with (data.md, Demo world)')
vae, target = weights / 'vae', out / 'vae_run' / 'vae'
if target.exists():
    comparison = filecmp.dircmp(vae, target)
    if comparison.left_only or comparison.right_only or filecmp.cmpfiles(vae, target, comparison.common_files,
                                                                         shallow=False)[1:] != ([], []):
        sys.exit(f'{target} exists and differs from {vae}; remove it to reuse the weights VAE')
else:
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(vae, target.parent / '.vae.copying', dirs_exist_ok=True)
    (target.parent / '.vae.copying').rename(target)
shutil.copy(weights / 'vae_eval.json', out / 'vae_run' / 'vae_eval.json')
print(f'reused the VAE of {weights} in {target}')
"""


# The encode stage under --reuse_weights with --distil_clips: clip tables of the evenly spaced subset of each table
# (predictor_training.data.ode_cache.evenly_spaced, as tools/build_ode_cache.py --max_clips picks them), with the
# same splits (file names) and paths made relative to the new tables.
SUBSET_TABLES_CODE = """
import json, os, sys
from pathlib import Path
from predictor_training.data.ode_cache import evenly_spaced
from predictor_training.runtime.io import write_bytes_atomic
out, counts, tables = Path(sys.argv[1]), [int(item) for item in sys.argv[2].split(',')], [Path(arg) for arg in sys.argv[3:]]
out.mkdir(parents=True, exist_ok=True)
for table, count in zip(tables, counts * len(tables) if len(counts) == 1 else counts):
    rows = [json.loads(line) for line in table.read_text().splitlines() if line.strip()]
    lines = []
    for index in evenly_spaced(len(rows), count):
        row = dict(rows[index])
        for key in ('video', 'pose'):
            row[key] = os.path.relpath((table.parent / row[key]).resolve(), out.resolve())
        lines.append(json.dumps(row) + chr(10))
    write_bytes_atomic(out / table.name, ''.join(lines).encode('utf-8'))
    print(f'{out / table.name}: {len(lines)} of {len(rows)} clips')
"""


def run(command: list[str], log: Path) -> None:
    """Run one stage's command; its output goes to `log` (and the last lines to the console on failure)."""
    print(f"[build_demo_world] $ {' '.join(command)}", flush=True)
    with open(log, "a", encoding="utf-8") as handle:
        result = subprocess.run(command, stdout=handle, stderr=subprocess.STDOUT, cwd=REPO_ROOT)
    if result.returncode != 0:
        tail = log.read_text(encoding="utf-8", errors="replace").splitlines()[-30:]
        raise SystemExit(f"stage command failed (exit {result.returncode}); last lines of {log}:\n" + "\n".join(tail))


def stage_commands(stage: str, args, out: Path) -> list[list[str]]:
    python = sys.executable
    if stage == "render":
        world = [f"--{name}={getattr(args, name)}" for name in asdict(WorldSettings()) if name not in ("seed", "video_format")]
        return [[python, "tools/render_world.py", "--out", str(out / "render"), "--seed", str(args.seed), *world]]
    if stage == "vae" and args.reuse_weights is not None:
        return [[python, "-c", REUSE_VAE_CODE, str(out), str(args.reuse_weights.resolve())]]
    if stage == "vae":
        return [[python, "tools/train_world_vae.py", "--clips", str(out / "render" / "train.jsonl"), "--holdout",
                 str(out / "render" / "holdout.jsonl"), "--max_steps", str(args.vae_steps), "--seed", str(args.seed),
                 "--num_frames", str(args.num_frames), "--latent_channels", str(args.vae_latent_channels),
                 "--block_out_channels", args.vae_block_out_channels, "--lr", str(args.vae_lr),
                 "--warmup_steps", str(args.vae_warmup_steps), "--grad_accum", str(args.vae_grad_accum),
                 "--long_fraction", str(args.vae_long_fraction),
                 "--eval_every", str(args.vae_eval_every), "--ckpt_every", str(args.vae_ckpt_every),
                 "--windows_per_item", str(args.vae_windows_per_item),
                 *(["--long_windows_per_item", str(args.vae_long_windows_per_item)]
                   if args.vae_long_windows_per_item is not None else []),
                 "--output_dir", str(out / "vae_run"), "--no_progress"]]
    if stage == "encoders":
        code = ("import json,sys; from predictor_training.world.assets import write_world_encoders, "
                "write_world_teacher_config; from diffusers import AutoencoderKLHunyuanVideo15 as V; "
                "out=sys.argv[1]; config=json.load(open(out+'/render/world_config.json')); "
                "captions=[clip['caption'] for clip in config['clips']]; "
                "write_world_encoders(out+'/encoders', out+'/vae_run/vae', captions, int(sys.argv[2])); "
                "write_world_teacher_config(out+'/teacher_config', V.load_config(out+'/vae_run/vae')['latent_channels'])")
        return [[python, "-c", code, str(out), str(args.seed)]]
    if stage == "encode":
        render = out / "render"
        tables, subset = [render / "train.jsonl", render / "holdout.jsonl"], []
        if args.reuse_weights is not None and args.distil_clips:
            # The video latents serve only the distillation: encode the clips the ode_cache stage will cache.
            subset = [[python, "-c", SUBSET_TABLES_CODE, str(out / "distil_clips"), args.distil_clips,
                       *map(str, tables)]]
            tables = [out / "distil_clips" / table.name for table in tables]
        return [*subset, [python, "tools/build_video_latent_dataset.py", "--clips",
                 ",".join(map(str, tables)), "--encoders", str(out / "encoders"),
                 "--out", str(out / "video_latents"), "--height", str(args.height), "--width", str(args.width),
                 "--num_frames", str(args.num_frames),
                 "--dtype", "float32", "--storage_dtype", "float32", "--device", "cpu"]]
    if stage in ("df_sft", "df_sft_continue"):
        # df_sft trains the world Teacher from scratch; each df_sft_continue round trains the previous model on.
        if stage == "df_sft":
            runs = [{"name": "df_sft", "init": out / "teacher_config", "run_dir": out / "df_sft",
                     "steps": args.df_sft_steps, "lr": 1e-3, "sigma_min": 0.0, "seed": args.seed}]
        else:
            runs = continue_rounds(args, out)
        # --no_action_ckpt: the world's Teacher folders (its config, a df_sft model/) hold the action weights.
        return [[python, "fvtools/train_df_sft.py", "--teacher", str(run["init"]), "--no_action_ckpt", "--dataset_root",
                 str(out / "video_latents"), "--train", "full",
                 "--init_weights", "scratch" if stage == "df_sft" else "teacher", "--precision", "fp32",
                 "--lr", f"{run['lr']:g}", "--max_steps", str(run["steps"]),
                 "--warmup_steps", str(args.df_sft_warmup_steps),
                 "--sigma_sampler", "uniform", "--sigma_min", f"{run['sigma_min']:g}", "--sigma_max", "1",
                 "--chunks_per_clip", "2", "--no-gradient_checkpointing", "--ckpt_every", "500", "--keep_last", "2",
                 "--log_every", "10", "--tracker", "none", "--num_workers", "0", "--seed", str(run["seed"]),
                 "--val_every", str(args.df_sft_val_every), "--val_videos", str(args.df_sft_val_videos),
                 "--experiment", f"world_{run['name']}", "--output_dir", str(run["run_dir"]), "--no_progress"]
                for run in runs]
    if stage == "ode_cache":
        return [[python, "tools/build_ode_cache.py", "--teacher", str(distilled_model(args, out)), "--video_latents",
                 str(out / "video_latents"), "--splits", "train,holdout", "--steps", str(args.teacher_steps),
                 "--store_grid", "4", "--dtype", "float32", "--storage_dtype", "float32", "--seed", str(args.seed),
                 *(["--max_clips", args.distil_clips] if args.distil_clips else []),
                 "--out", str(out / "ode_cache")]]
    if stage == "kd":
        return [[python, "fvtools/train_kd.py", "--teacher", str(run["init"]), "--no_action_ckpt", "--cache_root",
                 str(out / "ode_cache"), "--train", "full", "--init_weights", "teacher", "--precision", "fp32",
                 "--lr", f"{run['lr']:g}", "--max_steps", str(run["steps"]), "--warmup_steps", str(args.kd_warmup_steps),
                 "--chunks_per_clip", "2",
                 "--no-gradient_checkpointing", "--ckpt_every", "500", "--keep_last", "2", "--log_every", "10",
                 "--tracker", "none", "--num_workers", "0", "--seed", str(args.seed), "--experiment",
                 f"world_{run['name']}", "--output_dir", str(run["run_dir"]), "--no_progress"]
                for run in kd_rounds(args, out)]
    if stage == "dmd":
        return [[python, "fvtools/train_dmd2.py", "--teacher", str(dmd_start(args, out)), "--no_action_ckpt",
                 "--dataset_root",
                 str(out / "video_latents"), "--real_score", str(distilled_model(args, out)),
                 "--generator", "student", "--train", "full", "--init_weights", "teacher",
                 "--fake_score_train", "full", "--rollout", "self", "--exit_step", "uniform", "--precision", "fp32",
                 "--student_sampler", args.dmd_student_sampler, "--score_sigma_min", f"{args.dmd_score_sigma_min:g}",
                 "--truth_weight", f"{args.dmd_truth_weight:g}",
                 "--lr", f"{args.dmd_lr:g}", "--fake_score_lr", f"{args.dmd_fake_score_lr:g}", "--adam_beta1", "0",
                 "--generator_every", str(args.dmd_generator_every), "--max_steps", str(args.dmd_steps),
                 "--warmup_steps", str(args.dmd_warmup_steps), "--no-gradient_checkpointing",
                 "--ckpt_every", str(args.dmd_ckpt_every), "--keep_last", "100", "--log_every", "10",
                 "--monitor_every", "50", "--tracker", "none", "--num_workers", "0", "--seed", str(args.seed),
                 "--val_every", str(args.dmd_val_every), "--val_videos", "4", "--experiment", "world_dmd",
                 "--output_dir", str(out / "dmd"), "--no_progress"]]
    if stage == "ship":
        code = ("import shutil,sys; from pathlib import Path; from predictor_training.world.assets import WORLD_WEIGHTS; "
                "out=Path(sys.argv[1]); staging=WORLD_WEIGHTS.parent/'.weights.writing'; "
                "shutil.rmtree(staging, ignore_errors=True); staging.mkdir(); "
                "shutil.copytree(out/'vae_run'/'vae', staging/'vae'); shutil.copytree(sys.argv[2], staging/'teacher'); "
                "shutil.copy(out/'render'/'world_config.json', staging); shutil.copy(out/'shipped_report.json', staging/'build_report.json'); "
                "shutil.copy(out/'vae_run'/'vae_eval.json', staging); "
                "(WORLD_WEIGHTS/'README.md').is_file() and shutil.copy(WORLD_WEIGHTS/'README.md', staging); "
                "[(shutil.copytree(kept, staging/kept.name), print(f'[ship] kept {kept.name}/: a Predictor of the "
                "Teacher shipped before; retrain it on this one or replace it')) for kept in WORLD_WEIGHTS.glob('predictor_*')]; "
                "shutil.rmtree(WORLD_WEIGHTS, ignore_errors=True); staging.rename(WORLD_WEIGHTS)")
        return [[python, "-c", code, str(out), str(shipped_teacher(args, out))]]
    raise ValueError(stage)


def shipped_report(args, report: dict) -> dict:
    """The build_report.json the ship stage ships: this build's report, or with --reuse_weights the reused weights'
    report (the build that trained the distilled Teacher) with this build's distillation stages added and the
    wall time of its own render / vae copy / encoders / encode under "distillation_build"."""
    if args.reuse_weights is None:
        return report
    shipped = json.loads((args.reuse_weights / "build_report.json").read_text())
    distilled = {stage: report[stage] for stage in ("ode_cache", "kd", "dmd") if stage in report}
    setup = {stage: report[stage]["seconds"] for stage in ("render", "vae", "encoders", "encode") if stage in report}
    return {**shipped, **distilled, "distillation_build": {"seconds": setup}}


def headline(stage: str, args, out: Path) -> dict:
    """The stage's figure for the report (what a person checks first)."""
    def last_losses(run_dir: Path) -> dict:
        records = [json.loads(line) for line in (run_dir / "train_log.jsonl").read_text().splitlines()]
        losses = [record["loss"] for record in records if "loss" in record]
        window = max(1, len(losses) // 10)
        figures = {"first_loss_mean": sum(losses[:window]) / window, "last_loss_mean": sum(losses[-window:]) / window,
                   "logged_steps": len(losses)}
        validations = [record for record in records if "val/psnr_vs_truth" in record]
        if validations:
            figures["last_val_psnr_vs_truth"] = validations[-1]["val/psnr_vs_truth"]
        return figures

    if stage == "vae":
        return json.loads((out / "vae_run" / "vae_eval.json").read_text())
    if stage == "df_sft_continue":
        return {run["name"]: last_losses(run["run_dir"]) for run in continue_rounds(args, out)}
    if stage == "kd":
        return {run["name"]: {**last_losses(run["run_dir"]),
                              "student_vs_teacher": json.loads((run["run_dir"] / "kd_eval.json").read_text())}
                for run in kd_rounds(args, out)}
    if stage == "df_sft":
        return last_losses(out / stage)
    if stage == "dmd":
        return last_losses(out / "dmd")
    return {}


@command
def main(argv=None) -> int:
    args = parse_args(argv)
    out = args.out.resolve()
    if args.check_only:
        if out.exists() and not out.is_dir():
            raise UserInputError(f"--out {args.out}: a file; expected the world's build folder")
        return report_check_only(*(f"{stage}: {' '.join(str(part) for part in command)}"
                                   for stage in STAGES if stage in args.stages
                                   for command in stage_commands(stage, args, out)))
    out.mkdir(parents=True, exist_ok=True)
    report_path = out / "build_report.json"
    report = json.loads(report_path.read_text()) if report_path.is_file() else {}
    for stage in STAGES:
        if stage not in args.stages:
            continue
        started = time.time()
        if stage == "ship":
            write_json_atomic(out / "shipped_report.json", shipped_report(args, report))
        for stage_command in stage_commands(stage, args, out):
            run(stage_command, out / f"{stage}.log")
        seconds = time.time() - started
        spent = report.get(stage, {}).get("seconds", 0.0) + seconds  # over every run that worked on the stage
        report[stage] = {"seconds": round(spent, 1), **headline(stage, args, out)}
        write_json_atomic(report_path, report)
        print(f"[build_demo_world] {stage}: {seconds:.0f} s {json.dumps(report[stage])[:300]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
