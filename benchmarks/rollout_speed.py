"""Generation speed: rlhflab's KV-cached loop vs transformers' `model.generate` (part of ppo_vs_trl.py).

Same model, same left-padded prompts, sampling at temperature 0.7 from the full softmax, and
every row generates exactly `length` tokens on both sides (EOS is switched off), so tokens/s
compares the loops and not how early each one stops. rlhflab's early stop at EOS is a separate
win, visible in the PPO table (TRL's generate also stops when every row has ended).
"""

from __future__ import annotations

import statistics
import time

import torch

BATCHES = (1, 8, 32)
LENGTHS = (32, 128)


def rlhflab_generate(model, prompts, length: int, pad_id: int, seed: int) -> int:
    from rlhflab.rollout import GenerationSettings, generate

    settings = GenerationSettings(length, True, 0.7)
    out = generate(model, prompts, pad_id=pad_id, eos_id=-1, settings=settings,  # -1: EOS never matches
                   generator=torch.Generator().manual_seed(seed))
    return out.response_ids.numel()


def hf_generate(model, prompts, length: int, pad_id: int, seed: int) -> int:
    from rlhflab.data import left_pad

    ids, mask = left_pad(prompts, pad_id)
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask.long(), do_sample=True, temperature=0.7, top_k=0,
                             top_p=1.0, max_new_tokens=length, eos_token_id=None, pad_token_id=pad_id)
    new = out[:, ids.shape[1]:]
    assert new.shape[1] == length, f"model.generate stopped at {new.shape[1]} of {length} tokens"
    return new.numel()


def tokens_per_s(fn, model, prompts, length: int, pad_id: int, repeats: int) -> float:
    fn(model, prompts[:1], 4, pad_id, 0)  # warm-up
    rates = []
    for seed in range(repeats):
        started = time.perf_counter()
        tokens = fn(model, prompts, length, pad_id, seed)
        rates.append(tokens / (time.perf_counter() - started))
    return statistics.median(rates)


def rollout_rows(model_dir: str, prompt_ids: list[list[int]], threads_list: list[int], repeats: int = 3) -> list[list[str]]:
    from rlhflab import models

    model = models.load_causal_lm(model_dir).eval()
    model.generation_config.eos_token_id = None  # every row runs to the length cap on both sides
    pad_id = models.load_tokenizer(model_dir).pad_token_id
    rows = []
    for threads in threads_list:
        torch.set_num_threads(threads)
        for length in LENGTHS:
            for batch in BATCHES:
                prompts = prompt_ids[:batch]
                ours = tokens_per_s(rlhflab_generate, model, prompts, length, pad_id, repeats)
                theirs = tokens_per_s(hf_generate, model, prompts, length, pad_id, repeats)
                rows.append([str(threads), str(batch), str(length), f"{ours:.0f}", f"{theirs:.0f}",
                             f"{ours / theirs:.2f}x"])
    return rows


ROLLOUT_COLUMNS = ["threads", "batch", "new tokens", "rlhflab tok/s", "model.generate tok/s", "ratio"]
