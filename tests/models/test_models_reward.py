"""Reward models: load checks, build from a causal LM, and scores read at the last real token."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from transformers import BertConfig, BertForSequenceClassification

from rlhflab.errors import UserInputError
from rlhflab.models import build_random_reward_model, build_reward_model, build_tiny_model, grow_trunk
from rlhflab.models import build_tokenizer, last_real_index, load_reward_model, save_model_folder, sequence_scores
from rlhflab.tasks import template_corpus

TINY = dict(hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64)
TEXTS = ["Add 3 and 4.\nRESULT: 7", "yes", "red,fox,blue"]


@pytest.fixture(scope="module")
def suite_tokenizer():
    return build_tokenizer(template_corpus(), 256)


@pytest.fixture(scope="module")
def reward_model(suite_tokenizer):
    return build_random_reward_model(suite_tokenizer, **TINY, seed=3).eval()


@pytest.fixture(scope="module")
def reward_models(suite_tokenizer, reward_model):
    # gpt2 has learned absolute positions: wrong position_ids on a left-padded row change its score
    # (RoPE in llama is shift-invariant, so llama alone would not catch that)
    return {"llama": reward_model, "gpt2": build_random_reward_model(suite_tokenizer, arch="gpt2", **TINY).eval()}


def encode(tokenizer, texts):
    return [tokenizer.encode(t) + [tokenizer.eos_token_id] for t in texts]


def pad(rows, pad_id, side):
    length = max(map(len, rows))
    ids, mask = [], []
    for row in rows:
        fill = [pad_id] * (length - len(row))
        ids.append(fill + row if side == "left" else row + fill)
        mask.append([0] * len(fill) + [1] * len(row) if side == "left" else [1] * len(row) + [0] * len(fill))
    return torch.tensor(ids), torch.tensor(mask)


def manual_score(model, row):
    """Unpadded forward of one sequence, score of its last token, by hand."""
    hidden = model.base_model(input_ids=torch.tensor([row])).last_hidden_state[0, -1]
    return (hidden @ model.score.weight[0]).item()


def test_last_real_index():
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 0], [1, 0, 0, 0], [0, 1, 1, 0]])
    assert last_real_index(mask).tolist() == [3, 2, 0, 2]


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("pad_is_eos", [False, True])
def test_sequence_scores_ignore_padding(suite_tokenizer, reward_models, arch, pad_is_eos):
    model = reward_models[arch]
    pad_id = suite_tokenizer.pad_token_id
    if pad_is_eos:
        model = copy.deepcopy(model)
        pad_id = suite_tokenizer.eos_token_id
        model.config.pad_token_id = pad_id
    rows = encode(suite_tokenizer, TEXTS)
    with torch.no_grad():
        expected = [manual_score(model, row) for row in rows]
        alone = [sequence_scores(model, torch.tensor([row]), torch.ones(1, len(row))).item() for row in rows]
        left = sequence_scores(model, *pad(rows, pad_id, "left"))
        right = sequence_scores(model, *pad(rows, pad_id, "right"))
    assert alone == pytest.approx(expected, abs=1e-6)
    assert left.tolist() == pytest.approx(expected, abs=1e-5)
    assert right.tolist() == pytest.approx(expected, abs=1e-5)
    assert len(set(expected)) == 3  # the rows really score differently
    if pad_is_eos:  # HF's own pooling skips the real EOS when pad == eos: that is what we avoid
        with torch.no_grad():
            ids, mask = pad(rows, pad_id, "right")
            hf = model(input_ids=ids, attention_mask=mask).logits[:, 0]
        assert not torch.allclose(hf, right, atol=1e-3)


def test_sequence_scores_encoder_fallback_uses_first_token():
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=32, num_labels=1, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = BertForSequenceClassification(cfg).eval()
    rows = [[5, 6, 7, 8], [9, 10]]
    with torch.no_grad():
        expected = [model(torch.tensor([r])).logits[0, 0].item() for r in rows]
        left = sequence_scores(model, *pad(rows, 0, "left"))
    assert left.tolist() == pytest.approx(expected, abs=1e-5)


def test_build_reward_model_from_a_causal_lm_object(suite_tokenizer):
    causal = build_tiny_model(suite_tokenizer, **TINY)
    torch.manual_seed(0)
    model = build_reward_model(causal, suite_tokenizer)
    assert type(model).__name__ == "LlamaForSequenceClassification" and model.config.num_labels == 1
    assert model.score.weight.shape == (1, 32)
    assert abs(model.score.weight.std().item() - 1 / math.sqrt(33)) < 0.07
    assert torch.equal(model.model.embed_tokens.weight, causal.model.embed_tokens.weight)
    assert model.model.embed_tokens.weight.data_ptr() != causal.model.embed_tokens.weight.data_ptr()
    assert model.config.pad_token_id == suite_tokenizer.pad_token_id


def test_build_random_reward_model_is_seeded(suite_tokenizer):
    a = build_random_reward_model(suite_tokenizer, **TINY, seed=1)
    b = build_random_reward_model(suite_tokenizer, **TINY, seed=1)
    c = build_random_reward_model(suite_tokenizer, **TINY, seed=2)
    assert torch.equal(a.score.weight, b.score.weight)
    assert not torch.equal(a.score.weight, c.score.weight)


def test_load_reward_model_round_trip_and_pad(tmp_path, suite_tokenizer, reward_model):
    save_model_folder(tmp_path / "rm", reward_model, suite_tokenizer)
    loaded = load_reward_model(tmp_path / "rm").eval()
    ids, mask = pad(encode(suite_tokenizer, TEXTS), 0, "left")
    with torch.no_grad():
        assert torch.equal(sequence_scores(loaded, ids, mask), sequence_scores(reward_model, ids, mask))
    # a config without pad_token_id takes it from the given tokenizer
    nopad = copy.deepcopy(reward_model)
    nopad.config.pad_token_id = None
    nopad.save_pretrained(tmp_path / "nopad")
    with pytest.raises(UserInputError, match="no pad_token_id"):
        load_reward_model(tmp_path / "nopad")
    assert load_reward_model(tmp_path / "nopad", tokenizer=suite_tokenizer).config.pad_token_id == 0


def test_load_reward_model_refuses_two_labels(tmp_path, suite_tokenizer):
    model = build_random_reward_model(suite_tokenizer, **TINY)
    model.config.num_labels = 2
    model.save_pretrained(tmp_path / "two")
    with pytest.raises(UserInputError, match="a reward model must have exactly one output; found 2") as info:
        load_reward_model(tmp_path / "two")
    assert str(tmp_path / "two") in str(info.value)


def test_load_reward_model_refuses_causal_lm_and_missing_path(tmp_path, suite_tokenizer):
    save_model_folder(tmp_path / "sft", build_tiny_model(suite_tokenizer, **TINY), suite_tokenizer)
    with pytest.raises(UserInputError, match="not a reward model.*LlamaForCausalLM") as info:
        load_reward_model(tmp_path / "sft")
    assert "build_reward_model" in str(info.value)
    with pytest.raises(UserInputError, match="no reward model folder"):
        load_reward_model(tmp_path / "missing")


# per tiny architecture: where the trunk's layers are, a layer's residual outputs and one of its input projections
TRUNKS = {"llama": ("layers", ("self_attn.o_proj", "mlp.down_proj"), "self_attn.q_proj"),
          "qwen2": ("layers", ("self_attn.o_proj", "mlp.down_proj"), "self_attn.q_proj"),
          "gpt_neox": ("layers", ("attention.dense", "mlp.dense_4h_to_h"), "attention.query_key_value"),
          "gpt2": ("h", ("attn.c_proj", "mlp.c_proj"), "attn.c_attn")}


@pytest.mark.parametrize("arch", sorted(TRUNKS))
def test_grow_trunk_starts_as_the_same_scorer_and_saves_as_an_ordinary_folder(tmp_path, suite_tokenizer, arch):
    where, outputs, an_input = TRUNKS[arch]
    base = build_random_reward_model(suite_tokenizer, arch=arch, **TINY, seed=5).eval()
    grown = grow_trunk(copy.deepcopy(base), 2).eval()
    ids, mask = pad(encode(suite_tokenizer, TEXTS), suite_tokenizer.pad_token_id, "left")
    with torch.no_grad():
        before = sequence_scores(base, ids, mask)
        after, lean = sequence_scores(grown, ids, mask), sequence_scores(grown, ids, mask, lean=True)
    layers, base_last = getattr(grown.base_model, where), getattr(base.base_model, where)[-1]
    assert len(layers) == grown.config.num_hidden_layers == TINY["num_layers"] + 2
    assert torch.allclose(after, before, atol=1e-6) and torch.allclose(lean, before, atol=1e-5)
    new = layers[-1]
    assert not any(new.get_submodule(name).weight.any() for name in outputs)  # identity at the start
    assert torch.equal(new.get_submodule(an_input).weight, base_last.get_submodule(an_input).weight)
    assert new.get_submodule(outputs[0]).weight.data_ptr() != base_last.get_submodule(outputs[0]).weight.data_ptr()
    assert [m.layer_idx for m in new.modules() if hasattr(m, "layer_idx")] == [len(layers) - 1]  # its own cache slot
    with torch.no_grad():  # a trained grown model (nonzero new outputs) reloads as itself from its HF folder
        new.get_submodule(outputs[1]).weight.normal_(0, 0.5)
        changed = sequence_scores(grown, ids, mask)
    assert not torch.allclose(changed, before, atol=1e-4)
    save_model_folder(tmp_path / "rm", grown, suite_tokenizer)
    loaded = load_reward_model(tmp_path / "rm").eval()
    assert loaded.config.num_hidden_layers == TINY["num_layers"] + 2
    with torch.no_grad():
        assert torch.allclose(sequence_scores(loaded, ids, mask), changed, atol=1e-6)


def test_grown_layers_share_the_trunks_config_object(suite_tokenizer):
    grown = grow_trunk(build_random_reward_model(suite_tokenizer, arch="llama", **TINY), 1)
    assert grown.base_model.layers[-1].self_attn.config is grown.base_model.layers[0].self_attn.config


def test_grow_trunk_refuses_a_model_without_decoder_layers_it_knows():
    from transformers import BertConfig, BertForSequenceClassification

    bert = BertForSequenceClassification(BertConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                                    intermediate_size=32, vocab_size=40, num_labels=1))
    assert grow_trunk(bert, 0) is bert  # nothing asked, nothing checked
    with pytest.raises(UserInputError, match="extra_layers"):
        grow_trunk(bert, 1)


def test_grow_trunk_refuses_a_gpt2_trunk_that_scales_attention_by_layer_index(suite_tokenizer):
    gpt2 = build_random_reward_model(suite_tokenizer, arch="gpt2", **TINY)
    gpt2.config.scale_attn_by_inverse_layer_idx = True
    with pytest.raises(UserInputError, match="scale_attn_by_inverse_layer_idx"):
        grow_trunk(gpt2, 1)


def test_whether_a_saved_models_trunk_can_grow_is_read_from_its_config(tmp_path, suite_tokenizer):
    from transformers import OPTConfig, OPTForCausalLM

    from rlhflab.models import can_grow_saved_trunk

    save_model_folder(tmp_path / "llama", build_tiny_model(suite_tokenizer, **TINY), suite_tokenizer)
    opt = OPTForCausalLM(OPTConfig(vocab_size=len(suite_tokenizer), hidden_size=16, num_hidden_layers=1,
                                   ffn_dim=32, num_attention_heads=2, word_embed_proj_dim=16))
    save_model_folder(tmp_path / "opt", opt, suite_tokenizer)
    assert can_grow_saved_trunk(str(tmp_path / "llama")) and not can_grow_saved_trunk(str(tmp_path / "opt"))
