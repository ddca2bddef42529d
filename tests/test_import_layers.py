"""The package's layers import only downwards (README § Layout).

    runtime  <-  video  <-  teacher  <-  rollout  <-  data  <-  predictor  <-  methods, world, conformance  <-  eval
            <-  recipes

A module may import its own folder and any lower layer; nothing in the package imports `fvtools`, `tools`,
`benchmarks` or an entry script. Imports are read from the source (ast), including the ones inside functions and
under `TYPE_CHECKING`, so a typing-only cycle fails as well.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

PACKAGE = "predictor_training"
ROOT = Path(__file__).resolve().parents[1]
LAYER_RANK = {
    "runtime": 0,
    "video": 1,
    "teacher": 2,
    "rollout": 3,
    "data": 4,
    "predictor": 5,
    "methods": 6,
    "world": 6,
    "conformance": 6,
    "eval": 7,
    "recipes": 8,
}
OUTSIDE = ("fvtools", "tools", "benchmarks", "train_predictor_v4", "train_predictor_v4_rollout",
           "train_predictor_disca")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import statement in the file, relative ones resolved."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            found.append((node.lineno, base))
            # `from predictor_training import runtime` names a layer too
            if base == PACKAGE:
                found += [(node.lineno, f"{PACKAGE}.{alias.name}") for alias in node.names]
    return found


def layer_of(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != PACKAGE or len(parts) < 2:
        return None
    return parts[1]


def package_files() -> list[Path]:
    return sorted((ROOT / PACKAGE).rglob("*.py"))


def test_every_package_module_sits_in_a_layer():
    loose = [str(path.relative_to(ROOT)) for path in package_files()
             if path.parent == ROOT / PACKAGE and path.name != "__init__.py"]
    assert loose == [], f"modules outside a layer folder: {loose}"
    folders = {path.relative_to(ROOT / PACKAGE).parts[0] for path in package_files() if path.parent != ROOT / PACKAGE}
    assert folders <= set(LAYER_RANK), f"folders with no layer rank: {sorted(folders - set(LAYER_RANK))}"


def import_violations() -> list[str]:
    problems = []
    for path in package_files():
        own = layer_of(module_name(path))
        for line, target in imported_modules(path):
            where = f"{path.relative_to(ROOT)}:{line} imports {target}"
            if target.split(".")[0] in OUTSIDE:
                problems.append(f"{where} (outside the package)")
                continue
            other = layer_of(target)
            if own is None or other is None or other == own:
                continue
            if LAYER_RANK[other] >= LAYER_RANK[own]:
                problems.append(f"{where} ({own} may not import {other})")
    return problems


def test_imports_point_down():
    problems = import_violations()
    assert problems == [], "imports that point up or sideways:\n" + "\n".join(problems)


@pytest.mark.parametrize("source, expected", [
    ("from predictor_training.eval.methods import Schedule\n", "rollout may not import eval"),
    ("from ..eval import methods\n", "rollout may not import eval"),
    ("import fvtools.train_dmd2\n", "outside the package"),
])
def test_the_checker_sees_an_upward_import(tmp_path, monkeypatch, source, expected):
    fake_root = tmp_path
    target = fake_root / PACKAGE / "rollout" / "bad.py"
    target.parent.mkdir(parents=True)
    (fake_root / PACKAGE / "__init__.py").write_text("")
    (target.parent / "__init__.py").write_text("")
    target.write_text(source)
    monkeypatch.setattr(sys.modules[__name__], "ROOT", fake_root)  # tests.test_import_layers
    problems = import_violations()
    assert len(problems) == 1 and expected in problems[0], problems
