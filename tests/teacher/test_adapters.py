"""LoRA adapters on the Teacher (predictor_training/teacher/adapters.py) and the Teacher's activation checkpointing.

Tiny preset on CPU, FP32. Covered: targets, bit-identical zero-effect of a fresh adapter, switching (context
manager, None = base, nesting, exceptions) without touching requires_grad, exact adapter parameters and gradient
isolation, the Teacher's own keys staying loadable, adapter files (metadata, config-hash refusal, strict keys),
copy / delete, the meta-device parameter count (480p, rank 64), and checkpointing: forward bit-identical, gradients
equal, with and without LoRA, also when backward runs after the adapter context has exited.
"""

from __future__ import annotations

import json

import peft
import pytest
import safetensors
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from predictor_training.teacher import StateDictMismatchError, WorldPlayTransformer
from predictor_training.teacher.adapters import (
    LORA_TARGETS,
    LORA_TARGETS_WITHOUT_PROPE,
    LoraSpec,
    active_adapter,
    adapter,
    adapter_names,
    adapter_spec,
    add_lora,
    base_state_dict,
    copy_lora,
    count_lora_parameters,
    delete_lora,
    load_base_checkpoint,
    load_base_state_dict,
    load_lora,
    lora_parameters,
    lora_state_dict,
    named_lora_parameters,
    read_lora_header,
    save_lora,
    set_active_adapter,
    set_lora_trainable,
)
from predictor_training.teacher.source import teacher_config_sha256
from tests.helpers.tiny_teacher import image_inputs, make_model, text_inputs


pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def inputs():
    """Text K/V, context K/V (3 frames) and a 2-frame chunk for the tiny Teacher, from a fixed generator."""
    model = make_model("tiny")
    generator = torch.Generator().manual_seed(11)
    with torch.no_grad():
        text_kv = model.text_prefill(**text_inputs(model, generator))
        context_kv, _ = model.context_prefill(**image_inputs(model, 3, generator, 14.0), text_kv=text_kv)
    chunk = image_inputs(model, 2, generator, 700.0)
    target = torch.randn(1, model.config.in_channels, 2, 4, 3, generator=generator)
    return {"text_kv": text_kv, "context_kv": context_kv, "chunk": chunk, "target": target}


def velocity(model, inputs) -> torch.Tensor:
    return model.chunk_step(**inputs["chunk"], text_kv=inputs["text_kv"], context_kv=inputs["context_kv"])


def randomize_lora_(model, name: str, seed: int) -> None:
    """Random lora_B (and A), so the adapter changes the outputs."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in lora_parameters(model, name):
            parameter.copy_(0.2 * torch.randn(parameter.shape, generator=generator))


# ---------------------------------------------------------------------------------------------------------------
# 1. Targets, zero effect, switching
# ---------------------------------------------------------------------------------------------------------------
def test_targets_are_the_image_stream_linears_of_every_block():
    model = make_model("tiny")
    spec = add_lora(model, "student", rank=4, alpha=8)
    assert spec.targets == LORA_TARGETS and (spec.rank, spec.alpha, spec.dropout) == (4, 8.0, 0.0)
    wrapped = {name for name, module in model.named_modules() if isinstance(module, peft.tuners.lora.LoraLayer)}
    assert wrapped == {f"double_blocks.{i}.{target}" for i in range(model.num_layers) for target in LORA_TARGETS}
    assert all(isinstance(model.get_submodule(name).base_layer, nn.Linear) for name in wrapped)
    model_b = make_model("tiny")
    add_lora(model_b, "student", rank=4, alpha=8, targets=LORA_TARGETS_WITHOUT_PROPE)
    assert adapter_spec(model_b, "student").targets == LORA_TARGETS_WITHOUT_PROPE
    assert not isinstance(model_b.double_blocks[0].img_attn_prope_proj, peft.tuners.lora.LoraLayer)
    with pytest.raises(ValueError, match="txt_attn_q"):
        add_lora(make_model("tiny"), "student", rank=4, alpha=8, targets=["txt_attn_q"])


def test_adapter_init_comes_from_its_seed_not_the_callers_random_state():
    """Ranks seed their global RNG differently (seed + rank); an adapter added on each must still be the same, or
    the replicas of a LoRA role differ from the first step. The caller's random state is left untouched."""
    adapters = []
    for global_seed in (0, 1):
        model = make_model("tiny")
        torch.manual_seed(global_seed)
        add_lora(model, "student", rank=4, alpha=4, seed=7)
        after = torch.rand(1)
        torch.manual_seed(global_seed)
        assert torch.equal(after, torch.rand(1)), "add_lora consumed the caller's random numbers"
        adapters.append(lora_state_dict(model, "student"))
    assert adapters[0].keys() == adapters[1].keys()
    assert all(torch.equal(adapters[0][name], adapters[1][name]) for name in adapters[0])
    other = make_model("tiny")
    add_lora(other, "student", rank=4, alpha=4, seed=8)
    assert any(not torch.equal(adapters[0][name], tensor) for name, tensor in lora_state_dict(other, "student").items())


def test_fresh_adapter_is_bit_identical_to_the_base(inputs):
    model = make_model("tiny")
    with torch.no_grad():
        base = velocity(model, inputs)
    add_lora(model, "student", rank=8, alpha=16)
    add_lora(model, "real_score", rank=4, alpha=4, dropout=0.1)
    model.eval()
    with torch.no_grad():
        assert active_adapter(model) is None  # adding never selects
        assert torch.equal(velocity(model, inputs), base)
        for name in ("student", "real_score"):
            with adapter(model, name):
                assert active_adapter(model) == name
                assert torch.equal(velocity(model, inputs), base)


def test_switching_selects_one_adapter_restores_and_keeps_requires_grad(inputs):
    model = make_model("tiny").eval()
    with torch.no_grad():
        base = velocity(model, inputs)
    add_lora(model, "real_score", rank=4, alpha=4, trainable=False)
    add_lora(model, "fake_score", rank=4, alpha=4)
    randomize_lora_(model, "real_score", 1)
    randomize_lora_(model, "fake_score", 2)
    flags = {name: parameter.requires_grad for name, parameter in model.named_parameters()}
    with torch.no_grad():
        with adapter(model, "real_score"):
            real = velocity(model, inputs)
            with adapter(model, "fake_score"):
                fake = velocity(model, inputs)
                with adapter(model, None):
                    assert torch.equal(velocity(model, inputs), base)
                assert active_adapter(model) == "fake_score"
            assert torch.equal(velocity(model, inputs), real)
        assert active_adapter(model) is None and torch.equal(velocity(model, inputs), base)
        assert not torch.equal(real, base) and not torch.equal(fake, base) and not torch.equal(real, fake)
        with pytest.raises(RuntimeError, match="boom"), adapter(model, "fake_score"):
            raise RuntimeError("boom")
        assert active_adapter(model) is None
        set_active_adapter(model, "fake_score")
        assert torch.equal(velocity(model, inputs), fake)
        set_active_adapter(model, None)
    assert {name: parameter.requires_grad for name, parameter in model.named_parameters()} == flags
    with pytest.raises(KeyError, match="no LoRA adapter 'student'.*real_score"):
        set_active_adapter(model, "student")


# ---------------------------------------------------------------------------------------------------------------
# 2. Parameters and gradients
# ---------------------------------------------------------------------------------------------------------------
def test_only_adapter_parameters_require_grad_and_lora_parameters_is_exact(inputs):
    model = make_model("tiny")
    add_lora(model, "student", rank=4, alpha=4)
    add_lora(model, "real_score", rank=2, alpha=2, trainable=False)
    trainable = {name for name, parameter in model.named_parameters() if parameter.requires_grad}
    student = {id(parameter) for parameter in lora_parameters(model, "student")}
    assert {id(parameter) for name, parameter in model.named_parameters() if name in trainable} == student
    assert all(".lora_A.student." in name or ".lora_B.student." in name for name in trainable)
    assert len(student) == 2 * model.num_layers * len(LORA_TARGETS)
    assert all(parameter.dtype == torch.float32 for parameter in lora_parameters(model, "student"))
    assert sorted(named_lora_parameters(model, "real_score"))[0] == "double_blocks.0.img_attn_k.lora_A.weight"
    with pytest.raises(KeyError, match="fake_score"):
        lora_parameters(model, "fake_score")

    # The real score runs frozen inside the student's graph: only the student's parameters get gradients.
    randomize_lora_(model, "real_score", 3)
    with adapter(model, "student"):
        student_velocity = velocity(model, inputs)
    with adapter(model, "real_score"):
        real_velocity = velocity(model, inputs)
    (F.mse_loss(student_velocity, inputs["target"]) + real_velocity.square().mean()).backward()
    with_grad = {name for name, parameter in model.named_parameters() if parameter.grad is not None}
    assert with_grad == trainable
    assert all(parameter.grad.abs().sum() > 0 for name, parameter in model.named_parameters()
               if name in with_grad and ".lora_B." in name)
    set_lora_trainable(model, "real_score", True)
    assert all(parameter.requires_grad for parameter in lora_parameters(model, "real_score"))


# ---------------------------------------------------------------------------------------------------------------
# 3. The Teacher's own keys
# ---------------------------------------------------------------------------------------------------------------
def test_the_teachers_own_keys_stay_loadable(inputs, tmp_path):
    plain = make_model("tiny", seed=0)
    other = make_model("tiny", seed=5).eval()
    model = make_model("tiny", seed=0)
    add_lora(model, "student", rank=4, alpha=4)
    randomize_lora_(model, "student", 4)
    assert any(".base_layer." in key for key in model.state_dict())  # what peft does to the keys
    own = base_state_dict(model)
    assert list(own) == list(plain.state_dict())
    assert all(torch.equal(own[key], value) for key, value in plain.state_dict().items())

    # Another Teacher's weights (its own keys) into the adapted Teacher: the base now computes what it computes.
    save_file({key: value.contiguous() for key, value in other.state_dict().items()}, tmp_path / "other.safetensors")
    load_base_checkpoint(model, tmp_path / "other.safetensors")
    model.eval()
    with torch.no_grad():
        assert torch.equal(velocity(model, inputs), velocity(other, inputs))
        lora_before = {key: value.clone() for key, value in named_lora_parameters(model, "student").items()}
        with adapter(model, "student"):
            assert not torch.equal(velocity(model, inputs), velocity(other, inputs))
    assert all(torch.equal(lora_before[key], value) for key, value in named_lora_parameters(model, "student").items())
    # ...and back into a plain Teacher, strictly.
    restored = WorldPlayTransformer.from_preset("tiny")
    restored.load_state_dict(base_state_dict(model), strict=True)

    broken = dict(plain.state_dict())
    broken.pop("double_blocks.1.img_attn_q.weight")
    broken["double_blocks.0.img_mlp.fc1.bias"] = torch.zeros(3)
    with pytest.raises(StateDictMismatchError) as error:
        load_base_state_dict(model, broken, source="broken.safetensors")
    assert error.value.missing == ["double_blocks.1.img_attn_q.weight"]
    assert error.value.mismatched == ["double_blocks.0.img_mlp.fc1.bias"]
    assert "broken.safetensors" in str(error.value)


# ---------------------------------------------------------------------------------------------------------------
# 4. Adapter files, copy, delete
# ---------------------------------------------------------------------------------------------------------------
def test_save_and_load_an_adapter(inputs, tmp_path):
    model = make_model("tiny").eval()
    add_lora(model, "fake_score", rank=4, alpha=2, dropout=0.05, targets=LORA_TARGETS_WITHOUT_PROPE)
    randomize_lora_(model, "fake_score", 6)
    path = save_lora(model, "fake_score", tmp_path / "fake.safetensors", metadata={"step": 7})
    header = read_lora_header(path)
    assert header["metadata"] == {"step": 7}
    config = header["lora_config"]
    assert {key: config[key] for key in ("name", "rank", "alpha", "dropout", "targets", "num_layers")} == {
        "name": "fake_score", "rank": 4, "alpha": 2.0, "dropout": 0.05, "targets": list(LORA_TARGETS_WITHOUT_PROPE),
        "num_layers": 2}
    assert config["teacher_config_sha256"] == teacher_config_sha256(model)
    assert config["peft_version"] == peft.__version__
    stored = load_file(path)
    assert stored["double_blocks.1.img_mlp.fc1.lora_A.weight"].shape == (4, 64)
    assert stored["double_blocks.1.img_mlp.fc1.lora_B.weight"].shape == (256, 4)

    fresh = make_model("tiny").eval()
    spec = load_lora(fresh, path, name="eval_score")
    assert spec == LoraSpec("eval_score", 4, 2.0, 0.05, LORA_TARGETS_WITHOUT_PROPE)
    assert active_adapter(fresh) is None
    assert not any(parameter.requires_grad for parameter in fresh.parameters())  # loaded for eval: frozen
    with torch.no_grad(), adapter(model, "fake_score"), adapter(fresh, "eval_score"):
        assert torch.equal(velocity(fresh, inputs), velocity(model, inputs))

    with pytest.raises(ValueError, match="already has a LoRA adapter 'eval_score'"):
        load_lora(fresh, path, name="eval_score")
    other_config = WorldPlayTransformer.from_preset("tiny", rope_theta=128)
    with pytest.raises(ValueError, match=r"config sha256 .*refusing"):
        load_lora(other_config, path)
    assert adapter_names(other_config) == []
    tensors = load_file(path)
    tensors.pop("double_blocks.0.img_attn_q.lora_B.weight")
    with safetensors.safe_open(str(path), framework="pt") as handle:
        metadata = handle.metadata()
    save_file(tensors, tmp_path / "broken.safetensors", metadata=metadata)
    with pytest.raises(StateDictMismatchError, match="double_blocks.0.img_attn_q.lora_B.weight"):
        load_lora(make_model("tiny"), tmp_path / "broken.safetensors")
    save_file(tensors, tmp_path / "foreign.safetensors", metadata={"format": "something else"})
    with pytest.raises(ValueError, match="not a Teacher LoRA adapter file"):
        load_lora(make_model("tiny"), tmp_path / "foreign.safetensors")
    assert json.loads(metadata["lora_config"])["name"] == "fake_score"


def test_copy_and_delete(inputs):
    model = make_model("tiny").eval()
    add_lora(model, "real_score", rank=4, alpha=4, trainable=False)
    randomize_lora_(model, "real_score", 8)
    copy_lora(model, "real_score", "fake_score")
    assert adapter_names(model) == ["real_score", "fake_score"]
    assert all(parameter.requires_grad for parameter in lora_parameters(model, "fake_score"))
    assert not any(parameter.requires_grad for parameter in lora_parameters(model, "real_score"))
    with torch.no_grad():
        with adapter(model, "real_score"):
            real = velocity(model, inputs)
        with adapter(model, "fake_score"):
            assert torch.equal(velocity(model, inputs), real)
        set_active_adapter(model, "real_score")
        delete_lora(model, "real_score")
        assert adapter_names(model) == ["fake_score"] and active_adapter(model) is None
        assert not any(".real_score." in name for name, _ in model.named_parameters())
        with adapter(model, "fake_score"):
            assert torch.equal(velocity(model, inputs), real)


# ---------------------------------------------------------------------------------------------------------------
# 5. Parameter count on the meta device
# ---------------------------------------------------------------------------------------------------------------
def test_rank64_lora_on_the_480p_teacher_is_counted_on_meta():
    def formula(hidden, mlp, depth, rank, prope):
        square = (4 + prope) * rank * (2 * hidden)  # q, k, v, proj (+ prope_proj): hidden -> hidden
        return depth * (square + 2 * rank * (hidden + mlp))  # fc1: hidden -> mlp, fc2: mlp -> hidden

    assert count_lora_parameters("worldplay_480p_i2v", rank=64) == formula(2048, 8192, 54, 64, 1) == 141_557_760
    assert count_lora_parameters("worldplay_480p_i2v", 64, LORA_TARGETS_WITHOUT_PROPE) == 127_401_984
    tiny = make_model("tiny")
    assert count_lora_parameters(dict(tiny.config), rank=3) == formula(64, 256, 2, 3, 1)
    add_lora(tiny, "student", rank=3, alpha=3)
    assert sum(parameter.numel() for parameter in lora_parameters(tiny, "student")) == formula(64, 256, 2, 3, 1)


# ---------------------------------------------------------------------------------------------------------------
# 6. Activation checkpointing of the Teacher's blocks
# ---------------------------------------------------------------------------------------------------------------
def _forward_backward(model, inputs):
    output = velocity(model, inputs)
    F.mse_loss(output, inputs["target"]).backward()
    grads = {name: parameter.grad.clone() for name, parameter in model.named_parameters() if parameter.grad is not None}
    model.zero_grad(set_to_none=True)
    return output.detach(), grads


def test_checkpointing_is_off_by_default_and_changes_neither_outputs_nor_gradients(inputs):
    model = make_model("tiny").train()
    assert model.gradient_checkpointing is False and not model.is_gradient_checkpointing
    reference, reference_grads = _forward_backward(model, inputs)
    model.set_gradient_checkpointing(True)
    assert model.is_gradient_checkpointing
    output, grads = _forward_backward(model, inputs)
    assert torch.equal(output, reference)
    assert sorted(grads) == sorted(reference_grads)
    assert {f"double_blocks.1.{target}.weight" for target in LORA_TARGETS} <= set(grads)
    assert all(torch.equal(grads[name], reference_grads[name]) for name in grads)
    with torch.no_grad():
        assert torch.equal(velocity(model, inputs), reference)
    model.disable_gradient_checkpointing()
    assert model.gradient_checkpointing is False
    with pytest.raises(ValueError, match="non-reentrant"):
        model.enable_gradient_checkpointing(lambda *args: None)


def test_checkpointing_through_the_context_prefill_keeps_outputs_and_gradients():
    """A trainer that learns its context (df_sft, kd) back-propagates through `context_prefill`: checkpointing its
    blocks too changes neither the velocity nor any gradient."""
    results, prefill_calls = [], []
    for checkpointed in (False, True):
        model = make_model("tiny").train()
        model.set_gradient_checkpointing(checkpointed)
        generator = torch.Generator().manual_seed(11)
        with torch.no_grad():
            text_kv = model.text_prefill(**text_inputs(model, generator))
        context = image_inputs(model, 3, generator, 14.0)
        tokens = []  # of every image-stream pass of block 0: the prefill's are its 3 context frames'
        model.double_blocks[0].img_attn_proj.register_forward_pre_hook(
            lambda module, inputs: tokens.append(inputs[0].shape[1]))
        context_kv, _ = model.context_prefill(**context, text_kv=text_kv)
        output = model.chunk_step(**image_inputs(model, 2, generator, 700.0), text_kv=text_kv, context_kv=context_kv)
        output.square().mean().backward()
        results.append((output.detach(), {name: p.grad.clone() for name, p in model.named_parameters()
                                          if p.grad is not None}))
        prefill_calls.append(tokens.count(context["hidden_states"][0, 0].numel()))
    assert prefill_calls == [1, 2]  # checkpointed: block 0 of the prefill ran again in backward
    (reference, reference_grads), (output, grads) = results
    assert torch.equal(output, reference)
    assert sorted(grads) == sorted(reference_grads)
    assert all(torch.equal(grads[name], reference_grads[name]) for name in grads)
    assert "double_blocks.0.img_attn_k.weight" in grads  # reached through the context K/V only in block 0's keys


def test_checkpointing_with_lora_recomputes_with_the_forward_adapter(inputs):
    """train mode with LoRA dropout: the recomputation replays the dropout masks and the adapter, even when
    backward runs after the `with adapter(...)` block (another adapter active by then)."""
    results = []
    for checkpointed in (False, True):
        model = make_model("tiny").train()
        model.set_gradient_checkpointing(checkpointed)
        add_lora(model, "student", rank=4, alpha=4, dropout=0.2)
        add_lora(model, "fake_score", rank=4, alpha=4, dropout=0.2)
        randomize_lora_(model, "student", 9)
        randomize_lora_(model, "fake_score", 10)
        torch.manual_seed(0)
        with adapter(model, "student"):
            output = velocity(model, inputs)
        with adapter(model, "fake_score"):
            F.mse_loss(output, inputs["target"]).backward()
        grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
        results.append((output.detach(), grads))
    (reference, reference_grads), (output, grads) = results
    assert torch.equal(output, reference)
    assert sorted(grads) == sorted(reference_grads)
    assert len(grads) == 2 * 2 * len(LORA_TARGETS) and all(".student." in name for name in grads)
    assert all(torch.equal(grads[name], reference_grads[name]) for name in grads)
