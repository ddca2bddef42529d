"""Per-GPU memory of a recipe's training step at real size, without a GPU: the recipe's own code on fake tensors
(docs/memory.md).

    python tools/estimate_memory.py --recipe v4                          # 8.6B config, batch 16, 20 context frames
    python tools/estimate_memory.py --recipe v4 --context_frames 0 4 8 12 16 20 --json
    python tools/estimate_memory.py --recipe disca
    python tools/estimate_memory.py --recipe rollout --replace_steps 1,2,3 --context_mode incremental
    python tools/estimate_memory.py --recipe v4 --fit                    # largest batch on 80 GB / 141 GB cards

It builds the Teacher from its config (`--config`, no weights) in BF16 and the Predictor with the recipe's builder,
the recipe's optimizer (AdamW over its two groups, foreach as on CUDA) and precision policy (fp32master: frozen BF16,
trainable FP32, BF16 autocast with CUDA's rules), gradient checkpointing, DDP's gradient buckets (`--world_size` > 1),
then runs the recipe's own step function once (`pair_step`; the rollout's `trajectory_for_row` + `train_trajectory`)
and the loop's clip + optimizer step, all under FakeTensorMode: nothing of real size is allocated
(predictor_training/runtime/memory_rehearsal.py says what is modelled and what is not). It prints the per-rank peak
by category, the phase where it happens, per-phase peaks and the 10 largest tensors alive at the peak; `--json` for
tools. A recipe's batch is synthetic at the largest shapes the data gives (`--text_tokens`, `--latent_grid`,
`--context_frames`).

Recipes: v4, disca (offline pair step), rollout (F-P-P-P by default; --replace_steps 1,2 = F-P-P-F; --context_mode
exact | incremental), df_sft and kd (fvtools/train_{df_sft,kd}.py: the recipe's `build_method_model` and its step
class on one clip of --chunks chunks; --train lora, their default: a LoRA on the BF16 Teacher; --train full: every
parameter, FP32, sharded by the recipe's own `shard_model` (FSDP2's fully_shard) over --world_size ranks in a fake
process group, so the figures are rank 0's: its shard of parameters, gradients and AdamW state plus the all-gather
and reduce-scatter buffers FSDP2 holds while a block runs).

    python tools/estimate_memory.py --recipe df_sft                      # LoRA rank 64, 8 chunks, 4 trained
    python tools/estimate_memory.py --recipe kd --train full --world_size 8

For the methods the rehearsal replaces only what has no data here (`method_rehearsal_hooks`): the Teacher folder
(built from its config), PEFT's adapter move (made where it ends), the chunk draw (the clip's last chunks: the most
context) and the memory selection (run on real CPU values).

    python tools/estimate_memory.py --recipe adversarial                 # v4 + discriminator, batch 16, both roles due
    python tools/estimate_memory.py --recipe adversarial --data rollout  # on-policy F-P-P-P trajectory, 8 chunks
    python tools/estimate_memory.py --recipe eval --context_mode incremental   # eval rollout F-P-P-P, inference
    python tools/estimate_memory.py --recipe nft --samples_per_group 2   # LoRA policy / old / reference, K samples
    python tools/estimate_memory.py --recipe dmd2                        # Predictor F-P-P-P, LoRA real + fake score
    python tools/estimate_memory.py --recipe dmd2 --generator student --real_score model

adversarial: fvtools/train_adversarial.py, the recipe's AdversarialPairStep (--data offline, its default) or
AdversarialRolloutStep (--data rollout: one trajectory of --chunks chunks under --replace_steps) at its heaviest
step (generator term built, lazy R1 applied). eval: tools/eval_predictor.py's
EvalRuntime.rollout of one row (VAE decode, LPIPS and the text prefill not counted). nft: fvtools/train_nft.py's
NftStep with its rewards replaced (VAE decode and reward functions not counted). dmd2: fvtools/train_dmd2.py
(--rollout self, --fake_score_train lora) built by its own builders (build_predictor_role or build_student,
build_scores) and one DistributionMatchingStep on a clip of --chunks chunks at its heaviest loop step: both roles due
(the generator's graph and the critic) on a monitor step, then both roles' clip, AdamW and the generator's EMA.
--generator predictor (the F-P-P-P composite on --source_blocks / --replace_steps, DDP buckets over --world_size) or
student (--train lora: a LoRA rank 64 on the Teacher; full: every parameter, replicated); --real_score lora (a df_sft
adapter on the Teacher, the shapes of df_sft's defaults; default), model (a second BF16 model) or teacher (the raw
Teacher); the fake score is a LoRA on the real score's base. The report's peak_in names the part of the step where
the peak is reached (generator forward / backward of a chunk, critic, the scores' x0, the monitor).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from functools import partial
from pathlib import Path

import torch

from predictor_training.data.synthetic import clip_item, offline_batch, trajectory_row
from predictor_training.predictor.memory_cuts import CUTS, cuts_undone
from predictor_training.rollout.ar_rollout import RolloutConfig
from predictor_training.rollout.schedule import Schedule
from predictor_training.runtime.errors import CommandParser, command
from predictor_training.runtime.memory_rehearsal import (
    CUDA_CONTEXT_GIB,
    GIB,
    DDPBuckets,
    MemoryReport,
    Rehearsal,
    default_dtype,
    fake_process_group,
    fsdp_storage_accounting,
    patched,
    real_values,
    use_foreach,
)

RECIPES = ("v4", "disca", "rollout", "df_sft", "kd", "dmd2", "adversarial", "nft", "eval")
CONTEXT_TIMESTEP = 14.0
MAX_CONTEXT_FRAMES = RolloutConfig.memory_frames  # the AR loop's memory window: no chunk sees more context
MAX_TEXT_TOKENS = 1000  # the pipeline's tokenizer_max_length (data/encoders.py)
# The user's GPUs (torch.cuda.max_memory_allocated, GiB; train notes § 5 and § 8.10), per GPU at the recipe's batch.
USER_SECONDS_PER_MICRO_BATCH = {"v4": 4.49, "disca": 1.66}


def parse_grid(text: str) -> tuple[int, int]:
    try:
        height, width = (int(part) for part in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--latent_grid {text!r}: expected HxW like 30x52") from None
    if height < 1 or width < 1:
        raise argparse.ArgumentTypeError(f"--latent_grid {text!r}: both sizes must be >= 1")
    return height, width


def parse_blocks(text: str) -> tuple[int, int]:
    try:
        blocks = tuple(int(part) for part in text.split(","))
    except ValueError:
        blocks = ()
    if len(blocks) != 2:
        raise argparse.ArgumentTypeError(f"--source_blocks {text!r}: expected two indices like 1,52")
    return blocks


def parse_steps(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--replace_steps {text!r}: expected indices like 1,2,3") from None


def parse_args(argv=None) -> argparse.Namespace:
    parser = CommandParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", required=True, choices=RECIPES, help="the recipe to rehearse")
    parser.add_argument("--config", default="worldplay_480p_i2v",
                        help="Teacher preset (predictor_training/teacher/config.py; default %(default)s)")
    parser.add_argument("--batch_size", type=int, default=16, help="per-GPU batch of the offline recipes (16)")
    parser.add_argument("--context_frames", type=int, nargs="+", default=[20],
                        help=f"v4: context frames of the batch, multiples of 4 in 0..{MAX_CONTEXT_FRAMES} (the "
                             "memory window; the dataset's buckets are 4..20; default 20, the peak)")
    parser.add_argument("--source_blocks", type=parse_blocks, default=(1, 52), help="Predictor blocks (1,52)")
    parser.add_argument("--text_tokens", type=int, default=MAX_TEXT_TOKENS,
                        help=f"text tokens of the longest case, 1..{MAX_TEXT_TOKENS} (the text encoder keeps at most "
                             f"{MAX_TEXT_TOKENS}; default %(default)s)")
    parser.add_argument("--latent_grid", type=parse_grid, default=(30, 52), help="latent HxW (480x832 -> 30x52)")
    parser.add_argument("--chunks", type=int, default=8,
                        help="rollout, the fvtools methods: chunks of one trajectory / clip (8)")
    parser.add_argument("--replace_steps", type=parse_steps, default=(1, 2, 3),
                        help="rollout, dmd2 --generator predictor: Predictor steps per chunk (1,2,3 = F-P-P-P; 1,2 = "
                             "F-P-P-F)")
    parser.add_argument("--context_mode", choices=("exact", "incremental"), default="exact",
                        help="rollout: how each chunk's context K/V are built")
    parser.add_argument("--data", choices=("offline", "rollout"), default="offline",
                        help="adversarial: the recipe's --data, offline (stored Teacher pairs, batch --batch_size; "
                             "its default) or rollout (one on-policy trajectory of --chunks chunks under "
                             "--replace_steps)")
    parser.add_argument("--world_size", type=int, default=8,
                        help="ranks of the job (> 1 counts DDP's gradient buckets; df_sft / kd --train full: FSDP2's "
                             "per-rank shard; default 8)")
    parser.add_argument("--train", choices=("lora", "full"), default="lora",
                        help="df_sft, kd: a LoRA on the Teacher (the recipes' default) or every parameter; dmd2 "
                             "--generator student: its LoRA, or every parameter replicated (FP32, not sharded)")
    parser.add_argument("--generator", choices=("predictor", "student"), default="predictor",
                        help="dmd2: the generator, as train_dmd2's --generator: predictor (the F-P-P-P composite of "
                             "the Teacher and the v4 Predictor on --source_blocks, --replace_steps; the recipe's "
                             "default) or student (a few-step student, --train)")
    parser.add_argument("--real_score", choices=("lora", "model", "teacher"), default="lora",
                        help="dmd2: the kind of train_dmd2's --real_score: lora (a df_sft LoRA file on the Teacher, "
                             "what df_sft's default --train lora exports; default), model (a model folder: a second "
                             "BF16 Teacher-shaped model) or teacher (the raw Teacher, --allow_raw_teacher_score); the "
                             "fake score is a LoRA on the real score's base (--fake_score_train lora)")
    parser.add_argument("--samples_per_group", type=int, default=None,
                        help="nft: K, the samples rolled out per step (default: the recipe's, 8); the peak does not "
                             "grow with K (the samples go to host memory, each is trained with its own backwards)")
    parser.add_argument("--chunks_per_sample", type=int, default=None,
                        help="nft: chunks trained per sample (default: the recipe's, 2)")
    parser.add_argument("--optimizer_steps", type=int, default=1,
                        help="optimizer steps to run (2 shows a later step, with AdamW moments present)")
    parser.add_argument("--no_cuda_autocast", action="store_true",
                        help="leave CPU autocast's own rules (for comparison; the GPU follows CUDA's)")
    parser.add_argument("--fit", action="store_true",
                        help="offline recipes: also find the largest per-GPU batch that fits on 80 GB and 141 GB "
                             "cards (peak + allocator margin + CUDA context), at the largest --context_frames")
    parser.add_argument("--json", action="store_true", help="print one JSON object per estimate instead of text")
    parser.add_argument("--undo_cuts", nargs="+", choices=CUTS, default=[],
                        help="rehearse the code as the user measured it: these memory cuts of issue 20 undone "
                             "(predictor_training/predictor/memory_cuts.py; benchmarks/check_real_size_memory.py)")
    args = parser.parse_args(argv)
    if args.fit and args.recipe not in ("v4", "disca", "rollout"):
        parser.error(f"--fit: the largest batch is searched for the offline recipes (v4, disca) only, not "
                     f"{args.recipe}")
    if args.data != "offline" and args.recipe != "adversarial":
        parser.error(f"--data {args.data}: a mode of --recipe adversarial (the rollout recipe is --recipe rollout)")
    if args.batch_size < 1:
        parser.error(f"--batch_size {args.batch_size}: expected >= 1")
    if any(not 0 <= frames <= MAX_CONTEXT_FRAMES or frames % 4 for frames in args.context_frames):
        parser.error(f"--context_frames {' '.join(map(str, args.context_frames))}: expected multiples of 4 (whole "
                     f"chunks) in 0..{MAX_CONTEXT_FRAMES} (the memory window)")
    if not 1 <= args.text_tokens <= MAX_TEXT_TOKENS:
        parser.error(f"--text_tokens {args.text_tokens}: expected 1..{MAX_TEXT_TOKENS} (the text encoder's limit)")
    if args.chunks < 2:
        parser.error(f"--chunks {args.chunks}: expected >= 2 (chunk 0 plus a trained chunk)")
    if args.world_size < 1 or args.optimizer_steps < 1:
        parser.error("--world_size and --optimizer_steps must be >= 1")
    if not args.replace_steps or not all(1 <= step <= 3 for step in args.replace_steps):
        parser.error(f"--replace_steps {args.replace_steps}: expected steps within 1..3")
    return args


# ---- shared pieces ---------------------------------------------------------------------------------------------
def recipe_args(recipe: str) -> argparse.Namespace:
    """The recipe's own flag defaults (learning rates, betas, clip, loss weights) from its parser."""
    if recipe in ("v4", "disca"):
        import train_predictor_v4
        return train_predictor_v4.build_parser().parse_args(["--dataset_root", "unused"])
    import train_predictor_v4_rollout
    parser_args = ["--dataset_root", "unused"]
    return _rollout_defaults(train_predictor_v4_rollout, parser_args)


def _rollout_defaults(module, argv) -> argparse.Namespace:
    """The rollout parser's defaults without its file checks (no dataset, no --init_from on this machine)."""
    import argparse as _argparse
    captured = {}
    original = _argparse.ArgumentParser.parse_args

    def capture(self, args=None, namespace=None):
        captured["parser"] = self
        raise _Captured

    class _Captured(Exception):
        pass

    _argparse.ArgumentParser.parse_args = capture
    try:
        module.parse_args(argv)
    except _Captured:
        pass
    except SystemExit:
        pass
    finally:
        _argparse.ArgumentParser.parse_args = original
    if "parser" not in captured:
        raise RuntimeError("could not read the rollout recipe's defaults")
    return captured["parser"].parse_args(argv)


def build_models(rehearsal: Rehearsal, args, variant: str):
    """The Teacher (BF16 from its config, as load_teacher leaves it: eval, frozen) and the recipe's Predictor."""
    from predictor_training.predictor.model import build_predictor
    from predictor_training.teacher import WorldPlayTransformer
    with default_dtype(torch.bfloat16):
        teacher = WorldPlayTransformer.from_preset(args.config)
    teacher = teacher.eval().requires_grad_(False)
    rehearsal.label_parameters([teacher])
    torch.manual_seed(0)
    predictor = build_predictor(teacher, variant, args.source_blocks, gradient_checkpointing=True)
    rehearsal.label_parameters([predictor])
    return teacher, predictor


def build_role(rehearsal: Rehearsal, predictor, recipe_flags, world_size: int):
    from predictor_training.runtime.optim import build_optimizer_and_schedule
    from predictor_training.runtime.roles import Role
    optimizer, lr_schedule = build_optimizer_and_schedule(
        predictor, fusion_lr=recipe_flags.fusion_lr, blocks_lr=recipe_flags.blocks_lr,
        betas=(recipe_flags.adam_beta1, recipe_flags.adam_beta2), weight_decay=recipe_flags.weight_decay,
        warmup_steps=recipe_flags.scheduler_warmup_steps, max_steps=recipe_flags.max_steps,
        block_warmup_steps=recipe_flags.block_warmup_steps)
    use_foreach(optimizer)
    role = Role("predictor", predictor, optimizer, lr_schedule, module=predictor, grad_clip=recipe_flags.grad_clip)
    rehearsal.watch_gradients(role.parameters)
    buckets = DDPBuckets(role.parameters, rehearsal.tracker) if world_size > 1 else None
    return role, buckets


def optimizer_phase(rehearsal: Rehearsal, role, buckets, step: int) -> None:
    """What the loop does after the micro-batches: DDP leaves bucket views, clip, AdamW, schedule."""
    from predictor_training.runtime.loop import _grad_norm_and_clip
    if buckets is not None:
        buckets.adopt_gradients()  # the gradients are views of the buckets now
    else:  # FSDP2's sharded gradients are set by its reduce-scatter, not accumulated by autograd: label them here
        rehearsal.tracker.label([param.grad for param in role.parameters], "gradients")
    with rehearsal.phase("optimizer"):
        _grad_norm_and_clip(role.parameters, role.grad_clip, step, role.name)
        role.step()
        rehearsal.label_optimizer(role.optimizer)


# ---- offline (v4, disca) ---------------------------------------------------------------------------------------
def rehearse_offline(args, variant: str, n_ctx: int, *, fake: bool = True, host: str | None = None) -> MemoryReport:
    """One optimizer step (or --optimizer_steps) of the offline recipe at batch --batch_size, n_ctx context frames.
    fake=False runs the same on real CPU tensors (tiny configs only: it allocates). host: where the loop's batch
    lies before pair_step moves it to the device: "meta" (host memory, not counted; the default for fake runs) or
    "cpu" (the device itself: the batch is counted for the whole step, as on a CPU run)."""
    host = host or ("meta" if fake else "cpu")
    from predictor_training.predictor.pair_step import pair_step
    from predictor_training.runtime.precision import precision_policy
    flags = recipe_args(variant)
    name = f"{variant} offline, blocks {list(args.source_blocks)}, batch {args.batch_size}" + \
        (f", {n_ctx} context frames" if variant == "v4" else "")
    with Rehearsal(name, cuda_autocast=not args.no_cuda_autocast, fake=fake) as rehearsal:
        policy = precision_policy("fp32master", torch.device("cpu"))
        teacher, predictor = build_models(rehearsal, args, variant)
        make_batch = partial(offline_batch, variant, teacher.config, batch_size=args.batch_size, n_ctx=n_ctx,
                             text_tokens=args.text_tokens, grid=args.latent_grid, source_blocks=args.source_blocks,
                             device=host)
        del teacher  # as train_offline: the Predictor keeps only the frozen parts it runs
        role, buckets = build_role(rehearsal, predictor, flags, args.world_size)
        step_fn = partial(pair_step, model=predictor, predictor=predictor, policy=policy,
                          context_timestep=CONTEXT_TIMESTEP, velocity_weight=flags.velocity_weight,
                          hidden_weight=flags.hidden_weight)
        for step in range(1, args.optimizer_steps + 1):
            role.zero_grad()
            # The device batch is the step's alone (on the GPU the loop's batch stays in pinned host memory, and
            # pair_step's device copy is what counts): nothing here keeps a reference to it.
            with rehearsal.phase("forward"):
                step_fn(make_batch(), sync=True, due=frozenset({"predictor"}))
            optimizer_phase(rehearsal, role, buckets, step)
        rehearsal.notes["configuration"] = _configuration(args, variant)
        rehearsal.notes.update(flop_notes(args, variant, n_ctx if variant == "v4" else None))
    return rehearsal.report()


# ---- adversarial (fvtools/train_adversarial.py, --data offline) ------------------------------------------------------
def optimizer_phase_roles(rehearsal: Rehearsal, roles, buckets, step: int) -> None:
    """The loop's step 3-4 for several due roles: DDP's bucket views (the DDP-wrapped role), each role's clip, then
    each role's AdamW + schedule, in the loop's order (all clips before any update)."""
    from predictor_training.runtime.loop import _grad_norm_and_clip
    if buckets is not None:
        buckets.adopt_gradients()
    with rehearsal.phase("optimizer"):
        for role in roles:
            _grad_norm_and_clip(role.parameters, role.grad_clip, step, role.name)
        for role in roles:
            role.step()
            rehearsal.label_optimizer(role.optimizer)


def rehearse_adversarial(args, *, fake: bool = True, host: str | None = None) -> MemoryReport:
    """fvtools/train_adversarial.py: the v4 Predictor (the recipe's build_predictor, AdamW groups, DDP buckets) and
    the recipe's discriminator (`build_discriminator`, `build_discriminator_role`, `Adversary`), one loop step with
    both roles due. --data offline (the recipe's default): `AdversarialPairStep` at the v4 offline batch
    (--batch_size, --context_frames: the largest given); --data rollout: `AdversarialRolloutStep` on one trajectory
    of --chunks chunks under --replace_steps (the Teacher kept, the memory selection on real CPU values, as
    `rehearse_rollout`). The step rehearsed is the heaviest one the cadences give: the one after r1_every updates of
    both roles, where the generator term is built (its weight is above 0 once the Predictor has updated) and the lazy
    R1 pass runs (every r1_every-th discriminator update); the two schedules are advanced to it beforehand (LR
    values only, no memory)."""
    host = host or ("meta" if fake else "cpu")
    import fvtools.train_adversarial as recipe
    from predictor_training.methods.adversarial import (
        DISCRIMINATOR,
        PREDICTOR,
        Adversary,
        build_discriminator,
        build_discriminator_role,
    )
    from predictor_training.runtime.precision import precision_policy
    rollout = args.data == "rollout"
    flags = _rollout_defaults(recipe, ["--dataset_root", "unused", "--data", args.data])
    n_ctx = max(args.context_frames)
    data = (f"rollout {'-'.join(Schedule(tuple(args.replace_steps)).letters())}, {args.chunks} chunks, one "
            f"trajectory" if rollout else f"offline, batch {args.batch_size}, {n_ctx} context frames")
    name = (f"adversarial {data}, blocks {list(args.source_blocks)}, discriminator width {flags.discriminator_width}, "
            "both roles due")
    if rollout:
        from predictor_training.teacher.config import preset_config
        row, image_cond = trajectory_row(args.chunks, args.latent_grid,
                                         int(preset_config(args.config)["out_channels"]))
    with Rehearsal(name, cuda_autocast=not args.no_cuda_autocast, fake=fake) as rehearsal, \
            patched(selection_on_real_values()):
        policy = precision_policy(flags.precision, torch.device("cpu"))
        teacher, predictor = build_models(rehearsal, args, recipe.VARIANT)
        if not rollout:
            make_batch = partial(offline_batch, "v4", teacher.config, batch_size=args.batch_size, n_ctx=n_ctx,
                                 text_tokens=args.text_tokens, grid=args.latent_grid,
                                 source_blocks=args.source_blocks, device=host)
            del teacher  # as the recipe's offline mode
        with patched((torch.nn.Module, "to", _to_unless_unchanged)):  # built on its device: the move is a no-op
            discriminator = build_discriminator(predictor.hidden_size, width=flags.discriminator_width,
                                                seed=flags.seed, device=torch.device("cpu"))
        rehearsal.label_parameters([discriminator])
        predictor_role, buckets = build_role(rehearsal, predictor, flags, args.world_size)
        discriminator_role = build_discriminator_role(
            discriminator, lr=flags.discriminator_lr, weight_decay=flags.discriminator_weight_decay,
            betas=(flags.discriminator_adam_beta1, flags.discriminator_adam_beta2),
            grad_clip=flags.discriminator_grad_clip, every=flags.discriminator_every, max_steps=flags.max_steps)
        use_foreach(discriminator_role.optimizer)
        rehearsal.watch_gradients(discriminator_role.parameters)
        roles = [predictor_role, discriminator_role]
        # The heaviest step of the cadences: both roles r1_every updates in (generator term on, lazy R1 due).
        for role in roles:
            for _ in range(flags.r1_every):
                role.lr_schedule.step()
        adversary = Adversary(predictor_role, discriminator_role, adv_weight=flags.adv_weight,
                              adv_warmup_steps=flags.adv_warmup_steps, r1_weight=flags.r1_weight,
                              r1_every=flags.r1_every)
        if rollout:
            from predictor_training.predictor.self_rollout import SelfRolloutSettings
            from predictor_training.rollout.ar_rollout import RolloutConfig
            case = rollout_case(args, teacher, image_cond)
            rollout_config = RolloutConfig(state_dtype=policy.frozen_dtype, autocast_dtype=policy.autocast_dtype,
                                           context_mode=args.context_mode)
            settings = SelfRolloutSettings(velocity_weight=flags.velocity_weight, hidden_weight=flags.hidden_weight,
                                           predictor_autocast_dtype=policy.autocast_dtype,
                                           replace_steps=tuple(args.replace_steps))
            step_fn = recipe.AdversarialRolloutStep(
                model=predictor, teacher=teacher, dataset=argparse.Namespace(load_case=lambda case_id: case),
                rollout_config=rollout_config, settings=settings, adversary=adversary,
                source_blocks=args.source_blocks, env=argparse.Namespace(device=torch.device("cpu")))

            def trajectory_item():
                with real_values():
                    return {**row, "case_id": "rehearsal"}

            make_batch = trajectory_item
        else:
            step_fn = recipe.AdversarialPairStep(model=predictor, predictor=predictor, policy=policy,
                                                 context_timestep=CONTEXT_TIMESTEP, adversary=adversary,
                                                 velocity_weight=flags.velocity_weight,
                                                 hidden_weight=flags.hidden_weight)
        weight = adversary.weight()
        r1_applied = flags.r1_weight > 0 and discriminator_role.updates % flags.r1_every == 0
        for step in range(1, args.optimizer_steps + 1):
            for role in roles:
                role.zero_grad()
            with rehearsal.phase("forward"):
                step_fn(make_batch(), sync=True, due=frozenset({PREDICTOR, DISCRIMINATOR}))
            optimizer_phase_roles(rehearsal, roles, buckets, step)
        rehearsal.notes["configuration"] = (
            _configuration(args, "rollout" if rollout else "v4") + f"; adversarial weight {weight:g} (generator "
            f"term {'built' if weight > 0 else 'not built'}), lazy R1 {'applied' if r1_applied else 'not applied'}")
        # The Predictor's FLOPs (and the rollout's Teacher steps); the discriminator's matmuls are negligible.
        if rollout:
            rehearsal.notes.update(flop_notes(args, "rollout", None))
        else:
            count = step_flops(args, "v4", n_ctx)
            rehearsal.notes.update({"dit_tflops_per_micro_batch": round(count / 1e12, 1),
                                    "seconds_at_40pct_of_989_tflops": round(seconds_at(count, 0.40), 2)})
    return rehearsal.report()


# ---- rollout -----------------------------------------------------------------------------------------------------
def rollout_case(args, teacher, image_cond) -> dict:
    """A trajectory case at real shapes: stored text K/V of --text_tokens tokens (BF16) and the image condition."""
    config = teacher.config
    heads, head_dim = config.heads_num, config.hidden_size // config.heads_num
    shape = (teacher.num_layers, heads, args.text_tokens, head_dim)
    return {"text_k": torch.zeros(shape, dtype=torch.bfloat16), "text_v": torch.zeros(shape, dtype=torch.bfloat16),
            "image_cond": image_cond}


def rehearse_rollout(args) -> MemoryReport:
    from predictor_training.predictor.self_rollout import (
        SelfRolloutSettings,
        train_trajectory,
        trajectory_for_row,
    )
    from predictor_training.rollout.ar_rollout import RolloutConfig
    from predictor_training.runtime.precision import precision_policy
    flags = recipe_args("rollout")
    letters = Schedule(tuple(args.replace_steps)).letters()
    name = (f"rollout {'-'.join(letters)}, {args.chunks} chunks, context {args.context_mode}, blocks "
            f"{list(args.source_blocks)}, one trajectory")
    from predictor_training.teacher.config import preset_config
    item, image_cond = trajectory_row(args.chunks, args.latent_grid, int(preset_config(args.config)["out_channels"]))
    # The row's seed -> noise and memory points, made on real CPU tensors (small) before the fake mode.
    with Rehearsal(name, cuda_autocast=not args.no_cuda_autocast) as rehearsal:
        policy = precision_policy("fp32master", torch.device("cpu"))
        teacher, predictor = build_models(rehearsal, args, "v4")
        case = rollout_case(args, teacher, image_cond)
        role, buckets = build_role(rehearsal, predictor, flags, args.world_size)
        rollout_config = RolloutConfig(state_dtype=policy.frozen_dtype, autocast_dtype=policy.autocast_dtype,
                                       context_mode=args.context_mode)
        settings = SelfRolloutSettings(velocity_weight=flags.velocity_weight, hidden_weight=flags.hidden_weight,
                                       predictor_autocast_dtype=policy.autocast_dtype,
                                       replace_steps=tuple(args.replace_steps))
        context_frames = []
        for step in range(1, args.optimizer_steps + 1):
            role.zero_grad()
            with real_values():
                trajectory_item = dict(item)
            trajectory = trajectory_for_row(trajectory_item, case, teacher=teacher, predictor=predictor,
                                            config=rollout_config, settings=settings, device=torch.device("cpu"))
            rollout = trajectory.rollout
            select = rollout.select_context

            def select_on_real_values(chunk_index, select=select):
                # The memory selection reads poses and Monte-Carlo points: on the GPU it runs on the CPU's real
                # values; here too (its result decides the context length, hence the memory).
                with real_values():
                    indices = select(chunk_index)
                context_frames.append(len(indices))
                return indices

            rollout.select_context = select_on_real_values
            with rehearsal.phase("forward"):
                train_trajectory(trajectory, sync=True)
            del trajectory, rollout
            optimizer_phase(rehearsal, role, buckets, step)
        rehearsal.notes["configuration"] = _configuration(args, "rollout")
        rehearsal.notes["context_frames_per_chunk"] = context_frames
        rehearsal.notes.update(flop_notes(args, "rollout", None))
    return rehearsal.report()


# ---- the generic methods (fvtools/) --------------------------------------------------------------------------
def selection_on_real_values() -> tuple:
    """The patch (for `patched`) that runs `ARRollout.select_context` on real CPU values: the memory selection reads
    poses and Monte-Carlo points on the host, as on the GPU, and its result decides the context length."""
    from predictor_training.rollout.ar_rollout import ARRollout
    select = ARRollout.select_context

    def select_context(self, chunk_index):
        with real_values():
            return select(self, chunk_index)

    return ARRollout, "select_context", select_context


def method_flags(module, argv=()) -> argparse.Namespace:
    """An fvtools recipe's own flag defaults (plus `argv`), parsed by its parse_args without its file checks (the
    --dry_run path returns before them)."""
    args = module.parse_args([*argv, "--dry_run", "unused"])
    args.dry_run = None
    return args


_MODULE_TO = torch.nn.Module.to


def _to_unless_unchanged(self, *args, **kwargs):
    """Module.to() swaps every fake parameter, which fake tensors refuse; a move that changes nothing (PEFT moves each
    wrapped linear to its own device, the recipes move a model built on its device there) is skipped, anything else
    still goes to Module.to."""
    device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
    tensors = list(self.parameters()) + list(self.buffers())
    if all((device is None or tensor.device == torch.device(device))
           and (dtype is None or not tensor.is_floating_point() or tensor.dtype == dtype) for tensor in tensors):
        return self
    return _MODULE_TO(self, *args, **kwargs)


def last_chunks(num_chunks, count, rank_generator, shared_generator):
    """The recipes' `draw_chunks` in a rehearsal: the clip's last chunks (the most context: the worst draw)."""
    return list(range(max(0, num_chunks - count), num_chunks))


@contextlib.contextmanager
def method_rehearsal_hooks(rehearsal: Rehearsal, config: str):
    """What a method rehearsal replaces around the recipe's own code, and nothing else:
    * `load_teacher` (weights from a folder) builds the Teacher from its config in the requested dtype instead (the
      shapes are the config's; no weights exist here), frozen and in eval mode as load_teacher leaves it;
    * PEFT's move of a new LoRA adapter to its base layer's device and dtype (Module.to() cannot convert fake
      parameters): the adapter is made on the (fake CPU) device in FP32, where add_lora leaves it;
    * the Predictor's `--init_from` weights and LoRA files are not read (their shapes are the built model's);
    * the memory selection (cameras, Monte-Carlo points) runs on real CPU values, as on the GPU's host side;
    * `draw_training_chunks` returns the clip's last chunks (the most context: the worst draw; the chunks' backwards
      are separate, so each chunk's peak is its own)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    from predictor_training.methods import dmd2_models, method_model
    from predictor_training.rollout import ar_rollout, camera, teacher_forcing
    from predictor_training.teacher import WorldPlayTransformer

    def load_teacher(source, device, dtype):
        with default_dtype(dtype):
            teacher = WorldPlayTransformer.from_preset(config)
        teacher = teacher.eval().requires_grad_(False)
        rehearsal.label_parameters([teacher])
        return teacher

    def make_retrieval_points(seed, *rest, **kwargs):
        with real_values():
            return camera.make_retrieval_points(seed, *rest, **kwargs)

    def keep_adapter_where_made(self, adapter_name, device=None):
        pass  # PEFT's move to the base layer's device: the adapter is made on it here (fake CPU), FP32 as it ends

    patches = [(method_model, "load_teacher", load_teacher), (dmd2_models, "load_teacher", load_teacher),
               (torch.nn.Module, "to", _to_unless_unchanged),
               (BaseTunerLayer, "_move_adapter_to_device_of_base_layer", keep_adapter_where_made),
               (ar_rollout, "make_retrieval_points", make_retrieval_points),
               selection_on_real_values(),
               (teacher_forcing, "draw_training_chunks", last_chunks)]
    for name in ("train_df_sft", "train_kd", "train_dmd2", "train_adversarial", "train_nft"):
        module = sys.modules.get(f"fvtools.{name}")
        if module is not None and hasattr(module, "draw_training_chunks"):
            patches.append((module, "draw_training_chunks", last_chunks))
    with patched(*patches):
        yield load_teacher


def method_env(world_size: int, sharded: bool):
    from predictor_training.runtime.distributed import DistEnv
    return DistEnv(rank=0, local_rank=0, world_size=world_size if sharded else 1, device=torch.device("cpu"),
                   backend="fake" if sharded else None, is_main=True)


def _method_name(recipe: str, args, what: str) -> str:
    return (f"{recipe} {what}, {args.chunks} chunks"
            + (f", FSDP2 over {args.world_size} ranks (per rank)" if what.startswith("full") and args.world_size > 1
               else ""))


def rehearse_teacher_forced(args, recipe: str, *, fake: bool = True) -> MemoryReport:
    """df_sft / kd: the recipe's `build_method_model` (LoRA on the Teacher, or every parameter, FSDP2-sharded over
    --world_size ranks through a fake process group) and its step class (`DiffusionForcingStep` / `CausalKDStep`)
    on one clip, then the loop's clip + AdamW."""
    import importlib

    from predictor_training.methods.method_model import MethodSettings, build_method_model
    from predictor_training.rollout.ar_rollout import RolloutConfig
    from predictor_training.runtime.checkpoint import RunState
    from predictor_training.runtime.flags import settings_from_flags
    from predictor_training.runtime.precision import precision_policy
    from predictor_training.teacher.config import preset_config
    from predictor_training.teacher.source import TeacherSource
    module = importlib.import_module(f"fvtools.train_{recipe}")
    flags = method_flags(module, ["--train", args.train])
    sharded = args.train == "full" and args.world_size > 1
    what = f"LoRA rank {flags.lora_rank}" if args.train == "lora" else "full parameters"
    config = argparse.Namespace(**preset_config(args.config))
    steps = flags.student_steps if recipe == "kd" else 0
    # The loader's clip (host memory: meta in a fake run, CPU tensors made before the tracker in a real one).
    item = clip_item(config, chunks=args.chunks, grid=args.latent_grid, text_tokens=args.text_tokens,
                     data="latents" if recipe == "df_sft" else "final", states=steps, host="meta" if fake else "cpu",
                     encoder_text=args.train == "full")
    if recipe == "kd":
        item["sigmas"] = torch.linspace(1.0, 0.5, steps).tolist()
    with (fake_process_group(args.world_size) if sharded and fake else contextlib.nullcontext()), \
            Rehearsal(_method_name(recipe, args, what), cuda_autocast=not args.no_cuda_autocast,
                      fake=fake) as rehearsal, fsdp_storage_accounting(rehearsal.tracker), \
            method_rehearsal_hooks(rehearsal, args.config) as load_teacher:
        env = method_env(args.world_size, sharded and fake)
        policy = precision_policy("fp32master", env.device)
        source = TeacherSource(Path("unused"), None, "--teacher", None)
        method_model = build_method_model(source, settings_from_flags(MethodSettings, flags), env, policy,
                                          role_name=module.ROLE, load_teacher=load_teacher)
        role = method_model.role
        rehearsal.tracker.label(role.parameters, "parameters")  # the adapter, or FSDP2's shards
        use_foreach(role.optimizer)
        rehearsal.watch_gradients(role.parameters)
        rollout_config = RolloutConfig(state_dtype=torch.float32, autocast_dtype=policy.autocast_dtype)
        run_state = RunState()
        if recipe == "df_sft":
            step_fn = module.DiffusionForcingStep(method_model, rollout_config, flags, env, run_state,
                                                  draw_chunks=last_chunks)
        else:
            step_fn = module.CausalKDStep(method_model, rollout_config, list(range(steps)), flags, env, run_state,
                                          draw_chunks=last_chunks)
        for step in range(1, args.optimizer_steps + 1):
            role.zero_grad()
            with rehearsal.phase("forward"):
                step_fn(item, sync=True, due=frozenset({module.ROLE}))
            optimizer_phase(rehearsal, role, None, step)
        rehearsal.notes["configuration"] = _method_configuration(args, flags, sharded)
        rehearsal.notes["peak_groups"] = peak_groups(rehearsal.tracker)
        rehearsal.notes["live_after_step"] = rehearsal.tracker.live_by_category()
    return rehearsal.report()


def _method_configuration(args, flags, sharded: bool) -> str:
    text = "encoder outputs, prefilled under grad" if getattr(flags, "train", None) == "full" else "stored K/V"
    parts = [f"config {args.config}", "fp32master (frozen bf16, trainable fp32, bf16 autocast)",
             f"gradient checkpointing {'on' if flags.gradient_checkpointing else 'off'}",
             f"text {args.text_tokens} tokens ({text})",
             f"latents 4x{args.latent_grid[0]}x{args.latent_grid[1]} per chunk, {args.chunks} chunks",
             f"autocast rules {'CPU' if args.no_cuda_autocast else 'CUDA (emulated)'}"]
    if getattr(flags, "train", None) == "full":
        parts.append(f"FSDP2 over {args.world_size} ranks (fake process group), per-rank figures" if sharded else
                     "unsharded (1 rank)")
    return "; ".join(parts)


# ---- nft (fvtools/train_nft.py) ---------------------------------------------------------------------------------------
class ExcludedRewards:
    """Stands for the recipe's `VideoRewards` (VAE decode + reward functions, outside the DiT, not rehearsed): the
    K samples' scores as real CPU values, distinct per sample so that the advantages are not all zero."""

    def __init__(self, names):
        self.names = list(names)

    def __call__(self, samples, item) -> dict:
        from predictor_training.methods.rewards import TOTAL
        with real_values():
            count = samples.shape[0]
            scores = {name: torch.linspace(0.0, 1.0, count) for name in self.names}
            scores[TOTAL] = torch.linspace(0.0, 1.0, count)
        return scores


def rehearse_nft(args, *, fake: bool = True) -> MemoryReport:
    """fvtools/train_nft.py (--train lora, its default): the recipe's `build_method_model` (the policy's LoRA on the
    BF16 Teacher), `PolicyModels` (the old policy: a second adapter; the reference: the base without adapter),
    `OldPolicy` in the role's EMA slot, and one `NftStep` at step 1: K = --samples_per_group AR rollouts of the old
    policy without gradients (the recipe's sampler: --sample_steps at --sample_shift), then the training pass on
    --chunks_per_sample chunks of each sample (old and reference velocities without gradients, the policy's with its
    context prefill under grad, one backward per chunk), then step 1's monitor rollouts (policy and reference), then
    the loop's clip + AdamW + the old-policy update. The decoder and the reward functions (outside the DiT) are
    replaced by `ExcludedRewards`: the VAE's weights and decodes are not in the figure."""
    import importlib

    from predictor_training.methods.method_model import MethodSettings, build_method_model
    from predictor_training.methods.nft import OldPolicy, PolicyModels
    from predictor_training.methods.rewards import parse_reward_weights
    from predictor_training.runtime.checkpoint import RunState
    from predictor_training.runtime.flags import settings_from_flags
    from predictor_training.runtime.precision import precision_policy
    from predictor_training.teacher.config import preset_config
    from predictor_training.teacher.source import TeacherSource
    module = importlib.import_module("fvtools.train_nft")
    recipe_argv = ["--train", "lora"]
    for flag in ("samples_per_group", "chunks_per_sample"):
        if getattr(args, flag, None) is not None:
            recipe_argv += [f"--{flag}", str(getattr(args, flag))]
    flags = method_flags(module, recipe_argv)
    config = argparse.Namespace(**preset_config(args.config))
    name = (f"nft LoRA rank {flags.lora_rank}, {flags.samples_per_group} samples of {args.chunks} chunks, "
            f"{flags.chunks_per_sample} chunks trained per sample")
    item = clip_item(config, chunks=args.chunks, grid=args.latent_grid, text_tokens=args.text_tokens,
                     data="latents", host="meta" if fake else "cpu")
    with Rehearsal(name, cuda_autocast=not args.no_cuda_autocast, fake=fake) as rehearsal, \
            method_rehearsal_hooks(rehearsal, args.config) as load_teacher:
        env = method_env(1, False)
        policy = precision_policy(flags.precision, env.device)
        source = TeacherSource(Path("unused"), None, "--teacher", None)
        method_model = build_method_model(source, settings_from_flags(MethodSettings, flags), env, policy,
                                          role_name=module.ROLE, load_teacher=load_teacher)
        models = PolicyModels(method_model)
        role = method_model.role
        role.ema = OldPolicy(models.old_module, flags.old_decay_schedule, flags.old_decay)
        rehearsal.tracker.label(role.parameters, "parameters")
        rehearsal.tracker.label(models.old_module.parameters(), "parameters")
        use_foreach(role.optimizer)
        rehearsal.watch_gradients(role.parameters)
        rewards = ExcludedRewards(parse_reward_weights(flags.rewards))
        run_state = RunState()
        step_fn = module.NftStep(models, rewards, flags, env, run_state, policy.autocast_dtype,
                                 draw_chunks=last_chunks)
        for step in range(1, args.optimizer_steps + 1):
            role.zero_grad()
            with rehearsal.phase("forward"):
                step_fn(item, sync=True, due=frozenset({module.ROLE}))
            optimizer_phase(rehearsal, role, None, step)
            run_state.global_step = step
            run_state.micro_step += 1
        rehearsal.notes["configuration"] = (
            _method_configuration(args, flags, False) + f"; {flags.samples_per_group} samples of "
            f"{flags.sample_steps} steps (no grad), {flags.chunks_per_sample} chunks trained per sample (the "
            "sample's last ones); VAE decode and rewards not counted")
        rehearsal.notes["live_after_step"] = rehearsal.tracker.live_by_category()
    return rehearsal.report()


# ---- dmd2 (fvtools/train_dmd2.py) -----------------------------------------------------------------------------
class PeakSegments:
    """Names the part of a step in which the tracker's global peak was reached. Markers (`mark`, or the wrappers of
    `patch`) set the current part; a rise of the peak seen at the next marker belongs to the part that was current
    (sticky markers: a backward run after a marked call counts to that call's part unless `after` renames it)."""

    def __init__(self, tracker):
        self.tracker = tracker
        self.current = "setup"
        self.seen = tracker.peak
        self.at_peak = "setup"

    def mark(self, name: str) -> None:
        if self.tracker.peak > self.seen:
            self.at_peak, self.seen = self.current, self.tracker.peak
        self.current = name

    def patch(self, target, attribute: str, name, after=None):
        """A `patched` entry: `target.attribute` wrapped so that a call marks `name(*args)` and, with `after`, its
        return marks `after(*args)`."""
        original = getattr(target, attribute)

        def wrapper(*args, **kwargs):
            self.mark(name(*args))
            result = original(*args, **kwargs)
            if after is not None:
                self.mark(after(*args))
            return result

        return target, attribute, wrapper


def peak_groups(tracker, top: int = 8) -> list[str]:
    """The storages alive at the peak grouped by (op, shape, dtype, phase, category), largest totals first: many
    same-shaped tensors (a context K/V per layer) that no single one of the 10 largest shows."""
    groups: dict[tuple, list[int]] = {}
    for record in tracker.peak_records():
        key = (record.op, record.shape, str(record.dtype).removeprefix("torch."), record.phase, record.category)
        entry = groups.setdefault(key, [0, 0])
        entry[0] += 1
        entry[1] += record.nbytes
    ranked = sorted(groups.items(), key=lambda item: item[1][1], reverse=True)[:top]
    return [f"{count} x {list(shape)} {dtype} {op} ({phase}, {category}): {total / GIB:.2f} GiB"
            for (op, shape, dtype, phase, category), (count, total) in ranked]


def dmd2_real_score_lora(args):
    """A stand-in for `load_lora` of the real score's adapter file (not on this machine): an adapter of the df_sft
    recipe's default rank and alpha (what `fvtools/train_df_sft.py --train lora` exports), frozen; values not read."""
    import importlib

    from predictor_training.teacher.adapters import add_lora
    df_sft = method_flags(importlib.import_module("fvtools.train_df_sft"))

    def load_lora(teacher, path, name=None, *, trainable=False):
        return add_lora(teacher, name, df_sft.lora_rank, df_sft.lora_alpha, trainable=trainable)

    return load_lora, df_sft.lora_rank


def rehearse_dmd2(args, *, fake: bool = True) -> MemoryReport:
    """fvtools/train_dmd2.py (--rollout self, --fake_score_train lora: its defaults) at its heaviest loop step: both
    roles due (the generator's graph, the critic) on a monitor step (the Teacher's F-F-F-F of the same noise after
    the chunks), on one clip of --chunks chunks. Built by the recipe's own code in main()'s order: the BF16 Teacher,
    the generator (`build_predictor_role`: the v4 Predictor on --source_blocks, --replace_steps, its two AdamW groups,
    DDP buckets when --world_size > 1, its EMA; or `build_student`: a LoRA student on the Teacher, --train lora, or
    every parameter replicated, --train full), `build_scores` (the real score per --real_score: teacher = the raw
    Teacher, lora = a df_sft adapter on it, model = a second BF16 Teacher-shaped model; the fake score a LoRA copied
    from the real score's adapter or fresh, its AdamW), then one `DistributionMatchingStep` and the loop's clip +
    AdamW + schedule + EMA for both roles. Replaced, besides `method_rehearsal_hooks`: the real score's LoRA file
    (an adapter of the df_sft recipe's rank is added in its place) and the --init_from weights (the Predictor role is
    built as on resume, which reads none). notes["peak_in"] names the part of the step where the peak was reached."""
    import importlib

    from predictor_training.methods import chunk_generators, dmd2_models, score_models
    from predictor_training.methods.method_model import MethodSettings
    from predictor_training.rollout.ar_rollout import RolloutConfig
    from predictor_training.runtime.flags import settings_from_flags
    from predictor_training.rollout.scheduler import DISTILLED_SIGMA_FLOOR
    from predictor_training.runtime.checkpoint import RunState
    from predictor_training.runtime.precision import precision_policy
    from predictor_training.teacher.config import preset_config
    from predictor_training.teacher.source import TeacherSource
    module = importlib.import_module("fvtools.train_dmd2")
    recipe_argv = ["--generator", args.generator, "--real_score", args.real_score, "--train", args.train,
                   "--source_blocks", ",".join(map(str, args.source_blocks)),
                   "--replace_steps", ",".join(map(str, args.replace_steps))]
    if args.real_score == dmd2_models.RAW_TEACHER:
        recipe_argv += ["--allow_raw_teacher_score", "--score_sigma_min", str(DISTILLED_SIGMA_FLOOR)]
    flags = method_flags(module, recipe_argv)
    if args.real_score == dmd2_models.RAW_TEACHER:
        flags.real_score_kind, flags.real_score_path = dmd2_models.resolve_real_score_flags(
            flags.real_score, allow_raw_teacher_score=flags.allow_raw_teacher_score,
            score_sigma_min=flags.score_sigma_min, fake_score_train=flags.fake_score_train)
    else:  # resolve_real_score reads the file or folder; its kind is the flag here
        flags.real_score_kind, flags.real_score_path = args.real_score, Path("unused")
    load_lora, real_rank = dmd2_real_score_lora(args)
    if flags.generator == "predictor":
        letters = Schedule(tuple(flags.replace_steps)).letters()
        generator_text = f"Predictor {'-'.join(letters)} blocks {list(flags.source_blocks)}"
    else:
        generator_text = (f"{'LoRA rank ' + str(flags.lora_rank) if flags.train == 'lora' else 'full'} student, "
                          f"{flags.student_steps} steps")
    real_text = {"teacher": "the raw Teacher", "lora": f"a LoRA rank {real_rank} on the Teacher",
                 "model": "a second BF16 model"}[args.real_score]
    name = (f"dmd2 {generator_text}, real score {real_text}, fake score LoRA, {args.chunks} chunks, rollout "
            f"{flags.rollout}, both roles due, monitor step")
    config = argparse.Namespace(**preset_config(args.config))
    item = clip_item(config, chunks=args.chunks, grid=args.latent_grid, text_tokens=args.text_tokens,
                     data="latents", host="meta" if fake else "cpu")
    with Rehearsal(name, cuda_autocast=not args.no_cuda_autocast, fake=fake) as rehearsal, \
            method_rehearsal_hooks(rehearsal, args.config) as load_teacher:
        env = method_env(1, False)
        policy = precision_policy(flags.precision, env.device)
        rollout_config = RolloutConfig(state_dtype=torch.float32, autocast_dtype=policy.autocast_dtype)
        teacher = load_teacher(TeacherSource(Path("unused"), None, "--teacher", None), env.device,
                               policy.frozen_dtype)
        student, buckets, models = None, None, [teacher]
        if flags.generator == "predictor":
            predictor, generator_role, _ = dmd2_models.build_predictor_role(
                settings_from_flags(dmd2_models.PredictorGeneratorSettings, flags), teacher, env, resuming=True)
            models.append(predictor)
        else:
            student, generator_role, _ = dmd2_models.build_student(
                settings_from_flags(MethodSettings, flags), teacher, env, policy, teacher_folder=flags.teacher,
                generator_every=flags.generator_every, ema_decay=flags.ema_decay,
                ema_start_step=flags.ema_start_step, load_teacher=load_teacher)
        real, fake_score, fake_role = dmd2_models.build_scores(
            settings_from_flags(dmd2_models.ScoreSettings, flags), teacher, env, policy, load_teacher=load_teacher,
            load_lora=load_lora)
        roles = [generator_role, fake_role]
        rehearsal.label_parameters(models + [real.model])
        for role in roles:
            rehearsal.tracker.label(role.parameters, "parameters")
            use_foreach(role.optimizer)
            rehearsal.watch_gradients(role.parameters)
        if generator_role.ema is not None:  # the generator's FP32 EMA shadow, counted with the training state
            rehearsal.tracker.label(generator_role.ema.shadow.values(), "optimizer_state")
        if flags.generator == "predictor" and args.world_size > 1:  # DDP-wrapped (the scores all-reduce in place)
            buckets = DDPBuckets(generator_role.parameters, rehearsal.tracker)
        run_state = RunState(global_step=flags.monitor_every - 1)  # the step whose end runs the monitor rollout
        step_fn = module.DistributionMatchingStep(args=flags, env=env, run_state=run_state,
                                                  rollout_config=rollout_config, teacher=teacher, real=real,
                                                  fake=fake_score, generator_role=generator_role, student=student,
                                                  draw_chunks=last_chunks)
        segments = PeakSegments(rehearsal.tracker)
        generator_class = (chunk_generators.CompositeRollout if flags.generator == "predictor" else
                           chunk_generators.StudentRollout)
        marks = [
            segments.patch(module.DistributionMatchingStep, "start_generator",
                           lambda *a: "the generator's start (text K/V, chunk 0), the scores' clips"),
            segments.patch(generator_class, "produce", lambda self, chunk: f"generator forward, chunk {chunk}"),
            segments.patch(module.DistributionMatchingStep, "draw_score_inputs",
                           lambda *a: "critic: fake score forward + backward"),
            segments.patch(score_models.ScoreClip, "x0", lambda self, *a: f"{self.score.label} x0 (no grad)"),
            segments.patch(module, "dmd_generator_loss", lambda *a: "generator loss",
                           after=lambda *a: "generator backward"),
            segments.patch(generator_class, "commit", lambda *a: "commit"),
            segments.patch(module, "teacher_chunks", lambda *a: "monitor: the Teacher's F-F-F-F (no grad)"),
        ]
        due = frozenset({generator_role.name, dmd2_models.FAKE})
        with patched(*marks):
            for step in range(1, args.optimizer_steps + 1):
                for role in roles:
                    role.zero_grad()
                with rehearsal.phase("forward"):
                    step_fn(item, sync=True, due=due)
                segments.mark("optimizer")
                optimizer_phase_roles(rehearsal, roles, buckets, step)
                segments.mark("after the step")
                run_state.micro_step += 1
        rehearsal.notes["configuration"] = (
            _method_configuration(args, flags, False) + f"; generator due every {flags.generator_every} steps, "
            f"monitor every {flags.monitor_every}: both in the step rehearsed; fake score LoRA rank "
            f"{real_rank if args.real_score == 'lora' else flags.lora_rank}; the generator's EMA counted as "
            "optimizer_state")
        rehearsal.notes["peak_in"] = segments.at_peak
        rehearsal.notes["peak_groups"] = peak_groups(rehearsal.tracker)
        rehearsal.notes["live_after_step"] = rehearsal.tracker.live_by_category()
    return rehearsal.report()


# ---- the eval (tools/eval_predictor.py), inference only ------------------------------------------------------------
def rehearse_eval(args, *, fake: bool = True) -> MemoryReport:
    """tools/eval_predictor.py at real size: the eval's own `EvalRuntime.rollout` (its `TimedRollout`, the method's
    `make_step_fn`, `PredictorMethod.replaced_step`) of one sample-table row of --chunks chunks under --replace_steps
    (chunk 0 F-F-F-F), in --context_mode (exact: every chunk's context prefilled again; incremental: the frame K/V
    cache), with the eval's bf16 pipeline (`rollout_config_for`: BF16 Teacher, BF16 autocast and running latents)
    and the Predictor as `load_predictor` leaves it (its copied blocks FP32, eval, frozen). No optimizer, no
    gradients. Not in the figure: the VAE decoder and its decode (outside the DiT; the eval loads it once and decodes
    each finished rollout), the LPIPS network, the text prefill (the case's stored K/V are read, as with
    --dataset_root; with --encoded the eval prefills the text once per case, under no_grad, before the rollouts).
    The reference F-F-F-F and the reuse baselines run the same loop without the Predictor step: at most this
    rollout's memory (the Predictor's weights stay loaded for the whole eval)."""
    from predictor_training.eval.methods import PredictorCheckpoint, PredictorMethod, with_context_mode
    from predictor_training.eval.run import rollout_config_for
    from predictor_training.eval.runtime import EvalRuntime
    from predictor_training.eval.timing import Stopwatch
    from predictor_training.predictor.model import build_predictor
    from predictor_training.rollout.schedule import Schedule
    from predictor_training.teacher.config import preset_config
    dtype = torch.bfloat16
    letters = Schedule(tuple(args.replace_steps)).letters()
    name = (f"eval rollout {'-'.join(letters)}, {args.chunks} chunks, context {args.context_mode}, blocks "
            f"{list(args.source_blocks)}, inference")
    config = argparse.Namespace(**preset_config(args.config))
    item, image_cond = trajectory_row(args.chunks, args.latent_grid, config.out_channels)
    heads = config.heads_num
    host = "meta" if fake else "cpu"
    with torch.device(host):  # the case file, read into host memory by the dataset
        case = {name: torch.zeros(config.mm_double_blocks_depth, heads, args.text_tokens,
                                  config.hidden_size // heads, dtype=dtype) for name in ("text_k", "text_v")}
    case["image_cond"] = image_cond
    with Rehearsal(name, cuda_autocast=not args.no_cuda_autocast, fake=fake) as rehearsal, \
            method_rehearsal_hooks(rehearsal, args.config) as load_teacher:
        teacher = load_teacher(None, torch.device("cpu"), dtype)  # load_teacher(settings.teacher_source, dtype)
        torch.manual_seed(0)
        predictor = build_predictor(teacher, "v4", args.source_blocks).eval().requires_grad_(False)
        rehearsal.label_parameters([predictor])
        ckpt = PredictorCheckpoint(path=Path("unused"), run_name="rehearsal", step=0,
                                   meta={"variant": "v4", "source_blocks": list(args.source_blocks)},
                                   predictor_config=predictor.predictor_config(), run_flags={}, label="rehearsal",
                                   panel="rehearsal")
        method = with_context_mode(PredictorMethod(predictor, ckpt), args.context_mode)
        runtime = EvalRuntime(teacher=teacher, methods=[method], schedule=Schedule(tuple(args.replace_steps)),
                              rollout_config=rollout_config_for(dtype), decoder=None, scorer=None, dataset=None,
                              case_source="dataset", device=torch.device("cpu"), state_dtype=dtype)
        with rehearsal.phase("forward"):
            text_kv, _ = runtime.text_kv(case)
            rollout = runtime.rollout(method, text_kv, item, case, Stopwatch(torch.device("cpu")))
        rehearsal.notes["configuration"] = (
            f"config {args.config}; bf16 (Teacher, autocast, running latents; the Predictor's copied blocks FP32 as "
            f"loaded); text {args.text_tokens} tokens (stored K/V); latents 4x{args.latent_grid[0]}x"
            f"{args.latent_grid[1]} per chunk, {args.chunks} chunks; context {args.context_mode}; autocast rules "
            f"{'CPU' if args.no_cuda_autocast else 'CUDA (emulated)'}; VAE decoder, LPIPS and text prefill not "
            "counted")
        rehearsal.notes["context_frames_per_chunk"] = list(rollout.context_frames)
        del rollout
    return rehearsal.report()


# ---- FLOPs and time --------------------------------------------------------------------------------------------
PEAK_BF16_TFLOPS = 989.0  # dense BF16 peak of an H100 SXM / H200 (the same tensor cores), TFLOP/s
# Context frames of chunks 1..7 (memory of 20 frames reached at chunk 5): the v4 offline buckets' mix.
OFFLINE_CONTEXT_MIX = (4, 8, 12, 16, 20, 20, 20)


def _predictor_training_flops(shape, predictor_config, tokens_per_frame, text_tokens, context_frames) -> int:
    """Forward + backward (2x forward) + the checkpoint recompute of the two blocks, of one Predictor step."""
    from predictor_training.teacher import flops
    forward = flops.predictor_step_flops(shape, predictor_config, tokens_per_frame, text_tokens, context_frames)
    queries = 4 * tokens_per_frame
    keys = text_tokens + (context_frames * tokens_per_frame if predictor_config["variant"] == "v4" else 0) + queries
    recompute = 2 * flops.image_block_flops(shape, 4, queries, keys)
    return 3 * forward + recompute


def step_flops(args, recipe: str, context_frames: int | None = None) -> int:
    """DiT FLOPs of one micro-batch of the recipe (teacher/flops.py counting rules: matmuls only).

    offline: batch x (context projector of the 2 source layers + Predictor forward, backward, recompute);
    v4 with context_frames None: the mean over the chunks' context mix (4, 8, 12, 16, 20, 20, 20).
    rollout: one trajectory - chunk 0 F-F-F-F, then per trained chunk the context prefill, the Full steps and the
    Teacher targets of the Predictor steps (forward only) and the Predictor steps (forward, backward, recompute)."""
    from predictor_training.teacher import flops
    from predictor_training.teacher.config import preset_config
    shape = flops.TeacherShape.from_config(preset_config(args.config))
    hw = args.latent_grid[0] * args.latent_grid[1]
    text = args.text_tokens
    if recipe in ("v4", "disca"):
        predictor_config = {"variant": recipe, "hidden_size": shape.hidden_size,
                            "fusion_streams": ["image", "anchor", "prev_chunk"] if recipe == "v4" else
                            ["image", "anchor"]}
        mix = [0] if recipe == "disca" else (OFFLINE_CONTEXT_MIX if context_frames is None else [context_frames])
        per_item = []
        for frames in mix:
            projector = 0 if recipe == "disca" else 2 * flops.image_block_flops(
                shape, frames, frames * hw, frames * hw, kv_only=True)
            per_item.append(projector + _predictor_training_flops(shape, predictor_config, hw, text, frames))
        return int(args.batch_size * sum(per_item) / len(per_item))
    predictor_config = {"variant": "v4", "hidden_size": shape.hidden_size,
                        "fusion_streams": ["image", "anchor", "prev_chunk"]}
    context = [0] + [min(4 * chunk, 20) for chunk in range(1, args.chunks)]
    teacher = flops.rollout_flops(shape, hw, text, context, lambda chunk, step: "full", context_mode=args.context_mode)
    predictor = sum(len(args.replace_steps) * _predictor_training_flops(shape, predictor_config, hw, text, frames)
                    for frames in context[1:])
    return int(teacher["total"] + predictor)


def seconds_at(flop_count: int, utilisation: float) -> float:
    return flop_count / (utilisation * PEAK_BF16_TFLOPS * 1e12)


def flop_notes(args, recipe: str, context_frames: int | None) -> dict:
    count = step_flops(args, recipe, context_frames)
    notes = {"dit_tflops_per_micro_batch": round(count / 1e12, 1),
             "seconds_at_40pct_of_989_tflops": round(seconds_at(count, 0.40), 2)}
    if recipe in USER_SECONDS_PER_MICRO_BATCH and args.config == "worldplay_480p_i2v":
        mix = step_flops(args, recipe, None)
        measured = USER_SECONDS_PER_MICRO_BATCH[recipe]
        notes["user_seconds_per_micro_batch"] = measured
        notes["utilisation_implied_by_user_time"] = round(mix / (measured * PEAK_BF16_TFLOPS * 1e12), 3)
    return notes


# ---- the largest batch that fits ---------------------------------------------------------------------------------
CARDS_GB = (80, 141)


def card_gib(gigabytes: float) -> float:
    return gigabytes * 1e9 / GIB


def needed_gib(report: MemoryReport) -> float:
    """What a card must hold: the peak as the allocator counts it, the stated allocator margin, the CUDA context."""
    return report.with_margin_gib() + CUDA_CONTEXT_GIB


def largest_batches(args, recipe: str, n_ctx: int, cards_gb=CARDS_GB) -> dict[float, tuple[int, MemoryReport]]:
    """{card GB: (the largest per-GPU batch whose need fits, its rehearsal)}: a line through the step's peaks at
    batches 4 and 8 (affine in the batch), then rehearsals around each predicted batch until batch fits and batch + 1
    does not."""
    def run(batch: int) -> MemoryReport:
        return rehearse_offline(argparse.Namespace(**{**vars(args), "batch_size": batch}), recipe, n_ctx)

    def step_need(report: MemoryReport) -> float:  # the step's own peak (not the Teacher load before it)
        step = max(value for phase, value in report.phase_peaks.items() if phase != "setup")
        return needed_gib(report) * step / max(report.peak, 1)

    low, high = run(4), run(8)
    per_item = (step_need(high) - step_need(low)) / 4
    if per_item <= 0:
        raise RuntimeError(f"{recipe}: the step's peak does not grow with the batch ({step_need(low):.2f} GiB at 4 "
                           f"and {step_need(high):.2f} GiB at 8); cannot extrapolate")
    found = {}
    for card in cards_gb:
        batch = max(1, int((card_gib(card) - step_need(low)) / per_item) + 4)
        report = run(batch)
        while batch > 1 and needed_gib(report) > card_gib(card):
            batch -= 1
            report = run(batch)
        while needed_gib(report) <= card_gib(card):  # the line may have been low: try one more
            bigger = run(batch + 1)
            if needed_gib(bigger) > card_gib(card):
                break
            batch, report = batch + 1, bigger
        found[card] = (batch, report)
    return found


def _configuration(args, recipe: str) -> str:
    parts = [f"config {args.config}", "fp32master (frozen bf16, trainable fp32, bf16 autocast)",
             "gradient checkpointing", f"text {args.text_tokens} tokens",
             f"latents 4x{args.latent_grid[0]}x{args.latent_grid[1]} per chunk",
             f"DDP buckets {'counted' if args.world_size > 1 else 'none (1 rank)'}",
             f"autocast rules {'CPU' if args.no_cuda_autocast else 'CUDA (emulated)'}"]
    if recipe == "rollout":
        parts.append(f"{args.chunks} chunks, replace_steps {list(args.replace_steps)}, context {args.context_mode}")
    return "; ".join(parts)


def estimate(args) -> list[MemoryReport]:
    with cuts_undone(args.undo_cuts):
        return _estimate(args)


def _estimate(args) -> list[MemoryReport]:
    if args.recipe == "rollout":
        return [rehearse_rollout(args)]
    if args.recipe in ("df_sft", "kd"):
        return [rehearse_teacher_forced(args, args.recipe)]
    if args.recipe == "adversarial":
        return [rehearse_adversarial(args)]
    if args.recipe == "eval":
        return [rehearse_eval(args)]
    if args.recipe == "nft":
        return [rehearse_nft(args)]
    if args.recipe == "dmd2":
        return [rehearse_dmd2(args)]
    frames = args.context_frames if args.recipe == "v4" else [0]
    # The undone pre-feature cut: the loop's batch stays on the device for the whole step, as the user's dict kept it.
    host = "cpu" if "offline_prefeatures" in args.undo_cuts else None
    return [rehearse_offline(args, args.recipe, n_ctx, host=host) for n_ctx in frames]


@command
def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    for report in estimate(args):
        print(json.dumps(report.to_json()) if args.json else report.format(), flush=True)
    if args.fit:
        if args.recipe == "rollout":
            print("--fit: the rollout's peak is flat from chunk 5 on (the context stops growing at 20 frames): "
                  "if 8 chunks fit, any number does", flush=True)
            return 0
        n_ctx = max(args.context_frames) if args.recipe == "v4" else 0
        for card, (batch, report) in largest_batches(args, args.recipe, n_ctx).items():
            line = {"recipe": args.recipe, "card_gb": card, "context_frames": n_ctx, "largest_batch": batch,
                    "needs_gib": round(needed_gib(report), 2), "card_gib": round(card_gib(card), 2)}
            print(json.dumps(line) if args.json else
                  f"{args.recipe}: largest per-GPU batch on a {card} GB card ({card_gib(card):.1f} GiB): {batch} "
                  f"(needs {needed_gib(report):.1f} GiB incl. margin and CUDA context)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
