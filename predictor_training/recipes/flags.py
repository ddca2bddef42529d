"""The recipes' domain flag groups: what the flags mean to a Predictor recipe or a generic method (data, Teacher,
Predictor, optimisation, the method's model, loss, validation, the schedule), above every layer that reads them.
`runtime/flags.py` keeps the machinery (value parsers, presets, --config, the rules of single flags) and the run's
own groups (run directory, tracker, threads). As there, every `add_*_args` takes the recipe's numbers as required
keyword arguments: each entry script's `parse_args()` is the one place its defaults are written.

The schedule: one flag group (`add_plan_args`: --replace_steps, --reuse_steps) whose one check is
`StepPlan.from_steps` gives `args.plan` on every parse, the `StepPlan` every recipe, the eval and the leaderboard
take; `check_plan` holds the rules a recipe adds (a trained Predictor runs at least one step).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Sequence

from predictor_training.data.sample_table import SPLIT_NAMES
from predictor_training.eval.inputs import DEMO_CONFIG_NAME
from predictor_training.methods.flow_matching import SIGMA_SAMPLERS
from predictor_training.rollout.schedule import DEFAULT_REPLACE_STEPS, StepPlan, parse_replace_steps
from predictor_training.runtime.errors import CommandParser


# ---------------------------------------------------------------------------------------------------------------
# Value parsers of the domain flags
# ---------------------------------------------------------------------------------------------------------------
def parse_source_blocks(text: str) -> tuple[int, int]:
    """"1,52" -> (1, 52). Two distinct non-negative block indices (checked against the Teacher later)."""
    parts = [part.strip() for part in str(text).split(",") if part.strip()]
    try:
        blocks = tuple(int(part) for part in parts)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"--source_blocks {text!r}: expected two integers like '1,52'") from error
    if len(blocks) != 2 or blocks[0] == blocks[1] or min(blocks) < 0:
        raise argparse.ArgumentTypeError(f"--source_blocks {text!r}: expected two distinct indices >= 0 like '1,52'")
    return blocks


def parse_pairs(text: str) -> tuple[tuple[int, int], ...]:
    """"0-1,1-2,2-3" -> ((0, 1), (1, 2), (2, 3)): (anchor step, target step) pairs, anchor < target."""
    pairs = []
    for part in [part.strip() for part in str(text).split(",") if part.strip()]:
        pieces = part.split("-")
        if len(pieces) != 2 or not all(piece.strip().isdigit() for piece in pieces):
            raise argparse.ArgumentTypeError(f"--pairs {text!r}: item {part!r} is not 'anchor-target' like '0-1'")
        anchor, target = int(pieces[0]), int(pieces[1])
        if anchor >= target:
            raise argparse.ArgumentTypeError(f"--pairs {text!r}: item {part!r} needs anchor < target")
        pairs.append((anchor, target))
    if not pairs:
        raise argparse.ArgumentTypeError(f"--pairs {text!r}: no pair given")
    if len(set(pairs)) != len(pairs):
        raise argparse.ArgumentTypeError(f"--pairs {text!r}: a pair is listed twice")
    return tuple(pairs)


def format_pairs(pairs: Sequence[tuple[int, int]]) -> str:
    """((0, 1), (1, 2)) -> "0-1,1-2" (inverse of parse_pairs)."""
    return ",".join(f"{anchor}-{target}" for anchor, target in pairs)


def parse_subset_cases(text: str) -> int | list[str]:
    """"8" -> 8 (a seeded choice of 8 cases); "c004,c011" -> those case ids."""
    parts = [part.strip() for part in str(text).split(",") if part.strip()]
    if not parts:
        raise argparse.ArgumentTypeError(f"--subset_cases {text!r}: expected a count like 8 or case ids like c004,c011")
    if len(parts) == 1 and parts[0].isdigit():
        return int(parts[0])
    return parts


# ---------------------------------------------------------------------------------------------------------------
# The domain flag groups (the recipe's numbers come from the entry script)
# ---------------------------------------------------------------------------------------------------------------
def add_data_args(parser: argparse.ArgumentParser, *, num_workers: int, pairs: str | None) -> None:
    """--dataset_root, --split, --num_workers, --verify_dataset and (unless pairs=None) --pairs."""
    group = parser.add_argument_group("data")
    group.add_argument("--dataset_root", type=Path, required=True,
                       help="dataset root made by tools/build_predictor_dataset.py (dataset_config.json, "
                            "manifest.jsonl)")
    group.add_argument("--split", type=str, default="train", help="manifest split to train on (default %(default)s)")
    if pairs is not None:
        group.add_argument("--pairs", type=parse_pairs, default=parse_pairs(pairs),
                           help=f"supervision pairs 'anchor-target' of denoising steps, comma-separated (default "
                                f"{pairs}; '0-1,2-3' reproduces the F-P-F-P recipes v1-v3)")
    group.add_argument("--num_workers", type=int, default=num_workers,
                       help="DataLoader worker processes per rank, 0 = main process (default %(default)s)")
    group.add_argument("--verify_dataset", action="store_true",
                       help="also check size and sha256 of every dataset file against the manifest before training "
                            "(each tensor's checksum is checked when it is read in any case)")


def add_teacher_args(parser: argparse.ArgumentParser, *, group=None, from_dataset: bool = True) -> None:
    """--teacher, --action_ckpt, in `group` (default: a new "teacher" group of `parser`). from_dataset: the
    Predictor recipes' form, both defaulting to what the dataset recorded (`data.dataset_config.
    resolve_teacher_source`); otherwise the generic methods' (the model they train): --teacher required to train,
    --action_ckpt required whenever the Teacher's weights are read unless --no_action_ckpt (`check_action_ckpt`)."""
    group = parser.add_argument_group("teacher") if group is None else group
    if from_dataset:
        teacher_help = ("Teacher transformer folder (config.json + safetensors); default: the folder recorded in the "
                        "dataset's dataset_config.json, so the Predictor learns from the Teacher that made the data")
        action_help = ("WorldPlay action checkpoint loaded strictly on top of --teacher; default: the one recorded in "
                       "dataset_config.json when --teacher is not given, else none")
    else:
        teacher_help = ("Teacher transformer folder (config.json + safetensors), required to train: the base of a "
                        "LoRA, the start of a full run with --init_weights teacher, or only the config with "
                        "--init_weights scratch")
        action_help = ("WorldPlay action checkpoint loaded strictly on top of --teacher (the real model: "
                       "ar_distilled_action_model/diffusion_pytorch_model.safetensors); required whenever the "
                       "Teacher's weights are read, unless --no_action_ckpt")
    group.add_argument("--teacher", type=Path, default=None, help=teacher_help)
    group.add_argument("--action_ckpt", type=Path, default=None, help=action_help)
    if not from_dataset:
        group.add_argument("--no_action_ckpt", action="store_true",
                           help="--teacher already holds the WorldPlay action weights (a df_sft run's model/ folder, "
                                "the demo world's Teacher): load it alone")


def add_gradient_checkpointing_arg(group, *, default: bool, what: str) -> None:
    """--gradient_checkpointing / --no-gradient_checkpointing: non-reentrant activation checkpointing of `what`."""
    group.add_argument("--gradient_checkpointing", action=argparse.BooleanOptionalAction, default=default,
                       help=f"non-reentrant activation checkpointing of {what} (default %(default)s)")


def add_predictor_args(parser: argparse.ArgumentParser, *, source_blocks: str, gradient_checkpointing: bool) -> None:
    """--source_blocks, --gradient_checkpointing / --no-gradient_checkpointing."""
    group = parser.add_argument_group("predictor")
    group.add_argument("--source_blocks", type=parse_source_blocks, default=parse_source_blocks(source_blocks),
                       help=f"the two Teacher double blocks copied into the Predictor, 'a,b' (default {source_blocks}; "
                            "the real Teacher also has '0,53')")
    add_gradient_checkpointing_arg(group, default=gradient_checkpointing, what="the two Predictor blocks")
    group.add_argument("--no_gradient_checkpointing", dest="gradient_checkpointing", action="store_false",
                       help=argparse.SUPPRESS)  # the spelling of earlier versions


def add_optimization_args(
    parser: argparse.ArgumentParser,
    *,
    fusion_lr: float,
    blocks_lr: float,
    max_steps: int,
    scheduler_warmup_steps: int,
    block_warmup_steps: int,
    batch_size: int | None,
    grad_accum: int,
    weight_decay: float,
    adam_beta1: float,
    adam_beta2: float,
    grad_clip: float,
) -> None:
    """Learning rates, schedule, AdamW, clipping, batch (no --batch_size when batch_size=None) and accumulation."""
    group = parser.add_argument_group("optimisation")
    group.add_argument("--fusion_lr", type=float, default=fusion_lr,
                       help="peak LR of the image fusion + residual head group (default %(default)g)")
    group.add_argument("--blocks_lr", type=float, default=blocks_lr,
                       help="peak LR of the two copied Teacher blocks (default %(default)g)")
    _add_length_args(group, max_steps=max_steps)
    group.add_argument("--scheduler_warmup_steps", type=int, default=scheduler_warmup_steps,
                       help="linear warmup steps of both groups before the cosine decay (default %(default)s)")
    group.add_argument("--block_warmup_steps", type=int, default=block_warmup_steps,
                       help="steps during which the blocks group is held at LR 0 while fusion/head train, then it "
                            "follows the schedule; -1 = none (default %(default)s)")
    if batch_size is not None:
        group.add_argument("--batch_size", type=int, default=batch_size,
                           help="micro-batch per rank (per GPU) (default %(default)s)")
    _add_adamw_args(group, grad_accum=grad_accum, weight_decay=weight_decay, adam_beta1=adam_beta1,
                    adam_beta2=adam_beta2, grad_clip=grad_clip)


def _add_length_args(group, *, max_steps: int) -> None:
    group.add_argument("--max_steps", type=int, default=max_steps,
                       help="optimizer steps of the schedule: the cosine reaches 0 here (default %(default)s)")
    group.add_argument("--stop_at_step", type=int, default=-1,
                       help="end this run at this optimizer step (checkpoint written), keeping the max_steps schedule; "
                            "-1 = run to max_steps")


def _add_adamw_args(group, *, grad_accum: int, weight_decay: float, adam_beta1: float, adam_beta2: float,
                    grad_clip: float) -> None:
    group.add_argument("--grad_accum", type=int, default=grad_accum,
                       help="micro-batches accumulated per optimizer step on each rank (default %(default)s)")
    group.add_argument("--weight_decay", type=float, default=weight_decay, help="AdamW weight decay (default %(default)g)")
    group.add_argument("--adam_beta1", type=float, default=adam_beta1, help="AdamW beta1 (default %(default)g)")
    group.add_argument("--adam_beta2", type=float, default=adam_beta2, help="AdamW beta2 (default %(default)g)")
    group.add_argument("--grad_clip", type=float, default=grad_clip,
                       help="global gradient-norm clip; -1 = measure only (default %(default)g)")


def add_method_model_args(
    parser: argparse.ArgumentParser,
    *,
    train: str,
    init_weights: str,
    lora_rank: int,
    lora_alpha: float,
    gradient_checkpointing: bool,
    context_grad: bool,
) -> None:
    """The model a generic method trains (`method_model.py`): --teacher, --action_ckpt / --no_action_ckpt, --train,
    --init_weights, --lora_rank, --lora_alpha, --gradient_checkpointing, --context_grad, and --dry_run (its
    parameter counts). `check_action_ckpt` is the rule of the first pair."""
    group = parser.add_argument_group("model")
    add_teacher_args(parser, group=group, from_dataset=False)
    group.add_argument("--train", choices=("lora", "full"), default=train,
                       help="lora: a LoRA adapter on the frozen Teacher's image-stream linears; full: every parameter "
                            "(FSDP2-sharded under torchrun) (default %(default)s)")
    group.add_argument("--init_weights", choices=("teacher", "scratch"), default=init_weights,
                       help="--train full starts from the Teacher's weights or from a fresh seeded initialisation of "
                            "its config (default %(default)s; a LoRA always sits on the Teacher)")
    group.add_argument("--lora_rank", type=int, default=lora_rank, help="LoRA rank (default %(default)s)")
    group.add_argument("--lora_alpha", type=float, default=lora_alpha,
                       help="LoRA alpha; the update is scaled by alpha / rank (default %(default)g)")
    add_gradient_checkpointing_arg(group, default=gradient_checkpointing,
                                   what="the model's double blocks in the chunk step")
    group.add_argument("--context_grad", action=argparse.BooleanOptionalAction, default=context_grad,
                       help="back-propagate through the context prefill too, so the model learns to encode its "
                            "context (default %(default)s)")
    group.add_argument("--dry_run", type=str, default=None, metavar="CONFIG",
                       help="print the parameter count of each role and of a LoRA adapter at --lora_rank for this "
                            "Teacher config (a preset such as worldplay_480p_i2v, or a config.json), built on the "
                            "meta device, and exit")


def check_action_ckpt(parser: argparse.ArgumentParser, args: argparse.Namespace, *, reads_teacher_weights: bool
                      ) -> None:
    """A world-model method whose Teacher weights are read (`reads_teacher_weights`: a LoRA's base, the start of a
    full run, the Full steps of a composite) needs the WorldPlay action model: the real --teacher folder is the base
    HunyuanVideo-1.5 transformer, and without --action_ckpt the method would train on it silently. Refused (one
    line, exit 2) unless --no_action_ckpt says the folder already holds the action weights."""
    if args.action_ckpt is not None and args.no_action_ckpt:
        parser.error(f"--action_ckpt={str(args.action_ckpt)!r} with --no_action_ckpt: give one or the other")
    if args.teacher is not None and reads_teacher_weights and args.action_ckpt is None and not args.no_action_ckpt:
        parser.error(f"--action_ckpt is missing: --teacher {args.teacher} alone would be trained on without "
                     "WorldPlay's action weights; pass --action_ckpt FILE (the ar_distilled_action_model "
                     "safetensors, $ACTION_CKPT in docs/walkthrough.md), or --no_action_ckpt when --teacher already "
                     "holds them (a df_sft run's model/ folder, the demo world's Teacher)")


def add_method_optimization_args(
    parser: argparse.ArgumentParser,
    *,
    lr: float,
    max_steps: int,
    warmup_steps: int,
    grad_accum: int,
    weight_decay: float,
    adam_beta1: float,
    adam_beta2: float,
    grad_clip: float,
) -> None:
    """One learning rate with warmup + cosine, AdamW, clipping and accumulation (generic methods)."""
    group = parser.add_argument_group("optimisation")
    group.add_argument("--lr", type=float, default=lr, help="peak learning rate (default %(default)g)")
    _add_length_args(group, max_steps=max_steps)
    group.add_argument("--warmup_steps", type=int, default=warmup_steps,
                       help="linear warmup steps before the cosine decay (default %(default)s)")
    _add_adamw_args(group, grad_accum=grad_accum, weight_decay=weight_decay, adam_beta1=adam_beta1,
                    adam_beta2=adam_beta2, grad_clip=grad_clip)


def add_loss_args(parser: argparse.ArgumentParser, *, velocity_weight: float, hidden_weight: float) -> None:
    """--velocity_weight, --hidden_weight: loss = velocity_weight * mse_v + hidden_weight * mse_h (FP32)."""
    group = parser.add_argument_group("loss")
    group.add_argument("--velocity_weight", type=float, default=velocity_weight,
                       help="weight of mse(pred_velocity, teacher_velocity) (default %(default)g)")
    group.add_argument("--hidden_weight", type=float, default=hidden_weight,
                       help="weight of mse(pred_hidden, teacher_final_hidden) (default %(default)g)")


def add_validation_args(parser: argparse.ArgumentParser, *, val_every: int, val_videos: int) -> None:
    """--val_every, --val_split, --val_videos, --val_vae, --val_ground_truth (held-out quality while training)."""
    group = parser.add_argument_group("validation (held-out videos while training; docs/validation.md)")
    group.add_argument("--val_every", type=int, default=val_every,
                       help="validate every N optimizer steps and at the last step; 0 = never (default %(default)s)")
    group.add_argument("--val_split", type=str, default=None,
                       help="held-out split to validate on (default: the first held-out sample table the dataset "
                            "records, e.g. holdout25)")
    group.add_argument("--val_videos", type=int, default=val_videos,
                       help="videos per validation, the first rows of the split, sharded over the ranks (default "
                            "%(default)s)")
    group.add_argument("--val_vae", type=Path, default=None,
                       help="VAE folder that decodes the validation videos (AutoencoderKLHunyuanVideo15); needed "
                            "with --val_every > 0")
    group.add_argument("--val_ground_truth", type=Path, default=None,
                       help="folder of ground-truth videos (<case>__a<action>/ PNG frames or .mp4): also score "
                            "against the truth")


# ---------------------------------------------------------------------------------------------------------------
# The schedule: --replace_steps / --reuse_steps -> args.plan
# ---------------------------------------------------------------------------------------------------------------
def add_plan_args(parser: CommandParser, *, reuse: bool, group=None, note: str = "") -> None:
    """--replace_steps (F-P-P-P by default) and, with `reuse`, --reuse_steps (none by default), in `group` (an
    argument group of `parser`; default the parser), and `args.plan`, their `StepPlan` (chunk 0 F-F-F-F), on every
    parse of `parser` (a refused plan: one line naming the flags, exit 2). `note`: what the plan means in this
    recipe, appended to the help."""
    target = parser if group is None else group
    target.add_argument("--replace_steps", type=parse_replace_steps, default=DEFAULT_REPLACE_STEPS,
                        help="steps the Predictor runs in every chunk after chunk 0 (F-F-F-F): 1,2,3 = F-P-P-P "
                             "(default), 1,2 = F-P-P-F, 1,3 = F-P-F-P; the others are Full Teacher steps" + note)
    if reuse:
        target.add_argument("--reuse_steps", type=parse_replace_steps, default=(),
                            help="steps filled by velocity reuse (the fewer-step sampler's skipped steps: no model "
                                 "call), disjoint from --replace_steps: --reuse_steps 1,2 --replace_steps 3 = "
                                 "F-R-R-P. Default: none")
    parser.derive("plan", lambda args: StepPlan.from_steps(args.replace_steps, args.reuse_steps if reuse else ()))


def check_plan(parser: argparse.ArgumentParser, plan: StepPlan, *, predictor_step: bool = True) -> None:
    """A recipe's rules on its plan beyond `StepPlan.from_steps`: reused steps need a Predictor step after them,
    and with `predictor_step` (a trained Predictor) the plan has at least one. `parser.error` names the flags."""
    if plan.reuse_steps and not plan.predictor_steps:
        parser.error(f"--reuse_steps {','.join(map(str, plan.reuse_steps))}: needs --replace_steps, the steps the "
                     "Predictor runs")
    if predictor_step and not plan.predictor_steps:
        parser.error("--replace_steps is empty: the Predictor runs (and trains on) at least one step")


# ---------------------------------------------------------------------------------------------------------------
# Training noise levels (generic methods) and the evaluation commands' inputs
# ---------------------------------------------------------------------------------------------------------------
def add_sigma_args(
    parser: argparse.ArgumentParser,
    *,
    sampler: str,
    sigma_min: float,
    sigma_max: float,
    shift: float,
    logit_mean: float,
    logit_std: float,
) -> None:
    """How training noise levels are drawn (`flow_matching.sample_sigmas`): always inside the bounds, never clamped."""
    group = parser.add_argument_group("noise levels")
    group.add_argument("--sigma_sampler", choices=SIGMA_SAMPLERS, default=sampler,
                       help="uniform; logit_normal (sigmoid of a normal, redrawn outside the bounds); shifted (a "
                            "uniform u mapped by the schedule shift, more high noise for shift > 1) (default "
                            "%(default)s)")
    group.add_argument("--sigma_min", type=float, default=sigma_min, help="lowest noise level (default %(default)g)")
    group.add_argument("--sigma_max", type=float, default=sigma_max, help="highest noise level (default %(default)g)")
    group.add_argument("--sigma_shift", type=float, default=shift,
                       help="shift of --sigma_sampler shifted (default %(default)g, the 4-step schedule's)")
    group.add_argument("--logit_mean", type=float, default=logit_mean,
                       help="mean of --sigma_sampler logit_normal (default %(default)g)")
    group.add_argument("--logit_std", type=float, default=logit_std,
                       help="std of --sigma_sampler logit_normal (default %(default)g)")


def add_input_args(parser: argparse.ArgumentParser) -> None:
    """The evaluation commands' inputs (`eval/inputs.resolve_inputs` reads them): --demo, or the Teacher, VAE,
    sample tables, case source, split and ground truth one by one."""
    inputs = parser.add_argument_group("inputs (either --demo D, or the separate flags)")
    inputs.add_argument("--demo", type=Path, help="demo asset folder (tools/make_demo_assets.py): D/teacher, "
                        "D/encoders/vae, D/samples/<split>.jsonl, D/encoded")
    inputs.add_argument("--teacher", type=Path, help="Teacher transformer folder; default: the one recorded in the "
                        "first checkpoint's run config (flags teacher / dataset_root). Either way its config is "
                        "checked against the Teacher config recorded by the checkpoints' training dataset, if any")
    inputs.add_argument("--action_ckpt", type=Path, help="WorldPlay action checkpoint loaded strictly on --teacher")
    inputs.add_argument("--vae", type=Path, help="AutoencoderKLHunyuanVideo15 folder (or a diffusers pipeline folder "
                        "with vae/)")
    inputs.add_argument("--samples_dir", type=Path, help="folder of the sample tables <split>.jsonl")
    inputs.add_argument("--encoded", type=Path, help="encoder outputs {case_id}.pt (the text prefill then runs and "
                        "is timed)")
    inputs.add_argument("--dataset_root", type=Path, help="instead of --encoded: a built dataset whose cases/ hold the "
                        "stored text K/V (no text prefill is run or timed)")
    inputs.add_argument("--split", choices=SPLIT_NAMES, default="holdout25", help="which sample table to evaluate; "
                        "held-out numbers are the ones that count: choose on holdout25 / holdout50, quote final (new "
                        "scenes nothing is chosen on) in a headline")
    inputs.add_argument("--max_videos", type=int, default=None, help="evaluate only the first N rows of the split")
    inputs.add_argument("--num_latents", type=int, default=32, help="latent frames per video (poses must match)")
    inputs.add_argument("--ground_truth", type=Path, default=None, metavar="DIR", help="folder of ground-truth "
                        "videos, one per evaluated row, named by its video key <case_id>__a<action_id>: a folder of "
                        "PNG frames DIR/<key>/ or a file DIR/<key>.mp4, with the decoded videos' frame count, height "
                        "and width. Every method, the reference included, and the still-image baseline "
                        "repeat_first_frame (the ground truth's first frame held) are then also scored against it. "
                        f"Default with --demo D: D/<the 'ground_truth' entry of D/{DEMO_CONFIG_NAME}> when it has "
                        "one, else none")
