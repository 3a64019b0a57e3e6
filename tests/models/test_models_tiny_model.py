"""Tiny models of each architecture: deterministic, and saved as ordinary HF folders."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlhflab.errors import UserInputError
from rlhflab.models import TINY_ARCHITECTURES, build_tiny_model, count_parameters, load_tokenizer, save_model_folder

TINY = dict(hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64, max_positions=64)


TEXTS = ["Add 3 and 4. Answer as RESULT: 7", "Write the word zebra", "into"]
ARCH_CLASSES = {
    "llama": "LlamaForCausalLM",
    "gpt2": "GPT2LMHeadModel",
    "qwen2": "Qwen2ForCausalLM",
    "gpt_neox": "GPTNeoXForCausalLM",
}


def padded_batch(tokenizer):
    batch = tokenizer(TEXTS, padding=True, return_tensors="pt")
    assert batch["attention_mask"].sum(1).tolist() != [batch["input_ids"].shape[1]] * 3  # really padded
    return batch


def test_table_names():
    assert list(TINY_ARCHITECTURES) == ["llama", "gpt2", "qwen2", "gpt_neox"]


@pytest.mark.parametrize("arch", list(TINY_ARCHITECTURES))
def test_save_and_load_back_with_plain_auto_classes(tmp_path, tokenizer, arch):
    model = build_tiny_model(tokenizer, arch=arch, **TINY)
    assert type(model).__name__ == ARCH_CLASSES[arch]
    assert model.dtype == torch.float32
    out = save_model_folder(tmp_path / arch, model, tokenizer)
    assert (out / "model.safetensors").is_file()
    assert not list(out.glob("*.bin"))

    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert type(loaded) is type(model)
    for cfg in (loaded.config, loaded.generation_config):
        assert (cfg.pad_token_id, cfg.eos_token_id, cfg.bos_token_id) == (0, 1, 1)
    batch = padded_batch(tokenizer)
    model.eval(), loaded.eval()
    with torch.no_grad():
        assert torch.equal(model(**batch).logits, loaded(**batch).logits)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, loaded.state_dict()[name]), name


@pytest.mark.parametrize(
    "arch",
    [
        a if a != "qwen2" else pytest.param(
            a,
            marks=pytest.mark.xfail(
                strict=True,
                reason="transformers 5 AutoTokenizer forces Qwen2Tokenizer for model_type qwen2, "
                "which replaces the pre-tokenizer stored in tokenizer.json; use load_tokenizer",
            ),
        )
        for a in TINY_ARCHITECTURES
    ],
)
def test_plain_auto_tokenizer_gives_same_ids(tmp_path, tokenizer, arch):
    out = save_model_folder(tmp_path / arch, build_tiny_model(tokenizer, arch=arch, **TINY), tokenizer)
    loaded = AutoTokenizer.from_pretrained(out)
    assert (loaded.pad_token_id, loaded.eos_token_id) == (0, 1)
    for text in TEXTS + ["into  there\n"]:
        assert loaded.encode(text) == tokenizer.encode(text), text


@pytest.mark.parametrize("arch", list(TINY_ARCHITECTURES))
def test_load_tokenizer_gives_same_ids_for_every_arch(tmp_path, tokenizer, arch):
    out = save_model_folder(tmp_path / arch, build_tiny_model(tokenizer, arch=arch, **TINY), tokenizer)
    loaded = load_tokenizer(out)
    assert loaded.get_vocab() == tokenizer.get_vocab()
    for text in TEXTS + ["into  there\n"]:
        assert loaded.encode(text) == tokenizer.encode(text), text


def test_deterministic_given_seed_and_rng_untouched(tokenizer):
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    a = build_tiny_model(tokenizer, seed=7, **TINY).state_dict()
    b = build_tiny_model(tokenizer, seed=7, **TINY).state_dict()
    c = build_tiny_model(tokenizer, seed=8, **TINY).state_dict()
    assert torch.equal(torch.random.get_rng_state(), before)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])


@pytest.mark.parametrize("arch", list(TINY_ARCHITECTURES))
def test_no_dropout_in_fresh_models(tokenizer, arch):
    model = build_tiny_model(tokenizer, arch=arch, **TINY)
    assert [m.p for m in model.modules() if isinstance(m, torch.nn.Dropout) and m.p > 0] == []
    fields = {k: v for k, v in vars(model.config).items() if "dropout" in k or "pdrop" in k}
    assert all(v == 0.0 for v in fields.values()), fields


def test_llama_parameter_count_exact(tokenizer):
    V, H, L, I = len(tokenizer), 32, 2, 64
    model = build_tiny_model(tokenizer, **TINY)
    # tied embedding + per layer (q, k, v, o; gate, up, down; 2 RMSNorms) + final norm
    assert count_parameters(model) == V * H + L * (4 * H * H + 3 * H * I + 2 * H) + H
    assert model.lm_head.weight is model.model.embed_tokens.weight
    untied = build_tiny_model(tokenizer, tie_word_embeddings=False, **TINY)
    assert count_parameters(untied) == count_parameters(model) + V * H


def test_default_sizes(tokenizer):
    cfg = build_tiny_model(tokenizer).config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads) == (96, 3, 4)
    assert (cfg.intermediate_size, cfg.max_position_embeddings, cfg.vocab_size) == (256, 256, len(tokenizer))


def test_bad_arguments(tokenizer):
    with pytest.raises(UserInputError, match="unknown tiny architecture 'mamba'"):
        build_tiny_model(tokenizer, arch="mamba")
    with pytest.raises(UserInputError, match="not a multiple"):
        build_tiny_model(tokenizer, hidden_size=30, num_heads=4)
