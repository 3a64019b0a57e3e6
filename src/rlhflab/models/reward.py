"""Reward models: ordinary `*ForSequenceClassification` models with exactly one output.

Two kinds, each read the way its own architecture reads a sequence:
- decoder classifiers (Llama, Qwen2, GPT-2 ...: a `score` layer on a causal trunk):
  `sequence_scores` reads the score at the last REAL token (last position where the
  attention mask is 1), whatever the padding side. HF's own pooling looks for the
  last token that is not `pad_token_id`, which picks the wrong position when
  pad == eos (the real EOS looks like padding) and when the batch is left-padded
  with a pad id that also occurs in the text. Their text ends with EOS.
- encoder classifiers (BERT, MiniLM, RoBERTa ...): HF's own head, which pools the
  first token ([CLS]), on a right-padded batch. Their text is framed by the
  tokenizer's own special tokens (`special_tokens_frame`: [CLS] ... [SEP]), as
  `tokenizer(text)` frames one text; they have no EOS.
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path

import torch
from torch import Tensor, nn
from transformers.utils import logging as hf_logging
from transformers import AutoConfig, AutoModelForSequenceClassification, PreTrainedModel, PreTrainedTokenizerBase

from rlhflab.errors import UserInputError
from rlhflab.models.lean import lean_hidden, plan_lean
from rlhflab.models.packing import PackedPairs
from rlhflab.models.prompt_groups import PackedGroups
from rlhflab.models.load import DTYPES, _check_exists, _not_found, is_encoder, read_model_config, load_tokenizer
from rlhflab.models.tiny_model import build_tiny_model
from rlhflab.models.value import _is_reward_model, init_scalar_head

logger = logging.getLogger(__name__)


def _set_pad(model: PreTrainedModel, pad_token_id: int) -> None:
    for cfg in {id(c): c for c in (model.config, model.config.get_text_config())}.values():
        cfg.pad_token_id = pad_token_id


def _pad_id_from(tokenizer: PreTrainedTokenizerBase | None) -> int | None:
    if tokenizer is None:
        return None
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def load_reward_model(
    path: str | Path,
    dtype: str = "float32",
    trust_remote_code: bool = False,
    tokenizer: PreTrainedTokenizerBase | None = None,
) -> PreTrainedModel:
    """`AutoModelForSequenceClassification.from_pretrained` for a scalar reward model, with checks.

    `config.pad_token_id` is filled in from `tokenizer` (or the folder's own tokenizer) when missing.
    """
    s, config = read_model_config(path, "reward model", dtype, trust_remote_code)
    if not _is_reward_model(config):
        raise UserInputError(
            f"not a reward model: architectures {getattr(config, 'architectures', None)} has no "
            "*ForSequenceClassification",
            where=s,
            fix="train one with `rlhflab rm`, or build one from a causal LM or an encoder with build_reward_model",
        )
    if config.num_labels != 1:
        raise UserInputError(
            f"a reward model must have exactly one output; found {config.num_labels}",
            where=s,
            fix="use a scalar reward model (num_labels=1); a classifier with several labels is not a reward",
        )
    model = AutoModelForSequenceClassification.from_pretrained(
        s, config=config, dtype=DTYPES[dtype], trust_remote_code=trust_remote_code
    )
    if model.config.get_text_config().pad_token_id is None:
        if tokenizer is None and Path(s).is_dir() and (Path(s) / "tokenizer_config.json").is_file():
            tokenizer = load_tokenizer(s, trust_remote_code=trust_remote_code)
        pad = _pad_id_from(tokenizer)
        if pad is None:
            raise UserInputError(
                "the reward model's config has no pad_token_id and no tokenizer was given to take it from",
                where=s,
                fix="pass tokenizer=..., or set pad_token_id in config.json",
            )
        _set_pad(model, pad)
    return model


def build_reward_model(
    path_or_model: str | Path | PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    dtype: str = "float32",
    trust_remote_code: bool = False,
) -> PreTrainedModel:
    """A num_labels=1 `*ForSequenceClassification` on a pretrained trunk: a causal LM's (e.g. the SFT
    model) or an encoder's (e.g. BERT / MiniLM, whose pretrained pooler is kept).

    A given model object is copied, never shared. The output layer (`score`, BERT's `classifier`)
    is fresh: normal(0, 1/sqrt(H+1)), zero bias.
    """
    if isinstance(path_or_model, nn.Module):
        config = copy.deepcopy(path_or_model.config)
        config.num_labels = 1
        model = AutoModelForSequenceClassification.from_config(config, dtype=path_or_model.dtype)
        model.base_model.load_state_dict(path_or_model.base_model.state_dict())
    else:
        if dtype not in DTYPES:
            raise UserInputError(f"unknown dtype {dtype!r}", where="dtype", fix=f"use one of {sorted(DTYPES)}")
        s = _check_exists(path_or_model, "model")
        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # "score.weight MISSING" is the point here: we add the head
        try:
            model = AutoModelForSequenceClassification.from_pretrained(
                s, num_labels=1, dtype=DTYPES[dtype], trust_remote_code=trust_remote_code
            )
        except (OSError, ValueError) as err:
            raise _not_found(s, "causal LM for the reward model", err) from err
        finally:
            hf_logging.set_verbosity(verbosity)
    init_scalar_head(_output_layer(model))
    _set_pad(model, _pad_id_from(tokenizer))
    return model


build_reward_model_from_causal = build_reward_model  # its name from before encoders were accepted


# Decoder layouts whose trunk can grow and freeze: where the layers are on the base model, each layer's two
# residual outputs (attention, MLP), the projections whose zero makes the layer the identity whatever its residual
# form (sequential as Llama, or parallel as GPT-NeoX's default), and the base model's embeddings (tokens, and
# positions where they are learned).
TRUNK_LAYOUTS = (
    ("layers", ("self_attn.o_proj", "mlp.down_proj"), ("embed_tokens",)),  # Llama, Qwen2 and their kin
    ("layers", ("attention.dense", "mlp.dense_4h_to_h"), ("embed_in",)),  # GPT-NeoX (Pythia)
    ("h", ("attn.c_proj", "mlp.c_proj"), ("wte", "wpe")),  # GPT-2
)


def _decoder_layers(model: PreTrainedModel) -> tuple[nn.ModuleList, tuple[str, str], tuple[str, ...]] | None:
    """The trunk's decoder layers, their residual outputs' names and the embeddings' (TRUNK_LAYOUTS), or None."""
    for where, outputs, embeddings in TRUNK_LAYOUTS:
        layers = getattr(model.base_model, where, None)
        if isinstance(layers, nn.ModuleList) and len(layers) and all(
                _has_module(layer, name) for layer in layers for name in outputs):
            return layers, outputs, tuple(e for e in embeddings if hasattr(model.base_model, e))
    return None


def can_grow_trunk(model: PreTrainedModel) -> bool:
    """Whether `grow_trunk` and `freeze_lower_layers` know this model's layout (TRUNK_LAYOUTS)."""
    return _decoder_layers(model) is not None


def can_grow_saved_trunk(path: str, trust_remote_code: bool = False) -> bool:
    """`can_grow_trunk` for a saved or hub model, from its config alone: the classifier is built on the meta
    device (no weights read or allocated), so a stage can refuse a layout before hours of work upstream."""
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code, num_labels=1)
    with torch.device("meta"):
        model = AutoModelForSequenceClassification.from_config(config, trust_remote_code=trust_remote_code)
    return can_grow_trunk(model)


def _has_module(module: nn.Module, dotted: str) -> bool:
    try:
        module.get_submodule(dotted)
    except AttributeError:
        return False
    return True


def grow_trunk(model: PreTrainedModel, extra_layers: int) -> PreTrainedModel:
    """Append `extra_layers` decoder layers to a decoder classifier's trunk, each starting as the identity.

    A new layer is a copy of the last one with its two residual outputs (attention, MLP: TRUNK_LAYOUTS) zeroed,
    so the grown model scores every sequence exactly as before, and training starts from the trunk's own
    attention and MLP weights. The reward model then has more depth than the policy it judges, for checks the
    policy's trunk cannot make (a copied word against the prompt). Saved and loaded as an ordinary HF folder:
    `num_hidden_layers` (and `layer_types`) grow with it. Llama, Qwen2, GPT-NeoX and GPT-2 layouts (tested)."""
    if extra_layers <= 0:
        return model
    found = _decoder_layers(model)
    if found is None:
        raise UserInputError(f"{type(model).__name__} has no decoder layers of a known layout to grow (Llama / "
                             "Qwen2 / GPT-NeoX / GPT-2)", "--extra_layers",
                             "use one of those backbones, or --extra_layers 0")
    layers, outputs, _ = found
    if getattr(model.config, "scale_attn_by_inverse_layer_idx", False):  # GPT-2: a factor fixed at construction
        raise UserInputError("a GPT-2 trunk with scale_attn_by_inverse_layer_idx scales each layer's attention by its "
                             "index when built, so a grown layer would score differently once saved and reloaded",
                             "--extra_layers", "use --extra_layers 0 with this backbone")
    last = layers[-1]
    for _ in range(extra_layers):
        # the copy shares the model's HF config object (as every layer does), so later changes to it, e.g. the
        # attention implementation, reach the new layers too; the weights are copies
        shared = {id(m.config): m.config for m in last.modules() if hasattr(m, "config")}
        layer = copy.deepcopy(last, memo=dict(shared))
        with torch.no_grad():
            for out in (layer.get_submodule(name) for name in outputs):
                out.weight.zero_()
                if out.bias is not None:
                    out.bias.zero_()
        for module in layer.modules():  # the KV-cache slot the layer's attention writes during generation
            if isinstance(getattr(module, "layer_idx", None), int):
                module.layer_idx = len(layers)
        layers.append(layer)
    # the classifier's, its text part's and the trunk's config may be one object or several: each once
    for config in {id(c): c for c in (model.config, model.config.get_text_config(), model.base_model.config)}.values():
        config.num_hidden_layers = len(layers)
        if getattr(config, "layer_types", None):  # the trunk iterates layers[:num_hidden_layers] with these
            config.layer_types = list(config.layer_types) + [config.layer_types[-1]] * extra_layers
    return model


def freeze_lower_layers(model: PreTrainedModel, layers: int) -> PreTrainedModel:
    """Keep the embeddings (tokens, and positions where learned) and the first `layers` decoder layers of the
    trunk as they are (no gradient, no optimiser state): with a grown trunk (`grow_trunk`) the backbone's own
    layers can stay the policy's features while the new layers and the score head learn, and the backward pass
    stops above the frozen layers."""
    if layers <= 0:
        return model
    found = _decoder_layers(model)
    if found is None:
        raise UserInputError(f"--frozen_layers needs a trunk of decoder layers of a known layout (Llama / Qwen2 / "
                             f"GPT-NeoX / GPT-2); {type(model).__name__} has none", "--frozen_layers",
                             "use one of those backbones, or --frozen_layers 0")
    blocks, _, embeddings = found
    if layers > len(blocks):
        raise UserInputError(f"cannot freeze {layers} decoder layers: the trunk has {len(blocks)}", "--frozen_layers",
                             f"use at most {len(blocks)} (the backbone's layers plus --extra_layers), or 0")
    for module in (*(getattr(model.base_model, e) for e in embeddings), *blocks[:layers]):
        module.requires_grad_(False)
    return model


def _output_layer(model: PreTrainedModel) -> nn.Linear:
    """The layer that writes the one score: `score` (decoder classifiers), else the last one-output
    Linear outside the trunk (BERT's `classifier`, RoBERTa's `classifier.out_proj`)."""
    score = getattr(model, "score", None)
    if isinstance(score, nn.Linear):
        return score
    trunk = {id(m) for m in model.base_model.modules()}
    heads = [m for m in model.modules() if isinstance(m, nn.Linear) and m.out_features == 1 and id(m) not in trunk]
    if not heads:
        raise ValueError(f"{type(model).__name__} has no one-output Linear layer to use as the score head")
    return heads[-1]


def build_random_reward_model(
    tokenizer: PreTrainedTokenizerBase,
    arch: str = "llama",
    hidden_size: int = 32,
    num_layers: int = 2,
    num_heads: int = 4,
    intermediate_size: int = 64,
    seed: int = 0,
) -> PreTrainedModel:
    """A tiny randomly initialised scalar reward model for smoke runs; identical for equal seeds."""
    trunk = build_tiny_model(
        tokenizer, arch=arch, hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads,
        intermediate_size=intermediate_size, seed=seed,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build_reward_model_from_causal(trunk, tokenizer)


def last_real_index(attention_mask: Tensor) -> Tensor:
    """(B,) index of the last position where `attention_mask` is 1 (0 for an all-padding row)."""
    positions = torch.arange(attention_mask.shape[-1], device=attention_mask.device)
    return (positions * attention_mask.long()).argmax(-1)


def to_right_padding(input_ids: Tensor, attention_mask: Tensor) -> tuple[Tensor, Tensor]:
    """Move every row's real tokens to the front, in order (stable sort on "is padding")."""
    order = torch.argsort((attention_mask == 0).int(), dim=-1, stable=True)
    return input_ids.gather(-1, order), attention_mask.gather(-1, order)


def _unwrap(model: nn.Module) -> nn.Module:
    """The transformers model inside a PeftModel (LoRA layers stay in place and active)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def is_encoder_reward_model(reward_model: nn.Module) -> bool:
    """Whether the reward model is an encoder classifier (BERT-like): it reads its score at the first
    token and its text is framed by `special_tokens_frame`, not ended with EOS."""
    return is_encoder(getattr(_unwrap(reward_model), "config", None))


def _reads_last_token(model: nn.Module) -> bool:
    """A decoder classifier: a `score` layer on a base model, scored at the last real token."""
    return (isinstance(getattr(model, "score", None), nn.Module) and model.base_model is not model
            and not is_encoder(model.config))


def special_tokens_frame(tokenizer: PreTrainedTokenizerBase) -> tuple[list[int], list[int]]:
    """The ids `tokenizer` puts before and after one text with `add_special_tokens=True`:
    ([CLS], [SEP]) for BERT, ([<s>], [</s>]) for RoBERTa, ([BOS], []) for Llama.

    Read off a probe text rather than from `build_inputs_with_special_tokens`, which not every
    tokenizer class of transformers 5 has."""
    bare = tokenizer("a", add_special_tokens=False)["input_ids"]
    full = tokenizer("a", add_special_tokens=True)["input_ids"]
    for start in range(len(full) - len(bare) + 1):
        if full[start : start + len(bare)] == bare:
            return list(full[:start]), list(full[start + len(bare) :])
    raise ValueError(f"{type(tokenizer).__name__}: a text with special tokens does not contain the text without")


def sequence_scores(reward_model: nn.Module, input_ids: Tensor, attention_mask: Tensor, lean: bool = False) -> Tensor:
    """(B, L) ids and mask -> (B,) scores, any padding side.

    Decoder classifiers (a `score` layer on a base model): the trunk runs with explicit
    position_ids = cumsum(mask) - 1 (clamped at 0), so a left-padded row is positioned
    as if unpadded, and `score` is applied at the gathered last real position. Other
    models (BERT-like encoders pooling their first token, [CLS]) get a right-padded batch
    and `logits[:, 0]` from their own head; token_type_ids are left to the model's default
    (zeros), which is what the tokenizer gives one text. `lean` (no grad, eval mode, Llama
    layout): the trunk runs as `models.lean.lean_hidden`, the same math with less overhead
    (PPO's reward scoring).
    """
    model = _unwrap(reward_model)
    mask = attention_mask.long()
    if _reads_last_token(model):
        score, trunk = model.score, model.base_model
        position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
        plan = plan_lean(model) if lean and not torch.is_grad_enabled() else None
        if plan is not None:  # the last layer runs at the last real token only
            last = lean_hidden(plan, input_ids, mask, position_ids, read=last_real_index(mask)[:, None])[:, 0]
        else:
            hidden = trunk(
                input_ids=input_ids, attention_mask=mask, position_ids=position_ids, use_cache=False
            ).last_hidden_state  # (B, L, H)
            last = hidden[torch.arange(input_ids.shape[0], device=input_ids.device), last_real_index(mask)]  # (B, H)
        return score(last)[:, 0]
    ids, mask = to_right_padding(input_ids, mask)
    return model(input_ids=ids, attention_mask=mask).logits[:, 0]


def can_pack_pairs(reward_model: nn.Module) -> bool:
    """Whether `grouped_scores` (and `packed_pair_scores`) can score this model: a decoder classifier (`score` on a
    base model) whose trunk the lean forward runs (Llama layout; in training mode, no dropout)."""
    model = _unwrap(reward_model)  # an encoder reads both ways: packing two rests in one row would mix them
    return _reads_last_token(model) and plan_lean(model, allow_training=True) is not None


def packed_pair_scores(reward_model: nn.Module, packed: PackedPairs) -> tuple[Tensor, Tensor]:
    """(B,) scores of both sequences of each packed row (`models.pack_shared_prefix`), read at
    each one's last token: one forward over the shared prefix instead of two. Differentiable.
    Only for models where `can_pack_pairs` holds."""
    model = _unwrap(reward_model)
    plan = plan_lean(model, allow_training=True)
    if plan is None or not isinstance(getattr(model, "score", None), nn.Module):
        raise ValueError("packed_pair_scores needs a Llama-layout decoder classifier (see can_pack_pairs)")
    device = plan.embed.device
    read = torch.stack([packed.first_last, packed.second_last], dim=1).to(device)  # the last layer runs these only
    hidden = lean_hidden(plan, packed.input_ids.to(device), None, packed.position_ids.to(device),
                         allowed=packed.allowed.to(device), read=read)  # (B, 2, H)
    scores = model.score(hidden)[..., 0]
    return scores[:, 0], scores[:, 1]


def grouped_scores(reward_model: nn.Module, packed: PackedGroups) -> Tensor:
    """(N,) scores of the sequences of packed groups (`models.pack_groups`), read at each one's last token, every
    shared prefix run once. Differentiable. Only for models where `can_pack_pairs` holds."""
    model = _unwrap(reward_model)
    plan = plan_lean(model, allow_training=True)
    if plan is None or not isinstance(getattr(model, "score", None), nn.Module):
        raise ValueError("grouped_scores needs a Llama-layout decoder classifier (see can_pack_pairs)")
    device = plan.embed.device
    hidden = lean_hidden(plan, packed.input_ids.to(device), None, packed.position_ids.to(device),
                         allowed=packed.allowed(device), read=packed.read.to(device))  # (R, m, H)
    return model.score(hidden)[..., 0].reshape(-1).index_select(0, packed.score_index.to(device))
