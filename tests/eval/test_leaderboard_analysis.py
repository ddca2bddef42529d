"""The leaderboard's analysis (predictor_training/eval/leaderboard_analysis.py) on hand-made per-unit results
(tests/helpers/leaderboard_results.py): real-config FLOPs, costs on every axis, quality, intervals, the front and
the margins, the figures, and the bootstrap's units."""

from __future__ import annotations

import math

import pytest

from predictor_training.eval.leaderboard_analysis import real_config_flops
from predictor_training.teacher.config import preset_config
from predictor_training.teacher.flops import REAL_LATENT_GRID, REAL_TEXT_TOKENS, TeacherShape, teacher_chunk_step_flops
from tests.helpers.leaderboard_results import COST_ROWS, PREDICTOR_CONFIG, PSNR, cost_results, result_entry, row_spec


def test_real_config_flops_count_the_recorded_steps():
    """F-R-R-R at the real config = the reference minus three Full chunk steps in every scheduled chunk."""
    contexts = [0, 4, 8, 12, 16, 20, 20, 20]
    result = {"context_frames_per_chunk": contexts, "methods": {
        "reference": {"step_kinds": ["FFFF"] * 8}, "frrr": {"step_kinds": ["FFFF"] + ["FRRR"] * 7}}}
    shape = TeacherShape.from_config(preset_config("worldplay_480p_i2v"))
    tokens = REAL_LATENT_GRID[0] * REAL_LATENT_GRID[1]
    saved = sum(3 * teacher_chunk_step_flops(shape, tokens, REAL_TEXT_TOKENS, n) for n in contexts[1:])
    assert real_config_flops(result, "frrr", None) == real_config_flops(result, "reference", None) - saved
    bound = real_config_flops(result, "reference", None) / real_config_flops(result, "frrr", None)
    assert 1.6 < bound < 1.75  # the context prefill keeps one-Full-step plans under 2x at real size



# ---------------------------------------------------------------------------------------------------------------
# The analysis on hand-made per-unit results: costs on every axis, quality, intervals, the front and the margins
def _video_mean(per_unit: list[float]) -> float:
    """The mean over videos of each video's mean over its seeds (units a, a, b)."""
    return ((per_unit[0] + per_unit[1]) / 2 + per_unit[2]) / 2


def _mix_db(lam: float, psnr_a: float, psnr_b: float) -> float:
    return -10 * math.log10(lam * 10 ** (-psnr_a / 10) + (1 - lam) * 10 ** (-psnr_b / 10))


def _front(lam_sampler_mix: float, lam_with_reference: float) -> tuple[float, str]:
    """The best of: the 1-step sampler; it time-shared with the 2-step one (a fraction lam of the chunks); it
    time-shared with the reference (MSE 0: lam x its MSE)."""
    frrr, frrf = PSNR["sampler_1step_frrr"], PSNR["sampler_2step_frrf"]
    mixed = _video_mean([_mix_db(lam_sampler_mix, a, b) for a, b in zip(frrr, frrf)])
    with_reference = _video_mean(frrr) - 10 * math.log10(lam_with_reference)
    return max(_video_mean(frrr), mixed, with_reference), (
        f"{lam_sampler_mix:.2f} x sampler_1step_frrr + {1 - lam_sampler_mix:.2f} x sampler_2step_frrf")


def test_costs_quality_and_margins_of_hand_made_results():
    """Costs: summed row work over summed reference work, per axis (FLOPs 45 / 100, DiT 4 / 10, end-to-end 10 / 20
    for F-R-R-P); at the real config the recorded steps are counted again: per chunk c the context prefill P_c and
    its steps (Full F_c, Predictor Q_c, velocity reuse free). Quality: videos count once (a: 2 seeds, b: 1). The
    margin of F-R-R-P is over the baselines' front at its own cost on each axis, the Predictors never in it:
        FLOP run  0.45: the 1-step sampler (0.4) with the 2-step one (0.6), lam = 0.15 / 0.2 = 0.75
        DiT       0.40: 0.3 with 0.5, lam = 0.5
        FLOP real  c_P: c_R with c_F, lam = (c_F - c_P) / (c_F - c_R) = 1 - Q_1 / F_1"""
    from predictor_training.eval.leaderboard_analysis import analyse
    from predictor_training.teacher.flops import context_prefill_flops, predictor_step_flops

    specs = [row_spec(key, plan) for key, plan, *_ in COST_ROWS]
    analysis = analyse(cost_results(), specs, {"ck": PREDICTOR_CONFIG}, baseline="sampler_1step_frrr",
                       resamples=200, seed=0)
    rows = {row.spec.key: row for row in analysis["rows"]}
    assert analysis["num_videos"] == 2 and analysis["num_units"] == 3
    shape = TeacherShape.from_config(preset_config("worldplay_480p_i2v"))
    tokens = REAL_LATENT_GRID[0] * REAL_LATENT_GRID[1]
    prefill = [context_prefill_flops(shape, tokens, REAL_TEXT_TOKENS, n) for n in (0, 4)]
    full = [teacher_chunk_step_flops(shape, tokens, REAL_TEXT_TOKENS, n) for n in (0, 4)]
    predictor = predictor_step_flops(shape, {**PREDICTOR_CONFIG, "hidden_size": shape.hidden_size}, tokens,
                                     REAL_TEXT_TOKENS, 4)
    assert 3 * predictor < full[1]  # 2 of 54 blocks: three Predictor steps cost less than one Full step
    chunk0 = prefill[0] + 4 * full[0]
    reference = chunk0 + prefill[1] + 4 * full[1]
    real = {"sampler_1step_frrr": chunk0 + prefill[1] + full[1],
            "sampler_2step_frrf": chunk0 + prefill[1] + 2 * full[1],
            "predictor_ck_frrp": chunk0 + prefill[1] + full[1] + predictor,
            "predictor_ck_fppp": chunk0 + prefill[1] + full[1] + 3 * predictor}
    for key, _, _, flops, dit, e2e in COST_ROWS:
        expected = {"flops_run": flops / 100, "flops_real": real.get(key, reference) / reference,
                    "measured_dit": dit / 10, "measured_end_to_end": e2e / 20}
        assert rows[key].costs == pytest.approx(expected, rel=1e-12), key
    for key, per_unit in PSNR.items():
        assert rows[key].quality.value == pytest.approx(_video_mean(per_unit), rel=1e-12), key
    assert rows["reference"].quality.value == math.inf
    assert rows["predictor_ck_frrp"].vs_baseline.value == pytest.approx((28 - 21 + 34 - 30) / 2)  # 5.5
    assert rows["sampler_2step_frrf"].vs_baseline.value == pytest.approx((30 - 21 + 36 - 30) / 2)  # 7.5
    assert rows["sampler_1step_frrr"].vs_baseline is None
    c_r, c_f, c_p = (real[key] / reference for key in ("sampler_1step_frrr", "sampler_2step_frrf",
                                                        "predictor_ck_frrp"))
    fronts = {"flops_run": _front(0.75, (1 - 0.45) / (1 - 0.4)), "measured_dit": _front(0.5, (1 - 0.4) / (1 - 0.3)),
              "flops_real": _front(1 - predictor / full[1], (1 - c_p) / (1 - c_r))}
    assert (c_f - c_p) / (c_f - c_r) == pytest.approx(1 - predictor / full[1], rel=1e-9)
    for axis, (front, members) in fronts.items():
        margin, where = rows["predictor_ck_frrp"].margins[axis]
        assert margin.value == pytest.approx(_video_mean(PSNR["predictor_ck_frrp"]) - front, rel=1e-9), axis
        assert where == members, axis
        assert margin.low <= margin.value <= margin.high
    # the real-config FLOP front of every row: F-P-P-P is cheaper and better than the 2-step sampler
    assert {key: row.on_front for key, row in rows.items()} == {
        "reference": True, "sampler_1step_frrr": True, "sampler_2step_frrf": False, "predictor_ck_frrp": True,
        "predictor_ck_fppp": True}


def test_figures_of_hand_made_results():
    """SSIM, LPIPS, temporal-delta error, last chunk PSNR: means over the videos (one seed each); Full steps per
    chunk over chunks 1.. (chunk 0 is always F-F-F-F); ground truth on chunks 1.. (not the whole video); revisit
    figures over the videos that revisit a camera (a and b, not c)."""
    from predictor_training.eval.leaderboard_analysis import analyse

    kinds = {"reference": ["FFFF"] * 3, "sampler_1step_frrr": ["FFFF", "FRRR", "FRRR"],
             "teacache_full1.5": ["FFFF", "FAFA", "FAAA"]}
    specs = [row_spec("reference", "F-F-F-F"), row_spec("sampler_1step_frrr", "F-R-R-R"),
             row_spec("teacache_full1.5", "F-A-A-A")]
    results = []
    for index, video in enumerate("abc"):
        methods = {key: result_entry(kinds[key], 10.0, 1.0, 1.0, None if key == "reference" else 30.0 + index,
                               ssim=0.5 + 0.1 * index, lpips=0.2 * index, temporal_delta_mse=0.01 * index,
                               last_chunk_psnr=20.0 + 2 * index) for key in kinds}
        truth = {key: {"after_first_chunk": {"psnr_full": 25.0 + index, "ssim": 0.6 + 0.1 * index},
                       "metrics": {"psnr_full": 40.0, "ssim": 0.99}} for key in kinds}
        result = {"key": video, "case_id": f"scene_{video}", "context_frames_per_chunk": [0, 4, 8], "methods": methods,
                  "against_ground_truth": {"methods": truth}}
        if video != "c":
            result["revisits"] = {"methods": {key: {"self_psnr": 15.0 + 4 * index,
                                                    "return_minus_first_visit": -3.0 + index} for key in kinds}}
        results.append(result)
    analysis = analyse(results, specs, {}, baseline="sampler_1step_frrr", resamples=100)
    figures = {row.spec.key: row.figures for row in analysis["rows"]}
    assert figures["sampler_1step_frrr"] == pytest.approx({
        "ssim": 0.6, "lpips": 0.2, "temporal_delta_mse": 0.01, "last_chunk_psnr": 22.0,
        "gt_psnr_after_first_chunk": 26.0, "gt_ssim_after_first_chunk": 0.7, "revisit_self_psnr": 17.0,
        "revisit_return_minus_first_visit": -2.5, "full_steps_per_chunk": 1.0, "speedup_measured_dit_q25": 1.0,
        "speedup_measured_dit_q75": 1.0, "speedup_measured_dit_min": 1.0, "speedup_measured_dit_max": 1.0},
        rel=1e-12)
    assert figures["teacache_full1.5"]["full_steps_per_chunk"] == pytest.approx(1.5)  # (2 + 1) / 2
    assert figures["reference"]["full_steps_per_chunk"] == 4.0


def test_videos_of_one_scene_are_resampled_together():
    """Both videos made scenes of one case: the scene bootstrap has one cluster, so every resample draws the same
    units and the interval closes on the estimate; resampling videos keeps two clusters and an open interval."""
    from predictor_training.eval.leaderboard_analysis import analyse

    results = cost_results()
    for result in results:
        result["case_id"] = "one_scene"
    specs = [row_spec(key, plan) for key, plan, *_ in COST_ROWS]
    scene = analyse(results, specs, {"ck": PREDICTOR_CONFIG}, resamples=200, seed=0)
    video = analyse(results, specs, {"ck": PREDICTOR_CONFIG}, resamples=200, seed=0, unit="video")
    assert (scene["num_clusters"], video["num_clusters"]) == (1, 2)
    row, other = scene["rows"][1].quality, video["rows"][1].quality
    assert row.low == row.value == row.high and other.low < other.value < other.high
