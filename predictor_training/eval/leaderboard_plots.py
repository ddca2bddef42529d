"""The leaderboard's Pareto plots: quality against speedup on one cost axis, every row with its interval, the
baselines' front as a line, the trained rows' points labelled with their training cost."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from predictor_training.eval.front import FrontRow, front_curve
from predictor_training.eval.leaderboard import PREDICTOR_FAMILY, trained_source
from predictor_training.eval.leaderboard_analysis import COST_AXES
from predictor_training.eval.methods import REFERENCE
from predictor_training.eval.training_cost import cost_columns


def label_points(ax, points: list[tuple[str, float, float]]) -> None:
    """Name each (label, x, y) point beside it: labels of the right half point left, so the plot's edge does not
    cut them, and a label that would cover an already-labelled point (within 3 % of the y range, and within the
    label's own width along x, estimated from its length) moves one line down per such point, so rows at one cost
    or a long Predictor label beside a mixture do not print over each other."""
    if not points:
        return
    xs = [x for _, x, _ in points]
    ys = [y for _, _, y in points]
    x_mid = (min(xs) + max(xs)) / 2
    x_span = max(max(xs) - min(xs), 1e-9)
    y_near = 0.03 * max(max(ys) - min(ys), 1e-9)
    placed: list[tuple[float, float]] = []
    for label, x, y in sorted(points, key=lambda point: -point[2]):
        right = x > x_mid
        width = 0.02 * x_span + 0.0045 * 1.15 * x_span * len(label)  # fontsize 6 on a 9-inch figure
        low, high = (x - width, x) if right else (x, x + width)
        crowd = sum(low - 0.02 * x_span <= px <= high + 0.02 * x_span and abs(y - py) < y_near for px, py in placed)
        placed.append((x, y))
        ax.annotate(label, (x, y), fontsize=6, xytext=(-4 if right else 3, 2 - 8 * crowd),
                    textcoords="offset points", ha="right" if right else "left")


def point_label(panel: str, cost: dict | None) -> str:
    """A plot point's name: a trained row's carries its training cost (real-config FLOPs, demo core-hours)."""
    if cost is None:
        return panel
    cells = cost_columns(cost)
    return (f"{panel} [train {cells['train FLOPs (real config)']} FLOP, "
            f"{cells['train core-h (demo CPU)']} core-h]")


def plot_pareto(path: Path, analysis: dict, axis: str, title: str) -> None:
    """Quality vs speedup on one cost axis: every row with its interval bar, the baselines' front (mixtures in MSE)
    as a line, the Predictors highlighted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [row for row in analysis["rows"] if row.spec.key != REFERENCE]
    weights = analysis["weights"]
    baselines = [FrontRow(row.spec.key, row.costs[axis], row.psnr) for row in analysis["rows"] if row.spec.baseline]
    speedups = [row.speedup(axis) for row in rows]
    grid = np.linspace(1.0 / max(speedups) * 0.999, 1.0, 200)
    curve = front_curve(grid, baselines, weights)
    finite = np.isfinite(curve)
    colours = {"sampler": "tab:blue", "cache": "tab:green", "mixture": "tab:cyan", "reference": "tab:gray",
               "student": "tab:purple", PREDICTOR_FAMILY: "tab:red"}
    fig, ax = plt.subplots(figsize=(9, 6))
    ax.plot(1.0 / grid[finite], curve[finite], color="black", lw=1, label="front of the baselines")
    for family, colour in colours.items():
        members = [row for row in rows if row.spec.family == family]
        if not members:
            continue
        x = [row.speedup(axis) for row in members]
        y = [row.quality.value for row in members]
        err = [[row.quality.value - row.quality.low for row in members],
               [row.quality.high - row.quality.value for row in members]]
        ax.errorbar(x, y, yerr=err, fmt="o" if family != PREDICTOR_FAMILY else "*", ms=5 if family !=
                    PREDICTOR_FAMILY else 11, color=colour, capsize=2, lw=0.8, label=family)
    costs = analysis.get("training_costs") or {}
    label_points(ax, [(point_label(row.spec.panel, costs.get(trained_source(row.spec))), row.speedup(axis),
                       row.quality.value) for row in rows])
    ax.set_xlabel(f"speedup over F-F-F-F ({COST_AXES[axis]})")
    ax.set_ylabel("PSNR vs F-F-F-F (dB), 95 % interval")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=130)
    plt.close(fig)
    tmp.replace(path)
