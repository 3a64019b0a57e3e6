"""KL of a trained model to a reference, measured alike for every method (rlhflab compare reads it)."""

from __future__ import annotations

import torch

from rlhflab import data
from rlhflab.rollout import GenerationSettings, response_logprobs
from rlhflab.rollout.backends import generate_with


@torch.no_grad()
def kl_to_reference(policy, reference, tokenizer, prompts: list[str], *, samples: int, response_length: int,
                    temperature: float, batch_size: int, seed: int) -> float:
    """Mean over responses sampled from `policy` of sum_t [log pi(a_t|s_t) - log pi_ref(a_t|s_t)], in nats.

    The k1 Monte-Carlo estimate of KL(pi || pi_ref) per response: unbiased, exactly 0 when policy is the
    reference. Sampling uses the full softmax at `temperature` and the log-probs are taken at the same
    temperature, as in the online methods' rollouts; `samples` responses per prompt, a fixed seed.
    """
    settings = GenerationSettings(response_length, True, temperature)
    generator = torch.Generator().manual_seed(seed)
    encoded = [ids for ids in data.encode_prompts(tokenizer, prompts) for _ in range(samples)]
    totals = []
    for start in range(0, len(encoded), batch_size):
        out = generate_with(policy, encoded[start:start + batch_size], pad_id=tokenizer.pad_token_id,
                       eos_id=tokenizer.eos_token_id, settings=settings, generator=generator)
        args = (out.query_ids, out.query_mask, out.response_ids, out.response_mask, temperature)
        logprobs, ref_logprobs = response_logprobs(policy, *args), response_logprobs(reference, *args)  # (B, T)
        totals.append((logprobs - ref_logprobs).sum(dim=1))  # 0 past each response's end
    return torch.cat(totals).mean().item()
