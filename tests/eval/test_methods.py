"""The eval's methods (predictor_training/eval/methods.py) on the tiny eval world: an untrained
Predictor's rollout is hidden reuse bit for bit, and the Predictor's inputs come from this very rollout."""

from __future__ import annotations

import pytest
import torch

from predictor_training.data.trajectory_dataset import TrajectoryTableDataset
from predictor_training.eval import (
    REFERENCE,
    REUSE_HIDDEN,
    REUSE_VELOCITY,
    EvalRuntime,
    HiddenReuse,
    PredictorMethod,
    ReferenceMethod,
    VelocityReuse,
    label_checkpoints,
    load_predictor,
    read_predictor_checkpoint,
    rollout_config_for,
)
from predictor_training.eval.timing import Stopwatch
from predictor_training.rollout.schedule import StepPlan
from predictor_training.teacher import WorldPlayTransformer
from predictor_training.video.vae_decoder import VaeDecoder
from tests.helpers.eval_world import LONG_LATENTS, SOURCE_BLOCKS, write_eval_world
from tests.helpers.recording_models import RecordingPredictor, RecordingTeacher


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict:
    return write_eval_world(tmp_path_factory.mktemp("eval_world"))


# ---------------------------------------------------------------------------------------------------------------
# Untrained Predictor == hidden reuse, bitwise (and both differ from the reference and velocity reuse)
# ---------------------------------------------------------------------------------------------------------------
def test_untrained_predictor_rollout_equals_hidden_reuse_bitwise(world):
    root = world["root"]
    teacher = WorldPlayTransformer.from_pretrained(str(root / "teacher")).eval().requires_grad_(False)
    ckpt = label_checkpoints([read_predictor_checkpoint(world["ckpt"])])[0]
    methods = [ReferenceMethod(), VelocityReuse(), HiddenReuse(teacher), PredictorMethod(load_predictor(teacher, ckpt),
                                                                                          ckpt)]
    dataset = TrajectoryTableDataset(root / "samples" / "holdout50.jsonl", encoded_dir=root / "encoded",
                                     num_latents=LONG_LATENTS)
    runtime = EvalRuntime(
        teacher=teacher, methods=methods, plan=StepPlan.from_steps((1, 2, 3)),
        rollout_config=rollout_config_for(torch.float32),
        decoder=VaeDecoder.from_folder(root / "vae", torch.device("cpu"), torch.float32, tiling=False),
        scorer=None, dataset=dataset, case_source="encoded", device=torch.device("cpu"), state_dtype=torch.float32,
    )
    item = dataset[0]
    case = dataset.load_case(item["case_id"])
    text_kv, _ = runtime.text_kv(case)
    latents = {}
    stopwatches = {}
    for method in methods:
        stopwatches[method.name] = Stopwatch(torch.device("cpu"))
        latents[method.name] = runtime.rollout(method, text_kv, item, case, stopwatches[method.name]).latents
    predictor_name = methods[-1].name
    assert torch.equal(latents[predictor_name], latents[REUSE_HIDDEN])
    assert not torch.equal(latents[REUSE_HIDDEN], latents[REFERENCE])
    assert not torch.equal(latents[REUSE_HIDDEN], latents[REUSE_VELOCITY])
    chunk0 = slice(0, 4)
    assert torch.equal(latents[predictor_name][:, :, chunk0], latents[REFERENCE][:, :, chunk0])  # chunk 0 is F-F-F-F
    # the Predictor ran on chunks 1 and 2, steps 1-3; the Teacher ran the rest
    calls = stopwatches[predictor_name].summary()
    assert calls["predictor_step"]["count"] == 2 * 3 and calls["full_step"]["count"] == 4 + 2
    assert calls["context_prefill"]["count"] == 2


def test_predictor_inputs_come_from_this_rollout(world):
    """Anchor: h0 of the Teacher at step 1, then the Predictor's own pred_h; previous-chunk hidden: chunk 0's Teacher
    hidden for chunk 1, the Predictor's own pred_h of chunk 1 for chunk 2; context: the Teacher prefill's exact K/V
    objects of the source layers of the same chunk."""
    root = world["root"]
    teacher = WorldPlayTransformer.from_pretrained(str(root / "teacher")).eval().requires_grad_(False)
    ckpt = label_checkpoints([read_predictor_checkpoint(world["ckpt"])])[0]
    predictor = RecordingPredictor(load_predictor(teacher, ckpt))
    recording = RecordingTeacher(teacher, "context_prefill")
    dataset = TrajectoryTableDataset(root / "samples" / "holdout50.jsonl", encoded_dir=root / "encoded",
                                     num_latents=LONG_LATENTS)
    runtime = EvalRuntime(
        teacher=recording, methods=[PredictorMethod(predictor, ckpt)], plan=StepPlan.from_steps((1, 2, 3)),
        rollout_config=rollout_config_for(torch.float32),
        decoder=VaeDecoder.from_folder(root / "vae", torch.device("cpu"), torch.float32, tiling=False),
        scorer=None, dataset=dataset, case_source="encoded", device=torch.device("cpu"), state_dtype=torch.float32,
    )
    item = dataset[0]
    case = dataset.load_case(item["case_id"])
    runtime.rollout(runtime.methods[0], runtime.text_kv(case)[0], item, case, Stopwatch(torch.device("cpu")))
    calls = [{"anchor": call["args"][1], "prev": call["kwargs"]["prev_chunk_hidden"],
              "context": call["kwargs"]["context"], "hidden": call["outputs"][0]} for call in predictor.calls]
    prefills = [call["output"][0] for call in recording.calls["context_prefill"]]  # (K/V, pre-features)
    assert len(calls) == 6 and len(prefills) == 2  # chunks 1, 2 x steps 1, 2, 3
    own = [call["hidden"] for call in calls]
    for chunk in (0, 1):
        first = 3 * chunk
        assert not any(calls[first]["anchor"] is hidden for hidden in own)  # the Teacher's h0
        assert calls[first + 1]["anchor"] is own[first] and calls[first + 2]["anchor"] is own[first + 1]
        for index in range(first, first + 3):
            layers = calls[index]["context"].layers
            assert all(layers[j] is prefills[chunk].layers[block] for j, block in enumerate(SOURCE_BLOCKS))
    assert not any(calls[k]["prev"] is hidden for k in range(3) for hidden in own)  # chunk 0's Teacher hiddens
    assert all(calls[3 + k]["prev"] is own[k] for k in range(3))


def test_hidden_reuse_rows_carry_the_last_hidden_through_the_final_layer():
    """Scripted Teacher (tests/helpers/scripted_chunks.py: Full step of chunk c, step k: h = (c + 1) (1, 3, 4, 8)[k],
    v = -h; final layer v = 2 h + sigma). F-H-F-H: step 1 carries h_0 = c + 1 and gets v = 2 (c + 1) + 15/16; step
    2 is the Teacher's; step 3 carries h_2 = 4 (c + 1): v = 8 (c + 1) + 5/8. Chunk 0 is the Teacher's."""
    from predictor_training.eval.methods import PlannedMethod
    from predictor_training.rollout.schedule import StepPlan
    from tests.helpers.scripted_chunks import ScriptedTeacher, numbers, run_chunks

    method = PlannedMethod("fhfh", StepPlan.parse("F-H-F-H"), {"H": HiddenReuse(ScriptedTeacher())}, "fhfh")
    outputs, kinds, teacher_calls = run_chunks(method)
    assert numbers(outputs, 0, "velocity") == [-1, -3, -4, -8]
    for chunk in (1, 2):
        scale = chunk + 1
        assert numbers(outputs, chunk, "final_hidden") == [scale, scale, 4 * scale, 4 * scale]
        assert numbers(outputs, chunk, "velocity") == pytest.approx(
            [-scale, 2 * scale + 15 / 16, -4 * scale, 8 * scale + 5 / 8], rel=1e-6)
        assert [kinds[(chunk, step)] for step in range(4)] == ["full", REUSE_HIDDEN, "full", REUSE_HIDDEN]
    assert teacher_calls == [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 2), (2, 0), (2, 2)]


# ---------------------------------------------------------------------------------------------------------------
# A student row runs its own model: its text and context prefills and its S steps
# ---------------------------------------------------------------------------------------------------------------
def test_a_student_row_runs_its_own_model_in_every_chunk(world):
    """A 4-step "student" that is the Teacher itself, at S-S-S-S in every chunk, is the reference bit for bit (its
    text K/V and context are the rollout model's own); a student whose text-embedding weights alone differ changes
    every chunk, chunk 0 too, through its own text prefill; one whose image-stream MLP alone differs (the same text
    K/V) through its own steps; the evaluation scores each row from its own model and text K/V."""
    import copy

    from predictor_training.eval.methods import PlannedMethod
    from predictor_training.rollout.schedule import StepPlan
    from predictor_training.video.metrics import LpipsScorer

    root = world["root"]
    teacher = WorldPlayTransformer.from_pretrained(str(root / "teacher")).eval().requires_grad_(False)
    same = copy.deepcopy(teacher)
    other = copy.deepcopy(teacher)
    with torch.no_grad():
        for name, parameter in other.named_parameters():
            if name.startswith("txt_in."):
                parameter.add_(0.05 * torch.randn(parameter.shape, generator=torch.Generator().manual_seed(4)))
    steps = copy.deepcopy(teacher)
    with torch.no_grad():
        for name, parameter in steps.named_parameters():
            if name.startswith("double_blocks.0.img_mlp."):
                parameter.add_(0.05 * torch.randn(parameter.shape, generator=torch.Generator().manual_seed(5)))
    plan = StepPlan.parse("S-S-S-S", chunk0_full=False)
    twin = PlannedMethod("student_twin", plan, {}, "twin", model=same)
    shifted = PlannedMethod("student_other", plan, {}, "other", model=other)
    own_steps = PlannedMethod("student_steps", plan, {}, "steps", model=steps)
    dataset = TrajectoryTableDataset(root / "samples" / "holdout50.jsonl", encoded_dir=root / "encoded",
                                     num_latents=LONG_LATENTS)
    runtime = EvalRuntime(
        teacher=teacher, methods=[ReferenceMethod(), twin, shifted, own_steps], plan=StepPlan.from_steps((1, 2, 3)),
        rollout_config=rollout_config_for(torch.float32),
        decoder=VaeDecoder.from_folder(root / "vae", torch.device("cpu"), torch.float32, tiling=False),
        scorer=LpipsScorer.from_policy(random_backbone=True), dataset=dataset, case_source="encoded",
        device=torch.device("cpu"), state_dtype=torch.float32,
    )
    result, frames = runtime.evaluate(dataset[0])
    assert torch.equal(frames["student_twin"], frames[REFERENCE])
    assert result["methods"]["student_twin"]["step_kinds"] == result["methods"][REFERENCE]["step_kinds"]
    chunk0 = slice(0, 4)  # decoded frames of chunk 0 (temporal compression 4: latent 0 is one frame)
    assert not torch.equal(frames["student_other"][chunk0], frames[REFERENCE][chunk0])
    assert not torch.equal(frames["student_steps"][chunk0], frames[REFERENCE][chunk0])
    item = dataset[0]
    case = dataset.load_case(item["case_id"])
    own_text, _ = runtime.text_kv(case, other)
    own = runtime.rollout(shifted, own_text, item, case, Stopwatch(torch.device("cpu"))).latents
    assert torch.equal(runtime.decoder.decode(own), frames["student_other"])
