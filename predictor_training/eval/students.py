"""The trained few-step students a leaderboard scores as rows (`--student`): each read from its run directory's
recipe, given a short unique label, and loaded as what its user deploys (a LoRA merged into the Teacher's weights).
Their rows and plans are eval/leaderboard.py's."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Sequence

from peft.tuners.lora import LoraLayer

from predictor_training.runtime.errors import UserInputError
from predictor_training.runtime.io import read_json_file
from predictor_training.teacher.adapters import load_lora
from predictor_training.teacher.source import TeacherSource, load_teacher


@dataclass(frozen=True)
class StudentSource:
    """One `--student`: a trained few-step student of the Teacher. path: its model folder (config.json + weights:
    a run's model/ or ema/model/) or LoRA file (a run's lora_student.safetensors or ema/lora_student.safetensors);
    run_dir: the run directory whose train_config.json names its recipe; method: kd | dmd2 | ...; train: full |
    lora; steps, shift: its denoising schedule per chunk; ema: the generator's EMA weights; label: the row name."""

    path: Path
    run_dir: Path
    method: str
    train: str
    steps: int
    shift: float
    ema: bool
    label: str = ""

    def record(self) -> dict:
        return {"path": str(self.path), "method": self.method, "train": self.train, "steps": self.steps,
                "shift": self.shift, "ema": self.ema, "label": self.label}


def read_student(path: str | Path) -> StudentSource:
    """The student at `path` (see `StudentSource`), its recipe read from the nearest run directory above it
    (train_config.json: the method and the flags student_steps, student_shift, train). UserInputError naming the
    path when it is no student."""
    path = Path(path)
    is_model = path.is_dir() and (path / "config.json").is_file()
    is_lora = path.is_file() and path.suffix == ".safetensors"
    if not (is_model or is_lora):
        raise UserInputError(f"--student {path}: expected a student's model folder (config.json + weights, e.g. "
                             "RUN/model or RUN/ema/model) or its LoRA file (RUN/lora_student.safetensors)")
    run_dir = next((folder for folder in path.resolve().parents if (folder / "train_config.json").is_file()), None)
    if run_dir is None:
        raise UserInputError(f"--student {path}: no train_config.json in a folder above it, so its recipe (steps "
                             "per chunk, shift) is unknown; pass a student inside its run directory")
    config = read_json_file(run_dir / "train_config.json")
    flags = config.get("flags", {})
    if "student_steps" not in flags or flags.get("generator", "student") != "student":
        raise UserInputError(f"--student {path}: the run {run_dir.name} trained no few-step student (its "
                             "train_config.json flags have no student_steps, or its generator is not a student)")
    return StudentSource(path=path, run_dir=run_dir, method=str(config.get("derived", {}).get("method", "student")),
                         train=str(flags.get("train", "full")), steps=int(flags["student_steps"]),
                         shift=float(flags["student_shift"]), ema="ema" in path.resolve().relative_to(run_dir).parts[:-1])



def student_labels(students: Sequence[StudentSource]) -> list[StudentSource]:
    """The students with short unique labels: '<method>_<steps>step_<train>' (+ '_ema'), a counter where they
    repeat."""
    bases = [f"{student.method}_{student.steps}step_{student.train}{'_ema' if student.ema else ''}"
             for student in students]
    seen: dict[str, int] = {}
    out = []
    for base, student in zip(bases, students):
        seen[base] = seen.get(base, 0) + 1
        out.append(replace(student, label=base if bases.count(base) == 1 else f"{base}_{seen[base]}"))
    return out


def load_student(student: StudentSource, teacher_source, device, dtype):
    """The student's transformer, frozen, on `device` in `dtype`: its model folder, or the Teacher with its LoRA
    merged into the weights (what its user deploys: no adapter cost at inference)."""
    if student.train != "lora" or student.path.is_dir():
        return load_teacher(TeacherSource(student.path, None, "--student", None), device, dtype)
    model = load_teacher(teacher_source, device, dtype)
    name = load_lora(model, student.path, "student").name
    for _, layer in model.named_modules():
        if isinstance(layer, LoraLayer) and name in layer.lora_A:
            layer.merge(adapter_names=[name])
    return model
