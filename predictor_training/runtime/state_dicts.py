"""Key-and-shape comparison of a state dict against a model's, with one readable error (Teacher, LoRA, FSDP)."""

from __future__ import annotations

from collections.abc import Mapping

from predictor_training.runtime.errors import UserInputError

MAX_LISTED_KEYS = 20


class StateDictMismatchError(UserInputError, KeyError):
    """A state dict whose keys or shapes differ from the model's. Lists missing, unexpected and mismatched keys."""

    def __init__(self, source: str, missing: list[str], unexpected: list[str], mismatched: list[str], detail: str):
        self.source = source
        self.missing = missing
        self.unexpected = unexpected
        self.mismatched = mismatched
        self.message = detail
        super().__init__(detail)

    def __str__(self) -> str:
        return self.message


def listing(title: str, lines: list[str]) -> list[str]:
    if not lines:
        return []
    shown = [f"    {line}" for line in lines[:MAX_LISTED_KEYS]]
    if len(lines) > MAX_LISTED_KEYS:
        shown.append(f"    ... and {len(lines) - MAX_LISTED_KEYS} more")
    return [f"  {title} ({len(lines)}):", *shown]


def mismatch_report(model_shapes: Mapping[str, tuple], checkpoint_shapes: Mapping[str, tuple], source: str):
    """Compare key -> shape maps. Returns (missing, unexpected, mismatched, report text); report is '' if equal."""
    missing = sorted(set(model_shapes) - set(checkpoint_shapes))
    unexpected = sorted(set(checkpoint_shapes) - set(model_shapes))
    shared = set(model_shapes) & set(checkpoint_shapes)
    mismatched = sorted(key for key in shared if tuple(model_shapes[key]) != tuple(checkpoint_shapes[key]))
    if not (missing or unexpected or mismatched):
        return missing, unexpected, mismatched, ""
    lines = [
        f"checkpoint {source} does not match the model ({len(model_shapes)} keys expected, "
        f"{len(checkpoint_shapes)} found):"
    ]
    lines += listing("missing keys", [f"{key} {list(model_shapes[key])}" for key in missing])
    lines += listing("unexpected keys", [f"{key} {list(checkpoint_shapes[key])}" for key in unexpected])
    lines += listing(
        "shape mismatches",
        [f"{key}: checkpoint {list(checkpoint_shapes[key])}, model {list(model_shapes[key])}" for key in mismatched],
    )
    return missing, unexpected, mismatched, "\n".join(lines)
