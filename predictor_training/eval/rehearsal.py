"""The memory of the eval's rollout at real size on fake tensors (tools/estimate_memory.py --recipe eval).

tools/eval_predictor.py's own `EvalRuntime.rollout` of one sample-table row (chunk 0 F-F-F-F, then the Predictor at
`replace_steps`) in `context_mode`, with the eval's bf16 pipeline (`rollout_config_for`) and the Predictor as
`load_predictor` leaves it (copied blocks FP32, eval, frozen). No optimizer, no gradients. Not counted: the VAE
decoder and its decode (outside the DiT), the LPIPS network, the text prefill (the case's stored K/V are read, as
with --dataset_root). The reference and the reuse baselines run the same loop without the Predictor step: at most
this rollout's memory.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch

from predictor_training.data.synthetic import case_text_kv, trajectory_row
from predictor_training.eval.methods import PredictorCheckpoint, PredictorMethod, with_context_mode
from predictor_training.eval.run import rollout_config_for
from predictor_training.eval.runtime import EvalRuntime
from predictor_training.eval.timing import Stopwatch
from predictor_training.predictor.model import build_predictor
from predictor_training.rollout.schedule import StepPlan
from predictor_training.runtime.memory_rehearsal import MemoryReport, Rehearsal
from predictor_training.teacher.config import preset_config
from predictor_training.teacher.source import TeacherSource, preset_teacher_loader


def rehearse_eval_rollout(preset: str, *, chunks: int, grid: tuple[int, int], text_tokens: int,
                          replace_steps: tuple[int, ...], context_mode: str, source_blocks: tuple[int, int],
                          cuda_autocast: bool = True, fake: bool = True) -> MemoryReport:
    """One eval rollout of `chunks` chunks of the Teacher `preset` (latent `grid` HxW, `text_tokens` stored text
    tokens). fake=False: the same on real CPU tensors (tiny presets only). notes: the configuration and the
    memory selection's context frames per chunk."""
    config = SimpleNamespace(**preset_config(preset))
    item, image_cond = trajectory_row(chunks, grid, config.out_channels)
    case = {**case_text_kv(config, text_tokens=text_tokens, host="meta" if fake else "cpu"), "image_cond": image_cond}
    plan = StepPlan.from_steps(replace_steps)
    name = (f"eval rollout {plan.text}, {chunks} chunks, context {context_mode}, blocks {list(source_blocks)}, "
            "inference")
    with Rehearsal(name, cuda_autocast=cuda_autocast, fake=fake) as rehearsal:
        load = preset_teacher_loader(preset, on_load=lambda teacher: rehearsal.label_parameters([teacher]))
        teacher = load(TeacherSource(Path("unused"), None, "--teacher", None), "cpu", torch.bfloat16)
        torch.manual_seed(0)
        predictor = build_predictor(teacher, "v4", source_blocks).eval().requires_grad_(False)
        rehearsal.label_parameters([predictor])
        ckpt = PredictorCheckpoint(path=Path("unused"), run_name="rehearsal", step=0,
                                   meta={"variant": "v4", "source_blocks": list(source_blocks)},
                                   predictor_config=predictor.predictor_config(), run_flags={}, label="rehearsal",
                                   panel="rehearsal")
        method = with_context_mode(PredictorMethod(predictor, ckpt), context_mode)
        runtime = EvalRuntime(teacher=teacher, methods=[method], plan=plan,
                              rollout_config=rollout_config_for(torch.bfloat16), decoder=None, scorer=None,
                              dataset=None, case_source="dataset", device=torch.device("cpu"),
                              state_dtype=torch.bfloat16)
        with rehearsal.phase("forward"):
            text_kv, _ = runtime.text_kv(case)
            rollout = runtime.rollout(method, text_kv, item, case, Stopwatch(torch.device("cpu")))
        rehearsal.notes["configuration"] = (
            f"config {preset}; bf16 (Teacher, autocast, running latents; the Predictor's copied blocks FP32 as "
            f"loaded); text {text_tokens} tokens (stored K/V); latents 4x{grid[0]}x{grid[1]} per chunk, {chunks} "
            f"chunks; context {context_mode}; autocast rules {'CUDA (emulated)' if cuda_autocast else 'CPU'}; VAE "
            "decoder, LPIPS and text prefill not counted")
        rehearsal.notes["context_frames_per_chunk"] = list(rollout.context_frames)
        del rollout
    return rehearsal.report()
