"""Policy, reference and value behind three calls, whatever the memory mode.

Memory modes (MISSION.md §3, docs/ppo.md "Memory modes"):
- full fine-tune: the reference is a frozen copy (resident), or reloaded from
  disk for each rollout's log-probs and freed again (`reference_mode="reload"`);
- LoRA policy: the reference is the same base with the adapter switched off;
- value: a scalar head on the policy's own trunk (`shared`), a separate value
  model (`separate`), or a second LoRA adapter + head on the same frozen base
  (`lora_adapter`), so policy, reference and value share one backbone; or no critic at
  all (`none`: GRPO, RLOO, REINFORCE), where values are None.
Dropout is off in every role: with dropout, ratio != 1 at the first minibatch.
Precision (models/precision.py): with a bf16 / fp16 `dtype` only frozen weights stay half (a LoRA
base, which is also the reference and the value adapter's trunk); adapters, heads and any whole-weight
model train in float32; log-probs are taken in float32, values in the head's float32. Mixed precision
(`precision`, models/precision.py): every forward of the roles, the rollout's, the reference's and the training
one alike, runs under the same autocast, so ratio == 1 and KL == 0 at the first step stay exact; log-probs are
still taken in float32 from the (then bf16 / fp16) logits.
Alignment: values[:, t] = V(prompt + response[:t]), read at the position whose input is the last
token before response token t, like the logits that predict it (tests/trainers/test_ppo_bf16.py).
Several processes (trainers/online/ranks.py): the forwards of the trained modules and of the reference
run through their engine (DDP, FSDP2: `engines`), and sampling may use another copy of the policy's
weights (FSDP2 holds shards: `generation_policy`).
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Callable, ContextManager, Iterator, TypeVar

import torch
from torch import Tensor

from rlhflab import models
from rlhflab.models.precision import MixedPrecision
from rlhflab.data import position_ids_from_mask


T = TypeVar("T")


def as_is(forward: Callable[[], T]) -> T:
    """One process: a forward runs as it is."""
    return forward()


@dataclass(frozen=True)
class Engines:
    """How the roles' forwards run: `trained(fn)` / `reference(fn)` return fn() run as a forward of the engine
    that holds the trained modules (policy, value) / the frozen reference (DDP's gradient hooks, FSDP2's
    shard gathering); as is in one process."""

    trained: Callable[[Callable[[], T]], T] = as_is
    reference: Callable[[Callable[[], T]], T] = as_is


def joined(query_ids: Tensor, query_mask: Tensor, response_ids: Tensor, response_mask: Tensor):
    """(B, P) + (B, T) -> input_ids, attention_mask, position_ids over (B, P+T)."""
    input_ids = torch.cat([query_ids, response_ids], dim=1)
    attention = torch.cat([query_mask, response_mask], dim=1).long()
    return input_ids, attention, position_ids_from_mask(attention)


class PolicyRoles:
    """The trained policy (+ value) and the frozen reference, in one of the memory modes."""

    def __init__(
        self,
        policy: torch.nn.Module,
        *,
        value_mode: str = "shared",
        value_head: torch.nn.Module | None = None,
        value_model: torch.nn.Module | None = None,
        reference: torch.nn.Module | None = None,
        load_reference: Callable[[], torch.nn.Module] | None = None,
        lora: bool = False,
        merge_lora_for_generation: bool = False,
        lean: bool = True,
        precision: MixedPrecision | None = None,
    ):
        self.policy = policy
        self.value_mode = value_mode
        self.value_head = value_head
        self.value_model = value_model
        self.reference = reference
        self.load_reference = load_reference
        self.lora = lora
        self.merge_lora_for_generation = lora and merge_lora_for_generation
        self.lean = lean  # policy / reference forwards through models.lean where the model allows it
        self.precision = precision or MixedPrecision()  # autocast of every forward here; fp16's loss scaler
        self.engines = Engines()
        # what samples: the policy itself, or (FSDP2) a context giving a whole-weight copy of it
        self.generation_policy: Callable[[], ContextManager[torch.nn.Module]] | None = None
        for module in (policy, value_model, reference):
            if module is not None:
                models.disable_dropout(module)
        if reference is not None:
            reference.requires_grad_(False).eval()

    # --- trainable state ---------------------------------------------------------------

    def modules(self) -> list[torch.nn.Module]:
        return [m for m in (self.policy, self.value_head, self.value_model) if m is not None]

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        seen, params = set(), []
        for module in self.modules():
            for p in module.parameters():
                if p.requires_grad and id(p) not in seen:
                    seen.add(id(p))
                    params.append(p)
        return params

    def train(self, mode: bool = True) -> None:
        for module in self.modules():
            if module.training != mode:  # Module.train walks every submodule: ~1 ms a call on the demo model
                module.train(mode)

    # --- forward passes ----------------------------------------------------------------

    def generation_weights(self):
        """Context for sampling: LoRA merged into temporary weight copies when asked (models.merged_adapter)."""
        return models.merged_adapter(self.policy) if self.merge_lora_for_generation else nullcontext()

    @contextmanager
    def sampler(self) -> Iterator[torch.nn.Module]:
        """The model that samples responses, with the current weights (LoRA merged when asked)."""
        if self.generation_policy is None:
            with self.generation_weights():
                yield self.policy
            return
        with self.generation_policy() as whole:
            with models.merged_adapter(whole) if self.merge_lora_for_generation else nullcontext():
                yield whole

    def _policy_adapter(self):
        return models.use_adapter(self.policy, "default") if self.value_mode == "lora_adapter" else nullcontext()

    def _lm(self, model, input_ids, attention, positions, keep: int, hidden: bool = False
            ) -> tuple[Tensor | models.HeadInputs, Tensor | None]:
        """What predicts the last `keep` positions and their (B, keep, H) final hidden states. From `models.lean`
        for a Llama-layout model (same math, less overhead; its last layer runs those positions only), else the
        model's trunk; either way `models.HeadInputs` (the hidden states and the output layer: log-probs are taken
        chunk by chunk at a large vocabulary, models/token_head.py). (B, keep, V) logits from the model's own
        forward where the output layer is not a plain one or is sharded (hidden states then only if asked)."""
        plan = models.plan_lean(model, allow_training=True) if self.lean else None
        if plan is not None and plan.lm_head is not None:
            length = input_ids.shape[1]
            read = torch.arange(length - keep, length, device=input_ids.device).expand(input_ids.shape[0], keep)
            states = models.lean_hidden(plan, input_ids, attention, positions, read=read)
            return models.HeadInputs.of(states, plan.lm_head), states
        layers = models.output_layer(model)
        if layers is not None:
            trunk, head = layers
            states = trunk(input_ids=input_ids, attention_mask=attention, position_ids=positions,
                           use_cache=False).last_hidden_state[:, -keep:]
            return models.HeadInputs.of(states, head), states
        out = model(input_ids=input_ids, attention_mask=attention, position_ids=positions,
                    output_hidden_states=hidden, logits_to_keep=keep)
        return out.logits, out.hidden_states[-1][:, -keep:] if hidden else None

    def _response_logits(self, model, query_ids, query_mask, response_ids, response_mask) -> Tensor | models.HeadInputs:
        """What predicts each response token ((B, T) positions; see `_lm`). Without a critic the rows are packed
        back to back with no padding (models/shared_prompt.py), a batch that repeats prompts (k answers each)
        running each distinct prompt once: on the demo's rollouts (a third of a padded row is padding) a k = 1
        forward + backward of the trunk took 97 ms packed against 114 padded, and as long with no padding at
        all (113 against 112; 1 thread, 64 rows). With a critic, policy and reference keep the same joined-row
        forward, so KL == 0 at the start stays exact."""
        plan = models.plan_lean(model, allow_training=True) if self.lean else None
        if self.value_mode == "none" and plan is not None and plan.lm_head is not None:
            groups = models.distinct_prompts(query_ids, query_mask, every=True)
            if groups is not None and bool(query_mask.any(dim=1).all()):  # an empty prompt has no last token
                return models.shared_prompt_logits(plan, query_ids, query_mask, response_ids, response_mask, *groups)
        input_ids, attention, positions = joined(query_ids, query_mask, response_ids, response_mask)
        keep = response_ids.shape[1] + 1  # the LM head runs on the last prompt position and the responses only
        return self._lm(model, input_ids, attention, positions, keep)[0][:, -keep:-1]

    def policy_forward(self, query_ids, query_mask, response_ids, response_mask
                       ) -> tuple[Tensor | models.HeadInputs, Tensor | None]:
        """What predicts each response token ((B, T) positions: `models.HeadInputs`, or (B, T, V) logits) and,
        for a shared trunk, values (B, T)."""
        if self.value_mode != "shared":
            with self._policy_adapter():
                return self._response_logits(self.policy, query_ids, query_mask, response_ids, response_mask), None
        input_ids, attention, positions = joined(query_ids, query_mask, response_ids, response_mask)
        keep = response_ids.shape[1] + 1  # the LM head runs on the last prompt position and the responses only
        logits, hidden = self._lm(self.policy, input_ids, attention, positions, keep, hidden=True)
        return logits[:, :-1], self.value_head(hidden[:, :-1])

    def values(self, query_ids, query_mask, response_ids, response_mask) -> Tensor | None:
        """V(s_t) for every response token, from the value model or value adapter (B, T); None without a critic."""
        if self.value_mode == "none":
            return None
        input_ids, attention, positions = joined(query_ids, query_mask, response_ids, response_mask)
        start = query_ids.shape[1] - 1
        if self.value_mode == "separate":  # the last prompt position and the responses
            return self.value_model(input_ids, attention, positions, keep=response_ids.shape[1] + 1,
                                    lean=self.lean)[:, :-1]
        with models.use_adapter(self.policy, "value"):
            hidden = models.last_hidden_state(self.policy, input_ids, attention, positions)
        return self.value_head(hidden[:, start:-1])

    def logprobs_and_values(self, query_ids, query_mask, response_ids, response_mask, temperature: float,
                            entropy: bool = False, part: str = "all", entropy_grad: bool = False
                            ) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        """log pi(a_t|s_t) (B, T) float32, the entropy (B, T) when asked (for logging: no gradient; with
        `entropy_grad`, for an entropy bonus: with its gradient, from the same log-softmax pass) and values
        (B, T) (None without a critic): one forward of the trained engine under the roles' autocast. The log-probs
        are taken inside that forward and adapter context, so the output layer runs there too (chunk by chunk at
        a large vocabulary: models/token_head.py); what trains is never a (B, T, V) float32 tensor here.
        `part`: "all", or with a separate value model only its forward ("value": no log-probs) or only the
        policy's ("policy": no values)."""
        if part != "all" and self.value_mode != "separate":
            raise ValueError(f"part={part!r} needs a separate value model, not value_mode={self.value_mode!r}")

        def forward():
            if part == "value":
                return None, None, self.values(query_ids, query_mask, response_ids, response_mask)
            with self._policy_adapter():
                if part == "policy":
                    scores, values = self.policy_forward(query_ids, query_mask, response_ids, response_mask)
                else:
                    scores, values = self._logits_and_values(query_ids, query_mask, response_ids, response_mask)
                if entropy or entropy_grad:
                    logprobs, entropies = models.token_logprobs_and_entropy(scores, response_ids, temperature,
                                                                            entropy_grad=entropy_grad)
                    return logprobs, entropies if entropy_grad else entropies.detach(), values
                return models.token_logprobs(scores, response_ids, temperature), None, values

        with self.precision.autocast():
            return self.engines.trained(forward)

    def logits_and_values(self, query_ids, query_mask, response_ids, response_mask
                          ) -> tuple[Tensor | models.HeadInputs, Tensor | None]:
        """What predicts each response token (`policy_forward`: `models.HeadInputs`, or (B, T, V) logits) and
        values (B, T) (None without a critic), from one forward of the trained engine under the roles' autocast;
        `logprobs_and_values` takes the log-probs inside that forward (what the loop uses)."""
        with self.precision.autocast():
            return self.engines.trained(
                lambda: self._logits_and_values(query_ids, query_mask, response_ids, response_mask))

    def _logits_and_values(self, query_ids, query_mask, response_ids, response_mask):
        logits, values = self.policy_forward(query_ids, query_mask, response_ids, response_mask)
        if values is None:
            values = self.values(query_ids, query_mask, response_ids, response_mask)
        return logits, values

    @torch.no_grad()
    def reference_logprobs(self, query_ids, query_mask, response_ids, response_mask, temperature: float) -> Tensor:
        """log pi_ref(a_t|s_t) for every response token (B, T), computed once per rollout, under the policy's own
        autocast (KL == 0 while policy == reference) and inside the reference's forward and adapter context."""
        args = (query_ids, query_mask, response_ids, response_mask)

        def logprobs_of(model) -> Tensor:
            return models.token_logprobs(self._response_logits(model, *args), response_ids, temperature)

        def adapters_off() -> Tensor:
            with models.adapters_off(self.policy):
                return logprobs_of(self.policy)

        with self.precision.autocast():
            if self.lora:  # the reference is the trained policy's own base
                return self.engines.trained(adapters_off)
            if self.reference is not None:
                return self.engines.reference(lambda: logprobs_of(self.reference))
            return logprobs_of(self.load_reference())  # reference_mode=reload: loaded for this call, then freed
