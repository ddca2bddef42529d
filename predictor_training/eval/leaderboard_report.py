"""The leaderboard's reports: leaderboard.md (the headline, the cost and quality table, the Predictors' margins over
the front, ground truth and revisits, the trained rows' training cost, the TeaCache rows' targets), leaderboard.csv,
leaderboard.json and the Pareto plots (eval/leaderboard_plots.py)."""

from __future__ import annotations

import csv
import io
import math
from pathlib import Path
from typing import Sequence

from predictor_training.eval.leaderboard import DEFAULT_BASELINE, PREDICTOR_FAMILY, trained_source
from predictor_training.eval.leaderboard_analysis import (
    COST_AXES,
    MARGIN_AXES,
    MEASURED_SPREAD_PARTS,
    MEASURED_SPREAD_PREFIX,
    RowResult,
)
from predictor_training.eval.leaderboard_plots import plot_pareto
from predictor_training.eval.methods import REFERENCE
from predictor_training.eval.training_cost import cost_columns
from predictor_training.runtime.io import write_json_atomic, write_text_atomic
from predictor_training.video.metrics import jsonable

TEACACHE_TOLERANCE = 0.1  # Full steps per chunk: a TeaCache row within this of its target reached it


def _fmt(value, digits: int = 2, suffix: str = "") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    if isinstance(value, float) and math.isinf(value):
        return "∞"
    return f"{value:.{digits}f}{suffix}"


def row_record(row: RowResult) -> dict:
    return {"key": row.spec.key, "family": row.spec.family, "plan": row.spec.plan, "display": row.spec.display,
            "checkpoint": row.spec.checkpoint, "student": row.spec.student, "context_mode": row.spec.context_mode, "adaptive": row.spec.adaptive,
            "blocks": row.spec.blocks, "speedup": {axis: 1.0 / cost for axis, cost in row.costs.items()},
            "psnr_vs_reference": row.quality.to_dict(), "figures": row.figures,
            "vs_baseline": None if row.vs_baseline is None else row.vs_baseline.to_dict(),
            "margin_over_front": {axis: {**estimate.to_dict(), "front": front}
                                  for axis, (estimate, front) in row.margins.items()},
            "on_front_flops_real": row.on_front}


def training_cost_section(analysis: dict) -> list[str]:
    """The markdown section that puts each trained row's training cost beside its quality and inference cost
    (`analysis["training_costs"]`: {trained label: eval/training_cost.py's `training_cost`}); empty without any."""
    costs = analysis.get("training_costs") or {}
    rows = [row for row in analysis["rows"] if trained_source(row.spec) in costs]
    if not rows:
        return []
    lines = ["", "## Training cost of the trained rows", "",
             "What each trained row cost to train, over its lineage (docs/leaderboard.md § Training cost): CPU "
             "core-hours measured on the machine that trained it, and the FLOPs its optimizer steps take at the real "
             "config; ≥ marks a lower bound (a parent run not on this machine), ? a cost not known.", "",
             "| row | PSNR | Full steps/chunk | speedup FLOP real (projection) | train core-h (demo CPU) | "
             "train FLOPs (real config) | optimizer steps | lineage |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for row in rows:
        cost = costs[trained_source(row.spec)]
        cells = cost_columns(cost)
        lines.append(f"| {row.spec.display} | {row.quality.value:.2f} | "
                     f"{_fmt(row.figures.get('full_steps_per_chunk'))} | {row.speedup('flops_real'):.3f}x | "
                     f"{cells['train core-h (demo CPU)']} | {cells['train FLOPs (real config)']} | {cost['steps']} | "
                     f"{cells['lineage']} |")
    return lines


def extra_teacher_steps(rows: Sequence[RowResult], axis: str = "flops_run") -> dict[str, float]:
    """{row key: its cost above the 1-step sampler's, in Full Teacher steps per chunk} on `axis`: one Full step per
    chunk costs what a 2-step sampler costs more than the 1-step sampler (their plans differ by exactly one Full
    step in every scheduled chunk). Empty when the 1-step or no 2-step sampler is a row."""
    by_key = {row.spec.key: row for row in rows}
    one = by_key.get(DEFAULT_BASELINE)
    two = next((row for row in rows if row.spec.family == "sampler" and row.spec.key.startswith("sampler_2step_")),
               None)
    if one is None or two is None:
        return {}
    step = two.costs[axis] - one.costs[axis]
    return {row.spec.key: (row.costs[axis] - one.costs[axis]) / step for row in rows}


def headline_lines(analysis: dict) -> list[str]:
    """One line per trained row (Predictors, students): what it buys over the 1-step sampler and for how many more
    Teacher steps per chunk, its margin over the baselines' front on the FLOP axis of the config that ran, and its
    quality against F-F-F-F and the ground truth, temporal jitter and revisits beside."""
    rows: list[RowResult] = analysis["rows"]
    extra = extra_teacher_steps(rows)
    lines = []
    for row in rows:
        if row.spec.family not in (PREDICTOR_FAMILY, "student"):
            continue
        figures = row.figures
        parts = [f"**{row.spec.display}**: PSNR vs F-F-F-F {row.quality.value:.2f} dB "
                 f"[{row.quality.low:.2f}, {row.quality.high:.2f}]"]
        if row.vs_baseline is not None and analysis["baseline"] == DEFAULT_BASELINE:
            parts.append(f"{row.vs_baseline.format()} dB over the 1-step sampler")
        if row.spec.key in extra:
            parts.append(f"for {extra[row.spec.key]:+.2f} Teacher steps per chunk (FLOPs of the config that ran)")
        if "flops_run" in row.margins:
            margin, front = row.margins["flops_run"]
            parts.append(f"margin over the baselines' front {margin.format()} dB (front there: {front})")
        parts.append(f"GT PSNR / SSIM (chunks 1..) {_fmt(figures.get('gt_psnr_after_first_chunk'))} / "
                     f"{_fmt(figures.get('gt_ssim_after_first_chunk'), 3)}")
        parts.append(f"temporal-Δ MSE {_fmt(figures.get('temporal_delta_mse'), 5)}")
        parts.append(f"revisit self-PSNR {_fmt(figures.get('revisit_self_psnr'))}")
        lines.append("- " + "; ".join(parts))
    return lines


def speedup_cell(row: RowResult, axis: str) -> str:
    """'1.64×'; on the measured DiT axis with the interquartile range of the per-video speedups: '1.73× [1.65, 1.80]'
    (what to quote on a shared machine, docs/leaderboard.md § Measured speed)."""
    text = f"{row.speedup(axis):.2f}×"
    low, high = (row.figures.get(f"{MEASURED_SPREAD_PREFIX}{part}") for part in ("q25", "q75"))
    if axis != "measured_dit" or low is None or high is None:
        return text
    return f"{text} [{low:.2f}, {high:.2f}]"


def teacache_notes(rows: Sequence[RowResult]) -> list[str]:
    """Markdown lines on the TeaCache rows: each one's target, its threshold, the Full steps per chunk it reached on
    the calibration videos and the ones it ran here, and whether it reached its target (within
    TEACACHE_TOLERANCE); nothing without such rows."""
    adaptive = [row for row in rows if row.spec.adaptive is not None and row.spec.adaptive.get("threshold") is not None]
    if not adaptive:
        return []
    lines = ["", "## TeaCache: the targets and what ran", "",
             "A fixed threshold reaches a count between two whole numbers of Full steps only through the chunk-to-chunk "
             "spread of the accumulated distance, so a fractional target may land elsewhere on another split "
             "(docs/leaderboard.md § TeaCache's targets).", "",
             "| row | target | threshold | on the calibration videos | here | reached |",
             "| --- | ---: | ---: | ---: | ---: | --- |"]
    for row in adaptive:
        setting = row.spec.adaptive
        target, here = setting["target_full_steps"], row.figures.get("full_steps_per_chunk")
        calibration = setting.get("calibration_full_steps")
        reached = here is not None and abs(here - target) <= TEACACHE_TOLERANCE
        lines.append(f"| {row.spec.display} | {target:g} | {setting['threshold']:.4g} | {_fmt(calibration)} | "
                     f"{_fmt(here)} | {'yes' if reached else f'no: ran {here - target:+.2f} from its target'} |")
    return lines


def markdown(analysis: dict, header: dict) -> str:
    rows: list[RowResult] = analysis["rows"]
    baseline = analysis["baseline"]
    unit = analysis.get("bootstrap_unit", "video")
    lines = [f"# Leaderboard: {header['split']} ({analysis['num_videos']} videos, {analysis['num_units']} units "
             f"of video x seed, {analysis.get('num_clusters', analysis['num_videos'])} {unit}s)", ""]
    lines += [f"- {key}: {value}" for key, value in header.items() if key not in ("split",)]
    headline = headline_lines(analysis)
    if headline:
        lines += ["", "## Headline (the FLOP axis of the config that ran; the real-config axis is a projection)", "",
                  *headline]
    lines += ["", "Quality is PSNR against F-F-F-F of the same seed (dB; mean over videos, every video counting "
              f"once; bracket: paired bootstrap 95 % interval resampling {unit}s, a {unit}'s "
              f"videos and seeds together, {analysis['resamples']} resamples). Speedups: FLOP bound on the config "
              "that ran / at the real 8.6B config (a projection: the demo's quality at the real model's per-step "
              "costs, not a measurement of the real model) / measured DiT [interquartile range of the per-video "
              "speedups] / measured end-to-end. ★: on the quality-cost front of all rows on the real-config FLOP "
              "axis. Δ: difference from "
              f"`{baseline}` (paired; **bold** where the interval excludes 0).", "",
              "## Cost and quality against F-F-F-F", "",
              "| row | plan | Full steps/chunk | speedup FLOP run | FLOP real (projection) | measured DiT | e2e | "
              "PSNR [95 % CI] | "
              f"Δ vs {baseline} | SSIM | LPIPS | last chunk PSNR | temporal-Δ MSE | |",
              "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for row in rows:
        quality = "∞" if row.spec.key == REFERENCE else (
            f"{row.quality.value:.2f} [{row.quality.low:.2f}, {row.quality.high:.2f}]")
        delta = "–" if row.vs_baseline is None else row.vs_baseline.format()
        if row.vs_baseline is not None and row.vs_baseline.excludes_zero:
            delta = f"**{delta}**"
        figures = row.figures
        lines.append(
            f"| {row.spec.display} | {row.spec.plan} | {_fmt(figures.get('full_steps_per_chunk'))} | "
            + " | ".join(speedup_cell(row, axis) for axis in COST_AXES)
            + f" | {quality} | {delta} | {_fmt(figures.get('ssim'), 3)} | {_fmt(figures.get('lpips'), 3)} | "
            f"{_fmt(figures.get('last_chunk_psnr'))} | {_fmt(figures.get('temporal_delta_mse'), 5)} | "
            f"{'★' if row.on_front else ''} |")
    predictors = [row for row in rows if not row.spec.baseline]
    if predictors:
        lines += ["", "## Predictors against the front of the baselines (samplers, caches, students)", "",
                  "Margin = the row's PSNR minus the best the baselines reach at the same cost (a measured row, or a "
                  "per-chunk time-sharing of a cheaper and a dearer one, interpolated in MSE); negative: dominated. "
                  "**Bold** where the interval excludes 0.", "",
                  "| row | margin, FLOP run axis | front there | margin, real-config FLOP axis (projection) | "
                  "front there | margin, measured DiT axis |",
                  "| --- | ---: | --- | ---: | --- | ---: |"]
        for row in predictors:
            cells = []
            for axis in MARGIN_AXES:
                estimate, front = row.margins[axis]
                text = estimate.format()
                cells.append(f"**{text}**" if estimate.excludes_zero else text)
                if axis != "measured_dit":
                    cells.append(front)
            lines.append(f"| {row.spec.display} | " + " | ".join(cells) + " |")
    if any("gt_psnr_after_first_chunk" in row.figures for row in rows) or any(
            row.figures.get("revisit_self_psnr") is not None for row in rows):
        lines += ["", "## Against the ground truth (chunks 1..) and at revisited cameras", "",
                  "| row | GT PSNR | GT SSIM | revisit self-PSNR | return − first visit |",
                  "| --- | ---: | ---: | ---: | ---: |"]
        for row in rows:
            figures = row.figures
            lines.append(f"| {row.spec.display} | {_fmt(figures.get('gt_psnr_after_first_chunk'))} | "
                         f"{_fmt(figures.get('gt_ssim_after_first_chunk'), 3)} | "
                         f"{_fmt(figures.get('revisit_self_psnr'))} | "
                         f"{_fmt(figures.get('revisit_return_minus_first_visit'))} |")
    lines += training_cost_section(analysis)
    lines += teacache_notes(rows)
    return "\n".join(lines) + "\n"


CSV_FIELDS = ("key", "family", "plan", "checkpoint", "context_mode", "full_steps_per_chunk",
              *(f"speedup_{axis}" for axis in COST_AXES), "psnr", "psnr_low", "psnr_high", "delta_vs_baseline",
              "delta_low", "delta_high", *(f"margin_{axis}{part}" for axis in MARGIN_AXES
                                           for part in ("", "_low", "_high")),
              "ssim", "lpips", "last_chunk_psnr", "temporal_delta_mse", "gt_psnr_after_first_chunk",
              "gt_ssim_after_first_chunk", "revisit_self_psnr", "revisit_return_minus_first_visit", "on_front",
              "train_core_hours", "train_flops_real", "train_lineage_complete",
              *(f"{MEASURED_SPREAD_PREFIX}{part}" for part in MEASURED_SPREAD_PARTS))


def csv_text(analysis: dict) -> str:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=CSV_FIELDS, lineterminator="\n")
    writer.writeheader()
    for row in analysis["rows"]:
        record = {"key": row.spec.key, "family": row.spec.family, "plan": row.spec.plan,
                  "checkpoint": row.spec.checkpoint or "", "context_mode": row.spec.context_mode,
                  "psnr": row.quality.value, "psnr_low": row.quality.low, "psnr_high": row.quality.high,
                  "on_front": int(row.on_front)}
        record.update({f"speedup_{axis}": row.speedup(axis) for axis in COST_AXES})
        if row.vs_baseline is not None:
            record.update(delta_vs_baseline=row.vs_baseline.value, delta_low=row.vs_baseline.low,
                          delta_high=row.vs_baseline.high)
        for axis, (estimate, _) in row.margins.items():
            record.update({f"margin_{axis}": estimate.value, f"margin_{axis}_low": estimate.low,
                           f"margin_{axis}_high": estimate.high})
        record.update({key: value for key, value in row.figures.items() if key in CSV_FIELDS})
        cost = (analysis.get("training_costs") or {}).get(trained_source(row.spec))
        if cost is not None:
            record.update(train_core_hours=cost["core_hours"], train_flops_real=cost["flops"],
                          train_lineage_complete=int(cost["lineage_complete"]))
        writer.writerow(record)
    return buffer.getvalue()


def write_leaderboard(out_dir: Path, analysis: dict, header: dict) -> list[str]:
    """leaderboard.md / .csv / .json and pareto_<axis>.png (flops_run, flops_real, measured_dit)."""
    out_dir = Path(out_dir)
    write_text_atomic(out_dir / "leaderboard.md", markdown(analysis, header))
    write_text_atomic(out_dir / "leaderboard.csv", csv_text(analysis))
    write_json_atomic(out_dir / "leaderboard.json", jsonable({
        "header": header, "num_videos": analysis["num_videos"], "num_units": analysis["num_units"],
        "baseline": analysis["baseline"], "resamples": analysis["resamples"],
        "rows": [row_record(row) for row in analysis["rows"]],
        "training_costs": analysis.get("training_costs") or {}}))
    written = ["leaderboard.md", "leaderboard.csv", "leaderboard.json"]
    for axis in MARGIN_AXES:
        name = f"pareto_{axis}.png"
        plot_pareto(out_dir / name, analysis, axis, f"{header['split']}: {COST_AXES[axis]} "
                    f"({analysis['num_videos']} videos)")
        written.append(name)
    return written
