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
    chunk0_full: chunk 0 stays F-F-F-F (train.md § What is compared) when True; otherwise chunk 0 follows the schedule too.
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
