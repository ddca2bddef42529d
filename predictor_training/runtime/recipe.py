"""What a recipe's `build` returns (`RecipeParts`): the parts its `main()` hands to the loop, and what the memory rehearsal
(`tools/estimate_memory.py`) and the acceptance run build through the same function.

Every entry script (`train_predictor_*.py`, `fvtools/train_*.py`, `tools/train_world_vae.py`) has

    def build(args, env, policy, *, <inputs from main's data step>, <seams with the real behaviour as default>)
        -> RecipeParts

holding what `main()` builds between the run start and the loop: the Teacher and the trained models, the roles
(optimizer, schedule, cadence), the step function and the validation. A seam is a keyword whose default is what a
run does (`load_teacher=load_teacher`, `draw_chunks=draw_training_chunks`, ...): the rehearsal passes its own
(a Teacher built from its config on fake tensors, the worst chunk draw) instead of patching the recipe by name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from torch import nn

from predictor_training.runtime.checkpoint import RunState
from predictor_training.runtime.loop import BatchStream
from predictor_training.runtime.roles import Role

StepFn = Callable[..., dict]  # step_fn(micro_batch, *, sync: bool, due: frozenset[str]) -> detached metrics


@dataclass
class RecipeParts:
    """roles: what the loop steps (resume restores them). step_fn: the recipe's step. models: every module the step
    runs, frozen ones included (the rehearsal counts their parameters). run_state: the loop position the step reads
    (fresh; `resume_roles` fills it in place). validation: the loop's validation or None. derived: values for the
    run config and summary (the Predictor's config, the --init_from metadata, ...). loop_options: extra `train_loop`
    keywords (e.g. `extra_step_check`). objects: what `main()` needs after the loop (e.g. the model to export)."""

    roles: list[Role]
    step_fn: StepFn
    models: list[nn.Module]
    run_state: RunState = field(default_factory=RunState)
    validation: object | None = None
    derived: dict = field(default_factory=dict)
    loop_options: dict = field(default_factory=dict)
    objects: dict = field(default_factory=dict)


@dataclass(frozen=True)
class RecipeData:
    """What a recipe's data step returns when it has no type of its own: the batches the loop draws, the dataset
    they come from, and named values the later steps read (e.g. the cache states a KD student trains at)."""

    batches: BatchStream
    dataset: object = None
    values: dict = field(default_factory=dict)
