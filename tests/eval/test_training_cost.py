"""eval/training_cost.py on run directories the tests write by hand (train_config.json, train_log.jsonl, weights
files with their metadata): core-hours worked out by hand, the FLOPs of each item model, a two-run lineage summed up
to the step the child started from, a missing parent reported (and the shipped demo Predictor's), a student's
Teacher counted unless it is the Teacher every row serves, the step keys of the recipes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import safetensors.torch
import torch

from predictor_training.eval.training_cost import (
    STEP_FLOPS_TABLE,
    cost_columns,
    find_entry,
    load_step_flops,
    step_key,
    threads_per_rank,
    training_cost,
)
from predictor_training.runtime.inference_weights import save_inference_weights
from predictor_training.teacher.adapters import LORA_FILE_FORMAT
from predictor_training.world.assets import WORLD_WEIGHTS

FRRP_KEY = {"recipe": "rollout", "replace_steps": [3], "reuse_steps": [1, 2], "context_mode": "exact"}
KD_KEY = {"recipe": "kd", "train": "full", "student_steps": 1, "context_grad": False}
DMD2_KEY = {"recipe": "dmd2", "generator": "student", "rollout": "self", "real_score": "model",
            "fake_score_train": "full", "anchor": False, "recompute_context": True, "train": "full",
            "student_steps": 2, "exit_step": "uniform", "student_sampler": "renoise", "context_grad": False}


# ---- hand-made runs --------------------------------------------------------------------------------------------
def rollout_config(*, world_size=2, global_batch=2, environment=None, init_from=None, init_meta=None, **flags):
    """The train_config.json of an F-R-R-P rollout run (the fields the training cost reads)."""
    return {"flags": {"replace_steps": [3], "reuse_steps": [1, 2], "context_mode": "exact", "init_from": init_from,
                      "resume": None, "teacher": None, "output_dir": None, **flags},
            "derived": {"run_name": "frrp", "variant": "v4", "recipe": "rollout_frrp", "world_size": world_size,
                        "global_batch": global_batch, "init_meta": init_meta,
                        "environment": {"omp_num_threads": "1"} if environment is None else environment}}


def method_config(method, *, teacher, world_size=1, **flags):
    """A kd / dmd2 student run's train_config.json (full parameters from the Teacher's weights)."""
    defaults = {"kd": {"student_steps": 1, "chunks_per_clip": 2},
                "dmd2": {"generator": "student", "rollout": "self", "real_score_kind": "model", "real_score": None,
                         "real_score_path": None, "fake_score_train": "full", "anchor_weight": 0.0,
                         "recompute_context": True, "student_steps": 2, "exit_step": "uniform",
                         "student_sampler": "renoise", "generator_every": 5, "monitor_every": 10}}[method]
    return {"flags": {"train": "full", "init_weights": "teacher", "lora_rank": 64, "context_grad": False,
                      "teacher": None if teacher is None else str(teacher), "init_from": None, "resume": None,
                      "output_dir": None, **defaults, **flags},
            "derived": {"run_name": method, "method": method, "world_size": world_size, "global_batch": world_size,
                        "init_meta": None, "environment": {"omp_num_threads": "1", "torch_threads": 1}}}


def write_run(run_dir: Path, config: dict, step_seconds: list[float], first_step: int = 1) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "train_config.json").write_text(json.dumps(config))
    records = [{"step": first_step + index, "loss": 0.1, "time/step_s": seconds}
               for index, seconds in enumerate(step_seconds)]
    (run_dir / "train_log.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
    return run_dir


def write_weights(path: Path, config: dict, step: int, **meta) -> Path:
    """A Predictor's inference weights as the loop writes them (meta with the step, the run config)."""
    save_inference_weights(path, {"weight": torch.zeros(2)}, metadata={"variant": "v4", "step": step, **meta},
                           config=config)
    return path


def write_model_folder(folder: Path, metadata: dict | None) -> Path:
    """An exported model folder (a Teacher or a full student): config.json and the weights file with its
    {"metadata": JSON} header, as methods/method_model.py export_method_model writes it."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    header = {} if metadata is None else {"metadata": json.dumps(metadata)}
    safetensors.torch.save_file({"weight": torch.zeros(2)}, str(folder / "diffusion_pytorch_model.safetensors"),
                                metadata=header)
    return folder


def write_table(path: Path, *entries) -> Path:
    path.write_text(json.dumps({"entries": list(entries)}))
    return path


def per_item(key, item):
    return {"key": key, "item": "trajectory", "model": "per_item", "parts": {"item": item}}


# ---- core-hours ------------------------------------------------------------------------------------------------
def test_core_hours_by_hand(tmp_path):
    """4 logged steps of 1.5 + 2 + 2.5 + 4 = 10 s on 2 ranks of 3 threads: 10 x 2 x 3 / 3600 = 1/60 core-hour."""
    config = rollout_config(environment={"omp_num_threads": "3", "torch_threads": 3})
    run = write_run(tmp_path / "run", config, [1.5, 2.0, 2.5, 4.0])
    cost = training_cost(run, table=write_table(tmp_path / "table.json"))
    (own,) = cost["runs"]
    assert own["link"] == "self" and own["steps"] == [0, 4] and own["logged_steps"] == 4
    assert own["step_seconds"] == pytest.approx(10.0)
    assert own["core_hours"] == pytest.approx(10.0 * 2 * 3 / 3600)
    assert cost["core_hours"] == pytest.approx(1 / 60)
    assert cost["lineage_complete"] and cost["complete"]["core_hours"]
    assert cost["flops"] is None and not cost["complete"]["flops"]  # no step cost for its key in an empty table
    assert "python tools/measure_step_flops.py --run" in " ".join(own["notes"])


def test_threads_come_from_the_record_else_omp_else_one():
    def config(environment):
        return {"derived": {"environment": environment}}
    assert threads_per_rank(config({"torch_threads": 4, "omp_num_threads": "1"})) == (4, "torch_threads recorded")
    assert threads_per_rank(config({"omp_num_threads": "2"})) == (2, "OMP_NUM_THREADS recorded")
    assert threads_per_rank(config({"omp_num_threads": "unset"}))[0] == 1
    assert "assumed" in threads_per_rank(config({}))[1]


def test_a_step_without_a_record_makes_the_core_hours_a_lower_bound(tmp_path):
    run = write_run(tmp_path / "run", rollout_config(), [1.0, 1.0, 1.0])
    (run / "train_log.jsonl").write_text("".join(json.dumps({"step": step, "time/step_s": 1.0}) + "\n"
                                                 for step in (1, 3)))
    cost = training_cost(run, table=write_table(tmp_path / "table.json"))
    assert cost["runs"][0]["steps"] == [0, 3] and cost["runs"][0]["logged_steps"] == 2
    assert cost["lineage_complete"] and not cost["complete"]["core_hours"]
    assert cost["missing"][0]["link"] == "run_log" and "1 of steps 1..3" in cost["missing"][0]["what"]
    assert cost_columns(cost)["train core-h (demo CPU)"].startswith("≥ ")


# ---- FLOPs at the real config ----------------------------------------------------------------------------------
def test_flops_per_item_times_global_batch_and_steps(tmp_path):
    table = write_table(tmp_path / "table.json", per_item(FRRP_KEY, 3e15))
    run = write_run(tmp_path / "run", rollout_config(global_batch=4), [1.0] * 5)
    cost = training_cost(run, table=table)
    assert cost["flops"] == pytest.approx(3e15 * 4 * 5)
    assert cost["runs"][0]["flops_per_step"] == pytest.approx(3e15 * 4)
    assert cost["complete"] == {"core_hours": True, "flops": True}
    assert cost_columns(cost) == {"train core-h (demo CPU)": f"{5 * 2 / 3600:.3g}",
                                  "train FLOPs (real config)": "6e+16", "lineage": "complete"}


def test_kd_flops_take_the_chunks_it_draws(tmp_path):
    """2 of 8 chunks per sample, each equally likely: fixed 10 + 2/8 of all chunks' 800 = 210 per sample; 3 steps
    on 2 ranks."""
    table = write_table(tmp_path / "table.json", {"key": KD_KEY, "item": "sample", "model": "chunk_draw",
                                                  "parts": {"fixed": 10, "all_chunks": 800, "chunks": 8}})
    run = write_run(tmp_path / "kd", method_config("kd", teacher=None, world_size=2, chunks_per_clip=2), [1.0] * 3)
    assert training_cost(run, table=table)["flops"] == pytest.approx((10 + 800 * 2 / 8) * 3 * 2)


def test_dmd2_flops_count_the_cadences_exactly(tmp_path):
    """12 steps: the critic on all 12, the generator on steps 5 and 10, the monitor on step 10."""
    table = write_table(tmp_path / "table.json", {"key": DMD2_KEY, "item": "clip", "model": "cadence",
                                                  "parts": {"critic": 7, "generator": 100, "monitor": 1000}})
    run = write_run(tmp_path / "dmd2", method_config("dmd2", teacher=None), [1.0] * 12)
    assert training_cost(run, table=table)["flops"] == pytest.approx(12 * 7 + 2 * 100 + 1 * 1000)


def test_step_keys_of_the_recipes():
    assert step_key(rollout_config()) == FRRP_KEY
    assert step_key({"flags": {}, "derived": {"variant": "disca"}}) == {"recipe": "disca"}
    assert step_key(method_config("kd", teacher=None)) == KD_KEY
    assert step_key(method_config("dmd2", teacher=None)) == DMD2_KEY
    lora = step_key(method_config("kd", teacher=None, train="lora", lora_rank=16))
    assert lora["train"] == "lora" and lora["lora_rank"] == 16
    old = method_config("dmd2", teacher=None)
    del old["flags"]["student_sampler"]  # a run made before the flag: Euler, as the code then ran
    assert step_key(old)["student_sampler"] == "euler"


# ---- the lineage -----------------------------------------------------------------------------------------------
def test_two_run_lineage_is_summed_up_to_the_step_the_child_started_from(tmp_path):
    """The parent ran 6 steps (1 s each) but the child started from its step-4 weights: the parent counts 4 steps,
    the child its own 3 (2 s each); FLOPs likewise (7 steps x global batch 2)."""
    table = write_table(tmp_path / "table.json", per_item(FRRP_KEY, 5.0))
    parent = write_run(tmp_path / "parent", rollout_config(), [1.0] * 6)
    init = write_weights(parent / "predictor_step_00004.safetensors", rollout_config(), 4)
    child = write_run(tmp_path / "child", rollout_config(init_from=str(init), init_meta={"step": 4}), [2.0] * 3)
    cost = training_cost(child, table=table)
    own, ancestor = cost["runs"]
    assert (own["link"], own["steps"]) == ("self", [0, 3])
    assert (ancestor["link"], ancestor["steps"], ancestor["run_dir"]) == ("init_from", [0, 4], str(parent))
    assert ancestor["core_hours"] == pytest.approx(4 * 1.0 * 2 / 3600)
    assert cost["core_hours"] == pytest.approx((4 * 1.0 + 3 * 2.0) * 2 / 3600)
    assert cost["flops"] == pytest.approx(5.0 * 2 * (4 + 3))
    assert cost["steps"] == 7 and cost["lineage_complete"] and cost["missing"] == []
    assert cost_columns(cost)["lineage"] == "complete"


def test_weights_at_an_earlier_step_count_their_run_up_to_that_step(tmp_path):
    table = write_table(tmp_path / "table.json", per_item(FRRP_KEY, 5.0))
    run = write_run(tmp_path / "run", rollout_config(), [1.0] * 6)
    weights = write_weights(run / "predictor_step_00002.safetensors", rollout_config(), 2)
    cost = training_cost(weights, table=table)
    assert cost["runs"][0]["steps"] == [0, 2]
    assert cost["core_hours"] == pytest.approx(2 * 1.0 * 2 / 3600) and cost["flops"] == pytest.approx(5.0 * 2 * 2)


def test_a_missing_parent_is_reported_not_under_counted_silently(tmp_path):
    table = write_table(tmp_path / "table.json", per_item(FRRP_KEY, 5.0))
    gone = tmp_path / "elsewhere" / "predictor_step_01920.safetensors"
    recorded = {"variant": "v4", "recipe": "rollout_frrp", "step": 1920, "tensors_sha256": "ab" * 32}
    child = write_run(tmp_path / "child", rollout_config(init_from=str(gone), init_meta=recorded), [1.0] * 3)
    cost = training_cost(child, table=table)
    assert not cost["lineage_complete"]
    assert cost["complete"] == {"core_hours": False, "flops": False}
    (missing,) = cost["missing"]
    assert missing["link"] == "init_from" and missing["path"] == str(gone) and missing["recorded"] == recorded
    assert cost["core_hours"] == pytest.approx(3 * 2 / 3600)  # what was found: a lower bound
    assert cost_columns(cost) == {"train core-h (demo CPU)": f"≥ {3 * 2 / 3600:.3g}",
                                  "train FLOPs (real config)": "≥ 30", "lineage": "incomplete (1 missing)"}


def test_the_shipped_demo_predictor_says_its_lineage_is_incomplete():
    """Its run directory and its parent (step 1920 of the chain of fine-tunes) are not on this machine: no
    core-hours, FLOPs from the config it carries (480 steps x global batch 2 at the committed F-R-R-P step cost),
    and both named as missing."""
    cost = training_cost(WORLD_WEIGHTS / "predictor_frrp" / "predictor_step_00480.safetensors")
    assert not cost["lineage_complete"]
    assert cost["core_hours"] is None
    links = {item["link"]: item for item in cost["missing"]}
    assert set(links) == {"run_log", "init_from"}
    assert links["init_from"]["path"].endswith("predictor_step_01920.safetensors")
    assert links["init_from"]["recorded"]["step"] == 1920
    entry = find_entry(FRRP_KEY, load_step_flops(STEP_FLOPS_TABLE))
    assert entry is not None, "the committed table lacks the F-R-R-P rollout (tools/measure_step_flops.py --standard)"
    assert cost["flops"] == pytest.approx(entry["parts"]["item"] * 2 * 480)
    assert cost_columns(cost)["lineage"] == "incomplete (1 missing)"


def test_a_students_teacher_is_counted_unless_it_is_the_teacher_every_row_serves(tmp_path):
    """kd distilled from the exported model of a dmd2 run: that run's 5 steps count; passed as the shared Teacher
    (or a copy of it) they do not."""
    table = write_table(tmp_path / "table.json")
    teacher_run = write_run(tmp_path / "teacher_run", method_config("dmd2", teacher=None), [3.0] * 5)
    teacher = write_model_folder(teacher_run / "model", {"method": "dmd2", "step": 5})
    student = write_run(tmp_path / "student", method_config("kd", teacher=teacher), [1.0] * 2)
    cost = training_cost(student, table=table)
    assert [run["link"] for run in cost["runs"]] == ["self", "teacher"]
    assert cost["core_hours"] == pytest.approx((2 * 1.0 + 5 * 3.0) / 3600)
    copy = write_model_folder(tmp_path / "served_teacher", {"method": "dmd2", "step": 5})
    for shared in (teacher, copy):
        served = training_cost(student, table=table, shared=[shared])
        assert [run["link"] for run in served["runs"]] == ["self"] and served["lineage_complete"]
        assert "counted by no row" in served["notes"][0]


def test_a_teacher_path_that_does_not_resolve_here_is_recognised_by_its_recorded_sha256(tmp_path, monkeypatch):
    """A student run records --teacher as given on its command line, relative to where it was launched; read from
    another working directory that path names nothing. The run's provenance records the Teacher's weights sha256:
    the served Teacher with those weights is recognised as shared, another one is not."""
    from predictor_training.runtime.provenance import weights_sha256

    table = write_table(tmp_path / "table.json")
    teacher = write_model_folder(tmp_path / "launch" / "teacher", {"method": "kd", "step": 1500})
    config = method_config("kd", teacher=Path("teacher"))
    config["derived"]["provenance"] = {"format": 1, "teacher_sha256": weights_sha256(teacher)}
    student = write_run(tmp_path / "launch" / "student", config, [1.0])
    monkeypatch.chdir(tmp_path)  # not the launch folder: "teacher" does not resolve
    assert training_cost(student, table=table, shared=[teacher])["lineage_complete"]
    other = tmp_path / "other_teacher"
    other.mkdir()
    (other / "config.json").write_text("{}")
    safetensors.torch.save_file({"weight": torch.ones(2)}, str(other / "diffusion_pytorch_model.safetensors"))
    assert [item["link"] for item in training_cost(student, table=table, shared=[other])["missing"]] == ["teacher"]


def test_a_real_score_shared_by_every_row_is_not_counted(tmp_path):
    """dmd2 from the served Teacher with a flow-matching real score trained elsewhere: both missing unless shared."""
    table = write_table(tmp_path / "table.json")
    teacher = write_model_folder(tmp_path / "teacher", {"method": "kd", "step": 1500})
    score = write_model_folder(tmp_path / "fm_teacher", {"method": "df_sft", "step": 4000})
    run = write_run(tmp_path / "dmd2", method_config("dmd2", teacher=teacher, real_score=str(score),
                                                     real_score_path=str(score)), [1.0])
    assert [item["link"] for item in training_cost(run, table=table)["missing"]] == ["teacher", "real_score"]
    assert [item["link"] for item in training_cost(run, table=table, shared=[teacher])["missing"]] == ["real_score"]
    assert training_cost(run, table=table, shared=[teacher, score])["lineage_complete"]


def test_a_students_ema_export_costs_what_its_run_cost(tmp_path):
    """`<run>/ema/model` (a full student's EMA) and `<run>/ema/lora_student.safetensors` are the run's weights: the
    same steps, core-hours and FLOPs as `<run>/model`, not an unknown cost."""
    table = write_table(tmp_path / "table.json", per_item(DMD2_KEY, 2.0))
    run = write_run(tmp_path / "dmd2", method_config("dmd2", teacher=None), [1.0, 3.0])
    raw = write_model_folder(run / "model", {"method": "dmd2", "step": 2})
    ema = write_model_folder(run / "ema" / "model", {"method": "dmd2", "step": 2})
    lora = run / "ema" / "lora_student.safetensors"
    safetensors.torch.save_file({"weight": torch.zeros(2)}, str(lora),
                                metadata={"format": LORA_FILE_FORMAT, "metadata": json.dumps({"step": 2})})
    expected = training_cost(raw, table=table)
    assert expected["core_hours"] == pytest.approx(4.0 / 3600) and expected["flops"] > 0
    for weights in (ema, lora):
        cost = training_cost(weights, table=table)
        assert (cost["core_hours"], cost["flops"], cost["lineage_complete"]) == (
            expected["core_hours"], expected["flops"], expected["lineage_complete"]), weights


def test_a_trained_teacher_outside_any_run_is_missing_a_base_model_is_not(tmp_path):
    table = write_table(tmp_path / "table.json")
    trained = write_model_folder(tmp_path / "copied_teacher", {"method": "kd", "step": 1500})
    student = write_run(tmp_path / "student", method_config("kd", teacher=trained), [1.0])
    cost = training_cost(student, table=table)
    assert not cost["lineage_complete"]
    assert cost["missing"][0]["link"] == "teacher" and cost["missing"][0]["recorded"]["step"] == 1500
    base = write_model_folder(tmp_path / "base_teacher", None)
    cost = training_cost(write_run(tmp_path / "student2", method_config("kd", teacher=base), [1.0]), table=table)
    assert cost["lineage_complete"] and "base model" in cost["notes"][0]


def test_a_run_config_without_world_size_or_global_batch_has_unknown_figures_not_an_error(tmp_path):
    """Older run configs lack `world_size` / `global_batch`: their core-hours and FLOPs are unknown, said in the
    notes, and the leaderboard still scores the row."""
    from predictor_training.eval.training_cost import training_cost

    config = {"flags": {"replace_steps": [3], "reuse_steps": [1, 2], "context_mode": "exact", "init_from": None,
                        "resume": None}, "derived": {"recipe": "rollout_frrp", "variant": "v4"}}
    (tmp_path / "train_config.json").write_text(json.dumps(config))
    (tmp_path / "train_log.jsonl").write_text(json.dumps({"step": 1, "time/step_s": 1.0}) + "\n")
    cost = training_cost(tmp_path)
    assert (cost["core_hours"], cost["flops"]) == (None, None)
    notes = " ".join(cost["runs"][0]["notes"])
    assert "no world size" in notes and "no global batch" in notes
