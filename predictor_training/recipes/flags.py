"""The recipes' domain flag groups: what the flags mean to a Predictor recipe or a generic method, above every layer
that reads them. `runtime/flags.py` keeps the machinery (value parsers, presets, --config, the rules of single flags)
and the run's own groups.

The schedule: one flag group (`add_plan_args`: --replace_steps, --reuse_steps) whose one check is
`StepPlan.from_steps` gives `args.plan` on every parse, the `StepPlan` every recipe, the eval and the leaderboard
take; `check_plan` holds the rules a recipe adds (a trained Predictor runs at least one step).
"""

from __future__ import annotations

import argparse

from predictor_training.rollout.schedule import DEFAULT_REPLACE_STEPS, StepPlan, parse_replace_steps
from predictor_training.runtime.errors import CommandParser


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
