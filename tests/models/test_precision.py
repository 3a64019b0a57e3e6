"""Half precision: the lean forward and merged generation with float32 LoRA adapters on a bf16 base,
the RoPE check of the lean path, and whole-weight training kept in float32 (models/precision.py)."""

import types

import pytest
import torch

from rlhflab.data import left_pad, position_ids_from_mask
from rlhflab.models import apply_lora, merged_adapter
from rlhflab.models.lean import lean_hidden, plan_lean, plan_lean_decode
from rlhflab.models.precision import check_trainable_float32, float32_for_training
from rlhflab.rollout import GenerationSettings, generate

from tinyhf import EOS, PAD, build

PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12], [13, 14, 15]]
ULP_AT_ONE = 2.0**-7  # bf16 keeps 8 significant bits


def bf16_model(arch: str, lora: bool):
    """A tiny model in bf16; with `lora`, an adapter whose B is non-zero (peft keeps A / B in float32)."""
    model = build(arch).to(torch.bfloat16)
    if not lora:
        return model
    model = apply_lora(model, r=4, alpha=8)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.5)  # B starts at zero: make the adapter change the output
    return model.eval()


def batch():
    ids, mask = left_pad(PROMPTS, PAD)
    return ids, mask.bool(), position_ids_from_mask(mask.long())


@pytest.mark.parametrize("lora", [False, True], ids=["plain", "lora"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_lean_forward_agrees_with_hf_in_bf16(arch, lora):
    model = bf16_model(arch, lora)
    if lora:  # the case that raised: F.linear(x_bf16, A_fp32)
        assert {p.dtype for n, p in model.named_parameters() if "lora_" in n} == {torch.float32}
    ids, mask, positions = batch()
    with torch.no_grad():
        hf = model(input_ids=ids, attention_mask=mask.long(), position_ids=positions).logits
        plan = plan_lean(model)
        lean = plan.lm_head(lean_hidden(plan, ids, mask, positions))
    assert lean.dtype == hf.dtype == torch.bfloat16
    scale = hf[mask].float().abs().max().item()
    err = (lean[mask].float() - hf[mask].float()).abs().max().item()
    assert err <= 4 * ULP_AT_ONE * scale, (err, scale)  # a few bf16 steps at the logits' size
    greedy = GenerationSettings(max_new_tokens=6, do_sample=False)
    out = generate(model, PROMPTS, pad_id=PAD, eos_id=EOS, settings=greedy, lean=True)  # the LeanDecoder path
    assert out.response_ids.shape[0] == len(PROMPTS)


def test_lean_lora_linear_is_peft_bit_for_bit_in_bf16():
    """Same casts as peft's lora.Linear.forward: x to the adapter's dtype, the sum back to bf16."""
    model = bf16_model("llama", lora=True)
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    plan = plan_lean(model)
    x = torch.randn(3, 5, 32).to(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(plan.layers[0].q(x), layer(x))


def test_merged_generation_on_a_bf16_base_merges_like_peft_and_restores_the_base_bit_for_bit():
    import copy

    model = bf16_model("qwen2", lora=True)
    peft_merged = copy.deepcopy(model)
    peft_merged.merge_adapter()  # peft's own merge of the float32 deltas into bf16
    bases = {n: p for n, p in model.named_parameters() if "base_layer.weight" in n}
    originals = {n: (p.data_ptr(), p.detach().clone()) for n, p in bases.items()}
    expected = dict(peft_merged.named_parameters())
    with merged_adapter(model):
        for name, param in bases.items():
            assert param.dtype == torch.bfloat16
            assert torch.equal(param, expected[name]), name  # one rounding of W + BA, as peft does
            assert not torch.equal(param, originals[name][1]), name
        merged = generate(model, PROMPTS, pad_id=PAD, eos_id=EOS, lean=True,
                          settings=GenerationSettings(max_new_tokens=6, do_sample=False))
    for name, param in bases.items():
        assert param.data_ptr() == originals[name][0] and torch.equal(param, originals[name][1]), name
    assert merged.response_ids.shape[0] == len(PROMPTS)


def transformers4_config(config, rope_scaling):
    """What transformers 4.x keeps: `rope_scaling` (None = plain RoPE) and no `rope_parameters`."""
    fields = {k: v for k, v in config.to_dict().items() if k != "rope_parameters"}
    return types.SimpleNamespace(**fields, rope_scaling=rope_scaling)


@pytest.mark.parametrize("rope_scaling", [{"rope_type": "linear", "factor": 2.0}, {"type": "dynamic", "factor": 2.0}])
def test_scaled_rope_never_takes_the_lean_path(rope_scaling):
    from transformers import AutoModelForCausalLM

    from tinyhf import CONFIGS

    config = CONFIGS["llama"]()
    kind = rope_scaling.get("rope_type", rope_scaling.get("type"))
    config.rope_parameters = {**config.rope_parameters, "rope_type": kind, "factor": 2.0}  # transformers 5
    assert plan_lean(AutoModelForCausalLM.from_config(config).eval()) is None
    model = build("llama")
    plain = model.config
    model.config = transformers4_config(plain, None)
    assert plan_lean_decode(model) is not None  # 4.x plain RoPE: lean
    model.config = transformers4_config(plain, rope_scaling)
    assert plan_lean_decode(model) is None  # 4.x scaled RoPE: the model's own forward


def test_whole_weights_are_cast_to_float32_and_a_lora_base_stays_half():
    full = float32_for_training(build("llama").to(torch.bfloat16), "test model")
    assert {p.dtype for p in full.parameters()} == {torch.float32}
    lora = apply_lora(build("llama").to(torch.bfloat16), r=4, alpha=8)
    assert float32_for_training(lora, "test model") is lora
    assert {p.dtype for p in lora.parameters() if p.requires_grad} == {torch.float32}
    assert {p.dtype for p in lora.parameters() if not p.requires_grad} == {torch.bfloat16}


def test_an_optimiser_over_half_precision_weights_is_refused():
    from rlhflab.config import SFTConfig
    from rlhflab.trainers.setup import make_optimizer

    with pytest.raises(TypeError, match="half precision"):
        check_trainable_float32(build("llama").to(torch.float16).parameters())
    with pytest.raises(TypeError, match="half precision"):
        make_optimizer(build("llama").to(torch.bfloat16).parameters(), SFTConfig())
    frozen = build("llama").to(torch.bfloat16).requires_grad_(False)
    head = torch.nn.Linear(32, 1)
    assert len(make_optimizer([*frozen.parameters(), *head.parameters()], SFTConfig()).param_groups[0]["params"]) == 2
