"""Predictor (docs/offline.md § What is trained, and the loss) on the tiny Teacher preset
with randomised zero-init layers: hidden reuse when untrained, the context projector, copied blocks (equal to a deep
copy, the caller's random stream untouched), the fusion, gradients, padding, checkpointing, bf16, DDP."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from predictor_training.predictor.loss import predictor_loss
from predictor_training.predictor.model import build_predictor, build_predictor_from_config, text_kv_from_stacked
from predictor_training.teacher import ContextKV, TextKV, WorldPlayTransformer, randomize_zero_initialised_


LATENT_C, FRAMES, HEIGHT, WIDTH = 4, 4, 2, 3
TOKENS = FRAMES * HEIGHT * WIDTH
CTX_FRAMES = 4
CTX_TIMESTEP = 14.0
WEIGHTS = {"velocity_weight": 1.0, "hidden_weight": 0.1}  # the recipes' defaults


# ---------------------------------------------------------------------------------------------------------------
# Fixtures and helpers
# ---------------------------------------------------------------------------------------------------------------
def make_teacher(depth: int, seed: int) -> WorldPlayTransformer:
    torch.manual_seed(seed)
    teacher = WorldPlayTransformer.from_preset("tiny", mm_double_blocks_depth=depth)
    randomize_zero_initialised_(teacher, torch.Generator().manual_seed(seed + 1))
    return teacher.eval()


@pytest.fixture(scope="module")
def teacher2() -> WorldPlayTransformer:
    return make_teacher(depth=2, seed=0)


@pytest.fixture(scope="module")
def teacher3() -> WorldPlayTransformer:
    return make_teacher(depth=3, seed=10)


def random_cameras(frames: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """viewmats [1, T, 4, 4] (rigid w2c), Ks [1, T, 3, 3] (normalised)."""
    q, r = torch.linalg.qr(torch.randn(frames, 3, 3, generator=gen))
    q = q * torch.sign(torch.diagonal(r, dim1=-2, dim2=-1)).unsqueeze(-2)
    viewmats = torch.eye(4).repeat(frames, 1, 1)
    viewmats[:, :3, :3] = q
    viewmats[:, :3, 3] = torch.randn(frames, 3, generator=gen)
    Ks = torch.eye(3).repeat(frames, 1, 1)
    Ks[:, 0, 0] = 0.6 + 0.4 * torch.rand(frames, generator=gen)
    Ks[:, 1, 1] = 0.9 + 0.4 * torch.rand(frames, generator=gen)
    Ks[:, :2, 2] = 0.5
    return viewmats[None], Ks[None]


@dataclass
class Case:
    """One B=1 chunk with the Teacher's own caches and outputs."""

    noisy_input: torch.Tensor  # [1, 2C+1, T, H, W]
    timestep: torch.Tensor  # [1, T]
    action: torch.Tensor  # [1, T]
    viewmats: torch.Tensor
    Ks: torch.Tensor
    text_kv: TextKV  # all layers, B = 1, no mask
    context_kv: ContextKV  # all layers
    prefeatures: dict
    ctx_timestep: torch.Tensor  # [1, n]
    ctx_action: torch.Tensor
    ctx_viewmats: torch.Tensor
    ctx_Ks: torch.Tensor
    anchor: torch.Tensor  # [1, N, D]
    prev_chunk_hidden: torch.Tensor
    target_hidden: torch.Tensor
    target_velocity: torch.Tensor
    trace: dict


def make_case(teacher: WorldPlayTransformer, seed: int, text_len: int, source_blocks=()) -> Case:
    gen = torch.Generator().manual_seed(seed)
    cfg = teacher.config
    hidden = cfg.hidden_size
    with torch.no_grad():
        # 1. Text prefill with `text_len` valid LLM tokens out of 8.
        text_mask = torch.zeros(1, 8, dtype=torch.int64)
        text_mask[:, :text_len] = 1
        text_kv = teacher.text_prefill(
            torch.randn(1, 8, cfg.text_states_dim, generator=gen),
            text_mask,
            torch.randn(1, 3, cfg.byt5_states_dim, generator=gen),
            torch.tensor([[1, 1, 0]]),
            torch.randn(1, 2, cfg.vision_states_dim, generator=gen),
        )
        # 2. Context prefill of CTX_FRAMES history frames (with pre-features of every layer).
        ctx_viewmats, ctx_Ks = random_cameras(CTX_FRAMES, gen)
        ctx_action = torch.randint(0, 81, (1, CTX_FRAMES), generator=gen)
        ctx_input = torch.randn(1, 2 * LATENT_C + 1, CTX_FRAMES, HEIGHT, WIDTH, generator=gen)
        context_kv, prefeatures = teacher.context_prefill(
            ctx_input,
            torch.full((CTX_FRAMES,), CTX_TIMESTEP),
            ctx_action,
            ctx_viewmats,
            ctx_Ks,
            text_kv,
            prefeature_layers=range(teacher.num_layers),
        )
        # 3. The chunk step the Predictor stands in for.
        viewmats, Ks = random_cameras(FRAMES, gen)
        action = torch.randint(0, 81, (1, FRAMES), generator=gen)
        noisy_input = torch.randn(1, 2 * LATENT_C + 1, FRAMES, HEIGHT, WIDTH, generator=gen)
        timestep = torch.full((1, FRAMES), 833.3333)
        trace: dict = {}
        out = teacher.chunk_step(
            noisy_input, timestep[0], action, viewmats, Ks, text_kv, context_kv, return_final_hidden=True, trace=trace
        )
    return Case(
        noisy_input=noisy_input,
        timestep=timestep,
        action=action,
        viewmats=viewmats,
        Ks=Ks,
        text_kv=text_kv,
        context_kv=context_kv,
        prefeatures=prefeatures,
        ctx_timestep=torch.full((1, CTX_FRAMES), CTX_TIMESTEP),
        ctx_action=ctx_action,
        ctx_viewmats=ctx_viewmats,
        ctx_Ks=ctx_Ks,
        anchor=torch.randn(1, TOKENS, hidden, generator=gen),
        prev_chunk_hidden=torch.randn(1, TOKENS, hidden, generator=gen),
        target_hidden=out.final_hidden,
        target_velocity=out.velocity,
        trace=trace,
    )


def run_predictor(predictor, case: Case, exact_context: bool = True, noisy_input=None):
    """Predictor call on `case` (v4: with the Teacher's exact context K/V or the projector's)."""
    text_kv = case.text_kv.select(predictor.source_blocks)
    context = prev = None
    if predictor.variant == "v4":
        prev = case.prev_chunk_hidden
        if exact_context:
            context = case.context_kv.select(predictor.source_blocks)
        else:
            context = projector_context(predictor, case)
    return predictor(
        case.noisy_input if noisy_input is None else noisy_input,
        case.anchor,
        case.timestep,
        case.action,
        case.viewmats,
        case.Ks,
        text_kv,
        context=context,
        prev_chunk_hidden=prev,
    )


def projector_context(predictor, case: Case) -> ContextKV:
    return predictor.context_from_prefeatures(
        {layer: case.prefeatures[layer] for layer in predictor.source_blocks},
        case.ctx_timestep,
        case.ctx_action,
        case.ctx_viewmats,
        case.ctx_Ks,
        height=HEIGHT,
        width=WIDTH,
    )


def perturb_(predictor, seed: int, fusion: bool = True) -> None:
    """Give the zero-initialised head (and fusion) output layers random values so every path is live."""
    gen = torch.Generator().manual_seed(seed)
    layers = [predictor.residual_head.fc2] + ([predictor.fusion.proj] if fusion else [])
    with torch.no_grad():
        for layer in layers:
            layer.weight.copy_(torch.randn(layer.weight.shape, generator=gen) * 0.3 / layer.weight.shape[1] ** 0.5)
            layer.bias.copy_(torch.randn(layer.bias.shape, generator=gen) * 0.05)


def teacher_velocity(teacher, hidden, case: Case) -> torch.Tensor:
    vec = teacher.frame_vec(case.timestep, case.action)
    return teacher.unpatchify(teacher.final_projection(hidden, vec, HEIGHT * WIDTH), FRAMES, HEIGHT, WIDTH)


# ---------------------------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", ["v4", "disca"])
def test_untrained_predictor_is_hidden_reuse(teacher2, variant):
    case = make_case(teacher2, seed=1, text_len=5)
    predictor = build_predictor(teacher2, variant, source_blocks=(1, 0))
    pred_hidden, pred_velocity = run_predictor(predictor, case)
    assert pred_hidden.dtype == torch.float32
    assert torch.equal(pred_hidden, case.anchor)
    with torch.no_grad():
        expected = teacher_velocity(teacher2, case.anchor, case)
    assert pred_velocity.shape == (1, LATENT_C, FRAMES, HEIGHT, WIDTH)
    assert torch.equal(pred_velocity, expected)
    assert expected.abs().max() > 0  # the final layer is not degenerate


@pytest.mark.parametrize("source_blocks", [(0, 2), (2, 1)])
def test_context_projector_equals_teacher_prefill(teacher3, source_blocks):
    case = make_case(teacher3, seed=2, text_len=6)
    predictor = build_predictor(teacher3, "v4", source_blocks=source_blocks)
    context = projector_context(predictor, case)
    assert context.num_frames == CTX_FRAMES and context.num_layers == 2
    for j, layer in enumerate(source_blocks):
        expected = case.context_kv.layer(layer)
        got = context.layer(j)
        for name in ("rope_k", "rope_v", "prope_k", "prope_v"):
            torch.testing.assert_close(getattr(got, name), getattr(expected, name), rtol=1e-6, atol=1e-6)
            assert not getattr(got, name).requires_grad


def test_copied_blocks_reproduce_teacher_blocks(teacher3):
    # Blocks (1, 2) of a depth-3 Teacher: fed the Teacher's block-1 input, they must give its final hidden.
    case = make_case(teacher3, seed=3, text_len=4)
    predictor = build_predictor(teacher3, "v4", source_blocks=(1, 2))
    vec = predictor.teacher_frozen.frame_vec(case.timestep, case.action)
    conditioning = predictor.chunk_conditioning(
        vec,
        HEIGHT,
        WIDTH,
        case.viewmats,
        case.Ks,
        case.text_kv.select((1, 2)),
        projector_context(predictor, case),
        rope_start=CTX_FRAMES,
    )
    with torch.no_grad():
        block_output = predictor.run_blocks(case.trace["layer0.img_out"], conditioning)
    torch.testing.assert_close(block_output, case.target_hidden, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(block_output, case.trace["layer0.img_out"], atol=1e-3)


def test_zero_fusion_feeds_teacher_block0_input(teacher2):
    # Source blocks (0, 1) of a depth-2 Teacher: untrained fusion passes img_in(x_k) through, so the blocks
    # reproduce the Teacher's whole chunk step (final hidden).
    case = make_case(teacher2, seed=4, text_len=7)
    predictor = build_predictor(teacher2, "v4", source_blocks=(0, 1))
    img_tokens = predictor.teacher_frozen.embed_image(case.noisy_input)
    block_input = predictor.fuse_inputs(img_tokens, case.anchor, case.prev_chunk_hidden)
    assert torch.equal(block_input, case.trace["img_tokens_in"])
    vec = predictor.teacher_frozen.frame_vec(case.timestep, case.action)
    conditioning = predictor.chunk_conditioning(
        vec, HEIGHT, WIDTH, case.viewmats, case.Ks, case.text_kv.select((0, 1)),
        case.context_kv.select((0, 1)), rope_start=CTX_FRAMES,
    )
    with torch.no_grad():
        block_output = predictor.run_blocks(block_input, conditioning)
    torch.testing.assert_close(block_output, case.target_hidden, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("variant", ["v4", "disca"])
def test_trained_head_moves_hidden_and_gradients_reach_everything(teacher2, variant):
    case = make_case(teacher2, seed=5, text_len=5)
    predictor = build_predictor(teacher2, variant, source_blocks=(0, 1))
    perturb_(predictor, seed=6, fusion=False)  # only the head: the fusion output projection stays zero
    noisy_input = case.noisy_input.clone().requires_grad_(True)
    pred_hidden, pred_velocity = run_predictor(predictor, case, noisy_input=noisy_input)
    assert not torch.allclose(pred_hidden, case.anchor, atol=1e-3)
    loss, _ = predictor_loss(pred_hidden, pred_velocity, case.target_hidden, case.target_velocity, **WEIGHTS)
    loss.backward()
    groups = predictor.trainable_parameter_groups()
    named = dict(predictor.named_parameters())
    for name, param in named.items():
        if not param.requires_grad:
            assert param.grad is None, f"frozen {name} got a gradient"
    live = ("fusion.proj.weight", "residual_head.fc1.weight", "residual_head.fc2.weight", "residual_head.norm.weight")
    for name in live:
        assert named[name].grad is not None and named[name].grad.abs().sum() > 0, name
    for param in groups["fusion"]:
        assert param.grad is not None  # the fusion norms get exact zeros while proj is zero, but they are in the graph
    for name, param in predictor.blocks.named_parameters():
        assert param.grad is not None and param.grad.abs().sum() > 0, f"blocks.{name} has no gradient"
    # the frozen img_in passes the gradient on to the latent channels of the input
    assert noisy_input.grad[:, :LATENT_C].abs().sum() > 0


def test_padded_text_batch_equals_single_samples(teacher2):
    predictor = build_predictor(teacher2, "v4", source_blocks=(1, 0))
    perturb_(predictor, seed=7)
    cases = [make_case(teacher2, seed=8, text_len=3), make_case(teacher2, seed=9, text_len=8)]
    lengths = [case.text_kv.num_tokens for case in cases]
    assert lengths[0] < lengths[1]
    # 1. Batch: text K/V stacked as collate_pairs does, padding filled with garbage (the mask must hide it).
    gen = torch.Generator().manual_seed(11)
    stacked_k, stacked_v = [], []
    for case in cases:
        text = case.text_kv.select(predictor.source_blocks)
        k = torch.stack(text.k, dim=1)  # [1, 2, heads, L, d]
        v = torch.stack(text.v, dim=1)
        pad = max(lengths) - k.shape[3]
        stacked_k.append(torch.cat([k, 50 * torch.randn(*k.shape[:3], pad, k.shape[4], generator=gen)], dim=3))
        stacked_v.append(torch.cat([v, 50 * torch.randn(*v.shape[:3], pad, v.shape[4], generator=gen)], dim=3))
    mask = torch.tensor([[True] * lengths[0] + [False] * (lengths[1] - lengths[0]), [True] * lengths[1]])
    text_kv = text_kv_from_stacked(torch.cat(stacked_k), torch.cat(stacked_v), mask)

    def cat(name):
        return torch.cat([getattr(case, name) for case in cases])

    context = predictor.context_from_prefeatures(
        {layer: torch.cat([case.prefeatures[layer] for case in cases]) for layer in predictor.source_blocks},
        cat("ctx_timestep"), cat("ctx_action"), cat("ctx_viewmats"), cat("ctx_Ks"), height=HEIGHT, width=WIDTH,
    )
    with torch.no_grad():
        batch_hidden, batch_velocity = predictor(
            cat("noisy_input"), cat("anchor"), cat("timestep"), cat("action"), cat("viewmats"), cat("Ks"), text_kv,
            context=context, prev_chunk_hidden=cat("prev_chunk_hidden"),
        )
        # 2. Each sample alone (no padding, no mask, projector context of its own).
        for row, case in enumerate(cases):
            hidden, velocity = run_predictor(predictor, case, exact_context=False)
            torch.testing.assert_close(batch_hidden[row : row + 1], hidden, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(batch_velocity[row : row + 1], velocity, rtol=1e-5, atol=1e-5)
            assert not torch.allclose(hidden, case.anchor, atol=1e-3)


def test_gradient_checkpointing_gives_same_gradients(teacher2):
    case = make_case(teacher2, seed=12, text_len=6)
    predictor = build_predictor(teacher2, "v4", source_blocks=(0, 1))
    perturb_(predictor, seed=13)
    results = []
    for enabled in (False, True):
        predictor.gradient_checkpointing = enabled
        predictor.zero_grad(set_to_none=True)
        noisy_input = case.noisy_input.clone().requires_grad_(True)
        pred_hidden, pred_velocity = run_predictor(predictor, case, noisy_input=noisy_input)
        loss, _ = predictor_loss(pred_hidden, pred_velocity, case.target_hidden, case.target_velocity, **WEIGHTS)
        loss.backward()
        grads = {name: param.grad.clone() for name, param in predictor.named_parameters() if param.requires_grad}
        results.append((loss.detach(), grads, noisy_input.grad.clone()))
    (loss_a, grads_a, input_a), (loss_b, grads_b, input_b) = results
    torch.testing.assert_close(loss_a, loss_b, rtol=0, atol=0)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], rtol=1e-6, atol=1e-7, msg=name)
    torch.testing.assert_close(input_a, input_b, rtol=1e-6, atol=1e-7)


def test_bf16_autocast_with_fp32_master_and_bf16_teacher(teacher2):
    case = make_case(teacher2, seed=14, text_len=5)
    reference = build_predictor(teacher2, "v4", source_blocks=(0, 1))
    perturb_(reference, seed=15)
    with torch.no_grad():
        ref_hidden, ref_velocity = run_predictor(reference, case)
    teacher_bf16 = copy.deepcopy(teacher2).to(torch.bfloat16)
    predictor = build_predictor(teacher_bf16, "v4", source_blocks=(0, 1), gradient_checkpointing=True)
    predictor.load_state_dict(reference.state_dict(), strict=True)
    for group in predictor.trainable_parameter_groups().values():
        assert all(param.dtype == torch.float32 and param.requires_grad for param in group)
    assert predictor.teacher_frozen.img_in.proj.weight.dtype == torch.bfloat16
    bf16_case = copy.copy(case)
    bf16_case.text_kv = case.text_kv.to(dtype=torch.bfloat16)
    bf16_case.prefeatures = {layer: t.to(torch.bfloat16) for layer, t in case.prefeatures.items()}
    bf16_case.anchor = case.anchor.to(torch.bfloat16)
    bf16_case.prev_chunk_hidden = case.prev_chunk_hidden.to(torch.bfloat16)
    noisy_input = case.noisy_input.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        pred_hidden, pred_velocity = run_predictor(predictor, bf16_case, exact_context=False, noisy_input=noisy_input)
        loss, metrics = predictor_loss(pred_hidden, pred_velocity, case.target_hidden, case.target_velocity, **WEIGHTS)
    loss.backward()
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    assert pred_hidden.dtype == torch.float32
    # bf16 numerics stay close to the fp32 reference
    scale = ref_velocity.abs().max()
    assert (pred_velocity.float() - ref_velocity).abs().max() < 0.1 * scale
    assert (pred_hidden - ref_hidden).abs().max() < 0.1 * ref_hidden.abs().max()
    for param in predictor.parameters():
        if param.requires_grad:
            assert param.grad is not None and param.grad.dtype == torch.float32 and torch.isfinite(param.grad).all()
    assert torch.isfinite(noisy_input.grad).all() and noisy_input.grad.abs().sum() > 0


def test_variant_input_rules(teacher3):
    case = make_case(teacher3, seed=16, text_len=4)
    disca = build_predictor(teacher3, "disca", source_blocks=(0, 2))
    text_kv = case.text_kv.select((0, 2))
    args = (case.noisy_input, case.anchor, case.timestep, case.action, case.viewmats, case.Ks, text_kv)
    with pytest.raises(ValueError, match="disca"):
        disca(*args, context=case.context_kv.select((0, 2)))
    with pytest.raises(ValueError, match="disca"):
        disca(*args, prev_chunk_hidden=case.prev_chunk_hidden)
    with pytest.raises(ValueError, match="v4 only"):
        projector_context(disca, case)
    v4 = build_predictor(teacher3, "v4", source_blocks=(0, 2))
    with pytest.raises(ValueError, match="context"):
        v4(*args, prev_chunk_hidden=case.prev_chunk_hidden)
    with pytest.raises(ValueError, match="prev_chunk_hidden"):
        v4(*args, context=case.context_kv.select((0, 2)))
    with pytest.raises(ValueError, match="2 source layers"):  # all 3 layers instead of the selected 2
        v4(*args[:-1], case.text_kv, context=case.context_kv.select((0, 2)), prev_chunk_hidden=case.prev_chunk_hidden)
    with pytest.raises(ValueError, match="timestep"):
        disca(case.noisy_input, case.anchor, case.timestep[0], case.action, case.viewmats, case.Ks, text_kv)
    with pytest.raises(ValueError, match="unknown Predictor variant"):
        build_predictor(teacher3, "v3", source_blocks=(0, 2))
    with pytest.raises(ValueError, match="source_blocks"):
        build_predictor(teacher3, "v4", source_blocks=(0, 3))


def test_weights_groups_config_roundtrip(teacher3):
    case = make_case(teacher3, seed=17, text_len=5)
    predictor = build_predictor(teacher3, "v4", source_blocks=(2, 0))
    perturb_(predictor, seed=18)
    # 1. Groups: disjoint, FP32, exactly the trainable parameters; frozen parts are the Teacher's own modules.
    groups = predictor.trainable_parameter_groups()
    assert set(groups) == {"fusion", "blocks"}
    grouped = [id(p) for group in groups.values() for p in group]
    assert len(grouped) == len(set(grouped))
    assert set(grouped) == {id(p) for p in predictor.parameters() if p.requires_grad}
    assert predictor.teacher_frozen.img_in is teacher3.img_in
    assert predictor.teacher_frozen.context_blocks[0] is teacher3.double_blocks[2]
    assert predictor.blocks[0] is not teacher3.double_blocks[2]
    # The frozen Teacher parts are not registered: every parameter the Predictor (and so DDP) sees is trained.
    assert set(grouped) == {id(p) for p in predictor.parameters()}
    assert not any(param.requires_grad for param in teacher3.img_in.parameters())
    # 2. Inference weights: trainable only, no text stream, no Teacher keys.
    weights = predictor.state_dict()
    assert all(key.split(".")[0] in ("fusion", "blocks", "residual_head") for key in weights)
    assert not any(".txt_" in key for key in weights)
    assert sum(t.numel() for t in weights.values()) == sum(p.numel() for g in groups.values() for p in g)
    # 3. Rebuild from the config on the Teacher and reload: same outputs.
    config = predictor.predictor_config()
    assert config["variant"] == "v4" and config["source_blocks"] == [2, 0]
    rebuilt = build_predictor_from_config(teacher3, config)
    rebuilt.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in weights.items()}, strict=True)
    predictor.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in weights.items()}, strict=True)
    with torch.no_grad():
        for a, b in zip(run_predictor(predictor, case), run_predictor(rebuilt, case)):
            assert torch.equal(a, b)
    with pytest.raises(ValueError, match="hidden_size"):
        build_predictor_from_config(teacher3, {**config, "hidden_size": 128})
    with pytest.raises(RuntimeError, match="Missing key"):
        rebuilt.load_state_dict({k: v for k, v in weights.items() if not k.startswith("fusion.")}, strict=True)


def test_ddp_trains_without_unused_parameters(teacher2, tmp_path):
    case = make_case(teacher2, seed=19, text_len=5)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        predictor = build_predictor(teacher2, "v4", source_blocks=(0, 1), gradient_checkpointing=True)
        ddp = DistributedDataParallel(predictor, find_unused_parameters=False)
        for _ in range(2):  # DDP raises on the 2nd iteration if a trainable parameter got no gradient
            pred_hidden, pred_velocity = ddp(
                case.noisy_input, case.anchor, case.timestep, case.action, case.viewmats, case.Ks,
                case.text_kv.select((0, 1)), context=case.context_kv.select((0, 1)),
                prev_chunk_hidden=case.prev_chunk_hidden,
            )
            loss, _ = predictor_loss(pred_hidden, pred_velocity, case.target_hidden, case.target_velocity, **WEIGHTS)
            loss.backward()
        assert predictor.residual_head.fc2.weight.grad.abs().sum() > 0
    finally:
        dist.destroy_process_group()


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
