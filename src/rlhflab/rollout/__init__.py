"""Generation: batched, KV-cached, left-padded, stopping at EOS."""

from rlhflab.rollout.answers import Answer, decode_responses, generate_answers, response_tokens
from rlhflab.rollout.scoring import response_logits, response_logprobs
from rlhflab.rollout.generate import Generated, GenerationSettings, generate, response_mask_after_eos

__all__ = [
    "Answer",
    "Generated",
    "GenerationSettings",
    "decode_responses",
    "response_tokens",
    "generate",
    "generate_answers",
    "response_logits",
    "response_logprobs",
    "response_mask_after_eos",
]
