"""The plan of a Predictor dataset build (predictor_training/data/build_plan.py): a final sample table is refused
before any table is read (the other input checks run through whole builds: tests/data/test_builder.py)."""

from __future__ import annotations

import pytest

from predictor_training.data.build_plan import DatasetInputError, read_plan


def test_a_final_sample_table_is_refused(tmp_path):
    """The split nothing is chosen on (the demo's samples/final.jsonl) never goes into a Predictor dataset, so no
    recipe trains or validates on it."""
    tables = [tmp_path / "train.jsonl", tmp_path / "final.jsonl"]  # refused before either is read
    with pytest.raises(DatasetInputError, match=r"final\.jsonl: split 'final' is the split nothing is chosen"):
        read_plan(tables, None, 8, {}, read_encoded=False)
