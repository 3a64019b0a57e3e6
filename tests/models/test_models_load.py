"""load_tokenizer / load_causal_lm error paths, disable_dropout, count_parameters."""

from __future__ import annotations

import logging

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import BertConfig, BertModel, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
from transformers import PreTrainedTokenizerFast

from rlhflab.errors import UserInputError
from rlhflab.models import build_tiny_model, count_parameters, disable_dropout, load_causal_lm, load_tokenizer
from rlhflab.models import save_model_folder

TINY = dict(hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64, max_positions=64)


def word_level_tokenizer(**special) -> PreTrainedTokenizerFast:
    vocab = {"a": 0, "b": 1, "<eos>": 2}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="a"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, **special)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory, tokenizer):
    out = tmp_path_factory.mktemp("tiny")
    return save_model_folder(out, build_tiny_model(tokenizer, **TINY), tokenizer)


def test_load_tokenizer_keeps_pad(tiny_folder, caplog):
    with caplog.at_level(logging.WARNING, logger="rlhflab.models.load"):
        tok = load_tokenizer(tiny_folder)
    assert (tok.pad_token_id, tok.eos_token_id) == (0, 1)
    assert [r for r in caplog.records if r.name == "rlhflab.models.load"] == []


def test_load_tokenizer_without_pad_uses_eos(tmp_path, caplog):
    word_level_tokenizer(eos_token="<eos>").save_pretrained(tmp_path)
    with caplog.at_level(logging.WARNING, logger="rlhflab.models.load"):
        tok = load_tokenizer(tmp_path)
    assert (tok.pad_token, tok.pad_token_id, tok.eos_token_id) == ("<eos>", 2, 2)
    messages = [r.getMessage() for r in caplog.records if r.name == "rlhflab.models.load"]
    assert len(messages) == 1 and "pad == eos" in messages[0]


def test_load_tokenizer_without_pad_or_eos_fails(tmp_path):
    word_level_tokenizer().save_pretrained(tmp_path)
    with pytest.raises(UserInputError, match="neither a pad token nor an eos token") as info:
        load_tokenizer(tmp_path)
    assert str(tmp_path) in str(info.value) and info.value.fix


def test_load_missing_path(tmp_path):
    missing = tmp_path / "no_such_model"
    for load in (load_causal_lm, load_tokenizer):
        with pytest.raises(UserInputError) as info:
            load(missing)
        assert str(missing) in str(info.value)
        assert "hub id" in str(info.value)
    with pytest.raises(UserInputError, match="no model folder"):
        load_causal_lm(str(missing))


def test_load_encoder_is_refused(tmp_path):
    cfg = BertConfig(vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)
    BertModel(cfg).save_pretrained(tmp_path)
    with pytest.raises(UserInputError, match="causal") as info:
        load_causal_lm(tmp_path)
    assert "'bert'" in str(info.value) and "BertModel" in str(info.value)


def test_load_causal_lm_round_trip_and_dtypes(tiny_folder, tokenizer):
    built = build_tiny_model(tokenizer, **TINY)
    model = load_causal_lm(tiny_folder)
    assert type(model).__name__ == "LlamaForCausalLM" and model.dtype == torch.float32
    ids = torch.tensor([tokenizer.encode("Add 3 and 4.")])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, built.eval()(ids).logits)
    assert load_causal_lm(tiny_folder, dtype="bfloat16").dtype == torch.bfloat16
    assert load_causal_lm(tiny_folder, dtype="float16").dtype == torch.float16
    assert load_causal_lm(tiny_folder, dtype="auto").dtype == torch.float32
    with pytest.raises(UserInputError, match="unknown dtype 'fp32'"):
        load_causal_lm(tiny_folder, dtype="fp32")


def test_disable_dropout_gpt2():
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=40, n_embd=16, n_layer=2, n_head=2, n_positions=16,
                                       resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1, bos_token_id=0,
                                       eos_token_id=0))
    assert sum(isinstance(m, torch.nn.Dropout) and m.p == 0.1 for m in model.modules()) == 7
    assert disable_dropout(model) is model
    assert [m.p for m in model.modules() if isinstance(m, torch.nn.Dropout) and m.p > 0] == []
    assert (model.config.resid_pdrop, model.config.embd_pdrop, model.config.attn_pdrop) == (0.0, 0.0, 0.0)
    assert model.config.summary_first_dropout == 0.0
    model.train()
    ids = torch.arange(10).unsqueeze(0)
    assert torch.equal(model(ids).logits, model(ids).logits)  # train mode is now deterministic


def test_disable_dropout_functional_attention_dropout():
    cfg = LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, attention_dropout=0.1, pad_token_id=0, bos_token_id=0, eos_token_id=0)
    model = LlamaForCausalLM(cfg)
    assert model.model.layers[0].self_attn.attention_dropout == 0.1
    disable_dropout(model)
    assert model.model.layers[0].self_attn.attention_dropout == 0.0
    assert model.config.attention_dropout == 0.0


def test_count_parameters_trainable_only(tokenizer):
    model = build_tiny_model(tokenizer, **TINY)
    total = count_parameters(model)
    model.model.embed_tokens.weight.requires_grad_(False)
    assert count_parameters(model, trainable_only=True) == total - len(tokenizer) * 32
    assert count_parameters(model) == total


def test_a_run_folder_points_to_its_model_folder(tiny_folder, tmp_path):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(tiny_folder, run / "model")
    shutil.copytree(tiny_folder, tmp_path / "demo" / "sft" / "model")  # a demo: one model folder per stage
    for folder, inside in ((run, run / "model"), (tmp_path / "demo", tmp_path / "demo" / "sft" / "model")):
        for load in (load_causal_lm, load_tokenizer):
            with pytest.raises(UserInputError, match="run folder") as info:
                load(folder)
            assert str(inside) in str(info.value)
