"""The trained students a leaderboard scores (predictor_training/eval/students.py): read from their run, labelled,
given a row each, and a LoRA student loaded with its adapter merged."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from predictor_training.eval.leaderboard import build_rows
from predictor_training.teacher import WorldPlayTransformer
from predictor_training.teacher.source import TeacherSource
from tests.helpers.eval_world import write_eval_world


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict:
    return write_eval_world(tmp_path_factory.mktemp("students_world"))


def _teacher(world) -> WorldPlayTransformer:
    return WorldPlayTransformer.from_pretrained(str(world["root"] / "teacher")).eval().requires_grad_(False)


def _student_run(tmp_path, name: str, flags: dict, method: str = "kd") -> "Path":
    run = tmp_path / name
    (run / "model").mkdir(parents=True)
    (run / "model" / "config.json").write_text("{}")
    (run / "ema" / "model").mkdir(parents=True)
    (run / "ema" / "model" / "config.json").write_text("{}")
    (run / "lora_student.safetensors").write_bytes(b"")
    # the layout the loop writes (runtime/run_directory.py): the recipe's method under "derived"
    (run / "train_config.json").write_text(json.dumps({"flags": {"experiment": "students", **flags},
                                                       "derived": {"method": method}}))
    return run


def test_students_are_read_from_their_run_and_get_a_row_each(tmp_path, monkeypatch):
    """A student's recipe comes from its run's train_config.json (method, student_steps, student_shift, train); the
    EMA is told apart by its folder; labels repeat-proof; the rows run every chunk on the student and join the
    front as baselines; a folder with no run above it, or a run that trained no student, is refused."""
    from predictor_training.eval.students import read_student, student_labels
    from predictor_training.runtime.errors import UserInputError

    one = _student_run(tmp_path, "kd1", {"student_steps": 1, "student_shift": 5.0, "train": "full"})
    two = _student_run(tmp_path, "dmd2", {"student_steps": 2, "student_shift": 5.0 / 3.0, "train": "lora",
                                          "generator": "student"}, method="dmd2")
    students = student_labels([read_student(one / "model"), read_student(two / "ema" / "model"),
                               read_student(two / "lora_student.safetensors"), read_student(one / "model")])
    assert [student.label for student in students] == ["kd_1step_full_1", "dmd2_2step_lora_ema", "dmd2_2step_lora",
                                                       "kd_1step_full_2"]
    assert (students[0].steps, students[0].shift, students[0].ema, students[1].ema) == (1, 5.0, False, True)
    monkeypatch.chdir(tmp_path)  # a path relative to the working directory, as a command line gives it
    assert (read_student(Path("dmd2") / "ema" / "model").ema, read_student(Path("kd1") / "model").ema) == (True, False)
    rows = build_rows(num_steps=4, shift=5.0, samplers=[], caches=[], teacache_full_steps=[], mixtures=[],
                      predictor_plans={}, students=students[:2])
    student_rows = [row for row in rows if row.family == "student"]
    assert [(row.key, row.plan, row.student) for row in student_rows] == [
        ("student_kd_1step_full_1_srrr", "S-R-R-R", "kd_1step_full_1"),
        ("student_dmd2_2step_lora_ema_srrs", "S-R-R-S", "dmd2_2step_lora_ema")]
    assert all(row.baseline and not row.step_plan.chunk0_full for row in student_rows)
    assert "student" not in rows[0].record() and student_rows[0].record()["student"] == "kd_1step_full_1"
    predictor_run = _student_run(tmp_path, "dmd2_predictor", {"student_steps": 4, "student_shift": 5.0,
                                                              "generator": "predictor"}, method="dmd2")
    for bad in (predictor_run / "model", tmp_path / "nowhere", tmp_path):
        with pytest.raises(UserInputError):
            read_student(bad)


def test_a_lora_student_is_the_teacher_with_its_adapter_merged(world, tmp_path):
    """A LoRA student loads as the Teacher with the adapter merged into its weights: every adapted linear gives what
    the Teacher gives with the adapter active (W x + scale B A x), and no adapter runs at inference."""
    from predictor_training.eval.students import StudentSource, load_student
    from predictor_training.teacher.adapters import active_adapter, add_lora, adapter, named_lora_parameters, save_lora

    teacher = _teacher(world)
    add_lora(teacher, "student", 4, 8.0, trainable=False)
    with torch.no_grad():
        for key, parameter in named_lora_parameters(teacher, "student").items():
            if "lora_B" in key:
                parameter.copy_(0.1 * torch.randn(parameter.shape, generator=torch.Generator().manual_seed(5)))
    path = save_lora(teacher, "student", tmp_path / "lora_student.safetensors")
    source = TeacherSource(world["root"] / "teacher", None, "--teacher", None)
    student = load_student(StudentSource(path=path, run_dir=tmp_path, method="kd", train="lora", steps=1, shift=5.0,
                                         ema=False), source, torch.device("cpu"), torch.float32)
    assert active_adapter(student) in (None, "student")
    x = torch.randn(3, teacher.double_blocks[0].img_attn_q.base_layer.in_features,
                    generator=torch.Generator().manual_seed(6))
    with adapter(teacher, "student"):
        adapted = teacher.double_blocks[0].img_attn_q(x)
    merged_layer = student.double_blocks[0].img_attn_q
    merged = merged_layer.base_layer(x) if hasattr(merged_layer, "base_layer") else merged_layer(x)
    torch.testing.assert_close(merged, adapted)
    with adapter(teacher, None):
        assert not torch.allclose(teacher.double_blocks[0].img_attn_q(x), adapted)
