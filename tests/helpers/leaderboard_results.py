"""Hand-made per-unit eval results for the leaderboard's analysis and reports (tests/eval/test_leaderboard_analysis.py,
tests/eval/test_leaderboard_report.py): five rows (the reference, the 1- and 2-step samplers, two Predictor plans) on
three units, video a under two seeds and video b under one, with known costs and PSNRs."""

from __future__ import annotations

from predictor_training.eval.leaderboard import RowSpec

PREDICTOR_CONFIG = {"variant": "v4", "fusion_streams": ["anchor", "prev_chunk", "context"], "hidden_size": 64}


def row_spec(key: str, plan: str) -> RowSpec:
    family = "reference" if key == "reference" else "predictor" if key.startswith("predictor") else (
        "sampler" if key.startswith("sampler") else "cache")
    return RowSpec(key, family, plan, key, key, checkpoint="ck" if family == "predictor" else None)


def result_entry(letters: list[str], flops: float, dit_s: float, end_to_end_s: float, psnr: float | None = None,
           **figures) -> dict:
    """One row's entry of one unit's result, as the eval writes it (only the fields the analysis reads)."""
    entry = {"step_kinds": letters, "flops": {"total": flops},
             "timings": {"dit_s": dit_s, "end_to_end_s": end_to_end_s}}
    if psnr is not None:
        entry["metrics"] = {"psnr_full": psnr, "ssim": figures.get("ssim", 0.5), "lpips": figures.get("lpips", 0.1),
                            "temporal_delta_mse": figures.get("temporal_delta_mse", 0.01)}
        entry["per_chunk"] = [{"psnr_full": 99.0}, {"psnr_full": figures.get("last_chunk_psnr", psnr)}]
    return entry


# (key, plan, step kinds of chunk 1, FLOPs on the config that ran, DiT seconds, end-to-end seconds) per unit
COST_ROWS = [("reference", "F-F-F-F", "FFFF", 100.0, 10.0, 20.0),
             ("sampler_1step_frrr", "F-R-R-R", "FRRR", 40.0, 3.0, 9.0),
             ("sampler_2step_frrf", "F-R-R-F", "FRRF", 60.0, 5.0, 12.0),
             ("predictor_ck_frrp", "F-R-R-P", "FRRP", 45.0, 4.0, 10.0),
             ("predictor_ck_fppp", "F-P-P-P", "FPPP", 50.0, 4.5, 11.0)]
# PSNR per unit: video a under two seeds, video b under one
PSNR = {"sampler_1step_frrr": [20.0, 22.0, 30.0], "sampler_2step_frrf": [30.0, 30.0, 36.0],
        "predictor_ck_frrp": [28.0, 28.0, 34.0], "predictor_ck_fppp": [35.0, 35.0, 37.0]}


def cost_results() -> list[dict]:
    results = []
    for unit, video in enumerate(["a", "a", "b"]):
        methods = {key: result_entry(["FFFF", letters], flops, dit, e2e, PSNR.get(key, [None] * 3)[unit])
                   for key, _, letters, flops, dit, e2e in COST_ROWS}
        results.append({"key": f"{video}_seed{unit}", "video_key": video, "case_id": f"scene_{video}",
                        "context_frames_per_chunk": [0, 4], "methods": methods})
    return results
