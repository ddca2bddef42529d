"""The leaderboard's reports (predictor_training/eval/leaderboard_report.py) on hand-made per-unit results
(tests/helpers/leaderboard_results.py): the headline, the measured speedup's spread in the table, CSV and JSON, the
TeaCache rows' notes, and each trained row's training cost in every output."""

from __future__ import annotations

import json

import pytest

from predictor_training.eval.leaderboard import RowSpec
from tests.helpers.leaderboard_results import COST_ROWS, PREDICTOR_CONFIG, cost_results, result_entry, row_spec


def test_the_headline_decomposes_a_row_into_its_gain_over_one_step_and_its_extra_teacher_steps():
    """On the FLOP axis of the config that ran one Full step per chunk costs what the 2-step sampler costs more than
    the 1-step one, 0.60 - 0.40 = 0.20 of F-F-F-F; F-R-R-P costs 0.45, 0.05 more than the 1-step sampler: +0.25
    Teacher steps per chunk, F-P-P-P (0.50) +0.5. Its gain over the 1-step sampler: videos a (seeds 28 - 20 and
    28 - 22) and b (34 - 30): ((8 + 6) / 2 + 4) / 2 = +5.5 dB. Scene and video resampling agree here (one video
    per scene)."""
    from predictor_training.eval.leaderboard_analysis import analyse
    from predictor_training.eval.leaderboard_report import extra_teacher_steps, headline_lines

    specs = [row_spec(key, plan) for key, plan, *_ in COST_ROWS]
    analysis = analyse(cost_results(), specs, {"ck": PREDICTOR_CONFIG}, baseline="sampler_1step_frrr",
                       resamples=200, seed=0)
    extra = extra_teacher_steps(analysis["rows"])
    assert extra["predictor_ck_frrp"] == pytest.approx(0.25) and extra["predictor_ck_fppp"] == pytest.approx(0.5)
    assert extra["sampler_2step_frrf"] == pytest.approx(1.0) and extra["reference"] == pytest.approx(3.0)
    line = next(line for line in headline_lines(analysis) if "predictor_ck_frrp" in line)
    assert "+5.50" in line and "+0.25 Teacher steps per chunk" in line and "over the 1-step sampler" in line
    assert analysis["bootstrap_unit"] == "scene" and analysis["num_clusters"] == 2
    by_video = analyse(cost_results(), specs, {"ck": PREDICTOR_CONFIG}, baseline="sampler_1step_frrr",
                       resamples=200, seed=0, unit="video")
    for scene_row, video_row in zip(analysis["rows"], by_video["rows"]):
        assert scene_row.quality.to_dict() == video_row.quality.to_dict()


def test_the_measured_speedup_carries_the_spread_of_its_per_video_speedups():
    """Four videos (video a under two seeds): reference DiT seconds 10, 10 | 12 | 8 | 10, the 1-step sampler's
    5, 5 | 4 | 8 | 2: per-video speedups 20/10 = 2, 3, 1, 5 (a video's seeds summed); pooled 50 / 24; quartiles of
    (1, 2, 3, 5): 1.75, 3.5. The table prints the interquartile range beside the pooled speedup, the CSV and JSON
    every part."""
    from predictor_training.eval.leaderboard_analysis import analyse
    from predictor_training.eval.leaderboard_report import csv_text, markdown, row_record, speedup_cell

    reference_s, sampler_s = [10.0, 10.0, 12.0, 8.0, 10.0], [5.0, 5.0, 4.0, 8.0, 2.0]
    results = []
    for unit, video in enumerate("aabcd"):
        methods = {"reference": result_entry(["FFFF", "FFFF"], 100.0, reference_s[unit], reference_s[unit] + 1),
                   "sampler_1step_frrr": result_entry(["FFFF", "FRRR"], 40.0, sampler_s[unit], sampler_s[unit] + 1,
                                                30.0)}
        results.append({"key": f"{video}{unit}", "video_key": video, "case_id": video,
                        "context_frames_per_chunk": [0, 4], "methods": methods})
    specs = [row_spec("reference", "F-F-F-F"), row_spec("sampler_1step_frrr", "F-R-R-R")]
    analysis = analyse(results, specs, {}, baseline="sampler_1step_frrr", resamples=100)
    row = analysis["rows"][1]
    assert row.speedup("measured_dit") == pytest.approx(50 / 24)
    assert {key: value for key, value in row.figures.items() if key.startswith("speedup_measured_dit_")} == \
        pytest.approx({"speedup_measured_dit_q25": 1.75, "speedup_measured_dit_q75": 3.5,
                       "speedup_measured_dit_min": 1.0, "speedup_measured_dit_max": 5.0})
    assert speedup_cell(row, "measured_dit") == "2.08× [1.75, 3.50]" and speedup_cell(row, "flops_run") == "2.50×"
    assert "| 2.08× [1.75, 3.50] |" in markdown(analysis, {"split": "s"})
    assert row_record(row)["figures"]["speedup_measured_dit_q75"] == pytest.approx(3.5)
    header, line = csv_text(analysis).splitlines()[0::2]
    assert "speedup_measured_dit_q25" in header.split(",") and "1.75" in line


def test_the_teacache_rows_say_what_they_reached_here_and_on_the_calibration_videos():
    """A TeaCache row calibrated to 1.2 (1.21 on the calibration videos) that ran 1.92 Full steps per chunk here is
    marked as not reaching its target; one at 2 that ran 2.05 reached it (within 0.1)."""
    from predictor_training.eval.leaderboard_analysis import RowResult
    from predictor_training.eval.leaderboard_report import teacache_notes
    from predictor_training.eval.front import Estimate

    def row(target, calibration, here):
        spec = RowSpec(f"teacache_full{target:g}", "cache", "F-A-A-A", f"TeaCache {target:g}", "t",
                       adaptive={"target_full_steps": target, "threshold": 0.0884, "rescale": [1.0, 0.0],
                                 "calibration_full_steps": calibration})
        return RowResult(spec, {}, None, Estimate(1.0, 0.0, 2.0), figures={"full_steps_per_chunk": here})

    lines = teacache_notes([row(1.2, 1.214, 1.915), row(2.0, 2.0, 2.05)])
    assert "| TeaCache 1.2 | 1.2 | 0.0884 | 1.21 | 1.92 | no: ran +0.72 from its target |" in lines
    assert "| TeaCache 2 | 2 | 0.0884 | 2.00 | 2.05 | yes |" in lines
    assert teacache_notes([]) == []


def _cost(core_hours, flops, steps, missing=()):
    return {"core_hours": core_hours, "flops": flops, "steps": steps, "lineage_complete": not missing,
            "complete": {"core_hours": not missing, "flops": not missing}, "runs": [],
            "missing": [{"link": "init_from", "path": path} for path in missing], "notes": []}


def test_each_trained_row_carries_its_own_training_cost_in_the_table_csv_json_and_plot(tmp_path):
    """Two Predictors of two checkpoints: each row gets its own checkpoint's training cost (a lower bound marked ≥
    with its missing parent counted), the training-free rows none, in the markdown, the CSV, the JSON and the
    plot labels."""
    import csv
    from dataclasses import replace

    from predictor_training.eval.leaderboard_analysis import analyse
    from predictor_training.eval.leaderboard_plots import point_label
    from predictor_training.eval.leaderboard_report import markdown, write_leaderboard

    specs = [row_spec(key, plan) for key, plan, *_ in COST_ROWS]
    specs = [replace(spec, checkpoint="other") if spec.key == "predictor_ck_fppp" else spec for spec in specs]
    analysis = analyse(cost_results(), specs, {"ck": PREDICTOR_CONFIG, "other": PREDICTOR_CONFIG},
                       baseline="sampler_1step_frrr", resamples=50, seed=0)
    analysis["training_costs"] = {"ck": _cost(1.5, 2.0e18, 480), "other": _cost(0.25, 7.0e17, 96, ["gone.pt"])}
    rows = {row.spec.key: row for row in analysis["rows"]}
    text = markdown(analysis, {"split": "holdout25"})
    section = text.split("## Training cost of the trained rows")[1].split("\n## ")[0]
    lines = {line.split(" | ")[0].removeprefix("| "): line for line in section.splitlines() if line.startswith("| ")}
    assert set(lines) == {"row", "---", "predictor_ck_frrp", "predictor_ck_fppp"}
    frrp = lines["predictor_ck_frrp"].split(" | ")
    assert frrp[1] == f"{rows['predictor_ck_frrp'].quality.value:.2f}"
    assert frrp[4:8] == ["1.5", "2e+18", "480", "complete |"]
    assert lines["predictor_ck_fppp"].split(" | ")[4:8] == ["≥ 0.25", "≥ 7e+17", "96", "incomplete (1 missing) |"]
    assert point_label("P", analysis["training_costs"]["other"]) == "P [train ≥ 7e+17 FLOP, ≥ 0.25 core-h]"
    assert point_label("sampler", None) == "sampler"
    from predictor_training.eval.training_cost import cost_columns, unknown_cost
    assert cost_columns(unknown_cost("w.safetensors", "no recipe")) == {
        "train core-h (demo CPU)": "?", "train FLOPs (real config)": "?", "lineage": "unknown"}
    write_leaderboard(tmp_path, analysis, {"split": "holdout25"})
    table = {row["key"]: row for row in csv.DictReader((tmp_path / "leaderboard.csv").open())}
    assert (table["predictor_ck_frrp"]["train_core_hours"], table["predictor_ck_frrp"]["train_flops_real"]) == \
        ("1.5", "2e+18")
    assert table["predictor_ck_fppp"]["train_lineage_complete"] == "0"
    assert table["sampler_2step_frrf"]["train_core_hours"] == ""
    record = json.loads((tmp_path / "leaderboard.json").read_text())
    assert record["training_costs"]["other"]["flops"] == 7.0e17
    assert {row["key"]: row["checkpoint"] for row in record["rows"]}["predictor_ck_fppp"] == "other"
