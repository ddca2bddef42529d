"""Evaluation of Predictor checkpoints against the full Teacher (docs/eval.md).

For every (case, action) row of a split, the same seed (same noise, same memory points) is rolled out several ways
with the Teacher's AR loop (`ar_rollout.ARRollout`, one step hook per method), decoded with the VAE, and compared
frame by frame with the reference:

    reference        F-F-F-F in every chunk
    reuse_velocity   a replaced step k reuses the previous step's velocity:        v_k = v_{k-1}
    reuse_hidden     a replaced step k reuses the previous hidden through the final layer:
                     h_k = h_{k-1},  v_k = final_layer(h_{k-1}, vec_k)   (what an untrained Predictor computes)
    predictor_<ckpt> a replaced step k runs the Predictor: anchor = the Teacher's h_0 at step 1, then its own pred_h;
                     v4 also gets this rollout's previous-chunk hidden of the same step and the exact context K/V of
                     its source layers from the Teacher's prefill of this chunk

The plan (`StepPlan`, from --replace_steps / --reuse_steps) replaces its steps in chunks 1.. and, by default, runs
chunk 0 F-F-F-F (docs/eval.md § What is compared; `chunk0_full=False` applies it to chunk 0 as well). Every method
replaces the same steps (a Predictor with --reuse_steps runs its plan's R steps by velocity reuse), so the reuse
baselines are
exactly "the Predictor replaced by a copy".

Context modes (`EvalSettings.context_modes`, `--context_modes`; predictor_training/teacher/frame_kv_cache.py): the methods
above use the exact context (every chunk re-prefills its context). For every other mode M the reference and each
Predictor run once more with that mode, as `reference@M` and `predictor_<ckpt>@M` (`with_context_mode`), scored,
timed and FLOP-counted against the exact reference F-F-F-F.

Timings (CUDA synchronised around every timed call; perf_counter on the CPU; a warm-up rollout runs first and is
not counted): text prefill, context prefill, Full step, Predictor / reuse step, VAE decode, the rollout, and the
end-to-end time of each method (text prefill + rollout + VAE decode). Next to the measured speedups stands the
FLOP-count bound of `predictor_training.teacher.flops` (DiT work only: the VAE decode is the same for every method).

Outputs of one evaluation run (directory `<output_root>/<run_name>`), written by rank 0 except the per-video files:

    eval_config.json          settings and the fingerprint of everything that changes the numbers
    videos/<case>__a<action>.json   one per finished video (the unit of resume): metrics, per-chunk and per-frame
                              series of every method vs the reference, timings, FLOPs
    side_by_side/<case>__a<action>.mp4   [ground truth |] reference | reuse_velocity | reuse_hidden | predictor(s),
                              chosen subset, every panel scaled up (nearest) to at least 192 px high
    per_video.csv, per_chunk.csv, aggregate.csv, timings.csv, aggregate.json, drift.png, table.md
    drift_ground_truth.png    with ground truth only

Ground truth (`--ground_truth DIR`, or the demo world's renders): every method, the reference included, and the
`repeat_first_frame` baseline (the true first frame held still) are also scored against the true video; the
results gain `against_ground_truth` sections and table.md a second table.

Modules: `methods` (schedule, methods, step hooks), `runtime` (timing, timed rollout, VAE decoder, one video),
`reports` (reading results back, aggregation, CSV / markdown / JSON / drift plot, side-by-side videos),
`predictor_checkpoints` (reading, labelling and loading the checkpoints), `settings` (the settings from the flags,
the Teacher checked against the checkpoints), `run` (run names, fingerprint, the sharded and resumable run).
"""

from predictor_training.eval.methods import (
    EXACT_CONTEXT,
    PREDICTOR_PREFIX,
    REFERENCE,
    REUSE_HIDDEN,
    REUSE_VELOCITY,
    HiddenReuse,
    Method,
    PredictorMethod,
    ReferenceMethod,
    VelocityReuse,
    add_context_modes,
    context_mode_name,
    make_step_fn,
    parse_context_modes,
    with_context_mode,
)
from predictor_training.rollout.schedule import StepPlan, parse_replace_steps
from predictor_training.eval.reports import (
    aggregate_results,
    format_markdown_table,
    plot_drift,
    read_video_result,
    write_reports,
    write_side_by_side,
)
from predictor_training.eval.predictor_checkpoints import label_checkpoints, load_predictor, read_predictor_checkpoint
from predictor_training.eval.run import (
    EVAL_CONFIG_NAME,
    check_or_write_eval_config,
    context_modes_tag,
    default_run_name,
    rollout_config_for,
    run_evaluation,
    settings_fingerprint,
)
from predictor_training.eval.settings import (
    DTYPES,
    PRECISION_DTYPES,
    EvalSettings,
    check_schedule_fits,
    resolve_dtype,
    resolve_eval_settings,
    resolve_teacher,
)
from predictor_training.eval.methods import PredictorCheckpoint
from predictor_training.eval.runtime import RESULT_FORMAT, RESULT_VERSION, EvalRuntime
from predictor_training.eval.timing import Stopwatch, TimedRollout
from predictor_training.video.vae_decoder import VaeDecoder
from predictor_training.video.ground_truth import video_key

__all__ = [
    "DTYPES", "EVAL_CONFIG_NAME", "EXACT_CONTEXT", "PRECISION_DTYPES", "PREDICTOR_PREFIX", "REFERENCE", "RESULT_FORMAT",
    "RESULT_VERSION", "REUSE_HIDDEN", "REUSE_VELOCITY",
    "EvalRuntime", "EvalSettings", "HiddenReuse", "Method", "PredictorCheckpoint", "PredictorMethod",
    "ReferenceMethod", "StepPlan", "Stopwatch", "TimedRollout", "VaeDecoder", "VelocityReuse",
    "add_context_modes", "aggregate_results", "check_or_write_eval_config", "check_schedule_fits",
    "context_mode_name", "context_modes_tag", "default_run_name",
    "format_markdown_table", "label_checkpoints", "load_predictor", "make_step_fn",
    "parse_context_modes", "parse_replace_steps", "plot_drift", "read_predictor_checkpoint",
    "read_video_result", "resolve_dtype", "resolve_eval_settings",
    "resolve_teacher", "rollout_config_for", "run_evaluation", "settings_fingerprint",
    "video_key", "with_context_mode", "write_reports", "write_side_by_side",
]
