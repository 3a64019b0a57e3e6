"""Build the tiny default model: a standard HF architecture at toy size.

Nothing downstream special-cases it: it is an ordinary `transformers` model,
saved as an ordinary folder (`config.json`, `generation_config.json`,
`model.safetensors`, tokenizer files) that `AutoModelForCausalLM` and
`AutoTokenizer` load unchanged.

The architecture is chosen in one table, `TINY_ARCHITECTURES`: name -> function
that turns the shared sizes into that family's config class.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    GPT2Config,
    GPTNeoXConfig,
    LlamaConfig,
    PreTrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Qwen2Config,
)

from rlhflab.errors import UserInputError


@dataclass(frozen=True)
class TinySizes:
    """The sizes every tiny architecture shares; token ids come from the tokenizer."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_positions: int
    tie_word_embeddings: bool
    pad_token_id: int
    eos_token_id: int
    bos_token_id: int


def _ids(s: TinySizes) -> dict:
    return {"pad_token_id": s.pad_token_id, "eos_token_id": s.eos_token_id, "bos_token_id": s.bos_token_id}


def llama_config(s: TinySizes) -> PreTrainedConfig:
    return LlamaConfig(
        vocab_size=s.vocab_size,
        hidden_size=s.hidden_size,
        intermediate_size=s.intermediate_size,
        num_hidden_layers=s.num_layers,
        num_attention_heads=s.num_heads,
        num_key_value_heads=s.num_heads,
        max_position_embeddings=s.max_positions,
        tie_word_embeddings=s.tie_word_embeddings,
        attention_dropout=0.0,
        **_ids(s),
    )


def gpt2_config(s: TinySizes) -> PreTrainedConfig:
    return GPT2Config(
        vocab_size=s.vocab_size,
        n_embd=s.hidden_size,
        n_inner=s.intermediate_size,
        n_layer=s.num_layers,
        n_head=s.num_heads,
        n_positions=s.max_positions,
        tie_word_embeddings=s.tie_word_embeddings,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        summary_first_dropout=0.0,
        **_ids(s),
    )


def qwen2_config(s: TinySizes) -> PreTrainedConfig:
    return Qwen2Config(
        vocab_size=s.vocab_size,
        hidden_size=s.hidden_size,
        intermediate_size=s.intermediate_size,
        num_hidden_layers=s.num_layers,
        num_attention_heads=s.num_heads,
        num_key_value_heads=s.num_heads,
        max_position_embeddings=s.max_positions,
        tie_word_embeddings=s.tie_word_embeddings,
        use_sliding_window=False,
        attention_dropout=0.0,
        **_ids(s),
    )


def gpt_neox_config(s: TinySizes) -> PreTrainedConfig:
    return GPTNeoXConfig(
        vocab_size=s.vocab_size,
        hidden_size=s.hidden_size,
        intermediate_size=s.intermediate_size,
        num_hidden_layers=s.num_layers,
        num_attention_heads=s.num_heads,
        max_position_embeddings=s.max_positions,
        tie_word_embeddings=s.tie_word_embeddings,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        classifier_dropout=0.0,
        **_ids(s),
    )


TINY_ARCHITECTURES: dict[str, Callable[[TinySizes], PreTrainedConfig]] = {
    "llama": llama_config,
    "gpt2": gpt2_config,
    "qwen2": qwen2_config,
    "gpt_neox": gpt_neox_config,
}


def build_tiny_model(
    tokenizer: PreTrainedTokenizerBase,
    arch: str = "llama",
    hidden_size: int = 96,
    num_layers: int = 3,
    num_heads: int = 4,
    intermediate_size: int = 256,
    max_positions: int = 256,
    tie_word_embeddings: bool = True,
    seed: int = 0,
) -> PreTrainedModel:
    """A freshly initialised fp32 causal LM sized for `tokenizer`, identical for equal seeds.

    pad / eos / bos ids are copied from the tokenizer into the config and the
    generation config. A tokenizer without BOS (ours) gets bos = eos, GPT-2's
    convention, so generating from an empty prompt has a start token.
    The global torch RNG is left as it was.
    """
    if arch not in TINY_ARCHITECTURES:
        raise UserInputError(
            f"unknown tiny architecture {arch!r}",
            where="arch",
            fix=f"use one of {sorted(TINY_ARCHITECTURES)}",
        )
    if hidden_size % num_heads != 0:
        raise UserInputError(
            f"hidden_size {hidden_size} is not a multiple of num_heads {num_heads}",
            where="hidden_size / num_heads",
            fix="pick a hidden_size divisible by num_heads",
        )
    if tokenizer.eos_token_id is None or tokenizer.pad_token_id is None:
        raise UserInputError(
            "the tokenizer needs both an eos and a pad token to build a model",
            fix="use rlhflab.models.load_tokenizer or build_tokenizer",
        )
    bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    sizes = TinySizes(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        intermediate_size=intermediate_size,
        max_positions=max_positions,
        tie_word_embeddings=tie_word_embeddings,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=bos,
    )
    config = TINY_ARCHITECTURES[arch](sizes)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(**_ids(sizes))
    return model


def save_model_folder(out_dir: str | Path, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> Path:
    """Write `model` (safetensors) and `tokenizer` into one ordinary HF folder; returns its path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)  # safetensors is the only format in transformers 5
    tokenizer.save_pretrained(out)
    return out
