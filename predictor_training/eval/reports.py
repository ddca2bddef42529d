"""Reading per-video results back, aggregating them and writing the reports of one evaluation run.

Outputs of one evaluation run (directory `<output_root>/<run_name>`), written by rank 0 except the per-video files:

    videos/<case>__a<action>.json   one per finished video (the unit of resume; written by `run.run_evaluation`)
    side_by_side/<case>__a<action>.mp4   [ground_truth |] reference | reuse_velocity | reuse_hidden | predictor(s),
                              chosen subset, every panel scaled up (nearest neighbour) to be watchable
    revisit_sheet/<case>__a<action>.png   every row whose camera path revisits a camera (ground truth only):
                              ground truth | reference | predictor(s) [| their @mode copies] at the first visit,
                              the farthest point away and the return (`write_revisit_sheet`)
    per_video.csv, per_chunk.csv, aggregate.csv, timings.csv, aggregate.json, drift.png, table.md
    drift_ground_truth.png    with ground truth only

With ground truth the same files carry the scores against it as well: per_video.csv, per_chunk.csv and aggregate.csv
gain `gt_<metric>` columns and rows for the reference and `repeat_first_frame`, aggregate.json an
"against_ground_truth" section, table.md a second quality table. Without ground truth nothing of this appears.

With context modes other than exact (`--context_modes`), the methods `reference@M` and `predictor_<ckpt>@M` are rows
of every file like any other method (display names `reference @M`, `predictor <ckpt> @M`), the header gains
"context_modes", table.md a note under its first table, and the component timings rows for the context assembly
and the chunk caching of each such method.
"""

from __future__ import annotations

import csv
import io
import json
import math
import textwrap
from collections import defaultdict
from pathlib import Path
from typing import Sequence

import numpy as np
from PIL import Image
from torch import Tensor

from predictor_training.runtime.io import atomic_write, write_text_atomic
from predictor_training.eval.revisits import revisit_table
from predictor_training.eval.methods import REFERENCE, REUSE_HIDDEN, REUSE_VELOCITY, Method
from predictor_training.eval.runtime import GROUND_TRUTH, RESULT_FORMAT, RESULT_VERSION
from predictor_training.teacher.flops import flop_speedup_bound
from predictor_training.runtime.io import write_json_atomic
from predictor_training.video.io import label_strip, side_by_side, write_video
from predictor_training.video.metrics import LPIPS_METRIC_NAME, aggregate_videos, jsonable

# frame-mean PSNR is left out of the table: with chunk 0 F-F-F-F its identical frames make it inf (it is in the CSV)
TABLE_METRICS = ("psnr_full", "ssim", "<lpips>", "temporal_delta_mse")
DRIFT_METRICS = ("psnr_full", "ssim", "<lpips>")
GROUND_TRUTH_COLUMN_PREFIX = "gt_"  # CSV columns of the scores against the ground truth
GROUND_TRUTH_PANEL = "ground truth"
# per-method components of the component table (in this order), with their labels; the label is followed by the
# method's display name. context_*: methods of a cached context mode (frame_kv_cache.py) only.
METHOD_COMPONENTS = {
    "context_assembly": "context assembly from cached K/V",
    "context_cache": "context cache of a finished chunk",
    "predictor_step": "predictor step",
    "reuse_step": "reuse step",
}
SIDE_BY_SIDE_MIN_HEIGHT = 192  # --side_by_side_scale 0 (auto): panels scaled up to at least this many pixels high


# =============================================================================================================
# 1. Reading per-video results back
# =============================================================================================================
_NONFINITE = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}


def _restore_floats(value):
    """Inverse of `video_metrics.jsonable` inside metric records: "inf" / "-inf" / "nan" strings back to floats."""
    if isinstance(value, dict):
        return {key: _restore_floats(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_restore_floats(item) for item in value]
    if isinstance(value, str) and value in _NONFINITE:
        return _NONFINITE[value]
    return value


def read_video_result(path: Path, fingerprint: str) -> dict:
    """A finished per-video JSON, checked against this run's fingerprint; metric strings back to floats."""
    result = json.loads(path.read_text(encoding="utf-8"))
    if result.get("format") != RESULT_FORMAT or result.get("version") != RESULT_VERSION:
        raise ValueError(f"{path}: not a version-{RESULT_VERSION} eval video result (format/version fields)")
    if result.get("fingerprint") != fingerprint:
        raise ValueError(f"{path}: made with other eval settings (fingerprint {result.get('fingerprint')!r}, this run "
                         f"{fingerprint!r}); use another --output_root / --run_name, or remove that directory")
    entries = list(result["methods"].values())
    if "against_ground_truth" in result:
        entries += list(result["against_ground_truth"]["methods"].values())
    for entry in entries:
        for key in ("metrics", "per_chunk", "after_first_chunk", "per_frame"):
            if key in entry:
                entry[key] = _restore_floats(entry[key])
    return result


# =============================================================================================================
# 2. Aggregation and reports
# =============================================================================================================
def _mean_of(values: Sequence[float]) -> float:
    return float(np.mean(values))


def aggregate_results(results: Sequence[dict], method_names: Sequence[str]) -> dict:
    """Across videos, per method: mean metrics, mean per-chunk metrics, timings and FLOPs, speedups vs reference."""
    if not results:
        raise ValueError("no finished videos to aggregate")
    out: dict[str, dict] = {}
    reference_flops = sum(result["methods"][REFERENCE]["flops"]["total"] for result in results)
    reference_dit = _mean_of([result["methods"][REFERENCE]["timings"]["dit_s"] for result in results])
    reference_e2e = _mean_of([result["methods"][REFERENCE]["timings"]["end_to_end_s"] for result in results])
    num_chunks = len(results[0]["chunk_frame_ranges"])
    for name in method_names:
        entries = [result["methods"][name] for result in results]
        # 1. Timings: per-call means over every call of every video, per-video means of the totals.
        calls: dict[str, list] = defaultdict(lambda: [0, 0.0, math.inf])
        for entry in entries:
            for call, summary in entry["timings"]["calls"].items():
                calls[call][0] += summary["count"]
                calls[call][1] += summary["total_s"]
                calls[call][2] = min(calls[call][2], summary["min_s"])
        text_values = [entry["timings"]["text_prefill_s"] for entry in entries]
        timings = {
            "text_prefill_s": None if text_values[0] is None else _mean_of(text_values),
            **{key: _mean_of([entry["timings"][key] for entry in entries])
               for key in ("rollout_s", "vae_decode_s", "dit_s", "end_to_end_s")},
            "calls": {call: {"count": count, "mean_s": total / count, "min_s": fastest}
                      for call, (count, total, fastest) in calls.items()},
        }
        method_flops = sum(entry["flops"]["total"] for entry in entries)
        record = {
            "num_videos": len(entries),
            "timings": timings,
            "flops_per_video": method_flops / len(entries),
            "speedup": {
                "measured_dit": reference_dit / timings["dit_s"],
                "measured_end_to_end": reference_e2e / timings["end_to_end_s"],
                "flop_bound_dit": flop_speedup_bound(reference_flops, method_flops),
            },
        }
        # 2. Quality (not for the reference itself).
        if name != REFERENCE:
            record["metrics"] = aggregate_videos([entry["metrics"] for entry in entries])
            record["per_chunk"] = [aggregate_videos([entry["per_chunk"][chunk] for entry in entries])
                                   for chunk in range(num_chunks)]
        out[name] = record
    return out


def aggregate_ground_truth(results: Sequence[dict]) -> dict:
    """Across videos, the scores against the ground truth of every method and of `repeat_first_frame` (in the
    order of the results): {name: {"num_videos", "metrics", "per_chunk"}}, means as in `aggregate_results`."""
    if not results:
        raise ValueError("no finished videos to aggregate")
    missing = [result["key"] for result in results if "against_ground_truth" not in result]
    if missing:
        raise ValueError(f"videos {missing} have no scores against the ground truth")
    num_chunks = len(results[0]["chunk_frame_ranges"])
    out = {}
    for name in results[0]["against_ground_truth"]["methods"]:
        entries = [result["against_ground_truth"]["methods"][name] for result in results]
        out[name] = {
            "num_videos": len(entries),
            "metrics": aggregate_videos([entry["metrics"] for entry in entries]),
            "per_chunk": [aggregate_videos([entry["per_chunk"][chunk] for entry in entries])
                          for chunk in range(num_chunks)],
            "after_first_chunk": aggregate_videos([entry["after_first_chunk"] for entry in entries]),
        }
    return out


def _lpips_key(aggregate: dict) -> str:
    for record in aggregate.values():
        if "metrics" in record:
            keys = [key for key in record["metrics"] if key.startswith("lpips")]
            if len(keys) != 1:
                raise ValueError(f"expected one LPIPS key in the metrics, got {keys}")
            return keys[0]
    raise ValueError("no compared method in the aggregate")


def _metric_columns(lpips_key: str, names: Sequence[str]) -> list[str]:
    return [lpips_key if name == "<lpips>" else name for name in names]


def _fmt(value, digits: int = 4) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float) and not math.isfinite(value):
        return "inf" if value > 0 else ("-inf" if value < 0 else "nan")
    if isinstance(value, float):
        return f"{value:.{digits}f}" if abs(value) >= 1e-3 or value == 0 else f"{value:.3e}"
    return str(value)


def format_markdown_table(aggregate: dict, method_names: Sequence[str], header: dict,
                          ground_truth_aggregate: dict | None = None) -> str:
    """Quality table (method x PSNR / SSIM / LPIPS-label / temporal-delta MSE), with ground truth a second one
    against it (every method and `repeat_first_frame`; `aggregate_ground_truth`), speed table, component timings."""
    lpips_key = _lpips_key(aggregate)
    real_lpips = lpips_key == LPIPS_METRIC_NAME
    lpips_title = "LPIPS (AlexNet)" if real_lpips else f"{lpips_key} (random AlexNet, NOT LPIPS)"
    titles = {"psnr_full": "PSNR (dB)", "psnr_frame_mean": "frame-mean PSNR (dB)", "ssim": "SSIM",
              lpips_key: lpips_title, "temporal_delta_mse": "temporal-delta MSE"}
    columns = _metric_columns(lpips_key, TABLE_METRICS)
    lines = [
        f"**{header['run_name']}** - split `{header['split']}`, {header['num_videos']} videos, schedule "
        f"{header['schedule']}; every metric against the reference F-F-F-F rollout of the same seed.",
        "",
        "| method | " + " | ".join(titles[column] for column in columns) + " |",
        "| --- | " + " | ".join("---:" for _ in columns) + " |",
    ]
    display = header["display_names"]
    for name in method_names:
        if name == REFERENCE:
            continue
        metrics = aggregate[name]["metrics"]
        lines.append(f"| {display[name]} | " + " | ".join(_fmt(metrics[column]) for column in columns) + " |")
    if not real_lpips:
        lines += ["", f"`{lpips_key}`: LPIPS formula on a randomly initialised AlexNet (no real weights available); "
                      "it is NOT LPIPS and must not be compared with LPIPS numbers."]
    if header.get("context_modes"):
        others = [mode for mode in header["context_modes"] if mode != "exact"]
        lines += ["", f"`@{'` / `@'.join(others)}`: the same method with the context K/V of that context mode "
                      "(predictor_training/teacher/frame_kv_cache.py) instead of the exact per-chunk context prefill; every "
                      "metric, speedup and FLOP bound is still against the exact reference F-F-F-F."]
    if ground_truth_aggregate is not None:
        lines += [
            "",
            f"**Against the ground truth** (`{header['ground_truth']}`): every method's video, the reference "
            "F-F-F-F included, scored against the ground-truth video of its row; `repeat_first_frame` is the ground "
            "truth's first frame held for the whole video (the still-image baseline); the last two columns score "
            "only chunks 1.. (what each method made from its own history, after the image-conditioned chunk 0).",
            "",
            "| method | " + " | ".join(titles[column] for column in columns) + " | PSNR chunks 1.. (dB) | "
            "SSIM chunks 1.. |",
            "| --- | " + " | ".join("---:" for _ in columns) + " | ---: | ---: |",
        ]
        for name, record in ground_truth_aggregate.items():
            later = record["after_first_chunk"]
            lines.append(f"| {display[name]} | "
                         + " | ".join(_fmt(record["metrics"][column]) for column in columns)
                         + f" | {_fmt(later['psnr_full'])} | {_fmt(later['ssim'])} |")
    lines += ["", "| method | end-to-end s/video | DiT s/video | speedup end-to-end | speedup DiT | "
                  "FLOP bound (DiT) |", "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for name in method_names:
        timings, speed = aggregate[name]["timings"], aggregate[name]["speedup"]
        lines.append(f"| {display[name]} | {timings['end_to_end_s']:.3f} | {timings['dit_s']:.3f} | "
                     f"{speed['measured_end_to_end']:.2f}x | {speed['measured_dit']:.2f}x | "
                     f"{speed['flop_bound_dit']:.2f}x |")
    lines += ["", "| component | mean s/call | fastest s/call | calls |", "| --- | ---: | ---: | ---: |"]
    for row in component_rows(aggregate, method_names, display):
        lines.append(f"| {row[0]} | {_fmt(row[1], 5)} | {_fmt(row[2], 5)} | {row[3]} |")
    if header["legend"]:
        lines += [""] + [f"- {line}" for line in header["legend"]]
    return "\n".join(lines) + "\n"


def component_rows(aggregate: dict, method_names: Sequence[str], display: dict[str, str]
                   ) -> list[tuple[str, float | None, float | None, int]]:
    """(component, mean seconds per call, fastest call, number of calls): text prefill, context prefill, Full step,
    per method its context assembly and chunk caching (cached context modes) and Predictor / reuse step (per call),
    VAE decode (per video); the shared components from the reference rollouts. The fastest call is the least
    disturbed figure on a shared machine. display: method -> label."""
    reference = aggregate[REFERENCE]
    num_videos = reference["num_videos"]
    calls = reference["timings"]["calls"]
    rows = [("text prefill", reference["timings"]["text_prefill_s"], None, num_videos)]
    for call, label in (("context_prefill", "context prefill"), ("full_step", "full step (Teacher)")):
        if call in calls:
            rows.append((label, calls[call]["mean_s"], calls[call]["min_s"], calls[call]["count"]))
    for name in method_names:
        for call, label in METHOD_COMPONENTS.items():
            if call in aggregate[name]["timings"]["calls"]:
                summary = aggregate[name]["timings"]["calls"][call]
                rows.append((f"{label} ({display[name]})", summary["mean_s"], summary["min_s"], summary["count"]))
    rows.append(("VAE decode (per video)", reference["timings"]["vae_decode_s"], None, num_videos))
    return rows


def _csv_text(header: Sequence[str], rows: Sequence[Sequence]) -> str:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(header)
    writer.writerows([[_fmt(value, 8) if isinstance(value, float) else value for value in row] for row in rows])
    return buffer.getvalue()


def _values(record: dict | None, columns: Sequence[str]) -> list:
    """record[column] for each column; Nones (empty CSV cells) without a record."""
    return [None] * len(columns) if record is None else [record[column] for column in columns]


def write_reports(out_dir: Path, results: Sequence[dict], aggregate: dict, method_names: Sequence[str],
                  header: dict, ground_truth_aggregate: dict | None = None,
                  revisits_aggregate: dict | None = None) -> dict[str, Path]:
    """CSV files, aggregate.json, drift.png and table.md (each atomically). Returns {name: path}.

    ground_truth_aggregate (`aggregate_ground_truth`, with ground truth only): the CSV files gain `gt_<metric>`
    columns and rows for the reference and `repeat_first_frame` (their against-reference cells empty),
    aggregate.json an "against_ground_truth" section, table.md a second quality table, and drift_ground_truth.png
    is drawn. revisits_aggregate (`revisits.aggregate_revisits`, when ground-truth poses revisit cameras):
    aggregate.json gains a "revisits" section and table.md the memory table."""
    compared = [name for name in method_names if name != REFERENCE]
    lpips_key = _lpips_key(aggregate)
    method_labels = {name: name for name in method_names}  # the CSV files keep the full method keys
    with_truth = ground_truth_aggregate is not None
    row_names = list(ground_truth_aggregate) if with_truth else compared  # CSV rows of the per-video / chunk files

    def against_truth(result: dict, name: str) -> dict:
        return result["against_ground_truth"]["methods"][name]

    written = {}
    # 1. per video: one row per (video, method)
    video_columns = list(results[0]["methods"][compared[0]]["metrics"])
    truth_columns = [GROUND_TRUTH_COLUMN_PREFIX + key for key in video_columns] if with_truth else []
    rows = []
    for result in results:
        for name in row_names:
            entry = result["methods"].get(name)  # None for repeat_first_frame (no rollout)
            row = [result["key"], name] + _values(entry["metrics"] if name in compared else None, video_columns)
            row.append(None if entry is None else entry["timings"]["end_to_end_s"])
            if with_truth:
                row += _values(against_truth(result, name)["metrics"], video_columns)
            rows.append(row)
    written["per_video.csv"] = out_dir / "per_video.csv"
    write_text_atomic(written["per_video.csv"],
                      _csv_text(["video", "method"] + video_columns + ["end_to_end_s"] + truth_columns, rows))
    # 2. per chunk: every video and the mean
    chunk_columns = list(results[0]["methods"][compared[0]]["per_chunk"][0])
    truth_columns = [GROUND_TRUTH_COLUMN_PREFIX + key for key in chunk_columns] if with_truth else []
    rows = []
    for name in row_names:
        for chunk in range(len(results[0]["chunk_frame_ranges"])):
            for result in results:
                chunk_scores = result["methods"][name]["per_chunk"][chunk] if name in compared else None
                row = [result["key"], name, chunk] + _values(chunk_scores, chunk_columns)
                if with_truth:
                    row += _values(against_truth(result, name)["per_chunk"][chunk], chunk_columns)
                rows.append(row)
            mean = aggregate[name]["per_chunk"][chunk] if name in compared else None
            row = ["MEAN", name, chunk] + _values(mean, chunk_columns)
            if with_truth:
                row += _values(ground_truth_aggregate[name]["per_chunk"][chunk], chunk_columns)
            rows.append(row)
    written["per_chunk.csv"] = out_dir / "per_chunk.csv"
    write_text_atomic(written["per_chunk.csv"],
                      _csv_text(["video", "method", "chunk"] + chunk_columns + truth_columns, rows))
    # 3. aggregate: one row per method (+ repeat_first_frame with ground truth)
    columns = list(aggregate[compared[0]]["metrics"])
    truth_columns = [GROUND_TRUTH_COLUMN_PREFIX + key for key in columns] if with_truth else []
    speed_columns = ["end_to_end_s", "dit_s", "speedup_end_to_end", "speedup_dit", "flop_bound_dit",
                     "flops_per_video"]
    rows = []
    for name in method_names:
        record = aggregate[name]
        metrics = [record["metrics"][key] if "metrics" in record else None for key in columns]
        speed = record["speedup"]
        row = [name] + metrics + [record["timings"]["end_to_end_s"], record["timings"]["dit_s"],
                                  speed["measured_end_to_end"], speed["measured_dit"], speed["flop_bound_dit"],
                                  record["flops_per_video"]]
        if with_truth:
            row += _values(ground_truth_aggregate[name]["metrics"], columns)
        rows.append(row)
    if with_truth:
        for name in ground_truth_aggregate:
            if name not in aggregate:  # repeat_first_frame: scored against the ground truth only
                rows.append([name] + [None] * (len(columns) + len(speed_columns))
                            + _values(ground_truth_aggregate[name]["metrics"], columns))
    written["aggregate.csv"] = out_dir / "aggregate.csv"
    write_text_atomic(written["aggregate.csv"], _csv_text(["method"] + columns + speed_columns + truth_columns, rows))
    # 4. timings per component
    written["timings.csv"] = out_dir / "timings.csv"
    write_text_atomic(written["timings.csv"],
                      _csv_text(["component", "mean_s_per_call", "fastest_s_per_call", "calls"],
                                component_rows(aggregate, method_names, method_labels)))
    # 5. JSON, drift plot, markdown table
    written["aggregate.json"] = out_dir / "aggregate.json"
    payload = {"header": header, "methods": aggregate}
    if with_truth:
        payload["against_ground_truth"] = ground_truth_aggregate
    if revisits_aggregate is not None:
        payload["revisits"] = revisits_aggregate
    write_json_atomic(written["aggregate.json"], jsonable(payload))
    written["drift.png"] = out_dir / "drift.png"
    plot_drift(written["drift.png"], aggregate, compared, lpips_key, header)
    if with_truth:
        written["drift_ground_truth.png"] = out_dir / "drift_ground_truth.png"
        plot_drift(written["drift_ground_truth.png"], ground_truth_aggregate, list(ground_truth_aggregate),
                   lpips_key, header, against="the ground truth")
    written["table.md"] = out_dir / "table.md"
    table = format_markdown_table(aggregate, method_names, header, ground_truth_aggregate)
    if revisits_aggregate is not None:
        table += revisit_table(revisits_aggregate, header["display_names"])
    write_text_atomic(written["table.md"], table)
    return written


def plot_drift(path: Path, aggregate: dict, method_names: Sequence[str], lpips_key: str, header: dict,
               against: str | None = None) -> None:
    """Mean metric per chunk index (drift), one line per method; infinite PSNR (identical chunk) is left out.
    against: what the metrics compare with, named in the title (None: the reference, unnamed as it always was)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = _metric_columns(lpips_key, DRIFT_METRICS)
    figure, axes = plt.subplots(1, len(metrics), figsize=(5 * len(metrics), 4), squeeze=False)
    identical_note = False
    for axis, metric in zip(axes[0], metrics):
        for name in method_names:
            values = np.array([chunk[metric] for chunk in aggregate[name]["per_chunk"]], dtype=float)
            identical_note |= bool(np.isinf(values).any())
            values[~np.isfinite(values)] = np.nan
            axis.plot(range(len(values)), values, marker="o", label=header["display_names"][name])
        not_lpips = metric == lpips_key and lpips_key != LPIPS_METRIC_NAME
        axis.set_xlabel("chunk index")
        axis.set_ylabel("random-AlexNet LPIPS (NOT LPIPS)" if not_lpips else metric)
        axis.set_title(metric)
        axis.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    note = (f" (chunks identical to {against or 'the reference'}, PSNR = inf, are not drawn)" if identical_note
            else "")
    against_text = "" if against is None else f" against {against}"
    title = (f"{header['run_name']}: drift vs chunk{against_text}, {header['split']}, {header['num_videos']} "
             f"videos{note}")
    lines = textwrap.wrap(title, width=40 * len(metrics), break_on_hyphens=False)
    figure.suptitle("\n".join(lines), fontsize=9)
    figure.tight_layout(rect=(0, 0, 1, 1 - 0.04 * len(lines)))

    def save(tmp: Path) -> None:
        figure.savefig(tmp, format="png", dpi=100)

    try:
        atomic_write(path, save)
    finally:
        plt.close(figure)


# =============================================================================================================
# 3. Side-by-side videos
# =============================================================================================================
def side_by_side_scale_for(height: int, requested: int = 0) -> int:
    """The integer factor the side-by-side panels are scaled up by: `requested` when > 0 (--side_by_side_scale),
    else (0 = auto) the smallest one that makes a panel of `height` pixels at least SIDE_BY_SIDE_MIN_HEIGHT high,
    at least 1."""
    if requested > 0:
        return requested
    return max(1, math.ceil(SIDE_BY_SIDE_MIN_HEIGHT / height))


def upscale_nearest(frames: np.ndarray, factor: int) -> np.ndarray:
    """Nearest-neighbour upscaling: uint8 [F, H, W, 3] -> [F, H * factor, W * factor, 3] (each pixel a block)."""
    if factor == 1:
        return frames
    return frames.repeat(factor, axis=1).repeat(factor, axis=2)


def label_height_for(panel_width: int) -> int:
    """Pixel height of the labels above panels this wide (larger text once a panel is 256 pixels wide)."""
    return 24 if panel_width >= 256 else 14


def write_side_by_side(out_dir: Path, key: str, frames: dict[str, Tensor], methods: Sequence[Method],
                       fps: float, scale: int = 0) -> str:
    """[ground truth |] reference | reuse v | reuse h | P <ckpt>... as one mp4; returns its path relative to out_dir.

    frames: {method name: uint8 [F, H, W, 3]}, plus the ground truth's under GROUND_TRUTH when there is one (it then
    comes first). Every panel is scaled up by nearest neighbour by `side_by_side_scale_for(H, scale)`."""
    names = ([GROUND_TRUTH] if GROUND_TRUTH in frames else []) + [method.name for method in methods]
    labels = ([GROUND_TRUTH_PANEL] if GROUND_TRUTH in frames else []) + [method.panel for method in methods]
    factor = side_by_side_scale_for(int(frames[methods[0].name].shape[1]), scale)
    panels = [upscale_nearest(frames[name].numpy(), factor) for name in names]
    video = side_by_side(panels, labels, label_height=label_height_for(panels[0].shape[2]))
    relative = f"side_by_side/{key}.mp4"
    write_video(out_dir / relative, video, fps)
    return relative


def revisit_sheet_frames(pairs: dict[int, int]) -> list[tuple[str, int]]:
    """[(label, frame)] of the sheet's three rows for `pairs` ({revisiting frame: first-visit frame}): the pair with
    the longest time away, its first visit, the frame halfway between (the farthest point of the demo world's
    turn-away and back-up paths) and the return."""
    frame, first = max(pairs.items(), key=lambda pair: (pair[0] - pair[1], pair[0]))
    away = (first + frame) // 2
    return [(f"first visit (frame {first})", first), (f"away (frame {away})", away), (f"return (frame {frame})", frame)]


def write_revisit_sheet(out_dir: Path, key: str, frames: dict[str, Tensor], methods: Sequence[Method],
                        pairs: dict[int, int], scale: int = 0) -> str:
    """One PNG of how each method renders a camera it comes back to; returns its path relative to out_dir.

    Columns: ground truth | every method but the reuse baselines (reference, predictors, their context-mode copies);
    rows: `revisit_sheet_frames(pairs)`, each under its label. frames: {name: uint8 [F, H, W, 3]} with the ground
    truth under GROUND_TRUTH. Panels are scaled up as the side-by-side videos'."""
    shown = [method for method in methods if method.name not in (REUSE_VELOCITY, REUSE_HIDDEN)]
    names = [GROUND_TRUTH] + [method.name for method in shown]
    labels = [GROUND_TRUTH_PANEL] + [method.panel for method in shown]
    rows = revisit_sheet_frames(pairs)
    picks = [frame for _, frame in rows]
    factor = side_by_side_scale_for(int(frames[GROUND_TRUTH].shape[1]), scale)
    panels = [upscale_nearest(frames[name][picks].numpy(), factor) for name in names]
    label_height = label_height_for(panels[0].shape[2])
    grid = side_by_side(panels, labels, label_height=label_height)  # [3, label + H, W_all, 3]
    width = grid.shape[2]
    image = np.concatenate([np.concatenate([label_strip(label, width, label_height), grid[index]], axis=0)
                            for index, (label, _) in enumerate(rows)], axis=0)
    relative = f"revisit_sheet/{key}.png"
    path = out_dir / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda tmp: Image.fromarray(image).save(tmp, format="PNG"))
    return relative
