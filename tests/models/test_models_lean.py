"""The lean forward and decode step (models/lean.py) against the model's own forward."""

import pytest
import torch

from rlhflab.rollout import GenerationSettings, generate
from rlhflab.models.lean import lean_hidden, plan_lean, plan_lean_decode
from rlhflab.models.lean_decoder import LeanDecoder

from tinyhf import EOS, PAD, build

PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12], [13, 14, 15]]  # left padding of 0, 4 and 3 tokens
GREEDY = GenerationSettings(max_new_tokens=10, do_sample=False)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_lean_greedy_tokens_equal_the_hf_loop(arch):
    model = build(arch)
    assert plan_lean_decode(model) is not None
    lean = generate(model, PROMPTS, pad_id=PAD, eos_id=EOS, settings=GREEDY, lean=True)
    hf = generate(model, PROMPTS, pad_id=PAD, eos_id=EOS, settings=GREEDY, lean=False)
    assert torch.equal(lean.response_ids, hf.response_ids)
    assert torch.equal(lean.response_mask, hf.response_mask)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_lean_prefill_and_steps_match_the_model_forward(arch):
    """The prefill's logits and each decode step's equal a full forward over prompt + tokens so far."""
    from rlhflab.data import left_pad, position_ids_from_mask

    model = build(arch)
    ids, mask = left_pad(PROMPTS, PAD)
    attention = mask.long()
    positions = position_ids_from_mask(attention)
    with torch.no_grad():
        decoder = LeanDecoder(plan_lean_decode(model), ids, mask, positions, 4)
        full = model(input_ids=ids, attention_mask=attention, position_ids=positions).logits[:, -1]
        assert torch.allclose(decoder.logits, full, atol=1e-5)
        tokens = torch.tensor([[20, 21, 22, 23]] * len(PROMPTS))
        for t in range(4):
            lean_logits = decoder.step(tokens[:, t])
            full_ids = torch.cat([ids, tokens[:, : t + 1]], dim=1)
            full_mask = torch.cat([attention, torch.ones_like(tokens[:, : t + 1])], dim=1)
            full = model(input_ids=full_ids, attention_mask=full_mask,
                         position_ids=position_ids_from_mask(full_mask)).logits[:, -1]
            assert torch.allclose(lean_logits, full, atol=1e-5), (t, (lean_logits - full).abs().max())


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_lean_hidden_matches_the_model_on_real_positions(arch):
    from rlhflab.data import left_pad, position_ids_from_mask

    model = build(arch)
    ids, mask = left_pad([[5, 6, 7, 1, 0, 0], [11, 12, 13, 14, 15, 16]], PAD)
    mask = mask.bool()
    mask[0, 4:] = False  # padding after EOS inside the row, as in a rollout
    positions = position_ids_from_mask(mask.long())
    with torch.no_grad():
        hf = model(input_ids=ids, attention_mask=mask.long(), position_ids=positions,
                   output_hidden_states=True).hidden_states[-1]
        lean = lean_hidden(plan_lean(model), ids, mask, positions)
    assert torch.allclose(lean[mask], hf[mask], atol=1e-5)
    assert torch.isfinite(lean).all()


def test_lean_hidden_float_mask_equals_the_bool_mask_bit_for_bit(monkeypatch):
    """A small mask goes to attention as an additive float mask made once (models.lean.attention_bias); a large
    one stays bool (scaled_dot_product_attention converts it per layer): the same numbers either way."""
    import rlhflab.models.lean as lean
    from rlhflab.data import left_pad, position_ids_from_mask

    model = build("llama")
    ids, mask = left_pad([[5, 6, 7, 8, 9], [11, 12]], PAD)
    positions = position_ids_from_mask(mask.long())
    with torch.no_grad():
        small = lean.lean_hidden(plan_lean(model), ids, mask, positions)
        assert lean.attention_bias(torch.ones(1, 2, 2, dtype=torch.bool), torch.float32).dtype == torch.float32
        monkeypatch.setattr(lean, "FLOAT_MASK_BELOW", 0)  # every mask counts as large: bool
        assert lean.attention_bias(torch.ones(1, 2, 2, dtype=torch.bool), torch.float32).dtype == torch.bool
        large = lean.lean_hidden(plan_lean(model), ids, mask, positions)
    assert torch.equal(small[mask.bool()], large[mask.bool()])


def test_attention_bias_is_zero_where_allowed_and_minus_infinity_elsewhere():
    from rlhflab.models.lean import attention_bias

    allowed = torch.tensor([[True, False], [True, True]])
    bias = attention_bias(allowed, torch.bfloat16)
    assert bias.dtype == torch.bfloat16
    assert bias.tolist() == [[0.0, float("-inf")], [0.0, 0.0]]


def test_lean_sampling_equals_the_hf_loop_with_the_same_generator():
    model = build("llama")
    settings = GenerationSettings(max_new_tokens=8, do_sample=True, temperature=0.7)
    a = generate(model, PROMPTS, pad_id=PAD, eos_id=EOS, settings=settings, generator=torch.Generator().manual_seed(0))
    b = generate(model, PROMPTS, pad_id=PAD, eos_id=EOS, settings=settings, generator=torch.Generator().manual_seed(0),
                 lean=False)
    assert torch.equal(a.response_ids, b.response_ids)


def test_models_without_the_llama_layout_keep_their_own_forward():
    assert plan_lean_decode(build("gpt2")) is None
    model = build("llama").train()  # dropout would be skipped by the lean step
    assert plan_lean_decode(model) is None


def test_an_active_lora_adapter_is_not_skipped():
    from rlhflab.models import apply_lora

    model = apply_lora(build("llama"), r=4, alpha=8, target_modules=["q_proj", "v_proj", "up_proj"])
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.5)  # B starts at zero: make the adapter change the output
    model.eval()
    lean = generate(model, PROMPTS, pad_id=PAD, eos_id=EOS, settings=GREEDY, lean=True)
    hf = generate(model, PROMPTS, pad_id=PAD, eos_id=EOS, settings=GREEDY, lean=False)
    with model.disable_adapter():
        base = generate(model, PROMPTS, pad_id=PAD, eos_id=EOS, settings=GREEDY, lean=False)
    assert torch.equal(lean.response_ids, hf.response_ids)
    assert not torch.equal(hf.response_ids, base.response_ids)  # the adapter does change the answer


def test_lean_reward_scores_equal_the_model_forward():
    from transformers import AutoModelForSequenceClassification

    from rlhflab.models import sequence_scores
    from tinyhf import CONFIGS

    torch.manual_seed(0)
    config = CONFIGS["llama"]()
    config.num_labels = 1
    reward_model = AutoModelForSequenceClassification.from_config(config).eval()
    assert plan_lean(reward_model) is not None and plan_lean(reward_model).lm_head is None
    ids = torch.tensor([[5, 6, 7, 1, 0, 0], [11, 12, 13, 14, 15, 1]])
    mask = ids != 0
    with torch.no_grad():
        lean = sequence_scores(reward_model, ids, mask, lean=True)
        hf = sequence_scores(reward_model, ids, mask)
    assert torch.allclose(lean, hf, atol=1e-5)


def test_decoder_fuses_small_plain_layers_only():
    """q / k / v (and gate / up) run as one matmul on concatenated weights when each part is a small plain
    Linear; the fused output equals the parts side by side. LoRA parts and large layers stay separate."""
    from rlhflab.models import apply_lora
    from rlhflab.models.lean import _linear
    from rlhflab.models.lean_decoder import side_by_side

    layer = plan_lean_decode(build("qwen2")).layers[0]  # Qwen2: q / k / v carry biases
    fused = side_by_side([layer.q, layer.k, layer.v])
    x = torch.randn(3, fused.weight.shape[1])
    assert fused.weight is not None and fused.bias is not None
    assert torch.allclose(fused(x), torch.cat([layer.q(x), layer.k(x), layer.v(x)], dim=-1), atol=1e-6)

    lora = plan_lean_decode(apply_lora(build("llama"), r=4, alpha=8, target_modules=["q_proj"]).eval())
    assert side_by_side([lora.layers[0].q, lora.layers[0].k]).weight is None
    big = torch.nn.Linear(1024, 1025)  # 2 x 1M elements: above the cap
    assert side_by_side([_linear(big), _linear(big)]).weight is None


def _decode_under_bf16(model, steps: int = 3) -> tuple[list[torch.Tensor], list]:
    """Logits of the prefill and `steps` decode steps under bf16 autocast, and the casts of weight-shaped tensors
    (aten::_to_copy on an input shaped like one of the model's matrices) in the last step."""
    from rlhflab.data import left_pad, position_ids_from_mask

    ids, mask = left_pad(PROMPTS, PAD)
    positions = position_ids_from_mask(mask.long())
    weight_shapes = {tuple(p.shape) for p in model.parameters() if p.dim() == 2}
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        decoder = LeanDecoder(plan_lean_decode(model), ids, mask, positions, steps)
        logits = [decoder.logits]
        for t in range(steps):
            with torch.profiler.profile(record_shapes=True) as prof:
                logits.append(decoder.step(torch.full((len(PROMPTS),), 20 + t)))
    casts = [e.input_shapes[0] for e in prof.events() if e.name == "aten::_to_copy" and e.input_shapes
             and tuple(e.input_shapes[0]) in weight_shapes]
    return logits, casts


@pytest.mark.parametrize("fuse", [True, False])
@pytest.mark.parametrize("lora", [False, True])
def test_decoding_under_autocast_casts_each_weight_once_for_the_same_logits(monkeypatch, fuse, lora):
    """Fused, folded, transposed and frozen (LoRA base) weights are cast to bf16 once per decoder, not at every
    step; the logits are the ones autocast gives casting them each step, bit for bit."""
    from peft import LoraConfig, get_peft_model

    import rlhflab.models.lean_decoder as lean_decoder

    model = build("qwen2")  # q / k / v with biases
    if lora:
        model = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False))
    if not fuse:
        monkeypatch.setattr(lean_decoder, "FUSE_BELOW_ELEMENTS", 0)
    once, casts_once = _decode_under_bf16(model)

    class EveryStep(lean_decoder.Precast):  # what autocast alone does
        def __init__(self, device_type):
            super().__init__(device_type)
            self.dtype = None

    monkeypatch.setattr(lean_decoder, "Precast", EveryStep)
    every, casts_every = _decode_under_bf16(model)
    assert all(torch.equal(a, b) for a, b in zip(once, every))
    assert once[-1].dtype == torch.bfloat16
    assert casts_once == [] and len(casts_every) >= 2 * 2  # o and down of both layers at least, cast again
