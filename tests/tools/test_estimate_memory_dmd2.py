"""The dmd2 memory rehearsal (tools/estimate_memory.py --recipe dmd2: fvtools/train_dmd2.py's own step on fake
tensors) on the tiny Teacher: against the same code on real CPU tensors, and the tool for each generator and real
score the recipe offers."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch

from predictor_training.teacher import WorldPlayTransformer


ROOT = Path(__file__).resolve().parents[2]

sys.path.insert(0, str(ROOT / "tools"))

import estimate_memory  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py
TINY = ["--config", "tiny", "--text_tokens", "8", "--latent_grid", "2x3", "--source_blocks", "0,1"]


@pytest.mark.parametrize("generator,real_score", [("predictor", "lora"), ("student", "model")])
def test_dmd2_fake_run_matches_the_real_cpu_run(generator, real_score):
    """One DistributionMatchingStep with both roles due on a monitor step (2 chunks) and the loop's clip + AdamW +
    EMA, on fake tensors against the same code on real CPU tensors, both tracked: every phase's peak within 1 %, the
    peak in the same phase and the same part of the step, both roles' gradients and AdamW state present."""
    args = estimate_memory.parse_args(["--recipe", "dmd2", *TINY, "--chunks", "2", "--world_size", "1",
                                       "--generator", generator, "--real_score", real_score])
    fake = estimate_memory.rehearse(args)
    real = estimate_memory.rehearse(args, fake=False)
    assert set(fake.phase_peaks) == set(real.phase_peaks) == {"setup", "forward", "backward", "optimizer"}
    for phase, value in real.phase_peaks.items():
        assert abs(fake.phase_peaks[phase] - value) <= 0.01 * value, (phase, fake.phase_peaks, real.phase_peaks)
    assert fake.peak_phase == real.peak_phase
    assert fake.notes["peak_in"] == real.notes["peak_in"]
    after, real_after = fake.notes["live_after_step"], real.notes["live_after_step"]
    assert after["gradients"] > 0 and after["optimizer_state"] > 0
    for category in ("parameters", "gradients", "optimizer_state"):  # (activations: the CPU kernels' scalars)
        assert after[category] == real_after[category], (category, after, real_after)


# ---- the generator's context released before the critic (docs/memory.md) -------------------------------------
# The demo Teacher (4 blocks: the Predictor reads 2, so 2 layers' context K/V are released) at a grid where the
# context K/V count: the step's peak is the critic's backward of chunk 1 (4 context frames).
DEMO = ["--config", "demo", "--text_tokens", "8", "--latent_grid", "8x12", "--source_blocks", "1,2", "--chunks", "2",
        "--world_size", "1"]


def _context_kv_at_the_peak(report: dict, argv: list[str]) -> int:
    """How many context K/V tensors (`[2, heads, 4 H W, head_dim]` BF16, one k or v of one layer's 4-frame context of
    chunk 1, made by the prefill's cat) are alive at the step's peak, from the report's peak groups."""
    height, width = argv[argv.index("--latent_grid") + 1].split("x")
    tokens = 4 * int(height) * int(width)
    pattern = re.compile(rf"^(\d+) x \[2, \d+, {tokens}, \d+\] bfloat16 cat \(forward, activations\)")
    return sum(int(match.group(1)) for group in report["peak_groups"] if (match := pattern.match(group)))


def test_the_generator_context_cut_lowers_the_peak(capsys):
    """The tool's --recipe dmd2 with the Predictor generator and a model-folder real score (a second BF16
    Teacher-sized model among the parameters): the Predictor chunk's context K/V of the layers it does not read are
    released once the sample is made (`CompositeRollout.chunk_sample`), so the critic's backward, the step's peak,
    runs without them: undoing the cut (`--undo_cuts rollout_context`) raises the peak there."""
    argv = ["--recipe", "dmd2", *DEMO, "--generator", "predictor", "--real_score", "model"]
    assert estimate_memory.main([*argv, "--json"]) == 0
    assert estimate_memory.main([*argv, "--undo_cuts", "rollout_context", "--json"]) == 0
    cut, undone = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert cut["name"].startswith("dmd2 Predictor") and cut["live_after_step"]["optimizer_state"] > 0
    teacher = sum(param.numel() for param in WorldPlayTransformer.from_preset("demo").parameters()) * 2  # BF16
    assert cut["live_after_step"]["parameters"] >= 2 * teacher
    assert cut["peak_in"] == undone["peak_in"] == "critic: fake score forward + backward"
    assert undone["peak_gib"] > cut["peak_gib"], (cut["peak_gib"], undone["peak_gib"])


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict[str, Path]:
    """tests/helpers/method_world.py's demo world (4-block Teacher, clips of 2 chunks) and a v4 Predictor on
    blocks 1, 2 with non-zero output layers (every parameter gets a gradient), as tests/recipes/test_train_dmd2.py
    builds them."""
    from tests.helpers.method_world import write_method_world, write_trained_looking_predictor
    root = tmp_path_factory.mktemp("dmd2_cut")
    write_method_world(root)
    generator = torch.Generator().manual_seed(1)
    init = write_trained_looking_predictor(root / "teacher", root / "predictor_init.safetensors", generator)
    return {"teacher": root / "teacher", "videos": root / "videos", "init": init}


def _step_gradients(world, out: Path, generator: str = "predictor", replace_steps: str = "1,2,3", *extra
                    ) -> tuple[dict[str, list], int]:
    """(both roles' gradients, Teacher passes) of one DistributionMatchingStep with both due (the demo recipe,
    gradient checkpointing on, `extra` flags). Predictor generator: the fake score starts equal to the real one, so
    the DMD gradient is 0 at the first step and the anchor gives the Predictor's. Student generator (LoRA,
    --context_grad off): its adapter is set to random values first (a zero-initialised LoRA B runs as the base
    Teacher, so a recompute under the wrong adapter would go unseen) and the Teacher's x0 anchor gives it a
    gradient. Teacher passes: calls of the Teacher's first block's image-stream K projection (a context prefilled
    again in a backward is one more)."""
    import fvtools.train_dmd2 as train_dmd2
    import predictor_training.recipes.dmd2 as dmd2
    from predictor_training.data.video_latents import VideoLatentDataset
    from predictor_training.methods.dmd2_models import FAKE
    from predictor_training.runtime.distributed import DistEnv
    from predictor_training.runtime.precision import precision_policy
    cpu = torch.device("cpu")
    env = DistEnv(rank=0, local_rank=0, world_size=1, device=cpu, backend=None, is_main=True)
    argv = ["--preset", "demo", "--teacher", str(world["teacher"]), "--dataset_root", str(world["videos"]),
            "--real_score", str(world["teacher"]), "--source_blocks", "1,2", "--output_dir", str(out),
            "--gradient_checkpointing", "--generator", generator, "--val_every", "0", *extra]
    argv += (["--init_from", str(world["init"]), "--replace_steps", replace_steps] if generator == "predictor" else
             ["--anchor_weight", "1", "--exit_step", "last"])
    parts = dmd2.build(train_dmd2.parse_args(argv), env, precision_policy("fp32", cpu),
                       rollout_config=dmd2.RolloutConfig(state_dtype=torch.float32))
    generator_role, fake_role = parts.roles
    if generator != "predictor":
        values = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for param in generator_role.parameters:
                param.copy_(0.05 * torch.randn(param.shape, generator=values))
    passes = []
    hook = parts.step_fn.teacher.double_blocks[0].img_attn_k.register_forward_hook(lambda *_: passes.append(1))
    parts.step_fn(VideoLatentDataset(world["videos"], "train")[0], sync=True, due=frozenset({generator_role.name,
                                                                                              FAKE}))
    hook.remove()
    grads = {role.name: [None if param.grad is None else param.grad.clone() for param in role.parameters]
             for role in (generator_role, fake_role)}
    return grads, len(passes)


def _assert_same_gradients(cut: dict[str, list], undone: dict[str, list]) -> None:
    assert set(cut) == set(undone) and len(cut) == 2
    for name, grads in cut.items():
        assert any(grad is not None and grad.abs().sum() > 0 for grad in grads), name
        for grad, other in zip(grads, undone[name], strict=True):
            assert (grad is None and other is None) or torch.equal(grad, other), name


def test_tool_runs_an_fppf_generator_on_ddp_with_the_raw_teacher_score(capsys):
    """The tool's --recipe dmd2 with an F-P-P-F Predictor generator (its sample re-runs the trailing Full step with a
    graph), the raw Teacher as real score and DDP buckets over 8 ranks: one report naming the schedule, with the
    buckets and both roles' AdamW state, its peak at the critic. (That the trailing step's context is released and
    prefilled again, with the same gradients, is `test_the_generator_context_cut_changes_no_value[F-P-P-F]`.)"""
    ranks = DEMO.index("--world_size") + 1
    argv = ["--recipe", "dmd2", *DEMO[:ranks], "8", *DEMO[ranks + 1:], "--generator", "predictor",
            "--real_score", "teacher", "--replace_steps", "1,2"]
    assert estimate_memory.main([*argv, "--json"]) == 0
    (report,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert report["name"].startswith("dmd2 Predictor") and "F-P-P-F" in report["name"]
    assert report["live_after_step"]["ddp_buckets"] > 0 and report["live_after_step"]["optimizer_state"] > 0
    assert report["peak_in"] == "critic: fake score forward + backward"


@pytest.mark.parametrize("replace_steps", ["1,2,3", "1,2"], ids=["F-P-P-P", "F-P-P-F"])
def test_the_generator_context_cut_changes_no_value(world, tmp_path, replace_steps):
    """One step of the recipe on the tiny world with the cuts (the unread layers' context released once the sample
    is made; F-P-P-F: the trailing Full step's context prefilled again in the backward, once for chunk 1) and
    without them (--no-recompute_context): every gradient of both roles bit for bit the same."""
    cut, passes = _step_gradients(world, tmp_path / "cut", "predictor", replace_steps)
    undone, passes_undone = _step_gradients(world, tmp_path / "undone", "predictor", replace_steps,
                                            "--no-recompute_context")
    assert passes - passes_undone == (1 if replace_steps == "1,2" else 0)
    _assert_same_gradients(cut, undone)


# ---- the student's context recomputed in its backward (docs/memory.md) ---------------------------------------
def test_the_student_context_recompute_lowers_the_peak(capsys):
    """The tool's --recipe dmd2 --generator student (LoRA real score): the student's no-grad context K/V are
    released after the chunk's forward and prefilled again in its backward (`RecomputedContextKV`), so at the
    critic, the step's peak, the only context K/V alive are the fake score's: 2 x 4 tensors (with the student's
    held, 2 x 8)."""
    grid = DEMO.index("--latent_grid") + 1  # a grid where the critic, not the AdamW state, sets the student's peak
    argv = ["--recipe", "dmd2", *DEMO[:grid], "16x24", *DEMO[grid + 1:], "--generator", "student",
            "--real_score", "lora"]
    assert estimate_memory.main([*argv, "--json"]) == 0
    (report,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert report["name"].startswith("dmd2 LoRA rank 64 student")
    assert report["live_after_step"]["optimizer_state"] > 0 and report["live_after_step"]["ddp_buckets"] == 0
    assert report["peak_in"] == "critic: fake score forward + backward"
    assert _context_kv_at_the_peak(report, argv) == 2 * 4, report["peak_groups"]


def test_the_student_context_recompute_changes_no_value(world, tmp_path):
    """One step of the student generator with its context released and prefilled again in the backward (once per
    chunk with context: chunk 1), and with the K/V kept (--no-recompute_context): both roles' gradients bit for bit
    the same."""
    cut, passes = _step_gradients(world, tmp_path / "cut", "student")
    undone, passes_undone = _step_gradients(world, tmp_path / "undone", "student", "1,2,3", "--no-recompute_context")
    assert passes - passes_undone == 1  # chunk 1 (chunk 0 has no context)
    _assert_same_gradients(cut, undone)


def test_dmd2_flags_are_checked():
    with pytest.raises(SystemExit):
        estimate_memory.parse_args(["--recipe", "dmd2", "--generator", "unknown"])
    with pytest.raises(SystemExit):
        estimate_memory.parse_args(["--recipe", "dmd2", "--real_score", "folder"])
