"""Value models for PPO: a transformer trunk plus a scalar head, V(s_t) for every position.

Two layouts:
- `ValueModel`: its own backbone (`AutoModel`, no LM head) + `ValueHead`. It can
  start from the SFT model or from the reward model; from a reward model the head
  starts as the RM's `score` layer ("value initialised from the reward model",
  InstructGPT §3.5 / the N+ implementation details of RLHF with PPO, detail 8).
- a shared trunk: `last_hidden_state(policy, ...)` feeds a `ValueHead` on the policy.

A saved ValueModel folder is an ordinary `AutoModel` folder plus `value_head.safetensors`.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn
from transformers import AutoModel, AutoModelForSequenceClassification, PreTrainedModel

from rlhflab.errors import UserInputError
from rlhflab.models.lean import lean_hidden, plan_lean
from rlhflab.models.load import DTYPES, read_model_config

logger = logging.getLogger(__name__)

VALUE_HEAD_FILE = "value_head.safetensors"


def init_scalar_head(linear: nn.Linear) -> nn.Linear:
    """normal(0, 1/sqrt(H+1)) weight and zero bias: the init OpenAI's lm-human-preferences uses."""
    hidden_size = linear.weight.shape[-1]
    with torch.no_grad():
        linear.weight.normal_(mean=0.0, std=1.0 / math.sqrt(hidden_size + 1))
        if linear.bias is not None:
            linear.bias.zero_()
    return linear


class ValueHead(nn.Module):
    """(B, L, H) hidden states -> (B, L) values. A fresh head starts at zero (V = 0 everywhere): a random
    one's early value-loss gradients knocked the demo's validation pass rate from 0.57 to 0.40 in 10
    updates through a shared trunk, and TRL's random value head cost 0.07 held-out pass rate with the
    checker as reward against a zero one (benchmarks/RESULTS.md, "Held-out pass rate over 20 seeds").
    A reward model's score layer or a saved head replaces these weights when the value model starts
    from one."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.summary = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.summary.weight)
        nn.init.zeros_(self.summary.bias)

    def forward(self, hidden: Tensor) -> Tensor:
        # values in the head's dtype (fp32 by default) whatever the trunk's dtype, and outside any autocast (mixed
        # precision): an H -> 1 product costs nothing, and bf16 would round a value to ~3 significant digits
        with torch.autocast(hidden.device.type, enabled=False):
            return self.summary(hidden.to(self.summary.weight.dtype)).squeeze(-1)


def last_hidden_state(model: nn.Module, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor) -> Tensor:
    """(B, L, H) final hidden states of a causal LM (or PeftModel) — the trunk of a shared value head.

    `hidden_states[-1]` is the final-norm output, the same tensor the LM head reads.
    """
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        output_hidden_states=True,
        use_cache=False,
    )
    return out.hidden_states[-1]


def _is_reward_model(config) -> bool:
    return any(a.endswith("ForSequenceClassification") for a in (getattr(config, "architectures", None) or []))


class ValueModel(nn.Module):
    """A transformer backbone without LM head plus a `ValueHead`: V(s_t) for every position."""

    def __init__(self, backbone: PreTrainedModel, value_head: ValueHead | None = None):
        super().__init__()
        self.backbone = backbone
        hidden_size = backbone.config.get_text_config().hidden_size
        self.value_head = value_head if value_head is not None else ValueHead(hidden_size)

    @property
    def config(self):
        return self.backbone.config

    def forward(self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor, keep: int = 0,
                lean: bool = False) -> Tensor:
        """(B, L) token ids, bool/int mask, positions -> (B, L) values, or (B, keep) at the last `keep` positions.

        `lean`: a Llama-layout backbone runs as `models.lean.lean_hidden` (the same math, less overhead, its
        last layer at the kept positions only); only where its weights are whole (not FSDP2 / ZeRO-3 shards)."""
        plan = plan_lean(self.backbone, allow_training=True) if lean else None
        if plan is not None:
            length = input_ids.shape[1]
            keep = keep or length
            read = torch.arange(length - keep, length, device=input_ids.device).expand(input_ids.shape[0], keep)
            return self.value_head(lean_hidden(plan, input_ids, attention_mask, position_ids, read=read))
        hidden = self.backbone(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        ).last_hidden_state  # (B, L, H)
        return self.value_head(hidden[:, -keep:] if keep else hidden)

    @classmethod
    def from_pretrained(
        cls, path: str | Path, dtype: str = "float32", trust_remote_code: bool = False
    ) -> "ValueModel":
        """Load from a saved ValueModel, a causal-LM folder (fresh head) or a reward-model folder (head = score)."""
        s, config = read_model_config(path, "value model", dtype, trust_remote_code)
        kwargs = dict(dtype=DTYPES[dtype], trust_remote_code=trust_remote_code)
        head_file = Path(s) / VALUE_HEAD_FILE
        if head_file.is_file():
            model = cls(AutoModel.from_pretrained(s, **kwargs))
            model.value_head.load_state_dict(load_file(str(head_file)))
            return model
        if _is_reward_model(config) and getattr(config, "num_labels", None) == 1:
            reward_model = AutoModelForSequenceClassification.from_pretrained(s, **kwargs)
            model = cls(reward_model.base_model)
            if model.init_from_score(reward_model.score):
                logger.info("%s: value initialised from the reward model (backbone and score head)", s)
            return model
        return cls(AutoModel.from_pretrained(s, **kwargs))

    def init_from_score(self, score: nn.Linear) -> bool:
        """Copy a reward model's (1, H) score layer into the head; False when shapes differ."""
        head = self.value_head.summary
        if tuple(score.weight.shape) != tuple(head.weight.shape):
            return False
        with torch.no_grad():
            head.weight.copy_(score.weight)
            head.bias.copy_(score.bias if score.bias is not None else torch.zeros_like(head.bias))
        return True

    def save_pretrained(self, out_dir: str | Path) -> Path:
        """Backbone as an ordinary HF folder (safetensors) + `value_head.safetensors`."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        self.backbone.save_pretrained(out)
        state = {k: v.detach().cpu().contiguous() for k, v in self.value_head.state_dict().items()}
        save_file(state, str(out / VALUE_HEAD_FILE))
        return out
