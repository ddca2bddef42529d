"""Key-and-shape comparison of a checkpoint with a model (predictor_training/runtime/state_dicts.py): what is
missing, unexpected or of another shape, listed in one readable report (long lists cut), and the error's types."""

from __future__ import annotations

from predictor_training.runtime.errors import UserInputError
from predictor_training.runtime.state_dicts import MAX_LISTED_KEYS, StateDictMismatchError, mismatch_report


def test_equal_maps_give_no_report():
    shapes = {"a.weight": (2, 3), "a.bias": (2,)}
    assert mismatch_report(shapes, {"a.bias": [2], "a.weight": [2, 3]}, "x.safetensors") == ([], [], [], "")


def test_missing_unexpected_and_mismatched_keys_are_listed_with_both_shapes():
    model = {"a.weight": (2, 3), "b.weight": (4,), "c.bias": (5,)}
    checkpoint = {"a.weight": (3, 2), "c.bias": (5,), "d.extra": (1, 1)}
    missing, unexpected, mismatched, report = mismatch_report(model, checkpoint, "ckpt.safetensors")
    assert (missing, unexpected, mismatched) == (["b.weight"], ["d.extra"], ["a.weight"])
    assert report.splitlines() == [
        "checkpoint ckpt.safetensors does not match the model (3 keys expected, 3 found):",
        "  missing keys (1):",
        "    b.weight [4]",
        "  unexpected keys (1):",
        "    d.extra [1, 1]",
        "  shape mismatches (1):",
        "    a.weight: checkpoint [3, 2], model [2, 3]",
    ]


def test_a_long_listing_is_cut_after_the_first_keys():
    model = {f"layer{index:02d}": (1,) for index in range(MAX_LISTED_KEYS + 5)}
    _, _, _, report = mismatch_report(model, {}, "empty")
    lines = report.splitlines()
    assert lines[1] == f"  missing keys ({MAX_LISTED_KEYS + 5}):"
    assert lines[2] == "    layer00 [1]" and lines[1 + MAX_LISTED_KEYS] == f"    layer{MAX_LISTED_KEYS - 1:02d} [1]"
    assert lines[-1] == "    ... and 5 more" and len(lines) == 2 + MAX_LISTED_KEYS + 1


def test_the_error_is_a_user_error_and_a_key_error_with_its_own_text():
    error = StateDictMismatchError("ckpt", ["b"], ["d"], ["a"], "checkpoint ckpt does not match\n  missing keys (1):")
    assert isinstance(error, UserInputError) and isinstance(error, KeyError)
    assert str(error) == "checkpoint ckpt does not match\n  missing keys (1):"  # not KeyError's quoted repr
    assert (error.source, error.missing, error.unexpected, error.mismatched) == ("ckpt", ["b"], ["d"], ["a"])
