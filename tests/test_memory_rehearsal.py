"""The memory rehearsal (predictor_training/runtime/memory_rehearsal.py, tools/estimate_memory.py).

Fast tier: the CUDA-autocast emulation's op lists (pinned to torch's registrations) and its dtypes; the tracker's
byte accounting against hand-counted allocations and its categories; a fake run against the same step on real CPU
tensors; the tool on the tiny Teacher for every recipe it lists; each memory cut lowers its recipe's peak. The three
rows of the user's GPU table at real size (issue 20, each within 10 %) are checked by
`benchmarks/check_real_size_memory.py` (minutes of CPU: a benchmark, not a timed test).
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from predictor_training.runtime.memory_rehearsal import (
    AUTOCAST_TORCH_VERSION,
    PINNED_CPU_AUTOCAST_OPS,
    CudaAutocastRules,
    MemoryTracker,
    Rehearsal,
    cuda_autocast_policies,
    emulated_ops,
    registered_autocast_ops,
)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import estimate_memory


# ---- CUDA autocast emulation -------------------------------------------------------------------------------------
def test_autocast_op_lists_are_torchs_own():
    """The emulation's CUDA policies cover exactly the ops torch registers at AutocastCUDA, and the CPU list is the
    pinned one: a torch upgrade that changes either fails here (re-check the lists against autocast_mode.h)."""
    assert torch.__version__.startswith(AUTOCAST_TORCH_VERSION)
    assert set(cuda_autocast_policies()) == registered_autocast_ops("AutocastCUDA")
    assert set(PINNED_CPU_AUTOCAST_OPS) == registered_autocast_ops("AutocastCPU")
    ops = emulated_ops()
    for name in ("layer_norm", "native_layer_norm", "pow.Tensor_Scalar", "exp", "rsqrt", "reciprocal"):
        assert ops[name] == "fp32", name
    for name in ("softmax.int", "sum", "sum.dim_IntList"):
        assert ops[name] == "fp32_set_opt_dtype", name
    for name in ("cat", "stack", "index_copy"):
        assert ops[name] == "none", name  # CPU "promotes", CUDA has no policy
    for name in ("linear", "mm", "bmm", "scaled_dot_product_attention", "mse_loss"):
        assert name not in ops, name  # the policies agree: CPU's native kernel (and its weight-cast cache) stays


def test_cuda_rules_change_dtypes_and_are_removed_on_exit():
    x = torch.randn(4, 8, dtype=torch.bfloat16)

    def dtypes():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return (F.layer_norm(x, (8,)).dtype, x.pow(2).dtype, torch.softmax(x, -1).dtype, x.exp().dtype,
                    F.linear(x.float(), torch.randn(3, 8)).dtype)

    cpu_rules = dtypes()
    assert cpu_rules == (torch.bfloat16, torch.bfloat16, torch.bfloat16, torch.bfloat16, torch.bfloat16)
    with CudaAutocastRules():
        assert dtypes() == (torch.float32, torch.float32, torch.float32, torch.float32, torch.bfloat16)
    assert dtypes() == cpu_rules


def test_cat_has_no_promote_copy_under_cuda_rules():
    """CPU autocast casts every bf16 input of a mixed cat to float32 first (a full copy); CUDA does not."""
    a, b = torch.randn(64, 64, dtype=torch.bfloat16), torch.randn(64, 64)

    def copies(rules: bool) -> int:
        tracker = MemoryTracker()
        with (CudaAutocastRules() if rules else contextlib.nullcontext()), tracker, \
                torch.autocast("cpu", dtype=torch.bfloat16):
            out = torch.cat([a, b])
        assert out.dtype == torch.float32
        return tracker.peak

    assert copies(rules=False) == 64 * 64 * 4 + 2 * 64 * 64 * 4  # the fp32 copy of `a`, then the output
    assert copies(rules=True) == 2 * 64 * 64 * 4  # the output only


# ---- the tracker -------------------------------------------------------------------------------------------------
def test_tracker_counts_storages_views_and_releases():
    tracker = MemoryTracker()
    with tracker:
        a = torch.ones(1000)                 # 4000 B
        view = a[10:]                        # same storage: nothing new
        b = a * 2                            # 4000 B -> 8000 live
        del a                                # the view keeps the storage
        assert tracker.live == 8000
        del view                             # -> 4000
        c = torch.zeros(250, dtype=torch.float64)  # 2000 B -> 6000
        assert tracker.live == 6000
    assert tracker.peak == 8000
    assert [record.shape for record in tracker.peak_records()] == [(1000,), (1000,)]
    assert {record.op for record in tracker.peak_records()} == {"ones", "mul"}
    del b, c


def test_tracker_phases_and_categories():
    """Forward/backward told apart by the autograd engine; parameters, gradients and optimizer state labelled."""
    torch.manual_seed(0)
    with Rehearsal("tiny", cuda_autocast=False) as rehearsal:
        model = torch.nn.Linear(64, 64)
        rehearsal.label_parameters([model])
        rehearsal.watch_gradients(model.parameters())
        optimizer = torch.optim.AdamW(model.parameters(), foreach=True)
        with rehearsal.phase("forward"):
            model(torch.randn(32, 64)).square().sum().backward()
        with rehearsal.phase("optimizer"):
            optimizer.step()
            rehearsal.label_optimizer(optimizer)
        live = rehearsal.tracker.live_by_category()
    params = (64 * 64 + 64) * 4
    assert live["parameters"] == params
    assert live["gradients"] == params
    assert live["optimizer_state"] == 2 * params + 2 * 4  # exp_avg, exp_avg_sq and the two step counters
    assert set(rehearsal.tracker.phase_peaks) == {"setup", "forward", "backward", "optimizer"}


def _tiny_args(recipe: str, *extra: str):
    return estimate_memory.parse_args([
        "--recipe", recipe, "--config", "tiny", "--batch_size", "2", "--text_tokens", "8", "--latent_grid", "2x3",
        "--source_blocks", "0,1", *extra])


def test_fake_run_matches_the_real_cpu_run():
    """The v4 pair step of the tiny Teacher, once on fake tensors and once on real CPU tensors (same tracker): the
    peaks agree except the real CPU mse_loss kernel's larger result storage (a fake / GPU result is one element)."""
    args = _tiny_args("v4", "--context_frames", "4", "--world_size", "1")
    fake = estimate_memory.rehearse(args, "v4", n_ctx=4, host="cpu")
    real = estimate_memory.rehearse(args, "v4", n_ctx=4, fake=False)
    assert fake.peak > 0
    assert abs(real.peak - fake.peak) <= 2 * 128 * 1024, (real.peak, fake.peak)
    assert fake.peak_phase == real.peak_phase


# ---- the tool ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("recipe", ["df_sft", "kd"])
def test_method_fake_run_matches_the_real_cpu_run(recipe):
    """df_sft / kd with a LoRA on the tiny Teacher (their default mode): the recipe's own step on fake tensors
    against the same step on real CPU tensors, both tracked: same peak within the CPU mse kernel's result storages,
    same phase."""
    args = _tiny_args(recipe, "--chunks", "3", "--world_size", "1")
    fake = estimate_memory.rehearse(args, recipe)
    real = estimate_memory.rehearse(args, recipe, fake=False)
    assert fake.peak > 0 and fake.by_category["parameters"] > 0
    assert abs(real.peak - fake.peak) <= 0.05 * real.peak, (real.peak, fake.peak)
    assert fake.peak_phase == real.peak_phase


@pytest.mark.parametrize("data", ["offline", "rollout"])
def test_adversarial_fake_run_matches_the_real_cpu_run(data):
    """fvtools/train_adversarial.py on the tiny Teacher, each --data mode: the recipe's AdversarialPairStep (a batch
    with 4 context frames) or AdversarialRolloutStep (a 3-chunk F-P-P-P trajectory) with both roles due (generator
    term built, lazy R1 applied) on fake tensors against the same step on real CPU tensors: every phase's peak
    within 5 % (the CPU mse kernels' result storages), both roles' gradients and AdamW state."""
    args = _tiny_args("adversarial", "--context_frames", "4", "--world_size", "1", "--data", data, "--chunks", "3")
    fake = estimate_memory.rehearse(args, host="cpu")
    real = estimate_memory.rehearse(args, fake=False)
    assert "generator term built" in fake.notes["adversarial"] and "lazy R1 applied" in fake.notes["adversarial"]
    assert set(fake.phase_peaks) == set(real.phase_peaks) == {"setup", "forward", "backward", "optimizer"}
    for phase, value in real.phase_peaks.items():
        assert abs(fake.phase_peaks[phase] - value) <= 0.05 * value, (phase, fake.phase_peaks, real.phase_peaks)
    assert fake.peak_phase == real.peak_phase


@pytest.mark.parametrize("mode", ["exact", "incremental"])
def test_eval_fake_run_matches_the_real_cpu_run(mode):
    """tools/eval_predictor.py's rollout (EvalRuntime.rollout, F-P-P-P, inference only) of 3 chunks on the tiny
    Teacher: fake against real CPU tensors, same peak within 1 %, the memory selection's real context sizes."""
    args = _tiny_args("eval", "--chunks", "3", "--context_mode", mode)
    fake = estimate_memory.rehearse_eval(args)
    real = estimate_memory.rehearse_eval(args, fake=False)
    assert abs(real.peak - fake.peak) <= 0.01 * real.peak, (real.peak, fake.peak)
    assert fake.peak_phase == real.peak_phase == "forward"
    assert fake.notes["context_frames_per_chunk"] == real.notes["context_frames_per_chunk"] == [0, 4, 8]
    assert fake.by_category["gradients"] == fake.by_category["optimizer_state"] == 0


def test_nft_fake_run_matches_the_real_cpu_run():
    """fvtools/train_nft.py (LoRA policy, old-policy adapter, reference) on the tiny Teacher: one NftStep (K = 2
    samples of 2 chunks, 1 chunk trained each, step 1's monitor rollouts) and the loop's AdamW + old-policy update,
    fake against real CPU tensors: every phase's peak within 5 %."""
    args = _tiny_args("nft", "--chunks", "2", "--world_size", "1", "--samples_per_group", "2",
                      "--chunks_per_sample", "1")
    fake = estimate_memory.rehearse(args)
    real = estimate_memory.rehearse(args, fake=False)
    assert "2 samples" in fake.name
    for phase, value in real.phase_peaks.items():
        assert abs(fake.phase_peaks[phase] - value) <= 0.05 * value, (phase, fake.phase_peaks, real.phase_peaks)
    assert fake.peak_phase == real.peak_phase
    assert fake.notes["live_after_step"]["optimizer_state"] > 0


def test_fsdp_full_run_holds_the_per_rank_share(monkeypatch):
    """--train full over 8 ranks (FSDP2 through the fake process group): each rank holds 1/8 of the FP32 parameters,
    AdamW's two moments of its shard, and its sharded gradients. Each of the 3 trained chunks' backward
    reduce-scatters (`fsdp.gradient_sync` is a no-op for FSDP2), so no rank holds the model's unsharded FP32
    gradients until the last chunk: skipping the reduce-scatter on the first chunks (FSDP2's
    `set_requires_gradient_sync(False)`) raises the peak by about the model's FP32 size."""
    import contextlib

    import fvtools.train_df_sft as df_sft
    from predictor_training.teacher import WorldPlayTransformer
    total = sum(param.numel() for param in WorldPlayTransformer.from_preset("tiny").parameters()) * 4
    args = _tiny_args("df_sft", "--chunks", "3", "--train", "full", "--world_size", "8")
    report = estimate_memory.rehearse(args, "df_sft")
    assert "FSDP2 over 8 ranks" in report.name
    assert report.peak_phase in ("forward", "backward", "setup")
    # the shards: about an eighth (padding to a multiple of 8 rows per tensor), optimizer state twice that
    shards = report.notes["live_after_step"]
    assert total / 8 <= shards["parameters"] <= total / 8 * 1.3, (shards, total)
    assert shards["optimizer_state"] >= 0.95 * 2 * total / 8  # (the last block's text stream gets no gradient)
    assert 0 < shards["gradients"] <= total / 8 * 1.3

    @contextlib.contextmanager
    def skip_the_reduce_scatter(model, enabled):
        model.set_requires_gradient_sync(enabled)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)

    monkeypatch.setattr(df_sft, "gradient_sync", skip_the_reduce_scatter)
    accumulated = estimate_memory.rehearse(args, "df_sft")
    assert accumulated.peak - report.peak >= 0.5 * total, (report.peak, accumulated.peak, total)


def test_recipe_list():
    """RECIPES covers every entry script's recipe: the three Predictor entry scripts and every fvtools/train_*.py,
    plus the eval."""
    scripts = {path.stem.removeprefix("train_") for path in (ROOT / "fvtools").glob("train_*.py")}
    assert scripts <= set(estimate_memory.RECIPES)
    assert {"v4", "disca", "rollout"} <= set(estimate_memory.RECIPES)
    # every recipe is rehearsed, and the eval: none is refused (dmd2 runs in tests/test_memory_rehearsal_dmd2.py)
    for recipe in [*estimate_memory.RECIPES, "eval"]:
        assert estimate_memory.parse_args(["--recipe", recipe, "--config", "tiny"]).recipe == recipe
    with pytest.raises(SystemExit):
        estimate_memory.parse_args(["--recipe", "unknown"])
    with pytest.raises(SystemExit):
        estimate_memory.parse_args(["--recipe", "v4", "--context_frames", "6"])
    with pytest.raises(SystemExit):
        estimate_memory.parse_args(["--recipe", "v4", "--data", "rollout"])


@pytest.mark.parametrize("recipe,extra", [
    ("v4", ["--context_frames", "4", "8"]),
    ("disca", []),
    ("rollout", ["--chunks", "3"]),
    ("rollout", ["--chunks", "3", "--replace_steps", "1,2", "--context_mode", "incremental"]),
])
def test_tool_runs_every_recipe_at_tiny_size(recipe, extra, capsys):
    argv = ["--recipe", recipe, "--config", "tiny", "--batch_size", "2", "--text_tokens", "8", "--latent_grid",
            "2x3", "--source_blocks", "0,1", "--json", *extra]
    assert estimate_memory.main(argv) == 0
    reports = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(reports) == (2 if recipe == "v4" else 1)
    for report in reports:
        assert report["peak_gib"] > 0
        assert report["peak_phase"] in ("setup", "forward", "backward", "optimizer")
        assert {"forward", "backward", "optimizer"} <= set(report["phase_peaks_gib"])
        assert 0 < len(report["largest"]) <= 10
        assert report["by_category_gib"]["parameters"] > 0
        if report["peak_phase"] != "setup":  # at tiny sizes building the Teacher may set the peak, before DDP
            assert report["by_category_gib"]["ddp_buckets"] > 0  # --world_size 8 by default
        assert report["with_margin_gib"] > report["peak_gib"]
    if recipe == "v4":
        backward = [report["phase_peaks_gib"]["backward"] for report in reports]
        assert backward[1] > backward[0]  # more context, more memory


# ---- the memory cuts lower the peak ---------------------------------------------------------------------------------
# At real size against the user's GPUs: `python benchmarks/check_real_size_memory.py` (two 8-chunk rollouts on fake
# tensors, minutes). Here, at tiny size, each of this code's cuts must lower its recipe's forward peak.
TINY_REHEARSAL = ["--config", "tiny", "--batch_size", "2", "--text_tokens", "8", "--latent_grid", "2x3",
                  "--source_blocks", "0,1"]


def rehearse(recipe: str, flags: list[str], *, undo=()):
    """The tool's one report for `recipe` at `flags`, the memory cuts named in `undo` undone."""
    return estimate_memory.estimate(estimate_memory.parse_args(
        ["--recipe", recipe, *flags, *(["--undo_cuts", *undo] if undo else [])]))[0]


def test_each_offline_memory_cut_lowers_the_peak():
    """v4 at 20 context frames: undoing any one of RMSNorm's dtype cast, image_forward's early release of its
    attention inputs, or pair_step's release of the batch's pre-features raises the forward peak."""
    baseline = rehearse("v4", TINY_REHEARSAL).phase_peaks["forward"]
    for cut in ("rms_norm_dtype", "attention_inputs", "offline_prefeatures"):
        undone = rehearse("v4", TINY_REHEARSAL, undo=(cut,)).phase_peaks["forward"]
        assert undone > baseline, (cut, undone, baseline)


@pytest.mark.slow
def test_rollout_context_release_lowers_the_peak():
    """Rollout, 3 chunks: keeping each chunk's context K/V of every layer through its backward (the release undone)
    raises the backward peak (at tiny size the Teacher's weights set the forward phase's)."""
    flags = [*TINY_REHEARSAL, "--chunks", "3"]
    baseline = rehearse("rollout", flags).phase_peaks["backward"]
    undone = rehearse("rollout", flags, undo=("rollout_context",)).phase_peaks["backward"]
    assert undone > baseline


def test_undone_cuts_are_restored():
    from predictor_training.predictor.self_rollout import ChunkGraph
    from predictor_training.teacher import layers
    from predictor_training.teacher import model as teacher_model
    from predictor_training.predictor.memory_cuts import cuts_undone
    before = (layers.RMSNorm.forward, teacher_model.RELEASE_ATTENTION_INPUTS, ChunkGraph.release_context)
    with cuts_undone():
        assert teacher_model.RELEASE_ATTENTION_INPUTS is False and layers.RMSNorm.forward is not before[0]
    assert (layers.RMSNorm.forward, teacher_model.RELEASE_ATTENTION_INPUTS, ChunkGraph.release_context) == before
    with pytest.raises(ValueError, match="unknown cuts"):
        with cuts_undone(("no_such_cut",)):
            pass


# ---- the memory cuts keep the values -------------------------------------------------------------------------------
def test_rms_norm_keeps_the_input_dtype_and_fp32_values():
    """RMSNorm's weight is cast to the input's dtype: a BF16 input with an FP32 (master) weight stays BF16 (no
    float32 promotion of q, k and the key concatenation); with one dtype the values are the former formula's, bit
    for bit."""
    from predictor_training.teacher.layers import RMSNorm

    norm = RMSNorm(8)
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(3, 8)
    x32 = x.float()
    former = (x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + norm.eps)).type_as(x) * norm.weight
    assert torch.equal(norm(x), former)
    assert norm(x.bfloat16()).dtype == torch.bfloat16


def test_image_forward_release_changes_no_value():
    """Releasing image_forward's attention inputs early changes lifetimes only: same output and same gradients."""
    from predictor_training.teacher import model as teacher_model
    from predictor_training.teacher.layers import (
        build_camera_projection,
        build_rope_table,
    )

    results = []
    for release in (True, False):
        teacher_model.RELEASE_ATTENTION_INPUTS = release
        try:
            torch.manual_seed(0)
            teacher = teacher_model.WorldPlayTransformer.from_preset("tiny").eval().requires_grad_(False)
            block = teacher.double_blocks[0].requires_grad_(True)
            generator = torch.Generator().manual_seed(1)
            x = torch.randn(2, 24, teacher.config.hidden_size, generator=generator, requires_grad=True)
            vec = torch.randn(2, 4, teacher.config.hidden_size, generator=generator)
            rope = build_rope_table(4, 2, 3, 0, teacher.rope_dim_list, teacher.rope_theta)
            camera = build_camera_projection(torch.eye(4).repeat(2, 4, 1, 1), torch.eye(3).repeat(2, 4, 1, 1))
            heads, head_dim = teacher.heads_num, teacher.config.hidden_size // teacher.heads_num
            text = torch.randn(2, heads, 8, head_dim, generator=generator)
            out = block.image_forward(x, vec, 6, rope, camera, text, text)
            out.square().sum().backward()
            results.append((out.detach(), x.grad.clone(), block.img_attn_q.weight.grad.clone()))
        finally:
            teacher_model.RELEASE_ATTENTION_INPUTS = True
    for released, kept in zip(*results):
        assert torch.equal(released, kept)


def test_copied_blocks_equal_deepcopy_and_leave_the_rng_alone():
    """copy_image_stream builds the copy on the meta device and loads FP32 copies of the source weights (fake
    parameters can be neither deep-copied nor converted): the same tensors as deepcopy + .float(), the caller's
    random stream untouched (the residual head's initialisation after it stays the same)."""
    import copy

    from predictor_training.predictor.model import copy_image_stream
    from predictor_training.teacher import WorldPlayTransformer

    torch.manual_seed(0)
    block = WorldPlayTransformer.from_preset("tiny").double_blocks[1].to(torch.bfloat16).eval()
    state = torch.random.get_rng_state()
    copied = copy_image_stream(block)
    assert torch.equal(torch.random.get_rng_state(), state)
    former = copy.deepcopy(block)
    for name in [name for name, _ in former.named_children() if name.startswith("txt_")]:
        delattr(former, name)
    former = former.float()
    assert copied.state_dict().keys() == former.state_dict().keys()
    for name, tensor in former.state_dict().items():
        assert copied.state_dict()[name].dtype == torch.float32
        assert torch.equal(copied.state_dict()[name], tensor), name
    assert all(param.requires_grad for param in copied.parameters())
    assert copied.training is False
