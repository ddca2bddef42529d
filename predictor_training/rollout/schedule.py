"""What fills each denoising step of each chunk: the one type of a schedule (F-P-P-P, F-R-R-P, the leaderboard's
plans), `StepPlan`, from the flags (`--replace_steps` / `--reuse_steps`: `StepPlan.from_steps`, their one check) to
the trainer's policy, the validation, the eval and the leaderboard."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from predictor_training.teacher.config import DISTILLED_STEPS

# F-P-P-P: the schedule every Predictor recipe and the eval default to (--replace_steps).
DEFAULT_REPLACE_STEPS = (1, 2, 3)


def parse_replace_steps(text: str) -> tuple[int, ...]:
    """"1,2,3" -> (1, 2, 3); "" or "none" -> () (the `type` of --replace_steps / --reuse_steps; an empty plan runs
    every step Full)."""
    text = str(text).strip()
    if text in ("", "none"):
        return ()
    try:
        steps = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError as error:
        raise ValueError(f"--replace_steps {text!r}: expected comma-separated step indices like '1,2,3'") from error
    return steps


# A step plan names, per denoising step, what fills it (the leaderboard's rows, SPEC § 13):
#   F Full Teacher step        R velocity reuse (= the fewer-step Euler sampler)     H hidden reuse
#   P Predictor step           T first-order forecast of the hidden (TaylorSeer)     C previous-chunk reuse
#   A adaptive: Full or a cached residual, decided at run time (TeaCache)
#   B block-residual cache: a few Teacher blocks run, the others' residual from the chunk's last Full step (Delta-DiT)
#   S a Full step of the row's own model instead of the Teacher: a student distilled to fewer steps per chunk
#     (S-R-R-S is a 2-step student at sigma 1 and 0.625; its chunks, chunk 0 too, run on the student)
PLAN_LETTERS = "FRHPTCABS"
FULL_STEP_LETTERS = "FS"  # a whole-model step: the Teacher's (F) or a student's (S)
PLAN_MIXTURE_SEPARATOR = "|"  # "F-R-R-R|F-R-R-F": chunks 1, 3, 5, ... use the first pattern, chunks 2, 4, ... the second


@dataclass(frozen=True)
class StepPlan:
    """What fills each denoising step of each chunk: one letter of `PLAN_LETTERS` per step.

    patterns: one pattern per chunk of a cycle, each `num_steps` letters with step 0 'F' or 'S' (it has no previous
    step); a plan uses S (a student's steps) with no F: the row runs one model.
    Chunk 0 is F-F-F-F when chunk0_full (the eval's default, docs/eval.md § What is compared); the scheduled chunks
    1, 2, ... take patterns[0], patterns[1], ... cyclically, so "FRRR|FRRF" time-shares the 1-step and a 2-step
    sampler across chunks. Without chunk0_full chunk c takes patterns[c mod len].
    """

    patterns: tuple[str, ...]
    chunk0_full: bool = True

    def __post_init__(self):
        if not self.patterns:
            raise ValueError("a step plan needs at least one pattern")
        lengths = {len(pattern) for pattern in self.patterns}
        if len(lengths) != 1:
            raise ValueError(f"step plan {self.text!r}: every pattern needs the same number of steps")
        for pattern in self.patterns:
            bad = sorted(set(pattern) - set(PLAN_LETTERS))
            if bad:
                raise ValueError(f"step plan {self.text!r}: unknown letter(s) {bad}; expected letters of "
                                 f"{PLAN_LETTERS}")
            if pattern[0] not in FULL_STEP_LETTERS:
                raise ValueError(f"step plan {self.text!r}: step 0 must be F or S (the later steps start from it)")
        if "S" in self.letters_used and "F" in self.letters_used:
            raise ValueError(f"step plan {self.text!r}: S (a student's step) and F (the Teacher's) in one plan; a "
                             "row runs one model")

    @classmethod
    def parse(cls, text: str, chunk0_full: bool = True, num_steps: int = DISTILLED_STEPS) -> "StepPlan":
        """"F-R-R-P" or "FRRP" (one pattern), "F-R-R-R|F-R-R-F" (a per-chunk mixture) -> StepPlan."""
        patterns = tuple(part.replace("-", "").strip().upper() for part in str(text).split(PLAN_MIXTURE_SEPARATOR))
        wrong = [pattern for pattern in patterns if len(pattern) != num_steps]
        if wrong:
            raise ValueError(f"step plan {text!r}: every pattern needs {num_steps} letters (one per step), "
                             f"got {wrong}")
        return cls(patterns, chunk0_full)

    @classmethod
    def from_steps(cls, replace_steps, reuse_steps=(), num_steps: int = DISTILLED_STEPS,
                   chunk0_full: bool = True) -> "StepPlan":
        """P at `replace_steps`, R at `reuse_steps`, F elsewhere: (3,), (1, 2) -> F-R-R-P (the flags --replace_steps /
        --reuse_steps of the rollout recipe, the methods and the eval). The one check of those step lists: each
        ascending without repeats, within 1..num_steps-1 (step 0 is always Full), and no step in both."""
        for flag, steps in (("--replace_steps", tuple(replace_steps)), ("--reuse_steps", tuple(reuse_steps))):
            if list(steps) != sorted(set(steps)):
                raise ValueError(f"{flag} {list(steps)}: expected steps in ascending order without repeats")
            bad = [step for step in steps if not 1 <= step < num_steps]
            if bad:
                raise ValueError(f"{flag} {list(steps)}: {bad} outside 1..{num_steps - 1} (step 0 is always Full: "
                                 "the replaced steps need the previous step's output)")
        overlap = sorted(set(replace_steps) & set(reuse_steps))
        if overlap:
            raise ValueError(f"--reuse_steps {','.join(map(str, reuse_steps))}: steps {overlap} are also in "
                             "--replace_steps; a step is either reused or run by the Predictor")
        return cls(("".join("P" if step in replace_steps else "R" if step in reuse_steps else "F"
                            for step in range(num_steps)),), chunk0_full)

    @classmethod
    def from_flags(cls, flags: Mapping) -> "StepPlan":
        """The plan of a run's flags (the parsed namespace's `vars`, or the flags its train_config.json recorded):
        --replace_steps (1,2,3 when the recipe has none: the offline recipes train every step) and --reuse_steps
        (none when the recipe has none), each a list of steps or their comma text."""

        def steps(name: str, default) -> tuple[int, ...]:
            value = flags.get(name, default)
            return parse_replace_steps(value) if isinstance(value, str) else tuple(int(step) for step in value)

        return cls.from_steps(steps("replace_steps", DEFAULT_REPLACE_STEPS), steps("reuse_steps", ()))

    def with_letter(self, letter: str) -> "StepPlan":
        """This plan with every step that is not Full filled by `letter` (F-P-P-P, 'H' -> F-H-H-H)."""
        return StepPlan(tuple("".join(step if step in FULL_STEP_LETTERS else letter for step in pattern)
                              for pattern in self.patterns), self.chunk0_full)

    @property
    def num_steps(self) -> int:
        return len(self.patterns[0])

    @property
    def text(self) -> str:
        """'F-R-R-R|F-R-R-F'."""
        return PLAN_MIXTURE_SEPARATOR.join("-".join(pattern) for pattern in self.patterns)

    @property
    def tag(self) -> str:
        """File- and run-name part: 'fppp', 'frrp', 'frrr+frrf' (mixtures); '_allchunks' appended without
        chunk0_full, unless every step is Full (chunk 0 then runs as any other chunk)."""
        tag = "+".join(pattern.lower() for pattern in self.patterns)
        return tag if self.chunk0_full or not self.replaced_steps else f"{tag}_allchunks"

    @property
    def pattern(self) -> str:
        """The letters of a one-pattern plan, 'FRRP' (a mixture has no single pattern: ValueError)."""
        if len(self.patterns) != 1:
            raise ValueError(f"step plan {self.text!r} is a mixture of {len(self.patterns)} patterns; expected one")
        return self.patterns[0]

    def steps_of(self, letter: str) -> tuple[int, ...]:
        """The steps of a one-pattern plan that `letter` fills: F-R-R-P, 'R' -> (1, 2)."""
        return tuple(step for step, filled in enumerate(self.pattern) if filled == letter)

    @property
    def predictor_steps(self) -> tuple[int, ...]:
        """The steps a Predictor (or a trainer's student) runs: the P steps ((3,) for F-R-R-P)."""
        return self.steps_of("P")

    @property
    def reuse_steps(self) -> tuple[int, ...]:
        """The steps velocity reuse fills: the R steps ((1, 2) for F-R-R-P)."""
        return self.steps_of("R")

    @property
    def replaced_steps(self) -> tuple[int, ...]:
        """The steps of any pattern that no whole-model step fills (not F or S), ascending: what the eval's reuse
        baselines replace ((1, 2, 3) for F-R-R-P)."""
        return tuple(step for step in range(self.num_steps)
                     if any(pattern[step] not in FULL_STEP_LETTERS for pattern in self.patterns))

    def replaces(self, chunk_index: int, step_index: int) -> bool:
        """Whether the step is filled by something other than a whole-model step (F or S)."""
        return self.letter(chunk_index, step_index) not in FULL_STEP_LETTERS

    def describe(self) -> str:
        """'chunk 0 F-F-F-F, later chunks F-P-P-P', or 'every chunk F-P-P-P' without chunk0_full."""
        if self.chunk0_full:
            return f"chunk 0 F-F-F-F, later chunks {self.text}"
        return f"every chunk {self.text}"

    @property
    def letters_used(self) -> set[str]:
        return set("".join(self.patterns))

    def letter(self, chunk_index: int, step_index: int) -> str:
        if self.chunk0_full:
            if chunk_index == 0:
                return "S" if "S" in self.letters_used else "F"
            return self.patterns[(chunk_index - 1) % len(self.patterns)][step_index]
        return self.patterns[chunk_index % len(self.patterns)][step_index]

    def full_steps(self) -> float:
        """Full steps per scheduled chunk, averaged over the cycle (the adaptive 'A' counted as not Full; a
        student's S counted as Full: the same model size)."""
        return sum(sum(pattern.count(letter) for letter in FULL_STEP_LETTERS) for pattern in self.patterns) / len(
            self.patterns)

    def to_dict(self) -> dict:
        return {"plan": self.text, "chunk0_full": self.chunk0_full}
