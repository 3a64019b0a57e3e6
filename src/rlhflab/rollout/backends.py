"""Generation backends behind one call: which engine samples the responses (docs/scaling-out.md "Generation backends and vLLM").

`generation_backend` in a config picks one (the `BACKENDS` table):
- `lean` (default): `rollout.generate` with the lean KV decoder for Llama / Qwen2 layouts (models/lean.py);
  any other model runs its own forward with a KV cache;
- `hf`: `rollout.generate` with the model's own forward and KV cache for every model: the same sampler and
  generator, so the same tokens as `lean` up to float rounding; the reference path when a lean result is in doubt;
- `vllm`: a vLLM engine on the training GPU, the policy's weights pushed into it (rollout/vllm_backend.py).

Whatever samples, the log-probs the loss uses are recomputed by the training model over the sampled tokens
(rollout/rollout.py), so ratio == 1 at the first minibatch holds for every backend.

A backend is bound to the model it generates for (`use_backend`, at setup, from the config); the places that
generate (rollout.collect_rollout, rollout.generate_answers, eval.kl_to_reference) call `generate_with(model,
...)`, which asks that model's backend. A model nobody bound uses `lean`. The binding is a weak reference: it
ends with the model and does not travel with a copy of it.
"""

from __future__ import annotations

import importlib.util
import weakref
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable, ContextManager, Protocol

import torch
from torch import Tensor

from rlhflab.data import left_pad
from rlhflab.errors import UserInputError
from rlhflab.parallel.world import launched_ranks
from rlhflab.rollout.generate import BatchPlace, Generated, GenerationSettings, generate, response_mask_after_eos


class GenerationBackend(Protocol):
    """What samples responses: prompts (token ids, unpadded) in, a `Generated` out."""

    name: str

    def generate(self, model: torch.nn.Module, prompts: list[list[int]], *, pad_id: int, eos_id: int,
                 settings: GenerationSettings, generator: torch.Generator | None = None,
                 place: BatchPlace | None = None) -> Generated: ...


@dataclass(frozen=True)
class DecoderBackend:
    """`rollout.generate` in this process: the lean decoder where the model's layout allows it (`lean`),
    else (or always, with `lean=False`) the model's own forward with its KV cache."""

    name: str
    lean: bool

    def generate(self, model, prompts, *, pad_id, eos_id, settings, generator=None, place=None) -> Generated:
        return generate(model, prompts, pad_id=pad_id, eos_id=eos_id, settings=settings, generator=generator,
                        lean=self.lean, place=place)


LEAN = DecoderBackend("lean", lean=True)
HF = DecoderBackend("hf", lean=False)

_BOUND: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> the backend that generates for it


def use_backend(model: torch.nn.Module, backend: GenerationBackend) -> None:
    """From now on `generate_with(model, ...)` samples with `backend`."""
    _BOUND[model] = backend


def backend_of(model: torch.nn.Module) -> GenerationBackend:
    return _BOUND.get(model, LEAN)


def generation_autocast(model: torch.nn.Module, autocast: Callable[[], ContextManager]) -> ContextManager:
    """`autocast()` where `model`'s backend samples with this process's torch (lean, hf), so sampling runs in the
    training forward's precision; vLLM samples in its own engine's dtype and is left alone. `model` None (a rank
    that holds no whole policy and does not generate): autocast, harmlessly."""
    in_process = model is None or isinstance(backend_of(model), DecoderBackend)
    return autocast() if in_process else nullcontext()


def generate_with(model: torch.nn.Module, prompts: list[list[int]], *, pad_id: int, eos_id: int,
                  settings: GenerationSettings, generator: torch.Generator | None = None,
                  place: BatchPlace | None = None) -> Generated:
    """Sample a response for every prompt with the backend bound to `model` (`lean` when none is); `place`:
    the prompts are one process's part of a global batch (rollout.generate.BatchPlace)."""
    return backend_of(model).generate(model, prompts, pad_id=pad_id, eos_id=eos_id, settings=settings,
                                      generator=generator, **({"place": place} if place is not None else {}))


# --- from a config ------------------------------------------------------------------------


def check_backend(cfg) -> None:
    """Refuse a backend that cannot run here, at config-check time (before any model loads).

    `cfg`: any config with GenerationBackendFields (and `device`)."""
    if cfg.generation_backend != "vllm":
        return
    if not 0.0 < cfg.vllm_gpu_memory_utilization < 1.0:
        raise UserInputError(f"vllm_gpu_memory_utilization must be in (0, 1), got {cfg.vllm_gpu_memory_utilization}",
                             "--vllm_gpu_memory_utilization",
                             "give the engine a share of the GPU and leave the rest to training, e.g. 0.3")
    processes = launched_ranks()[1]
    if processes > 1:  # trainers/online/loop.py: the held-out evaluation samples on rank 0 alone
        raise UserInputError(f"generation_backend vllm runs in one process; this run has {processes}. Rank 0 alone "
                             "samples the held-out evaluations, and a vLLM engine that rank 0 starts there by itself "
                             "(distributed_executor_backend external_launcher) would wait for the other ranks forever",
                             "--generation_backend vllm",
                             "launch one process, or use --generation_backend lean (the default) or hf with several")
    missing = []
    if importlib.util.find_spec("vllm") is None:
        missing.append("the vllm package (not installed)")
    if not torch.cuda.is_available():
        missing.append("a CUDA GPU (torch sees none)")
    if missing:
        raise UserInputError(f"generation_backend vllm needs {' and '.join(missing)}", "--generation_backend vllm",
                             "pip install 'rlhflab[vllm]' on a machine with a CUDA GPU, or use --generation_backend "
                             "lean (the default) or hf")
    if not (cfg.device == "auto" or cfg.device.startswith("cuda")):
        raise UserInputError(f"vLLM runs on the training GPU but --device is {cfg.device}", "--device",
                             "use --device auto or cuda, or --generation_backend lean")


def _vllm_from_config(cfg, model_path: str, max_model_len: int | None) -> GenerationBackend:
    from rlhflab.rollout.vllm_backend import VLLMBackend  # imports vllm: only when asked for

    return VLLMBackend(model_path=model_path, dtype=cfg.vllm_dtype, seed=cfg.seed,
                       gpu_memory_utilization=cfg.vllm_gpu_memory_utilization, sleep_mode=cfg.vllm_sleep_mode,
                       max_model_len=max_model_len, trust_remote_code=cfg.trust_remote_code)


BACKENDS = {
    "lean": lambda cfg, model_path, max_model_len: LEAN,
    "hf": lambda cfg, model_path, max_model_len: HF,
    "vllm": _vllm_from_config,
}


def backend_from_config(cfg, model_path: str, max_model_len: int | None = None) -> GenerationBackend:
    """The backend `cfg.generation_backend` names, for the model in folder (or hub id) `model_path`.

    `max_model_len`: longest prompt + response the run needs (vLLM sizes its KV cache by it); None = the
    model's own context length. A vLLM engine starts at its first generation, not here."""
    return BACKENDS[cfg.generation_backend](cfg, model_path, max_model_len)


# --- for engines that return token lists ------------------------------------------------------


def prompt_seeds(generator: torch.Generator | None, count: int) -> list[int]:
    """One sampling seed per prompt, drawn from the run's sampling generator (torch's global one when None),
    so an engine that seeds each request itself still samples reproducibly from the run's seed."""
    device = generator.device if generator is not None else "cpu"
    return torch.randint(0, 2**31 - 1, (count,), generator=generator, device=device).tolist()


def generated_from_tokens(prompts: list[list[int]], responses: list[list[int]], stopped_at_eos: list[bool], *,
                          pad_id: int, eos_id: int, device: torch.device | str,
                          sampler_logprobs: list[list[float]] | None = None) -> Generated:
    """Token lists from an engine -> `Generated`, laid out as `rollout.generate` lays it out.

    `responses[b]`: prompt b's sampled ids (with or without the EOS it stopped at); `stopped_at_eos[b]`: it
    stopped because it produced EOS (else it ran to the length cap). Queries are left-padded; responses are
    padded on the right to the longest one; the mask is True up to and including the first EOS and never on
    padding, even when pad == eos. `sampler_logprobs[b]`: the engine's log-prob of each of `responses[b]`'s
    tokens; NaN on a token it gave none for (an EOS the engine left out and that is appended here)."""
    rows = []
    for tokens, stopped in zip(responses, stopped_at_eos, strict=True):
        tokens = list(tokens)
        if stopped and (not tokens or tokens[-1] != eos_id):  # an engine may leave the stop token out
            tokens.append(eos_id)
        rows.append(tokens)
    width = max(1, max(len(r) for r in rows))
    response_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)  # (B, T)
    for b, tokens in enumerate(rows):
        response_ids[b, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
    lengths = torch.tensor([len(r) for r in rows])
    real = torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)  # (B, T) sampled, not padding
    response_mask = response_mask_after_eos(response_ids, eos_id) & real
    ended = ((response_ids == eos_id) & response_mask).any(dim=1)
    query_ids, query_mask = left_pad(prompts, pad_id)
    response_ids = response_ids.masked_fill(~response_mask, pad_id)
    sampled = None
    if sampler_logprobs is not None:
        sampled = torch.full(response_ids.shape, float("nan"))
        for b, row in enumerate(sampler_logprobs):
            sampled[b, : len(row)] = torch.tensor(row[: width], dtype=torch.float32)
        sampled = sampled.masked_fill(~response_mask, 0.0).to(device)
    to = lambda t: t.to(device)  # noqa: E731
    return Generated(to(query_ids), to(query_mask.bool()), to(response_ids), to(response_mask), to(ended), sampled)


def checkpoint_weights(model: torch.nn.Module):
    """(name, tensor) of every weight as a Hugging Face checkpoint of the plain model names it.

    For a peft model call it inside `models.merged_adapter(model)`: the adapted layers then hold W + scale * B @ A
    and the adapter tensors (`lora_*`) are left out; peft's wrapper names (`base_model.model.`, `.base_layer`,
    `modules_to_save.default.`) are removed, a module's unused original copy skipped. Tied weights come once.
    FSDP2 shards (DTensors) are gathered whole, one tensor at a time: a collective, so every rank iterates
    in step (they all generate at the same time)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    for name, tensor in base.named_parameters():
        parts = name.split(".")
        if any(p.startswith("lora_") for p in parts) or "original_module" in parts:
            continue
        whole = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
        yield name.replace(".base_layer", "").replace(".modules_to_save.default", ""), whole
