"""Which denoising steps of which chunks a Predictor replaces (F-P-P-P and the other schedules), by step index."""

from __future__ import annotations

from dataclasses import dataclass

from predictor_training.teacher.config import DISTILLED_STEPS

# F-P-P-P: the schedule every Predictor recipe and the eval default to (--replace_steps).
DEFAULT_REPLACE_STEPS = (1, 2, 3)


def parse_replace_steps(text: str) -> tuple[int, ...]:
    """"1,2,3" -> (1, 2, 3); "" or "none" -> () (every method then equals the reference)."""
    text = str(text).strip()
    if text in ("", "none"):
        return ()
    try:
        steps = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError as error:
        raise ValueError(f"--replace_steps {text!r}: expected comma-separated step indices like '1,2,3'") from error
    return steps


@dataclass(frozen=True)
class Schedule:
    """Which denoising steps of which chunks are replaced.

    replace_steps: steps k in 1..num_steps-1 (step 0 has no previous step to reuse or anchor on), ascending.
    chunk0_full: chunk 0 stays F-F-F-F (docs/eval.md § What is compared) when True; otherwise chunk 0 follows the
    schedule too.
    """

    replace_steps: tuple[int, ...]
    num_steps: int = DISTILLED_STEPS
    chunk0_full: bool = True

    def __post_init__(self):
        steps = tuple(self.replace_steps)
        if list(steps) != sorted(set(steps)):
            raise ValueError(f"replace_steps {list(steps)} must be ascending without repeats")
        bad = [step for step in steps if not 1 <= step < self.num_steps]
        if bad:
            raise ValueError(
                f"replace_steps {list(steps)}: {bad} outside 1..{self.num_steps - 1} (step 0 is always Full: "
                "the replaced steps need the previous step's output)"
            )

    @classmethod
    def for_rollout(cls, replace_steps, config, chunk0_full: bool = True) -> "Schedule":
        """The schedule of an AR loop: its step count is the rollout config's (`RolloutConfig.num_steps`)."""
        return cls(tuple(replace_steps), num_steps=config.num_steps, chunk0_full=chunk0_full)

    def replaces(self, chunk_index: int, step_index: int) -> bool:
        if chunk_index == 0 and self.chunk0_full:
            return False
        return step_index in self.replace_steps

    def letters(self) -> str:
        """'FPPP' for (1, 2, 3)."""
        return "".join("P" if step in self.replace_steps else "F" for step in range(self.num_steps))

    @property
    def tag(self) -> str:
        """Run-name part: 'fppp' (chunk 0 Full) or 'fppp_allchunks'."""
        letters = self.letters().lower()
        return letters if self.chunk0_full or not self.replace_steps else f"{letters}_allchunks"

    def describe(self) -> str:
        letters = "-".join(self.letters())
        if self.chunk0_full:
            return f"chunk 0 F-F-F-F, later chunks {letters}"
        return f"every chunk {letters}"

    def to_dict(self) -> dict:
        return {"replace_steps": list(self.replace_steps), "num_steps": self.num_steps,
                "chunk0_full": self.chunk0_full, "letters": self.letters()}


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
        """P at `replace_steps`, R at `reuse_steps`, F elsewhere: (3,), (1, 2) -> F-R-R-P (a rollout run's
        --replace_steps / --reuse_steps, and the eval's)."""
        overlap = sorted(set(replace_steps) & set(reuse_steps))
        if overlap:
            raise ValueError(f"--reuse_steps: steps {overlap} are also in --replace_steps; a step is either reused "
                             "or run by the Predictor")
        Schedule(tuple(sorted(set(replace_steps) | set(reuse_steps))), num_steps)  # each step in 1..num_steps-1
        return cls(("".join("P" if step in replace_steps else "R" if step in reuse_steps else "F"
                            for step in range(num_steps)),), chunk0_full)

    @classmethod
    def from_schedule(cls, schedule: Schedule, letter: str) -> "StepPlan":
        """The plan that fills `schedule`'s replaced steps with `letter` (e.g. 'R' at F-P-P-P -> F-R-R-R)."""
        return cls(("".join(letter if step in schedule.replace_steps else "F" for step in range(schedule.num_steps)),),
                   schedule.chunk0_full)

    @property
    def num_steps(self) -> int:
        return len(self.patterns[0])

    @property
    def text(self) -> str:
        """'F-R-R-R|F-R-R-F'."""
        return PLAN_MIXTURE_SEPARATOR.join("-".join(pattern) for pattern in self.patterns)

    @property
    def tag(self) -> str:
        """File-name part: 'frrp', 'frrr+frrf' (mixtures), '_allchunks' appended without chunk0_full."""
        tag = "+".join(pattern.lower() for pattern in self.patterns)
        return tag if self.chunk0_full else f"{tag}_allchunks"

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
