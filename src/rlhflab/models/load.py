"""Load tokenizers and causal LMs with `from_pretrained`, turning user mistakes into clear errors.

A policy, reference or reward trunk is an ordinary Hugging Face model from a local
folder or a hub id. Loading never calls `model.eval()`: the trainers decide the
mode; `disable_dropout` is what RL uses to make train mode deterministic.
"""

from __future__ import annotations

import json
import logging
import pickle
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase
from transformers import PreTrainedTokenizerFast
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    MODEL_FOR_MASKED_LM_MAPPING_NAMES,
)

from rlhflab.errors import UserInputError

logger = logging.getLogger(__name__)

DTYPES: dict[str, torch.dtype | str] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "auto": "auto",
}

# tokenizer_config.json classes that mean "use tokenizer.json exactly as stored"
_GENERIC_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def _looks_like_path(path_or_id: str) -> bool:
    """True for strings that can only be a filesystem path, never a hub id ("org/name")."""
    s = str(path_or_id)
    return s.startswith(("/", "./", "../", "~", ".\\")) or s.count("/") > 1 or "\\" in s or s in (".", "..")


def _model_folders_inside(path: Path) -> list[Path]:
    """The model folders of a run folder (RUN/model, or RUN/<stage>/model for a demo); [] for anything else."""
    if not path.is_dir() or (path / "config.json").exists():
        return []
    return [p for p in [path / "model", *sorted(path.glob("*/model"))] if (p / "config.json").exists()]


def _check_exists(path_or_id: str | Path, what: str) -> str:
    """Return the string form; raise for a local path that does not exist (before touching the hub)."""
    path = Path(path_or_id).expanduser()
    inside = _model_folders_inside(path)
    if inside:
        raise UserInputError(f"this is a run folder, not a {what} folder", where=str(path),
                             fix="pass one of its model folders: " + ", ".join(map(str, inside)))
    if path.exists():
        return str(path)
    if isinstance(path_or_id, Path) or _looks_like_path(str(path_or_id)):
        raise UserInputError(
            f"no {what} folder at this path",
            where=str(path),
            fix="check the path (a hub id such as 'org/name' needs network access or a warm HF cache)",
        )
    return str(path_or_id)


def _not_found(s: str, what: str, err: Exception) -> UserInputError:
    return UserInputError(
        f"could not load the {what} ({type(err).__name__}: {err})",
        where=s,
        fix="give an existing local folder, or a hub id with network access "
        "(or HF_HUB_OFFLINE=1 with a warm cache)",
    )


def read_model_config(path_or_id: str | Path, what: str, dtype: str, trust_remote_code: bool):
    """Check the dtype name and the path, then load the folder's config. -> (path as str, config)."""
    if dtype not in DTYPES:
        raise UserInputError(f"unknown dtype {dtype!r}", where="dtype", fix=f"use one of {sorted(DTYPES)}")
    s = _check_exists(path_or_id, what)
    try:
        return s, AutoConfig.from_pretrained(s, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as err:
        raise _not_found(s, f"{what} config", err) from err


def _honour_declared_tokenizer_class(
    path: str, tokenizer: PreTrainedTokenizerBase, **kwargs
) -> PreTrainedTokenizerBase:
    """Reload with the generic class when the folder asks for it but AutoTokenizer chose another.

    transformers 5 forces the registered class for some model types (qwen2:
    `MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS` in tokenization_auto.py), and
    Qwen2Tokenizer rebuilds its own pre-tokenizer instead of the one in
    tokenizer.json — a different tokenization. A folder whose
    tokenizer_config.json says `TokenizersBackend` means "tokenizer.json as is".
    """
    config_file = Path(path) / "tokenizer_config.json"
    if not (config_file.is_file() and (Path(path) / "tokenizer.json").is_file()):
        return tokenizer
    declared = json.loads(config_file.read_text(encoding="utf-8")).get("tokenizer_class")
    if declared not in _GENERIC_TOKENIZER_CLASSES or type(tokenizer) is PreTrainedTokenizerFast:
        return tokenizer
    logger.info(
        "%s: AutoTokenizer chose %s but tokenizer_config.json declares %s; loading tokenizer.json unchanged",
        path, type(tokenizer).__name__, declared,
    )
    return PreTrainedTokenizerFast.from_pretrained(path, **kwargs)


def load_tokenizer(path_or_id: str | Path, *, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """Load a tokenizer; a tokenizer without pad uses eos as pad (with a warning)."""
    s = _check_exists(path_or_id, "tokenizer")
    try:
        tokenizer = AutoTokenizer.from_pretrained(s, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as err:
        raise _not_found(s, "tokenizer", err) from err
    if Path(s).is_dir():
        tokenizer = _honour_declared_tokenizer_class(s, tokenizer, trust_remote_code=trust_remote_code)
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise UserInputError(
                "the tokenizer has neither a pad token nor an eos token",
                where=s,
                fix="add one, e.g. tokenizer.add_special_tokens({'eos_token': '<|endoftext|>'}) "
                "and save it (then resize the model's embeddings)",
            )
        tokenizer.pad_token = tokenizer.eos_token
        logger.warning(
            "%s: tokenizer has no pad token; using eos %r as pad (pad == eos). EOS labels are built "
            "from sequence lengths, not from pad positions, so the real EOS is still trained.",
            s, tokenizer.eos_token,
        )
    return tokenizer


def is_encoder(config) -> bool:
    """A BERT-like encoder: a masked-LM model type not configured as a decoder.

    Encoders such as BERT are also listed for causal LM (BertLMHeadModel), but act as one
    only with is_decoder=True; otherwise every token reads the whole sequence both ways.
    """
    return getattr(config, "model_type", None) in MODEL_FOR_MASKED_LM_MAPPING_NAMES and not getattr(
        config, "is_decoder", False)


def _check_causal(config, s: str, trust_remote_code: bool) -> None:
    """Raise unless `config` describes a decoder-only causal LM."""
    model_type = getattr(config, "model_type", None)
    remote = trust_remote_code and "AutoModelForCausalLM" in (getattr(config, "auto_map", None) or {})
    encoder = is_encoder(config)  # loaded as a causal LM it would get a random head
    if remote or (model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and not encoder):
        return
    kind = "an encoder (masked LM)" if encoder else "not a causal LM"
    raise UserInputError(
        f"found model type {model_type!r} (architectures {getattr(config, 'architectures', None)}), "
        f"which is {kind}; expected a causal (decoder-only) language model loadable with AutoModelForCausalLM",
        where=s,
        fix="point to a decoder-only checkpoint such as Llama, Qwen2, GPT-2 or GPT-NeoX",
    )


def load_causal_lm(
    path_or_id: str | Path,
    *,
    dtype: str = "float32",
    trust_remote_code: bool = False,
    device: str | torch.device = "cpu",
) -> PreTrainedModel:
    """`AutoModelForCausalLM.from_pretrained` with checks; the train/eval mode is left as loaded."""
    s, config = read_model_config(path_or_id, "model", dtype, trust_remote_code)
    _check_causal(config, s, trust_remote_code)
    local = Path(s).is_dir()
    use_safetensors = True if local and any(Path(s).glob("*.safetensors")) else None
    try:
        model = AutoModelForCausalLM.from_pretrained(
            s,
            config=config,
            dtype=DTYPES[dtype],
            use_safetensors=use_safetensors,
            trust_remote_code=trust_remote_code,
        )
    except pickle.UnpicklingError as err:  # torch.load(weights_only=True) met something that is not a tensor
        raise UserInputError(
            "refused to load a pickled weights file holding more than tensors (it could run code)",
            where=s,
            fix="use a safetensors copy of the weights (model.safetensors) from a source you trust",
        ) from err
    return model.to(device)


def disable_dropout(model: nn.Module) -> nn.Module:
    """Set every dropout probability to 0: `nn.Dropout` modules, config fields, module attributes.

    Attention dropout is often a float read from the config at init and applied
    functionally (e.g. `LlamaAttention.attention_dropout`), so modules are patched too.
    """
    for module in model.modules():
        if isinstance(module, nn.modules.dropout._DropoutNd):
            module.p = 0.0
        for name, value in list(vars(module).items()):
            if _is_dropout_field(name, value):
                setattr(module, name, 0.0)
    config = getattr(model, "config", None)
    if config is not None:
        for cfg in {id(c): c for c in (config, config.get_text_config())}.values():
            for name, value in list(vars(cfg).items()):
                if _is_dropout_field(name, value):
                    setattr(cfg, name, 0.0)
    return model


def _is_dropout_field(name: str, value) -> bool:
    return ("dropout" in name or "pdrop" in name) and isinstance(value, (int, float)) and not isinstance(value, bool)


def count_parameters(model: nn.Module, trainable_only: bool = False) -> int:
    """Number of distinct parameters (tied weights counted once)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)
