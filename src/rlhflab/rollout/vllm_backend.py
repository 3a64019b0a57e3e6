"""vLLM as the generation backend, colocated with training on the same GPU (docs/scaling-out.md "Generation backends and vLLM").

How it runs (the same scheme as TRL's `vllm_mode="colocate"`; vLLM docs "Sleep Mode"):
- one `vllm.LLM` inside the training process (`distributed_executor_backend="external_launcher"`, which reads
  the torch.distributed variables; the process gets rank 0 of 1: several processes are refused at the config
  check, rollout/backends.check_backend, since rank 0 alone samples the evaluations), on the
  training GPU, allowed `gpu_memory_utilization` of its memory; it starts at the first generation, from the
  policy's own folder, without a tokenizer (token ids in, token ids out);
- before every generation the policy's current weights are copied into the engine (`model.load_weights` through
  `LLM.apply_model`, Hugging Face names), so each rollout samples from the weights of the last update. Always,
  not only when they changed: a fused AdamW step does not bump a tensor's version counter, so staleness is not
  cheaply detectable, and a copy on the same GPU costs milliseconds. A LoRA policy sends its merged weights
  W + scale * B @ A for the adapted layers (models.merged_adapter: temporary copies, the frozen base, i.e. the
  reference, stays bit for bit);
- between generations the engine sleeps (level 1: its weights go to CPU memory, its KV cache is freed), so the
  training step gets that GPU memory back. Level 2 would also drop the weights; after a level-2 wake the
  weights are garbage until reloaded (vllm-project/vllm#29341), and level 1 needs no such care;
- sampling: the run's temperature / top-k / top-p / length cap, one seed per prompt drawn from the run's
  sampling generator, and a stop at the tokenizer's EOS only (`ignore_eos` + `stop_token_ids`: a model's
  generation_config may list other stop tokens, which our response masks would not treat as the end);
- the token ids come back as `Generated` (left-padded queries, mask up to and including the first EOS).
The loss's old log-probs are the training model's own over the sampled tokens (rollout/rollout.py), so the first
minibatch's ratio is exactly 1 whatever the engine's kernels; vLLM's log-probs of its tokens (processed: after
temperature / top-k / top-p) come back as `Generated.sampler_logprobs`, for the sampler / trainer mismatch metrics
and --sampler_correction.

This module imports vllm only inside `VLLMBackend` methods, so its pure parts load (and are tested) anywhere.
"""

from __future__ import annotations

import logging
import os
import socket

import torch

from rlhflab import models
from rlhflab.errors import UserInputError
from rlhflab.rollout.backends import checkpoint_weights, generated_from_tokens, prompt_seeds
from rlhflab.rollout.generate import Generated, GenerationSettings

log = logging.getLogger("rlhflab")


def sampled_logprobs(completions) -> list[list[float]] | None:
    """Each completion's log-probs of its own tokens, from vLLM's per-token {token id: Logprob} (asked for with
    `logprobs=0`); None when the engine gave none."""
    rows = []
    for completion in completions:
        if completion.logprobs is None:
            return None
        rows.append([step[token].logprob for token, step in zip(completion.token_ids, completion.logprobs)])
    return rows


def sampling_arguments(settings: GenerationSettings, eos_id: int, seed: int) -> dict:
    """`vllm.SamplingParams` keywords for one prompt: what rollout.generate would do with `settings`.

    Greedy is temperature 0 in vLLM; top_k 0 and top_p 1 are "off" in both. Temperature, then top-k, then
    top-p, as in rollout.generate.filter_logits."""
    sample = settings.do_sample
    return {
        "n": 1,
        "temperature": settings.temperature if sample else 0.0,
        "top_k": settings.top_k if sample else 0,
        "top_p": settings.top_p if sample else 1.0,
        "max_tokens": settings.max_new_tokens,
        "seed": seed,
        "ignore_eos": True,  # only stop_token_ids ends a response: the primary EOS and generation_config's extra ones are off
        "stop_token_ids": [eos_id],
        "detokenize": False,  # the engine has no tokenizer; callers decode
        "logprobs": 0,  # the sampled token's own log-prob (processed: the distribution it was drawn from)
    }


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def unmerged_adapter_layers(model: torch.nn.Module) -> list[str]:
    """Adapter layers still active after models.merged_adapter (DoRA, LoRA bias, ...): their weights would not
    reach the engine."""
    return [name for name, m in model.named_modules()
            if hasattr(m, "_disable_adapters") and not m.disable_adapters and getattr(m, "active_adapters", None)]


class VLLMBackend:
    """Generation on a colocated vLLM engine; see the module docstring."""

    name = "vllm"

    def __init__(self, model_path: str, *, dtype: str = "auto", seed: int = 0, gpu_memory_utilization: float = 0.3,
                 sleep_mode: bool = True, max_model_len: int | None = None, trust_remote_code: bool = False,
                 enforce_eager: bool = False):
        self.model_path = model_path
        self.engine_arguments = dict(
            model=model_path, skip_tokenizer_init=True, dtype=dtype, seed=seed,
            gpu_memory_utilization=gpu_memory_utilization, max_model_len=max_model_len,
            enable_sleep_mode=sleep_mode, trust_remote_code=trust_remote_code, enforce_eager=enforce_eager,
            distributed_executor_backend="external_launcher",
            logprobs_mode="processed_logprobs")  # after temperature / top-k / top-p, as rollout.generate reports
        self.sleep_mode = sleep_mode
        self.llm = None
        self._asleep: set[str] = set()  # memory tags the engine has released

    def generate(self, model, prompts, *, pad_id, eos_id, settings, generator=None, place=None) -> Generated:
        from vllm import SamplingParams

        device = next(model.parameters()).device
        self._start(device)
        self._wake("weights")
        self.push_weights(model)
        self._wake("kv_cache")
        # several processes: the seeds of the whole global batch are drawn, this process keeps its rows' seeds
        seeds = prompt_seeds(generator, place.total)[place.first:] if place is not None else \
            prompt_seeds(generator, len(prompts))
        params = [SamplingParams(**sampling_arguments(settings, eos_id, seed)) for seed in seeds[: len(prompts)]]
        outputs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], sampling_params=params,
                                    use_tqdm=False)
        if self.sleep_mode:
            self.llm.sleep(level=1)
            self._asleep = {"weights", "kv_cache"}
        completions = [o.outputs[0] for o in outputs]  # outputs come in the prompts' order
        return generated_from_tokens(prompts, [list(c.token_ids) for c in completions],
                                     [c.finish_reason == "stop" for c in completions],
                                     pad_id=pad_id, eos_id=eos_id, device=device,
                                     sampler_logprobs=sampled_logprobs(completions))

    def push_weights(self, model: torch.nn.Module) -> None:
        """Copy the policy's current weights into the engine."""
        with torch.no_grad(), models.merged_adapter(model):
            stale = unmerged_adapter_layers(model)
            if stale:
                raise UserInputError(f"{len(stale)} adapter layers cannot be merged for vLLM (first: {stale[0]})",
                                     "--generation_backend vllm",
                                     "use plain LoRA (rlhflab's --lora_r), or --generation_backend lean")
            weights = checkpoint_weights(model)  # consumed inside apply_model: one whole tensor at a time
            self.llm.apply_model(lambda engine_model: engine_model.load_weights(weights))
        self.llm.reset_prefix_cache()  # cached prompt KV was computed with the old weights

    def close(self) -> None:
        """Free the engine's GPU memory (a later generation starts a new one)."""
        self.llm, self._asleep = None, set()
        torch.cuda.empty_cache()

    def _start(self, device: torch.device) -> None:
        if self.llm is not None:
            return
        from vllm import LLM

        # one training process is rank 0 of 1; under torchrun / accelerate these are set already
        index = device.index if device.index is not None else torch.cuda.current_device()
        for key, value in {"RANK": "0", "LOCAL_RANK": str(index), "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}.items():
            os.environ.setdefault(key, value)
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        # the engine core in this process: apply_model then reaches the live module, with no pickling of tensors
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        log.info("starting a vLLM engine for %s (%.0f%% of the GPU)", self.model_path,
                 100 * self.engine_arguments["gpu_memory_utilization"])
        self.llm = LLM(**self.engine_arguments)

    def _wake(self, tag: str) -> None:
        if tag in self._asleep:
            torch.cuda.empty_cache()  # hand the training step's cached blocks back first (TRL: avoids OOM)
            self.llm.wake_up(tags=[tag])
            self._asleep.discard(tag)
