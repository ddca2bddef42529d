"""Memory figures: how a method renders a camera it has seen before (the frames the pose JSON says revisit one).

For every revisiting frame f whose camera is that of an earlier frame f0 (`world.revisits.revisit_frames` of the
row's pose file), per method and for the ground truth itself:

    self_psnr                  PSNR(frame f, the same method's frame f0): does the view come back? (the truth:
                               ~55 dB, only render noise; a model without memory: as far as any other view)
    first_visit_psnr_vs_truth  PSNR(frame f0, truth f0)
    return_psnr_vs_truth       PSNR(frame f, truth f)
    return_minus_first_visit   their difference (0: the return is as good as the first visit)

each the mean over the video's revisiting frames; `aggregate_revisits` averages them over the videos that have
revisits. PSNR on uint8 frames in [0, 1], as the eval's other metrics, capped at 100 dB (identical frames).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
from torch import Tensor

from predictor_training.video.metrics import psnr_from_mse

PSNR_CAP_DB = 100.0
FIGURES = ("self_psnr", "first_visit_psnr_vs_truth", "return_psnr_vs_truth", "return_minus_first_visit")


def frame_psnr(a: Tensor, b: Tensor) -> float:
    """PSNR (dB) of two uint8 frames [H, W, 3], at most PSNR_CAP_DB."""
    mse = ((a.double() - b.double()) / 255.0).pow(2).mean()
    return min(float(psnr_from_mse(mse)), PSNR_CAP_DB)


def revisit_scores(frames: Mapping[str, Tensor], truth: Tensor, pairs: Mapping[int, int]) -> dict:
    """{"pairs": [[f, f0], ...], "methods": {name: {figure: value}}} for every video in `frames` (uint8
    [F, H, W, 3]) and the truth (under "ground_truth"); `pairs`: {revisiting frame: first-visit frame}."""
    pairs = {frame: first for frame, first in pairs.items() if frame < truth.shape[0]}
    out = {}
    for name, video in {**frames, "ground_truth": truth}.items():
        first = [frame_psnr(video[f0], truth[f0]) for f0 in pairs.values()]
        back = [frame_psnr(video[f], truth[f]) for f in pairs]
        out[name] = {
            "self_psnr": float(np.mean([frame_psnr(video[f], video[f0]) for f, f0 in pairs.items()])),
            "first_visit_psnr_vs_truth": float(np.mean(first)),
            "return_psnr_vs_truth": float(np.mean(back)),
            "return_minus_first_visit": float(np.mean(back) - np.mean(first)),
        }
    return {"pairs": [[frame, first] for frame, first in pairs.items()], "methods": out}


def aggregate_revisits(results: Sequence[dict]) -> dict | None:
    """Mean of each method's figures over the videos with revisits: {"num_videos", "num_pairs", "methods"}; None
    when no video has any."""
    scored = [result["revisits"] for result in results if result.get("revisits")]
    if not scored:
        return None
    methods = {}
    for name in scored[0]["methods"]:
        methods[name] = {figure: float(np.mean([entry["methods"][name][figure] for entry in scored]))
                         for figure in FIGURES}
    return {"num_videos": len(scored), "num_pairs": sum(len(entry["pairs"]) for entry in scored),
            "methods": methods}


def revisit_table(aggregate: dict, display_names: Mapping[str, str]) -> str:
    """Markdown section of the memory figures."""
    lines = [f"\n### Memory: frames whose camera was seen before ({aggregate['num_pairs']} frames in "
             f"{aggregate['num_videos']} videos)\n",
             "| method | self PSNR (return vs own first visit) | first visit vs truth | return vs truth | "
             "return - first visit |",
             "| --- | ---: | ---: | ---: | ---: |"]
    for name, figures in aggregate["methods"].items():
        lines.append(f"| {display_names.get(name, name)} | " + " | ".join(f"{figures[key]:.2f}" for key in FIGURES)
                     + " |")
    return "\n".join(lines) + "\n"


